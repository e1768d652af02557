"""Where a write session's chunks go: its epoch, and placements asked of the daemon (some ahead).

Shared by the replicated write path (client/striping.py) and the erasure-coded
one (client/ec_path.py). A write session takes one epoch (AllocEpochReq) for
all its chunk versions; a chunk without nodes gets a placement
(AllocChunksReq), and a file growing chunk by chunk gets the next ones in the
same round trip (``alloc_indices``).
"""

from __future__ import annotations

from ..common import protocol as p
from .data_rpc import NodePool
from .meta_rpc import MetaClient
from .open_files import OpenFile

#: chunks placed ahead of a sequential writer in one AllocChunksReq (alloc_indices)
ALLOC_AHEAD = 16


async def session_epoch(meta: MetaClient, of: OpenFile) -> int:
    """The epoch of ``of``'s write session, asked of the daemon at its first send."""
    if not of.epoch:
        rsp = await meta.call(p.AllocEpochReq())
        of.epoch = rsp.epoch
    return of.epoch


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
                    of.placed_ahead.add(c.index)  # released by flush if not written (_release_unused)
        ref = of.uncommitted.get(index) or of.chunks[index]
    return ref


def alloc_indices(of: OpenFile, index: int) -> list[int]:
    """The chunks to place in one AllocChunksReq when ``index`` needs a placement.

    A file growing chunk by chunk (the one before ``index`` is placed) is most
    likely written on: place the next chunks too, as many as the file already
    has before ``index`` (a small file never gets more than it holds, a growing
    one at most double), up to ``ALLOC_AHEAD``. Those not written are given back
    at the commit (``DataPath._release_unused``, ReleaseChunksReq).
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
