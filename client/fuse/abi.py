"""The kernel's FUSE wire format: opcodes, flags and one ``struct.Struct`` per kernel struct.

The facts are those of the kernel's ``include/uapi/linux/fuse.h`` (protocol 7.45 on this
project's machines, kernel 6.18), written down here in Python; nothing else in the package
spells a byte offset. Every struct is little-endian with no implicit padding (the kernel pads
each struct to 64 bits itself), is named after its kernel struct, and has its size asserted
below at import, so a typo in a format string fails the first import rather than a mount.

Minor versions: the kernel and the server each send the highest minor they speak in INIT and
both then use the lower one. This package speaks :data:`KERNEL_MINOR` and refuses a kernel below
:data:`MIN_MINOR` (7.12, Linux 2.6.31: from there on every request struct the mount reads has its
full size, so the parser needs no per-minor layouts). What later minors changed is noted beside
each field or flag ("7.23: ...") where it matters to a reader of this package:

* the INIT reply grew twice: 8 bytes below 7.5, 24 bytes below 7.23, 64 bytes since
  (:func:`init_out_size`);
* ``fuse_init_in`` grew ``flags2`` and reserved words in 7.36 (:data:`FUSE_INIT_IN` is the full
  form; a kernel before 7.36 sends only :data:`FUSE_INIT_IN_COMPAT`);
* ``fuse_in_header.total_extlen`` (7.38) counts 8-byte units of extensions appended after a
  request's arguments (security contexts, supplementary groups): only sent when the server asked
  for them in INIT, and stripped by the parser either way;
* ``fuse_setxattr_in`` is 8 bytes unless the server negotiated ``SETXATTR_EXT`` (7.33);
* ``fuse_open_out.padding`` became ``backing_id`` (7.40, passthrough).
"""

from __future__ import annotations

import enum
import struct

KERNEL_MAJOR = 7
#: the highest minor this package speaks (the kernel's on this project's machines)
KERNEL_MINOR = 45
#: the lowest minor it accepts: see the module docstring
MIN_MINOR = 12
ROOT_ID = 1
#: the kernel refuses a read of /dev/fuse into a smaller buffer (EINVAL)
MIN_READ_BUFFER = 8192
PAGE_SIZE = 4096
#: unique ids with this bit set are requests the kernel re-sent after NOTIFY_RESEND (7.40, HAS_RESEND)
RESEND_BIT = 1 << 63
#: offsets are signed 64-bit in the kernel (loff_t): a larger one in a request is answered EINVAL
MAX_OFFSET = (1 << 63) - 1


class Opcode(enum.IntEnum):
    """``enum fuse_opcode``: what a request asks, in ``fuse_in_header.opcode``."""

    LOOKUP = 1
    FORGET = 2  # no reply
    GETATTR = 3
    SETATTR = 4
    READLINK = 5
    SYMLINK = 6
    MKNOD = 8
    MKDIR = 9
    UNLINK = 10
    RMDIR = 11
    RENAME = 12
    LINK = 13
    OPEN = 14
    READ = 15
    WRITE = 16
    STATFS = 17
    RELEASE = 18
    FSYNC = 20
    SETXATTR = 21
    GETXATTR = 22
    LISTXATTR = 23
    REMOVEXATTR = 24
    FLUSH = 25
    INIT = 26
    OPENDIR = 27
    READDIR = 28
    RELEASEDIR = 29
    FSYNCDIR = 30
    GETLK = 31
    SETLK = 32
    SETLKW = 33
    ACCESS = 34
    CREATE = 35
    INTERRUPT = 36  # no reply unless EAGAIN (not found yet)
    BMAP = 37
    DESTROY = 38
    IOCTL = 39  # 7.11
    POLL = 40  # 7.11
    NOTIFY_REPLY = 41  # 7.15: the answer to a NOTIFY_RETRIEVE; no reply
    BATCH_FORGET = 42  # 7.16; no reply
    FALLOCATE = 43  # 7.19
    READDIRPLUS = 44  # 7.21
    RENAME2 = 45  # 7.23
    LSEEK = 46  # 7.24
    COPY_FILE_RANGE = 47  # 7.28
    SETUPMAPPING = 48  # 7.31 (virtiofs DAX)
    REMOVEMAPPING = 49  # 7.31 (virtiofs DAX)
    SYNCFS = 50  # 7.34
    TMPFILE = 51  # 7.37
    STATX = 52  # 7.39
    COPY_FILE_RANGE_64 = 53  # 7.45


#: requests the kernel expects no reply to
NO_REPLY = frozenset({Opcode.FORGET, Opcode.BATCH_FORGET, Opcode.NOTIFY_REPLY})


