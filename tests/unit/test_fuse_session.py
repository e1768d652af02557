"""The FUSE session (stripefs.client.fuse.session and dispatch) driven over a socket pair.

A ``SOCK_SEQPACKET`` socket pair stands in for /dev/fuse: one message per read and per write,
as the device has. The test plays the kernel on one end (sends requests, reads answers); the
session serves the other with its real reader thread. Slow paths run in the test's trio loop,
so the kernel's side of a test that has them blocks in a worker thread, never in trio.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import stat
import threading

import pytest
import trio

from stripefs.client.fuse import abi, device as device_mod, notify, requests as rq
from stripefs.client.fuse.abi import InitFlag, Opcode
from stripefs.client.fuse.device import Closed, Device
from stripefs.client.fuse.dispatch import MISS, Dispatcher
from stripefs.client.fuse.replies import AlreadyAnswered, Attr, Encoded, encode_attr_out
from stripefs.client.fuse.session import Options, Session, SessionError

from test_fuse_wire import u32, u64, request  # noqa: E402  (the same byte spellings)

INIT_FLAGS = InitFlag.ASYNC_READ | InitFlag.PARALLEL_DIROPS | InitFlag.NO_OPEN_SUPPORT | InitFlag.MAX_PAGES | InitFlag.INIT_EXT
ATTR = Attr(ino=2, mode=stat.S_IFREG | 0o644, size=5)


def init_args(minor: int = 45, flags: int = INIT_FLAGS, major: int = 7) -> bytes:
    return u32(major) + u32(minor) + u32(131072) + u32(flags & 0xFFFFFFFF) + u32(flags >> 32) + bytes(44)


def getattr_args() -> bytes:
    return u32(0) + u32(0) + u64(0)


class Kernel:
    """The kernel's end of the pair."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        sock.settimeout(10)

    def send(self, opcode: int, args: bytes = b"", unique: int = 2, nodeid: int = 2) -> None:
        self.sock.send(request(opcode, args, unique=unique, nodeid=nodeid))

    def answer(self) -> tuple[int, int, bytes]:
        """(unique, error, body) of the next message from the session."""
        msg = self.sock.recv(1 << 20)
        length, error, unique = int.from_bytes(msg[:4], "little"), int.from_bytes(msg[4:8], "little", signed=True), \
            int.from_bytes(msg[8:16], "little")
        assert length == len(msg)
        return unique, error, msg[16:]

    def nothing(self, wait: float = 0.2) -> bool:
        self.sock.settimeout(wait)
        try:
            self.sock.recv(1 << 20)
        except TimeoutError:
            return True
        finally:
            self.sock.settimeout(10)
        return False

    async def answer_async(self):
        return await trio.to_thread.run_sync(self.answer)


class FS:
    """Fast paths from memory; a slow getxattr that waits until told (or cancelled)."""

    def __init__(self):
        self.forgets: list[tuple[int, int]] = []
        self.destroyed = False
        self.release = trio.Event()
        self.started = threading.Event()
        self.errors: list[BaseException] = []
        self.reply_twice = False

    def fast_getattr(self, req):
        if req.header.nodeid == 666:
            raise RuntimeError("a bug in a handler")
        return ATTR, 1.0

    def fast_lookup(self, req):
        if req.name == b"slow":
            return MISS
        raise FileNotFoundError(errno.ENOENT, "no")

    async def lookup(self, req):
        self.started.set()
        await self.release.wait()
        raise FileNotFoundError(errno.ENOENT, "no")

    def forget(self, forgets):
        self.forgets.extend(forgets)

    def destroy(self):
        self.destroyed = True


class TwiceHandler:
    """Answers GETATTR twice: the second must raise, and the kernel must see one answer."""

    def __init__(self):
        self.raised: list[BaseException] = []

    def handle(self, req, reply):
        reply.attr(ATTR, 1.0)
        try:
            reply.error(errno.EIO)
        except AlreadyAnswered as e:
            self.raised.append(e)
            raise

    def forget(self, forgets):
        pass

    def destroy(self):
        pass


@pytest.fixture
def pair():
    kernel_sock, dev_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    yield Kernel(kernel_sock), Device(dev_sock.detach())
    kernel_sock.close()


