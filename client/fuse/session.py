"""One FUSE connection, served: INIT, the reader thread, requests in flight, shutdown.

Threads and order:

1. :meth:`Session.start` reads the first request on the caller's thread. It must be INIT; the
   answer (:func:`negotiate`) fixes the connection (:class:`Connection`): the minor both speak,
   the flags both want, ``max_write``/``max_pages``, ``max_background``. Only then does the reader
   start, and only then may the caller report the mount as up (any other request, a ``stat`` of
   the mount point included, waits in the kernel until INIT is answered).
2. One reader thread (``fuse-reader``) loops: a blocking read of the device into one
   preallocated buffer, parse, then one of: FORGET/BATCH_FORGET applied inline (no reply);
   INTERRUPT passed to the interrupted request's ``on_interrupt`` (EAGAIN if it is not in flight,
   which makes the kernel send it again later); DESTROY answered and the loop ended; an IOCTL
   of a command the handler does not serve (``Options.ioctls``) answered ENOTTY at once; anything
   else given to the handler with a :class:`~.replies.Reply`. The handler either answers before
   it returns (the hot path: from memory, on this thread, no other thread woken) or keeps the
   reply and answers later from another thread (dispatch hands it to trio); only then is the
   request put in flight (where an INTERRUPT finds it). A handler that raises answers EIO.
   While the session's ``side`` work has something under way (the reader thread's own cold
   loads: client/reader_loads.py), the reader waits for the device and that work's sockets in
   one poll instead of the blocking read, and handles the work's events between requests.
3. Replies and notifications are written from any thread, each with one ``writev``.
4. The loop ends when the device says the connection is gone (unmounted, aborted: ENODEV), on
   DESTROY, or on a header that cannot be a request. :meth:`Session.close` then unmounts (if the
   session owns a mount), joins the reader, and closes the device.

The GETATTR lane: a GETATTR is the one request a warm file of the default mount still costs
(the kernel marks a file's atime stale at the end of every READ it had answered, fs/fuse
``fuse_invalidate_atime``, unless the superblock is read-only, and a ``stat`` asking
STATX_BASIC_STATS then sends GETATTR: docs/design.md, "What a warm sample still sends on the
default mount"). When the handler offers ``lane_getattr(nodeid)`` (the reply body already in its
wire form, or None), the reader answers a GETATTR from the header alone, before anything else is
made of it: no request object, no :class:`~.replies.Reply`, no dispatch; under ``lane_lock`` (the
dispatcher's fast lock, held around the answer's write as a fast path's is). None: the request
takes the ordinary way. Server CPU per GETATTR (bench/fuse_session_cpu.py): 5.0 us, the bare
loop's floor, against 7.3-7.7 us through the dispatcher. The same for LOOKUP when the handler
offers ``lane_lookup(nodeid, name)``: the entry's bytes, an errno (a positive ``int``: the
answer is that error), or None; the name is read from the buffer as the parser reads it (up to
its NUL). A create's or mkdir's LOOKUP of its new name in a directory the mount holds whole is
answered ENOENT there, so of the three requests of such a create (LOOKUP, CREATE, the
directory's GETATTR) only CREATE is parsed and dispatched.

Requests in flight are bounded (``max_in_flight``): the reader waits before its next read when
that many are unanswered, so a burst cannot queue without bound behind a slow cluster. Every
request read is counted by opcode (``counts``), including those no handler sees, so a test or a
benchmark can say how many requests the kernel sent for an operation.

The GIL: a reader that answers from memory needs the interpreter for a few microseconds per
request; a busy trio thread would hold it for a whole switch interval (5 ms by default) before
the reader gets it back. ``Options.switch_interval`` (0.2 ms) is set for the process at start:
the trio thread works in bursts (a batch of answers from the daemon, a burst of change events),
and each request the reader reads meanwhile waits for the interval to end. Measured on creates
through the default mount (20,000 files, interleaved, load 3.7-4.3): 1 ms against 0.2 ms,
3,502 -> 4,664, 3,856 -> 4,450 and 3,383 -> 3,690 creates/s; 0.1 ms beside 1 ms earlier, +2 to +17%.
"""

from __future__ import annotations

import errno
import logging
import os
import struct
import sys
import threading
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

