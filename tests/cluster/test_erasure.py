"""Erasure-coded files (ec=4+2) on a 6-node cluster of real processes with a real mount: the CLI's part.

Layout refusals, the overhead status reports, conversions both ways and a
conversion killed half-way. The data path of EC files (fragments, overwrites,
truncates, nodes killed, corrupt fragments, degraded writes, fsync) is tested on
the mount's handlers without a kernel (tests/inprocess/test_erasure_ops.py).

The module starts its own cluster (6 storage nodes, short node, session and
mount RPC timeouts) next to the session's 4-node one. Reads that must not come
from the writer's memory cache use a fresh mount (a new client process).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import signal
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from conftest import Cluster, client_config, cluster_root, drop_caches, run_cli, run_cluster
from stripefs.common import config as cfg

MiB = 1 << 20
CHUNK = 1 * MiB  # small stripes keep the data small: 4 data fragments of 256 KiB


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def ec(request):
    c = Cluster(cluster_root("stripefs-ec-"), nodes=6)
    c.state.mkdir(parents=True)
    # the mount's: a fragment sent to a killed node is given up after 4 s (default 10 s), then the
    # stripe counts the fragments that were stored (as in tests/inprocess/test_erasure_ops.py)
    client_toml = client_config(c.state / "client.toml", rpc_timeout_s=4.0)
    c.local._create(c.mnt.absolute(), 6, ["allow_other", f"config={client_toml}"])
    meta_toml = c.state / "meta" / "metad.toml"
    meta = cfg.load(meta_toml, cfg.MetaConfig)
    meta_toml.write_text(cfg.dumps(msgspec.structs.replace(meta, node_timeout_s=3.0, session_lease_s=4.0)))
    c.expected_log_patterns += [
        r"not answering", r"failed", r"unreadable", r"no reply", r"fragments could be written", r"fewer than",
        r"fragments of one version", r"session",
    ]
    yield from run_cluster(
        request, c, label="ec ",
        after_up=lambda c: run_cli("layout", "set", str(c.mnt), "--ec", "4+2", "--chunk-size", "1M"),
    )


@pytest.fixture
def d(ec, request) -> Path:
    path = ec.mnt / re.sub(r"[^A-Za-z0-9_]", "_", request.node.name)
    path.mkdir()
    return path


def _fresh_view(ec, d: Path) -> Path:
    """``d`` as seen by a new mount: nothing in its memory cache."""
    name = f"fresh{len(ec.extra_mounts)}"
    return ec.mount_again(name) / d.relative_to(ec.mnt)


def _populate(d: Path, n: int, seed: int) -> dict[str, str]:
    rng = random.Random(seed)
    sums = {}
    for i in range(n):
        data = rng.randbytes(rng.choice([0, 1, 10, 5000, CHUNK - 1, CHUNK, CHUNK + 7, 3 * CHUNK + 123456]))
        (d / f"f{i}").write_bytes(data)
        sums[f"f{i}"] = hashlib.sha256(data).hexdigest()
    return sums


def test_layout_set_get_and_refusals(ec, d):
    out = run_cli("layout", "get", str(d)).stdout
    assert "ec=4+2" in out and "chunk_size=1.0M" in out
    (d / "f").write_bytes(b"x")
    assert "ec=4+2" in run_cli("layout", "get", str(d / "f")).stdout
    res = run_cli("layout", "set", str(d), "--ec", "4+3", check=False)
    assert res.returncode == 3 and "ec=4+3" in res.stderr and "choose a smaller K+M" in res.stderr
    res = run_cli("layout", "set", str(d), "--ec", "17+1", check=False)
    assert res.returncode == 1 and "K in 1..16" in res.stderr
    assert "ec=4+2" in run_cli("layout", "get", str(d)).stdout


def test_status_reports_overhead(ec, d):
    def usage():
        status = json.loads(run_cli("status", str(ec.mnt), "--json").stdout)
        found = [u for u in status["layouts"] if u["redundancy"] == "ec=4+2"]
        return found[0] if found else {"logical_bytes": 0, "raw_bytes": 0}

    before = usage()
    (d / "s").write_bytes(os.urandom(4 * CHUNK))
    after = usage()
    assert after["logical_bytes"] - before["logical_bytes"] == 4 * CHUNK
    # 4+2: exactly 1.5x
    assert after["raw_bytes"] - before["raw_bytes"] == 6 * CHUNK
    assert after["raw_bytes"] > after["logical_bytes"] and after["overhead"] > 1
    assert "ec=4+2" in run_cli("status", str(ec.mnt)).stdout


def test_convert_both_ways(ec, d):
    rep = d / "rep"
    rep.mkdir()
    run_cli("layout", "set", str(rep), "--replicas", "2")
    sums = _populate(rep, 6, seed=3)
    inos = {name: (rep / name).stat().st_ino for name in sums}
    res = run_cli("layout", "convert", "--recursive", str(rep), "--ec", "4+2")
    assert "6 file(s) converted to ec=4+2" in res.stdout
    assert "ec=4+2" in run_cli("layout", "get", str(rep)).stdout  # new files too
    for name, digest in sums.items():
        assert "ec=4+2" in run_cli("layout", "get", str(rep / name)).stdout
        assert (rep / name).stat().st_ino != inos[name]
    drop_caches()
    fresh = _fresh_view(ec, rep)
    for name, digest in sums.items():
        assert _sha(fresh / name) == digest, name
    res = run_cli("layout", "convert", str(rep / "f5"), "--replicas", "3")
    assert "converted to replicas=3" in res.stdout
    res = run_cli("layout", "convert", "-r", str(rep), "--ec", "4+2")
    assert "1 file(s) converted" in res.stdout and "5 already were" in res.stdout
    res = run_cli("layout", "convert", str(rep), "--ec", "4+2", check=False)
    assert res.returncode == 1 and "--recursive" in res.stderr


def test_convert_killed_leaves_every_file_readable(ec, d):
    sums = _populate(d, 10, seed=4)
    big = os.urandom(24 * CHUNK)
    (d / "zbig").write_bytes(big)  # last in walk order is not guaranteed: big enough to be copying at the kill
    sums["zbig"] = hashlib.sha256(big).hexdigest()
    run_cli("layout", "set", str(d), "--replicas", "2")  # the target differs from every file's layout
    proc = subprocess.Popen(
        [sys.executable, "-m", "stripefs", "layout", "convert", "-r", str(d), "--replicas", "2"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    for line in proc.stderr:  # one line per converted file: kill it half-way through the list
        if line.startswith("[6/"):
            break
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    proc.stderr.close()
    drop_caches()
    for name, digest in sums.items():
        assert _sha(d / name) == digest, name
        assert re.search(r"ec=4\+2|replicas=2", run_cli("layout", "get", str(d / name)).stdout)
    # running it again finishes the job
    res = run_cli("layout", "convert", "-r", str(d), "--replicas", "2")
    assert "failed" not in res.stdout
    drop_caches()
    for name, digest in sums.items():
        assert "replicas=2" in run_cli("layout", "get", str(d / name)).stdout
        assert _sha(d / name) == digest, name
