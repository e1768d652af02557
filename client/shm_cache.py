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
  asks ``has``). When room is needed, copies handed out more than
  ``HANDED_OUT_S`` ago go first (in the order they were handed out), then
  the oldest; the whole directory goes when
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
        self._copies: OrderedDict[int, Copy] = OrderedDict()  # ino -> its copy, oldest first
        # ino -> its copy, in the order they were handed out (entries of copies dropped since
        # stay until they age out; _reclaim checks identity): reclaiming is not a scan of all
        self._handed: OrderedDict[int, Copy] = OrderedDict()
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

    def put(self, info: p.OpenRsp, data: bytes | memoryview) -> bool:
        """Write one prefetched file (in a worker thread); False when there is no room."""
        size = len(data)
        attr = info.attr
        if size > self.budget or self._dir_fd < 0:
            return False
        with self._lock:
            old = self._copies.get(attr.ino)
            if old is not None and (old.mtime_ns, old.size) == (attr.mtime_ns, size):
                return True
            self._reclaim(size)
            if self.used + size > self.budget:
                return False
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
            return False
        copy = Copy(name, size, attr.mtime_ns, xxhash.xxh3_64_intdigest(data))
        with self._lock:
            replaced = self._copies.pop(attr.ino, None)
            if replaced is not None:
                self._drop(replaced)
            self._copies[attr.ino] = copy
            self.used += size
        return True

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
                self._drop(copy)  # of an older version: never of use again
                return None
            copy.handed_out = time.monotonic()  # (again in a later epoch: it goes to the end)
            self._handed.pop(ino, None)
            self._handed[ino] = copy
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
                self._drop(copy)

    def _reclaim(self, wanted: int) -> None:
        """(Under the lock.) Make room for ``wanted`` bytes: copies handed out a while ago first
        (oldest hand-out first), then the oldest copies."""
        if self.used + wanted <= self.budget:
            return
        now = time.monotonic()
        while self._handed:
            ino, copy = next(iter(self._handed.items()))
            if now - copy.handed_out <= HANDED_OUT_S:
                break
            del self._handed[ino]
            if self._copies.get(ino) is copy:
                self._drop(self._copies.pop(ino))
            if self.used + wanted <= self.budget:
                return
        while self._copies and self.used + wanted > self.budget:
            _, copy = self._copies.popitem(last=False)
            self._drop(copy)

    def _drop(self, copy: Copy) -> None:
        """(Under the lock.)"""
        self.used -= copy.size
        self._unlink(copy.name)

    def _unlink(self, name: str) -> None:
        try:
            os.unlink(name, dir_fd=self._dir_fd)
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("shared-memory prefetch: cannot delete a copy: %s", exc)
