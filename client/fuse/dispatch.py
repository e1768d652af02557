"""The bridge between the FUSE session and a file system: the one module that knows both.

A file system given to :class:`Dispatcher` answers each operation in up to two ways, found by
name once, at construction:

* ``fast_<op>(req)``: synchronous, called on the session's reader thread (or, for a file system
  with ``fast_on_trio_thread = True``, on the trio thread in a plain callback: no task, no scope;
  not for READDIR). It answers from
  memory what it can (a held name, attributes, cached bytes, a held directory) and returns the
  result, or :data:`MISS` when answering needs the cluster. It must not block, wait on a lock
  that a trio task may hold for long, or await: every request behind it waits.
* ``async <op>(req)``: runs in trio, in a task of the dispatcher's nursery, started with one
  cross-thread call (``TrioToken.run_sync_soon``: it does not wait for trio). A kernel INTERRUPT
  of the request cancels the task's scope, which answers EINTR.

An operation with neither is answered ENOSYS, which for OPEN and OPENDIR (with NO_OPEN_SUPPORT /
NO_OPENDIR_SUPPORT negotiated) and FLUSH tells the kernel never to send them again on this
connection: a file system that keeps nothing per open file declines them that way, and a warm
file is then read with no request at all. Errors: raise ``OSError(errno)`` (``FileNotFoundError``
...); anything else is logged and answered EIO.

Results, by operation (``req`` is the request object from requests.py):

=====================================================  ===========================================
lookup, mknod, mkdir, symlink, link                    ``replies.Entry``
getattr, setattr                                       ``(replies.Attr, valid_seconds)``
readlink, read                                         bytes
open, opendir                                          ``Opened(fh, open_flags, backing_id)``
create                                                 ``(Entry, Opened)``
write, copy_file_range                                 bytes written
statfs                                                 ``replies.Statfs``
getxattr, listxattr                                    the value (size 0 and ERANGE are handled here)
readdir(req, buf) (READDIR and READDIRPLUS)            fills ``buf`` (a ``replies.DirentBuffer``)
getlk                                                  ``(start, end, type, pid)``
bmap, lseek, poll                                      an int
ioctl                                                  ``(result, out_bytes)``
unlink, rmdir, rename, release, releasedir, flush,     None
fsync, fsyncdir, setxattr, removexattr, access,
setlk (SETLK, SETLKW), fallocate, syncfs
=====================================================  ===========================================

Any result may instead be a ``replies.Encoded``: the reply body already in its wire form, sent as is;
or a ``replies.Failed``: the errno to answer, as a raised ``OSError`` would be (no exception on a hot path).

* ``take_<op>(req, reply, slow)`` (only ``take_read``, ``take_getattr`` and ``take_lookup`` are looked for): called on the reader thread,
  under ``fast_lock``, when the fast path answered MISS. It returns True when it took the request:
  it answers ``reply`` later from a thread of its own (never trio's), or calls ``slow()`` (any
  thread) to hand the request to the slow path in trio after all; False: the slow path runs now.
  It must not block either: it only decides, and queues the work (client/thread_reads.py).

A file system may have ``fast_lock`` (a lock): the dispatcher holds it around each fast path run
on the reader thread and the writing of its answer, so a change that the file system's trio thread
makes under the same lock (dropping what a fast path answers from, then telling the kernel) either
comes after the answer reached the kernel or is seen by it.

``lane_getattr(nodeid)``, if the file system has it: a GETATTR's whole reply body (bytes) where it
holds the attributes long, else None; the session calls it on the reader thread from the request's
header alone, before the request is parsed or dispatched (session.py, "The GETATTR lane"), under
``fast_lock``. It must be what ``fast_getattr`` would answer, or None. ``lane_lookup(nodeid, name)`` likewise for LOOKUP: the
entry's bytes or an errno (``int``) where ``fast_lookup`` would answer them, else None.

``forget(pairs)`` (``(nodeid, nlookup)`` pairs) and ``destroy()`` are called on the reader thread.
Each READDIRPLUS entry with a nonzero nodeid counts as one lookup of it, as LOOKUP does.
"""

