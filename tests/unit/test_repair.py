"""Self-healing's pure parts: the repair planner, node states, the throttle, chunk verification,
and a storage node copying a chunk from another over real ZeroMQ."""

import logging
import socket

import pytest
import trio
import zmq

from stripefs.common import protocol as p
from stripefs.common.config import StorageConfig
from stripefs.common.errors import ErrorCode, StripefsError
from stripefs.common.transport import connect
from stripefs.common.layout import replica_part
from stripefs.daemon.db import open_database
from stripefs.daemon.health import NodeRegistry
from stripefs.daemon.repair import Throttle
from stripefs.daemon.repair_plan import ChunkRow, plan, plan_rebalance
from stripefs.daemon.store import SqliteStore
from stripefs.storage_node.chunk_store import ChunkStore
from stripefs.storage_node.service import StorageService

R2 = "replicas=2"


def row(ino, idx, nodes, version=5, redundancy=R2):
    return ChunkRow(ino, idx, version, tuple(nodes), redundancy, 1 << 20)


UP4 = {1: "up", 2: "up", 3: "up", 4: "up"}


def test_healthy_rows_need_nothing():
    out = plan([row(1, 0, [1, 2]), row(1, 1, [3, 4])], UP4)
    assert out.tasks == [] and out.fixes == [] and out.under_replicated == 0 and out.chunks == 2
    assert out.placed == {1: 1, 2: 1, 3: 1, 4: 1}


def test_fewest_live_copies_first_and_the_dead_slot_is_replaced():
    states = {**UP4, 2: "down", 3: "down"}
    rows = [row(1, 0, [1, 2, 4], redundancy="replicas=3"), row(1, 1, [2, 3, 1], redundancy="replicas=3"), row(1, 2, [4, 3])]
    out = plan(rows, states)
    assert out.under_replicated == 3 and out.lost == 0
    first = out.tasks[0]
    assert (first.ino, first.idx, first.live) == (1, 1, 1)  # one copy left: goes first
    assert first.replace == 2 and first.sources == (1,)
    assert [t.kind for t in out.tasks] == ["repair"] * 3
    assert {t.replace for t in out.tasks[1:]} == {2, 3}


def test_lost_chunks_are_counted_not_planned():
    out = plan([row(1, 0, [2, 3])], {**UP4, 2: "down", 3: "removed"})
    assert out.lost == 1 and out.under_replicated == 1 and out.tasks == []


def test_drain_moves_copies_after_repairs_and_counts_as_live():
    states = {**UP4, 1: "draining", 4: "down"}
    out = plan([row(1, 0, [1, 2]), row(1, 1, [4, 3])], states)
    assert out.under_replicated == 1
    assert [(t.kind, t.idx) for t in out.tasks] == [("repair", 1), ("drain", 0)]
    drain = out.tasks[1]
    assert drain.replace == 1 and drain.sources == (2, 1)  # placeable sources before the draining one


def test_suspect_copies_are_live():
    out = plan([row(1, 0, [1, 2])], {**UP4, 2: "suspect"})
    assert out.tasks == [] and out.under_replicated == 0


def test_empty_rows_on_unplaceable_nodes_are_pointed_elsewhere():
    out = plan([row(1, 0, [1, 2], version=0)], {**UP4, 2: "draining"})
    assert [(t.kind, t.replace) for t in out.tasks] == [("move_empty", 2)] and out.under_replicated == 0


def test_gone_nodes_beyond_the_target_are_dropped():
    out = plan([row(1, 0, [1, 2, 3])], {**UP4, 3: "down"})
    assert out.tasks == [] and out.fixes == [(row(1, 0, [1, 2, 3]), (1, 2))]


def test_short_rows_get_copies_appended():
    out = plan([row(1, 0, [1])], UP4)  # placed degraded (one node was up then)
    assert out.under_replicated == 1 and out.tasks[0].slot == -1 and out.tasks[0].replace is None


