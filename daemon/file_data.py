"""A file's data in the metadata: its chunk map, write epochs, chunk placement, commits, conversions.

``FileData`` is half of ``Namespace`` (daemon/namespace.py, which inherits it): the
same store, node source, quotas and clock, and the same rule that every public
method is one metadata operation run in one transaction. Names, inodes,
attributes and xattrs are namespace.py's; what is stored where, and which
version of it is current, is here.

* Epochs: strictly increasing and never repeated across restarts. The store
  keeps a high-water mark raised in blocks of ``EPOCH_BLOCK``; epochs below
  the stored mark may be handed out without writing. After a restart the
  numbers of a partly used block are skipped. ``alloc_epoch`` says when it
  raised the mark: that change must be durable before the epoch is used.
  A writer may ask for a *pair* (``alloc_epoch(pair=True)``): the epoch and
  the next number are both its own, one of each parity, which is what a
  write session's copy-on-write slots need (client/placements.py
  ``slot_version``): one request instead of asking again until the parity fits.
  On PostgreSQL (several daemons) epochs come from a database sequence
  instead: unique and increasing across daemons, durable when handed out.
* Placement: ``alloc_chunks`` places chunks (daemon/placement.py), padded to
  K+M positions for an erasure-coded file (daemon/redundancy.py);
  ``replace_replica`` moves a failed node's copy; ``release_chunks`` drops
  placements made ahead and never written.
* Commits: a length is committed only with the version of the chunk holding
  its last byte; a directory quota may cut a commit (daemon/quota.py); copies
  a commit leaves behind are queued as garbage.
* Conversions (daemon/redundancy.py): a nameless shadow inode is filled, then
  takes every name of the file if the file did not change meanwhile.
"""

from __future__ import annotations

import logging
from typing import Callable, Protocol, Sequence

import msgspec

from ..common.erasure import fragment_part
from ..common.errors import ErrorCode, StripefsError
from ..common.layout import chunk_count, parse_redundancy, replica_part
from ..common.log_limits import LogEvery
from ..common.protocol import Attr, ChunkRef, NodeAddr, fragment_version, uniform_fversions
from . import placement, redundancy
from . import redundancy as _redundancy
from .quota import Quotas
from .snapshots import Snapshots, check_writable
from .store import SqliteStore

log = logging.getLogger(__name__)
#: a node down with no spare makes every stripe committed degraded: one line per 10 s, the rest counted
_degraded_log = LogEvery(log, 10.0)

EPOCH_BLOCK = 1000


def _replaced_slots(ino: int, ref: ChunkRef, old_version: int, old_nodes: list[int], old_fv: list[int], is_ec: bool) -> list:
    """Garbage rows (node, ino, idx, part, bound) for the committed copies a commit of ``ref`` (newer
    than the row's ``old_version``) leaves behind: each fragment whose new version has the other
    parity than its committed one (the new one went to the other slot), bounded by its own old
    version; a fragment left at its version (a parity delta's untouched one) keeps its slot."""
    rows = []
    for j, node in enumerate(old_nodes):
        if node == redundancy.MISSING:
            continue
        old = fragment_version(old_version, old_fv, j) if is_ec else old_version
        new = ref.fragment_version(j) if is_ec else ref.version
        if old and new > old and (old & 1) != (new & 1):
            rows.append((node, ino, ref.index, fragment_part(j, old) if is_ec else replica_part(old), old))
    return rows


class NodeSource(Protocol):
    """What the namespace asks about storage nodes (daemon.health.NodeRegistry)."""

    def views(self) -> list[placement.NodeView]: ...

    def address(self, node_id: int) -> str: ...

    def capacity(self) -> tuple[int, int]: ...


