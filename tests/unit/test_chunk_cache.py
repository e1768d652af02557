"""The mount's chunk cache (client/chunk_cache.py): a load in flight across a change is not kept."""

import trio
import trio.testing

from stripefs.client.chunk_cache import ChunkCache

KEY = (5, 0, 7)  # (ino, index, version): an uncommitted version, rewritten in place by its session


async def test_a_load_in_flight_across_a_change_is_given_to_its_reader_and_not_stored():
    cache = ChunkCache(1 << 20)
    release = trio.Event()
    got = {}

    async def old_bytes():
        await release.wait()
        return b"old"

    async def new_bytes():
        return b"new"

    async def read(name, load):
        got[name] = await cache.fetch(KEY, load)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(read, "before", old_bytes)
        await trio.testing.wait_all_tasks_blocked()
        cache.drop_chunk(5, 0)  # the session rewrote chunk 0 at the same version
        nursery.start_soon(read, "after", new_bytes)  # a read that began after the change: waits, then loads again
        await trio.testing.wait_all_tasks_blocked()
        release.set()
    assert got == {"before": b"old", "after": b"new"}
    assert cache.get(KEY) == b"new"


async def test_a_drop_of_other_chunks_leaves_a_load_alone():
    cache = ChunkCache(1 << 20)
    release = trio.Event()

    async def load():
        await release.wait()
        return b"kept"

    async with trio.open_nursery() as nursery:
        nursery.start_soon(cache.fetch, KEY, load)
        await trio.testing.wait_all_tasks_blocked()
        cache.drop_inode(5, 1)  # chunks 1.. of the same file
        cache.drop_chunk(6, 0)  # another file
        release.set()
    assert cache.get(KEY) == b"kept"


def test_drop_inode_forgets_a_range_of_chunks():
    cache = ChunkCache(1 << 20)
    for index in range(5):
        cache.put((5, index, 1), b"x")
    cache.put((5, 2, 1, 3), b"fragment")  # an EC fragment of chunk 2
    cache.drop_inode(5, 1, 3)
    assert [k for k in [(5, i, 1) for i in range(5)] if cache.get(k)] == [(5, 0, 1), (5, 3, 1), (5, 4, 1)]
    assert cache.get((5, 2, 1, 3)) is None
    assert cache.used == 3