def test_erasure_coded_fragments_become_reconstruct_tasks():
    ec = "ec=2+1"
    out = plan([row(1, 0, [1, 2, 3], redundancy=ec), row(1, 1, [1, 2, 3], redundancy=ec)], {**UP4, 2: "down", 3: "down"})
    # chunk 0 and 1 each lost 2 of 3 fragments: fewer than K=2 left, so lost
    assert out.lost == 2 and out.tasks == []
    out = plan([row(1, 0, [1, 2, 3], redundancy=ec)], {**UP4, 3: "down"})
    (task,) = out.tasks
    assert task.kind == "reconstruct" and task.part == 2 + 32 and task.replace == 3  # version 5: the odd slot
    out = plan([row(1, 0, [1, 2, 3], version=4, redundancy=ec)], {**UP4, 2: "draining"})
    assert [(t.kind, t.part) for t in out.tasks] == [("drain", 1)]
    out = plan([row(1, 0, [1, 0, 3], redundancy=ec)], UP4)  # node 0: a fragment placed nowhere
    assert out.under_replicated == 1 and [(t.kind, t.slot) for t in out.tasks] == [("reconstruct", 1)]


# -- node states -----------------------------------------------------------------


def _register(reg, node_id, now):
    reg.register(p.RegisterNodeReq(node_id=node_id, address=f"tcp://h:{node_id}", host=f"h{node_id}",
                                   capacity_bytes=100, free_bytes=50, used_bytes=50, chunks=1), now=now)


def test_node_states_follow_heartbeats_and_operators(tmp_path, caplog):
    layout = p.Layout(1 << 20, 2, R2)
    store = SqliteStore(open_database(tmp_path / "m.db", layout))
    store.begin()
    reg = NodeRegistry(store, node_timeout_s=10, node_suspect_s=3)
    changes = []
    reg.on_change = lambda n, old, new: changes.append((n, old, new))
    caplog.set_level(logging.INFO, "stripefs.daemon.health")
    _register(reg, 1, now=0)
    assert reg.state(1) == "up" and reg.views()[0].up
    reg.sweep(now=4)
    assert reg.state(1) == "suspect" and reg.views()[0].up and reg.is_up(1)
    reg.sweep(now=11)
    assert reg.state(1) == "down" and not reg.views()[0].up and not reg.is_up(1)
    reg.heartbeat(p.NodeHeartbeatReq(node_id=1, capacity_bytes=100, free_bytes=50, used_bytes=50, chunks=1), now=12)
    assert reg.state(1) == "up"
    reg.set_admin(1, "draining", now=12)
    assert reg.state(1) == "draining" and not reg.views()[0].up and reg.is_up(1)
    assert changes == [(1, "down", "up"), (1, "up", "suspect"), (1, "suspect", "down"), (1, "down", "up"), (1, "up", "draining")]
    assert any("up -> suspect" in r.message for r in caplog.records)
    # the administrative state survives a restart of the daemon
    store.commit()
    again = NodeRegistry(store, node_timeout_s=10)
    assert again.state(1) == "down"
    _register(again, 1, now=0)
    assert again.state(1) == "draining"
    again.set_admin(1, "removed")
    assert again.state(1) == "removed" and not again.is_up(1)
    with pytest.raises(StripefsError) as err:
        again.set_admin(1, "")
    assert err.value.code == ErrorCode.INVALID
    with pytest.raises(StripefsError) as err:
        again.set_admin(9, "draining")
    assert err.value.code == ErrorCode.NOT_FOUND
    store.close()


async def test_throttle_keeps_the_average_rate(autojump_clock):
    throttle = Throttle(rate=1000, burst_s=1.0)
    start = trio.current_time()
    for _ in range(10):
        await throttle.consume(500)
    assert trio.current_time() - start >= 4.0  # 5000 bytes at 1000/s, one second of burst
    unlimited = Throttle(rate=0)
    start = trio.current_time()
    await unlimited.consume(10**9)
    assert trio.current_time() == start


# -- storage side ----------------------------------------------------------------


