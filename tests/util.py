"""What tests of every tier share: free ports by the project's rule, cold caches, waiting for a condition,
and what keeps pytest-xdist workers apart.

``tests/`` is on the import path of every test (``pythonpath`` in pyproject.toml):
``from util import free_port, free_address, drop_caches, eventually``.

Tiers run with pytest-xdist (the Makefile): several worker processes, each with its
own session fixtures (its own PostgreSQL server, rig or cluster). Two things they
share are kept apart here:

* ports: ``worker_ports()`` (each tier's ``pytest_configure`` calls ``configure``) gives every worker a
  range of its own in ``$STRIPEFS_LOCAL_PORTS``, which ``free_port`` and every
  ``stripefs local up`` the worker starts pick from, so two clusters starting at once
  cannot pick the same port;
* the kernel's page cache, dentries and inodes, which are the machine's: ``drop_caches()``
  waits for tests that need theirs kept (``caches_kept()``, the ``warm_caches`` mark) and
  they wait for it, across workers and test runs, and so do the benches' drops (the lock of
  stripefs/page_cache.py, a file in the temp dir).
"""

from __future__ import annotations

import fcntl
import os
import sys
import time
from contextlib import contextmanager
from typing import Callable, Iterator, TypeVar

import pytest
import trio

from stripefs import page_cache
from stripefs.local_cluster import PORTS_ENV, free_port, port_range

__all__ = ["free_port", "free_address", "drop_caches", "caches_kept", "cache_drops", "eventually", "eventually_async", "configure"]

T = TypeVar("T")


def free_address() -> str:
    """``tcp://127.0.0.1:PORT`` on a free port below the ephemeral range (stripefs.local_cluster.free_port:
    a client reconnecting to a stopped server there cannot be given that port and connect to itself)."""
    return f"tcp://127.0.0.1:{free_port()}"


def worker_ports() -> None:
    """Under pytest-xdist: this worker's slice of the port range, in ``$STRIPEFS_LOCAL_PORTS`` (inherited by
    the clusters it starts). Worker gwN of M takes the N-th of M equal slices of the range this run
    was given (by default 10000 up to the ephemeral range); nothing without xdist."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER", ""), os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if not (worker.startswith("gw") and count.isdigit()):
        return
    index, count = int(worker[2:]), int(count)
    low, high = port_range()
    size = (high - low) // count
    os.environ[PORTS_ENV] = f"{low + index * size}-{low + (index + 1) * size - 1}"


# -- the page cache ------------------------------------------------------------------------------

_kept = 0  # caches_kept() sections open in this process
_lock_fd = page_cache.lock_fd  # one lock for every test and bench process on the machine (stripefs/page_cache.py)


@contextmanager
def caches_kept() -> Iterator[None]:
    """While inside, no test process on this machine drops the kernel's caches (``drop_caches`` waits),
    nor does a bench (stripefs/page_cache.py ``drop``, for up to a minute): for a test that asserts
    what is in the page cache, or counts the requests a warm kernel spares. ``cache_drops()`` tells
    whether one happened anyway (a program that knows nothing of the lock)."""
    global _kept
    if _kept == 0:
        fcntl.flock(_lock_fd(), fcntl.LOCK_SH)
    _kept += 1
    try:
        yield
    finally:
        _kept -= 1
        if _kept == 0:
            fcntl.flock(_lock_fd(), fcntl.LOCK_UN)


def cache_drops() -> int:
    """Drops of the page cache or of dentries and inodes on this machine so far, by anyone (/proc/vmstat)."""
    return page_cache.drops()


def drop_caches() -> None:
    """Write dirty pages back (``sync``), then drop the page cache, dentries and inodes:
    the next read goes to the mount. Raises when the kernel does not take the write
    (not root, a read-only /proc), so that a "cold" test never runs warm unnoticed.

    Waits until no other test process keeps its caches (``caches_kept``); inside this process's
    own ``caches_kept`` it drops anyway (the test asked for it) and keeps them again after."""
    fd = _lock_fd()
    fcntl.flock(fd, fcntl.LOCK_EX)  # converts this process's shared lock, if it holds one
    try:
        try:
            page_cache.write_drop("3")
        except OSError as exc:
            raise AssertionError(f"cannot drop the kernel's caches, so this read would not be cold: {exc}") from exc
    finally:
        fcntl.flock(fd, fcntl.LOCK_SH if _kept else fcntl.LOCK_UN)


@pytest.fixture(autouse=True)
def _warm_caches(request):
    """Tests marked ``warm_caches`` run inside ``caches_kept()``."""
    if request.node.get_closest_marker("warm_caches") is None:
        yield
        return
    with caches_kept():
        yield


_groups_lost = ""  # why the tests of this worker fail (pytest_collection_modifyitems below)


@pytest.hookimpl(trylast=True)  # after pytest-xdist's own, which appends each test's group to its node id
def pytest_collection_modifyitems(config, items) -> None:
    """Under ``--dist loadgroup`` a test marked ``xdist_group`` whose node id does not name its group is
    scheduled on its own, and tests that must share a worker (a module's cluster, the PostgreSQL
    cluster's tests) would not: then every test fails, saying why (``_xdist_groups``). (Raising here,
    in a worker, reaches the terminal as an unrelated INTERNALERROR of pytest-xdist.)"""
    global _groups_lost
    if not config.getoption("loadgroup", False):  # set in pytest-xdist workers only
        return
    lost = [item.nodeid for item in items if item.get_closest_marker("xdist_group") and "@" not in item.nodeid]
    if lost:
        _groups_lost = (f"--dist loadgroup does not group tests with this pytest-xdist and pytest (pytest-xdist "
                        f"issue 1386: pyproject.toml keeps pytest below 9.2 for it): {lost[0]} has no group")


@pytest.fixture(autouse=True)
def _xdist_groups() -> None:
    if _groups_lost:
        pytest.fail(_groups_lost, pytrace=False)


def configure(config) -> None:
    """Each tier's ``pytest_configure``: this worker's ports, the ``warm_caches`` mark, and this module as a
    plugin (its ``_warm_caches`` fixture and its check of pytest-xdist's groups)."""
    worker_ports()
    config.addinivalue_line("markers", "warm_caches: the test needs the kernel's caches kept: other test processes' "
                            "drop_caches() waits until it ends (tests/util.py)")
    config.pluginmanager.register(sys.modules[__name__], "stripefs-tests-util")


# -- waiting -------------------------------------------------------------------------------------


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
