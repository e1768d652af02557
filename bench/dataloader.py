#!/usr/bin/env python3
"""stripefs DataLoader benchmark: a PyTorch DataLoader reading an ImageFolder
tree and tar shards through a fresh local-cluster mount AND from the local
disk, in one run, printed side by side as a ratio (stripefs / local).

    make bench                      # runs bench/run.py, bench/ec.py, then this
    .venv/bin/python bench/dataloader.py --quick      # 1,000 files: a smoke run (~1 min)
    .venv/bin/python bench/dataloader.py --only raw,prefetch --profile

Dataset (bench/imagedata.py): 8,000 real JPEG files of ~110 KiB in 100 class
folders, and the same samples in ~64 MiB tar shards; generated once into
--cache-dir, then copied into the mount and onto the local disk.

Mount modes (--modes): every workload runs through the default mount AND
through a dataset-mode mount (-o dataset: read-only, long kernel caching),
each beside the local disk in the same run (each mode gets its own cold
cycle and its own local epochs right next to its stripefs ones).

Workloads (--only takes a comma-separated list of the group names):
  raw       DataLoader, 2 persistent workers, batch 64, shuffled; each sample
            is one open(...).read() in a worker and nothing else (the
            minimal loader: the stress test, the filesystem is all there
            is); cold epoch, then a warm epoch (another shuffle)
  prefetch  as raw, through stripefs.torch.PrefetchSampler (sampler-order
            prefetch, lookahead 1024) on the mount, the workers reading with
            stripefs.torch.read_file (through the mount, where the prefetcher
            pushed the pages; --shm: from the mount's shared-memory copies,
            read_file(path, shm=True); --no-read-file: the loader's own plain
            read); the local side is plain raw. "n/a" while
            stripefs.torch is not installed.
  decode    as raw, plus PIL open + convert RGB + resize to 224x224 (what a
            training job does); cold and warm
  tar       the tar shards streamed by an IterableDataset (shards split
            across the workers), cold
  seq       one 1 GiB file read sequentially in 1 MiB reads, cold (the file
            and its check come from bench/run.py)

"Cold" = `stripefs local down`, sync + drop_caches, `stripefs local up` on the
same state (a fresh client; the local disk's caches are dropped too), then
the local cold epoch and the stripefs cold epoch; "warm" = the stripefs warm
epoch and the local warm epoch right after, nothing dropped. Each pair runs
back to back, so load from other users drifts less between the two sides.

CPU s/GiB: stripefs = this process and its children (the DataLoader workers)
plus every stripefs process (meta, storage nodes, mount), from /proc/PID/stat;
local = this process and its children. Mount RSS = VmHWM of the mount process
(/proc/PID/status; a fresh process per cold cycle), against its cache budget.
Context switches per sample, by stripefs process (voluntary and not, every
thread, /proc/PID/task/*/status): the thread hops and waits a cold file costs.
Page faults per sample, by stripefs process (minor and major, /proc/PID/stat): a
received message that lands in fresh memory costs a fault per page.

Every sample is checked, outside the timed epochs: what a timed epoch saw
(every sample once, every length, decoded shapes) after it, and each group's
checksums (xxh3 against the generator's manifest) in one more untimed epoch
through the mount per mode; a mismatch aborts the run (exit 1). Targets from
issue 16 are printed as PASS/BELOW; --strict exits 2 if one is below. --profile runs a
cold and a warm raw epoch more (and two with prefetch) per mode with
`py-spy record` attached to the mount, the metadata daemon and storage node 1
(not timed) and prints their top functions (bench/profiling.py). --dataset is
--modes dataset (the data is written through a plain mount first). The
cluster is always stopped and unmounted (Ctrl-C, SIGTERM, a phase past
--phase-timeout). See bench/README.md.
"""

from __future__ import annotations

import argparse
import fcntl
import datetime as _dt
import functools
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import profiling

from stripefs import page_cache
from common import (GiB, MiB, RESULTS, BenchError, Cluster, check_workdir, cold_cycle, fs_of, git_commit, human_size,
                    proc_cpu, progress, self_cpu, supervise, write_results)

GROUPS = ("raw", "prefetch", "decode", "tar", "seq")

# (key, group, label, cold?)
ROWS = [
    ("raw_cold", "raw", "raw read (open+read), cold", True),
    ("raw_warm", "raw", "raw read (open+read), warm", False),
    ("prefetch_cold", "prefetch", "stripefs.torch, cold epoch", True),
    ("prefetch_warm", "prefetch", "stripefs.torch, warm epoch", False),
    ("decode_cold", "decode", "JPEG decode, cold epoch", True),
    ("decode_warm", "decode", "JPEG decode, warm epoch", False),
    ("tar_cold", "tar", "tar shards, cold", True),
    ("seq_cold", "seq", "sequential read {seq}, cold", True),
]

# --shm: the prefetch rows use the mount's shared-memory copies (set by main)
SHM = False
SAMPLER_KW: dict = {}

MODES = ("default", "dataset")  # the mount's modes: default (read-write, close-to-open) and -o dataset

# the goals: issue 29's table where it sets the row (the default mount first; a goal per mode where the
# issue gives one), else issue 16's "Done when" (issue 4's targets). A floor is a ratio stripefs/local of
# the throughput, or {mode: ratio}.
TARGETS = [
    ("decode_cold", 0.95, "JPEG decode, cold epoch"),  # issue 29
    ("decode_warm", 0.95, "JPEG decode, warm epoch"),  # issue 29
    ("raw_cold", 0.40, "raw reads, cold epoch"),  # issue 29 (the dataset mount; issue 4: both)
    ("raw_warm", {"default": 0.60, "dataset": 0.80}, "raw reads, warm epoch"),  # issue 29 (issue 4: 0.40x)
    ("prefetch_cold", 1.00, "stripefs.torch (sampler-order prefetch), cold epoch"),  # issue 29
    ("prefetch_warm", 0.90, "stripefs.torch (sampler-order prefetch), warm epoch"),  # issue 29 (issue 4: 0.80x)
    ("tar_cold", 0.70, "tar-shard streaming, cold"),  # issue 4
    ("seq_cold", 0.60, "1 GiB sequential read, cold"),  # issue 4
]


def floor_of(floor: float | dict[str, float], mode: str) -> float:
    """A target's floor for one mount mode."""
    return floor[mode] if isinstance(floor, dict) else floor


CPU_MAX = 2.0  # host CPU s/GiB at most 2x the local disk's
RSS_SLACK = 200 * MiB  # the client's RSS never above its cache budget + 200 MiB


def prefetch_sampler_class():
    """stripefs.torch.PrefetchSampler, or (None, why) while it is not installed."""
    try:
        from stripefs.torch import PrefetchSampler
        return PrefetchSampler, None
    except (ImportError, AttributeError) as exc:
        return None, f"stripefs.torch.PrefetchSampler not available ({type(exc).__name__}: {exc})"


def read_file_function():
    """stripefs.torch.read_file (with shm=True under --shm: prefetched files from shared memory), or None."""
    try:
        from stripefs.torch import read_file
        return functools.partial(read_file, shm=True) if SHM else read_file
    except (ImportError, AttributeError):
        return None