from ...common.thread_names import name_os_thread
from . import abi, notify as _notify, requests as rq
from .abi import InitFlag, Opcode
from .device import Closed, Device
from .replies import Reply, encode_error, encode_init, encode_init_version_only

log = logging.getLogger(__name__)

#: the fields of a request's header the GETATTR lane reads: len, opcode, unique, nodeid
_HEAD_LANE = struct.Struct("<IIQQ")
#: ``fuse_out_header``: len, error, unique
_OUT_HEAD = struct.Struct("<IiQ")
#: a whole GETATTR request: the header and ``fuse_getattr_in``
_GETATTR_SIZE = abi.FUSE_IN_HEADER.size + 16

#: what a session asks for by default (each only if the kernel offers it)
DEFAULT_WANT = (
    InitFlag.ASYNC_READ  # readahead and concurrent reads of one file in parallel
    | InitFlag.BIG_WRITES
    | InitFlag.ATOMIC_O_TRUNC
    | InitFlag.AUTO_INVAL_DATA  # a changed mtime or size (GETATTR) drops the file's cached pages
    | InitFlag.DO_READDIRPLUS
    | InitFlag.READDIRPLUS_AUTO
    | InitFlag.ASYNC_DIO
    | InitFlag.NO_OPEN_SUPPORT  # OPEN answered ENOSYS: no OPEN, no RELEASE for the rest of the connection
    | InitFlag.NO_OPENDIR_SUPPORT
    | InitFlag.PARALLEL_DIROPS  # lookups and readdirs of one directory not serialized by the kernel
    | InitFlag.MAX_PAGES
    | InitFlag.CACHE_SYMLINKS
    | InitFlag.HAS_IOCTL_DIR
    | InitFlag.INIT_EXT  # needed for flags2 (bits 32..) to be read at all
)


#: request kinds the handler answers (everything but the session's own: forgets, interrupts, INIT, ...)
#: (tests/unit/test_fuse_session.py checks that every parsed kind is routed one way or the other)
_HANDLER_KINDS = frozenset({
    rq.Lookup, rq.Getattr, rq.Setattr, rq.Readlink, rq.Symlink, rq.Mknod, rq.Mkdir, rq.Unlink, rq.Rename,
    rq.Link, rq.Open, rq.Read, rq.Write, rq.Statfs, rq.Release, rq.Fsync, rq.Setxattr, rq.Getxattr,
    rq.Listxattr, rq.Removexattr, rq.Flush, rq.Lk, rq.Access, rq.Create, rq.Bmap, rq.Ioctl, rq.Poll,
    rq.Fallocate, rq.Lseek, rq.CopyFileRange, rq.Syncfs,
})


#: request kinds the session answers (or not) itself
SESSION_KINDS = frozenset({rq.Forget, rq.BatchForget, rq.Interrupt, rq.NotifyReply, rq.Init, rq.Destroy,
                           rq.Unsupported, rq.Malformed})


class SessionError(Exception):
    """The kernel and this session cannot agree (INIT failed, or the framing broke)."""


@dataclass(frozen=True)
class Options:
    want: int = DEFAULT_WANT
    max_write: int = 1 << 20  # bytes per WRITE (and READ with MAX_PAGES); capped by max_pages_limit
    max_readahead: int = 1 << 20  # capped by what the kernel offers
    max_background: int = 64  # async requests (readahead, ...) the kernel keeps in flight
    congestion_threshold: int = 0  # 0: 3/4 of max_background
    time_gran: int = 1  # ns: timestamps are kept to the nanosecond
    max_in_flight: int = 1024
    switch_interval: float | None = 0.0002  # seconds; None leaves the process's as it is
    #: the ioctl commands the handler serves; the session answers any other ENOTTY itself, from the
    #: parsed request, with no reply object, handler, lock or task (a buffered ``open()`` on Python
    #: before 3.14 asks isatty() of every file it opens: TCGETS, which the kernel forwards, as it
    #: forwards every ioctl of a FUSE file). None: every IOCTL goes to the handler.
    ioctls: frozenset[int] | None = None
    #: with PASSTHROUGH: the file-system stacking depth of the mount, sent as ``max_stack_depth``
    #: (the kernel takes passthrough only with 1..FILESYSTEM_MAX_STACK_DEPTH=2, and only without
    #: WRITEBACK_CACHE). 1: backing files on a plain file system (ext4, xfs: depth 0), and a stacked
    #: file system (overlayfs) may still sit on top of the mount; a backing file on overlayfs then
    #: fails BACKING_OPEN with ELOOP (2 would allow it, and forbid stacking on the mount).
    max_stack_depth: int = 1


