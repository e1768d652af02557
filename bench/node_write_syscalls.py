#!/usr/bin/env python3
"""File system calls per storage-node operation, counted with strace (issue 35, the node's write path).

A storage node's kernel time is mostly its chunk files' system calls (docs/design.md, "The storage
node's write path"). This runs ChunkStore alone (no sockets, no threads but its own) through each
case a model-tester run makes, ``--n`` times each on fresh chunks, every case in a child process
under ``strace -f -c``, and prints the file system calls per operation by name. Counts do not move
with the machine's load, so they compare two commits exactly:

    .venv/bin/python bench/node_write_syscalls.py [--n 192] [--size 16384] [--cpu]

``--cpu``: the process's CPU per operation instead (os.times around the operations, no strace;
clock ticks of 10 ms, so use --n 2000 or more).

Cases (an EC fragment or a replicated chunk alike: a chunk part in the slot of its version):

* ``merge, new slot``: a partial write of version 3 over the committed version 2 in the other slot,
  the version's slot empty (a parity delta's column write, a first write of a session);
* ``merge, slot holds garbage``: the same with an old version's copy left in the slot (not yet
  collected): the model tester's commonest write;
* ``merge, own copy``: a second range of the same session (version 3 already in the slot);
* ``replace, new slot`` / ``replace, slot holds garbage``: a whole-fragment write;
* ``delete, bounded``: the collector's DeleteChunksReq of all parts with a version bound (16 chunks of
  one inode per request, each with a copy in both slots, one of them newer than the bound);
* ``read``: a whole small copy from offset 0.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FILE_CALLS = {
    "openat", "open", "close", "newfstatat", "fstat", "stat", "statfs", "fstatfs", "pread64", "preadv2", "read",
    "writev", "write", "pwrite64", "rename", "renameat", "renameat2", "unlink", "unlinkat", "getdents64", "fsync",
    "fdatasync", "mkdir", "mkdirat", "lseek", "linkat",
}
CASES = ["merge, new slot", "merge, slot holds garbage", "merge, own copy", "replace, new slot",
         "replace, slot holds garbage", "delete, bounded", "read"]


def run_case(case: str, n: int, size: int, data_dir: str) -> None:
    """The child: with SETUP=1 store what the case needs on ``n`` chunks (not counted), else run
    the case's operations (``count`` traces this run and an empty one)."""
    sys.path.insert(0, str(ROOT))
    from stripefs.common.protocol import ChunkId
    from stripefs.storage_node.chunk_store import ChunkStore

    payload = os.urandom(size)
    piece = payload[: size // 4]
    with ChunkStore(data_dir, block_size=64 << 10, reserved_space=0) as store:
        ops = []
        for i in range(n):
            committed, slot = ChunkId(7, i, 0), ChunkId(7, i, 32)
            if os.environ.get("SETUP") == "1":
                store.write(committed, 2, 0, 0, payload, replace=True)
                if case.endswith("garbage") or case == "delete, bounded":
                    store.write(slot, 1, 0, 0, payload, replace=True)
                if case == "merge, own copy":
                    store.write(slot, 3, 2, 0, piece)
                continue
            if case.startswith("merge"):
                ops.append(lambda c=slot: store.write(c, 3, 2, size // 2, piece))
            elif case.startswith("replace"):
                ops.append(lambda c=slot: store.write(c, 3, 0, 0, payload, replace=True))
            elif case == "read":
                ops.append(lambda c=committed: store.read(c, 2, 0, size))
            elif case == "delete, bounded" and i % 16 == 0:
                batch = [ChunkId(7, j, 0) for j in range(i, min(i + 16, n))]
                ops.append(lambda b=batch: store.delete(b, all_parts=True, max_versions=[1] * len(b)))
        t0 = os.times()
        for op in ops:
            op()
        t1 = os.times()
        if ops and os.environ.get("CPU_OUT"):
            with open(os.environ["CPU_OUT"], "w") as f:
                f.write(f"{t1.user - t0.user} {t1.system - t0.system} {len(ops)}\n")


def count(case: str, n: int, size: int) -> dict[str, float]:
    """Per-operation file system calls of ``case``: strace of the operations' child less strace of
    a child that only opens the store (start-up and interpreter calls cancel out)."""
    totals = []
    with tempfile.TemporaryDirectory(prefix="stripefs-syscalls-") as tmp:
        data_dir = os.path.join(tmp, "data")
        os.mkdir(data_dir)
        env = dict(os.environ, SETUP="1")
        subprocess.run([sys.executable, __file__, "--child", case, "--n", str(n), "--size", str(size), "--dir", data_dir],
                       env=env, check=True)
        for child_case, child_n in ((case, 0), (case, n)):  # the empty run first: the same files at its start
            out = os.path.join(tmp, "strace.txt")
            subprocess.run(["strace", "-f", "-c", "-o", out, sys.executable, __file__, "--child", child_case, "--n",
                            str(child_n), "--size", str(size), "--dir", data_dir], check=True,
                           env=dict(os.environ, SETUP="0"))
            calls: dict[str, int] = {}
            for line in Path(out).read_text().splitlines():
                fields = line.split()
                if len(fields) >= 5 and fields[-1] in FILE_CALLS and fields[0][0].isdigit():
                    calls[fields[-1]] = int(fields[3])
            totals.append(calls)
    ops = n // 16 if case == "delete, bounded" else n
    empty, full = totals
    return {k: (full.get(k, 0) - empty.get(k, 0)) / ops for k in sorted(set(full) | set(empty))
            if full.get(k, 0) - empty.get(k, 0) > 0}


def cpu(case: str, n: int, size: int) -> tuple[float, float]:
    """User and system CPU microseconds per operation of ``case`` (no strace; the set-up not
    counted). Moves with the machine's load less than wall time does, but does move: alternate."""
    with tempfile.TemporaryDirectory(prefix="stripefs-syscalls-") as tmp:
        data_dir, out = os.path.join(tmp, "data"), os.path.join(tmp, "cpu.txt")
        os.mkdir(data_dir)
        args = [sys.executable, __file__, "--child", case, "--n", str(n), "--size", str(size), "--dir", data_dir]
        subprocess.run(args, env=dict(os.environ, SETUP="1"), check=True)
        subprocess.run(args, env=dict(os.environ, SETUP="0", CPU_OUT=out), check=True)
        user, system, ops = Path(out).read_text().split()
    return 1e6 * float(user) / int(ops), 1e6 * float(system) / int(ops)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=192)
    ap.add_argument("--size", type=int, default=16 << 10, help="a copy's bytes (16 KiB: a 64 KiB stripe's 4+2 fragment)")
    ap.add_argument("--cpu", action="store_true", help="CPU per operation instead of the calls (no strace)")
    ap.add_argument("--child")
    ap.add_argument("--dir")
    a = ap.parse_args()
    if a.child:
        run_case(a.child, a.n, a.size, a.dir)
        return 0
    for case in CASES:
        if a.cpu:
            user, system = cpu(case, a.n, a.size)
            label = "per request of 16 chunks" if case == "delete, bounded" else "per operation"
            print(f"{case:28s} CPU {user + system:7.1f} us {label} (user {user:.1f}, system {system:.1f})", flush=True)
            continue
        per_op = count(case, a.n, a.size)
        label = "per request of 16 chunks" if case == "delete, bounded" else "per operation"
        print(f"{case:28s} {sum(per_op.values()):6.2f} file calls {label}: "
              + ", ".join(f"{k} {v:.2f}" for k, v in per_op.items()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
