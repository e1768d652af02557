"""Plumbing shared by the benchmarks in bench/ (run.py, dataloader.py): a
`stripefs local` cluster driven through the CLI, cold cycles (drop_caches),
CPU accounting from /proc/PID/stat, formatting, and the supervisor that runs a
benchmark in a worker thread so Ctrl-C, SIGTERM and a hung phase always end in
a teardown (nothing left mounted or running) and a removed tmp dir.
"""

from __future__ import annotations

import ctypes
import datetime as _dt
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Callable

from stripefs import page_cache

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
RESULTS = BENCH_DIR / "results"
KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
CLK_TCK = os.sysconf("SC_CLK_TCK")
T0 = time.monotonic()


class BenchError(Exception):
    """A failure the benchmark reports and exits non-zero on (data mismatch, dead process, ...)."""


def progress(msg: str) -> None:
    print(f"[{time.monotonic() - T0:7.1f}s] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------- helpers


def fs_of(path: Path) -> dict:
    """The /proc/mounts entry whose mountpoint is the longest prefix of path."""
    real = os.path.realpath(path)
    best = None
    with open("/proc/mounts") as f:
        for line in f:
            dev, mnt, fstype, opts = line.split()[:4]
            mnt = mnt.replace("\\040", " ")
            if real == mnt or real.startswith(mnt.rstrip("/") + "/") or mnt == "/":
                if best is None or len(mnt) >= len(best["mountpoint"]):
                    best = {"device": dev, "mountpoint": mnt, "fstype": fstype, "options": opts}
    return best or {"device": "?", "mountpoint": "?", "fstype": "?", "options": ""}


_libc = ctypes.CDLL(None, use_errno=True)


def syncfs(path: Path) -> None:
    """syncfs(2) on the filesystem holding path (flushes the local disk where both
    the local directory and the storage nodes' chunk files live)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        if _libc.syncfs(fd) != 0:
            e = ctypes.get_errno()
            raise OSError(e, os.strerror(e))
    finally:
        os.close(fd)


def drop_caches() -> bool:
    """sync + drop the page cache, dentries and inodes, once no test on this machine keeps them
    (stripefs/page_cache.py: a drop inside a warm test fails it)."""
    try:
        page_cache.drop("3", note=progress)
        return True
    except OSError as exc:
        progress(f"WARNING: cannot drop the page cache ({exc}); 'cold' reads may be warm")
        return False


def _stat_fields(pid: int) -> list[str] | None:
    """/proc/PID/stat's fields after the command name (fields[0] is the state, field 3), or None
    if the process is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else fields


def proc_cpu(pid: int) -> float | None:
    """utime+stime+cutime+cstime of pid in seconds, None if it is gone."""
    fields = _stat_fields(pid)
    # utime is field 14 -> index 11
    return None if fields is None else sum(int(x) for x in fields[11:15]) / CLK_TCK


def _tasks(pid: int) -> list[str] | None:
    """The thread ids of process ``pid`` (/proc/PID/task), or None if it is gone."""
    try:
        return os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None


def proc_switches(pid: int) -> int | None:
    """Context switches of every thread of process ``pid`` (/proc/PID/task/*/status), or None if it is gone."""
    tasks = _tasks(pid)
    if tasks is None:
        return None
    total = 0
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                total += sum(int(ln.split()[1]) for ln in f if "ctxt_switches" in ln)
        except (OSError, ValueError, IndexError):
            continue  # a thread that ended meanwhile
    return total


def proc_faults(pid: int) -> int | None:
    """Page faults (minor and major) of every thread of process ``pid`` so far (/proc/PID/stat), or
    None if it is gone: each fresh page a received message or a new buffer lands in costs one."""
    fields = _stat_fields(pid)
    return None if fields is None else int(fields[7]) + int(fields[9])  # minflt (field 10), majflt (field 12)


def proc_threads(pid: int) -> dict[str, tuple[float, float, int]] | None:
    """CPU seconds on a core, seconds runnable but waiting for a core, and times run (switched in),
    by thread kind, of every thread of process
    ``pid`` so far (/proc/PID/task/TID/schedstat and comm), or None if it is gone. A kind is the
    thread's OS name less its number ("Trio thread 3" and "Trio thread 7" are "Trio thread";
    common/thread_names.py names the mount's own); the process's first thread is "main". A thread
    that ended meanwhile is not counted: figures over an epoch are of the threads alive at its end."""
    tasks = _tasks(pid)
    if tasks is None:
        return None
    out: dict[str, tuple[float, float, int]] = {}
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                on_cpu_ns, waited_ns, runs = (int(x) for x in f.read().split()[:3])
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                name = f.read().strip()
        except (OSError, ValueError):
            continue
        kind = "main" if int(tid) == pid else name.rstrip("0123456789").rstrip(" -/_") or name
        cpu, waited, n = out.get(kind, (0.0, 0.0, 0))
        out[kind] = (cpu + on_cpu_ns / 1e9, waited + waited_ns / 1e9, n + runs)
    return out


def self_cpu() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def fmt_rate(bps: float) -> str:
    if bps >= 1e9:
        return f"{bps / 1e9:.2f} GB/s"
    return f"{bps / 1e6:.0f} MB/s" if bps >= 100e6 else f"{bps / 1e6:.1f} MB/s"


def fmt_count(n: float, unit: str) -> str:
    if n >= 100:
        return f"{n:,.0f} {unit}"
    return f"{n:.1f} {unit}"


def git_commit() -> str | None:
    try:
        return subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10).stdout.strip() or None
    except Exception:
        return None


