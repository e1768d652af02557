"""The daemon's erasure-coding bookkeeping in-process: layout checks, missing
fragments, fragment moves, space per layout, and the conversion swap."""

import pytest

from stripefs.common import protocol as P
from stripefs.common.errors import ErrorCode, StripefsError
from stripefs.daemon import redundancy
from stripefs.daemon.placement import NodeView
from stripefs.common.layout import parse_redundancy

from test_namespace import ROOT, World, code_of


@pytest.fixture
def w(tmp_path):
    world = World(tmp_path)
    world.add_nodes(6)
    yield world
    world.store.close()


def _ec_dir(w, spec="ec=4+2"):
    d = w.ns.mkdir(ROOT, b"ec", 0o755, 0, 0)
    w.ns.set_layout(d.ino, redundancy=spec)
    return d.ino


def _down(w, *ids):
    for i in ids:
        w.nodes._nodes[i].up = False


def test_check_fits_counts_hosts_when_labelled():
    six_nodes_two_hosts = [NodeView(i, f"h{i % 2}", 1) for i in range(1, 7)]
    with pytest.raises(StripefsError, match="distinct hosts"):
        redundancy.check_fits(six_nodes_two_hosts, parse_redundancy("ec=4+2"))
    one_label = [NodeView(i, "box", 1) for i in range(1, 7)]
    redundancy.check_fits(one_label, parse_redundancy("ec=4+2"))  # a single machine: counted by nodes
    with pytest.raises(StripefsError, match="needs 7 storage nodes"):
        redundancy.check_fits(one_label, parse_redundancy("ec=4+3"))


def test_ec_placement_is_in_fragment_order_with_missing_slots(w):
    d = _ec_dir(w)
    ino, _ = w.ns.create(d, b"f", 0o644, 0, 0)
    nodes = w.ns.open_info(ino)[2][0].nodes
    assert sorted(nodes) == [1, 2, 3, 4, 5, 6]
    _down(w, 2)
    refs, addrs = w.ns.alloc_chunks(ino, [1])
    assert refs[0].nodes.count(redundancy.MISSING) == 1 and 2 not in refs[0].nodes
    assert redundancy.MISSING not in [a.node_id for a in addrs]


def test_replace_fragment_keeps_its_position(w):
    d = _ec_dir(w)
    ino, _ = w.ns.create(d, b"f", 0o644, 0, 0)
    _down(w, 6)
    w.add_nodes(0)
    w.nodes.register(P.RegisterNodeReq(node_id=7, address="tcp://127.0.0.1:7107", host="h7",
                                       capacity_bytes=1 << 40, free_bytes=1 << 39, used_bytes=0, chunks=0))
    before = w.ns.open_info(ino)[2][0].nodes
    part = before.index(3)
    ref, _ = w.ns.replace_replica(ino, 0, 3, part)
    assert ref.nodes[part] not in before and ref.nodes[part] != 6
    assert [n for i, n in enumerate(ref.nodes) if i != part] == [n for i, n in enumerate(before) if i != part]
    # a repeated request (the copy already moved) answers the current placement
    assert w.ns.replace_replica(ino, 0, 3, part)[0] == ref
    # no node left to take a fragment: the placement stays while its node heartbeats
    # (the writer only suspected it), UNAVAILABLE once it is down
    _down(w, 3)
    live = next(i for i, n in enumerate(ref.nodes) if w.nodes._nodes[n].up)
    assert w.ns.replace_replica(ino, 0, ref.nodes[live], live)[0] == ref
    _down(w, ref.nodes[live])
    assert code_of(w.ns.replace_replica, ino, 0, ref.nodes[live], live) == ErrorCode.UNAVAILABLE


