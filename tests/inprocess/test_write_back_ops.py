"""Small-file write-back (client/write_back.py) through the mount's handlers, on a client that follows the
change feed as a mount does: a small new file's close returns before its data is stored and committed;
the data follows in batches (one WriteChunksReq per node, one BatchReq of commits), before another
mount reads it, at fsync, FSYNCDIR and unmount; what cannot be stored is never committed and is
reported at the file's next close; ``sync_close`` commits at close as before."""

from __future__ import annotations

import errno
import os
import re

import pytest
import trio

from stripefs.client import async_dirops, idle_commits, write_back
from stripefs.client.operations import FAST_PATH_MISS
from stripefs.client.fuse.abi import ROOT_ID
from stripefs.common import protocol as P
from stripefs.common.errors import ErrorCode, StripefsError

from fsapi import Kernel, delegated_numbers, in_held_directory, open_fs, raises_errno

K = 1 << 10


@pytest.fixture
async def mine(rig, request, monkeypatch):
    """A client that follows the feed, and a directory it made (held whole: creates answered here)."""
    async with open_fs(rig, Kernel(monkeypatch), f"inprocess:{request.node.name}", follow=True) as fs:
        await delegated_numbers(fs)  # creates answered here (a synchronous one sends the queue first)
        name = re.sub(r"[^A-Za-z0-9_]", "_", request.node.name).encode()
        for attempt in range(3):
            # a change feed that dropped the mount's cache meanwhile (3 s silent under the tiers' load,
            # seen in clean-clone runs) took the new directory's hold with it: another directory, once
            # the feed is in step (in_held_directory does the same for a round)
            with trio.fail_after(10):
                while not fs.ops.kcache.healthy:
                    await trio.sleep(0.05)
            fs.dir = await fs.mkdir(ROOT_ID, name + b"_%d" % attempt)
            if fs.ops._names_of_dir(fs.dir) is not None:
                break
        else:
            pytest.fail("the change feed dropped the mount's cache at each of 3 directories")
        await fs.first_close()
        yield fs


@pytest.fixture
def no_timer(monkeypatch):
    """The flushers' bounds out of the way (the write-back's, and the asynchronous creates': under load
    a create sent between its file's create and first write made the timing part of the test): only
    the triggers under test send the files."""
    monkeypatch.setattr(write_back, "DELAY_S", 600)
    monkeypatch.setattr(async_dirops, "DELAY_S", 600)


def _counting(fs) -> list[str]:
    """The kinds of request ``fs``'s mount sends the daemon (a BatchReq's items too) and the nodes' writes."""
    calls: list[str] = []
    meta, nodes = fs.ops.meta, fs.ops.data.nodes
    real_call, real_batch, real_many, real_write = meta.call, meta.call_batch, nodes.write_many, nodes.write
    meta.call = lambda req, **kw: (calls.append(type(req).__name__), real_call(req, **kw))[1]
    meta.call_batch = lambda reqs: (calls.extend(f"batch:{type(r).__name__}" for r in reqs), real_batch(reqs))[1]
    nodes.write_many = lambda node, writes, **kw: (calls.append(f"write_many:{len(writes)}"), real_many(node, writes, **kw))[1]
    nodes.write = lambda node, req, data: (calls.append("WriteChunkReq"), real_write(node, req, data))[1]
    return calls


def _why_not_held(fs, of) -> str:
    ops, d, kc = fs.ops, fs.ops.dirops, fs.ops.kcache
    return (f"early={bool(of.early)} open_count={of.open_count} healthy={kc.healthy} left={d.left()} "
            f"grant={of.ino in kc.grants} dir_held={ops._names_of_dir(of.parent) is not None} parent={of.parent} "
            f"pending={d.pending(of.ino)} layout_pending={of.chunks == {}} drops={kc.drops}")


async def _closed(fs) -> None:
    """After a close on a mount whose closes send nothing (client/idle_commits.py): what the close's
    FLUSH did at once follows ``IDLE_S`` after the last write (a small file queued here, a larger one
    committed): waited for."""
    if fs.ops.silent_close:
        with trio.fail_after(10):
            while fs.ops.idle.pending():
                await trio.sleep(0.01)


async def _reported(fs, fh: int) -> None:
    """The call that reports a failed write session, then the close: the close itself on a mount that
    sends FLUSH, the fsync on one whose closes send nothing (docs/design.md)."""
    if fs.ops.silent_close:
        await fs.fsync(fh)
    await fs.close(fh)


