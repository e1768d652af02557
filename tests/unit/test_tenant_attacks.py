"""Security review, round 3 (issue 28): what a hostile key holder did to another tenant, done again.

Each test performs an attack of the review against an in-process CURVE cluster
(test_security.secure_cluster) with raw sockets, as the hostile key did, and
checks that it no longer works: another key's stored retry results (read or
planted), the change feed's writer field, the capability signed for a reply's
inode, and callbacks held by a key that never (or only just) acknowledges.
"""

from __future__ import annotations

import random
import statistics

import pytest
import trio

from stripefs.common import protocol as P
from stripefs.common import security
from stripefs.common.errors import ErrorCode
from stripefs.common.keyring import load_public
from stripefs.daemon import applied_ops
from stripefs.daemon import callbacks as cb
from test_key_scopes import _Listener
from test_security import ROOT, _code, secure_cluster


def _create(parent: int, name: bytes, session_id: int = 0, mode: int = 0o100600) -> P.CreateReq:
    return P.CreateReq(parent=parent, name=name, mode=mode, uid=1000, gid=1000, session_id=session_id)


async def _tenants(c) -> tuple[P.Attr, P.Attr, P.Attr]:
    """/team-a, /team-a/private (0700) and /team-b, made by an unrestricted key."""
    async with c.client("rw") as admin:
        mkdir = lambda parent, name, mode: admin.call(P.MkdirReq(parent=parent, name=name, mode=mode, uid=1000, gid=1000))
        team_a = (await mkdir(ROOT, b"team-a", 0o40755))[0].attr
        private = (await mkdir(team_a.ino, b"private", 0o40700))[0].attr
        team_b = (await mkdir(ROOT, b"team-b", 0o40755))[0].attr
    return team_a, private, team_b


async def test_a_key_can_neither_read_nor_plant_another_keys_retry_results(tmp_path):
    async with secure_cluster(tmp_path) as c:
        _, private, team_b = await _tenants(c)
        victim_id = random.getrandbits(63) or 1  # the victim mount's OnceReq client id, learnt somehow
        async with c.client("team") as victim, c.client("team-b") as attacker:
            session = (await victim.call(P.HelloReq(host="a", pid=1, client_id=victim_id)))[0].session_id
            secret = (await victim.call(P.OnceReq(client_id=victim_id, op_id=1, done_below=1,
                                                  body=_create(private.ino, b"secret.txt", session))))[0]
            assert secret.cap is not None and secret.cap.ino == secret.attr.ino
            # replaying the victim's op 1 under its id gives the attacker a create of its own, never the
            # victim's stored reply (nor a capability for the victim's file)
            replay = (await attacker.call(P.OnceReq(client_id=victim_id, op_id=1, done_below=1,
                                                    body=_create(team_b.ino, b"replay"))))[0]
            assert replay.attr.ino != secret.attr.ino and replay.cap.ino == replay.attr.ino
            # planting op 2 before the victim uses it: the victim's op 2 is still its own create
            planted = (await attacker.call(P.OnceReq(client_id=victim_id, op_id=2, done_below=1,
                                                     body=_create(team_b.ino, b"trap"))))[0]
            new = (await victim.call(P.OnceReq(client_id=victim_id, op_id=2, done_below=2,
                                               body=_create(private.ino, b"new.txt", session))))[0]
            assert new.attr.ino != planted.attr.ino
            # and the victim's own retry of op 2 still answers what op 2 answered (retries keep working)
            again = (await victim.call(P.OnceReq(client_id=victim_id, op_id=2, done_below=2,
                                                 body=_create(private.ino, b"new.txt", session))))[0]
            assert again.attr.ino == new.attr.ino
        async with c.client("rw") as admin:
            assert (await admin.call(P.LookupReq(parent=private.ino, name=b"new.txt")))[0].attr.ino == new.attr.ino
            assert await _code(admin.call(P.LookupReq(parent=team_b.ino, name=b"secret.txt"))) == ErrorCode.NOT_FOUND


