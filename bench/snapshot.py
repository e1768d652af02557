"""What a directory snapshot costs (issue 34): metadata only, beside ``cp -r`` of the same tree on the local disk.

    .venv/bin/python bench/snapshot.py [--files 10000] [--size 4096] [--rounds 3]

Builds a tree of FILES one-chunk files in directories of 1,000 in the
Namespace over SQLite (the daemon's database file, synchronous=FULL: the
snapshot's COMMIT is fsynced, as the daemon's), and the same tree of real
SIZE-byte files on the local disk beside it. Per round it times ``stripefs
snapshot create``'s transaction (``Snapshots.create`` and its COMMIT) and a
``cp -r`` of the local tree followed by ``sync -f`` (a copy of the bytes: what
a snapshot without copy-on-write would cost), and prints each with the ratio.
Goal row (issue 34): a 10,000-file snapshot under 2 s. No chunk is read or
written by a snapshot: there are no storage nodes here at all, and
tests/inprocess/test_snapshot_ops.py counts the nodes' chunk files around one.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from quota import in_process_namespace  # bench/ is the script's directory
from stripefs.common import protocol as P
from stripefs.daemon.namespace import Namespace
from stripefs.daemon.store import SqliteStore

GOAL_S = 2.0
PER_DIR = 1000


def namespace(tmp: Path) -> tuple[SqliteStore, Namespace]:
    store, ns = in_process_namespace(tmp / "meta.sqlite3")
    ns.snapshots.load()
    return store, ns


def fill(store: SqliteStore, ns: Namespace, files: int, size: int) -> int:
    """The tree through the namespace's own create and commit; its top directory."""
    store.begin()
    top = ns.mkdir(1, b"dataset", 0o755, 0, 0).ino
    d = top
    for i in range(files):
        if i % PER_DIR == 0:
            d = ns.mkdir(top, b"shard-%d" % (i // PER_DIR), 0o755, 0, 0).ino
        ino, _ = ns.create(d, b"%06d.bin" % i, 0o644, 0, 0)
        ns.commit(ino, size, 0, [P.ChunkRef(index=0, version=5, nodes=[1, 2])])
    store.commit()
    return top


def local_tree(root: Path, files: int, size: int) -> Path:
    top = root / "dataset"
    payload = os.urandom(size)
    for i in range(files):
        d = top / f"shard-{i // PER_DIR}"
        if i % PER_DIR == 0:
            d.mkdir(parents=True)
        (d / f"{i:06d}.bin").write_bytes(payload)
    subprocess.run(["sync", "-f", str(top)], check=True)
    return top


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=10_000)
    ap.add_argument("--size", type=int, default=4096, help="bytes per file of the local tree (cp -r copies them)")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    print(f"load: {os.getloadavg()[0]:.1f} (1 min), {os.cpu_count()} cpus")
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as tmp:
        tmp = Path(tmp)
        store, ns = namespace(tmp)
        started = time.perf_counter()
        top = fill(store, ns, args.files, args.size)
        print(f"tree: {args.files} files in the namespace in {time.perf_counter() - started:.1f}s")
        local = local_tree(tmp / "local", args.files, args.size)
        snaps, copies = [], []
        for r in range(args.rounds):
            started = time.perf_counter()
            ns.snapshots.create(top, b"r%d" % r)
            store.commit()
            snaps.append(time.perf_counter() - started)
            target = tmp / "local" / f"copy-{r}"
            started = time.perf_counter()
            subprocess.run(["cp", "-r", str(local), str(target)], check=True)
            subprocess.run(["sync", "-f", str(target)], check=True)
            copies.append(time.perf_counter() - started)
            shutil.rmtree(target)
        store.close()
    best, worst = min(snaps), max(snaps)
    cp_best = min(copies)
    print(f"{'row':48} {'stripefs':>16} {'local disk':>16} {'ratio':>7}")
    print(f"{f'snapshot of {args.files} files (s, best..worst)':48} {f'{best:.2f}..{worst:.2f}':>16} "
          f"{f'{cp_best:.2f}..{max(copies):.2f}':>16} {cp_best / best:>6.1f}x  (local: cp -r + sync)")
    verdict = "PASS" if worst < GOAL_S else "BELOW"
    print(f"goal: a {args.files}-file snapshot under {GOAL_S:.0f} s: {worst:.2f} s worst of {args.rounds}  {verdict}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
