"""Telling a mount which files to prefetch: the ``user.stripefs.prefetch`` xattr.

``setxattr(MOUNT_ROOT, "user.stripefs.prefetch", b"\\n".join(paths))`` with
paths relative to the mount's root queues them in the mount's prefetcher
(client/prefetch.py); ``getxattr`` of the same name reports
``pending=N fetched=N stored=N failed=N kept=N`` (kept: asked for shared memory and
already there, in that version). Used by ``stripefs.torch`` and
``stripefs warmup``. Setting it needs write permission on the mount's root.
"""

from __future__ import annotations

import os
from typing import Iterable

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
    """{mount root: [paths relative to it]}; paths outside stripefs mounts are left out."""
    by_root: dict[bytes, list[bytes]] = {}
    for path in paths:
        absolute = os.fsencode(os.path.abspath(path))
        root = roots.of(os.path.dirname(absolute))
        if root is not None:
            by_root.setdefault(root, []).append(os.path.relpath(absolute, root))
    return by_root


def announce(root: bytes, relative: list[bytes], *, shm: bool = False) -> None:
    """Queue files of the mount at ``root`` for prefetch, in this order (OSError if the mount refuses).

    ``shm``: the mount also puts each file in its shared-memory directory, for ``read_file``.
    """
    name = PREFETCH_SHM_XATTR if shm else PREFETCH_XATTR
    blob: list[bytes] = []
    size = 0
    for path in relative:
        if size + len(path) + 1 > MAX_BLOB and blob:
            os.setxattr(root, name, b"\n".join(blob))
            blob, size = [], 0
        blob.append(path)
        size += len(path) + 1
    if blob:
        os.setxattr(root, name, b"\n".join(blob))


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
