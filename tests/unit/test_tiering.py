"""The cold tier's pure parts and its row edits (docs/tiering.md): object names, policy rules,
durations, and the compare-and-swaps of migrate and recall on an in-process daemon (no bucket)."""

import time

import msgspec
import pytest

from stripefs.common import protocol as p
from stripefs.common.config import MetaConfig
from stripefs.common.layout import replica_part
from stripefs.daemon.service import MetaService
from stripefs.daemon.tier_store import object_name, parse_object_name, parse_url, to_signed, to_unsigned
from stripefs.daemon.tiering import is_cold, nearest_policy, policy_due
from stripefs.tier_cli import format_duration, parse_duration

CLUSTER = "0123456789abcdef0123456789abcdef"
DAY_NS = 86400 * 10**9


def test_urls():
    assert parse_url("s3://bucket") == ("bucket", "")
    assert parse_url("s3://my.bucket/a/b/") == ("my.bucket", "a/b/")
    for bad in ("http://bucket", "s3://", "s3://B", "s3://x"):
        with pytest.raises(ValueError):
            parse_url(bad)


def test_object_names_round_trip_and_differ_per_migration():
    name = object_name("pre/", CLUSTER, 42, 7, 1001, 123456789)
    assert name == f"pre/{CLUSTER}/42/7.1001.123456789"
    assert parse_object_name("pre/", name) == (CLUSTER, 42, 7, 1001, 123456789)
    assert object_name("pre/", CLUSTER, 42, 7, 1001, 1) != name  # migrated again: another object
    assert parse_object_name("pre/", f"pre/{CLUSTER}/42/7.1001") is None
    assert parse_object_name("other/", name) is None
    assert parse_object_name("pre/", "pre/notes.txt") is None


def test_checksums_fit_the_store():
    for x in (0, 1, (1 << 63) - 1, 1 << 63, (1 << 64) - 1):
        s = to_signed(x)
        assert -(1 << 63) <= s < (1 << 63) and to_unsigned(s) == x


def test_policy_rules():
    now = 100 * DAY_NS
    old = now - 31 * DAY_NS
    assert policy_due(old, old, 10, now, 30 * 86400, 0)
    assert not policy_due(now - DAY_NS, old, 10, now, 30 * 86400, 0)  # read yesterday
    assert not policy_due(old, now - DAY_NS, 10, now, 30 * 86400, 0)  # written yesterday
    assert not policy_due(old, old, 10, now, 30 * 86400, 11)  # too small
    assert not policy_due(old, old, 0, now, 30 * 86400, 0)  # empty: nothing to move
    parents = {5: 3, 3: 2, 2: 1}
    assert nearest_policy(5, parents.get, {2: "a", 1: "root"}) == "a"
    assert nearest_policy(5, parents.get, {5: "own", 2: "a"}) == "own"
    assert nearest_policy(5, parents.get, {}) is None
    assert nearest_policy(9, {}.get, {1: "root"}) is None  # no parent known: unlinked


def test_durations():
    assert parse_duration("30d") == 30 * 86400
    assert parse_duration("12h") == 43200 and parse_duration("90m") == 5400 and parse_duration("45") == 45
    assert parse_duration("2w") == 14 * 86400
    for bad in ("", "d", "1y", "-1d", "1.5d"):
        with pytest.raises(ValueError):
            parse_duration(bad)
    assert format_duration(30 * 86400) == "30d" and format_duration(90) == "90s" and format_duration(7200) == "2h"


def test_cold_means_written_and_on_no_node():
    assert is_cold(5, []) and not is_cold(0, []) and not is_cold(5, [1])


def test_malformed_tier_requests_are_refused_by_the_schema():
    for body in (
        {"t": "tier_add", "name": "bad name!", "url": "s3://b"},
        {"t": "tier_add", "name": "ok", "url": 5},
        {"t": "tier_recall", "ino": "x"},
        {"t": "tier_policy_set", "ino": 1, "tier": "cold", "after_s": -1},
    ):
        frame = msgspec.msgpack.encode([p.PROTOCOL_VERSION, 7, body])
        with pytest.raises(p.ProtocolError):
            p.decode_request(frame)


# -- the daemon's row edits (MetaService opened in-process, no sockets) -------------------


