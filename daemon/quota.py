"""Directory-tree quotas: limits on the bytes and inodes under a directory.

Like GPFS filesets, CephFS quotas and JuiceFS directory quotas, a quota is set
on a directory (its *quota root*) and limits what lies below it. Quotas nest:
a file under ``/a/b`` counts against a quota on ``/a/b`` and one on ``/a``, and
every one of them must have room for a change.

What counts
-----------
* **bytes**: the logical size (st_size) of every non-directory inode below
  the root: regular files (sparse ones count their full size) and symlinks
  (the target's length); directories are size 0 here. That is exactly
  ``du -sb --apparent-size DIR`` (an inode with several names counts once),
  not the bytes stored on disks (replicas, EC parity, holes): users see and
  plan in logical sizes, and the redundancy of a directory may change.
* **inodes**: every inode below the root (files, directories, symlinks,
  device nodes, FIFOs), not the root itself: a limit of 100 allows 100 creates
  in an empty directory.
* A limit of 0 means "no limit". Setting a limit below the current usage
  deletes nothing: only growth is refused.
* An inode leaves its trees' usage when its last name goes, even if a session
  still has it open (its later growth, as an orphan, counts nowhere).

Usage is incremental, never scanned on the hot path
---------------------------------------------------
``quotas(ino, max_bytes, max_inodes, used_bytes, used_inodes)`` (daemon/db.py)
holds limits and usage. Each namespace operation that changes what is under
a root updates ``used_*`` of every root above it with one UPDATE, in the same
transaction (and savepoint) as the change itself: create, mkdir, mknod,
symlink, unlink, rmdir, rename, commit (a file grows), setattr (truncate or
extend). So usage is exactly as durable as the namespace and survives
restarts. ``Quotas.recount`` (``stripefs quota recount``, fsck-like) counts a
tree again with one recursive query and corrects usage that drifted (a bug, a
database restored by hand); setting a new quota counts its tree once.

Finding a directory's quota roots
---------------------------------
The daemon keeps the set of quota roots in memory (loaded at start). When it
is empty, every hook returns after one ``if``: a cluster without quotas pays
nothing. Otherwise the roots of a directory are found by walking its parents
(one indexed query per level) and cached per directory; a file's roots are
its parent's. The cache is cleared when a quota is set or removed; a
directory rename never changes any cached answer because a rename between
directories with different roots is refused for directories (below).

Renames and hard links across quota trees
-----------------------------------------
Roots are compared as sets: moving between two directories under the same
roots changes nothing. Otherwise:

* a file (or symlink, device...) with one name moves its usage: the new trees
  are checked first (EDQUOT if it does not fit), the old ones credited;
* a directory answers EXDEV, as CephFS does across quota realms: moving the
  usage of a whole subtree would need a scan of it inside one metadata
  transaction. ``mv`` then copies and deletes, which the quotas account for;
* a hard link, or a rename of a file that has other names, answers EXDEV
  (``ln`` fails; ``mv`` copies): every name of an inode stays under the same
  roots, so an inode counts in exactly one set of trees.
* RENAME_EXCHANGE between different roots answers EXDEV.

Enforcement (EDQUOT)
--------------------
* creates beyond an inode limit: EDQUOT from create, mkdir, mknod, symlink.
* growth beyond a byte limit: file data goes from the mount to storage nodes
  directly, and the daemon sees only the commit of the new size. So:

  1. the mount refuses to buffer bytes past the limit. ``OpenRsp.quota_max_size``
     (create, open, lookup) tells it the largest size the file may reach
     (-1: no quota applies); a write that would cross it asks again
     (``QuotaRoomReq``: other files may have shrunk) and then writes the part
     that fits and returns a short count; the next write() gets EDQUOT. The
     file keeps exactly its bytes up to the limit.
  2. the daemon enforces at commit (the backstop for writers racing for the
     same room, a quota set while a file was open, or a mount that does not
     check): a commit that would exceed a limit is cut to the size that fits
     (``fit_growth``); chunks past it are dropped (their copies become
     garbage) and the reply's smaller size tells the mount, which cuts the
     boundary chunk on its replicas (client/striping.py) and answers EDQUOT to
     close()/fsync(). Nothing past the limit is kept.
  3. extending truncate (setattr size) beyond the limit: EDQUOT, no change.

Writes that only overwrite existing bytes never get EDQUOT.
"""

