"""Self-healing, the metadata daemon's side: what to copy where, and recording it.

The daemon decides; storage nodes move the bytes. Nothing bulk ever flows
through the daemon.

Planning (``plan``, pure)
-------------------------
A *scan* reads every chunk row (in pages, releasing the service lock between
pages) together with its file's redundancy, and classifies each by the states
of the nodes it names (daemon/health.py): a copy is *live* on an up, suspect or
draining node; *gone* on a down or removed one.

* fewer live copies than the target (R replicas, or K+M fragments):
  *under-replicated*; a ``repair`` task (``reconstruct`` for an erasure-coded
  fragment); none live at all: *lost* (nothing to copy from);
* full, but a copy sits on a draining node: a ``drain`` task;
* full, and the row still names gone nodes beyond the target: a ``fix``
  (the gone nodes are dropped from the row; their copies become garbage);
* version 0 (allocated, never committed: no data) naming a node that may not
  take chunks: ``move_empty`` (the row points elsewhere; nothing is copied).

Tasks run fewest-live-copies first (a chunk down to its last copy before one
that lost one of three), repairs before drains. One task per chunk per scan:
a chunk missing two copies gets the second on the next scan, which starts as
soon as the previous pass ends.

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
chunk is never dropped this way (an ERROR: the data may be lost).

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
while is evened out again.

Scale: the scan is a full walk of the chunk table in pages (fine for millions
of chunks; a per-node index would be needed beyond).
"""

from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable

import trio

from ..common import protocol as P
from ..common.erasure import fragment_part
from ..common.errors import ErrorCode, StripefsError
from ..common.layout import parse_redundancy
from ..common.transport import RpcClient, connect
from .health import LIVE_STATES, PLACEABLE_STATES
from .placement import NodeView, replace_node
from .store import decode_nodes

if TYPE_CHECKING:
    from .service import MetaService

log = logging.getLogger(__name__)

SCAN_PAGE = 5000
MOVABLE_PER_NODE = 2000  # rebalance candidates remembered per node and scan
RETRY_S = 10.0  # after a pass that made no progress
COPY_TIMEOUT_S = 10.0  # plus one second per MiB of chunk: a copy is one chunk read and one durable write
VERIFY_TIMEOUT_S = 300.0
_KIND_ORDER = {"repair": 0, "reconstruct": 1, "move_empty": 2, "drain": 3, "rebalance": 4}


@dataclass(frozen=True)
class ChunkRow:
    ino: int
    idx: int
    version: int
    nodes: tuple[int, ...]
    redundancy: str
    chunk_size: int

    @classmethod
    def from_sql(cls, row) -> ChunkRow:
        return cls(row[0], row[1], row[2], tuple(decode_nodes(row[3])), row[4], row[5])


@dataclass(frozen=True)
class Task:
    """Make one more copy of a chunk (or point an empty row elsewhere)."""

    kind: str  # repair | reconstruct | drain | move_empty | rebalance
    ino: int
    idx: int
    version: int
    nodes: tuple[int, ...]  # the row as planned
    sources: tuple[int, ...]  # live nodes holding it, placeable ones first
    slot: int  # position in ``nodes`` the new copy takes; -1: appended
    live: int  # live copies now (ordering: fewest first)
    length: int  # the file's chunk size
    ec: bool = False
    target: int = 0  # rebalance: the node chosen to receive it (0: placement chooses)

    @property
    def replace(self) -> int | None:
        return self.nodes[self.slot] if self.slot >= 0 else None

    @property
    def part(self) -> int:
        return fragment_part(self.slot, self.version) if self.ec and self.slot >= 0 else 0


@dataclass
class Plan:
    tasks: list[Task] = field(default_factory=list)
    fixes: list[tuple[ChunkRow, tuple[int, ...]]] = field(default_factory=list)  # (row, nodes to keep)
    chunks: int = 0
    under_replicated: int = 0
    over_replicated: int = 0
    lost: int = 0
    placed: collections.Counter = field(default_factory=collections.Counter)  # node -> rows naming it
    placed_bytes: collections.Counter = field(default_factory=collections.Counter)  # node -> chunk sizes of its copies
    movable: dict[int, list[ChunkRow]] = field(default_factory=dict)  # node -> fully healthy rows it holds (rebalance)
    backlog_bytes: int = 0


