"""The metadata daemon's snapshot requests (SnapshotCreateReq, SnapshotListReq, SnapshotDeleteReq)
and the copy-out that keeps a snapshot's shared chunks safe.

Dispatched like MetaService's own ``handle_*`` methods; the bookkeeping is
daemon/snapshots.py. Create and delete are namespace changes like a mkdir: logged
with their entries, so every mount's kernel cache of ``DIR/.snapshots`` hears of
them. A subtree key reaches only snapshots of directories inside its subtree
(``ino`` is checked as every request's inode is, daemon/access.py).

Copy-out (``gated``): an operation that would move a live chunk row off a version
a snapshot reads raises ``CopyOutNeeded`` before it writes anything; each pinned
copy or fragment is then copied on its own node to the snapshot's chunk id
(CopyChunkReq with ``source``: no byte crosses the network), the snapshot rows
are switched to their own copies (``Snapshots.copied``), and the operation runs
again. Only then is it applied and answered: no writer can reach the pinned
slot before (it learns the new committed version from this reply).
"""

from __future__ import annotations

import logging
from typing import Awaitable, Callable, TypeVar

import trio

from ..common import protocol as P
from ..common.errors import ErrorCode, StripefsError
from . import applied_ops
from .snapshots import CopyOutNeeded

log = logging.getLogger(__name__)

T = TypeVar("T")
#: copy-outs one operation may need before it gives up (each round copies what it found)
ROUNDS = 8
COPY_TIMEOUT_S = 30.0


class SnapshotService:
    def __init__(self, txn, ns, nodes, clients, wake_gc, on_change=lambda: None) -> None:
        self.txn = txn  # daemon/txn.py
        self.ns = ns  # daemon/namespace.py (ns.snapshots: daemon/snapshots.py)
        self.nodes = nodes  # daemon/health.py NodeRegistry
        self.clients = clients  # awaitable -> repair.NodeClients (the healer's connections)
        self.wake_gc = wake_gc
        self.on_change = on_change  # snapshots were made or deleted (the service's request path)
        self.copied_out = 0  # chunk copies made by copy-outs (tests, metrics)

    @property
    def snapshots(self):
        return self.ns.snapshots

    async def handle_snapshot_create(self, req: P.SnapshotCreateReq) -> P.Msg:
        def change(result):
            _, root, holder = result
            return [req.ino, holder, root], [(req.ino, b".snapshots"), (holder, req.name)]

        try:
            (snap_id, root, _), _, _ = await self.txn.write_reporting(
                self.snapshots.create, req.ino, req.name, report=None, change=change
            )
        finally:
            await self._counted()
        infos = await self.txn.read(self.snapshots.infos, req.ino)
        return P.SnapshotRsp(snapshots=[s for s in infos if s.id == snap_id])

    async def handle_snapshot_list(self, req: P.SnapshotListReq) -> P.Msg:
        return P.SnapshotRsp(snapshots=await self.txn.read(self.snapshots.infos, req.ino))

    async def handle_snapshot_delete(self, req: P.SnapshotDeleteReq) -> P.Msg:
        def change(result):
            root, holder, emptied = result
            return [req.ino, root, holder], [(holder, req.name)] + ([(req.ino, b".snapshots")] if emptied else [])

        try:
            await self.txn.write_reporting(self.snapshots.delete, req.ino, req.name, report=None, change=change)
        finally:
            await self._counted()
        self.wake_gc()
        return P.SnapshotRsp()

    async def _counted(self) -> None:
        """The snapshots' count as the database has it (a create or delete rolled back is not counted),
        and the request path that follows from it (service: commits leave the burst while any exist)."""
        await self.txn.read(self.snapshots.load)
        self.on_change()

    # -- copy-out -----------------------------------------------------------------------

    async def gated(self, run: Callable[[], Awaitable[T]]) -> T:
        """``run()`` (an operation's write), after copying out what it would leave unprotected."""
        key = applied_ops.once.get()  # a OnceReq's: the operation that finally applies is the one recorded
        for _ in range(ROUNDS):
            try:
                return await run()
            except CopyOutNeeded as need:
                await self.copy_out(need)  # its own write records nothing under the key (used by the attempt)
                if key is not None:
                    key.used = False  # the attempt applied nothing: the next one is the OnceReq's operation
        raise StripefsError(ErrorCode.BUSY, "snapshots kept pinning this file's chunks; try again")

    async def copy_out(self, need: CopyOutNeeded) -> None:
        """Copy each pinned copy to its snapshot row's own chunk id, on the node holding it, then
        switch the rows. A node that is down is skipped and left out of the row (a replica dropped,
        a fragment MISSING), so the healer makes that copy like any lost one;
        a node that is up and fails the copy fails the operation (UNAVAILABLE: nothing applied)."""
        clients = await self.clients()
        failed: list[str] = []
        skipped: list[tuple[int, int, int]] = []  # (ino, idx, node) of copies a down node could not make

        async def one(pin, node: int, part: int, version: int) -> None:
            if not self.nodes.is_up(node):
                log.warning("snapshot chunk %d:%d: node %d is down, its copy is left to repair", pin.ino, pin.idx, node)
                skipped.append((pin.ino, pin.idx, node))
                return
            request = P.CopyChunkReq(
                chunk=P.ChunkId(pin.ino, pin.idx, part), min_version=version, sources=[], length=need.chunk_size,
                source=P.ChunkId(pin.data_ino, pin.idx, part),
            )
            try:
                client = await clients.get(self.nodes.address(node))
                await client.call(request, timeout=COPY_TIMEOUT_S)
                self.copied_out += 1
            except StripefsError as exc:
                failed.append(f"{pin.ino}:{pin.idx}:{part} on node {node}: {exc}")

        async with trio.open_nursery() as nursery:
            for pin in need.pins:
                for node, part, version in pin.parts:
                    nursery.start_soon(one, pin, node, part, version)
        for pin in need.pins:
            missed = sum(1 for ino, idx, _ in skipped if (ino, idx) == (pin.ino, pin.idx))
            if len(pin.parts) - missed < pin.needed:
                failed.append(f"{pin.ino}:{pin.idx}: {missed} of its {len(pin.parts)} nodes are down")
        if failed:
            log.warning("snapshot copy-out failed: %s", "; ".join(failed[:5]))
            raise StripefsError(ErrorCode.UNAVAILABLE, f"a snapshot's shared chunk could not be copied out: {failed[0]}")
        done = await self.txn.write(self.snapshots.copied, need.pins, skipped)
        log.info("copy-out: %d snapshot chunk row(s) of file %d now hold their own copies", done, need.pins[0].data_ino)
