"""ZeroMQ under trio: the socket adapter, the RPC client and the request server.

pyzmq has no trio support, and the ZeroMQ file descriptor is *edge-triggered*:
libzmq's docs say the state of ZMQ_EVENTS must be re-read after every
``zmq_send``/``zmq_recv``, because any call on the socket may consume the edge
without a new readable event on the FD. The naive loop ("recv NOBLOCK; on
EAGAIN wait_readable") therefore hangs as soon as another task sends on the
same socket.

The adapter below:

* At most one task waits on the FD (trio allows one per direction): the first
  that must wait, normally the socket's receiving task. It re-reads
  ``ZMQ_EVENTS`` when it wakes and, leaving, wakes the others (``_changed``),
  one of whom takes the FD over if it still has to wait.
* Every call into libzmq is followed by ``_refresh()``: it re-reads
  ``ZMQ_EVENTS``, wakes the waiters, and cancels the FD wait of a task whose
  event is now ready, so an edge eaten by that call is never lost.
* Waiters capture the current ``trio.Event`` *before* re-reading, so a wake-up
  between the check and the wait cannot be missed.

The receiver waits on the FD itself rather than behind a pump task that wakes
it: an RpcClient call costs two passes of trio's scheduler instead of four,
and one recv attempt per message instead of two (the measurements, with
their date: bench/README.md, "Transport measurements").

Invariant: between two awaits a task either sends a whole multipart message or
none of it, so concurrent senders never interleave frames.

On top: ``RpcClient`` (a DEALER with any number of requests in flight, matched
by request id, each under a timeout) and ``serve`` (a ROUTER loop that decodes,
dispatches to a handler, and answers every request, errors included).

Every socket is bounded (common/limits.py): ZMQ_MAXMSGSIZE per socket type,
request headers and frame counts checked before decoding, requests in flight
per peer, and a deadline on every handler and every RPC.
"""

from __future__ import annotations

import contextvars
import itertools
import logging
import math
import time
from contextlib import asynccontextmanager
from typing import AsyncIterator, Awaitable, Callable, Sequence

import trio
import zmq

from . import limits, metrics, protocol, security
from .errors import ErrorCode, QuietError, StripefsError, sole
from .log_limits import LogEvery

log = logging.getLogger(__name__)
#: a peer whose requests are refused (its queue full) is logged once in this long, the rest counted
REFUSAL_LOG_EVERY_S = 60.0

Payload = bytes | memoryview | bytearray

#: the connection (ROUTER identity) whose request is being handled: what a handler charges
#: per-connection work to (set by ``serve()``, like ``security.PEER``; b"" outside a request)
CONNECTION: contextvars.ContextVar[bytes] = contextvars.ContextVar("stripefs_connection", default=b"")

# Frames up to this size are copied into libzmq even when sent with copy=False.
# Zero-copy hands libzmq the buffer and learns when it is done through pyzmq's
# garbage-collector thread: a thread wake-up per frame, which costs more than
# copying a small-file chunk (measured for a 110 KiB reply: bench/README.md,
# "Transport measurements"; pyzmq's own default threshold is 64 KiB). Whole
# 4 MiB chunks still go zero-copy.
COPY_THRESHOLD = 1 << 20

# plain ints: pyzmq's IntFlag members cost microseconds per operation on this hot path
_EVENTS, _POLLIN, _POLLOUT, _NOBLOCK = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.POLLOUT), int(zmq.NOBLOCK)


