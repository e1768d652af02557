"""Directory quotas through the mount's handlers: EDQUOT on creates and writes, nothing kept past a limit.

Moved from tests/cluster/test_quota.py, which keeps the quota CLI's refusals and
usage across a metadata daemon restart. Quotas are set, read and recounted with
the requests ``stripefs quota`` sends (QuotaSetReq, QuotaGetReq,
QuotaRecountReq); each test ends with a recount, which must find nothing to
correct: the accounting is checked against a scan after every scenario.
"""

from __future__ import annotations

import errno
import os
import struct

import pytest

from stripefs.client.fuse.replies import FuseError
from stripefs.common import protocol as P

from fsapi import raises_errno
from util import eventually_async

K = 1 << 10
CHUNK = 256 * K


async def quota_set(fs, ino: int, max_bytes: int | None = None, max_inodes: int | None = None) -> None:
    await fs.ops.meta.call(P.QuotaSetReq(ino=ino, max_bytes=max_bytes, max_inodes=max_inodes))


async def get(fs, ino: int) -> list[P.QuotaInfo]:
    return (await fs.ops.meta.call(P.QuotaGetReq(ino=ino))).quotas


async def used(fs, ino: int) -> tuple[int, int]:
    q = (await get(fs, ino))[0]
    return q.used_bytes, q.used_inodes


async def recount_ok(fs, ino: int) -> None:
    rsp = await fs.ops.meta.call(P.QuotaRecountReq(ino=ino))
    assert not rsp.corrected, f"usage had drifted from a recount: {rsp.corrected}"


def stored_ends(rig, ino: int) -> list[int]:
    """For every chunk copy of the file on the storage nodes: the file offset its data ends at."""
    ends = []
    for f in rig.root.glob(f"storage-*/data/chunks/*/*/{ino}-*.chunk"):
        index = int(f.name.split("-")[1])
        try:
            with open(f, "rb") as fh:
                length = struct.unpack("<Q", fh.read(32)[24:32])[0]
        except FileNotFoundError:  # collected between the listing and the open: what the callers wait for
            continue
        ends.append(index * CHUNK + length)
    return ends


async def eventually_stored_within(rig, ino: int, limit: int, timeout: float = 20) -> None:
    """Chunk copies past the limit are garbage: collected within a few GC rounds."""
    await eventually_async(lambda: max(stored_ends(rig, ino), default=0) <= limit, within=timeout,
                           what=f"bytes stored past the limit {limit}")
    assert stored_ends(rig, ino), "no copy stored"


