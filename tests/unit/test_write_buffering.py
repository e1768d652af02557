"""The mount's write buffering (open_files.DirtyChunk) and chunk placement ahead of a
sequential writer (striping.alloc_indices)."""

import random

import pytest

from stripefs.client.open_files import DirtyChunk, OpenFile
from stripefs.client.striping import ALLOC_AHEAD, alloc_indices
from stripefs.common import protocol as p

CS = 1 << 20


def _reference(writes, size=CS):
    """What the chunk holds after ``writes``, by brute force: (bytes, lo, hi) of the written range."""
    buf = bytearray(size)
    lo, hi = None, None
    for off, data in writes:
        buf[off : off + len(data)] = data
        lo = off if lo is None else min(lo, off)
        hi = off + len(data) if hi is None else max(hi, off + len(data))
    return bytes(buf[lo:hi]), lo, hi


def _apply(writes):
    off0 = writes[0][0]
    dc = DirtyChunk(0, bytearray(), off0, off0)
    for off, data in writes:
        assert dc.takes(off, len(data))
        dc.merge(off, data)
    return dc


@pytest.mark.parametrize(
    "writes",
    [
        [(0, b"a" * 100), (100, b"b" * 50), (150, b"c" * 10)],  # appending
        [(300, b"a" * 100), (400, b"b" * 100)],  # a range starting mid-chunk: padded in front
        [(300, b"a" * 100), (250, b"b" * 60)],  # growing at the front
        [(300, b"a" * 100), (350, b"b" * 200)],  # overlapping the end and past it
        [(0, b"a" * 100), (20, b"b" * 10), (100, b"c")],  # overwriting inside, then appending
        [(500, b"a" * 10), (200, b"b" * 400)],  # covering the whole range and both sides
    ],
)
def test_merge_keeps_the_written_range(writes):
    dc = _apply(writes)
    want, lo, hi = _reference(writes)
    assert (dc.lo, dc.hi) == (lo, hi)
    assert bytes(dc.buf[dc.lo : dc.hi]) == want