def plan(rows: Iterable[ChunkRow], states: dict[int, str], into: Plan | None = None) -> Plan:
    """Classify chunk rows by the node ``states``; tasks come out fewest live copies first."""
    out = into or Plan()
    for row in rows:
        out.chunks += 1
        out.placed.update(set(row.nodes))
        red = parse_redundancy(row.redundancy)
        copies = red.copies
        state = [states.get(n, "removed") for n in row.nodes]
        if row.version == 0:
            bad = [i for i, s in enumerate(state) if s not in PLACEABLE_STATES]
            if bad:
                out.tasks.append(Task("move_empty", row.ino, row.idx, 0, row.nodes, (), bad[0], copies, row.chunk_size, red.is_ec))
            continue
        for n in row.nodes:
            out.placed_bytes[n] += row.chunk_size
        live = [i for i, s in enumerate(state) if s in LIVE_STATES]
        gone = [i for i, s in enumerate(state) if s not in LIVE_STATES]
        draining = [i for i, s in enumerate(state) if s == "draining"]
        sources = tuple(row.nodes[i] for i in sorted(live, key=lambda i: state[i] == "draining"))
        if red.is_ec:
            distinct_live = len({row.nodes[i] for i in live})
            missing_slots = gone + [i for i in range(len(row.nodes), copies)]
            if missing_slots:
                out.under_replicated += 1
                if distinct_live < red.ec_k:
                    out.lost += 1
                    continue
                slot = missing_slots[0] if missing_slots[0] < len(row.nodes) else -1
                out.tasks.append(Task("reconstruct", row.ino, row.idx, row.version, row.nodes, sources, slot, len(live), row.chunk_size, True))
                out.backlog_bytes += row.chunk_size
            elif draining:
                out.tasks.append(Task("drain", row.ino, row.idx, row.version, row.nodes, sources, draining[0], len(live), row.chunk_size, True))
                out.backlog_bytes += row.chunk_size
            continue
        if len(set(row.nodes[i] for i in live)) > copies:
            out.over_replicated += 1
        if not live:
            out.under_replicated += 1
            out.lost += 1
            continue
        if len(live) < copies:
            out.under_replicated += 1
            slot = gone[0] if gone else -1
            out.tasks.append(Task("repair", row.ino, row.idx, row.version, row.nodes, sources, slot, len(live), row.chunk_size))
            out.backlog_bytes += row.chunk_size * (copies - len(live))
        elif draining:
            out.tasks.append(Task("drain", row.ino, row.idx, row.version, row.nodes, sources, draining[0], len(live), row.chunk_size))
            out.backlog_bytes += row.chunk_size * len(draining)
        elif gone:
            out.fixes.append((row, tuple(row.nodes[i] for i in live)))
        elif all(s in PLACEABLE_STATES for s in state):
            for n in row.nodes:
                bucket = out.movable.setdefault(n, [])
                if len(bucket) < MOVABLE_PER_NODE:
                    bucket.append(row)
    out.tasks.sort(key=lambda t: (t.live, _KIND_ORDER[t.kind]))
    return out