@pytest.fixture
def svc(tmp_path):
    # the trash off: an unlink frees the file (its objects become orphans) at once
    service = MetaService(MetaConfig(data_dir=str(tmp_path), chunk_size=1 << 20, stripe_count=2, redundancy="replicas=2",
                                     trash_keep_s=0.0))
    service.open()
    service.store.add_tier("cold", "bucket", "pre/", "http://127.0.0.1:1", "", time.time_ns())
    yield service
    service.store.close()


def _file(svc, name=b"f", chunks=((0, 5, [1, 2]),), parent=1):
    ino, _ = svc.ns.create(parent, name, 0o644, 0, 0)
    for idx, version, nodes in chunks:
        svc.store.put_chunk(ino, idx, version, nodes)
    return ino


def _garbage(svc):
    return sorted((r[0], r[1], r[2], r[3]) for r in svc.store.conn.execute("SELECT node_id, ino, idx, max_version FROM garbage"))


def _objects(svc):
    return {(r[0], r[1], r[2]): r[3] for r in svc.store.conn.execute("SELECT ino, idx, version, state FROM tier_objects")}


def _tier_garbage(svc):
    return [r[0] for r in svc.store.conn.execute("SELECT name FROM tier_garbage")]


def test_migration_switches_only_the_row_it_read(svc):
    t = svc.tiering
    ino = _file(svc, chunks=((0, 5, [1, 2]), (1, 5, [3, 4])))
    svc.store.add_tier_objects([(ino, 0, 5, 1, 11), (ino, 1, 5, 1, 12)])
    with svc.store.savepoint():
        assert t._switch_cold(ino, 0, 5, 1, "n0", 100, 1 << 63)
    assert svc.store.get_chunks(ino)[0] == (5, [], [])  # cold: no nodes
    assert _garbage(svc) == [(1, ino, 0, 5), (2, ino, 0, 5)]  # the copies go, bounded by the version
    assert _objects(svc)[(ino, 0, 5)] == "stored"
    svc.store.put_chunk(ino, 1, 9, [3, 4])  # a writer committed version 9 during the upload
    with svc.store.savepoint():
        assert not t._switch_cold(ino, 1, 5, 1, "n1", 100, 7)
    assert svc.store.get_chunks(ino)[1] == (9, [3, 4], [])
    assert (ino, 1, 5) not in _objects(svc) and _tier_garbage(svc) == ["n1"]  # the upload is garbage


def test_migration_releases_the_copies_the_row_names_at_the_switch(svc):
    """A repair moved a copy during the upload: the version (its bytes) is the same, so the switch
    happens, and the copies released are the row's own, not those the upload read."""
    t = svc.tiering
    ino = _file(svc, chunks=((0, 5, [1, 2]),))
    svc.store.add_tier_objects([(ino, 0, 5, 1, 11)])
    svc.store.put_chunk(ino, 0, 5, [1, 3])  # node 2's copy re-replicated onto node 3
    with svc.store.savepoint():
        assert t._switch_cold(ino, 0, 5, 1, "n0", 100, 7)
    assert svc.store.get_chunks(ino)[0] == (5, [], [])
    assert _garbage(svc) == [(1, ino, 0, 5), (3, ino, 0, 5)]
    assert _objects(svc)[(ino, 0, 5)] == "stored"


def test_recall_switches_back_and_queues_the_object(svc):
    t = svc.tiering
    ino = _file(svc)
    svc.store.add_tier_objects([(ino, 0, 5, 1, 11)])
    with svc.store.savepoint():
        t._switch_cold(ino, 0, 5, 1, "n0", 100, 7)
    with svc.store.savepoint():
        assert t._switch_hot(ino, 0, 5, [3, 4], 1, "n0")
    assert svc.store.get_chunks(ino)[0] == (5, [3, 4], [])
    assert _objects(svc) == {} and _tier_garbage(svc) == ["n0"]
    svc.store.conn.execute("DELETE FROM garbage")
    with svc.store.savepoint():  # a second recall (another daemon) lost the race: its copies go, never the row's
        assert not t._switch_hot(ino, 0, 5, [4, 1], 1, "n0")
    assert _garbage(svc) == [(1, ino, 0, 5)]  # node 4 holds the row's copy: not deleted
    assert svc.store.get_chunks(ino)[0] == (5, [3, 4], [])


