"""SQL statements per commit of a BatchReq of commits (issue 31, daemon/burst.py ``_commits``), counted.

An in-process daemon on SQLite (no cluster, no timing): N files created in one directory, then
their commits (OnceReqs, one chunk each, as a mount's write-back sends them) in BatchReqs of
``--batch``; each ``SqlStore._x`` / ``_xm`` call counted by its statement's first words, and
SQLite's own statement runs (the trace callback: an executemany's rows each). ``--singles`` runs
the same commits as the daemon did before the runs (``Burst.commits_run`` off): the A/B. The
process's CPU per commit (the counting's own included) is printed too: load moves it.

    STRIPEFS_LOCAL_PORTS=... python bench/commit_sql_probe.py [--files 300] [--batch 30] [--singles]
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
import time
from pathlib import Path

import trio
import zmq

sys.path.insert(0, str(Path(__file__).parent.parent / "tests" / "unit"))
sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))
from stripefs.common import protocol as P  # noqa: E402
from stripefs.common.config import MetaConfig  # noqa: E402
from stripefs.daemon.service import MetaService  # noqa: E402
from util import free_address  # noqa: E402

ROOT = 1


async def main(args) -> None:
    ctx = zmq.Context()
    with tempfile.TemporaryDirectory() as tmp:
        config = MetaConfig(listen=free_address(), data_dir=tmp, chunk_size=1 << 20, stripe_count=1, redundancy="replicas=1")
        service = MetaService(config, zmq_context=ctx)
        async with trio.open_nursery() as nursery:
            await nursery.start(service.run)
            await service.handle(P.RegisterNodeReq(node_id=1, address="tcp://127.0.0.1:1", host="h", capacity_bytes=1 << 40,
                                                   free_bytes=1 << 39, used_bytes=0, chunks=0), [])
            d = (await service.handle(P.MkdirReq(parent=ROOT, name=b"d", mode=0o40755, uid=0, gid=0), [])).attr.ino
            inos = [(await service.handle(P.CreateReq(parent=d, name=b"f%d" % i, mode=0o100644, uid=0, gid=0, session_id=0), [])).attr.ino
                    for i in range(args.files)]
            if args.singles:
                service.burst.commits_run = None
            store = service.store
            calls: collections.Counter = collections.Counter()
            runs = [0]
            x, xm = store._x, store._xm

            def key(sql: str) -> str:
                return " ".join(sql.split()[:4])[:60]

            def cx(sql, params=()):
                calls[key(sql)] += 1
                return x(sql, params)

            def cxm(sql, rows):
                calls["(executemany) " + key(sql)] += 1
                return xm(sql, rows)

            store._x, store._xm = cx, cxm
            store.conn.set_trace_callback(lambda s: runs.__setitem__(0, runs[0] + 1))
            op = 1
            cpu = time.process_time()
            for start in range(0, len(inos), args.batch):
                items = []
                for ino in inos[start:start + args.batch]:
                    body = P.CommitReq(ino=ino, size=110 * 1024, mtime_ns=5, chunks=[P.ChunkRef(index=0, version=3, nodes=[1])])
                    items.append(P.OnceReq(client_id=9, op_id=op, done_below=max(1, op - 64), body=body))
                    op += 1
                replies = (await service.burst.run([(P.BatchReq(items=items), None)]))[0].results
                assert all(isinstance(r, P.AttrRsp) for r in replies), replies[:3]
            cpu = time.process_time() - cpu
            store.conn.set_trace_callback(None)
            n = len(inos)
            print(f"{'singles' if args.singles else 'runs'}: {n} commits in batches of {args.batch}; "
                  f"_x/_xm calls {sum(calls.values()) / n:.2f} a commit, SQLite statement runs {runs[0] / n:.2f} a commit; "
                  f"process CPU {cpu * 1e6 / n:.0f} us a commit (with the counting)")
            for k, v in calls.most_common():
                print(f"  {v / n:6.3f}  {k}")
            nursery.cancel_scope.cancel()
    ctx.term()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--files", type=int, default=300)
    ap.add_argument("--batch", type=int, default=30)
    ap.add_argument("--singles", action="store_true")
    trio.run(main, ap.parse_args())
