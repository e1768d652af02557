"""What each key may see and hold beyond single requests (security review, issue 20).

Each test performs an attack of the review against an in-process CURVE cluster
(test_security.secure_cluster) with raw sockets, as a hostile key would: the
change feed, sessions, access to a file moved out of a subtree, the quotas in
StatusRsp, and storage node ids.
"""

from __future__ import annotations

import pytest
import trio
import zmq

from stripefs.common import protocol as P
from stripefs.common import security, zap
from stripefs.common.errors import ErrorCode, StripefsError
from stripefs.common.keyring import load_public
from stripefs.common.transport import open_socket
from test_security import ROOT, _code, secure_cluster


def _drop_key(c, name: str) -> None:
    """Remove ``name``'s entry from the cluster's keyring (re-read on its next use)."""
    path = c.keys / "keyring.toml"
    entries = path.read_text().split("[[key]]")
    path.write_text("[[key]]".join(e for e in entries if f'name = "{name}"' not in e))


# -- 1. the change feed ---------------------------------------------------------------------


class _Listener:
    """A raw SUB socket of one key on the daemon's change feed, recording what arrives."""

    def __init__(self, c, name: str, address: str):
        self.name, self.address, self.ctx = name, address, c.context(name)
        self.events: list[P.ChangeEvent] = []

    async def run(self, task_status=trio.TASK_STATUS_IGNORED):
        async with open_socket(self.ctx, zmq.SUB, connect=self.address) as sock:  # subscribes to everything
            task_status.started()
            while True:
                frames = await sock.recv_multipart()
                self.events.append(P.decode_event(frames[-1].bytes))

    def names(self) -> set[bytes]:
        return {name for e in self.events for _, name in e.entries}

    def changes(self) -> list[int]:
        return [e.seq for e in self.events if e.inodes or e.entries]


@pytest.mark.parametrize("store", ["sqlite", "postgresql"])
async def test_the_change_feed_tells_each_key_only_its_subtree_and_nothing_once_removed(tmp_path, store, request):
    settings = {"store": store, "dsn": request.getfixturevalue("pg_dsn")} if store == "postgresql" else {}
    async with secure_cluster(tmp_path, **settings) as c:
        async with c.client("rw") as meta, trio.open_nursery() as nursery:
            team_a = (await meta.call(P.MkdirReq(parent=ROOT, name=b"team-a", mode=0o40755, uid=0, gid=0)))[0].attr
            team_b = (await meta.call(P.MkdirReq(parent=ROOT, name=b"team-b", mode=0o40755, uid=0, gid=0)))[0].attr
            ping = (await meta.call(P.PingReq()))[0]
            feed = security.with_key(f"tcp://127.0.0.1:{ping.events_port}", load_public(c.keys / "meta.key"))
            who = {name: _Listener(c, name, feed) for name in ("team", "team-b", "rw", "node")}
            for listener in who.values():
                await nursery.start(listener.run)
            with trio.fail_after(10):  # subscribed: every key that may read the namespace hears a heartbeat
                while not all(who[name].events for name in ("team", "team-b", "rw")):
                    await trio.sleep(0.05)

            async def create(parent, name):
                f = (await meta.call(P.CreateReq(parent=parent, name=name, mode=0o100644, uid=0, gid=0, session_id=0)))[0].attr
                return f

            mine = await create(team_a.ino, b"a-plan.txt")
            secret = await create(team_b.ino, b"b-acquisition-target.txt")
            await meta.call(P.RenameReq(parent_old=team_b.ino, name_old=b"b-acquisition-target.txt",
                                        parent_new=team_b.ino, name_new=b"b-renamed.txt"))
            await meta.call(P.SetattrReq(ino=secret.ino, mode=0o100600))
            await meta.call(P.SetattrReq(ino=mine.ino, mode=0o100600))  # the last change
            team, other, whole = who["team"], who["team-b"], who["rw"]
            with trio.fail_after(10):
                while not (last := [e.seq for e in whole.events if mine.ino in e.inodes]):
                    await trio.sleep(0.05)
                while not all(w.events[-1].seq >= last[0] for w in (team, other)):
                    await trio.sleep(0.05)
            assert {b"a-plan.txt", b"b-acquisition-target.txt", b"b-renamed.txt"} <= whole.names()
            assert team.names() == {b"a-plan.txt"}  # not one of team b's names...
            assert other.names() == {b"b-acquisition-target.txt", b"b-renamed.txt"}
            assert secret.ino not in {i for e in team.events for i in e.inodes}  # ...nor its inode numbers
            assert mine.ino in {i for e in team.events for i in e.inodes}
            # every change is numbered for every key (an empty one where nothing is its own): no gaps
            for w in (team, other):
                seqs = [e.seq for e in w.events]
                assert all(b - a in (0, 1) for a, b in zip(seqs, seqs[1:])), seqs
            assert not who["node"].events  # a storage key reads no namespace

            # a key removed from the keyring hears nothing more on the connection it holds
            _drop_key(c, "team")
            heard = len(team.events)
            await create(team_a.ino, b"a-after-removal.txt")
            with trio.fail_after(10):
                while b"a-after-removal.txt" not in whole.names():
                    await trio.sleep(0.05)
            await trio.sleep(2 * P.EVENTS_HEARTBEAT_S)
            assert len(team.events) == heard, team.events[heard:]
            nursery.cancel_scope.cancel()


