"""Asynchronous creates (client/async_dirops.py) through the mount's handlers, on a client that
follows the change feed as a mount does: answered here in a directory the mount holds whole,
sent in batches, flushed by fsync and by another mount's change there; refused creates are
logged, counted and fail the file's next operation (the CephFS rule, docs/design.md)."""

from __future__ import annotations

import errno
import os
import re

import pytest
import trio

from stripefs.client.fuse.abi import ROOT_ID
from stripefs.common import protocol as P

from fsapi import Kernel, open_fs, raises_errno


@pytest.fixture
async def mine(rig, request, monkeypatch):
    """A client that follows the feed, and a directory it made (held whole: every name known)."""
    async with open_fs(rig, Kernel(monkeypatch), f"inprocess:{request.node.name}", follow=True) as fs:
        fs.dir = await fs.mkdir(ROOT_ID, re.sub(r"[^A-Za-z0-9_]", "_", request.node.name).encode())
        yield fs


async def _numbers(fs) -> None:
    """Wait until the daemon delegated inode numbers to this client (asked at its first create)."""
    fs.ops.dirops.take_ino()  # asks for a range (one number spent: holes cost nothing)
    with trio.fail_after(10):
        while not fs.ops.dirops.left():
            await trio.sleep(0.01)


async def _listing(rig, monkeypatch, name: str, d: int) -> list[bytes]:
    async with open_fs(rig, Kernel(monkeypatch), name) as other:
        return sorted(await other.listdir(d))


async def test_creates_in_a_held_directory_are_answered_here_and_sent_in_batches(mine, rig, monkeypatch):
    await _numbers(mine)
    calls = []
    real = mine.ops.meta.call
    mine.ops.meta.call = lambda req, **kw: (calls.append(type(req).__name__), real(req, **kw))[1]
    inodes = []
    for i in range(50):
        fh, ino = await mine.create(mine.dir, b"f%02d" % i)
        await mine.close(fh)
        inodes.append(ino)
        assert (await mine.getattr(ino)).size == 0  # answered here: no GetattrReq
    assert "CreateReq" not in calls and "GetattrReq" not in calls and len(set(inodes)) == 50
    await mine.ops.fsyncdir(mine.dir, False)  # durable once this returns
    assert calls.count("BatchReq") <= 2 and mine.ops.dirops.sent == 50
    assert await _listing(rig, monkeypatch, "other", mine.dir) == [b"f%02d" % i for i in range(50)]
    # the daemon's answers: the numbers the kernel was given, and the file is held (stat stays here)
    attr = await mine.getattr(inodes[7])
    assert attr.ino == inodes[7] and "GetattrReq" not in calls


async def test_data_written_to_a_file_created_here_waits_for_the_daemons_answer(mine):
    await _numbers(mine)
    fh, ino = await mine.create(mine.dir, b"data")
    assert mine.ops.dirops.pending(ino)
    assert await mine.write(fh, 0, b"x" * 5000) == 5000
    await mine.close(fh)
    assert not mine.ops.dirops.pending(ino)
    assert await mine.read_file(mine.dir, b"data") == b"x" * 5000


