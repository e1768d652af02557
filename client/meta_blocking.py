"""Metadata reads from plain threads: a blocking DEALER per thread, no trio.

The mount's ``MetaClient`` (client/meta_rpc.py) runs under trio: a request
costs the mount a task switch, the socket adapter's bookkeeping and a wake-up
of the waiting task when the reply comes (issue 30: an RpcClient round trip
to a server that does nothing costs 0.18-0.26 ms here, a bare blocking pyzmq
one 0.06-0.14 ms). A thread that already runs outside trio (the mount's
worker threads, client/thread_reads.py) asks with this client instead: its own
DEALER socket (libzmq sockets are one thread's each), the same CURVE keys and
context as the MetaClient it stands beside, the same encoding
(``MetaClient._wire``: root squash, the subtree's inode mapping) and the same
error mapping (an ErrorRsp raises StripefsError with its code).

Where it asks: the daemon's read lane (daemon/read_lane.py), a socket of its
own served by a plain thread there too, on the host of the MetaClient's
current address and the port a PingReq to that address tells
(``PingRsp.read_port``, asked once per address and asked again after a failure:
a restarted daemon's lane may be on another port); a daemon without one (0:
PostgreSQL, ``read_listen = "off"``) is asked at its address. A LookupReq that
asks a callback goes to the daemon's address, on a second socket of the
thread's: the lane leaves a grant to the daemon's trio side (daemon/read_lane.py)
and would only forward it there through its thread, which cost the daemon ~120
us more per lookup than the main socket (bench/run.py "stat 5,000 files,
cold": daemon CPU 1.07 -> 1.66 s).

Only requests that read and need nothing applied once go here
(``READS``: a GetattrReq, a LookupReq without open information, a PingReq);
anything else is the MetaClient's. No retry and no failover: a request that
times out or finds the daemon gone raises TIMEOUT or UNAVAILABLE after
``timeout``, and the caller takes the trio path, which retries across a
restart and moves to the next daemon (``MetaClient._call``). A reply that
comes after its request timed out is dropped by its request id, unless the
caller asked ``detach``: then a request sent and not answered in time is
returned as a ``Late`` holding its socket, whose reply another thread waits
for (client/thread_meta.py: the daemon may hold a read for a recall).

Closing: ``close()`` closes every thread's socket; the caller stops its
threads first (a socket must not be used while another thread closes it).
"""

from __future__ import annotations

import itertools
import threading
import time

import zmq

from ..common import protocol as p
from ..common.errors import ErrorCode, StripefsError
from ..common.fast_lane import recv_frames
from ..common.security import split_address, with_key
from ..common.transport import observe_rpc, new_socket

#: what may be asked from a plain thread: reads, nothing applied once, no trio state to keep
READS = frozenset({p.GetattrReq, p.LookupReq, p.PingReq})

_ids = itertools.count(1 << 48)  # apart from RpcClient's ids: easier log reading


#: a reply is waited for in a blocking receive (ZMQ_RCVTIMEO) of at most this long at a time,
#: the deadline looked at between them: no zmq_poll and no setsockopt per request (issue 30,
#: bench/getattr_probe.py: a zmq.Poller's poll and then a NOBLOCK receive cost the thread client
#: 3 poll(2)s and ~7 us of Python more per request than the bare pyzmq client)
_RECV_SLICE_MS = 100
_RCVTIMEO = int(zmq.RCVTIMEO)


class _Line:
    """One thread's socket to one daemon address."""

    __slots__ = ("sock", "address", "daemon", "rcvtimeo")

    def __init__(self, sock: zmq.Socket, address: str, daemon: str):
        self.sock = sock
        self.address = address  # where it is connected (the daemon's read lane, or the daemon)
        self.daemon = daemon  # the daemon's address (MetaClient.addresses)
        self.rcvtimeo = -1  # ZMQ_RCVTIMEO as set on sock (-1: libzmq's default, block)


