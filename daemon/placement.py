"""Chunk placement: which storage nodes hold each chunk. Pure functions.

Rules, in order of importance:

1. A chunk's ``copies`` (R replicas, or K+M fragments) go to distinct nodes
   that are up, and to distinct ``host`` labels (failure domains) while
   enough hosts exist; past that, distinct nodes on repeated hosts.
2. Striping: the primary (first) copy of chunk ``i`` is the
   ``i % stripe_count``-th node of the file's *stripe set*, so a sequential
   reader pulls consecutive chunks from ``stripe_count`` nodes at once.
3. Nodes with more free space are chosen more often.

Both the stripe set and the secondaries come from *weighted rendezvous
hashing*: node n's score for a key is ``-weight / ln(u)`` with ``u`` a
uniform number hashed from (key, n), and weight its free bytes. Sorting by
score gives a random, free-space-weighted order that depends only on the key
and the node set, so placing chunk 7 today and chunk 8 tomorrow still lands
them on different stripe members, and a new node moves only its fair share.
The key of the stripe set is the file's ``stripe_seed``; of chunk i's
secondaries, (stripe_seed, i).

Fewer up nodes than copies: a chunk gets as many copies as there are nodes
(degraded; repair restores it later) and a WARNING is logged at most once a
minute. No node up: UNAVAILABLE.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from dataclasses import dataclass
from typing import Iterable, Sequence

from ..common.errors import ErrorCode, StripefsError

log = logging.getLogger(__name__)

_DEGRADED_WARNING_INTERVAL_S = 60.0
_last_degraded_warning = -math.inf


@dataclass(frozen=True)
class NodeView:
    """What placement needs to know about a storage node."""

    node_id: int
    host: str
    free_bytes: int
    up: bool = True


def _score(key: bytes, node: NodeView) -> float:
    digest = hashlib.blake2b(key + node.node_id.to_bytes(8, "little", signed=True), digest_size=8).digest()
    u = (int.from_bytes(digest, "little") + 1) / (2**64 + 2)  # in (0, 1)
    weight = max(node.free_bytes, 1)
    return -weight / math.log(u)


def _ranked(key: bytes, nodes: Sequence[NodeView]) -> list[NodeView]:
    if len(nodes) == 1:
        return list(nodes)
    return sorted(nodes, key=lambda n: (-_score(key, n), n.node_id))


def _up(nodes: Iterable[NodeView]) -> list[NodeView]:
    up = [n for n in nodes if n.up]
    if not up:
        raise StripefsError(ErrorCode.UNAVAILABLE, "no storage node is up: cannot place chunks")
    return up


def _warn_degraded(copies: int, available: int) -> None:
    global _last_degraded_warning
    now = time.monotonic()
    if now - _last_degraded_warning >= _DEGRADED_WARNING_INTERVAL_S:
        _last_degraded_warning = now
        log.warning(
            "only %d storage node(s) up for %d copies per chunk: new chunks are placed degraded", available, copies
        )


def _pick(ranked: Sequence[NodeView], chosen: list[NodeView], copies: int) -> list[NodeView]:
    """Extend ``chosen`` to ``copies`` nodes from ``ranked``: new hosts first, then any new node."""
    chosen = list(chosen)
    hosts = {n.host for n in chosen}
    ids = {n.node_id for n in chosen}
    for n in ranked:
        if len(chosen) >= copies:
            return chosen
        if n.node_id not in ids and n.host not in hosts:
            chosen.append(n)
            ids.add(n.node_id)
            hosts.add(n.host)
    for n in ranked:
        if len(chosen) >= copies:
            break
        if n.node_id not in ids:
            chosen.append(n)
            ids.add(n.node_id)
    return chosen


def stripe_set(nodes: Iterable[NodeView], stripe_count: int, stripe_seed: int) -> list[NodeView]:
    """The file's primaries, in stripe order: up to ``stripe_count`` up nodes, distinct hosts first."""
    up = _up(nodes)
    ranked = _ranked(b"stripe:%d" % stripe_seed, up)
    return _pick(ranked, [], min(stripe_count, len(up)))


def place_chunks(
    nodes: Iterable[NodeView],
    indices: Iterable[int],
    *,
    copies: int,
    stripe_count: int,
    stripe_seed: int,
) -> dict[int, list[int]]:
    """Node ids for each chunk index: ``copies`` of them (fewer when degraded), primary first."""
    up = _up(nodes)
    if len(up) < copies:
        _warn_degraded(copies, len(up))
    copies = min(copies, len(up))
    key = b"stripe:%d" % stripe_seed
    primaries: list[NodeView] = []  # stripe_set's, made only for a chunk past the first
    placement: dict[int, list[int]] = {}
    for index in indices:
        if index == 0:  # the stripe set's first member, the best ranked (_pick takes it first)
            primary = up[0] if len(up) == 1 else min(up, key=lambda n: (-_score(key, n), n.node_id))
        else:
            primaries = primaries or _pick(_ranked(key, up), [], min(stripe_count, len(up)))
            primary = primaries[index % len(primaries)]
        if copies == 1:
            placement[index] = [primary.node_id]
            continue
        if copies == len(up) == 2:  # the one other node: nothing to rank
            placement[index] = [primary.node_id, next(n.node_id for n in up if n.node_id != primary.node_id)]
            continue
        ranked = _ranked(b"chunk:%d:%d" % (stripe_seed, index), up)
        placement[index] = [n.node_id for n in _pick(ranked, [primary], copies)]
    return placement


def replace_node(
    nodes: Iterable[NodeView],
    current: Sequence[int],
    failed: int,
    *,
    key: int,
) -> int:
    """A node to take over ``failed``'s copy: up, not among ``current``, a new host if possible."""
    nodes = list(nodes)
    up = [n for n in nodes if n.up and n.node_id not in current]
    if not up:
        raise StripefsError(
            ErrorCode.UNAVAILABLE, f"no other storage node is up to replace node {failed} (copies on {list(current)})"
        )
    by_id = {n.node_id: n for n in nodes if n.node_id in current and n.node_id != failed}
    keep = [by_id.get(i, NodeView(i, f"\0unknown-{i}", 0)) for i in current if i != failed]
    ranked = _ranked(b"replace:%d:%d" % (key, failed), up)
    return _pick(ranked, keep, len(keep) + 1)[-1].node_id
