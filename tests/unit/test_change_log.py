"""The change log (daemon/change_log.py): numbered in commit order, published by every daemon's feed.

Two connections to one SQLite file stand for two daemons sharing a database:
a change committed through "daemon A" reaches a mount following "daemon B"'s
real feed (a ZeroMQ PUB socket) and the mount's real follower
(client/kernel_cache.py); only the final calls into the FUSE session are recorded instead.
"""

import sqlite3

import pytest
import trio
import zmq

from stripefs.client import kernel_cache as kc
from stripefs.common import protocol as P
from stripefs.daemon import change_log
from stripefs.daemon.db import open_database
from stripefs.daemon.events import ChangeFeed
from test_kernel_cache import follow_until_heard
from stripefs.daemon.pg_store import open_pg_store
from stripefs.daemon.store import SqliteStore

LAYOUT = P.Layout(1 << 20, 1, "replicas=1")


@pytest.fixture
def two(tmp_path):
    """Two stores (two "daemons") over one database file."""
    a = SqliteStore(open_database(tmp_path / "meta.sqlite3", LAYOUT))
    b = SqliteStore(open_database(tmp_path / "meta.sqlite3", LAYOUT))
    yield a, b
    a.close()
    b.close()


def test_numbers_follow_commits_without_holes(two):
    a, b = two
    a.begin()
    assert a.log_change(1, change_log.encode([5], [(1, b"x")])) == 1
    a.commit()
    assert a.log_change(2, change_log.encode([6], [])) == 2
    a.rollback()  # the change failed: its number is given back
    a.begin()
    assert a.log_change(3, change_log.encode([7], [])) == 2
    with pytest.raises(sqlite3.OperationalError):  # a second writer waits for the first (here: refused at once)
        b.conn.execute("PRAGMA busy_timeout=0")
        b.log_change(4, change_log.encode([8], []))
    a.commit()
    a.rollback()
    rows = b.changes_after(0, 10)
    assert [seq for seq, _ in rows] == [1, 2]
    assert change_log.decode(rows[0][1]) == ([5], [(1, b"x")]) and change_log.decode(rows[1][1]) == ([7], [])
    assert b.log_change(4, change_log.encode([8], [])) == 3  # now b may write: after a's
    assert b.changes_after(2, 10)[0][0] == 3


def test_the_log_is_trimmed_to_its_newest_rows(two):
    a, _ = two
    for i in range(10):
        a.log_change(i, change_log.encode([i], []))
    assert a.trim_change_log(keep=4) == 6
    assert [seq for seq, _ in a.changes_after(0, 100)] == [7, 8, 9, 10]
    assert a.last_change_seq() == 10


@pytest.fixture(params=["sqlite", "postgresql"])
def two_daemons(tmp_path, request):
    """Two stores over one database, each writing as its daemon does: ``write(store, fn)``."""
    if request.param == "sqlite":
        stores = [SqliteStore(open_database(tmp_path / "meta.sqlite3", LAYOUT)) for _ in range(2)]

        def write(store, fn):
            store.begin()
            fn()
            store.commit()
            store.rollback()
    else:
        dsn = request.getfixturevalue("pg_dsn")
        stores = [open_pg_store(dsn, LAYOUT, pool_size=2) for _ in range(2)]

        def write(store, fn):
            store.run(fn)
    yield stores, write
    for s in stores:
        s.close()


async def test_a_change_made_through_one_daemon_reaches_a_mount_following_the_other(two_daemons, monkeypatch):
    (a, b), write = two_daemons
    calls = []
    monkeypatch.setattr(kc, "_invalidate", lambda inodes, names, lock: calls.append((sorted(inodes), list(names))))
    ctx = zmq.Context()
    log_id = b.get_meta("change_log_id")
    feed_b = ChangeFeed(ctx, "tcp://127.0.0.1:0", log_id, b.last_change_seq())
    cache = kc.KernelCache()
    cache.remember(1, b"x", 7)
    cache.remember(1, b"y", 8)

    try:
        async with trio.open_nursery() as nursery:
            with trio.fail_after(10):
                await follow_until_heard(nursery, cache, ctx, feed_b, log_id)
                published = []

                def rename():  # "daemon A" renames x to y: one transaction, the change logged in it
                    a.log_change(0, change_log.encode([1], [(1, b"x"), (1, b"y")]))
                    published.append(feed_b.publish_new(b))  # not committed yet: nothing to publish

                write(a, rename)
                assert published == [0]
                if not b.group_commit:  # a shared database: B's poll loop numbers the log first
                    assert feed_b.publish_new(b) == 0 and b.run(b.number_changes, change_log.PAGE) == 1
                assert feed_b.publish_new(b) == 1  # what B's poll loop does
                while not calls:
                    await trio.sleep(0.01)
                assert [(inodes, sorted(names)) for inodes, names in calls] == [([1], [(1, b"x"), (1, b"y")])]
                assert cache.drops == 0 and cache.healthy
                assert cache.lookup_known(1, b"x") is None and cache.lookup_known(1, b"y") is None
            nursery.cancel_scope.cancel()
    finally:
        feed_b.close()
        ctx.term()


