"""GETATTR and LOOKUP misses asked on plain threads: no trio task, no event-loop wake-up, per request.

A GETATTR the mount cannot answer from memory used to cross to trio (a task, the
handler's cancel scope, the MetaClient's RpcClient and its wake-up per reply)
before one GetattrReq (issue 30: 0.275 ms median at the client for a GetattrReq
round trip under trio, against 0.06-0.14 ms for a bare pyzmq one). Here the FUSE
reader thread decides (``Operations.thread_getattr``, under ``Operations.lock``)
and queues the request; one of a few worker threads asks the daemon with the
blocking client (client/meta_blocking.py: its own DEALER, the mount's keys,
session and request mapping) and answers the kernel itself.

Which GETATTRs: those whose trio handler would send nothing but the GetattrReq:
no creates answered here and not sent yet, no commit of closes that send
nothing pending, nothing in the write-back, the file not open here. The
answer is what the handler makes of the reply (``Operations._attr_out``), held
long only if no change of the inode was applied since the request was decided
(``KernelCache.changed_since`` from a stamp taken then): that check and the
answer to the kernel are made holding ``Operations.lock``, which every change
takes while it drops what the kernel may hold, so the answer either reaches the
kernel before the change's invalidation or is made knowing of it. A GetattrReq
carries no callback grant, so nothing is recorded on the trio side.

LOOKUP misses likewise (``Operations.thread_lookup``), those whose LookupReq asks
no open information: from a process that did not open what it looked up last
(``stat``, ``ls -l``, ``find``). The answer (``Operations.thread_entry_out``)
records what ``lookup`` records, under ``Operations.lock``, cached only if
neither the directory nor the file changed since the stamp; a default mount's
LookupReq asks a callback, and the grant its reply carries (a regular file's) is
recorded there as ``lookup`` records it (``Operations._lookup_held``): the grants
under ``Operations.lock``, which every change applied takes, and the
acknowledgement it may owe handed to trio (``to_trio``: it wakes trio's
flusher). The daemon's read lane leaves a grant to its trio side (it forwards
such a LookupReq to ``serve()``, which records the grant with the read:
daemon/read_lane.py). A name the daemon does not have is answered ENOENT here,
and what trio's ENOENT does beside it (``missing``: the directory's hint of the
name forgotten, client/dir_hints.py) is handed to trio; handing the lookup
itself back, as before, cost a default mount's stat of a missing name (an
import's path probes, a shell's PATH search) a second round trip through trio.
Without ``missing`` it is handed back.

Anything unusual goes to trio's path (``slow()``), which answers as before:
no daemon taking the request within the blocking client's timeout (trio's path
retries across a restart and moves to the next daemon), a queue that is too
far behind, the pool closing.

Held: a request sent but not answered within that timeout is not asked again.
The daemon may hold a lookup legitimately (a recall waits for a holder up to
``WAIT_S``, longer while a writer commits: daemon/callbacks.py); handing it to
trio's path sent a second LookupReq, which logged a second change naming the
file and waited for the same holder, the first answer thrown away. Its socket
leaves the worker (a ``Late``, client/meta_blocking.py) for a thread of its own
(``_wait_late``) that waits for the reply until trio's client would have given
up on one request (``MetaClient.timeout``, from the send) and answers it as the
worker would; no reply by then, the pool closing or the mount moving to another
daemon: trio's path. So the bound stays (no FUSE request waits forever on a
stuck lane or a dead daemon) and a held request keeps no worker from the next. An error the daemon answers (ENOENT, say) is
answered here with the errno trio's handler gives it.
"""

from __future__ import annotations

import logging
import errno
import queue
import threading
from typing import Callable

import trio
import zmq

from ..common import protocol as p
from ..common.errors import ErrorCode, StripefsError
from . import metrics, worker_threads
from .meta_blocking import BlockingMetaClient, Late

log = logging.getLogger(__name__)

#: worker threads (each with its own DEALER to the daemon)
WORKERS = 2
#: requests queued beyond this go to trio's path instead
MAX_QUEUED = 256
#: how long a worker waits for the daemon before trio's path takes the request (it retries there)
TIMEOUT_S = 2.0

_RETRYABLE = (ErrorCode.TIMEOUT, ErrorCode.UNAVAILABLE)


