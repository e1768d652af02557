"""The FUSE reader thread's own cold loads (client/reader_loads.py), against real ZeroMQ "nodes".

Each node here is a ROUTER socket the test answers by hand (or leaves unanswered); the pool is a
small stand-in that records what ReaderLoads hands back to it (``loaded``, ``mark``, ``queue``),
using ThreadReads' own reply check. The device is a pipe: readable when the test writes to it.
"""

from __future__ import annotations

import itertools
import os
import threading
import time

import pytest
import xxhash
import zmq

from stripefs.client.reader_loads import ReaderLoads
from stripefs.client.thread_reads import Load, ThreadReads, decode_reply
from stripefs.common import protocol as p


class _Nodes:
    def __init__(self, addresses):
        self.addresses = addresses


class _Pool:
    """What ReaderLoads uses of ThreadReads; its reply check is ThreadReads' own."""

    decode = staticmethod(decode_reply)
    checked = ThreadReads.checked

    def __init__(self, ctx, addresses, *, hedge_after_s=60.0, read_timeout=60.0):
        self.ctx, self.nodes = ctx, _Nodes(addresses)
        self.hedge_after_s, self.read_timeout = hedge_after_s, read_timeout
        self.ids = itertools.count(1)
        self.closing = False
        self.done: list = []  # (load, bytes or None)
        self.marks: list = []  # (node ids, suspect?)
        self.queued: list = []

    def loaded(self, load, data):
        self.done.append((load, None if data is None else bytes(data)))

    def mark(self, node_ids, exc):
        self.marks.append((sorted(node_ids), exc is not None))

    def queue(self, load):
        self.queued.append((load, list(load.order)))


@pytest.fixture
def nodes(ctx):
    socks = []
    for _ in range(3):
        s = ctx.socket(zmq.ROUTER)
        s.linger = 0
        port = s.bind_to_random_port("tcp://127.0.0.1")
        socks.append((s, f"tcp://127.0.0.1:{port}"))
    yield socks
    for s, _ in socks:
        s.close()


def _load(order):
    req = p.ReadChunkReq(chunk=p.ChunkId(7, 0, 0), min_version=3, offset=0, length=1 << 20, cap=None)
    return Load((7, 0, 3), req, order)


def _request(node):
    """The next request a node got: (routing id, request id)."""
    assert node.poll(5000), "no request reached the node"
    ident, frame = node.recv_multipart()
    return ident, p.decode_request(frame)[0]


def _answer(node, ident, request_id, data=b"x" * 1000, good=True):
    rsp = p.ReadChunkRsp(version=3, xxh3=xxhash.xxh3_64_intdigest(data) ^ (0 if good else 1))
    node.send_multipart([ident, p.encode(request_id, rsp), data])


def _run_until(loads: ReaderLoads, pool: _Pool, done, timeout=5.0):
    end = time.monotonic() + timeout
    while not done() and time.monotonic() < end:
        assert loads.pending
        loads.wait()
    assert done()


@pytest.fixture
def device():
    r, w = os.pipe()
    yield r, w
    os.close(r)
    os.close(w)


def _started(pool, device, connected=()) -> ReaderLoads:
    """ReaderLoads on this thread, its sockets to ``connected`` made and given time to connect (a
    socket connects asynchronously, and IMMEDIATE refuses a send before it has: a worker's case)."""
    loads = ReaderLoads(pool)
    loads.begin(device[0], threading.get_ident())
    for node_id in connected:
        loads._socket(node_id)
    time.sleep(0.3)
    return loads


def test_a_load_is_sent_by_the_reader_and_answered_from_the_first_replica(ctx, nodes, device):
    # (a socket connects asynchronously: IMMEDIATE refuses a send before it is connected, which
    # goes to a worker; the second load finds the connection made)
    pool = _Pool(ctx, {1: nodes[0][1], 2: nodes[1][1]})
    loads = _started(pool, device, [1])
    try:
        assert loads.start(_load([1, 2]))
        ident, rid = _request(nodes[0][0])
        _answer(nodes[0][0], ident, rid)
        _run_until(loads, pool, lambda: pool.done)
        assert pool.done[0][1] == b"x" * 1000 and not pool.marks and not loads.pending
        # the device readable: wait() says so, and nothing else happened
        loads.start(_load([1, 2]))
        os.write(device[1], b"r")
        assert loads.wait() is True
    finally:
        loads.end()