def test_a_shared_log_is_numbered_in_commit_order_after_the_commits(pg_dsn):
    """PostgreSQL: writers insert unnumbered rows (no counter to fight over); the sequencer
    numbers what has committed. A row inserted first but committed last is numbered last."""
    import threading

    a, b = (open_pg_store(pg_dsn, LAYOUT, pool_size=2) for _ in range(2))
    inserted, release = threading.Event(), threading.Event()

    def slow_writer():
        def op():
            a.log_change(1, change_log.encode([1], []))
            inserted.set()
            release.wait(10)  # still uncommitted while the others commit and get numbered
        a.run(op)

    try:
        t = threading.Thread(target=slow_writer)
        t.start()
        assert inserted.wait(10)
        assert not b.run(b.feed_behind, 0, readonly=True, hooks=False)  # the idle feed's probe: nothing committed yet
        b.run(b.log_change, 2, change_log.encode([2], []))
        assert b.run(b.feed_behind, 0, readonly=True, hooks=False)  # a row to number
        assert b.run(b.number_changes, 100) == 1  # only the committed row
        assert b.run(b.feed_behind, 0, readonly=True) and not b.run(b.feed_behind, 1, readonly=True)  # seq 1 published: idle
        assert [change_log.decode(e)[0] for _, e in b.changes_after(0, 10)] == [[2]]
        release.set()
        t.join(10)
        assert a.run(a.number_changes, 100) == 1 and a.run(a.number_changes, 100) == 0
        rows = a.changes_after(0, 10)
        assert [seq for seq, _ in rows] == [1, 2] and [change_log.decode(e)[0] for _, e in rows] == [[2], [1]]
        assert a.trim_change_log(keep=1) == 1 and [seq for seq, _ in a.changes_after(0, 10)] == [2]
    finally:
        release.set()
        a.close()
        b.close()


def test_a_row_names_its_writer_and_rows_without_one_still_decode():
    from stripefs.common.protocol import writer_tag

    tag = writer_tag(12345)
    assert tag and tag != 12345 and writer_tag(0) == 0  # the feed never tells the client id itself
    assert change_log.decode_writer(change_log.encode([3, 1], [(1, b"x")], tag)) == ([1, 3], [(1, b"x")], tag)
    assert change_log.decode(change_log.encode([3], [], tag)) == ([3], [])
    assert change_log.decode_writer(change_log.encode([3], [])) == ([3], [], 0)  # as written before writers


def test_the_plain_feed_sends_each_rows_lists_as_stored_the_same_frames_as_encoded_anew(monkeypatch):
    """The plain feed builds each event from its row's msgpack lists as stored
    (``protocol.encode_event_raw``): the same bytes as ``encode_event`` of the decoded row, with a
    writer and without, empty lists, large numbers and any bytes in a name; no row decoded into
    lists (an rm -rf publishes one row per unlink)."""
    rows = [(5, change_log.encode([7, 2], [(2, b"a")], 12345)), (6, change_log.encode([], [])),
            (7, change_log.encode([2**63 - 1, 1], [(1, bytes(range(256))), (2**40, b"")], 2**64 - 1))]
    expected = [P.encode_event(P.ChangeEvent("log-1", seq, *change_log.decode_writer(blob)[:2], "boot-9",
                                             change_log.decode_writer(blob)[2])) for seq, blob in rows]
    monkeypatch.setattr(change_log, "decode_writer", lambda blob: pytest.fail("the row's lists decoded"))
    ctx = zmq.Context()
    feed = ChangeFeed(ctx, "tcp://127.0.0.1:0", "log-1", 4, daemon="boot-9")
    sub = ctx.socket(zmq.SUB)
    try:
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(f"tcp://127.0.0.1:{feed.port}")
        for _ in range(100):  # until the subscription is in place (PUB drops before it)
            feed.seq = 4
            feed.publish(rows)
            if sub.poll(100):
                break
        while sub.poll(100):  # what the tries left
            sub.recv()
        feed.seq = 4
        feed.publish(rows)
        heard = [sub.recv() for _ in rows]
        assert heard == expected and feed.seq == 7
        assert [P.decode_event(f).seq for f in heard] == [5, 6, 7]
    finally:
        sub.close(linger=0)
        feed.close()
        ctx.term()
