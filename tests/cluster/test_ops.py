"""Operations: metrics of every process after real I/O, status after a node dies, top in a terminal."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import urllib.request

import pytest

from prometheus_client.parser import text_string_to_metric_families

from conftest import drop_caches, run_cli

MiB = 1 << 20


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of one /metrics endpoint."""
    with urllib.request.urlopen(url, timeout=10) as rsp:
        text = rsp.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def total(samples: dict, name: str, **labels) -> float:
    """Sum of ``name`` over the samples whose labels include ``labels``."""
    return sum(v for (n, lab), v in samples.items() if n == name and set(labels.items()) <= set(lab))


def _processes(cluster) -> list[dict]:
    return json.loads(run_cli("local", "status", "--dir", str(cluster.state), "--json").stdout)["processes"]


def test_every_process_serves_metrics_with_nonzero_values_after_io(cluster, mnt):
    data = os.urandom(10 * MiB)
    (mnt / "big").write_bytes(data)
    drop_caches()
    assert (mnt / "big").read_bytes() == data

    procs = _processes(cluster)
    assert all(p["metrics"] and p["metrics"].startswith("http://127.0.0.1:") for p in procs), procs
    by_role = {}
    for p in procs:
        by_role.setdefault(p["role"], []).append(scrape(p["metrics"]))

    (mount,) = by_role["mount"]
    for name, labels in [
        ("stripefs_fuse_ops_total", {"op": "read"}),
        ("stripefs_fuse_ops_total", {"op": "write"}),
        ("stripefs_fuse_op_seconds_count", {"op": "read"}),
        ("stripefs_fuse_op_seconds_sum", {"op": "lookup"}),
        ("stripefs_read_bytes_total", {}),
        ("stripefs_write_bytes_total", {}),
        ("stripefs_cache_hits_total", {}),
        ("stripefs_cache_misses_total", {}),
        ("stripefs_readahead_chunks_total", {"outcome": "fetched"}),
        ("stripefs_read_seconds_total", {"source": "network"}),
        ("stripefs_read_seconds_total", {"source": "cache"}),
        ("stripefs_rpc_seconds_count", {"type": "ReadChunkReq"}),
        ("stripefs_rpc_seconds_count", {"type": "WriteChunkReq"}),
        ("stripefs_rpc_seconds_count", {"peer": cluster.meta_address}),
    ]:
        assert total(mount, name, **labels) > 0, (name, labels)
    assert total(mount, "stripefs_read_bytes_total") >= len(data)
    assert total(mount, "stripefs_change_feed_healthy") == 1  # (the tests' mount_again waits for it)
    assert total(mount, "stripefs_write_bytes_total") >= len(data)

    (meta,) = by_role["meta"]
    assert total(meta, "stripefs_requests_seconds_count", server="meta") > 0
    meta_url = next(p["metrics"] for p in procs if p["role"] == "meta")
    deadline = time.monotonic() + 30  # the cluster gauges refresh every 2 s
    while not (total(meta, "stripefs_files") >= 1 and all(total(meta, "stripefs_node_up", node=str(i)) == 1 for i in range(1, 5))):
        assert time.monotonic() < deadline, "the daemon's gauges never showed 4 nodes up and a file"
        time.sleep(0.5)
        meta = scrape(meta_url)
    for node in range(1, 5):
        assert total(meta, "stripefs_node_capacity_bytes", node=str(node)) > 0
        # every node has its chunk gauge (its value may lag the write by a refresh)
        assert any(n == "stripefs_node_chunks" and ("node", str(node)) in lab for n, lab in meta), node
    assert total(meta, "stripefs_chunks") >= 3 and ("stripefs_degraded_chunks", ()) in meta

    storage = by_role["storage"]
    assert all(total(s, "stripefs_store_capacity_bytes") > 0 for s in storage)
    assert sum(total(s, "stripefs_payload_bytes_total", direction="in") for s in storage) >= 2 * len(data)  # 2 replicas
    assert sum(total(s, "stripefs_payload_bytes_total", direction="out") for s in storage) >= len(data)


def _status(cluster) -> dict:
    return json.loads(run_cli("status", "--meta", cluster.meta_address, "--json").stdout)


def _wait_status(cluster, predicate, what: str, timeout: float = 90, every: float = 0.5) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        status = _status(cluster)
        if predicate(status):
            return status
        assert time.monotonic() < deadline, f"{what}: {status}"
        time.sleep(every)


