"""Operator requests to the metadata daemon: node administration, scrub and fsck.

    NodeAdminReq   drain, undrain, remove a storage node (``stripefs node``)
    ScrubReq       verify the copies of some files now (``stripefs scrub PATH`` / ``--now``),
                   each against its node's checksums and the replicas of one version
                   against each other (``_diverged``)
    FsckReq        a node's chunk inventory against the namespace, or the namespace's
                   redundancy (``stripefs fsck [--repair]``)

These only inspect and record; the copies they call for (a drained node's, a
bad or missing copy's) are made by the healer (daemon/repair.py), woken with
``poke``. The CLI's side is stripefs/heal_cli.py.
"""

from __future__ import annotations

import collections
import logging
from typing import NamedTuple

import trio

from ..common import protocol as P
from ..common.errors import ErrorCode, StripefsError
from ..common.erasure import SLOT_STRIDE, fragment_part
from ..common.layout import parse_redundancy, replica_part
from .health import LIVE_STATES, NodeRegistry
from .repair import SCAN_PAGE, Healer
from .repair_plan import ChunkRow, plan
from .txn import Txn

log = logging.getLogger(__name__)

VERIFY_TIMEOUT_S = 300.0  # a node verifying (or listing) many chunks from its disk


class _Seen(NamedTuple):
    """One replica as its node's VerifyChunksReq saw it."""

    chunk: P.ChunkId
    version: int
    digest: int
    written_ns: int


def _diverged(rows: dict[tuple[int, int], ChunkRow], seen: dict[tuple[int, int], dict[int, _Seen]]) -> list[tuple[int, P.ChunkId, int]]:
    """(node, chunk, version) of every replica that differs from the other replicas of its committed version.

    Each node checks a copy only against its own checksums, which a replica holding other bytes
    under the same version passes. So the daemon compares the replicas' data digests: the bytes
    most replicas hold win. On a tie (two replicas, or no majority), the bytes of the copy
    written first: with copy-on-write the committed version's slot is written by its session,
    every range to every replica (a replica that missed one got the whole chunk, or the session
    failed) and all before the commit; after it only repair copies it (identical to their source,
    so never alone in a tie) and nothing else. A copy that differs and was written later than
    the others is therefore not the committed write. The losers are repaired as bad copies.
    """
    losers = []
    for key, copies in seen.items():
        row = rows.get(key)
        if row is None:
            continue
        same = {n: c for n, c in copies.items() if c.version == row.version}
        groups: dict[int, list[int]] = collections.defaultdict(list)
        for n, c in same.items():
            groups[c.digest].append(n)
        if len(groups) < 2:
            continue
        winner = max(groups, key=lambda d: (len(groups[d]), -min(same[n].written_ns for n in groups[d])))
        lost = sorted(n for d, nodes in groups.items() if d != winner for n in nodes)
        log.warning(
            "scrub: chunk %d:%d v%d: replicas on nodes %s hold other bytes than on %s (%s); repairing them from those",
            key[0], key[1], row.version, lost, sorted(groups[winner]),
            "a majority" if len(groups[winner]) * 2 > len(same) else "no majority: the copy written first",
        )
        losers += [(n, same[n].chunk, row.version) for n in lost]
    return losers


