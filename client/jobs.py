"""Training jobs reading through this mount: their own data wait, joined with what the mount did for them.

A job wrapped in ``stripefs.torch.watch`` (stripefs/data_wait.py) reports its
cumulative steps, data wait and compute every second, through a ``getxattr``
whose name carries the figures (``protocol.JOB_XATTR``). The job is the
process that reported (the request's pid); its DataLoader workers are its
descendants, so every FUSE request is attributed to the job whose pid is the
requester or one of its ancestors (``/proc/PID/stat``, resolved once per pid
and cached). READ, WRITE, FLUSH, FSYNC and RELEASE reach the handlers without a caller
(operations.py): they count for the job that opened the handle.

Per job the mount counts its FUSE requests and where their time went: reads
waiting on storage nodes (``network``), reads served from the mount's memory
(``memory``), namespace requests (``metadata``: lookups, getattrs, opens,
directory listings) and the rest (``other``). Reads the kernel answers from
its page cache never reach the mount: a warm job shows little mount time, and
its own data wait says whether that matters.

Everything is exported on the mount's Prometheus endpoint with a ``job``
label (``PID NAME``), which ``stripefs top`` reads. The mount's own figures
are published when the job reports, with its figures: both then cover the
same stretch of time, so a wait is never set beside requests of another
second (they are gauges of cumulative values, like the job's). Cardinality is bounded:
at most ``MAX_JOBS`` jobs at once (a new one past it is not tracked), and a
job's series are removed ``LINGER_S`` after its last report once its process
is gone (checked at every report and every ``SWEEP_S``), or ``IDLE_S`` after
its last report whatever its process does. The linger is what lets a job's
final figures be seen at all: a short job (a cold pass over a small data set
takes well under a second) would otherwise be swept before the next scrape of
``stripefs top`` (every second) or Prometheus (every 15 s, by default).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field

import trio
from prometheus_client import Gauge

from ..common import protocol as p

log = logging.getLogger(__name__)

MAX_JOBS = 32
#: a job that has not reported for this long is dropped (its loop ended, or it hangs)
IDLE_S = 60.0
#: a job whose process is gone keeps its series this long after its last report (a Prometheus scrape interval)
LINGER_S = 15.0
SWEEP_S = 5.0
#: requests whose time counts as the job's metadata waits
METADATA_OPS = frozenset({"lookup", "getattr", "open", "opendir", "readdir", "readdirplus", "create", "access",
                          "getxattr", "listxattr", "statfs", "releasedir"})
#: requests that name a file handle, not a caller
HANDLE_OPS = frozenset({"read", "write", "flush", "fsync", "release"})
#: ancestors looked at to find a job (a DataLoader worker is the job's child; a pool's, its grandchild)
MAX_DEPTH = 8
#: pids whose job is remembered (a job's workers come and go each epoch)
MAX_PIDS = 65536

JOB_STEPS = Gauge("stripefs_job_steps", "Training steps a job reported (stripefs.torch.watch)", ["job"])
JOB_WAIT = Gauge("stripefs_job_data_wait_seconds", "Time a job's loop waited for its next batch (GPU idle for data, when measured on the GPU)", ["job"])
JOB_COMPUTE = Gauge("stripefs_job_compute_seconds", "Time a job's loop spent on its steps besides waiting for data", ["job"])
JOB_GPU = Gauge("stripefs_job_gpu_measured", "1 when the job's data wait is measured on the GPU (CUDA events)", ["job"])
JOB_REQUESTS = Gauge("stripefs_job_fuse_requests", "FUSE requests of a job's processes (itself and its workers) "
                     "up to its last report", ["job"])
JOB_SECONDS = Gauge(
    "stripefs_job_fuse_seconds",
    "Time the mount spent answering a job's processes up to its last report, by where it went: network (reads "
    "waiting on storage nodes), memory (reads served by the mount), metadata (lookups, opens, listings), other",
    ["job", "kind"],
)
KINDS = ("network", "memory", "metadata", "other")


@dataclass
class Job:
    pid: int
    label: str  # the ``job`` label: "PID NAME"
    reported: float  # monotonic time of the last report
    done: bool = False
    requests: int = 0  # what the mount did for it so far (published at its reports)
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(KINDS, 0.0))


def _parent(pid: int, proc: str) -> int | None:
    """``pid``'s parent, from /proc (None: gone or unreadable)."""
    try:
        with open(f"{proc}/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    try:  # "PID (COMM) STATE PPID ...": COMM may hold spaces and parentheses
        return int(stat[stat.rindex(b")") + 2 :].split()[1])
    except (ValueError, IndexError):
        return None


def _command(pid: int, proc: str) -> str:
    try:
        with open(f"{proc}/{pid}/cmdline", "rb") as f:
            argv = [a for a in f.read().split(b"\0") if a]
    except OSError:
        return "?"
    names = [os.path.basename(a).decode(errors="replace") for a in argv[:2]]
    return " ".join(names) or "?"


class Jobs:
    def __init__(self, proc: str = "/proc") -> None:
        self.proc = proc
        self.by_pid: dict[int, Job] = {}
        self._job_of: dict[int, int | None] = {}  # any pid -> the pid of its job (None: none)
        self._handles: dict[int, Job] = {}  # file handle -> the job that opened it
        self._swept = time.monotonic()

    @property
    def active(self) -> bool:
        """Some job is tracked: requests are attributed (else attribution costs nothing)."""
        return bool(self.by_pid)

    # -- reports (the job's own figures) --------------------------------------------------------

    def report(self, pid: int, attr_name: bytes) -> bool:
        """A job's report (``getxattr`` of ``JOB_XATTR``...) from process ``pid``; False if malformed."""
        rep = p.decode_job_report(attr_name)
        if rep is None:
            return False
        now = time.monotonic()
        self.sweep(now)
        job = self.by_pid.get(pid)
        if job is None:
            if len(self.by_pid) >= MAX_JOBS:
                log.warning("job %d reported, but %d jobs are tracked already: not shown", pid, MAX_JOBS)
                return True
            job = Job(pid, f"{pid} {rep.name or _command(pid, self.proc)}", now)
            self.by_pid[pid] = job
            self._job_of.clear()  # pids resolved before this job existed may be its workers
            for kind in KINDS:
                JOB_SECONDS.labels(job.label, kind)
            JOB_REQUESTS.labels(job.label)
            log.info("job %s reports its data wait", job.label)
        job.reported, job.done = now, rep.done
        JOB_STEPS.labels(job.label).set(rep.steps)
        JOB_WAIT.labels(job.label).set(rep.wait_s)
        JOB_COMPUTE.labels(job.label).set(rep.compute_s)
        JOB_GPU.labels(job.label).set(1 if rep.gpu else 0)
        JOB_REQUESTS.labels(job.label).set(job.requests)
        for kind, seconds in job.seconds.items():
            JOB_SECONDS.labels(job.label, kind).set(seconds)
        return True

    def sweep(self, now: float | None = None) -> None:
        """Drop jobs whose process is gone (``LINGER_S`` after their last report) or that stopped
        reporting (``IDLE_S``); their series go too."""
        now = time.monotonic() if now is None else now
        self._swept = now
        for pid, job in list(self.by_pid.items()):
            quiet = now - job.reported
            if quiet > IDLE_S or (quiet > LINGER_S and not os.path.exists(f"{self.proc}/{pid}")):
                self._drop(job)

    async def sweep_loop(self) -> None:
        """``sweep`` every ``SWEEP_S`` while jobs are tracked (a job killed mid-epoch sends nothing more)."""
        while True:
            await trio.sleep(SWEEP_S)
            if self.by_pid:
                self.sweep()

    def _drop(self, job: Job) -> None:
        del self.by_pid[job.pid]
        self._job_of.clear()
        self._handles = {fh: j for fh, j in self._handles.items() if j is not job}
        for gauge in (JOB_STEPS, JOB_WAIT, JOB_COMPUTE, JOB_GPU, JOB_REQUESTS):
            try:
                gauge.remove(job.label)
            except KeyError:
                pass
        for kind in KINDS:
            try:
                JOB_SECONDS.remove(job.label, kind)
            except KeyError:
                pass

    # -- attribution (what the mount did for each job) ------------------------------------------

    def job_of(self, pid: int) -> Job | None:
        """The job ``pid`` belongs to: itself or its nearest reporting ancestor."""
        if pid in self._job_of:
            owner = self._job_of[pid]
            return self.by_pid.get(owner) if owner is not None else None
        owner, cur = None, pid
        for _ in range(MAX_DEPTH):
            if cur in self.by_pid:
                owner = cur
                break
            cur = _parent(cur, self.proc)
            if not cur or cur == 1:
                break
        if len(self._job_of) >= MAX_PIDS:
            self._job_of.clear()
        self._job_of[pid] = owner
        return self.by_pid.get(owner) if owner is not None else None

    def account(self, op: str, args: tuple, result, seconds: float, network: float, by_inode: bool = False) -> None:
        """One FUSE request answered (client/metrics.py ``_timed``): count it for its job. ``by_inode``:
        a request sent without OPEN (no-open), which names no handle: its own context names the
        process (a READ's or WRITE's; a FLUSH or FSYNC by inode carries none here: not counted)."""
        if time.monotonic() - self._swept > SWEEP_S:
            self.sweep()
        if op in HANDLE_OPS and not by_inode:
            job = self._handles.get(args[0]) if args else None
            if op == "release":
                self._handles.pop(args[0], None)
        else:
            ctx = args[-1] if args else None
            pid = getattr(ctx, "pid", 0)
            job = self.job_of(pid) if pid else None
            if job is not None and op in ("open", "create"):
                opened = result[1] if op == "create" else result  # (Entry, Opened) or Opened
                if opened is not None:
                    self._handles[opened.fh] = job
        if job is None:
            return
        job.requests += 1
        if op == "read":
            job.seconds["network"] += network
            job.seconds["memory"] += max(0.0, seconds - network)
        else:
            job.seconds["metadata" if op in METADATA_OPS else "other"] += seconds