async def test_a_hostile_peer_cannot_shift_subscriptions_onto_its_connection(tmp_path):
    """libzmq 4.3 queues each subscription with its connection, but a message that is not one
    without: a key sending one ahead of another key's subscription, then subscribing itself,
    would have the other key's topic applied to its own connection."""
    from stripefs.common.keyring import Keyring, load_identity, write_keypair
    from stripefs.daemon import change_log
    from stripefs.daemon.events import ChangeFeed

    keys, lines = {}, []
    for name, subdir in (("server", ""), ("victim", "/team-a"), ("hostile", "/team-b")):
        write_keypair(tmp_path / name)
        keys[name] = load_public(tmp_path / f"{name}.key")
        lines += ["[[key]]", f'name = "{name}"', f'public = "{keys[name]}"', f'role = "{"meta" if name == "server" else "client"}"']
        lines += [f'subdir = "{subdir}"'] if subdir else []
    (tmp_path / "keyring.toml").write_text("\n".join(lines) + "\n")
    ring = Keyring(tmp_path / "keyring.toml")
    contexts = {name: zmq.Context() for name in keys}
    for name, ctx in contexts.items():
        security.use_identity(ctx, load_identity(tmp_path / f"{name}.key_secret"))
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(zap.run_zap, contexts["server"], ring.accepts)
            feed = ChangeFeed(contexts["server"], "tcp://127.0.0.1:0", "log", 0, ring)
            address = security.with_key(f"tcp://127.0.0.1:{feed.port}", keys["server"])
            hostile, victim = contexts["hostile"].socket(zmq.XSUB), contexts["victim"].socket(zmq.SUB)
            for sock in (hostile, victim):
                sock.setsockopt(zmq.LINGER, 0)
                sock.connect(security.secure_socket(sock.context, sock, connect=address))

            async def queued():  # let libzmq queue what arrived, without reading it
                await trio.sleep(0.3)
                feed._sock.getsockopt(zmq.EVENTS)

            await queued()
            hostile.send(b"\x07 not a subscription")
            await queued()
            victim.setsockopt(zmq.SUBSCRIBE, b"")
            await queued()
            hostile.send(b"\x01")  # its own subscription, queued after the victim's
            await queued()
            secret = [(5, b"victim-secret")]
            feed.publish([(1, change_log.encode([5], secret))], {"/team-a": {1: ([5], secret)}, "/team-b": {1: ([], [])}})
            await trio.sleep(0.3)
            got = []
            while hostile.poll(100):
                got.append(hostile.recv_multipart())
            assert not any(b"victim-secret" in frame for frames in got for frame in frames), got
            feed.close()
            hostile.close(0)
            victim.close(0)
            nursery.cancel_scope.cancel()
    finally:
        for ctx in contexts.values():
            ctx.destroy(linger=0)


# -- 3. access follows where a file is now -------------------------------------------------------


