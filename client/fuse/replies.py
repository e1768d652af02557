"""Answers to the kernel: results to iovecs, and the reply object each request is answered with. No I/O.

A reply is one write of the device: ``fuse_out_header`` (len, error as a negative errno or 0,
the request's unique id) and the opcode's result struct(s). The encoders here turn results
(:class:`Attr`, :class:`Entry`, bytes, ...) into the bytes of those structs; :class:`Reply`
puts the header in front and hands the iovec to the ``send`` callable the session gave it
(the device's ``writev``), which keeps this module free of I/O and byte-exact in tests.

One :class:`Reply` per request, answered exactly once: a second answer raises
:class:`AlreadyAnswered` (two answers to one unique id would make the kernel answer a request it
has already completed with EINVAL, or worse, a later request that reused the id). Replies are
answered from the thread that holds them; the session never answers one behind the back of a
handler that still holds it (an INTERRUPT only asks the handler to stop).

Directory listings: :class:`DirentBuffer` packs ``fuse_dirent`` (READDIR) or ``fuse_direntplus``
(READDIRPLUS, entry and attributes with each name) records into the size the kernel asked
for, each record padded to 8 bytes; an entry that does not fit is left for the next READDIR,
which starts at the ``off`` cookie of the last entry packed.
"""

from __future__ import annotations

import errno as _errno
import os as _os
import stat
import struct
from typing import Callable, NamedTuple, Sequence

from . import abi

_OUT = abi.FUSE_OUT_HEADER
_OUT_SIZE = _OUT.size
_ATTR = abi.FUSE_ATTR
_ENTRY_HEAD = abi.FUSE_ENTRY_OUT_HEAD
_ATTR_HEAD = abi.FUSE_ATTR_OUT_HEAD
_DIRENT = abi.FUSE_DIRENT
#: fuse_attr_out and fuse_entry_out packed whole (one pack per reply on the hot path, no concatenation)
_ATTR_OUT = struct.Struct(abi.FUSE_ATTR_OUT_HEAD.format + abi.FUSE_ATTR.format[1:])
_ENTRY_OUT = struct.Struct(abi.FUSE_ENTRY_OUT_HEAD.format + abi.FUSE_ATTR.format[1:])
assert _ATTR_OUT.size == abi.ATTR_OUT_SIZE and _ENTRY_OUT.size == abi.ENTRY_OUT_SIZE
_NS = 1_000_000_000
_U64 = (1 << 64) - 1

#: how a reply is sent: ``send(unique, iovec)`` (the session writes it and notes the request done)
Send = Callable[[int, Sequence[bytes]], None]


class FuseError(OSError):
    """A request's answer is this error (``FuseError(errno.ENOENT)``): what a file system raises for
    the dispatcher to answer (dispatch.py), told apart from an OSError of its own doing, which is a
    fault (logged, answered EIO) rather than an answer."""

    def __init__(self, err: int):
        message = _MESSAGES.get(err)
        if message is None:
            message = _MESSAGES[err] = _os.strerror(err) if 0 < err < 4096 else f"errno {err}"
        super().__init__(err, message)


#: errno -> its message, looked up once (os.strerror was a tenth of a hot IOCTL's time)
_MESSAGES: dict[int, str] = {}


class AlreadyAnswered(RuntimeError):
    """A request was answered twice: a bug in whoever answered it."""


class Attr(NamedTuple):
    """A file's attributes as the kernel keeps them (``fuse_attr``), times in nanoseconds."""

    ino: int
    mode: int
    nlink: int = 1
    uid: int = 0
    gid: int = 0
    size: int = 0
    blocks: int = 0  # 512-byte blocks
    atime_ns: int = 0
    mtime_ns: int = 0
    ctime_ns: int = 0
    rdev: int = 0
    blksize: int = 0  # 0: the kernel uses the page size
    flags: int = 0  # AttrFlag (7.32)


class Entry(NamedTuple):
    """A LOOKUP's answer (and CREATE's, MKDIR's, ...): the inode, its generation and how long the
    kernel may keep the name and the attributes without asking again (seconds)."""

    nodeid: int
    attr: Attr
    entry_valid: float = 1.0
    attr_valid: float = 1.0
    generation: int = 0


