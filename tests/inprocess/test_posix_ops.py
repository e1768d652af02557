"""POSIX behaviour of the mount's handlers, with metadata in SQLite and in PostgreSQL.

Moved from tests/cluster/test_posix.py: the same scenarios, as the requests the
kernel sends for them, without the kernel. Every test runs on both rigs.
What needs the kernel stayed there: O_APPEND (the kernel picks the offset),
permissions checked by the kernel (default_permissions), mmap.
"""

import errno
import os
import stat

import pytest
from prometheus_client import REGISTRY

from fsapi import Ctx, raises_errno

MiB = 1 << 20
RENAME_NOREPLACE, RENAME_EXCHANGE = 1, 2


@pytest.fixture
def rig(both_stores):
    """Every test here runs with metadata in SQLite and in PostgreSQL (two daemons)."""
    return both_stores


async def test_write_read_and_stat(fs):
    d = fs.dir
    await fs.write_file(d, b"a.txt", b"hello stripefs\n")
    assert await fs.read_file(d, b"a.txt") == b"hello stripefs\n"
    st = await fs.lookup(d, b"a.txt")
    assert st.attr.size == 15 and stat.S_ISREG(st.attr.mode)
    assert sorted(await fs.listdir(d)) == [b"a.txt"]


async def test_rename_over_existing(fs):
    d = fs.dir
    await fs.write_file(d, b"a", b"A" * 1000)
    await fs.write_file(d, b"b", b"B" * 10)
    await fs.rename(d, b"a", d, b"b")
    assert not await fs.exists(d, b"a")
    assert await fs.read_file(d, b"b") == b"A" * 1000
    await fs.mkdir(d, b"d1")
    d2 = await fs.mkdir(d, b"d2")
    await fs.write_file(d2, b"x", b"x")
    async with raises_errno(errno.ENOTEMPTY):
        await fs.rename(d, b"d1", d, b"d2")
    await fs.rename(d, b"d2", d, b"d3")
    d3 = (await fs.lookup(d, b"d3")).nodeid
    assert await fs.read_file(d3, b"x") == b"x"
    async with raises_errno(errno.EINVAL):
        await fs.rename(d, b"d3", d3, b"sub")


async def test_rename_noreplace_and_exchange(fs):
    d = fs.dir
    await fs.write_file(d, b"x", b"x")
    await fs.write_file(d, b"y", b"y")
    async with raises_errno(errno.EEXIST):
        await fs.rename(d, b"x", d, b"y", RENAME_NOREPLACE)
    await fs.rename(d, b"x", d, b"y", RENAME_EXCHANGE)
    assert await fs.read_file(d, b"x") == b"y" and await fs.read_file(d, b"y") == b"x"


async def test_unlink_while_open(fs):
    d = fs.dir
    data = os.urandom(300_000)
    await fs.write_file(d, b"victim", data)
    assert await fs.read_file(d, b"victim") == data
    fh, _ = await fs.open_path(d, b"victim", os.O_RDONLY)
    await fs.unlink(d, b"victim")
    assert not await fs.exists(d, b"victim")
    assert await fs.read_all(fh) == data
    await fs.close(fh)
    fh, _ = await fs.open_path(d, b"w", os.O_RDWR | os.O_CREAT | os.O_TRUNC)
    await fs.unlink(d, b"w")
    assert await fs.write(fh, 0, b"still here") == 10
    assert await fs.read_all(fh) == b"still here"
    await fs.close(fh)


async def test_truncate_up_and_down_and_holes(fs):
    d = fs.dir
    payload = os.urandom(5 * MiB)  # spans two 4 MiB chunks
    ino = await fs.write_file(d, b"t", payload)
    await fs.setattr(ino, st_size=4 * MiB + 100)
    assert await fs.read_file(d, b"t") == payload[: 4 * MiB + 100]
    await fs.setattr(ino, st_size=1000)
    assert await fs.read_file(d, b"t") == payload[:1000]
    await fs.setattr(ino, st_size=3000)
    assert await fs.read_file(d, b"t") == payload[:1000] + bytes(2000)  # extended with zeros, old bytes gone
    fh, _ = await fs.open_path(d, b"t", os.O_RDWR)
    await fs.setattr(ino, fh=fh, st_size=10)
    await fs.write(fh, 9 * MiB, b"end")
    await fs.close(fh)
    data = await fs.read_file(d, b"t")
    assert len(data) == 9 * MiB + 3
    assert data[:10] == payload[:10] and data[10 : 9 * MiB] == bytes(9 * MiB - 10)
    assert data.endswith(b"end")


async def test_overwrite_middle(fs):
    d = fs.dir
    base = bytearray(os.urandom(200_000))
    await fs.write_file(d, b"m", bytes(base))
    fh, _ = await fs.open_path(d, b"m", os.O_RDWR)
    await fs.write(fh, 70_000, b"Z" * 5000)
    await fs.write(fh, 150_000, b"Y" * 100)
    await fs.close(fh)
    base[70_000:75_000] = b"Z" * 5000
    base[150_000:150_100] = b"Y" * 100
    assert await fs.read_file(d, b"m") == bytes(base)


async def test_hard_links_and_symlinks(fs):
    d = fs.dir
    orig = await fs.write_file(d, b"orig", b"data")
    await fs.link(orig, d, b"hard")
    assert (await fs.lookup(d, b"orig")).attr.nlink == 2
    assert (await fs.lookup(d, b"hard")).nodeid == (await fs.lookup(d, b"orig")).nodeid
    await fs.unlink(d, b"orig")
    assert await fs.read_file(d, b"hard") == b"data"
    assert (await fs.lookup(d, b"hard")).attr.nlink == 1
    sym = await fs.symlink(d, b"sym", b"hard")
    assert await fs.readlink(sym) == b"hard"
    assert await fs.read_file(d, await fs.readlink(sym)) == b"data"  # what the kernel follows it to
    assert stat.S_ISLNK((await fs.lookup(d, b"sym")).attr.mode)
    dir_ino = await fs.mkdir(d, b"dir")
    async with raises_errno(errno.EPERM):
        await fs.link(dir_ino, d, b"dirlink")