# --------------------------------------------------------------------- cluster


class Cluster:
    """One `stripefs local` cluster in STATE, mounted at MNT, driven through the CLI."""

    def __init__(self, state: Path, mnt: Path, nodes: int):
        self.state, self.mnt, self.nodes = state, mnt, nodes
        exe = Path(sys.executable).parent / "stripefs"
        self.cli = [str(exe)] if exe.exists() else [sys.executable, "-m", "stripefs"]
        self.pids: dict[str, int] = {}
        self.metrics: dict[str, str] = {}
        self.options: list[str] = []  # extra `-o` mount options for every later `up` (e.g. dataset)
        self.up_args: list[str] = []  # extra `local up` flags for a new cluster (e.g. --secure; --meta-store postgresql --metas 2)
        self.lock = threading.Lock()  # up/down never overlap (the supervisor may tear down)
        self.closed = False
        self.up_at = 0.0  # time.monotonic() when the last `up` returned

    def _run(self, *args: str, timeout: float = 120) -> str:
        res = subprocess.run(self.cli + list(args), capture_output=True, text=True, timeout=timeout,
                             stdin=subprocess.DEVNULL)
        if res.returncode:
            raise BenchError(f"stripefs {' '.join(args)} failed (rc {res.returncode}): "
                             f"{(res.stderr or res.stdout).strip()}")
        return res.stdout

    def up(self) -> None:
        with self.lock:
            if self.closed:
                raise BenchError("cluster was torn down")
            self._run("local", "up", "--dir", str(self.state), "--mount", str(self.mnt),
                      "--nodes", str(self.nodes), *self.up_args, *(a for o in self.options for a in ("-o", o)))
            status = json.loads(self._run("local", "status", "--dir", str(self.state), "--json"))
        pids, metrics = {}, {}
        for p in status["processes"]:
            name = p["role"] if p["node_id"] is None else f"{p['role']}-{p['node_id']}"
            if name in pids:  # a second metadata daemon: meta-2, ...
                name = f"{name}-{sum(1 for n in pids if n.split('-')[0] == name) + 1}"
            if p["state"] != "up" or not p["pid"]:
                raise BenchError(f"after 'local up', {name} is {p['state']}")
            pids[name] = p["pid"]
            if p.get("metrics"):
                metrics[name] = p["metrics"]
        self.metrics = metrics  # name -> Prometheus endpoint URL
        if not os.path.ismount(self.mnt):
            raise BenchError(f"{self.mnt} is not mounted after 'local up'")
        self.pids = pids
        self.up_at = time.monotonic()

    def past_restart_grace(self) -> None:
        """Wait until the metadata daemon's restart grace is over: for GRACE_S after it starts on an
        existing database, every namespace change waits (mounts may still cache under callbacks it
        never heard of: daemon/callbacks.py). A change timed right after `up` measured that wait
        (an `rm -rf` of 2,000 files: one unlink stalled ~1.7 s, the row 0.17x instead of ~0.55x)."""
        from stripefs.daemon.callbacks import GRACE_S

        rest = self.up_at + GRACE_S - time.monotonic()
        if rest > 0:
            time.sleep(rest)

    def down(self) -> None:
        with self.lock:
            if (self.state / "cluster.json").exists():
                self._run("local", "down", "--dir", str(self.state))
            self.pids = {}

    def teardown(self) -> None:
        """Best effort, never raises: stop every process, make sure nothing stays mounted."""
        self.closed = True
        got = self.lock.acquire(timeout=30)
        try:
            if (self.state / "cluster.json").exists():
                try:
                    res = subprocess.run(self.cli + ["local", "down", "--dir", str(self.state)], capture_output=True,
                                         text=True, timeout=60, stdin=subprocess.DEVNULL)
                    if res.returncode:
                        print(f"teardown: 'local down' failed: {(res.stderr or res.stdout).strip()}", file=sys.stderr)
                except Exception as exc:
                    print(f"teardown: 'local down' failed: {exc}", file=sys.stderr)
            if os.path.ismount(self.mnt):
                subprocess.run(["fusermount3", "-u", "-z", str(self.mnt)], capture_output=True)
            # anything from pids.json still alive (e.g. 'down' itself failed)
            for pid in self.pids.values():
                if proc_cpu(pid) is not None:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except OSError:
                        pass
        finally:
            if got:
                self.lock.release()

    def cpu(self) -> dict[str, float]:
        out = {}
        for name, pid in self.pids.items():
            c = proc_cpu(pid)
            if c is None:
                raise BenchError(f"stripefs {name} (pid {pid}) is gone; see {self.state / 'logs'}")
            out[name] = c
        return out

    def switches(self) -> dict[str, int]:
        """Context switches (voluntary and not) of every thread of each process so far: each is a
        thread hop or a wait, what a chain of per-file latencies is made of (processes gone: left out)."""
        return self._alive(proc_switches)

    def threads(self) -> dict[str, dict[str, tuple[float, float, int]]]:
        """``proc_threads`` of each process (processes gone: left out)."""
        return self._alive(proc_threads)

    def faults(self) -> dict[str, int]:
        """Page faults of each process so far (processes gone: left out)."""
        return self._alive(proc_faults)

    def _alive(self, read) -> dict[str, int]:
        """``read(pid)`` of each process, those still there (``read`` returns None for one gone)."""
        out = {}
        for name, pid in self.pids.items():
            n = read(pid)
            if n is not None:
                out[name] = n
        return out

    def log_problems(self, limit: int = 12) -> list[str]:
        lines = []
        logs = self.state / "logs"
        if not logs.is_dir():
            return lines
        for f in sorted(logs.glob("*.log")):
            try:
                text = f.read_text(errors="replace").splitlines()
            except OSError:
                continue
            for ln in text:
                # a mount's change-feed drop (INFO) empties the kernel's caches and callbacks: every
                # cached figure after it (stat warm, stat written) is a daemon round trip each
                if any(k in ln for k in ("ERROR", "Traceback", "CRITICAL", "WARNING", "Exception", "dropping the kernel's cache")):
                    lines.append(f"{f.name}: {ln.strip()}")
        return lines if len(lines) <= limit else lines[:limit] + [f"... {len(lines) - limit} more"]