async def test_a_subtree_key_loses_a_file_it_renamed_once_an_admin_moves_it_out(tmp_path):
    async with secure_cluster(tmp_path) as c:
        async with c.client("rw") as admin:
            team_a = (await admin.call(P.MkdirReq(parent=ROOT, name=b"team-a", mode=0o40755, uid=0, gid=0)))[0].attr
            team_b = (await admin.call(P.MkdirReq(parent=ROOT, name=b"team-b", mode=0o40755, uid=0, gid=0)))[0].attr
            async with c.client("team") as team:
                sid = (await team.call(P.HelloReq(host="a", pid=1)))[0].session_id
                f = (await team.call(P.CreateReq(parent=team_a.ino, name=b"draft", mode=0o100644, uid=0, gid=0, session_id=0)))[0].attr
                await team.call(P.RenameReq(parent_old=team_a.ino, name_old=b"draft", parent_new=team_a.ino, name_new=b"final"))
                linked = (await team.call(P.CreateReq(parent=team_a.ino, name=b"shared", mode=0o100644, uid=0, gid=0, session_id=0)))[0].attr
                gone = (await team.call(P.CreateReq(parent=team_a.ino, name=b"scratch", mode=0o100644, uid=0, gid=0, session_id=sid)))[0].attr
                # the administrator hands both files to team b (one moved, one linked there, team a's name then removed)
                await admin.call(P.RenameReq(parent_old=team_a.ino, name_old=b"final", parent_new=team_b.ino, name_new=b"final"))
                await admin.call(P.LinkReq(ino=linked.ino, new_parent=team_b.ino, new_name=b"shared"))
                await team.call(P.UnlinkReq(parent=team_a.ino, name=b"shared"))
                for ino in (f.ino, linked.ino):
                    for req in (P.OpenReq(ino=ino, session_id=0, write=True), P.SetattrReq(ino=ino, mode=0o100666),
                                P.CapsReq(inos=[ino]), P.GetattrReq(ino=ino), P.AllocChunksReq(ino=ino, indices=[0])):
                        assert await _code(team.call(req)) == ErrorCode.ACCESS, (ino, req)
                # a file it unlinked with no other name (open here) stays its own
                await team.call(P.UnlinkReq(parent=team_a.ino, name=b"scratch"))
                assert (await team.call(P.GetattrReq(ino=gone.ino)))[0].attr.nlink == 0
                assert (await team.call(P.CapsReq(inos=[gone.ino])))[0].caps[0].ino == gone.ino
            assert (await admin.call(P.GetattrReq(ino=f.ino)))[0].attr.mode & 0o777 == 0o644  # team b's file, unchanged


# -- 2. sessions belong to their key -----------------------------------------------------------


async def test_no_key_can_take_over_another_keys_session(tmp_path):
    async with secure_cluster(tmp_path) as c:
        async with c.client("rw") as admin:
            team_a = (await admin.call(P.MkdirReq(parent=ROOT, name=b"team-a", mode=0o40755, uid=0, gid=0)))[0].attr
            team_b = (await admin.call(P.MkdirReq(parent=ROOT, name=b"team-b", mode=0o40755, uid=0, gid=0)))[0].attr
            listed = (await admin.call(P.CreateReq(parent=team_b.ino, name=b"listed", mode=0o100644, uid=0, gid=0, session_id=0)))[0].attr
        async with c.client("team-b") as victim, c.client("team") as team, c.client("ro") as ro:
            sids = [(await victim.call(P.HelloReq(host="b", pid=i)))[0].session_id for i in range(3)]
            sid = sids[0]
            assert all(0 < s < 2**63 for s in sids) and sorted(b - a for a, b in zip(sids, sids[1:])) != [1, 1]
            # team b reads a file that someone then unlinks: open, so its data stays
            f = (await victim.call(P.CreateReq(parent=team_b.ino, name=b"checkpoint", mode=0o100644, uid=0, gid=0, session_id=sid)))[0].attr
            await victim.call(P.UnlinkReq(parent=team_b.ino, name=b"checkpoint"))
            for thief in (team, ro):  # another team's key, and a read-only key, name team b's session
                assert await _code(thief.call(P.SessionHeartbeatReq(session_id=sid, open_inodes=[]))) == ErrorCode.ACCESS
                assert await _code(thief.call(P.CloseReq(session_id=sid, ino=f.ino))) == ErrorCode.ACCESS
                assert await _code(thief.call(P.SessionEndReq(session_id=sid))) == ErrorCode.ACCESS
            assert await _code(ro.call(P.OpenReq(ino=listed.ino, session_id=sid))) == ErrorCode.ACCESS
            assert await _code(ro.call(P.LookupReq(parent=team_b.ino, name=b"listed", open_info=True, session_id=sid))) == ErrorCode.ACCESS
            assert (await victim.call(P.GetattrReq(ino=f.ino)))[0].attr.nlink == 0  # still there for its reader
            await victim.call(P.SessionHeartbeatReq(session_id=sid, open_inodes=[f.ino]))  # and its own key keeps it
            # a session this daemon does not know (it restarted) is adopted by the key naming it, for that key only
            unknown = 123_456_789
            await team.call(P.OpenReq(ino=team_a.ino, session_id=unknown))
            assert await _code(ro.call(P.OpenReq(ino=listed.ino, session_id=unknown))) == ErrorCode.ACCESS
            await team.call(P.SessionHeartbeatReq(session_id=unknown, open_inodes=[]))
            # a subtree key cannot hold another team's files open through its own session
            mine = (await team.call(P.HelloReq(host="a", pid=1)))[0].session_id
            await team.call(P.SessionHeartbeatReq(session_id=mine, open_inodes=[listed.ino]))
        async with c.client("rw") as admin:
            await admin.call(P.UnlinkReq(parent=team_b.ino, name=b"listed"))
            assert await _code(admin.call(P.GetattrReq(ino=listed.ino))) == ErrorCode.NOT_FOUND  # nobody held it