class NotifyCode(enum.IntEnum):
    """``enum fuse_notify_code``: sent as ``fuse_out_header.error`` with unique 0."""

    POLL = 1  # 7.11
    INVAL_INODE = 2  # 7.12
    INVAL_ENTRY = 3  # 7.12
    STORE = 4  # 7.15
    RETRIEVE = 5  # 7.15
    DELETE = 6  # 7.18
    RESEND = 7  # 7.40
    INC_EPOCH = 8  # 7.44
    PRUNE = 9  # 7.45


class InitFlag(enum.IntFlag):
    """INIT request and reply flags (``fuse_init_in.flags`` | ``flags2`` << 32). The kernel offers
    what it supports; the server answers the subset it wants, and that is the connection's."""

    ASYNC_READ = 1 << 0  # several READs of one file in flight (readahead in parallel)
    POSIX_LOCKS = 1 << 1
    FILE_OPS = 1 << 2
    ATOMIC_O_TRUNC = 1 << 3
    EXPORT_SUPPORT = 1 << 4  # the server answers LOOKUP of "." and ".."
    BIG_WRITES = 1 << 5
    DONT_MASK = 1 << 6
    SPLICE_WRITE = 1 << 7
    SPLICE_MOVE = 1 << 8
    SPLICE_READ = 1 << 9
    FLOCK_LOCKS = 1 << 10  # 7.17
    HAS_IOCTL_DIR = 1 << 11  # 7.18
    AUTO_INVAL_DATA = 1 << 12  # 7.20: the kernel drops a file's pages when its mtime or size changes
    DO_READDIRPLUS = 1 << 13  # 7.21
    READDIRPLUS_AUTO = 1 << 14  # 7.21
    ASYNC_DIO = 1 << 15  # 7.22
    WRITEBACK_CACHE = 1 << 16  # 7.23
    NO_OPEN_SUPPORT = 1 << 17  # 7.23: OPEN answered ENOSYS means "never send OPEN (nor RELEASE) again"
    PARALLEL_DIROPS = 1 << 18  # 7.25: lookups and readdirs of one directory are not serialized
    HANDLE_KILLPRIV = 1 << 19  # 7.26
    POSIX_ACL = 1 << 20  # 7.26
    ABORT_ERROR = 1 << 21  # 7.27
    MAX_PAGES = 1 << 22  # 7.28: fuse_init_out.max_pages is read
    CACHE_SYMLINKS = 1 << 23  # 7.28
    NO_OPENDIR_SUPPORT = 1 << 24  # 7.29: OPENDIR answered ENOSYS means "never send OPENDIR again"
    EXPLICIT_INVAL_DATA = 1 << 25  # 7.30
    MAP_ALIGNMENT = 1 << 26  # 7.31
    SUBMOUNTS = 1 << 27  # 7.32
    HANDLE_KILLPRIV_V2 = 1 << 28  # 7.33
    SETXATTR_EXT = 1 << 29  # 7.33
    INIT_EXT = 1 << 30  # 7.36: fuse_init_in is the long form and flags2 is read
    INIT_RESERVED = 1 << 31
    # bits 32..63 travel in flags2 (7.36)
    SECURITY_CTX = 1 << 32
    HAS_INODE_DAX = 1 << 33
    CREATE_SUPP_GROUP = 1 << 34  # 7.38
    HAS_EXPIRE_ONLY = 1 << 35  # 7.38: NOTIFY_INVAL_ENTRY may carry EXPIRE_ONLY
    DIRECT_IO_ALLOW_MMAP = 1 << 36  # 7.39
    PASSTHROUGH = 1 << 37  # 7.40: OPEN may answer a backing file (FOPEN_PASSTHROUGH)
    NO_EXPORT_SUPPORT = 1 << 38  # 7.40
    HAS_RESEND = 1 << 39  # 7.40
    ALLOW_IDMAP = 1 << 40  # 7.41
    OVER_IO_URING = 1 << 41  # 7.42
    REQUEST_TIMEOUT = 1 << 42  # 7.43: fuse_init_out.request_timeout is read


class OpenFlag(enum.IntFlag):
    """``fuse_open_out.open_flags`` (FOPEN_*): how the kernel treats one open file."""

    DIRECT_IO = 1 << 0  # bypass the page cache
    KEEP_CACHE = 1 << 1  # keep the page cache on open (else it is dropped)
    NONSEEKABLE = 1 << 2
    CACHE_DIR = 1 << 3  # 7.28: the kernel keeps READDIR results
    STREAM = 1 << 4
    NOFLUSH = 1 << 5  # no FLUSH on close of this file
    PARALLEL_DIRECT_WRITES = 1 << 6  # 7.38
    PASSTHROUGH = 1 << 7  # 7.40: reads and writes go to fuse_open_out.backing_id


