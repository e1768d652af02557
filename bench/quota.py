"""Cost of directory quotas on the metadata hot path, in-process (no network, no fsync).

    .venv/bin/python bench/quota.py [--files 2000] [--rounds 3]

Times create + commit + unlink of N files three directories deep in the
Namespace over SQLite (synchronous=OFF: the SQL alone, which is what quotas add
to), with no quota and with one quota on the top directory, alternating, best
of ROUNDS each, and prints the ratio. A real create also pays a network round
trip and an fsync, so the end-to-end cost is smaller than this ratio shows.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from stripefs.common import protocol as P
from stripefs.daemon.db import open_database
from stripefs.daemon.health import NodeRegistry
from stripefs.daemon.namespace import Namespace
from stripefs.daemon.store import SqliteStore

LAYOUT = P.Layout(chunk_size=1 << 20, stripe_count=2, redundancy="replicas=2")


def in_process_namespace(path: Path):
    """(store, Namespace) over a new SQLite database at ``path``, with three storage nodes registered
    (no processes: placement only): the in-process benches' namespace (this one, bench/snapshot.py)."""
    store = SqliteStore(open_database(path, LAYOUT))
    nodes = NodeRegistry(store, node_timeout_s=10)
    for i in range(1, 4):
        nodes.register(P.RegisterNodeReq(
            node_id=i, address=f"tcp://127.0.0.1:{7100 + i}", host=f"h{i}",
            capacity_bytes=1 << 40, free_bytes=1 << 39, used_bytes=0, chunks=0,
        ))
    return store, Namespace(store, nodes)


def ops_per_s(files: int, with_quota: bool) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        store, ns = in_process_namespace(Path(tmp) / "meta.sqlite3")
        store.conn.execute("PRAGMA synchronous=OFF")
        top = ns.mkdir(1, b"a", 0o755, 0, 0).ino
        leaf = ns.mkdir(ns.mkdir(top, b"b", 0o755, 0, 0).ino, b"c", 0o755, 0, 0).ino
        if with_quota:
            ns.quotas.set(top, 1 << 50, 10**12)
        store.begin()
        start = time.perf_counter()
        for i in range(files):
            with store.savepoint():
                ino, _ = ns.create(leaf, b"f%d" % i, 0o644, 0, 0)
            with store.savepoint():
                ns.commit(ino, 1000, 0, [P.ChunkRef(index=0, version=5, nodes=[])])
        for i in range(files):
            with store.savepoint():
                ns.unlink(leaf, b"f%d" % i)
        elapsed = time.perf_counter() - start
        store.close()
    return 3 * files / elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    best = {False: 0.0, True: 0.0}
    for _ in range(args.rounds):
        for with_quota in (False, True):
            best[with_quota] = max(best[with_quota], ops_per_s(args.files, with_quota))
    print(f"metadata ops/s (create, commit, unlink), best of {args.rounds}:")
    print(f"  no quota            {best[False]:8.0f}")
    print(f"  quota 2 levels up   {best[True]:8.0f}   {best[True] / best[False]:.2f}x of no quota")


if __name__ == "__main__":
    main()