class ZmqSocket:
    """Trio adapter for one pyzmq socket.

    Whoever must wait first (normally the socket's one receiving task) waits on
    the FD itself; anyone else who must wait meanwhile waits for ``_changed``.
    A task on the FD that sees events it did not wait for, or leaves, sets
    ``_changed``; a libzmq call by another task that finds the FD waiter's event
    ready cancels its wait (``_fd_scope``), since that call may have eaten the
    edge. A waiter captures ``_changed`` *before* re-reading ZMQ_EVENTS.
    """

    def __init__(self, sock: zmq.Socket):
        self._sock = sock
        self._fd = sock.getsockopt(zmq.FD)  # the int, not the socket: no fileno() call per wait
        self._changed = trio.Event()
        self._fd_want = 0  # the event the task on the FD waits for; 0: nobody is on the FD
        self._fd_scope: trio.CancelScope | None = None
        self.closed = False
        self.secure = False  # a CURVE server: every request carries its sender's key (security.py)

    @property
    def raw(self) -> zmq.Socket:
        return self._sock

    def _refresh(self) -> None:
        """Call after every libzmq call: it may have eaten the FD edge that others wait for."""
        if self.closed:
            return
        events = self._sock.get(_EVENTS)
        if events & self._fd_want:
            self._fd_scope.cancel()
        if events:
            self._changed.set()
            self._changed = trio.Event()

    async def _wait(self, want: int) -> None:
        """Return once ZMQ_EVENTS has ``want`` (zmq.POLLIN or zmq.POLLOUT)."""
        while True:
            if self.closed:
                raise trio.ClosedResourceError("socket is closed")
            changed = self._changed
            if self._sock.get(_EVENTS) & want:
                return
            if self._fd_want:  # another task is on the FD: it wakes us
                await changed.wait()
                continue
            self._fd_want = want
            try:
                with trio.CancelScope() as self._fd_scope:
                    await trio.lowlevel.wait_readable(self._fd)
            finally:
                self._fd_want = 0
                self._fd_scope = None
                self._changed.set()  # whoever else waits takes over the FD or finds its event
                self._changed = trio.Event()

    async def wait_writable(self) -> None:
        """Return once a message sent now goes out at once: a live connection takes it (sockets
        are ZMQ_IMMEDIATE, ``new_socket``). What a message says can then be read right before
        ``send_multipart``, not before a wait for the peer that may last seconds."""
        await self._wait(_POLLOUT)

    async def send_multipart(self, frames: Sequence[Payload]) -> None:
        while True:
            if self.closed:
                raise trio.ClosedResourceError("socket is closed")
            try:
                self._sock.send_multipart(frames, _NOBLOCK, copy=False)
            except zmq.Again:
                self._refresh()
                await self._wait(_POLLOUT)
            else:
                self._refresh()
                await trio.lowlevel.checkpoint_if_cancelled()
                return

    async def recv_multipart(self) -> list[zmq.Frame]:
        """Receive one message as zmq.Frame objects (``.bytes`` copies, ``.buffer`` does not)."""
        await self._wait(_POLLIN)
        frames = self._sock.recv_multipart(_NOBLOCK, copy=False)
        self._refresh()
        return frames

    async def recv_waiting(self, most: int) -> list[list[zmq.Frame]]:
        """One message, waiting for it, and then every message already queued behind it (up
        to ``most`` in all), without waiting again: a burst (serve()'s ``burst``)."""
        await self._wait(_POLLIN)
        sock = self._sock
        messages = [sock.recv_multipart(_NOBLOCK, copy=False)]
        while len(messages) < most and sock.get(_EVENTS) & _POLLIN:
            messages.append(sock.recv_multipart(_NOBLOCK, copy=False))
        self._refresh()
        return messages

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        trio.lowlevel.notify_closing(self._fd)
        self._sock.close(linger=0)
        self._changed.set()  # wake anyone still waiting so they see `closed`


def new_socket(
    ctx: zmq.Context,
    socket_type: int,
    *,
    bind: str | None = None,
    connect: str | None = None,
    hwm: int = 10_000,
    max_frame: int | None = None,
) -> zmq.Socket:
    """A pyzmq socket with stripefs's options, bound or connected (``open_socket`` without the trio adapter).

    ``max_frame``: ZMQ_MAXMSGSIZE, the largest frame a peer may send before it is
    disconnected; by default the largest legitimate frame for the socket type
    (common/limits.py).
    """
    sock = ctx.socket(socket_type)
    sock.setsockopt(zmq.LINGER, 0)
    sock.copy_threshold = COPY_THRESHOLD
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    sock.setsockopt(zmq.MAXMSGSIZE, max_frame if max_frame is not None else _MAX_FRAME.get(socket_type, limits.SERVER_MAX_FRAME))
    if socket_type == zmq.SUB:
        sock.setsockopt(zmq.SUBSCRIBE, b"")
    if socket_type in (zmq.DEALER, zmq.SUB):
        # reconnect quickly after a peer restarts, without hammering a dead one
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
        # queue requests only on a live connection: a request sent while the peer is
        # down waits (under its caller's timeout) instead of sitting in a queue that a
        # restarted peer would drain later: a write timed out and moved elsewhere must
        # never be applied by the node when it comes back
        sock.setsockopt(zmq.IMMEDIATE, 1)
    try:
        connect = security.secure_socket(ctx, sock, bind=bind, connect=connect)  # CURVE keys, or refuse
        if bind:
            sock.bind(bind)
        if connect:
            sock.connect(connect)
    except (zmq.ZMQError, QuietError):
        sock.close(linger=0)
        raise
    return sock


