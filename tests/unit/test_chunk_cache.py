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


async def test_keep_from_a_worker_thread_stores_unless_held_or_being_loaded():
    """ChunkCache.keep: what the cold-read threads store themselves (client/thread_reads.py), from
    another thread, without a callback on the trio thread; a trio load in flight stores its own."""
    cache = ChunkCache(1 << 20)
    release = trio.Event()

    async def trio_bytes():
        await release.wait()
        return b"trio"

    async def read():
        await cache.fetch((1, 0, 1), trio_bytes)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(read)
        await trio.testing.wait_all_tasks_blocked()
        kept = await trio.to_thread.run_sync(lambda: [cache.keep((1, 0, 1), b"thread"), cache.keep((2, 0, 1), b"two", ahead=True)])
        release.set()
    assert kept == [False, True]
    assert cache.get((1, 0, 1)) == b"trio" and cache.peek((2, 0, 1)) == b"two"
    assert not cache.keep((2, 0, 1), b"again")  # held: left as it is
    assert (2, 0, 1) in cache._prefetched  # fetched ahead, not read yet ...
    assert cache.touch((2, 0, 1)) and (2, 0, 1) not in cache._prefetched  # ... until a read touches it
    assert not cache.touch((3, 0, 1))


def test_many_threads_keeping_and_a_drop_leave_the_accounting_exact():
    import threading

    cache = ChunkCache(64 * 1000)  # room for 64 chunks of 1,000 bytes: keeps evict

    def work(t):
        for i in range(2000):
            cache.keep((t, i, 1), bytes(1000))
            cache.touch((t, i // 2, 1))

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for _ in range(200):
        cache.drop_inode(1)
    for th in threads:
        th.join()
    assert cache.used == sum(len(v) for v in cache._entries.values()) <= cache.budget
    assert {k for keys in cache._by_ino.values() for k in keys} == set(cache._entries)


async def test_release_lets_go_of_held_chunks_and_leaves_a_load_in_flight_alone():
    """ChunkCache.release (the prefetcher's chunks once the kernel's page cache holds them): the held
    keys go and their bytes leave the budget; a load in flight of a released key still stores what it
    brings (a release is not a change of the chunk: nothing is stale)."""
    cache = ChunkCache(1 << 20)
    cache.put((1, 0, 3), b"a" * 100)
    cache.put((2, 0, 3), b"b" * 50)
    release = trio.Event()

    async def later():
        await release.wait()
        return b"c" * 10

    async with trio.open_nursery() as nursery:
        nursery.start_soon(cache.fetch, (3, 0, 3), later)
        await trio.testing.wait_all_tasks_blocked()
        assert cache.release([(1, 0, 3), (3, 0, 3), (9, 0, 1)]) == 1
        release.set()
    assert cache.peek((1, 0, 3)) is None and cache.peek((2, 0, 3)) == b"b" * 50
    assert cache.peek((3, 0, 3)) == b"c" * 10
    assert cache.used == 60
    cache.drop_inode(1)  # its index no longer names the released key
