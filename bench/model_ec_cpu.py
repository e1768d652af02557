#!/usr/bin/env python3
"""Where the model tester's cluster CPU goes on an EC directory (issue 35's "EC CPU per operation").

Runs the data-path model (tests/datapath_model.py ``Engine``, no node kills; mmap only with
``--mmap``) on a cluster of its own (the model CLI's settings: 6 nodes, ec=4+2 and replicas=2 with
64 KiB chunks), once per layout asked, and prints per layout: cluster CPU per operation by role (meta,
storage, mount), the whole machine's (with the kernel's threads: writeback), each operation kind's
count and mean time, the mount's ``stripefs_ec_stripe_writes_total`` by path (delta, full, delta_fallback) per operation,
the storage nodes' and the metadata daemon's requests per operation by type, and each role's CPU per
operation by thread (main, libzmq's I/O thread, trio's workers, other Python threads: a node's fast
lane, the mount's FUSE reader), user and system apart. The counts say
what a design change can save before it is built: e.g. how many of the EC writes take the delta path at all, and how many
fragment writes and deletions each operation costs.

    .venv/bin/python bench/model_ec_cpu.py --ops 3000 --seed 7 [--layout ec rep] [--mmap] [--json out.json]

Runs back to back measure the previous one's teardown too on a journal-less ext4 (docs/design.md, "The new
copy put in place without a flush"): leave ~40 s between the runs of an A/B.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
import datapath_model as dm  # noqa: E402  (the model tester: engine and cluster helpers)
from common import self_cpu  # noqa: E402  (bench/common.py)


def _scrape(url: str | None) -> str:
    if not url:
        return ""
    try:
        return urllib.request.urlopen(url, timeout=5).read().decode()
    except OSError:
        return ""


def counters(cluster) -> dict[str, float]:
    """``ec:PATH``, ``ec:fragments_kept``, ``ec:fragments_unchanged``, ``ec:fragment_reads_spared`` and ``readahead:OUTCOME`` (fetched, used, wasted) from the mount, ``node:TYPE`` (request counts summed over the storage nodes),
    ``meta:TYPE`` (the requests the metadata daemon answered)."""
    out: dict[str, float] = {}
    for proc in cluster.local.status()["processes"]:
        text = _scrape(proc.get("metrics"))
        for line in text.splitlines():
            if proc["role"] == "mount" and line.startswith("stripefs_ec_stripe_writes_total{"):
                key = "ec:" + line.split('path="', 1)[1].split('"', 1)[0]
            elif proc["role"] == "mount" and line.startswith("stripefs_ec_fragments_kept_total "):
                key = "ec:fragments_kept"  # a delta's untouched data fragments, not written (per-fragment versions)
            elif proc["role"] == "mount" and line.startswith("stripefs_ec_fragments_unchanged_total "):
                key = "ec:fragments_unchanged"  # a whole-stripe write's data fragments it did not change, not written
            elif proc["role"] == "mount" and line.startswith("stripefs_ec_fragment_reads_spared_total "):
                key = "ec:fragment_reads_spared"  # a read-modify-write's data fragments covered whole, not read
            elif proc["role"] == "mount" and line.startswith("stripefs_readahead_chunks_total{"):
                key = "readahead:" + line.split('outcome="', 1)[1].split('"', 1)[0]
            elif proc["role"] in ("storage", "meta") and line.startswith("stripefs_requests_seconds_count{"):
                key = ("node:" if proc["role"] == "storage" else "meta:") + line.split('type="', 1)[1].split('"', 1)[0]
            else:
                continue
            out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def _thread_kind(pid: int, tid: int, comm: str) -> str:
    """A thread's part in its process: the main thread (the trio loop of the daemon, a node and a
    mount), libzmq's I/O thread, trio's worker threads, or another Python thread (a storage node's
    fast lane, the mount's FUSE reader)."""
    if tid == pid:
        return "main"
    if comm.startswith("ZMQbg/IO"):
        return "zmq-io"
    if comm.startswith("ZMQbg"):
        return "zmq-other"
    if comm.startswith("Trio thread"):
        return "trio-workers"
    return "other-threads"


def thread_cpu(state) -> dict[str, list[float]]:
    """``ROLE/KIND`` -> [user, system] CPU seconds so far of the cluster's threads (/proc/PID/task),
    summed over the role's processes: which thread of a role spends its CPU, and how much of it in
    the kernel. A thread that ended since the last look is not counted."""
    from stripefs.local_processes import processes_of

    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, list[float]] = {}
    for proc in processes_of(state):
        try:
            tids = [int(t) for t in os.listdir(f"/proc/{proc.pid}/task")]
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{proc.pid}/task/{tid}/stat") as f:
                    text = f.read()
            except OSError:
                continue
            comm = text[text.index("(") + 1 : text.rindex(")")]
            fields = text.rsplit(")", 1)[-1].split()
            key = f"{proc.name.split('-')[0]}/{_thread_kind(proc.pid, tid, comm)}"
            acc = out.setdefault(key, [0.0, 0.0])
            acc[0] += int(fields[11]) / tick
            acc[1] += int(fields[12]) / tick
    return out


