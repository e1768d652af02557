"""Requests from the kernel: bytes read from /dev/fuse to frozen request objects. No I/O.

One request is one read of the device: a ``fuse_in_header``, the opcode's fixed argument
struct, then NUL-terminated names, then any payload (WRITE data, xattr values, extensions).
:func:`parse` decodes it through one table indexed by opcode, built once at import.

Every request type is a ``NamedTuple`` (immutable, and as cheap to build as a tuple: the parser
runs on the reader thread for every request, hot ones included) whose first field is the
:class:`InHeader`. Names and data are copied out of the read buffer, so a request may outlive
the read that brought it (a handler running in trio while the reader reads the next one).

Failure policy, decided here once:

* a header that is short, or whose ``len`` is not the number of bytes read, means the two sides
  no longer agree on framing: :class:`BadHeader` is raised and the session ends;
* an opcode this package does not know, or knows and does not serve, parses as
  :class:`Unsupported`, answered ENOSYS (the kernel then stops sending most of them);
* arguments shorter than their struct, a name without its NUL, or a payload whose size is not
  the one the struct announces parse as :class:`Malformed` with EIO, answered to that request
  alone; an offset past 2**63-1 likewise, with EINVAL;
* a BATCH_FORGET whose count is larger than what follows is applied as far as it goes (the
  kernel cannot be asked again, and each forget is independent of the others).
"""

from __future__ import annotations

import errno
import struct
from typing import Callable, NamedTuple

from . import abi
from .abi import Opcode

_H = abi.FUSE_IN_HEADER
_H_SIZE = _H.size
#: the header without its padding: unpacks straight into InHeader's 8 fields
_H8 = struct.Struct(_H.format[:-1] + "2x")
assert _H8.size == _H_SIZE
#: NamedTuples are built with tuple.__new__ on the hot path: their generated __new__ is a Python call
_new = tuple.__new__
_GETATTR_IN, _READ_IN = abi.FUSE_GETATTR_IN, abi.FUSE_READ_IN
_MAX_OFFSET = abi.MAX_OFFSET


class BadHeader(Exception):
    """The bytes read are no FUSE request: the session cannot go on with this device."""


class InHeader(NamedTuple):
    len: int
    opcode: int
    unique: int
    nodeid: int
    uid: int
    gid: int
    pid: int
    total_extlen: int  # 7.38: 8-byte units of extensions after the arguments (stripped by the parser)


# -- request types, one per wire shape ----------------------------------------------------------


class Lookup(NamedTuple):
    header: InHeader
    name: bytes


class Forget(NamedTuple):
    header: InHeader  # header.nodeid is the inode
    nlookup: int


class BatchForget(NamedTuple):
    header: InHeader
    forgets: tuple[tuple[int, int], ...]  # (nodeid, nlookup) pairs
    complete: bool  # False: the count announced more than the request held (applied as far as it goes)


class Getattr(NamedTuple):
    header: InHeader
    flags: int  # GetattrFlag.FH: fh is set
    fh: int


class Setattr(NamedTuple):
    header: InHeader
    valid: int  # SetattrValid: which fields below are set
    fh: int
    size: int
    lock_owner: int
    atime: int
    mtime: int
    ctime: int
    atimensec: int
    mtimensec: int
    ctimensec: int
    mode: int
    uid: int
    gid: int


class Readlink(NamedTuple):
    header: InHeader


class Symlink(NamedTuple):
    header: InHeader
    name: bytes
    target: bytes


class Mknod(NamedTuple):
    header: InHeader
    mode: int
    rdev: int
    umask: int
    name: bytes


class Mkdir(NamedTuple):
    header: InHeader
    mode: int
    umask: int
    name: bytes


class Unlink(NamedTuple):
    """UNLINK and RMDIR."""

    header: InHeader
    name: bytes


class Rename(NamedTuple):
    """RENAME and RENAME2 (flags 0 for the first)."""

    header: InHeader
    newdir: int
    flags: int  # RENAME_NOREPLACE, RENAME_EXCHANGE, ...
    name: bytes
    newname: bytes


