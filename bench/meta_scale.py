"""The metadata daemon with many files already in its namespace (issue 30's scale row):
creates/s and stat/s against an empty namespace and against one holding ``--files``
files, and the daemon's memory and database bytes per file.

The files are generated through the batched path: BatchReqs of ``--batch`` creates
(``--dir-files`` per directory), ``--in-flight`` outstanding, straight to the daemon
of a fresh `stripefs local` cluster (one storage node, mounted but unused). The
probes, each on the empty namespace first and on the full one after, the same way:

- creates: ``--probe`` files in a new directory, BatchReqs of 64, 4 in flight;
- stats: ``--probe`` LookupReq of random existing names (in the probe's directory on
  the empty namespace, across the whole namespace on the full one), 64 in flight.

Memory: the daemon's VmRSS (/proc) before the fill and after it; the database: the
size of its files (meta.sqlite3 and its WAL). Goal: the full namespace's rates within
20% of the empty one's. The issue asks for 10,000,000 files; the default is
1,000,000 (about 10 minutes here).

    python bench/meta_scale.py [--files 1000000] [--workdir /var/tmp]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, Cluster, git_commit, proc_cpu, progress, write_results  # noqa: E402

WITHIN = 0.20  # the goal: the full namespace's rates within 20% of the empty one's


class Wire:
    """A blocking DEALER to the daemon: pipelined requests, ``in_flight`` outstanding."""

    def __init__(self, address: str):
        from stripefs.common import protocol as p

        self.p = p
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()

    def pipeline(self, messages, in_flight: int) -> float:
        """Send every message, ``in_flight`` at most outstanding; seconds taken. Any error aborts."""
        p = self.p
        started = time.perf_counter()
        sent = received = 0
        while received < len(messages):
            while sent < len(messages) and sent - received < in_flight:
                self.sock.send(p.encode(sent + 1, messages[sent]))
                sent += 1
            _, body = p.decode_reply(self.sock.recv_multipart()[0])
            bad = [body] if isinstance(body, p.ErrorRsp) else [r for r in getattr(body, "results", ()) if isinstance(r, p.ErrorRsp)]
            if bad:
                raise RuntimeError(f"the daemon refused a request: {bad[0].message}")
            received += 1
        return time.perf_counter() - started

    def mkdir(self, name: bytes) -> int:
        p = self.p
        self.sock.send(p.encode(0, p.MkdirReq(parent=1, name=name, mode=0o40755, uid=0, gid=0)))
        _, body = p.decode_reply(self.sock.recv_multipart()[0])
        return body.attr.ino

    def creates(self, parent: int, names: list[bytes], batch: int) -> list:
        p = self.p
        reqs = [p.CreateReq(parent=parent, name=n, mode=0o100644, uid=0, gid=0, session_id=0) for n in names]
        return [p.BatchReq(items=reqs[i:i + batch]) for i in range(0, len(reqs), batch)]


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def _db_bytes(state: Path) -> int:
    return sum(f.stat().st_size for f in state.rglob("meta.sqlite3*"))


def probe(wire: Wire, tag: str, n: int, stat_targets: list[tuple[int, bytes]], cpu) -> dict:
    """creates/s (n files, BatchReqs of 64, 4 in flight) and stat/s (n lookups, 64 in flight)."""
    p = wire.p
    parent = wire.mkdir(b"probe-" + tag.encode())
    names = [b"p%d" % i for i in range(n)]
    c0 = cpu()
    seconds = wire.pipeline(wire.creates(parent, names, 64), 4)
    create_cpu = cpu() - c0
    targets = stat_targets or [(parent, name) for name in names]
    lookups = [p.LookupReq(parent=d, name=nm) for d, nm in random.choices(targets, k=n)]
    c0 = cpu()
    stat_seconds = wire.pipeline(lookups, 64)
    stat_cpu = cpu() - c0
    return {"creates_per_s": n / seconds, "create_cpu_ms": 1e3 * create_cpu / n,
            "stats_per_s": n / stat_seconds, "stat_cpu_ms": 1e3 * stat_cpu / n}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", type=int, default=1_000_000, help="files in the full namespace (default 1,000,000)")
    ap.add_argument("--dir-files", type=int, default=10_000, help="files per directory (default 10,000)")
    ap.add_argument("--batch", type=int, default=1024, help="creates per BatchReq while filling (default 1024)")
    ap.add_argument("--in-flight", type=int, default=2, help="BatchReqs outstanding while filling (default 2)")
    ap.add_argument("--probe", type=int, default=20_000, help="creates and stats per probe (default 20,000)")
    ap.add_argument("--workdir", default="/var/tmp", help="a real disk for the cluster (default /var/tmp)")
    ap.add_argument("--json", default=str(RESULTS / "meta_scale.json"), help="results file")
    a = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="stripefs-bench-scale-", dir=a.workdir))
    cluster = Cluster(work / "state", work / "mnt", nodes=1)
    wire = None
    try:
        cluster.up()
        state = work / "state"
        address = f"tcp://127.0.0.1:{json.loads((state / 'cluster.json').read_text())['meta_port']}"
        pid = cluster.pids["meta"]
        cpu = lambda: proc_cpu(pid)  # noqa: E731
        wire = Wire(address)
        rss0, db0 = _rss_kib(pid), _db_bytes(state)
        progress("probe on the empty namespace")
        empty = probe(wire, "empty", a.probe, [], cpu)
        progress(f"filling: {a.files:,} files, {a.dir_files:,} per directory, BatchReqs of {a.batch}")
        targets: list[tuple[int, bytes]] = []
        started, c0 = time.perf_counter(), cpu()
        for d in range(0, a.files, a.dir_files):
            parent = wire.mkdir(b"fill-%d" % d)
            names = [b"f%d" % i for i in range(min(a.dir_files, a.files - d))]
            wire.pipeline(wire.creates(parent, names, a.batch), a.in_flight)
            targets += [(parent, random.choice(names)) for _ in range(max(1, a.probe // max(1, a.files // a.dir_files)))]
            if (d // a.dir_files) % 10 == 9:
                done = d + len(names)
                progress(f"  {done:,} files, {done / (time.perf_counter() - started):,.0f}/s, RSS {_rss_kib(pid) / 1024:.0f} MiB")
        fill_s, fill_cpu = time.perf_counter() - started, cpu() - c0
        rss1, db1 = _rss_kib(pid), _db_bytes(state)
        progress("probe on the full namespace")
        full = probe(wire, "full", a.probe, targets, cpu)
        res = {"files": a.files, "fill": {"per_s": a.files / fill_s, "cpu_ms": 1e3 * fill_cpu / a.files},
               "empty": empty, "full": full, "rss_kib": [rss0, rss1], "db_bytes": [db0, db1],
               "rss_bytes_per_file": (rss1 - rss0) * 1024 / a.files, "db_bytes_per_file": (db1 - db0) / a.files}
    finally:
        if wire is not None:
            wire.close()
        cluster.teardown()
        shutil.rmtree(work, ignore_errors=True)
    print(f"\nissue 30, the namespace at scale: {a.files:,} files generated through BatchReqs of {a.batch} "
          f"({res['fill']['per_s']:,.0f} creates/s, daemon CPU {res['fill']['cpu_ms']:.3f} ms a create)")
    print(f"  {'':40s} {'empty':>12s} {'full':>12s} {'full/empty':>11s}  goal")
    for key, label in (("creates_per_s", "creates/s (BatchReq of 64, 4 in flight)"), ("stats_per_s", "stat/s (LookupReq, 64 in flight)")):
        ratio = res["full"][key] / res["empty"][key]
        verdict = "PASS" if ratio >= 1 - WITHIN else "BELOW"
        print(f"  {label:40s} {res['empty'][key]:12,.0f} {res['full'][key]:12,.0f} {ratio:10.2f}x  >= {1 - WITHIN:.2f}x {verdict}")
    for key, label in (("create_cpu_ms", "daemon CPU per create, ms"), ("stat_cpu_ms", "daemon CPU per stat, ms")):
        print(f"  {label:40s} {res['empty'][key]:12.3f} {res['full'][key]:12.3f}")
    print(f"  daemon memory (VmRSS): {res['rss_kib'][0] / 1024:.0f} MiB empty, {res['rss_kib'][1] / 1024:.0f} MiB full: "
          f"{res['rss_bytes_per_file']:.0f} bytes per file; database {res['db_bytes_per_file']:.0f} bytes per file on disk")
    write_results({"commit": git_commit(), "when": time.strftime("%Y-%m-%dT%H:%M:%S"), **res}, a.json)
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the finally above tears the cluster down
    sys.exit(main())
