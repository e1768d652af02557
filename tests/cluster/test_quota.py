"""Directory quotas through a real mount: EDQUOT on creates and writes, nothing kept past a limit.

Each test ends with ``stripefs quota recount``, which counts the tree again
and exits 3 if the incrementally kept usage had drifted: the accounting is
checked against a scan after every scenario.
"""

from __future__ import annotations

import errno
import json
import os
import struct
import time
from pathlib import Path

import pytest

from conftest import run_cli

K = 1 << 10
CHUNK = 256 * K


def quota(*args: str, check: bool = True):
    return run_cli("quota", *args, check=check)


def get(path: Path) -> list[dict]:
    return json.loads(quota("get", str(path), "--json").stdout)


def used(path: Path) -> tuple[int, int]:
    q = get(path)[0]
    return q["used_bytes"], q["used_inodes"]


def recount_ok(path: Path) -> None:
    res = quota("recount", str(path), check=False)
    assert res.returncode == 0, f"usage had drifted from a recount:\n{res.stdout}{res.stderr}"


def edquot(fn, *args) -> None:
    with pytest.raises(OSError) as info:
        fn(*args)
    assert info.value.errno == errno.EDQUOT, info.value


def write_all(path: Path, data: bytes) -> tuple[int, bool]:
    """Write as a careful application does, until done or EDQUOT: (bytes written, whether EDQUOT came)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    done = 0
    try:
        while done < len(data):
            try:
                done += os.write(fd, data[done:])
            except OSError as exc:
                if exc.errno != errno.EDQUOT:
                    raise
                return done, True
    finally:
        os.close(fd)
    return done, False


def stored_ends(cluster, path: Path) -> list[int]:
    """For every chunk copy of the file on the storage nodes: the file offset its data ends at."""
    ends = []
    for f in cluster.state.glob(f"storage-*/data/chunks/*/*/{path.stat().st_ino}-*.chunk"):
        index = int(f.name.split("-")[1])
        with open(f, "rb") as fh:
            length = struct.unpack("<Q", fh.read(32)[24:32])[0]
        ends.append(index * CHUNK + length)
    return ends


def eventually_stored_within(cluster, path: Path, limit: int, timeout: float = 20) -> None:
    """Chunk copies past the limit are garbage: collected within a few GC rounds."""
    deadline = time.monotonic() + timeout
    while max(stored_ends(cluster, path), default=0) > limit and time.monotonic() < deadline:
        time.sleep(0.2)
    ends = stored_ends(cluster, path)
    assert ends and max(ends) <= limit, f"bytes stored past the limit {limit}: {sorted(ends)}"


@pytest.fixture
def d(mnt):
    run_cli("layout", "set", str(mnt), "--chunk-size", "256K")
    return mnt


def test_inode_limit(d):
    quota("set", str(d), "--inodes", "3")
    (d / "a").write_bytes(b"x")
    (d / "sub").mkdir()
    os.symlink("a", d / "sub" / "link")
    assert used(d) == (2, 3)  # bytes: the file and the symlink's target
    edquot((d / "b").write_bytes, b"y")
    edquot(os.mkdir, d / "sub" / "dir")
    edquot(os.symlink, "a", d / "l2")
    assert sorted(os.listdir(d)) == ["a", "sub"]
    os.unlink(d / "a")
    (d / "sub" / "b").write_bytes(b"z")  # unlink made room
    assert used(d) == (2, 3)
    recount_ok(d)


def test_byte_limit_short_write_then_edquot(cluster, d):
    limit = 600 * K
    quota("set", str(d), "--bytes", "600K")
    data = os.urandom(4 * CHUNK)
    fd = os.open(d / "f", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        assert os.write(fd, data) == limit  # the part that fits
        edquot(os.write, fd, b"more")
        assert os.pwrite(fd, b"overwrite", 0) == 9  # rewriting bytes below the limit is fine
    finally:
        os.close(fd)
    f = d / "f"
    assert f.stat().st_size == limit
    assert f.read_bytes() == b"overwrite" + data[9:limit]
    eventually_stored_within(cluster, f, limit)
    assert used(d) == (limit, 1)
    with open(d / "g", "wb", buffering=0) as g:
        edquot(g.write, b"x" * 10)
    os.truncate(f, 100 * K)  # shrinking frees; growing back past the limit does not fit
    edquot(os.truncate, f, limit + 1)
    assert used(d) == (100 * K, 2)
    os.unlink(f)
    (d / "h").write_bytes(data[: 2 * CHUNK])
    assert used(d) == (2 * CHUNK, 2)
    recount_ok(d)


def close_second_over_quota(d, one: bytes, two: bytes) -> None:
    """Write files one and two side by side; close one, then two, whose close gets EDQUOT."""
    f1, f2 = open(d / "one", "wb"), open(d / "two", "wb")
    try:
        f1.write(one)
        f2.write(two)
        f1.close()
        edquot(f2.close)
    finally:
        f1.close()


def test_racing_writers_are_cut_at_close(cluster, d):
    """Both files fit when written, not together: the second close gets EDQUOT and keeps what fits."""
    limit = 600 * K
    quota("set", str(d), "--bytes", str(limit))
    one, two = os.urandom(400 * K), os.urandom(400 * K)
    close_second_over_quota(d, one, two)
    assert (d / "one").read_bytes() == one
    assert (d / "two").stat().st_size == limit - len(one)
    assert (d / "two").read_bytes() == two[: limit - len(one)]
    eventually_stored_within(cluster, d / "two", limit - len(one))
    assert used(d) == (limit, 2)
    recount_ok(d)


def test_nested_quotas(d):
    inner = d / "inner"
    inner.mkdir()
    quota("set", str(d), "--bytes", "1M")
    quota("set", str(inner), "--bytes", "300K", "--inodes", "100")
    assert write_all(inner / "f", os.urandom(500 * K)) == (300 * K, True)  # inner's 300K is the tighter limit
    assert (inner / "f").stat().st_size == 300 * K
    assert write_all(d / "g", os.urandom(900 * K)) == (724 * K, True)  # the outer quota has 724K left
    assert (d / "g").stat().st_size == 724 * K
    chain = get(inner / "f")
    assert [q["path"] for q in chain] == [f"/{d.name}/inner", f"/{d.name}"]
    assert [(q["used_bytes"], q["max_bytes"]) for q in chain] == [(300 * K, 300 * K), (1024 * K, 1024 * K)]
    assert chain[0]["max_inodes"] == 100 and chain[1]["max_inodes"] == 0
    quota("set", str(inner), "--bytes", "none", "--inodes", "0")  # removed: only the outer one applies
    assert [q["path"] for q in get(inner)] == [f"/{d.name}"]
    recount_ok(d)


def test_rename_into_and_out_of_a_quota_tree(cluster, d):
    q, outside = d / "q", d / "outside"
    q.mkdir()
    outside.mkdir()
    quota("set", str(q), "--bytes", "300K")
    (outside / "small").write_bytes(b"s" * 100 * K)
    (outside / "big").write_bytes(b"b" * 250 * K)
    os.rename(outside / "small", q / "small")
    assert used(q) == (100 * K, 1)
    edquot(os.rename, outside / "big", q / "big")
    assert (outside / "big").exists()
    (outside / "dir").mkdir()
    with pytest.raises(OSError) as info:
        os.rename(outside / "dir", q / "dir")
    assert info.value.errno == errno.EXDEV  # mv copies instead
    os.rename(q / "small", outside / "small")
    assert used(q) == (0, 0)
    os.rename(outside / "big", q / "big")
    (q / "sub").mkdir()
    os.rename(q / "big", q / "sub" / "big")  # within the tree: nothing changes
    assert used(q) == (250 * K, 2)
    recount_ok(q)


def test_usage_survives_a_metadata_restart_and_shows_in_status(cluster, d):
    quota("set", str(d), "--bytes", "500K", "--inodes", "10")
    (d / "f").write_bytes(os.urandom(300 * K))
    before = get(d)
    cluster.kill_meta()
    cluster.restart()
    assert get(d) == before and used(d) == (300 * K, 1)
    assert write_all(d / "g", os.urandom(300 * K)) == (200 * K, True)  # still enforced after the restart
    assert (d / "g").stat().st_size == 200 * K
    status = json.loads(run_cli("status", str(d), "--json").stdout)
    mine = [q for q in status["quotas"] if q["path"] == f"/{d.name}"]
    assert mine and mine[0]["used_bytes"] == 500 * K and mine[0]["max_inodes"] == 10
    assert f"/{d.name}: bytes 500.0K of 500.0K (100%)" in run_cli("status", str(d)).stdout
    assert any(q["path"] == f"/{d.name}" for q in json.loads(quota("list", str(d), "--json").stdout))
    recount_ok(d)


def test_cli_refusals(d):
    res = quota("set", str(d), check=False)
    assert res.returncode == 1 and "--bytes" in res.stderr
    res = quota("set", str(d), "--bytes", "ten", check=False)
    assert res.returncode == 1 and "not a size" in res.stderr
    (d / "file").write_bytes(b"x")
    res = quota("set", str(d / "file"), "--inodes", "5", check=False)
    assert res.returncode == 1 and "not a directory" in res.stderr
    assert quota("get", str(d)).stdout.strip() == f"{d}: no quota applies"


def test_erasure_coded_files_are_cut_too(cluster, d):
    run_cli("layout", "set", str(d), "--ec", "2+1")
    quota("set", str(d), "--bytes", "300K")
    one, two = os.urandom(200 * K), os.urandom(300 * K)
    close_second_over_quota(d, one, two)
    assert (d / "two").read_bytes() == two[: 100 * K]
    ino = (d / "two").stat().st_ino
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:  # stripe 1 (past the limit) is garbage: collected within a few GC rounds
        indices = {int(f.name.split("-")[1]) for f in cluster.state.glob(f"storage-*/data/chunks/*/*/{ino}-*.chunk")}
        if indices == {0}:
            break
        time.sleep(0.2)
    assert indices == {0}
    os.unlink(d / "one")
    data = os.urandom(250 * K)
    assert write_all(d / "three", data) == (200 * K, True)
    assert (d / "three").read_bytes() == data[: 200 * K]
    assert used(d) == (300 * K, 2)
    recount_ok(d)
