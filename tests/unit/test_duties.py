"""The duties lease (daemon/duties.py) against the real SQLite store.

Two ``Duties`` share one database as two daemons would share PostgreSQL: the
take/renew SQL decides, the state machine follows it, and a holder that stops
renewing is replaced within the lease's time.
"""

import math
import time

import pytest
import trio

from stripefs.common import protocol as P
from stripefs.daemon import duties as D
from stripefs.daemon.db import open_database
from stripefs.daemon.pg_store import open_pg_store
from stripefs.daemon.store import SqliteStore

S = 1_000_000_000


@pytest.fixture(params=["sqlite", "postgresql"])
def store(tmp_path, request):
    layout = P.Layout(1 << 20, 1, "replicas=1")
    if request.param == "sqlite":
        s = SqliteStore(open_database(tmp_path / "meta.sqlite3", layout))
    else:
        s = open_pg_store(request.getfixturevalue("pg_dsn"), layout, pool_size=2)
    yield s  # used outside transactions: one statement each (the service runs take_lease as one transaction)
    s.close()


def test_the_lease_sql_renews_for_its_holder_and_moves_only_once_expired(store):
    assert store.take_lease("duties", "a", 100 * S, 3 * S) == ("a", 103 * S, 1)
    assert store.take_lease("duties", "b", 101 * S, 3 * S) == ("a", 103 * S, 1)  # unexpired: b follows
    assert store.take_lease("duties", "a", 102 * S, 3 * S) == ("a", 105 * S, 1)  # renewed, same term
    assert store.take_lease("duties", "b", 104 * S, 3 * S) == ("a", 105 * S, 1)
    assert store.take_lease("duties", "b", 106 * S, 3 * S) == ("b", 109 * S, 2)  # a went silent: b takes it
    assert store.take_lease("duties", "a", 107 * S, 3 * S) == ("b", 109 * S, 2)  # and a cannot take it back
    store.release_lease("duties", "a")  # not a's to give
    assert store.get_lease("duties") == ("b", 109 * S, 2)
    store.release_lease("duties", "b")
    assert store.take_lease("duties", "a", 107 * S, 3 * S) == ("a", 110 * S, 3)


def test_a_holder_leads_until_its_renewal_deadline_and_not_after():
    d = D.Duties("a", shared=True, ttl_s=3.0)
    lost = []
    d.on_lost.append(lambda: lost.append(True))
    assert not d.leading and d.leader == ""
    d.apply(("a", 0, 1), started=10.0)
    assert d.leading and d.leader == "a" and d.term == 1
    d.expire(10.0 + 3.0 - D.MAX_SKEW_S - 0.01)
    assert d.leading and not lost
    d.expire(10.0 + 3.0 - D.MAX_SKEW_S)  # no renewal in time: stop before anyone may take it
    assert not d.leading and lost == [True]
    d.apply(("a", 0, 1), started=20.0)  # renewed after all
    assert d.leading
    d.apply(("b", 0, 2), started=21.0)  # the row says b: follow at once
    assert not d.leading and d.leader == "b" and lost == [True, True]


def test_sqlite_always_leads():
    d = D.Duties("only", shared=False)
    assert d.leading and d.leader == "only"
    d.expire(math.inf)
    assert d.leading


async def test_duties_move_to_the_other_daemon_when_the_holder_stops(store):
    dead = set()  # daemons whose database calls hang from now on (a frozen or cut-off process)

    def take_for(name_of):
        async def take(name, holder, now_ns, ttl_ns):
            if name_of in dead:  # stuck in a database call that cannot be abandoned
                await trio.to_thread.run_sync(time.sleep, 3.0)
            return store.take_lease(name, holder, now_ns, ttl_ns)
        return take

    async def release(name, holder):
        store.release_lease(name, holder)

    running = {"a": 0, "b": 0}
    overlap = []

    def duty(me, other):
        async def work():
            running[me] += 1
            while True:  # a duty never runs while the other daemon's does
                if others[other].leading:
                    overlap.append(me)
                await trio.sleep(0.01)
        return work

    a = D.Duties("a", shared=True, ttl_s=1.2, renew_s=0.2)
    b = D.Duties("b", shared=True, ttl_s=1.2, renew_s=0.2)
    others = {"a": a, "b": b}
    stopped = []
    a.on_lost.append(lambda: stopped.append(("a", b.leading)))
    with trio.fail_after(15):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(a.run, take_for("a"), release)
            nursery.start_soon(a.run_while_leading, [(duty("a", "b"), "duty-a")])
            while not a.leading:
                await trio.sleep(0.02)
            nursery.start_soon(b.run, take_for("b"), release)
            nursery.start_soon(b.run_while_leading, [(duty("b", "a"), "duty-b")])
            await trio.sleep(0.6)
            assert a.leading and not b.leading and b.leader == "a" and running == {"a": 1, "b": 0}
            dead.add("a")  # a stops renewing
            while not b.leading:
                await trio.sleep(0.02)
            assert stopped == [("a", False)]  # a stopped its duties before b could start its own
            while not running["b"]:  # its duty tasks start next
                await trio.sleep(0.02)
            assert not a.leading and b.term == a.term + 1
            assert store.get_lease("duties")[0] == "b" and not overlap
            nursery.cancel_scope.cancel()


def test_a_drain_made_through_another_daemon_is_adopted(tmp_path):
    from stripefs.daemon.health import NodeRegistry

    a_store = SqliteStore(open_database(tmp_path / "meta.sqlite3", P.Layout(1 << 20, 1, "replicas=1")))
    b_store = SqliteStore(open_database(tmp_path / "meta.sqlite3", P.Layout(1 << 20, 1, "replicas=1")))
    reg = P.RegisterNodeReq(node_id=3, address="tcp://n3:1", host="h3", capacity_bytes=1, free_bytes=1, used_bytes=0, chunks=0)
    a, b = NodeRegistry(a_store, 10.0), NodeRegistry(b_store, 10.0)
    a.register(reg, now=0.0)
    b.register(reg, now=0.0)  # the node heartbeats both daemons
    changes = []
    b.on_change = lambda node_id, old, new: changes.append((node_id, old, new))
    a.set_admin(3, "draining", now=1.0)  # the operator asked daemon a
    assert a.state(3) == "draining" and b.state(3) == "up"
    b.apply_admin_states(b.admin_states(), now=1.0)
    assert b.state(3) == "draining" and changes == [(3, "up", "draining")]
    a.set_admin(3, "", now=2.0)
    b.apply_admin_states(b.admin_states(), now=2.0)
    assert b.state(3) == "up"
    a_store.close()
    b_store.close()


async def test_renewals_come_once_a_period_not_in_a_busy_loop():
    """The renew loop waited on time.monotonic()'s deadline with trio's clock, whose origin is
    random: the deadline was always past and an idle daemon renewed ~800 times a second."""
    from stripefs.daemon.duties import Duties

    calls = []

    async def take(lease, holder, now_ns, ttl_ns):
        calls.append(now_ns)
        return holder, now_ns + ttl_ns, 1

    duties = Duties("a", shared=True, ttl_s=1.0, renew_s=0.2)
    with trio.move_on_after(0.5):
        await duties._renew_forever(take)
    assert 2 <= len(calls) <= 4, len(calls)
