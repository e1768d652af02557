"""Directory snapshots: read-only, point-in-time copies that share the live files' chunks.

The design is docs/snapshots.md ("Snapshots"); the schema daemon/db.py (version 7).
This module is the metadata half, run inside the caller's operation (no network,
no awaits); daemon/snapshot_service.py serves the requests and does the copy-outs,
which need the storage nodes.

* ``create``: one transaction. The live tree below DIR (one recursive query,
  ``store.live_tree``; ``.snapshots`` directories and what they hold are not
  copied) gets new inode numbers (``store.reserve_inos``: a block, so the rows go
  in with one executemany per table), its inode rows (``snapshot`` = the
  snapshot's id), entries, symlinks, xattrs and committed chunk rows, each chunk
  row naming the inode whose chunk ids hold its bytes (``data_ino``). No chunk is
  read or written. The copy's top directory is ``DIR/.snapshots/NAME``;
  ``.snapshots`` is made on the first snapshot (mode 0555, DIR's owner,
  ``snapshot`` = -1) and removed with the last.
* Read-only: ``check_writable`` refuses (READ_ONLY, EROFS) every change of an
  inode with ``snapshot`` != 0; namespace.py and file_data.py call it on the row
  they read anyway.
* Pins: a chunk row with ``data_ino`` = L reads copies ``(L, idx, part(v))``.
  Those copies are safe while the live row (L, idx) stays at version v (its
  writers write the other slot). ``guard`` is called by every operation that
  would move a live row off a pinned version or drop it while the file lives on
  (a commit of another version, a truncate): it raises ``CopyOutNeeded`` naming
  the pins, before anything is written. The service copies those bytes to the
  snapshot's own chunk ids (CopyChunkReq with ``source``, on each node of the
  snapshot row), clears ``data_ino`` (``store.unpin``) and runs the operation
  again. A file that is removed needs no copy-out: its inode number is never
  reused, and the collector skips a garbage row while any row pins its chunk
  (``store.garbage_for_node``).
* ``delete``: the snapshot's inodes go (their entries, xattrs and chunk rows by
  cascade); the copies it owns (``data_ino`` 0: copied out) are queued as
  garbage; shared ones stay with the live file, or, if that is gone, its queued
  garbage now proceeds.
* Quota: nobody pays. Snapshot inodes are made without the quota hooks and are
  not counted by ``quota recount`` (``store.subtree_usage`` counts live inodes).
"""

from __future__ import annotations

import logging
import stat
from typing import Iterable, NamedTuple

from ..common.erasure import fragment_part
from ..common.errors import ErrorCode, StripefsError
from ..common.layout import parse_redundancy, replica_part
from ..common.protocol import SnapshotInfo, fragment_version
from .store import EXACT_PART, decode_fversions, decode_nodes

log = logging.getLogger(__name__)

HOLDER = b".snapshots"
#: ``inodes.snapshot`` of a ``.snapshots`` directory (read-only, never copied)
HOLDER_MARK = -1
_INODE_COLUMNS = "mode,uid,gid,nlink,rdev,size,atime_ns,mtime_ns,ctime_ns,generation,chunk_size,stripe_count,redundancy,stripe_seed"


def check_writable(row) -> None:
    """READ_ONLY (EROFS) for an inode of a snapshot or a ``.snapshots`` directory."""
    if row["snapshot"]:
        raise StripefsError(ErrorCode.READ_ONLY, f"inode {row['ino']} is in a snapshot: snapshots are read-only")


class Pin(NamedTuple):
    """A chunk row (``ino``, ``idx``) reading its bytes from ``data_ino``'s copies of ``version``."""

    ino: int
    idx: int
    version: int
    nodes: list[int]
    data_ino: int
    parts: list[tuple[int, int, int]]  # (node, chunk part, its version) of each copy or fragment to copy out
    needed: int = 1  # copies that must be made for the row to stay readable (K of an EC stripe)


class CopyOutNeeded(StripefsError):
    """The operation would move live chunk rows off versions snapshots still read: copy first."""

    def __init__(self, pins: list[Pin], chunk_size: int) -> None:
        super().__init__(ErrorCode.BUSY, f"{len(pins)} chunk(s) shared with a snapshot must be copied first")
        self.pins = pins
        self.chunk_size = chunk_size