# -- 4. quotas in StatusRsp ---------------------------------------------------------------------


async def test_status_shows_a_subtree_key_only_its_own_quotas_and_a_storage_key_none(tmp_path):
    async with secure_cluster(tmp_path) as c:
        async with c.client("admin") as admin:
            async def mkdir(parent, name):
                return (await admin.call(P.MkdirReq(parent=parent, name=name, mode=0o40755, uid=0, gid=0)))[0].attr.ino

            made = {"team-a": await mkdir(ROOT, b"team-a"), "team-b": await mkdir(ROOT, b"team-b")}
            made["proj"] = await mkdir(made["team-a"], b"proj")
            made["acquisition-x"] = await mkdir(made["team-b"], b"acquisition-x")
            for ino in (ROOT, made["team-a"], made["proj"], made["acquisition-x"]):
                await admin.call(P.QuotaSetReq(ino=ino, max_bytes=1 << 30))
            everything = {q.path for q in (await admin.call(P.StatusReq()))[0].quotas}
            assert everything == {b"/", b"/team-a", b"/team-a/proj", b"/team-b/acquisition-x"}
        async with c.client("team") as team:
            assert {(q.ino, q.path) for q in (await team.call(P.StatusReq()))[0].quotas} == {
                (made["team-a"], b"/"), (made["proj"], b"/proj")}
        async with c.client("node") as node:
            status = (await node.call(P.StatusReq()))[0]
            assert status.quotas == [] and status.nodes  # the rest of the status is still there


# -- 5. storage node ids ------------------------------------------------------------------------


def _set_node_ids(c, name: str, n: int) -> None:
    path = c.keys / "keyring.toml"
    text = path.read_text().replace(f'name = "{name}"\n', f'name = "{name}"\nnode_ids = {n}\n', 1)
    path.write_text(text)


async def test_a_storage_key_holds_a_bounded_number_of_node_ids_and_silent_ones_get_no_data(tmp_path, monkeypatch):
    from stripefs.daemon import service

    monkeypatch.setattr(service, "NODE_PING_TIMEOUT_S", 0.3, raising=False)  # the fake nodes never answer
    async with secure_cluster(tmp_path) as c:
        mine = load_public(c.keys / "node2.key")
        usage = dict(capacity_bytes=1 << 40, free_bytes=1 << 40, used_bytes=0, chunks=0)

        def register(node_id):  # an address with its own key, where nothing answers
            return P.RegisterNodeReq(node_id=node_id, address=security.with_key("tcp://127.0.0.1:1", mine),
                                     host=f"fake{node_id}", **usage)

        async with c.client("node2") as meta:
            accepted = []

            async def attempt(node_id):  # all at once: each waits for its ping meanwhile
                try:
                    await meta.call(register(node_id))
                    accepted.append(node_id)
                except StripefsError as exc:
                    assert exc.code == ErrorCode.ACCESS

            async with trio.open_nursery() as nursery:
                for node_id in range(2, 22):
                    nursery.start_soon(attempt, node_id)
            assert len(accepted) == 1, accepted  # its first id only
            held = accepted[0]
            await meta.call(register(held))  # registering it again is fine
            refused = [await _code(meta.call(register(i))) for i in range(22, 122)]
            assert refused == [ErrorCode.ACCESS] * 100
        async with c.client("admin") as admin:
            nodes = {n.node_id: n for n in (await admin.call(P.StatusReq()))[0].nodes}
            assert sorted(nodes) == [1, held]
            # node 2 never answered: nothing is placed on it, however many files are made
            for i in range(24):
                opened = (await admin.call(P.CreateReq(parent=ROOT, name=b"f%d" % i, mode=0o100644, uid=0, gid=0, session_id=0)))[0]
                assert {ref.node_id for ref in opened.nodes} == {1}, opened.nodes
            await admin.call(P.NodeAdminReq(node_id=held, action="remove"))  # an operator frees its id
        _set_node_ids(c, "node2", 2)  # and the keyring may allow more
        async with c.client("node2") as meta:
            await meta.call(register(200))
            await meta.call(register(201))
            assert await _code(meta.call(register(202))) == ErrorCode.ACCESS
