"""Self-healing, the metadata daemon's side: what to copy where, and recording it.

The daemon decides; storage nodes move the bytes. Nothing bulk ever flows
through the daemon.

Planning (``plan``, pure): daemon/repair_plan.py
------------------------------------------------
Which copies to make, fewest live copies first; ``Healer`` executes its plans.

Executing (``Healer``)
----------------------
For each task the daemon picks a target with the placement rules
(daemon/placement.py ``replace_node``: up, not already holding the chunk, a
new failure domain if possible, never a node with a pending deletion of that
chunk), then sends the target ``CopyChunkReq`` naming live sources; the target
pulls the chunk straight from a source, verifies it and stores it durably
(storage_node/healing.py). Only then is the new placement recorded, as a
compare-and-swap: if the row changed meanwhile (a writer committed a newer
version, another repair filled the slot) the new copy is queued as garbage
instead. A replaced copy (on a down or draining node) is queued as garbage
with the chunk's version as bound, so it is deleted when its node answers,
and never a newer copy. So redundancy never drops: copy, switch, then delete.

Copies run ``repair_parallelism`` at a time, throttled to
``repair_bandwidth`` bytes/s cluster-wide (a token bucket with one second of
burst), so training reads keep their bandwidth. A node going down cancels
the pass (its copies would only wait for their timeouts) and the next scan
replans. A copy whose outcome is unknown (timed out, cancelled) is queued for
deletion on its target once it can no longer be stored there: the target
discards a copy not ready within ``CopyChunkReq.deadline_s`` (half the
daemon's timeout) of its arrival, and the garbage row is written only when the
daemon's full timeout has passed, so a late store never outlives its deletion.

After the daemon starts, repair waits ``node_timeout_s``: until then every node
it has not heard from yet counts as down, and copying would only duplicate
chunks whose other copies are merely not registered yet.

Triggers: a node changing state, a bad copy reported, an operator command
(drain, remove, scrub, fsck) mark the state *dirty* and wake the loop; a
full scan also runs every ``repair_scan_interval_s``. ``stripefs status``
rescans first when dirty, so ``under_replicated`` is never older than the
last change. Every namespace change marks the figures *stale* (a flag only:
status rescans, the repair loop does not wake for it).

Bad copies (``mark_bad``): a copy that failed its checksum (found by a client
read, the node's background scrub or ``stripefs scrub --now``) or that fsck
found missing or stale is dropped from its row and queued for deletion: it is
a missing copy and gets re-replicated from a good one. The last live copy of a
chunk is never dropped this way (an ERROR: the data may be lost). A bad EC
fragment becomes node 0 in its slot (below) and is reconstructed from the
others, unless fewer than K others are live.

Erasure coding
--------------
Fragments of ``ec=K+M`` files are positional: node i of the row holds fragment
i, stored as part ``i + 32 * (version & 1)`` (common/erasure.fragment_part);
node 0 marks a fragment without a node. A missing fragment (its node down or
removed, or never placed) yields a ``reconstruct`` task: the target gets
``ReconstructFragmentReq`` naming the live fragments, reads K of them of
exactly the stripe's version, decodes, codes the missing fragment (trimmed to
the file's used length in that stripe) and stores it durably; the daemon
records it in the slot, as a copy. A stripe with fewer than K live fragments is
lost. Draining a node that holds fragments moves them as they are (a copy).

Rebalance (``plan_rebalance``)
------------------------------
Only when a scan finds nothing to repair or drain: a node whose utilisation
(bytes the namespace places there over its capacity) is above the mean by
more than ``rebalance_tolerance`` (10%) gives healthy copies to the emptiest
nodes, one chunk at a time, never so far that the taker ends fuller than the
giver (no ping-pong). A move is a ``rebalance`` task: the same copy, switch,
then delete, so no chunk is ever less redundant; it uses the same throttle.
New nodes therefore fill up after they join, and a node that was down for a
while is evened out again. Chunks of files open for writing are moved later (below).

Open files
----------
A mount sends a file's writes, and the cut of a truncate, to the nodes its
chunk map names: the placement as of the open, or the nodes that took the
mount's own writes. A move (copy, switch, delete) leaves that map naming a
node whose copy is gone. The rules:

* Rebalance leaves chunks of files that a session of this daemon has open
  *for writing* (``Sessions.writing_inodes``: opened with ``OpenReq.write``
  or created, until the session lets the file go) where they are for now.
  Checked when moves are planned, and again when one is recorded
  (``_record``): a file opened for writing while its chunk was being copied
  keeps its placement, the copy becomes garbage, and a later pass moves the
  chunk once the writer is gone (postponed, never dropped). Moving a chunk
  under a writer gains little: a writer whose old copies are not deleted yet
  writes them, and its commit, naming the nodes that took its writes, puts the
  chunk back; the next pass then moves it again (the fuzzer saw one chunk
  copied around a dozen times in four minutes while its file was open).
  Files merely held (open for reading, a lookup's open information, a
  callback: every file a mount has read stays held while the kernel caches
  it) are moved like any other: the mount follows (below). Counting them as
  open stopped rebalance on any cluster with a mount up (issue 36). A writer
  through another daemon (PostgreSQL) is not known here: its commit, newer
  than the copy, makes ``_record`` turn the copy into garbage, and the chunk
  is planned again.
* Repair and drain do not wait for a close: redundancy comes first, and a
  drain must finish while files stay open for days (a training job holds its
  data set open; the daemon cannot tell readers from writers). Their moves
  are safe for writers because the mount follows them (client/placements.py):
  when no node of its map takes a write or a truncate of a chunk, or one
  answers STALE (no copy: moved and deleted), it asks where the chunk is now
  and sends it there, once, as reads always did. Its commit then names the
  nodes of the current placement that hold the session's data, so a drain is
  not undone by the writer.
* A copy made (repair, drain) while a session writes the chunk holds the
  committed version or part of the session; either way the session's commit
  does not name it, so it is deleted, and the chunk is repaired again if it
  is short. Garbage bounds keep the writer's copies meanwhile: a replaced copy
  is deleted only up to the committed version, so a copy the session already
  wrote (newer, uncommitted) survives until the commit naming it cancels the
  deletion. A mount whose map of a chunk is short of copies looks it up again
  at the chunk's first write of a session, so its commits do not keep the
  chunk short (client/placements.py).

Scale: the scan is a full walk of the chunk table in pages (fine for millions
of chunks; a per-node index would be needed beyond).
"""

