#!/usr/bin/env python3
"""Self-healing benchmark: time to full redundancy after losing a node, and the read
throughput a DataLoader-style reader keeps while repair runs, beside the same reader
without repair, in one run.

    .venv/bin/python bench/heal.py                 # a node holding 2 GiB is lost
    .venv/bin/python bench/heal.py --gib 0.5       # smaller
    .venv/bin/python bench/heal.py --help

Steps, on a fresh ``stripefs local up`` cluster (4 nodes, replicas=2, 4 MiB chunks):

1. write files of 64 MiB until the fullest storage node holds ``--gib`` GiB;
2. baseline: the reader (whole files, shuffled order, page cache dropped before
   each file, one process, like a DataLoader worker streaming shards) runs for
   ``--seconds`` without repair: MB/s;
3. kill -9 the node holding the most and run the same reader until
   ``stripefs status`` reports the node down (the detection window:
   ``node_timeout_s``; reads hedge to the other copy), then until
   ``under_replicated`` is 0 (the repair): time from the kill and from the
   declaration of death to full redundancy, and the reader's MB/s in each window;
4. the reader again without repair (the node stays dead, redundancy is full):
   "without repair" is the mean of steps 2 and 4, which brackets the noise of a
   shared machine.

"Time to full redundancy" has no local-disk counterpart and is reported alone;
the reader's throughput is reported as a ratio (during repair / without), both
measured in this run on this machine. The repair bandwidth is the daemon's
``repair_bandwidth`` (``--repair-bandwidth``, default the shipped 64M/s): the
throttle is what keeps the reader fed, so the time to full redundancy is
bounded below by bytes / bandwidth. Results: bench/results/heal.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from stripefs import page_cache

BENCH = Path(__file__).resolve().parent
MiB, GiB = 1 << 20, 1 << 30
FILE = 64 * MiB


def cli(*args: str) -> str:
    res = subprocess.run([sys.executable, "-m", "stripefs", *args], capture_output=True, text=True, timeout=600)
    if res.returncode:
        raise SystemExit(f"stripefs {' '.join(args)} failed:\n{res.stdout}{res.stderr}")
    return res.stdout


def status(state: Path) -> dict:
    return json.loads(cli("status", "--dir", str(state), "--json"))


def drop_caches() -> None:
    try:  # (synced first: the storage nodes' dirty chunk files' writeback would slow the next reader)
        page_cache.drop("3")  # once no test keeps the caches (stripefs/page_cache.py)
    except OSError:
        pass


class Reader(threading.Thread):
    """Whole files in shuffled order, page cache dropped before each: bytes read and errors."""

    def __init__(self, files: list[Path], seed: int):
        super().__init__(daemon=True)
        self.files = list(files)
        random.Random(seed).shuffle(self.files)
        self.bytes = 0
        self.errors: list[str] = []
        self.stop = threading.Event()

    def run(self) -> None:
        i = 0
        while not self.stop.is_set():
            path = self.files[i % len(self.files)]
            i += 1
            try:
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    while not self.stop.is_set():
                        block = os.read(fd, 4 * MiB)
                        if not block:
                            break
                        self.bytes += len(block)
                finally:
                    os.close(fd)
            except OSError as exc:
                self.errors.append(f"{path}: {exc}")


def measure(files: list[Path], seconds: float, seed: int, until=None) -> tuple[float, float, list[str]]:
    """(MB/s, seconds) of the reader over ``seconds``, or until ``until()`` is true."""
    reader = Reader(files, seed)
    start = time.monotonic()
    reader.start()
    while True:
        time.sleep(0.25)
        elapsed = time.monotonic() - start
        if (until is None and elapsed >= seconds) or (until is not None and until()):
            break
    reader.stop.set()
    reader.join(60)
    elapsed = time.monotonic() - start
    return reader.bytes / elapsed / 1e6, elapsed, reader.errors


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=2.0, help="GiB on the node that is lost (default: %(default)s)")
    ap.add_argument("--seconds", type=float, default=20.0, help="baseline reader duration (default: %(default)s)")
    ap.add_argument("--repair-bandwidth", default="64M", help="metad repair_bandwidth (default: %(default)s)")
    ap.add_argument("--node-timeout", type=float, default=5.0, help="metad node_timeout_s (default: %(default)s)")
    ap.add_argument("--keep", action="store_true", help="leave the cluster's directory behind")
    a = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="stripefs-bench-heal-"))
    state, mnt = root / "state", root / "mnt"
    cli("local", "up", "--dir", str(state), "--mount", str(mnt), "--nodes", "4",
        "--set", f"meta.repair_bandwidth={a.repair_bandwidth}", "--set", f"meta.node_timeout_s={a.node_timeout}",
        "--set", f"meta.node_suspect_s={a.node_timeout / 2}", "--set", "meta.chunk_size=4M")
    try:
        data = mnt / "shards"
        data.mkdir()
        files: list[Path] = []
        target = a.gib * GiB
        block = os.urandom(FILE)
        print(f"writing 64 MiB shards until one node holds {a.gib} GiB ...", file=sys.stderr)
        while True:
            path = data / f"shard-{len(files):05d}"
            with open(path, "wb") as f:
                f.write(block[len(files) % 4096 :] + block[: len(files) % 4096])  # distinct content per shard
            files.append(path)
            if len(files) % 8 == 0:
                top = max(n["used_bytes"] for n in status(state)["nodes"])
                if top >= target:
                    break
        time.sleep(3)  # heartbeats carry the final usage
        st = status(state)
        victim = max(st["nodes"], key=lambda n: n["used_bytes"])
        print(f"{len(files)} shards; node {victim['node_id']} holds {victim['used_bytes'] / GiB:.2f} GiB", file=sys.stderr)

        drop_caches()
        base_mbs, base_s, base_err = measure(files, a.seconds, seed=1)
        print(f"reader without repair: {base_mbs:.0f} MB/s over {base_s:.0f}s", file=sys.stderr)

        pids = json.loads((state / "pids.json").read_text())
        killed = time.monotonic()
        os.kill(pids["storage"][str(victim["node_id"])], signal.SIGKILL)
        marks: dict[str, float] = {}

        def repaired() -> bool:
            s = status(state)
            node = next(n for n in s["nodes"] if n["node_id"] == victim["node_id"])
            if node["state"] == "down" and "down" not in marks:
                marks["down"] = time.monotonic()
            if "down" in marks and s["under_replicated"] == 0 and s["repair"]["backlog"] == 0:
                marks["full"] = time.monotonic()
                marks["copied_bytes"] = s["repair"]["copied_bytes"]
                return True
            return False

        drop_caches()
        det_mbs, det_s, det_err = measure(files, 0, seed=2, until=lambda: repaired() or "down" in marks)
        rep_mbs, rep_s, rep_err = measure(files, 0, seed=3, until=lambda: "full" in marks or repaired())
        drop_caches()
        after_mbs, after_s, after_err = measure(files, a.seconds, seed=4)
        print(f"reader after repair: {after_mbs:.0f} MB/s over {after_s:.0f}s", file=sys.stderr)
        without = (base_mbs + after_mbs) / 2
        result = {
            "lost_node_bytes": victim["used_bytes"],
            "repair_bandwidth": a.repair_bandwidth,
            "node_timeout_s": a.node_timeout,
            "time_to_full_redundancy_s": round(marks["full"] - killed, 1),
            "time_from_declared_down_s": round(marks["full"] - marks["down"], 1),
            "copied_bytes": marks["copied_bytes"],
            "reader_mb_s_without_repair_before": round(base_mbs, 1),
            "reader_mb_s_without_repair_after": round(after_mbs, 1),
            "reader_mb_s_before_declared_down": round(det_mbs, 1),
            "reader_mb_s_during_repair": round(rep_mbs, 1),
            "reader_ratio_during_repair_vs_without": round(rep_mbs / without, 2) if without else None,
            "reader_errors": base_err + det_err + rep_err + after_err,
        }
        print(json.dumps(result, indent=1))
        out = BENCH / "results"
        out.mkdir(exist_ok=True)
        (out / "heal.json").write_text(json.dumps(result, indent=1) + "\n")
        return 1 if result["reader_errors"] else 0
    finally:
        subprocess.run([sys.executable, "-m", "stripefs", "local", "down", "--dir", str(state)], capture_output=True)
        if not a.keep:
            subprocess.run(["rm", "-rf", str(root)])


if __name__ == "__main__":
    sys.exit(main())
