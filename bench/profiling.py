"""py-spy profiles of stripefs processes during a benchmark epoch: record
them, and summarise where the time goes.

``Recorder`` attaches ``py-spy record`` (100 Hz, raw collapsed stacks; blocking
mode: --nonblocking gave torn stacks here; but never for the mount, whose
blocking profile can deadlock: py-spy stops its threads, and one pushing pages
into the kernel (NOTIFY_STORE) waits uninterruptibly on a page a READ holds
locked, a READ only the stopped trio thread can answer, so py-spy waits for
that thread to stop forever and the epoch hangs (a prefetch epoch of
bench/dataloader.py --profile, 2026-12-06; py-spy 0.4 cannot sample ``gil``
profiles without stopping the process, and those benches push no pages); ``gil``: only samples of the thread
holding the GIL, i.e. Python at work, as bench/fuse_floor.py wants) to a few processes for the length
of a ``with`` block and stops them with SIGINT, on which py-spy writes its
output. ``summarise`` reads one raw profile: samples whose innermost Python
frame is a wait (epoll, a lock, trio's idle worker threads, pyzmq's reaper
thread) are idle; of the busy ones, the top functions by self samples, and by
inclusive samples leaving out the chain every stack shares (runpy, cli main,
trio's run loop, the to_thread machinery).
"""

from __future__ import annotations

import signal
import subprocess
import time
from collections import Counter
from pathlib import Path


class Recorder:
    """``with Recorder(exe, {"mount": pid, ...}, PREFIX):`` records each process
    to PREFIX-NAME.txt; afterwards ``results[name] = (path, None)`` or
    ``(None, py-spy's complaint)``."""

    def __init__(self, exe: str, pids: dict[str, int], prefix: Path, *, native: bool = False, rate: int = 100,
                 gil: bool = False):
        self.exe, self.pids, self.prefix, self.native, self.rate, self.gil = exe, pids, prefix, native, rate, gil
        self.spies: dict[str, tuple[Path, subprocess.Popen]] = {}
        self.results: dict[str, tuple[Path | None, str | None]] = {}

    def __enter__(self) -> "Recorder":
        self.prefix.parent.mkdir(parents=True, exist_ok=True)
        for name, pid in self.pids.items():
            out = Path(f"{self.prefix}-{name}.txt")
            out.unlink(missing_ok=True)
            cmd = [self.exe, "record", "--pid", str(pid), "--rate", str(self.rate), "--format", "raw",
                   *(["--native"] if self.native else []), *(["--gil"] if self.gil else []),
                   *(["--nonblocking"] if name.startswith("mount") and not self.gil else []), "--output", str(out)]
            # its own session: a Ctrl-C at the terminal is the benchmark's to handle
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                    start_new_session=True)
            self.spies[name] = (out, proc)
        time.sleep(1.0)  # py-spy attaches
        return self

    def __exit__(self, *exc) -> None:
        for _, proc in self.spies.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)  # py-spy writes its output on SIGINT
        for name, (out, proc) in self.spies.items():
            try:
                err = proc.communicate(timeout=60)[1]
            except subprocess.TimeoutExpired:
                proc.kill()
                err = proc.communicate()[1]
            why = err.decode(errors="replace").strip()[-500:] or f"py-spy exited with {proc.returncode}"
            self.results[name] = (out, None) if out.exists() else (None, why)
        self.spies = {}

    def kill(self) -> None:
        """From another thread (an aborted run): stop every py-spy now."""
        for _, proc in list(self.spies.values()):
            if proc.poll() is None:
                proc.kill()


IDLE_LEAVES = {"get_events", "_epoll_wait", "epoll_wait", "wait", "select", "poll", "sleep", "_wait_for_tstate_lock",
               "accept", "_work"}  # _work: trio's idle worker threads
