"""The mount's connection to the metadata daemon: session, heartbeats, retries.

One DEALER per metadata address. A request that times out (the daemon is
restarting, say) is retried on the next address, for up to ``retry_window_s``
in all: a metadata daemon restart is invisible to applications, only slower.

Idempotent retries: every mutating request (``protocol.ONCE_MESSAGES``) is
sent wrapped in ``OnceReq(client_id, op_id, done_below, body)``, and a retry
resends the very same OnceReq: a daemon that finds the op applied already
(by itself or another daemon, before a crash or a lost reply) answers what it
answered then instead of applying it twice (daemon/applied_ops.py). The
client id is random per MetaClient; op ids count up; ``done_below`` is the
lowest op id still waiting for its reply, so the daemons may forget the rest.

The session: ``HelloReq`` at start gives a session id; a heartbeat task sends
the set of open inodes every third of the lease. When the daemon answers
NOT_FOUND (it restarted and forgot us) we say hello again and re-announce.
"""

from __future__ import annotations

import logging
import os
import random
import socket
from contextlib import AsyncExitStack
from typing import Callable

import trio
import zmq

from ..common import protocol as p
from ..common.errors import ErrorCode, StripefsError
from ..common.keyring import squash
from ..common.security import split_address, with_key
from ..common.transport import RpcClient, connect
from .subtree import Subtree

log = logging.getLogger(__name__)

_RETRYABLE = {ErrorCode.TIMEOUT, ErrorCode.UNAVAILABLE}