class Link(NamedTuple):
    header: InHeader  # header.nodeid is the new parent
    oldnodeid: int
    newname: bytes


class Open(NamedTuple):
    """OPEN and OPENDIR."""

    header: InHeader
    flags: int  # the open(2) flags
    open_flags: int  # FUSE_OPEN_KILL_SUIDGID (7.33)


class Read(NamedTuple):
    """READ, READDIR and READDIRPLUS (offset is the directory cookie for the last two)."""

    header: InHeader
    fh: int
    offset: int
    size: int
    read_flags: int
    lock_owner: int
    flags: int


class Write(NamedTuple):
    header: InHeader
    fh: int
    offset: int
    size: int
    write_flags: int
    lock_owner: int
    flags: int
    data: bytes


class Statfs(NamedTuple):
    header: InHeader


class Release(NamedTuple):
    """RELEASE and RELEASEDIR."""

    header: InHeader
    fh: int
    flags: int
    release_flags: int
    lock_owner: int


class Fsync(NamedTuple):
    """FSYNC and FSYNCDIR."""

    header: InHeader
    fh: int
    fsync_flags: int


class Setxattr(NamedTuple):
    header: InHeader
    size: int
    flags: int  # XATTR_CREATE, XATTR_REPLACE
    setxattr_flags: int  # only with SETXATTR_EXT
    name: bytes
    value: bytes


class Getxattr(NamedTuple):
    header: InHeader
    size: int  # 0: the caller asks for the value's size only
    name: bytes


class Listxattr(NamedTuple):
    header: InHeader
    size: int  # 0: the caller asks for the list's size only


class Removexattr(NamedTuple):
    header: InHeader
    name: bytes


class Flush(NamedTuple):
    header: InHeader
    fh: int
    lock_owner: int


class Init(NamedTuple):
    header: InHeader
    major: int
    minor: int
    max_readahead: int
    flags: int  # flags | flags2 << 32 (flags2 only with INIT_EXT)


class Lk(NamedTuple):
    """GETLK, SETLK and SETLKW."""

    header: InHeader
    fh: int
    owner: int
    start: int
    end: int
    type: int
    pid: int
    lk_flags: int  # LkFlag.FLOCK


class Access(NamedTuple):
    header: InHeader
    mask: int


class Create(NamedTuple):
    header: InHeader
    flags: int
    mode: int
    umask: int
    open_flags: int
    name: bytes


class Interrupt(NamedTuple):
    header: InHeader
    target: int  # the unique id of the request to interrupt


class Bmap(NamedTuple):
    header: InHeader
    block: int
    blocksize: int


class Destroy(NamedTuple):
    header: InHeader


class Ioctl(NamedTuple):
    header: InHeader
    fh: int
    flags: int
    cmd: int
    arg: int
    in_size: int
    out_size: int
    data: bytes


class Poll(NamedTuple):
    header: InHeader
    fh: int
    kh: int
    flags: int
    events: int


class NotifyReply(NamedTuple):
    """The kernel's answer to a NOTIFY_RETRIEVE: header.unique is the notification's notify_unique."""

    header: InHeader
    offset: int
    size: int
    data: bytes


class Fallocate(NamedTuple):
    header: InHeader
    fh: int
    offset: int
    length: int
    mode: int


class Lseek(NamedTuple):
    header: InHeader
    fh: int
    offset: int
    whence: int


class CopyFileRange(NamedTuple):
    header: InHeader
    fh_in: int
    off_in: int
    nodeid_out: int
    fh_out: int
    off_out: int
    len: int
    flags: int


class Syncfs(NamedTuple):
    header: InHeader


class Unsupported(NamedTuple):
    """An opcode this package does not serve: answered ENOSYS."""

    header: InHeader


class Malformed(NamedTuple):
    """A request whose arguments do not parse: answered ``errno`` (EIO, or EINVAL for an offset)."""

    header: InHeader
    errno: int
    reason: str


# -- parsing -----------------------------------------------------------------------------------