def prefetcher_report(mnt: Path) -> dict | str:
    """The mount's prefetch counters (getfattr -n user.stripefs.prefetch MOUNT:
    "pending=N fetched=N stored=N failed=N", since the mount started), and
    what is left in its shared-memory directory (files prefetched for
    read_file and not read)."""
    try:
        text = os.getxattr(mnt, "user.stripefs.prefetch").decode(errors="replace")
    except OSError as exc:
        return f"unreadable: {exc.strerror}"
    try:
        out = {k: int(v) for k, v in (f.split("=", 1) for f in text.split())}
    except ValueError:
        return text
    try:
        from stripefs.prefetch_control import shm_dir
        shm = shm_dir(os.fsencode(mnt))
    except ImportError:
        shm = None
    if shm:
        out["shm_dir"] = os.fsdecode(shm)
        try:
            sizes = [e.stat().st_size for e in os.scandir(shm) if e.is_file()]
            out["shm_files_left"], out["shm_mib_left"] = len(sizes), sum(sizes) >> 20
        except OSError:
            pass
    return out


def mount_counters(url: str | None) -> dict[str, float]:
    """Request counters from the mount's Prometheus endpoint: FUSE requests
    by opcode ("fuse:lookup": every request the mount's session read, those no
    handler sees included) and RPCs by message type ("rpc:LookupReq", all
    peers); {} if there is no endpoint."""
    if not url:
        return {}
    try:
        with urllib.request.urlopen(url, timeout=5) as rsp:
            text = rsp.read().decode(errors="replace")
    except OSError:
        return {}
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("stripefs_fuse_requests_total{"):
            key = "fuse:" + line.split('opcode="', 1)[1].split('"', 1)[0]
        elif line.startswith("stripefs_rpc_seconds_count{"):
            key = "rpc:" + line.split('type="', 1)[1].split('"', 1)[0]
        elif line.startswith("stripefs_prefetch_race_total{"):  # READs of a chunk a prefetch batch was fetching
            key = "race:" + line.split('outcome="', 1)[1].split('"', 1)[0]
        elif line.startswith("stripefs_prefetch_push_seconds_total{"):  # from a batch's bytes to their push
            key = "push_us:" + line.split('stage="', 1)[1].split('"', 1)[0]
            out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1]) * 1e6  # (deltas under 1 are left out)
            continue
        elif line.startswith("stripefs_prefetch_push_total{"):  # the pushes, and the files in them
            key = "push:" + line.split('what="', 1)[1].split('"', 1)[0]
        else:
            continue
        out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def node_counters(urls: list[str]) -> dict[str, float]:
    """Requests the storage nodes handled, by message type ("node:ReadChunksReq"), summed over
    ``urls`` (their Prometheus endpoints)."""
    out: dict[str, float] = {}
    for url in urls:
        try:
            with urllib.request.urlopen(url, timeout=5) as rsp:
                text = rsp.read().decode(errors="replace")
        except OSError:
            continue
        for line in text.splitlines():
            if line.startswith("stripefs_requests_seconds_count{") and 'type="' in line:
                key = "node:" + line.split('type="', 1)[1].split('"', 1)[0]
                out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def strace_table(path: Path) -> dict[str, list[int]]:
    """{syscall: [calls, errors]} from an ``strace -c`` table ({} if it is not there)."""
    out: dict[str, list[int]] = {}
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        f = line.split()
        if len(f) in (5, 6) and f[-1] != "total" and f[3].isdigit():
            out[f[-1]] = [int(f[3]), int(f[4]) if len(f) == 6 else 0]
    return out


def proc_status(pid: int) -> dict[str, int]:
    """VmHWM and VmRSS of pid in bytes ({} if it is gone)."""
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                k, _, v = line.partition(":")
                if k in ("VmHWM", "VmRSS"):
                    out[k] = int(v.split()[0]) * 1024
    except OSError:
        pass
    return out


def mount_cache_budget(pid: int) -> tuple[int | None, str]:
    """The mount's memory cache budget in bytes, and where it came from: the
    client config named by `--config PATH` or `-o config=PATH` on its command
    line, else the ClientConfig default."""
    try:
        from stripefs.common import config as cfg
    except ImportError as exc:
        return None, f"stripefs.common.config not importable ({exc})"
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        argv = []
    path = None
    args = [a.decode(errors="replace") for a in argv]
    for i, a in enumerate(args):
        if a == "--config" and i + 1 < len(args):
            path = args[i + 1]
        elif a.startswith("--config="):
            path = a[len("--config="):]
        for opt in a.split(","):
            if opt.startswith("config=") and not path:
                path = opt[len("config="):]
    try:
        conf = cfg.load(path, cfg.ClientConfig) if path else cfg.ClientConfig()
    except Exception as exc:  # noqa: BLE001 - a report line, not a failure
        return None, f"cannot read {path}: {exc}"
    for name in ("cache_size", "memory_cache_size", "cache_budget", "mem_cache_size"):
        if hasattr(conf, name):
            return int(getattr(conf, name)), f"{name} from {path or 'the ClientConfig default'}"
    return None, "no cache size field in ClientConfig"


def bench_cpu() -> float:
    """CPU seconds of this process and its children, the live ones included: persistent
    DataLoader workers are not waited for, so os.times() alone would never count them."""
    live = 0.0
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/children") as f:
                pids = f.read().split()
        except OSError:
            continue
        live += sum(c for c in (proc_cpu(int(pid)) for pid in pids) if c is not None)
    return self_cpu() + live


# ---------------------------------------------------------------------- runner