async def _write_files(fs, names_and_data, *, held: bool = True) -> list[int]:
    """Create, write and close each file; with ``held``, each close returned before its commit."""
    inodes = []
    for name, data in names_and_data:
        fh, ino = await fs.create(fs.dir, name)
        assert await fs.write(fh, 0, data) == len(data)
        of = fs.ops.files.get(ino)
        why = _why_not_held(fs, of) if of is not None else "no state"  # before the close: what it decides on
        await fs.close(fh)
        await _closed(fs)
        if held:
            assert fs.ops.writeback.holds(ino), why  # closed, not committed (the flusher runs DELAY_S later)
        inodes.append(ino)
    return inodes


async def test_close_returns_before_the_commit_and_another_mount_reads_the_files_whole(mine, rig, monkeypatch, no_timer):
    files = [(b"f%02d" % i, os.urandom(20 * K + i)) for i in range(20)]
    calls = _counting(mine)
    inodes = await _write_files(mine, files)
    assert calls == []  # creates, data and commits all wait: no round trip per file
    async with open_fs(rig, Kernel(monkeypatch), "other") as other:  # its lookups wait for this mount's write-back
        for name, data in files:
            assert await other.read_file(mine.dir, name) == data
    assert not any(mine.ops.writeback.holds(ino) for ino in inodes)
    assert calls.count("batch:CommitReq") == 20 and "CommitReq" not in calls and "WriteChunkReq" not in calls
    assert calls.count("batch:CreateReq") == 20 and calls.index("batch:CreateReq") < calls.index("batch:CommitReq")
    assert sum(int(c.split(":")[1]) for c in calls if c.startswith("write_many:")) == 40  # two replicas each
    assert len([c for c in calls if c.startswith("write_many:")]) < 20  # a request per node and batch, not per file
    assert mine.ops.writeback.sent == 20
    # nothing left to send of the closed files (no-open keeps a file's state until the kernel forgets it)
    assert not any(of.has_unflushed or of.early for of in mine.ops.files.values())
    if not mine.ops.no_open:
        assert not mine.ops.files


async def test_the_flusher_sends_within_its_bound_and_stat_and_reads_here_see_the_data(mine):
    data = os.urandom(50 * K)
    (ino,) = await _write_files(mine, [(b"one", data)])
    with trio.fail_after(10):
        while mine.ops.writeback.holds(ino):
            await trio.sleep(0.02)  # (write_back.DELAY_S later)
    assert (await mine.getattr(ino)).size == len(data)
    assert await mine.read_file(mine.dir, b"one") == data
    (ino,) = await _write_files(mine, [(b"two", data[:7])])
    assert mine.ops.writeback.holds(ino)
    assert (await mine.getattr(ino)).size == 7  # what its commit will record, answered here
    assert mine.ops.writeback.holds(ino)  # without sending it
    assert await mine.read_file(mine.dir, b"two") == data[:7]  # a read sends it first
    assert not mine.ops.writeback.holds(ino)


async def test_fsync_and_fsyncdir_make_written_back_files_durable(mine, no_timer):
    data = os.urandom(30 * K)
    calls = _counting(mine)
    ino, other = await _write_files(mine, [(b"a", data), (b"b", data[::-1])])
    fh = await mine.open(ino, os.O_RDWR)  # an open here reuses the file's state
    await mine.fsync(fh)  # commits the queued files, then syncs this one's copies
    assert not mine.ops.writeback.holds(ino) and not mine.ops.writeback.holds(other)
    assert "SyncChunksReq" not in calls  # (the nodes' requests are not counted here: see below)
    await mine.close(fh)
    synced = []
    real_sync = mine.ops.data.nodes.sync_each
    mine.ops.data.nodes.sync_each = lambda by_node: (synced.append(by_node), real_sync(by_node))[1]
    (third,) = await _write_files(mine, [(b"c", data[:100])])
    fh = await mine.open(third, os.O_RDWR)
    await mine.fsync(fh)
    await mine.close(fh)
    assert synced and all(c.ino == third for chunks in synced[0].values() for c in chunks)
    assert sum(len(c) for c in synced[0].values()) == 2  # both copies of its one chunk
    (fourth,) = await _write_files(mine, [(b"d", data[:10])])
    await mine.ops.fsyncdir(mine.dir, False)
    assert not mine.ops.writeback.holds(fourth)
    assert await mine.read_file(mine.dir, b"d") == data[:10]


