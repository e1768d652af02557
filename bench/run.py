#!/usr/bin/env python3
"""stripefs benchmark: every workload through a fresh local-cluster mount AND on
the local disk, in one run, printed side by side as a ratio (stripefs / local).

    make bench                      # == .venv/bin/python bench/run.py
    .venv/bin/python bench/run.py --quick          # ~10x smaller smoke run
    .venv/bin/python bench/run.py --help

Why ratios: the machines are shared and noisy, so an absolute MB/s means little;
the same workload on the local disk, measured minutes apart in the same run,
is the yardstick (the project design notes, "Measuring"). See bench/README.md.

Workloads (defaults; --quick divides sizes by ~10):
  1. sequential write of a 1 GiB file, 1 MiB writes, fsync + close inside the timing
  2. sequential read of that file, cold
  3. 5,000 files of 100-120 KiB random content in 50 subdirectories: write,
     then read back in shuffled order, cold
  4. os.stat of all 5,000 files in shuffled order, warm (right after the
     write) and cold

"Cold" = for stripefs: `stripefs local down`, sync + drop_caches, `stripefs
local up` on the same STATE (fresh client: empty chunk cache, empty kernel
page/dentry cache); for the local disk: sync + drop_caches.

CPU: for stripefs the benchmark process (self + children) plus every stripefs
process (meta, storage nodes, mount: utime+stime (+cutime+cstime) from
/proc/PID/stat); for the local disk the benchmark process alone.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import random
import socket
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from common import (GiB, KiB, MiB, RESULTS, BenchError, Cluster, check_workdir, cold_cycle, fmt_count, fmt_rate,
                    fs_of, git_commit, human_size, progress, self_cpu, supervise, syncfs, write_results)
from common import drop_caches, proc_cpu  # noqa: F401 - still reachable as run.X (bench/ec.py uses run.drop_caches)

try:
    import xxhash

    def _hasher():
        return xxhash.xxh3_128()
except ImportError:  # pragma: no cover - xxhash is a stripefs dependency
    import hashlib

    def _hasher():
        return hashlib.blake2b(digest_size=16)


#: issue 31's absolute goals: (workload key, result field, goal, "min" or "max", label)
GOALS = [
    ("small_write", "files_per_s", 1500, "min", "issue 31: small files written, files/s"),
    ("small_write", "cpu_us_per_file", 1500, "max", "issue 31: CPU per small file written, all processes, us"),
]

FLOORS = [  # (workload key, minimum ratio stripefs/local, label)
    ("seq_read_cold", 0.30, "1 GiB sequential read (cold)"),
    ("small_read_cold", 0.15, "shuffled small-file read (cold)"),
    ("seq_write", 0.30, "sequential write"),
]


# -------------------------------------------------------------------- workload


@dataclass
class Plan:
    size: int
    block: int
    files: list[tuple[str, int, int]]  # relpath, size, offset into pool
    dirs: list[str]
    pool: bytes
    big_offsets: list[int]
    big_hash: bytes = b""
    file_hash: dict[str, bytes] = field(default_factory=dict)
    read_order: list[int] = field(default_factory=list)
    stat_order: list[int] = field(default_factory=list)

    def big_block(self, i: int) -> memoryview:
        n = min(self.block, self.size - i * self.block)
        o = self.big_offsets[i]
        return memoryview(self.pool)[o:o + n]

    def file_data(self, k: int) -> memoryview:
        _, size, o = self.files[k]
        return memoryview(self.pool)[o:o + size]


def make_plan(args) -> Plan:
    rnd = random.Random(args.seed)
    max_file = args.max_kib * KiB
    pool_size = max(64 * MiB, 4 * args.block) + max(args.block, max_file)
    # random content, different per block/file (pool slices at distinct offsets)
    pool = rnd.randbytes(pool_size)
    span = pool_size - max(args.block, max_file)
    nblocks = (args.size + args.block - 1) // args.block
    big_offsets = [(i * 1_000_003 + rnd.randrange(4096)) % span for i in range(nblocks)]
    dirs = [f"class_{d:03d}" for d in range(args.dirs)]
    files = []
    for k in range(args.files):
        size = rnd.randint(args.min_kib * KiB, args.max_kib * KiB)
        files.append((f"{dirs[k % len(dirs)]}/img_{k:06d}.bin", size, rnd.randrange(span)))
    plan = Plan(args.size, args.block, files, dirs, pool, big_offsets)
    h = _hasher()
    for i in range(nblocks):
        h.update(plan.big_block(i))
    plan.big_hash = h.digest()
    for k, (rel, _, _) in enumerate(files):
        plan.file_hash[rel] = _hasher_digest(plan.file_data(k))
    plan.read_order = list(range(len(files)))
    rnd.shuffle(plan.read_order)
    plan.stat_order = list(range(len(files)))
    rnd.shuffle(plan.stat_order)
    return plan


def _hasher_digest(data) -> bytes:
    h = _hasher()
    h.update(data)
    return h.digest()


def w_seq_write(root: Path, plan: Plan) -> dict:
    path = root / "big.bin"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for i in range(len(plan.big_offsets)):
            blk = plan.big_block(i)
            done = 0
            while done < len(blk):
                done += os.write(fd, blk[done:])
        os.fsync(fd)
    finally:
        os.close(fd)
    return {"bytes": plan.size}


def w_seq_read(root: Path, plan: Plan) -> dict:
    path = root / "big.bin"
    buf = bytearray(plan.block)
    mv = memoryview(buf)
    h = _hasher()
    total = 0
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(mv)
            if not n:
                break
            h.update(mv[:n])
            total += n
    if total != plan.size:
        raise BenchError(f"seq read: {path} read {total} bytes, wrote {plan.size}")
    if h.digest() != plan.big_hash:
        raise BenchError(f"seq read: DATA MISMATCH in {path}: content read differs from what was written")
    return {"bytes": total}


def w_small_write(root: Path, plan: Plan) -> dict:
    base = root / "images"
    base.mkdir()
    for d in plan.dirs:
        (base / d).mkdir()
    total = 0
    for k, (rel, size, _) in enumerate(plan.files):
        data = plan.file_data(k)
        with open(base / rel, "wb", buffering=0) as f:
            done = 0
            while done < size:
                done += f.write(data[done:])
        total += size
    # durability like the big file's fsync, at dataset granularity: syncfs the
    # disk that holds both the local directory and the storage nodes' chunks
    syncfs(root)
    return {"bytes": total, "files": len(plan.files)}


def w_small_read(root: Path, plan: Plan) -> dict:
    base = root / "images"
    buf = bytearray(plan.files and max(s for _, s, _ in plan.files) + 1 or 1)
    mv = memoryview(buf)
    total = 0
    bad = []
    for k in plan.read_order:
        rel, size, _ = plan.files[k]
        n = 0
        with open(base / rel, "rb", buffering=0) as f:
            while True:
                got = f.readinto(mv[n:])
                if not got:
                    break
                n += got
                if n == len(buf):
                    break
        total += n
        if n != size or _hasher_digest(mv[:n]) != plan.file_hash[rel]:
            bad.append(f"{rel} (read {n} bytes, wrote {size})")
    if bad:
        raise BenchError(f"small-file read: DATA MISMATCH in {len(bad)} of {len(plan.files)} files, e.g. "
                         + ", ".join(bad[:5]))
    return {"bytes": total, "files": len(plan.files)}


def w_stat(root: Path, plan: Plan) -> dict:
    base = root / "images"
    bad = []
    for k in plan.stat_order:
        rel, size, _ = plan.files[k]
        st = os.stat(base / rel)
        if st.st_size != size:
            bad.append(f"{rel} (st_size {st.st_size}, wrote {size})")
    if bad:
        raise BenchError(f"stat: WRONG SIZE for {len(bad)} files, e.g. " + ", ".join(bad[:5]))
    return {"files": len(plan.files)}


# ----------------------------------------------------------------------- runner


WORKLOADS = [
    # key, label, function, cold?, kind
    ("seq_write", "seq write {size}", w_seq_write, False, "bytes"),
    ("small_write", "small write {files} files", w_small_write, False, "files"),
    ("stat_warm", "stat {files} files, warm", w_stat, False, "stat"),
    ("seq_read_cold", "seq read {size}, cold", w_seq_read, True, "bytes"),
    ("small_read_cold", "shuffled read {files} files, cold", w_small_read, True, "files"),
    ("stat_cold", "stat {files} files, cold", w_stat, True, "stat"),
]


class Bench:
    def __init__(self, args):
        self.args = args
        self.work = Path(tempfile.mkdtemp(prefix="stripefs-bench-", dir=args.workdir))
        self.state = self.work / "state"
        self.mnt = self.work / "mnt"
        self.local = self.work / "local"
        self.local.mkdir()
        self.cluster = Cluster(self.state, self.mnt, args.nodes)
        if args.secure:
            self.cluster.up_args.append("--secure")
        self.phase = ("setup", time.monotonic(), args.phase_timeout)
        self.results: dict[str, dict] = {}
        self.problems: list[str] = []
        self.cold_ok = True

    def set_phase(self, name: str) -> None:
        self.phase = (name, time.monotonic(), self.args.phase_timeout)

    def cold(self, side: str) -> None:
        # --mount-option: every `local up` of a cold cycle (the writes come first: a dataset mount is read-only)
        self.cluster.options = list(self.args.mount_option)
        self.cold_ok &= cold_cycle(self.cluster, side)

    def measure(self, key: str, label: str, fn, side: str) -> dict:
        root = self.mnt if side == "stripefs" else self.local
        self.set_phase(f"{side}: {label}")
        before_p = self.cluster.cpu() if side == "stripefs" else {}
        before_s = self_cpu()
        t = time.perf_counter()
        out = fn(root, self.plan)
        wall = time.perf_counter() - t
        cpu_self = self_cpu() - before_s
        after_p = self.cluster.cpu() if side == "stripefs" else {}
        cpu_procs = {k: round(after_p[k] - before_p[k], 3) for k in after_p}
        cpu = cpu_self + sum(cpu_procs.values())
        r = {"wall_s": round(wall, 3), "cpu_s": round(cpu, 3), "cpu_bench_s": round(cpu_self, 3), **out}
        if cpu_procs:
            r["cpu_by_process_s"] = cpu_procs
        if "bytes" in out:
            r["bytes_per_s"] = out["bytes"] / wall
            r["cpu_s_per_gib"] = cpu / (out["bytes"] / GiB)
        if "files" in out:
            r["files_per_s"] = out["files"] / wall
            r["cpu_us_per_file"] = cpu / out["files"] * 1e6
        desc = []
        if "bytes" in out:
            desc.append(fmt_rate(r["bytes_per_s"]))
        if "files" in out:
            desc.append(fmt_count(r["files_per_s"], "files/s"))
        progress(f"  {side:8s} {label}: {', '.join(desc)} ({wall:.1f}s, cpu {cpu:.1f}s)")
        return r

    def run(self) -> None:
        a = self.args
        progress(f"preparing data (seed {a.seed}) ...")
        self.plan = make_plan(a)
        progress(f"starting a {a.nodes}-node stripefs local cluster in {self.state}")
        self.set_phase("local up")
        self.cluster.up()
        progress(f"  mounted at {self.mnt}; processes: "
                 + ", ".join(f"{k}={v}" for k, v in self.cluster.pids.items()))
        fmt = {"size": human_size(a.size), "files": f"{a.files:,}"}
        for key, label_t, fn, is_cold, kind in WORKLOADS:
            label = label_t.format(**fmt)
            progress(f"{label}")
            res = {}
            for side in ("stripefs", "local"):
                if is_cold:
                    self.set_phase(f"{side}: cold cycle before {label}")
                    self.cold(side)
                res[side] = self.measure(key, label, fn, side)
            self.results[key] = {"label": label, "kind": kind, **res}
        self.set_phase("finish")
        self.problems = self.cluster.log_problems()



# ----------------------------------------------------------------------- report


def ratio_of(res: dict) -> float | None:
    s, l = res["stripefs"], res["local"]
    key = "bytes_per_s" if "bytes_per_s" in s else "files_per_s"
    return s[key] / l[key] if l.get(key) else None


def report(bench: Bench, total_s: float) -> tuple[str, dict]:
    a = bench.args
    lines = []
    local_fs = fs_of(bench.local)
    state_fs = fs_of(bench.state)
    lines.append(f"stripefs benchmark  {_dt.datetime.now().strftime('%Y-%m-%d %H:%M:%S')}  "
                 f"commit {(git_commit() or '?')[:12]}  host {socket.gethostname()}  {os.cpu_count()} cpus"
                 f"{'  (--quick)' if a.quick else ''}")
    lines.append(f"stripefs: local cluster, {a.nodes} storage nodes, state {bench.state} "
                 f"on {state_fs['device']} ({state_fs['fstype']})")
    lines.append(f"local:    plain directory {bench.local} on {local_fs['device']} ({local_fs['fstype']}, "
                 f"mounted at {local_fs['mountpoint']}, {local_fs['options']})")
    lines.append("cold = sync + drop_caches (stripefs also: local down + local up = fresh client)"
                 + ("" if bench.cold_ok else "  ** WARNING: drop_caches FAILED, cold figures are not cold **"))
    lines.append("ratio = stripefs / local; every figure is a throughput: higher is better. MB = 10^6 bytes.")
    lines.append("cpu: stripefs = benchmark process + meta + storage nodes + mount; local = benchmark process")
    lines.append("")
    hdr = f"{'workload':34s} {'stripefs':>22s} {'local':>22s} {'ratio':>7s}   cpu (stripefs / local)"
    lines.append(hdr)
    lines.append("-" * len(hdr))
    for key, res in bench.results.items():
        s, l = res["stripefs"], res["local"]
        r = ratio_of(res)
        res["ratio"] = r
        if res["kind"] == "bytes":
            sv, lv = fmt_rate(s["bytes_per_s"]), fmt_rate(l["bytes_per_s"])
            cpu = f"{s['cpu_s_per_gib']:.2f} / {l['cpu_s_per_gib']:.2f} s/GiB"
        elif res["kind"] == "files":
            sv = f"{fmt_count(s['files_per_s'], 'f/s')} {fmt_rate(s['bytes_per_s'])}"
            lv = f"{fmt_count(l['files_per_s'], 'f/s')} {fmt_rate(l['bytes_per_s'])}"
            cpu = f"{s['cpu_s_per_gib']:.2f} / {l['cpu_s_per_gib']:.2f} s/GiB"
        else:
            sv, lv = fmt_count(s["files_per_s"], "stat/s"), fmt_count(l["files_per_s"], "stat/s")
            cpu = f"{s['cpu_us_per_file']:.0f} / {l['cpu_us_per_file']:.0f} us/file"
        rs = f"{r:6.2f}x" if r is not None else "     ?"
        lines.append(f"{res['label']:34s} {sv:>22s} {lv:>22s} {rs}   {cpu}")
    lines.append("")
    lines.append(f"stripefs cpu seconds by process: {'bench':>7s} {'mount':>7s} {'meta':>7s} {'storage':>8s}  (storage = all nodes)")
    for key, res in bench.results.items():
        s = res["stripefs"]
        by = s.get("cpu_by_process_s", {})
        stor = sum(v for k, v in by.items() if k.startswith("storage"))
        lines.append(f"  {res['label']:32s} {s['cpu_bench_s']:7.2f} {by.get('mount', 0):7.2f} "
                     f"{by.get('meta', 0):7.2f} {stor:8.2f}")
    lines.append("")
    floors = []
    for key, floor, label in FLOORS:
        if key not in bench.results:
            continue
        r = bench.results[key]["ratio"]
        ok = r is not None and r >= floor
        floors.append({"workload": key, "floor": floor, "ratio": r, "pass": ok})
        lines.append(f"{'PASS ' if ok else 'BELOW'} {label}: "
                     f"{'?' if r is None else f'{r:.2f}'}x local (floor {floor:.2f}x)")
    for key, field, goal, kind, label in GOALS:
        if key not in bench.results:
            continue
        value, local = bench.results[key]["stripefs"].get(field), bench.results[key].get("local", {}).get(field)
        ok = value is not None and (value >= goal if kind == "min" else value <= goal)
        floors.append({"workload": f"{key} {field}", "goal": goal, "value": value, "pass": ok})
        lines.append(f"{'PASS ' if ok else 'BELOW'} {label}: {'?' if value is None else f'{value:,.0f}'} "
                     f"(local disk {'?' if local is None else f'{local:,.0f}'}; goal {'>=' if kind == 'min' else '<='} {goal:,})")
    lines.append(f"total time {total_s:.0f}s")
    if bench.problems:
        lines.append("")
        lines.append("stripefs logs contain warnings/errors:")
        lines += [f"  {p}" for p in bench.problems]
    doc = {
        "when": _dt.datetime.now().isoformat(timespec="seconds"),
        "commit": git_commit(),
        "host": socket.gethostname(),
        "cpus": os.cpu_count(),
        "args": {k: v for k, v in vars(a).items()},
        "stripefs": {"state_dir": str(bench.state), "filesystem": state_fs, "nodes": a.nodes},
        "local": {"dir": str(bench.local), "filesystem": local_fs},
        "caches_dropped": bench.cold_ok,
        "results": bench.results,
        "floors": floors,
        "log_problems": bench.problems,
        "total_s": round(total_s, 1),
    }
    return "\n".join(lines), doc


# ------------------------------------------------------------------------- main


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="~10x smaller everything: a smoke run")
    ap.add_argument("--size-mib", type=int, default=None, help="big file size in MiB (default 1024; --quick 100)")
    ap.add_argument("--block-kib", type=int, default=1024, help="write/read size for the big file (default 1024)")
    ap.add_argument("--files", type=int, default=None, help="small files (default 5000; --quick 500)")
    ap.add_argument("--dirs", type=int, default=None, help="subdirectories for them (default 50; --quick 10)")
    ap.add_argument("--min-kib", type=int, default=100, help="smallest small file (default 100)")
    ap.add_argument("--max-kib", type=int, default=120, help="largest small file (default 120)")
    ap.add_argument("--nodes", type=int, default=4, help="storage nodes (default 4)")
    ap.add_argument("--workdir", default="/var/tmp",
                    help="where the run's tmp dir (cluster state, mountpoint, local dir) goes; must be a real disk, "
                         "not tmpfs (default /var/tmp)")
    ap.add_argument("--secure", action="store_true", help="CURVE on every socket (local up --secure): its cost on the data path")
    ap.add_argument("--mount-option", action="append", default=[], metavar="OPT",
                    help="an -o option for the mount from the first cold cycle on (repeatable), e.g. dataset")
    ap.add_argument("--keep", action="store_true", help="keep the tmp dir (state, logs, data) afterwards")
    ap.add_argument("--seed", type=int, default=1, help="random seed for sizes, content and shuffles")
    ap.add_argument("--phase-timeout", type=float, default=600,
                    help="abort (and tear down) if one phase takes longer, seconds (default 600)")
    ap.add_argument("--json", default=str(RESULTS / "latest.json"), help="results file (default bench/results/latest.json)")
    ap.add_argument("--strict", action="store_true", help="exit 2 if a floor is not met")
    a = ap.parse_args(argv)
    a.size_mib = a.size_mib or (100 if a.quick else 1024)
    a.files = a.files if a.files is not None else (500 if a.quick else 5000)
    a.dirs = a.dirs or (10 if a.quick else 50)
    a.size = a.size_mib * MiB
    a.block = a.block_kib * KiB
    if a.min_kib > a.max_kib or a.min_kib <= 0 or a.files <= 0 or a.dirs <= 0:
        ap.error("need 0 < --min-kib <= --max-kib, --files > 0, --dirs > 0")

    try:
        wfs = check_workdir(a.workdir)
    except BenchError as exc:
        ap.error(str(exc))

    bench = Bench(a)
    progress(f"work dir {bench.work} on {wfs['device']} ({wfs['fstype']})")

    def finish(total: float) -> int:
        text, doc = report(bench, total)
        print(text)
        write_results(doc, a.json)
        return 2 if a.strict and not all(f["pass"] for f in doc["floors"]) else 0

    return supervise(bench, finish, keep=a.keep)


if __name__ == "__main__":
    sys.exit(main())