def test_objects_of_deleted_truncated_or_rewritten_chunks_are_orphans(svc):
    t = svc.tiering
    a = _file(svc, b"a", chunks=((0, 5, [1, 2]), (1, 5, [1, 2])))
    b = _file(svc, b"b")
    svc.store.add_tier_objects([(a, 0, 5, 1, 1), (a, 1, 5, 1, 2), (b, 0, 5, 1, 3)])
    with svc.store.savepoint():
        for ino, idx in ((a, 0), (a, 1), (b, 0)):
            assert t._switch_cold(ino, idx, 5, 1, "x", 10, 1)
    assert svc.store.orphan_tier_objects(10) == []
    svc.ns.setattr(a, size=1 << 20)  # truncated to one chunk: chunk 1's object is an orphan
    svc.ns.unlink(1, b"b")  # deleted
    orphans = sorted(tuple(r) for r in svc.store.orphan_tier_objects(10))
    assert orphans == [(a, 1, 5, 1, 2), (b, 0, 5, 1, 3)]


def test_the_policy_pass_picks_idle_files_below_the_directory(svc):
    d = svc.ns.mkdir(1, b"d", 0o755, 0, 0).ino
    own = svc.ns.mkdir(d, b"own", 0o755, 0, 0).ino
    idle = _file(svc, b"idle", parent=d)
    _file(svc, b"empty", chunks=(), parent=d)
    below_own = _file(svc, b"x", parent=own)
    for ino in (idle, below_own):
        svc.store.update_inode(ino, size=1000, atime_ns=1, mtime_ns=1)
    svc.store.set_tier_policy(d, 1, 60, 0)
    svc.store.set_tier_policy(own, 1, 60, 0)
    now = time.time_ns()
    assert svc.store.policy_candidates(d, now, 0, 100) == [idle]  # not below 'own': its own policy walks it
    assert svc.store.policy_candidates(own, now, 0, 100) == [below_own]
    assert svc.store.policy_candidates(d, now, 2000, 100) == []  # --min-size
    assert svc.store.policy_candidates(d, 0, 0, 100) == []  # not idle long enough
    svc.store.put_chunk(idle, 0, 5, [])  # already cold
    assert svc.store.policy_candidates(d, now, 0, 100) == []


def test_repair_leaves_cold_chunks_alone():
    from stripefs.daemon.repair_plan import ChunkRow, plan

    out = plan([ChunkRow(5, 0, 7, (), "replicas=2", 1 << 20), ChunkRow(5, 1, 7, (), "ec=2+1", 1 << 20)], {1: "up"})
    assert out.tasks == [] and out.lost == 0 and out.under_replicated == 0 and out.chunks == 2


def test_the_tier_sql_runs_on_postgresql(pg_dsn):
    """The shared SQL of the tier tables (row-value comparisons, the recursive walk, upserts) on PostgreSQL."""
    from stripefs.daemon.health import NodeRegistry
    from stripefs.daemon.namespace import Namespace
    from stripefs.daemon.pg_store import open_pg_store

    store = open_pg_store(pg_dsn, p.Layout(chunk_size=1 << 20, stripe_count=2, redundancy="replicas=2"), pool_size=2)
    try:
        ns = Namespace(store, NodeRegistry(store, 10.0, 5.0), is_open=lambda ino: False)

        def work():
            tier = store.add_tier("cold", "bucket", "", "", "", 1)
            d = ns.mkdir(1, b"d", 0o755, 0, 0).ino
            f, _ = ns.create(d, b"f", 0o644, 0, 0)
            store.put_chunk(f, 0, 5, [1, 2])
            store.update_inode(f, size=100, atime_ns=1, mtime_ns=1)
            store.set_tier_policy(d, tier, 60, 0)
            store.set_tier_policy(d, tier, 30, 10)  # the upsert
            assert store.policy_candidates(d, time.time_ns(), 10, 10) == [f]
            store.add_tier_objects([(f, 0, 5, tier, 7), (f, 0, 5, tier, 8)])  # the second is ignored
            assert [tuple(r) for r in store.uploading_objects(10)] == [(f, 0, 5, tier)]
            store.set_object_stored(f, 0, 5, 100, to_signed(1 << 63))
            store.put_chunk(f, 0, 5, [])
            assert store.tier_objects_of(f)[(0, 5)] == (tier, 100, to_signed(1 << 63), "stored", 7)
            assert store.tier_usage() == {tier: (1, 100)} and store.orphan_tier_objects(10) == []
            assert [tuple(r) for r in store.cold_chunks_of(tier, (0, -1), 10)] == [(f, 0, 5, 7, 100)]
            store.drop_chunks(f, 0)
            assert [tuple(r) for r in store.orphan_tier_objects(10)] == [(f, 0, 5, tier, 7)]
            store.add_tier_garbage([(tier, "x")])
            assert store.count_tier_garbage() == 1 and store.tier_garbage_names(tier) == ["x"]

        store.run(work, readonly=False)
    finally:
        store.close()