class MetaClient:
    def __init__(self, ctx: zmq.Context, addresses: list[str], *, timeout: float, retry_window_s: float = 120.0):
        if not addresses:
            raise ValueError("no metadata daemon address")
        self._ctx = ctx
        self.addresses = addresses
        self.timeout = timeout
        self.retry_window_s = retry_window_s
        self._clients: list[RpcClient] = []
        self._current = 0
        self.session_id = 0
        self.lease_s = 15.0
        self.boot_id = ""
        self.cluster_id = ""
        self.open_inodes: Callable[[], list[int]] = lambda: []
        self.client_id = random.getrandbits(63) or 1  # names this client's ops in the daemons' applied-ops table
        self.writer = 0  # HelloRsp.writer: the change feed's name for this client's changes
        self.callbacks = False  # HelloRsp.callbacks: the daemon grants callbacks
        self.marks = False  # HelloRsp.marks: ... and write marks (so closes may send nothing)
        self._next_op = 1
        self._unanswered: set[int] = set()  # op ids sent and not answered yet
        self.subdir = b""  # ask to see only this directory (HelloReq.subdir)
        self.subtree: Subtree | None = None  # set when the daemon gives a root other than inode 1
        self.root_squash = False  # uid/gid 0 in requests become nobody (-o root_squash)
        self.caps = None  # client.caps.CapStore: keeps the capabilities replies carry (a subtree key's)

    async def open(self, stack: AsyncExitStack) -> None:
        for address in self.addresses:
            self._clients.append(await stack.enter_async_context(connect(self._ctx, address, timeout=self.timeout)))

    async def call(self, request: p.Msg, *, retry: bool = True) -> p.Msg:
        """One request to the metadata daemon; retried across a restart or failover.

        A mutating request is applied once however often it is retried (OnceReq)."""
        if type(request).__name__ in p.ONCE_MESSAGES:
            op_id, self._next_op = self._next_op, self._next_op + 1
            self._unanswered.add(op_id)
            try:
                return await self._call(request, retry, (op_id, min(self._unanswered)))
            finally:
                self._unanswered.discard(op_id)
        return await self._call(request, retry)

    async def call_batch(self, requests: list[p.Msg]) -> list[p.Msg]:
        """Many changes in one BatchReq (each in its own OnceReq: a retry applies each once);
        the reply or ErrorRsp of each, in order (daemon/burst.py)."""
        ops = list(range(self._next_op, self._next_op + len(requests)))
        self._next_op += len(requests)
        self._unanswered.update(ops)
        try:
            done_below = min(self._unanswered)
            items = [self._wire(request, (op_id, done_below)) for op_id, request in zip(ops, requests)]
            rsp = await self._call(p.BatchReq(items=items), True)
            results = rsp.results
            if self.subtree is not None:
                results = [r if isinstance(r, p.ErrorRsp) else self.subtree.reply(r) for r in results]
            if self.caps is not None:  # (``_call`` saw only the BatchRsp)
                for reply in results:
                    self.caps.take(reply)
            return results
        finally:
            self._unanswered.difference_update(ops)

    @property
    def current_address(self) -> str:
        """The daemon this client talks to now (it moves on at a failure: ``_call``)."""
        return self.addresses[self._current]

    def _wire(self, request: p.Msg, once: tuple[int, int] | None = None) -> p.Msg:
        """``request`` as sent: squashed, mapped into the subtree, in its OnceReq (``once``: op id,
        done below) when it must be applied once."""
        if self.root_squash:
            request = squash(request)
        wire = request if self.subtree is None else self.subtree.request(request)
        if once is not None:  # wrapped last: the daemon checks and maps what it carries
            wire = p.OnceReq(client_id=self.client_id, op_id=once[0], done_below=once[1], body=wire)
        return wire

    async def _call(self, request: p.Msg, retry: bool, once: tuple[int, int] | None = None) -> p.Msg:
        deadline = trio.current_time() + self.retry_window_s
        attempt = 0
        wire = self._wire(request, once)
        while True:
            client = self._clients[self._current]
            try:
                reply, _ = await client.call(wire)
                if self.subtree is not None:
                    reply = self.subtree.reply(reply)
                if attempt:
                    log.info("metadata daemon %s answers again", client.address)
                if self.caps is not None:
                    self.caps.take(reply)
                return reply
            except StripefsError as exc:
                if exc.code in _RETRYABLE:
                    self._next_after(client)  # also without retry: the next request (a feed_info, say) goes elsewhere
                if not retry or exc.code not in _RETRYABLE or trio.current_time() > deadline:
                    raise
                attempt += 1
                if attempt == 1:
                    log.warning("metadata daemon %s: %s; retrying", client.address, exc.message)
                await trio.sleep(min(0.1 * attempt, 1.0))

    def _next_after(self, failed: RpcClient) -> None:
        """Move on from ``failed``, once: many requests timing out on one dead daemon
        together must not rotate the mount past the live one and back."""
        if self._clients[self._current] is failed:
            self._current = (self._current + 1) % len(self._clients)

    async def hello(self, mountpoint: str, *, patience_s: float) -> None:
        """Open a session; QuietError-friendly StripefsError if nobody answers within ``patience_s``."""
        with trio.move_on_after(patience_s):
            while True:
                try:
                    rsp = await self._clients[self._current].call(
                        p.HelloReq(host=socket.gethostname(), pid=os.getpid(), mountpoint=mountpoint, subdir=self.subdir,
                                   client_id=self.client_id),
                        timeout=min(self.timeout, 2.0),
                        expect=p.HelloRsp,
                    )
                except StripefsError as exc:
                    if exc.code not in _RETRYABLE:
                        raise
                    self._current = (self._current + 1) % len(self._clients)
                    await trio.sleep(0.2)
                    continue
                reply = rsp[0]
                self.session_id, self.lease_s, self.boot_id = reply.session_id, reply.lease_s, reply.boot_id
                self.cluster_id = reply.cluster_id
                self.writer = reply.writer  # the feed's name for our own changes (the daemon's hash of our client id)
                self.callbacks = reply.callbacks
                self.marks = reply.callbacks and reply.marks
                self.subtree = Subtree(reply.root_ino) if reply.root_ino != 1 else None
                log.info("session %d with metadata daemon %s (boot %s)", self.session_id, self.addresses[self._current], self.boot_id)
                return
        raise StripefsError(
            ErrorCode.UNAVAILABLE,
            f"no metadata daemon answered at {', '.join(self.addresses)} within {patience_s:.0f}s"
            + ("; a CURVE daemon also stays silent to a key its keyring does not list (see its log)"
               if any(split_address(a)[1] for a in self.addresses) else ""),
        )

    async def feed_info(self) -> tuple[str, str, int]:
        """Where the current daemon's change feed is now: (address, log id, last change); "" without a feed.

        Asked, not remembered from the hello: a restarted daemon adopts our session
        without a new hello, and its feed may be on another port. A daemon that does
        not answer is left for the next one (the mount then follows that one's feed:
        every daemon publishes the whole change log).
        """
        client = self._clients[self._current]
        try:
            rsp, _ = await client.call(p.PingReq(), expect=p.PingRsp)
        except StripefsError as exc:
            if exc.code in _RETRYABLE:
                self._next_after(client)
            raise
        log_id = rsp.events_log or rsp.boot_id  # the change log's id names the feed's events
        if not rsp.events_port:
            return "", log_id, rsp.events_seq
        endpoint, key = split_address(self.addresses[self._clients.index(client)])  # the daemon that answered
        host = endpoint.rsplit(":", 1)[0]
        return with_key(f"{host}:{rsp.events_port}", key), log_id, rsp.events_seq

    async def heartbeat(self) -> None:
        """One SessionHeartbeatReq, its open set read once the daemon's connection takes it.

        A heartbeat's open set replaces the session's at the daemon. Read before a wait for a
        daemon that is down (the send waits for the connection: ZMQ_IMMEDIATE) and sent when
        it is back, it would name files closed meanwhile; a restarted daemon that adopted the
        session through another request (daemon/health.py) then kept them open until the next
        heartbeat, or the lease's end after an unmount: fsck kept the copies of a write cut by
        the restart, "a writer holds its file open". Not retried: the next one reads anew."""
        client = self._clients[self._current]
        with trio.move_on_after(self.timeout) as waited:
            await client.wait_writable()
        if waited.cancelled_caught:
            self._next_after(client)
            raise StripefsError(ErrorCode.TIMEOUT, f"session heartbeat: {client.address} took no request within {self.timeout:.1f}s")
        # no checkpoint from here to the send: the set read is the set sent
        await self.call(p.SessionHeartbeatReq(session_id=self.session_id, open_inodes=self.open_inodes()), retry=False)

    async def end_session(self, bound_s: float = 1.0) -> None:
        """Tell the daemon the mount is gone (at unmount, after the last flush): its open files,
        callbacks and delegated inode numbers go now, so another mount's change does not wait for
        this one's acknowledgement until the lease ends. Best effort: the lease ends it anyway."""
        if not self.session_id or not self._clients:
            return
        with trio.move_on_after(bound_s, shield=True):
            try:
                await self.call(p.SessionEndReq(session_id=self.session_id), retry=False)
            except StripefsError as exc:
                log.info("ending session %d: %s (its lease ends it)", self.session_id, exc.message)

    async def heartbeat_loop(self, mountpoint: str) -> None:
        """Keep the session alive; re-open it when the daemon forgot us."""
        while True:
            await trio.sleep(max(self.lease_s / 3, 0.5))
            try:
                await self.heartbeat()
            except StripefsError as exc:
                if exc.code == ErrorCode.NOT_FOUND:
                    log.info("metadata daemon forgot session %d (restarted?); opening a new one", self.session_id)
                    try:
                        await self.hello(mountpoint, patience_s=self.lease_s)
                        await self.heartbeat()
                    except StripefsError as exc2:
                        log.warning("cannot re-open session: %s", exc2)
                elif exc.code in _RETRYABLE:
                    log.debug("session heartbeat: %s", exc)
                else:
                    log.warning("session heartbeat failed: %s", exc)
