"""Which FUSE session the mount runs on, and the few calls the mount makes into it.

The mount's handlers (operations.py), its kernel-cache follower (kernel_cache.py) and its
prefetcher (prefetch.py) talk to the kernel outside of a request only through these functions:
invalidating names and inodes, storing pages, and (inside READDIR) adding a directory entry.
By default they go to pyfuse3's session; once the mount runs on its own session
(``-o fuse_session=own``, client/fuse/, :func:`use_session`) they go there. The signatures and the
errors are pyfuse3's (OSError with ENOENT when the kernel holds no such inode or name), so the
callers do not know which session serves them.

This module goes once pyfuse3 does (docs/design.md, "The mount's own FUSE session").
"""

from __future__ import annotations

import errno

import pyfuse3

from .fuse import notify as _notify
from .fuse.replies import Attr, DirentBuffer, Entry
from .fuse.session import Session

_session: Session | None = None


def use_session(session: Session | None) -> None:
    """Route the calls below to ``session`` (None: back to pyfuse3)."""
    global _session
    _session = session


def _sent(ok: bool, what: str) -> None:
    if not ok:  # the kernel had nothing to do (ENOENT), or the connection is gone
        raise OSError(errno.ENOENT, f"{what}: not in the kernel's caches")


def invalidate_inode(inode: int, attr_only: bool = False) -> None:
    if _session is None:
        pyfuse3.invalidate_inode(inode, attr_only=attr_only)
    else:
        _sent(_session.notify(_notify.inval_inode(inode, -1 if attr_only else 0, 0)), f"inode {inode}")


def invalidate_entry(parent: int, name: bytes) -> None:
    if _session is None:
        pyfuse3.invalidate_entry(parent, name)
    else:
        _sent(_session.notify(_notify.inval_entry(parent, name)), f"name {name!r} in {parent}")


def notify_store(inode: int, offset: int, data: bytes) -> None:
    if _session is None:
        pyfuse3.notify_store(inode, offset, data)
    else:
        _sent(_session.notify(_notify.store(inode, offset, data)), f"inode {inode}")


class ReaddirToken:
    """What the own session hands a pyfuse3-shaped ``readdir`` as its token: a READDIR(PLUS) buffer."""

    __slots__ = ("buf",)

    def __init__(self, buf: DirentBuffer):
        self.buf = buf


def entry_of(attrs) -> Entry:
    """A pyfuse3 ``EntryAttributes`` (or anything with its fields) as the own session's Entry."""
    return Entry(attrs.st_ino, attr_of(attrs), attrs.entry_timeout, attrs.attr_timeout, attrs.generation)


def attr_of(attrs) -> Attr:
    return Attr(ino=attrs.st_ino, mode=attrs.st_mode, nlink=attrs.st_nlink, uid=attrs.st_uid, gid=attrs.st_gid,
                size=attrs.st_size, blocks=attrs.st_blocks, atime_ns=attrs.st_atime_ns, mtime_ns=attrs.st_mtime_ns,
                ctime_ns=attrs.st_ctime_ns, rdev=attrs.st_rdev, blksize=attrs.st_blksize)


def readdir_reply(token, name: bytes, attrs, next_id: int) -> bool:
    """pyfuse3.readdir_reply, or the own session's: False when the kernel's buffer is full (the entry
    was not added; the next READDIR starts at it)."""
    if type(token) is not ReaddirToken:
        return pyfuse3.readdir_reply(token, name, attrs, next_id)
    return token.buf.add(name, next_id, attrs.st_ino, attrs.st_mode, entry_of(attrs) if token.buf.plus else None)
