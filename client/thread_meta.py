"""GETATTR misses asked on plain threads: no trio task, no event-loop wake-up, per request.

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

Anything unusual goes to trio's path (``slow()``), which answers as before:
no answer within the blocking client's timeout or no daemon (trio's path
retries across a restart and moves to the next daemon), a queue that is too
far behind, the pool closing. An error the daemon answers (ENOENT, say) is
answered here with the errno trio's handler gives it.
"""

from __future__ import annotations

import logging
import queue
import errno
from typing import Callable

import zmq

from ..common import protocol as p
from ..common.errors import ErrorCode, StripefsError
from . import metrics, worker_threads
from .meta_blocking import BlockingMetaClient

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

    def __init__(self, ctx: zmq.Context, meta, *, workers: int = WORKERS, timeout: float = TIMEOUT_S):
        self.client = BlockingMetaClient(ctx, meta, timeout=timeout)
        self._queue: queue.SimpleQueue[tuple | None] = queue.SimpleQueue()
        self._closing = False
        self._served = metrics.THREAD_META.labels("served")
        self._handed_back = metrics.THREAD_META.labels("handed_back")
        self._threads = worker_threads.start(self._work, "thread-meta", workers)

    def getattr(self, request: p.GetattrReq, answer: Callable[[p.AttrRsp], None], fail: Callable[[int], None],
                slow: Callable[[], None]) -> bool:
        """(reader thread) Queue ``request``; a worker then calls ``answer(reply)``, ``fail(errno)`` or
        ``slow()``. False: not taken (trio's path, now)."""
        if self._closing or self._queue.qsize() >= MAX_QUEUED:
            return False
        self._queue.put((request, answer, fail, slow))
        return True

    def close(self) -> None:
        """Stop the workers (what is queued goes to trio's path) and close their sockets."""
        self._closing = True
        worker_threads.stop(self._queue, self._threads)
        self.client.close()

    def _work(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            request, answer, fail, slow = job
            if self._closing:
                self._handed_back.inc()
                slow()
                continue
            try:
                reply = self.client.call(request)
            except StripefsError as exc:
                if exc.code in _RETRYABLE:
                    log.debug("thread getattr of inode %d: %s; trio's path retries", request.ino, exc.message)
                    self._handed_back.inc()
                    slow()
                else:
                    self._served.inc()
                    fail(exc.errno)
                continue
            except Exception:  # noqa: BLE001 - a bug: logged, trio's path answers
                log.exception("a thread getattr of inode %d failed", request.ino)
                self._handed_back.inc()
                slow()
                continue
            try:
                answer(reply)
                self._served.inc()
            except Exception:  # noqa: BLE001 - a bug: logged; the request is answered EIO if it was not
                log.exception("answering a thread getattr of inode %d failed", request.ino)
                fail(errno.EIO)