# -- migrate and recall end to end: real storage nodes over ZeroMQ, a bucket in memory ------------


class FakeBucket:
    """A tier's bucket in memory, with the real one's checks (tier_store.Bucket's interface)."""

    def __init__(self):
        self.objects: dict[str, bytes] = {}
        self.fail = False
        self.prefix = "pre/"

    def _check(self):
        from stripefs.common.errors import ErrorCode, StripefsError

        if self.fail:
            raise StripefsError(ErrorCode.IO, "tier cold (fake): the bucket does not answer")

    async def put(self, name, data, xxh3):
        self._check()
        self.objects[name] = bytes(data)

    async def verify(self, name, length, xxh3):
        self._check()
        assert len(self.objects[name]) == length

    async def get(self, name, length, xxh3):
        from stripefs.daemon.tier_store import checksum

        self._check()
        data = self.objects[name]
        assert len(data) == length and checksum(data) == xxh3
        return data

    async def delete(self, names):
        self._check()
        for n in names:
            self.objects.pop(n, None)
        return []


def _addr():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


async def test_migrate_and_recall_replicated_and_ec_through_real_nodes(tmp_path):
    import os

    import trio
    import zmq

    from stripefs.common.config import StorageConfig
    from stripefs.common.erasure import codec, fragment_part
    from stripefs.common.errors import StripefsError
    from stripefs.daemon.repair import NodeClients
    from stripefs.storage_node.chunk_store import ChunkStore
    from stripefs.storage_node.service import StorageService

    ctx = zmq.Context()
    stores, services = [], []
    svc = MetaService(MetaConfig(data_dir=str(tmp_path / "meta"), chunk_size=1 << 20, stripe_count=2,
                                 redundancy="replicas=2"), zmq_context=ctx)
    (tmp_path / "meta").mkdir()
    try:
        for i in (1, 2, 3, 4):
            d = tmp_path / f"n{i}"
            d.mkdir()
            cfg = StorageConfig(node_id=i, listen=_addr(), data_dir=str(d), meta=[_addr()], block_size=4096,
                                reserved_space=0, scrub_bandwidth=0)
            stores.append(ChunkStore(cfg.data_dir, block_size=4096, reserved_space=0, node_id=i))
            services.append(StorageService(cfg, stores[-1], ctx=ctx))
        svc.open()
        for i, s in enumerate(services, 1):
            svc.nodes.register(p.RegisterNodeReq(node_id=i, address=s.config.listen, host=f"h{i}", capacity_bytes=1 << 30,
                                                 free_bytes=1 << 30, used_bytes=0, chunks=0))
        tier = svc.store.add_tier("cold", "bucket", "pre/", "", "", 1)
        bucket = svc.tiering._buckets[tier] = FakeBucket()
        rep_data = os.urandom(700_000)
        rep, _ = svc.ns.create(1, b"rep", 0o644, 0, 0)
        for n in (1, 2):
            stores[n - 1].write(p.ChunkId(rep, 0, replica_part(5)), 5, 0, 0, rep_data)
        svc.store.put_chunk(rep, 0, 5, [1, 2])
        svc.store.update_inode(rep, size=len(rep_data))
        ec_data = os.urandom(900_000)
        ec, _ = svc.ns.create(1, b"ec", 0o644, 0, 0)
        svc.store.update_inode(ec, size=len(ec_data), redundancy="ec=2+1")
        frags = codec(2, 1, 1 << 20).encode(ec_data, len(ec_data))
        for j, n in enumerate((1, 2, 3)):
            if j != 0:  # data fragment 0 is lost: the migration reads the parity and decodes
                stores[n - 1].write(p.ChunkId(ec, 0, fragment_part(j, 7)), 7, 0, 0, frags[j])
        svc.store.put_chunk(ec, 0, 7, [1, 2, 3])
        async with trio.open_nursery() as nursery:
            for s in services:
                await nursery.start(s.run)
            nursery.start_soon(svc.txn.run_committer)
            svc.housekeeping.duties = svc.duties
            nursery.start_soon(svc.housekeeping.gc_loop)  # deletes the released copies
            svc.healer._clients = NodeClients(ctx, nursery, 10.0)
            svc.healer._ready.set()
            t = svc.tiering

            # the bucket fails: nothing is released, the intent stays for the daemon to retry
            bucket.fail = True
            with pytest.raises(StripefsError):
                await t.handle_tier_migrate(p.TierMigrateReq(ino=rep, tier="cold"))
            assert svc.store.get_chunks(rep)[0] == (5, [1, 2], []) and _objects(svc) == {(rep, 0, 5): "uploading"}
            bucket.fail = False

            for ino, data in ((rep, rep_data), (ec, ec_data)):
                rsp = await t.handle_tier_migrate(p.TierMigrateReq(ino=ino, tier="cold"))
                assert (rsp.chunks, rsp.cold, rsp.hot) == (1, 1, 0)
                assert is_cold(*svc.store.get_chunks(ino)[0][:2])
                (name,) = [n for n in bucket.objects if f"/{ino}/0." in n]
                assert bucket.objects[name] == data  # EC: the decoded stripe, one object
            # recalls: back on nodes with the chunk's own version, the object queued for deletion
            bucket.fail = True
            with pytest.raises(StripefsError):
                await t.handle_tier_recall(p.TierRecallReq(ino=rep))
            assert is_cold(*svc.store.get_chunks(rep)[0][:2])  # still cold, still recorded
            bucket.fail = False
            rsp = await t.handle_tier_recall(p.TierRecallReq(ino=rep))
            (ref,) = rsp.chunks
            assert ref.version == 5 and len(ref.nodes) == 2
            for n in ref.nodes:
                assert stores[n - 1].read(p.ChunkId(rep, 0, replica_part(5)), 5, 0, 1 << 20) == (5, rep_data)
            rsp = await t.handle_tier_recall(p.TierRecallReq(ino=ec))
            (ref,) = rsp.chunks
            got = {j: stores[n - 1].read(p.ChunkId(ec, 0, fragment_part(j, 7)), 7, 0, 1 << 20)[1] for j, n in enumerate(ref.nodes)}
            assert codec(2, 1, 1 << 20).decode({0: got[0], 2: got[2]})[: len(ec_data)] == ec_data
            assert _objects(svc) == {} and len(_tier_garbage(svc)) == 2
            await t._collect()
            assert bucket.objects == {}
            nursery.cancel_scope.cancel()
    finally:
        svc.store.close()
        for s in stores:
            s.close()
        ctx.destroy(linger=0)