class OperatorRequests:
    """NodeAdminReq, ScrubReq and FsckReq of one metadata daemon (dispatched by MetaService.handle)."""

    def __init__(self, healer: Healer, txn: Txn, store, nodes: NodeRegistry):
        self.healer = healer
        self.txn = txn  # the lock and the writes (daemon/txn.py)
        self.store = store
        self.nodes = nodes

    async def handle_node_admin(self, req: P.NodeAdminReq) -> P.Msg:
        if req.action == "drain":
            await self.txn.write(self.nodes.set_admin, req.node_id, "draining")
        elif req.action == "undrain":
            await self.txn.write(self.nodes.set_admin, req.node_id, "")
        elif req.action == "remove":
            await self.txn.write(self.remove_node, req.node_id)
        else:
            raise StripefsError(ErrorCode.BAD_REQUEST, f"unknown node action {req.action!r}: drain, undrain or remove")
        self.healer.poke()
        return P.OkRsp()

    async def handle_scrub(self, req: P.ScrubReq) -> P.Msg:
        return await self.scrub(req)

    async def handle_fsck(self, req: P.FsckReq) -> P.Msg:
        return await self.fsck(req)

    # -- operator requests -----------------------------------------------------

    async def _all_rows(self) -> list[ChunkRow]:
        rows: list[ChunkRow] = []
        after = (0, -1)
        while True:
            async with self.txn.lock:
                page = self.store.chunk_rows_page(after, SCAN_PAGE)
            rows += [ChunkRow.from_sql(r) for r in page]
            if len(page) < SCAN_PAGE:
                return rows
            after = (page[-1][0], page[-1][1])

    def remove_node(self, node_id: int) -> int:
        """Forget a node (under the lock, in a savepoint): NOT_EMPTY while it holds an only copy."""
        store, nodes = self.store, self.nodes
        if nodes.state(node_id) == "removed":
            nodes.set_admin(node_id, "removed")  # NOT_FOUND for a node this cluster never knew
            return 0
        only = 0
        edits = []
        after = (0, -1)
        while True:
            page = store.chunk_rows_page(after, SCAN_PAGE)
            for r in page:
                row = ChunkRow.from_sql(r)
                if node_id not in row.nodes:
                    continue
                if parse_redundancy(row.redundancy).is_ec and row.version:
                    raise StripefsError(ErrorCode.NOT_EMPTY, f"node {node_id} holds erasure-coded fragments; drain it first")
                others = [n for n in row.nodes if n != node_id and nodes.state(n) in LIVE_STATES]
                if row.version and not others:
                    only += 1
                edits.append((row, [n for n in row.nodes if n != node_id]))
            if len(page) < SCAN_PAGE:
                break
            after = (page[-1][0], page[-1][1])
        if only:
            raise StripefsError(
                ErrorCode.NOT_EMPTY,
                f"node {node_id} still holds the only live copy of {only} chunk(s); "
                f"drain it first (stripefs node drain {node_id}) and wait until it holds nothing",
            )
        for row, keep in edits:
            if keep:
                store.put_chunk(row.ino, row.idx, row.version, keep)
            else:  # an allocated, never written chunk on this node alone: unplace it
                store.delete_chunk(row.ino, row.idx)
        forgotten = store.forget_node_garbage(node_id)
        nodes.set_admin(node_id, "removed")
        log.warning("node %d removed: dropped from %d chunk row(s), %d pending deletion(s) forgotten", node_id, len(edits), forgotten)
        self.healer.poke()
        return len(edits)

    async def scrub(self, req: P.ScrubReq) -> P.ScrubRsp:
        """Every copy of the files' chunks verified by its node against its own checksums, then the
        replicas of each replicated chunk compared with each other (``_diverged``)."""
        async with self.txn.lock:
            inos = list(req.inos) or self.store.regular_files_after(req.after_ino, max(1, min(req.limit, 1000)))
            rows = [ChunkRow.from_sql(r) for r in self.store.chunk_rows_of(inos)]
            total = self.store.counts()["files"]
            by_node: dict[int, list[tuple[P.ChunkId, int]]] = collections.defaultdict(list)
            replicated: dict[tuple[int, int], ChunkRow] = {}
            for row in rows:
                if not row.version:
                    continue
                ec = parse_redundancy(row.redundancy).is_ec
                if not ec:
                    replicated[(row.ino, row.idx)] = row
                for pos, n in enumerate(row.nodes):
                    if self.nodes.is_up(n):
                        v = row.fragment_version(pos) if ec else row.version  # a fragment's own (ChunkRow.fversions)
                        by_node[n].append((P.ChunkId(row.ino, row.idx, fragment_part(pos, v) if ec else replica_part(v)), v))
            addresses = {n: self.nodes.address(n) for n in by_node}
        totals = collections.Counter()
        seen: dict[tuple[int, int], dict[int, _Seen]] = collections.defaultdict(dict)  # (ino, idx) -> node -> its copy

        async def verify(node_id: int, items: list[tuple[P.ChunkId, int]]) -> None:
            client = await (await self.healer.clients()).get(addresses[node_id])
            for i in range(0, len(items), 1000):
                part = items[i : i + 1000]
                try:
                    rsp, _ = await client.call(
                        P.VerifyChunksReq(chunks=[c for c, _ in part], min_versions=[v for _, v in part]), timeout=VERIFY_TIMEOUT_S
                    )
                except StripefsError as exc:
                    log.warning("scrub: node %d did not verify %d copies: %s", node_id, len(part), exc)
                    continue
                totals["copies"] += len(part)
                totals["bytes"] += rsp.bytes
                if len(rsp.digests) == len(part):
                    for (c, _), version, digest, written in zip(part, rsp.versions, rsp.digests, rsp.written_ns):
                        if version and (c.ino, c.index) in replicated:
                            seen[(c.ino, c.index)][node_id] = _Seen(c, version, digest, written)
                bad = list(rsp.bad) + list(rsp.missing)
                totals["bad"] += len(bad)
                if bad:
                    async with self.txn.lock:
                        dropped = self.txn.write_locked(self.healer.mark_bad, node_id, bad, "is bad, stale or missing (scrub)")[0]
                    totals["repairing"] += dropped  # the others have no good copy elsewhere (mark_bad logs each)

        async with trio.open_nursery() as nursery:
            for node_id, items in by_node.items():
                nursery.start_soon(verify, node_id, items)
        losers = _diverged(replicated, seen)
        if losers:
            totals["bad"] += len(losers)
            totals["diverged"] += len(losers)
            async with self.txn.lock:
                totals["repairing"] += self.txn.write_locked(self._drop_diverged, losers)[0]
        limit = max(1, min(req.limit, 1000))
        next_ino = inos[-1] if (not req.inos and len(inos) == limit) else 0
        return P.ScrubRsp(
            files=len(inos), copies=totals["copies"], bad=totals["bad"], bytes=totals["bytes"], next_ino=next_ino, total_files=total,
            repairing=totals["repairing"], diverged=totals["diverged"],
        )

    def _drop_diverged(self, losers: list[tuple[int, P.ChunkId, int]]) -> int:
        """Replicas whose bytes lost the comparison count as bad copies (re-replicated from a
        winner), if their row is still the one compared: a commit meanwhile made them garbage."""
        dropped = 0
        for node_id, chunk, version in losers:
            cur = self.store.get_chunks(chunk.ino, [chunk.index]).get(chunk.index)
            if cur is None or cur[0] != version or node_id not in cur[1]:
                continue
            dropped += self.healer.mark_bad(node_id, [chunk], f"differs from the other replicas of v{version} (scrub)")
        return dropped

    async def fsck(self, req: P.FsckReq) -> P.FsckRsp:
        if req.node_id == 0:
            return await self._fsck_redundancy(req.repair)
        return await self._fsck_node(req.node_id, req.repair)

    async def _fsck_redundancy(self, repair: bool) -> P.FsckRsp:
        rows = await self._all_rows()
        async with self.txn.lock:
            states = self.nodes.states()
        result = plan(rows, states)
        problems = []
        trimmed = 0
        async with self.txn.lock:
            doable = [t for t in result.tasks if self.healer.has_target(t)]
        doable_ids = {id(t) for t in doable}
        for t in [t for t in result.tasks if id(t) not in doable_ids][:10]:
            problems.append(f"chunk {t.ino}:{t.idx}: wants another copy, but every storage node up holds one already "
                            f"(copies on {list(t.nodes)}): add nodes or lower its layout (stripefs layout convert)")
        for row in rows:
            red = parse_redundancy(row.redundancy)
            live = [n for n in row.nodes if states.get(n) in LIVE_STATES]
            if row.version and row.nodes and not live and len(problems) < 20:  # no nodes: in a cold tier
                problems.append(f"chunk {row.ino}:{row.idx} v{row.version}: no live copy (nodes {list(row.nodes)})")
            if row.version and not red.is_ec and len(set(live)) > red.copies:
                if len(problems) < 20:
                    problems.append(f"chunk {row.ino}:{row.idx}: {len(live)} live copies for {red.copies}")
                if repair:
                    async with self.txn.lock:
                        self.txn.write_locked(self.healer.fix_row, row, tuple(live[: red.copies]))
                    trimmed += 1
        if repair:
            self.healer.poke()
        return P.FsckRsp(
            checked=result.chunks, orphans=0, missing=0, under_replicated=result.under_replicated,
            over_replicated=result.over_replicated, lost=result.lost,
            repaired=trimmed + (len(doable) if repair else 0), problems=problems,
            unrepairable=len(result.tasks) - len(doable),
        )

    async def _fsck_node(self, node_id: int, repair: bool) -> P.FsckRsp:
        async with self.txn.lock:
            if not self.nodes.is_up(node_id):
                raise StripefsError(ErrorCode.UNAVAILABLE, f"storage node {node_id} is {self.nodes.state(node_id)}; fsck needs it up")
            address = self.nodes.address(node_id)
        # the namespace first, then the node: a copy written in between is seen on the node,
        # and every finding is checked again against the current row before it is repaired
        expected: dict[tuple[int, int, int], int] = {}
        for row in await self._all_rows():
            if node_id in row.nodes and not (row.version == 0 and self.healer.abandoned(row.ino)):  # an abandoned write's: orphans
                ec = parse_redundancy(row.redundancy).is_ec
                pos = row.nodes.index(node_id)
                v = row.fragment_version(pos) if ec else row.version  # a fragment's own (ChunkRow.fversions)
                part = fragment_part(pos, v) if ec else replica_part(v)
                expected[(row.data_ino or row.ino, row.idx, part)] = v  # a snapshot's shared copy is referenced
        client = await (await self.healer.clients()).get(address)
        inventory: dict[tuple[int, int, int], int] = {}
        start = 0
        while start >= 0:
            rsp, _ = await client.call(P.ListChunksReq(start_dir=start), timeout=VERIFY_TIMEOUT_S)
            for c, v in zip(rsp.chunks, rsp.versions):
                inventory[(c.ino, c.index, c.part)] = v
            start = rsp.next_dir
        async with self.txn.lock:
            pending = self.store.pending_garbage(node_id)  # queued for deletion already: not orphans
        orphans = [k for k in inventory if k not in expected and (k[0], k[1]) not in pending]
        missing = [k for k, v in expected.items() if v and inventory.get(k, -1) < v]
        problems = [f"orphan copy {i}:{x}:{p} v{inventory[(i, x, p)]} on node {node_id}" for i, x, p in orphans[:10]]
        problems += [f"copy {i}:{x}:{p} v{expected[(i, x, p)]} missing or stale on node {node_id}" for i, x, p in missing[:10]]
        repaired = 0
        if repair and (orphans or missing):
            async with self.txn.lock:
                repaired, left = self.txn.write_locked(self._fsck_repair, node_id, orphans, missing, inventory, expected)[0]
            problems += left
        for line in problems:
            log.info("fsck: %s", line)
        return P.FsckRsp(
            checked=len(inventory), orphans=len(orphans), missing=len(missing), under_replicated=0, over_replicated=0,
            lost=0, repaired=repaired, problems=problems, unrepairable=len(orphans) + len(missing) - repaired if repair else 0,
        )

    def _fsck_repair(self, node_id, orphans, missing, inventory, expected) -> tuple[int, list[str]]:
        """Repair what ``_fsck_node`` found: the number repaired, and why each of the others was not."""
        store = self.store
        repaired = 0
        left: list[str] = []
        pending = store.pending_garbage(node_id)
        reclaimed: set[int] = set()
        for ino, idx, part in orphans:
            cur = store.get_chunks(ino, [idx]).get(idx)
            version = inventory[(ino, idx, part)]
            if cur is not None and node_id in cur[1] and cur[0] == 0 and (ino in reclaimed or self.healer.abandoned(ino)):
                # a write nobody can commit any more: its rows go, and their copies (this one too) with them
                if ino not in reclaimed:
                    self.healer.reclaim_uncommitted([ino])
                    reclaimed.add(ino)
                log.info("fsck: copy %d:%d:%d v%d on node %d of an abandoned write queued for deletion", ino, idx, part, version, node_id)
                repaired += 1
                continue
            if (ino, idx) in pending:
                repaired += 1  # queued for deletion meanwhile (another fsck, the collector): dealt with
                continue
            if (cur is not None and node_id in cur[1]) or (ino, idx, node_id) in self.healer.inflight:
                why = "a writer holds its file open" if cur is not None and cur[0] == 0 else "placed there meanwhile or being copied"
                left.append(f"orphan copy {ino}:{idx}:{part} v{version} on node {node_id} not repaired: {why}; run fsck again later")
                continue
            store.add_garbage([(node_id, ino, idx, part, version)])
            log.info("fsck: orphan copy %d:%d:%d v%d on node %d queued for deletion", ino, idx, part, version, node_id)
            repaired += 1
        still = []
        for ino, idx, part in missing:
            cur = store.get_chunks(ino, [idx]).get(idx)
            # the copy's own version in the row now (a replica's, or that fragment's: ChunkRef ``fversions``)
            if cur is not None and node_id in cur[1] and P.fragment_version(cur[0], cur[2], part % SLOT_STRIDE) == expected[(ino, idx, part)]:
                still.append(P.ChunkId(ino, idx, part))
        fixed = self.healer.mark_bad(node_id, still, "is missing or stale (fsck)")
        repaired += fixed + (len(missing) - len(still))  # the others were rewritten or moved meanwhile
        if fixed < len(still):
            left.append(f"{len(still) - fixed} missing or stale copies on node {node_id} kept: the only live copy, or too few "
                        "other fragments (see the daemon's log)")
        self.healer.poke()
        return repaired, left