from __future__ import annotations

import collections
import logging
import time
from typing import TYPE_CHECKING, Callable, Iterable

import trio

from ..common import protocol as P
from ..common.erasure import SLOT_STRIDE, fragment_part
from ..common.errors import ErrorCode, StripefsError
from ..common.layout import parse_redundancy, replica_part
from ..common.transport import RpcClient, connect
from .health import LIVE_STATES
from .placement import NodeView, replace_node
from .redundancy import MISSING
from .repair_plan import ChunkRow, Plan, Task, plan, plan_rebalance  # noqa: F401  (also here for tests)

if TYPE_CHECKING:
    from .health import NodeRegistry, Sessions
    from .duties import Duties
    from .namespace import Namespace
    from .txn import Txn

log = logging.getLogger(__name__)

SCAN_PAGE = 5000
RETRY_S = 10.0  # after a pass that made no progress
COPY_TIMEOUT_S = 10.0  # plus one second per MiB of chunk: a copy is one chunk read and one durable write


class Throttle:
    """A token bucket: ``consume(n)`` waits so that the average stays under ``rate`` bytes/s."""

    def __init__(self, rate: int, burst_s: float = 1.0):
        self.rate = rate
        self.burst_s = burst_s
        self._t = 0.0

    async def consume(self, n: int) -> None:
        if self.rate <= 0:
            return
        now = trio.current_time()
        self._t = max(self._t, now - self.burst_s) + n / self.rate
        if self._t > now:
            await trio.sleep(self._t - now)


