"""Where a write session's chunks go: its epoch, and placements asked of the daemon (some ahead).

Shared by the replicated write path (client/striping.py) and the erasure-coded
one (client/ec_path.py). A write session takes one epoch (AllocEpochReq) for
all its chunk versions; a chunk without nodes gets a placement
(AllocChunksReq), and a file growing chunk by chunk gets the next ones in the
same round trip (``alloc_indices``).

Chunks move while files are open
--------------------------------
The chunk map of an open file is the daemon's as of the open (or of this
mount's own writes). The daemon moves copies meanwhile: repair (a node down,
a bad copy), drain, and rebalance of files nobody holds open (daemon/repair.py:
copy, switch, then delete the old copy). So the map can name nodes that no
longer hold a chunk. The rule, for every path that writes to a chunk's
replicas (client/striping.py: writes and the cut of a truncate; reads follow
the same rule in ``DataPath._read_chunk_from_nodes``): when no node of the
map took a request, or one answered STALE (its copy may have been moved away
and deleted), ask the daemon where the chunk is now (``refresh``, one
OpenReq) and send the request to the nodes of the current placement not tried
yet, once, within the operation's deadline. From then on the current
placement counts: nodes it no longer names drop out (the daemon deletes their
copies), so a writer never puts a copy back on a drained node; only if none
of its nodes took the request do the old ones that did stay (they hold the
data; the commit names them). Only for a chunk this write session has not
written yet: its map is the committed one, and any current copy is at least
that version. A chunk the session did write lives only on the nodes that took
those writes (a copy made meanwhile holds part of the session at best, under
the same version), so if none of them takes the next range, the session
fails as before.

A replicated chunk whose known nodes are fewer than its copies (a truncate or
fsync that one replica missed, a placement made with too few nodes up) is
looked up again at its first write of a session (``placement``, once per
session): else the session writes only the copies it knows, its commit names
only those, and the copy repair added meanwhile is dropped as stale, leaving
the chunk short again after every session.
"""

from __future__ import annotations

import logging

from ..common import protocol as p
from ..common.errors import StripefsError
from ..common.layout import is_ec, parse_redundancy
from .data_rpc import NodePool
from .meta_rpc import MetaClient
from .open_files import OpenFile

log = logging.getLogger(__name__)

#: chunks placed ahead of a sequential writer in one AllocChunksReq (alloc_indices)
ALLOC_AHEAD = 16


async def session_epoch(meta: MetaClient, of: OpenFile) -> int:
    """The epoch of ``of``'s write session, asked of the daemon at its first send (a pair)."""
    if not of.epoch:
        of.epoch = await fresh_epoch(meta, of)
    return of.epoch


async def fresh_epoch(meta: MetaClient, of: OpenFile) -> int:
    """A fresh epoch (a pair where the daemon gives one) outside the session's: a truncate's cut."""
    rsp = await meta.call(p.AllocEpochReq(pair=True))
    took_pair(of, rsp.epoch, rsp.pair)
    return rsp.epoch


def took_pair(of: OpenFile, epoch: int, pair: bool) -> None:
    """``epoch`` came with ``epoch + 1`` (EpochRsp.pair, OpenRsp.epoch_pair): a chunk whose
    committed version has ``epoch``'s parity takes ``epoch + 1`` (``slot_version``), no request."""
    if pair:
        _keep_slot(of, (epoch, epoch & 1), epoch + 1)


def _keep_slot(of: OpenFile, key: tuple[int, int], epoch: int) -> int:
    """``epoch`` is the slot version for ``key`` (session epoch, committed parity) from now on;
    ``of.slot_epochs`` stays small (older sessions' entries go)."""
    if len(of.slot_epochs) > 8:
        of.slot_epochs.clear()
    of.slot_epochs[key] = epoch
    return epoch


async def slot_version(meta: MetaClient, of: OpenFile, epoch: int, committed: int) -> int:
    """The version a new version of a chunk whose committed version is ``committed`` gets.

    Newer than the committed one (else the daemon keeps that one and the write is lost) and of
    the other parity, so that it goes to the other slot and the committed copies stay as they
    are until the commit (common/layout.py "Slots"): ``epoch`` (this session's) when it is
    such; else the other number of its pair (``took_pair``); else a fresh epoch of the other
    parity, asked once per session and parity (a pair: one request)."""
    if not committed or ((epoch & 1) != (committed & 1) and epoch > committed):
        return epoch
    key = (epoch, committed & 1)
    other = of.slot_epochs.get(key)
    while other is None or other <= committed:
        rsp = await meta.call(p.AllocEpochReq(pair=True))
        for candidate in (rsp.epoch, rsp.epoch + 1) if rsp.pair else (rsp.epoch,):
            if (candidate & 1) != (committed & 1):
                other = _keep_slot(of, key, candidate)
    return other


def is_cold(ref: p.ChunkRef | None) -> bool:
    """A chunk whose data is in a tier (docs/tiering.md): written, on no storage node."""
    return ref is not None and ref.version > 0 and not ref.nodes


async def recall(meta: MetaClient, nodes: NodePool, of: OpenFile, indices: list[int]) -> None:
    """Bring cold chunks of ``of`` back onto storage nodes (TierRecallReq: the daemon moves them)
    and take their new placements. An unreachable bucket raises IO (EIO)."""
    rsp = await meta.call(p.TierRecallReq(ino=of.ino, indices=sorted(set(indices))))
    nodes.learn(rsp.nodes)
    for c in rsp.chunks:
        now = of.chunks.get(c.index)
        if now is None or is_cold(now) or now.version == c.version:
            of.chunks[c.index] = c


