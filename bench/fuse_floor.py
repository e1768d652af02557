#!/usr/bin/env python3
"""The FUSE floor: what one FUSE request answered from memory costs through
pyfuse3 + trio, and so what ratio to the local disk a warm small-file epoch can
reach at all.

    make bench                                     # runs this last
    .venv/bin/python bench/fuse_floor.py           # ~2 min on 2 busy cores
    .venv/bin/python bench/fuse_floor.py --files 500 --no-profile    # a smoke run

Why: a warm epoch of a shuffled small-file DataLoader asks the stripefs cluster
nothing, yet stays far below the local disk (issue 16): per file the kernel
still sends the mount a few requests (OPEN, FLUSH on a default mount, RELEASE,
the IOCTL of Python's isatty() check in open(), a GETATTR in the first warm
epoch), each answered in Python or libfuse. This measures such a request through
the same library stack with nothing of ours in it, beside stripefs's mounts and
the local disk, in one run.

The same --files files (default 2,000 of 100-120 KiB random content in 20
directories) on six sides:
  local         a directory on the --workdir disk (refused on tmpfs/FUSE)
  bare          bench/bare_fuse.py over that directory: the thinnest pyfuse3 + trio
                server (prebuilt attributes in dicts, hour-long timeouts, OPEN with
                keep_cache, FLUSH and RELEASE answered at once)
  bare_noflush  the same with FLUSH answered ENOSYS (connection-wide), as -o dataset
  bare_noopen   the same with OPEN answered ENOSYS too (FUSE's no-open: no OPEN, no
                RELEASE), after its pages are cached: what stripefs cannot do, as
                pyfuse3 3.5 hands `read` only the file handle
  default       a stripefs default mount of a fresh `stripefs local` cluster holding
                the files (written through it)
  dataset       a second client mount of that cluster, -o dataset
Each side is read twice untimed (the first time every file's content is checked
against the local copy), then, warm, in shuffled order by 1 and by 2 persistent
reader processes (as DataLoader workers), --passes at a time until
--min-seconds of reading:
  read             open(path, "rb").read(), the raw DataLoader sample
  read_unbuffered  open(path, "rb", buffering=0).read(): no isatty() in open()
  openclose        os.close(os.open(path, os.O_RDONLY)): the open/close pair alone
For each (workload, readers) the sides run back to back, the local disk first,
--rounds times; a ratio is to the local figure of its round, and the round with
the median ratio is shown, with the range. Other users of a shared machine drop
the kernel's caches for their cold runs (several times a minute on ours): a side
is warmed again before a measurement if /proc/vmstat drop_pagecache or drop_slab
moved since it was warmed, and measured again (up to 3 times) if they move
during it ("!" marks a figure that never ran undisturbed).

Per figure: files/s; FUSE requests per file by op (bare: counted in the server,
read through a getxattr; stripefs: every request its session read,
stripefs_fuse_requests_total) plus, for the bare servers, those no handler
sees ("ioctl*": requests the server read from /dev/fuse, its read(2) calls in
/proc/PID/io syscr, less the handled ones; Python's open() asks isatty(), a
TCGETS ioctl the kernel forwards and libfuse answers ENOSYS in C, every time); the server process's CPU (utime+stime, /proc/PID/stat) per file,
its system part, and per request; the reader processes' CPU per file.

Then (--no-profile skips it) `py-spy record --gil --native` of the bare_noopen
and bare_noflush servers and of the dataset mount, each during one more warm
2-reader read (not timed), each sample put where it is: in the read/writev of
/dev/fuse under libfuse, else in the innermost frame that is pyfuse3 (Cython,
libfuse), trio (run loop, Lock, wait_readable, epoll), stripefs's metrics
wrapper (client/metrics.py, prometheus_client) or the handler
(client/operations.py; bench/bare_fuse.py); and the user CPU per request split
in those proportions.

Output: the table on stdout, progress on stderr, JSON in
bench/results/fuse_floor.json, raw profiles in
bench/results/fuse-floor-profile-*.txt. Every mount is unmounted and the cluster
stopped, also on Ctrl-C/SIGTERM or a phase over --phase-timeout. See
bench/README.md ("The FUSE wall").
"""
from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import multiprocessing
import os
import platform
import random
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import xxhash

from stripefs import page_cache

sys.path.insert(0, str(Path(__file__).resolve().parent))
import profiling  # noqa: E402
from common import (BENCH_DIR, CLK_TCK, KiB, MiB, RESULTS, BenchError, Cluster, check_workdir,  # noqa: E402
                    git_commit, proc_cpu, progress, supervise, write_results)

