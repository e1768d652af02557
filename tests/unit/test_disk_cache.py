"""The local disk cache: checksummed entries, LRU within a byte cap, kept across remounts."""

import os

import pytest
import trio

from stripefs.client.disk_cache import BLOCK, DiskCache, decode, encode


def _fill(cache, key, data):
    async def run():
        async with trio.open_nursery() as nursery:
            cache.put_soon(nursery, key, data)
    trio.run(run)


def test_entries_round_trip_and_every_check_catches_damage():
    data = os.urandom(3 * BLOCK + 17)
    raw = b"".join(bytes(p) for p in encode((5, 2, 99), data))
    assert bytes(decode((5, 2, 99), raw)) == data
    with pytest.raises(ValueError, match="not"):
        decode((5, 2, 100), raw)  # another version's entry is never returned
    for pos in (3, 40, 60, len(raw) - 1, len(raw) - BLOCK - 5):
        bad = bytearray(raw)
        bad[pos] ^= 0x40
        with pytest.raises(ValueError):
            decode((5, 2, 99), bytes(bad))
    with pytest.raises(ValueError):
        decode((5, 2, 99), raw[:-1])


def test_hits_survive_a_new_instance_and_corruption_is_a_miss(tmp_path):
    cache = DiskCache(tmp_path, "cluster-a", capacity=1 << 30, min_free=0)
    cache.scan()
    data = os.urandom(200_000)
    _fill(cache, (1, 0, 7), data)
    assert bytes(trio.run(cache.get, (1, 0, 7))) == data
    assert trio.run(cache.get, (1, 0, 8)) is None  # a newer version is a miss

    again = DiskCache(tmp_path, "cluster-a", capacity=1 << 30, min_free=0)  # a remount
    again.scan()
    assert bytes(trio.run(again.get, (1, 0, 7))) == data
    other = DiskCache(tmp_path, "cluster-b", capacity=1 << 30, min_free=0)  # another cluster shares nothing
    other.scan()
    assert trio.run(other.get, (1, 0, 7)) is None

    path = again._path((1, 0, 7))
    raw = bytearray(path.read_bytes())
    raw[-100] ^= 1
    path.write_bytes(raw)
    assert trio.run(again.get, (1, 0, 7)) is None
    assert not path.exists() and again.used == 0


def test_least_recently_used_entries_go_first_within_the_cap(tmp_path):
    size = 100_000
    cache = DiskCache(tmp_path, "c", capacity=3 * size + 3000, min_free=0)
    cache.scan()
    for i in range(3):
        _fill(cache, (i, 0, 1), os.urandom(size))
    assert trio.run(cache.get, (0, 0, 1)) is not None  # 0 is now the most recent
    _fill(cache, (3, 0, 1), os.urandom(size))
    assert trio.run(cache.get, (1, 0, 1)) is None  # the least recently used went
    for key in ((0, 0, 1), (2, 0, 1), (3, 0, 1)):
        assert trio.run(cache.get, key) is not None
    assert cache.used <= cache.capacity


def test_free_space_floor_stops_filling(tmp_path):
    st = os.statvfs(tmp_path)
    cache = DiskCache(tmp_path, "c", capacity=1 << 40, min_free=st.f_bavail * st.f_frsize + (1 << 30))
    cache.scan()
    _fill(cache, (1, 0, 1), b"x" * 1000)
    assert trio.run(cache.get, (1, 0, 1)) is None and cache.used == 0

