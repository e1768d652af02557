"""Telling a mount which files to prefetch: the ``user.stripefs.prefetch`` xattr.

``setxattr(MOUNT_ROOT, "user.stripefs.prefetch", b"\\n".join(paths))`` with
paths relative to the mount's root queues them in the mount's prefetcher
(client/prefetch.py); ``getxattr`` of the same name reports
``pending=N fetched=N stored=N failed=N kept=N`` (kept: asked for shared memory and
already there, in that version). Used by ``stripefs.torch`` and
``stripefs warmup``. Setting it needs write permission on the mount's root; a read-only mount
refuses every setxattr, so :func:`announce` sends the same request as an ioctl
(``protocol.PREFETCH_IOC``), which needs only read permission on the directory.
"""

from __future__ import annotations

import errno
import fcntl
import os
import struct
from typing import Iterable, Iterator

from .common import protocol as _p

PREFETCH_XATTR = os.fsdecode(_p.PREFETCH_XATTR)
PREFETCH_SHM_XATTR = os.fsdecode(_p.PREFETCH_SHM_XATTR)
SHM_DIR_XATTR = os.fsdecode(_p.SHM_DIR_XATTR)
SHM_COPY_XATTR = os.fsdecode(_p.SHM_COPY_XATTR)
#: the kernel refuses xattr values above 64 KiB
MAX_BLOB = 60_000


class MountRoots:
    """Finds the stripefs mount holding a path (cached per directory)."""

    def __init__(self) -> None:
        self._roots: dict[bytes, bytes | None] = {}
        self._relative: dict[bytes, tuple[bytes | None, bytes]] = {}

    def relative(self, directory: bytes) -> tuple[bytes | None, bytes]:
        """(The mount holding absolute ``directory``, its path relative to that root with a
        trailing slash, empty for the root itself); (None, b"") outside stripefs mounts."""
        found = self._relative.get(directory)
        if found is None:
            root = self.of(directory)
            if root is None:
                found = (None, b"")
            else:
                rel = os.path.relpath(directory, root)
                found = (root, b"" if rel == b"." else rel + b"/")
            self._relative[directory] = found
        return found

    def of(self, directory: bytes) -> bytes | None:
        if directory in self._roots:
            return self._roots[directory]
        root = directory
        while not os.path.ismount(root) and root != b"/":
            root = os.path.dirname(root)
        found = root if root in _stripefs_mounts() else None
        self._roots[directory] = found
        return found


def _stripefs_mounts() -> set[bytes]:
    try:
        with open("/proc/self/mounts", "rb") as f:
            return {line.split()[1].replace(b"\\040", b" ") for line in f if line.split()[2] == b"fuse.stripefs"}
    except OSError:
        return set()


def group_by_mount(paths: Iterable[str | bytes | os.PathLike], roots: MountRoots) -> dict[bytes, list[bytes]]:
    """{mount root: [paths relative to it]}; paths outside stripefs mounts are left out.

    Each directory's mount and relative path are worked out once (``roots.relative``): a
    sampler announces every sample of every epoch from the DataLoader's main process, which
    ``os.path.relpath`` per path made cost ~20 us a sample (20 ms before an epoch's first batch).
    """
    by_root: dict[bytes, list[bytes]] = {}
    for path in paths:
        directory, _, name = os.fsencode(os.path.abspath(path)).rpartition(b"/")
        root, prefix = roots.relative(directory or b"/")
        if root is not None:
            by_root.setdefault(root, []).append(prefix + name)
    return by_root


def announce(root: bytes, relative: list[bytes], *, shm: bool = False) -> None:
    """Queue files of the mount at ``root`` for prefetch, in this order (OSError if the mount refuses).

    ``shm``: the mount also puts each file in its shared-memory directory, for ``read_file``.
    The request travels as an ioctl on the root (``protocol.PREFETCH_IOC``), which a read-only mount
    (a dataset mount) allows; a mount of an older release (served by pyfuse3) has no ioctl (ENOTTY) and is asked with
    setxattr instead.
    """
    try:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        fd = -1  # no read permission on the root: setxattr may still be allowed
    try:
        if fd >= 0:
            command = _p.PREFETCH_SHM_IOC if shm else _p.PREFETCH_IOC
            buf = bytearray(_p.PREFETCH_IOC_SIZE)
            try:
                for blob in split_blobs(relative, _p.PREFETCH_IOC_MAX_PATHS):
                    buf[:] = struct.pack("<I", len(blob)) + blob.ljust(_p.PREFETCH_IOC_MAX_PATHS, b"\0")
                    fcntl.ioctl(fd, command, buf)  # a bytearray: Python's own copy of a bytes is 1 KiB at most
                return
            except OSError as exc:
                if exc.errno not in (errno.ENOTTY, errno.ENOSYS):
                    raise
    finally:
        if fd >= 0:
            os.close(fd)
    for blob in split_blobs(relative, MAX_BLOB):
        os.setxattr(root, PREFETCH_SHM_XATTR if shm else PREFETCH_XATTR, blob)


def split_blobs(relative: list[bytes], limit: int) -> Iterator[bytes]:
    """``relative`` joined by newlines into blobs of at most ``limit`` bytes, in order."""
    blob: list[bytes] = []
    size = 0
    for path in relative:
        if size + len(path) + 1 > limit and blob:
            yield b"\n".join(blob)
            blob, size = [], 0
        blob.append(path)
        size += len(path) + 1
    if blob:
        yield b"\n".join(blob)


def shm_dir(root: bytes) -> bytes | None:
    """The shared-memory directory where the mount at ``root`` leaves prefetched files (None: it has none)."""
    try:
        found = os.getxattr(root, SHM_DIR_XATTR)
    except OSError:
        return None
    return found or None


def report(root: bytes | str) -> dict[str, int]:
    """The mount's prefetch counters: pending, fetched, stored, failed."""
    text = os.getxattr(root, PREFETCH_XATTR).decode()
    return {key: int(value) for key, value in (item.split("=") for item in text.split())}
