"""Erasure-coded files (ec=4+2) through the mount's handlers, on a rig of 6 storage nodes.

Moved from tests/cluster/test_erasure.py, which keeps what goes through the CLI
(layout refusals, status overhead, conversions). The module starts its own rig
with the cluster test's settings: the root directory ec=4+2 with 1 MiB chunks,
short node and session timeouts, and clients whose fragment sends to a killed
node are given up after 4 s. Reads that must not come from the writer's memory
cache go through a fresh client (``fresh``), as they went through a fresh mount.
"""

from __future__ import annotations

import hashlib
import os
import random

import pytest

from stripefs.client.fuse.replies import FuseError
from stripefs.common import protocol as P

from conftest import run_rig
from fsapi import Kernel, open_fs

MiB = 1 << 20
CHUNK = 1 * MiB  # small stripes keep the data small: 4 data fragments of 256 KiB


@pytest.fixture(scope="module")
def ec_rig(request):
    yield from run_rig(
        request, nodes=6,
        meta_settings={"redundancy": "ec=4+2", "chunk_size": CHUNK, "node_timeout_s": 3.0, "session_lease_s": 4.0},
        client_settings={"rpc_timeout_s": 4.0},
        expected_log_patterns=(r"not answering", r"failed", r"unreadable", r"no reply", r"fragments could be written",
                               r"fewer than", r"fragments of one version", r"session"),
    )


@pytest.fixture
def rig(ec_rig):
    return ec_rig


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


async def _populate(fs, d: int, n: int, seed: int) -> dict[bytes, str]:
    rng = random.Random(seed)
    sums = {}
    for i in range(n):
        data = rng.randbytes(rng.choice([0, 1, 10, 5000, CHUNK - 1, CHUNK, CHUNK + 7, 3 * CHUNK + 123456]))
        await fs.write_file(d, b"f%d" % i, data)
        sums[b"f%d" % i] = _sha(data)
    return sums


def _fragment_files(rig, ino: int, index: int):
    return sorted(rig.root.glob(f"storage-*/data/chunks/*/*/{ino}-{index}-*.chunk"))


async def _fragments_match_a_full_encode(fs, ino: int, want: bytes | bytearray):
    """Every fragment of file ``ino`` on its node, read at its own version (ChunkRef ``fversions``) in
    that version's slot, is exactly what coding the whole stripe of ``want`` gives; the file's OpenRsp."""
    from stripefs.common.erasure import codec, fragment_part
    from stripefs.common.transport import connect
    import zmq

    c = codec(4, 2, CHUNK)
    info = await fs.ops.meta.call(P.OpenReq(ino=ino, session_id=fs.ops.meta.session_id))
    ctx = zmq.Context()
    try:
        for ref in info.chunks:
            expected = c.encode(bytes(want[ref.index * CHUNK : (ref.index + 1) * CHUNK]))
            for j, node in enumerate(ref.nodes):
                version = ref.fragment_version(j)
                async with connect(ctx, fs.rig.node_addresses[node], timeout=10) as client:
                    rsp, frames = await client.call(P.ReadChunkReq(
                        chunk=P.ChunkId(ino, ref.index, fragment_part(j, version)), min_version=version, offset=0, length=CHUNK))
                stored = b"".join(bytes(f) for f in frames)
                assert rsp.version == version
                assert stored.ljust(c.fps, b"\0") == expected[j].ljust(c.fps, b"\0"), (ref.index, j)
    finally:
        ctx.destroy(linger=0)
    return info


def fresh(fs, monkeypatch, name: str = "fresh"):
    """Another client of the rig: nothing in its memory cache."""
    return open_fs(fs.rig, Kernel(monkeypatch), name)


