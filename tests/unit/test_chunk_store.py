"""ChunkStore: the chunk file format, write semantics, corruption, crash safety, space."""

import ctypes
import errno
import json
import logging
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from stripefs.common.errors import ErrorCode, QuietError, StripefsError
from stripefs.common.layout import replica_part
from stripefs.common.protocol import ChunkId
from stripefs.storage_node import chunk_file
from stripefs.storage_node import chunk_store as cs
from stripefs.storage_node.chunk_store import HEADER_SIZE, ChunkStore

BS = 4096  # small blocks: several blocks per chunk with small test data
C = ChunkId(42, 3, 0)


@pytest.fixture
def store(tmp_path):
    with ChunkStore(tmp_path, block_size=BS, reserved_space=0) as s:
        yield s


def _pattern(n, seed=0):
    return random.Random(seed).randbytes(n)


def _code(excinfo):
    return excinfo.value.code


def test_round_trip_and_ranges(store):
    data = _pattern(5 * BS + 123)
    assert store.write(C, 7, 0, 0, data) == (7, len(data))
    assert store.read(C, 7, 0, len(data)) == (7, data)
    assert store.read(C, 0, BS - 5, 10) == (7, data[BS - 5 : BS + 5])  # straddles a block boundary
    assert store.read(C, 0, len(data) - 3, 100) == (7, data[-3:])  # short past the end
    assert store.read(C, 0, len(data) + 10, 5) == (7, b"")
    assert store.stat(C) == (7, len(data))
    assert os.path.getsize(store.path(C)) == HEADER_SIZE + 8 * 6 + len(data)
    with pytest.raises(StripefsError) as e:
        store.read(ChunkId(42, 4, 0), 0, 0, 10)
    assert _code(e) == ErrorCode.NOT_FOUND
    with pytest.raises(StripefsError) as e:
        store.stat(ChunkId(42, 3, 1))
    assert _code(e) == ErrorCode.NOT_FOUND


def test_empty_chunk(store):
    assert store.write(C, 1, 0, 0, b"") == (1, 0)
    assert store.read(C, 1, 0, 100) == (1, b"")


def test_partial_overwrite_zero_fill_and_truncate(store):
    store.write(C, 1, 0, 0, b"a" * 10_000)
    assert store.write(C, 2, 1, 5_000, b"b" * 100) == (2, 10_000)
    assert store.read(C, 2, 0, 10_000)[1] == b"a" * 5_000 + b"b" * 100 + b"a" * 4_900
    # past the end: the gap reads as zeros
    assert store.write(C, 3, 2, 20_000, b"c" * 10) == (3, 20_010)
    v, d = store.read(C, 3, 9_990, 10_030)
    assert d == b"a" * 10 + bytes(10_000) + b"c" * 10
    # truncate applies after the payload: cut ...
    assert store.write(C, 4, 3, 0, b"d" * 3, truncate=6_000) == (4, 6_000)
    assert store.read(C, 4, 0, 100_000)[1] == b"ddd" + b"a" * 4_997 + b"b" * 100 + b"a" * 900
    # ... and zero-extend
    assert store.write(C, 5, 4, 0, b"", truncate=7_000) == (5, 7_000)
    assert store.read(C, 5, 5_990, 100_000)[1] == b"a" * 10 + bytes(1_000)
    # a new chunk written at an offset starts with zeros
    other = ChunkId(43, 0, 0)
    assert store.write(other, 1, 0, 100, b"x") == (1, 101)
    assert store.read(other, 1, 0, 200)[1] == bytes(100) + b"x"


def test_whole_rewrite_without_replace_keeps_nothing_old(store):
    store.write(C, 1, 0, 0, b"a" * 9_000)
    assert store.write(C, 2, 1, 0, b"b" * 9_000) == (2, 9_000)
    assert store.read(C, 2, 0, 9_000)[1] == b"b" * 9_000
    assert store.write(C, 3, 2, 0, b"c" * 100, truncate=100) == (3, 100)
    assert store.read(C, 3, 0, 9_000)[1] == b"c" * 100


def test_versions(store):
    store.write(C, 5, 0, 0, b"v5")
    with pytest.raises(StripefsError) as e:
        store.read(C, 6, 0, 2)
    assert _code(e) == ErrorCode.STALE
    # a merge onto a copy older than the writer's base is refused, nothing changes
    with pytest.raises(StripefsError) as e:
        store.write(C, 9, 6, 0, b"xx")
    assert _code(e) == ErrorCode.STALE
    assert store.read(C, 0, 0, 10) == (5, b"v5")
    # a missing copy is version 0
    with pytest.raises(StripefsError) as e:
        store.write(ChunkId(1, 1, 0), 9, 3, 0, b"xx")
    assert _code(e) == ErrorCode.STALE
    # the stored version is max(stored, written)
    assert store.write(C, 3, 5, 0, b"v3") == (5, 2)
    assert store.read(C, 5, 0, 10) == (5, b"v3")
    # replace ignores base_version and discards the old content entirely
    assert store.write(C, 8, 99, 0, b"new", replace=True) == (8, 3)
    assert store.read(C, 8, 0, 10) == (8, b"new")
    assert store.write(C, 2, 0, 0, b"R", replace=True) == (8, 1)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(offset=-1),
        dict(offset=64 << 20),  # offset + 1 byte > 64 MiB
        dict(offset=1, replace=True),
        dict(truncate=-2),
        dict(truncate=(64 << 20) + 1),
        dict(version=-1),
        dict(chunk=ChunkId(-1, 0, 0)),
    ],
)
def test_bad_write_requests(store, kwargs):
    args = dict(chunk=C, version=1, base_version=0, offset=0)
    args.update(kwargs)
    with pytest.raises(StripefsError) as e:
        store.write(args.pop("chunk"), args.pop("version"), args.pop("base_version"), args.pop("offset"), b"x", **args)
    assert _code(e) == ErrorCode.BAD_REQUEST
    assert not store.path(C).exists()


