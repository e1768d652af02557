#!/usr/bin/env python3
"""Cluster CPU per small write: ec=4+2 beside replicas=2, one session (open, pwrite, close) per write.

    .venv/bin/python bench/ec_small_writes.py                     # 4 KiB writes, 4 MiB and 64 KiB chunks
    .venv/bin/python bench/ec_small_writes.py --ops 500 --size 4096 --chunks 4M

One 6-node `stripefs local` cluster; per chunk size a directory ec=4+2 and one
replicas=2, each with a file of 8 chunks of random bytes. Then ``--ops`` times:
open the file, ``pwrite`` ``--size`` random bytes at a random offset, close (the
commit). What is measured is the CPU (user + system) of every cluster process
(metadata daemon, storage nodes, the mount) over those operations, per
operation, and the wall time per operation. The workload is the one a partial
EC write pays most for: before parity-delta updates every such write read the
stripe's K data fragments, coded the whole stripe and wrote K+M whole fragments
(client/ec_path.py "Writes"); the mount's ``stripefs_ec_stripe_writes_total``
says which path each stripe took, and is printed. Each file's content is
checked at the end against what was written.

Figures from one machine are noisy (the 2-core VM here is shared): compare runs of
two commits made minutes apart, several times. Results go to
bench/results/ec-small-writes-latest.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import run as base  # noqa: E402  (bench/run.py: cluster driver, CPU accounting)

KiB, MiB = base.KiB, base.MiB
CHUNKS_IN_FILE = 8


def _size(text: str) -> int:
    text = text.strip().upper()
    return int(text[:-1]) * {"K": KiB, "M": MiB}[text[-1]] if text[-1] in "KM" else int(text)


def ec_paths(metrics_url: str | None) -> dict[str, float]:
    """The mount's stripefs_ec_stripe_writes_total by path (empty without a metrics endpoint)."""
    if not metrics_url:
        return {}
    try:
        text = urllib.request.urlopen(metrics_url, timeout=5).read().decode()
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        if line.startswith("stripefs_ec_stripe_writes_total{"):
            label = line.split('path="', 1)[1].split('"', 1)[0]
            out[label] = float(line.rsplit(" ", 1)[1])
    return out


def node_requests(cluster) -> dict[str, tuple[float, float]]:
    """Storage nodes' handler time and count by request type, summed over the nodes (their metrics)."""
    out: dict[str, list[float]] = {}
    for name, url in cluster.metrics.items():
        if not name.startswith("storage"):
            continue
        try:
            text = urllib.request.urlopen(url, timeout=5).read().decode()
        except OSError:
            continue
        for line in text.splitlines():
            for suffix, i in (("_sum{", 0), ("_count{", 1)):
                if line.startswith("stripefs_requests_seconds" + suffix):
                    kind = line.split('type="', 1)[1].split('"', 1)[0]
                    out.setdefault(kind, [0.0, 0.0])[i] += float(line.rsplit(" ", 1)[1])
    return {k: (v[0], v[1]) for k, v in out.items()}


def run(a) -> dict:
    work = Path(tempfile.mkdtemp(prefix="stripefs-ecsmall-", dir=a.workdir))
    cluster = base.Cluster(work / "state", work / "mnt", 6)
    results: dict = {"commit": base.git_commit(), "ops": a.ops, "size": a.size, "runs": {}}
    try:
        cluster.up()
        rng = random.Random(a.seed)
        for chunk in a.chunks:
            for name, flag, value in (("ec", "--ec", "4+2"), ("rep", "--replicas", "2")):
                d = cluster.mnt / f"{name}-{chunk}"
                d.mkdir()
                cluster._run("layout", "set", str(d), flag, value, "--chunk-size", str(chunk))
                path = d / "f"
                model = bytearray(rng.randbytes(CHUNKS_IN_FILE * chunk))
                path.write_bytes(model)
                mount_metrics = cluster.metrics.get("mount")
                paths_before = ec_paths(mount_metrics)
                requests_before = node_requests(cluster)
                cpu_before = cluster.cpu()
                t = time.perf_counter()
                for _ in range(a.ops):
                    offset = rng.randrange(len(model) - a.size)
                    data = rng.randbytes(a.size)
                    fd = os.open(path, os.O_WRONLY)
                    try:
                        os.pwrite(fd, data, offset)
                    finally:
                        os.close(fd)
                    model[offset : offset + a.size] = data
                wall = time.perf_counter() - t
                cpu = {k: v - cpu_before[k] for k, v in cluster.cpu().items()}
                paths = {k: v - paths_before.get(k, 0) for k, v in ec_paths(mount_metrics).items()}
                requests = {k: (v[0] - requests_before.get(k, (0, 0))[0], v[1] - requests_before.get(k, (0, 0))[1])
                            for k, v in node_requests(cluster).items()}
                if path.read_bytes() != model:
                    raise base.BenchError(f"{path}: DATA MISMATCH")
                roles: dict[str, float] = {}
                for proc, seconds in cpu.items():
                    role = proc.split("-")[0]
                    roles[role] = roles.get(role, 0.0) + seconds
                r = {
                    "cpu_ms_per_op": round(1e3 * sum(cpu.values()) / a.ops, 2),
                    "cpu_ms_per_op_by_role": {k: round(1e3 * v / a.ops, 2) for k, v in sorted(roles.items())},
                    "wall_ms_per_op": round(1e3 * wall / a.ops, 2),
                    "ec_stripe_writes": paths if name == "ec" else {},
                    # storage nodes' handler time (ms) and requests per operation, by request type
                    "node_requests_per_op": {k: (round(1e3 * t / a.ops, 2), round(n / a.ops, 2))
                                             for k, (t, n) in sorted(requests.items()) if n},
                }
                results["runs"][f"{name} chunk {chunk // KiB} KiB"] = r
                base.progress(f"{name}, {chunk // KiB} KiB chunks, {a.ops} writes of {a.size} bytes: {r}")
    finally:
        cluster.teardown()
        if not os.path.ismount(cluster.mnt):
            shutil.rmtree(work, ignore_errors=True)
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ops", type=int, default=300, help="writes per directory (default 300)")
    ap.add_argument("--size", type=_size, default=4 * KiB, help="bytes per write (default 4K)")
    ap.add_argument("--chunks", type=lambda s: [_size(x) for x in s.split(",")], default=[4 * MiB, 64 * KiB],
                    help="chunk sizes, comma-separated (default 4M,64K: the default layout's and the model tester's)")
    ap.add_argument("--workdir", default="/var/tmp", help="a real disk for the cluster (default /var/tmp)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", default=str(base.RESULTS / "ec-small-writes-latest.json"))
    a = ap.parse_args(argv)
    try:
        results = run(a)
    except base.BenchError as exc:
        print(f"EC SMALL-WRITE BENCHMARK FAILED: {exc}", file=sys.stderr)
        return 1
    print(f"cluster CPU per {a.size}-byte write (open, pwrite, close), commit {(results['commit'] or '?')[:12]}:")
    for key, r in results["runs"].items():
        paths = ", ".join(f"{k} {v:.0f}" for k, v in r["ec_stripe_writes"].items() if v)
        print(f"  {key:22s} {r['cpu_ms_per_op']:7.2f} ms CPU  {r['wall_ms_per_op']:7.2f} ms wall  "
              f"{r['cpu_ms_per_op_by_role']}" + (f"  stripes: {paths}" if paths else ""))
    out = Path(a.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