async def test_fragments_on_distinct_nodes_and_trimmed(fs):
    d = fs.dir
    big = await fs.write_file(d, b"big", os.urandom(CHUNK))
    tiny = await fs.write_file(d, b"tiny", b"0123456789")
    files = _fragment_files(fs.rig, big, 0)
    assert len(files) == 6 and len({p.parts[-6] for p in files}) == 6  # one fragment per storage node
    sizes = sorted(p.stat().st_size for p in _fragment_files(fs.rig, tiny, 0))
    # chunk files of 64-byte header + 8-byte block checksums + data: 10 bytes in fragment 0
    # and in each parity fragment, nothing in data fragments 1-3
    assert sizes == [64, 64, 64, 64 + 8 + 10, 64 + 8 + 10, 64 + 8 + 10]


async def test_sizes_overwrites_sparse_truncate(fs, monkeypatch):
    d = fs.dir
    rng = random.Random(7)
    sums = await _populate(fs, d, 8, seed=1)
    content = bytearray(rng.randbytes(3 * CHUNK + 4321))
    await fs.write_file(d, b"rw", bytes(content))
    fh, rw = await fs.open_path(d, b"rw", os.O_RDWR)
    for _ in range(25):
        off = rng.randrange(len(content) + CHUNK)
        piece = rng.randbytes(rng.randrange(1, CHUNK // 2))
        assert await fs.write(fh, off, piece) == len(piece)
        if off > len(content):
            content.extend(bytes(off - len(content)))
        content[off : off + len(piece)] = piece
    await fs.close(fh)
    fh, _ = await fs.open_path(d, b"sparse", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    await fs.write(fh, 5 * CHUNK + 17, b"tail")
    await fs.close(fh)
    await fs.setattr(rw, st_size=2 * CHUNK + 999)  # cut inside a stripe
    del content[2 * CHUNK + 999 :]
    await fs.setattr(rw, st_size=4 * CHUNK)  # extend: zeros
    content.extend(bytes(4 * CHUNK - len(content)))
    async with fresh(fs, monkeypatch) as other:
        for view in (fs, other):
            for name, digest in sums.items():
                assert _sha(await view.read_file(d, name)) == digest, name
            assert await view.read_file(d, b"rw") == bytes(content)
            sparse = await view.read_file(d, b"sparse")
            assert len(sparse) == 5 * CHUNK + 21 and sparse.endswith(b"tail") and not any(sparse[:-4])


async def test_two_nodes_killed_every_file_reads(fs, monkeypatch):
    sums = await _populate(fs, fs.dir, 12, seed=2)
    async with fresh(fs, monkeypatch) as other:  # started before the kill, its cache empty
        fs.rig.kill_node(2)
        fs.rig.kill_node(5)
        try:
            for name, digest in sums.items():
                assert _sha(await other.read_file(fs.dir, name)) == digest, name
        finally:
            await fs.rig.restart()


async def test_corrupt_fragment_reads_stay_correct(fs, monkeypatch):
    data = os.urandom(2 * CHUNK)
    ino = await fs.write_file(fs.dir, b"c", data)
    victim = _fragment_files(fs.rig, ino, 0)[0]  # fragment 0 of stripe 0: data, read on every healthy read
    raw = bytearray(victim.read_bytes())
    raw[-100] ^= 0xFF
    victim.write_bytes(raw)
    async with fresh(fs, monkeypatch) as other:
        assert _sha(await other.read_file(fs.dir, b"c")) == _sha(data)


async def _degraded_stripes(fs) -> int:
    status = await fs.ops.meta.call(P.StatusReq())
    (usage,) = [u for u in status.layouts if u.redundancy == "ec=4+2"]
    return usage.degraded_stripes


async def test_degraded_writes(fs, monkeypatch):
    d = fs.dir
    sums = {}
    fs.rig.kill_node(3)
    try:
        data = os.urandom(3 * CHUNK + 5)
        await fs.write_file(d, b"one_down", data)  # 5 of 6 fragments per stripe: K+1 is enough
        sums[b"one_down"] = _sha(data)
        assert await _degraded_stripes(fs) >= 4
        fs.rig.kill_node(4)
        fs.rig.expect_log(r"could not be stored")
        # 4 nodes for 6 fragments: below K+1, the write fails and nothing is committed

        async def write_two_down():
            fh, _ = await fs.open_path(d, b"two_down", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            try:
                await fs.write(fh, 0, os.urandom(CHUNK))
                await fs.fsync(fh)
            finally:
                await fs.close(fh)

        with pytest.raises(FuseError):  # at the WRITE, FSYNC or FLUSH that finds it out
            await write_two_down()
        # nothing torn, no length without its data: the file keeps what it had (nothing)
        assert (await fs.lookup(d, b"two_down")).attr.size == 0
        async with fresh(fs, monkeypatch) as other:
            assert _sha(await other.read_file(d, b"one_down")) == sums[b"one_down"]
    finally:
        await fs.rig.restart()
    async with fresh(fs, monkeypatch, "after") as other:
        assert _sha(await other.read_file(d, b"one_down")) == sums[b"one_down"]


async def test_a_node_down_with_no_spare_is_asked_about_once_not_for_every_stripe(fs, monkeypatch, caplog):
    """Six nodes for 4+2, one down: every new stripe has a fragment with no node, and the daemon has
    none to give. The mount asks once (ReplaceReplicaReq: UNAVAILABLE) and leaves such fragments
    MISSING for ``NO_SPARE_S`` without asking again; it asked for every stripe, and in the model
    run's degraded half those asks outnumbered all the daemon's other requests. The degraded
    stripes are logged once, the rest counted, not a line each."""
    import logging
    import trio
    from stripefs.client import ec_path

    monkeypatch.setattr(ec_path, "NO_SPARE_S", 600)  # (the whole test: its writes may be slow under load)
    ec = fs.ops.data.ec
    monkeypatch.setattr(ec, "_degraded_log", ec_path.LogEvery(ec_path.log, 600))
    asked = []
    real_call = ec.meta.call

    async def call(req, **kw):
        if isinstance(req, P.ReplaceReplicaReq):
            asked.append(req.failed_node)
        return await real_call(req, **kw)

    monkeypatch.setattr(ec.meta, "call", call)
    fs.rig.kill_node(6)
    try:
        with trio.fail_after(30):  # the daemon sees it down: new stripes leave it out (a fragment with no node)
            while any(n.node_id == 6 and n.state == "up" for n in (await fs.ops.meta.call(P.StatusReq())).nodes):
                await trio.sleep(0.2)
        files = {b"nospare%d" % i: os.urandom(CHUNK // 2 + i) for i in range(4)}
        with caplog.at_level(logging.WARNING, logger=ec_path.log.name):
            for name, data in files.items():  # one stripe each, one after the other
                await fs.write_file(fs.dir, name, data)
        assert asked == [ec_path.MISSING], asked  # the first stripe's ask only
        degraded = [r for r in caplog.records if "(degraded)" in r.getMessage()]
        assert len(degraded) == 1, [r.getMessage() for r in degraded]
        assert await _degraded_stripes(fs) >= 4
        async with fresh(fs, monkeypatch) as other:
            for name, data in files.items():
                assert await other.read_file(fs.dir, name) == data
    finally:
        await fs.rig.restart()


async def test_fsync_and_rewrite_same_session(fs, monkeypatch):
    fh, _ = await fs.open_path(fs.dir, b"s", os.O_RDWR | os.O_CREAT | os.O_TRUNC)
    await fs.write(fh, 0, b"a" * (CHUNK + 10))
    await fs.fsync(fh)
    await fs.write(fh, 5, b"b" * 10)  # a stripe rewritten in the same write session
    await fs.fsync(fh)
    await fs.close(fh)
    want = b"a" * 5 + b"b" * 10 + b"a" * (CHUNK - 5)
    async with fresh(fs, monkeypatch) as other:
        assert await other.read_file(fs.dir, b"s") == want


async def test_small_writes_update_parity_by_delta_and_every_fragment_matches_a_full_encode(fs, monkeypatch):
    """Partial-stripe writes, each its own session (open, write, close), go the delta path (counted
    in stripefs_ec_stripe_writes_total), the data fragments a delta does not touch are not written
    and keep their version (ChunkRef ``fversions``, counted in stripefs_ec_fragments_kept_total),
    and afterwards every fragment on its node is exactly what coding the whole new stripe gives,
    in the slot of its own committed version."""
    from stripefs.client import metrics

    rng = random.Random(35)
    want = bytearray(rng.randbytes(2 * CHUNK + 300_000))
    await fs.write_file(fs.dir, b"d", bytes(want))
    delta, full = metrics.EC_STRIPE_WRITES.labels("delta"), metrics.EC_STRIPE_WRITES.labels("full")
    before = delta._value.get(), full._value.get()
    kept_before = metrics.EC_FRAGMENTS_KEPT._value.get()
    # across two stripes, across two data fragments, past the end of the file, in a data fragment's trimmed tail
    writes = [(0, 1), (CHUNK - 3, 7), (CHUNK // 4 - 10, 20), (2 * CHUNK + 290_000, 20_000), (5, 200_000)]
    writes += [(rng.randrange(len(want)), rng.randrange(1, 5000)) for _ in range(8)]
    for offset, n in writes:
        data = rng.randbytes(n)
        fh, ino = await fs.open_path(fs.dir, b"d", os.O_WRONLY)
        try:
            await fs.write(fh, offset, data)
        finally:
            await fs.close(fh)
        want[offset : offset + n] = data
    stripes = sum(len(range(o // CHUNK, (o + n - 1) // CHUNK + 1)) for o, n in writes)
    assert (delta._value.get() - before[0], full._value.get() - before[1]) == (stripes, 0)  # every stripe by delta
    # a delta touching one data fragment of four leaves three where they are: no empty copy-on-write write
    assert metrics.EC_FRAGMENTS_KEPT._value.get() - kept_before >= 2 * stripes

    info = await _fragments_match_a_full_encode(fs, ino, want)
    assert all(len(set(ref.fversions)) > 1 for ref in info.chunks)  # every stripe has a fragment left behind
    async with fresh(fs, monkeypatch) as other:
        assert await other.read_file(fs.dir, b"d") == bytes(want)


async def test_a_stripe_rewritten_in_pieces_is_read_from_the_nodes_once(fs, monkeypatch):
    """Write-through (EcPath._delta_kept, ``keep`` of a read-modify-write): the stripe the mount just
    wrote is what its nodes now hold, so after one read of it, the pieces written to it (by parity
    delta, or as columns within a session) and the reads after each load nothing from the nodes,
    and what they see is right, here and on a fresh client."""
    from stripefs.client import metrics

    rng = random.Random(351)
    want = bytearray(rng.randbytes(CHUNK + 1000))
    await fs.write_file(fs.dir, b"pieces", bytes(want))
    fh, _ = await fs.open_path(fs.dir, b"pieces", os.O_RDWR)
    try:
        assert await fs.read(fh, 0, CHUNK) == bytes(want[:CHUNK])  # the data fragments, read once
        misses = metrics.CACHE_MISSES._value.get()
        # 10: its own session (fsync commits), by delta; 300_000: the next session's first piece, by
        # delta; 600_000 and 5: that session's later pieces, written as columns of its own version
        # from the fragments held
        for offset, commit in ((10, True), (300_000, False), (600_000, False), (5, False)):
            data = rng.randbytes(3000)
            await fs.write(fh, offset, data)
            want[offset : offset + len(data)] = data
            if commit:
                await fs.fsync(fh)
            assert await fs.read(fh, 0, CHUNK) == bytes(want[:CHUNK])  # sends the piece first
        assert metrics.CACHE_MISSES._value.get() == misses
        await fs.fsync(fh)
    finally:
        await fs.close(fh)
    async with fresh(fs, monkeypatch) as other:
        assert await other.read_file(fs.dir, b"pieces") == bytes(want)


async def test_later_pieces_of_a_session_write_only_their_columns_and_every_fragment_matches_a_full_encode(fs, monkeypatch):
    """A stripe the mount holds: its first piece is a parity delta whose parity is coded from the
    stripe held (EcPath._send_delta, nothing read), its later pieces in the session go the columns
    path (EcPath._rewrite_columns, counted), writing the touched data fragments and the parity only,
    and afterwards every fragment on its node, parity included, is what coding the whole stripe gives."""
    from stripefs.client import metrics
    from stripefs.common.erasure import codec, fragment_part
    from stripefs.common.transport import connect
    import zmq

    rng = random.Random(352)
    want = bytearray(rng.randbytes(CHUNK + 5000))
    await fs.write_file(fs.dir, b"cols", bytes(want))
    paths = {k: metrics.EC_STRIPE_WRITES.labels(k) for k in ("delta", "columns", "full")}
    before = {k: c._value.get() for k, c in paths.items()}
    fh, ino = await fs.open_path(fs.dir, b"cols", os.O_RDWR)
    try:
        assert await fs.read(fh, 0, CHUNK) == bytes(want[:CHUNK])  # held now: no parity is read below
        # each read sends the piece before it; the first piece is a parity delta of the committed
        # stripe, the next ones columns of the session's own version (across two data fragments,
        # in one fragment's tail, at the stripe's start)
        for offset, n in ((100, 10), (CHUNK // 4 - 7, 20), (CHUNK - 50, 40), (0, 3), (CHUNK // 2 + 1, 70_000)):
            data = rng.randbytes(n)
            await fs.write(fh, offset, data)
            want[offset : offset + n] = data
            assert await fs.read(fh, 0, CHUNK) == bytes(want[:CHUNK])
        await fs.fsync(fh)
    finally:
        await fs.close(fh)
    assert {k: c._value.get() - before[k] for k, c in paths.items()} == {"delta": 1, "columns": 4, "full": 0}
    c = codec(4, 2, CHUNK)
    info = await fs.ops.meta.call(P.OpenReq(ino=ino, session_id=fs.ops.meta.session_id))
    ref = info.chunks[0]
    expected = c.encode(bytes(want[:CHUNK]))
    ctx = zmq.Context()
    try:
        for j, node in enumerate(ref.nodes):
            async with connect(ctx, fs.rig.node_addresses[node], timeout=10) as client:
                rsp, frames = await client.call(P.ReadChunkReq(
                    chunk=P.ChunkId(ino, 0, fragment_part(j, ref.fragment_version(j))), min_version=ref.fragment_version(j), offset=0,
                    length=CHUNK))
            assert rsp.version == ref.fragment_version(j)
            assert b"".join(bytes(f) for f in frames).ljust(c.fps, b"\0") == expected[j].ljust(c.fps, b"\0"), j
    finally:
        ctx.destroy(linger=0)
    async with fresh(fs, monkeypatch) as other:
        assert await other.read_file(fs.dir, b"cols") == bytes(want)


async def test_a_columns_write_that_fails_writes_the_stripe_whole(fs, monkeypatch):
    """A later piece of the session's stripe whose column write fails on a node (killed after the
    session's first piece) may have torn the session's version: the stripe is written whole from
    what the mount holds (counted as delta_fallback), degraded without that node, and reads right."""
    from stripefs.client import metrics

    rng = random.Random(353)
    want = bytearray(rng.randbytes(CHUNK + 100))
    await fs.write_file(fs.dir, b"torn", bytes(want))
    fallback = metrics.EC_STRIPE_WRITES.labels("delta_fallback")
    fh, ino = await fs.open_path(fs.dir, b"torn", os.O_RDWR)
    try:
        assert await fs.read(fh, 0, CHUNK) == bytes(want[:CHUNK])  # held: the pieces below need no read
        info = await fs.ops.meta.call(P.OpenReq(ino=ino, session_id=fs.ops.meta.session_id))
        for offset in (100, 300_000):  # a parity delta, then a columns write with a parity node dead
            data = rng.randbytes(50)
            await fs.write(fh, offset, data)
            want[offset : offset + len(data)] = data
            before = fallback._value.get()
            if offset == 300_000:
                fs.rig.kill_node(info.chunks[0].nodes[4])
            assert await fs.read(fh, 0, CHUNK) == bytes(want[:CHUNK])
        assert fallback._value.get() == before + 1
        await fs.fsync(fh)
    finally:
        await fs.close(fh)
        await fs.rig.restart()
    async with fresh(fs, monkeypatch) as other:
        assert await other.read_file(fs.dir, b"torn") == bytes(want)


async def test_a_stripe_with_fragments_at_different_versions_decodes_rewrites_and_cuts(fs, monkeypatch):
    """A parity delta leaves the untouched data fragments at their version (ChunkRef ``fversions``):
    such a stripe takes a delta on a fragment left behind (its new version of the other parity than
    its own: the slot its own version does not use), decodes from fragments of three versions with
    two nodes dead, takes a truncate's cut and a whole rewrite, and reads right after each."""

    async def session(offset: int, data: bytes) -> None:
        fh, _ = await fs.open_path(fs.dir, b"mixed", os.O_WRONLY)
        try:
            await fs.write(fh, offset, data)
        finally:
            await fs.close(fh)
        want[offset : offset + len(data)] = data

    async def current() -> P.ChunkRef:
        info = await fs.ops.meta.call(P.OpenReq(ino=ino, session_id=fs.ops.meta.session_id))
        return info.chunks[0]

    async def reads_right(name: str) -> None:
        async with fresh(fs, monkeypatch, name) as other:
            assert await other.read_file(fs.dir, b"mixed") == bytes(want)

    rng = random.Random(3535)
    want = bytearray(rng.randbytes(CHUNK))
    ino = await fs.write_file(fs.dir, b"mixed", bytes(want))
    first = await current()
    await session(100, rng.randbytes(50))  # fragment 0 and the parity move; 1, 2, 3 stay
    ref = await current()
    assert [ref.fragment_version(j) for j in range(6)] == [ref.version] + [first.version] * 3 + [ref.version] * 2
    await session(CHUNK // 4 + 10, rng.randbytes(30))  # fragment 1, left at the older version, moves now
    again = await current()
    assert again.fragment_version(1) > ref.version and again.fragment_version(2) == first.version
    assert (again.fragment_version(1) & 1) != (first.version & 1) and (again.fragment_version(4) & 1) != (ref.version & 1)
    await reads_right("second-delta")
    fs.rig.kill_node(again.nodes[1])  # fragments of all three versions left: 0, 2 or 3, the parity
    fs.rig.kill_node(again.nodes[3])
    try:
        await reads_right("degraded")
    finally:
        await fs.rig.restart()
    await fs.setattr(ino, st_size=CHUNK - 1000)  # the cut: fragment 3 and the parity change, 0-2 stay where they are
    del want[CHUNK - 1000 :]
    await reads_right("cut")
    await session(0, rng.randbytes(CHUNK - 1000))  # the whole stripe anew
    await reads_right("whole")


async def test_an_fsync_after_a_delta_syncs_the_fragments_it_left_behind(fs, monkeypatch):
    """The data fragments a parity delta does not write stay part of the new version, so an fsync
    makes them durable as it makes the written ones (the commit that made them did not sync them)."""
    from stripefs.common.erasure import fragment_part

    ino = await fs.write_file(fs.dir, b"synced", os.urandom(CHUNK))
    (ref,) = (await fs.ops.meta.call(P.OpenReq(ino=ino, session_id=fs.ops.meta.session_id))).chunks
    ec = fs.ops.data.ec
    synced: list[tuple[int, P.ChunkId]] = []
    real = ec.nodes.sync_each

    async def sync_each(by_node):
        synced.extend((node, c) for node, chunks in by_node.items() for c in chunks)
        return await real(by_node)

    monkeypatch.setattr(ec.nodes, "sync_each", sync_each)
    ec.forget_unsynced(ino)  # the first write's fragments (never fsynced): only the delta's count here
    fh, _ = await fs.open_path(fs.dir, b"synced", os.O_WRONLY)
    try:
        await fs.write(fh, 100, b"x" * 10)  # data fragment 0 only
        await fs.fsync(fh)
    finally:
        await fs.close(fh)
    kept = {(ref.nodes[j], P.ChunkId(ino, 0, fragment_part(j, ref.version))) for j in (1, 2, 3)}
    assert kept <= set(synced)


async def test_a_whole_stripe_write_leaves_the_data_fragments_it_does_not_change(fs, monkeypatch):
    """A truncate's cut and a read-modify-write (a partial write of more than half a stripe: no delta)
    code the stripe whole, but a data fragment whose bytes they do not change is not written: it keeps
    its version (ChunkRef ``fversions``, counted in stripefs_ec_fragments_unchanged_total), the data
    fragments the write covers whole are not read (stripefs_ec_fragment_reads_spared_total), and every
    fragment on its node is still what coding the whole new stripe gives."""
    from stripefs.client import metrics

    unchanged = metrics.EC_FRAGMENTS_UNCHANGED
    rng = random.Random(3536)
    want = bytearray(rng.randbytes(CHUNK))
    ino = await fs.write_file(fs.dir, b"kept", bytes(want))
    (first,) = (await fs.ops.meta.call(P.OpenReq(ino=ino, session_id=fs.ops.meta.session_id))).chunks
    before, spared = unchanged._value.get(), metrics.EC_FRAGMENT_READS_SPARED._value.get()
    await fs.setattr(ino, st_size=CHUNK // 4 + 100)  # the cut: fragment 0 as it was, 1-3 change (zeros), the parity
    del want[CHUNK // 4 + 100 :]
    assert unchanged._value.get() - before == 1
    (cut,) = (await fs.ops.meta.call(P.OpenReq(ino=ino, session_id=fs.ops.meta.session_id))).chunks
    assert cut.fragment_version(0) == first.version and all(cut.fragment_version(j) > first.version for j in range(1, 6))

    data = rng.randbytes(CHUNK * 5 // 8)  # fragments 1, 2 and part of 3: fragment 0 and the rest of 3 read
    fh, _ = await fs.open_path(fs.dir, b"kept", os.O_WRONLY)
    try:
        await fs.write(fh, CHUNK // 4, data)
    finally:
        await fs.close(fh)
    want[CHUNK // 4 : CHUNK // 4 + len(data)] = data
    assert unchanged._value.get() - before == 2
    assert metrics.EC_FRAGMENT_READS_SPARED._value.get() - spared == 2  # 1 and 2, written over whole: not read
    info = await _fragments_match_a_full_encode(fs, ino, want)
    (ref,) = info.chunks
    assert ref.fragment_version(0) == first.version and ref.fragment_version(1) > cut.fragment_version(1)
    async with fresh(fs, monkeypatch, "kept") as other:
        assert await other.read_file(fs.dir, b"kept") == bytes(want)


async def test_nodes_this_mount_found_slow_still_take_a_full_stripe(fs, monkeypatch):
    """A node the mount marked slow (a hedged read answered elsewhere first: ``note_slow``) is asked
    last, never left out: with every node so marked, a 2+1 stripe on 6 nodes is still written whole,
    not degraded with a fragment MISSING (a node killed next would lose it; CI saw 'lost: 3')."""
    d = await fs.mkdir(fs.dir, b"slow")
    await fs.ops.meta.call(P.SetLayoutReq(ino=d, redundancy="ec=2+1"))
    for node in range(1, 7):
        fs.ops.data.nodes.note_slow(node)
    data = os.urandom(3 * CHUNK + 5)
    ino = await fs.write_file(d, b"f", data)
    for index in range(4):
        files = _fragment_files(fs.rig, ino, index)
        assert len({p.parts[-6] for p in files}) == 3, (index, files)
    status = await fs.ops.meta.call(P.StatusReq())
    assert all(u.degraded_stripes == 0 for u in status.layouts if u.redundancy == "ec=2+1"), status.layouts
    async with fresh(fs, monkeypatch) as other:
        assert _sha(await other.read_file(d, b"f")) == _sha(data)