def test_bad_read_requests(store):
    store.write(C, 1, 0, 0, b"x")
    for offset, length in [(-1, 1), (0, -1), (0, (64 << 20) + 1)]:
        with pytest.raises(StripefsError) as e:
            store.read(C, 0, offset, length)
        assert _code(e) == ErrorCode.BAD_REQUEST


def _flip(path, pos):
    with open(path, "r+b") as f:
        f.seek(pos)
        b = f.read(1)
        f.seek(pos)
        f.write(bytes([b[0] ^ 0x40]))


def test_corrupt_data_block(store, caplog):
    data = _pattern(4 * BS)
    store.write(C, 1, 0, 0, data)
    nblocks = 4
    _flip(store.path(C), HEADER_SIZE + 8 * nblocks + 2 * BS + 17)  # a byte in block 2
    with caplog.at_level(logging.WARNING):
        with pytest.raises(StripefsError) as e:
            store.read(C, 0, 0, 4 * BS)
    assert _code(e) == ErrorCode.CORRUPT
    assert f"chunk {C}" in caplog.text and "block 2" in caplog.text
    with pytest.raises(StripefsError):
        store.read(C, 0, 2 * BS + 100, 1)
    # the other blocks of the same chunk still read
    assert store.read(C, 0, 0, 2 * BS)[1] == data[: 2 * BS]
    assert store.read(C, 0, 3 * BS, BS)[1] == data[3 * BS :]
    # a partial write must not spread the bad block; a replace repairs the copy
    with pytest.raises(StripefsError) as e:
        store.write(C, 2, 1, 0, b"x")
    assert _code(e) == ErrorCode.CORRUPT
    assert store.write(C, 2, 0, 0, data, replace=True) == (2, len(data))
    assert store.read(C, 2, 0, len(data))[1] == data


@pytest.mark.parametrize("pos", [0, 9, 17, 25, 33, HEADER_SIZE - 1, HEADER_SIZE + 3])
def test_corrupt_header_or_table(store, pos):
    """Magic, format, version, length, chunk id, header checksum, checksum table."""
    store.write(C, 1, 0, 0, _pattern(2 * BS))
    _flip(store.path(C), pos)
    for call in (lambda: store.read(C, 0, 0, 10), lambda: store.stat(C)):
        with pytest.raises(StripefsError) as e:
            call()
        assert _code(e) == ErrorCode.CORRUPT


def test_truncated_file_and_misplaced_file(store):
    store.write(C, 1, 0, 0, _pattern(3 * BS))
    os.truncate(store.path(C), os.path.getsize(store.path(C)) - 1)
    with pytest.raises(StripefsError) as e:
        store.read(C, 0, 0, 1)
    assert _code(e) == ErrorCode.CORRUPT
    other = ChunkId(7, 0, 0)
    store.write(other, 1, 0, 0, b"other")
    os.makedirs(store.path(ChunkId(8, 0, 0)).parent, exist_ok=True)
    os.replace(store.path(other), store.path(ChunkId(8, 0, 0)))
    with pytest.raises(StripefsError) as e:
        store.read(ChunkId(8, 0, 0), 0, 0, 5)
    assert _code(e) == ErrorCode.CORRUPT


def test_large_chunk_header_beyond_first_read(tmp_path):
    """A chunk whose checksum table does not fit in the first 4 KiB read."""
    with ChunkStore(tmp_path, block_size=512, reserved_space=0) as s:
        data = _pattern(600 * 512 + 7)
        s.write(C, 1, 0, 0, data)
        assert s.read(C, 1, 0, len(data))[1] == data
        assert s.read(C, 1, 599 * 512, 600)[1] == data[599 * 512 :]


def test_delete_and_all_parts(store):
    for part in range(3):
        store.write(ChunkId(9, 1, part), 1, 0, 0, b"p")
    store.write(ChunkId(9, 2, 0), 1, 0, 0, b"q")
    store.write(ChunkId(91, 1, 0), 1, 0, 0, b"r")  # a prefix lookalike
    assert store.delete([ChunkId(9, 1, 1)], all_parts=False) == 1
    assert store.delete([ChunkId(9, 1, 0), ChunkId(1000, 0, 0)], all_parts=True) == 2
    assert store.delete([ChunkId(9, 1, 0)]) == 0
    assert store.read(ChunkId(9, 2, 0), 0, 0, 1)[1] == b"q"
    assert store.read(ChunkId(91, 1, 0), 0, 0, 1)[1] == b"r"
    assert store.usage().chunks == 2