SIDES = {"local": "local disk", "bare": "bare pyfuse3+trio", "bare_noflush": "bare, FLUSH ENOSYS",
         "bare_noopen": "bare, no-open", "default": "stripefs default", "dataset": "stripefs -o dataset"}
BARE_FLAGS = {"bare": [], "bare_noflush": ["--noflush"], "bare_noopen": ["--noflush", "--noopen"]}
WORKLOADS = {"read": 'open(p, "rb").read()', "read_unbuffered": 'open(p, "rb", buffering=0).read()',
             "openclose": "close(open(p, O_RDONLY))"}
COUNTS_XATTR = "user.fuse_floor.ops"  # bench/bare_fuse.py's request counts
NOOPEN_XATTR = "user.fuse_floor.noopen"  # ... its switch to no-open
STORE_XATTR = "user.fuse_floor.store"  # ... and its push of every file into the kernel's page cache
CATEGORIES = [  # (profile category, marks of a frame that belongs to it); see categorise()
    ("pyfuse3", ("pyfuse3", "__pyx", "__Pyx", ".pyx", ".pxi", "libfuse")),
    ("trio", ("trio/", "outcome")),
    ("metrics wrapper", ("client/metrics.py", "prometheus_client/")),
    ("fuse session", ("client/fuse/",)),  # the mount's own session: parse, dispatch, encode (not its handlers)
    ("handler", ("client/", "bare_fuse.py")),
]
RETRIES = 3  # measurements again when someone dropped the kernel's caches meanwhile
UNHANDLED = "ioctl*"  # requests answered by libfuse itself (see measure): Python's open() asks isatty()
DEV_FUSE = "read+writev /dev/fuse"  # the category of syscalls libfuse makes: receiving a request, sending a reply
READER = "fuse/session.py"  # frames of the mount's own session (its reader thread, or a reply written from trio)


def reader(conn) -> None:
    """A reader process (a persistent DataLoader worker): runs each job the pipe brings."""
    while (job := conn.recv()) is not None:
        what, paths = job
        try:
            if what == "read":
                conn.send(("ok", sum(len(open(p, "rb").read()) for p in paths)))
            elif what == "read_unbuffered":  # no isatty() check in open(): no FUSE IOCTL
                conn.send(("ok", sum(len(open(p, "rb", buffering=0).read()) for p in paths)))
            elif what == "openclose":
                for p in paths:
                    os.close(os.open(p, os.O_RDONLY))
                conn.send(("ok", 0))
            else:  # "check": content hashes (untimed)
                conn.send(("ok", [xxhash.xxh3_64_intdigest(open(p, "rb").read()) for p in paths]))
        except OSError as exc:
            conn.send(("error", repr(exc)))


