"""Capabilities (common/capability.py): pure parts, then a subtree key sending raw chunk requests
to a storage node of an in-process CURVE cluster (test_security.secure_cluster), then the mount's
data path (NodePool + CapStore) renewing its capabilities past their expiry."""

from __future__ import annotations

import os
import time
from contextlib import AsyncExitStack
from pathlib import Path

import msgspec
import pytest
import trio
import xxhash

from stripefs.client.data_rpc import NodePool
from stripefs.client.meta_rpc import MetaClient
from stripefs.common import protocol as P
from stripefs.common.capability import Capabilities, write_secret
from stripefs.common.errors import ErrorCode, QuietError
from stripefs.common.keyring import load_public
from test_security import ROOT, _code, secure_cluster
from util import eventually_async

# -- pure parts ---------------------------------------------------------------------------


def test_a_capability_verifies_only_as_issued(tmp_path):
    path = tmp_path / "cap_secret"
    write_secret(path)
    assert (path.stat().st_mode & 0o777) == 0o600
    caps = Capabilities(path, ttl_s=60)
    cap = caps.issue(7, True, "K" * 40)
    assert caps.verify(cap, 7, True, "K" * 40) is None
    assert caps.verify(cap, 7, False, "K" * 40) is None  # writing implies reading
    assert "no capability" in caps.verify(None, 7, False, "K" * 40)
    assert "inode 7, not 8" in caps.verify(cap, 8, False, "K" * 40)
    assert "another key" in caps.verify(cap, 7, False, "L" * 40)
    assert "expired" in caps.verify(cap, 7, False, "K" * 40, now=time.time() + 120)
    assert "signature" in caps.verify(msgspec.structs.replace(cap, expires=cap.expires + 3600), 7, False, "K" * 40)
    assert "signature" in caps.verify(msgspec.structs.replace(cap, ino=8), 8, False, "K" * 40)
    reader = caps.issue(7, False, "K" * 40)
    assert "reading only" in caps.verify(reader, 7, True, "K" * 40)
    assert "signature" in caps.verify(msgspec.structs.replace(reader, write=True), 7, True, "K" * 40)
    other = tmp_path / "other"
    write_secret(other)
    assert "signature" in Capabilities(other).verify(cap, 7, False, "K" * 40)  # another cluster's secret


def test_rotation_accepts_the_previous_secret_until_retired(tmp_path):
    path = tmp_path / "cap_secret"
    write_secret(path)
    old = Capabilities(path).issue(3, False, "K" * 40)
    with pytest.raises(QuietError, match="--rotate"):
        write_secret(path)
    write_secret(path, rotate=True)
    os.utime(path, ns=(1, 1))  # a re-read is noticed even within one clock tick
    caps = Capabilities(path, recheck_s=0)
    new = caps.issue(3, False, "K" * 40)
    assert new.mac != old.mac
    assert caps.verify(old, 3, False, "K" * 40) is None and caps.verify(new, 3, False, "K" * 40) is None
    write_secret(path, retire=True)
    os.utime(path, ns=(2, 2))
    assert "signature" in caps.verify(old, 3, False, "K" * 40)  # the running verifier re-read the file
    assert caps.verify(new, 3, False, "K" * 40) is None


def test_a_bad_secret_file_is_refused_with_what_to_do(tmp_path):
    path = tmp_path / "cap_secret"
    with pytest.raises(QuietError, match="cap_secret"):
        Capabilities(path)
    write_secret(path)
    path.chmod(0o644)
    with pytest.raises(QuietError, match="chmod 600"):
        Capabilities(path)
    path.chmod(0o600)
    path.write_text("not hex\n")
    with pytest.raises(QuietError, match="hex characters"):
        Capabilities(path)


# -- a subtree key at the storage node ---------------------------------------------------------