class Encoded(bytes):
    """A result already in its wire form (e.g. ``Encoded(encode_attr_out(attr, valid))``), answered as
    it is: a file system that keeps a hot inode's attributes can keep their bytes too, and its fast
    path then encodes nothing."""

    __slots__ = ()


class Failed(int):
    """A fast path's answer that is an error, returned instead of raised (``Failed(errno.ENOENT)``):
    answered as a raised ``FuseError`` would be. For errors a hot path answers all the time (a
    create's LOOKUP of its new name, once per file, on the reader thread), where raising and
    catching the exception through the bridge and the dispatcher was a fifth of the request."""

    __slots__ = ()


class Statfs(NamedTuple):
    blocks: int
    bfree: int
    bavail: int
    files: int
    ffree: int
    bsize: int
    namelen: int = 255
    frsize: int = 0  # 0: bsize


def _split(seconds: float) -> tuple[int, int]:
    if not seconds:
        return 0, 0
    whole = int(seconds)
    return whole, int((seconds - whole) * _NS)


def encode_error(unique: int, err: int) -> bytes:
    """The whole answer failing request ``unique`` with errno ``err`` (positive), or an empty
    success (``err`` 0): the out header alone."""
    return _OUT.pack(_OUT_SIZE, -err, unique)


def encode_attr(a: Attr) -> bytes:
    """``fuse_attr`` (88 bytes)."""
    return _ATTR.pack(*_attr_fields(a))


def _attr_fields(a: Attr) -> tuple:
    asec, ansec = divmod(a.atime_ns, _NS)
    msec, mnsec = divmod(a.mtime_ns, _NS)
    csec, cnsec = divmod(a.ctime_ns, _NS)
    return (a.ino, a.size, a.blocks, asec & _U64, msec & _U64, csec & _U64, ansec, mnsec, cnsec,
            a.mode, a.nlink, a.uid, a.gid, a.rdev, a.blksize, a.flags)


def encode_entry(e: Entry) -> bytes:
    """``fuse_entry_out`` (128 bytes). A negative entry (nodeid 0) with an entry_valid makes the
    kernel keep the name's absence that long."""
    es, ens = _split(e.entry_valid)
    ats, atns = _split(e.attr_valid)
    return _ENTRY_OUT.pack(e.nodeid, e.generation, es, ats, ens, atns, *_attr_fields(e.attr))


def encode_held_entry(a, size: int, valid: float, blksize: int) -> bytes:
    """``encode_entry`` of the entry a file system answers for a name and attributes it holds
    long (both valid for ``valid``): protocol attributes ``a`` (ino, mode, nlink, uid, gid, rdev,
    the three times in ns, generation) with ``size`` (its blocks from it) and ``blksize``, packed
    at once, without the ``Attr`` and ``Entry`` made on the way: the same bytes (a cold walk's
    READDIRPLUS pages are one such entry per file)."""
    s, ns = _split(valid)
    asec, ansec = divmod(a.atime_ns, _NS)
    msec, mnsec = divmod(a.mtime_ns, _NS)
    csec, cnsec = divmod(a.ctime_ns, _NS)
    return _ENTRY_OUT.pack(a.ino, a.generation, s, s, ns, ns, a.ino, size, (size + 511) // 512, asec & _U64,
                           msec & _U64, csec & _U64, ansec, mnsec, cnsec, a.mode, a.nlink, a.uid, a.gid, a.rdev,
                           blksize, 0)


def encode_attr_out(a: Attr, valid: float) -> bytes:
    """``fuse_attr_out`` (104 bytes): GETATTR's and SETATTR's answer."""
    s, ns = _split(valid)
    return _ATTR_OUT.pack(s, ns, 0, *_attr_fields(a))


def encode_open(fh: int, open_flags: int = 0, backing_id: int = 0) -> bytes:
    """``fuse_open_out``: OPEN's, OPENDIR's (and CREATE's second) answer."""
    return abi.FUSE_OPEN_OUT.pack(fh, open_flags, backing_id)


def encode_statfs(s: Statfs) -> bytes:
    return abi.FUSE_KSTATFS.pack(s.blocks, s.bfree, s.bavail, s.files, s.ffree, s.bsize, s.namelen,
                                 s.frsize or s.bsize, 0)