def started(pair, handler, options=Options(switch_interval=None), minor=45) -> tuple[Kernel, Session]:
    kernel, dev = pair
    kernel.send(Opcode.INIT, init_args(minor), unique=1, nodeid=0)
    session = Session(dev, handler, options)
    session.start()
    unique, error, body = kernel.answer()
    assert (unique, error) == (1, 0)
    return kernel, session


def stop(kernel: Kernel, session: Session) -> None:
    kernel.sock.shutdown(socket.SHUT_RDWR)  # the connection goes: the reader ends
    assert session.wait(10)
    session.close()


def test_every_request_kind_has_a_route():
    from stripefs.client.fuse import session as session_mod
    from test_fuse_wire import GOLDEN

    kinds = {type(expected(None)) for _, _, expected in GOLDEN} | {rq.Unsupported, rq.Malformed}
    routed = session_mod._HANDLER_KINDS | session_mod.SESSION_KINDS
    assert kinds <= routed and not session_mod._HANDLER_KINDS & session_mod.SESSION_KINDS


def test_init_and_a_hot_request(pair):
    kernel, session = started(pair, Dispatcher(FS()))
    assert session.connection.minor == 45 and session.connection.flags & InitFlag.NO_OPEN_SUPPORT
    kernel.send(Opcode.GETATTR, getattr_args(), unique=10)
    unique, error, body = kernel.answer()
    assert (unique, error, len(body)) == (10, 0, abi.ATTR_OUT_SIZE)
    assert session.counts[Opcode.INIT] == 1 and session.counts[Opcode.GETATTR] == 1
    stop(kernel, session)


def test_init_at_an_old_minor_answers_24_bytes(pair):
    kernel, dev = pair
    kernel.send(Opcode.INIT, u32(7) + u32(22) + u32(65536) + u32(InitFlag.ASYNC_READ), unique=1, nodeid=0)
    session = Session(dev, Dispatcher(FS()), Options(switch_interval=None))
    conn = session.start()
    unique, error, body = kernel.answer()
    assert conn.minor == 22 and len(body) == 24 and body[:8] == u32(7) + u32(22)
    stop(kernel, session)


def test_a_newer_major_is_asked_again(pair):
    kernel, dev = pair
    kernel.send(Opcode.INIT, init_args(major=8, minor=0), unique=1, nodeid=0)
    kernel.send(Opcode.INIT, init_args(), unique=3, nodeid=0)
    session = Session(dev, Dispatcher(FS()), Options(switch_interval=None))
    conn = session.start()
    assert kernel.answer() == (1, 0, u32(7) + u32(45))
    assert kernel.answer()[:2] == (3, 0) and conn.minor == 45
    stop(kernel, session)


def test_a_first_request_other_than_init_fails_the_start(pair):
    kernel, dev = pair
    kernel.send(Opcode.GETATTR, getattr_args(), unique=5)
    with pytest.raises(SessionError, match="not INIT"):
        Session(dev, Dispatcher(FS()), Options(switch_interval=None)).start()
    assert kernel.answer() == (5, -errno.EIO, b"")
    dev.close()


def test_too_old_a_kernel_is_answered_eproto(pair):
    kernel, dev = pair
    kernel.send(Opcode.INIT, u32(7) + u32(8) + u32(0) + u32(0), unique=1, nodeid=0)
    with pytest.raises(SessionError, match="7.12"):
        Session(dev, Dispatcher(FS()), Options(switch_interval=None)).start()
    assert kernel.answer() == (1, -errno.EPROTO, b"")
    dev.close()


def test_unknown_malformed_and_unserved(pair, caplog):
    kernel, session = started(pair, Dispatcher(FS()))
    kernel.send(99, b"", unique=10)
    assert kernel.answer() == (10, -errno.ENOSYS, b"")
    kernel.send(Opcode.GETATTR, b"\0" * 3, unique=11)  # short arguments
    assert kernel.answer() == (11, -errno.EIO, b"")
    kernel.send(Opcode.MKDIR, u32(0o755) + u32(0) + b"d\0", unique=12)  # the file system has no mkdir
    assert kernel.answer() == (12, -errno.ENOSYS, b"")
    kernel.send(Opcode.LOOKUP, b"x\0", unique=13)
    assert kernel.answer() == (13, -errno.ENOENT, b"")
    assert session.running
    stop(kernel, session)


