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
toward a state that a crash could undo. A plain feed sends a row's lists as
the row stores them (msgpack, ``protocol.encode_event_raw``: the same bytes
as the event encoded anew), not decoded and made again: an ``rm -rf``
publishes one row per unlink, and that was about half of the feed's CPU.

Who hears what (CURVE on)
-------------------------
Names are what a subtree key must not learn of other teams, so a secure feed
does not broadcast. It is an XPUB socket in manual mode: libzmq hands the
daemon every subscription with the key that sent it (ZAP's ``User-Id``), and
the daemon, not the subscriber, decides what that connection is subscribed
to: the topic of its own key (the key's Z85 text), whatever it asked for. A
key of no role that reads the namespace (storage) is subscribed to nothing.
Every event then goes out once per subscribed key as ``[topic, event]``:
whole to an unrestricted key, and to a subtree key with only the inodes and
the (parent, name) entries inside its subtree, as the namespace stands when
the event is published (``MetaAccess.feed_views``; a name in a directory
removed meanwhile is not sent). The numbers stay consecutive for every key,
so filtering never looks like a gap; an event emptied by the filter names no writer
either (``ChangeEvent.writer`` is 0), and a writer tag is a one-way hash that no key can
turn back into the client id that names a mount's retries (daemon/applied_ops.py). Before each publication the keyring is
asked again: a key removed from it gets nothing more, not even heartbeats, on
the connection it still holds (libzmq cannot close one peer of a socket), so
its mount drops its cache within ``EVENTS_SILENCE_S`` and its next request is
refused. A subscriber whose subtree view was not computed for a batch (it
subscribed meanwhile) misses that batch and sees the gap.

libzmq 4.3 pairs each subscription it queues with its connection, but queues
other messages a hostile peer sends (an XSUB can) without one, and the pairs
shift; so after any message that is not a (un)subscription the daemon applies
none of the queued subscriptions until the queue is empty again (their mounts,
hearing nothing, subscribe again after ``EVENTS_SILENCE_S``).
"""

from __future__ import annotations

import logging

import trio
import zmq

from ..common import limits
from ..common import protocol as P
from . import change_log
from ..common.keyring import Grant, Keyring
from ..common.security import peer_of, secure_socket

log = logging.getLogger(__name__)

#: messages queued per subscriber before PUB drops (a gap, then a full drop, on that mount)
SEND_HWM = 100_000
#: subscriptions read per call (a peer flooding the socket cannot hold the daemon's thread)
ADMIT_BATCH = 1000

#: a subtree's view of published rows: seq -> (inodes, entries) inside it
View = dict[int, tuple[list[int], list[tuple[int, bytes]]]]


class ChangeFeed:
    def __init__(self, ctx: zmq.Context, bind: str, log_id: str, seq: int, keyring: Keyring | None = None, daemon: str = ""):
        self.boot_id = log_id
        self.daemon = daemon  # this daemon's boot id: a new one tells mounts its callbacks are gone (daemon/callbacks.py)
        self.seq = seq  # the last change published
        self.keyring = keyring  # None: a plain feed, every subscriber hears everything
        self._subscribers: dict[str, Grant] = {}  # secure feed: key -> its grant, keys subscribed to their topic
        self._misaligned = False  # a non-subscription was read: apply nothing until the queue is empty
        self._logged: set[tuple[str, str | None]] = set()  # (what, key) logged once: a peer cannot flood the log
        self._sock = ctx.socket(zmq.PUB if keyring is None else zmq.XPUB)
        if keyring is not None:
            self._sock.setsockopt(zmq.XPUB_MANUAL, 1)  # subscriptions are the daemon's to apply (admit)
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

    def publish_new(self, store, views=None) -> int:
        """Publish the committed changes after the last one published; how many.

        Call on the trio thread (the socket is not thread-safe) where ``store``
        sees only committed rows (right after a commit). ``views(rows, subdirs)``
        gives each subtree's view of the rows (``MetaAccess.feed_views``)."""
        published = 0
        while True:
            rows = store.changes_after(self.seq, change_log.PAGE)
            subdirs = self.subtrees() if rows else set()
            self.publish(rows, views(rows, subdirs) if views is not None and subdirs else None)
            published += len(rows)
            if len(rows) < change_log.PAGE:
                return published

    def publish(self, rows: list[tuple[int, bytes]], views: dict[str, View] | None = None) -> None:
        """Publish change-log rows read after ``seq`` (on the trio thread); ``views``: each
        subscribed subtree's view of them (a secure feed sends a subtree key nothing else)."""
        if self.keyring is None:  # every subscriber hears every event as the row has it
            send, boot_id, daemon = self._sock.send, self.boot_id, self.daemon
            for seq, blob in rows:
                if seq <= self.seq:  # read twice (two readers raced): already out
                    continue
                self.seq = seq
                inodes, entries, writer = change_log.decode_raw(blob)
                try:  # the row's lists as stored, not decoded and made again (an rm -rf: one row per unlink)
                    send(P.encode_event_raw(boot_id, seq, inodes, entries, daemon, writer), zmq.NOBLOCK)
                except zmq.Again:  # PUB drops rather than blocks; subscribers see the gap
                    pass
            return
        targets = self._targets()
        for seq, blob in rows:
            if seq <= self.seq:  # read twice (two readers raced): already out
                continue
            inodes, entries, writer = change_log.decode_writer(blob)
            self.seq = seq
            frames: dict[str, bytes] = {}
            for topic, subdir in targets:
                if subdir not in frames:
                    view = (inodes, entries) if not subdir else (views or {}).get(subdir, {}).get(seq)
                    if view is None:  # subscribed after the views were made: this key sees a gap
                        continue
                    # a subtree key hears nothing of a change outside its subtree, not even who made it
                    named = writer if not subdir or view[0] or view[1] else 0
                    frames[subdir] = P.encode_event(P.ChangeEvent(self.boot_id, seq, *view, self.daemon, named))
                self._send_frames([topic, frames[subdir]])

    def _send(self, event: P.ChangeEvent) -> None:
        """One event to every subscriber (a heartbeat: it names nothing)."""
        frame = P.encode_event(event)
        if self.keyring is None:
            self._send_frames([frame])
        for topic, _ in self._targets():
            self._send_frames([topic, frame])

    def _send_frames(self, frames: list[bytes]) -> None:
        try:
            self._sock.send_multipart(frames, zmq.NOBLOCK)
        except zmq.Again:  # PUB drops rather than blocks; subscribers see the gap
            pass

    async def heartbeat_loop(self) -> None:
        while True:
            await trio.sleep(P.EVENTS_HEARTBEAT_S)
            self._send(P.ChangeEvent(self.boot_id, self.seq, [], [], self.daemon))

    # -- who hears what (secure feed) ----------------------------------------------------

    def subtrees(self) -> set[str]:
        """The subtrees of the keys subscribed now: the views the next publication needs."""
        return {subdir for _, subdir in self._targets() if subdir}

    def _targets(self) -> list[tuple[bytes, str]]:
        """(topic, subdir) of every subscribed key still in the keyring; subscriptions
        waiting are admitted first, keys removed from the keyring are dropped."""
        if self.keyring is None:
            return []
        self.admit()
        targets = []
        for key, old in list(self._subscribers.items()):
            grant = self.keyring.grant(key)
            if grant is None or grant.role == "storage":
                del self._subscribers[key]
                log.warning("change feed: key %r is no longer in the keyring (or no longer reads the namespace): "
                            "it gets no more events", old.name)
                continue
            self._subscribers[key] = grant
            targets.append((key.encode(), grant.subdir))
        return targets

    def admit(self) -> None:
        """Apply the subscriptions waiting: each connection gets its own key's topic."""
        if self.keyring is None:
            return
        for _ in range(ADMIT_BATCH):
            try:
                frame = self._sock.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                self._misaligned = False  # nothing queued: libzmq's pairs are in step again
                return
            self._admit_one(frame.bytes, peer_of(frame))

    def _admit_one(self, data: bytes, key: str | None) -> None:
        if not data or data[0] > 1:  # not a (un)subscription: the queue's connection pairs shifted
            if self._once("junk", key):
                log.warning("change feed: key %s sent a message that is not a subscription; the subscriptions "
                            "queued with it are ignored (their mounts subscribe again)", key)
            self._misaligned = True
            return
        if self._misaligned or key is None:  # shifted, or an unsubscription of a closed connection (libzmq's)
            return
        topic = key.encode()
        if data[0] == 0:
            self._sock.setsockopt(zmq.UNSUBSCRIBE, topic)
            return
        grant = self.keyring.grant(key)
        if grant is None or grant.role == "storage":
            if self._once("refused", key):
                log.warning("change feed: subscription of key %s refused: %s", key,
                            "not in the keyring" if grant is None else "a storage key does not read the namespace")
            return
        self._sock.setsockopt(zmq.SUBSCRIBE, topic)  # the connection the subscription came from
        self._subscribers[key] = grant

    def _once(self, what: str, key: str | None) -> bool:
        """Whether to log ``what`` for ``key``: the first time only (for a bounded number of keys)."""
        if (what, key) in self._logged or len(self._logged) >= 10_000:
            return False
        self._logged.add((what, key))
        return True

    async def subscription_loop(self) -> None:
        """A secure feed: admit subscriptions as they arrive (every publication admits too)."""
        fd = self._sock.getsockopt(zmq.FD)
        while True:
            self.admit()
            with trio.move_on_after(P.EVENTS_HEARTBEAT_S):  # the FD is edge-triggered: sends may eat an edge
                await trio.lowlevel.wait_readable(fd)

    def close(self) -> None:
        self._sock.close()