class ParseContext(NamedTuple):
    """What the negotiated connection changes about request layouts."""

    minor: int = abi.KERNEL_MINOR
    setxattr_ext: bool = False  # SETXATTR_EXT negotiated: fuse_setxattr_in is 16 bytes


class _Short(Exception):
    """Arguments end before their struct or name does (EIO)."""


class _BadOffset(Exception):
    """An offset past 2**63-1 (EINVAL)."""


def _fixed(s, buf, off: int, end: int) -> tuple:
    if off + s.size > end:
        raise _Short(f"{s.size}-byte arguments in {end - off} bytes")
    return s.unpack_from(buf, off)


def _name(buf, off: int, end: int) -> tuple[bytes, int]:
    """The NUL-terminated name at ``off`` and where the next field starts."""
    nul = buf.find(b"\0", off, end)
    if nul < 0:
        raise _Short("a name without its NUL")
    return bytes(buf[off:nul]), nul + 1


def _payload(buf, off: int, end: int) -> bytes:
    """A copy of the payload (one copy: a slice of a bytearray would be a second)."""
    return bytes(memoryview(buf)[off:end])


def _offset(*offsets: int) -> None:
    for o in offsets:
        if o > _MAX_OFFSET:
            raise _BadOffset(f"offset {o} past 2**63-1")


def _p_lookup(h, buf, off, end, ctx):
    nul = buf.find(b"\0", off, end)
    if nul < 0:
        raise _Short("a name without its NUL")
    return _new(Lookup, (h, bytes(buf[off:nul])))


def _p_forget(h, buf, off, end, ctx):
    return Forget(h, _fixed(abi.FUSE_FORGET_IN, buf, off, end)[0])


def _p_batch_forget(h, buf, off, end, ctx):
    count, _ = _fixed(abi.FUSE_BATCH_FORGET_IN, buf, off, end)
    off += abi.FUSE_BATCH_FORGET_IN.size
    one = abi.FUSE_FORGET_ONE
    held = (end - off) // one.size
    n = min(count, held)
    forgets = tuple(one.unpack_from(buf, off + i * one.size) for i in range(n))
    return BatchForget(h, forgets, n == count)


def _p_getattr(h, buf, off, end, ctx):
    if off + 16 > end:
        raise _Short(f"16-byte arguments in {end - off} bytes")
    flags, _, fh = _GETATTR_IN.unpack_from(buf, off)
    return _new(Getattr, (h, flags, fh))


def _p_setattr(h, buf, off, end, ctx):
    (valid, _, fh, size, lock_owner, atime, mtime, ctime, atimensec, mtimensec, ctimensec, mode, _,
     uid, gid, _) = _fixed(abi.FUSE_SETATTR_IN, buf, off, end)
    return Setattr(h, valid, fh, size, lock_owner, atime, mtime, ctime, atimensec, mtimensec, ctimensec,
                   mode, uid, gid)


def _p_header_only(cls):
    def parse(h, buf, off, end, ctx):
        return cls(h)
    return parse


def _p_symlink(h, buf, off, end, ctx):
    name, off = _name(buf, off, end)
    target, _ = _name(buf, off, end)
    return Symlink(h, name, target)


def _p_mknod(h, buf, off, end, ctx):
    mode, rdev, umask, _ = _fixed(abi.FUSE_MKNOD_IN, buf, off, end)
    return Mknod(h, mode, rdev, umask, _name(buf, off + abi.FUSE_MKNOD_IN.size, end)[0])


def _p_mkdir(h, buf, off, end, ctx):
    mode, umask = _fixed(abi.FUSE_MKDIR_IN, buf, off, end)
    return Mkdir(h, mode, umask, _name(buf, off + abi.FUSE_MKDIR_IN.size, end)[0])


def _p_unlink(h, buf, off, end, ctx):
    return Unlink(h, _name(buf, off, end)[0])


def _p_rename(h, buf, off, end, ctx):
    (newdir,) = _fixed(abi.FUSE_RENAME_IN, buf, off, end)
    name, off = _name(buf, off + abi.FUSE_RENAME_IN.size, end)
    return Rename(h, newdir, 0, name, _name(buf, off, end)[0])