@dataclass(frozen=True)
class Connection:
    """What INIT settled."""

    major: int
    minor: int
    flags: int  # InitFlag: what both sides want
    kernel_flags: int  # InitFlag: what the kernel offered (its capabilities, e.g. HAS_EXPIRE_ONLY)
    max_readahead: int
    max_write: int
    max_pages: int
    max_background: int
    congestion_threshold: int
    time_gran: int
    max_stack_depth: int = 0  # sent with PASSTHROUGH, else 0

    @property
    def passthrough(self) -> bool:
        """Whether OPEN may answer backing files (FOPEN_PASSTHROUGH) on this connection."""
        return bool(self.flags & InitFlag.PASSTHROUGH)


class Handler(Protocol):
    """What the session serves requests with (dispatch.Dispatcher is the one)."""

    def handle(self, req, reply: Reply) -> None: ...
    def forget(self, forgets: Sequence[tuple[int, int]]) -> None: ...
    def destroy(self) -> None: ...


def max_pages_limit() -> int:
    """The kernel's cap on pages per request (/proc/sys/fs/fuse/max_pages_limit, 6.13+; 256 before)."""
    try:
        with open("/proc/sys/fs/fuse/max_pages_limit") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 256


def negotiate(init: rq.Init, options: Options, pages_limit: int) -> tuple[Connection, bytes]:
    """The connection an INIT request settles and the reply body; :class:`SessionError` if none.
    (A kernel with a higher major is answered by the caller with :func:`encode_init_version_only`.)"""
    if init.major < abi.KERNEL_MAJOR or (init.major == abi.KERNEL_MAJOR and init.minor < abi.MIN_MINOR):
        raise SessionError(f"the kernel speaks FUSE {init.major}.{init.minor}, this session needs "
                           f"{abi.KERNEL_MAJOR}.{abi.MIN_MINOR} or later")
    minor = min(init.minor, abi.KERNEL_MINOR)
    kernel_flags = init.flags if init.flags & InitFlag.INIT_EXT else init.flags & 0xFFFFFFFF
    flags = kernel_flags & options.want
    stack_depth = 0
    if flags & InitFlag.PASSTHROUGH:
        if flags & InitFlag.WRITEBACK_CACHE or not 0 < options.max_stack_depth <= 2:
            # the kernel would ignore it (fs/fuse/inode.c): say so here, not at the first BACKING_OPEN
            log.warning("passthrough not asked: it needs max_stack_depth 1 or 2 (given %d) and no writeback "
                        "cache", options.max_stack_depth)
            flags &= ~InitFlag.PASSTHROUGH
        else:
            stack_depth = options.max_stack_depth
    if flags & InitFlag.MAX_PAGES:
        max_pages = max(1, min(pages_limit, options.max_write // abi.PAGE_SIZE))
    else:
        max_pages = 32  # the kernel's default (FUSE_DEFAULT_MAX_PAGES_PER_REQ)
    max_write = max(abi.PAGE_SIZE, min(options.max_write, max_pages * abi.PAGE_SIZE))
    max_readahead = min(init.max_readahead, options.max_readahead)
    max_background = min(options.max_background, 0xFFFF)
    congestion = options.congestion_threshold or max(1, max_background * 3 // 4)
    conn = Connection(abi.KERNEL_MAJOR, minor, flags, kernel_flags, max_readahead, max_write, max_pages,
                      max_background, congestion, options.time_gran, stack_depth)
    body = encode_init(minor, max_readahead, flags, max_background, congestion, max_write, options.time_gran,
                       max_pages if flags & InitFlag.MAX_PAGES else 0, stack_depth)
    return conn, body


class Session:
    """Serves one FUSE connection on ``device`` with ``handler``; see the module docstring."""

    def __init__(self, device: Device, handler: Handler, options: Options = Options(),
                 on_close: Callable[[], None] | None = None):
        self.device = device
        self.handler = handler
        self.options = options
        self.connection: Connection | None = None
        #: requests read, by opcode (index 0: opcodes past the table)
        self.counts = [0] * (max(Opcode) + 1)
        self.error: BaseException | None = None  # why the loop ended, if not an unmount
        self._on_close = on_close  # unmounts, where the session owns the mount
        self._ctx = rq.ParseContext()
        self._ioctls = options.ioctls
        self._in_flight: dict[int, Reply] = {}
        self._room = threading.Event()  # set when the reader, waiting for room (_full), may read again
        self._full = False
        self._retrieves: dict[int, list] = {}
        self._next_retrieve = 1
        self._lock = threading.Lock()
        #: work the reader thread does between requests (client/reader_loads.py), or None: an object
        #: with ``begin(fd, ident)`` (on the reader thread, before its first read), ``pending`` (true
        #: while it waits for something besides the device), ``wait(device=True)`` (waits for the
        #: device or its own events, handles the latter; True when the device is readable;
        #: ``device=False``: its own events only) and ``end()`` (the loop ended). Set before ``start``.
        self.side = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._closed = False

    # -- start ---------------------------------------------------------------------------------

    def start(self) -> Connection:
        """Answer INIT (on this thread), then start the reader. Returns the connection."""
        buf = bytearray(abi.MIN_READ_BUFFER + 4096)
        while True:
            try:
                n = self.device.read_into(buf)
            except Closed as e:
                raise SessionError(f"the connection ended before INIT: {e}") from None
            try:
                req = rq.parse(buf, n)
            except rq.BadHeader as e:
                raise SessionError(f"the first request is no FUSE request: {e}") from None
            self._count(req.header.opcode)
            reply = Reply(req.header.unique, self._finish)
            if not isinstance(req, rq.Init):
                reply.error(errno.EIO)
                raise SessionError(f"the kernel's first request was opcode {req.header.opcode}, not INIT")
            if req.major > abi.KERNEL_MAJOR:
                reply.init(encode_init_version_only())  # the kernel sends INIT again at our major
                continue
            try:
                conn, body = negotiate(req, self.options, max_pages_limit())
            except SessionError:
                reply.error(errno.EPROTO)
                raise
            reply.init(body)
            break
        self.connection = conn
        self._ctx = rq.ParseContext(conn.minor, bool(conn.flags & InitFlag.SETXATTR_EXT))
        log.debug("FUSE %d.%d: flags %s, max_write %d, max_pages %d", conn.major, conn.minor,
                  InitFlag(conn.flags), conn.max_write, conn.max_pages)
        if self.options.switch_interval is not None:
            sys.setswitchinterval(self.options.switch_interval)
        size = max(conn.max_write, 1 << 17) + abi.PAGE_SIZE  # WRITE data, or a 64 KiB xattr value, and headers
        self._thread = threading.Thread(target=self._serve, args=(bytearray(size),), name="fuse-reader", daemon=True)
        self._thread.start()
        return conn

    # -- the reader ----------------------------------------------------------------------------

    def _count(self, opcode: int) -> None:
        self.counts[opcode if opcode < len(self.counts) else 0] += 1

    def _serve(self, buf: bytearray) -> None:
        fd, bufs, readv = self.device.fd, (buf,), os.readv
        read, parse, ctx, handle, counts = self.device.read_into, rq.parse, self._ctx, self._handle, self.counts
        n_counts, in_flight, cap = len(counts), self._in_flight, self.options.max_in_flight
        side = self.side
        name_os_thread()
        lane = getattr(self.handler, "lane_getattr", None)
        lane_lock = getattr(self.handler, "lane_lock", None)
        lookup_lane = getattr(self.handler, "lane_lookup", None)
        head, out_head, getattr_op, getattr_size = _HEAD_LANE.unpack_from, _OUT_HEAD.pack, Opcode.GETATTR, _GETATTR_SIZE
        lookup_op, name_at = int(Opcode.LOOKUP), abi.FUSE_IN_HEADER.size
        try:
            if side is not None:
                side.begin(fd, threading.get_ident())
            while not self._stopping:
                if side is not None and side.pending and not side.wait():
                    continue  # its own events handled; the device has nothing yet
                try:
                    n = readv(fd, bufs)  # the hot path: one call, no wrapper
                    if n == 0:
                        raise Closed("end of file")
                except OSError:
                    try:
                        n = read(buf)  # retries, or says the connection is gone
                    except Closed:
                        break
                except Closed:
                    break
                if lane is not None and n == getattr_size:
                    length, opcode, unique, nodeid = head(buf)
                    if opcode == getattr_op and length == n and self._on_lane("GETATTR", lane_lock, out_head, unique, lane, nodeid):
                        counts[opcode] += 1
                        continue
                elif lookup_lane is not None and buf[4] == lookup_op and n > name_at:
                    length, opcode, unique, nodeid = head(buf)
                    nul = buf.find(0, name_at, n)
                    if (opcode == lookup_op and length == n and nul >= 0
                            and self._on_lane("LOOKUP", lane_lock, out_head, unique, lookup_lane, nodeid, bytes(buf[name_at:nul]))):
                        counts[opcode] += 1
                        continue
                req = parse(buf, n, ctx)
                opcode = req.header.opcode
                counts[opcode if opcode < n_counts else 0] += 1
                handle(req)
                if len(in_flight) >= cap:
                    self._wait_for_room()
        except rq.BadHeader as e:
            log.error("FUSE session ends: %s", e)
            self.error = e
        except BaseException as e:  # a bug here: end the session loudly rather than hang the kernel's callers
            log.exception("FUSE reader failed")
            self.error = e
        finally:
            self._stopping = True
            if side is not None:
                try:
                    side.end()
                except Exception:
                    log.exception("ending the reader thread's side work failed")

    def _on_lane(self, what: str, lock, out_head, unique: int, ask, *args) -> bool:
        """Answer request ``unique`` from a lane (module docstring: GETATTR's ``lane(nodeid)``,
        LOOKUP's ``lane(nodeid, name)``): ``ask(*args)`` gives the reply's body, or the errno it
        fails with; None (or a failure) and the request takes the ordinary way: False."""
        if lock is not None:
            lock.acquire()
        try:
            answer = ask(*args)
            if answer is None:
                return False
            try:
                if isinstance(answer, int):
                    self.device.writev((encode_error(unique, answer),))
                else:
                    self.device.writev((out_head(16 + len(answer), 0, unique), answer))
            except Closed:
                pass  # the connection is gone: the next read says so
            return True
        except Exception:
            log.exception("the %s lane failed for %r: the request takes the ordinary way", what, args)
            return False
        finally:
            if lock is not None:
                lock.release()

    def _handle(self, req) -> None:
        kind = type(req)
        h = req.header
        if kind in _HANDLER_KINDS:  # the common case first: one set lookup
            if kind is rq.Ioctl and self._ioctls is not None and req.cmd not in self._ioctls:
                self._send_error(h.unique, errno.ENOTTY)  # not one of ours (Options.ioctls)
                return
            reply = Reply(h.unique, self._finish)
            try:
                self.handler.handle(req, reply)
            except Exception:
                log.exception("request %d (%s) failed", h.unique, kind.__name__)
                if not reply.sent:
                    reply.error(errno.EIO)
            if not reply.sent:
                # in flight only once handed on (most are answered above, on this thread): an
                # INTERRUPT, read by this thread after this, finds it. Answered meanwhile by another
                # thread (its _finish found nothing to pop): taken out again.
                self._in_flight[h.unique] = reply
                if reply.sent:
                    self._in_flight.pop(h.unique, None)
            return
        if kind is rq.Forget:
            self._forget(((h.nodeid, req.nlookup),))
            return
        if kind is rq.BatchForget:
            if not req.complete:
                log.warning("BATCH_FORGET %d holds fewer forgets than it announces: applied %d", h.unique,
                            len(req.forgets))
            self._forget(req.forgets)
            return
        if kind is rq.Interrupt:
            target = self._in_flight.get(req.target)
            if target is None:
                Reply(h.unique, self._finish).error(errno.EAGAIN)
            elif target.on_interrupt is not None:
                try:
                    target.on_interrupt()
                except Exception:
                    log.exception("interrupting request %d failed", req.target)
            return
        if kind is rq.NotifyReply:
            self._retrieved(req)
            return
        reply = Reply(h.unique, self._finish)
        self._in_flight[h.unique] = reply
        if kind is rq.Unsupported:
            reply.error(errno.ENOSYS)
        elif kind is rq.Malformed:
            log.warning("request %d (opcode %d) answered %s: %s", h.unique, h.opcode, errno.errorcode[req.errno],
                        req.reason)
            reply.error(req.errno)
        elif kind is rq.Init:
            log.warning("a second INIT (request %d): answered EPROTO", h.unique)
            reply.error(errno.EPROTO)
        elif kind is rq.Destroy:
            try:
                self.handler.destroy()
            except Exception:
                log.exception("destroy failed")
            reply.ok()
            self._stopping = True
        else:  # a request type this session does not route: a bug here, not in the kernel
            log.error("request %d (%s) has no route in the session: answered EIO", h.unique, kind.__name__)
            reply.error(errno.EIO)

    def _forget(self, forgets) -> None:
        try:
            self.handler.forget(forgets)
        except Exception:
            log.exception("forget failed")

    def _send_error(self, unique: int, err: int) -> None:
        """Answer errno ``err`` to a request the session answers itself, never in flight."""
        try:
            self.device.writev((encode_error(unique, err),))
        except Closed:
            pass

    def _finish(self, unique: int, parts: Sequence[bytes]) -> None:
        """Send an answer (any thread); the request is then no longer in flight."""
        try:
            self.device.writev(parts)
        except Closed:
            pass  # the connection is gone: nobody waits for this answer
        finally:
            self._in_flight.pop(unique, None)
            if self._full and len(self._in_flight) < self.options.max_in_flight:
                self._room.set()

    def _wait_for_room(self) -> None:
        self._room.clear()
        self._full = True
        side = self.side
        while len(self._in_flight) >= self.options.max_in_flight and not self._stopping:
            if side is not None and side.pending:
                side.wait(device=False)  # some of those in flight may be this thread's to answer
            else:
                self._room.wait(0.5)
        self._full = False

    # -- writing -------------------------------------------------------------------------------

    def notify(self, parts: Sequence[bytes]) -> bool:
        """Send a notification (see notify.py); False if the kernel had nothing to do (ENOENT) or the
        connection is gone."""
        try:
            return self.device.writev(parts)
        except Closed:
            return False

    def retrieve(self, nodeid: int, offset: int, size: int, timeout: float = 10.0) -> bytes | None:
        """The bytes the kernel holds in ``nodeid``'s page cache from ``offset`` (NOTIFY_RETRIEVE;
        the answer arrives as a request). None if it holds none or the connection is gone. Not on
        the reader thread: that thread reads the answer."""
        conn = self.connection
        _notify.check(abi.NotifyCode.RETRIEVE, conn.minor, conn.kernel_flags)
        with self._lock:
            unique, self._next_retrieve = self._next_retrieve, self._next_retrieve + 1
            slot = self._retrieves[unique] = [threading.Event(), None]
        try:
            if not self.notify(_notify.retrieve(unique, nodeid, offset, size)):
                return None
            slot[0].wait(timeout)
            return slot[1]
        finally:
            self._retrieves.pop(unique, None)

    def _retrieved(self, req: rq.NotifyReply) -> None:
        slot = self._retrieves.get(req.header.unique)
        if slot is not None:
            slot[1] = req.data
            slot[0].set()

    # -- the end -------------------------------------------------------------------------------

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the reader has ended (unmounted, DESTROY, or broken); False on timeout."""
        if self._thread is not None:
            self._thread.join(timeout)
            return not self._thread.is_alive()
        return True

    def close(self) -> None:
        """Unmount (if this session owns the mount), let the reader end, answer what is still in
        flight (nothing is listening once the connection is gone), close the device. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stopping = True
        if self._on_close is not None:
            try:
                self._on_close()
            except Exception:
                log.exception("unmount failed")
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(10)
            if self._thread.is_alive():
                log.warning("the FUSE reader did not end within 10 s of the unmount")
        for reply in list(self._in_flight.values()):
            if not reply.sent:
                try:
                    reply.error(errno.EIO)
                except Exception:
                    pass
        self.device.close()
