"""Limits that keep a slow or hostile peer from exhausting memory or blocking others.

Every socket (common/transport.py) is bounded at three levels:

* **Frame size.** ``ZMQ_MAXMSGSIZE`` is set on every socket: libzmq checks each
  incoming frame's length as it is announced on the wire and drops the
  connection of a peer that announces a larger one, before any byte of it is
  buffered. The largest legitimate frame is a chunk payload (at most
  ``MAX_CHUNK_SIZE``: a whole-chunk write, a read, a repair copy) or a header;
  so a server's limit is ``max(MAX_CHUNK_SIZE, MAX_HEADER_BYTES) + FRAME_SLACK``.
  Replies may carry larger headers (a directory listing with chunk maps), so a
  client's limit uses ``MAX_REPLY_HEADER_BYTES``. The change feed's frames are
  headers only.
* **Header size and shape.** A request's header frame over ``MAX_HEADER_BYTES``
  is refused before msgpack decoding; lists a handler iterates over carry a
  ``max_length`` in their schema (common/protocol.py) so that one request
  cannot hold the metadata daemon's lock for long (a ``LookupPathsReq``, whose
  paths may name 65,536 names, is resolved in slices, each under the lock on its
  own, one request of a connection at a time: daemon/service.py); a message
  with more frames than ``MAX_REQUEST_FRAMES`` is refused without looking at them.
* **Requests in flight.** ``serve()`` admits at most ``per_peer_inflight``
  requests of one peer (one ROUTER identity: one connection) into its
  handlers at once and queues up to ``per_peer_queue`` more of that peer; a
  request past that, or past ``max_queued`` / ``max_queued_bytes`` for all
  peers together, is answered at once with ``BUSY`` and costs nothing more. A
  peer flooding requests therefore fills only its own queue: the others' are
  served in turn, because each peer's queue drains through its own slots.
  Every handler runs under ``request_timeout_s``; one that has not finished by
  then is cancelled and answered ``TIMEOUT``, so its slot is freed (a worker
  thread doing disk I/O is never abandoned halfway: the slot is freed when it
  returns). On the client side ``RpcClient`` never waits without a deadline.
* **Replies not taken.** A peer whose replies its connection has not taken
  reach ``per_peer_reply_bytes`` (``ReplyQueues``: a peer that sends and
  never reads) has none of its further requests run until they leave; they
  wait in its queue like requests past its slots.

The choice "reply BUSY" over "stop reading the socket": a ROUTER that stops
reading stops every peer, not just the flooding one; a queue per peer with an
immediate refusal past it keeps the others served and bounds memory. A
legitimate client never reaches the defaults (a mount has at most the
kernel's ``max_background`` requests plus prefetch in flight).

The limit is per connection: a hostile process can open several. CURVE keys
(docs/security.md) are what stops an unknown process from connecting at all.
"""

from __future__ import annotations

import collections
import threading
from typing import Generic, TypeVar

import msgspec
import zmq

from .layout import MAX_CHUNK_SIZE
from .protocol import MAX_BATCH_WRITES, MAX_HEADER_BYTES, MAX_REPLY_HEADER_BYTES

#: added to the frame limits (ZeroMQ's own framing, future small fields)
FRAME_SLACK = 64 << 10
#: identity + header + payloads: a WriteChunksReq carries one payload frame per chunk write
MAX_REQUEST_FRAMES = 2 + MAX_BATCH_WRITES

#: ZMQ_MAXMSGSIZE of a server's ROUTER socket: a chunk payload or a request header
SERVER_MAX_FRAME = max(MAX_CHUNK_SIZE, MAX_HEADER_BYTES) + FRAME_SLACK
#: ZMQ_MAXMSGSIZE of a client's DEALER socket: a chunk payload or a reply header
CLIENT_MAX_FRAME = max(MAX_CHUNK_SIZE, MAX_REPLY_HEADER_BYTES) + FRAME_SLACK
#: ZMQ_MAXMSGSIZE of a change-feed subscriber
FEED_MAX_FRAME = MAX_HEADER_BYTES + FRAME_SLACK
#: ZMQ_MAXMSGSIZE of the change feed's PUB socket: it only receives subscriptions
SUBSCRIPTION_MAX_FRAME = 1024