def _p_rename2(h, buf, off, end, ctx):
    newdir, flags, _ = _fixed(abi.FUSE_RENAME2_IN, buf, off, end)
    name, off = _name(buf, off + abi.FUSE_RENAME2_IN.size, end)
    return Rename(h, newdir, flags, name, _name(buf, off, end)[0])


def _p_link(h, buf, off, end, ctx):
    (oldnodeid,) = _fixed(abi.FUSE_LINK_IN, buf, off, end)
    return Link(h, oldnodeid, _name(buf, off + abi.FUSE_LINK_IN.size, end)[0])


def _p_open(h, buf, off, end, ctx):
    flags, open_flags = _fixed(abi.FUSE_OPEN_IN, buf, off, end)
    return Open(h, flags, open_flags)


def _p_read(h, buf, off, end, ctx):
    if off + 40 > end:
        raise _Short(f"40-byte arguments in {end - off} bytes")
    fh, offset, size, read_flags, lock_owner, flags, _ = _READ_IN.unpack_from(buf, off)
    if offset > _MAX_OFFSET:
        raise _BadOffset(f"offset {offset} past 2**63-1")
    return _new(Read, (h, fh, offset, size, read_flags, lock_owner, flags))


def _p_write(h, buf, off, end, ctx):
    fh, offset, size, write_flags, lock_owner, flags, _ = _fixed(abi.FUSE_WRITE_IN, buf, off, end)
    _offset(offset, offset + size)
    off += abi.FUSE_WRITE_IN.size
    if end - off != size:
        raise _Short(f"WRITE announces {size} bytes and carries {end - off}")
    return Write(h, fh, offset, size, write_flags, lock_owner, flags, _payload(buf, off, end))


def _p_release(h, buf, off, end, ctx):
    fh, flags, release_flags, lock_owner = _fixed(abi.FUSE_RELEASE_IN, buf, off, end)
    return Release(h, fh, flags, release_flags, lock_owner)


def _p_fsync(h, buf, off, end, ctx):
    fh, fsync_flags, _ = _fixed(abi.FUSE_FSYNC_IN, buf, off, end)
    return Fsync(h, fh, fsync_flags)


def _p_setxattr(h, buf, off, end, ctx):
    if ctx.setxattr_ext:
        size, flags, setxattr_flags, _ = _fixed(abi.FUSE_SETXATTR_IN, buf, off, end)
        off += abi.FUSE_SETXATTR_IN.size
    else:
        size, flags = _fixed(abi.FUSE_SETXATTR_IN_COMPAT, buf, off, end)
        setxattr_flags = 0
        off += abi.FUSE_SETXATTR_IN_COMPAT.size
    name, off = _name(buf, off, end)
    if end - off != size:
        raise _Short(f"SETXATTR announces a {size}-byte value and carries {end - off}")
    return Setxattr(h, size, flags, setxattr_flags, name, _payload(buf, off, end))


def _p_getxattr(h, buf, off, end, ctx):
    size, _ = _fixed(abi.FUSE_GETXATTR_IN, buf, off, end)
    return Getxattr(h, size, _name(buf, off + abi.FUSE_GETXATTR_IN.size, end)[0])


def _p_listxattr(h, buf, off, end, ctx):
    return Listxattr(h, _fixed(abi.FUSE_GETXATTR_IN, buf, off, end)[0])


def _p_removexattr(h, buf, off, end, ctx):
    return Removexattr(h, _name(buf, off, end)[0])


def _p_flush(h, buf, off, end, ctx):
    fh, _, _, lock_owner = _fixed(abi.FUSE_FLUSH_IN, buf, off, end)
    return Flush(h, fh, lock_owner)


def _p_init(h, buf, off, end, ctx):
    major, minor, max_readahead, flags = _fixed(abi.FUSE_INIT_IN_COMPAT, buf, off, end)
    if flags & abi.InitFlag.INIT_EXT and end - off >= abi.FUSE_INIT_IN.size:
        flags |= abi.FUSE_INIT_IN.unpack_from(buf, off)[4] << 32
    return Init(h, major, minor, max_readahead, flags)


