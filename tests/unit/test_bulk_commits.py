"""A BatchReq's run of commits (a ``cp -r``'s files, written back together) runs in one savepoint
on SQLite (daemon/burst.py ``_commits``): one look-up and one insert of its OnceReq records, each
commit its own checks, outcome and change (its own number, in order); a refused commit undoes
the run and the commits run one by one, so it fails alone and is answered in order; a retried
batch is applied once. The same batches on PostgreSQL (commits one by one in the burst's
transaction) get the same answers."""

from __future__ import annotations

import pytest
import trio

from stripefs.common import protocol as P
from stripefs.common.config import MetaConfig
from stripefs.common.errors import ErrorCode
from stripefs.daemon.service import MetaService
from test_meta_burst import _create, _register
from test_security import ROOT
from util import free_address


async def _service(nursery, ctx, tmp_path, request, store: str) -> MetaService:
    extra = dict(store="postgresql", dsn=request.getfixturevalue("pg_dsn"), pool_size=4) if store == "postgresql" else {}
    config = MetaConfig(listen=free_address(), data_dir=str(tmp_path), chunk_size=1 << 20, stripe_count=1,
                        redundancy="replicas=1", **extra)
    service = MetaService(config, zmq_context=ctx)
    await nursery.start(service.run)
    await service.handle(_register(), [])
    return service


class _Lookups:
    """Counts the store's per-op look-ups of OnceReq records (``get_applied``) and their inserts."""

    def __init__(self, service: MetaService):
        self.single = self.inserts = 0
        store = service.store
        get, put = store.get_applied, store.put_applied

        def counted_get(*args):
            self.single += 1
            return get(*args)

        def counted_put(*args):
            self.inserts += 1
            return put(*args)

        store.get_applied, store.put_applied = counted_get, counted_put


def _commit(ino: int, size: int, version: int, op_id: int, extra=()) -> P.OnceReq:
    chunks = [P.ChunkRef(index=0, version=version, nodes=[1]), *extra]
    return P.OnceReq(client_id=9, op_id=op_id, done_below=1, body=P.CommitReq(ino=ino, size=size, mtime_ns=5, chunks=chunks))


async def _four_files(service: MetaService) -> list[int]:
    """Four empty files made in a new directory ``d``: their inodes."""
    d = (await service.handle(P.MkdirReq(parent=ROOT, name=b"d", mode=0o40755, uid=0, gid=0), [])).attr.ino
    return [(await service.handle(_create(b"f%d" % i, parent=d), [])).attr.ino for i in range(4)]


@pytest.mark.parametrize("store", ["sqlite", "postgresql"])
async def test_a_run_of_commits_is_answered_as_singles_and_a_retry_applied_once(tmp_path, ctx, request, store):
    async with trio.open_nursery() as nursery:
        service = await _service(nursery, ctx, tmp_path, request, store)
        inos = await _four_files(service)
        lookups = _Lookups(service)
        batch = P.BatchReq(items=[_commit(ino, 100 + i, 3, i + 1) for i, ino in enumerate(inos)])
        first = (await service.burst.run([(batch, None)]))[0].results
        assert all(isinstance(r, P.AttrRsp) for r in first), first
        assert [r.attr.size for r in first] == [100, 101, 102, 103]
        assert [r.attr.ino for r in first] == inos
        # each its own change, numbered in commit order (SQLite numbers them at once; PostgreSQL later)
        seqs = [r.seq for r in first]
        if store == "sqlite":
            assert seqs == list(range(seqs[0], seqs[0] + 4)) and seqs[0] > 0
            assert (lookups.single, lookups.inserts) == (0, 0)  # one look-up and one insert for the run
        for ino, size in zip(inos, (100, 101, 102, 103)):
            assert service.ns.getattr(ino).size == size

        # the replies were lost: the same batch again (answered from the records), a new commit after it
        retry = P.BatchReq(items=[*batch.items, _commit(inos[0], 200, 5, 5)])
        again = (await service.burst.run([(retry, None)]))[0].results
        assert [r.attr for r in again[:4]] == [r.attr for r in first]
        assert again[4].attr.size == 200 and service.ns.getattr(inos[0]).size == 200
        assert service.ns.getattr(inos[1]).size == 101
        if store == "sqlite":
            assert [r.seq for r in again[:4]] == [0, 0, 0, 0] and again[4].seq == seqs[-1] + 1  # nothing logged twice
            assert (lookups.single, lookups.inserts) == (0, 0)
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("store", ["sqlite", "postgresql"])
async def test_a_refused_commit_in_a_run_fails_alone_and_is_answered_in_order(tmp_path, ctx, request, store):
    async with trio.open_nursery() as nursery:
        service = await _service(nursery, ctx, tmp_path, request, store)
        inos = await _four_files(service)
        bad_chunk = P.ChunkRef(index=5, version=3, nodes=[])  # no placement and no nodes: INVALID after chunk 0's row
        items = [
            _commit(inos[0], 100, 3, 1),
            _commit(inos[1], 101, 3, 2, extra=[bad_chunk]),  # refused after writing chunk 0's row
            P.OnceReq(client_id=9, op_id=3, done_below=1,  # growth without its last chunk's version: refused first
                      body=P.CommitReq(ino=inos[2], size=102, mtime_ns=5, chunks=[])),
            _commit(inos[3], 103, 3, 4),
            _commit(999_999, 10, 3, 6),  # no such inode
        ]
        replies = (await service.burst.run([(P.BatchReq(items=items), None)]))[0].results
        assert [type(r).__name__ for r in replies] == ["AttrRsp", "ErrorRsp", "ErrorRsp", "AttrRsp", "ErrorRsp"]
        assert [replies[i].code for i in (1, 2, 4)] == [ErrorCode.INVALID, ErrorCode.INVALID, ErrorCode.NOT_FOUND]
        assert replies[0].attr.size == 100 and replies[3].attr.size == 103
        if store == "sqlite":
            assert 0 < replies[0].seq < replies[3].seq
        assert [service.ns.getattr(ino).size for ino in inos] == [100, 0, 0, 103]
        assert service.store.get_chunks(inos[1], [0])[0][0] == 0  # the refused commit left nothing
        # a refused op recorded nothing: sent again, fixed, it is applied
        fixed = P.BatchReq(items=[_commit(inos[1], 101, 3, 2), _commit(inos[2], 102, 3, 3)])
        ok = (await service.burst.run([(fixed, None)]))[0].results
        assert [r.attr.size for r in ok] == [101, 102]
        nursery.cancel_scope.cancel()
