"""Cold READs loaded by the FUSE reader thread itself, between two requests: no worker hop.

A READ taken by client/thread_reads.py used to be queued for a worker thread, which sent the
ReadChunkReq, waited for the reply and answered. That hand-off costs a thread wake-up, a GIL
hand-over and a few futex calls per cold READ on the mount, and one more scheduling delay in
the READ's latency (the worker must get a CPU before the request leaves). Here the reader thread
sends the request on a DEALER of its own, goes back to the device, and, while any of its loads
is under way, waits for the device *and* its sockets in one ``zmq.Poller.poll`` instead of a
blocking read of the device (client/fuse/session.py: ``Session.side``); a reply is checked and
answered on the reader thread as a worker would answer it (``ThreadReads.loaded``). With no
load under way the reader reads the device exactly as before (one blocking ``readv``), so warm
requests pay nothing for this.

Only the plain case stays here: the first replica takes the request at once. Everything that
would make the reader wait goes to the workers (``ThreadReads`` queue), with the replicas not
yet asked: a socket with no live connection yet (a new one, or a dead node: IMMEDIATE; the
sockets to a load's other replicas are made when it starts, so a hedge usually finds one), a
replica that answered an error or a corrupt copy (when no other is asked). A replica that has
not answered within ``hedge_after_s`` is joined by the next one from here (the first good answer
wins, the slow one is marked ``note_slow``; the next not connected: a worker asks the others,
the slow one last), and when ``read_timeout`` passes with no answer the replicas asked are
marked suspect and the READs go to trio's path, as the workers do. The sockets belong to the
reader thread (created, used and closed there: libzmq's rule of one thread per socket); when
the session ends (``end``) what is still under way goes to trio's path.
"""

from __future__ import annotations

import logging
import time

import zmq

from ..common import protocol as p
from ..common.errors import ErrorCode, StripefsError
from ..common.fast_lane import recv_frames
from ..common.transport import new_socket
from . import metrics

log = logging.getLogger(__name__)

_POLL_STOP_S = 0.2  # the longest poll: how soon the reader notices the session is stopping
_NOBLOCK = int(zmq.NOBLOCK)


class _Under:
    """One load under way from the reader thread."""

    __slots__ = ("load", "order", "asked", "hedge_at", "deadline")

    def __init__(self, load, order: list[int], now: float, hedge_after_s: float, timeout: float):
        self.load = load
        self.order = order  # replicas not asked yet
        self.asked: dict[int, int] = {}  # request id -> node id, not answered yet
        self.hedge_at = now + hedge_after_s
        self.deadline = now + timeout


