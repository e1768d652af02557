"""POSIX behaviour through the real mount, with metadata in SQLite and in PostgreSQL.

Every test taking ``mnt`` runs twice: on the default cluster (SQLite) and on
``pg_cluster`` (PostgreSQL, two metadata daemons; the mount talks to the first).
"""

import errno
import mmap
import os
import re
import stat
import subprocess

import pytest


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.pg_cluster)])  # the mark: conftest runs it last
def mnt(request) -> "os.PathLike":
    """A fresh directory inside the mount of the cluster whose metadata store is the parameter."""
    c = request.getfixturevalue("cluster" if request.param == "sqlite" else "pg_cluster")
    d = c.mnt / re.sub(r"[^A-Za-z0-9_]", "_", request.node.name)
    d.mkdir()
    return d


def test_write_read_and_stat(mnt):
    p = mnt / "a.txt"
    p.write_bytes(b"hello stripefs\n")
    assert p.read_bytes() == b"hello stripefs\n"
    st = p.stat()
    assert st.st_size == 15 and stat.S_ISREG(st.st_mode)
    assert sorted(os.listdir(mnt)) == ["a.txt"]


def test_rename_over_existing(mnt):
    (mnt / "a").write_bytes(b"A" * 1000)
    (mnt / "b").write_bytes(b"B" * 10)
    os.rename(mnt / "a", mnt / "b")
    assert not (mnt / "a").exists()
    assert (mnt / "b").read_bytes() == b"A" * 1000
    os.mkdir(mnt / "d1")
    os.mkdir(mnt / "d2")
    (mnt / "d2" / "x").write_text("x")
    with pytest.raises(OSError) as e:
        os.rename(mnt / "d1", mnt / "d2")
    assert e.value.errno == errno.ENOTEMPTY
    os.rename(mnt / "d2", mnt / "d3")
    assert (mnt / "d3" / "x").read_text() == "x"
    with pytest.raises(OSError) as e:
        os.rename(mnt / "d3", mnt / "d3" / "sub")
    assert e.value.errno == errno.EINVAL


def test_rename_noreplace_and_exchange(mnt):
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    (mnt / "x").write_text("x")
    (mnt / "y").write_text("y")
    AT_FDCWD = -100

    def renameat2(a, b, flags):
        r = libc.renameat2(AT_FDCWD, bytes(a), AT_FDCWD, bytes(b), flags)
        return 0 if r == 0 else ctypes.get_errno()

    assert renameat2(mnt / "x", mnt / "y", 1) == errno.EEXIST  # RENAME_NOREPLACE
    assert renameat2(mnt / "x", mnt / "y", 2) == 0  # RENAME_EXCHANGE
    assert (mnt / "x").read_text() == "y" and (mnt / "y").read_text() == "x"


def test_unlink_while_open(mnt):
    p = mnt / "victim"
    p.write_bytes(os.urandom(300_000))
    data = p.read_bytes()
    with open(p, "rb") as f:
        os.unlink(p)
        assert not p.exists()
        assert f.read() == data
    with open(mnt / "w", "w+b") as f:
        os.unlink(mnt / "w")
        f.write(b"still here")
        f.flush()
        f.seek(0)
        assert f.read() == b"still here"


def test_truncate_up_and_down_and_holes(mnt):
    p = mnt / "t"
    payload = os.urandom(5 * 1024 * 1024)  # spans two 4 MiB chunks
    p.write_bytes(payload)
    os.truncate(p, 4 * 1024 * 1024 + 100)
    assert p.read_bytes() == payload[: 4 * 1024 * 1024 + 100]
    os.truncate(p, 1000)
    assert p.read_bytes() == payload[:1000]
    os.truncate(p, 3000)
    assert p.read_bytes() == payload[:1000] + bytes(2000)  # extended with zeros, old bytes gone
    with open(p, "r+b") as f:
        f.truncate(10)
        f.seek(9 * 1024 * 1024)
        f.write(b"end")
    data = p.read_bytes()
    assert len(data) == 9 * 1024 * 1024 + 3
    assert data[:10] == payload[:10] and data[10 : 9 * 1024 * 1024] == bytes(9 * 1024 * 1024 - 10)
    assert data.endswith(b"end")


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


def test_overwrite_middle(mnt):
    p = mnt / "m"
    base = bytearray(os.urandom(200_000))
    p.write_bytes(base)
    with open(p, "r+b") as f:
        f.seek(70_000)
        f.write(b"Z" * 5000)
        f.seek(150_000)
        f.write(b"Y" * 100)
    base[70_000:75_000] = b"Z" * 5000
    base[150_000:150_100] = b"Y" * 100
    assert p.read_bytes() == bytes(base)


