"""Notifications: messages the server sends the kernel unasked (unique 0, the code in ``error``).

Encoders only (iovecs, no I/O) and the capability gates that say whether the connection can
take them; the session writes them (``Session.notify``). What each asks of the kernel:

* ``inval_inode``: drop cached pages of a range (or, with ``offset`` -1, only the attributes);
* ``inval_entry``: forget a name's lookup (with ``expire_only`` it merely expires, 7.38);
* ``delete``: a name is gone, and the kernel may prune its dentry from a busy directory (7.18);
* ``store``: put bytes into a file's page cache, as if read (7.15), so a later read of them
  sends nothing;
* ``retrieve``: ask for a file's cached pages back; the kernel answers with a NOTIFY_REPLY request
  carrying ``notify_unique`` (7.15).

An invalidation the kernel answers ENOENT (it holds no such inode or name) has nothing to do
and counts as done. Never send one while holding a lock that a request handler may need: the
kernel may wait on a request in flight (a write back under writeback caching) before it answers.
"""

from __future__ import annotations

from . import abi
from .abi import InitFlag, NotifyCode

_OUT = abi.FUSE_OUT_HEADER

#: the minor that introduced each notification
MIN_MINOR = {
    NotifyCode.POLL: 11,
    NotifyCode.INVAL_INODE: 12,
    NotifyCode.INVAL_ENTRY: 12,
    NotifyCode.STORE: 15,
    NotifyCode.RETRIEVE: 15,
    NotifyCode.DELETE: 18,
}


class NotSupported(Exception):
    """The connection cannot take this notification: it has nothing to gain from trying."""


def check(code: NotifyCode, minor: int, flags: int, expire_only: bool = False) -> None:
    """Raise :class:`NotSupported` unless a connection at ``minor`` with ``flags`` takes ``code``."""
    need = MIN_MINOR.get(code)
    if need is None or minor < need:
        raise NotSupported(f"{code.name} needs protocol 7.{need}, the connection speaks 7.{minor}")
    if expire_only and not flags & InitFlag.HAS_EXPIRE_ONLY:
        raise NotSupported("INVAL_ENTRY with EXPIRE_ONLY needs the kernel's HAS_EXPIRE_ONLY")


def _message(code: NotifyCode, *parts: bytes) -> list[bytes]:
    return [_OUT.pack(_OUT.size + sum(map(len, parts)), int(code), 0), *parts]


def inval_inode(ino: int, offset: int = 0, length: int = 0) -> list[bytes]:
    """Drop ``ino``'s pages from ``offset`` for ``length`` bytes (0: to the end) and its attributes;
    ``offset`` -1 drops the attributes only."""
    return _message(NotifyCode.INVAL_INODE, abi.FUSE_NOTIFY_INVAL_INODE_OUT.pack(ino, offset, length))


def inval_entry(parent: int, name: bytes, expire_only: bool = False) -> list[bytes]:
    flags = abi.InvalEntryFlag.EXPIRE_ONLY if expire_only else 0
    return _message(NotifyCode.INVAL_ENTRY, abi.FUSE_NOTIFY_INVAL_ENTRY_OUT.pack(parent, len(name), flags),
                    name + b"\0")


def delete(parent: int, child: int, name: bytes) -> list[bytes]:
    return _message(NotifyCode.DELETE, abi.FUSE_NOTIFY_DELETE_OUT.pack(parent, child, len(name), 0), name + b"\0")


def store(nodeid: int, offset: int, data: bytes) -> list[bytes]:
    """Put ``data`` into ``nodeid``'s page cache at ``offset`` (the file grows if it ends beyond)."""
    return _message(NotifyCode.STORE, abi.FUSE_NOTIFY_STORE_OUT.pack(nodeid, offset, len(data), 0), data)


def retrieve(notify_unique: int, nodeid: int, offset: int, size: int) -> list[bytes]:
    return _message(NotifyCode.RETRIEVE, abi.FUSE_NOTIFY_RETRIEVE_OUT.pack(notify_unique, nodeid, offset, size, 0))
