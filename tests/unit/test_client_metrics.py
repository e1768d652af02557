"""The mount's instrumentation: the op wrapper, the network/cache split, read-ahead accounting."""

import errno

import pytest
import trio

from stripefs.client import metrics as m
from stripefs.client.chunk_cache import ChunkCache
from stripefs.client.fuse.replies import FuseError


def _value(counter, *labels) -> float:
    child = counter.labels(*labels) if labels else counter
    return child._value.get()


class FakeOps:
    async def read(self, fh, off, size):
        m.network_wait(0.02)  # what the chunk cache reports for a miss
        await trio.sleep(0.03)
        return b"x" * size

    async def write(self, fh, off, buf):
        return len(buf)

    async def lookup(self, parent, name, ctx=None):
        raise FuseError(errno.ENOENT)


async def test_wrapped_ops_count_time_bytes_errors_and_split_read_time():
    ops = FakeOps()
    m.instrument(ops)
    before = {
        "reads": _value(m.FUSE_OPS, "read"),
        "bytes": _value(m.READ_BYTES),
        "wbytes": _value(m.WRITE_BYTES),
        "net": _value(m.READ_SECONDS, "network"),
        "mem": _value(m.READ_SECONDS, "cache"),
        "enoent": _value(m.FUSE_ANSWERS, "lookup", str(errno.ENOENT)),
    }
    assert await ops.read(1, 0, 1000) == b"x" * 1000
    assert await ops.write(1, 0, b"abc") == 3
    with pytest.raises(FuseError):
        await ops.lookup(1, b"nope")
    assert _value(m.FUSE_OPS, "read") == before["reads"] + 1
    assert _value(m.READ_BYTES) == before["bytes"] + 1000
    assert _value(m.WRITE_BYTES) == before["wbytes"] + 3
    assert _value(m.FUSE_ANSWERS, "lookup", str(errno.ENOENT)) == before["enoent"] + 1
    net = _value(m.READ_SECONDS, "network") - before["net"]
    mem = _value(m.READ_SECONDS, "cache") - before["mem"]
    assert net == pytest.approx(0.02)
    assert mem > 0  # the rest of the read's time
    m.network_wait(5.0)  # outside a read: charged to nobody
    assert _value(m.READ_SECONDS, "network") - before["net"] == pytest.approx(0.02)


class AnsweringOps:
    """What an ordinary copy sees: lookups of names not there yet, getxattr of absent attributes,
    the open the mount declines; and what is a failure: EIO, ETIMEDOUT, ENOSPC, EDQUOT."""

    def __init__(self):
        self.next = errno.ENOENT

    async def lookup(self, parent, name, ctx=None):
        raise FuseError(self.next)

    async def getxattr(self, ino, name, ctx=None):
        raise FuseError(errno.ENODATA)

    async def open(self, ino, flags, ctx=None):
        raise FuseError(errno.ENOSYS)


async def test_fuse_errors_count_failures_and_answers_apart():
    """issue 17, item 7: 'FUSE errors/s 1005.5' during a copy were ENOENT and ENODATA answers."""
    ops = AnsweringOps()
    m.instrument(ops)

    def errors() -> float:
        return sum(s.value for metric in m.FUSE_ERRORS.collect() for s in metric.samples if s.name.endswith("_total"))

    def answers() -> float:
        return sum(s.value for metric in m.FUSE_ANSWERS.collect() for s in metric.samples if s.name.endswith("_total"))

    e0, a0 = errors(), answers()
    for call in (lambda: ops.lookup(1, b"x"), lambda: ops.getxattr(1, b"user.x"), lambda: ops.open(1, 0)):
        with pytest.raises(FuseError):
            await call()
    assert errors() == e0 and answers() == a0 + 3
    for failure in (errno.EIO, errno.ETIMEDOUT, errno.ENOSPC, errno.EDQUOT, errno.ENOTCONN):
        ops.next = failure
        with pytest.raises(FuseError):
            await ops.lookup(1, b"x")
    assert errors() == e0 + 5 and answers() == a0 + 3
    assert _value(m.FUSE_ERRORS, "lookup", str(errno.EDQUOT)) >= 1


def test_top_shows_failures_as_errors_and_answers_apart():
    from stripefs import top

    def samples(errors, answers):
        return {("stripefs_fuse_errors_total", (("errno", "5"), ("op", "read"))): errors,
                ("stripefs_fuse_negative_answers_total", (("errno", "2"), ("op", "lookup"))): answers}

    text = "\n".join(top.render(samples(3, 2000), samples(0, 0), 1.0, "/mnt"))
    assert "FUSE errors/s      3.0" in text and "negative answers/s 2000.0" in text


async def test_readahead_used_and_wasted():
    cache = ChunkCache(budget_bytes=300)
    fetched, used, wasted = (_value(m.READAHEAD, o) for o in ("fetched", "used", "wasted"))

    async def load():
        return b"d" * 100

    await cache.fetch((1, 0, 1), load, prefetch=True)
    await cache.fetch((1, 1, 1), load, prefetch=True)
    await cache.fetch((1, 0, 1), load)  # a reader reads chunk 0: used
    await cache.fetch((1, 2, 1), load)
    cache.put((2, 0, 1), b"e" * 200)  # evicts chunk 1 (never read) and chunk 0 (read)
    assert _value(m.READAHEAD, "fetched") - fetched == 2
    assert _value(m.READAHEAD, "used") - used == 1
    assert _value(m.READAHEAD, "wasted") - wasted == 1