class SetattrValid(enum.IntFlag):
    """``fuse_setattr_in.valid`` (FATTR_*): which fields of a SETATTR are set."""

    MODE = 1 << 0
    UID = 1 << 1
    GID = 1 << 2
    SIZE = 1 << 3
    ATIME = 1 << 4
    MTIME = 1 << 5
    FH = 1 << 6
    ATIME_NOW = 1 << 7
    MTIME_NOW = 1 << 8
    LOCKOWNER = 1 << 9
    CTIME = 1 << 10  # 7.23
    KILL_SUIDGID = 1 << 11  # 7.33


class ReleaseFlag(enum.IntFlag):
    FLUSH = 1 << 0
    FLOCK_UNLOCK = 1 << 1  # 7.17


class GetattrFlag(enum.IntFlag):
    FH = 1 << 0  # fuse_getattr_in.fh is set (fstat)


class WriteFlag(enum.IntFlag):
    CACHE = 1 << 0  # a delayed write from the page cache; fh is guessed
    LOCKOWNER = 1 << 1
    KILL_SUIDGID = 1 << 2


class ReadFlag(enum.IntFlag):
    LOCKOWNER = 1 << 1


class FsyncFlag(enum.IntFlag):
    FDATASYNC = 1 << 0


class LkFlag(enum.IntFlag):
    FLOCK = 1 << 0  # a BSD flock(), not a POSIX lock


class IoctlFlag(enum.IntFlag):
    COMPAT = 1 << 0
    UNRESTRICTED = 1 << 1
    RETRY = 1 << 2
    BIT32 = 1 << 3
    DIR = 1 << 4
    COMPAT_X32 = 1 << 5


class InvalEntryFlag(enum.IntFlag):
    EXPIRE_ONLY = 1 << 0  # 7.38, with HAS_EXPIRE_ONLY


class AttrFlag(enum.IntFlag):
    """``fuse_attr.flags`` (7.32)."""

    SUBMOUNT = 1 << 0
    DAX = 1 << 1


# -- structs -----------------------------------------------------------------------------------
# One per kernel struct, named after it. '<' = little-endian, standard sizes, no padding.