class ThreadMeta:
    """The worker threads, their queue and their blocking client (module docstring)."""

    def __init__(self, ctx: zmq.Context, meta, *, workers: int = WORKERS, timeout: float = TIMEOUT_S,
                 missing: Callable[[int, bytes], None] | None = None):
        self.client = BlockingMetaClient(ctx, meta, timeout=timeout)
        self.missing = missing  # (trio thread) what a LOOKUP's NOT_FOUND does beside the ENOENT (module docstring)
        self._token = trio.lowlevel.current_trio_token()  # made on the trio thread (client/mount.py)
        self._queue: queue.SimpleQueue[tuple | None] = queue.SimpleQueue()
        self._closing = False
        self._lock = threading.Lock()
        self._late: set[threading.Thread] = set()  # the threads waiting for held requests (_wait_late)
        self._counts = {p.GetattrReq: (metrics.THREAD_META.labels("served"), metrics.THREAD_META.labels("handed_back")),
                        p.LookupReq: (metrics.THREAD_META.labels("lookup_served"),
                                      metrics.THREAD_META.labels("lookup_handed_back"))}
        self._threads = worker_threads.start(self._work, "thread-meta", workers)

    def getattr(self, request: p.GetattrReq, answer: Callable[[p.AttrRsp], None], fail: Callable[[int], None],
                slow: Callable[[], None]) -> bool:
        """(reader thread) Queue ``request``; a worker then calls ``answer(reply)``, ``fail(errno)`` or
        ``slow()``. False: not taken (trio's path, now)."""
        return self._put(request, answer, fail, slow)

    def lookup(self, request: p.LookupReq, answer: Callable[[p.AttrRsp], None], fail: Callable[[int], None],
               slow: Callable[[], None]) -> bool:
        """(reader thread) As ``getattr``, for a LookupReq with no ``open_info`` (module docstring): a
        NOT_FOUND is answered ENOENT when ``missing`` is set (else it goes to ``slow()``, as does a
        reply that is not an AttrRsp, or one with a grant that was not asked)."""
        assert not request.open_info, request
        return self._put(request, answer, fail, slow)

    def to_trio(self, fn: Callable, *args) -> None:
        """(a worker thread) ``fn(*args)`` on the trio thread, soon (an exception logged there); nothing
        once trio's run is over (the mount is closing: what it owed ends with its session)."""
        try:
            self._token.run_sync_soon(worker_threads.logged_callback, fn, *args)
        except trio.RunFinishedError:
            pass

    def _put(self, request, answer, fail, slow) -> bool:
        if self._closing or self._queue.qsize() >= MAX_QUEUED:
            return False
        self._queue.put((request, answer, fail, slow))
        return True

    def close(self) -> None:
        """Stop the workers (what is queued or held goes to trio's path) and close their sockets."""
        with self._lock:
            self._closing = True
        worker_threads.stop(self._queue, self._threads)
        with self._lock:
            held = list(self._late)
        for thread in held:  # each sees _closing within 0.1 s and closes its own socket
            thread.join(worker_threads.STOP_WAIT_S)
        self.client.close()

    def _work(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            request = job[0]
            if self._closing:
                self._counts[type(request)][1].inc()
                job[3]()  # slow()
                continue
            try:
                reply = self.client.call(request, detach=True)
            except Exception as exc:  # noqa: BLE001 - answered by _finish as the call's outcome
                self._finish(job, exc)
                continue
            if isinstance(reply, Late):  # held at the daemon past TIMEOUT_S: waited for on a thread of its own
                self._wait_late(reply, job)
            else:
                self._finish(job, reply)

    def _wait_late(self, late: Late, job: tuple) -> None:
        """The request's reply, waited for without a worker (module docstring: "held"), until the
        trio client's own wait for one request (``MetaClient.timeout``) since the send; cut short
        by close() or the mount moving to another daemon (trio's path then asks that one)."""
        meta = self.client.meta
        daemon = meta.current_address
        seconds = max(getattr(meta, "timeout", 0.0), self.client.timeout)
        metrics.THREAD_META.labels("held").inc()

        def wait() -> None:
            try:
                reply = late.wait(seconds, lambda: self._closing or meta.current_address != daemon)
            except Exception as exc:  # noqa: BLE001 - answered by _finish as the call's outcome
                reply = exc
            finally:
                with self._lock:
                    self._late.discard(thread)
            self._finish(job, reply)

        thread = threading.Thread(target=wait, name="thread-meta-held", daemon=True)
        with self._lock:
            closing = self._closing  # (close() joins only the threads it finds in _late)
            if not closing:
                self._late.add(thread)
        if closing:
            late.line.sock.close(linger=0)
            self._finish(job, StripefsError(ErrorCode.UNAVAILABLE, "the mount is closing"))
        else:
            thread.start()

    def _finish(self, job: tuple, reply) -> None:
        """Answer ``job`` from its call's outcome ``reply`` (an exception: what the call raised)."""
        request, answer, fail, slow = job
        served, handed_back = self._counts[type(request)]
        if isinstance(reply, StripefsError):
            exc = reply
            missing = exc.code == ErrorCode.NOT_FOUND and type(request) is p.LookupReq
            if exc.code in _RETRYABLE or (missing and self.missing is None):
                log.debug("thread %s: %s; trio's path answers", _what(request), exc.message)
                handed_back.inc()
                slow()
            else:
                if missing:
                    self.to_trio(self.missing, request.parent, request.name)
                served.inc()
                fail(exc.errno)
            return
        if isinstance(reply, BaseException):  # a bug: logged, trio's path answers
            log.error("a thread %s failed", _what(request), exc_info=reply)
            handed_back.inc()
            slow()
            return
        if type(reply) is not p.AttrRsp or (type(request) is p.LookupReq and reply.callback >= 0 and not request.callback):
            log.warning("thread %s: unexpected %s; trio's path answers", _what(request), type(reply).__name__)
            handed_back.inc()
            slow()
            return
        try:
            answer(reply)
            served.inc()
        except Exception:  # noqa: BLE001 - a bug: logged; the request is answered EIO if it was not
            log.exception("answering a thread %s failed", _what(request))
            fail(errno.EIO)


def _what(request) -> str:
    """A request as its log lines name it (made only when one is written: not per request)."""
    subject = f"of inode {request.ino}" if type(request) is p.GetattrReq else f"of {request.name!r} in {request.parent}"
    return f"{type(request).__name__} {subject}"
