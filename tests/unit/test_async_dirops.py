"""client/async_dirops.py's queue: what a flush sends (the daemon stands in as a stub: the batches it
receives are what is tested; tests/inprocess/test_async_dirops_ops.py runs the real one)."""

from __future__ import annotations

import trio

from stripefs.client.async_dirops import AsyncDirops, Pending
from stripefs.common import protocol as P


class _Daemon:
    """Takes each BatchReq's items and answers them once ``release`` is set."""

    session_id = 1

    def __init__(self) -> None:
        self.batches: list[int] = []
        self.release = trio.Event()

    async def call_batch(self, requests: list[P.Msg]) -> list[P.Msg]:
        self.batches.append(len(requests))
        await self.release.wait()
        return [P.ChangedRsp(dir_attrs=[], seq=1) for _ in requests]


def _create(i: int) -> Pending:
    name = b"f%d" % i
    return Pending(P.CreateReq(parent=5, name=name, mode=0o644, uid=0, gid=0, session_id=1, new_ino=100 + i), 5, name, 100 + i)


async def test_changes_answered_during_a_flush_wait_for_the_next_turn_not_a_batch_per_round_trip():
    """A steady stream of creates (bench/meta_ops.py) was cut into a batch per round trip (~50
    creates, each batch its own transaction and fsync at the daemon): a flush now sends what was
    pending when it began; what comes meanwhile waits for the flusher's next turn (or a full batch,
    or the next flush)."""
    daemon = _Daemon()
    dirops = AsyncDirops(daemon)
    dirops.add(_create(0))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(dirops.flush)
        while not daemon.batches:
            await trio.sleep(0.001)
        for i in range(1, 11):
            dirops.add(_create(i))  # answered while the first batch is at the daemon
        daemon.release.set()
    assert daemon.batches == [1] and dirops.pending(101) and not dirops.pending(100)
    await dirops.flush()
    assert daemon.batches == [1, 10] and not dirops.unanswered


def test_more_numbers_are_asked_for_once_fewer_than_low_are_left_in_all_ranges():
    """take_ino asks for a new range when fewer than LOW numbers are left in all the ranges together
    (the first range alone is looked at first, to skip the sum per create)."""
    from stripefs.client.async_dirops import LOW

    class Nursery:
        started: list = []

        def start_soon(self, fn, *args):
            self.started.append(fn)

    def dirops_with(ranges):
        d = AsyncDirops(_Daemon())
        d._session, d._ranges, d.nursery, d._token = 1, list(ranges), Nursery(), None
        Nursery.started = []
        return d

    d = dirops_with([(1, LOW + 1)])  # LOW + 1 numbers
    assert d.take_ino() == 1 and not Nursery.started  # LOW left
    assert d.take_ino() == 2 and len(Nursery.started) == 1  # LOW - 1 left: asked, once
    assert d.take_ino() == 3 and len(Nursery.started) == 1
    d = dirops_with([(1, 10), (100, 100 + 2 * LOW)])  # a small first range, plenty behind it
    assert d.take_ino() == 1 and not Nursery.started
    d = dirops_with([(1, 10), (100, 100 + LOW - 20)])  # two ranges, fewer than LOW together
    assert d.take_ino() == 1 and len(Nursery.started) == 1


async def test_the_flushers_turn_sends_at_once_what_piled_up_past_half_a_batch_and_a_small_remainder_rides_along():
    """An ``rm -rf`` answers unlinks faster than a loaded daemon takes a batch: what piled up during
    the flusher's round trip waited for the next full batch (or the delay), the daemon idle
    meanwhile. The flusher's own turn (``drain``) now sends it at once when at least ``DRAIN`` piled
    up; fewer wait as before (a steady stream of creates is not cut into small batches); and a
    flush of a whole batch and a few sends them as one BatchReq, not a second tiny one."""
    from stripefs.client.async_dirops import BATCH, DRAIN

    daemon = _Daemon()
    dirops = AsyncDirops(daemon)
    for i in range(BATCH + 3):
        dirops.add(_create(i))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(lambda: dirops.flush(drain=True))
        while not daemon.batches:
            await trio.sleep(0.001)
        for i in range(BATCH + 3, BATCH + 3 + DRAIN):
            dirops.add(_create(i))  # piled up while the first batch is at the daemon
        daemon.release.set()
    assert daemon.batches == [BATCH + 3, DRAIN] and not dirops.unanswered
    daemon.release = trio.Event()
    daemon.batches.clear()
    async with trio.open_nursery() as nursery:
        start = BATCH + 3 + DRAIN
        dirops.add(_create(start))
        nursery.start_soon(lambda: dirops.flush(drain=True))
        while not daemon.batches:
            await trio.sleep(0.001)
        for i in range(start + 1, start + DRAIN):
            dirops.add(_create(i))  # fewer than DRAIN: the next turn's
        daemon.release.set()
    assert daemon.batches == [1] and dirops.pending(100 + start + 1)
    await dirops.flush()
    assert daemon.batches == [1, DRAIN - 1] and not dirops.unanswered
    big = BATCH * 2 + 3
    daemon.batches.clear()
    for i in range(big):
        dirops.add(_create(10_000 + i))
    await dirops.flush()
    assert daemon.batches == [BATCH, BATCH + 3]  # never past BATCH + DRAIN, never a small last one