def test_verify_and_inventory(tmp_path):
    with ChunkStore(tmp_path, block_size=4096, reserved_space=0) as store:
        c = p.ChunkId(3, 1, 0)
        store.write(c, 7, 0, 0, b"x" * 10000)
        assert store.verify(c, 7) == 10000
        with pytest.raises(StripefsError) as err:
            store.verify(c, 8)
        assert err.value.code == ErrorCode.STALE
        listed = [x for d in range(ChunkStore.FANOUT_DIRS) for x in store.chunks_in_dir(d)]
        assert listed == [c]
        with open(store.path(c), "r+b") as f:
            f.seek(-3, 2)
            f.write(b"!!!")
        with pytest.raises(StripefsError) as err:
            store.verify(c)
        assert err.value.code == ErrorCode.CORRUPT
        # a repair copy never replaces a copy at least as new
        store.write(c, 9, 0, 0, b"new", replace=True)
        assert store.write(c, 8, 0, 0, b"old", replace=True, if_newer=True).version == 9
        assert store.read(c, 0, 0, 100) == (9, b"new")
        assert store.write(c, 10, 0, 0, b"newer", replace=True, if_newer=True).version == 10


def _addr():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


async def test_a_node_copies_a_chunk_from_another(tmp_path):
    ctx = zmq.Context()
    stores = []
    try:
        services = []
        for i in (1, 2):
            cfg = StorageConfig(node_id=i, listen=_addr(), data_dir=str(tmp_path / f"n{i}"), meta=[_addr()],
                                block_size=4096, reserved_space=0, scrub_bandwidth=0)
            (tmp_path / f"n{i}").mkdir()
            store = ChunkStore(cfg.data_dir, block_size=4096, reserved_space=0, node_id=i)
            stores.append(store)
            services.append(StorageService(cfg, store, ctx=ctx))
        c = p.ChunkId(5, 0, 0)
        stores[0].write(c, 4, 0, 0, b"payload" * 1000)
        async with trio.open_nursery() as nursery:
            for s in services:
                await nursery.start(s.run)
            async with connect(ctx, services[1].config.listen, timeout=30) as target:
                rsp, _ = await target.call(p.CopyChunkReq(chunk=c, min_version=4, sources=[services[1].config.listen, services[0].config.listen], length=1 << 20))
                assert (rsp.version, rsp.length) == (4, 7000)
                assert stores[1].read(c, 4, 0, 1 << 20) == (4, b"payload" * 1000)
                with pytest.raises(StripefsError) as err:  # nobody has version 5
                    await target.call(p.CopyChunkReq(chunk=c, min_version=5, sources=[services[0].config.listen], length=1 << 20))
                assert err.value.code == ErrorCode.UNAVAILABLE
                # a corrupt copy: VerifyChunks says so, and the node queues a report for the daemon
                with open(stores[1].path(c), "r+b") as f:
                    f.seek(-2, 2)
                    f.write(b"??")
                rsp, _ = await target.call(p.VerifyChunksReq(chunks=[c, p.ChunkId(9, 9, 0)], min_versions=[4, 1]))
                assert rsp.bad == [c] and rsp.missing == [p.ChunkId(9, 9, 0)]
                with pytest.raises(StripefsError):
                    await target.call(p.ReadChunkReq(chunk=c, min_version=0, offset=0, length=1 << 20))
                assert c in services[1].healing._bad
                chunks, versions, start, pages = [], [], 0, 0
                while start >= 0:
                    listed, _ = await target.call(p.ListChunksReq(start_dir=start, max_dirs=1 << 16))
                    chunks += listed.chunks
                    versions += listed.versions
                    start, pages = listed.next_dir, pages + 1
                assert chunks == [c] and versions == [4] and pages == 4  # a bad data block: the header still reads
            nursery.cancel_scope.cancel()
    finally:
        for s in stores:
            s.close()
        ctx.destroy(linger=0)


# -- the daemon's row edits (MetaService opened in-process, no sockets) -----------

from stripefs.common.config import MetaConfig  # noqa: E402
from stripefs.daemon.repair_plan import Task  # noqa: E402
from stripefs.daemon.service import MetaService  # noqa: E402


