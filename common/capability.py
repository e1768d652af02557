"""Per-file capabilities: the metadata daemon's signed word that a key may read (or write) one inode.

Why
---
Storage nodes know nothing of the namespace. A client key restricted to a
subtree (keyring ``subdir``) is held inside it by the metadata daemon, but a
hostile holder could send ReadChunkReq/WriteChunkReq straight to a storage
node with a guessed chunk id ``(inode, index)``. So for such keys the daemon
signs, in every reply that hands out chunk locations (``OpenRsp.cap``,
``ChunksRsp.cap``, and through them lookups with open info, readdir with open
info, LookupPathsRsp, alloc and replace replica), a ``Cap``::

    Cap(ino, write, expires, key, mac)
    mac = BLAKE2b-128(key=secret, person="stripefs-cap-v1", "ino:write:expires:key")

and storage nodes refuse every chunk read, write, sync and stat of such a key
(ACCESS) unless the request carries a Cap that verifies under the secret, is
not expired, names the chunk's inode, was issued to the very key sending the
request (the CURVE key ZAP authenticated), and grants writing when the
request writes. The same design as Ceph's cephx capabilities or Lustre's
capabilities, scaled down: one shared secret, one right per inode.

Who needs one: only subtree-restricted client/admin keys. Unrestricted keys
(read-only ones included: their writes are refused at the nodes anyway, and
they may read everything), storage keys (repair copies) and the daemon send
none and the nodes check none; a cluster without CURVE has no keys and checks
nothing (a subtree there is a convenience, not a security boundary).

The secret
----------
A file of lines of 64 hex characters (32 random bytes), mode 0600, named by
``cap_secret`` in metad.toml and every storage.toml (``stripefs cap-secret
PATH`` writes one; ``local up --secure`` puts it in STATE/keys/). Daemons sign
with the first line; nodes accept a Cap signed with any line. Rotation
(``stripefs cap-secret PATH --rotate``) puts a new secret first and keeps the
previous one second: install it on the nodes first, then on the daemons; after
``cap_ttl_s`` no Cap signed with the old secret is alive, and ``--retire``
drops it. The file is re-read when it changes (no restart), like the keyring.

Costs: a MAC is about a microsecond; unrestricted keys pay nothing (no Cap in
their requests, no check). Expiry is wall-clock seconds: the daemons' and
nodes' clocks must agree to well within ``cap_ttl_s`` (NTP). A mount keeps
its Caps per inode and asks for fresh ones (``CapsReq``) when one is within a
quarter of its lifetime (at most a minute) of expiring, or once when a node
refuses a request with ACCESS.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import time
from pathlib import Path

from .errors import QuietError
from .protocol import Cap

log = logging.getLogger(__name__)

_PERSON = b"stripefs-cap-v1"
SECRET_BYTES = 32


def mac(secret: bytes, ino: int, write: bool, expires: int, key: str) -> bytes:
    text = b"%d:%d:%d:%s" % (ino, 1 if write else 0, expires, key.encode("ascii", "replace"))
    return hashlib.blake2b(text, key=secret, digest_size=16, person=_PERSON).digest()


def parse_secrets(text: str, source: str) -> list[bytes]:
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        try:
            value = bytes.fromhex(line)
        except ValueError:
            value = b""
        if len(value) != SECRET_BYTES:
            raise QuietError(f"{source}: line {n} is not {2 * SECRET_BYTES} hex characters (write one with 'stripefs cap-secret PATH')")
        out.append(value)
    if not out:
        raise QuietError(f"{source} holds no secret (write one with 'stripefs cap-secret PATH')")
    return out


class Capabilities:
    """The cluster's capability secret(s): ``issue`` (daemons) and ``verify`` (storage nodes)."""

    def __init__(self, path: str | Path, ttl_s: float = 3600.0, *, recheck_s: float = 1.0):
        self.path = Path(path)
        self.ttl_s = ttl_s
        self.recheck_s = recheck_s  # look at the file's stamp at most this often (not on every chunk)
        self._checked = float("-inf")
        self._stamp: tuple[int, int] | None = None
        self._secrets: list[bytes] = []
        self._load()

    def _load(self) -> None:
        now = time.monotonic()
        if now - self._checked < self.recheck_s:
            return
        self._checked = now
        stamp = None
        try:
            st = self.path.stat()
            stamp = (st.st_mtime_ns, st.st_size)
            if stamp == self._stamp:
                return
            if st.st_mode & 0o077:
                raise QuietError(f"it is readable by others (mode {st.st_mode & 0o777:o}); chmod 600 {self.path}")
            found = parse_secrets(self.path.read_text(), str(self.path))
        except (OSError, UnicodeDecodeError, QuietError) as exc:
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            if self._stamp is None:
                raise QuietError(f"cannot use capability secret {self.path}: {why}") from None
            if stamp != self._stamp:  # once per change of the file, not on every request
                log.error("capability secret %s unusable (keeping the secrets read before): %s", self.path, why)
                self._stamp = stamp or self._stamp
            return
        if self._stamp is not None:
            log.info("capability secret %s re-read: %d secret(s)", self.path, len(found))
        self._secrets, self._stamp = found, stamp

    def issue(self, ino: int, write: bool, key: str, *, now: float | None = None) -> Cap:
        self._load()
        expires = int((time.time() if now is None else now) + self.ttl_s)
        return Cap(ino=ino, write=write, expires=expires, key=key, mac=mac(self._secrets[0], ino, write, expires, key))

    def verify(self, cap: Cap | None, ino: int, write: bool, key: str, *, now: float | None = None) -> str | None:
        """None when ``cap`` lets ``key`` read (``write``: and write) ``ino`` now; else why not."""
        if cap is None:
            return "no capability (ask the metadata daemon: open the file)"
        if cap.ino != ino:
            return f"the capability is for inode {cap.ino}, not {ino}"
        if cap.key != key:
            return "the capability was issued to another key"
        if write and not cap.write:
            return "the capability allows reading only"
        if cap.expires < (time.time() if now is None else now):
            return "the capability has expired"
        self._load()
        for secret in self._secrets:
            if hmac.compare_digest(mac(secret, cap.ino, cap.write, cap.expires, cap.key), cap.mac):
                return None
        return "the capability's signature is not valid"


def load(path: str, ttl_s: float = 3600.0) -> Capabilities | None:
    return Capabilities(path, ttl_s) if path else None


def write_secret(path: str | Path, *, rotate: bool = False, retire: bool = False, force: bool = False) -> list[str]:
    """Create (or rotate / retire in) a capability secret file, mode 0600; returns its lines."""
    path = Path(path)
    old: list[str] = []
    if path.exists():
        old = [s.hex() for s in parse_secrets(path.read_text(), str(path))]
        if not (rotate or retire or force):
            raise QuietError(f"{path} exists: --rotate adds a new secret (keeping the previous one), --retire drops old ones, --force replaces it")
    if retire:
        if not old:
            raise QuietError(f"{path} does not exist: nothing to retire")
        lines = old[:1]
    elif rotate:
        lines = [secrets.token_hex(SECRET_BYTES)] + old[:1]
    else:
        lines = [secrets.token_hex(SECRET_BYTES)]
    text = "# stripefs capability secret(s): daemons sign with the first, nodes accept any (docs/security.md)\n"
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(fd, 0o600)
        f.write(text + "\n".join(lines) + "\n")
    os.replace(tmp, path)
    return lines