async def test_data_that_cannot_be_stored_is_never_committed_and_the_next_close_reports_it(mine, rig, monkeypatch, no_timer):
    data = os.urandom(40 * K)
    nodes = mine.ops.data.nodes
    real_many, real_write = nodes.write_many, nodes.write

    async def refuse_many(node_id, writes, **kw):
        raise StripefsError(ErrorCode.IO, "the disk is gone")

    async def refuse(node_id, request, payload):
        raise StripefsError(ErrorCode.IO, "the disk is gone")

    rig.expect_log(r"could not be stored|was not stored|no replica took the write")

    async def body(d):  # (a feed drop under load: the close commits at once and reports EIO; again)
        mine.dir = d
        (good,) = await _write_files(mine, [(b"good", data)])
        await mine.ops.fsyncdir(mine.dir, False)
        nodes.write_many, nodes.write = refuse_many, refuse
        try:
            (bad,) = await _write_files(mine, [(b"bad", data)])
            await mine.ops.fsyncdir(mine.dir, False)
        finally:
            nodes.write_many, nodes.write = real_many, real_write
        assert mine.ops.writeback.failed >= 1
        async with open_fs(rig, Kernel(monkeypatch), "other") as other:
            assert await other.read_file(mine.dir, b"bad") == b""  # never committed as zeros or a length without data
            assert await other.read_file(mine.dir, b"good") == data
        fh = await mine.open(bad, os.O_RDWR)
        async with raises_errno(errno.EIO):
            await _reported(mine, fh)  # the next close of the file (fsync: closes that send nothing) reports it, once
        fh = await mine.open(bad, os.O_RDWR)
        await mine.close(fh)

    await in_held_directory(mine, body)


async def test_a_node_killed_during_write_back_gets_the_usual_retries(mine, rig, monkeypatch, no_timer):
    files = [(b"k%02d" % i, os.urandom(10 * K + i)) for i in range(12)]
    inodes = await _write_files(mine, files)
    await mine.ops.dirops.flush()  # their creates answered: placed on nodes that are up
    nodes = {n for ino in inodes for n in mine.ops.files[ino].chunks[0].nodes}
    victim = sorted(nodes)[0]
    rig.kill_node(victim)
    rig.expect_log(r"storage node \d+ .* is not answering|moving that copy|not answering")
    try:
        await mine.ops.fsyncdir(mine.dir, False)  # a node timing out: each of its files sent again, copy moved
        assert mine.ops.writeback.failed == 0
        async with open_fs(rig, Kernel(monkeypatch), "other") as other:
            for name, data in files:
                assert await other.read_file(mine.dir, name) == data
                ino = (await other.lookup(mine.dir, name)).nodeid
                rsp = await other.ops.meta.call(P.OpenReq(ino=ino, session_id=other.ops.meta.session_id))
                assert victim not in rsp.chunks[0].nodes and len(rsp.chunks[0].nodes) == 2
    finally:
        await rig.restart()


async def test_a_directory_quota_cuts_what_is_written_back_and_the_next_close_says_so(mine, rig, no_timer):
    limit = 100 * K
    await mine.ops.meta.call(P.QuotaSetReq(ino=mine.dir, max_bytes=limit))
    one, two = os.urandom(70 * K), os.urandom(70 * K)
    f1, i1 = await mine.create(mine.dir, b"one")
    f2, i2 = await mine.create(mine.dir, b"two")
    assert await mine.write(f1, 0, one) == len(one)
    assert await mine.write(f2, 0, two) == len(two)  # each fits alone
    await mine.close(f1)
    await mine.close(f2)  # answered at once: the quota is the daemon's to check at the commit
    await mine.ops.fsyncdir(mine.dir, False)
    assert (await mine.getattr(i1)).size + (await mine.getattr(i2)).size <= limit
    cut = i2 if (await mine.getattr(i2)).size < len(two) else i1
    fh = await mine.open(cut, os.O_RDWR)
    async with raises_errno(errno.EDQUOT):
        await _reported(mine, fh)
    assert await mine.read_file(mine.dir, b"one") == one[: (await mine.getattr(i1)).size]


