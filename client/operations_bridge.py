"""The mount's pyfuse3-shaped ``Operations`` served on its own FUSE session (``-o fuse_session=own``).

Transitional: ``Operations`` (operations.py) is written for pyfuse3 (inode and file-handle
arguments, ``EntryAttributes``/``FileInfo`` results, ``FUSEError``). This adapter gives
client.fuse's ``Dispatcher`` the shape it serves (an async method per operation taking the
request, client.fuse results, ``OSError``), calling ``Operations`` as pyfuse3 would: the same
arguments, the same request context (uid, gid, pid, umask), the same flags.

Hot requests never reach trio: ``Operations``' ``_fast_*`` paths (what it answers from memory:
a name known absent, attributes, a read-only open from what a lookup or the feed left, FLUSH,
RELEASE of a clean file, the mount's own xattrs) run on the session's reader thread under
``Operations.lock`` (``fast_lock``: the dispatcher holds it around the fast path and its reply;
``Operations`` and ``KernelCache`` hold it while they change what those paths read), counted in
the mount's metrics as its handlers are. FORGET is applied there too. Only a MISS crosses to trio,
where the handler runs in a task (its own fast path first, then the cluster).
"""

from __future__ import annotations

import errno
import logging
import os
import time
from typing import Sequence

import pyfuse3
import trio

from ..common import protocol as p
from ..common.errors import StripefsError
from . import metrics as client_metrics
from .fuse import abi, requests as rq
from .fuse.dispatch import MISS, Opened
from .fuse.replies import Attr, DirentBuffer, Entry, Statfs
from .fuse_backend import ReaddirToken, attr_of, entry_of
from .operations import FAST_PATH_MISS

log = logging.getLogger(__name__)

_V = abi.SetattrValid
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_TRUNC


class _Ctx:
    """pyfuse3's RequestContext: who asks."""

    __slots__ = ("uid", "gid", "pid", "umask")

    def __init__(self, h: rq.InHeader, umask: int = 0):
        self.uid, self.gid, self.pid, self.umask = h.uid, h.gid, h.pid, umask


class _SetattrFields:
    __slots__ = ("update_atime", "update_mtime", "update_ctime", "update_mode", "update_uid", "update_gid",
                 "update_size")

    def __init__(self, valid: int):
        self.update_atime = bool(valid & (_V.ATIME | _V.ATIME_NOW))
        self.update_mtime = bool(valid & (_V.MTIME | _V.MTIME_NOW))
        self.update_ctime = bool(valid & _V.CTIME)
        self.update_mode = bool(valid & _V.MODE)
        self.update_uid = bool(valid & _V.UID)
        self.update_gid = bool(valid & _V.GID)
        self.update_size = bool(valid & _V.SIZE)


class _NewAttrs:
    """The st_* fields a SETATTR sets (pyfuse3 fills an EntryAttributes the same way)."""

    __slots__ = ("st_mode", "st_uid", "st_gid", "st_size", "st_atime_ns", "st_mtime_ns", "st_ctime_ns")

    def __init__(self, req: rq.Setattr):
        now = time.time_ns()
        self.st_mode, self.st_uid, self.st_gid, self.st_size = req.mode, req.uid, req.gid, req.size
        self.st_atime_ns = now if req.valid & _V.ATIME_NOW else req.atime * 1_000_000_000 + req.atimensec
        self.st_mtime_ns = now if req.valid & _V.MTIME_NOW else req.mtime * 1_000_000_000 + req.mtimensec
        self.st_ctime_ns = req.ctime * 1_000_000_000 + req.ctimensec


def _opened(fi: pyfuse3.FileInfo, open_flags: int = os.O_RDWR) -> Opened:
    """``open_flags``: the open(2) flags. A file opened only for reading is closed with no FLUSH
    (FOPEN_NOFLUSH): such a handle has nothing to commit, and the mount keeps no POSIX locks of
    its own (the kernel does), so the request would only cost the close a round to the mount."""
    flags = 0 if open_flags & (os.O_WRONLY | os.O_RDWR) else abi.OpenFlag.NOFLUSH
    if fi.direct_io:
        flags |= abi.OpenFlag.DIRECT_IO
    if fi.keep_cache:
        flags |= abi.OpenFlag.KEEP_CACHE
    if fi.nonseekable:
        flags |= abi.OpenFlag.NONSEEKABLE
    return Opened(fi.fh, flags)


async def _call(coro):
    try:
        return await coro
    except pyfuse3.FUSEError as e:
        raise OSError(e.errno, "") from None


