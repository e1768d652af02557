"""The `cp -r` ingest, counted per file (issue 31): CPU per thread of every process of the cluster
(from /proc/PID/task/*/schedstat, summed by thread name), requests per file of each kind (the
mount's FUSE opcodes and requests to the cluster, the daemon's requests by type) and the rate.

Not a benchmark row (bench/meta.py's ingest group is): a probe to find where a copied file's CPU
goes. One cluster of 2 nodes as bench/meta.py's; the source tree made once under WORK/source.

    STRIPEFS_LOCAL_PORTS=... python bench/ingest_probe.py --work /var/tmp/probe [--files 2000] [--spy 4]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import tree  # noqa: E402
from common import Children, Cluster  # noqa: E402


def threads_cpu(pid: int) -> dict[str, float]:
    """Seconds on CPU of each thread of pid so far, summed by thread name (schedstat's first field)."""
    out: dict[str, float] = {}
    for t in os.scandir(f"/proc/{pid}/task"):
        try:
            with open(f"{t.path}/comm") as f:
                name = f.read().strip()
            with open(f"{t.path}/schedstat") as f:
                ns = int(f.read().split()[0])
            with open(f"{t.path}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[name] = out.get(name, 0.0) + ns / 1e9
        try:
            with open(f"{t.path}/status") as f:
                sw = sum(int(line.split()[1]) for line in f if "ctxt_switches" in line)
        except OSError:
            sw = 0
        out["(switches)"] = out.get("(switches)", 0.0) + sw / 1e6  # (shown per file, as counts)
        tick = os.sysconf("SC_CLK_TCK")
        out["(sys)"] = out.get("(sys)", 0.0) + int(fields[12]) / tick  # stime of every thread, 10 ms ticks
    return out


def counts(url: str) -> dict[str, float]:
    """Every counter of a Prometheus endpoint whose name ends in _total or _count, labels kept."""
    url = url if url.startswith("http") else f"http://{url}/metrics"
    with urllib.request.urlopen(url, timeout=10) as rsp:
        text = rsp.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        key, value = line.rsplit(" ", 1)
        name = key.split("{", 1)[0]
        if name.endswith(("_total", "_count")):
            out[key] = float(value)
    return out


def snapshot(cluster: Cluster) -> dict:
    return {"cpu": {n: threads_cpu(p) for n, p in cluster.pids.items()},
            "counts": {n: counts(u) for n, u in cluster.metrics.items()}}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--files", type=int, default=2000)
    ap.add_argument("--spy", type=float, default=0, help="py-spy record the mount and the daemon for this long")
    ap.add_argument("--spy-args", default="--native")
    ap.add_argument("--spy-roles", default="mount,meta")
    ap.add_argument("--perf", default="", help="perf record -g this process (mount, meta, storage-1) for 6 s")
    a = ap.parse_args()
    a.work.mkdir(parents=True, exist_ok=True)
    src = a.work / "source"
    if not src.exists():
        tree.make_source(src, a.files, 20)
    cluster = Cluster(a.work / "state", a.work / "mnt", nodes=2)
    if (a.work / "state").exists():
        shutil.rmtree(a.work / "state")
    (a.work / "mnt").mkdir(exist_ok=True)
    children = Children()
    cluster.up()
    try:
        time.sleep(4)
        dst = cluster.mnt / "ingest"
        spies = []
        if a.spy:
            spy = Path(sys.executable).parent / "py-spy"
            for role in a.spy_roles.split(","):
                out = a.work / f"spy-{role}-{os.getpid()}.txt"
                spies.append(subprocess.Popen(
                    [str(spy), "record", "-r", "400", "-d", str(int(a.spy)), "-f", "raw", "-o", str(out), "-p",
                     str(cluster.pids[role]), "--threads", *a.spy_args.split()],
                    stdout=subprocess.DEVNULL))
            time.sleep(1.5)
        if a.perf:
            spies.append(subprocess.Popen(
                ["perf", "record", "-F", "1999", "-g", "-o", str(a.work / f"perf-{a.perf}.data"), "-p",
                 str(cluster.pids[a.perf]), "--", "sleep", "6"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            time.sleep(0.5)
        load = os.getloadavg()[0]
        before = snapshot(cluster)
        t = time.perf_counter()
        s = tree.ingest(children, src, dst, 600)
        tree.settle(dst)
        after = snapshot(cluster)
        for p in spies:
            p.wait()
        n = a.files
        print(f"cp -r + sync -f: {s:.3f} s, {n / s:,.0f} files/s; load {load:.1f}-{os.getloadavg()[0]:.1f}")
        total = 0.0
        for proc, threads in after["cpu"].items():
            per = {k: (v - before["cpu"][proc].get(k, 0.0)) * 1e6 / n for k, v in threads.items()}
            whole = sum(v for k, v in per.items() if not k.startswith("("))
            total += whole
            top = ", ".join(f"{k} {v:.0f}" for k, v in sorted(per.items(), key=lambda kv: -kv[1]) if v >= 2)
            print(f"  {proc:10s} {whole:7.0f} us/file  ({top})")
        print(f"  cluster    {total:7.0f} us/file  (cp and sync not counted)")
        for proc, c in after["counts"].items():
            rows = [(k, (v - before["counts"][proc].get(k, 0.0)) / n) for k, v in c.items()]
            rows = [(k, v) for k, v in rows if v >= 0.004 and "fuse_ops_total" not in k and "_bucket" not in k]
            if rows:
                print(f"  {proc}:")
                for k, v in sorted(rows):
                    print(f"    {v:8.3f}  {k}")
        print(f"  (elapsed incl. settle {time.perf_counter() - t:.2f} s)")
    finally:
        cluster.teardown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