class BlockingMetaClient:
    """``call`` from any plain thread (module docstring); ``meta``: the mount's MetaClient, whose
    current address, session and request mapping it follows."""

    def __init__(self, ctx: zmq.Context, meta, *, timeout: float):
        if not timeout > 0:
            raise ValueError(f"a BlockingMetaClient needs a positive timeout, not {timeout!r}")
        self.ctx = ctx
        self.meta = meta
        self.timeout = timeout
        self._local = threading.local()
        self._lines: list[_Line] = []  # every thread's, for close()
        self._lanes: dict[str, str] = {}  # a daemon's address -> where its read lane is (its address: none)
        self._lock = threading.Lock()
        self.closed = False
        self.calls = 0  # figures for tests (client/metrics.py counts them too)

    def _line(self, deadline: float, main: bool = False) -> _Line:
        """This thread's socket to the current daemon's read lane, or (``main``) to its address."""
        daemon = self.meta.current_address  # the daemon the mount talks to now
        address = daemon if main else self._lanes.get(daemon)
        lines = getattr(self._local, "lines", None)
        if lines is None:
            lines = self._local.lines = {}
        line = lines.get(main)
        if line is not None and address is not None and line.address == address:
            return line
        if address is None:
            address = self._lane_of(daemon, line, deadline)
        with self._lock:
            if self.closed:
                raise StripefsError(ErrorCode.UNAVAILABLE, "the mount's metadata connection is closed")
            if line is not None and line in self._lines:  # the lane moved, or the mount to another daemon
                self._lines.remove(line)
                line.sock.close(linger=0)
            line = _Line(new_socket(self.ctx, zmq.DEALER, connect=address), address, daemon)
            self._lines.append(line)
        lines[main] = line
        return line

    def _lane_of(self, daemon: str, line: "_Line | None", deadline: float) -> str:
        """Where ``daemon``'s read lane is: a PingReq to it, on this thread's socket to it (kept for
        the calls when it has none)."""
        with self._lock:
            if line is not None and line.address == daemon:
                sock = line.sock
            else:
                sock = None
        made = sock is None
        if made:
            sock = new_socket(self.ctx, zmq.DEALER, connect=daemon)
        try:
            request_id = next(_ids)
            rsp = self._round_trip(_Line(sock, daemon, daemon), request_id, p.encode(request_id, p.PingReq()), deadline)
        finally:
            if made:
                sock.close(linger=0)
        if rsp is None:
            raise StripefsError(ErrorCode.TIMEOUT, f"PingReq to {daemon} got no reply")
        if isinstance(rsp, p.ErrorRsp):
            raise StripefsError(rsp.code, rsp.message)
        port = getattr(rsp, "read_port", 0)
        if port:
            endpoint, key = split_address(daemon)
            address = with_key(f"{endpoint.rsplit(':', 1)[0]}:{port}", key)
        else:
            address = daemon
        self._lanes[daemon] = address
        return address

    def call(self, request: p.Msg, *, timeout: float | None = None, detach: bool = False) -> "p.Msg | Late":
        """One read from the metadata daemon, waiting at most ``timeout`` (default: the client's);
        an ErrorRsp raises StripefsError with its code, no answer TIMEOUT or UNAVAILABLE.

        ``detach``: a request sent but not answered within ``timeout`` is not given up: its socket
        leaves this thread in a ``Late``, returned instead of a reply, whose ``wait`` another thread
        continues (the daemon may legitimately hold a read: a recall, daemon/callbacks.py; asking
        again would only make it a second request waiting for the same holder)."""
        if type(request) not in READS or getattr(request, "open_info", False):
            raise ValueError(f"{type(request).__name__} is not a read a plain thread may send (meta_blocking.READS)")
        wait = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + wait
        line = self._line(deadline, main=type(request) is p.LookupReq and bool(request.callback))
        request_id = next(_ids)
        started = time.perf_counter()
        body = late = None
        try:
            header = p.encode(request_id, self.meta._wire(request))
            body = self._round_trip(line, request_id, header, deadline)  # (None: sent, not answered yet)
            if body is None and detach:
                late = self._detach(line, request, request_id, started)
                return late
        except StripefsError:
            self._lanes.pop(line.daemon, None)  # asked again next time: a restarted daemon's lane may have moved
            raise
        finally:
            if late is None:
                observe_rpc(line.address, request, body, time.perf_counter() - started)
        return self._reply(line, request, body, wait)

    def _reply(self, line: _Line, request: p.Msg, body: p.Msg | None, wait: float) -> p.Msg:
        """``call``'s answer from the reply ``body`` (None: none came within ``wait``)."""
        self.calls += 1
        if body is None:
            self._lanes.pop(line.daemon, None)
            raise StripefsError(ErrorCode.TIMEOUT, f"{p.kind(request)} to {line.address} got no reply within {wait:.1f}s")
        if isinstance(body, p.ErrorRsp):
            raise StripefsError(body.code, body.message)
        subtree = self.meta.subtree
        return body if subtree is None else subtree.reply(body)

    def _detach(self, line: _Line, request: p.Msg, request_id: int, started: float) -> "Late":
        """``line`` no more this thread's (its next call connects a new one): a ``Late``'s."""
        with self._lock:
            if self.closed:
                raise StripefsError(ErrorCode.UNAVAILABLE, "the mount's metadata connection is closed")
            if line in self._lines:
                self._lines.remove(line)
        lines = self._local.lines
        for key, held in list(lines.items()):
            if held is line:
                del lines[key]
        return Late(self, line, request, request_id, started)

    def _round_trip(self, line: _Line, request_id: int, header: bytes, deadline: float, sent: bool = False) -> p.Msg | None:
        """Send ``header`` (not when ``sent``: only wait) and wait for the reply to ``request_id`` until
        ``deadline``: the reply, or None once it passed; UNAVAILABLE if it could not be sent by then."""
        sock = line.sock
        try:
            while not sent:
                try:
                    sock.send(header, zmq.NOBLOCK)  # ZMQ_IMMEDIATE: Again while no connection takes it
                    break
                except zmq.Again:
                    left = deadline - time.monotonic()
                    if left <= 0 or not sock.poll(int(left * 1000) + 1, zmq.POLLOUT):
                        if time.monotonic() >= deadline:
                            raise StripefsError(ErrorCode.UNAVAILABLE, f"no connection to {line.address}") from None
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                wait_ms = min(_RECV_SLICE_MS, int(left * 1000) + 1)
                if line.rcvtimeo != wait_ms:  # set again only at the end of a long wait, and after it
                    sock.setsockopt(_RCVTIMEO, wait_ms)
                    line.rcvtimeo = wait_ms
                try:
                    frames = recv_frames(sock)  # blocking, without pyzmq's sugar (common/fast_lane.py)
                except zmq.Again:
                    continue
                try:
                    reply_id, body = p.decode_reply(frames[0].buffer)
                except p.ProtocolError:
                    continue  # as RpcClient: an undecodable reply is dropped
                if reply_id == request_id:
                    return body
                # a reply to a request that timed out before: dropped
        except zmq.ZMQError as exc:
            if exc.errno == zmq.ENOTSOCK or sock.closed:
                raise StripefsError(ErrorCode.UNAVAILABLE, f"the connection to {line.address} is closed") from None
            raise

    def close(self) -> None:
        """Close every thread's socket (the threads stopped first: module docstring; a ``Late``
        closes its own)."""
        with self._lock:
            self.closed = True
            lines, self._lines = self._lines, []
        for line in lines:
            line.sock.close(linger=0)


