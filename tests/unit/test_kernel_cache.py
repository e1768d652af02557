"""KernelCache: which replies may be cached long, and how the change feed is followed.

The feed side runs the daemon's real ChangeFeed (a ZeroMQ PUB socket) against
the mount's real follower; only the final calls into the FUSE session (which need a live
FUSE session) are replaced by a recorder.
"""

import os
import threading

import pytest
import trio
import trio.testing
import zmq

from stripefs.client import kernel_cache as kc
from stripefs.client.no_open_primer import NoOpenPrimer
from stripefs.common import protocol as P
from stripefs.daemon import change_log
from stripefs.daemon.db import open_database
from stripefs.daemon.events import ChangeFeed
from stripefs.daemon.store import SqliteStore


def _logged_feed(ctx, tmp_path):
    """A real feed over a real change log; ``changed`` commits one change and publishes it."""
    store = SqliteStore(open_database(tmp_path / "meta.sqlite3", P.Layout(1 << 20, 1, "replicas=1")))
    store.begin()
    feed = ChangeFeed(ctx, "tcp://127.0.0.1:0", "log-1", store.last_change_seq())

    def changed(inodes, entries):
        store.log_change(0, change_log.encode(inodes, entries))
        store.commit()
        feed.publish_new(store)

    return feed, store, changed


def _acking_cache() -> tuple[kc.KernelCache, list[int]]:
    """A cache of mount 77 whose acknowledgements are recorded: (the cache, the acknowledged seqs)."""
    acks: list[int] = []

    async def send_ack(seq, everything, opened):
        acks.append(seq)

    cache = kc.KernelCache()
    cache.send_ack, cache.own_writer = send_ack, 77
    return cache, acks


def test_names_are_remembered_and_forgotten():
    cache = kc.KernelCache()
    cache.remember(1, b"a", 10)
    cache.remember(1, b"b", 10)  # a hard link
    cache.remember(2, b"c", 11)
    assert cache.knows(10) and cache.lookup_known(1, b"b") == 10
    cache.forget(10)
    assert not cache.knows(10) and cache.lookup_known(1, b"a") is None
    assert cache.lookup_known(2, b"c") == 11


async def test_a_name_the_kernel_forgot_is_kept_while_the_mount_holds_it(monkeypatch):
    """After FORGET (drop_caches, memory pressure) a held name still answers a LOOKUP from memory
    (``lookup_kept``); not once its grant, the file's or the directory's, ended, an event named it,
    this mount removed it, or the feed dropped everything."""
    monkeypatch.setattr(kc, "_invalidate", lambda inodes, names, lock: None)
    cache = kc.KernelCache()
    cache.own_writer = 77

    async def send_ack(seq, everything, opened):
        pass

    cache.send_ack = send_ack
    for ino in (10, 11, 12, 13, 14):
        cache.remember(1, b"f%d" % ino, ino)
        cache.granted(ino, 1, b"f%d" % ino, seq=5)
    cache.remember(2, b"loose", 20)  # looked up, never held
    for ino in (10, 11, 12, 13, 14, 20):
        cache.forget(ino)
    assert [cache.lookup_kept(1, b"f%d" % ino) for ino in (10, 11, 12, 13, 14)] == [10, 11, 12, 13, 14]
    assert cache.lookup_known(1, b"f10") is None and cache.lookup_kept(2, b"loose") is None

    cache.apply([11], [], seq=6, writer=99)  # another mount changed f11: its grant ends
    cache.apply([], [(1, b"f12")], seq=7, writer=99)  # and renamed f12 away
    cache.name_gone(1, b"f13")  # this mount unlinked f13
    cache.apply([], [(1, b"f14")], seq=8, writer=77)  # the feed's event of this mount's own create of f14
    assert [cache.lookup_kept(1, b"f%d" % ino) for ino in (10, 11, 12, 13, 14)] == [10, None, None, None, 14]
    cache.remember(1, b"f10", 10)  # answered again: the kernel knows it
    assert cache.lookup_known(1, b"f10") == 10 and cache.lookup_kept(1, b"f10") is None
    await cache.drop_all("test")
    assert cache.lookup_kept(1, b"f14") is None