from __future__ import annotations

import logging
import stat
import threading
from typing import NamedTuple

from ..common.errors import ErrorCode, StripefsError
from ..common.protocol import INT64_MAX
from .db import ROOT_INO
from .store import SqliteStore

log = logging.getLogger(__name__)

#: directories whose roots are cached; the cache is dropped whole when it grows past this
CACHE_MAX = 100_000


class Quota(NamedTuple):
    ino: int
    max_bytes: int  # 0: no limit
    max_inodes: int
    used_bytes: int
    used_inodes: int


def charged_bytes(row) -> int:
    """What an inode row counts against byte limits: its size, unless it is a directory."""
    return 0 if stat.S_ISDIR(row["mode"]) else row["size"]


def _exceeded(what: str, root: int, limit: int, used: int, more: int) -> StripefsError:
    return StripefsError(
        ErrorCode.QUOTA_EXCEEDED, f"quota of directory {root}: {used} + {more} {what} would exceed the limit of {limit}"
    )


class Quotas:
    """Quota bookkeeping over the store; one per Namespace. No network code, no awaits."""

    def __init__(self, store: SqliteStore):
        self.store = store
        # PostgreSQL (several daemons, one transaction per request in worker threads): another daemon may
        # set a quota at any time, so each transaction reads the roots afresh into its own thread's view,
        # with its own directory cache: a begin hook of the store forgets the view, and the first use of
        # ``roots`` in the transaction reads them (a lookup or getattr, which never asks, costs no query)
        self._per_transaction = not getattr(store, "group_commit", True)
        self._view = threading.local()
        self.reload()
        if self._per_transaction:
            store.begin_hooks.append(self._forget_view)

    @property
    def roots(self) -> set[int]:
        if self._per_transaction and not hasattr(self._view, "roots"):
            self.reload()
        return self._view.roots if self._per_transaction else self._roots

    @roots.setter
    def roots(self, value: set[int]) -> None:
        if self._per_transaction:
            self._view.roots = value
        else:
            self._roots = value

    @property
    def _cache(self) -> dict[int, tuple[int, ...]]:
        if self._per_transaction:
            if not hasattr(self._view, "cache"):
                self._view.cache = {}
            return self._view.cache
        return self._shared_cache

    @_cache.setter
    def _cache(self, value: dict[int, tuple[int, ...]]) -> None:
        if self._per_transaction:
            self._view.cache = value
        else:
            self._shared_cache = value

    @property
    def active(self) -> bool:
        return bool(self.roots)

    def _rows(self, inos) -> list[Quota]:
        return [Quota(*row) for row in self.store.get_quotas(inos)] if inos else []

    # -- roots -----------------------------------------------------------------

    def roots_of_dir(self, ino: int) -> tuple[int, ...]:
        """The quota roots that apply to entries of directory ``ino`` (it included), nearest first."""
        if not self.roots:
            return ()
        chain = []
        node: int | None = ino
        base: tuple[int, ...] = ()
        while node is not None:
            cached = self._cache.get(node)
            if cached is not None:
                base = cached
                break
            chain.append(node)
            if node == ROOT_INO or len(chain) > 100_000:
                break
            node = self.store.parent_of(node)
        if len(self._cache) > CACHE_MAX:
            self._cache.clear()
        for d in reversed(chain):
            base = ((d,) if d in self.roots else ()) + base
            self._cache[d] = base
        return base

    def roots_of_inode(self, ino: int) -> tuple[int, ...]:
        """The roots a non-directory counts against: those of (any of) its parents; () for an orphan."""
        if not self.roots:
            return ()
        parent = self.store.parent_of(ino)
        return () if parent is None else self.roots_of_dir(parent)

    # -- checks and charges --------------------------------------------------------

    def _charge(self, roots, nbytes: int, ninodes: int) -> None:
        """Add usage to ``roots``; growth is checked first (EDQUOT, nothing changed)."""
        if not roots or (nbytes == 0 and ninodes == 0):
            return
        if nbytes > 0 or ninodes > 0:
            for q in self._rows(roots):
                if ninodes > 0 and q.max_inodes and q.used_inodes + ninodes > q.max_inodes:
                    raise _exceeded("inodes", q.ino, q.max_inodes, q.used_inodes, ninodes)
                if nbytes > 0 and q.max_bytes and q.used_bytes + nbytes > q.max_bytes:
                    raise _exceeded("bytes", q.ino, q.max_bytes, q.used_bytes, nbytes)
        self.store.add_quota_usage(roots, nbytes, ninodes)

    def room(self, roots) -> int:
        """Bytes that may still be added under all of ``roots``; -1 when none limits bytes."""
        rooms = [max(0, q.max_bytes - q.used_bytes) for q in self._rows(roots) if q.max_bytes]
        return min(rooms) if rooms else -1

    def max_size(self, ino: int, size: int, parent: int | None = None) -> int:
        """The largest size file ``ino`` (now ``size`` bytes, in directory ``parent`` when known)
        may grow to; -1: no limit applies."""
        if not self.roots:
            return -1
        room = self.room(self.roots_of_inode(ino) if parent is None else self.roots_of_dir(parent))
        return -1 if room < 0 else size + room

    # -- namespace hooks (called by daemon/namespace.py inside the operation's savepoint) --

    def created(self, parent: int, nbytes: int = 0) -> None:
        """A new inode of ``nbytes`` under ``parent``."""
        if self.roots:
            self._charge(self.roots_of_dir(parent), nbytes, 1)

    def removed(self, parent: int, row) -> None:
        """The last name of inode ``row`` under ``parent`` is gone (a directory: it is deleted)."""
        if not self.roots:
            return
        self._charge(self.roots_of_dir(parent), -charged_bytes(row), -1)
        # a deleted quota root's row goes with its inode (ON DELETE CASCADE); its ino stays in
        # ``roots`` until ``all`` prunes it: harmless (nothing can be created under it), and an
        # operation that fails after this (a rename answered EXDEV) cannot lose a live root
        self._cache.pop(row["ino"], None)

    def resized(self, ino: int, old: int, new: int) -> None:
        """File ``ino`` changes size; growth beyond a limit raises EDQUOT."""
        if self.roots and new != old:
            self._charge(self.roots_of_inode(ino), new - old, 0)

    def fit_growth(self, ino: int, growth: int) -> int:
        """The part of ``growth`` bytes that file ``ino`` may take now (the commit backstop)."""
        if not self.roots or growth <= 0:
            return growth
        room = self.room(self.roots_of_inode(ino))
        return growth if room < 0 else min(growth, room)

    def linking(self, ino: int, new_parent: int) -> None:
        """A new name for ``ino``: EXDEV unless it stays under the same roots."""
        if self.roots and set(self.roots_of_inode(ino)) != set(self.roots_of_dir(new_parent)):
            raise StripefsError(ErrorCode.CROSS_DEVICE, f"a hard link of inode {ino} cannot cross into another quota tree")

    def moving(self, row, parent_old: int, parent_new: int, *, exchange: bool = False) -> None:
        """The entry for inode ``row`` moves from ``parent_old`` to ``parent_new`` (rename)."""
        if not self.roots or parent_old == parent_new:
            return
        old, new = set(self.roots_of_dir(parent_old)), set(self.roots_of_dir(parent_new))
        if old == new:
            return
        what = "directory" if stat.S_ISDIR(row["mode"]) else "file"
        if exchange or stat.S_ISDIR(row["mode"]) or row["nlink"] > 1:
            raise StripefsError(
                ErrorCode.CROSS_DEVICE,
                f"{what} {row['ino']} cannot be renamed into another quota tree (EXDEV: mv copies it instead)",
            )
        nbytes = charged_bytes(row)
        self._charge(tuple(new - old), nbytes, 1)
        self._charge(tuple(old - new), -nbytes, -1)

    # -- the trash (daemon/trash.py): a trashed inode stays charged to the roots it was under --

    def forget(self, ino: int) -> None:
        """Directory ``ino`` lost its name (moved to the trash): its cached roots are stale."""
        self._cache.pop(ino, None)

    def uncharge(self, roots, nbytes: int) -> None:
        """A trashed inode of ``nbytes`` is freed: off the ``roots`` it was charged to (those left)."""
        live = [r for r in roots if r in self.roots]
        if live:
            self.store.add_quota_usage(live, -nbytes, -1)

    def recharge(self, old, new, nbytes: int) -> None:
        """A trashed inode charged to roots ``old`` comes back under roots ``new``: EDQUOT if they lack room."""
        old = {r for r in old if r in self.roots}
        new = set(new)
        if old == new:
            return
        self._charge(tuple(new - old), nbytes, 1)
        if old - new:
            self.store.add_quota_usage(tuple(old - new), -nbytes, -1)

    # -- administration ------------------------------------------------------------

    def get(self, ino: int) -> Quota | None:
        rows = self._rows([ino])
        return rows[0] if rows else None

    def applying(self, ino: int, is_dir: bool) -> list[Quota]:
        """Every quota over ``ino`` (a directory's own included), nearest first."""
        roots = self.roots_of_dir(ino) if is_dir else self.roots_of_inode(ino)
        by_ino = {q.ino: q for q in self._rows(roots)}
        return [by_ino[r] for r in roots if r in by_ino]

    def all(self) -> list[Quota]:
        rows = self._rows(sorted(self.roots))
        self.roots = {q.ino for q in rows}  # prunes roots deleted with their directory
        return rows

    def set(self, ino: int, max_bytes: int | None, max_inodes: int | None) -> Quota | None:
        """Set (None: keep) the limits of directory ``ino``; both 0 removes the quota. The new quota or None."""
        for value in (max_bytes, max_inodes):
            if value is not None and value < 0:
                raise StripefsError(ErrorCode.INVALID, f"a quota limit cannot be negative ({value})")
            if value is not None and value > INT64_MAX:  # what the database's integers hold
                raise StripefsError(ErrorCode.INVALID, f"a quota limit cannot exceed {INT64_MAX} ({value})")
        current = self.get(ino)
        new_bytes = max_bytes if max_bytes is not None else (current.max_bytes if current else 0)
        new_inodes = max_inodes if max_inodes is not None else (current.max_inodes if current else 0)
        self._cache.clear()
        if not new_bytes and not new_inodes:
            if current is not None:
                self.store.delete_quota(ino)
                self.roots.discard(ino)
                log.info("quota of directory %d removed", ino)
            return None
        if current is None:
            used_bytes, used_inodes = self.store.subtree_usage(ino)
            self.store.insert_quota(ino, new_bytes, new_inodes, used_bytes, used_inodes)
        else:
            self.store.set_quota_limits(ino, new_bytes, new_inodes)
        self.roots.add(ino)
        log.info("quota of directory %d: %d bytes, %d inodes (0: no limit)", ino, new_bytes, new_inodes)
        return self.get(ino)

    def recount(self, ino: int | None = None) -> list[tuple[Quota, Quota]]:
        """Count the trees of every quota (or one) again; (before, after) of those that were wrong, corrected."""
        fixed = []
        trashed = self.store.trash_rows()
        for q in [self.get(ino)] if ino is not None else self.all():
            if q is None:
                continue
            used_bytes, used_inodes = self.store.subtree_usage(q.ino)
            for r in trashed:  # the trash stays charged to where it was (daemon/trash.py)
                if q.ino in r[4]:
                    used_bytes += 0 if stat.S_ISDIR(r[5]) else r[6]
                    used_inodes += 1
            if (used_bytes, used_inodes) != (q.used_bytes, q.used_inodes):
                self.store.set_quota_usage(q.ino, used_bytes, used_inodes)
                after = q._replace(used_bytes=used_bytes, used_inodes=used_inodes)
                log.warning(
                    "quota of directory %d: usage was %d bytes, %d inodes; counted %d bytes, %d inodes (corrected)",
                    q.ino, q.used_bytes, q.used_inodes, used_bytes, used_inodes,
                )
                fixed.append((q, after))
        return fixed

    def _forget_view(self) -> None:
        """A transaction begins (PostgreSQL): what the last one on this thread read is stale."""
        self._view.__dict__.clear()

    def reload(self) -> None:
        """Read the set of roots again (after a transaction was rolled back; PostgreSQL: as each one begins)."""
        self.roots = set(self.store.quota_roots())
        self._cache = {}
