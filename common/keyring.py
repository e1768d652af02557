"""Key files (``stripefs keygen``) and the keyring: which public keys may do what.

Key files
---------
``stripefs keygen NAME`` writes ``NAME.key`` (the public key) and
``NAME.key_secret`` (public and secret, mode 0600) in ZeroMQ's certificate
format (zcert: ``curve`` section, ``public-key = "Z85"``, ``secret-key =
"Z85"``), so ZeroMQ's own tools read them too.

Keyring
-------
A TOML file read by the metadata daemon and every storage node
(``keyring = PATH`` in their configs); one ``[[key]]`` table per key::

    [[key]]
    name = "team-a-mounts"          # shown in logs
    public = "Z85 public key"       # 40 characters (the line in NAME.key)
    role = "client"                 # meta | storage | admin | client
    read_only = false               # client: every change refused (EROFS), chunk writes too
    subdir = "/team-a"              # client: only this subtree (the daemon; nodes through capabilities)
    root_squash = false             # client: uid/gid 0 in its requests become nobody (65534)
    node_ids = 1                    # storage: how many storage node ids this key may register

Roles: ``meta`` (a metadata daemon: everything on storage nodes), ``storage``
(registers and heartbeats; reads other nodes' chunks to repair), ``admin``
(a client that may also drain/remove nodes, scrub and fsck), ``client``
(namespace and chunk reads/writes). Unknown fields are errors. The file is
read again when its modification time changes, so adding or removing a key
needs no restart: a removed key is refused on its next request.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import msgspec
import zmq
import zmq.auth

from .errors import QuietError
from .security import Identity, valid_key

log = logging.getLogger(__name__)

ROLES = ("meta", "storage", "admin", "client")
#: the most storage node ids one key may hold (``node_ids``)
MAX_NODE_IDS = 4096
NOBODY = 65534


class Grant(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """One keyring entry: what a key may do."""

    name: str
    public: str
    role: str
    read_only: bool = False
    subdir: str = ""
    root_squash: bool = False
    node_ids: int = 1  # storage keys: node ids it may hold (registered, not removed); the first come first

    @property
    def is_client(self) -> bool:
        return self.role in ("admin", "client")


#: request fields holding a uid or gid (root squash)
OWNER_FIELDS = ("uid", "gid")


def squash(body: msgspec.Struct) -> msgspec.Struct:
    """A request with uid/gid 0 replaced by nobody: root squash (the daemon's per key, a mount's -o root_squash)."""
    changes = {f: NOBODY for f in OWNER_FIELDS if getattr(body, f, None) == 0}
    return msgspec.structs.replace(body, **changes) if changes else body


#: what a plain (unauthenticated) socket's peers get: everything, as before CURVE
TRUSTED = Grant(name="plain", public="", role="meta")


class _File(msgspec.Struct, forbid_unknown_fields=True):
    key: list[Grant] = []


def parse(data: bytes | str, source: str = "<keyring>") -> dict[str, Grant]:
    """Grants by public key; QuietError naming the file and the entry on any problem."""
    try:
        entries = msgspec.toml.decode(data, type=_File).key
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise QuietError(f"{source}: {exc}") from None
    grants: dict[str, Grant] = {}
    for i, g in enumerate(entries):
        where = f"{source}: key {i + 1} ({g.name!r})"
        if not valid_key(g.public):
            raise QuietError(f"{where}: public must be a 40-character Z85 key (the public-key line of NAME.key)")
        if g.role not in ROLES:
            raise QuietError(f"{where}: role {g.role!r} is not one of {', '.join(ROLES)}")
        if not g.is_client and (g.read_only or g.subdir or g.root_squash):
            raise QuietError(f"{where}: read_only, subdir and root_squash apply to client and admin keys only")
        if g.node_ids != 1 and g.role != "storage":
            raise QuietError(f"{where}: node_ids applies to storage keys only")
        if not 1 <= g.node_ids <= MAX_NODE_IDS:
            raise QuietError(f"{where}: node_ids must be 1 to {MAX_NODE_IDS}")
        if g.subdir and (not g.subdir.startswith("/") or "/../" in g.subdir + "/" or "/./" in g.subdir + "/"):
            raise QuietError(f"{where}: subdir {g.subdir!r} must be an absolute path without . or .. parts")
        if g.public in grants:
            raise QuietError(f"{where}: the same public key is listed twice")
        grants[g.public] = g
    return grants


class Keyring:
    """The keyring file, re-read when it changes. ``grant(key)`` is None for a key it does not list."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._stamp: tuple[int, int] | None = None
        self._grants: dict[str, Grant] = {}
        self._load()

    def _load(self) -> None:
        try:
            st = self.path.stat()
            stamp = (st.st_mtime_ns, st.st_size)
            if stamp == self._stamp:
                return
            data = self.path.read_bytes()
        except OSError as exc:
            if self._stamp is None:
                raise QuietError(f"cannot read keyring {self.path}: {exc.strerror}") from None
            log.error("cannot read keyring %s (keeping the keys read before): %s", self.path, exc.strerror)
            return
        try:
            self._grants = parse(data, str(self.path))
        except QuietError as exc:
            if self._stamp is None:
                raise
            log.error("keyring %s is invalid (keeping the keys read before): %s", self.path, exc)
        else:
            if self._stamp is not None:
                log.info("keyring %s re-read: %d key(s)", self.path, len(self._grants))
        self._stamp = stamp

    def grant(self, key: str) -> Grant | None:
        self._load()
        return self._grants.get(key)

    def accepts(self, key: str) -> bool:
        return self.grant(key) is not None


