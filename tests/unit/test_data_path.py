"""The mount's data path (client/striping.py) without a kernel: a real metadata daemon process,
real storage nodes in this process, over real ZeroMQ, driven through ``DataPath`` directly.

What it pins down: the ordering and failure rules of write sessions (client/open_files.py) that
the kernel makes hard to hit on purpose: WRITEs of one file arriving at once (the kernel's
writeback of mmap'd pages), sends of one chunk taken in one order and run in another, and a
failed send, which must never let a length be committed without its data.
"""

from __future__ import annotations

import errno
from contextlib import AsyncExitStack

import pytest
import trio
import trio.testing
import zmq

from stripefs.client.chunk_cache import ChunkCache
from stripefs.client.data_rpc import NodePool
from stripefs.client.meta_rpc import MetaClient
from stripefs.client.open_files import DirtyChunk, OpenFile
from stripefs.client.striping import DataPath
from stripefs.common import protocol as P
from stripefs.common.config import MetaConfig, StorageConfig, load
from stripefs.common.errors import StripefsError, leaves
from stripefs.daemon.service import MetaService
from stripefs.storage_node.chunk_store import ChunkStore
from stripefs.storage_node.service import StorageService
from test_meta_service import ROOT, Daemon
from test_meta_service import _free_address as _addr

CS = 64 << 10
PAGE = 4096


class Rig:
    """A daemon (replicas=2, 64 KiB chunks), two storage nodes that can be stopped and started
    again on the same data, and a DataPath as the mount builds it."""

    def __init__(self, tmp_path, nursery: trio.Nursery, ctx: zmq.Context):
        self.tmp, self.nursery, self.ctx = tmp_path, nursery, ctx
        self.daemon = Daemon(tmp_path)
        self.daemon.config.write_text(
            self.daemon.config.read_text().replace('chunk_size = "1M"', 'chunk_size = "64K"').replace("replicas=1", "replicas=2")
        )
        self.nodes: dict[int, tuple[StorageConfig, ChunkStore, trio.CancelScope | None]] = {}
        self._stopped: dict[int, trio.Event] = {}  # node id -> set once its service has ended
        self.data: DataPath
        self.meta: MetaClient

    async def start_node(self, node_id: int) -> None:
        if node_id not in self.nodes:
            cfg = StorageConfig(
                node_id=node_id, listen=_addr(), data_dir=str(self.tmp / f"node{node_id}"), meta=[self.daemon.address],
                reserved_space=0, scrub_bandwidth=0, heartbeat_interval_s=0.5, metrics="",
            )
            (self.tmp / f"node{node_id}").mkdir()
            store = ChunkStore(self.tmp / f"node{node_id}", reserved_space=0, node_id=node_id)
            self.nodes[node_id] = (cfg, store, None)
        cfg, store, _ = self.nodes[node_id]

        async def serve(task_status=trio.TASK_STATUS_IGNORED):
            stopped = self._stopped[node_id] = trio.Event()
            try:
                with trio.CancelScope() as scope:
                    self.nodes[node_id] = (cfg, store, scope)
                    await StorageService(cfg, store, ctx=self.ctx).run(task_status=task_status)
            finally:
                stopped.set()  # its fast lane thread has closed its sockets (common/fast_lane.py)

        for attempt in range(100):
            try:
                await self.nursery.start(serve)
                return
            except BaseException as exc:
                # the same port again: libzmq releases a closed socket's listener a moment later
                # (the service's nursery wraps the bind's error in an exception group)
                in_use = any(isinstance(e, zmq.ZMQError) and e.errno == errno.EADDRINUSE for e in leaves(exc))
                if not in_use or attempt == 99:
                    raise
                await trio.sleep(0.05)

    async def stop_node(self, node_id: int) -> None:
        """Stop a node and wait until its fast lane thread has closed its sockets: until then the lane
        still answers the requests it does itself (small reads, writes, syncs: common/fast_lane.py)."""
        cfg, store, scope = self.nodes[node_id]
        scope.cancel()
        self.nodes[node_id] = (cfg, store, None)
        await self._stopped[node_id].wait()

    async def stop_all(self) -> None:
        """Stop every node and wait until each has closed its sockets: a context destroyed
        under a lane thread still polling them is undefined behaviour in libzmq (a crash)."""
        for node_id, (_, _, scope) in list(self.nodes.items()):
            if scope is not None:
                await self.stop_node(node_id)
        for stopped in self._stopped.values():
            await stopped.wait()

    async def create(self, name: bytes, parent: int = ROOT) -> OpenFile:
        rsp = await self.meta.call(P.CreateReq(parent=parent, name=name, mode=0o100644, uid=0, gid=0, session_id=self.meta.session_id))
        self.data.nodes.learn(rsp.nodes)
        of = OpenFile(rsp.attr.ino, rsp.attr, rsp.layout, {c.index: c for c in rsp.chunks})
        of.epoch = rsp.epoch
        return of

    async def committed(self, of: OpenFile) -> tuple[int, bytes]:
        """The file as another mount opening it now sees it: (size, bytes)."""
        rsp = await self.meta.call(P.OpenReq(ino=of.ino, session_id=self.meta.session_id))
        self.data.nodes.learn(rsp.nodes)
        fresh = OpenFile(of.ino, rsp.attr, rsp.layout, {c.index: c for c in rsp.chunks})
        reader = DataPath(self.meta, self.data.nodes, ChunkCache(16 << 20), self.nursery, readahead_chunks=0, write_parallelism=1)
        return rsp.attr.size, bytes(await reader.read(fresh, 0, rsp.attr.size + 1))