FUSE_IN_HEADER = struct.Struct("<IIQQIIIHH")  # len opcode unique nodeid uid gid pid total_extlen(7.38) padding
FUSE_OUT_HEADER = struct.Struct("<IiQ")  # len error unique
# ino size blocks atime mtime ctime atimensec mtimensec ctimensec mode nlink uid gid rdev blksize flags(7.32)
FUSE_ATTR = struct.Struct("<QQQQQQIIIIIIIIII")
FUSE_KSTATFS = struct.Struct("<QQQQQIIII24x")  # blocks bfree bavail files ffree bsize namelen frsize padding spare[6]
FUSE_FILE_LOCK = struct.Struct("<QQII")  # start end type pid
# nodeid generation entry_valid attr_valid entry_valid_nsec attr_valid_nsec, then fuse_attr
FUSE_ENTRY_OUT_HEAD = struct.Struct("<QQQQII")
FUSE_FORGET_IN = struct.Struct("<Q")  # nlookup
FUSE_FORGET_ONE = struct.Struct("<QQ")  # nodeid nlookup
FUSE_BATCH_FORGET_IN = struct.Struct("<II")  # count dummy
FUSE_GETATTR_IN = struct.Struct("<IIQ")  # getattr_flags dummy fh
FUSE_ATTR_OUT_HEAD = struct.Struct("<QII")  # attr_valid attr_valid_nsec dummy, then fuse_attr
FUSE_MKNOD_IN = struct.Struct("<IIII")  # mode rdev umask padding
FUSE_MKDIR_IN = struct.Struct("<II")  # mode umask
FUSE_RENAME_IN = struct.Struct("<Q")  # newdir
FUSE_RENAME2_IN = struct.Struct("<QII")  # newdir flags padding
FUSE_LINK_IN = struct.Struct("<Q")  # oldnodeid
# valid padding fh size lock_owner atime mtime ctime atimensec mtimensec ctimensec mode unused4 uid gid unused5
FUSE_SETATTR_IN = struct.Struct("<IIQQQQQQIIIIIIII")
FUSE_OPEN_IN = struct.Struct("<II")  # flags open_flags (FUSE_OPEN_KILL_SUIDGID, 7.33)
FUSE_CREATE_IN = struct.Struct("<IIII")  # flags mode umask open_flags
FUSE_OPEN_OUT = struct.Struct("<QIi")  # fh open_flags backing_id (7.40; padding before)
FUSE_RELEASE_IN = struct.Struct("<QIIQ")  # fh flags release_flags lock_owner
FUSE_FLUSH_IN = struct.Struct("<QIIQ")  # fh unused padding lock_owner
FUSE_READ_IN = struct.Struct("<QQIIQII")  # fh offset size read_flags lock_owner flags padding
FUSE_WRITE_IN = struct.Struct("<QQIIQII")  # fh offset size write_flags lock_owner flags padding
FUSE_WRITE_OUT = struct.Struct("<II")  # size padding
FUSE_FSYNC_IN = struct.Struct("<QII")  # fh fsync_flags padding
FUSE_SETXATTR_IN_COMPAT = struct.Struct("<II")  # size flags (without SETXATTR_EXT)
FUSE_SETXATTR_IN = struct.Struct("<IIII")  # size flags setxattr_flags padding (SETXATTR_EXT, 7.33)
FUSE_GETXATTR_IN = struct.Struct("<II")  # size padding
FUSE_GETXATTR_OUT = struct.Struct("<II")  # size padding
FUSE_LK_IN = struct.Struct("<QQQQIIII")  # fh owner lk.start lk.end lk.type lk.pid lk_flags padding
FUSE_ACCESS_IN = struct.Struct("<II")  # mask padding
FUSE_INIT_IN_COMPAT = struct.Struct("<IIII")  # major minor max_readahead flags (before 7.36)
FUSE_INIT_IN = struct.Struct("<IIIII44x")  # ... flags2 unused[11] (7.36)
# major minor max_readahead flags max_background congestion_threshold max_write time_gran max_pages
# map_alignment flags2 max_stack_depth(7.40) request_timeout(7.43) unused[11]
FUSE_INIT_OUT = struct.Struct("<IIIIHHIIHHIIH22x")
FUSE_INTERRUPT_IN = struct.Struct("<Q")  # unique
FUSE_BMAP_IN = struct.Struct("<QII")  # block blocksize padding
FUSE_BMAP_OUT = struct.Struct("<Q")  # block
FUSE_IOCTL_IN = struct.Struct("<QIIQII")  # fh flags cmd arg in_size out_size
FUSE_IOCTL_OUT = struct.Struct("<iIII")  # result flags in_iovs out_iovs
FUSE_POLL_IN = struct.Struct("<QQII")  # fh kh flags events
FUSE_POLL_OUT = struct.Struct("<II")  # revents padding
FUSE_FALLOCATE_IN = struct.Struct("<QQQII")  # fh offset length mode padding
FUSE_LSEEK_IN = struct.Struct("<QQII")  # fh offset whence padding
FUSE_LSEEK_OUT = struct.Struct("<Q")  # offset
FUSE_COPY_FILE_RANGE_IN = struct.Struct("<QQQQQQQ")  # fh_in off_in nodeid_out fh_out off_out len flags
FUSE_COPY_FILE_RANGE_OUT = struct.Struct("<Q")  # bytes_copied (7.45, COPY_FILE_RANGE_64)
FUSE_SYNCFS_IN = struct.Struct("<Q")  # padding
FUSE_DIRENT = struct.Struct("<QQII")  # ino off namelen type, then the name, padded to 8 bytes
FUSE_NOTIFY_INVAL_INODE_OUT = struct.Struct("<Qqq")  # ino off len
FUSE_NOTIFY_INVAL_ENTRY_OUT = struct.Struct("<QII")  # parent namelen flags (7.38; padding before)
FUSE_NOTIFY_DELETE_OUT = struct.Struct("<QQII")  # parent child namelen padding
FUSE_NOTIFY_STORE_OUT = struct.Struct("<QQII")  # nodeid offset size padding
FUSE_NOTIFY_RETRIEVE_OUT = struct.Struct("<QQQII")  # notify_unique nodeid offset size padding
FUSE_NOTIFY_RETRIEVE_IN = struct.Struct("<QQIIQQ")  # dummy1 offset size dummy2 dummy3 dummy4 (as fuse_write_in)
FUSE_BACKING_MAP = struct.Struct("<iIQ")  # fd flags padding (7.40, FUSE_DEV_IOC_BACKING_OPEN)