class Bench:
    def __init__(self, args):
        self.args = args
        self.work = Path(tempfile.mkdtemp(prefix="stripefs-dlbench-", dir=args.workdir))
        self.state = self.work / "state"
        self.mnt = self.work / "mnt"
        self.local = self.work / "local"
        self.local.mkdir()
        self.cluster = Cluster(self.state, self.mnt, args.nodes)
        self.phase = ("setup", time.monotonic(), args.phase_timeout)
        self.results: dict[str, dict] = {}
        self.scan: dict[str, dict] = {}
        self.profiles: dict[str, dict] = {}
        self.problems: list[str] = []
        self.cold_ok = True
        self.budget: tuple[int | None, str] = (None, "mount not started")
        self.recorder: profiling.Recorder | None = None
        self.read_file_used = False
        self.mode = "default"  # the mount mode being measured (self.results keys are "row@mode")

    # -- plumbing

    def set_phase(self, name: str) -> None:
        self.phase = (name, time.monotonic(), self.args.phase_timeout)

    def root(self, side: str) -> Path:
        return (self.mnt if side == "stripefs" else self.local) / "data"

    def cold(self, side: str) -> None:
        """side "stripefs" or "both": the stripefs cycle (down, drop_caches, up) empties every cache."""
        self.set_phase(f"{side}: cold cycle")
        self.cold_ok &= cold_cycle(self.cluster, "stripefs" if side == "both" else side)

    def abort(self) -> None:
        """From the supervisor thread: stop a dataset generation or copy and
        py-spy if they run (the DataLoader workers are daemonic children: they
        end with this process)."""
        import imagedata

        imagedata.cancel.set()
        if self.recorder is not None:
            self.recorder.kill()

    def after_teardown(self) -> None:
        """Every mount is stopped now: report the shared-memory directories they left behind."""
        dirs = {r["stripefs"]["prefetcher"].get("shm_dir") for r in self.results.values()
                if isinstance(r.get("stripefs", {}).get("prefetcher"), dict)} - {None}
        for d in sorted(d for d in dirs if os.path.exists(d)):
            progress(f"WARNING: the stopped mount left its shared-memory directory {d} behind")

    def set_mode(self, mode: str) -> None:
        """Every later `local up` (each cold cycle) mounts in this mode."""
        self.mode = mode
        self.cluster.options = ["dataset"] if mode == "dataset" else list(filter(None, self.args.mount_options.split(",")))

    def measure(self, key: str, label: str, side: str, fn) -> dict:
        """Time fn(); it returns (figures, check): check() runs after the timing."""
        self.set_phase(f"{side} [{self.mode}]: {label}")
        url = self.cluster.metrics.get("mount") if side == "stripefs" else None
        node_urls = [u for n, u in self.cluster.metrics.items() if n.startswith("storage")] if side == "stripefs" else []
        before_ops = {**mount_counters(url), **node_counters(node_urls)}
        before_p = self.cluster.cpu()  # on the local side: what the idle cluster burns meanwhile (not counted)
        before_x = self.cluster.switches()
        before_f = self.cluster.faults()
        before_t = self.cluster.threads()
        before_s = bench_cpu()
        # no test on this machine drops the kernel's caches meanwhile (they wait: stripefs/page_cache.py);
        # a program that knows nothing of the lock still can, and is counted
        drops = page_cache.drops()
        fcntl.flock(page_cache.lock_fd(), fcntl.LOCK_SH)
        strace = self.strace_mount(key) if side == "stripefs" else None
        try:
            t = time.perf_counter()
            out, check = fn()
            wall = time.perf_counter() - t
        finally:
            fcntl.flock(page_cache.lock_fd(), fcntl.LOCK_UN)
            if strace is not None:
                strace.send_signal(signal.SIGINT)  # detaches and writes its table
                strace.wait(30)
                strace = strace_table(self.work / f"strace-{key}@{self.mode}.txt")
        drops = page_cache.drops() - drops
        cpu_self = bench_cpu() - before_s
        after_p = self.cluster.cpu()
        after_x = self.cluster.switches()
        after_f = self.cluster.faults()
        after_t = self.cluster.threads()
        after_ops = {**mount_counters(url), **node_counters(node_urls)}
        try:
            check()  # what the epoch saw: outside the timing
        except ValueError as exc:  # run_epoch's verdict on the data
            raise BenchError(f"{side} [{self.mode}] {label}: {exc}") from None
        cpu_procs = {k: round(after_p[k] - before_p[k], 3) for k in after_p}
        idle_cluster = None
        if side == "local":
            idle_cluster, cpu_procs = round(sum(cpu_procs.values()), 3), {}
        cpu = cpu_self + sum(cpu_procs.values())
        r = {"wall_s": round(wall, 3), "cpu_s": round(cpu, 3), "cpu_bench_s": round(cpu_self, 3), **out,
             "mib_per_s": out["bytes"] / MiB / wall, "cpu_s_per_gib": cpu / (out["bytes"] / GiB)}
        if "samples" in out:
            r["samples_per_s"] = out["samples"] / wall
        if cpu_procs:
            r["cpu_by_process_s"] = cpu_procs
            # thread hops and waits: a cold epoch is a chain of them per file
            r["switches_by_process"] = {k: after_x[k] - before_x[k] for k in after_x if k in before_x}
            # fresh pages: each received message that lands in new memory costs its page faults
            r["faults_by_process"] = {k: after_f[k] - before_f[k] for k in after_f if k in before_f}
            # where each process's CPU went, by thread kind: [CPU s, s waiting for a core, times run]
            # (bench/common.py proc_threads)
            r["threads_by_process"] = {
                k: {t: [round(v - b, 4) for v, b in zip(vals, before_t[k].get(t, (0.0, 0.0, 0)))]
                    for t, vals in after_t[k].items()}
                for k in after_t if k in before_t}
        if idle_cluster is not None:
            r["cpu_idle_cluster_s"] = idle_cluster  # competes with the local epoch for the CPUs
        if drops:
            r["cache_drops"] = drops  # the kernel's names and pages went mid-epoch: its figures are not this code's
            progress(f"  WARNING: {drops} drop(s) of the machine's page cache or dentries during {side} [{self.mode}] {label}")
        r["loadavg_1m"] = os.getloadavg()[0]  # other users' load: context for noisy figures
        ops = {k: int(v - before_ops.get(k, 0)) for k, v in after_ops.items() if v - before_ops.get(k, 0) >= 1}
        if ops:
            r["mount_requests"] = ops  # FUSE operations and RPCs the mount handled during the epoch
        if strace:
            r["mount_syscalls"] = strace  # {syscall: [calls, errors]} under strace (--strace-mount)
        if side == "stripefs":
            st = proc_status(self.cluster.pids["mount"])
            r["mount_vmhwm"] = st.get("VmHWM")
            r["mount_vmrss"] = st.get("VmRSS")
        rate = f"{r['samples_per_s']:,.0f} samples/s, " if "samples" in out else ""
        progress(f"  {side:8s} [{self.mode}] {label}: {rate}{r['mib_per_s']:.0f} MiB/s ({wall:.1f}s, cpu {cpu:.1f}s"
                 + (f", mount VmHWM {r['mount_vmhwm'] / MiB:.0f} MiB)" if r.get("mount_vmhwm") else ")"))
        return r

    def strace_mount(self, key: str):
        """``strace -c -f`` attached to the mount for the epochs ``--strace-mount`` names (not for a
        timed comparison: strace slows every syscall), its table in the workdir; the process, or None."""
        if key not in self.args.strace_mount.split(","):
            return None
        import subprocess

        out = self.work / f"strace-{key}@{self.mode}.txt"
        proc = subprocess.Popen(["strace", "-c", "-f", "-o", str(out), "-p", str(self.cluster.pids["mount"])],
                                stderr=subprocess.DEVNULL)
        time.sleep(1.0)  # attached to every thread before the epoch starts
        progress(f"  strace -c -f of the mount during {key} [{self.mode}]: {out}")
        return proc

    # -- setup

    def run(self) -> None:
        a = self.args
        import imagedata

        self.set_phase("dataset")
        need_tree = bool({"raw", "prefetch", "decode"} & a.only)
        if need_tree or "tar" in a.only:
            cache = imagedata.ensure(Path(a.cache_dir), a.files, a.classes, a.shard_mib * MiB, a.seed)
            self.manifest = imagedata.load_manifest(cache)
            self.rels = sorted(self.manifest)
            self.index = {r: i for i, r in enumerate(self.rels)}
        progress(f"starting a {a.nodes}-node stripefs local cluster in {self.state}")
        self.set_phase("local up")
        self.cluster.up()
        self.budget = mount_cache_budget(self.cluster.pids["mount"])
        progress(f"  mounted at {self.mnt}; processes: " + ", ".join(f"{k}={v}" for k, v in self.cluster.pids.items()))
        for side in ("stripefs", "local"):
            self.set_phase(f"{side}: copying the dataset")
            self.root(side).mkdir()
            if need_tree:
                imagedata.copy_tree(cache / "tree", self.root(side) / "tree", f"{side}: copying the JPEG tree",
                                    threads=8)
            if "tar" in a.only:
                imagedata.copy_tree(cache / "shards", self.root(side) / "shards", f"{side}: copying the tar shards",
                                    threads=2)
            if "seq" in a.only:
                self.write_seq_file(side)
        # each group in each mode (a dataset-mode mount is read-only: the data is written above);
        # each mode's cold cycle remounts in that mode
        for group in GROUPS:
            if group not in a.only:
                continue
            for mode in a.modes:
                self.set_mode(mode)
                if group in ("raw", "prefetch"):
                    self.tree_group(group, "raw")
                elif group == "decode":
                    self.tree_group("decode", "decode")
                elif group == "tar":
                    self.tar_group()
                else:
                    self.seq_group()
        if a.profile:
            for mode in a.modes:
                self.set_mode(mode)
                self.profile_runs()
        self.set_phase("finish")
        self.problems = self.cluster.log_problems()

    def write_seq_file(self, side: str) -> None:
        import run as runbench  # the 1 GiB file and its check come from bench/run.py

        if not hasattr(self, "seq_plan"):
            a = self.args
            self.seq_plan = runbench.make_plan(SimpleNamespace(seed=a.seed, min_kib=100, max_kib=120, block=MiB,
                                                               size=a.seq_mib * MiB, files=0, dirs=1))
        t = time.monotonic()
        runbench.w_seq_write(self.root(side), self.seq_plan)
        progress(f"  {side}: wrote {human_size(self.seq_plan.size)} in {time.monotonic() - t:.1f}s")

    # -- workloads

    def rows_of(self, group: str) -> list[tuple[str, str, bool]]:
        fmt = {"seq": human_size(self.args.seq_mib * MiB)}
        return [(k, label.format(**fmt), cold) for k, g, label, cold in ROWS if g == group]

    # Order of the measurements. One cold cycle (the stripefs cycle drops the
    # kernel's caches for the local disk too) serves both sides, so the pair of
    # cold epochs and the pair of warm ones run next to each other in time (the
    # machine is shared: load drifts over minutes):
    #     cycle, local cold, stripefs cold, stripefs warm, local warm
    # The local disk's page cache survives the stripefs epochs in between
    # (nothing is dropped), and the stripefs cold epoch reads chunk files the
    # local cold epoch never touched.
    COLD_WARM_ORDER = [("local", 0), ("stripefs", 0), ("stripefs", 1), ("local", 1)]
    COLD_ORDER = [("local", 0), ("stripefs", 0)]

    def run_pairs(self, group: str, epoch_fn) -> None:
        """Measure every row of group on both sides, --repeat times; epoch_fn(side, n)
        -> the function to time (n: row number; n == 0 is the cold epoch).

        With repetitions, each row keeps the repetition whose ratio is the median
        (its figures, CPU and counters, all from the same pair of epochs) and the
        list of every repetition's ratio."""
        rows = self.rows_of(group)
        order = self.COLD_WARM_ORDER if len(rows) == 2 else self.COLD_ORDER
        runs: dict[str, list[dict]] = {key: [] for key, _, _ in rows}
        for rep in range(self.args.repeat):
            pair: dict[str, dict] = {key: {} for key, _, _ in rows}
            self.cold("both")
            for side, n in order:
                key, label, _ = rows[n]
                progress(f"{label} ({side}, {self.mode} mount)" + (f", repetition {rep + 1}/{self.args.repeat}" if self.args.repeat > 1
                                                else ""))
                pair[key][side] = self.measure(key, label, side, epoch_fn(side, n))
            for key in runs:
                runs[key].append(pair[key])
        for key, label, _ in rows:
            reps = sorted(runs[key], key=lambda r: r["stripefs"]["mib_per_s"] / r["local"]["mib_per_s"])
            res = self.results[f"{key}@{self.mode}"] = {"label": label, "mode": self.mode, "row": key,
                                                        **reps[(len(reps) - 1) // 2]}
            res["ratios"] = [round(r["stripefs"]["mib_per_s"] / r["local"]["mib_per_s"], 5) for r in runs[key]]
            res["cpu_ratios"] = [round(r["stripefs"]["cpu_s_per_gib"] / r["local"]["cpu_s_per_gib"], 2)
                                 for r in runs[key] if r["local"]["cpu_s_per_gib"]]

    def tree_group(self, group: str, mode: str) -> None:
        import loaders

        a = self.args
        sampler_cls = None
        if group == "prefetch":
            sampler_cls, why = prefetch_sampler_class()
            if sampler_cls is None:
                progress(f"{group}: n/a: {why}")
                for key, label, _ in self.rows_of(group):
                    self.results[f"{key}@{self.mode}"] = {"label": label, "mode": self.mode, "row": key, "na": why}
                return
        datasets: dict[str, object] = {}
        loaders_: dict[str, object] = {}  # side -> its DataLoader, workers kept from the cold epoch to the warm one

        def reader_for(side: str):
            if sampler_cls is not None and side == "stripefs" and not a.no_read_file:
                reader = read_file_function()  # None: plain reads through the mount
                self.read_file_used = reader is not None
                return reader
            return None

        def sampler_for(side: str, ds, seed: int):
            sampler = loaders.random_sampler(ds, seed)  # the same shuffles on both sides; a new one each epoch
            if sampler_cls is not None and side == "stripefs":
                sampler = sampler_cls(sampler, paths=[str(p) for p in ds.paths], lookahead=a.lookahead, **SAMPLER_KW)
            return sampler

        def epoch_fn(side: str, n: int):
            if n == 0:  # the tree scan (ImageFolder's) is not timed: it is before the first epoch
                self.set_phase(f"{side}: scanning the tree")
                t = time.perf_counter()
                ds = datasets[side] = loaders.ImageTree(self.root(side) / "tree", mode)
                scan_s = time.perf_counter() - t
                if ds.rels != self.rels:
                    raise BenchError(f"{side}: the tree lists {len(ds.rels)} samples, the dataset has "
                                     f"{len(self.rels)} (or other names)")
                self.scan.setdefault(f"{group}@{self.mode}", {})[side] = {"files": len(ds), "s": round(scan_s, 3)}
                ds.reader = reader_for(side)
                # persistent workers: made at the cold epoch's first batch (inside its timing, as in a job)
                loaders_[side] = loaders.make_loader(ds, seed=0, batch_size=a.batch_size, workers=a.workers,
                                                     sampler=sampler_for(side, ds, a.seed * 1000))
            loader = loaders_[side]

            def epoch():
                out, check = loaders.run_epoch(loader, self.rels, self.manifest, mode)
                if sampler_cls is not None and side == "stripefs":
                    out["prefetcher"] = prefetcher_report(self.mnt)  # one getxattr: inside the timing, negligible
                return out, check

            return epoch

        try:
            self.run_pairs(group, epoch_fn)
            if mode == "raw":
                self.verify_epoch(f"{group}", lambda: self._verify_tree(sampler_for, reader_for))
        except BenchError:
            raise
        except Exception as exc:
            if group != "prefetch":
                raise
            # the prefetch path is new: its failure is a finding, not the end of the run
            traceback.print_exc()
            why = f"failed: {type(exc).__name__}: {exc}"
            progress(f"  {group}: {why}")
            for key, label, _ in self.rows_of(group):
                self.results[f"{key}@{self.mode}"] = {"label": label, "mode": self.mode, "row": key, "na": why}
        finally:
            loaders_.clear()  # ends the persistent workers

    def _verify_tree(self, sampler_for, reader_for):
        import loaders

        a = self.args
        ds = loaders.ImageTree(self.root("stripefs") / "tree", "raw", verify=True)
        ds.reader = reader_for("stripefs")
        loader = loaders.make_loader(ds, seed=0, batch_size=a.batch_size, workers=a.workers, persistent=False,
                                     sampler=sampler_for("stripefs", ds, a.seed * 1000 + 99))
        return loaders.run_epoch(loader, self.rels, self.manifest, "raw")

    def verify_epoch(self, group: str, fn) -> None:
        """One untimed epoch through the mount with every sample's length and xxh3 checked."""
        self.set_phase(f"stripefs [{self.mode}]: {group}: verifying every sample")
        t = time.perf_counter()
        _out, check = fn()
        try:
            check()
        except ValueError as exc:
            raise BenchError(f"stripefs [{self.mode}] {group}, verification epoch: {exc}") from None
        progress(f"  stripefs [{self.mode}] {group}: every sample's length and xxh3 verified "
                 f"(untimed epoch, {time.perf_counter() - t:.1f}s)")

    def tar_group(self) -> None:
        import loaders

        a = self.args

        def epoch_fn(side: str, n: int):
            ds = loaders.TarShards(self.root(side) / "shards", self.index, a.seed)

            def epoch():
                loader = loaders.make_loader(ds, seed=a.seed, batch_size=a.batch_size, workers=a.workers)
                out, check = loaders.run_epoch(loader, self.rels, self.manifest, "raw")
                return {**out, "shards": len(ds.shards)}, check

            return epoch

        self.run_pairs("tar", epoch_fn)

        def verify():
            ds = loaders.TarShards(self.root("stripefs") / "shards", self.index, a.seed, verify=True)
            loader = loaders.make_loader(ds, seed=a.seed, batch_size=a.batch_size, workers=a.workers,
                                         persistent=False)
            return loaders.run_epoch(loader, self.rels, self.manifest, "raw")

        self.verify_epoch("tar", verify)

    def seq_group(self) -> None:
        import run as runbench

        def timed(side):
            return lambda: (runbench.w_seq_read(self.root(side), self.seq_plan), lambda: None)

        self.run_pairs("seq", lambda side, n: timed(side))

    # -- profiling (not timed)

    def profile_runs(self) -> None:
        import loaders

        a = self.args
        exe = a.py_spy or shutil.which("py-spy")
        if not exe:
            progress("--profile: py-spy not found (pip install py-spy, or give --py-spy PATH); no profile")
            self.profiles["error"] = {"error": "py-spy not found"}
            return
        sampler_cls, why = prefetch_sampler_class()
        variants = [("raw", None)] + ([("prefetch", sampler_cls)] if sampler_cls else [])
        for name, cls in variants:
            progress(f"profiling the mount, the metadata daemon and storage node 1 during a cold and a warm "
                     f"{name} epoch, {self.mode} mount (not timed)")
            self.cold("both")
            ds = loaders.ImageTree(self.root("stripefs") / "tree", "raw")
            if cls is not None and not a.no_read_file:
                ds.reader = read_file_function()
            for n, temp in enumerate(("cold", "warm")):
                sampler = loaders.random_sampler(ds, a.seed * 1000 + 7 + n)
                if cls is not None:
                    sampler = cls(sampler, paths=[str(p) for p in ds.paths], lookahead=a.lookahead, **SAMPLER_KW)
                self.profiled_epoch(exe, name, temp, ds, sampler)

    def profiled_epoch(self, exe: str, name: str, temp: str, ds, sampler) -> None:
        import loaders

        a = self.args
        self.set_phase(f"stripefs [{self.mode}]: profiled {temp} {name} epoch")
        procs = {proc: self.cluster.pids[proc] for proc in ("mount", "meta", "storage-1")}
        name = f"{name}-{self.mode}"
        self.recorder = profiling.Recorder(exe, procs, RESULTS / f"dataloader-profile-{name}-{temp}",
                                           native=a.profile_native)
        with self.recorder:
            t = time.perf_counter()
            _out, check = loaders.run_epoch(loaders.make_loader(ds, seed=0, batch_size=a.batch_size,
                                                                workers=a.workers, sampler=sampler, persistent=False),
                                            self.rels, self.manifest, "raw")
            wall = time.perf_counter() - t
        try:
            check()
        except ValueError as exc:  # run_epoch's verdict on the data
            raise BenchError(f"stripefs profiled {temp} {name} epoch: {exc}") from None
        progress(f"  {temp} {name} epoch under py-spy: {len(ds) / wall:,.0f} samples/s")
        for proc, (out, err) in self.recorder.results.items():
            key = f"{name}-{temp}-{proc}"
            if err is not None:
                progress(f"  py-spy wrote nothing for the {proc}: {err}")
                self.profiles[key] = {"error": err}
                continue
            self.profiles[key] = {"workload": name, "epoch": temp, "process": proc,
                                  **profiling.summarise(out, wall)}
            progress(f"  {proc}: {self.profiles[key]['samples']} samples in {wall:.1f}s -> {out}")


def ratio(res: dict, key: str) -> float | None:
    s, l = res.get("stripefs"), res.get("local")
    if not s or not l or not l.get(key):
        return None
    return s[key] / l[key]


def report(bench: Bench, total_s: float) -> tuple[str, dict]:
    a = bench.args
    lines = []
    local_fs, state_fs = fs_of(bench.local), fs_of(bench.state)
    budget, budget_src = bench.budget
    lines.append(f"stripefs DataLoader benchmark  {_dt.datetime.now().strftime('%Y-%m-%d %H:%M:%S')}  "
                 f"commit {(git_commit() or '?')[:12]}  host {socket.gethostname()}  {os.cpu_count()} cpus"
                 f"{'  (--quick)' if a.quick else ''}")
    lines.append(f"dataset: {a.files:,} JPEG files (~110 KiB) in {a.classes} classes, tar shards of ~{a.shard_mib} MiB; "
                 f"DataLoader: {a.workers} workers, batch {a.batch_size}, shuffled")
    lines.append(f"stripefs: local cluster, {a.nodes} storage nodes, "
                 f"mount modes: {', '.join(m + (' (-o dataset)' if m == 'dataset' else ' (read-write)') for m in a.modes)}, "
                 f"state on {state_fs['device']} ({state_fs['fstype']}); "
                 f"local: plain directory on {local_fs['device']} ({local_fs['fstype']})")
    lines.append("cold = stripefs local down, sync + drop_caches, local up (fresh client; the local disk's caches "
                 "are dropped too), then the local cold epoch, the stripefs cold and warm epochs, the local warm one"
                 + ("" if bench.cold_ok else "  ** WARNING: drop_caches FAILED, cold figures are not cold **"))
    loads = [r[side]["loadavg_1m"] for r in bench.results.values() for side in ("stripefs", "local") if side in r]
    if loads:
        lines.append(f"host load average (1 min) after each measurement: {min(loads):.1f} to {max(loads):.1f} on "
                     f"{os.cpu_count()} cpus (other users' work makes figures noisy; compare the ratios)")
    lines.append("ratio = stripefs / local (higher is better); cpu = host CPU s per GiB read: stripefs = benchmark + "
                 "DataLoader workers + meta + storage + mount; local = benchmark + workers. MiB = 2^20 bytes.")
    lines.append("")
    hdr = (f"{'workload':30s} {'mount':8s} {'stripefs':>25s} {'local':>25s} {'ratio':>6s} {'range':>10s}  "
           f"{'cpu s/GiB stripefs / local':>27s}  {'mount RSS':>9s}")
    lines.append(hdr)
    lines.append("-" * len(hdr))

    def fig(r: dict) -> str:
        if "samples_per_s" in r:
            return f"{r['samples_per_s']:,.0f} smp/s {r['mib_per_s']:,.0f} MiB/s"
        return f"{r['mib_per_s']:,.0f} MiB/s"

    def rng(values: list[float] | None) -> str:
        return f"{min(values):.2f}-{max(values):.2f}" if values else ""

    for key, res in bench.results.items():
        if "na" in res:
            lines.append(f"{res['label']:30s} {res['mode']:8s} {'n/a':>25s} {'':>25s} {'':>6s}  {res['na']}")
            continue
        s, l = res["stripefs"], res["local"]
        res["ratio"] = ratio(res, "mib_per_s")
        res["cpu_ratio"] = s["cpu_s_per_gib"] / l["cpu_s_per_gib"] if l["cpu_s_per_gib"] else None
        rs = f"{res['ratio']:5.2f}x" if res["ratio"] is not None else "    ?"
        cr = f"({res['cpu_ratio']:.1f}x)" if res["cpu_ratio"] is not None else "(?)"
        cpu = f"{s['cpu_s_per_gib']:.2f} / {l['cpu_s_per_gib']:.2f} {cr}"
        rss = f"{s['mount_vmhwm'] / MiB:,.0f} MiB" if s.get("mount_vmhwm") else "?"
        lines.append(f"{res['label']:30s} {res['mode']:8s} {fig(s):>25s} {fig(l):>25s} {rs} {rng(res.get('ratios')):>10s}"
                     f"  {cpu:>27s}  {rss:>9s}")
    lines.append(f"ratio = the repetition with the median ratio of {a.repeat}; range = all {a.repeat} repetitions' "
                 "ratios (each against the local epoch measured next to it)")
    lines.append("")
    # the table: each row's ratio to the local disk, default mount beside dataset mode
    lines.append(f"{'workload (ratio to the local disk, min-max over repeats)':58s} "
                 + " ".join(f"{m + ' mount':>18s}" for m in a.modes) + f"  {'goal':>10s}")
    goals = {k: ">= " + ("/".join(f"{floor_of(v, m):.2f}" for m in a.modes) if isinstance(v, dict) else f"{v:.2f}") + "x"
             for k, v, _ in TARGETS}

    def cell(key: str, mode: str, field: str = "ratios") -> str:
        res = bench.results.get(f"{key}@{mode}")
        if res is None:
            return "-"
        if "na" in res:
            return "n/a"
        vals = res.get(field)
        med = res["ratio"] if field == "ratios" else res["cpu_ratio"]
        return f"{med:.2f}x ({rng(vals)})" if med is not None else "?"

    for key, _group, label, _cold in ROWS:
        if any(f"{key}@{m}" in bench.results for m in a.modes):
            lines.append(f"{label.format(seq=human_size(a.seq_mib * MiB)):58s} "
                         + " ".join(f"{cell(key, m):>18s}" for m in a.modes) + f"  {goals.get(key, ''):>10s}")
        if key == "raw_cold" and any(f"{key}@{m}" in bench.results for m in a.modes):
            lines.append(f"{'host CPU s/GiB, raw read cold (stripefs / local)':58s} "
                         + " ".join(f"{cell(key, m, 'cpu_ratios'):>18s}" for m in a.modes)
                         + f"  {f'<= {CPU_MAX:.1f}x':>10s}")
    lines.append("")
    lines.append(f"stripefs cpu seconds by process: {'bench+workers':>13s} {'mount':>7s} {'meta':>7s} {'storage':>8s}"
                 f"   (idle cluster during the local epoch, not counted)")
    for key, res in bench.results.items():
        if "na" in res:
            continue
        s = res["stripefs"]
        by = s.get("cpu_by_process_s", {})
        stor = sum(v for k, v in by.items() if k.startswith("storage"))
        lines.append(f"  {res['label'] + ' [' + res['mode'] + ']':40s} {s['cpu_bench_s']:13.2f} {by.get('mount', 0):7.2f} "
                     f"{by.get('meta', 0):7.2f} {stor:8.2f}   ({res['local'].get('cpu_idle_cluster_s', 0):.2f})")
    for title, field in (("context switches", "switches_by_process"), ("page faults", "faults_by_process")):
        lines.append(f"{'stripefs ' + title + ' per sample, by process (every thread):':65s}"
                     f"{'mount':>7s} {'meta':>7s} {'storage':>8s}")
        for key, res in bench.results.items():
            if "na" in res or not res["stripefs"].get("samples"):
                continue
            s = res["stripefs"]
            by, n = s.get(field, {}), s["samples"]
            stor = sum(v for k, v in by.items() if k.startswith("storage"))
            lines.append(f"  {res['label'] + ' [' + res['mode'] + ']':40s} {'':25s}{by.get('mount', 0) / n:7.1f} "
                         f"{by.get('meta', 0) / n:7.1f} {stor / n:8.1f}")
    thread_rows = [(f"{res['label']} [{res['mode']}]", res["stripefs"]) for res in bench.results.values()
                   if "na" not in res and res["stripefs"].get("threads_by_process") and res["stripefs"].get("samples")]
    if thread_rows:
        lines.append("stripefs CPU per sample by thread (us on a core / us runnable, waiting for a core / times run), "
                     "the mount | the storage nodes summed:")
        for label, s in thread_rows:
            n, by = s["samples"], s["threads_by_process"]
            nodes: dict[str, list[float]] = {}
            for proc, threads in by.items():
                if proc.startswith("storage"):
                    for t, vals in threads.items():
                        acc = nodes.setdefault(t, [0.0, 0.0, 0])
                        for i, v in enumerate(vals):
                            acc[i] += v

            def cells(threads) -> str:
                return " ".join(f"{t} {c / n * 1e6:.0f}/{w / n * 1e6:.0f}/{runs / n:.1f}" for t, (c, w, runs)
                                in sorted(threads.items(), key=lambda kv: -kv[1][0]) if c / n * 1e6 >= 1)
            lines.append(f"  {label:40s} {cells(by.get('mount', {})) or '-'} | {cells(nodes) or '-'}")
    for res in bench.results.values():
        sc = res.get("stripefs", {}).get("mount_syscalls") if "na" not in res else None
        if sc and res["stripefs"].get("samples"):
            n = res["stripefs"]["samples"]
            lines.append(f"mount syscalls per sample under strace -c -f, {res['label']} [{res['mode']}] (calls/failed): "
                         + " ".join(f"{k} {c / n:.2f}/{e / n:.2f}" for k, (c, e)
                                    in sorted(sc.items(), key=lambda kv: -kv[1][0]) if c / n >= 0.05))
    if any(k.startswith("prefetch_cold@") and "na" not in r for k, r in bench.results.items()):
        how = ("plain reads through the mount (page cache)" if not bench.read_file_used
               else "stripefs.torch.read_file(shm=True) (shared memory, falls back to the mount)" if SHM
               else "stripefs.torch.read_file (through the mount: the page cache the prefetcher filled)")
        lines.append(f"prefetch rows: PrefetchSampler(lookahead {a.lookahead}); the workers read with {how}")
    for key, res in bench.results.items():
        pf = res.get("stripefs", {}).get("prefetcher") if "na" not in res else None
        if pf is not None:
            text = (" ".join(f"{k}={v:,}" for k, v in pf.items() if k != "shm_dir") if isinstance(pf, dict)
                    else pf)
            lines.append(f"prefetcher after the {res['label']} [{res['mode']}] (counters since the mount started): {text}")
    req_rows = [(f"{res['label']} [{res['mode']}]", res["stripefs"]) for res in bench.results.values()
                if "na" not in res and res["stripefs"].get("mount_requests") and res["stripefs"].get("samples")]
    if req_rows:
        lines.append("mount requests per sample (FUSE operations | RPCs to daemon and nodes), from its metrics:")
        for label, s in req_rows:
            n = s["samples"]
            fuse = " ".join(f"{k[5:]} {v / n:.2f}" for k, v in sorted(s["mount_requests"].items(), key=lambda kv: -kv[1])
                            if k.startswith("fuse:") and v / n >= 0.01)
            rpc = " ".join(f"{k[4:]} {v / n:.2f}" for k, v in sorted(s["mount_requests"].items(), key=lambda kv: -kv[1])
                           if k.startswith("rpc:") and v / n >= 0.01)
            race = " ".join(f"{k[5:]} {v / n:.3f}" for k, v in sorted(s["mount_requests"].items()) if k.startswith("race:"))
            pushes = s["mount_requests"].get("push:files", 0)
            push = " ".join(f"{k[8:]} {v / pushes:.0f}" for k, v in s["mount_requests"].items()
                            if k.startswith("push_us:")) if pushes else ""
            if pushes:  # us per file pushed, by stage, from its batch's bytes landing to its push done
                push = (f"{pushes / n:.2f} pushed a sample in {s['mount_requests'].get('push:hops', 0) / n:.3f} hops; "
                        f"us a file pushed: {push}")
            node = " ".join(f"{k[5:]} {v / n:.2f}" for k, v in sorted(s["mount_requests"].items(), key=lambda kv: -kv[1])
                            if k.startswith("node:") and v / n >= 0.01)
            lines.append(f"  {label:40s} {fuse or '-'} | {rpc or '-'}" + (f" | nodes handled: {node}" if node else "")
                         + (f" | prefetch race: {race}" if race else "") + (f" | push: {push}" if push else ""))
    for group, sides in bench.scan.items():
        if "stripefs" in sides and "local" in sides:
            lines.append(f"tree scan before the cold {group} epoch ({sides['stripefs']['files']:,} files, "
                         f"readdir of every class folder): stripefs {sides['stripefs']['s']:.2f}s, "
                         f"local {sides['local']['s']:.2f}s")
    lines.append("")

    # targets
    targets = []

    def verdict(ok: bool | None) -> str:
        return "n/a  " if ok is None else ("PASS " if ok else "BELOW")

    for mode in a.modes:
        for key, floor, label in TARGETS:
            res = bench.results.get(f"{key}@{mode}")
            if res is None:
                continue
            r, need = res.get("ratio"), floor_of(floor, mode)
            ok = None if r is None else r >= need
            spread = f" (range {min(res['ratios']):.2f}-{max(res['ratios']):.2f}x)" if len(res.get("ratios") or ()) > 1 else ""
            targets.append({"target": f"{key}@{mode}", "min_ratio": need, "ratio": r, "pass": ok})
            lines.append(f"{verdict(ok)} [{mode}] {label}: {'n/a' if r is None else f'{r:.2f}x'} local{spread} "
                         f"(target >= {need:.2f}x)")
    for key, res in bench.results.items():
        c = res.get("cpu_ratio")
        if "na" in res or c is None:
            continue
        ok = c <= CPU_MAX
        targets.append({"target": f"cpu:{key}", "max_ratio": CPU_MAX, "ratio": c, "pass": ok})
        lines.append(f"{verdict(ok)} [{res['mode']}] CPU per GiB, {res['label']}: {c:.2f}x local (target <= {CPU_MAX:.1f}x)")
    peaks = [res["stripefs"].get("mount_vmhwm") or 0 for res in bench.results.values() if "stripefs" in res]
    peak = max(peaks, default=0)
    if peak:
        limit = budget + RSS_SLACK if budget is not None else None
        ok = None if limit is None else peak <= limit
        targets.append({"target": "mount_rss", "peak": peak, "limit": limit, "pass": ok})
        lines.append(f"{verdict(ok)} mount peak RSS {peak / MiB:,.0f} MiB (VmHWM) vs cache budget "
                     + (f"{budget / MiB:,.0f} MiB + 200 MiB ({budget_src})" if budget is not None else f"? ({budget_src})"))
    lines.append(f"total time {total_s:.0f}s")

    for name, prof in bench.profiles.items():
        lines.append("")
        lines += profiling.format_summary(name, prof)
    if bench.problems:
        lines.append("")
        lines.append("stripefs logs contain warnings/errors:")
        lines += [f"  {p}" for p in bench.problems]
    doc = {
        "when": _dt.datetime.now().isoformat(timespec="seconds"),
        "commit": git_commit(),
        "host": socket.gethostname(),
        "cpus": os.cpu_count(),
        "args": {k: (sorted(v) if isinstance(v, set) else v) for k, v in vars(a).items()},
        "stripefs": {"state_dir": str(bench.state), "filesystem": state_fs, "nodes": a.nodes,
                     "mount_cache_budget": budget, "budget_source": budget_src},
        "local": {"dir": str(bench.local), "filesystem": local_fs},
        "caches_dropped": bench.cold_ok,
        "results": bench.results,
        "scan": bench.scan,
        "targets": targets,
        "profiles": bench.profiles,
        "log_problems": bench.problems,
        "total_s": round(total_s, 1),
    }
    return "\n".join(lines), doc


# ------------------------------------------------------------------------ main


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: 1,000 files, 16 MiB shards, a 128 MiB sequential file")
    ap.add_argument("--files", type=int, default=None, help="JPEG files (default 8000; --quick 1000)")
    ap.add_argument("--classes", type=int, default=100, help="class folders (default 100)")
    ap.add_argument("--shard-mib", type=int, default=None, help="tar shard size in MiB (default 64; --quick 16)")
    ap.add_argument("--seq-mib", type=int, default=None, help="sequential file in MiB (default 1024; --quick 128)")
    ap.add_argument("--only", default=",".join(GROUPS),
                    help=f"comma-separated workload groups to run, of {','.join(GROUPS)} (default all)")
    ap.add_argument("--workers", type=int, default=2, help="DataLoader workers (default 2)")
    ap.add_argument("--batch-size", type=int, default=64, help="DataLoader batch size (default 64)")
    ap.add_argument("--lookahead", type=int, default=1024, help="PrefetchSampler lookahead in samples (default 1024)")
    ap.add_argument("--modes", default=",".join(MODES),
                    help="mount modes to measure, each beside the local disk: default (read-write, close-to-open) "
                         "and dataset (-o dataset: read-only, long kernel caching, opens without round trips; the "
                         "data is written through a plain mount first); default both")
    ap.add_argument("--dataset", action="store_true", help="the same as --modes dataset")
    ap.add_argument("--repeat", type=int, default=1,
                    help="measure each cold/warm pair N times and report the repetition with the median ratio "
                         "(the lower middle one for an even N) and the range (the machines are shared and single "
                         "epochs vary by up to 2x; default 1)")
    ap.add_argument("--nodes", type=int, default=4, help="storage nodes (default 4)")
    ap.add_argument("--workdir", default="/var/tmp",
                    help="where the run's tmp dir (cluster state, mountpoint, local copy) goes; must be a real "
                         "disk, not tmpfs (default /var/tmp)")
    ap.add_argument("--cache-dir", default=None,
                    help="where the generated dataset is kept between runs (default WORKDIR/stripefs-bench-cache)")
    ap.add_argument("--keep", action="store_true", help="keep the tmp dir (state, logs, data) afterwards")
    ap.add_argument("--mount-options", default="", help="-o options of the default mount, e.g. per_open_handles=no (no OPEN: docs/design.md)")
    ap.add_argument("--seed", type=int, default=1, help="random seed for the images, shards and shuffles")
    ap.add_argument("--phase-timeout", type=float, default=600,
                    help="abort (and tear down) if one phase takes longer, seconds (default 600)")
    ap.add_argument("--no-read-file", action="store_true",
                    help="prefetch rows: the loader's own plain reads instead of stripefs.torch.read_file")
    ap.add_argument("--shm", action="store_true",
                    help="prefetch rows: PrefetchSampler(shm=True) and read_file(path, shm=True): the mount's "
                         "shared-memory copies (default mount only)")
    ap.add_argument("--profile", action="store_true",
                    help="afterwards, record mount, meta and storage node 1 with py-spy during a cold and a warm "
                         "raw epoch more (and two with prefetch), not timed; raw profiles go to "
                         "bench/results/dataloader-profile-*.txt")
    ap.add_argument("--profile-native", action="store_true",
                    help="with --profile: py-spy --native (C frames too: syscalls, Cython, libzmq; fewer samples)")
    ap.add_argument("--py-spy", default=None, help="py-spy executable for --profile (default: py-spy on PATH)")
    ap.add_argument("--json", default=str(RESULTS / "dataloader-latest.json"),
                    help="results file (default bench/results/dataloader-latest.json)")
    ap.add_argument("--strace-mount", default="", metavar="ROWS",
                    help="attach strace -c -f to the mount during these rows' stripefs epochs (e.g. prefetch_cold; "
                         "its syscall table lands in the workdir: --keep); their timings are not comparable")
    ap.add_argument("--strict", action="store_true", help="exit 2 if a target is not met")
    a = ap.parse_args(argv)
    global SHM, SAMPLER_KW
    SHM = a.shm
    SAMPLER_KW = {"shm": True} if a.shm else {}
    a.files = a.files if a.files is not None else (1000 if a.quick else 8000)
    a.shard_mib = a.shard_mib or (16 if a.quick else 64)
    a.seq_mib = a.seq_mib or (128 if a.quick else 1024)
    a.cache_dir = a.cache_dir or str(Path(a.workdir) / "stripefs-bench-cache")
    only = {g.strip() for g in a.only.split(",") if g.strip()}
    if not only or only - set(GROUPS):
        ap.error(f"--only: unknown workload group(s) {', '.join(sorted(only - set(GROUPS))) or '(none given)'}; "
                 f"choose from {', '.join(GROUPS)}")
    a.only = only
    a.modes = ["dataset"] if a.dataset else [m.strip() for m in a.modes.split(",") if m.strip()]
    if not a.modes or set(a.modes) - set(MODES) or len(set(a.modes)) != len(a.modes):
        ap.error(f"--modes: choose one or both of {', '.join(MODES)}")
    if a.repeat < 1:
        ap.error("--repeat must be at least 1")
    if a.files < a.classes or a.classes <= 0 or a.workers < 0 or a.batch_size <= 0 or a.shard_mib <= 0:
        ap.error("need --files >= --classes > 0, --workers >= 0, --batch-size > 0, --shard-mib > 0")
    if a.py_spy and not os.access(a.py_spy, os.X_OK):
        ap.error(f"--py-spy {a.py_spy} is not an executable")
    try:
        import PIL  # noqa: F401

        import loaders  # noqa: F401 - torch, imported before the DataLoader forks its workers
    except ImportError as exc:
        ap.error(f"{exc.name} is missing: install the bench extra: .venv/bin/pip install -e '.[bench]' "
                 "(make bench does it)")
    try:
        wfs = check_workdir(a.workdir)
    except BenchError as exc:
        ap.error(str(exc))

    bench = Bench(a)
    progress(f"work dir {bench.work} on {wfs['device']} ({wfs['fstype']}); dataset cache {a.cache_dir}")

    def finish(total: float) -> int:
        text, doc = report(bench, total)
        print(text)
        write_results(doc, a.json)
        return 2 if a.strict and not all(t["pass"] for t in doc["targets"] if t["pass"] is not None) else 0

    return supervise(bench, finish, keep=a.keep)


if __name__ == "__main__":
    sys.exit(main())