async def test_fifo_and_mkdir_rmdir(fs):
    d = fs.dir
    await fs.mknod(d, b"fifo", stat.S_IFIFO | 0o666)
    assert stat.S_ISFIFO((await fs.lookup(d, b"fifo")).attr.mode)
    a = await fs.mkdir(d, b"a")
    b = await fs.mkdir(a, b"b")
    await fs.mkdir(b, b"c")
    async with raises_errno(errno.ENOTEMPTY):
        await fs.rmdir(d, b"a")
    await fs.rmdir(b, b"c")
    assert (await fs.getattr(a)).nlink == 3
    async with raises_errno(errno.EEXIST):
        await fs.mkdir(d, b"a")


async def test_xattrs(fs):
    d = fs.dir
    ino = await fs.write_file(d, b"x", b"x")
    await fs.setxattr(ino, b"user.color", b"blue")
    assert await fs.getxattr(ino, b"user.color") == b"blue"
    assert b"user.color" in await fs.listxattr(ino)
    async with raises_errno(errno.EEXIST):
        await fs.setxattr(ino, b"user.color", b"red", os.XATTR_CREATE)
    await fs.removexattr(ino, b"user.color")
    async with raises_errno(errno.ENODATA):
        await fs.getxattr(ino, b"user.color")



def _sent(kind: str) -> float:
    """Requests of this type the clients of this process sent, to any peer (common/metrics.py)."""
    return sum(s.value for m in REGISTRY.collect() if m.name == "stripefs_rpc_seconds"
               for s in m.samples if s.name == "stripefs_rpc_seconds_count" and s.labels.get("type") == kind)


async def test_a_new_files_capabilities_are_known_and_a_set_one_still_drops(fs):
    """The kernel asks for security.capability before every WRITE (FUSE has no SB_NOSEC).
    A file this mount just created has none: the question costs no round trip. Once the
    xattr is set, the mount asks again (a write must then remove it)."""
    caps = b"\x01\x00\x00\x02" + bytes(16)
    fh, ino = await fs.create(fs.dir, b"new")
    before = _sent("GetxattrReq")
    async with raises_errno(errno.ENODATA):
        await fs.getxattr(ino, b"security.capability")
    assert _sent("GetxattrReq") == before
    assert await fs.write(fh, 0, b"data") == 4
    await fs.setxattr(ino, b"security.capability", caps)
    assert await fs.getxattr(ino, b"security.capability") == caps
    assert _sent("GetxattrReq") == before + 1
    await fs.close(fh)

async def test_chmod_chown_utimes(fs):
    ino = await fs.write_file(fs.dir, b"f", b"f")
    await fs.setattr(ino, st_mode=stat.S_IFREG | 0o640)
    assert stat.S_IMODE((await fs.getattr(ino)).mode) == 0o640
    await fs.setattr(ino, st_uid=1234, st_gid=5678)
    st = await fs.getattr(ino)
    assert (st.uid, st.gid) == (1234, 5678)
    await fs.setattr(ino, st_atime_ns=1_000_000_123, st_mtime_ns=2_000_000_456)
    st = await fs.getattr(ino)
    assert st.atime_ns == 1_000_000_123 and st.mtime_ns == 2_000_000_456


async def test_truncating_open_by_another_user_kills_set_id_bits(fs):
    """open(O_WRONLY|O_TRUNC) by a user without CAP_FSETID clears set-uid and set-gid (with group
    exec), as ext4 and tmpfs do; the kernel leaves it to the FUSE server (atomic O_TRUNC)."""
    d = fs.dir
    prog = await fs.write_file(d, b"prog", b"#!/bin/sh\n")
    await fs.setattr(prog, st_mode=stat.S_IFREG | 0o6777)
    nobody = Ctx(uid=65534, gid=65534)
    fh, _ = await fs.open_path(d, b"prog", os.O_WRONLY | os.O_TRUNC, ctx=nobody)  # echo x > prog
    await fs.write(fh, 0, b"x\n")
    await fs.close(fh)
    assert stat.S_IMODE((await fs.getattr(prog)).mode) == 0o777
    await fs.setattr(prog, st_mode=stat.S_IFREG | 0o6777)
    fh, _ = await fs.open_path(d, b"prog", os.O_WRONLY | os.O_TRUNC)  # root keeps them (CAP_FSETID)
    await fs.write(fh, 0, b"y")
    await fs.close(fh)
    assert stat.S_IMODE((await fs.getattr(prog)).mode) == 0o6777


async def test_statfs_reports_real_capacity(fs):
    st = await fs.statfs()
    assert st.blocks > 0 and 0 < st.bavail <= st.blocks


async def test_open_with_o_trunc_truncates(fs):
    d = fs.dir
    await fs.write_file(d, b"f", os.urandom(300_000))
    await fs.write_file(d, b"f", b"short")  # open(O_WRONLY|O_CREAT|O_TRUNC) of an existing, longer file
    assert await fs.read_file(d, b"f") == b"short"
    fh, ino = await fs.open_path(d, b"f", os.O_RDWR | os.O_TRUNC)
    try:
        assert (await fs.getattr(ino)).size == 0
    finally:
        await fs.close(fh)
    assert (await fs.lookup(d, b"f")).attr.size == 0 and await fs.read_file(d, b"f") == b""

