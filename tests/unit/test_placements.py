"""A write session's epochs (client/placements.py): the versions its copy-on-write writes get, and
what they cost in requests to the daemon."""

from __future__ import annotations

import trio

from stripefs.client.open_files import OpenFile
from stripefs.client.placements import fresh_epoch, session_epoch, slot_version
from stripefs.common import protocol as p


class Epochs:
    """The daemon's side of AllocEpochReq, as daemon/file_data.py hands epochs out: pairs when
    asked and ``pairs`` (SQLite), single numbers otherwise (a PostgreSQL sequence, an older daemon)."""

    def __init__(self, pairs: bool, first: int = 10):
        self.pairs = pairs
        self.next = first
        self.asked = 0

    async def call(self, request: p.Msg) -> p.Msg:
        assert isinstance(request, p.AllocEpochReq)
        self.asked += 1
        pair = request.pair and self.pairs
        epoch, self.next = self.next, self.next + (2 if pair else 1)
        return p.EpochRsp(epoch=epoch, pair=pair)


def _file() -> OpenFile:
    attr = p.Attr(ino=5, mode=0o100644, nlink=1, uid=0, gid=0, rdev=0, size=0, atime_ns=0, mtime_ns=0, ctime_ns=0, generation=0)
    return OpenFile(5, attr, p.Layout(chunk_size=1 << 16, stripe_count=4, redundancy="replicas=2"), {})


def _versions(meta: Epochs, committed: list[int], cut: int = 0) -> list[int]:
    of = _file()

    async def run() -> list[int]:
        epoch = await session_epoch(meta, of)
        out = [await slot_version(meta, of, epoch, c) for c in committed]
        if cut:
            out.append(await slot_version(meta, of, await fresh_epoch(meta, of), cut))
        return out

    return trio.run(run)


def test_a_session_with_a_pair_asks_once_whatever_the_committed_parities():
    meta = Epochs(pairs=True)
    # the session's pair is (10, 11): each chunk takes the one of the other parity than its committed version
    assert _versions(meta, [4, 5, 0, 9, 8]) == [11, 10, 10, 10, 11]
    assert meta.asked == 1


def test_a_truncates_cut_takes_the_other_number_of_its_pair():
    meta = Epochs(pairs=True)
    assert _versions(meta, [], cut=12) == [13]  # the session's (10, 11), the cut's (12, 13): 12 is the committed parity
    assert meta.asked == 2


def test_a_chunk_committed_after_the_session_began_gets_a_fresh_pair():
    meta = Epochs(pairs=True)
    of = _file()

    async def run() -> list[int]:
        epoch = await session_epoch(meta, of)  # (10, 11)
        meta.next = 31  # another mount's sessions took epochs up to 30 meanwhile and committed 30
        return [await slot_version(meta, of, epoch, 4), await slot_version(meta, of, epoch, 30), await slot_version(meta, of, epoch, 30)]

    assert trio.run(run) == [11, 31, 31]
    assert meta.asked == 2


def test_without_pairs_the_writer_asks_until_the_parity_fits():
    meta = Epochs(pairs=False)
    # 10 (the session's), then 11 for an even committed version: one more request, then kept for the session
    assert _versions(meta, [4, 6, 5]) == [11, 11, 10]
    assert meta.asked == 2