async def test_sync_close_commits_at_close_as_before(rig, monkeypatch):
    async with open_fs(rig, Kernel(monkeypatch), "sync-close", follow=True, sync_close=True) as fs:
        assert fs.ops.writeback is None
        fs.dir = await fs.mkdir(ROOT_ID, b"sync_close")
        calls = _counting(fs)
        data = os.urandom(20 * K)
        await _write_files(fs, [(b"x", data)], held=False)
        assert calls.count("CommitReq") == 1 and calls.count("WriteChunkReq") == 2 and not any(c.startswith("write_many") for c in calls)
        async with open_fs(rig, Kernel(monkeypatch), "other") as other:
            assert await other.read_file(fs.dir, b"x") == data


async def test_larger_files_and_rewrites_commit_at_close(mine):
    calls = _counting(mine)
    big = os.urandom(5 << 20)  # more than one 4 MiB chunk
    (ino,) = await _write_files(mine, [(b"big", big)], held=False)
    assert not mine.ops.writeback.holds(ino) and "CommitReq" in calls
    fh = await mine.open(ino, os.O_RDWR)
    await mine.write(fh, 10, b"rewritten")
    await mine.close(fh)  # a committed chunk rewritten: not a new file's
    assert not mine.ops.writeback.holds(ino)
    assert await mine.read_file(mine.dir, b"big") == big[:10] + b"rewritten" + big[19:]


async def test_a_create_refused_after_the_close_commits_none_of_its_data(mine, rig, monkeypatch, no_timer):
    """An inode quota the mount did not know of: the creates past it are refused when the write-back
    sends them; their kept data goes nowhere, the next operation on such a file fails once, and the
    others are committed whole."""
    await mine.ops.meta.call(P.QuotaSetReq(ino=mine.dir, max_inodes=3))
    rig.expect_log(r"was not stored|refused after the kernel was answered")
    files = [(b"q%d" % i, os.urandom(3 * K + i)) for i in range(5)]
    inodes = await _write_files(mine, files)
    await mine.ops.fsyncdir(mine.dir, False)
    refused = []
    for ino in inodes:
        try:
            await mine.getattr(ino)
        except Exception as exc:  # noqa: BLE001 - the CephFS rule: the refusal's error, once
            assert getattr(exc, "errno", None) == errno.EDQUOT, exc
            refused.append(ino)
    assert len(refused) == 2
    async with open_fs(rig, Kernel(monkeypatch), "other") as other:
        names = sorted(await other.listdir(mine.dir))
        assert len(names) == 3
        for name, data in files:
            if name in names:
                assert await other.read_file(mine.dir, name) == data


async def test_a_close_past_the_queues_bound_waits_for_a_batch(mine, monkeypatch, no_timer):
    monkeypatch.setattr(write_back, "MAX_QUEUED", 3)
    files = [(b"m%d" % i, os.urandom(2 * K + i)) for i in range(5)]
    inodes = await _write_files(mine, files[:2])
    fh, third = await mine.create(mine.dir, b"m2")
    await mine.write(fh, 0, files[2][1])
    await mine.close(fh)  # the third queued: this close sends the three (backpressure)
    await _closed(mine)  # (closes that send nothing: the third's idle commit does)
    assert not any(mine.ops.writeback.holds(ino) for ino in [*inodes, third])
    await _write_files(mine, files[3:])  # held again, below the bound
    for name, data in files:
        assert await mine.read_file(mine.dir, name) == data


async def test_a_file_waiting_to_be_sent_is_never_answered_with_the_size_its_create_had(mine, no_timer):
    """Found merging write-back with no-open: the create's answer re-held the new file's attributes
    (size 0) after its close queued it, and once the kernel forgot the inode (drop_caches) the
    reader thread answered a LOOKUP and a GETATTR from them: a stat and a read saw an empty file
    until the write-back sent it. Now a GETATTR while the write-back holds the file is answered
    with what its commit will record (the size written, the last write's mtime), held for no time,
    a lookup in its directory sends the waiting files first, and the commit records that mtime."""
    data = os.urandom(5000)
    (ino,) = await _write_files(mine, [(b"queued", data)])
    await mine.ops.dirops.flush()  # the create is answered; its data and commit still wait
    assert mine.ops.writeback.holds(ino)
    mine.ops.forget_now([(ino, 1)])  # the kernel forgets the inode (memory pressure, drop_caches)
    assert mine.ops._fast_lookup(mine.dir, b"queued") is FAST_PATH_MISS
    early, valid = mine.ops._fast_getattr(ino)
    assert (early.size, valid) == (len(data), 0.0)
    assert mine.ops.writeback.holds(ino)  # answered without sending it
    committed = (await mine.lookup(mine.dir, b"queued")).attr
    assert not mine.ops.writeback.holds(ino)  # the lookup sent it
    assert (committed.size, committed.mtime_ns) == (early.size, early.mtime_ns)
    assert await mine.read_file(mine.dir, b"queued") == data


