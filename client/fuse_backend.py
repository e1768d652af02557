"""The mount's calls to the kernel outside of a request, through its FUSE session.

The mount's kernel-cache follower (kernel_cache.py), its handlers (operations.py) and its
prefetcher (prefetch.py) invalidate names and inodes and store pages only through these
functions; the mount (client/mount.py) names the session they go to (:func:`use_session`).
Each raises OSError with ENOENT when the kernel holds no such inode or name, or when no
session is serving (nothing is cached then), so a caller treats both as "nothing to drop".
"""

from __future__ import annotations

import errno

from .fuse import notify as _notify
from .fuse.session import Session

_session: Session | None = None


def use_session(session: Session | None) -> None:
    """Route the calls below to ``session`` (None: no session serves; they answer ENOENT)."""
    global _session
    _session = session


def _send(parts, what: str) -> None:
    session = _session
    if session is None or not session.notify(parts):  # the kernel had nothing to do, or no connection
        raise OSError(errno.ENOENT, f"{what}: not in the kernel's caches")


def invalidate_inode(inode: int, attr_only: bool = False) -> None:
    _send(_notify.inval_inode(inode, -1 if attr_only else 0, 0), f"inode {inode}")


def invalidate_entry(parent: int, name: bytes) -> None:
    _send(_notify.inval_entry(parent, name), f"name {name!r} in {parent}")


def notify_store(inode: int, offset: int, data: bytes) -> None:
    _send(_notify.store(inode, offset, data), f"inode {inode}")
