"""Erasure-coded files (ec=4+2) on a 6-node cluster of real processes with a real mount.

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
    # stripe counts the fragments that were stored (test_degraded_writes waits this out twice)
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


def _fragment_files(ec, ino: int, index: int) -> list[Path]:
    return sorted(ec.state.glob(f"storage-*/data/chunks/*/*/{ino}-{index}-*.chunk"))


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


def test_fragments_on_distinct_nodes_and_trimmed(ec, d):
    (d / "big").write_bytes(os.urandom(CHUNK))
    (d / "tiny").write_bytes(b"0123456789")
    big = _fragment_files(ec, (d / "big").stat().st_ino, 0)
    assert len(big) == 6 and len({p.parts[-6] for p in big}) == 6  # one fragment per storage node
    tiny = _fragment_files(ec, (d / "tiny").stat().st_ino, 0)
    sizes = sorted(p.stat().st_size for p in tiny)
    # chunk files of 64-byte header + 8-byte block checksums + data: 10 bytes in fragment 0
    # and in each parity fragment, nothing in data fragments 1-3
    assert sizes == [64, 64, 64, 64 + 8 + 10, 64 + 8 + 10, 64 + 8 + 10]


def test_sizes_overwrites_sparse_truncate(ec, d):
    rng = random.Random(7)
    sums = _populate(d, 8, seed=1)
    content = bytearray(rng.randbytes(3 * CHUNK + 4321))
    (d / "rw").write_bytes(content)
    with open(d / "rw", "r+b") as f:
        for _ in range(25):
            off = rng.randrange(len(content) + CHUNK)
            piece = rng.randbytes(rng.randrange(1, CHUNK // 2))
            f.seek(off)
            f.write(piece)
            if off > len(content):
                content.extend(bytes(off - len(content)))
            content[off : off + len(piece)] = piece
    with open(d / "sparse", "wb") as f:
        f.seek(5 * CHUNK + 17)
        f.write(b"tail")
    os.truncate(d / "rw", 2 * CHUNK + 999)  # cut inside a stripe
    del content[2 * CHUNK + 999 :]
    os.truncate(d / "rw", 4 * CHUNK)  # extend: zeros
    content.extend(bytes(4 * CHUNK - len(content)))
    drop_caches()
    for view in (d, _fresh_view(ec, d)):
        for name, digest in sums.items():
            assert _sha(view / name) == digest, name
        assert (view / "rw").read_bytes() == bytes(content)
        sparse = (view / "sparse").read_bytes()
        assert len(sparse) == 5 * CHUNK + 21 and sparse.endswith(b"tail") and not any(sparse[:-4])


def test_two_nodes_killed_every_file_reads(ec, d):
    sums = _populate(d, 12, seed=2)
    fresh = _fresh_view(ec, d)  # mounted before the kill, its cache empty
    ec.kill_node(2)
    ec.kill_node(5)
    try:
        drop_caches()
        for name, digest in sums.items():
            assert _sha(fresh / name) == digest, name
    finally:
        ec.restart()


def test_corrupt_fragment_reads_stay_correct(ec, d):
    data = os.urandom(2 * CHUNK)
    (d / "c").write_bytes(data)
    ino = (d / "c").stat().st_ino
    victim = _fragment_files(ec, ino, 0)[0]  # fragment 0 of stripe 0: data, read on every healthy read
    raw = bytearray(victim.read_bytes())
    raw[-100] ^= 0xFF
    victim.write_bytes(raw)
    drop_caches()
    assert _sha(_fresh_view(ec, d) / "c") == hashlib.sha256(data).hexdigest()


def test_degraded_writes(ec, d):
    sums = {}
    ec.kill_node(3)
    try:
        data = os.urandom(3 * CHUNK + 5)
        (d / "one_down").write_bytes(data)  # 5 of 6 fragments per stripe: K+1 is enough
        sums["one_down"] = hashlib.sha256(data).hexdigest()
        status = json.loads(run_cli("status", str(ec.mnt), "--json").stdout)
        (usage,) = [u for u in status["layouts"] if u["redundancy"] == "ec=4+2"]
        assert usage["degraded_stripes"] >= 4
        ec.kill_node(4)
        ec.expect_log(r"could not be stored")
        # 4 nodes for 6 fragments: below K+1, the write fails and nothing is committed
        with pytest.raises(OSError):
            with open(d / "two_down", "wb") as f:
                f.write(os.urandom(CHUNK))
                os.fsync(f.fileno())
        # nothing torn, no length without its data: the file keeps what it had (nothing)
        assert (d / "two_down").stat().st_size == 0
        drop_caches()
        assert _sha(_fresh_view(ec, d) / "one_down") == sums["one_down"]
    finally:
        ec.restart()
    drop_caches()
    assert _sha(d / "one_down") == sums["one_down"]


def test_fsync_and_rewrite_same_session(ec, d):
    with open(d / "s", "w+b") as f:
        f.write(b"a" * (CHUNK + 10))
        os.fsync(f.fileno())
        f.seek(5)
        f.write(b"b" * 10)  # a stripe rewritten in the same write session
        os.fsync(f.fileno())
    want = b"a" * 5 + b"b" * 10 + b"a" * (CHUNK - 5)
    drop_caches()
    assert (_fresh_view(ec, d) / "s").read_bytes() == want


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
