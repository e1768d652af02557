"""The namespace: POSIX semantics over the store. No network code, no awaits.

Every public method is one metadata operation. It validates, reads and writes
through ``SqliteStore`` (daemon/store.py, the only place with SQL) and raises
``StripefsError`` with the code rename(2), unlink(2) & co. would turn into an
errno. A method that raises may have written part of its change: the caller
runs each operation inside ``store.savepoint()`` so a failure is undone as a
whole (daemon/service.py does; the unit tests do the same).

Semantics worth knowing
-----------------------
* Names: empty, ``.``, ``..``, or containing ``/`` or NUL -> INVALID;
  longer than 255 bytes -> NAME_TOO_LONG. Readdir lists neither ``.`` nor
  ``..`` (the client adds them).
* Times are ``time.time_ns()``. Entry changes update the parent's mtime and
  ctime; any attribute change updates ctime. atime is never updated by reads
  (noatime).
* Directories: nlink = 2 + subdirectories. Hard links to directories ->
  PERMISSION (EPERM, as link(2)).
* Unlink of the last name: the inode is reclaimed at once (its chunks queued
  as garbage) unless a session has it open (``is_open``); then it stays as an
  *orphan* (nlink 0) and ``reclaim_if_orphan`` frees it when the last session
  lets go. ``reclaim_orphans`` sweeps them all (daemon start, after a lease).
* Snapshots (daemon/snapshots.py, ``self.snapshots``): every change of an
  inode with ``snapshot`` != 0 (a snapshot's, or a ``.snapshots`` directory)
  is READ_ONLY (``check_writable`` on the row the operation reads anyway).
* The trash (daemon/trash.py, ``self.trash``): when on, the unlink of a last
  name and every rmdir keep the inode (nlink 0, a trash row) instead; the
  sweeps above leave it. A removed directory takes no new entries (NOT_FOUND).
* Rename follows rename(2)/renameat2(2): a file replaces a file, a directory
  replaces an empty directory; flags RENAME_NOREPLACE (EXISTS if the target
  exists) and RENAME_EXCHANGE (both must exist). Moving a directory into its
  own subtree -> INVALID. Renaming onto another name of the same inode does
  nothing.
* Layout: a directory's layout is what new entries inherit; a file's is fixed.
* Quotas: operations that add, remove, move or resize inodes call the hooks
  of ``self.quotas`` (daemon/quota.py) inside their savepoint; EDQUOT
  (QUOTA_EXCEEDED) and EXDEV across quota trees are decided there.
* A file's data (chunk maps, epochs, placement, commits, conversions) is
  daemon/file_data.py, the half of ``Namespace`` it inherits.
"""

from __future__ import annotations

import logging
import random
import stat
import time
from typing import Callable, Sequence

import msgspec

from ..common.errors import ErrorCode, StripefsError
from ..common.layout import chunk_count, parse_redundancy, validate_layout
from ..common.protocol import NAME_MAX, PATH_MAX, Attr, ChunkRef, DirEntry, Layout, NodeAddr
from . import redundancy as _redundancy
from .db import ROOT_INO
from .file_data import FileData, NodeSource
from .quota import Quotas
from .snapshots import Snapshots, check_writable
from .store import SqliteStore, decode_fversions, decode_nodes
from .trash import Trash

log = logging.getLogger(__name__)

XATTR_NAME_MAX = 255
XATTR_VALUE_MAX = 64 * 1024
XATTR_CREATE, XATTR_REPLACE = 1, 2
RENAME_NOREPLACE, RENAME_EXCHANGE = 1, 2
READDIR_MAX = 10_000


def check_name(name: bytes) -> None:
    if not name or name in (b".", b"..") or b"/" in name or b"\0" in name:
        raise StripefsError(ErrorCode.INVALID, f"invalid name {name!r}")
    if len(name) > NAME_MAX:
        raise StripefsError(ErrorCode.NAME_TOO_LONG, f"name of {len(name)} bytes is longer than {NAME_MAX}")


def to_attr(row) -> Attr:
    return Attr(
        ino=row["ino"],
        mode=row["mode"],
        nlink=row["nlink"],
        uid=row["uid"],
        gid=row["gid"],
        rdev=row["rdev"],
        size=row["size"],
        atime_ns=row["atime_ns"],
        mtime_ns=row["mtime_ns"],
        ctime_ns=row["ctime_ns"],
        generation=row["generation"],
    )


def to_layout(row) -> Layout:
    return Layout(chunk_size=row["chunk_size"], stripe_count=row["stripe_count"], redundancy=row["redundancy"])