def test_sync(store):
    store.write(C, 1, 0, 0, b"x")
    assert store.sync([C, ChunkId(5, 5, 5)]) == 1
    assert store.write(C, 2, 1, 1, b"y", sync=True) == (2, 2)


def test_usage_accounting(tmp_path):
    with ChunkStore(tmp_path, block_size=BS, reserved_space=0) as s:
        assert s.usage().used_bytes == 0 and s.usage().chunks == 0
        s.write(C, 1, 0, 0, b"a" * 10_000)
        s.write(ChunkId(1, 0, 0), 1, 0, 0, b"b" * 100)
        s.write(C, 2, 1, 10_000, b"c" * 100)  # grows in place
        expected = os.path.getsize(s.path(C)) + os.path.getsize(s.path(ChunkId(1, 0, 0)))
        u = s.usage()
        assert (u.used_bytes, u.chunks) == (expected, 2)
        assert u.capacity_bytes > 0 and u.free_bytes > 0
    with ChunkStore(tmp_path, block_size=BS, reserved_space=0, capacity=1 << 20) as s:  # restart: the scan agrees
        u = s.usage()
        assert (u.capacity_bytes, u.used_bytes, u.chunks) == (1 << 20, expected, 2)
        assert u.free_bytes == (1 << 20) - expected
        s.delete([C])
        assert s.usage().used_bytes == os.path.getsize(s.path(ChunkId(1, 0, 0)))
        assert s.usage().chunks == 1


def test_no_space_by_capacity(tmp_path):
    with ChunkStore(tmp_path, block_size=BS, reserved_space=0, capacity=20_000) as s:
        s.write(C, 1, 0, 0, b"a" * 8_000)
        s.write(C, 2, 1, 0, b"b" * 8_000, replace=True)  # a replace of the same size fits
        with pytest.raises(StripefsError) as e:
            s.write(ChunkId(1, 0, 0), 1, 0, 0, b"x" * 15_000)
        assert _code(e) == ErrorCode.NO_SPACE
        with pytest.raises(StripefsError) as e:
            s.write(C, 3, 2, 8_000, b"x" * 15_000)
        assert _code(e) == ErrorCode.NO_SPACE
        assert s.read(C, 2, 0, 100_000) == (2, b"b" * 8_000)
        assert s.usage().chunks == 1
        assert [n for n in os.listdir(s.path(C).parent)] == [s.path(C).name]


def test_no_space_by_reserved_space(tmp_path):
    with ChunkStore(tmp_path, block_size=BS, reserved_space=0) as s:
        s.write(C, 1, 0, 0, b"a" * 100)
        used = s.usage().used_bytes
    with ChunkStore(tmp_path, block_size=BS, reserved_space=1 << 62) as s:
        assert s.usage().free_bytes == 0
        with pytest.raises(StripefsError) as e:
            s.write(C, 2, 1, 0, b"b" * 100)
        assert _code(e) == ErrorCode.NO_SPACE
        assert s.read(C, 1, 0, 1000) == (1, b"a" * 100)
        assert s.usage().used_bytes == used


def test_real_enospc_removes_temp_file(store, monkeypatch):
    store.write(C, 1, 0, 0, b"old" * 1000)
    real_writev = os.writev

    def full_disk(fd, buffers):
        real_writev(fd, [memoryview(buffers[0])[:10]])  # a few bytes land, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(cs.os, "writev", full_disk)
    with pytest.raises(StripefsError) as e:
        store.write(C, 2, 1, 0, b"new" * 1000, replace=True)
    assert _code(e) == ErrorCode.NO_SPACE
    monkeypatch.undo()
    assert os.listdir(store.path(C).parent) == [store.path(C).name]
    assert store.read(C, 0, 0, 10_000) == (1, b"old" * 1000)


def test_temp_files_removed_at_startup(tmp_path):
    with ChunkStore(tmp_path, block_size=BS, reserved_space=0) as s:
        s.write(C, 1, 0, 0, b"keep")
        tmp = s.path(C).with_name(s.path(C).name + ".tmp")
    tmp.write_bytes(b"half a chunk")
    with ChunkStore(tmp_path, block_size=BS, reserved_space=0) as s:
        assert not tmp.exists()
        assert s.read(C, 1, 0, 10) == (1, b"keep")
        assert s.usage().chunks == 1


def _renames_over_a_file(monkeypatch):
    """Spy on rename(2): the destinations it was asked to replace."""
    over = []
    real_rename = os.rename

    def rename(src, dst):
        if os.path.exists(dst):
            over.append(dst)
        real_rename(src, dst)

    monkeypatch.setattr(cs.os, "rename", rename)
    return over


