"""CURVE on the sockets: whose key a process holds, which server key an address names, ZAP.

ZeroMQ CURVE (RFC 26) encrypts a connection and authenticates both ends with
Curve25519 keys; the server learns the client's public key during the
handshake and asks a ZAP handler (RFC 27, ``inproc://zeromq.zap.01`` in the
server's context) whether to accept it. Accepted, the key is attached to every
message of the connection as its ``User-Id`` property, so a server knows which
key sent each request (``peer_of``). docs/security.md is the operator's view.

Conventions
-----------
* A process's own keypair (``Identity``) belongs to its ZeroMQ context
  (``use_identity``); ``None`` there means the process default, which the
  command line sets (``$STRIPEFS_KEY``). A context without one talks plain.
* A server's public key travels with its address: ``tcp://HOST:PORT?key=Z85``
  (``with_key`` / ``split_address``). Z85 has neither ',' nor ';', so lists of
  addresses still split on them; the endpoint part never contains ``?key=``.
  Storage nodes register their address with their key, so the metadata daemon
  hands clients and peers addresses they can connect to securely; a client
  learns the daemon's key from the address it is given (or the mount source).
* A socket that binds anything but loopback (127.0.0.0/8, ::1, localhost,
  ipc://, inproc://) needs a key: ``secure_socket`` refuses it otherwise.
* ``serve()`` (common/transport.py) sets ``PEER`` to the sending key's Z85 text
  for the duration of each request (None on a plain socket); services map it to
  a ``Grant`` through their keyring (common/keyring.py).
"""

from __future__ import annotations

import contextvars
import ipaddress
import logging
import math
import time
import weakref
from dataclasses import dataclass
from typing import Callable

import trio
import zmq
import zmq.utils.z85

from .errors import QuietError

log = logging.getLogger(__name__)

KEY_MARK = "?key="
ZAP_ENDPOINT = "inproc://zeromq.zap.01"
ZAP_DOMAIN = "stripefs"

#: the Z85 public key of the peer that sent the request being handled (None: plain socket)
PEER: contextvars.ContextVar[str | None] = contextvars.ContextVar("stripefs_peer", default=None)

#: a refused handshake is logged once per key and address in this long; the others are counted
REFUSAL_LOG_EVERY_S = 60.0
#: refused handshakes logged one by one in that long, all keys together (a peer making up keys)
REFUSAL_LOG_LINES = 10


@dataclass(frozen=True)
class Identity:
    """A CURVE keypair, both halves as 40-byte Z85 text."""

    public: bytes
    secret: bytes

    @property
    def public_text(self) -> str:
        return self.public.decode()


_by_context: "weakref.WeakKeyDictionary[zmq.Context, Identity]" = weakref.WeakKeyDictionary()
_default: list[Identity | None] = [None]


def use_identity(ctx: zmq.Context | None, identity: Identity | None) -> None:
    """Sockets of ``ctx`` (of every context without its own, when ``ctx`` is None) use ``identity``."""
    if ctx is None:
        _default[0] = identity
    elif identity is None:
        _by_context.pop(ctx, None)
    else:
        _by_context[ctx] = identity


def identity_of(ctx: zmq.Context | None) -> Identity | None:
    """The context's own identity, else the process default (``ctx`` None: the default only)."""
    return _default[0] if ctx is None else _by_context.get(ctx, _default[0])


def valid_key(text: str) -> bool:
    """Whether ``text`` is a Z85-encoded 32-byte key."""
    if len(text) != 40:
        return False
    try:
        return len(zmq.utils.z85.decode(text.encode("ascii"))) == 32
    except (ValueError, UnicodeEncodeError, KeyError):
        return False


def split_address(address: str) -> tuple[str, str | None]:
    """``tcp://h:p?key=K`` -> (``tcp://h:p``, ``K``); an address without a key -> (address, None)."""
    endpoint, mark, key = address.partition(KEY_MARK)
    if not mark:
        return address, None
    if not valid_key(key):
        raise QuietError(f"address {address!r}: the server key after {KEY_MARK} must be 40 characters of Z85")
    return endpoint, key


def with_key(endpoint: str, key: str | bytes | None) -> str:
    """The address naming ``endpoint`` and its server's public key (unchanged without a key)."""
    if not key:
        return endpoint
    return f"{split_address(endpoint)[0]}{KEY_MARK}{key.decode() if isinstance(key, bytes) else key}"


def is_local(endpoint: str) -> bool:
    """Whether a bind endpoint is reachable from this machine only."""
    if endpoint.startswith(("ipc://", "inproc://")):
        return True
    host = endpoint.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name or an interface: assume reachable from the network


def secure_socket(ctx: zmq.Context, sock: zmq.Socket, *, bind: str | None = None, connect: str | None = None) -> str | None:
    """Set CURVE options on ``sock`` before it binds or connects; returns the endpoint to connect to.

    A bind with this context's identity makes a CURVE server (ZAP decides who
    gets in); a bind without one is refused unless it is loopback. A connect to
    an address naming a server key makes a CURVE client (and needs an identity).
    """
    identity = identity_of(ctx)
    if bind is not None:
        if identity is not None:
            sock.curve_server = True
            sock.curve_secretkey = identity.secret
            sock.curve_publickey = identity.public
            sock.zap_domain = ZAP_DOMAIN.encode()
        elif not is_local(bind):
            raise QuietError(
                f"refusing to listen on {bind} without CURVE authentication: anyone on the network could read "
                "and write data. Create a keypair with 'stripefs keygen NAME', set curve_key = \"NAME.key_secret\" "
                "and keyring = \"keyring.toml\" in this config (docs/security.md), or listen on 127.0.0.1"
            )
    if connect is None:
        return None
    endpoint, server_key = split_address(connect)
    if server_key is not None:
        if identity is None:
            raise QuietError(
                f"{connect} is a CURVE server, but this process has no key: set curve_key in its config, "
                "or $STRIPEFS_KEY to a secret key file (stripefs keygen)"
            )
        sock.curve_serverkey = server_key.encode()
        sock.curve_secretkey = identity.secret
        sock.curve_publickey = identity.public
    return endpoint


def peer_of(frame: zmq.Frame) -> str | None:
    """The Z85 public key that sent ``frame`` (set by ZAP), or None on a plain connection."""
    try:
        return frame.get("User-Id") or None
    except zmq.ZMQError:
        return None


def current_peer() -> str | None:
    return PEER.get()


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
    from .transport import open_socket  # transport imports this module

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