async def test_a_reply_naming_an_inode_outside_the_subtree_gets_no_capability(tmp_path, monkeypatch):
    """The second wall: even if a stored result of another key were found again (as before the
    fix, simulated by binding client ids to no key), the daemon signs no capability for an inode
    outside the requesting key's subtree: the request is refused."""
    monkeypatch.setattr(applied_ops, "bind", lambda client_id, key: client_id)  # the hole of the review
    async with secure_cluster(tmp_path) as c:
        _, private, team_b = await _tenants(c)
        victim_id = random.getrandbits(63) or 1
        async with c.client("team") as victim, c.client("team-b") as attacker:
            await victim.call(P.OnceReq(client_id=victim_id, op_id=1, done_below=1, body=_create(private.ino, b"secret.txt")))
            assert await _code(attacker.call(P.OnceReq(client_id=victim_id, op_id=1, done_below=1,
                                                       body=_create(team_b.ino, b"replay")))) == ErrorCode.ACCESS


async def test_the_feed_names_writers_by_a_tag_that_is_not_their_client_id_and_not_to_other_subtrees(tmp_path):
    async with secure_cluster(tmp_path) as c:
        team_a, _, _ = await _tenants(c)
        victim_id = random.getrandbits(63) or 1
        async with c.client("team") as victim, c.client("rw") as admin, trio.open_nursery() as nursery:
            hello = (await victim.call(P.HelloReq(host="a", pid=1, client_id=victim_id)))[0]
            assert hello.writer and hello.writer != victim_id
            ping = (await admin.call(P.PingReq()))[0]
            feed = security.with_key(f"tcp://127.0.0.1:{ping.events_port}", load_public(c.keys / "meta.key"))
            listeners = {name: _Listener(c, name, feed) for name in ("rw", "team-b", "team")}
            for listener in listeners.values():
                await nursery.start(listener.run)
            with trio.fail_after(10):
                while not all(w.events for w in listeners.values()):
                    await trio.sleep(0.05)
            await victim.call(P.OnceReq(client_id=victim_id, op_id=1, done_below=1,
                                          body=_create(team_a.ino, b"f", hello.session_id)))
            with trio.fail_after(10):
                made_it = lambda e: (team_a.ino, b"f") in [tuple(x) for x in e.entries]  # noqa: E731
                while not [e for e in listeners["rw"].events if made_it(e)]:
                    await trio.sleep(0.05)
                seq = next(e.seq for e in listeners["rw"].events if made_it(e))
                while not all(w.events[-1].seq >= seq for w in listeners.values()):
                    await trio.sleep(0.05)
            told = {name: next(e for e in w.events if e.seq == seq) for name, w in listeners.items()}
            assert told["rw"].writer == hello.writer  # whoever may see the change hears who made it...
            assert told["team"].writer == hello.writer  # (the victim's own mount keeps its caches by it)
            other = told["team-b"]
            assert (other.inodes, other.entries, other.writer) == ([], [], 0)  # ...another subtree nothing at all
            assert victim_id not in {e.writer for w in listeners.values() for e in w.events}
            nursery.cancel_scope.cancel()


async def _hold_team_a(c, hostile, team_a: P.Attr) -> int:
    """A session of ``hostile``'s key holding every name of /team-a under a callback; its id."""
    hello = (await hostile.call(P.HelloReq(host="h", pid=2, client_id=random.getrandbits(63) or 1)))[0]
    rsp = (await hostile.call(P.ReaddirReq(ino=team_a.ino, session_id=hello.session_id, callback=True)))[0]
    return hello.session_id if rsp.dir_callback >= 0 else 0


async def _touch_times(victim, team_a: P.Attr, prefix: bytes, n: int) -> list[float]:
    times = []
    for i in range(n):
        start = trio.current_time()
        await victim.call(_create(team_a.ino, b"%s-%d" % (prefix, i), mode=0o100644))
        times.append(trio.current_time() - start)
    return times