async def placement(meta: MetaClient, nodes: NodePool, of: OpenFile, index: int) -> p.ChunkRef:
    """Chunk ``index`` of ``of`` with its nodes: the file's own, or a new placement (and some ahead).
    A cold chunk is recalled first: a write merges into its content."""
    ref = of.uncommitted.get(index) or of.chunks.get(index)
    if is_cold(ref) and index not in of.uncommitted:
        await recall(meta, nodes, of, [index])
        ref = of.chunks.get(index)
    if ref is not None and index not in of.uncommitted and of.placements_checked != of.epoch and _short(of, ref):
        try:
            await refresh(meta, nodes, of)  # repair may have restored its copies meanwhile
        except StripefsError as exc:  # the copies we know still take the write
            log.info("inode %d: asking for its current chunk placements failed: %s", of.ino, exc)
        ref = of.uncommitted.get(index) or of.chunks.get(index)
    if ref is None or not ref.nodes:
        indices = alloc_indices(of, index)
        rsp = await meta.call(p.AllocChunksReq(ino=of.ino, indices=indices))
        nodes.learn(rsp.nodes)
        for c in rsp.chunks:
            # only where the file still has no placement: a chunk placed ahead here may have
            # been placed, written and recorded by another send during the round trip, and
            # its bare placement would hide that version from reads (a hole) until the commit
            now = of.uncommitted.get(c.index) or of.chunks.get(c.index)
            if now is None or not now.nodes:
                of.chunks[c.index] = c
                if c.index != index:
                    of.place_ahead(c.index)  # released by flush if not written (_release_unused)
        ref = of.uncommitted.get(index) or of.chunks[index]
    return ref


def alloc_indices(of: OpenFile, index: int) -> list[int]:
    """The chunks to place in one AllocChunksReq when ``index`` needs a placement.

    A file growing chunk by chunk (the one before ``index`` is placed) is most
    likely written on: place the next chunks too, as many as the file already
    has before ``index`` (a small file never gets more than it holds, a growing
    one at most double), up to ``ALLOC_AHEAD``. Those not written are given back
    at the commit (``DataPath.flush`` releases them: ReleaseChunksReq).
    """
    want = [index]
    before = of.uncommitted.get(index - 1) or of.chunks.get(index - 1)
    if before is None or not before.nodes:  # not growing chunk by chunk (a new file, a sparse writer)
        return want
    for i in range(index + 1, index + 1 + min(index, ALLOC_AHEAD)):
        ref = of.uncommitted.get(i) or of.chunks.get(i)
        if ref is None or not ref.nodes:
            want.append(i)
    return want


def _short(of: OpenFile, ref: p.ChunkRef) -> bool:
    """A written replicated chunk known on fewer nodes than its copies."""
    return bool(ref.version) and not is_ec(of.layout) and len(set(ref.nodes)) < parse_redundancy(of.layout.redundancy).copies


async def refresh(meta: MetaClient, nodes: NodePool, of: OpenFile) -> None:
    """Take the daemon's current nodes for the chunks of ``of`` this write session has not written.

    Versions stay those of the map (what the session's writes are based on): a current copy
    is at least that version. Chunks the session wrote keep the nodes that took its writes."""
    rsp = await meta.call(p.OpenReq(ino=of.ino, session_id=meta.session_id))
    nodes.learn(rsp.nodes)
    of.placements_checked = of.epoch
    for now in rsp.chunks:
        mine = of.chunks.get(now.index)
        if mine is None or now.index in of.uncommitted or not now.nodes or now.version < mine.version:
            continue
        if list(now.nodes) != list(mine.nodes):
            of.chunks[now.index] = p.ChunkRef(index=now.index, version=mine.version, nodes=list(now.nodes), fversions=mine.fversions)


async def current(meta: MetaClient, nodes: NodePool, ino: int, index: int) -> p.ChunkRef | None:
    """Chunk ``index`` of ``ino`` as the daemon has it now (a reader's question: nothing of an open
    file changes); None when it has none or could not be asked."""
    try:
        rsp = await meta.call(p.OpenReq(ino=ino, session_id=meta.session_id))
    except StripefsError as exc:
        log.debug("chunk %d:%d: asking where it is now failed: %s", ino, index, exc)
        return None
    nodes.learn(rsp.nodes)
    return next((c for c in rsp.chunks if c.index == index), None)


async def moved(meta: MetaClient, nodes: NodePool, of: OpenFile, ref: p.ChunkRef) -> p.ChunkRef | None:
    """Chunk ``ref`` (committed, as this session's writes are based on it) where the daemon has it now,
    when that names nodes ``ref`` does not; else None (also when the daemon could not be asked)."""
    try:
        await refresh(meta, nodes, of)
    except StripefsError as exc:
        log.info("chunk %d:%d: asking where it is now failed: %s", of.ino, ref.index, exc)
        return None
    now = of.chunks.get(ref.index)
    if now is None or set(now.nodes) <= set(ref.nodes):
        return None
    log.info("chunk %d:%d: moved from nodes %s to %s since the file was opened", of.ino, ref.index, ref.nodes, now.nodes)
    return now