def dirent_type(mode: int) -> int:
    """The DT_* of a mode: its S_IFMT bits shifted down (as the kernel's IFTODT)."""
    return stat.S_IFMT(mode) >> 12


#: READDIRPLUS's answer for a name whose attributes are not known true (nodeid 0: listed, no inode)
ZERO_ENTRY = bytes(abi.ENTRY_OUT_SIZE)


def dirent_record(name: bytes, off: int, ino: int, mode: int) -> bytes:
    """One ``fuse_dirent`` with its name and padding: a READDIR entry, and a READDIRPLUS entry's
    part after its ``fuse_entry_out`` (``DirentBuffer.add_record``)."""
    head = _DIRENT.size
    return _DIRENT.pack(ino, off, len(name), dirent_type(mode)) + name + bytes(abi.dirent_size(len(name), head) - head - len(name))


class DirentBuffer:
    """READDIR(PLUS) records packed into at most ``size`` bytes.

    ``off`` of each entry is the cookie the kernel passes back in the next READDIR's offset to
    continue after it; it must not be 0 (the start) and must keep its meaning across calls.
    """

    __slots__ = ("size", "plus", "_buf")

    def __init__(self, size: int, plus: bool = False):
        self.size, self.plus, self._buf = size, plus, bytearray()

    def add(self, name: bytes, off: int, ino: int, mode: int, entry: Entry | None = None) -> bool:
        """Append one entry; False (and nothing appended) if it does not fit in what is left.
        READDIRPLUS: ``entry`` is the name's LOOKUP answer (it counts as one); None sends a
        zero entry (nodeid 0: the kernel then only lists the name)."""
        head = abi.DIRENTPLUS_HEAD if self.plus else _DIRENT.size
        total = abi.dirent_size(len(name), head)
        if len(self._buf) + total > self.size:
            return False
        buf = self._buf
        if self.plus:
            buf += encode_entry(entry) if entry is not None else bytes(abi.ENTRY_OUT_SIZE)
        buf += _DIRENT.pack(ino, off, len(name), dirent_type(mode))
        buf += name
        buf += bytes(total - head - len(name))
        return True

    def add_record(self, record: bytes, entry: bytes | None = None) -> bool:
        """Append one entry already encoded (``dirent_record``); READDIRPLUS: ``entry`` is its
        ``encode_entry`` (None: a zero entry). False (and nothing appended) if it does not fit."""
        total = len(record) + (abi.ENTRY_OUT_SIZE if self.plus else 0)
        if len(self._buf) + total > self.size:
            return False
        if self.plus:
            self._buf += entry if entry is not None else ZERO_ENTRY
        self._buf += record
        return True

    def room(self) -> int:
        """Bytes still free."""
        return self.size - len(self._buf)

    def extend(self, parts: list[bytes]) -> None:
        """Append ``parts``, whole entries already in wire form (READDIRPLUS: each entry's
        ``fuse_entry_out`` then its record) that the caller fitted into ``room()``."""
        self._buf += b"".join(parts)

    def __len__(self) -> int:
        return len(self._buf)

    def getvalue(self) -> bytes:
        return bytes(self._buf)


def encode_init(minor: int, max_readahead: int, flags: int, max_background: int, congestion_threshold: int,
                max_write: int, time_gran: int = 1, max_pages: int = 0, max_stack_depth: int = 0,
                request_timeout: int = 0) -> bytes:
    """``fuse_init_out`` cut to the size a kernel at ``minor`` reads (:func:`abi.init_out_size`);
    flags above bit 31 go in flags2 (7.36, with INIT_EXT)."""
    full = abi.FUSE_INIT_OUT.pack(abi.KERNEL_MAJOR, minor, max_readahead, flags & 0xFFFFFFFF, max_background,
                                  congestion_threshold, max_write, time_gran, max_pages, 0,
                                  flags >> 32, max_stack_depth, request_timeout)
    return full[:abi.init_out_size(minor)]


def encode_init_version_only() -> bytes:
    """The answer to a kernel with a higher major: our version, so it sends INIT again at ours."""
    return abi.FUSE_INIT_OUT.pack(abi.KERNEL_MAJOR, abi.KERNEL_MINOR, *([0] * 11))[:8]


