"""The trash end to end through the mount's handlers (daemon/trash.py, docs/snapshots.md).

A rig of its own with a short ``trash_keep_s``, on SQLite and on PostgreSQL
with two daemons: an ``rm -rf`` (the unlinks and
rmdirs rm sends) restored with the request ``stripefs trash restore`` sends
reads back byte for byte; a removed file's chunks stay on the nodes while it
is in the trash, and once it expires the collector deletes them and fsck
finds nothing wrong.
"""

from __future__ import annotations

import hashlib
import os
import stat

import pytest

from stripefs.common import protocol as P

from conftest import run_rig
from util import eventually_async

KiB = 1 << 10
KEEP_S = 5.0  # long enough for a restore right after the rm; short enough to watch one expire


@pytest.fixture(scope="module", params=["sqlite", pytest.param("postgresql", marks=pytest.mark.pg_rig)])
def trash_rig(request):
    """SQLite, and PostgreSQL with two daemons: the mount talks to the first, the duties leader
    (either) expires the trash."""
    yield from run_rig(request, request.param, 1 if request.param == "sqlite" else 2, nodes=3,
                       meta_settings={"trash_keep_s": KEEP_S})


@pytest.fixture
def rig(trash_rig):
    return trash_rig


async def _walk(fs, ino: int, path: bytes = b"") -> dict[bytes, str]:
    """path -> sha256 of every file below directory ``ino`` ("dir" for directories)."""
    out = {}
    for name in await fs.listdir(ino):
        attr = await fs.lookup(ino, name)
        if stat.S_ISDIR(attr.attr.mode):
            out[path + b"/" + name] = "dir"
            out.update(await _walk(fs, attr.nodeid, path + b"/" + name))
        else:
            out[path + b"/" + name] = hashlib.sha256(await fs.read_file(ino, name)).hexdigest()
    return out


async def _rm_rf(fs, parent: int, name: bytes) -> None:
    ino = (await fs.lookup(parent, name)).nodeid
    for child in await fs.listdir(ino):
        if stat.S_ISDIR((await fs.lookup(ino, child)).attr.mode):
            await _rm_rf(fs, ino, child)
        else:
            await fs.unlink(ino, child)
    await fs.rmdir(parent, name)


def _copies(rig, ino: int) -> list:
    return list(rig.root.glob(f"storage-*/data/chunks/*/*/{ino}-*.chunk"))


async def test_an_rm_rf_restored_from_the_trash_is_byte_identical(fs):
    ds = await fs.mkdir(fs.dir, b"dataset")
    for shard in range(2):
        d = await fs.mkdir(ds, b"shard-%d" % shard)
        for i in range(5):
            await fs.write_file(d, b"%d.bin" % i, os.urandom(1 + 37 * KiB * i + shard))
    await fs.write_file(ds, b"index.json", b'{"shards": 2}')
    before = await _walk(fs, ds)
    await _rm_rf(fs, fs.dir, b"dataset")
    assert not await fs.exists(fs.dir, b"dataset")
    entries = (await fs.ops.meta.call(P.TrashListReq())).entries
    mine = [e for e in entries if e.ino == ds]
    assert mine and mine[0].path.endswith(b"/dataset") and stat.S_ISDIR(mine[0].mode)
    rsp = await fs.ops.meta.call(P.TrashRestoreReq(item=ds))
    assert rsp.left == [] and len(rsp.done) == len(before) + 1
    assert (await fs.lookup(fs.dir, b"dataset")).nodeid == ds
    assert await _walk(fs, ds) == before


async def test_an_expired_file_is_freed_on_the_nodes_and_fsck_is_clean(fs):
    ino = await fs.write_file(fs.dir, b"scratch", os.urandom(300 * KiB))
    await fs.unlink(fs.dir, b"scratch")
    assert _copies(fs.rig, ino), "a file in the trash keeps its chunks"
    await eventually_async(lambda: not _copies(fs.rig, ino), within=KEEP_S + 20, what="the expired file's chunks deleted")
    assert ino not in {e.ino for e in (await fs.ops.meta.call(P.TrashListReq())).entries}
    for node_id in fs.rig.node_addresses:
        report = await fs.ops.meta.call(P.FsckReq(node_id=node_id))
        assert (report.orphans, report.missing) == (0, 0), report.problems
