"""Two processes at once on one filesystem: what a training job's DataLoader
workers or a parallel copy do, which one thread of bench/meta.py does not show.

- ``creates``: each process creates N empty files in its own directory;
  aggregate creates/s (issue 15: >= 4,000/s on one mount).
- ``records``: both write ONE shared file in interleaved records of 47,008
  bytes (a record-oriented writer's size: not a multiple of a page or a
  chunk), process 0 the even records k (at offset k * 47,008), process 1 the
  odd ones, with pwrite(), then fsync and close; aggregate MiB/s (issue 15:
  >= 50 MiB/s). Two writers of one file on one mount share its chunks and
  its write buffers: neighbouring records cut the same 4 MiB chunk and even
  the same page. The content is checked after (``check_records``).
- ``mdtest_easy``: io500's mdtest-easy phases (issue 31): each process creates
  N empty files in its own directory, then stats N of its neighbour's, then
  removes its own; files/s per phase, aggregate.

The clock: each child gets ready first (interpreter started, file open,
records built), says so, and starts on the parent's "go"; it reports when it
started and ended (CLOCK_MONOTONIC, shared by the processes of the machine),
and the figure is the work of both over the span from the first start to the
last end. The interpreter's start and the record building are not timed.

    python bench/procs.py creates DIR N        # a child (started by run_pair); also stat, remove
    python bench/procs.py records FILE PARITY RECORDS
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

RECORD = 47_008


def record(k: int) -> bytes:
    """Record k's content: pseudo-random, different for every k (a misplaced record is seen)."""
    return random.Random(k * 7919 + 17).randbytes(RECORD)


def run_pair(children, argvs: list[list[str]], timeout: float) -> float:
    """Run one child per argv, started together; seconds from the first start to the last end."""
    from common import BenchError  # bench/common.py: this file also runs as a child, outside the bench

    procs = [children.start([sys.executable, __file__, *argv], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True) for argv in argvs]
    try:
        for proc in procs:
            if proc.stdout.readline().strip() != "ready":
                raise BenchError(f"worker {proc.args[2:]} did not get ready: {proc.communicate(timeout=10)[1][-500:]}")
        for proc in procs:
            proc.stdin.write("go\n")
            proc.stdin.flush()
        spans = []
        for proc in procs:
            out, err = proc.communicate(timeout=timeout)
            if proc.returncode:
                raise BenchError(f"worker {proc.args[2:]} failed (rc {proc.returncode}): {err.strip()[-500:]}")
            spans.append(json.loads(out))
    except subprocess.TimeoutExpired:
        raise BenchError(f"workers {[p.args[2] for p in procs]} took longer than {timeout:.0f}s") from None
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            children.done(proc)
    return max(s["end"] for s in spans) - min(s["start"] for s in spans)


def creates(children, dirs: list[Path], n: int, timeout: float) -> dict:
    """One process per directory, n files each; then every directory must list exactly its n names."""
    from common import BenchError

    for d in dirs:
        d.mkdir(parents=True)
    s = run_pair(children, [["creates", str(d), str(n)] for d in dirs], timeout)
    for d in dirs:
        names = sorted(os.listdir(d))
        if names != [f"f{i:06d}" for i in range(n)]:
            raise BenchError(f"{d}: {len(names)} files after {n} creates (or other names)")
    return {"files": n * len(dirs), "s": round(s, 4), "rate": n * len(dirs) / s}


def mdtest_easy(children, dirs: list[Path], n: int, timeout: float) -> dict:
    """io500's mdtest-easy shape with one process per directory ("rank", each in a unique
    directory, ``mdtest -u``): create ``n`` empty files each, then stat ``n`` files each, a
    neighbour's (``-N 1``: rank r stats rank r+1's), then remove its own; each phase timed over
    both processes (first start to last end), files/s aggregate. No cache is dropped between
    phases, as one mdtest run does not."""
    out = {"files": n * len(dirs), "create": creates(children, dirs, n, timeout)}
    neighbours = dirs[1:] + dirs[:1]
    for phase, targets in (("stat", neighbours), ("remove", dirs)):
        s = run_pair(children, [[phase, str(d), str(n)] for d in targets], timeout)
        out[phase] = {"files": n * len(dirs), "s": round(s, 4), "rate": n * len(dirs) / s}
    for d in dirs:
        if os.listdir(d):
            from common import BenchError

            raise BenchError(f"{d}: files left after the remove phase")
        d.rmdir()
    return out


def records(children, path: Path, count: int, timeout: float) -> dict:
    """Two processes, even and odd records of one new file; then its content is checked."""
    os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
    s = run_pair(children, [["records", str(path), str(parity), str(count)] for parity in (0, 1)], timeout)
    check_records(path, count)
    return {"records": count, "bytes": count * RECORD, "s": round(s, 4), "mib_per_s": count * RECORD / (1 << 20) / s}


def check_records(path: Path, count: int) -> None:
    """Every record where it belongs, the file exactly as long as the records."""
    from common import BenchError

    size = os.stat(path).st_size
    if size != count * RECORD:
        raise BenchError(f"{path}: {size:,} bytes, {count} records of {RECORD} make {count * RECORD:,}")
    with open(path, "rb", buffering=0) as f:
        for k in range(count):
            if f.read(RECORD) != record(k):
                raise BenchError(f"{path}: record {k} (offset {k * RECORD:,}) is not what was written")


# --------------------------------------------------------------------- the children


def _child(argv: list[str]) -> dict:
    import time

    if argv[0] in ("creates", "stat", "remove"):
        d, n = Path(argv[1]), int(argv[2])
        names = [os.fspath(d / f"f{i:06d}") for i in range(n)]
        flags = os.O_CREAT | os.O_EXCL | os.O_WRONLY
        _ready()
        start = time.monotonic()
        if argv[0] == "creates":
            for name in names:
                os.close(os.open(name, flags, 0o644))
        elif argv[0] == "stat":
            for name in names:
                if os.stat(name).st_size:
                    raise OSError(f"{name}: not the empty file created")
        else:
            for name in names:
                os.unlink(name)
        return {"start": start, "end": time.monotonic()}
    path, parity, count = argv[1], int(argv[2]), int(argv[3])
    mine = [(k, record(k)) for k in range(parity, count, 2)]
    fd = os.open(path, os.O_WRONLY)
    _ready()
    start = time.monotonic()
    for k, data in mine:
        if os.pwrite(fd, data, k * RECORD) != RECORD:
            raise OSError(f"short pwrite of record {k}")
    os.fsync(fd)
    os.close(fd)
    return {"start": start, "end": time.monotonic()}


def _ready() -> None:
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        sys.exit("no go from the parent")


if __name__ == "__main__":
    print(json.dumps(_child(sys.argv[1:])))