def test_a_new_copy_takes_the_old_ones_place_without_a_rename_over_it(store, monkeypatch):
    # ext4 flushes a file renamed over another inside the rename (auto_da_alloc): _swap_in
    over = _renames_over_a_file(monkeypatch)
    store.write(C, 1, 0, 0, b"a" * 5000)
    store.write(C, 2, 1, 0, b"b" * 3000, replace=True)
    store.write(C, 3, 2, 100, b"c" * 10)  # a merge over the copy in its slot
    assert over == []
    assert store.read(C, 0, 0, 10_000) == (3, b"b" * 100 + b"c" * 10 + b"b" * 2890)
    assert os.listdir(store.path(C).parent) == [store.path(C).name]  # the old copies are gone
    assert store.usage().chunks == 1


def test_a_file_system_that_refuses_the_exchange_gets_a_rename(store, monkeypatch, caplog):
    def refused(*args):
        ctypes.set_errno(errno.EINVAL)
        return -1

    monkeypatch.setattr(cs, "_libc_renameat2", refused)
    store.write(C, 1, 0, 0, b"old")
    with caplog.at_level(logging.INFO, logger=cs.__name__):
        store.write(C, 2, 1, 0, b"new", replace=True)
    assert cs._libc_renameat2 is False  # asked once, then rename(2) for good
    assert "RENAME_EXCHANGE) refused" in caplog.text
    store.write(C, 3, 2, 0, b"newer", replace=True)
    assert store.read(C, 0, 0, 10) == (3, b"newer")
    assert os.listdir(store.path(C).parent) == [store.path(C).name]


def test_an_exchange_that_fails_otherwise_is_retried_as_a_rename(store, monkeypatch):
    def failing(*args):
        ctypes.set_errno(errno.EPERM)  # not "the file system has no such flag": tried again next time
        return -1

    monkeypatch.setattr(cs, "_libc_renameat2", failing)
    store.write(C, 1, 0, 0, b"old")
    store.write(C, 2, 1, 0, b"new", replace=True)
    assert cs._libc_renameat2 is failing
    assert store.read(C, 0, 0, 10) == (2, b"new")
    assert os.listdir(store.path(C).parent) == [store.path(C).name]


def test_a_kill_between_the_exchange_and_the_unlink_leaves_the_new_copy(tmp_path, monkeypatch):
    with ChunkStore(tmp_path, block_size=BS, reserved_space=0) as s:
        s.write(C, 1, 0, 0, b"old")
        monkeypatch.setattr(cs, "_unlink_quietly", lambda path: None)  # the process dies before it
        s.write(C, 2, 1, 0, b"new", replace=True)
        tmp = s.path(C).with_name(s.path(C).name + ".tmp")
        assert tmp.exists()  # the old copy, swapped out
    monkeypatch.undo()
    with ChunkStore(tmp_path, block_size=BS, reserved_space=0) as s:
        assert not tmp.exists()
        assert s.read(C, 0, 0, 10) == (2, b"new")
        assert s.usage().chunks == 1


def test_data_dir_is_exclusive_and_owned(tmp_path):
    with ChunkStore(tmp_path, reserved_space=0, node_id=1):
        with pytest.raises(QuietError, match="in use"):
            ChunkStore(tmp_path, reserved_space=0, node_id=1)
    with pytest.raises(QuietError, match="belongs to storage node 1"):
        ChunkStore(tmp_path, reserved_space=0, node_id=2)
    ChunkStore(tmp_path, reserved_space=0, node_id=1).close()


def test_block_size_of_the_file_wins(tmp_path):
    """Chunks written with one block size stay readable after the config changes."""
    data = _pattern(50_000)
    with ChunkStore(tmp_path, block_size=4096, reserved_space=0) as s:
        s.write(C, 1, 0, 0, data)
    with ChunkStore(tmp_path, block_size=65536, reserved_space=0) as s:
        assert s.read(C, 1, 1000, 20_000)[1] == data[1000:21_000]
        s.write(C, 2, 1, 10, b"z")
        assert s.read(C, 2, 0, 50_000)[1] == data[:10] + b"z" + data[11:]


def test_concurrent_partial_writes_to_one_chunk(store):
    """Read-merge-rename under the per-chunk lock: no write is lost."""
    def writer(i):
        store.write(C, 1, 0, i * 1000, bytes([65 + i]) * 1000)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert store.read(C, 1, 0, 8000)[1] == b"".join(bytes([65 + i]) * 1000 for i in range(8))


_REWRITER = textwrap.dedent(
    """
    import json, sys
    from stripefs.common.protocol import ChunkId
    from stripefs.storage_node.chunk_store import ChunkStore
    spec = json.loads(sys.argv[2])
    store = ChunkStore(sys.argv[1], block_size=spec["block_size"], reserved_space=0)
    contents = [b"".join(bytes([b]) * n for b, n in runs) for runs in spec["contents"]]
    chunk = ChunkId(42, 3, 0)
    i = 0
    while True:
        store.write(chunk, 1, 0, 0, contents[i % 2], replace=True)
        if i == 0:
            print("writing", store._direct.enabled, flush=True)
        i += 1
    """
)


