"""One GetattrReq round trip of the mount's thread client, counted per thread (issue 30).

bench/transport.py times the round trip; on this shared machine its median moves with the load
(0.13-0.33 ms for the same code). This probe counts what the load does not move, per request,
for every thread of both processes (the client's: this process; the server's: the metadata
daemon, or the bare echo server of bench/transport.py for the floor):

- CPU (/proc/PID/task/TID/schedstat: ns on the CPU), its run-queue wait, and its time slices;
- context switches, voluntary (a wait: a wake-up per request) and not (preempted);

over ``--n`` sequential requests, one in flight, after a warm-up. ``--strace``: also ``strace -c
-f`` of each side over a run of its own (strace slows it; only its counts matter): syscalls per
request. ``--py-spy DIR``: ``py-spy record --native`` of each side over a third run.

    STRIPEFS_LOCAL_PORTS=... python bench/getattr_probe.py [--n 5000] [--strace] [--py-spy DIR]
        [--meta tcp://127.0.0.1:PORT --meta-pid PID]      # without: a throwaway cluster
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent))
import transport  # noqa: E402  (bench/transport.py: its floor server and the blocking client's set-up)

WARMUP = 300


def threads(pid: int) -> dict[int, dict]:
    """Every thread of ``pid``: tid -> {comm, cpu_ns, wait_ns, slices, vol, invol}."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        base = f"/proc/{pid}/task/{tid}"
        try:
            with open(f"{base}/schedstat") as f:
                cpu, wait, slices = (int(x) for x in f.read().split())
            with open(f"{base}/comm") as f:
                comm = f.read().strip()
            with open(f"{base}/status") as f:
                status = dict(ln.split(":", 1) for ln in f if ":" in ln)
        except OSError:
            continue
        out[int(tid)] = {"comm": comm, "cpu_ns": cpu, "wait_ns": wait, "slices": slices,
                         "vol": int(status["voluntary_ctxt_switches"]), "invol": int(status["nonvoluntary_ctxt_switches"])}
    return out


def delta(before: dict, after: dict, n: int, names: dict[int, str]) -> list[dict]:
    """Per request, for each thread that ran: cpu_us, wait_us, slices, vol, invol."""
    rows = []
    for tid, a in after.items():
        b = before.get(tid, {k: 0 for k in a} | {"comm": a["comm"]})
        row = {"tid": tid, "name": names.get(tid, a["comm"]),
               "cpu_us": (a["cpu_ns"] - b["cpu_ns"]) / n / 1e3, "wait_us": (a["wait_ns"] - b["wait_ns"]) / n / 1e3,
               "slices": (a["slices"] - b["slices"]) / n, "vol": (a["vol"] - b["vol"]) / n, "invol": (a["invol"] - b["invol"]) / n}
        if row["slices"] * n >= 10:
            rows.append(row)
    return sorted(rows, key=lambda r: -r["cpu_us"])


def python_names(pid: int) -> dict[int, str]:
    """Native thread id -> Python thread name, for the threads of this process (py-spy would do
    the same for another: left to the reader)."""
    return {t.native_id: t.name for t in threading.enumerate() if t.native_id} if pid == os.getpid() else {}


class Side:
    """How to run n requests (``go(n)``) and which process answers them (``server_pid``)."""

    def __init__(self, name: str, go, server_pid: int):
        self.name, self.go, self.server_pid = name, go, server_pid


def floor_side(children: list) -> Side:
    proc, address = transport._server("echo")
    children.append(proc)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    frame = b"\x93\x01\x01\x81\xa1t\xa4ping"

    def go(n: int) -> list[float]:
        times = []
        for _ in range(n):
            t = time.perf_counter()
            sock.send(frame)
            sock.recv()
            times.append(time.perf_counter() - t)
        return times

    return Side("floor (bare pyzmq echo)", go, proc.pid)


def blocking_side(address: str, meta_pid: int) -> Side:
    from stripefs.client.meta_blocking import BlockingMetaClient
    from stripefs.client.meta_rpc import MetaClient
    from stripefs.common import protocol as p

    ctx = zmq.Context()
    client = BlockingMetaClient(ctx, MetaClient(ctx, [address], timeout=10.0), timeout=10.0)
    request = p.GetattrReq(ino=1)

    def go(n: int) -> list[float]:
        times = []
        for _ in range(n):
            t = time.perf_counter()
            client.call(request)
            times.append(time.perf_counter() - t)
        return times

    return Side("thread client -> read lane, GetattrReq", go, meta_pid)