class Snapshots:
    """The snapshots of one Namespace (``ns.snapshots``)."""

    def __init__(self, ns) -> None:
        self.ns = ns
        self.store = ns.store
        #: snapshots that exist (SQLite: this daemon is the only writer, so the count is exact and
        #: a file system without snapshots pays no query per commit); None: ask the database
        self.count: int | None = None

    def load(self) -> None:
        """Read the count (at start, and after each create or delete: a rolled-back one is not counted)."""
        self.count = None if self.store.dialect.sequences else self.store.count_snapshots()

    def _any(self) -> bool:
        return self.count is None or self.count > 0

    # -- create, list, delete -------------------------------------------------------

    def _holder(self, dir_ino: int, make: bool, now: int) -> int | None:
        """The inode of ``dir_ino/.snapshots`` (made when ``make``); None when there is none."""
        row = self.store.lookup_inode(dir_ino, HOLDER)
        if row is not None:
            if row["snapshot"] != HOLDER_MARK:
                raise StripefsError(ErrorCode.EXISTS, f"{HOLDER.decode()} in directory {dir_ino} is not its snapshots "
                                    "directory: rename it to take snapshots here")
            return row["ino"]
        if not make:
            return None
        d = self.ns.inode(dir_ino)
        ino = self.store.insert_inode(
            mode=stat.S_IFDIR | 0o555, uid=d["uid"], gid=d["gid"], nlink=2, atime_ns=now, mtime_ns=now, ctime_ns=now,
            chunk_size=d["chunk_size"], stripe_count=d["stripe_count"], redundancy=d["redundancy"],
            stripe_seed=d["stripe_seed"], snapshot=HOLDER_MARK,
        )
        self.store.insert_dentry(dir_ino, HOLDER, ino)
        self.store.touch_dir(dir_ino, now, 1)
        return ino

    def create(self, dir_ino: int, name: bytes) -> tuple[int, int, int]:
        """Snapshot the tree below ``dir_ino`` as ``dir_ino/.snapshots/name``: (id, its top inode,
        the ``.snapshots`` inode)."""
        self.ns.check_name(name)
        store = self.store
        check_writable(self.ns.live_directory(dir_ino))
        now = self.ns.clock()
        holder = self._holder(dir_ino, True, now)
        if store.get_dentry(holder, name) is not None:
            raise StripefsError(ErrorCode.EXISTS, f"snapshot {name!r} of directory {dir_ino} exists")
        tree = store.live_tree(dir_ino)
        inos = list(dict.fromkeys([dir_ino, *(ino for _, _, ino in tree)]))  # hard links once
        new = dict(zip(inos, store.reserve_inos(len(inos))))
        names: dict[int, int] = {}  # names of each inode inside the tree
        subdirs: dict[int, int] = {}
        rows = {r[0]: r for r in store.rows_in("inodes", "ino," + _INODE_COLUMNS, inos)}
        for parent, _, ino in tree:
            names[ino] = names.get(ino, 0) + 1
            if stat.S_ISDIR(rows[ino][1]):
                subdirs[parent] = subdirs.get(parent, 0) + 1
        snap_id = store.add_snapshot(dir_ino, name, new[dir_ino], now)

        def inode_row(r):
            ino = r[0]
            nlink = 2 + subdirs.get(ino, 0) if stat.S_ISDIR(r[1]) else names[ino]
            return (new[ino], *r[1:4], nlink, *r[5:], snap_id)

        store.insert_rows("inodes", "ino," + _INODE_COLUMNS + ",snapshot", (inode_row(rows[i]) for i in inos))
        store.insert_rows("dentries", "parent,name,ino", [(holder, name, new[dir_ino])] + [(new[p], n, new[i]) for p, n, i in tree])
        store.insert_rows("symlinks", "ino,target", ((new[r[0]], r[1]) for r in store.rows_in("symlinks", "ino,target", inos)))
        store.insert_rows("xattrs", "ino,name,value", ((new[r[0]], r[1], r[2]) for r in store.rows_in("xattrs", "ino,name,value", inos)))
        files = [i for i in inos if stat.S_ISREG(rows[i][1])]
        chunks = [
            (new[r[0]], r[1], r[2], r[3], r[4] or r[0], r[5])
            for r in store.rows_in("chunks", "ino,idx,version,nodes,data_ino,fversions", files)
            if r[2] > 0  # committed: a placement never written holds no bytes
        ]
        store.insert_rows("chunks", "ino,idx,version,nodes,data_ino,fversions", chunks)
        store.touch_dir(holder, now, 1)
        if self.count is not None:  # at once: the next commit under the lock must see the pins
            self.count += 1
        log.info("snapshot %d %r of directory %d: %d inode(s), %d chunk row(s) shared", snap_id, name, dir_ino, len(inos), len(chunks))
        return snap_id, new[dir_ino], holder

    def infos(self, dir_ino: int) -> list[SnapshotInfo]:
        self.ns.directory(dir_ino)
        return [
            SnapshotInfo(id=i, name=name, ino=root, created_ns=created)
            for i, _, name, root, created in self.store.snapshots_of(dir_ino)
        ]

    def delete(self, dir_ino: int, name: bytes) -> tuple[int, int, bool]:
        """Remove snapshot ``name`` of ``dir_ino``: (its top inode, the ``.snapshots`` inode, whether
        that went too). Its own copies become garbage; shared ones stay with the live file."""
        self.ns.check_name(name)
        store = self.store
        self.ns.directory(dir_ino)
        found = [s for s in store.snapshots_of(dir_ino) if s[2] == name]
        if not found:
            raise StripefsError(ErrorCode.NOT_FOUND, f"directory {dir_ino} has no snapshot {name!r}")
        snap_id, _, _, root, _ = found[0]
        now = self.ns.clock()
        holder = self._holder(dir_ino, False, now)
        own = store.snapshot_chunks(snap_id)
        store.add_garbage((node, ino, idx, 0, version) for ino, idx, version, nodes in own for node in decode_nodes(nodes) if node)
        store.add_garbage(self._extra_shared_copies(snap_id))
        store.delete_snapshot_inodes(snap_id)  # entries, xattrs, symlinks and chunk rows by cascade
        store.delete_snapshot(snap_id)  # the count is read again once this is durable (load): never low
        emptied = False
        if holder is not None:
            if store.has_children(holder):
                store.touch_dir(holder, now, -1)
            else:
                store.delete_inode(holder)
                store.touch_dir(dir_ino, now, -1)
                emptied = True
        log.info("snapshot %d %r of directory %d deleted: %d own chunk row(s) queued as garbage", snap_id, name, dir_ino, len(own))
        return root, holder or 0, emptied

    def _extra_shared_copies(self, snap_id: int) -> list[tuple[int, int, int, int, int]]:
        """Garbage rows for the shared copies of a snapshot's rows on nodes the live row does not
        name (a repair of the snapshot's row made them; with the live file gone, all of them):
        that slot only (``EXACT_PART``), bounded by the version. Another snapshot still naming one
        keeps it (``store.garbage_for_node``)."""
        rows = []
        for data_ino, idx, version, nodes, redundancy, live_nodes, fv in self.store.shared_rows(snap_id):
            ec = parse_redundancy(redundancy).is_ec
            keep = set(decode_nodes(live_nodes)) if live_nodes is not None else set()
            fv = decode_fversions(fv)
            rows += [
                (n, data_ino, idx, (fragment_part(j, fragment_version(version, fv, j)) if ec else replica_part(version)) | EXACT_PART,
                 version)
                for j, n in enumerate(decode_nodes(nodes)) if n and n not in keep
            ]
        return rows

    # -- pins -----------------------------------------------------------------------

    def guard(self, ino: int, moved: dict[int, int] | None = None, from_index: int | None = None) -> None:
        """Raise ``CopyOutNeeded`` if a snapshot reads copies of file ``ino`` that this operation
        would leave unprotected: rows at an index of ``moved`` (index -> the version the live row
        gets) at another version, or at an index from ``from_index`` (a truncate)."""
        if not self._any() or (not moved and from_index is None):
            return
        pins = self.store.pins(ino, from_index=from_index) if from_index is not None else []
        if moved:
            pins += [
                p for p in self.store.pins(ino, moved)
                if moved[p[1]] > p[2] and (from_index is None or p[1] < from_index)
            ]
        pins = [p for p in pins if p[3]]  # a cold row (no nodes): its object stays while a row names it
        if not pins:
            return
        row = self.ns.inode(ino)
        red = parse_redundancy(row["redundancy"])
        ec = red.is_ec
        found = []
        for s_ino, idx, version, nodes, fv in pins:
            nodes, fv = decode_nodes(nodes), decode_fversions(fv)
            parts = []
            for j, n in enumerate(nodes):
                if n:
                    v = fragment_version(version, fv, j) if ec else version
                    parts.append((n, fragment_part(j, v) if ec else replica_part(v), v))
            found.append(Pin(s_ino, idx, version, nodes, ino, parts, red.ec_k if ec else 1))
        raise CopyOutNeeded(found, row["chunk_size"])

    def copied(self, pins: Iterable[Pin], skipped: Iterable[tuple[int, int, int]] = ()) -> int:
        """Rows whose copies were copied out read their own now; how many (a row changed since is
        left). ``skipped``: (ino, idx, node) copies a node that was down could not make: that node
        leaves the row (a replica is dropped, a fragment is MISSING) and the healer makes it anew."""
        missed: dict[tuple[int, int], set[int]] = {}
        for ino, idx, node in skipped:
            missed.setdefault((ino, idx), set()).add(node)
        done = 0
        for p in pins:
            if not self.store.unpin(p.ino, p.idx, p.data_ino, p.version):
                continue
            done += 1
            gone = missed.get((p.ino, p.idx))
            if gone:
                nodes = [0 if n in gone else n for n in p.nodes] if self._is_ec(p.ino) else [n for n in p.nodes if n not in gone]
                self.store.set_chunk_nodes(p.ino, p.idx, nodes)
        return done

    def _is_ec(self, ino: int) -> bool:
        return parse_redundancy(self.ns.inode(ino)["redundancy"]).is_ec
