"""POSIX behaviour that needs the kernel, through the real mount, with metadata in SQLite and in PostgreSQL.

O_APPEND (the kernel picks the offset), permissions the kernel checks
(default_permissions) for real processes of another user, mmap. The rest of
POSIX semantics is tested on the mount's handlers without a kernel
(tests/inprocess/test_posix_ops.py).

Every test taking ``mnt`` runs twice: on the default cluster (SQLite) and on
``pg_cluster`` (PostgreSQL, two metadata daemons; the mount talks to the first).
"""

import mmap
import os
import re
import subprocess

import pytest


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.pg_cluster)])  # the mark: conftest runs it last
def mnt(request) -> "os.PathLike":
    """A fresh directory inside the mount of the cluster whose metadata store is the parameter."""
    root = request.getfixturevalue("cluster" if request.param == "sqlite" else "pg_cluster").mnt
    d = root / re.sub(r"[^A-Za-z0-9_]", "_", request.node.name)
    d.mkdir()
    return d


def test_append(mnt):
    p = mnt / "log"
    for i in range(20):
        with open(p, "a") as f:
            f.write(f"line {i}\n")
    assert p.read_text() == "".join(f"line {i}\n" for i in range(20))
    fd = os.open(p, os.O_WRONLY | os.O_APPEND)
    os.write(fd, b"tail")
    os.close(fd)
    assert p.read_text().endswith("line 19\ntail")


def test_fsync_of_a_directory(mnt):
    """fsync(2) of a directory (FSYNCDIR: what a database or ``git`` does after creating files)
    succeeds, and the files made in it are there for another look after (the bridge once called a
    helper that did not exist: EIO)."""
    for i in range(5):
        (mnt / f"f{i}").write_bytes(b"x" * i)
    fd = os.open(mnt, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
        os.fdatasync(fd)
    finally:
        os.close(fd)
    assert sorted(os.listdir(mnt)) == [f"f{i}" for i in range(5)]


def test_permissions_as_other_user(mnt):
    """The kernel enforces POSIX permissions (default_permissions) for a non-root uid."""
    secret = mnt / "secret"
    secret.write_text("top secret")
    os.chmod(secret, 0o600)
    public = mnt / "public"
    public.write_text("hello")
    os.chmod(public, 0o644)
    os.chmod(mnt, 0o755)

    def as_nobody(script):
        # sh, not python: the interpreter running the tests may live where nobody cannot read
        return subprocess.run(
            ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "sh", "-c", script],
            capture_output=True, text=True,
        )

    r = as_nobody(f"cat '{secret}'")
    assert r.returncode != 0 and "Permission denied" in r.stderr
    r = as_nobody(f"cat '{public}'")
    assert r.returncode == 0 and r.stdout.strip() == "hello"
    r = as_nobody(f"echo x > '{mnt / 'new'}'")
    assert r.returncode != 0 and "Permission denied" in r.stderr
    os.chmod(mnt, 0o777)
    r = as_nobody(f"echo x > '{mnt / 'mine'}'")
    assert r.returncode == 0, r.stderr
    assert (mnt / "mine").stat().st_uid == 65534


def test_mmap_read_and_shared_write(mnt):
    p = mnt / "mm"
    data = bytearray(os.urandom(3 * 4096))
    p.write_bytes(data)
    with open(p, "r+b") as f:
        m = mmap.mmap(f.fileno(), 0)
        assert m[:] == data
        m[100:110] = b"0123456789"
        m.flush()
        m.close()
    data[100:110] = b"0123456789"
    assert p.read_bytes() == bytes(data)