def kill_9_while_rewriting(tmp_path, contents, *, block_size: int, kills: int, max_pause_s: float, seed: int) -> set[bytes]:
    """A child process rewrites chunk 42:3:0 with the two ``contents`` (lists of (byte, count)
    runs) in turn and is killed with SIGKILL at a random moment, ``kills`` times; after each kill
    the chunk holds one of them whole (every block verified), alone, with no temp file left.
    Returns the child's first lines ("writing" and whether it writes with O_DIRECT)."""
    expected = {b"".join(bytes([b]) * n for b, n in runs) for runs in contents}
    c = ChunkId(42, 3, 0)
    with ChunkStore(tmp_path, block_size=block_size, reserved_space=0) as s:
        s.write(c, 1, 0, 0, b"".join(bytes([b]) * n for b, n in contents[0]))
    spec = json.dumps({"block_size": block_size, "contents": contents})
    rng = random.Random(seed)
    ready = set()
    for _ in range(kills):
        proc = subprocess.Popen([sys.executable, "-c", _REWRITER, str(tmp_path), spec], stdout=subprocess.PIPE)
        try:
            ready.add(proc.stdout.readline())
            time.sleep(rng.uniform(0, max_pause_s))
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            proc.stdout.close()
        with ChunkStore(tmp_path, block_size=block_size, reserved_space=0) as s:
            version, data = s.read(c, 1, 0, max(map(len, expected)))  # verifies every block
            assert data in expected
            assert s.usage().chunks == 1
            assert not [n for n in os.listdir(s.path(c).parent) if n.endswith(".tmp")]
    return ready


def test_kill_9_leaves_old_or_new_content(tmp_path):
    # about a third of the kills land mid-write
    ready = kill_9_while_rewriting(tmp_path, [[(65, 300_000)], [(66, 200_000), (67, 150_000)]],
                                   block_size=4096, kills=8, max_pause_s=0.03, seed=1)
    assert all(line.startswith(b"writing") for line in ready)


def test_delete_respects_version_bound(tmp_path):
    """A late delete of garbage must not destroy a copy rewritten after it became garbage."""
    store = ChunkStore(tmp_path)
    c = ChunkId(7, 0)
    store.write(c, 5, 0, 0, b"old", replace=True)
    store.write(c, 9, 0, 0, b"new", replace=True)
    assert store.delete([c], max_versions=[5]) == 0
    assert store.read(c, 0, 0, 10) == (9, b"new")
    assert store.delete([c], max_versions=[9]) == 1
    assert store.delete([c], max_versions=[9]) == 0


@pytest.mark.warm_caches  # reads with RWF_NOWAIT what it just read: no drop_caches() elsewhere meanwhile
def test_nowait_reads_come_from_the_page_cache_or_say_so(store):
    data = _pattern(30 * BS + 7)
    store.write(C, 3, 0, 0, data)
    store.read(C, 3, 0, len(data))  # now in the page cache
    version, got = store.read(C, 3, 1000, 5000, nowait=True)
    assert version == 3 and bytes(got) == data[1000:6000]
    with pytest.raises(BlockingIOError):
        store.read(C, 3, 0, len(data), nowait=True, max_bytes=10 * BS)  # too large to do inline
    # the limit is on what the chunk holds: a client asks for a whole chunk by its layout's chunk size
    version, got = store.read(C, 3, 0, 64 << 20, max_bytes=len(data))
    assert version == 3 and bytes(got) == data
    with pytest.raises(StripefsError) as e:  # errors other than "would block" stay errors
        store.read(ChunkId(42, 9, 0), 3, 0, 10, nowait=True)
    assert _code(e) == ErrorCode.NOT_FOUND


def test_a_new_data_directory_keeps_files_written_together_in_one_fanout_directory(tmp_path):
    with ChunkStore(tmp_path) as store:
        for ino in range(128, 192):  # 64 consecutive inodes: one directory
            store.write(ChunkId(ino, 0), 1, 0, 0, b"x", replace=True)
        store.write(ChunkId(128, 4096), 1, 0, 0, b"y", replace=True)  # a big file's chunks move on every 4,096
        dirs = {p.parent for p in (tmp_path / "chunks").glob("*/*/*.chunk")}
        assert len(dirs) == 2 and store.path(ChunkId(128, 0)).parent != store.path(ChunkId(128, 4096)).parent
        assert store.path(ChunkId(128, 0, 1)).parent == store.path(ChunkId(128, 0, 0)).parent  # parts stay together
        assert cs.chunk_path(tmp_path, ChunkId(128, 4096)) == store.path(ChunkId(128, 4096))  # tools find it too
    assert (tmp_path / "fanout").read_text() == "by-inode\n"