def _chunk_files(root: Path) -> dict[str, bytes]:
    return {str(p): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def _write(chunk, data, version, base=0, cap=None):
    return P.WriteChunkReq(chunk=chunk, version=version, base_version=base, offset=0,
                           xxh3=xxhash.xxh3_64_intdigest(data), replace=True, cap=cap)


async def test_a_subtree_key_needs_a_capability_for_every_chunk(tmp_path):
    async with secure_cluster(tmp_path) as c:
        team_pub = load_public(c.keys / "team.key")
        async with c.client("rw") as meta, c.client("rw", c.node) as node:
            team_a = (await meta.call(P.MkdirReq(parent=ROOT, name=b"team-a", mode=0o40755, uid=0, gid=0)))[0].attr
            team_b = (await meta.call(P.MkdirReq(parent=ROOT, name=b"team-b", mode=0o40755, uid=0, gid=0)))[0].attr
            opened = (await meta.call(P.CreateReq(parent=team_b.ino, name=b"secret", mode=0o100600, uid=0, gid=0, session_id=0)))[0]
            assert opened.cap is None  # an unrestricted key gets no capability...
            secret = P.ChunkId(opened.attr.ino, 0, 0)
            await node.call(_write(secret, b"team b's secret", 5), [b"team b's secret"])  # ...and needs none
            assert (await meta.call(P.CapsReq(inos=[secret.ino])))[0].caps == []
        async with c.client("team-b") as meta:  # the other team's own capability for its file
            await meta.call(P.HelloReq(host="h", pid=2))
            theirs = (await meta.call(P.OpenReq(ino=secret.ino, session_id=0)))[0].cap
            assert theirs is not None and theirs.ino == secret.ino
        before = _chunk_files(tmp_path / "node")
        async with c.client("team") as meta, c.client("team", c.node) as node:
            await meta.call(P.HelloReq(host="h", pid=1))
            created = (await meta.call(P.CreateReq(parent=team_a.ino, name=b"mine", mode=0o100644, uid=0, gid=0, session_id=0)))[0]
            mine = created.cap
            assert mine is not None and mine.ino == created.attr.ino and mine.write and mine.key == team_pub
            forged = Capabilities(c.cap_secret, ttl_s=-10).issue(secret.ino, True, team_pub)  # signed, but expired
            reader = Capabilities(c.cap_secret).issue(secret.ino, False, team_pub)
            tampered = msgspec.structs.replace(mine, ino=secret.ino)
            data = b"overwritten by team a"
            for cap in (None, mine, theirs, forged, tampered):  # guessed chunk id: none, another inode's, another key's...
                assert await _code(node.call(P.ReadChunkReq(chunk=secret, min_version=0, offset=0, length=100, cap=cap))) == ErrorCode.ACCESS
                assert await _code(node.call(P.StatChunkReq(chunk=secret, cap=cap))) == ErrorCode.ACCESS
                assert await _code(node.call(_write(secret, data, 9, cap=cap), [data])) == ErrorCode.ACCESS
                assert await _code(node.call(P.SyncChunksReq(chunks=[secret], caps=[cap] if cap else []))) == ErrorCode.ACCESS
                batch = P.WriteChunksReq(writes=[_write(secret, data, 9, cap=cap)], sync=True)
                assert await _code(node.call(batch, [data])) == ErrorCode.ACCESS
            assert await _code(node.call(_write(secret, data, 9, cap=reader), [data])) == ErrorCode.ACCESS  # read cap, a write
            own = P.ChunkId(created.attr.ino, 0, 0)
            both = P.ReadChunksReq(reads=[P.ReadChunkReq(chunk=own, min_version=0, offset=0, length=10, cap=mine),
                                          P.ReadChunkReq(chunk=secret, min_version=0, offset=0, length=10, cap=mine)])
            assert await _code(node.call(both)) == ErrorCode.ACCESS  # one uncovered read refuses the batch
            writes = P.WriteChunksReq(writes=[_write(own, data, 9, cap=mine), _write(secret, data, 9, cap=mine)])
            assert await _code(node.call(writes, [data, data])) == ErrorCode.ACCESS  # one uncovered write refuses the batch
            assert await _code(meta.call(P.CapsReq(inos=[secret.ino]))) == ErrorCode.ACCESS  # no capability for outside
            # its own file: everything works with the capability the daemon gave
            await node.call(_write(own, b"team a data", 3, cap=mine), [b"team a data"])
            rsp = (await node.call(P.WriteChunksReq(writes=[_write(own, b"team a data", 3, cap=mine)], sync=True), [b"team a data"]))[0]
            assert [(r.code, r.length) for r in rsp.results] == [(0, len(b"team a data"))]
            got = (await node.call(P.ReadChunkReq(chunk=own, min_version=0, offset=0, length=100, cap=mine)))[1][0]
            assert bytes(got) == b"team a data"
            assert (await node.call(P.StatChunkReq(chunk=own, cap=mine)))[0].length == len(b"team a data")
            await node.call(P.SyncChunksReq(chunks=[own], caps=[mine]))
            assert await _code(node.call(P.ReadChunkReq(chunk=own, min_version=0, offset=0, length=100))) == ErrorCode.ACCESS
            # every reply handing out chunk locations carries one
            assert (await meta.call(P.LookupReq(parent=team_a.ino, name=b"mine", open_info=True)))[0].cap.ino == own.ino
            listing = (await meta.call(P.ReaddirReq(ino=team_a.ino, open_info=True)))[0]
            assert [f.cap.ino for f in listing.files] == [own.ino]
            paths = (await meta.call(P.LookupPathsReq(root=team_a.ino, paths=[b"mine"])))[0]
            assert paths.files[0].cap.ino == own.ino
            alloc = (await meta.call(P.AllocChunksReq(ino=own.ino, indices=[1])))[0]
            assert alloc.cap.ino == own.ino and alloc.cap.write
            renewed = (await meta.call(P.CapsReq(inos=[own.ino])))[0].caps
            assert [c.ino for c in renewed] == [own.ino]
        assert {k: v for k, v in _chunk_files(tmp_path / "node").items() if k in before} == before  # nothing outside changed
        async with c.client("team-ro") as meta, c.client("team-ro", c.node) as node:  # read-only: a reading capability
            cap = (await meta.call(P.OpenReq(ino=own.ino, session_id=0)))[0].cap
            assert cap is not None and not cap.write
            assert bytes((await node.call(P.ReadChunkReq(chunk=own, min_version=0, offset=0, length=100, cap=cap)))[1][0]) == b"team a data"
            assert await _code(node.call(_write(own, b"x", 8, cap=cap), [b"x"])) == ErrorCode.READ_ONLY
        async with c.client("rw", c.node) as node:  # the other team's chunk is as it was
            assert bytes((await node.call(P.ReadChunkReq(chunk=secret, min_version=0, offset=0, length=100)))[1][0]) == b"team b's secret"


async def test_the_mount_data_path_renews_capabilities_past_their_expiry(tmp_path):
    async with secure_cluster(tmp_path, cap_ttl_s=1.5) as c:
        async with c.client("rw") as meta:
            team_a = (await meta.call(P.MkdirReq(parent=ROOT, name=b"team-a", mode=0o40755, uid=0, gid=0)))[0].attr
        async with AsyncExitStack() as stack:  # as client/mount.py opens them
            nursery = await stack.enter_async_context(trio.open_nursery())
            stack.callback(nursery.cancel_scope.cancel)
            ctx = c.context("team")
            meta = MetaClient(ctx, [c.meta], timeout=5.0)
            await meta.open(stack)
            nodes = NodePool(ctx, nursery, timeout=5.0, read_timeout=5.0)
            meta.caps, nodes.caps.meta = nodes.caps, meta  # as client/mount.py wires them
            nodes.learn([P.NodeAddr(1, c.node)])
            created = await meta.call(P.CreateReq(parent=team_a.ino, name=b"f", mode=0o100644, uid=0, gid=0, session_id=0))
            chunk = P.ChunkId(created.attr.ino, 0, 0)
            assert nodes.caps.active and nodes.caps.get(chunk.ino) == created.cap
            batched = await meta.call_batch([P.CreateReq(parent=team_a.ino, name=b"g%d" % i, mode=0o100644, uid=0, gid=0,
                                                         session_id=0) for i in range(2)])  # (client/async_dirops.py)
            assert [nodes.caps.get(r.attr.ino) for r in batched] == [r.cap for r in batched] and batched[0].cap
            await nodes.write(1, _write(chunk, b"hello", 2), b"hello")
            # once the capability has expired, the pool renews it before sending
            await eventually_async(lambda: time.time() > created.cap.expires, within=10, what="the capability expiring")
            assert bytes(await nodes.read(1, chunk, 0, 0, 100, last_try=True)) == b"hello"
            assert nodes.caps.get(chunk.ino).expires > created.cap.expires
            # a capability the node refuses (as after a secret rotation): renewed once on ACCESS, then retried
            nodes.caps._caps[chunk.ino] = (msgspec.structs.replace(nodes.caps.get(chunk.ino), mac=b"x" * 16), time.time() + 60)
            await nodes.write(1, _write(chunk, b"again", 3, base=2), b"again")
            await nodes.sync(1, [chunk])
            assert bytes(await nodes.read(1, chunk, 0, 0, 100, last_try=True)) == b"again"


def test_a_node_without_the_secret_refuses_subtree_keys_and_checks_nobody_else(tmp_path):
    from stripefs.common.errors import StripefsError
    from stripefs.common.keyring import Grant
    from stripefs.storage_node.access import check_caps

    team = Grant(name="team", public="K" * 40, role="client", subdir="/team-a")
    read = P.ReadChunkReq(chunk=P.ChunkId(5, 0, 0), min_version=0, offset=0, length=1)
    with pytest.raises(StripefsError, match="no cap_secret") as e:
        check_caps(None, team, read, 1)  # fails closed
    assert e.value.code == ErrorCode.ACCESS
    write_secret(tmp_path / "s")
    caps = Capabilities(tmp_path / "s")
    check_caps(caps, team, msgspec.structs.replace(read, cap=caps.issue(5, False, "K" * 40)), 1)
    check_caps(caps, team, P.PingReq(), 1)  # no chunk, nothing to show
    sync = P.SyncChunksReq(chunks=[P.ChunkId(5, 0, 0), P.ChunkId(6, 1, 0)], caps=[caps.issue(5, True, "K" * 40)])
    with pytest.raises(StripefsError, match="inode 6"):
        check_caps(caps, team, sync, 1)  # every inode of a sync needs its own
