"""Directory quotas through a real mount and the quota CLI: usage across a metadata daemon restart, refusals.

The limits themselves (EDQUOT on creates and writes, short writes, cuts at
close, nested quotas, renames across quota trees, erasure-coded files, nothing
kept past a limit) are tested on the mount's handlers without a kernel
(tests/inprocess/test_quota_ops.py). ``stripefs quota recount`` counts the tree
again and exits 3 if the incrementally kept usage had drifted.
"""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest

from conftest import run_cli

K = 1 << 10


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


@pytest.fixture
def d(mnt):
    run_cli("layout", "set", str(mnt), "--chunk-size", "256K")
    return mnt


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