async def write_all(fs, parent: int, name: bytes, data: bytes) -> tuple[int, bool]:
    """Write as a careful application does, until done or EDQUOT: (bytes written, whether EDQUOT came)."""
    fh, _ = await fs.open_path(parent, name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    done = 0
    try:
        while done < len(data):
            try:
                done += await fs.write(fh, done, data[done:])  # write(2): short at the limit
            except FuseError as exc:
                if exc.errno != errno.EDQUOT:
                    raise
                return done, True
    finally:
        await fs.close(fh)
    return done, False


@pytest.fixture
async def d(fs):
    await fs.ops.meta.call(P.SetLayoutReq(ino=fs.dir, chunk_size=CHUNK))  # stripefs layout set DIR --chunk-size 256K
    return fs.dir


async def test_inode_limit(fs, d):
    await quota_set(fs, d, max_inodes=3)
    await fs.write_file(d, b"a", b"x")
    sub = await fs.mkdir(d, b"sub")
    await fs.symlink(sub, b"link", b"a")
    assert await used(fs, d) == (2, 3)  # bytes: the file and the symlink's target
    async with raises_errno(errno.EDQUOT):
        await fs.write_file(d, b"b", b"y")
    async with raises_errno(errno.EDQUOT):
        await fs.mkdir(sub, b"dir")
    async with raises_errno(errno.EDQUOT):
        await fs.symlink(d, b"l2", b"a")
    assert sorted(await fs.listdir(d)) == [b"a", b"sub"]
    await fs.unlink(d, b"a")
    await fs.write_file(sub, b"b", b"z")  # unlink made room
    assert await used(fs, d) == (2, 3)
    await recount_ok(fs, d)


async def test_byte_limit_short_write_then_edquot(fs, d):
    limit = 600 * K
    await quota_set(fs, d, max_bytes=limit)
    data = os.urandom(4 * CHUNK)
    fh, f = await fs.open_path(d, b"f", os.O_WRONLY | os.O_CREAT)
    try:
        assert await fs.write(fh, 0, data) == limit  # the part that fits
        async with raises_errno(errno.EDQUOT):
            await fs.write(fh, limit, b"more")
        assert await fs.write(fh, 0, b"overwrite") == 9  # rewriting bytes below the limit is fine
    finally:
        await fs.close(fh)
    assert (await fs.lookup(d, b"f")).attr.size == limit
    assert await fs.read_file(d, b"f") == b"overwrite" + data[9:limit]
    await eventually_stored_within(fs.rig, f, limit)
    assert await used(fs, d) == (limit, 1)
    fh, _ = await fs.open_path(d, b"g", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        async with raises_errno(errno.EDQUOT):
            await fs.write(fh, 0, b"x" * 10)
    finally:
        await fs.close(fh)
    await fs.setattr(f, st_size=100 * K)  # shrinking frees; growing back past the limit does not fit
    async with raises_errno(errno.EDQUOT):
        await fs.setattr(f, st_size=limit + 1)
    assert await used(fs, d) == (100 * K, 2)
    await fs.unlink(d, b"f")
    await fs.write_file(d, b"h", data[: 2 * CHUNK])
    assert await used(fs, d) == (2 * CHUNK, 2)
    await recount_ok(fs, d)


async def close_second_over_quota(fs, d: int, one: bytes, two: bytes) -> None:
    """Write files one and two side by side; close one, then two, whose close gets EDQUOT."""
    f1, _ = await fs.open_path(d, b"one", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    f2, _ = await fs.open_path(d, b"two", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    assert await fs.write(f1, 0, one) == len(one)
    assert await fs.write(f2, 0, two) == len(two)
    await fs.close(f1)
    async with raises_errno(errno.EDQUOT):
        await fs.close(f2)  # FLUSH answers EDQUOT; the RELEASE still comes


async def test_racing_writers_are_cut_at_close(fs, d):
    """Both files fit when written, not together: the second close gets EDQUOT and keeps what fits."""
    limit = 600 * K
    await quota_set(fs, d, max_bytes=limit)
    one, two = os.urandom(400 * K), os.urandom(400 * K)
    await close_second_over_quota(fs, d, one, two)
    assert await fs.read_file(d, b"one") == one
    two_ino = (await fs.lookup(d, b"two")).nodeid
    assert (await fs.getattr(two_ino)).size == limit - len(one)
    assert await fs.read_file(d, b"two") == two[: limit - len(one)]
    await eventually_stored_within(fs.rig, two_ino, limit - len(one))
    assert await used(fs, d) == (limit, 2)
    await recount_ok(fs, d)


async def test_nested_quotas(fs, d):
    inner = await fs.mkdir(d, b"inner")
    await quota_set(fs, d, max_bytes=1024 * K)
    await quota_set(fs, inner, max_bytes=300 * K, max_inodes=100)
    assert await write_all(fs, inner, b"f", os.urandom(500 * K)) == (300 * K, True)  # inner's 300K is the tighter limit
    f = await fs.lookup(inner, b"f")
    assert f.attr.size == 300 * K
    assert await write_all(fs, d, b"g", os.urandom(900 * K)) == (724 * K, True)  # the outer quota has 724K left
    assert (await fs.lookup(d, b"g")).attr.size == 724 * K
    chain = await get(fs, f.nodeid)
    name = fs.dir_name
    assert [q.path for q in chain] == [b"/" + name + b"/inner", b"/" + name]
    assert [(q.used_bytes, q.max_bytes) for q in chain] == [(300 * K, 300 * K), (1024 * K, 1024 * K)]
    assert chain[0].max_inodes == 100 and chain[1].max_inodes == 0
    await quota_set(fs, inner, max_bytes=0, max_inodes=0)  # removed: only the outer one applies
    assert [q.path for q in await get(fs, inner)] == [b"/" + name]
    await recount_ok(fs, d)


async def test_rename_into_and_out_of_a_quota_tree(fs, d):
    q, outside = await fs.mkdir(d, b"q"), await fs.mkdir(d, b"outside")
    await quota_set(fs, q, max_bytes=300 * K)
    await fs.write_file(outside, b"small", b"s" * 100 * K)
    await fs.write_file(outside, b"big", b"b" * 250 * K)
    await fs.rename(outside, b"small", q, b"small")
    assert await used(fs, q) == (100 * K, 1)
    async with raises_errno(errno.EDQUOT):
        await fs.rename(outside, b"big", q, b"big")
    assert await fs.exists(outside, b"big")
    await fs.mkdir(outside, b"dir")
    async with raises_errno(errno.EXDEV):  # mv copies instead
        await fs.rename(outside, b"dir", q, b"dir")
    await fs.rename(q, b"small", outside, b"small")
    assert await used(fs, q) == (0, 0)
    await fs.rename(outside, b"big", q, b"big")
    sub = await fs.mkdir(q, b"sub")
    await fs.rename(q, b"big", sub, b"big")  # within the tree: nothing changes
    assert await used(fs, q) == (250 * K, 2)
    await recount_ok(fs, q)


async def test_erasure_coded_files_are_cut_too(fs, d):
    await fs.ops.meta.call(P.SetLayoutReq(ino=d, redundancy="ec=2+1"))  # stripefs layout set DIR --ec 2+1
    await quota_set(fs, d, max_bytes=300 * K)
    one, two = os.urandom(200 * K), os.urandom(300 * K)
    await close_second_over_quota(fs, d, one, two)
    assert await fs.read_file(d, b"two") == two[: 100 * K]
    ino = (await fs.lookup(d, b"two")).nodeid

    def indices():
        return {int(f.name.split("-")[1]) for f in fs.rig.root.glob(f"storage-*/data/chunks/*/*/{ino}-*.chunk")}

    # stripe 1 (past the limit) is garbage: collected within a few GC rounds
    await eventually_async(lambda: indices() == {0}, within=20, what=f"only stripe 0 of inode {ino} kept (have {indices()})")
    await fs.unlink(d, b"one")
    data = os.urandom(250 * K)
    assert await write_all(fs, d, b"three", data) == (200 * K, True)
    assert await fs.read_file(d, b"three") == data[: 200 * K]
    assert await used(fs, d) == (300 * K, 2)
    await recount_ok(fs, d)
