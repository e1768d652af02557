"""What tests of both tiers share: free ports by the project's rule, cold caches, waiting for a condition.

``tests/`` is on the import path of every test (``pythonpath`` in pyproject.toml):
``from util import free_port, free_address, drop_caches, eventually``.
"""

from __future__ import annotations

import os
import time
from typing import Callable, TypeVar

import pytest
import trio

from stripefs.local_cluster import free_port

__all__ = ["free_port", "free_address", "drop_caches", "eventually", "eventually_async"]

T = TypeVar("T")


def free_address() -> str:
    """``tcp://127.0.0.1:PORT`` on a free port below the ephemeral range (stripefs.local_cluster.free_port:
    a client reconnecting to a stopped server there cannot be given that port and connect to itself)."""
    return f"tcp://127.0.0.1:{free_port()}"


def drop_caches() -> None:
    """Write dirty pages back (``sync``), then drop the page cache, dentries and inodes:
    the next read goes to the mount. Raises when the kernel does not take the write
    (not root, a read-only /proc), so that a "cold" test never runs warm unnoticed."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError as exc:
        raise AssertionError(f"cannot drop the kernel's caches, so this read would not be cold: {exc}") from exc


def eventually(check: Callable[[], T], within: float = 10.0, what: str = "condition", *, every: float = 0.05) -> T:
    """Poll ``check`` until it returns something truthy, and return that; fail the test after ``within`` seconds.
    Instead of a fixed sleep: as quick as the system is, and as patient as a loaded machine needs."""
    deadline = time.monotonic() + within
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {within:.1f}s")
        time.sleep(every)


async def eventually_async(check: Callable[[], T], within: float = 10.0, what: str = "condition", *, every: float = 0.05) -> T:
    """``eventually`` inside a trio test: sleeps with trio, so the services under test keep running."""
    deadline = time.monotonic() + within
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {within:.1f}s")
        await trio.sleep(every)
