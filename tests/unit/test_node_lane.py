"""The storage node's hot requests on its fast lane thread (storage_node/service.py ``handle_now``).

Small writes, deletes, stats and syncs are answered by the thread that owns the node's ROUTER
socket, without a trio task or a worker thread (docs/design.md, "The storage node's write path").
These tests run a real StorageService over real ZeroMQ in this process and look at which thread
did the store's work (a recording wrapper around the real ChunkStore methods), what was stored,
and which thread logged a refusal; the access rules are checked through ``handle_now`` itself with
a real keyring (the CURVE end-to-end refusals are tests/unit/test_security.py's).
"""

import logging
import os
import threading

import pytest
import trio
import xxhash
import zmq

from stripefs.common import protocol as p
from stripefs.common import security
from stripefs.common.config import StorageConfig
from stripefs.common.errors import ErrorCode, StripefsError
from stripefs.common.keyring import Keyring
from stripefs.common.transport import connect
from stripefs.storage_node import service as service_module
from stripefs.storage_node.chunk_store import ChunkStore
from stripefs.storage_node.service import INLINE_WRITE_MAX, StorageService

from util import free_address

NODE_ID = 3
LANE = f"storage-{NODE_ID}-fast-lane"


def _h(data) -> int:
    return xxhash.xxh3_64_intdigest(data)


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


class _Node:
    """A StorageService in this process; ``threads[method]``: the threads that ran each store call."""

    def __init__(self, tmp_path, **store_options):
        data_dir = tmp_path / "data"
        os.makedirs(data_dir)
        self.config = StorageConfig(node_id=NODE_ID, listen=free_address(), data_dir=str(data_dir), meta=[free_address()],
                                    heartbeat_interval_s=0.2, block_size=4096, reserved_space=0, metrics="")
        self.store = ChunkStore(data_dir, block_size=4096, reserved_space=0, node_id=NODE_ID, **store_options)
        self.service = StorageService(self.config, self.store, ctx=zmq.Context.instance())
        self.threads: dict[str, list[str]] = {}
        for method in ("write", "delete", "stat", "sync"):
            self._record(method)

    def _record(self, method: str) -> None:
        real = getattr(self.store, method)

        def recorded(*args, **kwargs):
            self.threads.setdefault(method, []).append(threading.current_thread().name)
            return real(*args, **kwargs)

        setattr(self.store, method, recorded)

    def last(self, method: str) -> str:
        return self.threads[method][-1]


@pytest.fixture
async def node(tmp_path, nursery):
    n = _Node(tmp_path)
    await nursery.start(n.service.run)
    yield n
    n.store.close()


def write(chunk, data, *, version=1, base=0, offset=0, replace=False, sync=False, truncate=-1):
    return p.WriteChunkReq(chunk=chunk, version=version, base_version=base, offset=offset, xxh3=_h(data), replace=replace,
                           sync=sync, truncate=truncate), [data]


async def _code(call) -> ErrorCode:
    with pytest.raises(StripefsError) as e:
        await call
    return e.value.code


async def test_small_writes_deletes_stats_and_syncs_are_answered_on_the_lane(node, ctx):
    c, big = p.ChunkId(1, 0, 0), p.ChunkId(2, 0, 0)
    async with connect(ctx, node.config.listen, timeout=10) as client:
        rsp, _ = await client.call(*write(c, b"a" * 5000, replace=True))
        assert (rsp.version, rsp.length) == (1, 5000) and node.last("write") == LANE
        rsp, _ = await client.call(*write(c, b"patch", version=2, base=1, offset=100, sync=True))
        assert (rsp.version, rsp.length) == (2, 5000) and node.last("write") == LANE
        rsp, _ = await client.call(p.StatChunkReq(chunk=c))
        assert (rsp.version, rsp.length) == (2, 5000) and node.last("stat") == LANE
        assert isinstance((await client.call(p.SyncChunksReq(chunks=[c])))[0], p.OkRsp) and node.last("sync") == LANE
        _, data = await client.call(p.ReadChunkReq(chunk=c, min_version=2, offset=0, length=10_000))
        assert bytes(data[0]) == b"a" * 100 + b"patch" + b"a" * 4895

        # a chunk past INLINE_WRITE_MAX is written by a worker thread, and so is a small write into it
        blob = os.urandom(INLINE_WRITE_MAX + 1)
        await client.call(*write(big, blob, replace=True))
        assert node.last("write") != LANE
        await client.call(*write(big, b"tail", version=2, base=1, offset=len(blob)))
        assert node.last("write") != LANE
        _, data = await client.call(p.ReadChunkReq(chunk=big, min_version=2, offset=len(blob) - 3, length=100))
        assert bytes(data[0]) == blob[-3:] + b"tail"

        rsp, _ = await client.call(p.DeleteChunksReq(chunks=[c, big]))
        assert rsp.deleted == 2 and node.last("delete") == LANE
        assert await _code(client.call(p.StatChunkReq(chunk=c))) == ErrorCode.NOT_FOUND
        assert node.last("stat") == LANE  # its error too