def test_degraded_commit_is_queued_and_counted(w):
    d = _ec_dir(w)
    ino, _ = w.ns.create(d, b"f", 0o644, 0, 0)
    nodes = list(w.ns.open_info(ino)[2][0].nodes)
    nodes[5] = redundancy.MISSING
    epoch, _ = w.ns.alloc_epoch()
    w.ns.commit(ino, 1000, 0, [P.ChunkRef(index=0, version=epoch, nodes=nodes)])
    assert w.store.degraded_stripes() == [(ino, 0)]
    usage = redundancy.layout_usage(w.store.usage_rows())["ec=4+2"]
    assert usage["files"] == 1 and usage["logical_bytes"] == 1000 and usage["degraded_stripes"] == 1
    # 1000 bytes of a 4+2 stripe: 1000 in fragment 0 and in the parity fragment present (one is missing)
    assert usage["raw_bytes"] == 1000 * 2
    # truncating it away leaves no garbage row for the missing node
    w.ns.setattr(ino, size=0)
    assert 0 not in w.store.garbage_nodes()


def test_layout_usage_of_replicas(w):
    ino, _ = w.ns.create(ROOT, b"r", 0o644, 0, 0)  # replicas=2, 1 MiB chunks
    epoch, _ = w.ns.alloc_epoch()
    refs, _ = w.ns.alloc_chunks(ino, [0, 1])
    w.ns.commit(ino, (1 << 20) + 10, 0, [P.ChunkRef(index=r.index, version=epoch, nodes=r.nodes) for r in refs])
    usage = redundancy.layout_usage(w.store.usage_rows())["replicas=2"]
    assert usage["raw_bytes"] == 2 * ((1 << 20) + 10)


def test_conversion_swap(w):
    ino, _ = w.ns.create(ROOT, b"f", 0o644, 0, 0)
    w.ns.link(ino, ROOT, b"hard")
    w.ns.setxattr(ino, b"user.k", b"v")
    epoch, _ = w.ns.alloc_epoch()
    ref = w.ns.open_info(ino)[2][0]
    attr = w.ns.commit(ino, 5, 0, [P.ChunkRef(index=0, version=epoch, nodes=ref.nodes)])
    shadow = w.ns.create_shadow(ino, "ec=4+2")
    assert w.ns.get_layout(shadow).redundancy == "ec=4+2"
    assert w.ns.lookup(ROOT, b"f").ino == ino  # nothing visible yet
    copied = [P.ChunkRef(index=0, version=epoch, nodes=[])]
    # the file changed meanwhile: BUSY, nothing moves
    w.ns.commit(ino, 6, 0, [P.ChunkRef(index=0, version=epoch + 1, nodes=ref.nodes)])
    assert code_of(w.ns.swap_shadow, ino, shadow, attr.size, attr.mtime_ns, copied) == ErrorCode.BUSY
    assert w.ns.lookup(ROOT, b"f").ino == ino
    attr = w.ns.getattr(ino)
    copied = [P.ChunkRef(index=0, version=epoch + 1, nodes=[])]
    new, entries = w.ns.swap_shadow(ino, shadow, attr.size, attr.mtime_ns, copied)
    assert sorted(entries) == [(ROOT, b"f"), (ROOT, b"hard")]
    assert new.ino == shadow and new.nlink == 2 and new.size == 6 and new.mtime_ns == attr.mtime_ns
    assert w.ns.lookup(ROOT, b"f").ino == shadow == w.ns.lookup(ROOT, b"hard").ino
    assert w.ns.getxattr(shadow, b"user.k") == b"v"
    assert code_of(w.ns.getattr, ino) == ErrorCode.NOT_FOUND  # nobody had it open: reclaimed
    assert {r["ino"] for r in w.store.conn.execute("SELECT ino FROM garbage")} == {ino}


def test_unheld_shadow_is_an_orphan(w):
    ino, _ = w.ns.create(ROOT, b"f", 0o644, 0, 0)
    shadow = w.ns.create_shadow(ino, "ec=4+2")
    assert w.ns.reclaim_orphans() == 1
    assert code_of(w.ns.getattr, shadow) == ErrorCode.NOT_FOUND
    assert w.ns.lookup(ROOT, b"f").ino == ino