# sizes from fuse.h: a wrong format string fails here, at import
_SIZES = {
    FUSE_IN_HEADER: 40, FUSE_OUT_HEADER: 16, FUSE_ATTR: 88, FUSE_KSTATFS: 80, FUSE_FILE_LOCK: 24,
    FUSE_ENTRY_OUT_HEAD: 40, FUSE_FORGET_IN: 8, FUSE_FORGET_ONE: 16, FUSE_BATCH_FORGET_IN: 8,
    FUSE_GETATTR_IN: 16, FUSE_ATTR_OUT_HEAD: 16, FUSE_MKNOD_IN: 16, FUSE_MKDIR_IN: 8, FUSE_RENAME_IN: 8,
    FUSE_RENAME2_IN: 16, FUSE_LINK_IN: 8, FUSE_SETATTR_IN: 88, FUSE_OPEN_IN: 8, FUSE_CREATE_IN: 16,
    FUSE_OPEN_OUT: 16, FUSE_RELEASE_IN: 24, FUSE_FLUSH_IN: 24, FUSE_READ_IN: 40, FUSE_WRITE_IN: 40,
    FUSE_WRITE_OUT: 8, FUSE_FSYNC_IN: 16, FUSE_SETXATTR_IN_COMPAT: 8, FUSE_SETXATTR_IN: 16,
    FUSE_GETXATTR_IN: 8, FUSE_GETXATTR_OUT: 8, FUSE_LK_IN: 48, FUSE_ACCESS_IN: 8, FUSE_INIT_IN_COMPAT: 16,
    FUSE_INIT_IN: 64, FUSE_INIT_OUT: 64, FUSE_INTERRUPT_IN: 8, FUSE_BMAP_IN: 16, FUSE_BMAP_OUT: 8,
    FUSE_IOCTL_IN: 32, FUSE_IOCTL_OUT: 16, FUSE_POLL_IN: 24, FUSE_POLL_OUT: 8, FUSE_FALLOCATE_IN: 32,
    FUSE_LSEEK_IN: 24, FUSE_LSEEK_OUT: 8, FUSE_COPY_FILE_RANGE_IN: 56, FUSE_COPY_FILE_RANGE_OUT: 8,
    FUSE_SYNCFS_IN: 8, FUSE_DIRENT: 24, FUSE_NOTIFY_INVAL_INODE_OUT: 24, FUSE_NOTIFY_INVAL_ENTRY_OUT: 16,
    FUSE_NOTIFY_DELETE_OUT: 24, FUSE_NOTIFY_STORE_OUT: 24, FUSE_NOTIFY_RETRIEVE_OUT: 32,
    FUSE_NOTIFY_RETRIEVE_IN: 40, FUSE_BACKING_MAP: 16,
}
for _s, _size in _SIZES.items():
    assert _s.size == _size, f"{_s.format} is {_s.size} bytes, fuse.h says {_size}"
del _s, _size

ENTRY_OUT_SIZE = FUSE_ENTRY_OUT_HEAD.size + FUSE_ATTR.size  # 128
ATTR_OUT_SIZE = FUSE_ATTR_OUT_HEAD.size + FUSE_ATTR.size  # 104
DIRENTPLUS_HEAD = ENTRY_OUT_SIZE + FUSE_DIRENT.size  # 152: fuse_direntplus before its name


def init_out_size(minor: int) -> int:
    """How many bytes of ``fuse_init_out`` a kernel speaking ``minor`` reads (FUSE_COMPAT_*_INIT_OUT_SIZE)."""
    if minor < 5:
        return 8
    if minor < 23:
        return 24
    return FUSE_INIT_OUT.size


def dirent_size(namelen: int, head: int = FUSE_DIRENT.size) -> int:
    """A dirent's size on the wire: header and name, rounded up to 8 bytes (FUSE_DIRENT_ALIGN)."""
    return (head + namelen + 7) & ~7


# -- /dev/fuse ioctls ----------------------------------------------------------------------------
# _IOR/_IOW(FUSE_DEV_IOC_MAGIC=229, nr, type): dir << 30 | size << 16 | magic << 8 | nr
_IOC_WRITE, _IOC_READ = 1, 2


def _ioc(direction: int, nr: int, size: int) -> int:
    return direction << 30 | size << 16 | 229 << 8 | nr


FUSE_DEV_IOC_CLONE = _ioc(_IOC_READ, 0, 4)  # _IOR(229, 0, uint32_t): attach this fd to the connection of another
FUSE_DEV_IOC_BACKING_OPEN = _ioc(_IOC_WRITE, 1, FUSE_BACKING_MAP.size)  # 7.40: a backing file for passthrough
FUSE_DEV_IOC_BACKING_CLOSE = _ioc(_IOC_WRITE, 2, 4)  # 7.40
assert FUSE_DEV_IOC_CLONE == 0x8004E500