class Children:
    """The child processes a benchmark runs (cp, rm, worker processes), so that an
    abort from the supervisor thread can kill them by pid: after a teardown,
    a child stuck in a FUSE syscall gets an error and ends, but one that was
    not in the mount yet would go on."""

    def __init__(self) -> None:
        self._procs: set[subprocess.Popen] = set()
        self._lock = threading.Lock()

    def start(self, cmd: list[str], **popen) -> subprocess.Popen:
        proc = subprocess.Popen(cmd, **popen)
        with self._lock:
            self._procs.add(proc)
        return proc

    def done(self, proc: subprocess.Popen) -> None:
        with self._lock:
            self._procs.discard(proc)

    def run(self, cmd: list[str], timeout: float) -> None:
        """Run cmd to its end; BenchError on a non-zero exit (its stderr in the message)."""
        proc = self.start(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            _, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            raise BenchError(f"{' '.join(cmd[:2])} ... took longer than {timeout:.0f}s") from None
        finally:
            self.done(proc)
        if proc.returncode:
            raise BenchError(f"{' '.join(cmd)} failed (rc {proc.returncode}): {err.strip()[:500]}")

    def kill_all(self) -> None:
        with self._lock:
            procs, self._procs = list(self._procs), set()
        for proc in procs:
            if proc.poll() is None:
                proc.kill()


def human_size(n: int) -> str:
    if n % GiB == 0:
        return f"{n // GiB} GiB"
    if n % MiB == 0:
        return f"{n // MiB} MiB"
    return f"{n:,} B"


def py_spy_dump(pid: int, exe: str | None = None) -> None:
    """Print the stacks of pid (the mount, when a phase hangs) if py-spy is installed."""
    exe = exe or shutil.which("py-spy")
    if not exe:
        print("(py-spy not installed: no stack dump)", file=sys.stderr)
        return
    try:
        res = subprocess.run([exe, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=30)
        print(res.stdout + res.stderr, file=sys.stderr)
    except Exception as exc:
        print(f"py-spy dump failed: {exc}", file=sys.stderr)


def cold_cycle(cluster: Cluster, side: str) -> bool:
    """Empty every cache before a cold measurement; False if drop_caches failed.

    stripefs: `local down`, sync + drop_caches, `local up` on the same state (a
    fresh client: no chunk cache, no kernel page/dentry cache); local: sync +
    drop_caches."""
    t = time.monotonic()
    if side == "stripefs":
        cluster.down()
        ok = drop_caches()
        cluster.up()
    else:
        ok = drop_caches()
    progress(f"  {side}: caches dropped{' (cluster remounted)' if side == 'stripefs' else ''} "
             f"in {time.monotonic() - t:.1f}s")
    return ok


def write_results(doc: dict, path: str | Path) -> None:
    """The run's figures as JSON (bench/results/...)."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    progress(f"results written to {out}")


def check_workdir(workdir: str) -> dict:
    """The filesystem of --workdir; BenchError unless it is a real disk ('local disk' is the yardstick)."""
    Path(workdir).mkdir(parents=True, exist_ok=True)
    wfs = fs_of(Path(workdir))
    if wfs["fstype"] in ("tmpfs", "ramfs", "fuse", "overlay") or wfs["fstype"].startswith("fuse"):
        raise BenchError(f"--workdir {workdir} is on {wfs['fstype']}: 'local disk' must be a real disk filesystem")
    if os.geteuid() != 0:
        progress("WARNING: not root: drop_caches will fail and cold figures will be warm")
    return wfs


def supervise(bench, finish: Callable[[float], int], *, keep: bool) -> int:
    """Run bench.run() in a worker thread; return the exit status.

    bench has .run(), .phase = (name, since, limit), .cluster, .work, .state,
    .mnt and optionally .abort() (called from this thread on a signal or a
    phase timeout, before the teardown) and .after_teardown() (checks for
    leftovers). finish(total_s) prints the report and
    returns 0 or 2. The main thread stays free to handle SIGINT/SIGTERM and
    per-phase timeouts even while the worker is stuck in a FUSE syscall;
    tearing the cluster down makes that syscall fail. Whatever happens, the
    cluster is torn down and the tmp dir removed (unless keep); on failure the
    cluster's logs are copied to bench/results/failed-*-logs/.
    """
    outcome: dict = {}

    def worker():
        try:
            bench.run()
            outcome["ok"] = True
        except BaseException as exc:  # noqa: BLE001 - reported below
            outcome["exc"] = exc
            outcome["tb"] = traceback.format_exc()

    stop = {"why": None}

    def on_signal(signum, _frame):
        stop["why"] = f"interrupted by {signal.Signals(signum).name}"

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    t = threading.Thread(target=worker, name="bench", daemon=True)
    rc = 0
    try:
        t.start()
        while t.is_alive():
            t.join(0.25)
            name, since, limit = bench.phase
            if stop["why"] is None and time.monotonic() - since > limit:
                stop["why"] = f"phase '{name}' exceeded {limit:.0f}s (stripefs hung?)"
                mpid = bench.cluster.pids.get("mount")
                if mpid:
                    print(f"stack of the mount process (pid {mpid}):", file=sys.stderr)
                    py_spy_dump(mpid)
            if stop["why"]:
                progress(f"ABORT: {stop['why']}; tearing down")
                if hasattr(bench, "abort"):
                    bench.abort()
                bench.cluster.teardown()
                t.join(30)
                break
        total = time.monotonic() - T0
        if stop["why"]:
            rc = 130 if "interrupted" in stop["why"] else 3
        elif "exc" in outcome:
            exc = outcome["exc"]
            if isinstance(exc, BenchError):
                print(f"\nBENCHMARK FAILED: {exc}", file=sys.stderr)
            else:
                print(f"\nBENCHMARK FAILED:\n{outcome['tb']}", file=sys.stderr)
            probs = bench.cluster.log_problems()
            if probs:
                print("stripefs logs:", *probs, sep="\n  ", file=sys.stderr)
            rc = 1
        else:
            rc = finish(total)
    finally:
        progress("tearing down the cluster")
        if hasattr(bench, "abort"):
            bench.abort()
        bench.cluster.teardown()
        if hasattr(bench, "after_teardown"):
            bench.after_teardown()
        for s, h in old.items():
            signal.signal(s, h)
        if rc not in (0, 2) and (bench.state / "logs").is_dir():
            # the tmp dir goes away; the cluster's logs are the evidence of a failure
            dest = RESULTS / f"failed-{_dt.datetime.now().strftime('%Y%m%d-%H%M%S')}-logs"
            shutil.copytree(bench.state / "logs", dest, dirs_exist_ok=True)
            progress(f"stripefs logs of the failed run copied to {dest}")
        if keep:
            progress(f"kept {bench.work}")
        else:
            if os.path.ismount(bench.mnt):
                progress(f"WARNING: {bench.mnt} still mounted; not removing {bench.work}")
            else:
                shutil.rmtree(bench.work, ignore_errors=True)
                progress(f"removed {bench.work}")
    return rc