def test_a_snapshots_cold_row_keeps_the_object_through_the_live_recall_and_is_recalled_under_its_own_ids(svc):
    t = svc.tiering
    d = svc.ns.mkdir(1, b"d", 0o755, 0, 0).ino
    ino = _file(svc, parent=d)
    svc.store.add_tier_objects([(ino, 0, 5, 1, 11)])
    with svc.store.savepoint():
        t._switch_cold(ino, 0, 5, 1, "n0", 100, 7)
    with svc.store.savepoint():
        svc.ns.snapshots.create(d, b"s")
    snap = svc.ns.lookup(svc.ns.lookup(svc.ns.lookup(d, b".snapshots").ino, b"s").ino, b"f").ino
    with svc.store.savepoint():  # the live file comes back: the snapshot's cold row still reads the object
        assert t._switch_hot(ino, 0, 5, [3, 4], 1, "n0")
    assert _objects(svc) == {(ino, 0, 5): "stored"} and _tier_garbage(svc) == []
    with svc.store.savepoint():  # the snapshot's chunk comes back under its own ids: the object may go now
        assert t._switch_hot(snap, 0, 5, [1, 3], 1, "n0", ino)
    assert svc.store.get_chunks(snap)[0] == (5, [1, 3], []) and svc.store.data_inos(snap) == {}
    assert _objects(svc) == {} and _tier_garbage(svc) == ["n0"]
