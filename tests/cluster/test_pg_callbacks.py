"""Directories held across two metadata daemons sharing one PostgreSQL database (``pg_cluster``).

A mount holding a directory through daemon 1 creates there asynchronously
(client/async_dirops.py); a change or a read of that directory through daemon 2
waits for it (daemon/shared_holds.py, docs/design.md "Callbacks across daemons"):

* the other mount sees every name made asynchronously as soon as it looks;
* a holder that is stopped delays another mount's change by the bound once,
  and loses its callbacks (a later change does not wait);
* a daemon killed while its session holds a directory delays the other
  daemon's changes there by ``SHARED_WAIT_S`` once, never more.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
from conftest import _wait_dead
from test_multi_meta import _both_up, _meta_pid
from test_ops import scrape, total

from stripefs.daemon.callbacks import WAIT_S
from stripefs.daemon.shared_holds import SHARED_WAIT_S
from stripefs.local_cluster import free_port

#: slack on the documented bounds for a busy shared 2-core machine
SLACK_S = 5.0


def _create(path) -> None:
    os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))


def _meta_logs(cluster) -> str:
    return "".join(text for name, text in cluster.logs().items() if name.startswith("meta"))


@pytest.fixture
def two(pg_cluster):
    """(mount through daemon 1 only, its metrics URL, its pid file name, mount through daemon 2 only)."""
    _both_up(pg_cluster)
    first, second = pg_cluster.local.meta_addresses
    port = free_port()
    m1 = pg_cluster.mount_again("held-via-1", f"metrics=127.0.0.1:{port}", meta=first)
    m2 = pg_cluster.mount_again("other-via-2", meta=second)
    try:
        yield m1, f"http://127.0.0.1:{port}/metrics", m2
    finally:
        for m in (m1, m2):
            pg_cluster.unmount(m)
            pg_cluster.extra_mounts.remove(m)


def _async_creates(url: str) -> float:
    return total(scrape(url), "stripefs_async_creates_total")


def test_names_made_asynchronously_through_one_daemon_are_seen_through_the_other(pg_cluster, two):
    m1, url, m2 = two
    d = m1 / "async-names"
    d.mkdir()  # made here: held whole by this mount (a row of dir_holds)
    before = _async_creates(url)
    names = [f"f{i:03d}" for i in range(200)]
    for name in names:
        _create(d / name)
    # right after: the listing through the other daemon recalls the holder, which sends its creates first
    assert sorted(os.listdir(m2 / "async-names")) == names
    (m1 / "async-names-2").mkdir()
    for name in names:
        _create(m1 / "async-names-2" / name)
    # a lookup through the other daemon of the last name made asynchronously (the newest: still unsent)
    assert os.path.exists(m2 / "async-names-2" / names[-1])
    assert sorted(os.listdir(m2 / "async-names-2")) == names
    assert _async_creates(url) - before >= len(names)  # answered by the mount (numbers delegated first)


def test_a_stopped_holder_delays_a_change_through_the_other_daemon_by_the_bound_once(pg_cluster, two):
    m1, url, m2 = two
    d = m1 / "stopped-holder"
    d.mkdir()
    _create(d / "mine")
    assert os.path.exists(m2 / "stopped-holder" / "mine")  # recalled: sent, and the directory let go
    os.listdir(d)  # held whole again (a listing of every name)
    pid = int((pg_cluster.state / "held-via-1.pid").read_text())
    os.kill(pid, signal.SIGSTOP)
    try:
        start = time.monotonic()
        _create(m2 / "stopped-holder" / "theirs")  # waits for the stopped mount's daemon to give up on it
        waited = time.monotonic() - start
        start = time.monotonic()
        _create(m2 / "stopped-holder" / "theirs-2")  # it holds nothing now: no wait
        again = time.monotonic() - start
    finally:
        os.kill(pid, signal.SIGCONT)
    assert WAIT_S - 0.5 < waited < SHARED_WAIT_S + SLACK_S, waited
    assert again < WAIT_S - 0.5, again
    assert "did not acknowledge change" in _meta_logs(pg_cluster)  # penalised on its own daemon
    deadline = time.monotonic() + 30
    while not os.path.exists(d / "theirs-2"):  # and it sees the change once it runs again
        assert time.monotonic() < deadline
        time.sleep(0.1)


def test_a_daemon_killed_while_holding_delays_the_other_daemons_changes_once(pg_cluster, two):
    m1, url, m2 = two
    pg_cluster.expect_log(r"did not let go", r"metadata daemon .* unreachable", r"ERROR")
    d = m1 / "dead-holder"
    d.mkdir()  # held by a session of daemon 1
    os.listdir(m2)  # daemon 2 knows the directory
    pid = _meta_pid(pg_cluster, 0)
    os.kill(pid, signal.SIGKILL)
    _wait_dead(pid)
    try:
        start = time.monotonic()
        _create(m2 / "dead-holder" / "a")  # the row of a dead daemon's session: waited for once
        waited = time.monotonic() - start
        start = time.monotonic()
        _create(m2 / "dead-holder" / "b")  # dropped after that wait: no wait now
        again = time.monotonic() - start
    finally:
        _both_up(pg_cluster)
    assert waited < SHARED_WAIT_S + SLACK_S, waited
    assert again < WAIT_S - 0.5, again
    assert "did not let go" in pg_cluster.logs()["meta-2.log"]
    assert sorted(os.listdir(m2 / "dead-holder")) == ["a", "b"]