def _hold_commits(fs, monkeypatch) -> tuple[trio.Event, trio.Event]:
    """(sent, go): ``fs``'s CommitReqs wait at the mount, once ``sent`` is set, until ``go`` is."""
    meta = fs.ops.data.meta
    real_call, sent, go = meta.call, trio.Event(), trio.Event()

    async def call(req, **kw):
        if isinstance(req, P.CommitReq):
            sent.set()
            await go.wait()
        return await real_call(req, **kw)

    monkeypatch.setattr(meta, "call", call)
    return sent, go


async def test_a_stat_while_the_mount_commits_a_file_answers_what_the_commit_recorded(mine, monkeypatch, no_timer):
    """Closes that send nothing: a stat that comes while this mount's commit of the file is on its way
    (its session handed over, so the mount holds no write time of its own for it) waits for that
    commit and answers what the daemon recorded, never the times from before the writes. Found by a
    clean-clone CI run: test_tier's stat of a file right after writing it and the same stat after a
    migration differed by the commit's mtime."""
    assert mine.ops.silent_close
    (ino,) = await _write_files(mine, [(b"rewritten", os.urandom(5000))])
    await mine.ops.fsyncdir(mine.dir, False)  # committed: a rewrite is no new file, so it commits itself
    before = await mine.getattr(ino)
    fh = await mine.open(ino, os.O_RDWR)
    await trio.sleep(0.01)  # (a write time the clock can tell from the create's)
    assert await mine.write(fh, 0, b"new") == 3
    await mine.close(fh)
    sent, go = _hold_commits(mine, monkeypatch)  # the commit stays on its way while the stat comes
    answered = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(mine.ops._commit_idle, ino)  # (what the idle timer does IDLE_S after the write)
        await sent.wait()

        async def stat():
            answered.append(await mine.getattr(ino))

        nursery.start_soon(stat)
        await trio.sleep(0.2)
        assert not answered  # it waits for the commit
        go.set()
    committed = (await mine.ops.meta.call(P.GetattrReq(ino=ino, session_id=0))).attr
    assert answered[0].mtime_ns == committed.mtime_ns > before.mtime_ns


async def test_another_mount_s_read_waits_for_a_commit_already_on_its_way(mine, rig, monkeypatch, no_timer):
    """Closes that send nothing: another mount's open and read of a file this mount is committing
    right now (its idle commit sent, the session handed over: nothing of it counts as written here
    any more) waits for that commit, and reads what was closed. The acknowledgement of their recall
    went at once, and they read the bytes from before the write: a million-operation model run,
    EC, a commit held up ~50 ms by a snapshot's copy-out (tests/datapath_model.py, seed 440301366)."""
    assert mine.ops.silent_close
    old, new = os.urandom(70 * K), os.urandom(70 * K)
    (ino,) = await _write_files(mine, [(b"rewritten", old)])
    await mine.ops.fsyncdir(mine.dir, False)  # committed: a rewrite is no new file, so it commits itself
    fh = await mine.open(ino, os.O_RDWR)
    assert await mine.write(fh, 0, new) == len(new)
    await mine.close(fh)
    sent, go = _hold_commits(mine, monkeypatch)  # the commit stays on its way while the other mount reads
    read = []
    with pytest.MonkeyPatch.context() as theirs_patch:  # (their kernel's invalidations are theirs: undone after)
        async with open_fs(rig, Kernel(theirs_patch), "theirs") as theirs:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(mine.ops._commit_idle, ino)  # (what the idle timer does IDLE_S after the write)
                await sent.wait()

                async def their_read():
                    read.append(await theirs.read_file(mine.dir, b"rewritten"))

                nursery.start_soon(their_read)
                await trio.sleep(0.3)
                assert not read or read[0] != old, "read the bytes from before the closed write"
                assert not read  # it waits for the commit on its way
                go.set()
    assert read == [new]


