"""A READ of a chunk the prefetcher's batch is fetching (issue 29, docs/design.md "The prefetched
cold epoch", fifth pass): it waits for the batch's bytes rather than loading the chunk again from a
node, loads it itself when the batch fails, and never takes bytes the batch brought back across a
change of the chunk.

A real metadata daemon process and real storage nodes over ZeroMQ (test_data_path.Rig); the batch
is ``DataPath.fetch(..., node=N)`` as client/prefetch.py sends it, held at the node's door until
the READ has started, so the race is the same every run. The READ's own loads are counted at
``DataPath._read_chunk`` (what a READ that misses the chunk cache sends to a node).
"""

from __future__ import annotations

import trio
import trio.testing

from stripefs.client.fetch import Fetch
from stripefs.client.open_files import OpenFile
from stripefs.common import protocol as P
from stripefs.common.errors import ErrorCode, StripefsError
from test_data_path import rig  # noqa: F401 (the fixture)

BODY = b"sample-bytes " * 700


async def _file(rig, name: bytes):
    """A committed one-chunk file, as the prefetcher resolves it (OpenRsp) and a READ opens it (OpenFile)."""
    of = await rig.create(name)
    await rig.data.write(of, 0, BODY)
    await rig.data.flush(of)
    info = await rig.meta.call(P.OpenReq(ino=of.ino, session_id=rig.meta.session_id))
    rig.data.nodes.learn(info.nodes)
    return info, OpenFile(of.ino, info.attr, info.layout, {c.index: c for c in info.chunks})


class Held:
    """The batch's ReadChunksReq held until ``go``; then sent (or failed, ``fail``). The READ's own
    loads counted."""

    def __init__(self, rig, *, fail: bool = False, before_send=None, old: bytes | None = None):
        self.go = trio.Event()
        self.sent = trio.Event()
        self.own_loads = 0
        read_many, read_chunk = rig.data.nodes.read_many, rig.data._read_chunk

        async def held_read_many(node_id, reads):
            await self.go.wait()
            if before_send is not None:
                before_send()
            self.sent.set()
            if fail:
                raise StripefsError(ErrorCode.TIMEOUT, "the batch's node did not answer (test)")
            results = await read_many(node_id, reads)
            return results if old is None else [memoryview(old)] * len(results)

        async def counted_read_chunk(*args, **kwargs):
            self.own_loads += 1
            return await read_chunk(*args, **kwargs)

        rig.data.nodes.read_many = held_read_many
        rig.data._read_chunk = counted_read_chunk


async def _race(rig, info, of, held: Held) -> tuple[bytes, list]:
    """The batch started, then a READ of the whole file while it is in flight; the batch let go once
    the READ has done all it does before it waits. (the READ's bytes, the batch's results)"""
    node = rig.data.nodes.order(info.chunks[0].nodes, start=info.attr.ino)[0]
    got: dict = {}

    async def batch():
        got["batch"] = await rig.data.fetch([Fetch.small_file(info)], node=node)

    async def read():
        got["read"] = bytes(await rig.data.read(of, 0, of.size))

    async with trio.open_nursery() as n:
        n.start_soon(batch)
        await trio.testing.wait_all_tasks_blocked(0.01)
        n.start_soon(read)
        await trio.testing.wait_all_tasks_blocked(0.05)
        held.go.set()
    return got["read"], got["batch"]


async def test_a_read_during_the_prefetch_batch_waits_for_its_bytes(rig):
    info, of = await _file(rig, b"raced")
    key = (info.attr.ino, 0, info.chunks[0].version)
    held = Held(rig)
    data, results = await _race(rig, info, of, held)
    assert data == BODY
    assert bytes(results[0][: len(BODY)]) == BODY
    assert held.own_loads == 0  # one load of the chunk, the batch's (main: the READ sent its own too)
    assert rig.data.cache.peek(key) is not None and not rig.data.cache.loading(key)


async def test_a_read_loads_the_chunk_itself_when_the_batch_fails(rig):
    info, of = await _file(rig, b"failed")
    key = (info.attr.ino, 0, info.chunks[0].version)
    held = Held(rig, fail=True)
    data, results = await _race(rig, info, of, held)
    assert isinstance(results[0], StripefsError)
    assert data == BODY
    assert held.own_loads == 1
    assert not rig.data.cache.loading(key)


async def test_bytes_the_batch_brings_back_across_a_change_never_serve(rig):
    """The chunk changes while the batch is in flight (``drop_inode``: an uncommitted rewrite at the
    same version). What the batch brings back (here: other bytes, as a copy from before the change
    would be) is not stored, and the waiting READ loads again."""
    info, of = await _file(rig, b"changed")
    key = (info.attr.ino, 0, info.chunks[0].version)
    held = Held(rig, before_send=lambda: rig.data.cache.drop_inode(info.attr.ino), old=b"o" * len(BODY))
    data, _ = await _race(rig, info, of, held)
    assert data == BODY
    assert held.own_loads == 1  # the READ's own load after the change (the batch's bytes not taken)
    assert not rig.data.cache.loading(key)