def test_merge_random_contiguous_writes():
    rng = random.Random(7)
    for _ in range(200):
        start = rng.randrange(0, CS // 2)
        writes = [(start, rng.randbytes(rng.randrange(1, 5000)))]
        lo, hi = start, start + len(writes[0][1])
        for _ in range(rng.randrange(1, 8)):
            off = rng.randrange(max(0, lo - 3000), hi + 1)  # contiguous with [lo, hi)
            data = rng.randbytes(rng.randrange(max(1, lo - off), max(2, lo - off) + 4000))
            writes.append((off, data))
            lo, hi = min(lo, off), max(hi, off + len(data))
        dc = _apply(writes)
        want, wlo, whi = _reference(writes)
        assert (dc.lo, dc.hi) == (wlo, whi)
        assert bytes(dc.buf[dc.lo : dc.hi]) == want


def test_writes_with_gaps_keep_their_ranges_and_bytes():
    """Writes that leave gaps (records written out of order, by two processes, or by mmap
    writeback) are kept as separate ranges and coalesce once the gaps are filled."""
    rng = random.Random(11)
    for _ in range(300):
        dc = DirtyChunk(0, bytearray(), 0, 0)
        model = bytearray(CS)
        written = bytearray(CS)  # 1 where some write put a byte
        for _ in range(rng.randrange(1, 40)):
            off = rng.randrange(0, CS - 1)
            data = rng.randbytes(rng.randrange(1, min(20_000, CS - off) + 1))
            if not dc.takes(off, len(data)):
                break
            dc.merge(off, data)
            model[off : off + len(data)] = data
            written[off : off + len(data)] = b"\1" * len(data)
        want, pos = [], 0
        while (start := written.find(1, pos)) >= 0:
            end = written.find(0, start)
            end = CS if end < 0 else end
            want.append((start, end))
            pos = end
        assert dc.ranges == want
        assert (dc.lo, dc.hi) == (want[0][0], want[-1][1])
        for lo, hi in dc.ranges:
            assert dc.buf[lo:hi] == model[lo:hi]
        assert not any(dc.buf[want[-1][1] :]) and all(not any(dc.buf[a:b]) for (_, a), (b, _) in zip(want, want[1:]))
        assert dc.contiguous == (len(want) == 1)
        assert [(d.lo, d.hi, bytes(d.buf[d.lo : d.hi])) for d in dc.pieces()] == [(a, b, bytes(model[a:b])) for a, b in want]


def test_interleaved_records_coalesce_into_the_whole_chunk():
    """Two writers' records, each leaving the other's gap: one range once both are done."""
    rec = 47_008
    dc = DirtyChunk(0, bytearray(), 0, 0)
    n = CS // rec
    for k in list(range(0, n, 2)) + list(range(1, n, 2)):  # the even records, then the odd ones
        assert dc.takes(k * rec, rec)
        dc.merge(k * rec, bytes([k % 251]) * rec)
    assert dc.ranges == [(0, n * rec)]
    assert bytes(dc.buf[rec : 2 * rec]) == bytes([1]) * rec


def test_a_range_past_the_limit_is_refused_but_a_touching_one_is_not():
    from stripefs.client.open_files import MAX_DIRTY_RANGES

    dc = DirtyChunk(0, bytearray(), 0, 0)
    for k in range(MAX_DIRTY_RANGES):
        dc.merge(k * 100, b"x" * 10)
    assert len(dc.ranges) == MAX_DIRTY_RANGES
    assert not dc.takes(MAX_DIRTY_RANGES * 100, 10)  # a new range: the chunk is sent first
    assert dc.takes(5, 20)  # extends a range (and so adds none)
    assert dc.takes(10, 90)  # joins two


def _file(placed: dict[int, int]) -> OpenFile:
    """A file whose chunks ``placed`` (index -> version) have nodes."""
    attr = p.Attr(ino=9, mode=0o100644, nlink=1, uid=0, gid=0, rdev=0, size=0, atime_ns=0, mtime_ns=0, ctime_ns=0)
    chunks = {i: p.ChunkRef(index=i, version=v, nodes=[1, 2]) for i, v in placed.items()}
    return OpenFile(9, attr, p.Layout(CS, 4, "replicas=2"), chunks)


def test_a_new_file_and_a_sparse_writer_place_one_chunk():
    assert alloc_indices(_file({}), 0) == [0]
    assert alloc_indices(_file({}), 7) == [7]  # nothing before it is placed: no guess
    assert alloc_indices(_file({0: 3}), 5) == [5]


def test_a_growing_file_places_ahead_at_most_doubling():
    assert alloc_indices(_file({0: 0}), 1) == [1, 2]
    assert alloc_indices(_file({i: 0 for i in range(3)}), 3) == [3, 4, 5, 6]
    big = _file({i: 0 for i in range(100)})
    assert alloc_indices(big, 100) == list(range(100, 101 + ALLOC_AHEAD))


def test_chunks_already_placed_or_written_here_are_not_asked_for():
    of = _file({i: 0 for i in range(5)} | {6: 0})
    of.uncommitted[7] = p.ChunkRef(index=7, version=12, nodes=[3, 4])
    assert alloc_indices(of, 5) == [5, 8, 9, 10]  # 5 ahead of index 5: 6..10, less 6 and 7
    of.chunks[8] = p.ChunkRef(index=8, version=0, nodes=[])  # known, but without a placement
    assert 8 in alloc_indices(of, 5)


# -- the daemon's side: ReleaseChunksReq (namespace.release_chunks), on both stores ---------

from test_namespace import ROOT, w  # noqa: E402,F401 - the namespace fixture, on SQLite and PostgreSQL


def test_release_drops_only_unwritten_placements_past_the_end(w):
    ino, _ = w.ns.create(ROOT, b"f", 0o644, 0, 0)
    w.ns.alloc_chunks(ino, list(range(6)))
    w.ns.commit(ino, 2 * CS + 5, 1, [p.ChunkRef(index=i, version=7, nodes=[]) for i in range(3)])
    w.ns.commit(ino, 0, 2, [p.ChunkRef(index=5, version=9, nodes=[])])  # stored past the end (a racing writer)
    assert w.ns.release_chunks(ino, [1, 3, 4, 5, 40]) == 2  # 3 and 4: past the end and never written
    chunks = {c.index: c for c in w.ns.open_info(ino)[2]}
    assert sorted(chunks) == [0, 1, 2, 5] and chunks[1].version == 7 and chunks[5].version == 9
    assert w.ns.release_chunks(ino, [3, 4]) == 0  # idempotent
    # a writer that stored copies under a released placement recreates the row by committing
    w.ns.commit(ino, 4 * CS, 3, [p.ChunkRef(index=3, version=11, nodes=[2, 3])])
    chunks = {c.index: c for c in w.ns.open_info(ino)[2]}
    assert chunks[3].version == 11 and chunks[3].nodes == [2, 3]


def _open_rsp(size: int, versions: dict[int, int]) -> p.OpenRsp:
    attr = p.Attr(ino=5, mode=0o100644, nlink=1, uid=0, gid=0, rdev=0, size=size, atime_ns=0, mtime_ns=0, ctime_ns=0)
    chunks = [p.ChunkRef(index=i, version=v, nodes=[1, 2]) for i, v in versions.items()]
    return p.OpenRsp(attr=attr, layout=p.Layout(chunk_size=CS, stripe_count=1, redundancy="replicas=2"), chunks=chunks, nodes=[])


def test_an_open_answer_older_than_the_mount_s_state_is_not_taken():
    """The daemon never lowers a chunk's committed version, so an answer naming an older one than the
    mount holds predates the mount's own commit: taking it would read (and read-modify-write from)
    the replaced version while its slot is still on the nodes."""
    of = OpenFile(5, _open_rsp(100, {0: 7}).attr, _open_rsp(100, {0: 7}).layout, {0: p.ChunkRef(index=0, version=9, nodes=[1, 2])})
    of.size = 200
    of.refresh(_open_rsp(100, {0: 7}))
    assert of.chunks[0].version == 9 and of.size == 200
    of.refresh(_open_rsp(300, {0: 11, 1: 12}))  # newer: taken
    assert (of.chunks[0].version, of.chunks[1].version, of.size) == (11, 12, 300)
    of.refresh(_open_rsp(0, {}))  # truncated elsewhere: taken
    assert (of.chunks, of.size) == ({}, 0)
    of.chunks = {0: p.ChunkRef(index=0, version=11, nodes=[1, 2])}
    of.refresh(_open_rsp(0, {0: 0}))  # truncated and placed again elsewhere (not written yet): taken
    assert of.chunks[0].version == 0


def test_a_file_s_send_and_commit_state_is_made_at_first_use():
    """A create keeps an OpenFile until the kernel forgets the inode: its events, lock, early writes
    and chunks placed ahead are made when first needed, and behave as if made at the start."""
    import trio

    of, other = _file({}), _file({})
    assert of._idle is None and of._commit_lock is None and not of.placed_ahead and not of.early
    assert of.placed_ahead is other.placed_ahead  # the shared empty one, never changed in place
    assert of.idle.is_set() and not of.committing  # nothing in flight, no commit
    of.start_io()
    assert not of.idle.is_set()
    of.end_io()
    assert of.idle.is_set()
    of.place_ahead(3)
    of.keep_early(0, b"x")
    assert of.placed_ahead == {3} and not other.placed_ahead and of.early == [(0, b"x")] and of.early_bytes == 1
    assert not other.early

    async def commit():
        async with of.commit_lock:
            assert of.committing and not other.committing
        assert not of.committing

    trio.run(commit)