def test_a_data_directory_from_before_the_marker_keeps_hashed_fanout(tmp_path):
    with ChunkStore(tmp_path) as store:
        store.write(C, 3, 0, 0, b"old data", replace=True)
    (tmp_path / "fanout").unlink()
    h = chunk_file.dir_hashed(C.ino, C.index)
    assert h != chunk_file.dir_by_inode(C.ino, C.index)
    target = tmp_path / "chunks" / f"{h & 0xFF:02x}" / f"{h >> 8:02x}"
    source = next((tmp_path / "chunks").glob("*/*/*.chunk"))
    target.mkdir(parents=True, exist_ok=True)
    os.rename(source, target / source.name)  # where a node from before the marker put it
    with ChunkStore(tmp_path) as store:
        assert store.read(C, 0, 0, 100) == (3, b"old data")
    assert (tmp_path / "fanout").read_text() == "hashed\n"
    (tmp_path / "fanout").write_text("spiral\n")
    with pytest.raises(QuietError, match="fan-out"):
        ChunkStore(tmp_path)


def test_a_new_version_is_merged_from_the_committed_slot_never_from_an_abandoned_one(store):
    """Copy-on-write (common/layout.py "Slots"): v4 committed in slot 0, a session's v7 in slot 32."""
    even, odd = ChunkId(5, 0, replica_part(4)), ChunkId(5, 0, replica_part(7))
    committed = _pattern(3 * BS, 1)
    store.write(even, 4, 0, 0, committed)
    # a partial write of v7 based on v4: the rest of the chunk comes from the committed slot
    assert store.write(odd, 7, 4, 100, b"seven") == (7, 3 * BS)
    assert store.read(odd, 7, 0, 3 * BS)[1] == committed[:100] + b"seven" + committed[105:]
    assert store.read(even, 4, 0, 3 * BS) == (4, committed)  # untouched
    # a later range of the same session merges into its own copy
    assert store.write(odd, 7, 7, 0, b"S") == (7, 3 * BS)
    assert store.read(odd, 7, 0, 3 * BS)[1] == b"S" + committed[1:100] + b"seven" + committed[105:]
    # v7 was abandoned (never committed); a new session's v9 based on v4 again never sees its bytes
    assert store.write(odd, 9, 4, 200, b"nine") == (9, 3 * BS)
    assert store.read(odd, 9, 0, 3 * BS)[1] == committed[:200] + b"nine" + committed[204:]
    # no copy of the base anywhere: STALE (the writer then sends the whole chunk)
    store.delete([even], all_parts=False)
    with pytest.raises(StripefsError) as e:
        store.write(ChunkId(5, 0, replica_part(11)), 11, 10, 0, b"x")
    assert _code(e) == ErrorCode.STALE


def test_replicas_from_before_slots_are_moved_once(tmp_path):
    """A data directory of the in-place days: replicas at part 0 whatever their version."""
    odd, even = ChunkId(8, 0, 0), ChunkId(8, 1, 0)
    with ChunkStore(tmp_path, block_size=BS, reserved_space=0) as s:
        s.write(odd, 5, 0, 0, b"odd version")
        s.write(even, 6, 0, 0, b"even version")
    (tmp_path / "slots").unlink()  # as an old node left it
    with ChunkStore(tmp_path, block_size=BS, reserved_space=0) as s:
        assert s.read(ChunkId(8, 0, replica_part(5)), 5, 0, 100) == (5, b"odd version")
        assert s.read(even, 6, 0, 100) == (6, b"even version")
        with pytest.raises(StripefsError) as e:
            s.read(odd, 0, 0, 100)
        assert _code(e) == ErrorCode.NOT_FOUND
        assert s.usage().chunks == 2
    assert (tmp_path / "slots").exists()


