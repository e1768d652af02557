"""Callbacks (daemon/callbacks.py): who a change waits for, and when it stops waiting."""

from __future__ import annotations

import trio
import trio.testing

from stripefs.common import protocol as P
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
    calls.grant_dir(A, 1)
    with trio.fail_after(0.1):
        assert await calls.settle(4, [1, 7], [(1, b"g")], writer=CLIENT_A) == [7]  # its own create of 1/g, and 7 changed
    assert not calls.held(7)  # a file it changed is not kept (an unlinked one would stay an orphan)
    with trio.move_on_after(0.2) as scope:
        await calls.settle(5, [1], [(1, b"h")], writer=CLIENT_B)  # the directory's names it kept: others wait
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


# -- a hostile holder (security review round 3): penalties are the key's, late acknowledgements count --------


def make_keyed(seq: list[int], owners: dict[int, str]) -> Callbacks:
    calls = Callbacks(enabled=True, last_seq=lambda: seq[0], owner=owners.get)
    for sid in owners:
        calls.hello(sid, 1000 + sid)
    calls.hello(A, CLIENT_A)
    return calls


async def test_a_penalty_is_the_keys_and_a_fresh_session_does_not_escape_it(autojump_clock):
    seq = [1]
    owners = {B: "hostile", C: "honest"}
    calls = make_keyed(seq, owners)
    calls.grant(B, 7, 1, b"f")
    calls.grant(C, 8, 1, b"g")
    waited, _ = await settle_time(calls, 2, [7], [], writer=CLIENT_A)
    assert waited == cb.WAIT_S  # the first offence costs one wait
    owners[44] = "hostile"  # a new session of the same key (a fresh HelloReq)
    calls.hello(44, 1044)
    assert calls.grant(44, 7, 1, b"f") == -1 and calls.grant_dir(44, 1) == -1
    assert calls.grant(C, 9, 1, b"h") == 1  # another key is not punished for it
    await trio.sleep(cb.PENALTY_S)
    assert calls.grant(44, 7, 1, b"f") == 1  # served
    waited, _ = await settle_time(calls, 3, [7], [], writer=CLIENT_A)
    assert waited == cb.WAIT_S  # a second offence...
    await trio.sleep(cb.PENALTY_S)
    assert calls.grant(44, 7, 1, b"f") == -1  # ...costs twice as long
    await trio.sleep(cb.PENALTY_S)
    assert calls.grant(44, 7, 1, b"f") == seq[0]


async def test_acknowledging_just_inside_the_wait_costs_the_writer_one_wait_not_one_per_change(autojump_clock):
    seq = [1]
    owners = {B: "hostile", C: "hostile"}  # two sessions of one key, each holding the file
    calls = make_keyed(seq, owners)
    calls.grant(B, 7, 1, b"f")
    calls.grant(C, 7, 1, b"f")

    async def ack_late(sid, n):
        await trio.sleep(cb.WAIT_S - 0.4)
        calls.ack(sid, n)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ack_late, B, 2)
        nursery.start_soon(ack_late, C, 2)
        waited, freed = await settle_time(calls, 2, [7], [], writer=CLIENT_A)
    assert cb.LATE_S < waited < cb.WAIT_S and calls.timeouts == 0 and calls.late == 2
    assert calls.grant(B, 7, 1, b"f") == -1 and calls.grant(C, 7, 1, b"f") == -1  # the key lost its callbacks
    with trio.fail_after(0.01):  # so the next change waits for nobody
        await calls.settle(3, [7], [], writer=CLIENT_A)


