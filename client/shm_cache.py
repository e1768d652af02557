"""Prefetched files in shared memory: the path around the kernel's per-file cost.

Even from the page cache, every open+read+close through FUSE costs the kernel
a round of FUSE requests (on these machines ~4,500 files/s at best, against
~18,000 from tmpfs). For sampler-order prefetch (stripefs.torch) the mount
also writes each prefetched file into a shared-memory directory, and the
DataLoader workers read it from there (``stripefs.torch.read_file``) instead of
through the mount: the model is 3FS's USRBIO, with plain files on tmpfs as
the shared buffer.

Who may read a copy: exactly who may read the original, as the kernel decides
(docs/security.md). The mount runs as root and writes into a world-writable
place (/dev/shm), so nothing here trusts a name:

- The directory is made fresh by the mount, ``BASE/stripefs-PID-RANDOM``,
  with ``mkdir`` (which fails on anything already there: nothing is adopted),
  mode 0711, owned by the mount's user: others may open a name in it but not
  list it, create, rename or delete anything. Every later operation goes
  through the directory's file descriptor (``*at`` calls), never its path.
- A copy's name is 128 random bits, created ``O_EXCL|O_NOFOLLOW``; it takes
  the original's owner, group and permission bits. A reader learns the name
  only from ``getxattr(PATH, "user.stripefs.shm_copy")`` on the original
  through the mount; the kernel answers that only to a caller who can walk the
  path and read the file (user.* extended attributes need read permission),
  so a copy of a 0644 file in a 0700 directory stays private to those who can
  enter the directory. The mount names a copy only of the file's current
  version (mtime, size) as the newest attributes it holds say (the LOOKUP of
  the getxattr's own path walk in the default mode, which asks the daemon:
  close-to-open; the feed-validated attributes in dataset mode). The answer
  carries the copy's size, that version, its xxh3 checksum and the
  original's owner, group and permission bits, which ``read_file`` checks
  against the copy (fstat) and its bytes before it uses one, with no stat of
  the original (one request through the mount per file, not two); anything
  else falls back to a read through the mount.
- Readers cannot delete copies (the directory is not theirs). Copies stay
  while they fit in ``budget``: a later epoch that asks for a file whose copy
  of the same version is still here costs no fetch at all (the prefetcher
  asks ``has``).
- The budget is shared fairly between the users who announce prefetches (the
  uid of the ``setxattr``): a copy is charged to its announcer, and bytes are
  reserved before a copy is written, so copies written at once never
  overshoot it. When room is needed, the copies that go are those of the user
  holding the most, counting the new copy as the announcer's: a user can
  evict another user's copies only while holding less than that user, so
  nobody is pushed below an equal share by someone else's announcements.
  Within a user's copies, those handed out more than ``HANDED_OUT_S`` ago go
  first (in the order they were handed out), then the oldest. The whole
  directory goes when
  the mount ends (or, after a ``kill -9``, when the next mount on this machine
  starts and finds a ``stripefs-PID-*`` directory of its own user whose PID is
  gone).
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import stat
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import xxhash

from ..common import protocol as p

log = logging.getLogger(__name__)

#: a copy whose name was handed to a reader is deleted this long after (time enough to open it)
HANDED_OUT_S = 10.0

DIR_MODE = 0o711


@dataclass
class Copy:
    name: str
    size: int
    mtime_ns: int  # the original's version the copy was made from
    digest: int  # xxh3_64 of the bytes
    user: int = 0  # who announced it (uid): its bytes count against that user's share
    handed_out: float = 0.0  # monotonic time the name was given to a reader; 0: not yet


def describe(copy: Copy, attr: p.Attr) -> bytes:
    """The ``user.stripefs.shm_copy`` value: NAME SIZE MTIME_NS XXH3 UID GID MODE (octal permission
    bits of the original as ``attr`` has them; stripefs.torch.read_file parses it)."""
    return f"{copy.name} {copy.size} {copy.mtime_ns} {copy.digest:016x} {attr.uid} {attr.gid} {attr.mode & 0o777:o}".encode()


class ShmCache:
    def __init__(self, base: str | Path, budget: int):
        self.base = Path(base)
        self.budget = budget
        self.used = 0
        self.dir: Path | None = None
        self._dir_fd = -1
        self._copies: dict[int, Copy] = {}  # ino -> its copy
        self._held: dict[int, int] = {}  # user -> bytes of its copies and reservations
        self._oldest: dict[int, OrderedDict[int, Copy]] = {}  # user -> its copies, oldest first
        # user -> its copies in the order they were handed out (entries of copies dropped since
        # stay until they age out; _reclaim checks identity): reclaiming is not a scan of all
        self._handed: dict[int, OrderedDict[int, Copy]] = {}
        self._lock = threading.Lock()  # put() runs in worker threads, lookup() on the trio loop

    def open(self) -> None:
        """Make this mount's directory; OSError (said plainly) when that is not possible."""
        self._sweep_dead_mounts()
        for _ in range(8):
            path = self.base / f"stripefs-{os.getpid()}-{secrets.token_hex(8)}"
            try:
                os.mkdir(path, DIR_MODE)
            except FileExistsError:
                continue  # someone made that name: never adopted
            break
        else:
            raise OSError(f"cannot create a fresh directory under {self.base}")
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            os.close(fd)
            raise OSError(f"{path} is not ours after mkdir")
        os.fchmod(fd, DIR_MODE)  # whatever the umask took away or added
        self.dir, self._dir_fd = path, fd

    def close(self) -> None:
        if self._dir_fd < 0:
            return
        for name in os.listdir(self._dir_fd):
            try:
                os.unlink(name, dir_fd=self._dir_fd)
            except OSError:
                pass
        os.close(self._dir_fd)
        self._dir_fd = -1
        try:
            os.rmdir(self.dir)
        except OSError as exc:
            log.warning("cannot remove the shared-memory directory %s: %s", self.dir, exc)

    def _sweep_dead_mounts(self) -> None:
        """Remove what mounts of this user killed without a chance to clean up left."""
        if not self.base.is_dir():
            return
        for other in self.base.iterdir():
            parts = other.name.split("-")
            if len(parts) != 3 or parts[0] != "stripefs" or not parts[1].isdigit():
                continue
            try:
                st = os.lstat(other)
            except OSError:
                continue
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
                continue  # not a directory a mount of ours made: not ours to remove
            try:
                os.kill(int(parts[1]), 0)
            except ProcessLookupError:
                log.info("removing %s, left by a mount that is gone", other)
                shutil.rmtree(other, ignore_errors=True)
            except PermissionError:
                pass  # alive, another user's

    def put(self, info: p.OpenRsp, data: bytes | memoryview, user: int = 0) -> bool:
        """Write one prefetched file announced by ``user`` (in a worker thread); False when there
        is no room for it within that user's fair share of the budget (module docstring)."""
        size = len(data)
        attr = info.attr
        if size > self.budget or self._dir_fd < 0:
            return False
        with self._lock:
            old = self._copies.get(attr.ino)
            if old is not None and (old.mtime_ns, old.size) == (attr.mtime_ns, size):
                return True
            self._reclaim(size, user)
            if self.used + size > self.budget:
                return False
            self._charge(user, size)  # reserved before writing: copies written at once cannot overshoot
        name = secrets.token_hex(16)
        try:
            fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=self._dir_fd)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
                os.fchown(fd, attr.uid, attr.gid)
                os.fchmod(fd, attr.mode & 0o777)  # never set-id bits
            finally:
                os.close(fd)
        except OSError as exc:
            log.warning("shared-memory prefetch: cannot write a copy of inode %d: %s", attr.ino, exc)
            self._unlink(name)
            with self._lock:
                self._charge(user, -size)
            return False
        copy = Copy(name, size, attr.mtime_ns, xxhash.xxh3_64_intdigest(data), user)
        with self._lock:
            replaced = self._copies.pop(attr.ino, None)
            if replaced is not None:
                self._drop(attr.ino, replaced)
            self._copies[attr.ino] = copy
            self._oldest.setdefault(user, OrderedDict())[attr.ino] = copy
        return True

    def held(self, user: int) -> int:
        """Bytes of ``user``'s copies (and copies being written)."""
        with self._lock:
            return self._held.get(user, 0)

    def _charge(self, user: int, size: int) -> None:
        """(Under the lock.)"""
        self.used += size
        held = self._held.get(user, 0) + size
        if held > 0:
            self._held[user] = held
        else:
            self._held.pop(user, None)

    def lookup(self, ino: int, attr: p.Attr) -> bytes | None:
        """What a reader allowed to read inode ``ino`` is told of its copy (``describe``); None: no
        copy of the version ``attr`` (the file's current attributes) describes.

        The kernel has checked the caller's permission before asking (getxattr of user.*)."""
        with self._lock:
            copy = self._copies.get(ino)
            if copy is None:
                return None
            if (copy.mtime_ns, copy.size) != (attr.mtime_ns, attr.size):
                self._copies.pop(ino)
                self._drop(ino, copy)  # of an older version: never of use again
                return None
            copy.handed_out = time.monotonic()  # (again in a later epoch: it goes to the end)
            handed = self._handed.setdefault(copy.user, OrderedDict())
            handed.pop(ino, None)
            handed[ino] = copy
            return describe(copy, attr)

    def has(self, ino: int, mtime_ns: int, size: int) -> bool:
        """A copy of this version of inode ``ino`` is here (the prefetcher need not fetch it)."""
        with self._lock:
            copy = self._copies.get(ino)
            return copy is not None and (copy.mtime_ns, copy.size) == (mtime_ns, size)

    def forget(self, ino: int) -> None:
        """Inode ``ino`` changed: its copy is of an old version."""
        with self._lock:
            copy = self._copies.pop(ino, None)
            if copy is not None:
                self._drop(ino, copy)

    def _reclaim(self, wanted: int, user: int) -> None:
        """(Under the lock.) Make room for ``wanted`` bytes of ``user``: copies of whoever holds
        the most, the new copy counted as ``user``'s (module docstring)."""
        while self.used + wanted > self.budget:
            mine = self._held.get(user, 0) + wanted
            victim = max(self._held, key=self._held.__getitem__, default=user)
            if self._held.get(victim, 0) <= mine:
                victim = user  # nobody holds more than the announcer would: its own copies go
            if not self._reclaim_one(victim):
                return

    def _reclaim_one(self, user: int) -> bool:
        """(Under the lock.) Drop one copy of ``user``: one handed out a while ago, else its
        oldest; False when it has none."""
        handed = self._handed.get(user)
        now = time.monotonic()
        while handed:
            ino, copy = next(iter(handed.items()))
            if now - copy.handed_out <= HANDED_OUT_S:
                break
            del handed[ino]
            if self._copies.get(ino) is copy:
                self._drop(ino, self._copies.pop(ino))
                return True
        oldest = self._oldest.get(user)
        if not oldest:
            return False
        ino, copy = next(iter(oldest.items()))
        if self._copies.get(ino) is copy:
            self._copies.pop(ino)
        self._drop(ino, copy)
        return True

    def _drop(self, ino: int, copy: Copy) -> None:
        """(Under the lock.) ``copy`` (of ``ino``, out of ``_copies`` already) goes."""
        self._charge(copy.user, -copy.size)
        oldest = self._oldest.get(copy.user)
        if oldest is not None and oldest.get(ino) is copy:
            del oldest[ino]
            if not oldest:
                del self._oldest[copy.user]
                self._handed.pop(copy.user, None)
        self._unlink(copy.name)

    def _unlink(self, name: str) -> None:
        try:
            os.unlink(name, dir_fd=self._dir_fd)
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("shared-memory prefetch: cannot delete a copy: %s", exc)