class ServeLimits(msgspec.Struct, frozen=True, kw_only=True):
    """What one ``serve()`` loop admits (config keys of the same names in metad.toml / storage.toml)."""

    per_peer_inflight: int = 64  # requests of one connection in handlers at once
    per_peer_queue: int = 1024  # more requests of one connection waiting for a slot; past it: BUSY
    max_queued: int = 16384  # waiting requests of all connections together; past it: BUSY
    max_queued_bytes: int = 256 << 20  # their frames' bytes together; past it: BUSY
    request_timeout_s: float = 600.0  # a handler still running after this is cancelled: TIMEOUT
    per_peer_reply_bytes: int = 64 << 20  # replies to one connection the network has not taken; past it its requests wait


T = TypeVar("T")

START, QUEUED, REFUSED = "start", "queued", "refused"


class _Peer:
    __slots__ = ("inflight", "queue")

    def __init__(self) -> None:
        self.inflight = 0
        self.queue: collections.deque = collections.deque()


class PeerQueues(Generic[T]):
    """Admission of requests per peer (pure: ``serve()`` runs what ``offer``/``finish`` say).

    ``offer`` answers START (run it now: the peer has a free slot), QUEUED (it
    waits in the peer's queue; ``finish`` hands it out later) or REFUSED (answer
    BUSY). ``finish(peer)`` frees one of the peer's slots and returns the next
    queued request of that peer to run in the same slot, or None.
    """

    def __init__(self, limits: ServeLimits):
        self.limits = limits
        self._peers: dict[bytes, _Peer] = {}
        self.queued = 0
        self.queued_bytes = 0

    def offer(self, peer: bytes, item: T, nbytes: int) -> str:
        state = self._peers.get(peer)
        if state is None:
            state = self._peers[peer] = _Peer()
        if state.inflight < self.limits.per_peer_inflight:
            state.inflight += 1
            return START
        if (
            len(state.queue) >= self.limits.per_peer_queue
            or self.queued >= self.limits.max_queued
            or self.queued_bytes + nbytes > self.limits.max_queued_bytes
        ):
            return REFUSED
        state.queue.append((item, nbytes))
        self.queued += 1
        self.queued_bytes += nbytes
        return QUEUED

    def finish(self, peer: bytes) -> T | None:
        state = self._peers[peer]
        if state.queue:
            item, nbytes = state.queue.popleft()
            self.queued -= 1
            self.queued_bytes -= nbytes
            return item  # runs in the slot just freed: inflight unchanged
        state.inflight -= 1
        if state.inflight == 0:
            del self._peers[peer]  # a peer with nothing in flight costs nothing
        return None

    def inflight(self, peer: bytes) -> int:
        state = self._peers.get(peer)
        return state.inflight if state else 0

    def waiting(self, peer: bytes) -> int:
        """The peer's requests queued for a slot (a request answered at once must not pass them)."""
        state = self._peers.get(peer)
        return len(state.queue) if state else 0

    def __len__(self) -> int:
        """Peers with something in flight."""
        return len(self._peers)


class _Sent:
    __slots__ = ("segments", "closed", "open")

    def __init__(self) -> None:
        self.segments: collections.deque = collections.deque()  # (bytes, tracker): ends with a tracked reply
        self.closed = 0  # bytes in segments
        self.open = 0  # bytes of untracked replies after the last tracked one


