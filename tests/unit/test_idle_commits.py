"""The idle commits' timer (client/idle_commits.py), on trio's mock clock."""

import trio
from trio.testing import MockClock

from stripefs.client import idle_commits
from stripefs.client.idle_commits import IdleCommits


def _committed_at(touches: list[tuple[float, int]]) -> dict[int, float]:
    """Touch each inode at its time; when each was handed to ``commit``."""
    out: dict[int, float] = {}

    async def commit(ino: int) -> None:
        out[ino] = trio.current_time()

    async def main() -> None:
        idle = IdleCommits(commit)
        async with trio.open_nursery() as nursery:
            await nursery.start(idle.run)
            start = trio.current_time()
            for at, ino in touches:
                await trio.sleep_until(start + at)
                idle.touched(ino)
            await trio.sleep(1)
            nursery.cancel_scope.cancel()
        for ino in out:
            out[ino] -= start

    trio.run(main, clock=MockClock(autojump_threshold=0))
    return out


def test_sessions_due_close_together_are_committed_on_one_wake_up():
    """`cp -r` of small files (issue 31): a file every ~0.5 ms, each due IDLE_S after its last write,
    made the timer wake once per file. Those due within EARLY_S of the first are committed with it
    (a little early: never later than IDLE_S after the last write)."""
    step = idle_commits.EARLY_S / 4
    touches = [(i * step, i) for i in range(1, 4)]  # three files, all due within EARLY_S of the first
    at = _committed_at(touches)
    assert sorted(at) == [1, 2, 3]
    assert len(set(at.values())) == 1  # one wake-up for the three
    for t, ino in touches:
        assert idle_commits.IDLE_S - idle_commits.EARLY_S <= at[ino] - t <= idle_commits.IDLE_S


def test_a_file_written_again_is_committed_after_its_last_write():
    at = _committed_at([(0.0, 1), (0.03, 1), (0.06, 1)])  # each write moves its deadline
    assert idle_commits.IDLE_S - idle_commits.EARLY_S <= at[1] - 0.06 <= idle_commits.IDLE_S


def test_a_stream_of_files_shares_wake_ups():
    """A file every 0.5 ms for 50 ms: the timer wakes about once per EARLY_S, not once per file."""
    at = _committed_at([(i * 0.0005, i) for i in range(100)])
    assert len(at) == 100
    assert len(set(at.values())) <= round(0.05 / idle_commits.EARLY_S) + 2
    for i, when in at.items():
        assert idle_commits.IDLE_S - idle_commits.EARLY_S <= when - i * 0.0005 <= idle_commits.IDLE_S