def test_a_raising_handler_answers_eio_and_serving_goes_on(pair, caplog):
    kernel, session = started(pair, Dispatcher(FS()))
    with caplog.at_level(logging.ERROR):
        kernel.send(Opcode.GETATTR, getattr_args(), unique=10, nodeid=666)
        assert kernel.answer() == (10, -errno.EIO, b"")
    assert "a bug in a handler" in caplog.text
    kernel.send(Opcode.GETATTR, getattr_args(), unique=11)
    assert kernel.answer()[:2] == (11, 0)
    stop(kernel, session)


def test_a_double_reply_raises_and_the_kernel_sees_one(pair, caplog):
    handler = TwiceHandler()
    kernel, session = started(pair, handler)
    with caplog.at_level(logging.ERROR):
        kernel.send(Opcode.GETATTR, getattr_args(), unique=10)
        assert kernel.answer()[:2] == (10, 0)
        assert kernel.nothing()
    assert len(handler.raised) == 1 and "answered already" in caplog.text
    stop(kernel, session)


def test_forget_and_a_bad_batch_forget_count(pair, caplog):
    fs = FS()
    kernel, session = started(pair, Dispatcher(fs))
    kernel.send(Opcode.FORGET, u64(3), unique=10, nodeid=7)
    with caplog.at_level(logging.WARNING):
        # announces 3, holds 2 and a half: the 2 are applied, and nothing is answered
        kernel.send(Opcode.BATCH_FORGET, u32(3) + u32(0) + u64(5) + u64(1) + u64(6) + u64(2) + u64(9), unique=11)
        kernel.send(Opcode.GETATTR, getattr_args(), unique=12)
        assert kernel.answer()[:2] == (12, 0)  # the first answer is GETATTR's: forgets got none
    assert fs.forgets == [(7, 3), (5, 1), (6, 2)]
    assert "fewer forgets than it announces" in caplog.text
    stop(kernel, session)


def test_destroy_answers_and_ends_the_reader(pair):
    fs = FS()
    kernel, session = started(pair, Dispatcher(fs))
    kernel.send(Opcode.DESTROY, unique=10, nodeid=0)
    assert kernel.answer() == (10, 0, b"")
    assert session.wait(10) and fs.destroyed
    session.close()


async def test_interrupt_in_flight_and_unknown(pair):
    fs = FS()
    async with trio.open_nursery() as nursery:
        dispatcher = Dispatcher(fs, trio.lowlevel.current_trio_token(), nursery)
        kernel, session = await trio.to_thread.run_sync(started, pair, dispatcher)
        kernel.send(Opcode.LOOKUP, b"slow\0", unique=10, nodeid=1)
        await trio.to_thread.run_sync(fs.started.wait, 10)
        kernel.send(Opcode.INTERRUPT, u64(999), unique=13, nodeid=0)  # not in flight: EAGAIN, try later
        assert await kernel.answer_async() == (13, -errno.EAGAIN, b"")
        kernel.send(Opcode.INTERRUPT, u64(10), unique=11, nodeid=0)
        assert await kernel.answer_async() == (10, -errno.EINTR, b"")  # the request, not the INTERRUPT
        assert await trio.to_thread.run_sync(kernel.nothing)
        await trio.to_thread.run_sync(stop, kernel, session)


async def test_a_slow_request_answers_from_trio(pair):
    fs = FS()
    async with trio.open_nursery() as nursery:
        dispatcher = Dispatcher(fs, trio.lowlevel.current_trio_token(), nursery)
        kernel, session = await trio.to_thread.run_sync(started, pair, dispatcher)
        kernel.send(Opcode.LOOKUP, b"slow\0", unique=10, nodeid=1)
        kernel.send(Opcode.GETATTR, getattr_args(), unique=11)  # hot: answered while the lookup waits
        assert (await kernel.answer_async())[:2] == (11, 0)
        fs.release.set()
        assert await kernel.answer_async() == (10, -errno.ENOENT, b"")
        await trio.to_thread.run_sync(stop, kernel, session)


async def test_a_slow_path_may_answer_in_wire_form(pair):
    """A handler in trio may answer with ``Encoded`` bytes as a fast path may (the mount's
    getattr does when the feed came back between the MISS and the task): sent as they are."""
    packed = Encoded(encode_attr_out(ATTR, 2.0))

    class SlowFS:
        async def getattr(self, req):
            return packed

    async with trio.open_nursery() as nursery:
        dispatcher = Dispatcher(SlowFS(), trio.lowlevel.current_trio_token(), nursery)
        kernel, session = await trio.to_thread.run_sync(started, pair, dispatcher)
        kernel.send(Opcode.GETATTR, getattr_args(), unique=10)
        assert await kernel.answer_async() == (10, 0, bytes(packed))
        await trio.to_thread.run_sync(stop, kernel, session)


