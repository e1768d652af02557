"""Fuzzing the mount's side of the change feed (client/kernel_cache.py) over a real PUB/SUB pair.

The mount follows whatever arrives on its SUB socket. Garbage, other protocol
versions, truncated or multipart messages, and well-formed events with hostile
values (negative or enormous inode numbers, names with NUL or '/', long
lists) must never end the follower: it drops its cache (trusting nothing)
and is back in step with the next good event. Only the final calls into the FUSE session are
replaced by a recorder, as in test_kernel_cache.py; they must only ever be
asked about inodes and names the mount itself handed to the kernel.
"""

from __future__ import annotations

import os

import msgspec
import trio
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stripefs.client import kernel_cache as kc
from stripefs.common import protocol as P
from stripefs.daemon import change_log
from stripefs.daemon.events import ChangeFeed
from test_kernel_cache import follow_until_heard

WIRE_INT = st.integers(-(2**63), 2**64 - 1)
INO = st.one_of(st.sampled_from([0, -1, 1, 7, 2**63 - 1, 2**64 - 1, -(2**63)]), WIRE_INT)
NAME = st.one_of(st.binary(max_size=20), st.sampled_from([b"", b"\0", b"a/b", b"x" * 5000]))
WRONG = st.one_of(st.none(), st.text(max_size=4), st.floats(), st.lists(WIRE_INT, max_size=3), WIRE_INT)


@st.composite
def hostile_event_frames(draw) -> list[bytes]:
    kind = draw(st.integers(0, 5))
    event = [
        draw(st.sampled_from(["boot-1", "boot-2", ""]) | st.text(max_size=8)),
        draw(st.sampled_from([0, 1, 2, 10**6]) | WIRE_INT),
        draw(st.lists(INO, max_size=8)),
        draw(st.lists(st.tuples(INO, NAME), max_size=8)),
    ]
    if kind == 0:
        return draw(st.lists(st.binary(max_size=200), min_size=1, max_size=3))
    if kind == 1:  # another version, maybe another shape
        return [msgspec.msgpack.encode([draw(st.sampled_from([0, 2, -1])), event, *draw(st.lists(WRONG, max_size=2))])]
    if kind == 2:  # a field of a wrong type
        event[draw(st.integers(0, 3))] = draw(WRONG)
    frame = msgspec.msgpack.encode([P.PROTOCOL_VERSION, event])
    if kind == 3:
        frame = frame[: draw(st.integers(0, len(frame)))]
    if kind == 4:  # a multipart message: only frame 0 is an event
        return [frame, *draw(st.lists(st.binary(max_size=50), min_size=1, max_size=3))]
    return [frame]


@settings(max_examples=int(os.environ.get("STRIPEFS_FUZZ_EXAMPLES", "0")) // 100 or 12, deadline=None,
          derandomize="STRIPEFS_FUZZ_EXAMPLES" not in os.environ, suppress_health_check=list(HealthCheck), database=None)
@given(st.lists(hostile_event_frames(), min_size=5, max_size=40))
def test_the_mount_follows_the_feed_whatever_arrives(frames_list):
    trio.run(_follow_through, frames_list)


async def _follow_through(frames_list: list[list[bytes]]) -> None:
    calls: list[tuple[list[int], list]] = []
    saved = kc._invalidate
    kc._invalidate = lambda inodes, names, lock: calls.append((sorted(inodes), list(names)))
    ctx = zmq.Context()
    feed = ChangeFeed(ctx, "tcp://127.0.0.1:0", "boot-1", 0)

    def changed(inodes, entries):  # the daemon publishes the next row of its change log
        feed.publish([(feed.seq + 1, change_log.encode(inodes, entries))])
    cache = kc.KernelCache()

    try:
        async with trio.open_nursery() as nursery:
            with trio.fail_after(20):
                await follow_until_heard(nursery, cache, ctx, feed, "boot-1", every=0.02)
                for frames in frames_list:
                    feed._sock.send_multipart(frames)
                # then the real daemon goes on: a heartbeat, then a change to an inode the kernel knows
                cache.remember(1, b"known", 7)
                feed.seq += 1000  # from a number the follower has not seen: it drops all, then follows
                changed([], [])
                while not cache.healthy:
                    await trio.sleep(0.01)
                calls.clear()
                changed([7], [(1, b"known")])
                while not any(7 in inodes for inodes, _ in calls):
                    await trio.sleep(0.01)
            known = {7, 1}
            for inodes, names in calls:  # the kernel only ever hears of what the mount told it
                assert set(inodes) <= known and all(name == (1, b"known") for name in names)
            nursery.cancel_scope.cancel()
    finally:
        kc._invalidate = saved
        feed.close()
        ctx.term()


OWN_INO = st.sampled_from([1, 2, 3, 10, 11, 12])
OWN_CHANGE = st.tuples(st.lists(OWN_INO, max_size=3),
                       st.lists(st.tuples(st.sampled_from([1, 2, 3]), st.sampled_from([b"a", b"b", b"c"])), max_size=2))


@settings(max_examples=int(os.environ.get("STRIPEFS_FUZZ_EXAMPLES", "0")) // 10 or 200, deadline=None,
          derandomize="STRIPEFS_FUZZ_EXAMPLES" not in os.environ, suppress_health_check=list(HealthCheck), database=None)
@given(st.lists(OWN_CHANGE, min_size=1, max_size=12), st.dictionaries(OWN_INO, st.integers(0, 20)),
       st.sets(OWN_INO), st.lists(st.tuples(st.sampled_from([1, 2, 3]), st.sampled_from([b"a", b"b", b"c"]), OWN_INO)))
def test_a_run_of_the_mounts_own_changes_applied_together_is_applied_one_by_one(changes, grants, opened, names):
    """The follower applies a burst's run of this mount's own events at once (KernelCache.apply_own):
    grants, names, invalidations, acknowledgements and what Operations hears are those of applying
    them one after the other."""
    def made():
        changed = []
        cache = kc.KernelCache(on_change=changed.append)
        cache.own_writer = 77
        cache.is_open = lambda ino: ino in opened
        for parent, name, ino in names:
            cache.remember(parent, name, ino)
        cache.grants.update(grants)
        return cache, changed

    run = [(inodes, entries, 5 + i) for i, (inodes, entries) in enumerate(changes)]
    one, one_changed = made()
    for inodes, entries, seq in run:
        one.apply(inodes, entries, seq, 77)
    together, together_changed = made()
    stamp = together.stamp()
    together.apply_own(run)
    assert together.grants == one.grants and together._names == one._names
    assert {k: v for k, v in together._names_of.items() if v} == {k: v for k, v in one._names_of.items() if v}
    assert together._pending_inodes == one._pending_inodes and together._pending_names == one._pending_names
    assert together._pending.is_set() == one._pending.is_set()
    assert (together._seq, together._ack_seq, together._ack_open) == (one._seq, one._ack_seq, one._ack_open)
    assert set().union(*together_changed) == set().union(*one_changed)
    noted = {ino for inodes, entries, _ in run for ino in (*inodes, *(parent for parent, _ in entries))}
    assert all(together.changed_since(stamp, ino) for ino in noted)