def test_a_batch_is_made_durable_by_one_syncfs(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(cs, "_libc_syncfs", lambda fd: calls.append(os.readlink(f"/proc/self/fd/{fd}")) or 0)
    with ChunkStore(tmp_path, block_size=BS, reserved_space=0) as s:
        chunks = [ChunkId(100 + i, 0, 0) for i in range(5)]
        for c in chunks:
            s.write(c, 1, 0, 0, b"small file %d" % c.ino)  # new fan-out directories, not synced yet
        assert s._unsynced_dirs
        s.sync_batch(chunks)
        assert calls == [str(tmp_path / "chunks")] and not s._unsynced_dirs  # one call, for the data file system
        s.sync_batch([])
        assert len(calls) == 1  # nothing written: nothing to sync


def test_a_batch_falls_back_to_fsync_of_each_file_without_syncfs(tmp_path, monkeypatch):
    monkeypatch.setattr(cs, "_libc_syncfs", False)
    with ChunkStore(tmp_path, block_size=BS, reserved_space=0) as s:
        chunks = [ChunkId(100 + i, 0, 0) for i in range(3)]
        for c in chunks:
            s.write(c, 1, 0, 0, b"x")
        synced = []
        real = s.sync
        monkeypatch.setattr(s, "sync", lambda cs_: synced.append(list(cs_)) or real(cs_))
        s.sync_batch(chunks)
        assert synced == [chunks] and not s._unsynced_dirs


def test_a_failed_syncfs_is_an_io_error_and_keeps_the_directories_to_sync(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(cs, "_libc_syncfs", lambda fd: -1)
    with ChunkStore(tmp_path, block_size=BS, reserved_space=0) as s:
        s.write(C, 1, 0, 0, b"x")
        dirs = set(s._unsynced_dirs)
        with pytest.raises(StripefsError) as e:
            s.sync_batch([C])
        assert _code(e) == ErrorCode.IO and "syncfs" in e.value.message
        assert s._unsynced_dirs == dirs and "syncfs" in caplog.text


def test_the_real_syncfs_runs(tmp_path):
    with ChunkStore(tmp_path, block_size=BS, reserved_space=0) as s:
        s.write(C, 1, 0, 0, b"x")
        s.sync_batch([C])
        assert cs._syncfs(tmp_path) is True  # Linux with glibc: the batch path really uses it
        assert s.read(C, 1, 0, 10) == (1, b"x")


_BATCH_WRITER = textwrap.dedent(
    """
    import sys
    from stripefs.common.protocol import ChunkId
    from stripefs.storage_node.chunk_store import ChunkStore
    store = ChunkStore(sys.argv[1], block_size=4096, reserved_space=0)
    contents = [bytes([65]) * 90_000, bytes([66]) * 50_000 + bytes([67]) * 30_000]
    chunks = [ChunkId(50 + i, 0, 0) for i in range(int(sys.argv[2]))]
    i = 0
    while True:  # as a WriteChunksReq with sync: every write without a sync, then one for the batch
        for c in chunks:
            store.write(c, 1, 0, 0, contents[i % 2], replace=True)
        store.sync_batch(chunks)
        if i == 0:
            print("writing", flush=True)
        i += 1
    """
)


def test_kill_9_during_a_batch_leaves_each_chunk_old_or_new(tmp_path):
    expected = {bytes([65]) * 90_000, bytes([66]) * 50_000 + bytes([67]) * 30_000}
    chunks = [ChunkId(50 + i, 0, 0) for i in range(6)]
    with ChunkStore(tmp_path, block_size=BS, reserved_space=0) as s:
        for c in chunks:
            s.write(c, 1, 0, 0, bytes([65]) * 90_000)
    rng = random.Random(3)
    seen = set()
    for _ in range(8):
        proc = subprocess.Popen([sys.executable, "-c", _BATCH_WRITER, str(tmp_path), str(len(chunks))], stdout=subprocess.PIPE)
        try:
            assert proc.stdout.readline() == b"writing\n"
            time.sleep(rng.uniform(0, 0.05))
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            proc.stdout.close()
        with ChunkStore(tmp_path, block_size=BS, reserved_space=0) as s:
            for c in chunks:
                version, data = s.read(c, 1, 0, 1 << 20)  # verifies every block
                assert data in expected, c
                seen.add(bytes(data[:1]))
                assert not [n for n in os.listdir(s.path(c).parent) if n.endswith(".tmp")]
            assert s.usage().chunks == len(chunks)
    assert seen == {b"A", b"B"}  # the kills landed between batches' writes, not only before the first


def test_a_small_chunk_is_read_without_a_copy(store):
    """A small chunk comes back as a view into the one pread of its file (header, table and data),
    not a copy of its bytes: the copy was a storage node's per-file cost in a cold prefetch epoch."""
    data = _pattern(3 * BS + 100)
    store.write(C, 1, 0, 0, data)
    version, got = store.read(C, 0, 0, 1 << 20)
    assert version == 1 and bytes(got) == data
    assert isinstance(got, memoryview) and len(got.obj) > len(data)  # the file's whole buffer: no copy
    _, part = store.read(C, 0, BS + 5, 10)  # a range inside: sliced from the view, still the data
    assert bytes(part) == data[BS + 5 : BS + 15]


def _count_calls(monkeypatch, name):
    """Calls of ``os.<name>`` made through chunk_store, by their first argument (a path or fd)."""
    calls = []
    real = getattr(os, name)

    def counted(*args, **kwargs):
        calls.append(str(args[0]) if args else "")
        return real(*args, **kwargs)

    monkeypatch.setattr(cs.os, name, counted)
    return calls


def test_a_write_opens_the_copy_in_its_slot_once(store, monkeypatch):
    """Issue 35 (the node's write path): the copy a write replaces is opened once, its size, version
    and (a merge over it) its bytes read from that one open; no stat of it, no second open. The
    copy-on-write rules are the ones above: an own copy (the session's version) is merged into, an
    older one in the slot never is."""
    committed, slot = ChunkId(5, 0, replica_part(4)), ChunkId(5, 0, replica_part(7))
    base = _pattern(3 * BS, 2)
    store.write(committed, 4, 0, 0, base)
    store.write(slot, 3, 0, 0, _pattern(3 * BS, 3))  # an abandoned session's copy: garbage in the slot
    opens, stats = _count_calls(monkeypatch, "open"), _count_calls(monkeypatch, "stat")
    assert store.write(slot, 7, 4, 100, b"seven") == (7, 3 * BS)  # merged from the committed slot
    target = str(store.path(slot))
    assert opens.count(target) == 1 and target not in stats
    opens.clear()
    assert store.write(slot, 7, 4, 2 * BS, b"later") == (7, 3 * BS)  # the same session's second range
    assert opens.count(target) == 1 and opens.count(str(store.path(committed))) == 0 and target not in stats
    monkeypatch.undo()
    expected = bytearray(base)
    expected[100:105] = b"seven"
    expected[2 * BS : 2 * BS + 5] = b"later"
    assert store.read(slot, 7, 0, 3 * BS) == (7, expected)
    assert store.read(committed, 4, 0, 3 * BS) == (4, base)
    assert store.usage().used_bytes == sum(os.path.getsize(store.path(c)) for c in (committed, slot))
    # a replacing write over a copy still keeps the newer version of the two (if_newer too)
    assert store.write(slot, 5, 0, 0, b"older", replace=True, if_newer=True) == (7, 3 * BS)
    assert store.write(slot, 5, 0, 0, b"older", replace=True) == (7, 5)


def test_a_corrupt_copy_in_the_slot_is_replaced_whole(store):
    committed, slot = ChunkId(5, 1, replica_part(4)), ChunkId(5, 1, replica_part(7))
    base = _pattern(2 * BS, 4)
    store.write(committed, 4, 0, 0, base)
    store.write(slot, 7, 4, 0, b"x")
    with open(store.path(slot), "r+b") as f:  # a torn or rotten copy of the session's version
        f.seek(HEADER_SIZE + 20)
        f.write(b"rot")
    assert store.write(slot, 9, 4, 10, b"nine") == (9, 2 * BS)  # built on the committed slot
    assert store.read(slot, 9, 0, 2 * BS)[1] == base[:10] + b"nine" + base[14:]


def test_the_space_check_reuses_a_recent_statvfs_far_from_the_reserve(store, monkeypatch):
    """A statvfs was one of a write's ~10 file system calls (issue 35): its answer serves the
    writes of the next second, less what the store grew since, unless the write would come within
    ``_FREE_MARGIN`` of the reserve; near the reserve every write asks the file system. The file
    system's answer is held fixed: other processes change the real one (a clean-clone CI run's
    in-process tier, writing beside this one, moved it past the 1 MiB left over the reserve)."""
    real = os.statvfs(store.data_dir)
    fixed = os.statvfs_result((real.f_bsize, real.f_frsize, real.f_blocks, real.f_bfree, real.f_bavail,
                               real.f_files, real.f_ffree, real.f_favail, real.f_flag, real.f_namemax))
    statvfs = []
    monkeypatch.setattr(cs.os, "statvfs", lambda path: (statvfs.append(str(path)), fixed)[1])
    for i in range(20):
        store.write(ChunkId(6, i, 0), 1, 0, 0, b"x" * 1000)
    assert len(statvfs) == 1
    store.reserved_space = store._fs_free() - (1 << 20)  # the file system is nearly at the reserve now
    statvfs.clear()
    store.write(ChunkId(6, 0, 0), 2, 0, 0, b"y" * 1000, replace=True)
    assert len(statvfs) == 1
    with pytest.raises(StripefsError) as e:  # 2 MiB would cross the reserve: refused at once
        store.write(ChunkId(6, 1, 0), 2, 0, 0, b"z" * (2 << 20), replace=True)
    assert _code(e) == ErrorCode.NO_SPACE
    assert store.read(ChunkId(6, 1, 0), 1, 0, 2000) == (1, b"x" * 1000)


def test_a_delete_lists_a_directory_once_per_request(store, monkeypatch):
    """The collector's DeleteChunksReq names many chunks of one file, all in one fan-out directory:
    it is listed once per request (it was once per chunk), and each copy is opened once for its
    size and, with a bound, its version. A copy newer than the bound is kept, as before."""
    chunks = [ChunkId(9, i, 0) for i in range(16)]
    for c in chunks:
        store.write(c, 4, 0, 0, b"committed", replace=True)
        store.write(ChunkId(9, c.index, 32), 3, 0, 0, b"old", replace=True)
    store.write(ChunkId(9, 15, 32), 5, 0, 0, b"newer", replace=True)
    listings, stats = _count_calls(monkeypatch, "listdir"), _count_calls(monkeypatch, "stat")
    assert store.delete(chunks, all_parts=True, max_versions=[3] * 16) == 15
    assert len(listings) == 1 and not stats
    monkeypatch.undo()
    assert sorted(store.chunks_in_dir(store.existing_dirs()[0]), key=lambda c: (c.index, c.part)) == [
        *chunks, ChunkId(9, 15, 32)]
    assert store.usage().chunks == 17
    assert store.usage().used_bytes == sum(os.path.getsize(store.path(c)) for c in [*chunks, ChunkId(9, 15, 32)])
    # other chunks of the directory, and names that are not copies, are left alone
    store.write(ChunkId(9, 100, 3), 1, 0, 0, b"other", replace=True)
    (store.path(chunks[0]).parent / "9-0-x.chunk").write_bytes(b"not a copy")
    assert store.delete(chunks[:2], all_parts=True) == 2
    assert store.read(ChunkId(9, 100, 3), 1, 0, 10) == (1, b"other")
    assert (store.path(chunks[0]).parent / "9-0-x.chunk").exists()