@pytest.fixture
def svc(tmp_path):
    service = MetaService(MetaConfig(data_dir=str(tmp_path), chunk_size=1 << 20, stripe_count=2, redundancy=R2))
    service.open()
    for i in (1, 2, 3, 4):
        _register(service.nodes, i, now=0)
    yield service
    service.store.close()


def _file(svc, name=b"f", chunks=((0, 5, [1, 2]),)):
    ino, _ = svc.ns.create(1, name, 0o644, 0, 0)
    for idx, version, nodes in chunks:
        svc.store.put_chunk(ino, idx, version, nodes)
    return ino


def _garbage(svc):
    return sorted((r[0], r[1], r[2], r[4]) for r in svc.store.conn.execute("SELECT node_id, ino, idx, part, max_version FROM garbage"))


def test_record_is_a_compare_and_swap(svc):
    ino = _file(svc)
    task = Task("repair", ino, 0, 5, (1, 2), (1,), 1, 1, 1 << 20)
    with svc.store.savepoint():
        assert svc.healer._record(task, 3, 5)
    assert svc.store.get_chunks(ino)[0] == (5, [1, 3], [])
    assert _garbage(svc) == [(2, ino, 0, 5)]  # the replaced copy goes, bounded by the chunk's version
    with svc.store.savepoint():  # the same task again: node 2 is no longer in the row, the new copy is garbage
        assert not svc.healer._record(task, 4, 5)
    assert (4, ino, 0, 5) in _garbage(svc) and svc.store.get_chunks(ino)[0] == (5, [1, 3], [])
    svc.store.put_chunk(ino, 0, 9, [1, 3])  # a writer committed version 9 meanwhile
    with svc.store.savepoint():
        assert not svc.healer._record(Task("drain", ino, 0, 5, (1, 3), (1, 3), 0, 2, 1 << 20), 2, 5)
    assert svc.store.get_chunks(ino)[0] == (9, [1, 3], [])
    svc.store.put_chunk(ino, 0, 9, [])  # moved to a tier while a copy was made: the copy never makes it hot
    with svc.store.savepoint():
        assert not svc.healer._record(Task("repair", ino, 0, 9, (1, 3), (1,), -1, 2, 1 << 20), 4, 9)
    assert svc.store.get_chunks(ino)[0] == (9, [], []) and (4, ino, 0, 9) in _garbage(svc)


def test_bad_copies_are_dropped_but_never_the_last(svc, caplog):
    ino = _file(svc, chunks=((0, 5, [1, 2]), (1, 5, [3])))
    with svc.store.savepoint():  # a report of another slot (a writer's copy, garbage) is not of the committed copy
        assert svc.healer.mark_bad(2, [p.ChunkId(ino, 0, 0)]) == 0
    assert svc.store.get_chunks(ino)[0] == (5, [1, 2], [])
    with svc.store.savepoint():  # v5 lives in slot part 32 (common/layout.py "Slots")
        assert svc.healer.mark_bad(2, [p.ChunkId(ino, 0, replica_part(5))]) == 1
    assert svc.store.get_chunks(ino)[0] == (5, [1], []) and (2, ino, 0, 5) in _garbage(svc)
    with svc.store.savepoint():
        assert svc.healer.mark_bad(3, [p.ChunkId(ino, 1, replica_part(5))]) == 0
    assert svc.store.get_chunks(ino)[1] == (5, [3], [])
    assert any("only live copy" in r.message for r in caplog.records)


def test_remove_refuses_only_copies(svc):
    ino = _file(svc, chunks=((0, 5, [1, 2]), (1, 5, [3]), (2, 0, [3])))
    with pytest.raises(StripefsError) as err, svc.store.savepoint():
        svc.operator.remove_node(3)
    assert err.value.code == ErrorCode.NOT_EMPTY and "drain" in err.value.message
    assert svc.nodes.state(3) == "up"
    with svc.store.savepoint():
        svc.operator.remove_node(2)
    assert svc.nodes.state(2) == "removed" and svc.store.get_chunks(ino)[0] == (5, [1], [])