@pytest.fixture
async def rig(tmp_path, nursery):
    ctx = zmq.Context()
    r = Rig(tmp_path, nursery, ctx)
    r.daemon.start()
    try:
        await r.daemon.wait_ready(ctx)
        for node_id in (1, 2, 3):  # replicas=2; ec=2+1 in a directory that asks for it
            await r.start_node(node_id)
        async with AsyncExitStack() as stack:
            r.meta = MetaClient(ctx, [r.daemon.address], timeout=5.0, retry_window_s=20.0)
            await r.meta.open(stack)
            await r.meta.hello("test_data_path", patience_s=10)
            with trio.fail_after(30):  # every node registered and up (a loaded machine registers late): ec=2+1 needs 3
                while sum(n.state == "up" for n in (await r.meta.call(P.StatusReq())).nodes) < 3:
                    await trio.sleep(0.05)
            pool = NodePool(ctx, nursery, timeout=2.0, read_timeout=2.0)
            r.data = DataPath(r.meta, pool, ChunkCache(16 << 20), nursery, readahead_chunks=0, write_parallelism=2)
            yield r
            with trio.CancelScope(shield=True):
                await r.stop_all()
            nursery.cancel_scope.cancel()
    finally:
        r.daemon.stop()
        for _, store, _ in r.nodes.values():
            store.close()
        ctx.destroy(linger=0)


async def test_writes_of_one_chunk_arriving_at_once_all_land(rig):
    """The kernel's writeback of mmap'd pages: WRITEs of scattered pages of one chunk, concurrently.
    Each non-contiguous page sends the chunk's buffered range first; while it waits, the others
    buffer theirs. Every page must be stored (a range was overwritten in the buffer before)."""
    of = await rig.create(b"pages")
    order = [0, 2, 4, 6, 1, 3, 5, 7, 12, 9, 14, 11, 8, 15, 10, 13]
    want = bytearray(16 * PAGE)
    async with trio.open_nursery() as writers:
        for page in order:
            data = bytes([page + 1]) * PAGE
            want[page * PAGE : (page + 1) * PAGE] = data
            writers.start_soon(rig.data.write, of, page * PAGE, data)
    await rig.data.flush(of)
    assert await rig.committed(of) == (len(want), bytes(want))