async def test_a_chunk_another_thread_holds_is_left_to_a_worker(node, ctx):
    """The lane never waits for a worker thread's write of the same chunk: it hands the request on."""
    c = p.ChunkId(5, 0, 0)
    async with connect(ctx, node.config.listen, timeout=10) as client:
        await client.call(*write(c, b"x" * 100, replace=True))
        holding, release = threading.Event(), threading.Event()

        def hold():
            with node.store._chunk_lock(c):
                holding.set()
                release.wait(10)

        holder = threading.Thread(target=hold)
        holder.start()
        try:
            assert holding.wait(10)
            async with trio.open_nursery() as calls:
                answers = []

                async def call(request, payloads=()):
                    answers.append((await client.call(request, payloads))[0])

                calls.start_soon(call, *write(c, b"y", version=2, base=1, offset=0))
                calls.start_soon(call, p.DeleteChunksReq(chunks=[p.ChunkId(5, 0, 32)], all_parts=False))
                with trio.fail_after(5):
                    while len(node.threads["write"]) < 2 or not node.threads.get("delete"):
                        await trio.sleep(0.01)  # both reached the worker threads, which wait for the lock
                # both handed on (the delete's copy is another part: it need not wait); the write waits
                assert node.threads["write"][-1] != LANE and node.threads["delete"][-1] != LANE
                assert not [a for a in answers if isinstance(a, p.WriteChunkRsp)]
                rsp, _ = await client.call(p.PingReq())  # meanwhile the lane answers others
                assert rsp.node_id == NODE_ID
                release.set()
        finally:
            release.set()
            holder.join()
        assert sorted(type(a).__name__ for a in answers) == ["DeleteChunksRsp", "WriteChunkRsp"]
        _, data = await client.call(p.ReadChunkReq(chunk=c, min_version=2, offset=0, length=3))
        assert bytes(data[0]) == b"yxx"