def machine_cpu() -> float:
    """CPU seconds so far of the whole machine (/proc/stat, every CPU, all but idle and iowait): with the
    cluster's own and this process's, what the kernel's threads did for them (writeback above all)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return (sum(v[:8]) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ops", type=int, default=3000)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--layout", nargs="+", choices=["ec", "rep"], default=["ec"])
    ap.add_argument("--mmap", action="store_true", help="with the model's mmap reads and writes (each write an msync: make fuzz's slowest run)")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    a = ap.parse_args()
    conftest = dm._cluster_helpers()
    cluster = dm.new_cluster(conftest, prefix="stripefs-modelcpu-")
    results = {}
    try:
        cluster.up()
        other = dm.set_up(cluster, conftest.run_cli)
        for layout in a.layout:
            target = dm.cluster_target(cluster, cluster.mnt / layout, other, f"{layout} ")
            before_cpu, before = dm.cluster_cpu(cluster.state), counters(cluster)
            before_threads = thread_cpu(cluster.state)
            before_machine, before_own = machine_cpu(), self_cpu()
            res = dm.Engine(target, a.seed, use_mmap=a.mmap, nfiles=3, progress=0).run(a.ops)
            cpu = {k: v - before_cpu.get(k, 0.0) for k, v in dm.cluster_cpu(cluster.state).items()}
            machine, own = machine_cpu() - before_machine, self_cpu() - before_own
            threads = {
                k: [round(1e3 * (u - before_threads.get(k, [0.0, 0.0])[0]) / a.ops, 3),
                    round(1e3 * (sy - before_threads.get(k, [0.0, 0.0])[1]) / a.ops, 3)]
                for k, (u, sy) in sorted(thread_cpu(cluster.state).items())
            }
            after = counters(cluster)
            per_op = {k: round((v - before.get(k, 0.0)) / a.ops, 3) for k, v in sorted(after.items()) if v - before.get(k, 0.0)}
            results[layout] = {
                "ops": a.ops, "seed": a.seed, "seconds": round(res["seconds"], 1),
                "cpu_ms_per_op": round(1e3 * sum(cpu.values()) / a.ops, 2),
                "cpu_ms_per_op_by_role": {k: round(1e3 * v / a.ops, 2) for k, v in sorted(cpu.items())},
                "per_op": per_op,
                "thread_cpu_ms_per_op": {k: v for k, v in threads.items() if v[0] or v[1]},  # [user, system]
                # the whole machine, and the part of it neither the cluster's processes nor the model's
                "machine_cpu_ms_per_op": round(1e3 * machine / a.ops, 2),
                "other_cpu_ms_per_op": round(1e3 * (machine - own - sum(cpu.values())) / a.ops, 2),
                "op_counts": res["counts"],
            }
            r = results[layout]
            print(f"{layout}: {r['cpu_ms_per_op']} ms cluster CPU/op {r['cpu_ms_per_op_by_role']} in {r['seconds']} s", flush=True)
            print(f"   machine: {r['machine_cpu_ms_per_op']} ms CPU/op, of it {r['other_cpu_ms_per_op']} ms neither the "
                  "cluster's nor the model's (the kernel's threads: writeback, ...)", flush=True)
            print("   per op: " + ", ".join(f"{k} {v}" for k, v in per_op.items()), flush=True)
            print("   operations (count, mean ms): " + ", ".join(
                f"{k} {n} ({1e3 * res['times'][k] / n:.1f})" for k, n in sorted(res["counts"].items(), key=lambda kv: -res["times"][kv[0]])), flush=True)
            print("   CPU ms per op by thread (user+system): " + ", ".join(
                f"{k} {u:.2f}+{sy:.2f}" for k, (u, sy) in r["thread_cpu_ms_per_op"].items()), flush=True)
    finally:
        cluster.teardown()
        shutil.rmtree(cluster.root, ignore_errors=True)
    if a.json:
        a.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
