"""A request the daemon holds past the worker threads' timeout (client/thread_meta.py, "held").

A default mount's cold LOOKUP, asked on a worker thread, may legitimately wait at the daemon for a
recall (daemon/callbacks.py: ``WAIT_S``, longer while a writer commits). The thread used to give
up after its 2 s and hand the lookup to trio's path, which sent a second LookupReq: the daemon
logged a second change naming the file, waiting for the same holder, and the first answer was
thrown away. Here a plain ROUTER plays the daemon and holds a lookup past the threads' timeout:
it must receive it once and its late answer must be the one given, without keeping a worker
from the next request; a reply that never comes still ends in trio's path, once the trio
client's own wait for one request ran out, and so does a held request when the pool closes.
"""

from __future__ import annotations

import threading
import time
from contextlib import asynccontextmanager

import trio
import zmq

from stripefs.client.meta_rpc import MetaClient
from stripefs.client.thread_meta import ThreadMeta
from stripefs.common import protocol as P

ROOT = 1


class _Daemon:
    """A ROUTER answering PingReq at once (no read lane), a GetattrReq at once, and a LookupReq
    after ``hold`` seconds (None: never)."""

    def __init__(self, ctx: zmq.Context, hold: float | None):
        self.router = ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.address = f"tcp://127.0.0.1:{self.router.bind_to_random_port('tcp://127.0.0.1')}"
        self.hold = hold
        self.seen: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        held: list[tuple[float, list]] = []
        while not self._stop.is_set():
            now = time.monotonic()
            for due, reply in [h for h in held if h[0] <= now]:
                held.remove((due, reply))
                self.router.send_multipart(reply)
            if not self.router.poll(20):
                continue
            identity, header = self.router.recv_multipart()
            request_id, body = P.decode_request(header)
            if isinstance(body, P.PingReq):
                self.router.send_multipart([identity, P.encode(request_id, P.PingRsp(role="meta"))])
                continue
            self.seen.append(type(body).__name__)
            ino = 5 if isinstance(body, P.LookupReq) else body.ino
            reply = [identity, P.encode(request_id, P.AttrRsp(attr=P.Attr(ino=ino, mode=0o100644, nlink=1, uid=0, gid=0, rdev=0, size=0, atime_ns=0, mtime_ns=0, ctime_ns=0)))]
            if isinstance(body, P.GetattrReq):
                self.router.send_multipart(reply)
            elif self.hold is not None:
                held.append((now + self.hold, reply))

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.router.close()


class _Job:
    """One request's outcome: answered (the reply), failed (errno) or handed to trio's path (slow)."""

    def __init__(self):
        self.done = threading.Event()
        self.outcomes: list = []

    def answer(self, rsp):
        self.outcomes.append(("answer", rsp.attr.ino))
        self.done.set()

    def fail(self, err):
        self.outcomes.append(("fail", err))
        self.done.set()

    def slow(self):
        self.outcomes.append(("slow",))
        self.done.set()


def _ask(pool: ThreadMeta, request) -> _Job:
    job = _Job()
    submit = pool.lookup if isinstance(request, P.LookupReq) else pool.getattr
    assert submit(request, job.answer, job.fail, job.slow)
    return job


@asynccontextmanager
async def _pool(ctx, hold: float | None, trio_timeout: float):
    """A daemon holding each request ``hold`` seconds (None: never answering) and a pool asking it;
    both closed on the way out."""
    daemon = _Daemon(ctx, hold=hold)
    pool = ThreadMeta(ctx, MetaClient(ctx, [daemon.address], timeout=trio_timeout), timeout=0.3, missing=lambda *a: None)
    try:
        yield daemon, pool
    finally:
        await trio.to_thread.run_sync(pool.close)
        daemon.close()


async def test_a_lookup_held_past_the_threads_timeout_is_asked_once_and_its_late_answer_given(ctx):
    async with _pool(ctx, 1.0, 10.0) as (daemon, pool):  # held past the pool's 0.3 s, within the trio client's 10 s
        lookup = _ask(pool, P.LookupReq(parent=ROOT, name=b"f", callback=True))
        await trio.sleep(0.5)  # the lookup is held: a worker answers a getattr meanwhile
        getattr_job = _ask(pool, P.GetattrReq(ino=7))
        assert await trio.to_thread.run_sync(getattr_job.done.wait, 10.0)
        assert getattr_job.outcomes == [("answer", 7)]
        assert await trio.to_thread.run_sync(lookup.done.wait, 10.0)
        assert lookup.outcomes == [("answer", 5)]  # the held request's own answer, not trio's path
        assert daemon.seen.count("LookupReq") == 1, daemon.seen


async def test_a_held_request_with_no_answer_goes_to_trio_s_path_after_the_trio_client_s_wait(ctx):
    async with _pool(ctx, None, 1.0) as (daemon, pool):
        started = time.monotonic()
        lookup = _ask(pool, P.LookupReq(parent=ROOT, name=b"f", callback=True))
        assert await trio.to_thread.run_sync(lookup.done.wait, 30.0)  # (bounded loosely: a shared machine)
        assert lookup.outcomes == [("slow",)] and time.monotonic() - started >= 1.0
        assert daemon.seen == ["LookupReq"]


async def test_a_held_request_goes_to_trio_s_path_when_the_pool_closes(ctx):
    async with _pool(ctx, None, 60.0) as (daemon, pool):
        lookup = _ask(pool, P.LookupReq(parent=ROOT, name=b"f", callback=True))
        while not pool._late:  # held: its own thread waits for it
            await trio.sleep(0.05)
    # (the close was not 60 s: the held thread sees it)
    assert lookup.outcomes == [("slow",)]