async def test_the_connection_going_mid_request(pair):
    """The device ends (ENODEV: unmounted, aborted) while a request is in flight: the reader ends,
    and the late answer goes nowhere without an error."""
    fs = FS()
    async with trio.open_nursery() as nursery:
        dispatcher = Dispatcher(fs, trio.lowlevel.current_trio_token(), nursery)
        kernel, session = await trio.to_thread.run_sync(started, pair, dispatcher)
        kernel.send(Opcode.LOOKUP, b"slow\0", unique=10, nodeid=1)
        await trio.to_thread.run_sync(fs.started.wait, 10)
        kernel.sock.close()
        assert await trio.to_thread.run_sync(session.wait, 10)
        fs.release.set()  # the lookup answers now: to a closed connection
        await trio.sleep(0.1)
        await trio.to_thread.run_sync(session.close)
    assert session.error is None


def test_requests_in_flight_are_bounded(pair):
    """With max_in_flight 2 the reader stops reading until one of two deferred requests is answered."""
    held = []

    class Holder:
        def handle(self, req, reply):
            held.append(reply)

        def forget(self, forgets):
            pass

        def destroy(self):
            pass

    kernel, session = started(pair, Holder(), Options(switch_interval=None, max_in_flight=2))
    for unique in (10, 11, 12):
        kernel.send(Opcode.GETATTR, getattr_args(), unique=unique)
    for _ in range(100):
        if len(held) == 2:
            break
        threading.Event().wait(0.01)
    threading.Event().wait(0.1)
    assert [r.unique for r in held] == [10, 11]  # 12 is not read yet
    held[0].error(errno.EIO)
    assert kernel.answer()[0] == 10
    for _ in range(100):
        if len(held) == 3:
            break
        threading.Event().wait(0.01)
    assert [r.unique for r in held] == [10, 11, 12]
    held[1].error(errno.EIO)
    held[2].error(errno.EIO)
    stop(kernel, session)


def test_notify_and_retrieve_from_another_thread(pair):
    kernel, session = started(pair, Dispatcher(FS()))
    assert session.notify(notify.inval_inode(2, 0, 0))
    unique, code, body = kernel.answer()
    assert (unique, code, body) == (0, abi.NotifyCode.INVAL_INODE, u64(2) + u64(0) + u64(0))
    got = []
    t = threading.Thread(target=lambda: got.append(session.retrieve(2, 0, 5)))
    t.start()
    unique, code, body = kernel.answer()
    assert (unique, code) == (0, abi.NotifyCode.RETRIEVE)
    notify_unique = int.from_bytes(body[:8], "little")
    kernel.send(Opcode.NOTIFY_REPLY, u64(0) + u64(0) + u32(5) + u32(0) + u64(0) + u64(0) + b"hello",
                unique=notify_unique, nodeid=2)
    t.join(10)
    assert got == [b"hello"]
    assert kernel.nothing()  # NOTIFY_REPLY is not answered
    stop(kernel, session)


def test_device_reads_retry_and_end(monkeypatch):
    results = iter([InterruptedError(errno.EINTR, "x"), FileNotFoundError(errno.ENOENT, "interrupted"), 48,
                    OSError(errno.ENODEV, "unmounted")])

    def fake_readv(fd, bufs):
        r = next(results)
        if isinstance(r, BaseException):
            raise r
        return r

    monkeypatch.setattr(device_mod.os, "readv", fake_readv)
    dev = Device(-1, owned=False)
    assert dev.read_into(bytearray(8192)) == 48
    with pytest.raises(Closed):
        dev.read_into(bytearray(8192))


def test_device_writes_map_enoent_and_enodev(monkeypatch):
    errors = iter([FileNotFoundError(errno.ENOENT, "gone"), OSError(errno.ENODEV, "unmounted")])

    def fake_writev(fd, parts):
        raise next(errors)

    monkeypatch.setattr(device_mod.os, "writev", fake_writev)
    dev = Device(-1, owned=False)
    assert dev.writev([b"x"]) is False
    with pytest.raises(Closed):
        dev.writev([b"x"])