class NodeClients:
    """One RpcClient per storage node address, each held by a task of ``nursery``."""

    def __init__(self, ctx, nursery: trio.Nursery, timeout: float):
        self._ctx = ctx
        self._nursery = nursery
        self._timeout = timeout
        self._clients: dict[str, RpcClient] = {}
        self._lock = trio.Lock()

    async def get(self, address: str) -> RpcClient:
        if not address:
            raise StripefsError(ErrorCode.UNAVAILABLE, "storage node address unknown")
        async with self._lock:
            client = self._clients.get(address)
            if client is None:
                client = self._clients[address] = await self._nursery.start(self._hold, address)
            return client

    async def _hold(self, address: str, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with connect(self._ctx, address, timeout=self._timeout) as client:
            task_status.started(client)
            await trio.sleep_forever()


class Healer:
    """Repair loop and bad-copy handling of one metadata daemon (operator requests: daemon/repair_admin.py)."""

    def __init__(
        self, config, txn: Txn, store, nodes: NodeRegistry, *, ns: Namespace, sessions: Sessions, duties: Duties,
        wake_gc: Callable[[], None], ctx=None,
    ):
        self.config = config
        self.txn = txn  # the lock and the writes (daemon/txn.py)
        self.store = store
        self.nodes = nodes
        self.ns = ns
        self.sessions = sessions
        self.duties = duties
        self.wake_gc = wake_gc  # garbage was added: the collector runs soon
        self.ctx = ctx
        self.throttle = Throttle(int(self.config.repair_bandwidth))
        self.dirty = True  # the repair loop should rescan
        self.stale = True  # status figures may be out of date (any namespace change)
        self._wake = trio.Event()
        self._scanned_at = -1.0
        self._last = Plan()
        self.inflight: set[tuple[int, int, int]] = set()  # (ino, idx, target) copies not yet recorded
        self.copied = self.copied_bytes = self.failed = 0
        self.changes = 0  # placements recorded (copies and moves of empty rows): progress
        self.stuck = 0  # tasks of the last pass that no node could take (logged when the number changes)
        self._backlog = 0
        self._backlog_bytes = 0
        self._clients: NodeClients | None = None
        self._pass_scope: trio.CancelScope | None = None
        self._ready = trio.Event()
        self._started = 0.0
        self._nursery: trio.Nursery | None = None

    # -- triggers and status ---------------------------------------------------

    def poke(self) -> None:
        self.dirty = True
        self._wake.set()

    def stop_pass(self) -> None:
        """This daemon stopped leading: the pass in progress ends now."""
        if self._pass_scope is not None:
            self._pass_scope.cancel()

    def node_changed(self, node_id: int, old: str, new: str) -> None:
        if new in ("down", "removed") and self._pass_scope is not None:
            self._pass_scope.cancel()  # copies to or from it would only wait for their timeouts: replan now
        self.poke()

    def info(self) -> P.RepairInfo:
        last = self._last
        return P.RepairInfo(
            under_replicated=last.under_replicated,
            lost=last.lost,
            backlog=self._backlog,
            backlog_bytes=self._backlog_bytes,
            copied=self.copied,
            copied_bytes=self.copied_bytes,
            failed=self.failed,
            bandwidth=int(self.config.repair_bandwidth),
            scanned_age_s=round(time.monotonic() - self._scanned_at, 1) if self._scanned_at >= 0 else -1.0,
        )

    def placed(self) -> dict[int, int]:
        return {n: self._last.placed.get(n, 0) for n in self.nodes.states()} if self._scanned_at >= 0 else {}

    async def fresh(self) -> Plan:
        """The last scan's plan, rescanned first if anything changed since."""
        if self.dirty or self.stale or self._scanned_at < 0:
            await self.scan()
        return self._last

    async def scan(self) -> Plan:
        self.dirty = self.stale = False
        out = Plan()
        after = (0, -1)
        while True:
            async with self.txn.lock:
                rows = self.store.chunk_rows_page(after, SCAN_PAGE)
                states = self.nodes.states()
            plan((ChunkRow.from_sql(r) for r in rows), states, out)
            if len(rows) < SCAN_PAGE:
                break
            after = (rows[-1][0], rows[-1][1])
            await trio.sleep(0)
        self._last = out
        self._scanned_at = time.monotonic()
        return out

    # -- the loop --------------------------------------------------------------

    async def run(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            self._clients = NodeClients(self.ctx, nursery, COPY_TIMEOUT_S)
            self._started = trio.current_time()
            self._ready.set()
            task_status.started()
            while True:
                if not self.dirty:
                    with trio.move_on_after(self.config.repair_scan_interval_s):
                        await self._wake.wait()
                self._wake = trio.Event()
                if not self.duties.leading:  # another daemon runs repair (daemon/duties.py)
                    await self.duties.wait_leading()
                    self.dirty = True
                    continue
                self.dirty = False
                try:
                    await self._one_pass()
                except Exception:  # a bug: loud, but the daemon keeps serving
                    log.exception("repair pass failed; retrying in %.0fs", RETRY_S)
                    await trio.sleep(RETRY_S)
                await trio.sleep(0.2)  # let a burst of changes settle before the next scan

    async def _one_pass(self) -> None:
        work = await self.scan()
        grace = self._started + self.config.node_timeout_s - trio.current_time()
        if grace > 0:
            # a daemon that just started knows every node as down until it heartbeats: copying
            # now would duplicate chunks whose other copies are merely not registered yet
            if work.tasks or work.fixes:
                log.info("repair waits %.1fs for storage nodes to register after the daemon's start", grace)
                await trio.sleep(grace)
                self.dirty = True
            return
        if not work.tasks and not work.fixes and self.config.rebalance_tolerance > 0:
            async with self.txn.lock:
                capacity = {n: c for n, (_, c) in self.nodes.usage().items()}
                writing = self.sessions.writing_inodes()
            work.tasks = plan_rebalance(work, capacity, self.config.rebalance_tolerance, held=writing)
        if not (work.tasks or work.fixes):
            return
        before = self.changes
        try:
            with trio.CancelScope() as self._pass_scope:
                await self._execute(work)
        finally:
            self._pass_scope = None
            self._backlog = self._backlog_bytes = 0
        if self.changes > before or work.fixes:
            self.dirty = True  # progress: scan again at once for what is left
        else:  # nothing could be done (no target, sources unreachable): retry later
            with trio.move_on_after(min(RETRY_S, self.config.repair_scan_interval_s)):
                await self._wake.wait()

    async def clients(self) -> NodeClients:
        await self._ready.wait()
        return self._clients

    async def _execute(self, work: Plan) -> None:
        if work.fixes:
            async with self.txn.lock:
                for row, keep in work.fixes:
                    self.txn.write_locked(self.fix_row, row, keep)
        runnable = [t for t in work.tasks if self.has_target(t)]
        stuck = len(work.tasks) - len(runnable)
        if stuck != self.stuck:
            self.stuck = stuck
            if stuck:  # once per change, not on every pass: nothing will change until nodes are added
                log.warning(
                    "repair: %d chunk(s) need a copy that no storage node can take (every node up holds one already: "
                    "a layout wanting more copies than there are nodes, or a drain with nowhere to go); "
                    "they wait until nodes are added or their layout is lowered", stuck,
                )
        self._backlog = len(runnable)
        self._backlog_bytes = sum(t.copy_bytes for t in runnable)
        kinds = collections.Counter(t.kind for t in runnable)
        log.info(
            "repair: %s (%d under-replicated chunk(s), %d lost), copying up to %s bytes/s",
            ", ".join(f"{n} {k}" for k, n in sorted(kinds.items())), work.under_replicated, work.lost,
            self.config.repair_bandwidth or "unlimited",
        )
        send, recv = trio.open_memory_channel(0)
        async with trio.open_nursery() as nursery:
            for i in range(max(1, self.config.repair_parallelism)):
                nursery.start_soon(self._worker, recv.clone(), name=f"repair-worker-{i}")
            recv.close()
            async with send:
                for task in runnable:
                    await send.send(task)

    async def _worker(self, recv) -> None:
        async with recv:
            async for task in recv:
                try:
                    await self._do(task)
                except StripefsError as exc:
                    self.failed += 1
                    log.warning("repair of chunk %d:%d (%s) failed, will retry: %s", task.ino, task.idx, task.kind, exc)
                except Exception:  # a bug: loud, but the other tasks and the daemon go on
                    self.failed += 1
                    log.exception("repair of chunk %d:%d (%s) failed", task.ino, task.idx, task.kind)
                finally:
                    self._backlog = max(0, self._backlog - 1)
                    self._backlog_bytes = max(0, self._backlog_bytes - task.copy_bytes)

    def has_target(self, task: Task) -> bool:
        """Whether some node could take ``task``'s copy now: up and not holding the chunk already."""
        if task.target:  # rebalance: its own target, checked when it runs
            return True
        return any(v.up and v.node_id not in task.nodes and self.nodes.state(v.node_id) == "up" for v in self.nodes.views())

    def _choose_target(self, task: Task) -> int:
        store, nodes = self.store, self.nodes
        avoid = store.garbage_nodes_of_chunk(task.ino, task.idx) | set(task.nodes)
        if task.data_ino:  # a snapshot's shared row: never onto a node of the live row (its copy is the live one's)
            live = store.get_chunks(task.data_ino, [task.idx]).get(task.idx)
            avoid |= store.garbage_nodes_of_chunk(task.data_ino, task.idx) | set(live[1] if live else ())
        if task.target:  # rebalance: that node or none (it may still hold a copy being deleted)
            ok = task.target not in avoid and nodes.state(task.target) == "up"
            return task.target if ok else 0
        views = [  # a copy goes to a node that is plainly up: never a suspect one
            NodeView(v.node_id, v.host, v.free_bytes, v.up and v.node_id not in avoid and nodes.state(v.node_id) == "up")
            for v in nodes.views()
        ]
        current = [n for n in task.nodes if nodes.state(n) in LIVE_STATES]
        replaced = task.replace if task.replace is not None else -1
        return replace_node(views, [n for n in current if n != replaced], replaced, key=task.ino * 7919 + task.idx)

    async def _do(self, task: Task) -> None:
        async with self.txn.lock:
            target = self._choose_target(task)
            target_address = self.nodes.address(target)
            sources = [self.nodes.address(n) for n in task.sources if self.nodes.is_up(n)]
        if not target:
            log.debug("chunk %d:%d: %s skipped, its target cannot take it now", task.ino, task.idx, task.kind)
            return
        if task.kind == "move_empty":
            await self._record_durably(task, target, 0)
            return
        if not sources:
            raise StripefsError(ErrorCode.UNAVAILABLE, "no live copy to copy from")
        if task.kind == "reconstruct":
            await self.reconstruct(task, target, target_address)
            return
        chunk = P.ChunkId(task.chunk_ino, task.idx, task.part)  # a snapshot row: the copies it shares
        timeout = COPY_TIMEOUT_S + task.length / (1 << 20)
        request = P.CopyChunkReq(chunk=chunk, min_version=task.slot_version, sources=sources, length=task.length, deadline_s=timeout / 2)
        recorded, rsp = await self._store_on(task, target, target_address, request, timeout)
        if recorded:
            log.info(
                "chunk %s v%d: copied to node %d (%s%s)", chunk, rsp.version, target, task.kind,
                f", replacing node {task.replace}" if task.replace is not None else "",
            )
        await self.throttle.consume(rsp.length)

    async def _store_on(self, task: Task, target: int, target_address: str, request: P.Msg, timeout: float):
        """Have ``target`` store a copy (CopyChunkReq) or a rebuilt fragment (ReconstructFragmentReq)
        and record it durably: (recorded, the node's reply)."""
        key = (task.ino, task.idx, target)
        self.inflight.add(key)
        sent = trio.current_time()
        stored = False
        try:
            client = await (await self.clients()).get(target_address)
            rsp, _ = await client.call(request, timeout=timeout)
            stored = True
            recorded = await self._record_durably(task, target, rsp.version)
        except (trio.Cancelled, StripefsError) as exc:
            if not stored and (isinstance(exc, trio.Cancelled) or exc.code == ErrorCode.TIMEOUT):
                # the target may still store it until its deadline (half our timeout after it
                # arrived): once our full timeout has passed, make sure it does not stay unrecorded
                self._nursery.start_soon(self._forget_copy_at, task, target, sent + timeout)
            raise
        finally:
            self.inflight.discard(key)
        if recorded:
            self.copied += 1
            self.copied_bytes += rsp.length
        return recorded, rsp

    async def reconstruct(self, task: Task, target: int, target_address: str) -> None:
        """Rebuild fragment ``task.slot`` of an EC stripe on ``target`` from K live fragments.

        The target reads the other fragments itself (ReconstructFragmentReq); the
        daemon only names them and records the result as for a copy."""
        async with self.txn.lock:
            inode = self.store.get_inode(task.ino)
            if inode is None:
                return
            red = parse_redundancy(inode["redundancy"])
            used = max(0, min(task.length, inode["size"] - task.idx * task.length))
            # each source and the rebuilt fragment at its own version (common/protocol.ChunkRef ``fversions``)
            sources = [
                P.FragmentSource(i, fragment_part(i, task.fragment_version(i)), self.nodes.address(n), task.fragment_version(i))
                for i, n in enumerate(task.nodes)
                if i != task.slot and self.nodes.is_up(n)
            ]
        chunk = P.ChunkId(task.chunk_ino, task.idx, task.part)  # a snapshot row: the copies it shares
        timeout = COPY_TIMEOUT_S + 2 * task.length / (1 << 20)
        request = P.ReconstructFragmentReq(
            chunk=chunk, version=task.slot_version, k=red.ec_k, m=red.ec_m, chunk_size=task.length,
            used=used, fragment=task.slot, sources=sources, deadline_s=timeout / 2,
        )
        recorded, rsp = await self._store_on(task, target, target_address, request, timeout)
        if recorded:
            log.info("chunk %s v%d: fragment %d reconstructed on node %d%s", chunk, rsp.version, task.slot, target,
                     f", replacing node {task.replace}" if task.replace else "")
        await self.throttle.consume(rsp.length * max(1, red.ec_k))  # K fragments were read for it

    async def _record_durably(self, task: Task, target: int, version: int) -> bool:
        async with self.txn.lock:
            done, batch = self.txn.write_locked(self._record, task, target, version)
        await batch.wait()
        self.changes += done
        return done

    # -- row edits (synchronous: run under the transaction lock, in a savepoint) ---

    def _copies(self, ino: int) -> int:
        row = self.store.get_inode(ino)
        return parse_redundancy(row["redundancy"]).copies if row is not None else 0

    def _record(self, task: Task, target: int, version: int) -> bool:
        """Compare-and-swap the new copy into the chunk's row; else queue it as garbage."""
        store = self.store
        cur = store.get_chunks(task.ino, [task.idx]).get(task.idx)
        garbage = [(target, task.chunk_ino, task.idx, task.part, version)]
        if task.kind == "rebalance" and self.sessions.is_writing(task.ino):
            # opened for writing while the copy was made: the writer has the old placement, and a later
            # pass moves the chunk once it is gone (module docstring, "Open files")
            store.add_garbage(garbage)
            log.debug("chunk %d:%d: rebalance to node %d postponed, the file was opened for writing meanwhile",
                      task.ino, task.idx, target)
            return False
        if cur is None:
            if task.kind != "move_empty":
                store.add_garbage(garbage)
            return False
        cur_version, nodes, cur_fv = cur
        if cur_version > 0 and not nodes:  # moved to a tier meanwhile (daemon/tiering.py): never made hot again here
            if task.kind != "move_empty":
                store.add_garbage(garbage)
            return False
        if task.ec:  # the stripe as planned, and the new fragment at the version its slot holds
            stale = cur_version != task.version or tuple(cur_fv) != task.fversions or version != task.slot_version
        else:
            stale = cur_version > version
        if task.kind != "move_empty" and stale:
            store.add_garbage(garbage)  # a writer committed a newer version meanwhile
            return False
        if target in nodes:
            return False
        if task.slot >= 0:
            slot = task.slot
            if not (slot < len(nodes) and nodes[slot] == task.replace):
                if task.ec or task.replace not in nodes:
                    if task.kind != "move_empty":
                        store.add_garbage(garbage)
                    return False
                slot = nodes.index(task.replace)
            new = nodes[:slot] + [target] + nodes[slot + 1 :]
            if task.kind != "move_empty" and task.replace:  # node 0: a fragment that had no node
                store.add_garbage([(task.replace, task.chunk_ino, task.idx, task.part, cur_version)])
        else:
            live = sum(self.nodes.state(n) in LIVE_STATES for n in nodes)
            if live >= self._copies(task.ino):
                store.add_garbage(garbage)
                return False
            new = nodes + [target]
        fv = list(cur_fv) + [cur_version] * (len(new) - len(cur_fv)) if cur_fv else []
        store.put_chunk(task.ino, task.idx, cur_version, new, fv)
        return True

    async def _forget_copy_at(self, task: Task, target: int, when: float) -> None:
        await trio.sleep_until(when)
        async with self.txn.lock:
            self.txn.write_locked(self._forget_copy, task, target)
        self.wake_gc()

    def _forget_copy(self, task: Task, target: int) -> None:
        """A copy whose outcome is unknown: delete it on ``target`` unless the row places it there."""
        cur = self.store.get_chunks(task.ino, [task.idx]).get(task.idx)
        if cur is None or target not in cur[1]:
            self.store.add_garbage([(target, task.chunk_ino, task.idx, task.part, self.ns.last_epoch())])

    def fix_row(self, row: ChunkRow, keep: tuple[int, ...]) -> None:
        """Drop gone nodes from a row that has enough live copies without them."""
        cur = self.store.get_chunks(row.ino, [row.idx]).get(row.idx)
        if cur is None or tuple(cur[1]) != row.nodes or cur[0] != row.version:
            return
        dropped = [n for n in row.nodes if n not in keep]
        self.store.add_garbage((n, row.ino, row.idx, 0, row.version) for n in dropped)
        self.store.put_chunk(row.ino, row.idx, row.version, list(keep))
        log.info("chunk %d:%d: dropped copies on gone node(s) %s (enough live copies remain)", row.ino, row.idx, dropped)

    def mark_bad(self, node_id: int, chunks: Iterable[P.ChunkId], why: str = "failed its checksum") -> int:
        """Copies on ``node_id`` that are bad (or missing) count as missing; the number dealt with:
        dropped (re-replicated from a good copy, or an EC fragment reconstructed from the others),
        or no longer placed there (deleted). The others (an only live copy, a fragment of a stripe
        with fewer than K other live fragments) are kept as they are and logged."""
        store, nodes = self.store, self.nodes
        dropped = 0
        for c in chunks:
            cur = store.get_chunks(c.ino, [c.index]).get(c.index)
            if cur is None or node_id not in cur[1]:
                bound = cur[0] if cur is not None else self.ns.last_epoch()
                store.add_garbage([(node_id, c.ino, c.index, c.part, bound)])
                dropped += 1
                continue
            version, holders, fversions = cur
            red = parse_redundancy(store.get_inode(c.ino)["redundancy"])
            if red.is_ec:
                dropped += self._drop_bad_fragment(c, node_id, version, holders, fversions, red.ec_k, why)
                continue
            if c.part != replica_part(version):
                # another version's slot (a writer's uncommitted copy, or an old one not collected
                # yet): the committed copy on that node is not the one reported
                log.info("chunk %s: report of a bad copy on node %d is not of the committed v%d: ignored", c, node_id, version)
                continue
            others = [n for n in holders if n != node_id and nodes.state(n) in LIVE_STATES]
            if not others:
                log.error("chunk %s v%d: the only live copy, on node %d, %s: keeping it, the data may be lost", c, version, node_id, why)
                continue
            store.put_chunk(c.ino, c.index, version, others + [n for n in holders if n != node_id and n not in others])
            store.add_garbage([(node_id, c.ino, c.index, c.part, version)])
            log.warning("chunk %s v%d: copy on node %d %s; re-replicating from %s", c, version, node_id, why, others)
            dropped += 1
        if dropped:
            self.poke()
        return dropped

    def _drop_bad_fragment(self, c: P.ChunkId, node_id: int, version: int, holders: list[int], fversions: list[int], k: int,
                           why: str) -> int:
        """An EC fragment that is bad or missing on ``node_id`` becomes MISSING in its stripe's row
        (daemon/redundancy.py), so the next scan reconstructs it elsewhere from K others, and its
        copy is deleted; 1 if so. Kept as it is (0) while fewer than K other fragments are live
        (the stripe could not be rebuilt without it either) or when the report is of another
        version's slot (a writer committed since the copy was verified)."""
        pos = c.part % SLOT_STRIDE
        if pos >= len(holders) or holders[pos] != node_id or fragment_part(pos, P.fragment_version(version, fversions, pos)) != c.part:
            log.info("chunk %s: report of a bad fragment on node %d is not of the committed v%d: ignored", c, node_id, version)
            return 0
        others = {n for j, n in enumerate(holders) if j != pos and n != MISSING and self.nodes.state(n) in LIVE_STATES}
        if len(others) < k:
            log.error("chunk %s v%d: fragment %d on node %d %s, and only %d other fragments are live (K=%d): keeping it",
                      c, version, pos, node_id, why, len(others), k)
            return 0
        self.store.put_chunk(c.ino, c.index, version, holders[:pos] + [MISSING] + holders[pos + 1 :])
        self.store.add_garbage([(node_id, c.ino, c.index, c.part, version)])
        log.warning("chunk %s v%d: fragment %d on node %d %s; reconstructing it from the others", c, version, pos, node_id, why)
        return 1

    def abandoned(self, ino: int) -> bool:
        """Whether chunks of ``ino`` allocated but never committed (version 0) belong to nobody: no
        session holds the file open (with several daemons, no session of any of them), so no writer
        can commit them any more (a write cut by a daemon kill, whose mount got EIO at close).
        A callback alone does not count: a mount must open a file to write it."""
        if self.sessions.is_open(ino):
            return False
        return self.store.group_commit or not self.ns.is_open(ino)  # PostgreSQL: daemon/open_holds.py

    def reclaim_uncommitted(self, inos: Iterable[int]) -> None:
        """A session expired: what it wrote and never committed, in files nobody has open, goes.

        Chunks it allocated and never committed are dropped; of the committed chunks, the slot
        the committed version does not use (common/layout.py "Slots": where a write session
        puts its new versions, copy-on-write) is deleted on each node, that part only: a writer
        that died mid-session left its copies there. For a stripe that slot is each fragment's
        own: a fragment left at an older version of the other parity (``fversions``) is stored
        in the slot of ``version + 1``, and deleting that would lose it. Both up to the newest epoch handed out so
        far, and that epoch becomes the file's *fence* (``Sessions.fence``, daemon/health.py):
        a commit of chunks written at or below it is refused.
        """
        store = self.store
        bound = self.ns.last_epoch()
        for ino in inos:
            row = store.get_inode(ino)
            if self.sessions.is_open(ino) or row is None:
                continue
            n = store.drop_uncommitted_chunks(ino, bound)
            if parse_redundancy(row["redundancy"]).is_ec:
                def other_slots(version: int, nodes: list[int], fv: list[int]) -> list[tuple[int, int]]:
                    return [(node, fragment_part(j, P.fragment_version(version, fv, j) + 1))
                            for j, node in enumerate(nodes) if node != MISSING]
            else:
                def other_slots(version: int, nodes: list[int], fv: list[int]) -> list[tuple[int, int]]:
                    return [(node, replica_part(version + 1)) for node in nodes]
            slots = store.abandoned_slots(ino, bound, other_slots)
            if n or slots:
                self.sessions.fence(ino, bound)
            if n:
                log.info("inode %d: %d chunk(s) allocated but never committed by an expired session reclaimed", ino, n)

    # -- requests (dispatched by MetaService.handle) -----------------------------

    async def handle_report_bad_chunks(self, req: P.ReportBadChunksReq) -> P.Msg:
        async with self.txn.lock:
            self.txn.write_locked(self.mark_bad, req.node_id, req.chunks)
        return P.OkRsp()
