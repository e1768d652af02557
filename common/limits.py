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
from typing import Generic, TypeVar

import msgspec

from .layout import MAX_CHUNK_SIZE
from .protocol import MAX_HEADER_BYTES, MAX_REPLY_HEADER_BYTES

#: added to the frame limits (ZeroMQ's own framing, future small fields)
FRAME_SLACK = 64 << 10
#: identity + header + payloads: no request carries more than one payload frame today
MAX_REQUEST_FRAMES = 8

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
