"""Creates, mkdirs and unlinks of one process on the default mount, counted per operation (issue
30/31): CPU per thread of every cluster process (/proc/PID/task/*/schedstat, summed by thread
name), the mount's FUSE requests by opcode and every other counter per operation, and the rate.

Not a benchmark row (bench/meta.py's ops group is): a probe to find where a create's CPU goes.
One cluster of 2 nodes as bench/meta.py's; the phases as bench/meta_ops.py runs them (4 held
directories, names precomputed): create N empty files, mkdir N directories, unlink the N files.

    STRIPEFS_LOCAL_PORTS=... python bench/dirops_probe.py --work /var/tmp/dprobe [--files 10000]
        [--spy create --spy-s 4 --spy-role mount]  # py-spy of that process's threads in that phase (raw stacks)
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import Cluster  # noqa: E402
from ingest_probe import snapshot  # noqa: E402
from meta_ops import DIRS, _create, _names  # noqa: E402

PHASES = ("create", "mkdir", "unlink")


def report(phase: str, n: int, s: float, load: tuple[float, float], before: dict, after: dict) -> None:
    print(f"{phase}: {n} in {s:.3f} s, {n / s:,.0f}/s; load {load[0]:.1f}-{load[1]:.1f}")
    for proc, threads in after["cpu"].items():
        per = {k: (v - before["cpu"][proc].get(k, 0.0)) * 1e6 / n for k, v in threads.items()}
        whole = sum(v for k, v in per.items() if not k.startswith("("))
        top = ", ".join(f"{k} {v:.1f}" for k, v in sorted(per.items(), key=lambda kv: -kv[1]) if v >= 1)
        print(f"  {proc:10s} {whole:7.1f} us/op  ({top})")
    for proc, c in after["counts"].items():
        rows = [(k, (v - before["counts"][proc].get(k, 0.0)) / n) for k, v in c.items()]
        rows = [(k, v) for k, v in rows if v >= 0.004 and "_bucket" not in k]
        if rows:
            print(f"  {proc}:")
            for k, v in sorted(rows):
                print(f"    {v:8.3f}  {k}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--files", type=int, default=10000)
    ap.add_argument("--spy", default="", help="py-spy record the mount during this phase")
    ap.add_argument("--spy-s", type=float, default=3)
    ap.add_argument("--spy-args", default="--native --idle")
    ap.add_argument("--spy-role", default="mount", help="the process py-spy records (mount, meta)")
    a = ap.parse_args()
    a.work.mkdir(parents=True, exist_ok=True)
    if (a.work / "state").exists():
        shutil.rmtree(a.work / "state")
    (a.work / "mnt").mkdir(exist_ok=True)
    cluster = Cluster(a.work / "state", a.work / "mnt", nodes=2)
    cluster.up()
    try:
        cluster.past_restart_grace()
        root = cluster.mnt / "probe"
        for k in range(DIRS):
            (root / f"d{k}").mkdir(parents=True)
        for k in range(DIRS):  # held, as bench/meta_ops.py's directories are by its first create
            os.listdir(root / f"d{k}")
        n = a.files
        files, made = _names(root, n, "f{:06d}"), _names(root, n, "m{:06d}")
        work = {"create": (_create, files), "mkdir": (os.mkdir, made), "unlink": (os.unlink, files)}
        time.sleep(1)
        for phase in PHASES:
            op, args = work[phase]
            spy = None
            if a.spy == phase:
                exe = Path(sys.executable).parent / "py-spy"
                out = a.work / f"spy-{a.spy_role}-{phase}-{os.getpid()}.txt"
                spy = subprocess.Popen(
                    [str(exe), "record", "-r", "400", "-d", str(int(a.spy_s)), "-f", "raw", "-o", str(out), "-p",
                     str(cluster.pids[a.spy_role]), "--threads", *a.spy_args.split()], stdout=subprocess.DEVNULL)
                time.sleep(1.0)
            load0 = os.getloadavg()[0]
            before = snapshot(cluster)
            t = time.perf_counter()
            th = threading.Thread(target=lambda: [op(x) for x in args])  # as meta_ops: a thread per root
            th.start()
            th.join()
            s = time.perf_counter() - t
            after = snapshot(cluster)
            report(phase, n, s, (load0, os.getloadavg()[0]), before, after)
            if spy:
                spy.wait()
                print(f"  py-spy: {out}")
            time.sleep(1)
    finally:
        cluster.teardown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