@pytest.mark.parametrize("attack", ["never acknowledges", "acknowledges just in time"])
async def test_a_key_holding_callbacks_cannot_make_another_tenants_changes_wait(tmp_path, attack):
    async with secure_cluster(tmp_path) as c:
        team_a, _, _ = await _tenants(c)
        async with c.client("rw") as victim, c.client("ro") as hostile, trio.open_nursery() as nursery:
            baseline = statistics.median(await _touch_times(victim, team_a, b"base", 5))
            held = await _hold_team_a(c, hostile, team_a)
            assert held  # a read-only key may hold callbacks on what it reads
            if attack == "acknowledges just in time":
                async def ack_late():  # acknowledge every change just inside the wait
                    while True:
                        await trio.sleep(cb.WAIT_S - 0.5)
                        await hostile.call(P.AckReq(session_id=held, seq=P.INT64_MAX // 2))

                nursery.start_soon(ack_late)
            first = (await _touch_times(victim, team_a, b"first", 1))[0]
            assert first > cb.LATE_S  # the first offence costs one wait...
            # ...and none after it: not with the sessions it has, nor with a fresh HelloReq per round
            for _ in range(3):
                assert not await _hold_team_a(c, hostile, team_a)
            after = statistics.median(await _touch_times(victim, team_a, b"after", 5))
            print(f"\n{attack}: touch without attacker {baseline * 1e3:.1f} ms, first offence {first * 1e3:.0f} ms, after {after * 1e3:.1f} ms")
            assert after < max(2 * baseline, 0.25), (baseline, first, after)
            nursery.cancel_scope.cancel()


async def test_a_subtree_key_sees_only_its_own_tier_policies_and_cannot_administer_tiers(tmp_path):
    async with secure_cluster(tmp_path) as c:
        team_a, private, team_b = await _tenants(c)
        c.service.store.add_tier("cold", "cluster-bucket", "pre/", "http://10.1.2.3:9000", "eu-1", 1)  # no S3 to probe here
        async with c.client("admin") as admin:
            for ino in (private.ino, team_b.ino, ROOT):
                await admin.call(P.TierPolicySetReq(ino=ino, tier="cold", after_s=3600))
            whole = (await admin.call(P.TierListReq()))[0]
        assert {p.path for p in whole.policies} == {b"/team-a/private", b"/team-b", b"/"}
        assert whole.tiers[0].endpoint == "http://10.1.2.3:9000"
        for who in ("team", "team-admin"):
            async with c.client(who) as meta:
                seen = (await meta.call(P.TierListReq()))[0]
                assert [(p.ino, p.path) for p in seen.policies] == [(private.ino, b"/private")], who
                assert [(t.name, t.url, t.endpoint, t.region) for t in seen.tiers] == [("cold", "", "", "")], who
        async with c.client("team-admin") as team_admin:
            # where the cluster's data goes, and what is deleted from its buckets, is no team's to say
            assert await _code(team_admin.call(P.TierAddReq(name="mine", url="s3://any-bucket/x",
                                                            endpoint="http://attacker:9000"))) == ErrorCode.ACCESS
            assert await _code(team_admin.call(P.TierFsckReq(repair=True))) == ErrorCode.ACCESS
            # its own subtree's policy is still its to set, and what it gets back is filtered too
            rsp = (await team_admin.call(P.TierPolicySetReq(ino=team_a.ino, tier="cold", after_s=60)))[0]
            assert sorted(p.path for p in rsp.policies) == [b"/", b"/private"]
            assert await _code(team_admin.call(P.TierPolicySetReq(ino=team_b.ino, tier="", after_s=0))) == ErrorCode.ACCESS


def test_a_tier_credentials_file_readable_by_others_is_refused(tmp_path):
    from stripefs.common.config import MetaConfig
    from stripefs.common.errors import QuietError
    from stripefs.daemon.service import MetaService

    creds = tmp_path / "credentials"
    creds.write_text("[default]\naws_access_key_id = a\naws_secret_access_key = b\n")
    creds.chmod(0o644)
    service = MetaService(MetaConfig(data_dir=str(tmp_path), tier_credentials=str(creds)))
    with pytest.raises(QuietError, match="chmod 600"):
        service.open()
    creds.chmod(0o600)
    service.open()
    service.store.close()