async def test_a_reply_that_raced_a_change_is_not_cached_long(monkeypatch):
    calls = []
    monkeypatch.setattr(kc, "_invalidate", lambda inodes, names, lock: calls.append((sorted(inodes), names)))
    changed = []
    cache = kc.KernelCache(on_change=changed.append)
    cache.remember(1, b"f", 5)
    before = cache.stamp()
    cache.apply([5], [(1, b"f")])
    assert cache.changed_since(before, 5) and not calls  # noted at once, sent by the flusher
    await cache.flush_pending()
    assert cache.changed_since(before, 5) and cache.changed_since(before, 1)  # the parent's entries changed too
    assert not cache.changed_since(before, 6)
    assert not cache.changed_since(cache.stamp(), 5)
    assert calls == [([5], [(1, b"f")])] and changed == [{5}]
    assert cache.lookup_known(1, b"f") is None  # the kernel was told to drop the name

    await cache.drop_all("test")
    assert changed[-1] is None
    assert cache.changed_since(before, 999)  # after a full drop nothing older may be trusted


async def test_a_flush_returns_only_once_the_flushers_invalidations_in_flight_are_sent(monkeypatch):
    """A caller that needs the kernel told now (``flush_pending``) while the flusher's own hop to the
    kernel is under way waits for it: it found nothing queued, but the names it wants dropped are in
    that hop (an in-process test saw the refused rename's names not dropped yet)."""
    sent, release = [], threading.Event()

    def slow(inodes, names, lock):
        release.wait(10)
        sent.extend(names)

    monkeypatch.setattr(kc, "_invalidate", slow)
    cache = kc.KernelCache()
    cache.drop_name(1, b"f")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(cache.flush_pending)  # the flusher's: takes the name, then waits in its thread
        await trio.testing.wait_all_tasks_blocked()
        flushed = trio.Event()

        async def caller():
            await cache.flush_pending()
            flushed.set()

        nursery.start_soon(caller)
        await trio.sleep(0.2)
        assert not flushed.is_set() and sent == []  # nothing queued, but the hop in flight is not done
        release.set()
        await flushed.wait()
        assert sent == [(1, b"f")]