class Reply:
    """The one answer to request ``unique``, sent with ``send(unique, iovec)`` (the session's: the
    device's writev, and the request is no longer in flight).

    ``on_interrupt`` is set by whoever runs the request where an INTERRUPT can stop it (a trio
    task's cancel scope); the session calls it when the kernel interrupts this request.
    """

    __slots__ = ("unique", "sent", "on_interrupt", "_send")

    def __init__(self, unique: int, send: Send):
        self.unique = unique
        self.sent = False
        self.on_interrupt: Callable[[], None] | None = None
        self._send = send

    def _answer(self, error: int, parts: Sequence[bytes]) -> None:
        if self.sent:
            raise AlreadyAnswered(f"request {self.unique} was answered already")
        self.sent = True
        if not parts:
            self._send(self.unique, (encode_error(self.unique, -error),))
        elif len(parts) == 1:
            self._send(self.unique, (_OUT.pack(_OUT_SIZE + len(parts[0]), error, self.unique), parts[0]))
        else:
            self._send(self.unique, [_OUT.pack(_OUT_SIZE + sum(map(len, parts)), error, self.unique), *parts])

    # -- the answers -------------------------------------------------------------------------

    def error(self, err: int) -> None:
        """Fail the request with errno ``err`` (positive, as in ``errno``)."""
        if not 0 < err < 4096:
            err = _errno.EIO
        self._answer(-err, ())

    def ok(self, *parts: bytes) -> None:
        """Success with the given result bytes (none: an empty success, e.g. UNLINK's)."""
        self._answer(0, parts)

    def entry(self, e: Entry) -> None:
        self._answer(0, (encode_entry(e),))

    def attr(self, a: Attr, valid: float = 1.0) -> None:
        self._answer(0, (encode_attr_out(a, valid),))

    def open(self, fh: int, open_flags: int = 0, backing_id: int = 0) -> None:
        self._answer(0, (encode_open(fh, open_flags, backing_id),))

    def create(self, e: Entry, fh: int, open_flags: int = 0, backing_id: int = 0) -> None:
        self._answer(0, (encode_entry(e), encode_open(fh, open_flags, backing_id)))

    def data(self, data: bytes) -> None:
        """READ's bytes, READLINK's target, a READDIR buffer: the bytes as they are."""
        self._answer(0, (data,) if data else ())

    def write(self, size: int) -> None:
        self._answer(0, (abi.FUSE_WRITE_OUT.pack(size, 0),))

    def statfs(self, s: Statfs) -> None:
        self._answer(0, (encode_statfs(s),))

    def xattr(self, value: bytes, size: int) -> None:
        """GETXATTR's or LISTXATTR's answer to a caller with a ``size``-byte buffer: the value's
        size alone for size 0, ERANGE if it does not fit, else the value."""
        if size == 0:
            self._answer(0, (abi.FUSE_GETXATTR_OUT.pack(len(value), 0),))
        elif len(value) > size:
            self._answer(-_errno.ERANGE, ())
        else:
            self._answer(0, (value,) if value else ())

    def lock(self, start: int, end: int, type_: int, pid: int) -> None:
        self._answer(0, (abi.FUSE_FILE_LOCK.pack(start, end, type_, pid),))

    def bmap(self, block: int) -> None:
        self._answer(0, (abi.FUSE_BMAP_OUT.pack(block),))

    def lseek(self, offset: int) -> None:
        self._answer(0, (abi.FUSE_LSEEK_OUT.pack(offset),))

    def poll(self, revents: int) -> None:
        self._answer(0, (abi.FUSE_POLL_OUT.pack(revents, 0),))

    def ioctl(self, result: int, data: bytes = b"") -> None:
        """A restricted ioctl's answer: its return value and ``out_size`` bytes at most of output."""
        self._answer(0, (abi.FUSE_IOCTL_OUT.pack(result, 0, 0, 0), data) if data
                     else (abi.FUSE_IOCTL_OUT.pack(result, 0, 0, 0),))

    def init(self, body: bytes) -> None:
        self._answer(0, (body,))