def test_expired_sessions_uncommitted_chunks_go_and_late_commits_are_fenced(svc):
    ino = _file(svc, chunks=((0, 5, [1, 2]), (1, 0, [2, 3])))
    epoch, _ = svc.ns.alloc_epoch()
    with svc.store.savepoint():
        svc.healer.reclaim_uncommitted([ino])
    assert set(svc.store.get_chunks(ino)) == {0}
    # chunk 1's copies (never committed), and chunk 0's unused slot (a dead writer's new version)
    assert {(g[0], g[2]) for g in _garbage(svc)} == {(2, 1), (3, 1), (1, 0), (2, 0)}
    with pytest.raises(StripefsError) as err:
        svc.sessions.check_fence(ino, [p.ChunkRef(index=1, version=epoch, nodes=[2, 3])])
    assert err.value.code == ErrorCode.STALE
    newer, _ = svc.ns.alloc_epoch()
    svc.sessions.check_fence(ino, [p.ChunkRef(index=1, version=newer, nodes=[2, 3])])  # a new session's write


def test_a_commit_that_drops_a_node_queues_its_copy(svc):
    ino = _file(svc, chunks=((0, 5, [1, 3]),))  # a drain moved 2 -> 3 while a writer wrote to [1, 2]
    with svc.store.savepoint():
        svc.ns.commit(ino, 100, 0, [p.ChunkRef(index=0, version=7, nodes=[1, 2])])
    assert svc.store.get_chunks(ino)[0] == (7, [1, 2], []) and (3, ino, 0, 7) in _garbage(svc)


def test_rebalance_postpones_chunks_of_files_open_for_writing(svc):
    """Rebalance waits for a writer's close: a writer of the file names the nodes its map had. Checked
    when planning and when recording (the file may be opened while the copy is made); drains do not
    wait. A file merely held (open for reading, under a callback) is moved: the mount follows."""
    held, idle = _file(svc, b"held"), _file(svc, b"idle")
    work = plan([row(held, 0, [1, 2]), row(idle, 0, [1, 2])], UP4)  # nodes 3 and 4 hold nothing
    capacity = {n: 4 << 20 for n in UP4}
    assert {t.ino for t in plan_rebalance(work, capacity, 0.1)} == {held, idle}
    assert {t.ino for t in plan_rebalance(work, capacity, 0.1, held={held})} == {idle}
    sid = svc.sessions.hello("h", 1, "/mnt")
    svc.sessions.open(sid, idle)  # open for reading ...
    svc.callbacks.grant(sid, held, 1, b"held")  # ... and held under a callback: neither stops a move
    assert svc.sessions.writing_inodes() == set()
    with svc.store.savepoint():
        assert svc.healer._record(Task("rebalance", idle, 0, 5, (1, 2), (1, 2), 0, 2, 1 << 20, target=4), 4, 5)
    assert svc.store.get_chunks(idle)[0] == (5, [4, 2], [])
    svc.sessions.open(sid, held, write=True)
    assert svc.sessions.writing_inodes() == {held}
    move = Task("rebalance", held, 0, 5, (1, 2), (1, 2), 0, 2, 1 << 20, target=3)
    with svc.store.savepoint():
        assert not svc.healer._record(move, 3, 5)  # opened for writing while it was copied: the copy is garbage
    assert svc.store.get_chunks(held)[0] == (5, [1, 2], []) and (3, held, 0, 5) in _garbage(svc)
    with svc.store.savepoint():
        assert svc.healer._record(Task("drain", held, 0, 5, (1, 2), (1, 2), 0, 2, 1 << 20), 4, 5)
    assert svc.store.get_chunks(held)[0] == (5, [4, 2], [])
    svc.sessions.close(sid, held)
    with svc.store.savepoint():
        assert svc.healer._record(Task("rebalance", held, 0, 5, (4, 2), (4, 2), 1, 2, 1 << 20, target=3), 3, 5)
    assert svc.store.get_chunks(held)[0] == (5, [4, 3], [])


