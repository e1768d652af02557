"""The FUSE device: one file descriptor of /dev/fuse (or, in tests, a SOCK_SEQPACKET socket).

Reads return one whole request each into the caller's buffer; writes send one whole reply or
notification with one ``writev`` (the kernel takes a message only whole, and a single call keeps
messages from two threads from interleaving). Errors are mapped once here:

* a read that fails with EINTR, EAGAIN (a non-blocking descriptor, or a clone with nothing yet)
  or ENOENT (the request was interrupted and withdrawn before it was read) is retried;
* ENODEV on read or write means the connection is gone (unmounted or aborted): :class:`Closed`;
  a read of 0 bytes (the peer of a socket closed) means the same;
* ENOENT on write means the kernel no longer waits for that request (interrupted, or the
  connection aborted it): the write reports False and nothing else happens.

Also the device's ioctls: ``clone`` (a second descriptor on the same connection, for a second
reader thread), ``backing_open``/``backing_close`` (passthrough, 7.40, root only) and ``alive``
(poll for POLLERR, which the kernel raises once the connection is gone: used before unmounting
by path, so a mount point that now holds another file system is left alone).
"""

from __future__ import annotations

import errno
import fcntl
import os
import select
import struct
from typing import Sequence

from . import abi

_RETRY = frozenset({errno.EINTR, errno.EAGAIN, errno.ENOENT})
_GONE = frozenset({errno.ENODEV, errno.ECONNABORTED, errno.EBADF, errno.EPIPE, errno.ECONNRESET})


class Closed(Exception):
    """The connection is gone: nothing more will be read, and replies go nowhere."""


class Device:
    __slots__ = ("fd", "_owned")

    def __init__(self, fd: int, owned: bool = True):
        self.fd, self._owned = fd, owned

    def fileno(self) -> int:
        return self.fd

    def read_into(self, buf: bytearray) -> int:
        """Block until a request arrives and read it whole into ``buf``; its size in bytes."""
        while True:
            try:
                n = os.readv(self.fd, (buf,))
            except OSError as e:
                if e.errno in _RETRY:
                    if e.errno == errno.EAGAIN:
                        select.select([self.fd], [], [], 1.0)
                    continue
                if e.errno in _GONE:
                    raise Closed(f"device read: {os.strerror(e.errno)}") from None
                raise
            if n == 0:
                raise Closed("device read: end of file")
            return n

    def writev(self, parts: Sequence[bytes]) -> bool:
        """Send one message; False if the kernel no longer waits for it (ENOENT)."""
        try:
            os.writev(self.fd, parts)
        except OSError as e:
            if e.errno == errno.ENOENT:
                return False
            if e.errno in _GONE:
                raise Closed(f"device write: {os.strerror(e.errno)}") from None
            raise
        return True

    def alive(self) -> bool:
        """False once the kernel has ended the connection (POLLERR on the device)."""
        p = select.poll()
        p.register(self.fd, select.POLLIN)
        try:
            events = p.poll(0)
        except OSError:
            return False
        return not any(ev & (select.POLLERR | select.POLLNVAL) for _, ev in events)

    def clone(self) -> "Device":
        """A new /dev/fuse descriptor attached to this one's connection (FUSE_DEV_IOC_CLONE)."""
        fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
        try:
            fcntl.ioctl(fd, abi.FUSE_DEV_IOC_CLONE, struct.pack("<I", self.fd))
        except BaseException:
            os.close(fd)
            raise
        return Device(fd)

    def backing_open(self, fd: int) -> int:
        """Register ``fd`` as a backing file for passthrough (7.40, root only); its backing id."""
        arg = bytearray(abi.FUSE_BACKING_MAP.pack(fd, 0, 0))
        return fcntl.ioctl(self.fd, abi.FUSE_DEV_IOC_BACKING_OPEN, arg, True)

    def backing_close(self, backing_id: int) -> None:
        fcntl.ioctl(self.fd, abi.FUSE_DEV_IOC_BACKING_CLOSE, bytearray(struct.pack("<I", backing_id)), True)

    def close(self) -> None:
        if self._owned and self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)