class Namespace(FileData):
    """Metadata operations of one filesystem, over one store (a file's data: daemon/file_data.py)."""

    check_name = staticmethod(check_name)  # for daemon/trash.py, which this module imports

    def __init__(
        self,
        store: SqliteStore,
        nodes: NodeSource,
        is_open: Callable[[int], bool] = lambda ino: False,
        clock: Callable[[], int] = time.time_ns,
    ):
        self.store = store
        self.nodes = nodes
        self.is_open = is_open
        self.unlinked: list[int] = []  # inodes that lost a name in the current operation (unlink, rename over)
        self.clock = clock
        self.quotas = Quotas(store)  # directory quotas: hooks below, design in daemon/quota.py
        self.trash = Trash(self)  # off until the service sets keep_ns (trash_keep_s)
        self.snapshots = Snapshots(self)  # directory snapshots (daemon/snapshots.py)
        super().__init__(store)  # epochs (daemon/file_data.py)

    # -- rows by inode (also for daemon/quota_service.py) ---------------------

    def inode(self, ino: int):
        """The inode's row; NOT_FOUND when there is none."""
        row = self.store.get_inode(ino)
        if row is None:
            raise StripefsError(ErrorCode.NOT_FOUND, f"inode {ino} does not exist")
        return row

    def directory(self, ino: int):
        """The row of a directory; NOT_FOUND, or NOT_DIR for anything else."""
        row = self.inode(ino)
        if not stat.S_ISDIR(row["mode"]):
            raise StripefsError(ErrorCode.NOT_DIR, f"inode {ino} is not a directory")
        return row

    def live_directory(self, ino: int):
        """The row of a directory that may take new entries: NOT_FOUND once removed (in the trash),
        READ_ONLY in a snapshot."""
        row = self.directory(ino)
        if row["nlink"] == 0:
            raise StripefsError(ErrorCode.NOT_FOUND, f"directory {ino} has been removed")
        check_writable(row)
        return row

    def path_of(self, ino: int) -> bytes:
        """The path of a directory (or a file's first name), for display; ``<unlinked N>`` when it has none
        (quotas, tier policies and the trash show paths with it)."""
        parts = []
        while ino != ROOT_INO:
            names = self.store.dentries_of(ino)
            if not names:
                return b"<unlinked %d>" % ino
            _, ino, name = names[0]
            parts.append(name)
            if len(parts) > 4096:
                break
        return b"/" + b"/".join(reversed(parts))

    def regular_file(self, ino: int):
        """The row of a regular file; NOT_FOUND, IS_DIR, or INVALID for anything else."""
        row = self.inode(ino)
        if stat.S_ISDIR(row["mode"]):
            raise StripefsError(ErrorCode.IS_DIR, f"inode {ino} is a directory")
        if not stat.S_ISREG(row["mode"]):
            raise StripefsError(ErrorCode.INVALID, f"inode {ino} is not a regular file")
        return row

    def _entry(self, parent: int, name: bytes):
        check_name(name)
        self.directory(parent)
        entry = self.store.get_dentry(parent, name)
        if entry is None:
            raise StripefsError(ErrorCode.NOT_FOUND, f"no entry {name!r} in directory {parent}")
        return entry

    def _entry_row(self, parent: int, name: bytes):
        """The inode row of ``name`` in ``parent`` with its entry's ``cookie``: one query when it
        exists; the precise error (NOT_DIR, NOT_FOUND of the parent or the name) when not."""
        check_name(name)
        row = self.store.entry_inode(parent, name)
        if row is None:
            self._entry(parent, name)
            raise StripefsError(ErrorCode.NOT_FOUND, f"no entry {name!r} in directory {parent}")  # a dentry without its inode
        return row

    def _touch_dir(self, ino: int, now: int, nlink: int = 0) -> None:
        self.store.touch_dir(ino, now, nlink)

    def _new_inode(self, parent_row, mode: int, uid: int, gid: int, *, nlink: int = 1, rdev: int = 0, now: int, ino: int = 0) -> dict:
        """Insert an inode; its row as written (a dict of the ``inodes`` columns: no read back).
        ``ino``: its number, delegated to the creating session (checked by the caller), else the next."""
        fields = self.new_inode_row(parent_row, mode, uid, gid, nlink=nlink, rdev=rdev, now=now)
        if ino:
            if self.store.get_inode(ino) is not None:  # (SQLite's own error would be a constraint, not EXISTS)
                raise StripefsError(ErrorCode.EXISTS, f"inode {ino} exists already")
            fields["ino"] = ino
        fields["ino"] = self.store.insert_inode(**fields)
        return fields

    @staticmethod
    def new_inode_row(parent_row, mode: int, uid: int, gid: int, *, nlink: int = 1, rdev: int = 0, now: int) -> dict:
        """The columns of a new inode in directory ``parent_row`` (its layout, a fresh stripe seed), without ``ino``."""
        return dict(
            mode=mode,
            uid=uid,
            gid=gid,
            nlink=nlink,
            rdev=rdev,
            size=0,
            atime_ns=now,
            mtime_ns=now,
            ctime_ns=now,
            generation=0,
            chunk_size=parent_row["chunk_size"],
            stripe_count=parent_row["stripe_count"],
            redundancy=parent_row["redundancy"],
            stripe_seed=random.getrandbits(31),
        )

    def _add_entry(self, parent: int, name: bytes, mode: int, uid: int, gid: int, rdev: int = 0, *, parent_row=None, ino: int = 0) -> dict:
        """A new inode named ``name`` in ``parent``; its row as written (``_new_inode``).
        ``parent_row``: the caller has read the directory (``live_directory``) and checked the name.

        Without quotas, no lookup of the name first: the entry's UNIQUE constraint answers
        EXISTS, and the caller's savepoint undoes the inode inserted before it. Under a quota
        the lookup comes first, so an existing name is EXISTS, never QUOTA_EXCEEDED."""
        if parent_row is None:
            check_name(name)
            parent_row = self.live_directory(parent)
        if self.quotas.roots and self.store.get_dentry(parent, name) is not None:
            raise StripefsError(ErrorCode.EXISTS, f"{name!r} exists in directory {parent}")
        self.quotas.created(parent)
        now = self.clock()
        is_dir = stat.S_ISDIR(mode)
        row = self._new_inode(parent_row, mode, uid, gid, nlink=2 if is_dir else 1, rdev=rdev, now=now, ino=ino)
        if self.store.insert_new_dentry(parent, name, row["ino"]) is None:
            raise StripefsError(ErrorCode.EXISTS, f"{name!r} exists in directory {parent}")
        self._touch_dir(parent, now, 1 if is_dir else 0)
        log.debug("new inode %d %r in %d, mode %o", row["ino"], name, parent, mode)
        return row

    def _drop_link(self, ino: int, now: int, nlink: int) -> None:
        """One name of a non-directory (``nlink`` names before) is gone: reclaim it, or keep it as an orphan while open."""
        self.unlinked.append(ino)  # its attributes changed (nlink): the change names it (daemon/callbacks.py)
        if nlink - 1 <= 0 and not self.is_open(ino):
            self.reclaim(ino)  # its row goes: no nlink to write first
            return
        self.store.add_nlink(ino, -1, now)
        if nlink - 1 <= 0:
            log.debug("inode %d unlinked while open: kept as an orphan", ino)

    def reclaim(self, ino: int) -> None:
        """Free an inode no name leads to and no session holds: its chunks are queued as garbage."""
        dropped = self.store.drop_chunks(ino, 0)
        self.store.delete_inode(ino)
        log.debug("inode %d reclaimed, %d chunk(s) queued for deletion", ino, dropped)

    # -- lookups -------------------------------------------------------------

    def lookup(self, parent: int, name: bytes) -> Attr:
        return to_attr(self.lookup_row(parent, name))

    def lookup_row(self, parent: int, name: bytes):
        """The inode row of ``name`` in ``parent``: one query when it exists; the precise error when not."""
        check_name(name)
        row = self.store.lookup_inode(parent, name)
        if row is None:
            self._entry(parent, name)  # NOT_DIR, or NOT_FOUND for the parent or the name
            raise StripefsError(ErrorCode.NOT_FOUND, f"no entry {name!r} in directory {parent}")  # a dentry without its inode
        return row

    def getattr(self, ino: int) -> Attr:
        return to_attr(self.inode(ino))

    attr_of = staticmethod(to_attr)  # (an inode row read already: daemon/file_data.py's commit)

    def readlink(self, ino: int) -> bytes:
        row = self.inode(ino)
        target = self.store.get_symlink(ino)
        if not stat.S_ISLNK(row["mode"]) or target is None:
            raise StripefsError(ErrorCode.INVALID, f"inode {ino} is not a symlink")
        return target

    def readdir(self, ino: int, after: int = 0, limit: int = 1000) -> tuple[list[DirEntry], bool]:
        """Up to ``limit`` entries with cookie > ``after``, and whether more follow."""
        rows, more = self._listed(ino, after, limit)
        return [DirEntry(name=bytes(r["name"]), attr=to_attr(r), cookie=r["cookie"]) for r in rows], more

    def _listed(self, ino: int, after: int, limit: int) -> tuple[list, bool]:
        """The rows (dentry and inode) of up to ``limit`` entries of directory ``ino`` after cookie
        ``after`` (at most READDIR_MAX), and whether more follow."""
        self.directory(ino)
        limit = max(1, min(limit, READDIR_MAX))
        rows = self.store.list_dentries(ino, after, limit + 1)
        return rows[:limit], len(rows) > limit

    def readdir_open_info(self, ino: int, after: int, limit: int, wanted) -> tuple[list[DirEntry], bool, list[tuple]]:
        """``readdir`` with ``open_info`` of each listed regular file whose ``wanted(attr, layout)``
        accepts: the inode rows come with the listing and every file's chunks in one statement.

        A dataset mount's cold index walk asks this for every directory (issue 30: 16 us of daemon
        CPU per entry), so the page is built from positions, not names (``list_dentries_open``),
        and what files of a data set share is made once per page, not once per file: a Layout per
        distinct layout, a chunk's node list and its NodeAddrs per distinct stored node list (the
        files of one placement share them: the reply is encoded, never changed). A file of one
        chunk, a data set's sample, takes its NodeAddrs as they are."""
        self.directory(ino)
        limit = max(1, min(limit, READDIR_MAX))
        rows = self.store.list_dentries_open(ino, after, limit + 1)
        more = len(rows) > limit
        entries, regular, layouts = [], [], {}
        for r in rows[:limit]:
            attr = Attr(*r[2:13])
            entries.append(DirEntry(name=bytes(r[1]), attr=attr, cookie=r[0]))
            if stat.S_ISREG(attr.mode):
                key = (r[13], r[14], r[15])
                layout = layouts.get(key)
                if layout is None:
                    layout = layouts[key] = Layout(chunk_size=key[0], stripe_count=key[1], redundancy=key[2])
                if wanted(attr, layout):
                    regular.append((attr, layout, r[16]))
        if not regular:
            return entries, more, []
        placed: dict = {}  # stored node list -> (its node ids, their NodeAddrs)
        addrs: dict[int, NodeAddr] = {}
        refs_of: dict[int, list[ChunkRef]] = {}
        lists_of: dict[int, list] = {}  # ino -> the stored node lists of its chunks
        for file_ino, idx, version, text, fv in self.store.chunk_maps_of([a.ino for a, _, _ in regular]):
            known = placed.get(text)
            if known is None:
                nodes = decode_nodes(text)
                ids = sorted(set(nodes) - {_redundancy.MISSING})
                known = placed[text] = (nodes, [addrs.get(i) or addrs.setdefault(i, NodeAddr(node_id=i, address=self.nodes.address(i))) for i in ids])
            ref = ChunkRef(index=idx, version=version, nodes=known[0], fversions=decode_fversions(fv) if fv else [])
            if file_ino in refs_of:
                refs_of[file_ino].append(ref)
                lists_of[file_ino].append(known)
            else:
                refs_of[file_ino], lists_of[file_ino] = [ref], [known]
        files = []
        for attr, layout, snapshot in regular:
            refs = refs_of.get(attr.ino, [])
            known = lists_of.get(attr.ino, ())
            if len(known) == 1:
                nodes = known[0][1]
            else:  # no chunk, or several: their nodes' union, ordered by id (``_chunk_map``)
                ids = sorted({a.node_id for k in known for a in k[1]})
                nodes = [addrs[i] for i in ids]
            if snapshot > 0 and refs:
                refs = self._snapshot_refs(attr.ino, refs)
            files.append((attr, layout, refs, nodes))
        return entries, more, files

    # -- creating ------------------------------------------------------------

    def mknod(self, parent: int, name: bytes, mode: int, rdev: int, uid: int, gid: int) -> Attr:
        fmt = stat.S_IFMT(mode) or stat.S_IFREG
        if fmt not in (stat.S_IFREG, stat.S_IFIFO, stat.S_IFSOCK, stat.S_IFCHR, stat.S_IFBLK):
            raise StripefsError(ErrorCode.INVALID, f"mknod cannot create mode {mode:o}")
        rdev = rdev if fmt in (stat.S_IFCHR, stat.S_IFBLK) else 0
        return to_attr(self._add_entry(parent, name, fmt | (mode & 0o7777), uid, gid, rdev))

    def mkdir(self, parent: int, name: bytes, mode: int, uid: int, gid: int, ino: int = 0) -> Attr:
        return to_attr(self._add_entry(parent, name, stat.S_IFDIR | (mode & 0o7777), uid, gid, ino=ino))

    def symlink(self, parent: int, name: bytes, target: bytes, uid: int, gid: int) -> Attr:
        if not target or b"\0" in target:
            raise StripefsError(ErrorCode.INVALID, "a symlink target is 1 or more bytes without NUL")
        if len(target) >= PATH_MAX:  # PATH_MAX counts the NUL: as symlink(2), ENAMETOOLONG
            raise StripefsError(ErrorCode.NAME_TOO_LONG, f"symlink target of {len(target)} bytes is longer than {PATH_MAX - 1}")
        ino = self._add_entry(parent, name, stat.S_IFLNK | 0o777, uid, gid)["ino"]
        self.store.insert_symlink(ino, target)
        self.quotas.resized(ino, 0, len(target))
        self.store.update_inode(ino, size=len(target))
        return self.getattr(ino)

    def create(self, parent: int, name: bytes, mode: int, uid: int, gid: int, exclusive: bool = True) -> tuple[int, bool]:
        """Create a regular file (or open the existing one when not exclusive); (ino, created)."""
        info, created = self.create_open(parent, name, mode, uid, gid, exclusive)
        return info[0].ino, created

    def create_open(
        self, parent: int, name: bytes, mode: int, uid: int, gid: int, exclusive: bool = True, ino: int = 0
    ) -> tuple[tuple[Attr, Layout, list[ChunkRef], list[NodeAddr]], bool]:
        """``create``, with the file's ``open_info``: a new file's from the rows just written
        (nothing read back: the hot path of a burst of creates), an existing one's read."""
        check_name(name)
        parent_row = self.live_directory(parent)
        entry = None if exclusive else self.store.get_dentry(parent, name)  # exclusive: _add_entry answers EXISTS
        if entry is not None:
            row = self.inode(entry["ino"])
            if stat.S_ISDIR(row["mode"]):
                raise StripefsError(ErrorCode.IS_DIR, f"{name!r} in directory {parent} is a directory")
            return self.open_info_of(row), False
        row = self._add_entry(parent, name, stat.S_IFREG | (mode & 0o7777), uid, gid, parent_row=parent_row, ino=ino)
        try:
            refs, addrs = self.place_new(row, [0])
        except StripefsError as exc:
            if exc.code != ErrorCode.UNAVAILABLE:
                raise
            log.debug("inode %d created without a placement for chunk 0: %s", row["ino"], exc.message)
            refs, addrs = [], []
        return (to_attr(row), to_layout(row), refs, addrs), True

    def link(self, ino: int, new_parent: int, new_name: bytes) -> Attr:
        row = self.inode(ino)
        check_writable(row)
        if stat.S_ISDIR(row["mode"]):
            raise StripefsError(ErrorCode.PERMISSION, f"inode {ino} is a directory: no hard links")
        if row["nlink"] <= 0:
            raise StripefsError(ErrorCode.NOT_FOUND, f"inode {ino} has been unlinked")
        check_name(new_name)
        self.live_directory(new_parent)
        if self.store.get_dentry(new_parent, new_name) is not None:
            raise StripefsError(ErrorCode.EXISTS, f"{new_name!r} exists in directory {new_parent}")
        self.quotas.linking(ino, new_parent)
        now = self.clock()
        self.store.insert_dentry(new_parent, new_name, ino)
        self.store.add_nlink(ino, 1, now)
        self._touch_dir(new_parent, now)
        return self.getattr(ino)

    # -- removing ------------------------------------------------------------

    def take_unlinked(self) -> list[int]:
        """The inodes the operation just run took a name from (for its change log row)."""
        unlinked, self.unlinked = self.unlinked, []
        return unlinked

    def unlink(self, parent: int, name: bytes) -> None:
        self.unlinked = []
        row = self.unlink_checked(parent, name)
        now = self.clock()
        self.unlink_row(parent, name, row, now)
        self._touch_dir(parent, now)

    def unlink_checked(self, parent: int, name: bytes, row=None):
        """``unlink``'s checks, nothing written: the entry's row, or the StripefsError it fails with.
        ``row``: the entry's row read already (``entry_inode``'s, daemon/namespace_bulk.py)."""
        if row is None:
            row = self._entry_row(parent, name)
        else:
            check_name(name)
        check_writable(row)
        if stat.S_ISDIR(row["mode"]):
            raise StripefsError(ErrorCode.IS_DIR, f"{name!r} in directory {parent} is a directory")
        return row

    def unlink_row(self, parent: int, name: bytes, row, now: int) -> None:
        """``unlink``'s writes, but the directory's times (the caller changes them: once for a run of
        unlinks, daemon/namespace_bulk.py ``unlink_many``); the inodes it took a name from in ``unlinked``."""
        if row["nlink"] <= 1 and self.trash.keep_ns:
            self.store.delete_dentry(row["cookie"])
            self.unlinked.append(row["ino"])  # nlink changed, as in _drop_link
            self.trash.take(parent, name, row, now)
            return
        if row["nlink"] <= 1:
            self.quotas.removed(parent, row)
        self.store.delete_dentry(row["cookie"])
        self._drop_link(row["ino"], now, row["nlink"])

    def rmdir(self, parent: int, name: bytes) -> None:
        row = entry = self._entry_row(parent, name)
        check_writable(row)  # a snapshot, or .snapshots while it holds any (snapshot delete removes them)
        ino = entry["ino"]
        if not stat.S_ISDIR(row["mode"]):
            raise StripefsError(ErrorCode.NOT_DIR, f"{name!r} in directory {parent} is not a directory")
        if self.store.has_children(ino):
            raise StripefsError(ErrorCode.NOT_EMPTY, f"directory {ino} ({name!r}) is not empty")
        now = self.clock()
        if self.trash.keep_ns:
            self.store.delete_dentry(entry["cookie"])
            self.trash.take(parent, name, row, now)
        else:
            self.quotas.removed(parent, row)
            self.store.delete_dentry(entry["cookie"])
            self.store.delete_inode(ino)
        self._touch_dir(parent, now, -1)

    def is_ancestor(self, ancestor: int, ino: int) -> bool:
        """Whether directory ``ancestor`` is ``ino`` or one of its ancestors (also daemon/access.py's subtree checks)."""
        seen = 0
        while ino is not None and ino != ROOT_INO:
            if ino == ancestor:
                return True
            ino = self.store.parent_of(ino)
            seen += 1
            if seen > 100_000:
                raise StripefsError(ErrorCode.INTERNAL, "directory tree loop while walking up")
        return ancestor == ROOT_INO

    def rename(self, parent_old: int, name_old: bytes, parent_new: int, name_new: bytes, flags: int = 0) -> None:
        self.unlinked = []
        if flags not in (0, RENAME_NOREPLACE, RENAME_EXCHANGE):
            raise StripefsError(ErrorCode.INVALID, f"rename flags {flags} are not supported")
        src = self._entry(parent_old, name_old)
        check_name(name_new)
        self.live_directory(parent_new)
        dst = self.store.get_dentry(parent_new, name_new)
        src_row = self.inode(src["ino"])
        check_writable(src_row)
        src_dir = stat.S_ISDIR(src_row["mode"])
        if flags == RENAME_EXCHANGE and dst is None:
            raise StripefsError(ErrorCode.NOT_FOUND, f"no entry {name_new!r} in directory {parent_new} to exchange with")
        if dst is not None and flags == RENAME_NOREPLACE:
            raise StripefsError(ErrorCode.EXISTS, f"{name_new!r} exists in directory {parent_new}")
        if dst is not None and dst["ino"] == src["ino"]:
            return  # the same inode under both names: rename(2) does nothing
        if src_dir and self.is_ancestor(src["ino"], parent_new):
            raise StripefsError(ErrorCode.INVALID, f"cannot move directory {src['ino']} into its own subtree")
        now = self.clock()
        if flags == RENAME_EXCHANGE:
            dst_row = self.inode(dst["ino"])
            check_writable(dst_row)
            dst_dir = stat.S_ISDIR(dst_row["mode"])
            if dst_dir and self.is_ancestor(dst["ino"], parent_old):
                raise StripefsError(ErrorCode.INVALID, f"cannot move directory {dst['ino']} into its own subtree")
            self.quotas.moving(src_row, parent_old, parent_new, exchange=True)
            self.store.set_dentry_ino(src["cookie"], dst["ino"])
            self.store.set_dentry_ino(dst["cookie"], src["ino"])
            if parent_old != parent_new and src_dir != dst_dir:
                delta = 1 if src_dir else -1
                self.store.add_nlink(parent_new, delta, now)
                self.store.add_nlink(parent_old, -delta, now)
            self.store.update_inode(src["ino"], ctime_ns=now)
            self.store.update_inode(dst["ino"], ctime_ns=now)
        else:
            if dst is not None:
                dst_row = self.inode(dst["ino"])
                check_writable(dst_row)
                dst_dir = stat.S_ISDIR(dst_row["mode"])
                if src_dir and not dst_dir:
                    raise StripefsError(ErrorCode.NOT_DIR, f"{name_new!r} in directory {parent_new} is not a directory")
                if dst_dir and not src_dir:
                    raise StripefsError(ErrorCode.IS_DIR, f"{name_new!r} in directory {parent_new} is a directory")
                if dst_dir and self.store.has_children(dst["ino"]):
                    raise StripefsError(ErrorCode.NOT_EMPTY, f"directory {dst['ino']} ({name_new!r}) is not empty")
                if dst_dir or dst_row["nlink"] <= 1:
                    self.quotas.removed(parent_new, dst_row)
                self.store.delete_dentry(dst["cookie"])
                if dst_dir:
                    self.store.delete_inode(dst["ino"])
                    self.store.add_nlink(parent_new, -1, now)
                else:
                    self._drop_link(dst["ino"], now, dst_row["nlink"])
            self.quotas.moving(src_row, parent_old, parent_new)
            self.store.move_dentry(src["cookie"], parent_new, name_new)
            if src_dir and parent_old != parent_new:
                self.store.add_nlink(parent_old, -1, now)
                self.store.add_nlink(parent_new, 1, now)
            self.store.update_inode(src["ino"], ctime_ns=now)
        self._touch_dir(parent_old, now)
        if parent_new != parent_old:
            self._touch_dir(parent_new, now)

    # -- orphans ---------------------------------------------------------------

    def reclaim_if_orphan(self, ino: int) -> bool:
        """Free ``ino`` if it has no name and no session has it open."""
        row = self.store.get_inode(ino)
        if row is None or row["nlink"] > 0 or self.is_open(ino) or self.trash.holds(ino):
            return False
        self.reclaim(ino)
        log.info("orphan inode %d reclaimed: its last opener let go", ino)
        return True

    def reclaim_orphans(self) -> int:
        """Free every orphan nobody has open; the number freed."""
        freed = 0
        for ino in self.store.orphans():
            if not self.is_open(ino):
                self.reclaim(ino)
                freed += 1
        if freed:
            log.info("%d orphan inode(s) reclaimed", freed)
        return freed

    # -- attributes ------------------------------------------------------------

    def setattr(
        self,
        ino: int,
        *,
        mode: int | None = None,
        uid: int | None = None,
        gid: int | None = None,
        size: int | None = None,
        atime_ns: int | None = None,
        mtime_ns: int | None = None,
        ctime_ns: int | None = None,
        chunks: Sequence[ChunkRef] = (),
    ) -> Attr:
        row = self.inode(ino)
        check_writable(row)
        now = self.clock()
        changes: dict[str, int] = {}
        if mode is not None:
            changes["mode"] = stat.S_IFMT(row["mode"]) | (mode & 0o7777)
        if uid is not None:
            changes["uid"] = uid
        if gid is not None:
            changes["gid"] = gid
        if atime_ns is not None:
            changes["atime_ns"] = atime_ns
        if mtime_ns is not None:
            changes["mtime_ns"] = mtime_ns
        if size is not None:
            self.regular_file(ino)
            if size < 0:
                raise StripefsError(ErrorCode.INVALID, f"negative size {size} for inode {ino}")
            keep = chunk_count(size, row["chunk_size"])
            if keep < chunk_count(row["size"], row["chunk_size"]) or chunks:
                self.snapshots.guard(ino, {c.index: c.version for c in chunks}, keep)
            self.quotas.resized(ino, row["size"], size)
            dropped = self.store.drop_chunks(ino, keep, max_version=self.last_epoch())
            if dropped:
                log.debug("inode %d truncated to %d: %d chunk(s) queued for deletion", ino, size, dropped)
            self._record_chunks(ino, chunks)
            changes["size"] = size
            if mtime_ns is None:
                changes["mtime_ns"] = now
        elif chunks:
            self.regular_file(ino)
            self.snapshots.guard(ino, {c.index: c.version for c in chunks})
            self._record_chunks(ino, chunks)
        changes["ctime_ns"] = ctime_ns if ctime_ns is not None else now
        self.store.update_inode(ino, **changes)
        return self.getattr(ino)

    # -- xattrs ----------------------------------------------------------------

    @staticmethod
    def _check_xattr_name(name: bytes) -> None:
        if not name or b"\0" in name:
            raise StripefsError(ErrorCode.INVALID, f"invalid xattr name {name!r}")
        if len(name) > XATTR_NAME_MAX:
            raise StripefsError(ErrorCode.RANGE, f"xattr name of {len(name)} bytes is longer than {XATTR_NAME_MAX}")

    def setxattr(self, ino: int, name: bytes, value: bytes, flags: int = 0) -> None:
        check_writable(self.inode(ino))
        self._check_xattr_name(name)
        if len(value) > XATTR_VALUE_MAX:
            raise StripefsError(ErrorCode.INVALID, f"xattr value of {len(value)} bytes is larger than {XATTR_VALUE_MAX}")
        if flags & ~(XATTR_CREATE | XATTR_REPLACE) or flags == XATTR_CREATE | XATTR_REPLACE:
            raise StripefsError(ErrorCode.INVALID, f"xattr flags {flags} are not supported")
        exists = self.store.get_xattr(ino, name) is not None
        if flags & XATTR_CREATE and exists:
            raise StripefsError(ErrorCode.EXISTS, f"xattr {name!r} of inode {ino} exists")
        if flags & XATTR_REPLACE and not exists:
            raise StripefsError(ErrorCode.NO_ATTR, f"inode {ino} has no xattr {name!r}")
        self.store.set_xattr(ino, name, value)
        self.store.update_inode(ino, ctime_ns=self.clock())

    def getxattr(self, ino: int, name: bytes) -> bytes:
        self.inode(ino)
        self._check_xattr_name(name)
        value = self.store.get_xattr(ino, name)
        if value is None:
            raise StripefsError(ErrorCode.NO_ATTR, f"inode {ino} has no xattr {name!r}")
        return value

    def listxattr(self, ino: int) -> list[bytes]:
        self.inode(ino)
        return self.store.list_xattrs(ino)

    def removexattr(self, ino: int, name: bytes) -> None:
        check_writable(self.inode(ino))
        self._check_xattr_name(name)
        if not self.store.delete_xattr(ino, name):
            raise StripefsError(ErrorCode.NO_ATTR, f"inode {ino} has no xattr {name!r}")
        self.store.update_inode(ino, ctime_ns=self.clock())

    # -- layouts and statfs ----------------------------------------------------

    def get_layout(self, ino: int) -> Layout:
        return to_layout(self.inode(ino))

    def set_layout(
        self, ino: int, chunk_size: int | None = None, stripe_count: int | None = None, redundancy: str | None = None
    ) -> Layout:
        row = self.directory(ino)
        check_writable(row)
        old = to_layout(row)
        new = Layout(
            chunk_size=old.chunk_size if chunk_size is None else chunk_size,
            stripe_count=old.stripe_count if stripe_count is None else stripe_count,
            redundancy=old.redundancy if redundancy is None else str(parse_redundancy(redundancy)),
        )
        validate_layout(new)
        if new.redundancy != old.redundancy:
            _redundancy.check_fits(self.nodes.views(), parse_redundancy(new.redundancy))
        self.store.update_inode(
            ino, chunk_size=new.chunk_size, stripe_count=new.stripe_count, redundancy=new.redundancy, ctime_ns=self.clock()
        )
        log.info("directory %d layout: %s", ino, new)
        return new

    def statfs(self) -> tuple[int, int, int, int]:
        """(total bytes, free bytes, used bytes, inodes): a shared file system counted once, used is
        what stripefs stores (daemon/health.py ``capacity``)."""
        total, free, used = self.nodes.capacity()
        return total, free, used, self.store.counts()["inodes"]

    # -- open: a file's attributes, layout and chunk map ----------------------

    def open_info(self, ino: int) -> tuple[Attr, Layout, list[ChunkRef], list[NodeAddr]]:
        return self.open_info_of(self.inode(ino))

    def open_info_of(self, row) -> tuple[Attr, Layout, list[ChunkRef], list[NodeAddr]]:
        """``open_info`` of an inode row already read (a lookup's)."""
        refs, addrs = self.chunk_map_of(row, self.store.get_chunks(row["ino"]))
        return to_attr(row), to_layout(row), refs, addrs

    def chunk_map_of(self, row, chunks: dict[int, tuple[int, list[int], list[int]]]) -> tuple[list[ChunkRef], list[NodeAddr]]:
        """The chunk map of inode ``row`` for ``chunks`` (store.get_chunks), as readers get it: a
        snapshot's file says which chunks it reads under its live file's ids (daemon/snapshots.py)."""
        refs, addrs = self._chunk_map(row["ino"], chunks)
        if row["snapshot"] > 0 and refs:
            refs = self._snapshot_refs(row["ino"], refs)
        return refs, addrs

    def _snapshot_refs(self, ino: int, refs: list[ChunkRef]) -> list[ChunkRef]:
        """The chunk refs of snapshot file ``ino``, each still shared with its live file naming it."""
        shared = self.store.data_inos(ino)
        return [msgspec.structs.replace(r, data_ino=shared[r.index]) if shared.get(r.index) else r for r in refs]