def test_a_silent_replica_is_joined_by_the_next_and_marked_slow(ctx, nodes, device):
    pool = _Pool(ctx, {1: nodes[0][1], 2: nodes[1][1]}, hedge_after_s=0.05)
    loads = _started(pool, device, [1, 2])
    try:
        assert loads.start(_load([1, 2]))
        _request(nodes[0][0])  # never answered
        _run_until(loads, pool, lambda: nodes[1][0].poll(0))
        ident, rid = _request(nodes[1][0])
        _answer(nodes[1][0], ident, rid, b"y" * 10)
        _run_until(loads, pool, lambda: pool.done)
        assert pool.done == [(pool.done[0][0], b"y" * 10)]
        assert pool.marks == [([1], False)]  # note_slow, not suspect
    finally:
        loads.end()


def test_a_corrupt_copy_hands_the_other_replicas_to_a_worker(ctx, nodes, device):
    pool = _Pool(ctx, {1: nodes[0][1], 2: nodes[1][1], 3: nodes[2][1]})
    loads = _started(pool, device, [1])
    try:
        assert loads.start(_load([1, 2, 3]))
        ident, rid = _request(nodes[0][0])
        _answer(nodes[0][0], ident, rid, good=False)
        _run_until(loads, pool, lambda: pool.queued)
        assert pool.queued[0][1] == [2, 3] and not pool.done and not loads.pending
    finally:
        loads.end()


def test_no_answer_by_the_deadline_marks_the_replica_suspect_and_goes_to_trio(ctx, nodes, device):
    pool = _Pool(ctx, {1: nodes[0][1]}, read_timeout=0.2)
    loads = _started(pool, device, [1])
    try:
        assert loads.start(_load([1]))
        _run_until(loads, pool, lambda: pool.done)
        assert pool.done[0][1] is None and pool.marks == [([1], True)]
    finally:
        loads.end()


def test_what_is_under_way_at_the_end_goes_to_trio(ctx, nodes, device):
    pool = _Pool(ctx, {1: nodes[0][1]})
    loads = _started(pool, device, [1])
    assert loads.start(_load([1]))
    loads.end()
    assert [d for _, d in pool.done] == [None] and not loads.pending


def test_a_replica_with_no_live_connection_is_left_to_a_worker(ctx, device):
    gone = ctx.socket(zmq.ROUTER)
    port = gone.bind_to_random_port("tcp://127.0.0.1")
    gone.close(linger=0)  # nobody listens there now: a dead node
    pool = _Pool(ctx, {1: f"tcp://127.0.0.1:{port}"})
    loads = _started(pool, device, [1])
    try:
        assert not loads.start(_load([1]))  # (the caller queues it for a worker)
        assert not loads.pending
    finally:
        loads.end()


def test_waiting_without_the_device_answers_replies_and_ignores_it(ctx, nodes, device):
    """(the session's wait for room: the device readable must not end the wait early)"""
    pool = _Pool(ctx, {1: nodes[0][1]})
    loads = _started(pool, device, [1])
    try:
        os.write(device[1], b"r")
        assert loads.start(_load([1]))
        t = time.monotonic()
        assert loads.wait(device=False) is False  # nothing answered: a poll of the sockets only
        assert time.monotonic() - t >= 0.1 and not pool.done
        ident, rid = _request(nodes[0][0])
        _answer(nodes[0][0], ident, rid)
        while not pool.done:
            loads.wait(device=False)
        assert pool.done[0][1] == b"x" * 1000
    finally:
        loads.end()


def test_a_failure_while_waiting_hands_the_reads_to_trio_and_keeps_the_session(ctx, nodes, device):
    pool = _Pool(ctx, {1: nodes[0][1]})
    loads = _started(pool, device, [1])
    try:
        assert loads.start(_load([1]))

        def broken(*args):
            raise RuntimeError("a bug")

        loads._receive = broken
        ident, rid = _request(nodes[0][0])
        _answer(nodes[0][0], ident, rid)
        said = []
        while loads.pending:
            said.append(loads.wait())
        assert said[-1] is True  # the session goes on reading the device
        assert [d for _, d in pool.done] == [None]
    finally:
        loads.end()