def plan_rebalance(work: Plan, capacity: dict[int, int], tolerance: float, max_moves: int = 500) -> list[Task]:
    """Moves that bring every placeable node's utilisation within ``tolerance`` of the mean.

    Utilisation is placed bytes (chunk sizes of the copies the namespace puts
    there, so a move counts at once, without waiting for heartbeats) over
    capacity. The fullest node gives a copy to the emptiest node that does not
    hold that chunk, as long as the giver stays at least as full as the taker
    after the move (no ping-pong), until the fullest is within tolerance.
    Only ``capacity`` (placeable nodes with a known capacity) take part.
    """
    nodes = [n for n, c in capacity.items() if c > 0]
    if len(nodes) < 2:
        return []
    used = {n: work.placed_bytes.get(n, 0) for n in nodes}
    mean = sum(used.values()) / sum(capacity[n] for n in nodes)
    if mean <= 0:
        return []
    util = lambda n: used[n] / capacity[n]  # noqa: E731
    rows = {n: list(work.movable.get(n, ())) for n in nodes}
    moved: set[tuple[int, int]] = set()
    tasks: list[Task] = []
    while len(tasks) < max_moves:
        giver = max(nodes, key=util)
        if util(giver) <= mean * (1 + tolerance) and min(util(n) for n in nodes) >= mean * (1 - tolerance):
            break
        done = False
        for row in rows[giver]:
            if (row.ino, row.idx) in moved:
                continue
            takers = sorted((n for n in nodes if n not in row.nodes), key=util)
            if not takers:
                continue
            taker = takers[0]
            size = row.chunk_size
            if (used[giver] - size) / capacity[giver] < (used[taker] + size) / capacity[taker]:
                continue  # would overshoot: the taker would end up fuller than the giver
            slot = row.nodes.index(giver)
            tasks.append(Task("rebalance", row.ino, row.idx, row.version, row.nodes, row.nodes, slot, len(row.nodes),
                              size, parse_redundancy(row.redundancy).is_ec, target=taker))
            moved.add((row.ino, row.idx))
            used[giver] -= size
            used[taker] += size
            done = True
            break
        if not done:
            break
    return tasks


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
    """Repair loop, bad-copy handling, scrub and fsck requests of one metadata daemon."""

    def __init__(self, service: MetaService):
        self.svc = service
        self.config = service.config
        self.throttle = Throttle(int(self.config.repair_bandwidth))
        self.dirty = True  # the repair loop should rescan
        self.stale = True  # status figures may be out of date (any namespace change)
        self._wake = trio.Event()
        self._scanned_at = -1.0
        self._last = Plan()
        self._inflight: set[tuple[int, int, int]] = set()  # (ino, idx, target) copies not yet recorded
        self.copied = self.copied_bytes = self.failed = 0
        self.changes = 0  # placements recorded (copies and moves of empty rows): progress
        self.stuck = 0  # tasks of the last pass that no node could take (logged when the number changes)
        self._backlog = 0
        self._backlog_bytes = 0
        self._clients: NodeClients | None = None
        self._pass_scope: trio.CancelScope | None = None
        self._fences: dict[int, int] = {}  # ino -> epochs at or below are no longer committable (lease expired)
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
        return {n: self._last.placed.get(n, 0) for n in self.svc.nodes.states()} if self._scanned_at >= 0 else {}

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
            async with self.svc._lock:
                rows = self.svc.store.chunk_rows_page(after, SCAN_PAGE)
                states = self.svc.nodes.states()
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
            self._clients = NodeClients(self.svc.ctx, nursery, COPY_TIMEOUT_S)
            self._started = trio.current_time()
            self._ready.set()
            task_status.started()
            while True:
                if not self.dirty:
                    with trio.move_on_after(self.config.repair_scan_interval_s):
                        await self._wake.wait()
                self._wake = trio.Event()
                if not self.svc.duties.leading:  # another daemon runs repair (daemon/duties.py)
                    await self.svc.duties.wait_leading()
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
            async with self.svc._lock:
                capacity = {n: c for n, (_, c) in self.svc.nodes.usage().items()}
            work.tasks = plan_rebalance(work, capacity, self.config.rebalance_tolerance)
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
            async with self.svc._lock:
                for row, keep in work.fixes:
                    self.svc._write_locked(self._fix, row, keep)
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
        self._backlog_bytes = sum(t.length for t in runnable)
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
                    self._backlog_bytes = max(0, self._backlog_bytes - task.length)

    def has_target(self, task: Task) -> bool:
        """Whether some node could take ``task``'s copy now: up and not holding the chunk already."""
        if task.target:  # rebalance: its own target, checked when it runs
            return True
        return any(v.up and v.node_id not in task.nodes and self.svc.nodes.state(v.node_id) == "up" for v in self.svc.nodes.views())

    def _choose_target(self, task: Task) -> int:
        store, nodes = self.svc.store, self.svc.nodes
        avoid = store.garbage_nodes_of_chunk(task.ino, task.idx) | set(task.nodes)
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
        async with self.svc._lock:
            target = self._choose_target(task)
            target_address = self.svc.nodes.address(target)
            sources = [self.svc.nodes.address(n) for n in task.sources if self.svc.nodes.is_up(n)]
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
        chunk = P.ChunkId(task.ino, task.idx, task.part)
        timeout = COPY_TIMEOUT_S + task.length / (1 << 20)
        request = P.CopyChunkReq(chunk=chunk, min_version=task.version, sources=sources, length=task.length, deadline_s=timeout / 2)
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
        self._inflight.add(key)
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
            self._inflight.discard(key)
        if recorded:
            self.copied += 1
            self.copied_bytes += rsp.length
        return recorded, rsp

    async def reconstruct(self, task: Task, target: int, target_address: str) -> None:
        """Rebuild fragment ``task.slot`` of an EC stripe on ``target`` from K live fragments.

        The target reads the other fragments itself (ReconstructFragmentReq); the
        daemon only names them and records the result as for a copy."""
        async with self.svc._lock:
            inode = self.svc.store.get_inode(task.ino)
            if inode is None:
                return
            red = parse_redundancy(inode["redundancy"])
            used = max(0, min(task.length, inode["size"] - task.idx * task.length))
            sources = [
                P.FragmentSource(i, fragment_part(i, task.version), self.svc.nodes.address(n))
                for i, n in enumerate(task.nodes)
                if i != task.slot and self.svc.nodes.is_up(n)
            ]
        chunk = P.ChunkId(task.ino, task.idx, task.part)
        timeout = COPY_TIMEOUT_S + 2 * task.length / (1 << 20)
        request = P.ReconstructFragmentReq(
            chunk=chunk, version=task.version, k=red.ec_k, m=red.ec_m, chunk_size=task.length,
            used=used, fragment=task.slot, sources=sources, deadline_s=timeout / 2,
        )
        recorded, rsp = await self._store_on(task, target, target_address, request, timeout)
        if recorded:
            log.info("chunk %s v%d: fragment %d reconstructed on node %d%s", chunk, rsp.version, task.slot, target,
                     f", replacing node {task.replace}" if task.replace else "")
        await self.throttle.consume(rsp.length * max(1, red.ec_k))  # K fragments were read for it

    async def _record_durably(self, task: Task, target: int, version: int) -> bool:
        async with self.svc._lock:
            done, batch = self.svc._write_locked(self._record, task, target, version)
        await batch.wait()
        self.changes += done
        return done

    # -- row edits (synchronous: run under the service lock, in a savepoint) ---

    def _copies(self, ino: int) -> int:
        row = self.svc.store.get_inode(ino)
        return parse_redundancy(row["redundancy"]).copies if row is not None else 0

    def _record(self, task: Task, target: int, version: int) -> bool:
        """Compare-and-swap the new copy into the chunk's row; else queue it as garbage."""
        store = self.svc.store
        cur = store.get_chunks(task.ino, [task.idx]).get(task.idx)
        garbage = [(target, task.ino, task.idx, task.part, version)]
        if cur is None:
            if task.kind != "move_empty":
                store.add_garbage(garbage)
            return False
        cur_version, nodes = cur
        if task.kind != "move_empty" and (cur_version > version or (task.ec and cur_version != version)):
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
                store.add_garbage([(task.replace, task.ino, task.idx, task.part, cur_version)])
        else:
            live = sum(self.svc.nodes.state(n) in LIVE_STATES for n in nodes)
            if live >= self._copies(task.ino):
                store.add_garbage(garbage)
                return False
            new = nodes + [target]
        store.put_chunk(task.ino, task.idx, cur_version, new)
        return True

    async def _forget_copy_at(self, task: Task, target: int, when: float) -> None:
        await trio.sleep_until(when)
        async with self.svc._lock:
            self.svc._write_locked(self._forget_copy, task, target)
        self.svc._gc_wake.set()

    def _forget_copy(self, task: Task, target: int) -> None:
        """A copy whose outcome is unknown: delete it on ``target`` unless the row places it there."""
        cur = self.svc.store.get_chunks(task.ino, [task.idx]).get(task.idx)
        if cur is None or target not in cur[1]:
            self.svc.store.add_garbage([(target, task.ino, task.idx, task.part, self.svc.ns.last_epoch())])

    def _fix(self, row: ChunkRow, keep: tuple[int, ...]) -> None:
        """Drop gone nodes from a row that has enough live copies without them."""
        cur = self.svc.store.get_chunks(row.ino, [row.idx]).get(row.idx)
        if cur is None or tuple(cur[1]) != row.nodes or cur[0] != row.version:
            return
        dropped = [n for n in row.nodes if n not in keep]
        self.svc.store.add_garbage((n, row.ino, row.idx, 0, row.version) for n in dropped)
        self.svc.store.put_chunk(row.ino, row.idx, row.version, list(keep))
        log.info("chunk %d:%d: dropped copies on gone node(s) %s (enough live copies remain)", row.ino, row.idx, dropped)

    def mark_bad(self, node_id: int, chunks: Iterable[P.ChunkId], why: str = "failed its checksum") -> int:
        """Copies on ``node_id`` that are bad (or missing) count as missing; the number dealt with:
        dropped (re-replicated from a good copy), or no longer placed there (deleted). The others
        (an only live copy, an erasure-coded fragment) are kept as they are and logged."""
        store, nodes = self.svc.store, self.svc.nodes
        dropped = 0
        for c in chunks:
            cur = store.get_chunks(c.ino, [c.index]).get(c.index)
            if cur is None or node_id not in cur[1]:
                bound = cur[0] if cur is not None else self.svc.ns.last_epoch()
                store.add_garbage([(node_id, c.ino, c.index, c.part, bound)])
                dropped += 1
                continue
            version, holders = cur
            if parse_redundancy(store.get_inode(c.ino)["redundancy"]).is_ec:
                log.warning("chunk %s: fragment on node %d %s; it needs reconstruction (EC codec not built yet)", c, node_id, why)
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

    def reclaim_uncommitted(self, inos: Iterable[int]) -> None:
        """A session expired: chunks it allocated but never committed in files nobody has open go.

        The copies are deleted up to the newest epoch handed out so far, and that
        epoch becomes the file's *fence*: a commit of chunks written at or below
        it (a mount that was only paused past its lease, not dead) is refused
        with STALE, as a lost lease should be, instead of recording copies that
        are being deleted. Fences live in memory: a daemon restart forgets them
        (and every session with them).
        """
        store = self.svc.store
        bound = self.svc.ns.last_epoch()
        for ino in inos:
            if self.svc.sessions.is_open(ino) or store.get_inode(ino) is None:
                continue
            n = store.drop_uncommitted_chunks(ino, bound)
            if n:
                self._fences[ino] = bound
                log.info("inode %d: %d chunk(s) allocated but never committed by an expired session reclaimed", ino, n)

    def check_fence(self, ino: int, chunks: Iterable[P.ChunkRef]) -> None:
        """Refuse a commit of chunk versions written under a lease that expired (see reclaim_uncommitted)."""
        fence = self._fences.get(ino)
        if fence is None:
            return
        old = [c.index for c in chunks if 0 < c.version <= fence]
        if old:
            raise StripefsError(
                ErrorCode.STALE,
                f"inode {ino}: chunk(s) {old[:5]} were written under a session lease that expired; their copies are gone",
            )

    # -- requests (dispatched by MetaService.handle) -----------------------------

    async def handle_report_bad_chunks(self, req: P.ReportBadChunksReq) -> P.Msg:
        async with self.svc._lock:
            self.svc._write_locked(self.mark_bad, req.node_id, req.chunks)
        return P.OkRsp()

    async def handle_node_admin(self, req: P.NodeAdminReq) -> P.Msg:
        if req.action == "drain":
            await self.svc._write(self.svc.nodes.set_admin, req.node_id, "draining")
        elif req.action == "undrain":
            await self.svc._write(self.svc.nodes.set_admin, req.node_id, "")
        elif req.action == "remove":
            await self.svc._write(self.remove_node, req.node_id)
        else:
            raise StripefsError(ErrorCode.BAD_REQUEST, f"unknown node action {req.action!r}: drain, undrain or remove")
        self.poke()
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
            async with self.svc._lock:
                page = self.svc.store.chunk_rows_page(after, SCAN_PAGE)
            rows += [ChunkRow.from_sql(r) for r in page]
            if len(page) < SCAN_PAGE:
                return rows
            after = (page[-1][0], page[-1][1])

    def remove_node(self, node_id: int) -> int:
        """Forget a node (under the lock, in a savepoint): NOT_EMPTY while it holds an only copy."""
        store, nodes = self.svc.store, self.svc.nodes
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
        self.poke()
        return len(edits)

    async def scrub(self, req: P.ScrubReq) -> P.ScrubRsp:
        async with self.svc._lock:
            inos = list(req.inos) or self.svc.store.regular_files_after(req.after_ino, max(1, min(req.limit, 1000)))
            rows = [ChunkRow.from_sql(r) for r in self.svc.store.chunk_rows_of(inos)]
            total = self.svc.store.counts()["files"]
            by_node: dict[int, list[tuple[P.ChunkId, int]]] = collections.defaultdict(list)
            for row in rows:
                if not row.version:
                    continue
                ec = parse_redundancy(row.redundancy).is_ec
                for pos, n in enumerate(row.nodes):
                    if self.svc.nodes.is_up(n):
                        by_node[n].append((P.ChunkId(row.ino, row.idx, fragment_part(pos, row.version) if ec else 0), row.version))
            addresses = {n: self.svc.nodes.address(n) for n in by_node}
        totals = collections.Counter()

        async def verify(node_id: int, items: list[tuple[P.ChunkId, int]]) -> None:
            client = await (await self.clients()).get(addresses[node_id])
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
                bad = list(rsp.bad) + list(rsp.missing)
                totals["bad"] += len(bad)
                if bad:
                    async with self.svc._lock:
                        dropped = self.svc._write_locked(self.mark_bad, node_id, bad, "is bad, stale or missing (scrub)")[0]
                    totals["repairing"] += dropped  # the others have no good copy elsewhere (mark_bad logs each)

        async with trio.open_nursery() as nursery:
            for node_id, items in by_node.items():
                nursery.start_soon(verify, node_id, items)
        limit = max(1, min(req.limit, 1000))
        next_ino = inos[-1] if (not req.inos and len(inos) == limit) else 0
        return P.ScrubRsp(
            files=len(inos), copies=totals["copies"], bad=totals["bad"], bytes=totals["bytes"], next_ino=next_ino, total_files=total,
            repairing=totals["repairing"],
        )

    async def fsck(self, req: P.FsckReq) -> P.FsckRsp:
        if req.node_id == 0:
            return await self._fsck_redundancy(req.repair)
        return await self._fsck_node(req.node_id, req.repair)

    async def _fsck_redundancy(self, repair: bool) -> P.FsckRsp:
        rows = await self._all_rows()
        async with self.svc._lock:
            states = self.svc.nodes.states()
        result = plan(rows, states)
        problems = []
        trimmed = 0
        async with self.svc._lock:
            doable = [t for t in result.tasks if self.has_target(t)]
        doable_ids = {id(t) for t in doable}
        for t in [t for t in result.tasks if id(t) not in doable_ids][:10]:
            problems.append(f"chunk {t.ino}:{t.idx}: wants another copy, but every storage node up holds one already "
                            f"(copies on {list(t.nodes)}): add nodes or lower its layout (stripefs layout convert)")
        for row in rows:
            red = parse_redundancy(row.redundancy)
            live = [n for n in row.nodes if states.get(n) in LIVE_STATES]
            if row.version and not live and len(problems) < 20:
                problems.append(f"chunk {row.ino}:{row.idx} v{row.version}: no live copy (nodes {list(row.nodes)})")
            if row.version and not red.is_ec and len(set(live)) > red.copies:
                if len(problems) < 20:
                    problems.append(f"chunk {row.ino}:{row.idx}: {len(live)} live copies for {red.copies}")
                if repair:
                    async with self.svc._lock:
                        self.svc._write_locked(self._fix, row, tuple(live[: red.copies]))
                    trimmed += 1
        if repair:
            self.poke()
        return P.FsckRsp(
            checked=result.chunks, orphans=0, missing=0, under_replicated=result.under_replicated,
            over_replicated=result.over_replicated, lost=result.lost,
            repaired=trimmed + (len(doable) if repair else 0), problems=problems,
            unrepairable=len(result.tasks) - len(doable),
        )

    async def _fsck_node(self, node_id: int, repair: bool) -> P.FsckRsp:
        async with self.svc._lock:
            if not self.svc.nodes.is_up(node_id):
                raise StripefsError(ErrorCode.UNAVAILABLE, f"storage node {node_id} is {self.svc.nodes.state(node_id)}; fsck needs it up")
            address = self.svc.nodes.address(node_id)
        # the namespace first, then the node: a copy written in between is seen on the node,
        # and every finding is checked again against the current row before it is repaired
        expected: dict[tuple[int, int, int], int] = {}
        for row in await self._all_rows():
            if node_id in row.nodes:
                ec = parse_redundancy(row.redundancy).is_ec
                part = fragment_part(row.nodes.index(node_id), row.version) if ec else 0
                expected[(row.ino, row.idx, part)] = row.version
        client = await (await self.clients()).get(address)
        inventory: dict[tuple[int, int, int], int] = {}
        start = 0
        while start >= 0:
            rsp, _ = await client.call(P.ListChunksReq(start_dir=start), timeout=VERIFY_TIMEOUT_S)
            for c, v in zip(rsp.chunks, rsp.versions):
                inventory[(c.ino, c.index, c.part)] = v
            start = rsp.next_dir
        async with self.svc._lock:
            pending = self.svc.store.pending_garbage(node_id)  # queued for deletion already: not orphans
        orphans = [k for k in inventory if k not in expected and (k[0], k[1]) not in pending]
        missing = [k for k, v in expected.items() if v and inventory.get(k, -1) < v]
        problems = [f"orphan copy {i}:{x}:{p} v{inventory[(i, x, p)]} on node {node_id}" for i, x, p in orphans[:10]]
        problems += [f"copy {i}:{x}:{p} v{expected[(i, x, p)]} missing or stale on node {node_id}" for i, x, p in missing[:10]]
        repaired = 0
        if repair and (orphans or missing):
            async with self.svc._lock:
                repaired = self.svc._write_locked(self._fsck_repair, node_id, orphans, missing, inventory, expected)[0]
        for line in problems:
            log.info("fsck: %s", line)
        return P.FsckRsp(
            checked=len(inventory), orphans=len(orphans), missing=len(missing), under_replicated=0, over_replicated=0,
            lost=0, repaired=repaired, problems=problems,
        )

    def _fsck_repair(self, node_id, orphans, missing, inventory, expected) -> int:
        store = self.svc.store
        repaired = 0
        pending = store.pending_garbage(node_id)
        for ino, idx, part in orphans:
            cur = store.get_chunks(ino, [idx]).get(idx)
            if (cur is not None and node_id in cur[1]) or (ino, idx, node_id) in self._inflight or (ino, idx) in pending:
                continue  # placed meanwhile, being copied, or already queued
            store.add_garbage([(node_id, ino, idx, part, inventory[(ino, idx, part)])])
            log.info("fsck: orphan copy %d:%d:%d v%d on node %d queued for deletion", ino, idx, part, inventory[(ino, idx, part)], node_id)
            repaired += 1
        still = []
        for ino, idx, part in missing:
            cur = store.get_chunks(ino, [idx]).get(idx)
            if cur is not None and node_id in cur[1] and cur[0] == expected[(ino, idx, part)]:
                still.append(P.ChunkId(ino, idx, part))
        repaired += self.mark_bad(node_id, still, "is missing or stale (fsck)")
        self.poke()
        return repaired