def test_status_json_matches_the_cluster_after_a_node_is_killed(cluster, mnt):
    # 80 chunks over 4 nodes, 2 copies each: node 4's ~160 MiB take repair (64 MiB/s, one second of
    # burst) 1.5 s past its burst at least, so the status that first shows the node down (a CLI run
    # every 0.1 s, up to a second each on a loaded machine) still counts degraded chunks
    (mnt / "striped").write_bytes(os.urandom(320 * MiB))
    # a node's chunk count comes with its heartbeat (every second): wait for the one after the write
    before = _wait_status(cluster, lambda s: all(n["chunks"] > 0 for n in s["nodes"]), "nodes never reported their chunks", timeout=10)
    # (what made it degraded, if it is: once seen in CI, cause unknown)
    why = {k: before[k] for k in ("nodes_up", "degraded_chunks", "under_replicated", "repair")}
    why["states"] = {n["node_id"]: (n["state"], n["last_heartbeat_age_s"]) for n in before["nodes"]}
    assert before["health"] == "ok" and before["nodes_up"] == before["nodes_total"] == 4, why
    assert before["degraded_chunks"] == 0
    assert before["leader"] and before["leader"] == before["daemon"]  # one daemon (SQLite): it leads
    on_node4 = next(n for n in before["nodes"] if n["node_id"] == 4)["chunks"]
    assert on_node4 > 0

    cluster.kill_node(4)
    try:
        after = _wait_status(cluster, lambda s: s["nodes_up"] == 3, "node 4 never declared down", every=0.1)
        states = {n["node_id"]: n["state"] for n in after["nodes"]}
        assert states == {1: "up", 2: "up", 3: "up", 4: "down"}
        assert after["health"] == "degraded"
        assert 0 < after["degraded_chunks"] <= after["chunks"]
        # repair starts as soon as the node is down (daemon/repair.py): the backlog is the
        # chunks below their redundancy, and both counts only fall from here
        assert after["repair_backlog"] == after["under_replicated"] <= after["chunks"]
        assert next(n for n in after["nodes"] if n["node_id"] == 4)["last_heartbeat_age_s"] > 0
        text = run_cli("status", "--meta", cluster.meta_address).stdout
        assert "DEGRADED, 3/4 storage nodes up" in text
        assert f"duties      led by {before['leader']} (this daemon)" in text
        degraded_now = int(re.search(r"(\d+) chunks? degraded", text).group(1))
        assert degraded_now <= after["degraded_chunks"]
        meta_metrics = next(p["metrics"] for p in _processes(cluster) if p["role"] == "meta")
        deadline = time.monotonic() + 30
        while total(scrape(meta_metrics), "stripefs_node_up", node="4") != 0:
            assert time.monotonic() < deadline
            time.sleep(0.5)
        # the gauge is refreshed every 2 s from its own read of the database, which may predate the
        # status above (the count falls as repair goes): it must agree with a status taken with it
        deadline = time.monotonic() + 60
        while True:
            gauge = total(scrape(meta_metrics), "stripefs_degraded_chunks")
            now = _status(cluster)["degraded_chunks"]
            if gauge == now == total(scrape(meta_metrics), "stripefs_degraded_chunks"):
                break
            assert time.monotonic() < deadline, f"metrics say {gauge} degraded chunks, status {now}"
            time.sleep(0.5)
    finally:
        cluster.restart()
    _wait_status(cluster, lambda s: s["health"] == "ok", "node 4 never came back")
    (mnt / "striped").unlink()  # the cluster is shared by the session's tests: give its space back


def test_top_renders_in_a_terminal(cluster, mnt):
    assert shutil.which("tmux"), "tmux is missing: 'make install' installs it"
    session = f"stripefs-top-{os.getpid()}"
    command = f"{shlex.quote(sys.executable)} -m stripefs top {shlex.quote(str(cluster.mnt))} --interval 0.5; echo TOP EXITED $?; sleep 60"
    subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "120", "-y", "40", command], check=True, timeout=30)
    try:
        deadline = time.monotonic() + 60
        screen = ""
        i = 0
        while time.monotonic() < deadline:
            data = os.urandom(4 * MiB)  # a new file each time: its chunks are in no cache yet
            (mnt / f"watched{i}").write_bytes(data)
            drop_caches()
            assert (mnt / f"watched{i}").read_bytes() == data
            i += 1
            screen = subprocess.run(
                ["tmux", "capture-pane", "-p", "-t", session], capture_output=True, text=True, timeout=30
            ).stdout
            assert "Traceback" not in screen and "TOP EXITED" not in screen, screen
            if re.search(r"read  MiB/s +[1-9]", screen) and "tcp://127.0.0.1" in screen:
                break
            time.sleep(0.3)
        else:
            raise AssertionError(f"top never showed reads from storage nodes:\n{screen}")
        for words in ("reads/s", "cache hit rate", "read time: network", "p99 ms", "=> ", "chunk reads from"):
            assert words in screen, (words, screen)
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True, timeout=30)


def test_top_without_a_mount_says_what_to_do(tmp_path):
    res = run_cli("top", str(tmp_path), "--once", check=False)
    assert res.returncode == 1 and "--metrics" in res.stderr and "Traceback" not in res.stderr


@pytest.mark.parametrize(
    "args,words",
    [
        (["top"], ["MOUNT", "--metrics", "network", "--once"]),
        (["meta", "backup"], ["FILE", "--config", "--dir", "while the daemon serves"]),
        (["meta", "restore"], ["FILE", "stopped"]),
        (["install-mount-helper"], ["/sbin/mount.fuse.stripefs", "fstab", "--dir"]),
        (["status"], ["--json", "repair backlog", "docs/operations.md"]),
    ],
)
def test_help_explains(args, words):
    out = " ".join(run_cli(*args, "--help").stdout.split())  # whatever the terminal width wrapped
    for w in words:
        assert w in out, (args, w, out)