class ReplyQueues:
    """Bytes of replies handed to libzmq for each peer that its connection has not taken yet.

    libzmq keeps a ROUTER's replies to a peer in a queue of up to SNDHWM messages of any size
    until the peer's connection takes them: a peer that never reads made a storage node hold
    every read it answered (review, issue 20: 250 unread 4 MiB reads took one from 64 MiB to
    1 GiB). serve() therefore runs a peer's requests only while its replies waiting here are
    under ``per_peer_reply_bytes`` (``over``); the others wait in its queue, and past the queue
    are answered BUSY, as for a peer with too many requests.

    pyzmq says when libzmq is done with a frame sent without a copy (a ``MessageTracker``), and
    a peer's replies leave in order: once a tracked reply is done, so is every reply before it.
    A reply is tracked (its last frame sent without a copy) once it and the untracked replies
    since the last tracked one reach ``track_every`` bytes, so the count is exact to within
    ``track_every`` per peer, for one wake-up of pyzmq's collector thread per ``track_every``
    bytes (a reply of 1 MiB or more goes without a copy and is tracked anyway).

    Thread-safe: a fast lane (common/fast_lane.py) sends on its thread while serve() asks.
    """

    MAX_PEERS = 10_000  # peers remembered with nothing tracked: past it they are forgotten

    def __init__(self, per_peer_bytes: int):
        self.limit = max(1, per_peer_bytes)
        self.track_every = min(1 << 20, max(1, self.limit // 8))
        self._lock = threading.Lock()
        self._peers: dict[bytes, _Sent] = {}

    def outgoing(self, peer: bytes, frames: list) -> tuple[list, int, bool]:
        """(the frames to send, their bytes, whether tracked): tracked, the last frame is a zmq.Frame
        sent without a copy; give its ``tracker`` to ``sent`` once sent."""
        nbytes = sum(f.nbytes if isinstance(f, memoryview) else len(f) for f in frames[1:])
        with self._lock:
            state = self._peers.get(peer)
            pending = state.open if state is not None else 0
        if pending + nbytes < self.track_every:
            return frames, nbytes, False
        last = frames[-1]
        last = zmq.Frame(last.buffer if isinstance(last, zmq.Frame) else last, copy=False, track=True)
        return [*frames[:-1], last], nbytes, True

    def add_small(self, peer: bytes, nbytes: int) -> bool:
        """``outgoing`` and ``sent`` in one step for a reply that needs no tracking: True, and its
        ``nbytes`` counted, when it and the untracked replies since the last tracked one stay under
        ``track_every`` (send it as it is); False, nothing counted: ``outgoing``/``sent`` as usual.
        One lock instead of two for a fast lane's small reply (issue 30: its thread's Python is on
        a round trip's critical path); counted before the send, which only makes ``over`` say so
        a moment sooner."""
        with self._lock:
            state = self._peers.get(peer)
            if (state.open if state is not None else 0) + nbytes >= self.track_every:
                return False
            (state or self._new_peer(peer)).open += nbytes
            return True

    def _new_peer(self, peer: bytes) -> _Sent:
        """(``_lock`` held) ``peer``'s count, new; past ``MAX_PEERS`` those with nothing tracked go first."""
        if len(self._peers) >= self.MAX_PEERS:
            self._peers = {p: s for p, s in self._peers.items() if s.segments}
        state = self._peers[peer] = _Sent()
        return state

    def sent(self, peer: bytes, nbytes: int, tracker=None) -> None:
        """A reply of ``nbytes`` went to libzmq for ``peer``; ``tracker``: it was tracked."""
        with self._lock:
            state = self._peers.get(peer) or self._new_peer(peer)
            if tracker is None:
                state.open += nbytes
            else:
                state.segments.append((state.open + nbytes, tracker))
                state.closed += state.open + nbytes
                state.open = 0

    def queued(self, peer: bytes) -> int:
        """Bytes of replies to ``peer`` libzmq may still hold."""
        with self._lock:
            state = self._peers.get(peer)
            if state is None:
                return 0
            segments = state.segments
            while segments and segments[0][1].done:
                state.closed -= segments.popleft()[0]
            if not segments and not state.open:
                del self._peers[peer]
            return state.closed + state.open

    def over(self, peer: bytes) -> bool:
        """Whether ``peer``'s next request must wait for its replies to leave."""
        return self.queued(peer) >= self.limit
