"""Large chunk files written with O_DIRECT (storage_node/direct_io.py), and the chunk store's
directory fsyncs deferred to the next sync."""

import ctypes
import errno
import logging
import mmap
import os
import random

import pytest

from stripefs.common.protocol import ChunkId
from stripefs.storage_node.chunk_store import HEADER_SIZE, ChunkStore
from stripefs.storage_node.direct_io import ALIGN, DirectWriter, round_up
from test_chunk_store import kill_9_while_rewriting

MiB = 1 << 20
BS = 64 << 10


def _pattern(n, seed=0):
    return random.Random(seed).randbytes(n)


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
_MAP_FAILED = ctypes.c_void_p(-1).value


def _cached(path) -> bool:
    """Whether the first page of ``path`` is in the page cache: mincore(2) of a mapping, which reads
    nothing. (Not a read with RWF_NOWAIT: one that misses starts readahead, and on a busy machine
    it could find the very pages its readahead had just read: ~1 in 600 under -n 4.)"""
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = _libc.mmap(None, mmap.PAGESIZE, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr == _MAP_FAILED:
            raise OSError(ctypes.get_errno(), "mmap failed")
        try:
            vec = (ctypes.c_ubyte * 1)()
            if _libc.mincore(addr, mmap.PAGESIZE, vec):
                raise OSError(ctypes.get_errno(), "mincore failed")
            return bool(vec[0] & 1)
        finally:
            _libc.munmap(addr, mmap.PAGESIZE)
    finally:
        os.close(fd)


@pytest.fixture
def writer(tmp_path):
    w = DirectWriter()
    fd = w.write_file(tmp_path / "probe", [b"x" * ALIGN])
    if fd is None:
        pytest.skip(f"the file system of {tmp_path} refuses O_DIRECT")
    os.close(fd)
    return w


def test_round_up():
    assert round_up(0) == 0
    assert round_up(1) == ALIGN
    assert round_up(ALIGN) == ALIGN
    assert round_up(ALIGN + 1) == 2 * ALIGN


@pytest.mark.parametrize("sizes", [[64, 8 * 64, MiB], [MiB + 1], [3, 5, 2 * MiB + 4093], [ALIGN]])
def test_write_file_holds_exactly_the_parts(writer, tmp_path, sizes):
    parts = [_pattern(n, seed=i) for i, n in enumerate(sizes)]
    path = tmp_path / "f"
    fd = writer.write_file(path, [parts[0], memoryview(parts[1]) if len(parts) > 1 else b"", *parts[2:]])
    os.close(fd)
    assert path.read_bytes() == b"".join(parts)
    assert os.path.getsize(path) == sum(sizes)


def test_buffers_are_reused_and_bounded(writer, tmp_path):
    w = DirectWriter(pool_max=2)
    os.close(w.write_file(tmp_path / "a", [_pattern(2 * MiB)]))
    (first,) = w._pool
    os.close(w.write_file(tmp_path / "b", [_pattern(MiB + 5)]))  # fits: the same buffer again
    assert w._pool == [first]
    for i, n in enumerate([3 * MiB, MiB, 5 * MiB, MiB + 1]):
        os.close(w.write_file(tmp_path / f"f{i}", [_pattern(n, seed=i)]))
        assert (tmp_path / f"f{i}").read_bytes() == _pattern(n, seed=i)
        assert 1 <= len(w._pool) <= 2
    assert max(len(b) for b in w._pool) == 5 * MiB  # the larger ones are kept


def test_a_file_system_refusing_o_direct_turns_it_off(tmp_path, monkeypatch, caplog):
    real_open = os.open

    def no_direct(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", no_direct)
    caplog.set_level(logging.INFO, logger="stripefs.storage_node.direct_io")
    w = DirectWriter()
    assert w.wants(2 * MiB)
    assert w.write_file(tmp_path / "f", [b"x" * (2 * MiB)]) is None
    assert not w.enabled and not w.wants(2 * MiB)
    assert not (tmp_path / "f").exists()
    assert "refuses O_DIRECT" in caplog.text
    # the chunk store then writes through the page cache, the same bytes
    (tmp_path / "store").mkdir()
    with ChunkStore(tmp_path / "store", block_size=BS, reserved_space=0) as s:
        data = _pattern(2 * MiB + 3)
        assert s.write(ChunkId(1, 0), 4, 0, 0, data) == (4, len(data))
        assert not s._direct.enabled
        assert s.read(ChunkId(1, 0), 4, 0, 4 * MiB) == (4, data)


@pytest.mark.warm_caches  # asserts the small chunk is in the page cache: no drop_caches() elsewhere meanwhile
def test_large_chunks_bypass_the_page_cache_small_ones_do_not(writer, tmp_path):
    with ChunkStore(tmp_path, block_size=BS, reserved_space=0) as s:
        big, small = ChunkId(5, 0), ChunkId(5, 1)
        data = _pattern(4 * MiB)
        assert s.write(big, 9, 0, 0, data) == (9, len(data))
        s.write(small, 9, 0, 0, _pattern(100_000))
        assert not _cached(s.path(big)), f"the big chunk is in the page cache (O_DIRECT on: {s._direct.enabled})"
        assert _cached(s.path(small))
        nblocks = -(-len(data) // BS)
        assert os.path.getsize(s.path(big)) == HEADER_SIZE + 8 * nblocks + len(data)
        assert s.read(big, 9, 0, 4 * MiB) == (9, data)
        assert s.verify(big) == len(data)
        # a partial write merges with the stored copy and is written whole again
        s.write(big, 10, 9, MiB + 7, b"patch")
        assert s.read(big, 10, MiB, 16) == (10, data[MiB : MiB + 7] + b"patch" + data[MiB + 12 : MiB + 16])
        s.write(big, 11, 10, 0, b"", truncate=3 * MiB + 1)  # still large: cut exactly
        assert s.read(big, 11, 3 * MiB - 2, 100)[1] == data[3 * MiB - 2 : 3 * MiB + 1]
        assert s.verify(big) == 3 * MiB + 1
        assert s.usage().used_bytes == os.path.getsize(s.path(big)) + os.path.getsize(s.path(small))


def test_kill_9_during_direct_writes_leaves_old_or_new_content(writer, tmp_path):
    ready = kill_9_while_rewriting(tmp_path, [[(65, 1_500_000)], [(66, 1_200_000), (67, 1_100_000)]],
                                   block_size=65536, kills=6, max_pause_s=0.05, seed=2)
    assert ready == {b"writing True\n"}


def test_new_directories_are_made_durable_by_the_next_sync(tmp_path, monkeypatch):
    synced_dirs = []
    real = os.fsync

    def fsync(fd):
        path = os.readlink(f"/proc/self/fd/{fd}")
        if os.path.isdir(path):
            synced_dirs.append(path)
        return real(fd)

    with ChunkStore(tmp_path, block_size=BS, reserved_space=0) as s:
        monkeypatch.setattr(os, "fsync", fsync)
        a, b = ChunkId(7, 0), ChunkId(7, 1)
        s.write(a, 1, 0, 0, b"data")  # no sync: its new directories' entries wait
        fanout = s.path(a).parent
        assert synced_dirs == []
        assert s.sync([a]) == 1
        # the chunk's directory, the fan-out directory's parent and the chunks directory
        assert {str(fanout), str(fanout.parent), str(fanout.parent.parent)} <= set(synced_dirs)
        synced_dirs.clear()
        assert s.sync([a]) == 1
        assert synced_dirs == [str(fanout)]  # nothing left over
        synced_dirs.clear()
        s.write(b, 1, 0, 0, b"data", sync=True)  # a sync write makes its directories durable at once
        fanout_b = s.path(b).parent
        if fanout_b != fanout:
            assert str(fanout_b.parent) in synced_dirs
        assert str(fanout_b) in synced_dirs
        synced_dirs.clear()
        assert s.sync([]) == 0 and synced_dirs == []