def fuse_ops(url: str) -> dict[str, float]:
    """stripefs_fuse_requests_total by opcode from a mount's Prometheus endpoint: every request its
    FUSE session read, those no handler sees included (an IOCTL the session answers itself)."""
    with urllib.request.urlopen(url, timeout=10) as rsp:
        text = rsp.read().decode()
    return {line.split('opcode="', 1)[1].split('"', 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line.startswith("stripefs_fuse_requests_total{")}


def per_file(before: dict[str, float], after: dict[str, float], files: int) -> dict[str, float]:
    """Requests per file by op between two counter snapshots."""
    return {op: round((v - before.get(op, 0)) / files, 3) for op, v in sorted(after.items()) if v > before.get(op, 0)}


def cpu_times(pid: int) -> tuple[float, float] | None:
    """(user, system) CPU seconds of pid from /proc/PID/stat; None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[11]) / CLK_TCK, int(fields[12]) / CLK_TCK


def read_calls(pid: int) -> int:
    """read(2)-like syscalls pid made (/proc/PID/io syscr): a FUSE server reads each request from
    /dev/fuse with one, including those libfuse answers itself without calling a Python handler."""
    with open(f"/proc/{pid}/io") as f:
        return int(next(line for line in f if line.startswith("syscr:")).split()[1])


#: how often anyone wrote /proc/sys/vm/drop_caches (the page cache, or dentries and inodes)
cache_drops = page_cache.drops


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Bench:
    def __init__(self, a):
        self.a = a
        self.work = Path(tempfile.mkdtemp(prefix="stripefs-fusefloor-", dir=a.workdir))
        self.state, self.mnt = self.work / "state", self.work / "mnt"
        self.cluster = Cluster(self.state, self.mnt, a.nodes)
        self.cluster.options = list(filter(None, a.mount_options.split(",")))  # the default mount's
        self.phase = ("setup", time.monotonic(), a.phase_timeout)
        self.mounts = {**{side: self.work / side for side in BARE_FLAGS}, "default": self.mnt,
                       "dataset": self.work / "mnt-dataset"}
        self.roots = {"local": self.work / "local", **{side: self.mounts[side] for side in BARE_FLAGS},
                      "default": self.mnt / "data", "dataset": self.mounts["dataset"] / "data"}
        self.servers: dict[str, subprocess.Popen] = {}  # the bare servers
        self.pids: dict[str, int] = {}  # side -> the FUSE server's pid
        self.readers: list[tuple[multiprocessing.Process, object]] = []
        self.recorder: profiling.Recorder | None = None
        self.results: list[dict] = []
        self.profiles: dict[str, dict] = {}
        self.load: dict[str, list[float]] = {}
        self.warmup: dict[str, list[dict]] = {}  # side -> FUSE requests per file of the two untimed passes
        self.rnd = random.Random(a.seed)  # the readers' shuffles
        self.warmed: dict[str, int] = {}  # side -> cache_drops() when it was last warmed
        self.warmed_once: set[str] = set()

    def set_phase(self, name: str) -> None:
        self.phase = (name, time.monotonic(), self.a.phase_timeout)
        progress(name)

    # -- setup

    def run(self) -> None:
        a = self.a
        self.load["start"] = list(os.getloadavg())
        self.set_phase(f"writing {a.files:,} files to the local disk")
        self.make_files()
        ctx = multiprocessing.get_context("spawn")
        for _ in range(2):
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(target=reader, args=(theirs,), daemon=True)
            proc.start()
            self.readers.append((proc, mine))
        self.set_phase("mounting the bare filesystems")
        for side in BARE_FLAGS:
            self.start_bare(side)
        self.set_phase(f"starting a {a.nodes}-node stripefs local cluster, copying the files in")
        self.cluster.up()
        self.pids["default"] = self.cluster.pids["mount"]
        src, dst = self.roots["local"], self.roots["default"]
        for d in self.dirs:
            (dst / d).mkdir(parents=True)
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda rel: shutil.copyfile(src / rel, dst / rel), self.rels))
        self.mount_dataset()
        for side in SIDES:
            self.set_phase(f"{side}: checking every file, then warming")
            n, ops0 = len(self.rels), self.requests(side)
            got = self.run_job(side, "check", self.rels, 2)
            bad = [rel for rel, h in zip(self.rels, got) if h != self.hashes[rel]]
            if bad:
                raise BenchError(f"{side}: {len(bad)} files differ from the local copy, e.g. {bad[0]}")
            ops1 = self.requests(side)
            if side == "bare_noopen":  # its pages are cached now (and pushed in again: notify_store)
                os.setxattr(self.mounts[side], NOOPEN_XATTR, b"1")
            self.run_job(side, "read", self.rels, 2)
            if side != "local":  # what the first read and the first warm read cost (not timed)
                self.warmup[side] = [per_file(ops0, ops1, n), per_file(ops1, self.requests(side), n)]
            self.warmed[side] = cache_drops()  # (if someone dropped them meanwhile, measure() warms again)
            self.warmed_once.add(side)
        for readers in (1, 2):
            for what in WORKLOADS:
                rounds = []
                for k in range(a.rounds):
                    self.set_phase(f"measuring {what}, {readers} reader(s), round {k + 1}/{a.rounds}")
                    rounds.append({side: self.measure(side, what, readers) for side in SIDES})
                    for r in rounds[-1].values():
                        if "error" not in r:
                            r["ratio"] = round(r["files_per_s"] / rounds[-1]["local"]["files_per_s"], 4)
                for side in SIDES:  # the round with the median ratio, and every round's
                    ok = [r[side] for r in rounds if "error" not in r[side]]
                    ok = sorted([r for r in ok if not r.get("disturbed")] or ok,
                                key=lambda r: r["files_per_s" if side == "local" else "ratio"])
                    pick = ok[(len(ok) - 1) // 2] if ok else rounds[-1][side]
                    self.results.append({**pick, "ratios": [r[side].get("ratio") for r in rounds]})
        if not a.no_profile:
            self.profile()
        self.load["end"] = list(os.getloadavg())
        self.set_phase("finish")

    def make_files(self) -> None:
        a = self.a
        rnd = random.Random(a.seed)
        pool = rnd.randbytes(16 * MiB + 120 * KiB)  # each file a slice of it at its own offset
        self.dirs = [f"class_{d:02d}" for d in range(a.dirs)]
        self.rels, self.hashes = [], {}
        for k in range(a.files):
            rel, off = f"{self.dirs[k % a.dirs]}/img_{k:05d}.bin", rnd.randrange(16 * MiB)
            data = pool[off:off + rnd.randint(100 * KiB, 120 * KiB)]
            path = self.roots["local"] / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
            self.rels.append(rel)
            self.hashes[rel] = xxhash.xxh3_64_intdigest(data)
        self.nbytes = {rel: (self.roots["local"] / rel).stat().st_size for rel in self.rels}

    def start_bare(self, side: str) -> None:
        mp = self.mounts[side]
        mp.mkdir()
        cmd = [sys.executable, str(BENCH_DIR / "bare_fuse.py"), str(self.roots["local"]), str(mp)]
        log = open(self.work / f"{side}.log", "w")
        proc = self.servers[side] = subprocess.Popen(cmd + BARE_FLAGS[side], stdout=subprocess.PIPE, stderr=log,
                                                     stdin=subprocess.DEVNULL)
        log.close()
        if not select.select([proc.stdout], [], [], 60)[0] or proc.stdout.readline().strip() != b"ready":
            raise BenchError(f"{side}: bench/bare_fuse.py did not mount {mp}; see {self.work / f'{side}.log'}")
        self.pids[side] = proc.pid

    def mount_dataset(self) -> None:
        """A second client of the cluster, -o dataset (the cluster's own mount stays the default one)."""
        info = json.loads((self.state / "cluster.json").read_text())
        mp, pidfile, port = self.mounts["dataset"], self.work / "mount-dataset.pid", free_port()
        mp.mkdir()
        cmd = ["mount", f"tcp://127.0.0.1:{info['meta_port']}", str(mp), "-o", "dataset", "-o", f"metrics=127.0.0.1:{port}",
               "--pidfile", str(pidfile), "--log", str(self.state / "logs" / "mount-dataset.log")]
        res = subprocess.run(self.cluster.cli + cmd, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
        if res.returncode:
            raise BenchError(f"stripefs mount -o dataset failed: {(res.stderr or res.stdout).strip()}")
        self.pids["dataset"] = int(pidfile.read_text())
        self.dataset_metrics = f"http://127.0.0.1:{port}/metrics"

    # -- measuring

    def run_job(self, side: str, what: str, rels: list[str], readers: int) -> list:
        """Hand rels (1/readers each, interleaved) to the readers at once; their answers, in rels' order for check."""
        root = str(self.roots[side])
        shares = [[f"{root}/{rel}" for rel in rels[i::readers]] for i in range(readers)]
        for (_, conn), share in zip(self.readers, shares):
            conn.send((what, share))
        replies = [conn.recv() for _, conn in self.readers[:readers]]
        for status, value in replies:
            if status != "ok":
                raise BenchError(f"{side}: {what} failed in a reader: {value}")
        if what == "check":
            out = [None] * len(rels)
            for i, (_, hashes) in enumerate(replies):
                out[i::readers] = hashes
            return out
        if what.startswith("read") and sum(v for _, v in replies) != sum(self.nbytes[r] for r in rels):
            raise BenchError(f"{side}: the readers read {sum(v for _, v in replies):,} bytes, not "
                             f"{sum(self.nbytes[r] for r in rels):,}")
        return []

    def requests(self, side: str) -> dict[str, float]:
        if side.startswith("bare"):
            counts = json.loads(os.getxattr(self.mounts[side], COUNTS_XATTR))
            counts.pop("getxattr")  # this very question
            counts.pop("setxattr")  # the no-open switch
            return counts
        if side == "default":
            return fuse_ops(self.cluster.metrics["mount"])
        return fuse_ops(self.dataset_metrics) if side == "dataset" else {}

    def warm(self, side: str) -> None:
        """Read every file twice (its data; then the GETATTR its atime asks for) unless nobody dropped
        the kernel's caches since this side was last warmed. bare_noopen cannot answer a READ: before
        every measurement its inodes are looked up again and their pages pushed into the cache (also
        what memory pressure evicted: the others see that as the odd READ)."""
        if self.warmed.get(side) == cache_drops() and side != "bare_noopen":
            return
        if self.warmed.get(side) not in (None, cache_drops()):
            progress(f"  {SIDES[side]}: someone dropped the kernel's caches (drop_caches): warming again")
        self.warmed[side] = cache_drops()
        if side == "bare_noopen" and side in self.warmed_once:
            for rel in self.rels:
                os.stat(self.roots[side] / rel)
            os.setxattr(self.mounts[side], STORE_XATTR, b"1")
            return
        for _ in range(2):
            self.run_job(side, "read", self.rels, 2)
        self.warmed_once.add(side)

    def measure(self, side: str, what: str, readers: int, min_seconds: float | None = None,
                around: contextlib.AbstractContextManager | None = None) -> dict:
        """Warm reads of side, measured; again (up to RETRIES times) while someone drops the
        kernel's caches meanwhile (other users of the machine do, for their cold runs: /proc/vmstat
        drop_pagecache and drop_slab count it): such a figure is not warm. The last one is
        marked "disturbed" if it is still not."""
        for attempt in range(RETRIES + 1):
            self.warm(side)
            r = self.measure_once(side, what, readers, min_seconds, around or contextlib.nullcontext())
            if self.warmed.get(side) == cache_drops() and "error" not in r:
                break
        else:
            r["disturbed"] = True
        r["attempts"] = attempt + 1
        return r

    def measure_once(self, side: str, what: str, readers: int, min_seconds: float | None, around) -> dict:
        """--passes shuffled passes over the files, split between the readers, repeated until
        min_seconds (--min-seconds) of reading (the local disk is done with one in ~0.1 s);
        ``around`` wraps the reading alone (a profiler)."""
        pid, rpids = self.pids.get(side), [p.pid for p, _ in self.readers[:readers]]
        ops0, cpu0, rcpu0 = self.requests(side), cpu_times(pid) if pid else None, sum(map(proc_cpu, rpids))
        reads0 = read_calls(pid) if pid else 0
        n = wall = 0
        with around:
            while wall < (min_seconds or self.a.min_seconds):
                order = [rel for _ in range(self.a.passes) for rel in self.rnd.sample(self.rels, len(self.rels))]
                t = time.perf_counter()
                try:
                    self.run_job(side, what, order, readers)
                except BenchError as exc:
                    if side != "bare_noopen":
                        raise
                    progress(f"  {SIDES[side]}: {exc} (a page was dropped meanwhile: it cannot READ)")
                    return {"side": side, "workload": what, "readers": readers, "error": str(exc)}
                wall += time.perf_counter() - t
                n += len(order)
        cpu1, rcpu1 = cpu_times(pid) if pid else None, sum(map(proc_cpu, rpids))
        reads1 = read_calls(pid) if pid else 0
        ops1 = self.requests(side)
        if pid and cpu1 is None:
            raise BenchError(f"{side}: the FUSE server (pid {pid}) is gone")
        r = {"side": side, "workload": what, "readers": readers, "files": n, "wall_s": round(wall, 4),
             "files_per_s": round(n / wall, 1), "reader_cpu_us_per_file": round((rcpu1 - rcpu0) * 1e6 / n, 1),
             "loadavg_1m": os.getloadavg()[0]}
        if pid:
            ops = per_file(ops0, ops1, n)
            # requests no handler saw: /dev/fuse reads less the handled requests (less a bare server's
            # os.pread per READ); for a stripefs mount also the odd read(2) of its background work
            preads = ops.get("read", 0) if side.startswith("bare") else 0
            unhandled = (reads1 - reads0) / n - sum(ops.values()) - preads
            if unhandled >= 0.005:
                ops[UNHANDLED] = round(unhandled, 3)
            req = sum(ops.values())
            user_us, sys_us = ((b - a) * 1e6 / n for a, b in zip(cpu0, cpu1))
            r.update(requests_per_file=ops, req_per_file=round(req, 3),
                     server_cpu_us_per_file=round(user_us + sys_us, 1), server_sys_us_per_file=round(sys_us, 1),
                     us_per_request=round((user_us + sys_us) / req, 1) if req else None)
        progress(f"  {SIDES[side]:20s} {r['files_per_s']:9,.0f} files/s"
                 + (f"  {r['req_per_file']:.2f} req/file, {r['server_cpu_us_per_file']:.0f} us CPU/file" if pid else ""))
        return r

    # -- profiles

    def profile(self) -> None:
        exe = self.a.py_spy or shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
        if not os.access(exe, os.X_OK):
            progress("no py-spy (--py-spy PATH): no profiles")
            return
        for side in ("bare_noopen", "bare_noflush", "dataset", "default"):
            self.set_phase(f"profiling {side}: py-spy record --gil --native during a warm 2-reader read")
            self.recorder = profiling.Recorder(exe, {side: self.pids[side]}, RESULTS / "fuse-floor-profile", gil=True,
                                               native=True, rate=self.a.profile_rate)
            r = self.measure(side, "read", 2, min_seconds=self.a.profile_seconds, around=self.recorder)
            path, err = self.recorder.results[side]
            self.recorder = None
            if path is None or "error" in r:
                self.profiles[side] = {"error": err or r["error"]}
                continue
            p = self.profiles[side] = {**categorise(path, r["wall_s"], self.a.profile_rate), "measured": r}
            # The CPU per request of the timed 2-reader read (py-spy's pauses add to the profiled one's):
            # system (the kernel's part: /dev/fuse, epoll), and user split as the samples outside the
            # /dev/fuse syscalls and outside other threads
            t = next(x for x in self.results if (x["side"], x["workload"], x["readers"]) == (side, "read", 2))
            if "error" in t:
                continue
            user_us = (t["server_cpu_us_per_file"] - t["server_sys_us_per_file"]) / t["req_per_file"]
            rest = {c: v for c, v in p["by_category"].items() if c not in (DEV_FUSE, "other threads")}
            p["sys_us_per_request"] = round(t["server_sys_us_per_file"] / t["req_per_file"], 1)
            p["user_us_per_request"] = {c: round(user_us * v / (sum(rest.values()) or 1), 1) for c, v in rest.items()}

    # -- cleanup (supervise calls it before the cluster's teardown, also on a signal or a timeout)

    def abort(self) -> None:
        if self.recorder is not None:
            self.recorder.kill()
        for proc, _ in self.readers:
            if proc.is_alive():
                proc.kill()
        for side in ("dataset", *BARE_FLAGS):
            if os.path.ismount(self.mounts[side]):
                subprocess.run(["fusermount3", "-u", "-z", str(self.mounts[side])], capture_output=True, timeout=30)
        for side in ("dataset", *BARE_FLAGS):
            pid, deadline = self.pids.pop(side, None), time.monotonic() + 10
            while pid and proc_cpu(pid) is not None and time.monotonic() < deadline:
                if side in self.servers:
                    self.servers[side].poll()  # reap it
                time.sleep(0.1)
            if pid and proc_cpu(pid) is not None:
                progress(f"WARNING: the {side} FUSE server (pid {pid}) did not end after its unmount; killing it")
                os.kill(pid, signal.SIGKILL)
        for proc in self.servers.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait()


def categorise(path: Path, wall: float, rate: int) -> dict:
    """Samples of a py-spy --gil --native raw profile by category: a sample whose innermost frame is
    a libc syscall under libfuse or the mount's own session is DEV_FUSE (the kernel's side of a request); any other goes to the
    first CATEGORIES entry that one of its frames matches, from the innermost frame out (so a
    libpython frame counts for the Python or Cython code it runs for)."""
    counts: Counter = Counter()
    for line in path.read_text(errors="replace").splitlines():
        stack, _, n = line.rpartition(" ")
        frames = stack.split(";")
        if not n.isdigit() or not stack:
            continue
        if "unrolled_run (trio" not in stack and READER not in stack:
            counts["other threads"] += int(n)  # e.g. the mount's metrics endpoint; or a stack py-spy could not unwind
        elif ("(libc" in frames[-1] and frames[-1].split(" (")[0] in ("read", "readv", "writev", "write")
              and ("libfuse" in stack or READER in stack)):
            counts[DEV_FUSE] += int(n)
        else:
            counts[next((name for f in reversed(frames) for name, marks in CATEGORIES if any(m in f for m in marks)),
                        "other")] += int(n)
    total = sum(counts.values())
    return {"file": str(path), "samples": total, "gil_busy": round(total / (wall * rate), 3) if wall else None,
            "by_category": {k: round(100 * counts[k] / total, 1) if total else 0.0 for k in PROFILE_COLUMNS}}


PROFILE_COLUMNS = [DEV_FUSE] + [c for c, _ in CATEGORIES] + ["other", "other threads"]


# ---------------------------------------------------------------------- report


def _result(results, side: str, workload: str, readers: int) -> dict | None:
    return next((r for r in results if (r["side"], r["workload"], r["readers"]) == (side, workload, readers)
                 and "error" not in r), None)


def goal_table(results) -> list[str]:
    """Issue 29's goal rows this bench measures, PASS or BELOW, each beside the local disk of the
    same run (the ratio is to the local figure of its round). The rows it does not measure say
    where they are (or that nothing measures them yet)."""
    lines = ["", "issue 29 goals measured here (2 readers; ratio: median of the rounds, range):"]

    def row(name: str, value: str, ok: bool | None, goal: str) -> None:
        verdict = "" if ok is None else ("PASS" if ok else "BELOW")
        lines.append(f"  {name:66s} {value:>24s}  goal {goal:12s} {verdict}")

    for workload, label in (("read", 'open(p,"rb").read()'), ("read_unbuffered", 'open(p,"rb",buffering=0).read()')):
        ds, df = _result(results, "dataset", workload, 2), _result(results, "default", workload, 2)
        if ds and df:
            row(f"FUSE requests per warm file, {label}, dataset / default",
                f"{ds['req_per_file']:.2f} / {df['req_per_file']:.2f}",
                ds["req_per_file"] < 0.05 and df["req_per_file"] <= 1.05, "0 / <= 1")
    df = _result(results, "default", "read_unbuffered", 2)
    if df and df.get("us_per_request"):
        row("mount CPU per hot request (default mount, unbuffered warm read)", f"{df['us_per_request']:.1f} us",
            df["us_per_request"] <= 10, "<= 10 us")
    for workload, label in (("read", 'open(p,"rb").read()'), ("read_unbuffered", "unbuffered")):
        ds, df = _result(results, "dataset", workload, 2), _result(results, "default", workload, 2)
        if ds and df:
            spread = lambda r: f"{min(x for x in r['ratios'] if x is not None):.2f}-{max(x for x in r['ratios'] if x is not None):.2f}"
            row(f"warm raw read ({label}), default / dataset", f"{spread(df)}x / {spread(ds)}x",
                df["ratio"] >= 0.6 and ds["ratio"] >= 0.8, ">=0.6/>=0.8x")
    lines.append("  (the DataLoader, torch, decode and ImageFolder rows: bench/dataloader.py and bench/imagedata.py; "
                 "passthrough and CPU per GiB: not measured yet)")
    return lines


def report(bench: Bench, total_s: float) -> tuple[str, dict]:
    a = bench.a
    load = "; ".join(f"{k} {' '.join(f'{x:.2f}' for x in v)}" for k, v in bench.load.items())
    lines = ["", f"FUSE floor: warm small-file reads, {a.files:,} files of 100-120 KiB in {a.dirs} dirs, "
                 f"{_dt.datetime.now():%Y-%m-%d %H:%M}, {platform.node()} ({os.cpu_count()} CPUs), "
                 f"load average {load}, {total_s:.0f}s",
             f"ratio: to the local disk just before, median of {a.rounds} rounds (range); the other figures are that "
             "round's; req: FUSE requests per file; srv CPU: the FUSE server "
             "process's CPU per file (sys: of it in the kernel), and per request (= srv CPU / req); rdr CPU: "
             "the readers' CPU per file", "",
             f"{'':2s}{'side':20s} {'files/s':>9s} {'ratio':>7s} {'(range)':>9s} {'req':>5s} {'srv CPU':>7s} {'sys':>5s} "
             f"{'us/req':>6s} {'rdr CPU':>7s}  requests per file"]
    for r in bench.results:
        if r["side"] == "local":
            lines.append(f"{WORKLOADS[r['workload']]}, {r['readers']} reader{'s' if r['readers'] > 1 else ''} "
                         f"(load {r['loadavg_1m']:.1f}):")
        if "error" in r:
            lines.append(f"  {SIDES[r['side']]:20s} failed: {r['error']}")
            continue
        ratios = [x for x in r["ratios"] if x is not None]
        spread = f"{min(ratios):.2f}-{max(ratios):.2f}" if r["side"] != "local" else ""
        mark = "!" if r.get("disturbed") else " "  # someone dropped the caches during every attempt
        row = f"  {SIDES[r['side']]:19s}{mark} {r['files_per_s']:9,.0f} {r['ratio']:6.3f}x {spread:>9s}"
        if "req_per_file" in r:
            ops = " ".join(f"{op} {v:.2f}" for op, v in r["requests_per_file"].items() if v >= 0.005)
            row += (f" {r['req_per_file']:5.2f} {r['server_cpu_us_per_file']:7.0f} {r['server_sys_us_per_file']:5.0f} "
                    f"{r['us_per_request'] or 0:6.1f} {r['reader_cpu_us_per_file']:7.0f}  {ops}")
        else:
            row += f" {'':5s} {'':7s} {'':5s} {'':6s} {r['reader_cpu_us_per_file']:7.0f}"  # local: no server
        lines.append(row.rstrip())
    if bench.warmup:
        lines += ["", "handled requests per file in the untimed passes before (2 readers): the first read | the next"]
        for side, (first, second) in bench.warmup.items():
            lines.append(f"  {SIDES[side]:20s} " + " ".join(f"{op} {v:.2f}" for op, v in first.items())
                         + " | " + " ".join(f"{op} {v:.2f}" for op, v in second.items()))
    if bench.profiles:
        lines += ["", "py-spy record --gil --native of the FUSE server, one more warm 2-reader read (its files/s and "
                      "us/req include py-spy's pauses): % of the samples (GIL held) by where they are"]
        lines.append(f"  {'side':20s} {'files/s':>8s} {'GIL held':>8s} {'us/req':>6s} "
                     + " ".join(f"{c:>16s}" for c in PROFILE_COLUMNS))
        for side, p in bench.profiles.items():
            if "error" in p:
                lines.append(f"  {SIDES[side]:20s} py-spy failed: {p['error']}")
                continue
            m = p["measured"]
            lines.append(f"  {SIDES[side]:20s} {m['files_per_s']:8,.0f} {100 * p['gil_busy']:7.0f}% "
                         f"{m['us_per_request']:6.1f} " + " ".join(f"{p['by_category'][c]:15.1f}%" for c in PROFILE_COLUMNS))
        lines.append("  so the CPU per request (us) of the timed 2-reader read above: system (the kernel: /dev/fuse, "
                     "epoll) + user, split as these samples outside the syscalls")
        for side, p in bench.profiles.items():
            if "user_us_per_request" in p:
                lines.append(f"  {SIDES[side]:20s} {p['sys_us_per_request']:.1f} sys + "
                             + " + ".join(f"{v:.1f} {c}" for c, v in p["user_us_per_request"].items() if v >= 0.05))
    lines += goal_table(bench.results)
    doc = {"benchmark": "fuse_floor", "commit": git_commit(), "date": _dt.datetime.now().isoformat(timespec="seconds"),
           "host": platform.node(), "cpus": os.cpu_count(), "args": vars(a), "loadavg": bench.load,
           "total_s": round(total_s, 1), "results": bench.results, "warmup_requests_per_file": bench.warmup,
           "profiles": bench.profiles}
    return "\n".join(lines), doc


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", type=int, default=2000, help="files (default 2000)")
    ap.add_argument("--dirs", type=int, default=20, help="directories for them (default 20)")
    ap.add_argument("--rounds", type=int, default=3,
                    help="rounds of every side per figure; the median ratio's round is shown (default 3)")
    ap.add_argument("--passes", type=int, default=1, help="shuffled passes over the files per chunk (default 1)")
    ap.add_argument("--min-seconds", type=float, default=0.5,
                    help="repeat the passes until a figure has this much reading time (default 0.5)")
    ap.add_argument("--nodes", type=int, default=2, help="storage nodes (default 2: warm reads never reach them)")
    ap.add_argument("--workdir", default="/var/tmp", help="a real disk for the files and the cluster (default /var/tmp)")
    ap.add_argument("--seed", type=int, default=1, help="random seed for content and shuffles")
    ap.add_argument("--no-profile", action="store_true", help="skip the py-spy profiles")
    ap.add_argument("--profile-seconds", type=float, default=4, help="reading time per profile (default 4)")
    ap.add_argument("--profile-rate", type=int, default=250, help="py-spy samples per second (default 250)")
    ap.add_argument("--py-spy", default=None, help="py-spy executable (default: PATH, then beside this Python)")
    ap.add_argument("--keep", action="store_true", help="keep the tmp dir afterwards")
    ap.add_argument("--mount-options", default="", help="-o options of the default mount, e.g. per_open_handles=no (no OPEN: docs/design.md)")
    ap.add_argument("--phase-timeout", type=float, default=300, help="abort if one phase takes longer (default 300 s)")
    ap.add_argument("--json", default=str(RESULTS / "fuse_floor.json"), help="results file")
    a = ap.parse_args(argv)
    try:
        check_workdir(a.workdir)
    except BenchError as exc:
        ap.error(str(exc))
    bench = Bench(a)
    progress(f"work dir {bench.work}")

    def finish(total: float) -> int:
        text, doc = report(bench, total)
        print(text, flush=True)
        write_results(doc, a.json)
        return 0

    return supervise(bench, finish, keep=a.keep)


if __name__ == "__main__":
    sys.exit(main())