# -- key files -----------------------------------------------------------------


def write_keypair(base: str | Path, *, force: bool = False) -> tuple[Path, Path]:
    """Write BASE.key (public) and BASE.key_secret (mode 0600); returns both paths."""
    base = Path(base)
    public_path, secret_path = base.with_name(base.name + ".key"), base.with_name(base.name + ".key_secret")
    for path in (public_path, secret_path):
        if path.exists() and not force:
            raise QuietError(f"{path} exists; remove it or pass --force to replace the keypair")
    public, secret = zmq.curve_keypair()
    header = "#   stripefs CURVE key (ZeroMQ certificate format); the secret file must stay private\n"
    text = '{}metadata\ncurve\n    public-key = "{}"\n'.format(header, public.decode())
    public_path.write_text(text)
    fd = os.open(secret_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(fd, 0o600)  # also when the file existed with wider rights
        f.write(text + '    secret-key = "{}"\n'.format(secret.decode()))
    return public_path, secret_path


def check_private(path: str | Path, what: str) -> None:
    """QuietError unless ``path`` (a secret: a key, credentials) is readable by its owner only."""
    try:
        mode = Path(path).stat().st_mode
    except OSError as exc:
        raise QuietError(f"cannot read {what} {path}: {exc.strerror}") from None
    if mode & 0o077:
        raise QuietError(f"{what} {path} is readable by others (mode {mode & 0o777:o}); chmod 600 {path}")


def load_identity(path: str | Path) -> Identity:
    """The keypair in a NAME.key_secret file; QuietError saying what to do when it is unusable."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
        public, secret = zmq.auth.load_certificate(str(path))
    except (OSError, ValueError) as exc:
        raise QuietError(f"cannot read key {path}: {exc} (create one with 'stripefs keygen NAME')") from None
    if secret is None:
        raise QuietError(f"{path} holds no secret key: give the NAME.key_secret file, not NAME.key")
    if mode & 0o077:
        raise QuietError(f"secret key {path} is readable by others (mode {mode & 0o777:o}); chmod 600 {path}")
    return Identity(public=public, secret=secret)


def load_public(path: str | Path) -> str:
    """The public key in a NAME.key (or NAME.key_secret) file, as Z85 text."""
    try:
        public, _ = zmq.auth.load_certificate(str(path))
    except (OSError, ValueError) as exc:
        raise QuietError(f"cannot read key {path}: {exc}") from None
    return public.decode()


# -- servers -----------------------------------------------------------------------


def server_keyring(ctx, curve_key: str, keyring: str, listen: list[str], *, source: str = "config") -> Keyring | None:
    """Check a server's CURVE settings and give ``ctx`` its key; the Keyring, or None when CURVE is off.

    Raises QuietError (saying what to do) for half a setting, an unusable key
    file, or a listen address beyond loopback without CURVE.
    """
    from .security import is_local, use_identity

    if bool(curve_key) != bool(keyring):
        raise QuietError(f"{source}: curve_key and keyring go together: set both (docs/security.md) or neither")
    if not curve_key:
        for address in listen:
            if address and not is_local(address):
                raise QuietError(
                    f"{source}: {address} is reachable from the network, so CURVE is required: create a key with "
                    "'stripefs keygen NAME', set curve_key = \"NAME.key_secret\" and keyring = \"keyring.toml\" "
                    "(docs/security.md), or listen on 127.0.0.1"
                )
        return None
    ring = Keyring(keyring)
    if ctx is not None:
        use_identity(ctx, load_identity(curve_key))
    else:
        load_identity(curve_key)
    return ring