class Late:
    """A request sent by ``call(detach=True)`` and not answered in its time: the socket it went on,
    now this object's alone (a libzmq socket may move between threads, used by one at a time)."""

    __slots__ = ("client", "line", "request", "request_id", "started")

    def __init__(self, client: BlockingMetaClient, line: _Line, request: p.Msg, request_id: int, started: float):
        self.client = client
        self.line = line
        self.request = request
        self.request_id = request_id
        self.started = started  # time.perf_counter() at the send

    def wait(self, seconds: float, stop) -> p.Msg:
        """(any one thread) The reply, waiting until ``seconds`` after the send at most, as ``call``
        answers it (ErrorRsp raised, no reply TIMEOUT); ``stop()``, looked at every 0.1 s, true ends
        the wait as a TIMEOUT at once. The socket is closed after."""
        line, body = self.line, None
        try:
            while body is None and not stop():
                left = self.started + seconds - time.perf_counter()
                if left <= 0:
                    break
                body = self.client._round_trip(line, self.request_id, b"", time.monotonic() + min(left, 0.1), sent=True)
        finally:
            line.sock.close(linger=0)
            observe_rpc(line.address, self.request, body, time.perf_counter() - self.started)
        return self.client._reply(line, self.request, body, time.perf_counter() - self.started)