from __future__ import annotations

import errno
import logging
from functools import partial
from typing import Any, Callable, NamedTuple, Sequence

import trio

from . import requests as rq
from .abi import Opcode
from .replies import DirentBuffer, Encoded, Failed, Reply

log = logging.getLogger(__name__)


class _Miss:
    __slots__ = ()

    def __repr__(self) -> str:
        return "MISS"


#: what a fast_<op> returns when it cannot answer from memory
MISS: Any = _Miss()


class Opened(NamedTuple):
    fh: int = 0
    open_flags: int = 0  # abi.OpenFlag
    backing_id: int = 0  # passthrough (7.40)


def _entry(reply: Reply, req, result) -> None:
    reply.entry(result)


def _attr(reply: Reply, req, result) -> None:
    attr, valid = result
    reply.attr(attr, valid)


def _data(reply: Reply, req, result) -> None:
    reply.data(result)


def _none(reply: Reply, req, result) -> None:
    reply.ok()


def _open(reply: Reply, req, result) -> None:
    reply.open(*result)


def _create(reply: Reply, req, result) -> None:
    entry, opened = result
    reply.create(entry, *opened)


def _write(reply: Reply, req, result) -> None:
    reply.write(result)


def _statfs(reply: Reply, req, result) -> None:
    reply.statfs(result)


def _xattr(reply: Reply, req, result) -> None:
    reply.xattr(result, req.size)


def _dir(reply: Reply, req, buf: DirentBuffer) -> None:
    reply.data(buf.getvalue())


def _lock(reply: Reply, req, result) -> None:
    reply.lock(*result)


def _bmap(reply: Reply, req, result) -> None:
    reply.bmap(result)


def _lseek(reply: Reply, req, result) -> None:
    reply.lseek(result)


def _poll(reply: Reply, req, result) -> None:
    reply.poll(result)


def _ioctl(reply: Reply, req, result) -> None:
    reply.ioctl(*result)


#: opcode -> (file system method name, how its result is answered)
OPERATIONS: dict[int, tuple[str, Callable[[Reply, Any, Any], None]]] = {
    Opcode.LOOKUP: ("lookup", _entry),
    Opcode.GETATTR: ("getattr", _attr),
    Opcode.SETATTR: ("setattr", _attr),
    Opcode.READLINK: ("readlink", _data),
    Opcode.SYMLINK: ("symlink", _entry),
    Opcode.MKNOD: ("mknod", _entry),
    Opcode.MKDIR: ("mkdir", _entry),
    Opcode.UNLINK: ("unlink", _none),
    Opcode.RMDIR: ("rmdir", _none),
    Opcode.RENAME: ("rename", _none),
    Opcode.RENAME2: ("rename", _none),
    Opcode.LINK: ("link", _entry),
    Opcode.OPEN: ("open", _open),
    Opcode.READ: ("read", _data),
    Opcode.WRITE: ("write", _write),
    Opcode.STATFS: ("statfs", _statfs),
    Opcode.RELEASE: ("release", _none),
    Opcode.FSYNC: ("fsync", _none),
    Opcode.SETXATTR: ("setxattr", _none),
    Opcode.GETXATTR: ("getxattr", _xattr),
    Opcode.LISTXATTR: ("listxattr", _xattr),
    Opcode.REMOVEXATTR: ("removexattr", _none),
    Opcode.FLUSH: ("flush", _none),
    Opcode.OPENDIR: ("opendir", _open),
    Opcode.READDIR: ("readdir", _dir),
    Opcode.READDIRPLUS: ("readdir", _dir),
    Opcode.RELEASEDIR: ("releasedir", _none),
    Opcode.FSYNCDIR: ("fsyncdir", _none),
    Opcode.GETLK: ("getlk", _lock),
    Opcode.SETLK: ("setlk", _none),
    Opcode.SETLKW: ("setlk", _none),
    Opcode.ACCESS: ("access", _none),
    Opcode.CREATE: ("create", _create),
    Opcode.BMAP: ("bmap", _bmap),
    Opcode.IOCTL: ("ioctl", _ioctl),
    Opcode.POLL: ("poll", _poll),
    Opcode.FALLOCATE: ("fallocate", _none),
    Opcode.LSEEK: ("lseek", _lseek),
    Opcode.COPY_FILE_RANGE: ("copy_file_range", _write),
    Opcode.SYNCFS: ("syncfs", _none),
}
_DIR_OPS = {Opcode.READDIR, Opcode.READDIRPLUS}
#: operations a file system may take off the reader thread without trio (``take_<op>``)
_TAKEN = {"read", "getattr", "lookup"}