def test_hard_links_and_symlinks(mnt):
    (mnt / "orig").write_text("data")
    os.link(mnt / "orig", mnt / "hard")
    assert (mnt / "orig").stat().st_nlink == 2
    assert (mnt / "hard").stat().st_ino == (mnt / "orig").stat().st_ino
    os.unlink(mnt / "orig")
    assert (mnt / "hard").read_text() == "data"
    assert (mnt / "hard").stat().st_nlink == 1
    os.symlink("hard", mnt / "sym")
    assert os.readlink(mnt / "sym") == "hard"
    assert (mnt / "sym").read_text() == "data"
    assert stat.S_ISLNK(os.lstat(mnt / "sym").st_mode)
    os.mkdir(mnt / "dir")
    with pytest.raises(OSError):
        os.link(mnt / "dir", mnt / "dirlink")


def test_fifo_and_mkdir_rmdir(mnt):
    os.mkfifo(mnt / "fifo")
    assert stat.S_ISFIFO(os.stat(mnt / "fifo").st_mode)
    os.makedirs(mnt / "a" / "b" / "c")
    with pytest.raises(OSError) as e:
        os.rmdir(mnt / "a")
    assert e.value.errno == errno.ENOTEMPTY
    os.rmdir(mnt / "a" / "b" / "c")
    assert os.stat(mnt / "a").st_nlink == 3
    with pytest.raises(FileExistsError):
        os.mkdir(mnt / "a")


def test_xattrs(mnt):
    p = mnt / "x"
    p.write_text("x")
    os.setxattr(p, "user.color", b"blue")
    assert os.getxattr(p, "user.color") == b"blue"
    assert "user.color" in os.listxattr(p)
    with pytest.raises(OSError) as e:
        os.setxattr(p, "user.color", b"red", os.XATTR_CREATE)
    assert e.value.errno == errno.EEXIST
    os.removexattr(p, "user.color")
    with pytest.raises(OSError) as e:
        os.getxattr(p, "user.color")
    assert e.value.errno == errno.ENODATA


def test_chmod_chown_utimes(mnt):
    p = mnt / "f"
    p.write_text("f")
    os.chmod(p, 0o640)
    assert stat.S_IMODE(p.stat().st_mode) == 0o640
    os.chown(p, 1234, 5678)
    st = p.stat()
    assert (st.st_uid, st.st_gid) == (1234, 5678)
    os.utime(p, ns=(1_000_000_123, 2_000_000_456))
    st = p.stat()
    assert st.st_atime_ns == 1_000_000_123 and st.st_mtime_ns == 2_000_000_456


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


def test_truncating_open_by_another_user_kills_set_id_bits(mnt):
    """open(O_WRONLY|O_TRUNC) by a user without CAP_FSETID clears set-uid and set-gid (with group
    exec), as ext4 and tmpfs do; the kernel leaves it to the FUSE server (atomic O_TRUNC)."""
    prog = mnt / "prog"
    prog.write_bytes(b"#!/bin/sh\n")
    os.chmod(prog, 0o6777)
    r = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "sh", "-c", f"echo x > '{prog}'"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert stat.S_IMODE(os.stat(prog).st_mode) == 0o777
    os.chmod(prog, 0o6777)
    with open(prog, "w") as f:  # root keeps them (CAP_FSETID)
        f.write("y")
    assert stat.S_IMODE(os.stat(prog).st_mode) == 0o6777


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


def test_large_directory_listing(mnt):
    d = mnt / "many"
    d.mkdir()
    names = {f"f{i:05d}" for i in range(2500)}  # the listing spans three of the daemon's pages (1000 names)
    for n in names:
        os.mknod(d / n)  # an empty file, made by one MKNOD (touch() is a failed utime, CREATE, FLUSH, RELEASE)
    assert set(os.listdir(d)) == names


def test_statfs_reports_real_capacity(cluster):
    st = os.statvfs(cluster.mnt)
    assert st.f_blocks > 0 and 0 < st.f_bavail <= st.f_blocks


def test_open_with_o_trunc_truncates(mnt):
    p = mnt / "f"
    p.write_bytes(os.urandom(300_000))
    p.write_bytes(b"short")  # open(O_WRONLY|O_CREAT|O_TRUNC) of an existing, longer file
    assert p.read_bytes() == b"short"
    fd = os.open(p, os.O_RDWR | os.O_TRUNC)
    try:
        assert os.fstat(fd).st_size == 0
    finally:
        os.close(fd)
    assert p.stat().st_size == 0 and p.read_bytes() == b""
