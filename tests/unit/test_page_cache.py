"""stripefs/page_cache.py: a bench's drop_caches waits for the tests that keep the machine's caches.

No cache is dropped here (that would disturb every warm test on the machine), and the lock is a file of
this test's own (the machine's may be held by test runs beside this one): what is checked is the lock a
drop takes first, against a holder on another open file (as another process's ``caches_kept``)."""

import fcntl
import os

import pytest
from util import caches_kept

from stripefs import page_cache


@pytest.fixture
def other_test(tmp_path, monkeypatch):
    """Another test process's hold of the lock: its own open file of the lock file."""
    monkeypatch.setattr(page_cache, "LOCK_PATH", str(tmp_path / "page-cache.lock"))
    monkeypatch.setattr(page_cache, "_fd", None)  # this process's descriptor: of that file
    fd = os.open(page_cache.LOCK_PATH, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
    yield fd
    os.close(fd)
    if page_cache._fd is not None:
        os.close(page_cache._fd)


def test_a_drop_does_not_get_the_lock_while_a_test_keeps_the_caches(other_test):
    fcntl.flock(other_test, fcntl.LOCK_SH)  # a warm test's caches_kept()
    with page_cache.held_exclusively(0.2) as locked:
        assert not locked
    fcntl.flock(other_test, fcntl.LOCK_UN)  # the test ended: the drop may go
    with page_cache.held_exclusively(30) as locked:
        assert locked
        with pytest.raises(BlockingIOError):  # and no test starts keeping the caches while it drops them
            fcntl.flock(other_test, fcntl.LOCK_SH | fcntl.LOCK_NB)


def test_caches_kept_holds_the_lock_a_drop_takes(other_test):
    """tests/util.py's caches_kept and the benches' drops use one lock (one file, stripefs/page_cache.py)."""
    with caches_kept():
        with pytest.raises(BlockingIOError):
            fcntl.flock(other_test, fcntl.LOCK_EX | fcntl.LOCK_NB)
    fcntl.flock(other_test, fcntl.LOCK_EX | fcntl.LOCK_NB)
    fcntl.flock(other_test, fcntl.LOCK_UN)


def test_a_drop_that_waited_too_long_drops_anyway_and_says_so(other_test, monkeypatch):
    dropped, notes = [], []
    monkeypatch.setattr(page_cache, "write_drop", lambda level, sync=True: dropped.append(level))
    fcntl.flock(other_test, fcntl.LOCK_SH)
    page_cache.drop("1", wait_s=0.1, note=notes.append)
    assert dropped == ["1"] and len(notes) == 1 and "anyway" in notes[0]
    fcntl.flock(other_test, fcntl.LOCK_UN)
    page_cache.drop("3", wait_s=5, note=notes.append)
    assert dropped == ["1", "3"] and len(notes) == 1
