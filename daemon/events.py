"""The change feed: the metadata daemon tells every mount what changed.

Mounts cache names and attributes in the kernel for long (and file pages
across opens); the feed is how they learn to drop what is no longer true. It
is a ZeroMQ PUB socket: one ``ChangeEvent`` frame per row of the change log
(daemon/change_log.py), numbered by the log, plus a heartbeat that repeats
the last number every ``EVENTS_HEARTBEAT_S``. The log holds the changes made
through every daemon sharing the database, so a mount following any one of
them hears of all of them, in order. ``ChangeEvent.boot_id`` carries the
log's id (``meta.change_log_id``), the same on every daemon of a cluster.

PUB never blocks the daemon: a slow subscriber whose queue is full loses
messages, sees the gap in the numbers and drops its whole cache
(client/kernel_cache.py). That is the consistency rule: a mount either saw
every change, in order, or it trusts nothing it cached. A mount that switches
to another daemon (failover) hears silence on the old feed and drops its cache
once.

Events are published from committed rows only, so a mount never invalidates
toward a state that a crash could undo.
"""

from __future__ import annotations

import logging

import trio
import zmq

from ..common import limits
from ..common import protocol as P
from . import change_log
from ..common.security import secure_socket

log = logging.getLogger(__name__)

#: messages queued per subscriber before PUB drops (a gap, then a full drop, on that mount)
SEND_HWM = 100_000


class ChangeFeed:
    def __init__(self, ctx: zmq.Context, bind: str, log_id: str, seq: int):
        self.boot_id = log_id
        self.seq = seq  # the last change published
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
        log.info("change feed on port %d, from change %d of log %s", self.port, seq, log_id)

    def publish_new(self, store) -> int:
        """Publish the committed changes after the last one published; how many.

        Call on the trio thread (the socket is not thread-safe) where ``store``
        sees only committed rows (right after a commit)."""
        published = 0
        while True:
            rows = store.changes_after(self.seq, change_log.PAGE)
            self.publish(rows)
            published += len(rows)
            if len(rows) < change_log.PAGE:
                return published

    def publish(self, rows: list[tuple[int, bytes]]) -> None:
        """Publish change-log rows read after ``seq`` (on the trio thread)."""
        for seq, blob in rows:
            if seq <= self.seq:  # read twice (two readers raced): already out
                continue
            inodes, entries = change_log.decode(blob)
            self.seq = seq
            self._send(P.ChangeEvent(self.boot_id, seq, inodes, entries))

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