def test_an_encoded_result_is_sent_as_it_is(pair):
    from stripefs.client.fuse.replies import Encoded, encode_attr_out

    body = encode_attr_out(ATTR, 2.0)

    class Packed:
        def fast_getattr(self, req):
            return Encoded(body)

    kernel, session = started(pair, Dispatcher(Packed()))
    kernel.send(Opcode.GETATTR, getattr_args(), unique=10)
    assert kernel.answer() == (10, 0, body)
    stop(kernel, session)


async def test_an_error_returned_not_raised_is_answered_as_raised(pair):
    """``Failed(errno)`` from a fast path (on the reader thread or the trio thread) or a slow path
    answers that error, as a raised OSError would (a create's LOOKUP of its new name returns it)."""
    from stripefs.client.fuse.replies import Failed

    class Returns:
        def fast_lookup(self, req):
            return Failed(errno.ENOENT) if req.name == b"new" else MISS

        async def lookup(self, req):
            return Failed(errno.EACCES)

    async with trio.open_nursery() as nursery:
        dispatcher = Dispatcher(Returns(), trio.lowlevel.current_trio_token(), nursery)
        kernel, session = await trio.to_thread.run_sync(started, pair, dispatcher)
        kernel.send(Opcode.LOOKUP, b"new\0", unique=10, nodeid=1)
        assert await kernel.answer_async() == (10, -errno.ENOENT, b"")
        kernel.send(Opcode.LOOKUP, b"other\0", unique=11, nodeid=1)
        assert await kernel.answer_async() == (11, -errno.EACCES, b"")
        await trio.to_thread.run_sync(stop, kernel, session)


async def test_an_error_returned_by_a_fast_path_on_the_trio_thread_is_answered(pair):
    from stripefs.client.fuse.replies import Failed

    class Returns:
        fast_on_trio_thread = True

        def fast_lookup(self, req):
            return Failed(errno.ENOENT)

    async with trio.open_nursery() as nursery:
        dispatcher = Dispatcher(Returns(), trio.lowlevel.current_trio_token(), nursery)
        kernel, session = await trio.to_thread.run_sync(started, pair, dispatcher)
        kernel.send(Opcode.LOOKUP, b"new\0", unique=12, nodeid=1)
        assert await kernel.answer_async() == (12, -errno.ENOENT, b"")
        await trio.to_thread.run_sync(stop, kernel, session)


async def test_fast_paths_on_the_trio_thread(pair):
    """A file system with fast_on_trio_thread: its fast paths run on the trio thread, in a callback
    (no task), and a MISS starts the slow path's task."""
    threads = []

    class TrioFS:
        fast_on_trio_thread = True

        def fast_getattr(self, req):
            threads.append(threading.current_thread())
            if req.header.nodeid == 3:
                return MISS
            return ATTR, 1.0

        async def getattr(self, req):
            threads.append(("task", trio.lowlevel.current_task().name))
            return ATTR, 2.0

    async with trio.open_nursery() as nursery:
        dispatcher = Dispatcher(TrioFS(), trio.lowlevel.current_trio_token(), nursery)
        kernel, session = await trio.to_thread.run_sync(started, pair, dispatcher)
        kernel.send(Opcode.GETATTR, getattr_args(), unique=10, nodeid=2)
        assert (await kernel.answer_async())[:2] == (10, 0)
        kernel.send(Opcode.GETATTR, getattr_args(), unique=11, nodeid=3)
        unique, error, body = await kernel.answer_async()
        assert (unique, error, body[:8]) == (11, 0, u64(2))  # the slow path's answer: valid 2 s
        await trio.to_thread.run_sync(stop, kernel, session)
    assert threads[0] is threading.main_thread() and threads[1] is threading.main_thread()
    assert threads[2] == ("task", "fuse-getattr")


