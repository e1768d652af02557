"""The mount's pools of plain worker threads, each fed from a queue of jobs (client/thread_reads.py,
client/thread_meta.py): how they start and how they stop.

A pool's workers take jobs until they take ``None``; ``stop`` queues one ``None`` per worker and waits for
them. What is still queued behind is the pool's to hand back (to trio's path) before it stops them.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Callable

from ..common.thread_names import name_os_thread

log = logging.getLogger(__name__)

#: how long ``stop`` waits for each worker (one in a network wait finishes it first: its own timeout)
STOP_WAIT_S = 10.0


def logged_callback(fn, *args) -> None:
    """(trio thread) ``fn(*args)`` for a worker's ``run_sync_soon``, an exception logged: one raised
    by a run_sync_soon callback would end trio's run, and the mount with it."""
    try:
        fn(*args)
    except Exception:  # noqa: BLE001 - a bug: logged loudly, the mount goes on
        log.exception("a worker thread's callback on the trio thread failed")


def start(work: Callable[[], None], name: str, count: int) -> list[threading.Thread]:
    """``count`` daemon threads running ``work``, named ``name-0``, ``name-1``..., started."""
    threads = [threading.Thread(target=_named, args=(work,), name=f"{name}-{i}", daemon=True) for i in range(count)]
    for t in threads:
        t.start()
    return threads


def _named(work: Callable[[], None]) -> None:
    name_os_thread()  # per-thread CPU figures tell the pools apart (common/thread_names.py)
    work()


def stop(jobs: queue.SimpleQueue, threads: list[threading.Thread]) -> None:
    """Tell every worker to stop (a ``None`` job each) and wait for them; one still running after
    ``STOP_WAIT_S`` is logged (daemon threads: it does not hold the process up)."""
    for _ in threads:
        jobs.put(None)
    for t in threads:
        t.join(STOP_WAIT_S)
        if t.is_alive():
            log.warning("%s did not stop within %.0f s", t.name, STOP_WAIT_S)