def _p_lk(h, buf, off, end, ctx):
    fh, owner, start, lk_end, type_, pid, lk_flags, _ = _fixed(abi.FUSE_LK_IN, buf, off, end)
    return Lk(h, fh, owner, start, lk_end, type_, pid, lk_flags)


def _p_access(h, buf, off, end, ctx):
    return Access(h, _fixed(abi.FUSE_ACCESS_IN, buf, off, end)[0])


def _p_create(h, buf, off, end, ctx):
    flags, mode, umask, open_flags = _fixed(abi.FUSE_CREATE_IN, buf, off, end)
    return Create(h, flags, mode, umask, open_flags, _name(buf, off + abi.FUSE_CREATE_IN.size, end)[0])


def _p_interrupt(h, buf, off, end, ctx):
    return Interrupt(h, _fixed(abi.FUSE_INTERRUPT_IN, buf, off, end)[0])


def _p_bmap(h, buf, off, end, ctx):
    block, blocksize, _ = _fixed(abi.FUSE_BMAP_IN, buf, off, end)
    return Bmap(h, block, blocksize)


def _p_ioctl(h, buf, off, end, ctx):
    fh, flags, cmd, arg, in_size, out_size = _fixed(abi.FUSE_IOCTL_IN, buf, off, end)
    off += abi.FUSE_IOCTL_IN.size
    if end - off != in_size:
        raise _Short(f"IOCTL announces {in_size} bytes in and carries {end - off}")
    return Ioctl(h, fh, flags, cmd, arg, in_size, out_size, _payload(buf, off, end))


def _p_poll(h, buf, off, end, ctx):
    fh, kh, flags, events = _fixed(abi.FUSE_POLL_IN, buf, off, end)
    return Poll(h, fh, kh, flags, events)


def _p_notify_reply(h, buf, off, end, ctx):
    _, offset, size, _, _, _ = _fixed(abi.FUSE_NOTIFY_RETRIEVE_IN, buf, off, end)
    off += abi.FUSE_NOTIFY_RETRIEVE_IN.size
    if end - off != size:
        raise _Short(f"NOTIFY_REPLY announces {size} bytes and carries {end - off}")
    return NotifyReply(h, offset, size, _payload(buf, off, end))


def _p_fallocate(h, buf, off, end, ctx):
    fh, offset, length, mode, _ = _fixed(abi.FUSE_FALLOCATE_IN, buf, off, end)
    _offset(offset, length, offset + length)
    return Fallocate(h, fh, offset, length, mode)


def _p_lseek(h, buf, off, end, ctx):
    fh, offset, whence, _ = _fixed(abi.FUSE_LSEEK_IN, buf, off, end)
    _offset(offset)
    return Lseek(h, fh, offset, whence)


def _p_copy_file_range(h, buf, off, end, ctx):
    args = _fixed(abi.FUSE_COPY_FILE_RANGE_IN, buf, off, end)
    _offset(args[1], args[4])
    return CopyFileRange(h, *args)


def _p_syncfs(h, buf, off, end, ctx):
    _fixed(abi.FUSE_SYNCFS_IN, buf, off, end)
    return Syncfs(h)


Parser = Callable[[InHeader, "bytes | bytearray", int, int, ParseContext], NamedTuple]