def test_fast_paths_on_the_reader_thread_hold_the_fast_lock(pair):
    """A file system with a fast_lock: its fast paths run on the reader thread (no trio at all),
    and the answer is sent while the lock is held, so a change made under the lock by another
    thread is either seen by the answer or made after the kernel has it."""
    lock = threading.RLock()
    seen = []

    class LockedFS:
        fast_lock = lock

        def fast_getattr(self, req):
            seen.append((threading.current_thread().name, lock._is_owned()))
            return ATTR, 1.0

    kernel, session = started(pair, Dispatcher(LockedFS()))
    with lock:  # another thread is changing what the fast path reads
        kernel.send(Opcode.GETATTR, getattr_args(), unique=10)
        assert kernel.nothing(0.2)  # not answered meanwhile
    assert kernel.answer()[:2] == (10, 0)
    assert seen == [("fuse-reader", True)]
    assert not lock._is_owned()
    stop(kernel, session)


def test_ioctls_the_handler_does_not_serve_are_answered_by_the_session(pair):
    """Options.ioctls: an IOCTL of another command (a buffered open()'s isatty(): TCGETS) is
    answered ENOTTY by the session itself, never reaching the handler; one of the listed commands
    goes to the handler. Both are counted."""
    ours, tcgets = 0x40045301, 0x5401
    seen = []

    class Ioctls:
        def fast_ioctl(self, req):
            seen.append(req.cmd)
            return 7, b""

    def ioctl_args(cmd: int) -> bytes:
        return u64(0) + u32(0) + u32(cmd) + u64(0) + u32(0) + u32(0)

    kernel, session = started(pair, Dispatcher(Ioctls()), Options(switch_interval=None, ioctls=frozenset({ours})))
    kernel.send(Opcode.IOCTL, ioctl_args(tcgets), unique=10)
    assert kernel.answer() == (10, -errno.ENOTTY, b"")
    kernel.send(Opcode.IOCTL, ioctl_args(ours), unique=11)
    unique, error, body = kernel.answer()
    assert (unique, error, body[:4]) == (11, 0, u32(7))
    assert seen == [ours] and session.counts[Opcode.IOCTL] == 2
    assert not session._in_flight  # answered on the reader thread: never in flight
    stop(kernel, session)


async def test_a_read_taken_off_the_reader_thread_is_answered_from_another_thread_or_handed_to_trio(pair):
    """``take_read`` (client/thread_reads.py's hook): called on the reader thread under the fast
    lock after the fast path; a READ it takes is answered later from a thread of its own (no trio
    task), one it gives back with ``slow()`` runs the slow path in trio, one it declines runs there
    at once."""
    lock = threading.RLock()
    taken, slow_runs = [], []

    class ThreadFS:
        fast_lock = lock

        def take_read(self, req, reply, slow):
            assert lock._is_owned() and threading.current_thread().name == "fuse-reader"
            if req.offset == 0:  # declined
                return False
            taken.append(req.offset)
            if req.offset == 1:  # answered by a thread of its own
                threading.Thread(target=reply.data, args=(b"from a thread",)).start()
            else:  # given back: trio's path after all
                threading.Thread(target=slow).start()
            return True

        async def read(self, req):
            slow_runs.append(req.offset)
            return b"from trio"

    def read_args(offset: int) -> bytes:
        return u64(0) + u64(offset) + u32(100) + u32(0) + u64(0) + u32(0) + u32(0)

    async with trio.open_nursery() as nursery:
        dispatcher = Dispatcher(ThreadFS(), trio.lowlevel.current_trio_token(), nursery)
        kernel, session = await trio.to_thread.run_sync(started, pair, dispatcher)
        kernel.send(Opcode.READ, read_args(1), unique=10)
        assert await kernel.answer_async() == (10, 0, b"from a thread")
        kernel.send(Opcode.READ, read_args(2), unique=11)
        assert await kernel.answer_async() == (11, 0, b"from trio")
        kernel.send(Opcode.READ, read_args(0), unique=12)
        assert await kernel.answer_async() == (12, 0, b"from trio")
        await trio.to_thread.run_sync(stop, kernel, session)
    assert taken == [1, 2] and slow_runs == [2, 0]


