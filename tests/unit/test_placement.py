"""Chunk placement: distinct nodes and hosts, striping, free-space weighting, degraded mode."""

import collections
import logging

import pytest

from stripefs.common.errors import ErrorCode, StripefsError
from stripefs.daemon import placement
from stripefs.daemon.placement import NodeView, place_chunks, replace_node, stripe_set


def nodes(n, hosts=None, free=1 << 30):
    return [NodeView(i, f"h{(i - 1) % hosts if hosts else i}", free) for i in range(1, n + 1)]


def test_copies_on_distinct_nodes_and_hosts():
    cluster = nodes(8, hosts=4)
    placed = place_chunks(cluster, range(64), copies=3, stripe_count=4, stripe_seed=7)
    host = {n.node_id: n.host for n in cluster}
    for index, ids in placed.items():
        assert len(ids) == 3 == len(set(ids))
        assert len({host[i] for i in ids}) == 3, (index, ids)


def test_falls_back_to_distinct_nodes_when_hosts_run_out():
    cluster = nodes(4, hosts=2)
    for ids in place_chunks(cluster, range(16), copies=3, stripe_count=2, stripe_seed=1).values():
        assert len(set(ids)) == 3
        assert {cluster[i - 1].host for i in ids} == {"h0", "h1"}


def test_primaries_rotate_over_stripe_count_nodes():
    cluster = nodes(10)
    placed = place_chunks(cluster, range(40), copies=2, stripe_count=4, stripe_seed=42)
    primaries = [placed[i][0] for i in range(40)]
    assert len(set(primaries)) == 4
    for i in range(36):
        assert len(set(primaries[i : i + 4])) == 4  # any 4 consecutive chunks: 4 different nodes
    # the same placement when the chunks are placed one call at a time
    assert [place_chunks(cluster, [i], copies=2, stripe_count=4, stripe_seed=42)[i] for i in range(8)] == [
        placed[i] for i in range(8)
    ]
    # different files use different stripe sets
    sets = {tuple(n.node_id for n in stripe_set(cluster, 4, seed)) for seed in range(20)}
    assert len(sets) > 10


def test_weighted_by_free_space():
    cluster = [NodeView(1, "a", 100 << 30), NodeView(2, "b", 1 << 30), NodeView(3, "c", 100 << 30)]
    counts = collections.Counter()
    for seed in range(300):
        counts.update(stripe_set(cluster, 1, seed)[0].node_id for _ in [0])
    assert counts[2] < counts[1] / 5 and counts[2] < counts[3] / 5


def test_down_nodes_are_skipped_and_none_up_is_unavailable():
    cluster = [NodeView(1, "a", 1, up=False), NodeView(2, "b", 1), NodeView(3, "c", 1)]
    for ids in place_chunks(cluster, range(10), copies=2, stripe_count=4, stripe_seed=3).values():
        assert sorted(ids) == [2, 3]
    with pytest.raises(StripefsError) as info:
        place_chunks([NodeView(1, "a", 1, up=False)], [0], copies=2, stripe_count=1, stripe_seed=0)
    assert info.value.code == ErrorCode.UNAVAILABLE and "no storage node is up" in info.value.message


def test_degraded_places_on_what_there_is_and_warns(caplog, monkeypatch):
    monkeypatch.setattr(placement, "_last_degraded_warning", float("-inf"))
    with caplog.at_level(logging.WARNING, logger="stripefs.daemon.placement"):
        placed = place_chunks(nodes(2), range(5), copies=3, stripe_count=4, stripe_seed=0)
        place_chunks(nodes(2), range(5), copies=3, stripe_count=4, stripe_seed=0)
    assert all(sorted(ids) == [1, 2] for ids in placed.values())
    assert len([r for r in caplog.records if "degraded" in r.message]) == 1  # rate-limited


def test_replace_node():
    cluster = nodes(6, hosts=3)  # hosts h0 h1 h2, two nodes each
    new = replace_node(cluster, [1, 2], failed=2, key=5)
    assert new not in (1, 2) and cluster[new - 1].host != cluster[0].host  # a new host preferred
    down = [NodeView(n.node_id, n.host, n.free_bytes, up=n.node_id in (1, 2)) for n in cluster]
    with pytest.raises(StripefsError) as info:
        replace_node(down, [1, 2], failed=2, key=5)
    assert info.value.code == ErrorCode.UNAVAILABLE
