"""The trash: removed files and directories kept for ``trash_keep_s`` (docs/snapshots.md).

``Namespace.unlink`` (the last name of a file) and ``Namespace.rmdir`` call
``Trash.take`` instead of freeing the inode when the trash is on: the
directory entry goes as before, the inode stays with nlink 0 and a ``trash``
row (daemon/db.py) saying where it was and which quota roots it still counts
against. Nothing that reclaims nlink-0 inodes touches it (``store.orphans``,
``Namespace.reclaim_if_orphan``), so an inode in the trash keeps its
attributes, xattrs and chunks until ``purge`` (a command, or ``expire`` on the
duties leader) frees it as the unlink would have.

Why no hidden trash directory: an inode without a directory entry is invisible
to everything that walks the namespace (readdir, lookups, the change feed's
subtree filter, ``du``), so none of it needs to learn about the trash.

An ``rm -rf`` leaves one row per file naming its directory's inode, and one
per directory naming its parent: ``restore`` of the top directory brings the
tree back, depth first, with its inode numbers, attributes and data.

Runs inside the caller's operation (savepoint or transaction): no network, no
awaits. Subtree keys are checked by daemon/access.py with ``origin_inside``.
"""

from __future__ import annotations

import logging
import stat
from typing import NamedTuple

from ..common.errors import ErrorCode, StripefsError
from ..common.protocol import TrashEntry
from .db import ROOT_INO

log = logging.getLogger(__name__)

#: trash rows ``expire`` frees per call (the duties leader calls it again while there are more)
EXPIRE_BATCH = 1000
#: most rows one listing returns
LIST_MAX = 100_000


class Row(NamedTuple):
    ino: int
    parent: int
    name: bytes
    deleted_ns: int
    roots: list[int]
    mode: int = 0
    size: int = 0
    uid: int = 0


