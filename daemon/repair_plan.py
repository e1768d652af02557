"""Repair planning: which copies to make, fewest first. Pure functions over chunk rows and node states.

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

The plan is executed by ``Healer`` (daemon/repair.py), which also reads the
rows (``ChunkRow.from_sql``) and applies the targets the placement rules pick.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Container, Iterable

from ..common.erasure import fragment_part
from ..common.layout import parse_redundancy, replica_part
from ..common.protocol import fragment_version
from .health import LIVE_STATES, PLACEABLE_STATES
from .store import decode_fversions, decode_nodes

MOVABLE_PER_NODE = 2000  # rebalance candidates remembered per node and scan
_KIND_ORDER = {"repair": 0, "reconstruct": 1, "move_empty": 2, "drain": 3, "rebalance": 4}


@dataclass(frozen=True)
class ChunkRow:
    ino: int
    idx: int
    version: int
    nodes: tuple[int, ...]
    redundancy: str
    chunk_size: int
    size: int = -1  # the file's size (-1: unknown): what a copy of a small file's chunk really holds
    data_ino: int = 0  # a snapshot's row sharing this inode's copies (daemon/snapshots.py): their chunk ids are its
    fversions: tuple[int, ...] = ()  # each fragment's version (common/protocol.ChunkRef); empty: all at ``version``

    @classmethod
    def from_sql(cls, row) -> ChunkRow:
        """A row of store.chunk_rows_page / chunk_rows_of."""
        return cls(row[0], row[1], row[2], tuple(decode_nodes(row[3])), row[4], row[5], *row[6:8],
                   fversions=tuple(decode_fversions(row[8])) if len(row) > 8 else ())

    def fragment_version(self, j: int) -> int:
        return fragment_version(self.version, self.fversions, j)

    def copy_bytes(self, ec_k: int = 0) -> int:
        """Bytes one copy (one fragment of ``ec=K+M``) of this chunk holds: the file's bytes in it, not
        the chunk size (a 100 KiB file's chunk is 100 KiB, not 4 MiB); the chunk size when unknown."""
        used = self.chunk_size if self.size < 0 else max(0, min(self.chunk_size, self.size - self.idx * self.chunk_size))
        return -(-used // ec_k) if ec_k else used


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
    nbytes: int = -1  # bytes the copy will hold (ChunkRow.copy_bytes; -1: ``length``): backlog figures only
    data_ino: int = 0  # the copies' chunk ids are this inode's (a snapshot's shared row), not ``ino``'s
    fversions: tuple[int, ...] = ()  # an EC row's version per fragment (ChunkRow.fversions)

    def fragment_version(self, j: int) -> int:
        """The version fragment ``j`` of the row as planned is stored at (``version`` for a replica)."""
        return fragment_version(self.version, self.fversions, j) if self.ec else self.version

    @property
    def chunk_ino(self) -> int:
        """The inode in the chunk ids of this row's copies."""
        return self.data_ino or self.ino

    @property
    def copy_bytes(self) -> int:
        return self.length if self.nbytes < 0 else self.nbytes

    @property
    def replace(self) -> int | None:
        return self.nodes[self.slot] if self.slot >= 0 else None

    @property
    def slot_version(self) -> int:
        """The version the copy made for ``slot`` is stored at (an appended one: ``version``)."""
        return self.fragment_version(self.slot) if self.slot >= 0 else self.version

    @property
    def part(self) -> int:
        if self.ec and self.slot >= 0:
            return fragment_part(self.slot, self.fragment_version(self.slot))
        return replica_part(self.version)


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
        if row.version and not row.nodes:  # in a cold tier (docs/tiering.md): its object is its redundancy
            continue
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
                nbytes = row.copy_bytes(red.ec_k)
                out.tasks.append(Task("reconstruct", row.ino, row.idx, row.version, row.nodes, sources, slot, len(live), row.chunk_size, True,
                                      nbytes=nbytes, data_ino=row.data_ino, fversions=row.fversions))
                out.backlog_bytes += nbytes
            elif draining:
                nbytes = row.copy_bytes(red.ec_k)
                out.tasks.append(Task("drain", row.ino, row.idx, row.version, row.nodes, sources, draining[0], len(live), row.chunk_size, True,
                                      nbytes=nbytes, data_ino=row.data_ino, fversions=row.fversions))
                out.backlog_bytes += nbytes
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
            out.tasks.append(Task("repair", row.ino, row.idx, row.version, row.nodes, sources, slot, len(live), row.chunk_size,
                                  nbytes=row.copy_bytes(), data_ino=row.data_ino))
            out.backlog_bytes += row.copy_bytes() * (copies - len(live))
        elif draining:
            out.tasks.append(Task("drain", row.ino, row.idx, row.version, row.nodes, sources, draining[0], len(live), row.chunk_size,
                                  nbytes=row.copy_bytes(), data_ino=row.data_ino))
            out.backlog_bytes += row.copy_bytes() * len(draining)
        elif gone:
            out.fixes.append((row, tuple(row.nodes[i] for i in live)))
        elif all(s in PLACEABLE_STATES for s in state) and not row.data_ino:  # shared copies stay where both rows point
            for n in row.nodes:
                bucket = out.movable.setdefault(n, [])
                if len(bucket) < MOVABLE_PER_NODE:
                    bucket.append(row)
    out.tasks.sort(key=lambda t: (t.live, _KIND_ORDER[t.kind]))
    return out


def plan_rebalance(
    work: Plan, capacity: dict[int, int], tolerance: float, max_moves: int = 500, held: Container[int] = frozenset()
) -> list[Task]:
    """Moves that bring every placeable node's utilisation within ``tolerance`` of the mean.

    Utilisation is placed bytes (chunk sizes of the copies the namespace puts
    there, so a move counts at once, without waiting for heartbeats) over
    capacity. The fullest node gives a copy to the emptiest node that does not
    hold that chunk, as long as the giver stays at least as full as the taker
    after the move (no ping-pong), until the fullest is within tolerance.
    Only ``capacity`` (placeable nodes with a known capacity) take part. Chunks
    of the files in ``held`` (open in some session) stay where they are: moving
    them is optional, and a writer of the file still names the old nodes
    (daemon/repair.py, "Open files").
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
            if (row.ino, row.idx) in moved or row.ino in held:
                continue
            takers = sorted((n for n in nodes if n not in row.nodes), key=util)
            if not takers:
                continue
            taker = takers[0]
            size = row.chunk_size
            if (used[giver] - size) / capacity[giver] < (used[taker] + size) / capacity[taker]:
                continue  # would overshoot: the taker would end up fuller than the giver
            slot = row.nodes.index(giver)
            red = parse_redundancy(row.redundancy)
            tasks.append(Task("rebalance", row.ino, row.idx, row.version, row.nodes, row.nodes, slot, len(row.nodes),
                              size, red.is_ec, target=taker, nbytes=row.copy_bytes(red.ec_k if red.is_ec else 0),
                              fversions=row.fversions))
            moved.add((row.ino, row.idx))
            used[giver] -= size
            used[taker] += size
            done = True
            break
        if not done:
            break
    return tasks