IDLE_FRAMES = {"GarbageCollectorThread.run (zmq/utils/garbage.py)"}  # pyzmq's zero-copy reaper, mostly in recv
ROOT_CHAIN = ("<frozen runpy>", "stripefs/__main__.py", "stripefs/cli.py", "main (client/mount.py)",
              "_serve (client/mount.py)", "main (daemon/cli.py)", "_serve (daemon/cli.py)",
              "main (storage_node/cli.py)", "_run (storage_node/cli.py)", "run (trio/_core/_run.py)",
              "unrolled_run (trio/_core/_run.py)",
              # the chain of every trio.to_thread job
              "(threading.py)", "(trio/_core/_thread_cache.py)", "capture (outcome/_impl.py)", "(trio/_threads.py)")


PRINT_TOP = 8  # rows printed per profile; the JSON has 15


def summarise(path: Path, wall: float, top: int = 15) -> dict:
    """Top functions of a py-spy raw (collapsed) profile.

    Stacks whose innermost frame is a wait (epoll, a lock, select) are idle
    time: counted apart. Of the busy samples: top functions by self samples,
    and by inclusive samples (a function counted once per stack) leaving out
    the chain every stack shares (runpy, cli main, trio's run loop)."""
    self_c: Counter = Counter()
    incl: Counter = Counter()
    total = busy = 0
    for line in path.read_text(errors="replace").splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        n = int(n)
        frames = [f for f in (_frame_name(f) for f in stack.split(";")) if f]
        if not frames:
            continue
        total += n
        py = [f for f in frames if ".py)" in f or "<frozen" in f]  # with --native: the innermost Python frame
        leaf = (py or frames)[-1]
        if leaf.split(" (")[0].rsplit(".", 1)[-1] in IDLE_LEAVES or leaf in IDLE_FRAMES:
            continue
        busy += n
        self_c[frames[-1]] += n
        for f in set(frames):
            incl[f] += n
    shared = {f for f, v in incl.items() if v >= 0.9 * busy or any(r in f for r in ROOT_CHAIN)}
    for f in shared:
        del incl[f]

    def pct(c: Counter) -> list:
        return [[f, round(100 * v / busy, 1)] for f, v in c.most_common(top)] if busy else []

    return {"file": str(path), "samples": total, "busy_samples": busy, "epoch_s": round(wall, 2),
            "self_pct": pct(self_c), "inclusive_pct": pct(incl)}


def _frame_name(frame: str) -> str:
    """'read (client/operations.py:123)' -> 'read (client/operations.py)'; thread/process frames dropped."""
    frame = frame.strip()
    if frame.startswith(("process ", "thread ")):
        return ""
    name, _, loc = frame.partition(" (")
    loc = loc.rstrip(")")
    fname = loc.rsplit(":", 1)[0] if loc else ""
    for marker in ("site-packages/", "lib/python3"):
        if marker in fname:
            fname = fname.split(marker, 1)[1]
    for marker in ("/client/", "/common/", "/stripefs/", "/daemon/", "/storage_node/"):
        if marker in fname:
            fname = marker.strip("/") + "/" + fname.rsplit(marker, 1)[1]
    return f"{name} ({fname})" if fname else name


# ---------------------------------------------------------------------- report


def format_summary(name: str, prof: dict) -> list[str]:
    """Report lines for one summary (PRINT_TOP rows)."""
    if "error" in prof:
        return [f"profile ({name}): {prof['error']}"]
    idle = 100 - 100 * prof["busy_samples"] / prof["samples"] if prof["samples"] else 100
    lines = [f"{prof['process']} profile, {prof['epoch']} {prof['workload']} epoch "
             f"({prof['epoch_s']}s, {prof['samples']} py-spy samples, "
             f"{idle:.0f}% of them idle (waiting in epoll or on a lock); {prof['file']})",
             f"  % of busy samples: {'self':>5s}  function                                  | "
             f"{'incl':>5s}  function (leaving out the chain every stack shares)"]
    for i in range(min(PRINT_TOP, max(len(prof["self_pct"]), len(prof["inclusive_pct"])))):
        sf, sp = prof["self_pct"][i] if i < len(prof["self_pct"]) else ("", None)
        inf, ip = prof["inclusive_pct"][i] if i < len(prof["inclusive_pct"]) else ("", 0)
        lines.append(f"  {'':18s} {'' if sp is None else f'{sp:5.1f}':>5s}  {sf[:40]:40s}  | {ip:5.1f}  {inf[:60]}")
    return lines