async def test_another_mounts_change_in_the_directory_sends_the_pending_creates_first(mine, rig, monkeypatch):
    await _numbers(mine)
    for i in range(5):
        await mine.close((await mine.create(mine.dir, b"p%d" % i))[0])
    async with open_fs(rig, Kernel(monkeypatch), "theirs") as theirs:
        # their create waits for this mount's acknowledgement, which sends the pending creates first
        with trio.fail_after(5):  # (well inside the daemon's WAIT_S: no penalty, no timeout)
            await theirs.close((await theirs.create(mine.dir, b"theirs"))[0])
        async with raises_errno(errno.EEXIST):  # a name this mount made is taken for the other mount
            await theirs.create(mine.dir, b"p3", flags=os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        assert sorted(await theirs.listdir(mine.dir)) == [b"p0", b"p1", b"p2", b"p3", b"p4", b"theirs"]
    assert mine.ops.dirops.refused == 0


async def test_a_create_refused_after_the_answer_fails_the_files_next_operation_once(mine, rig):
    """A directory quota the mount does not know of: the daemon refuses the third create after the
    kernel was answered; the refusal is logged and counted, the kernel forgets the name and the
    inode, and the next operation on the file fails with EDQUOT, once."""
    await _numbers(mine)
    await mine.ops.meta.call(P.QuotaSetReq(ino=mine.dir, max_inodes=2))
    made = []
    for i in range(3):
        fh, ino = await mine.create(mine.dir, b"q%d" % i)
        await mine.close(fh)
        made.append(ino)
    await mine.ops.dirops.flush()
    assert mine.ops.dirops.refused == 1
    async with raises_errno(errno.EDQUOT):
        await mine.getattr(made[2])
    assert mine.ops.dirops.take_error(made[2]) is None  # once
    await mine.ops.kcache.flush_pending()
    assert (mine.dir, b"q2") in mine.kernel.invalidated_entries  # the kernel forgets the name
    assert sorted(await mine.listdir(mine.dir)) == [b"q0", b"q1"]
    await mine.ops.meta.call(P.QuotaSetReq(ino=mine.dir, max_inodes=0))


async def test_another_mount_reading_the_directory_sees_the_creates_answered_here(mine, rig, monkeypatch):
    """Close-to-open for names: another mount's lookup or listing of the directory recalls it
    (daemon/callbacks.py ``recall_needed``): this mount sends its pending creates first."""
    await _numbers(mine)
    made = []
    for i in range(3):
        fh, ino = await mine.create(mine.dir, b"r%d" % i)
        await mine.close(fh)
        made.append(ino)
    assert mine.ops.dirops.pending(made[1])
    async with open_fs(rig, Kernel(monkeypatch), "reader") as theirs:
        with trio.fail_after(5):
            assert (await theirs.lookup(mine.dir, b"r1")).nodeid == made[1]
    for i in range(3, 6):
        await mine.close((await mine.create(mine.dir, b"r%d" % i))[0])
    assert await _listing(rig, monkeypatch, "lister", mine.dir) == [b"r%d" % i for i in range(6)]


async def test_unlinks_in_a_held_directory_are_answered_here_in_order_with_the_creates(mine, rig, monkeypatch):
    await _numbers(mine)
    calls = []
    real = mine.ops.meta.call
    mine.ops.meta.call = lambda req, **kw: (calls.append(type(req).__name__), real(req, **kw))[1]
    for i in range(20):
        await mine.close((await mine.create(mine.dir, b"u%02d" % i))[0])
    for i in range(0, 20, 2):
        await mine.unlink(mine.dir, b"u%02d" % i)
    await mine.close((await mine.create(mine.dir, b"u00"))[0])  # made again after its unlink: order kept
    assert "UnlinkReq" not in calls and "CreateReq" not in calls
    fh, ino = await mine.create(mine.dir, b"open")
    await mine.unlink(mine.dir, b"open")  # open here: the daemon must learn it is open, so it is asked
    assert "UnlinkReq" in calls
    await mine.close(fh)
    await mine.ops.fsyncdir(mine.dir, False)
    expected = sorted([b"u00"] + [b"u%02d" % i for i in range(1, 20, 2)])
    assert await _listing(rig, monkeypatch, "other", mine.dir) == expected


async def test_mkdir_in_a_held_directory_is_answered_here_and_what_is_made_in_it_too(mine, rig, monkeypatch):
    await _numbers(mine)
    calls = []
    real = mine.ops.meta.call
    mine.ops.meta.call = lambda req, **kw: (calls.append(type(req).__name__), real(req, **kw))[1]
    parent = mine.dir
    chain = []
    for level in range(5):  # mkdir -p: each level made in the one made just before
        parent = await mine.mkdir(parent, b"l%d" % level)
        chain.append(parent)
        await mine.close((await mine.create(parent, b"f"))[0])
    assert (await mine.getattr(chain[2])).nlink == 3  # answered here: "..", ".", l3
    assert not {"MkdirReq", "CreateReq", "GetattrReq", "LookupReq"} & set(calls)
    await mine.mkdir(chain[4], b"gone")
    await mine.rmdir(chain[4], b"gone")  # made and removed before the daemon had either
    await mine.unlink(chain[4], b"f")
    await mine.rmdir(chain[3], b"l4")  # empty now: answered here as well
    assert not {"RmdirReq", "UnlinkReq"} & set(calls)
    chain.pop()
    await mine.ops.fsyncdir(mine.dir, False)
    async with open_fs(rig, Kernel(monkeypatch), "other") as other:
        ino = mine.dir
        for level in range(4):
            ino = (await other.lookup(ino, b"l%d" % level)).nodeid
            assert ino == chain[level]
        assert sorted(await other.listdir(ino)) == [b"f"]