async def test_sends_of_one_chunk_apply_in_the_order_their_ranges_were_taken(rig):
    """A range sent in the background and a later, overlapping range of the same chunk sent
    inline: whichever task runs first, the later range wins."""
    of = await rig.create(b"order")
    of.dirty[0] = DirtyChunk(0, bytearray(b"a" * 300), 0, 300)
    first = of.take(0)
    of.dirty[0] = DirtyChunk(0, bytearray(b"\0" * 100 + b"b" * 100), 100, 200)
    second = of.take(0)
    of.size = of.written_end = 300
    async with trio.open_nursery() as senders:
        senders.start_soon(rig.data._send, of, second)  # started first, must wait for the first range
        await trio.sleep(0.5)  # time enough to store it if it did not wait (then the first range would win)
        senders.start_soon(rig.data._send, of, first)
    await rig.data.flush(of)
    assert await rig.committed(of) == (300, b"a" * 100 + b"b" * 100 + b"a" * 100)


async def test_a_write_no_node_takes_is_reported_once_and_never_committed(rig):
    """Every node gone: the flush (close) fails; the next flush (the kernel's RELEASE) must not
    commit the size the lost write had reached. The file keeps its content; later writes work."""
    of = await rig.create(b"lost")
    await rig.data.write(of, 0, b"old content\n")
    await rig.data.flush(of)
    for node_id in list(rig.nodes):
        await rig.stop_node(node_id)
    await rig.data.write(of, 0, b"new content, longer than the old one\n")
    with pytest.raises(StripefsError):
        await rig.data.flush(of)
    await rig.data.flush(of)  # reported once; nothing left to commit
    assert of.size == len(b"old content\n")
    for node_id in list(rig.nodes):
        await rig.start_node(node_id)
    assert await rig.committed(of) == (12, b"old content\n")
    await rig.data.write(of, 12, b"more\n")  # a new write session
    await rig.data.flush(of)
    assert await rig.committed(of) == (17, b"old content\nmore\n")


async def test_writes_after_a_failed_send_are_refused_until_the_error_is_reported(rig):
    of = await rig.create(b"refused")
    for node_id in list(rig.nodes):
        await rig.stop_node(node_id)
    await rig.data.write(of, 0, b"x" * CS)  # a whole chunk: sent in the background, fails there
    await of.idle.wait()
    with pytest.raises(StripefsError):
        await rig.data.write(of, CS, b"y")
    with pytest.raises(StripefsError):
        await rig.data.flush(of)
    assert (of.size, of.dirty, of.uncommitted) == (0, {}, {})
    for node_id in list(rig.nodes):
        await rig.start_node(node_id)
    await rig.data.write(of, 0, b"z")
    await rig.data.flush(of)
    assert await rig.committed(of) == (1, b"z")


async def test_a_chunk_rewritten_after_a_truncate_shows_no_bytes_of_before(rig):
    """Truncated chunks are deleted on their nodes later (garbage); a write into such a chunk
    index before that must not merge with the old copy: the part before it is a hole (zeros)."""
    of = await rig.create(b"regrown")
    await rig.data.write(of, 0, b"o" * (2 * CS))
    await rig.data.flush(of)
    await rig.data.truncate(of, CS)  # chunk 1 dropped: its copies wait for deletion
    await rig.data.write(of, CS + 1000, b"new")
    await rig.data.flush(of)
    assert await rig.committed(of) == (CS + 1003, b"o" * CS + bytes(1000) + b"new")


async def test_a_stripe_written_after_a_truncate_in_the_same_session_is_not_lost(rig):
    """A write session that began before a truncate (the epoch a writable open hands out) must
    still write a version newer than the stripe the truncate cut, or the daemon keeps that one."""
    d = (await rig.meta.call(P.MkdirReq(parent=ROOT, name=b"ec", mode=0o40755, uid=0, gid=0))).attr.ino
    await rig.meta.call(P.SetLayoutReq(ino=d, redundancy="ec=2+1"))
    for i in range(4):
        of = await rig.create(b"s%d" % i, parent=d)
        await rig.data.write(of, 0, b"a" * (2 * CS))
        await rig.data.flush(of)
        for _ in range(i):  # other writers take epochs meanwhile: every parity order happens
            await rig.meta.call(P.AllocEpochReq())
        reopened = await rig.meta.call(P.OpenReq(ino=of.ino, session_id=rig.meta.session_id, write=True))
        of.epoch = reopened.epoch  # as Operations._opened takes it
        await rig.data.truncate(of, CS + 100)
        await rig.data.write(of, CS + 10, b"b" * 10)
        await rig.data.flush(of)
        want = b"a" * (CS + 10) + b"b" * 10 + b"a" * 80
        assert await rig.committed(of) == (CS + 100, want), i