def test_the_lookup_lane_answers_a_name_or_its_error_under_the_fast_lock(pair, caplog):
    """A file system with ``lane_lookup``: a LOOKUP it can answer from memory is answered by the
    session before the request is parsed or dispatched (the name read up to its NUL; an entry's
    bytes as they are, or an errno as the error reply), counted, under the fast lock; None, or a
    lane that fails, takes the ordinary way (fast_lookup)."""
    from stripefs.client.fuse.replies import Entry, encode_entry

    lock = threading.RLock()
    held = encode_entry(Entry(9, Attr(ino=9, mode=stat.S_IFREG | 0o644, size=7), 30.0, 30.0, 0))
    lanes, fast = [], []

    class LaneFS:
        fast_lock = lock

        def lane_lookup(self, nodeid, name):
            lanes.append((nodeid, name, lock._is_owned()))
            if name == b"bug":
                raise RuntimeError("a bug in a lane")
            return {b"new": errno.ENOENT, b"held": held}.get(name)

        def fast_lookup(self, req):
            fast.append(req.name)
            return Entry(10, Attr(ino=10, mode=stat.S_IFREG | 0o644, size=1), 1.0, 1.0, 0)

    kernel, session = started(pair, Dispatcher(LaneFS()))
    with lock:  # another thread is changing what the lane reads: no answer meanwhile
        kernel.send(Opcode.LOOKUP, b"new\0", unique=10, nodeid=5)
        assert kernel.nothing(0.2)
    assert kernel.answer() == (10, -errno.ENOENT, b"")
    kernel.send(Opcode.LOOKUP, b"held\0", unique=11, nodeid=5)
    assert kernel.answer() == (11, 0, held)
    assert lanes == [(5, b"new", True), (5, b"held", True)] and fast == []
    kernel.send(Opcode.LOOKUP, b"other\0", unique=12, nodeid=5)
    unique, error, body = kernel.answer()
    assert (unique, error, len(body)) == (12, 0, abi.ENTRY_OUT_SIZE) and body != held and fast == [b"other"]
    with caplog.at_level(logging.ERROR):
        kernel.send(Opcode.LOOKUP, b"bug\0", unique=13, nodeid=5)
        assert kernel.answer()[:2] == (13, 0)
    assert fast == [b"other", b"bug"] and "LOOKUP lane failed" in caplog.text
    kernel.send(Opcode.LOOKUP, b"held", unique=14, nodeid=5)  # no NUL: not the lane's (the parser's EIO)
    assert kernel.answer()[:2] == (14, -errno.EIO) and len(lanes) == 4
    assert session.counts[Opcode.LOOKUP] == 5
    assert not lock._is_owned()
    stop(kernel, session)


def test_the_getattr_lane_answers_from_the_header_under_the_fast_lock(pair, caplog):
    """A file system with ``lane_getattr``: a GETATTR it holds is answered by the session from the
    request's header (its bytes as they are, counted, under the fast lock, no fast path run); one
    it does not hold (None), or whose lane fails, takes the ordinary way (fast_getattr)."""
    lock = threading.RLock()
    held = encode_attr_out(ATTR, 2.0)
    lanes, fast = [], []

    class LaneFS:
        fast_lock = lock

        def lane_getattr(self, nodeid):
            lanes.append((nodeid, lock._is_owned()))
            if nodeid == 666:
                raise RuntimeError("a bug in a lane")
            return held if nodeid == 2 else None

        def fast_getattr(self, req):
            fast.append(req.header.nodeid)
            return Attr(ino=req.header.nodeid, mode=stat.S_IFREG | 0o644, size=7), 1.0

    kernel, session = started(pair, Dispatcher(LaneFS()))
    with lock:  # another thread is changing what the lane reads: no answer meanwhile
        kernel.send(Opcode.GETATTR, getattr_args(), unique=10, nodeid=2)
        assert kernel.nothing(0.2)
    assert kernel.answer() == (10, 0, held)
    assert lanes == [(2, True)] and fast == []
    kernel.send(Opcode.GETATTR, getattr_args(), unique=11, nodeid=3)
    unique, error, body = kernel.answer()
    assert (unique, error, len(body)) == (11, 0, abi.ATTR_OUT_SIZE) and body != held and fast == [3]
    with caplog.at_level(logging.ERROR):
        kernel.send(Opcode.GETATTR, getattr_args(), unique=12, nodeid=666)
        assert kernel.answer()[:2] == (12, 0)
    assert fast == [3, 666] and "GETATTR lane failed" in caplog.text
    kernel.send(Opcode.GETATTR, getattr_args()[:8], unique=13, nodeid=2)  # short: not the lane's
    assert kernel.answer()[:2] == (13, -errno.EIO) and len(lanes) == 3
    assert session.counts[Opcode.GETATTR] == 4
    assert not lock._is_owned()
    stop(kernel, session)
