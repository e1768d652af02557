"""The ZAP handler (RFC 27): which CURVE clients a server's context lets in.

A CURVE server socket asks ``inproc://zeromq.zap.01`` in its own context
whether to accept the client key it learned in the handshake (common/security.py
holds the rest of CURVE: identities, keys in addresses, ``secure_socket``).
``run_zap`` answers there, from a socket of common/transport.py, with the
answer of an ``accept(key)`` function (a keyring's, common/keyring.py); what
it refuses is logged at a bounded rate (``_Refusals``), under the
``stripefs.common.security`` logger as before the handler had a module of its own.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Callable

import trio
import zmq
import zmq.utils.z85

from .security import ZAP_ENDPOINT
from .transport import open_socket

log = logging.getLogger("stripefs.common.security")

#: a refused handshake is logged once per key and address in this long; the others are counted
REFUSAL_LOG_EVERY_S = 60.0
#: refused handshakes logged one by one in that long, all keys together (a peer making up keys)
REFUSAL_LOG_LINES = 10


class _Refusals:
    """The log of refused handshakes, rate-limited (review, issue 20: a client retrying with an
    unknown key made ~390 lines a second). A (key, address) pair is logged once per ``every_s``,
    and at most ``lines`` pairs per ``every_s`` in all; the refusals not logged are counted, and
    the count is logged once the ``every_s`` since the first of them has passed."""

    def __init__(self, every_s: float | None = None, lines: int | None = None):
        self.every_s = REFUSAL_LOG_EVERY_S if every_s is None else every_s
        self.lines = REFUSAL_LOG_LINES if lines is None else lines
        self._last: dict[tuple[str, str], float] = {}  # (key, address) -> when it was last logged
        self._window = -math.inf  # when the current window of ``lines`` began
        self._logged = 0  # lines logged in this window
        self._quiet = 0  # refusals not logged since the last count
        self._quiet_since = math.inf
        self._quiet_addresses: set[str] = set()

    def note(self, key: str, address: str, message: str, *args) -> None:
        """A refusal of ``key`` (or a mechanism) from ``address``: ``message % args`` if it may be logged."""
        now = time.monotonic()
        if now - self._window >= self.every_s:
            self._window, self._logged = now, 0
        last = self._last.get((key, address), -math.inf)
        if now - last < self.every_s or self._logged >= self.lines:
            if not self._quiet:
                self._quiet_since = now
            self._quiet += 1
            if len(self._quiet_addresses) < 1000:
                self._quiet_addresses.add(address)
            return
        if len(self._last) >= 10_000:  # forget old pairs: bounded like everything else
            self._last.clear()
        self._last[(key, address)] = now
        self._logged += 1
        log.warning(message, *args)

    def due_in(self) -> float:
        """Seconds until the count of unlogged refusals is due (inf: none to count)."""
        return self._quiet_since + self.every_s - time.monotonic() if self._quiet else math.inf

    def flush(self) -> None:
        """Log the count of refusals not logged one by one, if due."""
        if self._quiet and self.due_in() <= 0:
            many = len(self._quiet_addresses)
            log.warning("ZAP: %d more handshake(s) refused in the last %.0fs, from %s address(es), not logged one by one",
                        self._quiet, time.monotonic() - self._quiet_since, f"{many}+" if many >= 1000 else many)
            self._quiet, self._quiet_since = 0, math.inf
            self._quiet_addresses.clear()


async def run_zap(ctx: zmq.Context, accept: Callable[[str], bool], *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Answer ZAP requests of ``ctx`` until cancelled: a CURVE client gets in when ``accept(key)``.

    Start it (``await nursery.start``) before binding a CURVE server socket in
    the same context. Anything but CURVE is refused; so is a key ``accept``
    does not know, with a log line naming the key and the peer's address: once
    per key and address per ``REFUSAL_LOG_EVERY_S``, at most
    ``REFUSAL_LOG_LINES`` of them in that time, and a count of the others.
    """
    refusals = _Refusals()
    async with open_socket(ctx, zmq.ROUTER, bind=ZAP_ENDPOINT) as sock:
        task_status.started()
        while True:
            received = None
            with trio.move_on_after(refusals.due_in()):  # wakes when a count of unlogged refusals is due
                received = await sock.recv_multipart()
            refusals.flush()
            if received is None:
                continue
            frames = [f.bytes for f in received]
            # [routing id, b"", version, request id, domain, address, identity, mechanism, credentials...]
            if len(frames) < 8:
                log.warning("ZAP: malformed request of %d frames ignored", len(frames))
                continue
            routing, _, version, request_id, domain, address, _, mechanism, *credentials = frames
            status, text, user = b"400", b"unknown key", b""
            if version != b"1.0":
                status, text = b"500", b"unsupported ZAP version"
            elif mechanism != b"CURVE" or len(credentials) != 1 or len(credentials[0]) != 32:
                text = b"CURVE required"
                mechanism_text, address_text = mechanism.decode(errors="replace"), address.decode(errors="replace")
                refusals.note(mechanism_text, address_text, "refused a %s connection from %s: CURVE is required", mechanism_text, address_text)
            else:
                key = zmq.utils.z85.encode(credentials[0]).decode()
                try:
                    ok = accept(key)
                except Exception:  # a broken keyring file must not kill the handler
                    log.exception("ZAP: checking key %s failed; refusing it", key)
                    ok = False
                if ok:
                    status, text, user = b"200", b"OK", key.encode()
                else:
                    address_text = address.decode(errors="replace")
                    refusals.note(key, address_text, "refused key %s from %s (domain %s): not in the keyring", key, address_text,
                                  domain.decode(errors="replace"))
            await sock.send_multipart([routing, b"", b"1.0", request_id, status, text, user, b""])