@asynccontextmanager
async def open_socket(ctx: zmq.Context, socket_type: int, **options) -> AsyncIterator[ZmqSocket]:
    """A ZmqSocket over ``new_socket(ctx, socket_type, **options)``; closed (linger 0) on exit.
    SUB sockets subscribe to everything."""
    sock = new_socket(ctx, socket_type, **options)
    zsock = ZmqSocket(sock)
    zsock.secure = bool(sock.curve_server)  # set only on a bound socket with a key (security.secure_socket)
    try:
        yield zsock
    finally:
        zsock.close()


_MAX_FRAME = {zmq.ROUTER: limits.SERVER_MAX_FRAME, zmq.DEALER: limits.CLIENT_MAX_FRAME, zmq.SUB: limits.FEED_MAX_FRAME}


class _Pending:
    __slots__ = ("event", "body", "payloads")

    def __init__(self) -> None:
        self.event = trio.Event()
        self.body: protocol.Msg | None = None
        self.payloads: list[memoryview] = []


class RpcClient:
    """Requests to one peer over one DEALER socket; any number in flight at once."""

    _ids = itertools.count(1)  # unique across clients of a process: easier log reading

    def __init__(self, sock: ZmqSocket, address: str, timeout: float):
        if not (timeout > 0 and math.isfinite(timeout)):
            raise ValueError(f"an RpcClient needs a finite timeout, not {timeout!r}")
        self.sock = sock
        self.address = address
        self.timeout = timeout
        self._pending: dict[int, _Pending] = {}

    async def _receive_loop(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            try:
                frames = await self.sock.recv_multipart()
            except trio.ClosedResourceError:
                return
            try:
                request_id, body = protocol.decode_reply(frames[0].bytes)
            except protocol.ProtocolError as exc:
                log.warning("undecodable reply from %s: %s", self.address, exc)
                continue
            slot = self._pending.pop(request_id, None)
            if slot is None:
                log.debug("late reply %d from %s dropped", request_id, self.address)
                continue
            slot.body = body
            slot.payloads = [f.buffer for f in frames[1:]]
            slot.event.set()

    async def call(
        self,
        request: protocol.Msg,
        payloads: Sequence[Payload] = (),
        *,
        timeout: float | None = None,
        expect: type | tuple[type, ...] | None = None,
    ) -> tuple[protocol.Msg, list[memoryview]]:
        """Send one request and wait for its reply. ErrorRsp is raised as StripefsError.

        ``expect``: the reply type(s) the request must get; any other is a peer error
        (UNAVAILABLE, which callers fail over on), never an assertion that ``python -O`` drops."""
        request_id = next(self._ids)
        slot = _Pending()
        self._pending[request_id] = slot
        deadline = self.timeout if timeout is None or not math.isfinite(timeout) else timeout  # never wait forever
        started = time.perf_counter()
        try:
            with trio.move_on_after(deadline):
                await self.sock.send_multipart([protocol.encode(request_id, request), *payloads])
                await slot.event.wait()
        except trio.ClosedResourceError:
            raise StripefsError(ErrorCode.UNAVAILABLE, f"connection to {self.address} is closed") from None
        finally:
            self._pending.pop(request_id, None)
        body = slot.body
        observe_rpc(self.address, request, body, time.perf_counter() - started)
        if body is None:
            raise StripefsError(
                ErrorCode.TIMEOUT,
                f"{protocol.kind(request)} to {self.address} got no reply within {deadline:.1f}s",
            )
        if isinstance(body, protocol.ErrorRsp):
            raise StripefsError(body.code, body.message)
        if expect is not None and not isinstance(body, expect):
            raise StripefsError(
                ErrorCode.UNAVAILABLE, f"{self.address} answered {protocol.kind(request)} with a {protocol.kind(body)}"
            )
        return body, slot.payloads

    async def wait_writable(self) -> None:
        """Return once a request sent now goes out at once (``ZmqSocket.wait_writable``); a closed
        connection (the process is stopping) is UNAVAILABLE, as for ``call``."""
        try:
            await self.sock.wait_writable()
        except trio.ClosedResourceError:
            raise StripefsError(ErrorCode.UNAVAILABLE, f"connection to {self.address} is closed") from None


@asynccontextmanager
async def connect(ctx: zmq.Context, address: str, *, timeout: float = 10.0) -> AsyncIterator[RpcClient]:
    """An RpcClient connected to ``address`` with its receive loop running.

    An exception leaving the ``async with`` body leaves as itself, not wrapped in the exception group
    of the connection's nursery (the group is unwrapped here, where it arises, when it holds one)."""
    async with open_socket(ctx, zmq.DEALER, connect=address) as sock:
        client = RpcClient(sock, address, timeout)
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(client._receive_loop)
                try:
                    yield client
                finally:
                    nursery.cancel_scope.cancel()
        except BaseExceptionGroup as group:
            inner = sole(group)
            if inner is group:
                raise
            raise inner from None


Handler = Callable[[protocol.Msg, list[memoryview]], Awaitable[protocol.Msg | tuple[protocol.Msg, Sequence[Payload]]]]
#: serve()'s fast path: the reply to a request it can answer at once, without waiting, else None
FastHandler = Callable[[protocol.Msg, list[memoryview]], protocol.Msg | tuple[protocol.Msg, Sequence[Payload]] | None]
#: serve()'s burst path: given the requests received together, as (body, sender's key), and
#: ``early``, a result for each, in order: its reply (an ErrorRsp too), sent at once; an
#: ``async () -> reply`` that must wait for something, run in a task of its own; or None: not
#: taken, served the usual way. ``await early(index, reply)`` sends one request's reply ahead of
#: the others (a read that need not wait for the burst's commit); that index's result is ignored
BurstHandler = Callable[[list[tuple[protocol.Msg, str | None]], Callable[[int, protocol.Msg], Awaitable[None]]], Awaitable[list]]
#: the most requests serve() takes in one burst
BURST_MAX = 64


async def serve(
    sock: ZmqSocket,
    handler: Handler,
    *,
    concurrency: int = 64,
    name: str = "server",
    limits: limits.ServeLimits = limits.ServeLimits(),
    fast: FastHandler | None = None,
    burst: BurstHandler | None = None,
    keyed: bool = False,
    replies: _limits.ReplyQueues | None = None,
) -> None:
    """Answer requests on a bound ROUTER socket until cancelled.

    ``handler(body, payloads)`` returns a reply body, or ``(body, payload_frames)``.
    A StripefsError becomes an ErrorRsp with its code; any other exception is
    logged with its traceback and answered INTERNAL. The server never dies on input.

    At most ``concurrency`` handlers run at once, at most
    ``limits.per_peer_inflight`` of them for one peer; a peer's further requests
    wait in its own bounded queue and past it are answered BUSY at once
    (common/limits.py). A handler still running after
    ``limits.request_timeout_s`` is cancelled and answered TIMEOUT. A peer whose
    replies the network has not taken reach ``limits.per_peer_reply_bytes``
    (``replies``: a peer that does not read them) has no further request run
    until they drop below: they wait in its queue, as if its slots were full.

    ``fast(body, payloads)``, when given, is offered each request first, on the
    receiving task, unless its peer has requests queued: a reply it returns is
    sent at once; None sends the request the usual way, to ``handler`` in a task
    of its own. It must not block for long, and answers only successes (on any
    doubt: None). For a storage node's small reads this halves the CPU a request
    costs: no task, semaphore, cancel scope or extra scheduler passes.

    ``burst(items)``, when given, takes every request waiting on the socket at
    once (up to ``BURST_MAX``; those without payload frames whose peer has none
    queued), as ``(body, peer key)``, and gives a result for each (``BurstHandler``):
    the metadata daemon runs them in one hold of its lock and one commit
    (daemon/burst.py), with no task per request. Replies go out in request order, but
    for those the burst sends ahead through ``early`` (reads, before its commit).

    ``keyed``: ``sock`` is the inner end of a fast lane (common/fast_lane.py),
    whose messages carry the sender's key as a frame after the identity; the
    lane sends the replies and counts them in its ``replies``, given here.
    """
    running = trio.Semaphore(concurrency)
    admission: _limits.PeerQueues[tuple] = _limits.PeerQueues(limits)
    refusals = LogEvery(log, REFUSAL_LOG_EVERY_S)  # a flood of refusals must not flood the log
    counting = replies is None and not keyed  # replies go out here: count them
    if counting:
        replies = _limits.ReplyQueues(limits.per_peer_reply_bytes)
    held = _Held(replies)

    async def reply(identity: bytes, request_id: int, body: protocol.Msg, payloads: Sequence[Payload] = ()) -> None:
        try:
            header = protocol.encode(request_id, body)
        except (TypeError, ValueError, OverflowError) as exc:  # a value the wire cannot carry: a bug
            log.error("%s: cannot encode %s for request %d: %s", name, type(body).__name__, request_id, exc)
            header = protocol.encode(request_id, protocol.ErrorRsp(code=ErrorCode.INTERNAL, message=f"unencodable reply: {exc}"))
            payloads = ()
        frames = [identity, header, *payloads]
        if counting:
            frames, nbytes, tracked = replies.outgoing(identity, frames)
        try:
            await sock.send_multipart(frames)
        except trio.ClosedResourceError:
            return
        if counting:
            replies.sent(identity, nbytes, frames[-1].tracker if tracked else None)

    async def handle_one(identity: bytes, request_id: int, body: protocol.Msg, payloads: list[memoryview], later=None) -> None:
        kind = protocol.kind(body)  # a OnceReq counts as what it carries
        started = time.perf_counter()
        error = None
        async with running:
            with trio.move_on_after(limits.request_timeout_s) as timer:  # around the handler only: one reply, always
                try:
                    result = await (handler(body, payloads) if later is None else later())
                except StripefsError as exc:
                    log.debug("%s: %s (request %d) -> %s", name, kind, request_id, exc)
                    metrics.REQUEST_ERRORS.labels(name, kind, getattr(exc.code, "name", str(exc.code))).inc()
                    error = protocol.ErrorRsp(code=int(exc.code), message=exc.message)
                except Exception as exc:  # a bug: answer and log loudly, keep serving
                    log.exception("%s: handling %s (request %d) failed", name, kind, request_id)
                    error = protocol.ErrorRsp(code=ErrorCode.INTERNAL, message=f"{type(exc).__name__}: {exc}")
        if error is not None:
            await reply(identity, request_id, error)
            return
        if timer.cancelled_caught:
            log.warning("%s: %s (request %d) from %r still running after %.0fs: cancelled", name, kind, request_id, identity, limits.request_timeout_s)
            metrics.REQUEST_ERRORS.labels(name, kind, "TIMEOUT").inc()
            message = f"{kind} took longer than the server's request_timeout_s ({limits.request_timeout_s:.0f}s)"
            await reply(identity, request_id, protocol.ErrorRsp(code=ErrorCode.TIMEOUT, message=message))
            return
        observe_served(name, body, payloads, result, time.perf_counter() - started)
        if isinstance(result, tuple):
            await reply(identity, request_id, result[0], result[1])
        else:
            await reply(identity, request_id, result)

    async def peer_slot(identity: bytes, request: tuple) -> None:
        # one of a peer's slots: runs its request, then the peer's queued ones, in turn
        while request is not None:
            await held.until_taken(identity)  # its replies so far have left (a peer that never reads them waits here)
            await handle_one(identity, *request)
            request = admission.finish(identity)

    def admit(identity: bytes, request: tuple, nbytes: int) -> Awaitable[None] | None:
        # the usual path: a task of the peer's slots, or a place in its queue; a refusal to send (returned)
        verdict = admission.offer(identity, request, nbytes)
        if verdict == _limits.START:
            # the slot's task inherits the sender's key and connection (one connection, one key: its queued requests too)
            nursery.start_soon(peer_slot, identity, request)
        elif verdict == _limits.REFUSED:
            refusals.log(logging.WARNING, identity, "%s: peer %r has %d requests running and its queue full: a request answered BUSY",
                         name, identity, admission.inflight(identity))
            metrics.REQUEST_ERRORS.labels(name, type(request[1]).__name__, "BUSY").inc()
            message = f"too many requests in flight from this connection ({admission.inflight(identity)} running, queue full): retry later"
            return reply(identity, request[0], protocol.ErrorRsp(code=ErrorCode.BUSY, message=message))
        return None

    async def run_burst(taken: list[tuple]) -> None:
        # taken: (identity, request_id, body, payloads, peer, nbytes), received together
        started = time.perf_counter()
        sent: set[int] = set()

        async def early(index: int, result: protocol.Msg) -> None:
            identity, request_id, body, payloads, _, _ = taken[index]
            sent.add(index)
            if isinstance(result, protocol.ErrorRsp):
                metrics.REQUEST_ERRORS.labels(name, protocol.kind(body), code_name(result.code)).inc()
            else:
                observe_served(name, body, payloads, result, time.perf_counter() - started)
            await reply(identity, request_id, result)

        try:
            results = await burst([(body, peer) for _, _, body, _, peer, _ in taken], early)
        except Exception as exc:  # a bug: what ran of them is unknown, so none is run again; answered, logged loudly
            log.exception("%s: a burst of %d request(s) failed", name, len(taken))
            results = [protocol.ErrorRsp(code=ErrorCode.INTERNAL, message=f"{type(exc).__name__}: {exc}")] * len(taken)
        seconds = (time.perf_counter() - started) / len(taken)
        for index, ((identity, request_id, body, payloads, peer, nbytes), result) in enumerate(zip(taken, results)):
            if index in sent:
                continue
            security.PEER.set(peer)
            CONNECTION.set(identity)
            if result is None:
                refused = admit(identity, (request_id, body, payloads), nbytes)
                if refused is not None:
                    await refused
            elif callable(result):
                nursery.start_soon(handle_one, identity, request_id, body, payloads, result)
            else:
                if isinstance(result, protocol.ErrorRsp):
                    metrics.REQUEST_ERRORS.labels(name, protocol.kind(body), code_name(result.code)).inc()
                else:
                    observe_served(name, body, payloads, result, seconds)
                await reply(identity, request_id, result)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(held.watch, name=f"{name}-held-peers")
        waiting: list[list[zmq.Frame]] = []  # a burst's messages not looked at yet
        taken: list[tuple] = []  # a burst's requests for ``burst``
        unyielded = 0  # messages taken since this task last let the others run
        while True:
            if burst is not None and not waiting:
                if taken:
                    await run_burst(taken)
                    taken = []
                waiting = await sock.recv_waiting(BURST_MAX)
            if waiting:
                frames = waiting.pop(0)
            else:
                frames = await sock.recv_multipart()
            unyielded += 1
            if unyielded >= BURST_MAX:
                # A message already queued is taken with no scheduling point, nor is a reply sent
                # one: a server whose socket never empties would starve every other task of the
                # process (the metadata daemon's feed heartbeat: idle mounts dropped their caches
                # after EVENTS_SILENCE_S of silence while other mounts created files).
                unyielded = 0
                await trio.lowlevel.checkpoint()
            identity = frames[0].bytes
            if keyed:  # [identity, key, header, payloads...] from a fast lane: its thread read the key
                peer = frames[1].bytes.decode() or None
                frames = [frames[0], *frames[2:]]
            else:
                peer = security.peer_of(frames[1]) if sock.secure and len(frames) > 1 else None
            if len(frames) < 2:
                log.warning("%s: message without a header frame from %r", name, identity)
                await reply(identity, 0, protocol.ErrorRsp(code=ErrorCode.BAD_REQUEST, message="no header frame"))
                continue
            if len(frames) > _limits.MAX_REQUEST_FRAMES:
                log.warning("%s: message of %d frames from %r refused", name, len(frames), identity)
                message = f"{len(frames) - 1} frames; a request has at most {_limits.MAX_REQUEST_FRAMES - 1}"
                await reply(identity, 0, protocol.ErrorRsp(code=ErrorCode.BAD_REQUEST, message=message))
                continue
            try:
                request_id, body = protocol.decode_request(frames[1].bytes)
            except protocol.ProtocolError as exc:
                log.warning("%s: bad request from %r: %s", name, identity, exc)
                await reply(identity, exc.request_id, protocol.ErrorRsp(code=exc.code, message=str(exc)))
                continue
            payloads = [f.buffer for f in frames[2:]]
            security.PEER.set(peer)
            CONNECTION.set(identity)
            if burst is not None:
                # never passes the peer's queued requests, nor answers a peer that does not take its replies
                if not payloads and not admission.waiting(identity) and not held.over(identity):
                    taken.append((identity, request_id, body, payloads, peer, sum(len(f) for f in frames)))
                else:
                    refused = admit(identity, (request_id, body, payloads), sum(len(f) for f in frames))
                    if refused is not None:
                        await refused
                continue
            # never passes the peer's queued requests, nor answers a peer that does not take its replies
            if fast is not None and not admission.waiting(identity) and not held.over(identity):
                started = time.perf_counter()
                result = fast(body, payloads)
                if result is not None:
                    observe_served(name, body, payloads, result, time.perf_counter() - started)
                    if isinstance(result, tuple):
                        await reply(identity, request_id, result[0], result[1])
                    else:
                        await reply(identity, request_id, result)
                    continue
            refused = admit(identity, (request_id, body, payloads), sum(len(f) for f in frames))
            if refused is not None:
                await refused


def code_name(code: int) -> str:
    try:
        return ErrorCode(code).name
    except ValueError:
        return str(code)


_limits = limits  # serve()'s parameter of the same name shadows the module

#: how often serve() looks whether the replies of a peer it holds back have left
HELD_POLL_S = 0.01


class _Held:
    """serve()'s peers whose requests wait until their replies leave (limits.ReplyQueues).

    pyzmq's trackers cannot be awaited under trio; one task (``watch``) looks at the held
    peers every ``HELD_POLL_S`` while there are any, and lets each go once it is under."""

    def __init__(self, replies: limits.ReplyQueues | None):
        self.replies = replies
        self._peers: dict[bytes, trio.Event] = {}
        self._wake = trio.Event()

    def over(self, identity: bytes) -> bool:
        return self.replies is not None and self.replies.over(identity)

    async def until_taken(self, identity: bytes) -> None:
        while self.over(identity):
            event = self._peers.get(identity)
            if event is None:
                event = self._peers[identity] = trio.Event()
                self._wake.set()
            await event.wait()

    async def watch(self) -> None:
        while True:
            if not self._peers:
                await self._wake.wait()
                self._wake = trio.Event()
            await trio.sleep(HELD_POLL_S)
            for identity in [i for i in self._peers if not self.over(i)]:
                self._peers.pop(identity).set()


# -- metrics (common.metrics): one call per request, kept out of the paths above ----------


_children: dict[tuple, object] = {}  # (metric, *labels) -> its child: ``labels()`` locks and hashes on every call


def _child(metric, *labels):
    key = (metric, *labels)
    child = _children.get(key)
    if child is None:
        if len(_children) > 100_000:  # peers come and go: bounded like everything else
            _children.clear()
        child = _children[key] = metric.labels(*labels)
    return child


def observe_rpc(peer: str, request: protocol.Msg, body: protocol.Msg | None, seconds: float) -> None:
    """Count one call to ``peer`` in the client's RPC metrics (its time; a timeout or error reply by code):
    RpcClient's and the blocking metadata client's (client/meta_blocking.py) calls alike."""
    kind = protocol.kind(request)
    _child(metrics.RPC_SECONDS, peer, kind).observe(seconds)
    if body is None:
        metrics.RPC_ERRORS.labels(peer, kind, "TIMEOUT").inc()
    elif isinstance(body, protocol.ErrorRsp):
        try:
            code = ErrorCode(body.code).name
        except ValueError:
            code = str(body.code)
        metrics.RPC_ERRORS.labels(peer, kind, code).inc()


def observe_served(server: str, body: protocol.Msg, payloads: list, result, seconds: float) -> None:
    _child(metrics.REQUEST_SECONDS, server, protocol.kind(body)).observe(seconds)
    if payloads:
        _child(metrics.PAYLOAD_BYTES, server, "in").inc(sum(memoryview(f).nbytes for f in payloads))
    if isinstance(result, tuple) and result[1]:
        _child(metrics.PAYLOAD_BYTES, server, "out").inc(sum(memoryview(f).nbytes for f in result[1]))