class ReaderLoads:
    """The reader thread's loads (module docstring); every method runs on the reader thread."""

    def __init__(self, pool):
        self.pool = pool  # client.thread_reads.ThreadReads
        self._ids = pool.ids
        self._sockets: dict[str, zmq.Socket] = {}  # address -> a DEALER connected (or connecting) there
        self._poller = zmq.Poller()
        self._by_id: dict[int, tuple[_Under, zmq.Socket]] = {}  # request id -> its load, the socket asked on
        #: sockets with a request not answered yet, and how many: only those are polled (each socket
        #: polled costs libzmq an event check, and a getpid, per poll)
        self._asking: dict[zmq.Socket, int] = {}
        self._under: set[_Under] = set()
        self._fd: int | None = None
        self.owner: int | None = None  # the reader thread's ident, once ``begin`` ran
        self._started = metrics.THREAD_READS.labels("reader")

    @property
    def pending(self) -> bool:
        """Whether a load is under way (the reader then polls instead of reading the device)."""
        return bool(self._under)

    def begin(self, fd: int, ident: int) -> None:
        """(the reader thread, before its first read) The device to wait on beside the sockets."""
        self._fd = fd
        self._poller.register(fd, zmq.POLLIN)
        self.owner = ident

    def start(self, load) -> bool:
        """Send ``load``'s request to its first replica; False if that cannot be done at once (the
        caller queues it for a worker, which waits for a connection)."""
        address = self.pool.nodes.addresses.get(load.order[0]) if load.order else None
        if address is None or self.pool.closing:
            return False
        under = _Under(load, list(load.order[1:]), time.monotonic(), self.pool.hedge_after_s, self.pool.read_timeout)
        if not self._send(under, load.order[0]):
            return False
        for node_id in under.order:  # connected ahead (asynchronously), so that a hedge finds a connection
            self._socket(node_id)
        self._under.add(under)
        self._started.inc()
        return True

    def wait(self, device: bool = True) -> bool:
        """Wait for the device (``device``: else only for the replies: the session has no room for
        another request) or a reply, at most until the next hedge or deadline; handle the replies
        and the timers. True: the device is readable (or broken: its read says how). A failure
        here (a bug) must not end the session: it is logged, and what is under way goes to
        trio's path."""
        try:
            return self._wait(device)
        except Exception:  # noqa: BLE001 - logged loudly; the READs are answered by trio's path
            log.exception("the reader thread's cold loads failed; their READs go to trio's path")
            self._give_up()
            return device

    def _give_up(self) -> None:
        under, self._under = list(self._under), set()
        for u in under:
            self._finish(u)
            try:
                self.pool.loaded(u.load, None)
            except Exception:  # noqa: BLE001
                log.exception("handing the READs of chunk %s to trio failed", u.load.request.chunk)

    def _wait(self, device: bool) -> bool:
        now = time.monotonic()
        until = min((min(u.deadline, u.hedge_at if u.order else u.deadline) for u in self._under), default=now)
        wait_ms = max(0, int(min(until - now, _POLL_STOP_S) * 1000 + 0.999))
        readable = False
        if not device:
            self._poller.unregister(self._fd)
        try:
            ready = self._poller.poll(wait_ms)
        finally:
            if not device:
                self._poller.register(self._fd, zmq.POLLIN)
        for what, _ in ready:
            if what == self._fd:
                readable = True
            else:
                self._receive(what)
        if self._under:
            self._timers(time.monotonic())
        return readable

    def end(self) -> None:
        """(the reader thread, its loop ended) What is under way to trio's path; the sockets closed."""
        self._give_up()
        for sock in self._sockets.values():
            sock.close(linger=0)
        self._sockets.clear()

    # -- inside

    def _socket(self, node_id: int) -> zmq.Socket | None:
        address = self.pool.nodes.addresses.get(node_id)
        if address is None:
            return None
        sock = self._sockets.get(address)
        if sock is None:
            sock = self._sockets[address] = new_socket(self.pool.ctx, zmq.DEALER, connect=address)
        return sock

    def _send(self, under: _Under, node_id: int) -> bool:
        sock = self._socket(node_id)
        if sock is None:
            return False
        request_id = next(self._ids)
        try:
            sock.send(p.encode(request_id, under.load.request), zmq.NOBLOCK)
        except zmq.Again:
            return False  # IMMEDIATE: no live connection (yet): a worker waits for one
        under.asked[request_id] = node_id
        self._by_id[request_id] = (under, sock)
        n = self._asking.get(sock, 0)
        if not n:
            self._poller.register(sock, zmq.POLLIN)
        self._asking[sock] = n + 1
        return True

    def _answered(self, sock: zmq.Socket) -> None:
        """One request asked on ``sock`` needs no answer any more (answered, or given up)."""
        n = self._asking.get(sock, 0) - 1
        if n > 0:
            self._asking[sock] = n
        elif n == 0:
            del self._asking[sock]
            self._poller.unregister(sock)  # (a late answer waits there, dropped when next polled)

    def _receive(self, sock: zmq.Socket) -> None:
        while True:
            try:
                frames = recv_frames(sock, _NOBLOCK)  # (without pyzmq's RCVMORE getsockopt per frame)
            except zmq.Again:
                return
            decoded = self.pool.decode(frames)
            if decoded is None:
                continue
            request_id, body = decoded
            held = self._by_id.pop(request_id, None)
            if held is None:
                continue  # a late answer to a hedge already beaten: dropped
            under = held[0]
            self._answered(held[1])
            node_id = under.asked.pop(request_id)
            outcome = self.pool.checked(body, frames, under.load, node_id)
            if outcome is not False:
                self._finish(under)
                if under.asked:  # beaten by a hedge: asked last for a while (NodePool.note_slow)
                    self.pool.mark(list(under.asked.values()), None)
                self.pool.loaded(under.load, outcome)
            elif not under.asked:  # an error or a corrupt copy, nothing else asked: the next replicas
                self._finish(under)
                self._hand_over(under)

    def _timers(self, now: float) -> None:
        for under in [u for u in self._under if now >= u.deadline or (u.order and now >= u.hedge_at)]:
            if now >= under.deadline:
                # nobody answered in time: those asked are suspect (trio's retry asks the others first)
                self._finish(under)
                self.pool.mark(list(under.asked.values()), StripefsError(ErrorCode.TIMEOUT, "no reply to a thread read"))
                self.pool.loaded(under.load, None)
                continue
            # the replica asked has not answered: the next is asked too, the first answer wins
            if self._send(under, under.order[0]):
                under.order.pop(0)
                under.hedge_at = now + self.pool.hedge_after_s
            else:  # no live connection to it (yet): a worker asks the others, and the slow one last
                self._finish(under)
                under.order += under.asked.values()
                self._hand_over(under)

    def _finish(self, under: _Under) -> None:
        self._under.discard(under)
        for request_id in under.asked:
            held = self._by_id.pop(request_id, None)
            if held is not None:
                self._answered(held[1])

    def _hand_over(self, under: _Under) -> None:
        """The replicas not asked yet, to a worker; none left: to trio's path."""
        if not under.order or self.pool.closing:
            self.pool.loaded(under.load, None)
            return
        under.load.order = under.order
        self.pool.queue(under.load)
