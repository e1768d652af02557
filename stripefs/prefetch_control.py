"""Telling a mount which files to prefetch: the ``user.stripefs.prefetch`` xattr.

``setxattr(MOUNT_ROOT, "user.stripefs.prefetch", b"\\n".join(paths))`` with
paths relative to the mount's root queues them in the mount's prefetcher
(client/prefetch.py); ``getxattr`` of the same name reports
``pending=N fetched=N stored=N failed=N``. Used by ``stripefs.torch`` and
``stripefs warmup``. Setting it needs write permission on the mount's root.
"""

from __future__ import annotations

import os
from typing import Iterable

from .common.protocol import PREFETCH_XATTR as _NAME

PREFETCH_XATTR = os.fsdecode(_NAME)
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


def announce(root: bytes, relative: list[bytes]) -> None:
    """Queue files of the mount at ``root`` for prefetch, in this order (OSError if the mount refuses)."""
    blob: list[bytes] = []
    size = 0
    for name in relative:
        if size + len(name) + 1 > MAX_BLOB and blob:
            os.setxattr(root, PREFETCH_XATTR, b"\n".join(blob))
            blob, size = [], 0
        blob.append(name)
        size += len(name) + 1
    if blob:
        os.setxattr(root, PREFETCH_XATTR, b"\n".join(blob))


def report(root: bytes | str) -> dict[str, int]:
    """The mount's prefetch counters: pending, fetched, stored, failed."""
    text = os.getxattr(root, PREFETCH_XATTR).decode()
    return {key: int(value) for key, value in (item.split("=") for item in text.split())}
