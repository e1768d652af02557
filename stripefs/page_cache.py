"""The machine's page cache, dentries and inodes: one lock for whoever drops them and whoever counts on them.

They are the machine's, not a process's: a ``drop_caches`` anywhere empties them for everyone. Tests that
assert what the kernel keeps (pages pushed into the page cache, names and attributes that spare a
request) hold this lock shared while they run (tests/util.py ``caches_kept``); whoever drops the caches
takes it exclusively first (``drop``): the tests' own ``drop_caches`` and every bench's cold cycle
(bench/common.py). Benches once wrote /proc/sys/vm/drop_caches without it, and on a machine shared with
test runs such a drop landed inside a warm test: tests/cluster/test_kernel_cache.py's pushed pages were
gone and each file sent one READ (a drop of pages only, ``1``, leaves exactly that mark: no LOOKUP, no
GETATTR, one READ a file). ``drops()`` counts every drop on the machine (/proc/vmstat), so a test can say
when one happened anyway (a program that knows nothing of this lock).

A bench does not wait forever: after ``wait_s`` it drops anyway and says so (a warm test may then fail).
"""

from __future__ import annotations

import fcntl
import os
import tempfile
import time
from contextlib import contextmanager
from typing import Callable, Iterator

#: the lock file, one for the machine (every checkout and test run: the caches it guards are the machine's)
LOCK_PATH = os.path.join(tempfile.gettempdir(), "stripefs-tests-page-cache.lock")

_fd: int | None = None


def lock_fd() -> int:
    """This process's descriptor of the lock file (opened once: flock locks belong to the open file)."""
    global _fd
    if _fd is None:
        _fd = os.open(LOCK_PATH, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
        try:
            os.chmod(LOCK_PATH, 0o666)  # other users' test runs take it too
        except OSError:
            pass
    return _fd


def write_drop(level: str = "3", sync: bool = True) -> None:
    """sync (unless not ``sync``), then drop the caches: ``3`` pages, dentries and inodes; ``1`` pages
    only; ``2`` dentries and inodes only. Raises OSError where the kernel does not take it (not root, a
    read-only /proc). The caller holds the lock exclusively (``drop``, or tests/util.py's ``drop_caches``)."""
    if sync:
        os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write(f"{level}\n")


@contextmanager
def held_exclusively(wait_s: float) -> Iterator[bool]:
    """The lock, exclusively, once no test keeps the caches, waiting at most ``wait_s``: yields whether
    it got it (False: a test kept them all that time)."""
    fd, deadline, locked = lock_fd(), time.monotonic() + wait_s, False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            locked = True
            break
        except BlockingIOError:
            if time.monotonic() >= deadline:
                break
            time.sleep(0.05)
    try:
        yield locked
    finally:
        if locked:
            fcntl.flock(fd, fcntl.LOCK_UN)


def drop(level: str = "3", wait_s: float = 60.0, note: Callable[[str], None] | None = None, sync: bool = True) -> None:
    """A bench's drop_caches: wait (at most ``wait_s``) until no test keeps the caches, then drop them.
    Raises OSError as ``write_drop``; ``note`` hears that it waited past ``wait_s`` and dropped anyway."""
    with held_exclusively(wait_s) as locked:
        if not locked and note is not None:
            note(f"a test kept the page cache for over {wait_s:.0f}s: dropping it anyway")
        write_drop(level, sync)


def drops() -> int:
    """How often anyone on this machine dropped its page cache or its dentries and inodes so far."""
    with open("/proc/vmstat") as f:
        return sum(int(line.split()[1]) for line in f if line.startswith(("drop_pagecache ", "drop_slab ")))