async def _write_here(fs, ino: int, fh: int, offset: int, data: bytes):
    """A WRITE's fast path as the FUSE session's reader thread runs it: on a thread of its own,
    under the lock the dispatcher holds around fast paths (client/fuse/dispatch.py)."""
    def on_reader():
        with fs.ops.lock:
            return fs.ops._write_here(ino, 0 if fh < 0 else fh, offset, data)
    return await trio.to_thread.run_sync(on_reader)


async def test_a_write_to_a_file_whose_create_is_not_sent_is_answered_on_the_reader_thread(mine, rig, monkeypatch, no_timer):
    """`cp -r` (issue 31): each copied file's WRITE went to a trio task (a hand-off, a task, a reply
    from the trio thread) only to be kept until the create is sent. Now the reader thread keeps it:
    no request to the daemon or the nodes, the idle commit queues the file in the write-back as
    before, and another mount reads it whole; a write after the create was sent is the slow path's."""
    calls = _counting(mine)
    data = [os.urandom(40 * K), os.urandom(30 * K)]
    fh, ino = await mine.create(mine.dir, b"copied")
    assert mine.ops.dirops.pending(ino)  # its create answered here, not sent
    assert await _write_here(mine, ino, fh, 0, data[0]) == len(data[0])
    assert await _write_here(mine, ino, fh, len(data[0]), data[1]) == len(data[1])
    assert calls == []  # kept: no round trip
    of = mine.ops.files[ino]
    assert of.size == sum(map(len, data)) and of.early_bytes == of.size
    await mine.close(fh)
    await _closed(mine)  # the idle commit, its timer set from the reader thread, queued the file
    assert mine.ops.writeback.holds(ino), _why_not_held(mine, of)
    assert calls == []
    async with open_fs(rig, Kernel(monkeypatch), "other") as other:  # its lookup waits for this mount's write-back
        assert await other.read_file(mine.dir, b"copied") == b"".join(data)
    assert calls.count("batch:CreateReq") == 1 and calls.count("batch:CommitReq") == 1
    fh, ino = await mine.create(mine.dir, b"sent first")
    await mine.ops.dirops.flush()  # its create is sent: a write needs its layout, in trio
    assert await _write_here(mine, ino, fh, 0, data[0]) is FAST_PATH_MISS
    assert await mine.write(fh, 0, data[0]) == len(data[0])
    await mine.close(fh)
    await _closed(mine)
    assert await mine.read_file(mine.dir, b"sent first") == data[0]


async def test_a_file_written_again_while_queued_keeps_one_entry(mine, no_timer):
    """Found measuring issue 31: a file written again after its close, its create still not sent
    (no-open: the kernel's WRITE names the inode, no LOOKUP settles it first), is queued again by
    its idle commit. The queue kept one entry but counted the file's directory twice and its bytes
    twice, and its send took one of each back: the directory stayed ``busy`` for good (every
    lookup there then went to trio to send nothing) and the bytes counted toward the backpressure
    bound (MAX_QUEUED_BYTES) grew with each such file. Now a file queued again is counted once."""
    fh, ino = await mine.create(mine.dir, b"twice")
    await mine.write(fh, 0, b"a" * 100)
    await mine.close(fh)
    await _closed(mine)
    wb = mine.ops.writeback
    assert wb.holds(ino)
    assert mine.ops.dirops.pending(ino)  # its create is not sent: the next write is kept, as the first
    await mine.write(fh, 100, b"b" * 100)  # the kernel's WRITE by inode, no OPEN nor LOOKUP (its dentry kept)
    await _closed(mine)  # its idle commit queues it again
    assert wb.holds(ino)
    await wb.flush()
    assert not wb.holds(ino) and not wb.busy(mine.dir)
    assert wb._queued_bytes == 0
    assert await mine.read_file(mine.dir, b"twice") == b"a" * 100 + b"b" * 100


