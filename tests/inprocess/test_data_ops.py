"""Data through the mount's handlers: a writer scattering small writes over many chunks, thousands of small files.

Moved from tests/cluster/test_data.py, which keeps what needs the kernel
(large sequential I/O through its read-ahead, several mounts, the CLI).
"""

import hashlib
import os
import random

import pytest
import trio

from stripefs.client import fuse_backend
from stripefs.common import protocol as P

from fsapi import Ctx, Kernel, NewAttrs, SetattrFields, open_fs

MiB = 1 << 20


async def test_scattered_writer_over_many_chunks(fs):
    """More partial chunks than a file may hold unsent: the oldest go out early, nothing is lost."""
    rng = random.Random(7)
    chunk = 4 * MiB
    pieces = {}
    fh, ino = await fs.open_path(fs.dir, b"sparse", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        for _ in range(3):
            for i in rng.sample(range(40), 40):
                off = i * chunk + rng.randrange(0, chunk - 5000)
                data = rng.randbytes(rng.randrange(1, 5000))
                assert await fs.write(fh, off, data) == len(data)  # each a write(2) of its own
                pieces[off] = data
    finally:
        await fs.close(fh)
    fh, _ = await fs.open_path(fs.dir, b"sparse", os.O_RDONLY)
    try:
        for off, data in pieces.items():
            got = await fs.read(fh, off, len(data))
            # a later piece may overlap an earlier one: compare only bytes no later write touched
            later = [(o, d) for o, d in pieces.items() if o != off and o < off + len(data) and o + len(d) > off]
            if not later:
                assert got == data
    finally:
        await fs.close(fh)
    assert (await fs.getattr(ino)).size == max(o + len(d) for o, d in pieces.items())


async def test_thousands_of_small_files(fs, monkeypatch):
    rng = random.Random(3)
    sums, contents = {}, {}
    dirs = [await fs.mkdir(fs.dir, b"d%d" % i) for i in range(10)]
    for i in range(1500):
        data = rng.randbytes(rng.randrange(0, 40_000))
        name = (i % 10, b"f%d" % i)
        contents[name] = data
        sums[name] = hashlib.sha256(data).hexdigest()
    # written by 4 writers at once, as a copy tool's threads do: the kernel hands the mount their
    # requests side by side, and the mount, the daemon and the nodes work side by side
    todo = iter(contents.items())

    async def writer():
        for (d, name), data in todo:
            await fs.write_file(dirs[d], name, data)

    async with trio.open_nursery() as nursery:
        for _ in range(4):
            nursery.start_soon(writer)
    # read back through another client: nothing of them in its memory (the kernel's caches dropped)
    async with open_fs(fs.rig, Kernel(monkeypatch), "cold-reader") as reader:
        for (d, name), digest in sums.items():
            assert hashlib.sha256(await reader.read_file(dirs[d], name)).hexdigest() == digest, name


@pytest.mark.per_open
async def test_a_release_while_another_open_waits_keeps_one_state_per_file(fs, monkeypatch):
    """RELEASE of a file's last handle can arrive while an OPEN of the same file waits (here: for the
    kernel's attributes to be dropped, because the file changed since its pages were cached). The
    new handle must still be the file's one state (``Operations.files``): with a second one, a later
    open read a chunk map older than this handle's writes and wrote over them (found by the data-path
    tester, tests/datapath_model.py: a read of bytes just written returned zeros)."""
    ops = fs.ops
    ino = await fs.write_file(fs.dir, b"f", b"a" * 5000)
    first = await fs.open(ino, os.O_RDWR)
    ops._kernel_view[ino] = (0, 0)  # the kernel's pages are older than the file: the open drops its attributes
    released = []

    def invalidate(inode, attr_only=False):  # on a worker thread: the RELEASE is handled meanwhile
        if inode == ino and not released:
            released.append(first)
            trio.from_thread.run(fs.release, first)

    monkeypatch.setattr(fuse_backend, "invalidate_inode", invalidate)
    second = await fs.open(ino, os.O_RDWR)
    assert released == [first]  # the race happened
    assert ops.files.get(ino) is ops.handles[second]  # ... and the file still has one state, this handle's
    await fs.write(second, 0, b"b" * 10)
    third = await fs.open(ino, os.O_RDONLY)
    assert ops.handles[third] is ops.handles[second]
    assert await fs.read(third, 0, 20) == b"b" * 10 + b"a" * 10
    await fs.close(third)
    await fs.close(second)
    assert await fs.read_file(fs.dir, b"f") == b"b" * 10 + b"a" * 4990


async def test_a_truncate_during_another_handles_commit_keeps_its_size(fs, monkeypatch):
    """One thread fsyncs a file while another extends it with ftruncate (a database's log does
    both). The fsync's commit reply, computed before the truncate, must not put the file's size
    back: the extended bytes would then read as past the end, and the kernel would cut its size."""
    ops = fs.ops
    ino = await fs.write_file(fs.dir, b"t", b"a" * 1000)
    fh = await fs.open(ino, os.O_RDWR)
    await fs.write(fh, 0, b"b" * 10)  # something for the fsync to commit
    meta = ops.data.meta
    real_call = meta.call
    commit_sent, release_commit = trio.Event(), trio.Event()

    async def call(request, **kw):
        rsp = await real_call(request, **kw)
        if isinstance(request, P.CommitReq) and not commit_sent.is_set():
            commit_sent.set()  # answered by the daemon, the reply not yet taken in
            await release_commit.wait()
        return rsp

    monkeypatch.setattr(meta, "call", call)
    extended = SetattrFields(update_size=True)
    attr = NewAttrs(st_size=5000)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(fs.fsync, fh)
        await commit_sent.wait()
        nursery.start_soon(fs.ops.setattr, ino, attr, extended, fh, Ctx())
        await trio.sleep(0.5)  # the truncate runs as far as it may while the commit waits
        release_commit.set()
    assert ops.files[ino].size == 5000
    assert (await fs.getattr(ino)).size == 5000
    assert await fs.read(fh, 0, 6000) == b"b" * 10 + b"a" * 990 + bytes(4000)
    await fs.close(fh)


async def test_an_open_after_an_fsync_does_not_take_an_older_lookups_answer(fs):
    """An open uses the open information of a LOOKUP younger than OPEN_INFO_FRESH_S. A commit of
    the file makes that answer old, whichever request committed: here an fsync, after which the
    FLUSH of close has nothing left to send. The next open (the kernel still has the name: no
    LOOKUP) must not take the file's size and chunk map from before the fsync."""
    ino = await fs.write_file(fs.dir, b"s", b"a" * 100)
    await fs.lookup(fs.dir, b"s")  # open information: 100 bytes
    fh = await fs.open(ino, os.O_RDWR)
    await fs.write(fh, 100, b"b" * 10)
    await fs.fsync(fh)  # committed: 110 bytes
    await fs.close(fh)
    fh = await fs.open(ino, os.O_RDONLY)
    assert await fs.read(fh, 0, 200) == b"a" * 100 + b"b" * 10
    await fs.close(fh)


@pytest.mark.per_open  # (an OPEN's race: no-open has none)
async def test_an_open_during_a_commit_keeps_the_chunk_map_being_committed(fs, monkeypatch):
    """While a flush's CommitReq is on its way, the write session is already handed over (nothing
    is left unflushed), but the daemon does not have it yet: an open answered meanwhile carries the
    chunk map from before the commit, and must not replace the one being committed."""
    ops = fs.ops
    ino = await fs.write_file(fs.dir, b"m", b"a" * 1000)
    fh = await fs.open(ino, os.O_RDWR)
    await fs.write(fh, 0, b"b" * 10)
    meta = ops.data.meta
    real_call = meta.call
    committing, go = trio.Event(), trio.Event()

    async def call(request, **kw):
        if isinstance(request, P.CommitReq) and not committing.is_set():
            committing.set()  # the session is handed over; the daemon has not seen it yet
            await go.wait()
        return await real_call(request, **kw)

    monkeypatch.setattr(meta, "call", call)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(fs.fsync, fh)
        await committing.wait()
        second = await fs.open(ino, os.O_RDWR)  # an OpenReq answered from the committed state
        go.set()
    of = ops.files[ino]
    assert of.chunks[0].version == (await real_call(P.OpenReq(ino=ino, session_id=meta.session_id))).chunks[0].version
    assert await fs.read(second, 0, 20) == b"b" * 10 + b"a" * 10
    await fs.close(second)
    await fs.close(fh)


async def _answer_then_hold(fs, monkeypatch, kind):
    """Make the next ``kind`` request to the daemon be answered at once but handed to the mount only
    when the test says so: (answered, go) events."""
    meta = fs.ops.data.meta
    real_call = meta.call
    answered, go = trio.Event(), trio.Event()

    async def call(request, **kw):
        rsp = await real_call(request, **kw)
        if isinstance(request, kind) and not answered.is_set():
            answered.set()  # the daemon answered from the state before the commit below
            await go.wait()
        return rsp

    monkeypatch.setattr(meta, "call", call)
    return answered, go


@pytest.mark.per_open  # (an OPEN's race: no-open has none)
async def test_an_open_answered_before_a_commit_and_taken_after_it_keeps_the_commit(fs, monkeypatch):
    """A second thread opens the file while the first one's fsync commits: the OpenReq is answered
    before the commit, its answer taken after it. That answer is older than the mount's state of the
    file (size, chunk map); taken, the bytes the fsync committed read as missing (an EC file's older
    stripe is deleted by then: EIO)."""
    ino = await fs.write_file(fs.dir, b"m", b"a" * 1000)
    fh = await fs.open(ino, os.O_RDWR)
    await fs.write(fh, 1000, b"b" * 10)
    answered, go = await _answer_then_hold(fs, monkeypatch, P.OpenReq)
    async with trio.open_nursery() as nursery:
        opened = []

        async def second_open():
            opened.append(await fs.open(ino, os.O_RDONLY))

        nursery.start_soon(second_open)
        await answered.wait()
        await fs.fsync(fh)  # committed while the open's answer is on its way
        go.set()
    assert fs.ops.files[ino].size == 1010
    assert await fs.read(opened[0], 0, 2000) == b"a" * 1000 + b"b" * 10
    await fs.close(opened[0])
    await fs.close(fh)


async def test_a_lookup_answered_before_a_commit_is_not_an_open_answer_after_it(fs, monkeypatch):
    """The same race through a LOOKUP: its open information, answered before a commit and taken
    after it, must not stand in for an OpenReq of the next open (OPEN_INFO_FRESH_S)."""
    ino = await fs.write_file(fs.dir, b"m", b"a" * 1000)
    fh = await fs.open(ino, os.O_RDWR)
    await fs.write(fh, 1000, b"b" * 10)
    answered, go = await _answer_then_hold(fs, monkeypatch, P.LookupReq)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(fs.lookup, fs.dir, b"m")
        await answered.wait()
        await fs.fsync(fh)
        go.set()
    second = await fs.open(ino, os.O_RDONLY)
    assert await fs.read(second, 0, 2000) == b"a" * 1000 + b"b" * 10
    await fs.close(second)
    await fs.close(fh)


async def test_a_write_during_another_descriptors_flush_is_committed_with_its_chunk(fs, monkeypatch):
    """One descriptor's close (FLUSH) while another writes on: a WRITE that arrives while the flush
    waits for the sends in flight buffers a new chunk and moves the file's end. The flush must not
    commit that end without the chunk holding it (the daemon refuses such a commit, and the write
    session was then thrown away). Found by a clean-clone CI run: the mount's own no-open primer
    (client/no_open_primer.py) opened and closed a fresh mount's first file while the test wrote it."""
    ops = fs.ops
    fh, ino = await fs.create(fs.dir, b"two-writers")
    of = ops.files[ino]
    cs = of.chunk_size
    real_send = ops.data._send_chunk
    sending, go = trio.Event(), trio.Event()

    async def send_chunk(of_, dc, **kw):
        if dc.index == 0:
            sending.set()
            await go.wait()  # chunk 0 stays in flight while the flush waits for it
        return await real_send(of_, dc, **kw)

    monkeypatch.setattr(ops.data, "_send_chunk", send_chunk)
    first, second = os.urandom(cs), os.urandom(1000)
    await fs.write(fh, 0, first)  # a whole chunk: sent in the background
    async with trio.open_nursery() as nursery:
        await sending.wait()
        nursery.start_soon(fs.flush, fh)  # the other descriptor's close
        await trio.sleep(0.2)  # ... waits for chunk 0
        assert await fs.write(fh, cs, second) == len(second)  # the file's end moves into chunk 1
        go.set()
    await fs.close(fh)
    assert (await fs.getattr(ino)).size == cs + len(second)
    assert await fs.read_file(fs.dir, b"two-writers") == first + second