def counted(side: Side, n: int) -> dict:
    side.go(WARMUP)
    me, other = os.getpid(), side.server_pid
    b_me, b_other = threads(me), threads(other)
    times = side.go(n)
    a_me, a_other = threads(me), threads(other)
    times.sort()
    return {"side": side.name, "n": n, "median_ms": times[n // 2] * 1e3, "p99_ms": times[int(n * 0.99)] * 1e3,
            "client": delta(b_me, a_me, n, python_names(me)), "server": delta(b_other, a_other, n, {}),
            "load": os.getloadavg()[0]}


def straced(side: Side, n: int, workdir: Path) -> dict:
    """syscalls per request on each side: (name -> calls per request), over ``n`` requests under
    strace -c -f (each side attached at once: both sides slowed alike)."""
    side.go(WARMUP)
    out = {}
    spies = {}
    for who, pid in (("client", os.getpid()), ("server", side.server_pid)):
        path = workdir / f"strace-{who}.txt"
        spies[who] = (path, subprocess.Popen(["strace", "-c", "-f", "-o", str(path), "-p", str(pid)],
                                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    time.sleep(1.0)
    side.go(n)
    for who, (path, proc) in spies.items():
        proc.send_signal(signal.SIGINT)
        proc.wait(30)
        calls = {}
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) >= 5 and parts[0][0].isdigit() and parts[-1] != "total":
                calls[parts[-1]] = int(parts[3]) / n
        out[who] = dict(sorted(calls.items(), key=lambda kv: -kv[1]))
    return out


def spied(side: Side, n: int, directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    tag = side.name.split()[0]
    spies = [subprocess.Popen([str(Path(sys.executable).parent / "py-spy"), "record", "--native", "--rate", "250", "--format", "raw", "--threads",
                               "--pid", str(pid), "--output", str(directory / f"{tag}-{who}.txt")],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
             for who, pid in (("client", os.getpid()), ("server", side.server_pid))]
    time.sleep(1.0)
    side.go(n)
    for proc in spies:
        proc.send_signal(signal.SIGINT)
        proc.wait(60)


def report(res: dict) -> None:
    print(f"\n{res['side']}: n {res['n']}, median {res['median_ms']:.3f} ms, p99 {res['p99_ms']:.3f} ms, load {res['load']:.1f}")
    print(f"  {'':7s} {'thread':24s} {'cpu us':>8s} {'runq us':>8s} {'slices':>7s} {'vol cs':>7s} {'invol':>6s}   (per request)")
    for who in ("client", "server"):
        for r in res[who]:
            print(f"  {who:7s} {r['tid']:>7d} {r['name'][:16]:16s} {r['cpu_us']:8.1f} {r['wait_us']:8.1f} {r['slices']:7.2f} {r['vol']:7.2f} {r['invol']:6.2f}")
        print(f"  {who:7s} {'all threads':24s} {sum(r['cpu_us'] for r in res[who]):8.1f} {'':8s} "
              f"{sum(r['slices'] for r in res[who]):7.2f} {sum(r['vol'] for r in res[who]):7.2f}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=5000)
    ap.add_argument("--meta", help="an idle metadata daemon's address (default: a throwaway cluster)")
    ap.add_argument("--meta-pid", type=int, help="its process id (with --meta)")
    ap.add_argument("--strace", action="store_true", help="also syscalls per request (strace -c -f)")
    ap.add_argument("--py-spy", type=Path, help="also py-spy record --native of each side, into this folder")
    ap.add_argument("--rounds", type=int, default=1, help="counted runs of each side, alternating")
    ap.add_argument("--json", type=Path, help="write every figure here")
    ap.add_argument("--workdir", default="/var/tmp")
    a = ap.parse_args(argv)
    cluster = work = None
    children: list = []
    results = []
    try:
        work = Path(tempfile.mkdtemp(prefix="stripefs-getattr-probe-", dir=a.workdir))
        address, meta_pid = a.meta, a.meta_pid
        if not address:
            from common import Cluster

            cluster = Cluster(work / "state", work / "mnt", nodes=1)
            cluster.up()
            cluster.past_restart_grace()
            address = f"tcp://127.0.0.1:{json.loads((work / 'state' / 'cluster.json').read_text())['meta_port']}"
            meta_pid = cluster.pids["meta"]
        sides = [floor_side(children), blocking_side(address, meta_pid)]
        for _ in range(a.rounds):
            for side in sides:
                res = counted(side, a.n)
                results.append(res)
                report(res)
        for side in sides:
            if a.strace:
                calls = straced(side, min(a.n, 2000), work)
                for who, per in calls.items():
                    print(f"  {side.name}, strace {who}: " + ", ".join(f"{k} {v:.2f}" for k, v in per.items() if v >= 0.05))
                results.append({"side": side.name, "strace": calls})
            if a.py_spy:
                spied(side, a.n, a.py_spy)
    finally:
        for proc in children:
            proc.kill()
            proc.wait()
        if cluster is not None:
            cluster.teardown()
        if work is not None:
            shutil.rmtree(work, ignore_errors=True)
    if a.json:
        a.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    sys.exit(main())