async def test_a_small_file_s_kept_write_is_sent_from_the_buffer_it_was_copied_into(mine, rig, monkeypatch, no_timer):
    """`cp -r` (issue 31): a copied file's one WRITE is copied once out of the FUSE request into what
    the file keeps until its create is sent (``OpenFile.early``); applying it then (``_replay``)
    copied it again into the chunk's buffer. Now that buffer is the kept one (``DataPath.adopt``):
    the write-back hands the nodes that very memory, and another mount reads the file whole."""
    nodes = mine.ops.data.nodes
    real_many, sent = nodes.write_many, []
    nodes.write_many = lambda node, writes, **kw: (sent.extend(d for _, d in writes), real_many(node, writes, **kw))[1]
    data = os.urandom(110 * K)
    fh, ino = await mine.create(mine.dir, b"copied once")
    assert await _write_here(mine, ino, fh, 0, data) == len(data)
    (kept,) = [buf for _, buf in mine.ops.files[ino].early]
    await mine.close(fh)
    await _closed(mine)
    assert mine.ops.writeback.holds(ino), _why_not_held(mine, mine.ops.files[ino])
    await mine.ops.writeback.flush()
    assert sent and all(payload.obj is kept for payload in sent)  # every replica's payload: the kept buffer, not a copy
    async with open_fs(rig, Kernel(monkeypatch), "other") as other:
        assert await other.read_file(mine.dir, b"copied once") == data


async def test_an_acknowledgement_waits_only_for_the_write_back_of_what_the_change_touched(mine, rig, monkeypatch, no_timer):
    """Another mount's change of a file this mount holds waits for its acknowledgement. The
    acknowledgement sends first what the change must see (the files, or files in directories, whose
    grants it ended) but not every small file queued here: up to MAX_QUEUED_BYTES on their way to the
    nodes made it run past the daemon's wait on a loaded machine, and the mount was penalised."""
    (elsewhere,) = await _write_files(mine, [(b"elsewhere", b"e" * 100)], held=False)
    await mine.ops.writeback.flush()  # committed: held here, nothing of it waits
    queued = await _write_files(mine, [(b"q%d" % i, os.urandom(5000)) for i in range(3)])
    with pytest.MonkeyPatch.context() as theirs_patch:  # (their kernel's invalidations are theirs: undone after)
        async with open_fs(rig, Kernel(theirs_patch), "theirs") as theirs:
            with trio.fail_after(10):  # their change of a file this mount holds: waits for its acknowledgement
                await theirs.setattr(elsewhere, st_mode=0o100600)
            assert all(mine.ops.writeback.holds(ino) for ino in queued)  # not what the change touched
            assert await theirs.read_file(mine.dir, b"q1") == (await mine.read_file(mine.dir, b"q1"))
    assert not any(mine.ops.writeback.holds(ino) for ino in queued)


async def test_an_acknowledgement_looks_only_at_files_marked_or_written(mine, rig, monkeypatch, no_timer):
    """A no-open mount keeps a state per inode the kernel knows (every file it created, until FORGET),
    and an acknowledgement commits the write sessions of what the change touched. It looks through the
    files that may be marked or written (``Operations._unclean``), not every state: 40,000 created
    files made each acknowledgement a scan of them all under the mount's lock. Created files found
    clean and unmarked leave that index, their states stay; a file written after that is back in it,
    and the next acknowledgement still commits it before another mount reads it."""
    monkeypatch.setattr(idle_commits, "IDLE_S", 600)  # only the acknowledgement commits the write below
    ops = mine.ops
    made = []
    for i in range(20):
        fh, ino = await mine.create(mine.dir, b"e%d" % i)
        await mine.close(fh)
        made.append(ino)
    assert set(made) <= set(ops._unclean)  # marked: created in a directory held whole
    with pytest.MonkeyPatch.context() as theirs_patch:  # (their kernel's invalidations are theirs: undone after)
        async with open_fs(rig, Kernel(theirs_patch), "theirs") as theirs:
            with trio.fail_after(10):  # their listing of the directory waits for this mount's acknowledgement
                assert set(await theirs.listdir(mine.dir)) >= {b"e%d" % i for i in range(20)}
            assert not set(made) & set(ops._unclean), "clean files stayed in the index"
            assert set(made) <= set(ops.files)  # (the states themselves stay: the kernel did not forget them)
            fh = await mine.open(made[0], os.O_WRONLY)
            data = os.urandom(300 * K)
            assert await mine.write(fh, 0, data) == len(data)
            assert made[0] in ops._unclean
            with trio.fail_after(10):  # their read waits for the acknowledgement, which commits it first
                assert await theirs.read_file(mine.dir, b"e0") == data
            await mine.close(fh)
