"""Replicas of one committed chunk version never diverge (docs/design.md "Write sessions").

A write session stores a replicated chunk's new version in the slot the committed
version does not use (common/layout.py "Slots"), so a writer that dies after some
replicas took a range and others did not leaves the committed bytes as they were on
every replica. The copies are read here straight from each storage node, not
through a client, which would hide a divergent replica behind the one it asks.
"""

import math
import os
import signal

import pytest
import trio
import xxhash
import zmq

from stripefs.common import protocol as P
from stripefs.client.striping import MAX_DIRTY_CHUNKS
from stripefs.common.transport import connect

from fsapi import Kernel, open_fs

KiB = 1 << 10


async def _copies(ctx: zmq.Context, address: str, ino: int, index: int = 0) -> dict[int, int]:
    """part -> version of every copy of chunk ``ino:index`` a node holds (its inventory)."""
    out = {}
    async with connect(ctx, address, timeout=10) as node:
        start = 0
        while start >= 0:
            rsp, _ = await node.call(P.ListChunksReq(start_dir=start, max_dirs=1 << 16))
            out.update({c.part: v for c, v in zip(rsp.chunks, rsp.versions) if (c.ino, c.index) == (ino, index)})
            start = rsp.next_dir
    return out


async def _read_copy(ctx: zmq.Context, address: str, chunk: P.ChunkId, version: int) -> bytes:
    async with connect(ctx, address, timeout=10) as node:
        rsp, frames = await node.call(P.ReadChunkReq(chunk=chunk, min_version=version, offset=0, length=4 << 20))
    assert rsp.version == version
    return b"".join(bytes(f) for f in frames)


async def _committed_bytes(ctx: zmq.Context, rig, ino: int, ref: P.ChunkRef) -> dict[int, bytes | None]:
    """node -> the bytes its copy of ``ref``'s committed version holds (None: it holds none of that version)."""
    out: dict[int, bytes | None] = {}
    for node_id in ref.nodes:
        address = rig.node_addresses[node_id]
        parts = [part for part, v in (await _copies(ctx, address, ino, ref.index)).items() if v == ref.version]
        out[node_id] = await _read_copy(ctx, address, P.ChunkId(ino, ref.index, parts[0]), ref.version) if parts else None
    return out


async def _chunk0(fs, ino: int) -> P.ChunkRef:
    rsp = await fs.ops.meta.call(P.OpenReq(ino=ino, session_id=fs.ops.meta.session_id))
    return rsp.chunks[0]


async def _wait(predicate, what: str, timeout: float = 20) -> None:
    """Poll ``predicate`` (async) until it holds: a condition, not a guessed sleep."""
    with trio.move_on_after(timeout):
        while not await predicate():
            await trio.sleep(0.05)
        return
    pytest.fail(f"timed out waiting for {what}")