async def test_a_writer_that_says_it_is_committing_is_waited_for_past_the_usual_bound_and_is_not_late(autojump_clock):
    """A write mark's holder whose commit is held up (a dead storage node's timeouts) says so
    (AckReq.committing): the reader's change waits on, COMMITTING_S from each notice, and the
    late acknowledgement is no offence. Without the notices it would be answered at WAIT_S."""
    seq = [1]
    calls = make_keyed(seq, {B: "writer"})
    assert calls.grant_write(B, 7) >= 0

    async def commit_slowly():
        for _ in range(int(3 * cb.WAIT_S / (P.COMMITTING_S / 4))):  # three times the usual wait
            calls.committing(B)
            await trio.sleep(P.COMMITTING_S / 4)
        calls.ack(B, 2)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(commit_slowly)
        waited, _ = await settle_time(calls, 2, [7], [], writer=CLIENT_A)
    assert 3 * cb.WAIT_S - 0.1 < waited < 3 * cb.WAIT_S + 0.1, waited
    assert calls.timeouts == 0 and calls.late == 0 and calls.grant_write(B, 7) >= 0  # not barred


async def test_a_writer_that_stops_saying_it_is_committing_is_waited_for_committing_s_more_and_never_past_commit_wait(autojump_clock):
    for notices_until, expected in ((cb.WAIT_S + 2.0, cb.WAIT_S + 2.0 + P.COMMITTING_S), (float("inf"), P.COMMIT_WAIT_S)):
        seq = [1]
        calls = make_keyed(seq, {B: "writer"})
        calls.grant_write(B, 7)

        async def say_committing():
            start = trio.current_time()
            while trio.current_time() - start <= notices_until:
                calls.committing(B)
                await trio.sleep(P.COMMITTING_S / 4)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(say_committing)
            waited, _ = await settle_time(calls, 2, [7], [], writer=CLIENT_A)
            nursery.cancel_scope.cancel()
        assert abs(waited - expected) < 0.01 and calls.timeouts == 1, (notices_until, waited)


async def test_a_prompt_acknowledgement_is_no_offence(autojump_clock):
    seq = [1]
    calls = make_keyed(seq, {B: "honest"})
    calls.grant(B, 7, 1, b"f")

    async def ack_soon():
        await trio.sleep(cb.LATE_S / 2)
        calls.ack(B, 2)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ack_soon)
        await calls.settle(2, [7], [], writer=CLIENT_A)
    assert calls.late == 0 and calls.grant(B, 7, 1, b"f") == seq[0]  # not barred


async def test_the_writer_keeps_its_holding_of_a_file_it_changed_alone_but_not_through_a_name():
    """Issue 31: a stat after a write is answered by the writer's mount. Its own commit or setattr
    (no entry named) keeps its holding of the file, so another mount's later change still waits
    for it; its unlink (an entry named) ends it, so the file never stays an orphan for it."""
    seq = [3]
    calls = make(seq)
    calls.grant(A, 7, 1, b"f")  # A created 1/f (CreateReq with callback)
    with trio.fail_after(0.1):
        assert await calls.settle(4, [7], [], writer=CLIENT_A) == []  # its commit of 7
    assert calls.held(7)
    with trio.move_on_after(0.2) as scope:
        await calls.settle(5, [7], [], writer=CLIENT_B)  # B's change of 7 waits for A
    assert scope.cancelled_caught
    calls.ack(A, 5)
    with trio.fail_after(0.1):
        await calls.settle(5, [7], [], writer=CLIENT_B)
    assert not calls.held(7)
    seq[0] = 6
    calls.grant(A, 8, 1, b"g")
    with trio.fail_after(0.1):
        assert await calls.settle(7, [1, 8], [(1, b"g")], writer=CLIENT_A) == [8]  # its unlink of 1/g
    assert not calls.held(8)