class FileData:
    """The data half of ``Namespace``: what it uses of the other half is below."""

    store: SqliteStore
    nodes: NodeSource
    quotas: Quotas
    snapshots: Snapshots
    clock: Callable[[], int]
    is_open: Callable[[int], bool]
    # from daemon/namespace.py: inode(ino), regular_file(ino), getattr(ino), attr_of(row), reclaim(ino)

    def __init__(self, store: SqliteStore) -> None:
        # epochs in [_epoch_next, _epoch_limit) may be handed out without a write
        self._epoch_next = self._epoch_limit = int(store.get_meta("epoch_hwm", 1))

    def _chunk_map(self, ino: int, chunks: dict[int, tuple[int, list[int], list[int]]], addrs: dict[int, NodeAddr] | None = None
                   ) -> tuple[list[ChunkRef], list[NodeAddr]]:
        """``chunks`` (store.get_chunks) as readers get them; ``addrs``: NodeAddrs made so far, shared
        (many maps at once)."""
        refs = [ChunkRef(index=i, version=v, nodes=n, fversions=fv) for i, (v, n, fv) in sorted(chunks.items())]
        ids = sorted({n for ref in refs for n in ref.nodes} - {redundancy.MISSING})
        if addrs is None:
            return refs, [NodeAddr(node_id=i, address=self.nodes.address(i)) for i in ids]
        for i in ids:
            if i not in addrs:
                addrs[i] = NodeAddr(node_id=i, address=self.nodes.address(i))
        return refs, [addrs[i] for i in ids]

    def last_epoch(self) -> int:
        """The newest epoch handed out so far: every write started before now carries at most this."""
        if self.store.dialect.sequences:  # several daemons: the database's sequence (daemon/pg_store.py)
            return self.store.last_epoch()
        return self._epoch_next - 1

    @property
    def epoch_pairs(self) -> bool:
        """Whether ``alloc_epoch(pair=True)`` can hand out pairs (not from a database sequence,
        whose numbers other daemons take in between)."""
        return not self.store.dialect.sequences

    def alloc_epoch(self, pair: bool = False) -> tuple[int, bool]:
        """A fresh epoch, and whether the stored high-water mark was raised for it; ``pair`` (when
        ``epoch_pairs``): the next number too is the asker's (never handed out to anyone else)."""
        if self.store.dialect.sequences:
            return self.store.next_epoch(), False
        epoch = self._epoch_next
        taken = 2 if pair else 1
        raised = False
        if epoch + taken > self._epoch_limit:
            self._epoch_limit = epoch + EPOCH_BLOCK
            self.store.set_meta("epoch_hwm", self._epoch_limit)
            raised = True
        self._epoch_next = epoch + taken
        return epoch, raised

    def alloc_chunks(self, ino: int, indices: Sequence[int]) -> tuple[list[ChunkRef], list[NodeAddr]]:
        """Placement for ``indices`` of file ``ino``; chunks already placed are returned as they are."""
        row = self.regular_file(ino)
        check_writable(row)
        if any(i < 0 for i in indices):
            raise StripefsError(ErrorCode.INVALID, "negative chunk index")
        existing = self.store.get_chunks(ino, indices)
        return self._place(row, sorted(set(indices) - set(existing)), existing, fresh=False)

    def place_new(self, row, indices: Sequence[int]) -> tuple[list[ChunkRef], list[NodeAddr]]:
        """``alloc_chunks`` for a file created in this operation (``row``: its row as written):
        it has no chunks and no pending deletions yet, so nothing is read."""
        return self._place(row, sorted(set(indices)), {}, fresh=True)

    def place_new_files(self, rows: Sequence[dict]) -> list[tuple[list[ChunkRef], list[NodeAddr]]]:
        """``place_new(row, [0])`` of many files created in this operation (a batch of creates,
        daemon/namespace_bulk.py): the nodes looked at once, the rows written in one statement.
        No node up: none of them gets a placement (([], [])), as a single create gets none."""
        views = self.nodes.views()
        placed = []
        try:
            for row in rows:
                red = parse_redundancy(row["redundancy"])
                nodes = placement.place_chunks(views, (0,), copies=red.copies, stripe_count=row["stripe_count"],
                                               stripe_seed=row["stripe_seed"])[0]
                placed.append(redundancy.pad_fragments(nodes, red))
        except StripefsError as exc:
            if exc.code != ErrorCode.UNAVAILABLE:
                raise
            log.debug("%d inode(s) created without a placement for chunk 0: %s", len(rows), exc.message)
            return [([], [])] * len(rows)
        self.store.put_new_chunks((row["ino"], 0, 0, nodes) for row, nodes in zip(rows, placed))
        addrs: dict[int, NodeAddr] = {}
        maps: dict[tuple, list[NodeAddr]] = {}  # one address list per set of nodes (replies only read them)
        out = []
        for nodes in placed:
            key = tuple(nodes)
            if key not in maps:
                maps[key] = self._chunk_map(0, {0: (0, nodes, [])}, addrs)[1]
            out.append(([ChunkRef(index=0, version=0, nodes=nodes)], maps[key]))
        return out

    def _place(self, row, missing: list[int], existing: dict, *, fresh: bool) -> tuple[list[ChunkRef], list[NodeAddr]]:
        ino = row["ino"]
        if missing:
            red = parse_redundancy(row["redundancy"])
            placed = placement.place_chunks(
                self.nodes.views(), missing, copies=red.copies, stripe_count=row["stripe_count"], stripe_seed=row["stripe_seed"]
            )
            for index, nodes in placed.items():
                nodes = placed[index] = redundancy.pad_fragments(nodes, red)
                self.store.put_chunk(ino, index, 0, nodes, fresh=fresh)
                existing[index] = (0, nodes, [])
            log.debug("inode %d: placed chunk(s) %s", ino, placed)
        return self._chunk_map(ino, existing)

    def release_chunks(self, ino: int, indices: Sequence[int]) -> int:
        """Drop placements ``indices`` of ``ino`` past its end that were never committed
        (ReleaseChunksReq: a writer placed them ahead and did not use them); how many."""
        row = self.regular_file(ino)
        check_writable(row)
        first = chunk_count(row["size"], row["chunk_size"])
        dropped = self.store.drop_unwritten_chunks(ino, [i for i in indices if i >= first])
        if dropped:
            log.debug("inode %d: %d placement(s) made ahead and not used released", ino, dropped)
        return dropped

    def replace_replica(self, ino: int, index: int, failed_node: int, part: int = -1) -> tuple[ChunkRef, list[NodeAddr]]:
        """Move ``failed_node``'s copy (fragment ``part`` of an EC stripe, when given) to another node."""
        row = self.regular_file(ino)
        check_writable(row)
        current = self.store.get_chunks(ino, [index]).get(index)
        if current is None:
            raise StripefsError(ErrorCode.NOT_FOUND, f"chunk {ino}:{index} has no placement")
        version, nodes, fversions = current
        position = redundancy.fragment_position(nodes, failed_node, part)
        if position is None:
            # already replaced (a retry, or another writer did it): answer the current placement
            refs, addrs = self._chunk_map(ino, {index: current})
            return refs[0], addrs
        present = [n for n in nodes if n != redundancy.MISSING]
        try:
            new = placement.replace_node(
                self.nodes.views(), present + ([failed_node] if failed_node == redundancy.MISSING else []), failed_node,
                key=row["stripe_seed"] ^ index,
            )
        except StripefsError as exc:
            views = {v.node_id: v for v in self.nodes.views()}
            if exc.code == ErrorCode.UNAVAILABLE and part >= 0 and failed_node in views and views[failed_node].up:
                # an EC writer that skipped a node it suspects, with nowhere else to go: the node
                # heartbeats, so the placement stays and the writer tries it after all
                refs, addrs = self._chunk_map(ino, {index: current})
                return refs[0], addrs
            raise
        nodes = list(nodes)
        nodes[position] = new
        self.store.put_chunk(ino, index, version, nodes, fversions)
        is_ec = parse_redundancy(row["redundancy"]).is_ec
        if failed_node != redundancy.MISSING:
            # every part goes (all_parts): the fragment's own slot named only for the node's bookkeeping
            part = fragment_part(position, fragment_version(version, fversions, position)) if is_ec else replica_part(version)
            self.store.add_garbage([(failed_node, ino, index, part, self.last_epoch())])
        log.info("chunk %d:%d: copy on node %d moved to node %d", ino, index, failed_node, new)
        refs, addrs = self._chunk_map(ino, {index: (version, nodes, fversions)})
        return refs[0], addrs

    def _record_chunks(self, ino: int, chunks: Sequence[ChunkRef], row=None) -> None:
        """The chunk rows of ``chunks`` and the garbage they leave; ``row``: the file's inode row, if
        the caller read it already (its redundancy is all that is used)."""
        if not chunks:
            return
        existing = self.store.get_chunks(ino, [c.index for c in chunks])
        is_ec = parse_redundancy((row if row is not None else self.inode(ino))["redundancy"]).is_ec
        for ref in chunks:
            if ref.index < 0 or ref.version < 0:
                raise StripefsError(ErrorCode.INVALID, f"bad chunk ref {ref} for inode {ino}")
            old_version, old_nodes, old_fv = existing.get(ref.index, (0, [], []))
            nodes = list(ref.nodes) or old_nodes
            if not nodes:
                raise StripefsError(ErrorCode.INVALID, f"chunk {ino}:{ref.index} has no placement and no nodes given")
            if any(v < 0 or v > ref.version for v in ref.fversions) or (ref.fversions and len(ref.fversions) != len(nodes)):
                raise StripefsError(ErrorCode.INVALID, f"bad fragment versions in chunk ref {ref} for inode {ino}")
            dropped = [n for n in old_nodes if n not in nodes]
            if dropped and is_ec:  # (positional EC fragments are left to their own rules)
                dropped = []
            # a copy the writer did not write (a repair or drain moved the row meanwhile) is now stale: garbage
            self.store.add_garbage((n, ino, ref.index, 0, max(old_version, ref.version)) for n in dropped)
            if ref.version >= old_version:
                self.store.put_chunk(ino, ref.index, ref.version, nodes, uniform_fversions(ref.version, ref.fversions))
            else:  # an older version than the row's (never sent by a writer): the row's versions stay
                self.store.put_chunk(ino, ref.index, old_version, nodes)
            if old_version and ref.version > old_version:
                # each fragment whose new version went to the other slot (copy-on-write, common/layout.py
                # "Slots"): the committed one's copy or fragment is garbage now, bounded by its own version
                self.store.add_garbage(_replaced_slots(ino, ref, old_version, old_nodes, old_fv, is_ec))
            if redundancy.MISSING in nodes:
                _degraded_log.log(
                    logging.WARNING, "degraded",
                    "stripe %d:%d v%d committed with %d of %d fragments: queued for reconstruction",
                    ino, ref.index, ref.version, len(nodes) - nodes.count(redundancy.MISSING), len(nodes),
                )

    def commit(self, ino: int, size: int, mtime_ns: int, chunks: Sequence[ChunkRef]) -> Attr:
        row = self.regular_file(ino)
        check_writable(row)
        # a snapshot reading a version this commit moves past gets its own copy first (daemon/snapshots.py)
        self.snapshots.guard(ino, {c.index: c.version for c in chunks if c.version})
        if size < 0:
            raise StripefsError(ErrorCode.INVALID, f"negative size {size} for inode {ino}")
        if size > row["size"]:
            # a length is committed only with its data: the writer of the new last byte stored
            # the chunk holding it, and commits that chunk's version here (client/open_files.py)
            last = (size - 1) // row["chunk_size"]
            if not any(c.index == last and c.version for c in chunks):
                raise StripefsError(
                    ErrorCode.INVALID,
                    f"inode {ino}: a commit growing the file to {size} bytes carries no version of chunk {last}, "
                    "which holds its last byte: its data was not stored",
                )
        new_size = max(row["size"], size)
        fits = self.quotas.fit_growth(ino, new_size - row["size"])
        if fits < new_size - row["size"]:
            # the quota backstop (daemon/quota.py): keep what fits, drop the chunks past it;
            # the smaller size in the reply tells the writer to cut the boundary chunk
            new_size = row["size"] + fits
            keep = chunk_count(new_size, row["chunk_size"])
            chunks = [c for c in chunks if c.index < keep]
            self.snapshots.guard(ino, from_index=keep)
            dropped = self.store.drop_chunks(ino, keep, max_version=self.last_epoch())
            log.info(
                "inode %d: commit of %d bytes cut to %d by a directory quota (%d chunk(s) dropped)", ino, size, new_size, dropped
            )
        self._record_chunks(ino, chunks, row)
        self.quotas.resized(ino, row["size"], new_size)
        now = self.clock()
        self.store.update_inode(ino, size=new_size, mtime_ns=mtime_ns or now, ctime_ns=now)
        # the row read above, as this update leaves it: nothing else here writes the inode's row (the
        # guard and the quota read it or write their own tables), so no third read of it (issue 31:
        # a commit read the row three times, ~18 us each, of the daemon's ~11 statements a commit)
        return msgspec.structs.replace(self.attr_of(row), size=new_size, mtime_ns=mtime_ns or now, ctime_ns=now)

    # -- online conversion (daemon/redundancy.py) --------------------------------

    def create_shadow(self, ino: int, new_redundancy: str) -> int:
        """A nameless copy target for file ``ino`` with ``new_redundancy``; its inode number."""
        row = self.regular_file(ino)
        check_writable(row)
        red = parse_redundancy(new_redundancy)
        _redundancy.check_fits(self.nodes.views(), red)
        shadow = self.store.insert_inode(**_redundancy.shadow_fields(row, str(red), self.clock()))
        log.info("inode %d: conversion to %s started into shadow inode %d", ino, red, shadow)
        return shadow

    def swap_shadow(
        self, ino: int, shadow: int, size: int, mtime_ns: int, chunks: Sequence[ChunkRef]
    ) -> tuple[Attr, list[tuple[int, bytes]]]:
        """Give every name of ``ino`` to ``shadow`` if ``ino`` is unchanged since the copy began;
        the shadow's attributes and the (parent, name) entries that changed.

        ``size``, ``mtime_ns`` and ``chunks`` (index, version) are what the copy read.
        Raises BUSY when the file changed: the caller copies again or gives up.
        """
        row = self.regular_file(ino)
        srow = self.regular_file(shadow)
        if srow["nlink"] != 0:
            raise StripefsError(ErrorCode.INVALID, f"inode {shadow} is not a conversion shadow")
        versions = {i: v for i, (v, _, _) in self.store.get_chunks(ino).items() if v}
        copied = {c.index: c.version for c in chunks if c.version}
        if row["size"] != size or row["mtime_ns"] != mtime_ns or versions != copied:
            raise StripefsError(ErrorCode.BUSY, f"inode {ino} changed while it was being converted")
        if row["nlink"] <= 0:
            raise StripefsError(ErrorCode.NOT_FOUND, f"inode {ino} was unlinked while it was being converted")
        now = self.clock()
        self.store.update_inode(
            shadow, nlink=row["nlink"], size=size, mtime_ns=row["mtime_ns"], atime_ns=row["atime_ns"], ctime_ns=now,
            mode=row["mode"], uid=row["uid"], gid=row["gid"],
        )
        for name in self.store.list_xattrs(ino):
            self.store.set_xattr(shadow, name, self.store.get_xattr(ino, name))
        entries = []
        for cookie, parent, name in self.store.dentries_of(ino):
            self.store.set_dentry_ino(cookie, shadow)
            entries.append((parent, name))
        self.store.update_inode(ino, nlink=0, ctime_ns=now)
        if not self.is_open(ino):
            self.reclaim(ino)
        log.info("inode %d converted: its names now lead to inode %d (%s)", ino, shadow, srow["redundancy"])
        return self.getattr(shadow), entries