def test_the_backlog_counts_the_bytes_small_files_hold(svc):
    """Issue 36 item 7: status showed a repair backlog of 467 copies (1.8G) for 100 KiB files (the chunk
    size, 4 MiB, per copy); the repair then made 994 copies (97.1M). A copy holds the file's bytes in
    its chunk: the size comes with the rows the healer plans from."""
    small = _file(svc, b"small", chunks=())
    big = _file(svc, b"big", chunks=())
    chunk = svc.store.get_inode(big)["chunk_size"]
    with svc.store.savepoint():
        svc.ns.commit(small, 100 * 1024, 0, [p.ChunkRef(index=0, version=7, nodes=[1, 2])])
        svc.ns.commit(big, chunk + chunk // 2, 0, [p.ChunkRef(index=0, version=8, nodes=[1, 2]),
                                                   p.ChunkRef(index=1, version=8, nodes=[2, 3])])
    rows = [ChunkRow.from_sql(r) for r in svc.store.chunk_rows_page((0, -1), 100)]
    work = plan(rows, {1: "up", 2: "down", 3: "up", 4: "up"})
    assert sorted((t.ino, t.idx, t.copy_bytes) for t in work.tasks) == [
        (small, 0, 100 * 1024), (big, 0, chunk), (big, 1, chunk // 2)]
    assert work.backlog_bytes == 100 * 1024 + chunk + chunk // 2


async def test_a_node_reconstructs_a_lost_fragment_from_the_others(tmp_path):
    from stripefs.common.erasure import codec, fragment_part

    ctx = zmq.Context()
    stores, services = [], []
    cs, version = 64 * 1024, 7
    coder = codec(2, 1, cs)
    stripe = bytes(range(256)) * 200  # 51,200 bytes used of a 64 KiB stripe
    frags = coder.encode(stripe, len(stripe))
    try:
        for i in (1, 2, 3):
            (tmp_path / f"n{i}").mkdir()
            cfg = StorageConfig(node_id=i, listen=_addr(), data_dir=str(tmp_path / f"n{i}"), meta=[_addr()],
                                block_size=4096, reserved_space=0, scrub_bandwidth=0)
            store = ChunkStore(cfg.data_dir, block_size=4096, reserved_space=0, node_id=i)
            stores.append(store)
            services.append(StorageService(cfg, store, ctx=ctx))
        stores[0].write(p.ChunkId(9, 0, fragment_part(0, version)), version, 0, 0, frags[0])
        stores[1].write(p.ChunkId(9, 0, fragment_part(2, version)), version, 0, 0, frags[2])
        target = p.ChunkId(9, 0, fragment_part(1, version))
        sources = [p.FragmentSource(0, fragment_part(0, version), services[0].config.listen),
                   p.FragmentSource(2, fragment_part(2, version), services[1].config.listen)]
        async with trio.open_nursery() as nursery:
            for s in services:
                await nursery.start(s.run)
            async with connect(ctx, services[2].config.listen, timeout=30) as node3:
                rsp, _ = await node3.call(p.ReconstructFragmentReq(
                    chunk=target, version=version, k=2, m=1, chunk_size=cs, used=len(stripe), fragment=1, sources=sources))
                assert rsp.version == version and stores[2].read(target, version, 0, cs) == (version, frags[1])
                with pytest.raises(StripefsError) as err:  # no fragment of that version anywhere: fewer than K
                    await node3.call(p.ReconstructFragmentReq(
                        chunk=target, version=version + 2, k=2, m=1, chunk_size=cs, used=len(stripe), fragment=1,
                        sources=sources))
                assert err.value.code == ErrorCode.UNAVAILABLE
                for bad in (dict(fragment=5), dict(chunk_size=0), dict(k=0)):  # bad input: a clear error, never a crash
                    fields = dict(chunk=target, version=version, k=2, m=1, chunk_size=cs, used=0, fragment=1, sources=[])
                    with pytest.raises(StripefsError) as err:
                        await node3.call(p.ReconstructFragmentReq(**{**fields, **bad}))
                    assert err.value.code in (ErrorCode.BAD_REQUEST, ErrorCode.INVALID), bad
            nursery.cancel_scope.cancel()
    finally:
        for s in stores:
            s.close()
        ctx.destroy(linger=0)


def test_a_bad_fragment_is_reconstructed_unless_too_few_others_are_live(svc, caplog):
    """A fragment that failed its checksum (a client read, a scrub) leaves its slot (node 0,
    MISSING) and becomes a reconstruct task; a stripe that could not be rebuilt without it keeps it."""
    from stripefs.common.erasure import fragment_part

    ino = _file(svc, chunks=((0, 5, [1, 2, 3]),))
    svc.store.conn.execute("UPDATE inodes SET redundancy='ec=2+1' WHERE ino=?", (ino,))
    with svc.store.savepoint():  # a report of the other version's slot (a writer moved on): ignored
        assert svc.healer.mark_bad(2, [p.ChunkId(ino, 0, fragment_part(1, 6))]) == 0
    assert svc.store.get_chunks(ino)[0] == (5, [1, 2, 3], [])
    with svc.store.savepoint():
        assert svc.healer.mark_bad(2, [p.ChunkId(ino, 0, fragment_part(1, 5))]) == 1
    assert svc.store.get_chunks(ino)[0] == (5, [1, 0, 3], [])
    assert (2, ino, 0, 5) in _garbage(svc)
    tasks = plan([ChunkRow(ino, 0, 5, (1, 0, 3), "ec=2+1", 1 << 20)], {n: "up" for n in (1, 2, 3, 4)}).tasks
    assert [(t.kind, t.slot, t.replace, t.part) for t in tasks] == [("reconstruct", 1, 0, fragment_part(1, 5))]
    # fragment 0 bad too: only one other (node 3) is live, K=2: kept, and said
    with svc.store.savepoint():
        assert svc.healer.mark_bad(1, [p.ChunkId(ino, 0, fragment_part(0, 5))]) == 0
    assert svc.store.get_chunks(ino)[0] == (5, [1, 0, 3], [])
    assert any("other fragments are live" in r.message for r in caplog.records)


async def test_an_expired_session_s_abandoned_slots_are_collected_that_part_only(svc):
    """A writer that died mid-session left its new versions in the slot the committed version does
    not use (common/layout.py "Slots"); when its session expires and nobody holds the file, that
    slot goes on every node, and only that part (the committed copy beside it is never touched)."""
    from stripefs.common.erasure import fragment_part
    from stripefs.daemon.store import EXACT_PART

    rep = _file(svc, b"rep", chunks=((0, 5, [1, 2]), (1, 0, [3, 4])))
    ec = _file(svc, b"ec", chunks=((0, 8, [1, 2, 0, 3]),))
    svc.store.update_inode(ec, redundancy="ec=2+2")
    bound = svc.ns.last_epoch()
    with svc.store.savepoint():
        svc.healer.reclaim_uncommitted([rep, ec])
    rows = sorted(tuple(r) for r in svc.store.conn.execute("SELECT node_id, ino, idx, part, max_version FROM garbage"))
    assert rows == sorted([
        (1, rep, 0, replica_part(6) | EXACT_PART, bound), (2, rep, 0, replica_part(6) | EXACT_PART, bound),
        (3, rep, 1, 0, bound), (4, rep, 1, 0, bound),  # allocated, never committed: every part
        (1, ec, 0, fragment_part(0, 9) | EXACT_PART, bound), (2, ec, 0, fragment_part(1, 9) | EXACT_PART, bound),
        (3, ec, 0, fragment_part(3, 9) | EXACT_PART, bound),
    ])
    assert svc.store.get_chunks(rep) == {0: (5, [1, 2], [])}

    sent = []

    class Node:
        async def call(self, req):
            sent.append(req)
            return p.OkRsp(), []

    for node_id in (1, 3):
        await svc.housekeeping._collect(node_id, Node())
    assert [(r.all_parts, [c.part for c in r.chunks]) for r in sent] == [
        (False, [replica_part(6), fragment_part(0, 9)]),  # node 1: the abandoned slots, those parts only
        (True, [0]), (False, [fragment_part(3, 9)]),  # node 3: an uncommitted chunk (every part), a slot
    ]
