"""CURVE on the sockets: whose key a process holds, which server key an address names.

ZeroMQ CURVE (RFC 26) encrypts a connection and authenticates both ends with
Curve25519 keys; the server learns the client's public key during the
handshake and asks a ZAP handler (RFC 27, ``inproc://zeromq.zap.01`` in the
server's context; common/zap.py answers) whether to accept it. Accepted, the key is attached to every
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
import weakref
from dataclasses import dataclass

import zmq
import zmq.utils.z85

from .errors import QuietError

log = logging.getLogger(__name__)

KEY_MARK = "?key="
ZAP_ENDPOINT = "inproc://zeromq.zap.01"
ZAP_DOMAIN = "stripefs"

#: the Z85 public key of the peer that sent the request being handled (None: plain socket)
PEER: contextvars.ContextVar[str | None] = contextvars.ContextVar("stripefs_peer", default=None)


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