class OperationsBridge:
    """The file system the own session's Dispatcher serves: ``ops`` (an Operations), in trio."""

    def __init__(self, ops, trio_token: trio.lowlevel.TrioToken, nursery: trio.Nursery):
        self.ops = ops
        self._token, self._nursery = trio_token, nursery
        #: the dispatcher runs the fast paths below on the reader thread, holding this
        self.fast_lock = ops.lock

    # -- fast paths: Operations' _fast_* (what it answers from memory), counted as its handlers are

    def _fast(self, op: str, fn, *args):
        started = time.perf_counter()
        try:
            result = fn(*args)
        except pyfuse3.FUSEError as e:
            client_metrics.observe(op, time.perf_counter() - started, e.errno)
            raise OSError(e.errno, "") from None
        except StripefsError as e:
            client_metrics.observe(op, time.perf_counter() - started, e.errno)
            raise OSError(e.errno, str(e)) from None
        if result is FAST_PATH_MISS:
            return MISS
        client_metrics.observe(op, time.perf_counter() - started)
        return result

    def _declined(self, op: str) -> None:
        client_metrics.observe(op, 0.0, errno.ENOSYS)

    def fast_lookup(self, req: rq.Lookup):
        r = self._fast("lookup", self.ops._fast_lookup, req.header.nodeid, req.name, _Ctx(req.header))
        return r if r is MISS else entry_of(r)

    def fast_getattr(self, req: rq.Getattr):
        r = self._fast("getattr", self.ops._fast_getattr, req.header.nodeid, _Ctx(req.header))
        return r if r is MISS else (attr_of(r), r.attr_timeout)

    def fast_getxattr(self, req: rq.Getxattr):
        if req.name.startswith(p.JOB_XATTR):
            return MISS  # a training job's report changes client/jobs.py's state, which lives in trio
        return self._fast("getxattr", self.ops._fast_getxattr, req.header.nodeid, req.name, _Ctx(req.header))

    def fast_open(self, req: rq.Open):
        if self.ops.dataset and not req.flags & _WRITE_FLAGS:
            # no-open: ENOSYS tells the kernel never to send OPEN (nor RELEASE) again on this
            # connection; every READ then names the inode (read_inode) and a warm file is read with
            # no request at all. A dataset mount keeps nothing per open file that needs them.
            self._declined("open")
            raise OSError(errno.ENOSYS, "")
        r = self._fast("open", self.ops._fast_open, req.header.nodeid, req.flags, _Ctx(req.header))
        return r if r is MISS else _opened(r, req.flags)

    def fast_opendir(self, req: rq.Open):
        if self.ops.dataset:
            # no-opendir: the kernel sends no OPENDIR (nor RELEASEDIR) again on this connection and
            # keeps each directory's listing in its cache (the feed's invalidation of the directory
            # drops it); READDIR then names the directory by its inode
            self._declined("opendir")
            raise OSError(errno.ENOSYS, "")
        return MISS

    def fast_ioctl(self, req: rq.Ioctl):
        return self._fast("ioctl", self.ops._fast_ioctl, req.header.nodeid, req.cmd, req.data, _Ctx(req.header))

    def fast_flush(self, req: rq.Flush):
        return self._fast("flush", self.ops._fast_flush, req.fh)

    def fast_release(self, req: rq.Release):
        return self._fast("release", self.ops._fast_release, req.fh)

    # namespace changes answered here in a directory the mount holds whole (client/async_dirops.py)

    def fast_create(self, req: rq.Create):
        r = self._fast("create", self.ops._fast_create, req.header.nodeid, req.name, req.mode, req.flags,
                       _Ctx(req.header, req.umask))
        return r if r is MISS else (entry_of(r[1]), _opened(r[0]))

    def fast_mkdir(self, req):
        r = self._fast("mkdir", self.ops._fast_mkdir, req.header.nodeid, req.name, req.mode, _Ctx(req.header, req.umask))
        return r if r is MISS else entry_of(r)

    def fast_unlink(self, req: rq.Unlink):
        return self._fast("unlink", self.ops._fast_unlink, req.header.nodeid, req.name, _Ctx(req.header))

    def fast_rmdir(self, req: rq.Unlink):
        return self._fast("rmdir", self.ops._fast_rmdir, req.header.nodeid, req.name, _Ctx(req.header))

    # -- the handlers, in tasks

    async def lookup(self, req: rq.Lookup) -> Entry:
        return entry_of(await _call(self.ops.lookup(req.header.nodeid, req.name, _Ctx(req.header))))

    async def getattr(self, req: rq.Getattr) -> tuple[Attr, float]:
        a = await _call(self.ops.getattr(req.header.nodeid, _Ctx(req.header)))
        return attr_of(a), a.attr_timeout

    async def setattr(self, req: rq.Setattr) -> tuple[Attr, float]:
        fh = req.fh if req.valid & _V.FH else None
        a = await _call(self.ops.setattr(req.header.nodeid, _NewAttrs(req), _SetattrFields(req.valid), fh,
                                         _Ctx(req.header)))
        return attr_of(a), a.attr_timeout

    async def readlink(self, req: rq.Readlink) -> bytes:
        return await _call(self.ops.readlink(req.header.nodeid, _Ctx(req.header)))

    async def mknod(self, req: rq.Mknod) -> Entry:
        return entry_of(await _call(self.ops.mknod(req.header.nodeid, req.name, req.mode, req.rdev,
                                                   _Ctx(req.header, req.umask))))

    async def mkdir(self, req: rq.Mkdir) -> Entry:
        return entry_of(await _call(self.ops.mkdir(req.header.nodeid, req.name, req.mode, _Ctx(req.header, req.umask))))

    async def symlink(self, req: rq.Symlink) -> Entry:
        return entry_of(await _call(self.ops.symlink(req.header.nodeid, req.name, req.target, _Ctx(req.header))))

    async def link(self, req: rq.Link) -> Entry:
        return entry_of(await _call(self.ops.link(req.oldnodeid, req.header.nodeid, req.newname, _Ctx(req.header))))

    async def unlink(self, req: rq.Unlink) -> None:
        await _call(self.ops.unlink(req.header.nodeid, req.name, _Ctx(req.header)))

    async def rmdir(self, req: rq.Unlink) -> None:
        await _call(self.ops.rmdir(req.header.nodeid, req.name, _Ctx(req.header)))

    async def rename(self, req: rq.Rename) -> None:
        await _call(self.ops.rename(req.header.nodeid, req.name, req.newdir, req.newname, req.flags, _Ctx(req.header)))

    async def open(self, req: rq.Open) -> Opened:
        return _opened(await _call(self.ops.open(req.header.nodeid, req.flags, _Ctx(req.header))), req.flags)

    async def create(self, req: rq.Create) -> tuple[Entry, Opened]:
        fi, attrs = await _call(self.ops.create(req.header.nodeid, req.name, req.mode, req.flags,
                                                _Ctx(req.header, req.umask)))
        return entry_of(attrs), _opened(fi)

    async def read(self, req: rq.Read) -> bytes:
        if req.fh == 0:  # no OPEN was sent (fast_open declined it): the inode names the file
            return await _call(self.ops.read_inode(req.header.nodeid, req.offset, req.size, _Ctx(req.header)))
        return await _call(self.ops.read(req.fh, req.offset, req.size))

    async def write(self, req: rq.Write) -> int:
        return await _call(self.ops.write(req.fh, req.offset, req.data))

    async def flush(self, req: rq.Flush) -> None:
        await _call(self.ops.flush(req.fh))

    async def release(self, req: rq.Release) -> None:
        await _call(self.ops.release(req.fh))

    async def fsync(self, req: rq.Fsync) -> None:
        await _call(self.ops.fsync(req.fh, bool(req.fsync_flags & abi.FsyncFlag.FDATASYNC)))

    async def fsyncdir(self, req: rq.Fsync) -> None:
        # the handle opendir gave is the inode; 0 where OPENDIR was declined: the inode names it
        await _call(self.ops.fsyncdir(req.fh or req.header.nodeid, bool(req.fsync_flags & abi.FsyncFlag.FDATASYNC)))

    async def opendir(self, req: rq.Open) -> Opened:
        return Opened(await _call(self.ops.opendir(req.header.nodeid, _Ctx(req.header))))

    async def readdir(self, req: rq.Read, buf: DirentBuffer) -> None:
        # the handle opendir gave is the inode; 0 where OPENDIR was declined (fast_opendir)
        await _call(self.ops.readdir(req.fh or req.header.nodeid, req.offset, ReaddirToken(buf)))

    async def releasedir(self, req: rq.Release) -> None:
        await _call(self.ops.releasedir(req.fh))

    async def statfs(self, req: rq.Statfs) -> Statfs:
        s = await _call(self.ops.statfs(_Ctx(req.header)))
        return Statfs(s.f_blocks, s.f_bfree, s.f_bavail, s.f_files, s.f_ffree, s.f_bsize, s.f_namemax, s.f_frsize)

    async def setxattr(self, req: rq.Setxattr) -> None:
        await _call(self.ops.setxattr(req.header.nodeid, req.name, req.value, _Ctx(req.header)))

    async def getxattr(self, req: rq.Getxattr) -> bytes:
        return await _call(self.ops.getxattr(req.header.nodeid, req.name, _Ctx(req.header)))

    async def listxattr(self, req: rq.Listxattr) -> bytes:
        names = await _call(self.ops.listxattr(req.header.nodeid, _Ctx(req.header)))
        return b"".join(bytes(n) + b"\0" for n in names)

    async def ioctl(self, req: rq.Ioctl) -> tuple[int, bytes]:
        return await _call(self.ops.ioctl(req.header.nodeid, req.cmd, req.data, _Ctx(req.header))), b""

    async def removexattr(self, req: rq.Removexattr) -> None:
        await _call(self.ops.removexattr(req.header.nodeid, req.name, _Ctx(req.header)))

    def forget(self, forgets: Sequence[tuple[int, int]]) -> None:
        """On the reader thread, under ``Operations.lock``: no crossing to trio."""
        try:
            self.ops.forget_now(forgets)
        except Exception:
            log.exception("forget of %d inodes failed", len(forgets))