async def test_follower_applies_in_order_and_drops_everything_on_a_gap(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(kc, "_invalidate", lambda inodes, names, lock: calls.append((sorted(inodes), list(names))))
    ctx = zmq.Context()
    feed, store, changed = _logged_feed(ctx, tmp_path)
    cache = kc.KernelCache()
    cache.remember(1, b"x", 7)
    try:
        async with trio.open_nursery() as nursery:
            with trio.fail_after(10):
                await follow_until_heard(nursery, cache, ctx, feed, "log-1")
                assert cache.healthy
                changed([7], [(1, b"x")])
                while not calls:
                    await trio.sleep(0.01)
                assert calls == [([7], [(1, b"x")])] and cache.drops == 0

                cache.remember(1, b"y", 8)
                for _ in range(5):  # five changes this mount never saw (as if PUB dropped them)
                    store.log_change(0, change_log.encode([3], []))
                store.commit()
                feed.seq += 5
                changed([3], [])
                while len(calls) < 2:  # the drop counts at once; its invalidations go out from a worker thread
                    await trio.sleep(0.01)
                assert cache.drops == 1 and len(calls) == 2
                assert 8 in calls[-1][0] and (1, b"y") in calls[-1][1]  # everything known was dropped
                assert cache.healthy  # and it is in step again from there

                changed([42], [])  # back in sequence: applied normally (inode 42 unknown: nothing to do)
                await trio.sleep(0.2)
                assert cache.drops == 1

                garbage = feed._sock
                garbage.send(b"\x00not an event")
                while cache.drops == 1:
                    await trio.sleep(0.01)
            nursery.cancel_scope.cancel()
    finally:
        feed.close()
        store.close()
        ctx.term()


def test_events_round_trip_and_reject_garbage():
    event = P.ChangeEvent("b", 3, [1, 2], [(1, b"n\xff")])
    assert P.decode_event(P.encode_event(event)) == event
    for bad in (b"", b"\x93\x01\x02", P.encode(1, P.PingReq())):
        with pytest.raises(P.ProtocolError):
            P.decode_event(bad)


async def follow_until_heard(nursery, cache, ctx, feed, log_id: str, every: float = 0.05) -> None:
    """Start ``cache`` following ``feed`` (a real ChangeFeed) and return once it hears it:
    subscribed, since a heartbeat came through."""

    async def feed_info():
        return f"tcp://127.0.0.1:{feed.port}", log_id, feed.seq

    nursery.start_soon(cache.follow, ctx, feed_info)
    while not cache.events_heard:
        feed._send(P.ChangeEvent(log_id, feed.seq, [], []))
        await trio.sleep(every)


async def test_a_mounts_own_change_of_a_held_file_owes_no_acknowledgement_unless_it_is_open(monkeypatch):
    """Issue 31: an rm -rf sent one AckReq per file, for files whose holding the daemon had
    already ended (the writer waits for nobody, daemon/callbacks.py). Another mount's change, or
    an own change of a file open here (the daemon must learn it is open), is acknowledged."""
    monkeypatch.setattr(kc, "_invalidate", lambda inodes, names, lock: None)
    acks = []

    async def send_ack(seq, everything, opened):
        acks.append((seq, everything, opened))

    cache = kc.KernelCache()
    cache.send_ack, cache.own_writer = send_ack, 77
    opened = {12}
    cache.is_open = lambda ino: ino in opened
    for ino in (10, 11, 12):
        cache.remember(1, b"f%d" % ino, ino)
        cache.granted(ino, 1, b"f%d" % ino, seq=5)

    cache.apply([10], [(1, b"f10")], seq=6, writer=77)  # this mount unlinked f10
    await cache.flush_pending()
    assert acks == [] and 10 not in cache.grants  # its holding ended on both sides, silently

    cache.apply([12], [(1, b"f12")], seq=7, writer=77)  # its own change of a file open here
    await cache.flush_pending()
    assert acks == [(7, False, [12])]

    cache.apply([11], [(1, b"f11")], seq=8, writer=99)  # another mount's change: the daemon waits for us
    await cache.flush_pending()
    assert acks[-1] == (8, False, [])


async def test_a_mounts_own_commit_keeps_its_grant_and_its_create_keeps_the_new_name(monkeypatch):
    """Issue 31: stat after a write is answered here. The event of this mount's own commit (no
    entry) keeps the file's grant; its own create's event does not drop the name it granted as
    of that change or later; another mount's change still ends the grant and drops the name."""
    calls = []
    monkeypatch.setattr(kc, "_invalidate", lambda inodes, names, lock: calls.append((sorted(inodes), sorted(names))))
    cache, acks = _acking_cache()
    cache.remember(1, b"new", 10)
    cache.granted(10, 1, b"new", seq=5)  # the create's reply, as of its own change 5
    cache.apply([1], [(1, b"new")], seq=5, writer=77)  # the create's event
    cache.apply([10], [], seq=6, writer=77)  # this mount's commit of it
    await cache.flush_pending()
    assert 10 in cache.grants and (1, b"new") in cache.grants and acks == []
    assert all((1, b"new") not in names for _, names in calls)  # the kernel keeps the name
    assert cache.lookup_known(1, b"new") == 10
    cache.apply([10], [], seq=7, writer=99)  # another mount's change: the grant ends, acknowledged
    await cache.flush_pending()
    assert 10 not in cache.grants and acks == [7]
    assert calls[-1] == ([10], [(1, b"new")])  # its attributes and name are asked afresh


def test_a_mounts_own_create_event_changes_its_directory_not_the_new_file():
    """Issues 30/31: the event of a create this mount answered itself changes the directory only.
    The new file is what the mount made it: not reported changed (Operations would mark its state
    stale and drop what it keeps of it), and a reply about it is not taken for one that raced a
    change. The same event from another mount still reaches the file its name names."""
    changed = []
    cache = kc.KernelCache(on_change=changed.append)
    cache.own_writer = 77
    cache.remember(1, b"new", 10)
    cache.held_here(10, 1, b"new")
    before = cache.stamp()
    cache.apply([1], [(1, b"new")], seq=5, writer=77)  # the feed's event of this mount's own create
    assert changed == [{1}]
    assert cache.changed_since(before, 1) and not cache.changed_since(before, 10)
    cache.remember(1, b"other", 11)
    cache.apply([1], [(1, b"other")], seq=6, writer=99)  # another mount's change of that name
    assert changed[-1] == {1, 11} and cache.changed_since(before, 11)


async def test_the_follower_applies_runs_of_its_own_changes_together_in_feed_order(monkeypatch):
    """The own events of a burst next to each other are applied as one run (apply_own), and another
    mount's event between two runs is applied between them: its grant ending and acknowledgement
    stand, and the runs after it end nothing it granted anew."""
    monkeypatch.setattr(kc, "_invalidate", lambda inodes, names, lock: None)
    runs = []
    real = kc.KernelCache.apply_own
    monkeypatch.setattr(kc.KernelCache, "apply_own", lambda self, changes: (runs.append([c[2] for c in changes]),
                                                                           real(self, changes)))
    acks = []

    async def send_ack(seq, everything, opened):
        acks.append(seq)

    ctx = zmq.Context()
    feed = kc_feed = None
    try:
        from stripefs.daemon.events import ChangeFeed
        feed = kc_feed = ChangeFeed(ctx, "tcp://127.0.0.1:0", "log-1", 0)
        cache = kc.KernelCache()
        cache.send_ack, cache.own_writer = send_ack, 77
        async with trio.open_nursery() as nursery:
            with trio.fail_after(10):
                await follow_until_heard(nursery, cache, ctx, feed, "log-1")
                cache.remember(1, b"theirs", 10)
                cache.granted(10, 1, b"theirs", seq=0)
                rows = [change_log.encode([1], [(1, b"a")], 77), change_log.encode([1], [(1, b"b")], 77),
                        change_log.encode([10], [], 99),  # another mount's change of a file held here
                        change_log.encode([1], [(1, b"c")], 77), change_log.encode([1], [(1, b"d")], 77)]
                kc_feed.publish([(feed.seq + 1 + i, row) for i, row in enumerate(rows)])
                while cache._seq < 5 or not acks:
                    await trio.sleep(0.01)
                assert 10 not in cache.grants and acks == [3] and cache.lookup_known(1, b"theirs") is None
                assert sum(runs, []) == [1, 2, 4, 5] and all(run in ([1, 2], [1], [2], [4, 5], [4], [5]) for run in runs)
            nursery.cancel_scope.cancel()
    finally:
        if feed is not None:
            feed.close()
        ctx.term()


async def test_a_grant_older_than_this_mounts_own_changes_owes_no_acknowledgement(monkeypatch):
    """Issue 31: during an rm -rf each lookup's grant is older than the mount's own latest unlinks;
    only changes of other mounts can be waiting for this one, so only they call for an AckReq."""
    monkeypatch.setattr(kc, "_invalidate", lambda inodes, names, lock: None)
    cache, acks = _acking_cache()
    for seq in (1, 2, 3):
        cache.apply([1], [(1, b"gone%d" % seq)], seq=seq, writer=77)  # this mount's own unlinks
    cache.granted(10, 1, b"f", seq=1)  # a lookup answered as of change 1
    await cache.flush_pending()
    assert acks == []
    cache.apply([1], [(1, b"theirs")], seq=4, writer=99)  # another mount's change
    cache.granted(11, 1, b"g", seq=3)  # answered before it: change 4 may wait for this mount
    await cache.flush_pending()
    assert acks == [4]


async def test_a_grant_recorded_on_a_worker_thread_owes_what_trio_s_would(monkeypatch):
    """Issue 30: a default mount's cold LOOKUP answered on a worker thread records its grant there
    (``record_grant``, under state_lock) and hands the acknowledgement part (``granted_as_of``: it
    wakes the flusher, a trio event) to trio only when an event of another mount above the grant
    was applied already: the same AckReqs as ``granted`` in trio."""
    monkeypatch.setattr(kc, "_invalidate", lambda inodes, names, lock: None)
    cache, acks = _acking_cache()
    cache.apply([1], [(1, b"theirs")], seq=4, writer=99)  # another mount's change
    owed = await trio.to_thread.run_sync(cache.record_grant, 10, 1, b"f", 5)  # answered after it
    assert owed is False and cache.grants[10] == 5 and cache.grants[(1, b"f")] == 5
    owed = await trio.to_thread.run_sync(cache.record_grant, 11, 1, b"g", 3)  # before it: 4 may wait here
    assert owed is True and cache.grants[11] == 3
    await cache.flush_pending()
    assert acks == []  # nothing owed until trio runs the second half
    cache.granted_as_of(3)
    await cache.flush_pending()
    assert acks == [4]
    cache.apply([10], [], seq=6, writer=99)  # a change of the file granted on the thread ends it
    await cache.flush_pending()
    assert acks == [4, 6] and 10 not in cache.grants


def test_path_of_walks_the_names_the_kernel_knows_up_to_the_root():
    """The no-open primer opens a created file through the mountpoint (client/no_open_primer.py):
    its path is built from the names the kernel was given; a name missing on the way gives None."""
    cache = kc.KernelCache()
    cache.remember(kc.ROOT_ID, b"tree", 10)
    cache.remember(10, b"d00", 11)
    cache.remember(11, b"f00000", 12)
    assert cache.path_of(12) == b"tree/d00/f00000"
    assert cache.path_of(kc.ROOT_ID) == b""
    cache.forget(10)
    assert cache.path_of(12) is None and cache.path_of(99) is None


def test_the_primers_own_flush_is_known_by_its_threads_id(tmp_path):
    """The kernel names a FLUSH's sender by its thread (fs/fuse/dev.c: ``task_pid(current)``): the
    primer's close carries its thread's id, not the mount's pid, and only while it runs. Taken for
    a writer's close, it committed a file under its writer (client/no_open_primer.py)."""
    (tmp_path / "f").write_bytes(b"x")
    seen = {}

    def path_of(ino):  # called on the primer's thread, before its open and close
        seen["own"] = primer.own_flush(threading.get_native_id())
        seen["process"] = primer.own_flush(os.getpid())
        return b"f"

    primer = NoOpenPrimer(str(tmp_path), path_of)
    primer.created(5)
    for thread in threading.enumerate():
        if thread.name == "no-open-primer":
            thread.join(10)
    assert seen == {"own": True, "process": False}
    assert primer.tries == 1 and not primer.own_flush(0)


async def test_the_flusher_still_acknowledges_after_someone_else_flushed(monkeypatch):
    """A direct ``flush_pending`` (a test, a caller that needs the kernel told now) while the flusher
    waits once replaced the event the flusher waited on: nothing woke it again, the mount never
    acknowledged another change, and the daemon waited 4 s for each before taking its callbacks
    away (tests/inprocess/test_async_dirops_ops.py's rename-then-unlink test took 4 s for that)."""
    monkeypatch.setattr(kc, "_invalidate", lambda inodes, names, lock: None)
    acked = trio.Event()
    acks = []

    async def send_ack(seq, everything, opened):
        acks.append(seq)
        acked.set()

    cache = kc.KernelCache()
    cache.send_ack, cache.own_writer = send_ack, 77
    cache.remember(1, b"f", 10)
    cache.granted(10, 1, b"f", seq=5)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(cache._flusher)
        await trio.testing.wait_all_tasks_blocked()  # the flusher waits for work
        await cache.flush_pending()  # nothing queued: someone else's flush
        cache.apply([10], [(1, b"f")], seq=6, writer=99)  # another mount's change of the held file
        with trio.fail_after(2):
            await acked.wait()
        nursery.cancel_scope.cancel()
    assert acks == [6]
