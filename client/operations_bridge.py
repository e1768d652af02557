"""The mount's ``Operations`` served on its FUSE session: requests in, Operations' arguments out.

``Operations`` (operations.py) takes what the kernel names (inode, file handle, name, the request
context) and answers in client/fuse's types (``Entry``, ``(Attr, valid)`` or ``Encoded``,
``Opened``, ``Statfs``, ``FuseError``). This adapter gives client.fuse's ``Dispatcher`` the
shape it serves (an async method per operation taking the request), unpacking each request into
those arguments: the request context (uid, gid, pid, umask), the flags, a SETATTR's fields.

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

import trio

from ..common import protocol as p
from ..common.errors import StripefsError
from . import metrics as client_metrics
from .fuse import abi, requests as rq
from .fuse.dispatch import MISS, Opened
from .fuse.replies import Attr, DirentBuffer, Encoded, Entry, Failed, FuseError, Statfs
from .operations import FAST_PATH_MISS
from .thread_meta import ThreadMeta
from .thread_reads import ThreadReads, plan_read

log = logging.getLogger(__name__)

_V = abi.SetattrValid
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_TRUNC


class _Ctx:
    """Who asks: the request context a handler receives."""

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
    """The st_* fields a SETATTR sets (those ``_SetattrFields`` names)."""

    __slots__ = ("st_mode", "st_uid", "st_gid", "st_size", "st_atime_ns", "st_mtime_ns", "st_ctime_ns")

    def __init__(self, req: rq.Setattr):
        now = time.time_ns()
        self.st_mode, self.st_uid, self.st_gid, self.st_size = req.mode, req.uid, req.gid, req.size
        self.st_atime_ns = now if req.valid & _V.ATIME_NOW else req.atime * 1_000_000_000 + req.atimensec
        self.st_mtime_ns = now if req.valid & _V.MTIME_NOW else req.mtime * 1_000_000_000 + req.mtimensec
        self.st_ctime_ns = req.ctime * 1_000_000_000 + req.ctimensec


class OperationsBridge:
    """The file system the own session's Dispatcher serves: ``ops`` (an Operations), in trio."""

    def __init__(self, ops, trio_token: trio.lowlevel.TrioToken, nursery: trio.Nursery):
        self.ops = ops
        self._token, self._nursery = trio_token, nursery
        #: the dispatcher runs the fast paths below on the reader thread, holding this
        self.fast_lock = ops.lock
        #: the real mount's (client/no_open_primer.py): sets the kernel's no-open at the first create
        self.primer = None
        #: the real mount's (client/thread_reads.py): cold READs served on plain threads; None: all in trio
        self.thread_reads: ThreadReads | None = None
        #: the real mount's (client/thread_meta.py): GETATTR misses asked on plain threads; None: all in trio
        self.thread_meta: ThreadMeta | None = None

    # -- fast paths: Operations' _fast_* (what it answers from memory), counted as its handlers are

    def _fast(self, op: str, fn, *args):
        started = time.perf_counter()
        try:
            result = fn(*args)
        except FuseError as e:
            client_metrics.observe(op, time.perf_counter() - started, e.errno)
            raise
        except StripefsError as e:
            client_metrics.observe(op, time.perf_counter() - started, e.errno)
            raise FuseError(e.errno) from None
        if result is FAST_PATH_MISS:
            return MISS
        if result.__class__ is Failed:  # an error answered without raising (a new name's LOOKUP)
            client_metrics.observe(op, time.perf_counter() - started, int(result))
            return result
        client_metrics.observe(op, time.perf_counter() - started)
        return result

    def _declined(self, op: str) -> None:
        client_metrics.observe(op, 0.0, errno.ENOSYS)

    def fast_lookup(self, req: rq.Lookup):
        return self._fast("lookup", self.ops._fast_lookup, req.header.nodeid, req.name, None)

    def fast_getattr(self, req: rq.Getattr):
        return self._fast("getattr", self.ops._fast_getattr, req.header.nodeid)

    def lane_getattr(self, nodeid: int) -> bytes | None:
        """The session's GETATTR lane (client/fuse/session.py): the reply body held for ``nodeid``
        or None, counted as fast_getattr's answers are."""
        started = time.perf_counter()
        body = self.ops._lane_getattr(nodeid)
        if body is not None:
            client_metrics.observe("getattr", time.perf_counter() - started)
        return body

    def lane_lookup(self, nodeid: int, name: bytes) -> bytes | int | None:
        """The session's LOOKUP lane (client/fuse/session.py): fast_lookup's answer from memory, the
        entry's bytes or the errno (a new name in a directory held whole: ENOENT), or None,
        counted as fast_lookup's answers are."""
        started = time.perf_counter()
        result = self.ops._fast_lookup(nodeid, name, None)
        kind = result.__class__
        if kind is Encoded:
            client_metrics.observe("lookup", time.perf_counter() - started)
            return result
        if kind is Failed:
            client_metrics.observe("lookup", time.perf_counter() - started, int(result))
            return int(result)
        return None

    def fast_getxattr(self, req: rq.Getxattr):
        if req.name.startswith(p.JOB_XATTR):
            return MISS  # a training job's report changes client/jobs.py's state, which lives in trio
        return self._fast("getxattr", self.ops._fast_getxattr, req.header.nodeid, req.name, _Ctx(req.header))

    def fast_open(self, req: rq.Open):
        if self.ops.no_open and not (self.ops.dataset and req.flags & _WRITE_FLAGS):
            # no-open: ENOSYS tells the kernel never to send OPEN (nor RELEASE) again on this
            # connection; every READ (WRITE, FLUSH, FSYNC) then names the inode (read_inode ...)
            # and a warm file is read with no request at all (a dataset mount) or one FLUSH (the
            # default mount without per_open_handles: docs/design.md, "No OPEN on the read-write mount")
            self._declined("open")
            if self.primer is not None:
                self.primer.open_declined()
            raise FuseError(errno.ENOSYS)
        return self._fast("open", self.ops._fast_open, req.header.nodeid, req.flags, _Ctx(req.header))

    def fast_opendir(self, req: rq.Open):
        if self.ops.no_open:
            # no-opendir: the kernel sends no OPENDIR (nor RELEASEDIR) again on this connection and
            # keeps each directory's listing in its cache (the feed's invalidation of the directory
            # drops it; docs/design.md "Listings kept by the kernel"); READDIR then names the
            # directory by its inode
            self._declined("opendir")
            raise FuseError(errno.ENOSYS)
        return self._fast("opendir", self.ops._fast_opendir, req.header.nodeid, _Ctx(req.header))

    def fast_readdir(self, req: rq.Read, buf: DirentBuffer):
        # a page of a listing kept in memory (client/dir_listings.py); the handle is the inode, 0
        # where OPENDIR was declined
        return self._fast("readdir", self.ops._fast_readdir, req.fh or req.header.nodeid, req.offset, buf)

    def fast_ioctl(self, req: rq.Ioctl):
        return self._fast("ioctl", self.ops._fast_ioctl, req.header.nodeid, req.cmd, req.data, _Ctx(req.header))

    def fast_flush(self, req: rq.Flush):
        if req.fh == 0 and self.ops.per_inode:  # no-open on the default mount: the inode names the file
            if self.primer is not None and self.primer.own_flush(req.header.pid):
                return None  # the primer's own close: it wrote nothing (client/no_open_primer.py)
            return self._fast("flush", self.ops._fast_flush_inode, req.header.nodeid)
        return self._fast("flush", self.ops._fast_flush, req.fh)

    def fast_release(self, req: rq.Release):
        if req.fh == 0:
            return None  # no-open: a created file's RELEASE (some kernels send it); its state is the inode's
        return self._fast("release", self.ops._fast_release, req.fh)

    def fast_releasedir(self, req: rq.Release):
        return self._fast("releasedir", self.ops._fast_releasedir, req.fh)

    # namespace changes answered here in a directory the mount holds whole (client/async_dirops.py)

    def fast_create(self, req: rq.Create):
        answer = self._fast("create", self.ops._fast_create, req.header.nodeid, req.name, req.mode, req.flags,
                            _Ctx(req.header, req.umask))
        if self.primer is not None and answer is not MISS:
            self.primer.created(answer[0].nodeid)
        return answer

    def fast_mkdir(self, req):
        return self._fast("mkdir", self.ops._fast_mkdir, req.header.nodeid, req.name, req.mode, _Ctx(req.header, req.umask))

    def fast_write(self, req: rq.Write):
        n = self._fast("write", self.ops._write_here, req.header.nodeid, req.fh, req.offset, req.data)
        if n is not MISS:
            client_metrics.WRITE_BYTES.inc(n)
        return n

    def fast_unlink(self, req: rq.Unlink):
        return self._fast("unlink", self.ops._fast_unlink, req.header.nodeid, req.name, _Ctx(req.header))

    def fast_rmdir(self, req: rq.Unlink):
        return self._fast("rmdir", self.ops._fast_rmdir, req.header.nodeid, req.name, _Ctx(req.header))

    def fast_rename(self, req: rq.Rename):
        return self._fast("rename", self.ops._fast_rename, req.header.nodeid, req.name, req.newdir, req.newname, req.flags,
                          _Ctx(req.header))

    # -- cold READs on plain threads (client/thread_reads.py): decided here, under Operations.lock

    def take_read(self, req: rq.Read, reply, slow) -> bool:
        pool = self.thread_reads
        if pool is None:
            return False
        started = time.perf_counter()
        of = self.ops.thread_read_file(req.fh, req.header.nodeid, _Ctx(req.header))
        if of is None:
            return False
        jobs = self.ops.jobs
        account = None
        if jobs is not None and jobs.active:  # attributed to its job as the handler's wrapper would (client/jobs.py)
            ctx = _Ctx(req.header)
            args = (req.header.nodeid, req.offset, req.size, ctx) if req.fh == 0 else (req.fh, req.offset, req.size)
            account = (jobs, args, req.fh == 0)
        return plan_read(of, req.offset, req.size, self.ops.data, pool, reply, slow, started, account,
                         cached=not req.flags & os.O_DIRECT)

    # -- GETATTR and LOOKUP misses on plain threads (client/thread_meta.py): decided here, under Operations.lock

    def take_getattr(self, req: rq.Getattr, reply, slow) -> bool:
        pool, ops = self.thread_meta, self.ops
        inode = req.header.nodeid
        stamp = ops.thread_getattr(inode) if pool is not None else None
        if stamp is None:
            return False
        return self._take_meta("getattr", pool.getattr, p.GetattrReq(ino=inode, session_id=ops.meta.session_id),
                               lambda rsp: reply.attr(*ops.thread_attr_out(stamp, rsp.attr)), reply, slow)

    def take_lookup(self, req: rq.Lookup, reply, slow) -> bool:
        """Only those with no open information to ask (``Operations.thread_lookup``)."""
        pool, ops = self.thread_meta, self.ops
        parent, name, pid = req.header.nodeid, req.name, req.header.pid
        taken = ops.thread_lookup(parent, name, pid) if pool is not None else None
        if taken is None:
            return False
        stamp, callback = taken
        request = p.LookupReq(parent=parent, name=name, open_info=False, session_id=ops.meta.session_id, callback=callback)
        return self._take_meta("lookup", pool.lookup, request,
                               lambda rsp: reply.entry(ops.thread_entry_out(stamp, parent, name, pid, rsp, pool.to_trio)), reply, slow)

    def _take_meta(self, op: str, submit, request: p.Msg, answer_locked, reply, slow) -> bool:
        """Hand ``request`` to the worker threads (``submit``: ThreadMeta.getattr or .lookup). A worker
        answers the daemon's reply with ``answer_locked(rsp)`` under Operations.lock (the check and
        the answer against a change's invalidation: thread_meta.py), an error as the handler would."""
        started = time.perf_counter()
        ops = self.ops

        def answer(rsp: p.AttrRsp) -> None:
            with ops.lock:
                answer_locked(rsp)
            client_metrics.observe(op, time.perf_counter() - started)

        def fail(err: int) -> None:
            if not reply.sent:
                reply.error(err)
            client_metrics.observe(op, time.perf_counter() - started, err)

        return submit(request, answer, fail, slow)

    # -- the handlers, in tasks

    async def lookup(self, req: rq.Lookup) -> Entry:
        return await self.ops.lookup(req.header.nodeid, req.name, _Ctx(req.header))

    async def getattr(self, req: rq.Getattr) -> tuple[Attr, float]:
        return await self.ops.getattr(req.header.nodeid, _Ctx(req.header))

    async def setattr(self, req: rq.Setattr) -> tuple[Attr, float]:
        fh = req.fh if req.valid & _V.FH else None
        return await self.ops.setattr(req.header.nodeid, _NewAttrs(req), _SetattrFields(req.valid), fh,
                                            _Ctx(req.header))

    async def readlink(self, req: rq.Readlink) -> bytes:
        return await self.ops.readlink(req.header.nodeid, _Ctx(req.header))

    async def mknod(self, req: rq.Mknod) -> Entry:
        return await self.ops.mknod(req.header.nodeid, req.name, req.mode, req.rdev, _Ctx(req.header, req.umask))

    async def mkdir(self, req: rq.Mkdir) -> Entry:
        return await self.ops.mkdir(req.header.nodeid, req.name, req.mode, _Ctx(req.header, req.umask))

    async def symlink(self, req: rq.Symlink) -> Entry:
        return await self.ops.symlink(req.header.nodeid, req.name, req.target, _Ctx(req.header))

    async def link(self, req: rq.Link) -> Entry:
        return await self.ops.link(req.oldnodeid, req.header.nodeid, req.newname, _Ctx(req.header))

    async def unlink(self, req: rq.Unlink) -> None:
        await self.ops.unlink(req.header.nodeid, req.name, _Ctx(req.header))

    async def rmdir(self, req: rq.Unlink) -> None:
        await self.ops.rmdir(req.header.nodeid, req.name, _Ctx(req.header))

    async def rename(self, req: rq.Rename) -> None:
        await self.ops.rename(req.header.nodeid, req.name, req.newdir, req.newname, req.flags, _Ctx(req.header))

    async def open(self, req: rq.Open) -> Opened:
        return await self.ops.open(req.header.nodeid, req.flags, _Ctx(req.header))

    async def create(self, req: rq.Create) -> tuple[Entry, Opened]:
        answer = await self.ops.create(req.header.nodeid, req.name, req.mode, req.flags, _Ctx(req.header, req.umask))
        if self.primer is not None:
            self.primer.created(answer[0].nodeid)
        return answer

    async def read(self, req: rq.Read) -> bytes:
        if req.fh == 0:  # no OPEN was sent (fast_open declined it): the inode names the file
            return await self.ops.read_inode(req.header.nodeid, req.offset, req.size, _Ctx(req.header))
        return await self.ops.read(req.fh, req.offset, req.size)

    async def write(self, req: rq.Write) -> int:
        if req.fh == 0:  # no OPEN was sent: the inode names the file
            return await self.ops.write_inode(req.header.nodeid, req.offset, req.data, _Ctx(req.header))
        return await self.ops.write(req.fh, req.offset, req.data)

    async def flush(self, req: rq.Flush) -> None:
        if req.fh == 0 and self.ops.per_inode:
            await self.ops.flush_inode(req.header.nodeid)
            return
        await self.ops.flush(req.fh)  # (a dataset mount's: declined with ENOSYS by its fast path)

    async def release(self, req: rq.Release) -> None:
        if req.fh:
            await self.ops.release(req.fh)

    async def fsync(self, req: rq.Fsync) -> None:
        datasync = bool(req.fsync_flags & abi.FsyncFlag.FDATASYNC)
        if req.fh == 0:
            await self.ops.fsync_inode(req.header.nodeid, datasync)
            return
        await self.ops.fsync(req.fh, datasync)

    async def fsyncdir(self, req: rq.Fsync) -> None:
        # the handle opendir gave is the inode; 0 where OPENDIR was declined: the inode names it
        await self.ops.fsyncdir(req.fh or req.header.nodeid, bool(req.fsync_flags & abi.FsyncFlag.FDATASYNC))

    async def opendir(self, req: rq.Open) -> Opened:
        return await self.ops.opendir(req.header.nodeid, _Ctx(req.header))

    async def readdir(self, req: rq.Read, buf: DirentBuffer) -> None:
        # the handle opendir gave is the inode; 0 where OPENDIR was declined (fast_opendir)
        await self.ops.readdir(req.fh or req.header.nodeid, req.offset, buf)

    async def releasedir(self, req: rq.Release) -> None:
        await self.ops.releasedir(req.fh)

    async def statfs(self, req: rq.Statfs) -> Statfs:
        return await self.ops.statfs(_Ctx(req.header))

    async def setxattr(self, req: rq.Setxattr) -> None:
        await self.ops.setxattr(req.header.nodeid, req.name, req.value, _Ctx(req.header))

    async def getxattr(self, req: rq.Getxattr) -> bytes:
        return await self.ops.getxattr(req.header.nodeid, req.name, _Ctx(req.header))

    async def listxattr(self, req: rq.Listxattr) -> bytes:
        names = await self.ops.listxattr(req.header.nodeid, _Ctx(req.header))
        return b"".join(bytes(n) + b"\0" for n in names)

    async def ioctl(self, req: rq.Ioctl) -> tuple[int, bytes]:
        return await self.ops.ioctl(req.header.nodeid, req.cmd, req.data, _Ctx(req.header)), b""

    async def removexattr(self, req: rq.Removexattr) -> None:
        await self.ops.removexattr(req.header.nodeid, req.name, _Ctx(req.header))

    def forget(self, forgets: Sequence[tuple[int, int]]) -> None:
        """On the reader thread, under ``Operations.lock``: no crossing to trio."""
        try:
            self.ops.forget_now(forgets)
        except Exception:
            log.exception("forget of %d inodes failed", len(forgets))
