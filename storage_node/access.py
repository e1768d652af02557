"""Who may send what to a storage node (the daemon's side is daemon/access.py).

With CURVE on, only keys in the node's keyring connect at all (ZAP,
common/security.py); then each request is checked against the sender's role:

========  =====================================================================
meta      everything (deletes, copies, reconstruction, verification, listing)
storage   reads only: a peer copying or reconstructing a chunk reads it here
admin     reads, writes, scrub start
client    reads and writes; a read-only client key reads only (writes: READ_ONLY)
========  =====================================================================

Storage nodes know nothing of the namespace, so a subtree key (``subdir``)
must show, with every chunk read, write, sync and stat, a capability for the
chunk's inode that the metadata daemon signed for that very key (and that
grants writing, for a write or a sync): ``check_caps``, common/capability.py.
Other keys send none and are not checked; without CURVE nothing is.
"""

from __future__ import annotations

import logging

from ..common import protocol as p
from ..common.errors import ErrorCode, StripefsError
from ..common.keyring import TRUSTED, Grant, Keyring
from ..common.security import current_peer

log = logging.getLogger(__name__)

READS = frozenset({p.PingReq, p.ReadChunkReq, p.ReadChunksReq, p.StatChunkReq, p.NodeStatsReq})
WRITES = frozenset({p.WriteChunkReq, p.WriteChunksReq, p.SyncChunksReq})
ADMIN = frozenset({p.ScrubStartReq})
META_ONLY = frozenset({p.DeleteChunksReq, p.CopyChunkReq, p.ReconstructFragmentReq, p.VerifyChunksReq, p.ListChunksReq})


def allowed(grant: Grant, kind: type) -> ErrorCode | None:
    """None when ``grant`` may send a ``kind`` request; else the error code of the refusal."""
    if grant.role == "meta" or kind in READS:
        return None
    if grant.role == "storage" or kind in META_ONLY:
        return ErrorCode.ACCESS
    if kind in ADMIN:
        return None if grant.role == "admin" else ErrorCode.ACCESS
    if kind in WRITES:
        return ErrorCode.READ_ONLY if grant.read_only else None
    return ErrorCode.ACCESS


def check(keyring: Keyring | None, body: p.Msg, node_id: int, caps=None) -> None:
    """Raise READ_ONLY or ACCESS when the request's sender may not send it."""
    peer = current_peer()
    if peer is None:
        grant = TRUSTED
    else:
        grant = keyring.grant(peer) if keyring is not None else None
        if grant is None:
            log.warning("node %d: %s from key %s refused: no longer in the keyring", node_id, type(body).__name__, peer)
            raise StripefsError(ErrorCode.ACCESS, "this key is not in the cluster's keyring")
    code = allowed(grant, type(body))
    if code is not None:
        log.warning("node %d: refused %s from key %r (role %s%s)", node_id, type(body).__name__, grant.name, grant.role,
                    ", read-only" if grant.read_only else "")
        raise StripefsError(code, f"{type(body).__name__} refused: key {grant.name!r} may not send it")
    if grant.subdir:
        check_caps(caps, grant, body, node_id)


def _needs(body: p.Msg) -> list[tuple[int, p.Cap | None, bool]]:
    """(inode, the capability shown for it, whether writing) for every chunk ``body`` touches."""
    if isinstance(body, (p.ReadChunkReq, p.StatChunkReq)):
        return [(body.chunk.ino, body.cap, False)]
    if isinstance(body, p.ReadChunksReq):
        return [(r.chunk.ino, r.cap, False) for r in body.reads]
    if isinstance(body, p.WriteChunkReq):
        return [(body.chunk.ino, body.cap, True)]
    if isinstance(body, p.WriteChunksReq):  # one uncovered write refuses the batch, as for ReadChunksReq
        return [(w.chunk.ino, w.cap, True) for w in body.writes]
    if isinstance(body, p.SyncChunksReq):
        shown = {c.ino: c for c in body.caps}
        return [(ino, shown.get(ino), True) for ino in {c.ino for c in body.chunks}]
    return []  # no chunk: ping, stats, scrub start


def check_caps(caps, grant: Grant, body: p.Msg, node_id: int) -> None:
    """ACCESS unless every chunk of a subtree key's request is covered by a valid capability of that key."""
    for ino, cap, write in _needs(body):
        why = "this node has no cap_secret, so it cannot check subtree keys" if caps is None else caps.verify(cap, ino, write, grant.public)
        if why is not None:
            log.warning("node %d: refused %s of inode %d from key %r (restricted to %s): %s", node_id, type(body).__name__,
                        ino, grant.name, grant.subdir, why)
            raise StripefsError(ErrorCode.ACCESS, f"{type(body).__name__} of inode {ino} refused: {why}")