async def test_lane_and_worker_writes_of_one_chunk_lose_no_range(node, ctx, monkeypatch):
    """200 writes of disjoint ranges of one chunk at once, every other one handed to a worker thread:
    the lane's writes and the workers' serialise on the chunk's lock, so every range is there."""
    c = p.ChunkId(6, 0, 0)
    now = node.service._now[p.WriteChunkReq]
    monkeypatch.setitem(node.service._now, p.WriteChunkReq, lambda req, data, waiting: None if req.offset // 512 % 2 else now(req, data, waiting))
    expected = bytearray(b"." * 512)
    async with connect(ctx, node.config.listen, timeout=30) as client:
        await client.call(*write(c, bytes(expected), replace=True))

        async def one(i):
            await client.call(*write(c, bytes([i]) * 512, version=2, base=1, offset=512 * i))

        async with trio.open_nursery() as calls:
            for i in range(1, 201):
                expected += bytes([i]) * 512
                calls.start_soon(one, i)
        _, data = await client.call(p.ReadChunkReq(chunk=c, min_version=2, offset=0, length=1 << 20))
    assert bytes(data[0]) == bytes(expected)
    threads = node.threads["write"]
    assert threads.count(LANE) >= 100 and len(threads) - threads.count(LANE) >= 100


async def test_refusals_on_the_lane_are_answered_and_logged(node, ctx, caplog):
    c = p.ChunkId(7, 0, 0)
    caplog.set_level(logging.WARNING, logger="stripefs.storage_node.service")
    async with connect(ctx, node.config.listen, timeout=10) as client:
        await client.call(*write(c, b"committed", replace=True))
        # damaged in flight: nothing written
        req = p.WriteChunkReq(chunk=c, version=2, base_version=1, offset=0, xxh3=_h(b"good"))
        assert await _code(client.call(req, [b"evil"])) == ErrorCode.BAD_REQUEST
        # malformed: two payload frames for a write; max_versions that do not match the chunks
        assert await _code(client.call(req, [b"good", b"more"])) == ErrorCode.BAD_REQUEST
        assert await _code(client.call(p.DeleteChunksReq(chunks=[c], max_versions=[1, 2]))) == ErrorCode.BAD_REQUEST
        # a write over a committed copy this node does not have
        stale = write(p.ChunkId(8, 0, 0), b"z", version=4, base=3, offset=10)
        assert await _code(client.call(*stale)) == ErrorCode.STALE
        assert node.last("write") == LANE
        _, data = await client.call(p.ReadChunkReq(chunk=c, min_version=1, offset=0, length=100))
        assert bytes(data[0]) == b"committed"
    refusals = [r for r in caplog.records if "refusing" in r.getMessage()]
    assert len(refusals) == 3, [r.getMessage() for r in caplog.records]
    assert {r.threadName for r in refusals} == {LANE}


async def test_a_full_disk_is_answered_no_space_on_the_lane(tmp_path, nursery, ctx):
    n = _Node(tmp_path, capacity=40_000)
    await nursery.start(n.service.run)
    try:
        c, d = p.ChunkId(1, 0, 0), p.ChunkId(2, 0, 0)
        async with connect(ctx, n.config.listen, timeout=10) as client:
            await client.call(*write(c, b"1" * 30_000, replace=True))
            assert await _code(client.call(*write(d, b"2" * 20_000, replace=True))) == ErrorCode.NO_SPACE
            assert n.last("write") == LANE
            assert await _code(client.call(*write(c, b"3" * 50_000, version=2, base=1))) == ErrorCode.NO_SPACE
            assert await _code(client.call(p.StatChunkReq(chunk=d))) == ErrorCode.NOT_FOUND
            rsp, data = await client.call(p.ReadChunkReq(chunk=c, min_version=0, offset=0, length=1 << 20))
            assert rsp.version == 1 and bytes(data[0]) == b"1" * 30_000  # the stored copy is intact
    finally:
        n.store.close()


def test_access_rules_hold_on_the_lane(tmp_path):
    """``handle_now`` checks the sender's key as ``handle`` does: a read-only key writes and syncs
    nothing (READ_ONLY), a client key deletes nothing (ACCESS), a key no longer in the keyring
    gets nothing (ACCESS); the store is not touched."""
    n = _Node(tmp_path)
    try:
        keys = {name: zmq.curve_keypair()[0].decode() for name in ("ro", "rw", "gone")}
        ring = tmp_path / "keyring.toml"
        ring.write_text(f'[[key]]\nname = "ro"\npublic = "{keys["ro"]}"\nrole = "client"\nread_only = true\n'
                        f'[[key]]\nname = "rw"\npublic = "{keys["rw"]}"\nrole = "client"\n')
        n.service.keyring = Keyring(ring)
        c = p.ChunkId(9, 0, 0)
        cases = [
            ("ro", *write(c, b"data", replace=True), ErrorCode.READ_ONLY),
            ("ro", p.SyncChunksReq(chunks=[c]), [], ErrorCode.READ_ONLY),
            ("rw", p.DeleteChunksReq(chunks=[c]), [], ErrorCode.ACCESS),
            ("gone", *write(c, b"data", replace=True), ErrorCode.ACCESS),
            ("gone", p.StatChunkReq(chunk=c), [], ErrorCode.ACCESS),
        ]
        for who, body, payloads, code in cases:
            token = security.PEER.set(keys[who])
            try:
                reply = n.service.handle_now(body, [memoryview(x) for x in payloads])
            finally:
                security.PEER.reset(token)
            assert isinstance(reply, p.ErrorRsp) and reply.code == code, (who, body, reply)
        assert not n.threads  # refused before the store
        token = security.PEER.set(keys["rw"])
        try:
            reply = n.service.handle_now(*write(c, b"data", replace=True))
        finally:
            security.PEER.reset(token)
        assert isinstance(reply, p.WriteChunkRsp) and n.store.stat(c).version == 1
    finally:
        n.store.close()