@pytest.mark.parametrize("layout", ["replicas=2", "ec=2+1"])
async def test_records_written_out_of_order_keep_the_stored_bytes_between_them(rig, layout):
    """Writes that leave gaps and fill some later (two writers' interleaved records) are buffered
    as ranges of one chunk: where the chunk has stored data the gaps keep it, over a hole they
    read as zeros, and a fresh chunk whose gaps are filled goes out as one send."""
    d = (await rig.meta.call(P.MkdirReq(parent=ROOT, name=b"recs-" + layout.encode(), mode=0o40755, uid=0, gid=0))).attr.ino
    await rig.meta.call(P.SetLayoutReq(ino=d, redundancy=layout))
    of = await rig.create(b"f", parent=d)
    old = bytes(range(256)) * (CS // 256) + b"z" * 3000  # chunk 0 stored, chunk 1 partly
    await rig.data.write(of, 0, old)
    await rig.data.flush(of)
    want = bytearray(old) + bytearray(3 * CS - len(old))
    rec = 1000
    order = [k for k in range(3 * CS // rec) if k % 3 == 0] + [k for k in range(3 * CS // rec) if k % 3 == 1]  # 2 of 3
    sends = 0
    real_write = rig.data.nodes.write

    async def counting_write(node_id, req, payload):
        nonlocal sends
        sends += 1
        return await real_write(node_id, req, payload)

    rig.data.nodes.write = counting_write
    for k in order:
        data = bytes([k % 251 + 1]) * rec
        await rig.data.write(of, k * rec, data)
        want[k * rec : k * rec + rec] = data
    await rig.data.flush(of)
    size = max(len(old), (max(order) + 1) * rec)
    assert await rig.committed(of) == (size, bytes(want[:size]))
    if layout == "replicas=2":  # one send per chunk and replica (there was one per record and replica)
        assert sends == 6, sends
    # the gaps filled in: the fresh chunk 2 is one range, sent once per replica
    of2 = await rig.create(b"g", parent=d)
    sends = 0
    for k in [k for k in range(CS // rec) if k % 2 == 0] + [k for k in range(CS // rec) if k % 2 == 1]:
        await rig.data.write(of2, k * rec, bytes([k % 251 + 1]) * rec)
    await rig.data.flush(of2)
    n = CS // rec * rec
    assert await rig.committed(of2) == (n, b"".join(bytes([k % 251 + 1]) * rec for k in range(CS // rec)))
    if layout == "replicas=2":
        assert sends == 2, sends


@pytest.mark.parametrize("layout", ["replicas=2", "ec=2+1"])
async def test_a_placement_made_ahead_never_hides_a_version_written_meanwhile(rig, layout):
    """Placing chunk 1 also places chunk 2 ahead (alloc_indices). When chunk 2 is written and
    recorded while that reply is still on its way, the late reply must not put chunk 2 back to
    its bare placement: reads would return a hole (zeros) where the data was, until the commit."""
    d = (await rig.meta.call(P.MkdirReq(parent=ROOT, name=b"d", mode=0o40755, uid=0, gid=0))).attr.ino
    await rig.meta.call(P.SetLayoutReq(ino=d, redundancy=layout))
    rig.data.ec.min_extra = 0
    of = await rig.create(b"f", parent=d)
    await rig.data.write(of, 0, b"a" * CS)
    await rig.data.flush(of)  # chunk 0 placed: placing chunk 1 places chunk 2 too
    real_call, held, recorded = rig.meta.call, trio.Event(), trio.Event()

    async def slow_alloc(req, **kw):
        if isinstance(req, P.AllocChunksReq) and req.indices[:2] == [1, 2]:
            held.set()
            rsp = await real_call(req, **kw)
            await recorded.wait()  # the reply arrives after chunk 2 was written
            return rsp
        return await real_call(req, **kw)

    rig.meta.call = slow_alloc
    await rig.data.write(of, CS + 10, b"b" * 10)
    await rig.data.write(of, 2 * CS + 10, b"c" * 10)
    async with trio.open_nursery() as senders:
        senders.start_soon(rig.data._send, of, of.take(1))
        await held.wait()
        await rig.data._send(of, of.take(2))
        recorded.set()
    assert await rig.data.read(of, 2 * CS + 10, 10) == b"c" * 10
    await rig.data.flush(of)
    want = b"a" * CS + bytes(10) + b"b" * 10 + bytes(CS - 20) + bytes(10) + b"c" * 10
    assert await rig.committed(of) == (len(want), want)


@pytest.mark.parametrize("layout", ["replicas=2", "ec=2+1"])
async def test_a_write_during_a_commits_round_trip_leaves_the_committed_copy_alone(rig, layout):
    """A commit hands its session over before its round trip, and a whole chunk written meanwhile
    is sent at once. Its new version goes to the slot the handed version does not use, which holds
    the committed version until the daemon answers (a snapshot may pin it: the daemon copies it
    out first; a commit that fails leaves it the file's content): that send waits for the answer,
    so until then every reader gets the committed bytes (the million-operation run found
    snapshots whose copy-out found the pinned copy overwritten, issue 35)."""
    d = (await rig.meta.call(P.MkdirReq(parent=ROOT, name=b"d", mode=0o40755, uid=0, gid=0))).attr.ino
    await rig.meta.call(P.SetLayoutReq(ino=d, redundancy=layout))
    rig.data.ec.min_extra = 0
    of = await rig.create(b"f", parent=d)
    await rig.data.write(of, 0, b"a" * CS)
    await rig.data.flush(of)  # the committed version
    await rig.data.write(of, 0, b"b" * CS)  # the session the commit below carries
    real_call, held, answer = rig.meta.call, trio.Event(), trio.Event()

    async def slow_commit(req, **kw):
        if isinstance(req, P.CommitReq):
            held.set()
            await answer.wait()
        return await real_call(req, **kw)

    rig.meta.call = slow_commit
    async with trio.open_nursery() as flushing:
        flushing.start_soon(rig.data.flush, of)
        await held.wait()
        await rig.data.write(of, 0, b"c" * CS)  # the next session: a whole chunk, sent in the background
        await trio.sleep(0.5)  # time enough to store it, had it not waited
        assert await rig.committed(of) == (CS, b"a" * CS)
        answer.set()
    assert await rig.committed(of) == (CS, b"b" * CS)
    await rig.data.flush(of)
    assert await rig.committed(of) == (CS, b"c" * CS)


@pytest.mark.parametrize("layout", ["replicas=2", "ec=2+1"])
async def test_fsync_after_a_node_died_keeps_the_write_on_the_other_copies(rig, layout):
    """The node holding one copy (one fragment) dies between the write and the fsync: the fsync
    succeeds with the copies that are durable, and the commit leaves that copy to repair."""
    d = (await rig.meta.call(P.MkdirReq(parent=ROOT, name=b"d", mode=0o40755, uid=0, gid=0))).attr.ino
    await rig.meta.call(P.SetLayoutReq(ino=d, redundancy=layout))
    rig.data.ec.min_extra = 0  # ec=2+1 on three nodes: K fragments are enough here
    of = await rig.create(b"f", parent=d)
    data = bytes(range(256)) * (CS // 256) + b"tail"
    await rig.data.write(of, 0, data)
    await rig.data.flush(of)  # sent, committed, not yet durable
    await rig.data.write(of, 5, b"again")  # a second session, on the same nodes
    await rig.data.flush(of)
    await rig.data.write(of, 10, b"third")
    assert await rig.data.read(of, 10, 5) == b"third"  # sent (a read sends what it covers), not committed
    victim = of.chunks[0].nodes[0]
    await rig.stop_node(victim)  # the victim dies between the write and the fsync
    await rig.data.flush(of, sync=True)
    assert victim not in of.chunks[0].nodes  # committed without it: repair restores the copy
    want = bytearray(data)
    want[5:10], want[10:15] = b"again", b"third"
    for node_id in list(rig.nodes):
        if rig.nodes[node_id][2] is None:
            await rig.start_node(node_id)
    assert await rig.committed(of) == (len(want), bytes(want))


# -- chunks the daemon moves while the file is open (daemon/repair.py "Open files") ---------


@pytest.fixture
async def moving(tmp_path):
    """The rig with the metadata daemon in this process (its healer driven by the test) and four
    storage nodes, so that both copies of a chunk can be moved away from the nodes a mount knows.
    Everything runs in a nursery of its own, left before the ZeroMQ context is destroyed."""
    ctx = zmq.Context()
    stores: list[ChunkStore] = []
    try:
        async with trio.open_nursery() as nursery:
            r = Rig(tmp_path, nursery, ctx)
            config = load(r.daemon.config, MetaConfig)
            (tmp_path / "meta").mkdir()
            r.service = MetaService(config, zmq_context=ctx)
            await nursery.start(r.service.run)
            for node_id in (1, 2, 3, 4):
                await r.start_node(node_id)
            stores = [store for _, store, _ in r.nodes.values()]
            async with AsyncExitStack() as stack:
                r.meta = MetaClient(ctx, [r.daemon.address], timeout=5.0, retry_window_s=20.0)
                await r.meta.open(stack)
                await r.meta.hello("test_data_path", patience_s=10)
                pool = NodePool(ctx, nursery, timeout=2.0, read_timeout=2.0)
                r.data = DataPath(r.meta, pool, ChunkCache(16 << 20), nursery, readahead_chunks=0, write_parallelism=2)
                yield r
            stores = [store for _, store, _ in r.nodes.values()]
            with trio.CancelScope(shield=True):
                await r.stop_all()
            nursery.cancel_scope.cancel()
    finally:
        for store in stores:
            store.close()
        ctx.destroy(linger=0)


async def _heal(service: MetaService, ino: int, index: int) -> None:
    """Run the healer's tasks for chunk ``ino:index`` (copy, switch) until it plans none, then let the
    garbage collector delete the copies it replaced."""
    while True:
        tasks = [t for t in (await service.healer.scan()).tasks if (t.ino, t.idx) == (ino, index)]
        if not tasks:
            break
        for task in tasks:
            await service.healer._do(task)
    with trio.fail_after(20):
        while service.store.count_garbage():
            service._wake_gc()
            await trio.sleep(0.05)


async def _move_away(service: MetaService, ino: int, index: int) -> list[int]:
    """Drain the nodes holding chunk ``ino:index`` until both its copies live elsewhere and the old
    ones are deleted (a drain does not wait for the file to be closed); the new nodes."""
    old = service.store.get_chunks(ino, [index])[index][1]
    for node_id in old:
        await service.handle(P.NodeAdminReq(node_id=node_id, action="drain"), [])
    await _heal(service, ino, index)
    for node_id in old:
        await service.handle(P.NodeAdminReq(node_id=node_id, action="undrain"), [])
    new = service.store.get_chunks(ino, [index])[index][1]
    assert not set(new) & set(old)
    return new


@pytest.mark.parametrize("how", ["write", "truncate"])
async def test_a_chunk_moved_since_the_open_takes_writes_and_truncates_where_it_is_now(moving, how):
    """Both copies of a chunk moved (copy, switch, delete) while the file stays open: the mount's map
    names nodes without a copy (they answer STALE), so it asks where the chunk is now and writes there.
    Before, the truncate failed with EIO and the write lost its session (the fuzzer's failures)."""
    of = await moving.create(b"moved")
    data = bytes(range(256)) * (CS // 256)
    await moving.data.write(of, 0, data)
    await moving.data.flush(of)
    known = list(of.chunks[0].nodes)
    new = await _move_away(moving.service, of.ino, 0)
    assert of.chunks[0].nodes == known  # the mount still names the old nodes
    want = bytearray(data)
    if how == "write":
        await moving.data.write(of, 1000, b"new bytes")
        want[1000:1009] = b"new bytes"
        await moving.data.flush(of)
    else:
        await moving.data.truncate(of, 5000)
        del want[5000:]
    assert await moving.committed(of) == (len(want), bytes(want))
    assert sorted(moving.service.store.get_chunks(of.ino)[0][1]) == sorted(new)  # the move stands


async def test_a_writer_that_knows_too_few_copies_asks_again_and_keeps_repairs(moving):
    """A truncate that one replica missed leaves the mount knowing one copy; repair makes the second.
    The next write session must write (and commit) both: committing only the copy it knew made the
    daemon drop the repaired copy as stale, and every session undid the repair again."""
    of = await moving.create(b"short")
    await moving.data.write(of, 0, b"a" * CS)
    await moving.data.flush(of)
    missed = of.chunks[0].nodes[1]
    await moving.stop_node(missed)
    await moving.data.truncate(of, CS - 10)  # committed with the one copy that took the cut
    assert len(of.chunks[0].nodes) == 1
    await moving.start_node(missed)
    await _heal(moving.service, of.ino, 0)  # repair: a second copy, from the one left
    assert len(moving.service.store.get_chunks(of.ino)[0][1]) == 2
    await moving.data.write(of, 0, b"b" * 10)
    await moving.data.flush(of)
    assert len(moving.service.store.get_chunks(of.ino)[0][1]) == 2
    assert await moving.committed(of) == (CS - 10, b"b" * 10 + b"a" * (CS - 20))


async def test_a_stripe_whose_fragments_moved_since_the_open_is_read_and_rewritten(moving):
    """ec=2+1 with two of its three fragments moved away from the nodes the mount knows: fewer than K
    readable there, so the read asks where the stripe is now; a partial write (read-modify-write)
    reads it the same way, and its fragments, written whole to the nodes the map names, commit there."""
    await moving.start_node(5)  # two fragments need two nodes that hold none
    d = (await moving.meta.call(P.MkdirReq(parent=ROOT, name=b"ec", mode=0o40755, uid=0, gid=0))).attr.ino
    await moving.meta.call(P.SetLayoutReq(ino=d, redundancy="ec=2+1"))
    of = await moving.create(b"s", parent=d)
    data = bytes(range(256)) * (CS // 256)
    await moving.data.write(of, 0, data)
    await moving.data.flush(of)
    known = list(of.chunks[0].nodes)
    service = moving.service
    for node_id in known[:2]:
        await service.handle(P.NodeAdminReq(node_id=node_id, action="drain"), [])
    await _heal(service, of.ino, 0)
    assert not set(service.store.get_chunks(of.ino)[0][1]) & set(known[:2])
    moving.data.cache.drop_inode(of.ino)
    assert bytes(await moving.data.read(of, 0, CS)) == data  # from the old map: 1 fragment of 3
    moving.data.cache.drop_inode(of.ino)
    await moving.data.write(of, 100, b"new")
    await moving.data.flush(of)
    want = bytearray(data)
    want[100:103] = b"new"
    assert await moving.committed(of) == (CS, bytes(want))


@pytest.mark.parametrize("how", ["write", "truncate"])
async def test_a_writer_does_not_undo_a_drain(moving, how):
    """One copy drained away (and deleted) while the file is open: the old node answers STALE. The
    write goes to the node that has the copy now, and the commit keeps it there; giving the old
    node the whole chunk again put the copy back on the draining node after every session."""
    of = await moving.create(b"drained")
    await moving.data.write(of, 0, b"a" * CS)
    await moving.data.flush(of)
    service = moving.service
    gone, kept = of.chunks[0].nodes
    await service.handle(P.NodeAdminReq(node_id=gone, action="drain"), [])
    await _heal(service, of.ino, 0)
    now = service.store.get_chunks(of.ino)[0][1]
    assert gone not in now and kept in now
    want = bytearray(b"a" * CS)
    if how == "write":
        await moving.data.write(of, 10, b"b" * 10)
        await moving.data.flush(of)
        want[10:20] = b"b" * 10
    else:
        await moving.data.truncate(of, 100)
        del want[100:]
    assert sorted(service.store.get_chunks(of.ino)[0][1]) == sorted(now)
    assert await moving.committed(of) == (len(want), bytes(want))