class _Op(NamedTuple):
    fast: Callable | None
    slow: Callable | None
    answer: Callable[[Reply, Any, Any], None]
    is_dir: bool
    take: Callable | None = None  # take_<op> (module docstring)


class Dispatcher:
    """The session's handler: each request to ``fs``'s fast path, else to trio (see module docstring).

    ``trio_token`` and ``nursery`` are where slow paths run; without them (a file system that
    answers everything from memory) a MISS is answered EIO.
    """

    def __init__(self, fs: Any, trio_token: trio.lowlevel.TrioToken | None = None,
                 nursery: trio.Nursery | None = None):
        self.fs = fs
        self._token, self._nursery = trio_token, nursery
        self._ops: list[_Op | None] = [None] * (max(Opcode) + 1)
        for opcode, (name, answer) in OPERATIONS.items():
            fast, slow = getattr(fs, f"fast_{name}", None), getattr(fs, name, None)
            if fast is not None or slow is not None:
                take = getattr(fs, f"take_{name}", None) if name in _TAKEN else None
                self._ops[opcode] = _Op(fast, slow, answer, opcode in _DIR_OPS, take)
        # a file system whose state lives on the trio thread runs its fast paths there, in a callback
        # (no task, no cancel scope), not on the reader thread (operations_bridge.py)
        self._fast_in_trio = bool(getattr(fs, "fast_on_trio_thread", False)) and trio_token is not None
        # held around a fast path on the reader thread and its reply (a file system whose other
        # thread changes what its fast paths read takes it around such changes): the answer is
        # then either sent before a change it misses, or made after it
        self._fast_lock = getattr(fs, "fast_lock", None)
        self._forget = getattr(fs, "forget", None)
        self._destroy = getattr(fs, "destroy", None)
        #: the session's GETATTR lane (session.py): ``fs.lane_getattr(nodeid)``, the reply body in its
        #: wire form or None, run on the reader thread under ``lane_lock``; not for a file system
        #: whose fast paths run on the trio thread
        self.lane_getattr = None if self._fast_in_trio else getattr(fs, "lane_getattr", None)
        #: the same for LOOKUP: ``fs.lane_lookup(nodeid, name)``, the entry's bytes, an errno or None
        self.lane_lookup = None if self._fast_in_trio else getattr(fs, "lane_lookup", None)
        self.lane_lock = self._fast_lock

    def handle(self, req, reply: Reply) -> None:
        op = self._ops[req.header.opcode]
        if op is None:
            reply.error(errno.ENOSYS)
            return
        if op.fast is not None and self._fast_in_trio and not op.is_dir:
            self._schedule(self._fast_then_slow, op, req, reply)
            return
        if op.fast is not None:
            lock = self._fast_lock
            if lock is not None:
                lock.acquire()
            try:
                if op.is_dir:
                    buf = DirentBuffer(req.size, req.header.opcode == Opcode.READDIRPLUS)
                    result = buf if op.fast(req, buf) is not MISS else MISS
                else:
                    result = op.fast(req)
                if result is not MISS:
                    if result.__class__ is Encoded:
                        reply.ok(result)
                    elif result.__class__ is Failed:
                        reply.error(result)
                    else:
                        op.answer(reply, req, result)
                    return
            except OSError as e:
                reply.error(e.errno or errno.EIO)
                return
            finally:
                if lock is not None:
                    lock.release()
        if op.take is not None and self._token is not None and self._take(op, req, reply):
            return  # answered later, from the file system's own thread (or handed to trio by it)
        if op.slow is None:
            log.error("%s answered MISS and has no slow path: request %d answered EIO", type(req).__name__,
                      req.header.unique)
            reply.error(errno.EIO)
            return
        if self._token is None:
            reply.error(errno.ENOSYS if op.fast is None else errno.EIO)
            return
        self._schedule(self._spawn, op, req, reply)

    def _take(self, op: _Op, req, reply: Reply) -> bool:
        lock = self._fast_lock
        if lock is not None:
            lock.acquire()
        try:
            return op.take(req, reply, partial(self._slow, op, req, reply))
        except OSError as e:
            reply.error(e.errno or errno.EIO)
            return True
        finally:
            if lock is not None:
                lock.release()

    def _slow(self, op: _Op, req, reply: Reply) -> None:
        """(any thread) Run ``op``'s slow path for a request a ``take_<op>`` gave back."""
        self._schedule(self._spawn, op, req, reply)

    def _schedule(self, fn, op: _Op, req, reply: Reply) -> None:
        """Run ``fn(op, req, reply, scope)`` on the trio thread; an INTERRUPT cancels ``scope``."""
        scope = trio.CancelScope()
        reply.on_interrupt = partial(self._cancel, scope)
        try:
            self._token.run_sync_soon(fn, op, req, reply, scope)
        except trio.RunFinishedError:
            reply.error(errno.EIO)

    def _fast_then_slow(self, op: _Op, req, reply: Reply, scope: trio.CancelScope) -> None:
        """On the trio thread, for a file system whose fast paths must run there: answer from memory
        without a task, or start the slow path's task."""
        try:
            result = op.fast(req)
        except OSError as e:
            reply.error(e.errno or errno.EIO)
            return
        except Exception:
            log.exception("request %d (%s) failed", req.header.unique, type(req).__name__)
            reply.error(errno.EIO)
            return
        if result is MISS:
            if op.slow is None:
                reply.error(errno.EIO)
            else:
                self._spawn(op, req, reply, scope)
        elif result.__class__ is Encoded:
            reply.ok(result)
        elif result.__class__ is Failed:
            reply.error(result)
        else:
            op.answer(reply, req, result)

    def _cancel(self, scope: trio.CancelScope) -> None:
        try:
            self._token.run_sync_soon(scope.cancel)
        except trio.RunFinishedError:
            pass

    def _spawn(self, op: _Op, req, reply: Reply, scope: trio.CancelScope) -> None:
        try:
            self._nursery.start_soon(self._run, op, req, reply, scope, name=f"fuse-{type(req).__name__.lower()}")
        except RuntimeError:  # the nursery is closed: the mount is stopping
            reply.error(errno.EIO)

    async def _run(self, op: _Op, req, reply: Reply, scope: trio.CancelScope) -> None:
        try:
            with scope:
                if op.is_dir:
                    buf = DirentBuffer(req.size, req.header.opcode == Opcode.READDIRPLUS)
                    await op.slow(req, buf)
                    result = buf
                else:
                    result = await op.slow(req)
                if result.__class__ is Encoded:
                    reply.ok(result)
                elif result.__class__ is Failed:
                    reply.error(result)
                else:
                    op.answer(reply, req, result)
            if scope.cancelled_caught:
                reply.error(errno.EINTR)
        except OSError as e:
            reply.error(e.errno or errno.EIO)
        except Exception:
            log.exception("request %d (%s) failed", req.header.unique, type(req).__name__)
            if not reply.sent:
                reply.error(errno.EIO)

    def forget(self, forgets: Sequence[tuple[int, int]]) -> None:
        if self._forget is not None:
            self._forget(forgets)

    def destroy(self) -> None:
        if self._destroy is not None:
            self._destroy()
