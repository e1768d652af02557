"""The change feed: the metadata daemon tells every mount what changed.

Mounts cache names and attributes in the kernel for long (and file pages
across opens); the feed is how they learn to drop what is no longer true. It
is a ZeroMQ PUB socket: one ``ChangeEvent`` frame per namespace change,
numbered per daemon boot, plus a heartbeat that repeats the last number every
``EVENTS_HEARTBEAT_S``. PUB never blocks the daemon: a slow subscriber whose
queue is full loses messages, sees the gap in the numbers and drops its whole
cache (client/kernel_cache.py). That is the consistency rule: a mount either
saw every change, in order, or it trusts nothing it cached.

Events are published after the change is durable (the handler's commit
returned), so a mount never invalidates toward a state that a crash could undo.
"""

from __future__ import annotations

import logging
from typing import Iterable

import trio
import zmq

from ..common import limits
from ..common import protocol as P
from ..common.security import secure_socket

log = logging.getLogger(__name__)

#: messages queued per subscriber before PUB drops (a gap, then a full drop, on that mount)
SEND_HWM = 100_000


class ChangeFeed:
    def __init__(self, ctx: zmq.Context, bind: str, boot_id: str):
        self.boot_id = boot_id
        self.seq = 0
        self._sock = ctx.socket(zmq.PUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, SEND_HWM)
        secure_socket(ctx, self._sock, bind=bind)  # a CURVE server when the daemon has a key
        # what subscribers send a PUB is subscriptions (mounts subscribe to everything: one byte);
        # a peer sending more is cut off (common/limits.py)
        self._sock.setsockopt(zmq.MAXMSGSIZE, limits.SUBSCRIPTION_MAX_FRAME)
        if bind.rsplit(":", 1)[-1] in ("0", "*"):
            self.port = self._sock.bind_to_random_port(bind.rsplit(":", 1)[0])
        else:
            self._sock.bind(bind)
            self.port = int(self._sock.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[-1])
        log.info("change feed on port %d", self.port)

    def changed(self, inodes: Iterable[int] = (), entries: Iterable[tuple[int, bytes]] = ()) -> None:
        """Publish one change (call only once it is durable)."""
        self.seq += 1
        self._send(P.ChangeEvent(self.boot_id, self.seq, list(inodes), list(entries)))

    def _send(self, event: P.ChangeEvent) -> None:
        try:
            self._sock.send(P.encode_event(event), zmq.NOBLOCK)
        except zmq.Again:  # PUB drops rather than blocks; subscribers see the gap
            pass

    async def heartbeat_loop(self) -> None:
        while True:
            await trio.sleep(P.EVENTS_HEARTBEAT_S)
            self._send(P.ChangeEvent(self.boot_id, self.seq, [], []))

    def close(self) -> None:
        self._sock.close()