#: the one table: opcode -> parser (None: Unsupported, answered ENOSYS)
PARSERS: list[Parser | None] = [None] * (max(Opcode) + 1)
for _op, _parser in {
    Opcode.LOOKUP: _p_lookup,
    Opcode.FORGET: _p_forget,
    Opcode.GETATTR: _p_getattr,
    Opcode.SETATTR: _p_setattr,
    Opcode.READLINK: _p_header_only(Readlink),
    Opcode.SYMLINK: _p_symlink,
    Opcode.MKNOD: _p_mknod,
    Opcode.MKDIR: _p_mkdir,
    Opcode.UNLINK: _p_unlink,
    Opcode.RMDIR: _p_unlink,
    Opcode.RENAME: _p_rename,
    Opcode.LINK: _p_link,
    Opcode.OPEN: _p_open,
    Opcode.READ: _p_read,
    Opcode.WRITE: _p_write,
    Opcode.STATFS: _p_header_only(Statfs),
    Opcode.RELEASE: _p_release,
    Opcode.FSYNC: _p_fsync,
    Opcode.SETXATTR: _p_setxattr,
    Opcode.GETXATTR: _p_getxattr,
    Opcode.LISTXATTR: _p_listxattr,
    Opcode.REMOVEXATTR: _p_removexattr,
    Opcode.FLUSH: _p_flush,
    Opcode.INIT: _p_init,
    Opcode.OPENDIR: _p_open,
    Opcode.READDIR: _p_read,
    Opcode.RELEASEDIR: _p_release,
    Opcode.FSYNCDIR: _p_fsync,
    Opcode.GETLK: _p_lk,
    Opcode.SETLK: _p_lk,
    Opcode.SETLKW: _p_lk,
    Opcode.ACCESS: _p_access,
    Opcode.CREATE: _p_create,
    Opcode.INTERRUPT: _p_interrupt,
    Opcode.BMAP: _p_bmap,
    Opcode.DESTROY: _p_header_only(Destroy),
    Opcode.IOCTL: _p_ioctl,
    Opcode.POLL: _p_poll,
    Opcode.NOTIFY_REPLY: _p_notify_reply,
    Opcode.BATCH_FORGET: _p_batch_forget,
    Opcode.FALLOCATE: _p_fallocate,
    Opcode.READDIRPLUS: _p_read,
    Opcode.RENAME2: _p_rename2,
    Opcode.LSEEK: _p_lseek,
    Opcode.COPY_FILE_RANGE: _p_copy_file_range,
    Opcode.SYNCFS: _p_syncfs,
    # not served (ENOSYS; the kernel then falls back or stops asking): SETUPMAPPING, REMOVEMAPPING
    # (virtiofs DAX only), TMPFILE (O_TMPFILE fails EOPNOTSUPP), STATX (the kernel asks GETATTR),
    # COPY_FILE_RANGE_64 (the kernel asks COPY_FILE_RANGE)
}.items():
    PARSERS[_op] = _parser
del _op, _parser
_N_PARSERS = len(PARSERS)


def parse_header(buf, n: int) -> InHeader:
    """The header of the ``n`` bytes read into ``buf``; :class:`BadHeader` if they cannot be a request."""
    if n < _H_SIZE:
        raise BadHeader(f"read {n} bytes, a request header is {_H_SIZE}")
    length, opcode, unique, nodeid, uid, gid, pid, total_extlen, _ = _H.unpack_from(buf, 0)
    if length != n:
        raise BadHeader(f"request {unique} (opcode {opcode}) says it is {length} bytes, the read returned {n}")
    if _H_SIZE + total_extlen * 8 > n:
        raise BadHeader(f"request {unique} (opcode {opcode}) announces {total_extlen * 8} bytes of extensions "
                        f"in {n - _H_SIZE} bytes of arguments")
    return InHeader(length, opcode, unique, nodeid, uid, gid, pid, total_extlen)


def parse(buf, n: int, ctx: ParseContext = ParseContext()):
    """The request in the first ``n`` bytes of ``buf`` (bytes or bytearray): one of the types above,
    :class:`Unsupported` or :class:`Malformed`. Raises :class:`BadHeader` only."""
    if n < _H_SIZE:
        raise BadHeader(f"read {n} bytes, a request header is {_H_SIZE}")
    h = _new(InHeader, _H8.unpack_from(buf, 0))
    if h[0] != n or _H_SIZE + h[7] * 8 > n:
        parse_header(buf, n)  # says what is wrong
    opcode = h[1]
    parser = PARSERS[opcode] if opcode < _N_PARSERS else None
    if parser is None:
        return _new(Unsupported, (h,))
    try:
        return parser(h, buf, _H_SIZE, n - h[7] * 8, ctx)
    except _Short as e:
        return Malformed(h, errno.EIO, str(e))
    except _BadOffset as e:
        return Malformed(h, errno.EINVAL, str(e))
