"""Callbacks (daemon/callbacks.py): who a change waits for, and when it stops waiting."""

from __future__ import annotations

import trio
import trio.testing

from stripefs.daemon import callbacks as cb
from stripefs.daemon.callbacks import Callbacks

A, B, C = 11, 22, 33  # sessions
CLIENT_A, CLIENT_B = 101, 202


def make(seq: list[int], alive=lambda sid: True) -> Callbacks:
    calls = Callbacks(enabled=True, alive=alive, last_seq=lambda: seq[0])
    calls.hello(A, CLIENT_A)
    calls.hello(B, CLIENT_B)
    return calls


async def settle_time(calls: Callbacks, *args, **kwargs) -> tuple[float, list[int]]:
    start = trio.current_time()
    freed = await calls.settle(*args, **kwargs)
    return trio.current_time() - start, freed


async def test_a_change_of_a_held_file_waits_for_the_holders_acknowledgement():
    seq = [5]
    calls = make(seq)
    assert calls.grant(B, 7, 1, b"f") == 5
    assert calls.held(7)
    done = []

    async def change():
        done.append(await settle_time(calls, 6, [7], [], writer=CLIENT_A))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(change)
        await trio.sleep(0.5)
        assert not done  # B has not acknowledged change 6
        calls.ack(B, 5)  # an older change: not enough
        await trio.sleep(0.5)
        assert not done
        calls.ack(B, 6)
    waited, freed = done[0]
    assert 0.9 < waited < 1.5
    assert freed == [7] and not calls.held(7)  # the grant ended with the change


async def test_the_name_is_a_key_of_its_own():
    seq = [1]
    calls = make(seq)
    calls.grant(B, 7, 1, b"f")
    with trio.move_on_after(0.2) as scope:
        await calls.settle(2, [1], [(1, b"f")], writer=CLIENT_A)  # an unlink of 1/f
    assert scope.cancelled_caught  # it waits for B
    assert calls.held(7)


async def test_the_writer_never_waits_for_itself_and_later_grants_are_not_waited_for():
    seq = [3]
    calls = make(seq)
    calls.grant(A, 7, 1, b"f")
    with trio.fail_after(0.1):
        await calls.settle(4, [7], [], writer=CLIENT_A)
    assert calls.held(7)  # the writer keeps its own (the feed names it: its mount keeps it too)
    with trio.move_on_after(0.2) as scope:
        await calls.settle(5, [7], [], writer=CLIENT_B)  # someone else's change waits for it
    assert scope.cancelled_caught
    seq[0] = 5
    calls.grant(B, 8, 1, b"g")  # granted after change 5: the answer already had it
    with trio.fail_after(0.1):
        await calls.settle(5, [8], [], writer=CLIENT_A)
    assert calls.held(8)


async def test_a_session_whose_client_id_is_unknown_gets_no_callbacks():
    calls = make([1])
    assert calls.grant(C, 7, 1, b"f") == -1 and calls.grant_dir(C, 1) == -1
    calls.ack(C, 0, client_id=303)  # an adopted session names its client id in its first AckReq
    assert calls.grant(C, 7, 1, b"f") == 1


async def test_a_directory_held_whole_makes_other_mounts_changes_of_its_names_wait():
    seq = [2]
    calls = make(seq)
    assert calls.grant_dir(B, 5) == 2
    with trio.fail_after(0.1):
        await calls.settle(3, [9], [], writer=CLIENT_A)  # a file's data: not a name of 5
        await calls.settle(3, [5], [(6, b"x")], writer=CLIENT_A)  # a name in another directory
    with trio.move_on_after(0.2) as scope:
        await calls.settle(4, [5], [(5, b"new")], writer=CLIENT_A)  # a create in 5
    assert scope.cancelled_caught
    with trio.fail_after(0.1):
        await calls.settle(4, [5], [(5, b"new")], writer=CLIENT_B)  # its own create: no wait


async def test_an_unanswered_wait_runs_out_and_the_session_gets_no_callbacks_for_a_while(autojump_clock):
    seq = [1]
    calls = make(seq)
    calls.grant(B, 7, 1, b"f")
    calls.grant(B, 8, 1, b"g")
    waited, freed = await settle_time(calls, 2, [7], [], writer=CLIENT_A)
    assert waited == cb.WAIT_S
    assert sorted(freed) == [7, 8] and calls.timeouts == 1  # everything B held is dropped
    assert calls.grant(B, 9, 1, b"h") == -1
    await trio.sleep(cb.PENALTY_S)
    assert calls.grant(B, 9, 1, b"h") == 1


async def test_dead_sessions_are_not_waited_for_and_do_not_hold_files():
    seq = [1]
    live = {A, B}
    calls = make(seq, alive=live.__contains__)
    calls.grant(B, 7, 1, b"f")
    live.discard(B)
    assert not calls.held(7)
    with trio.fail_after(0.1):
        await calls.settle(2, [7], [], writer=CLIENT_A)
    calls.hello(C, 303)
    calls.grant(C, 8, 1, b"g")  # C is not alive either
    assert calls.forget_dead() == [8]


async def test_an_acknowledgement_of_everything_ends_every_grant():
    seq = [1]
    calls = make(seq)
    calls.grant(B, 7, 1, b"f")
    calls.grant(B, 8, 1, b"g")
    assert sorted(calls.ack(B, 1, everything=True)) == [7, 8]
    assert not calls.held(7) and not calls.held(8)
    seq[0] = 3
    with trio.fail_after(0.1):
        await calls.settle(3, [7], [], writer=CLIENT_A)


async def test_after_a_restart_changes_wait_out_the_grace(autojump_clock):
    seq = [1]
    calls = make(seq)
    calls.start_grace()
    waited, _ = await settle_time(calls, 2, [7], [])
    assert waited == cb.GRACE_S
    waited, _ = await settle_time(calls, 3, [7], [])
    assert waited == 0


async def test_disabled_callbacks_grant_nothing_and_never_wait():
    calls = Callbacks(enabled=False)
    assert calls.grant(A, 7, 1, b"f") == -1
    calls.start_grace()
    with trio.fail_after(0.1):
        assert await calls.settle(2, [7], []) == []