async def test_a_write_mark_makes_others_reads_and_changes_wait_for_the_writer_and_ends_at_its_acknowledgement():
    """Closes that send nothing (daemon/callbacks.py, write marks): while A writes file 7 under its
    mark, B's read of it (``written_elsewhere``) and any change of it by another wait for A; A's own
    changes of it (its commits) do not, and keep the mark; A's acknowledgement of B's change ends it."""
    seq = [4]
    calls = make(seq)
    assert not calls.written_elsewhere(B, 7) and calls.marks == 0
    assert calls.grant_write(A, 7) == 4 and calls.marks == 1
    assert calls.written_elsewhere(B, 7) and not calls.written_elsewhere(A, 7)  # not its own reads
    assert not calls.held(7)  # a mark is not a cached file: it does not keep an unlinked one
    with trio.fail_after(0.1):
        await calls.settle(5, [7], [], writer=CLIENT_A)  # A's own commit: no wait
    assert calls.written_elsewhere(B, 7)  # ... and the mark stays
    done = []

    async def recall():  # B's read logs a change naming 7 on B's behalf
        done.append(await settle_time(calls, 6, [7], [], writer=CLIENT_B))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(recall)
        await trio.sleep(0.5)
        assert not done  # A has not acknowledged (it commits first)
        calls.ack(A, 6)
    assert done and not calls.written_elsewhere(B, 7) and calls.marks == 0  # ended with the change
    seq[0] = 6
    assert calls.grant_write(A, 7) == 6  # written again: marked again, as of now
    calls.forget_session(A)
    assert not calls.written_elsewhere(B, 7) and calls.marks == 0  # a session that ends takes its marks


async def test_a_dead_writer_is_not_waited_for_and_a_barred_one_gets_no_mark(autojump_clock):
    seq = [1]
    alive = {A, B}
    calls = make(seq, alive=alive.__contains__)
    calls.grant_write(A, 7)
    alive.discard(A)
    assert not calls.written_elsewhere(B, 7)  # a mark of a session gone is no reason to wait
    with trio.fail_after(0.1):
        await calls.settle(2, [7], [], writer=CLIENT_B)
    calls.grant_write(B, 8)
    calls.grant(B, 9, 1, b"f")
    alive.add(A)
    calls.grant(A, 9, 1, b"f")
    await calls.settle(3, [9], [], writer=0)  # nobody acknowledges: both run out and are penalised
    assert calls.grant_write(A, 7) == -1 and calls.grant_write(B, 8) == -1
    assert not calls.written_elsewhere(A, 8)  # B's mark went with its holdings


async def test_a_change_waiting_behind_an_earlier_one_ends_with_the_holders_acknowledgement_of_that_one(autojump_clock):
    """Two changes of a file B holds, 2 and 3, both waiting for B: B's mount ends its grant at event 2
    and acknowledges 2; at event 3 it holds nothing, so it never acknowledges 3
    (client/kernel_cache.py acknowledges only events that end a grant). B's acknowledgement of 2
    ended its holding, so change 3 must end with it, whichever of the two waiting changes looks
    first, instead of waiting WAIT_S (or a committing writer's notices) out and penalising B.
    (tests/cluster/test_failures.py's commit-held-up test met it: the reader's LOOKUP, handed to
    trio's path after client/thread_meta.py's 2 s, logged a second change naming the file.)"""
    for committing in (False, True) * 4:  # (trio wakes the two waiting changes in either order)
        seq = [1]
        calls = make(seq)
        if committing:
            assert calls.grant_write(B, 7) == 1  # B writes 7 with closes that send nothing
        else:
            assert calls.grant(B, 7, 1, b"f") == 1
        done = {}

        async def change(n):
            done[n] = await settle_time(calls, n, [7], [], writer=CLIENT_A)

        async def holder():
            if committing:  # B's commit is held up past WAIT_S (a stopped storage node): it says so
                for _ in range(int((cb.WAIT_S + 1.0) / (P.COMMITTING_S / 4))):
                    calls.committing(B)
                    await trio.sleep(P.COMMITTING_S / 4)
            else:
                await trio.sleep(0.5)
            calls.ack(B, 2)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(change, 2)
            await trio.sleep(0.1)
            nursery.start_soon(change, 3)
            nursery.start_soon(holder)
        assert done[3][0] < done[2][0], (committing, done)  # both ended at B's acknowledgement of 2
        assert calls.timeouts == 0 and calls.late == 0, committing  # and B was not penalised
        assert not calls.held(7) and not calls.written_elsewhere(A, 7)
