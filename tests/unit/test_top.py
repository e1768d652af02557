"""stripefs top's arithmetic: rates and percentiles from two scrapes."""

import math

import pytest

from stripefs.top import quantile, render, verdict


def _hist(name, labels, bounds_counts):
    out = {}
    for le, count in bounds_counts:
        key = tuple(sorted({**labels, "le": le}.items()))
        out[(f"{name}_bucket", key)] = count
    return out


def test_quantile_interpolates_inside_the_bucket():
    buckets = [(0.001, 0.0), (0.01, 100.0), (0.1, 100.0), (math.inf, 100.0)]
    assert quantile(0.5, buckets) == pytest.approx(0.0055)
    assert quantile(0.99, buckets) == pytest.approx(0.00991)
    assert quantile(0.5, []) is None
    assert quantile(0.5, [(0.1, 0.0), (math.inf, 0.0)]) is None
    assert quantile(0.99, [(0.1, 1.0), (math.inf, 10.0)]) == 0.1  # beyond the last bound: that bound


def test_render_shows_rates_hit_rate_and_the_network_share():
    prev = {
        ("stripefs_fuse_ops_total", (("op", "read"),)): 100.0,
        ("stripefs_read_bytes_total", ()): 0.0,
        ("stripefs_cache_hits_total", ()): 10.0,
        ("stripefs_cache_misses_total", ()): 10.0,
        ("stripefs_read_seconds_total", (("source", "network"),)): 0.0,
        ("stripefs_read_seconds_total", (("source", "cache"),)): 0.0,
        **_hist("stripefs_fuse_op_seconds", {"op": "read"}, [("0.001", 0.0), ("0.01", 0.0), ("+Inf", 0.0)]),
    }
    cur = dict(prev)
    cur.update({
        ("stripefs_fuse_ops_total", (("op", "read"),)): 300.0,  # 200 reads in 2 s
        ("stripefs_read_bytes_total", ()): 400.0 * (1 << 20),
        ("stripefs_cache_hits_total", ()): 40.0,  # 30 hits, 10 misses: 75 %
        ("stripefs_cache_misses_total", ()): 20.0,
        ("stripefs_read_seconds_total", (("source", "network"),)): 1.5,
        ("stripefs_read_seconds_total", (("source", "cache"),)): 0.5,
        **_hist("stripefs_fuse_op_seconds", {"op": "read"}, [("0.001", 0.0), ("0.01", 200.0), ("+Inf", 200.0)]),
    })
    screen = "\n".join(render(cur, prev, 2.0, "/mnt/data"))
    assert "reads/s      100.0" in screen
    assert "read  MiB/s     200.0" in screen
    assert "75.0%" in screen
    assert "network  75%" in screen and "cache/memory  25%" in screen
    assert "waiting on storage nodes" in screen
    assert "read" in screen and "5.50" in screen  # p50 of 200 reads between 1 and 10 ms


def test_verdict_idle_and_cached():
    assert verdict(None, 0, None).startswith("idle")
    assert "served from memory" in verdict(0.05, 10, 0.99)
    assert "bottleneck is elsewhere" in verdict(0.9, 10, 0.5, busy=0.01)
    assert "waiting on storage nodes" in verdict(0.9, 10, 0.5, busy=0.8)


def test_a_job_reading_from_the_page_cache_is_not_idle():
    """Issue 36 item 6: a warm epoch sends no reads (the kernel serves them from its page cache), only
    what a file's open or stat asks (here a buffered open's isatty() IOCTL and a GETATTR, counted by the
    session: stripefs_fuse_requests_total); top called that 'idle: no reads'."""
    prev = {("stripefs_fuse_requests_total", (("opcode", op),)): 0.0 for op in ("read", "ioctl", "getattr")}
    cur = {("stripefs_fuse_requests_total", (("opcode", op),)): n for op, n in (("read", 0.0), ("ioctl", 1458.0),
                                                                              ("getattr", 1458.0))}
    screen = "\n".join(render(cur, prev, 1.0, "/mnt/data"))
    assert "idle" not in screen and "page cache" in screen
    assert verdict(None, 0, None).startswith("idle")
    assert "page cache" in verdict(0.0, 2, 1.0, busy=0.001, ops=3000)  # a stray read beside thousands of opens
    assert "rarely inside stripefs" in verdict(0.0, 200, 1.0, busy=0.01, ops=600)