@pytest.mark.parametrize("replicas", [2, 3])
async def test_a_writer_killed_mid_session_leaves_every_replica_committed_bytes_identical(fs, monkeypatch, replicas):
    rig = fs.rig
    d = await fs.mkdir(fs.dir, b"r%d" % replicas)
    await fs.ops.meta.call(P.SetLayoutReq(ino=d, redundancy=f"replicas={replicas}"))
    old = os.urandom(300 * KiB)
    ino = await fs.write_file(d, b"f", old)
    ref = await _chunk0(fs, ino)
    assert len(ref.nodes) == replicas and ref.version
    stopped, took = ref.nodes[-1], ref.nodes[:-1]
    ctx = zmq.Context()
    rig.expect_log(r"could not be stored", r"no replica took the write")
    try:
        # the writer: its own client, a range sent to every replica; one replica's node is
        # stopped, so the others take it and this one does not, then the writer dies
        os.kill(rig.procs[f"storage-{stopped}"].pid, signal.SIGSTOP)
        try:
            async with trio.open_nursery() as nursery:
                async def writer(task_status=trio.TASK_STATUS_IGNORED):
                    async with open_fs(rig, Kernel(monkeypatch), "inprocess:doomed-writer") as w:
                        w.release_all = _nothing  # killed: nothing is released, flushed or committed
                        fh, _ = await w.open_path(d, b"f", os.O_WRONLY)
                        task_status.started()
                        await w.write(fh, 1000, b"N" * 5000)
                        for i in range(1, MAX_DIRTY_CHUNKS + 1):  # more partial chunks than a file holds unsent:
                            await w.write(fh, i * (4 << 20) + 10, b"M")  # chunk 0's range is sent now, alone
                        await trio.sleep(math.inf)

                await nursery.start(writer)

                async def taken() -> bool:
                    for node_id in took:
                        copies = await _copies(ctx, rig.node_addresses[node_id], ino)
                        if not any(v > ref.version for v in copies.values()):
                            return False
                    return True

                await _wait(taken, "the running replicas to take the writer's range")
                nursery.cancel_scope.cancel()  # the writer dies mid-session
        finally:
            rig.kill_node(stopped)  # what it had received of the writer dies with it
        await rig.restart()

        # every replica still holds the committed version, byte for byte
        committed = await _committed_bytes(ctx, rig, ino, await _chunk0(fs, ino))
        assert all(data == old for data in committed.values()), {n: data is not None and data[:8] for n, data in committed.items()}
        assert await fs.read_file(d, b"f") == old

        # the next session's commit makes the dead writer's copies garbage: each node ends with one copy
        new = os.urandom(300 * KiB)
        fh, _ = await fs.open_path(d, b"f", os.O_WRONLY)  # no O_TRUNC: the chunk keeps its row
        try:
            await fs.write(fh, 0, new)
        finally:
            await fs.close(fh)
        ref = await _chunk0(fs, ino)

        async def collected() -> bool:
            for node_id in ref.nodes:
                copies = await _copies(ctx, rig.node_addresses[node_id], ino)
                if list(copies.values()) != [ref.version]:
                    return False
            return True

        await _wait(collected, "the old and abandoned copies to be deleted")
        assert set((await _committed_bytes(ctx, rig, ino, ref)).values()) == {new}
    finally:
        ctx.destroy(linger=0)


async def _nothing() -> None:
    pass


@pytest.mark.parametrize("replicas", [2, 3])
async def test_scrub_finds_and_repairs_a_replica_with_other_bytes_under_the_same_version(fs, replicas):
    """Each node's own checksums pass such a copy (they were computed from its bytes): only a
    comparison across the replicas finds it. The planted copy is the one written last, so it
    loses with 2 replicas (no majority: the copy written first wins) and with 3 (the majority)."""
    rig = fs.rig
    d = await fs.mkdir(fs.dir, b"s%d" % replicas)
    await fs.ops.meta.call(P.SetLayoutReq(ino=d, redundancy=f"replicas={replicas}"))
    old = os.urandom(200 * KiB)
    ino = await fs.write_file(d, b"f", old)
    ref = await _chunk0(fs, ino)
    planted = ref.nodes[0]
    ctx = zmq.Context()
    try:
        address = rig.node_addresses[planted]
        (part,) = [part for part, v in (await _copies(ctx, address, ino)).items() if v == ref.version]
        other = bytearray(old)
        other[50_000:50_010] = b"0123456789"
        async with connect(ctx, address, timeout=10) as node:
            await node.call(
                P.WriteChunkReq(chunk=P.ChunkId(ino, 0, part), version=ref.version, base_version=0, offset=0,
                                xxh3=xxhash.xxh3_64_intdigest(other), replace=True),
                [bytes(other)],
            )
        before = await _committed_bytes(ctx, rig, ino, ref)
        assert before[planted] == other and all(before[n] == old for n in ref.nodes[1:])

        rsp = await fs.ops.meta.call(P.ScrubReq(inos=[ino]))
        assert (rsp.diverged, rsp.bad, rsp.repairing) == (1, 1, 1)

        async def repaired() -> bool:
            now = await _chunk0(fs, ino)
            if len(now.nodes) != replicas:
                return False
            return set((await _committed_bytes(ctx, rig, ino, now)).values()) == {old}

        await _wait(repaired, "the diverged replica to be replaced by a copy of the others")
        assert (await fs.ops.meta.call(P.ScrubReq(inos=[ino]))).bad == 0
    finally:
        ctx.destroy(linger=0)
