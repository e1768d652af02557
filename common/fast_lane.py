"""A server's fast lane: a thread that owns the bound ROUTER socket and answers cheap requests itself.

Under trio, every request costs its server a wake-up of the event loop, the
adapter's ZMQ_EVENTS bookkeeping and a few scheduler passes (common/transport.py)
before any work is done: several times the disk and checksum work of a small
read, and several times what a plain blocking pyzmq loop costs (the figures,
with their date: bench/README.md, "Transport measurements"). So a storage node
runs its ROUTER in a thread of its own::

    peers <-> ROUTER (lane thread) --fast(body)--> reply at once
                       |    ^
            inproc PAIR|    | replies, errors
                       v    |
              serve() under trio, as before (every other request)

The lane offers each request to ``fast`` (the service's ``handle_now``: a small
read from the page cache, or from the disk while nothing else waits; a small
write, delete, stat or sync that need not wait for another thread) and
forwards the rest, with the sender's CURVE key as a frame of its own (the key
is a property of the received message and does not survive a forward), to
``serve(..., keyed=True)`` over an inproc PAIR; replies come back the same way
and go out on the ROUTER. Admission limits, timeouts and error answers stay in
``serve()``; a forward the inner pipe cannot take at once is answered BUSY, so
the lane never blocks. ``fast`` runs on the lane thread: it must be
thread-safe, as everything a worker thread touches already is, and bounded
(serve()'s timeout cannot cut it short). It may answer an error (an ErrorRsp:
counted in the request-error metric as serve() counts it); an exception is a
bug, logged, and the usual path answers the request.

Every reply leaves through the lane, which counts what each peer's connection
has not taken yet (``limits.ReplyQueues``): a peer at ``per_peer_reply_bytes``
gets no fast answer, and ``serve()``, which shares the count, runs none of
its requests until its replies have left (a peer that never reads them).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time

import trio
import zmq

from . import limits, metrics, protocol, security
from .errors import ErrorCode
from .limits import ReplyQueues
from .thread_names import name_os_thread
from .transport import FastHandler, Handler, code_name, observe_served, new_socket, open_socket, serve

log = logging.getLogger(__name__)

_lanes = itertools.count(1)
_POLL_MS = 100  # how soon the thread notices it must stop
_INNER_MAX_FRAME = max(limits.SERVER_MAX_FRAME, limits.CLIENT_MAX_FRAME)  # requests one way, replies the other
# plain ints: pyzmq's enums cost an object and a lookup per use on the hot path
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)
_SNDMORE = int(zmq.SNDMORE)
_NOBLOCK = int(zmq.NOBLOCK)
_RCVTIMEO = int(zmq.RCVTIMEO)


def recv_frames(sock: zmq.Socket, flags: int = 0) -> list[zmq.Frame]:
    """``sock.recv_multipart(copy=False)`` without pyzmq's sugar, which asks libzmq for RCVMORE
    (a getsockopt and an enum) per frame where the frame already says it (``Frame.more``); with
    ``send_frames``, 3-4 us less per request and reply on this machine (issue 30: the lane thread's
    CPU is on the round trip's critical path)."""
    frame = sock.recv(flags, copy=False)
    frames = [frame]
    while frame.more:  # the other parts of a message are there with its first
        frame = sock.recv(flags, copy=False)
        frames.append(frame)
    return frames


def send_frames(sock: zmq.Socket, frames: list) -> None:
    """``sock.send_multipart(frames, copy=False)``, one ``send`` per frame, without the sugar's
    per-frame checks (``recv_frames``)."""
    last = frames[-1]
    for frame in frames[:-1]:
        sock.send(frame, _SNDMORE, copy=False)
    sock.send(last, 0, copy=False)


class _Lane:
    def __init__(self, router: zmq.Socket, inner: zmq.Socket, fast: FastHandler, name: str, replies: ReplyQueues,
                 ordered: bool = False, tell_waiting: bool = True):
        self.router = router
        self.inner = inner
        self.fast = fast
        self.name = name
        self.replies = replies  # bytes sent to each peer and not yet taken by its connection
        self.secure = bool(router.curve_server)
        self.stopping = False
        #: ``ordered``: requests forwarded to serve() and not answered yet, per connection; a
        #: connection with any gets no fast answer (it would overtake them); None: not counted
        self.forwarded: dict[bytes, int] | None = {} if ordered else None
        #: requests forwarded to serve() and not answered yet, all connections: while none, the
        #: thread waits on the ROUTER alone (``run``)
        self.outstanding = 0
        #: whether ``fast`` is told ``waiting`` (a getsockopt of ZMQ_EVENTS per request, which
        #: processes libzmq's commands: a poll(2) on the lane's critical path)
        self.tell_waiting = tell_waiting
        self.peer: str | None = None  # security.PEER as this thread last set it (its default: None)
        self.timers: dict[type, object] = {}  # a request type -> its REQUEST_SECONDS child's observe

    def run(self) -> None:
        """Serve until ``stopping``. While no forwarded request waits for serve()'s reply (nearly
        always, on the metadata daemon's read lane), the thread blocks in a receive on the ROUTER
        alone, as a bare pyzmq server does; else it polls both sockets. Counted per GetattrReq on
        the read lane (bench/getattr_probe.py, issue 30): zmq_poll on two sockets costs 6 poll(2)s
        and a Poller's Python where the blocking receive costs ~2 (lane thread: 11.2 -> ~5 poll(2)
        per request). A reply of serve() that arrives while none is counted (none should) waits at
        most ``_POLL_MS``: the inner socket is read at every receive timeout."""
        name_os_thread()
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        poller.register(self.inner, zmq.POLLIN)
        self.router.setsockopt(_RCVTIMEO, _POLL_MS)
        try:
            while not self.stopping:
                if self.outstanding <= 0:
                    try:
                        frames = recv_frames(self.router)
                    except zmq.Again:  # _POLL_MS without a request: look at stopping, and at serve()'s socket
                        while self.inner.poll(0):
                            self._reply(recv_frames(self.inner))
                        continue
                    self._request(frames)
                    continue
                for sock, _ in poller.poll(_POLL_MS):
                    if sock is self.router:
                        self._request(recv_frames(self.router, _NOBLOCK))
                    else:
                        self._reply(recv_frames(self.inner))
        except Exception:  # noqa: BLE001 - a bug: logged loudly; serve() stops getting requests
            log.exception("%s: the fast lane failed", self.name)
        finally:
            self.router.close(linger=0)
            self.inner.close(linger=0)

    def _reply(self, frames: list[zmq.Frame]) -> None:
        """serve()'s reply to a forwarded request: out on the ROUTER."""
        identity = frames[0].bytes
        self.outstanding -= 1
        if self.forwarded is not None:
            left = self.forwarded.pop(identity, 1) - 1
            if left > 0:
                self.forwarded[identity] = left
        self._send(identity, frames)

    def _request(self, frames: list[zmq.Frame]) -> None:
        peer = security.peer_of(frames[1]) if self.secure and len(frames) > 1 else None
        identity = frames[0].bytes
        if (2 <= len(frames) <= limits.MAX_REQUEST_FRAMES and not self.replies.over(identity)
                and not (self.forwarded and identity in self.forwarded) and self._answered(frames, peer)):
            return
        try:
            self.inner.send_multipart([frames[0], (peer or "").encode(), *frames[1:]], zmq.NOBLOCK, copy=False)
        except zmq.Again:  # serve() is that far behind: as its own admission would say
            self._busy(frames)
            return
        self.outstanding += 1
        if self.forwarded is not None:
            self.forwarded[identity] = self.forwarded.get(identity, 0) + 1

    def _answered(self, frames: list[zmq.Frame], peer: str | None) -> bool:
        try:
            request_id, body = protocol.decode_request(frames[1].bytes)
        except protocol.ProtocolError:
            return False  # serve() answers what is wrong with it
        payloads = [f.buffer for f in frames[2:]] if len(frames) > 2 else []
        if peer != self.peer:  # this thread's context: what access checks read (set when it changes)
            security.PEER.set(peer)
            self.peer = peer
        started = time.perf_counter()
        try:
            if self.tell_waiting:
                result = self.fast(body, payloads, waiting=bool(self.router.getsockopt(_EVENTS) & _POLLIN))
            else:
                result = self.fast(body, payloads)
        except Exception:  # noqa: BLE001 - a bug in the fast path: the usual path answers
            log.exception("%s: fast path failed on %s; the usual path answers it", self.name, type(body).__name__)
            return False
        if result is None:
            return False
        seconds = time.perf_counter() - started
        reply, out = result if isinstance(result, tuple) else (result, ())
        try:
            header = protocol.encode(request_id, reply)
        except (TypeError, ValueError, OverflowError) as exc:  # a value the wire cannot carry: a bug, as in serve()
            log.error("%s: cannot encode %s for request %d: %s", self.name, type(reply).__name__, request_id, exc)
            header, out = protocol.encode(request_id, protocol.ErrorRsp(code=ErrorCode.INTERNAL, message=f"unencodable reply: {exc}")), ()
        identity = frames[0].bytes
        if not out and self.replies.add_small(identity, len(header)):  # one lock, no tracker (limits.ReplyQueues)
            send_frames(self.router, [frames[0], header])
        else:
            self._send(identity, [frames[0], header, *out])
        # the metrics after the send: off the round trip's critical path (the send wakes libzmq's I/O
        # thread, which takes the reply from here while this thread counts)
        if isinstance(reply, protocol.ErrorRsp):  # an error answered here is counted as serve() counts it
            log.debug("%s: %s (request %d) -> %s", self.name, protocol.kind(body), request_id, reply.message)
            metrics.REQUEST_ERRORS.labels(self.name, protocol.kind(body), code_name(reply.code)).inc()
        elif payloads or out or type(body) is protocol.OnceReq:
            observe_served(self.name, body, payloads, result, seconds)
        else:  # a bare request without payloads (the read lane's): observe_served's one histogram, its child kept here
            timer = self.timers.get(type(body))
            if timer is None:
                timer = self.timers[type(body)] = metrics.REQUEST_SECONDS.labels(self.name, protocol.kind(body)).observe
            timer(seconds)
        return True

    def _send(self, identity: bytes, frames: list) -> None:
        frames, nbytes, tracked = self.replies.outgoing(identity, frames)
        send_frames(self.router, frames)
        self.replies.sent(identity, nbytes, frames[-1].tracker if tracked else None)

    def _busy(self, frames: list[zmq.Frame]) -> None:
        try:
            request_id, _ = protocol.decode_request(frames[1].bytes)
        except (protocol.ProtocolError, IndexError):
            request_id = 0
        message = "the server is too far behind: retry later"
        self._send(frames[0].bytes, [frames[0], protocol.encode(request_id, protocol.ErrorRsp(code=ErrorCode.BUSY, message=message))])


async def serve_with_fast_lane(
    ctx: zmq.Context,
    bind: str | zmq.Socket,
    handler: Handler,
    fast: FastHandler,
    *,
    name: str,
    limits: limits.ServeLimits = limits.ServeLimits(),
    ordered: bool = False,
    tell_waiting: bool = True,
    task_status=trio.TASK_STATUS_IGNORED,
    **serve_options,
) -> None:
    """``serve()`` for a ROUTER bound at ``bind`` (or ``bind`` itself: a ROUTER from ``new_socket``,
    bound already; it is this function's from here on, closed at the end), with
    ``fast(body, payloads, waiting=...)`` answered on a lane thread (``waiting``: more requests are
    queued on the socket). ``ordered``: a connection's request is never answered fast while one
    it sent before waits in serve() (a read must not overtake a change of the same peer).
    ``tell_waiting`` False: ``fast(body, payloads)`` only (a handler that ignores ``waiting``
    spares the lane a getsockopt per request).
    ``serve_options``: serve()'s (``burst``, ``concurrency``). Reports started once bound; runs
    until cancelled, then stops the thread and closes both sockets."""
    inner_address = f"inproc://stripefs-fast-lane-{next(_lanes)}"
    router = bind if isinstance(bind, zmq.Socket) else new_socket(ctx, zmq.ROUTER, bind=bind)
    try:
        inner = new_socket(ctx, zmq.PAIR, bind=inner_address, hwm=100_000, max_frame=_INNER_MAX_FRAME)
    except BaseException:
        router.close(linger=0)
        raise
    lane = _Lane(router, inner, fast, name, ReplyQueues(limits.per_peer_reply_bytes), ordered, tell_waiting)
    thread = threading.Thread(target=lane.run, name=f"{name}-fast-lane", daemon=True)
    try:
        async with open_socket(ctx, zmq.PAIR, connect=inner_address, hwm=100_000, max_frame=_INNER_MAX_FRAME) as sock:
            thread.start()  # the thread owns router and inner from here on (libzmq: one thread per socket)
            task_status.started()
            await serve(sock, handler, name=name, limits=limits, keyed=True, replies=lane.replies, **serve_options)
    finally:
        lane.stopping = True
        if thread.is_alive():
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(thread.join, 5.0)
        elif not thread.ident:  # never started: the sockets are still ours to close
            router.close(linger=0)
            inner.close(linger=0)
