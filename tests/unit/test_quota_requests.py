"""Quota requests against a real metadata daemon process over real ZeroMQ.

Bad input gets an error code and the process stays up; usage and limits
survive kill -9 (they commit with the namespace changes).
"""

import os

import pytest

from stripefs.common import protocol as P
from stripefs.common.errors import ErrorCode, StripefsError
from stripefs.common.transport import connect
from test_meta_service import ROOT, _call, _register, daemon  # noqa: F401 (daemon: a fixture)


async def _code(client, req) -> ErrorCode:
    with pytest.raises(StripefsError) as info:
        await client.call(req)
    return info.value.code


async def test_quota_requests_errors_and_kill9(daemon, ctx):
    await daemon.wait_ready(ctx)
    async with connect(ctx, daemon.address, timeout=10) as c:
        await _call(c, _register())
        sid = (await _call(c, P.HelloReq(host="test", pid=os.getpid()))).session_id
        d = (await _call(c, P.MkdirReq(parent=ROOT, name=b"d", mode=0o755, uid=0, gid=0))).attr.ino
        free = await _call(c, P.CreateReq(parent=ROOT, name=b"free", mode=0o644, uid=0, gid=0, session_id=sid))
        assert free.quota_max_size == -1
        (q,) = (await _call(c, P.QuotaSetReq(ino=d, max_bytes=5000, max_inodes=2))).quotas
        assert (q.path, q.max_bytes, q.max_inodes, q.used_bytes, q.used_inodes) == (b"/d", 5000, 2, 0, 0)
        f = await _call(c, P.CreateReq(parent=d, name=b"f", mode=0o644, uid=0, gid=0, session_id=sid))
        assert f.quota_max_size == 5000
        await _call(c, P.CommitReq(ino=f.attr.ino, size=3000, mtime_ns=1, chunks=[P.ChunkRef(index=0, version=1, nodes=[])]))
        assert (await _call(c, P.QuotaRoomReq(ino=f.attr.ino))).max_size == 5000
        assert (await _call(c, P.OpenReq(ino=f.attr.ino, session_id=sid, write=True))).quota_max_size == 5000
        looked = await _call(c, P.LookupReq(parent=d, name=b"f", open_info=True, session_id=sid))
        assert looked.quota_max_size == 5000
        await _call(c, P.MkdirReq(parent=d, name=b"sub", mode=0o755, uid=0, gid=0))
        assert await _code(c, P.CreateReq(parent=d, name=b"g", mode=0o644, uid=0, gid=0, session_id=sid)) == ErrorCode.QUOTA_EXCEEDED
        assert await _code(c, P.QuotaSetReq(ino=f.attr.ino, max_bytes=1)) == ErrorCode.NOT_DIR
        assert await _code(c, P.QuotaSetReq(ino=99999, max_bytes=1)) == ErrorCode.NOT_FOUND
        assert await _code(c, P.QuotaSetReq(ino=d, max_inodes=-5)) == ErrorCode.INVALID
        assert await _code(c, P.QuotaSetReq(ino=d, max_bytes=1 << 63)) == ErrorCode.INVALID  # past SQLite's integers
        assert await _code(c, P.QuotaRoomReq(ino=d)) == ErrorCode.IS_DIR
        assert await _code(c, P.QuotaGetReq(ino=99999)) == ErrorCode.NOT_FOUND
        assert await _code(c, P.QuotaRecountReq(ino=ROOT)) == ErrorCode.NOT_FOUND  # no quota there
        status = await _call(c, P.StatusReq())
        assert [(q.path, q.used_bytes, q.used_inodes) for q in status.quotas] == [(b"/d", 3000, 2)]
    daemon.kill9()
    daemon.start()
    await daemon.wait_ready(ctx)
    async with connect(ctx, daemon.address, timeout=10) as c:
        got = (await _call(c, P.QuotaGetReq(ino=f.attr.ino))).quotas
        assert [(q.ino, q.used_bytes, q.used_inodes) for q in got] == [(d, 3000, 2)]
        rsp = await _call(c, P.QuotaRecountReq())
        assert rsp.corrected == [] and [q.ino for q in rsp.quotas] == [d]
        assert (await _call(c, P.QuotaSetReq(ino=d, max_bytes=0, max_inodes=0))).quotas == []
        assert (await _call(c, P.QuotaGetReq())).quotas == []