class Trash:
    """The trash of one Namespace (``ns.trash``). ``keep_ns`` 0: off (removals free at once)."""

    def __init__(self, ns, keep_ns: int = 0) -> None:
        self.ns = ns
        self.store = ns.store
        self.keep_ns = keep_ns

    # -- taking (called by Namespace.unlink and rmdir, after the entry is gone) --

    def take(self, parent: int, name: bytes, row, now: int) -> None:
        """Keep inode ``row``, whose last name ``name`` in ``parent`` was just removed.

        Its quota charge stays on the roots it was under (recorded for the purge)."""
        ino = row["ino"]
        roots = self.ns.quotas.roots_of_dir(parent)
        self.ns.quotas.forget(ino)  # a directory's cached roots: it has no parent any more
        self.store.update_inode(ino, nlink=0, ctime_ns=now)
        self.store.put_trash(ino, parent, name, now, roots)
        log.debug("inode %d (%r in %d) moved to the trash", ino, name, parent)

    def take_many(self, taken: list[tuple]) -> None:
        """``take`` of each (parent, name, row, now), the entries (``row["cookie"]``) deleted too:
        a run of unlinks' writes at once (daemon/namespace_bulk.py ``unlink_many``), a statement
        per table for all of them instead of three per file."""
        if not taken:
            return
        self.store.delete_dentries([row["cookie"] for _, _, row, _ in taken])
        out = []
        for parent, name, row, now in taken:
            roots = self.ns.quotas.roots_of_dir(parent)
            self.ns.quotas.forget(row["ino"])
            out.append((row["ino"], parent, name, now, roots))
        self.store.trash_many(out)
        log.debug("%d inode(s) moved to the trash at once", len(out))

    def holds(self, ino: int) -> bool:
        return self.store.get_trash(ino) is not None

    def row(self, ino: int) -> Row:
        found = self.store.get_trash(ino)
        if found is None:
            raise StripefsError(ErrorCode.NOT_FOUND, f"{ino} is not in the trash (see stripefs trash list)")
        inode = self.ns.inode(ino)
        return Row(*found, mode=inode["mode"], size=inode["size"], uid=inode["uid"])

    # -- looking -----------------------------------------------------------------

    def rows(self, limit: int = LIST_MAX) -> list[Row]:
        return [Row(*r) for r in self.store.trash_rows(limit=limit)]

    def origin(self, ino: int) -> tuple[int | None, list[bytes]]:
        """The live directory a trashed inode's old path starts from (None: gone) and the names
        below it, following parents that are in the trash themselves."""
        names: list[bytes] = []
        cur = ino
        for _ in range(100_000):
            found = self.store.get_trash(cur)
            if found is None:
                break
            names.append(found[2])
            cur = found[1]
        else:
            return None, names[::-1]
        row = self.store.get_inode(cur)
        if row is None or not stat.S_ISDIR(row["mode"]) or row["nlink"] == 0:
            return None, names[::-1]
        return cur, names[::-1]

    def origin_inside(self, top: int, ino: int) -> bool:
        """Whether trashed ``ino`` was removed inside directory ``top`` (a subtree key's root)."""
        start, _ = self.origin(ino)
        if start is None:
            return False
        return start == top or (start != ROOT_INO and self.ns.is_ancestor(top, start))

    def path_of(self, ino: int) -> bytes:
        """Where a trashed inode was, as the namespace stands now ("?DIR/..." when its start is gone)."""
        start, names = self.origin(ino)
        if start is None:
            return b"?/" + b"/".join(names)
        return self.ns.path_of(start).rstrip(b"/") + b"/" + b"/".join(names)

    def entry(self, r: Row, path: bytes) -> TrashEntry:
        expires = r.deleted_ns + self.keep_ns if self.keep_ns else 0
        return TrashEntry(ino=r.ino, path=path, deleted_ns=r.deleted_ns, expires_ns=expires, mode=r.mode, size=r.size, uid=r.uid)

    # -- restoring ------------------------------------------------------------------

    def restore(self, ino: int, new_parent: int | None = None, new_name: bytes | None = None) -> tuple[list[tuple[int, int, bytes]], list[str]]:
        """Put ``ino`` back (under its old name, or ``new_name`` in ``new_parent``) and, for a
        directory, what was trashed out of it, depth first. Returns ((ino, parent, name) of each
        restored inode, why each left behind was left)."""
        r = self.row(ino)
        parent = r.parent if new_parent is None else new_parent
        name = r.name if not new_name else new_name
        self._put_back(r, parent, name)
        restored, left = [(ino, parent, name)], []
        todo = [ino] if stat.S_ISDIR(r.mode) else []
        while todo:
            d = todo.pop()
            for child in self.store.trash_rows(parent=d):
                c = Row(*child)
                try:
                    self._put_back(c, d, c.name)
                except StripefsError as exc:
                    left.append(f"{c.ino}: {exc.message}")
                    continue
                restored.append((c.ino, d, c.name))
                if stat.S_ISDIR(c.mode):
                    todo.append(c.ino)
        log.info("trash: restored %d inode(s) from %d (%d left)", len(restored), ino, len(left))
        return restored, left

    def _put_back(self, r: Row, parent: int, name: bytes) -> None:
        self.ns.check_name(name)
        prow = self.store.get_inode(parent)
        if prow is None or not stat.S_ISDIR(prow["mode"]) or prow["nlink"] == 0:
            raise StripefsError(
                ErrorCode.NOT_FOUND,
                f"directory {parent} is gone or in the trash: restore it first, or give a new place (trash restore {r.ino} NEWPATH)",
            )
        if self.store.get_dentry(parent, name) is not None:
            raise StripefsError(ErrorCode.EXISTS, f"{name!r} exists in directory {parent}: give a new name (trash restore {r.ino} NEWPATH)")
        self.ns.quotas.recharge(r.roots, self.ns.quotas.roots_of_dir(parent), 0 if stat.S_ISDIR(r.mode) else r.size)
        now = self.ns.clock()
        is_dir = stat.S_ISDIR(r.mode)
        self.store.delete_trash(r.ino)
        self.store.insert_dentry(parent, name, r.ino)
        self.store.update_inode(r.ino, nlink=2 if is_dir else 1, ctime_ns=now)
        self.store.touch_dir(parent, now, 1 if is_dir else 0)  # as any new entry does to its directory

    # -- freeing ----------------------------------------------------------------------

    def purge(self, ino: int) -> None:
        """Free trashed ``ino`` now, as its unlink would have without the trash."""
        r = self.row(ino)
        self.store.delete_trash(ino)
        self.ns.quotas.uncharge(r.roots, 0 if stat.S_ISDIR(r.mode) else r.size)
        if stat.S_ISDIR(r.mode):
            for child in self.store.dentries_in(ino):  # made through a handle after the rmdir: freed with it
                self._free_entry(ino, child)
            self.store.delete_inode(ino)
        elif not self.ns.is_open(ino):
            self.ns.reclaim(ino)
        # else: an ordinary orphan now, freed when its last opener lets go

    def _free_entry(self, parent: int, entry) -> None:
        cookie, ino = entry
        self.store.delete_dentry(cookie)
        row = self.store.get_inode(ino)
        if row is None:
            return
        if stat.S_ISDIR(row["mode"]):
            for child in self.store.dentries_in(ino):
                self._free_entry(ino, child)
            self.store.delete_inode(ino)
            return
        self.store.add_nlink(ino, -1, self.ns.clock())
        if row["nlink"] <= 1 and not self.ns.is_open(ino):
            self.ns.reclaim(ino)

    def _expired_before(self, now: int) -> int:
        return now - self.keep_ns if self.keep_ns else now + 1

    def due(self, now: int) -> bool:
        """Whether anything in the trash has expired (the collector's check each round)."""
        return bool(self.store.trash_rows(before_ns=self._expired_before(now), limit=1))

    def expire(self, now: int, limit: int = EXPIRE_BATCH) -> int:
        """Free what has been in the trash longer than ``keep_ns`` (all of it when the trash is off)."""
        rows = self.store.trash_rows(before_ns=self._expired_before(now), limit=limit)
        for r in rows:
            if self.store.get_trash(r[0]) is not None:  # not freed with a directory above it
                self.purge(r[0])
        if rows:
            log.info("trash: %d expired inode(s) freed", len(rows))
        return len(rows)
