"""Metadata through the mount against the goals of issue 15 ("Metadata at the
kernel's speed"), every figure beside the local disk doing the same in the
same run (the machine is shared and noisy: only same-run ratios compare),
with its goal and PASS/BELOW, in one table.

Configurations (--configs), each a fresh `stripefs local` cluster with 2
storage nodes: sqlite (one daemon, one client), pg1 (PostgreSQL behind one
daemon; the server is the throwaway one of `--meta-store postgresql`), pg2
(PostgreSQL behind two daemons, two mounts, one per daemon, working at once;
the local side then runs two threads).

Groups (--only), each timing what a user's program does:
  ops        bench/meta_ops.py: create, stat cold and warm, readdir warm,
             rename, unlink, mkdir, rmdir, mkdir -p chains, one thread per
             client; the metadata daemon's and the mount's CPU per create
             (/proc/PID/stat across the create phase). Every configuration.
  transport  bench/transport.py: a metadata round trip at the client (PingReq
             and GetattrReq of the root) on the idle cluster, beside a bare
             pyzmq DEALER/ROUTER round trip between two processes (the floor:
             the local-disk ratio does not fit a round trip).
  procs      bench/procs.py: two processes creating files on one mount, each
             in its own directory; aggregate creates/s; then each on a mount
             of its own (issue 30's "2 processes, 2 mounts").
  mdtest     bench/procs.py: io500's mdtest-easy phases, two processes on one
             mount, each in its own directory: create empty files, stat a
             neighbour's, remove its own; files/s per phase (issue 31).
  records    bench/procs.py: two processes writing interleaved 47,008-byte
             records into one shared file (pwrite, fsync); aggregate MiB/s;
             the content checked after.
  wire       bench/transport.py: BatchReqs of 64 creates straight to every
             daemon at once (a thread each, no mount): aggregate creates/s
             and the daemons' CPU per create (issue 30's PostgreSQL rows),
             beside the local disk creating as many files, a thread per
             daemon. Every configuration.
  ingest     bench/tree.py: `cp -r` of a tree of small files plus `sync -f`, and
             (untimed) the copy settled: the CPU per file of cp, sync and every
             process of the cluster (issue 31's "CPU per 110 KiB file ingested");
             ImageFolder's index walk of the copy, cold (drop_caches 3) and
             warm, on the default mount and on a dataset-mode mount
             (`-o dataset`, remounted as bench/dataloader.py does); `rm -rf`.
The groups other than ops and wire run on the first configuration of --configs (by
default SQLite, the store the issue's goals are set for); of the PostgreSQL
rows only pg2's aggregate create has a goal.

Any content mismatch aborts the run (exit 1); --strict exits 2 when a goal
is BELOW. Every cluster is stopped and every mount unmounted, also on Ctrl-C,
SIGTERM or a phase past --phase-timeout (bench/common.py supervise).
Results: the table on stdout, progress on stderr, JSON in
bench/results/meta.json.

    python bench/meta.py [--files 2000] [--configs sqlite,pg1,pg2] [--only ops,ingest] [--workdir /var/tmp]
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import meta_ops  # noqa: E402
import procs  # noqa: E402
import transport  # noqa: E402
import tree  # noqa: E402
from common import (RESULTS, BenchError, Children, Cluster, check_workdir, cold_cycle, drop_caches, git_commit,  # noqa: E402
                    proc_cpu, progress, supervise, write_results)
from meta_report import report  # noqa: E402

OPS = meta_ops.OPS
GROUPS = ("ops", "transport", "procs", "mdtest", "records", "ingest", "wire")
CONFIGS = {
    "sqlite": ("SQLite, 1 daemon, 1 client", [], 1),
    "pg1": ("PostgreSQL, 1 daemon, 1 client", ["--meta-store", "postgresql"], 1),
    "pg2": ("PostgreSQL, 2 daemons, 2 clients", ["--meta-store", "postgresql", "--metas", "2"], 2),
}
WALK_MIN_S = 0.3  # warm index walks repeat for at least this long (a warm local walk of 2,000 files takes ~5 ms)
# each pair: cold walks right after the drop, warm ones right after them (load drifts over minutes)
WALK_ORDER = [("local", "cold"), ("stripefs", "cold"), ("stripefs", "warm"), ("local", "warm")]


class MetaBench:
    """The run: one configuration after another, each on its own cluster (``self.cluster``: the current one)."""

    def __init__(self, args, work: Path):
        self.args, self.work = args, work
        self.children = Children()
        self.results: dict[str, dict] = {}
        self.extra_mounts: list[tuple[Path, Path]] = []  # (mountpoint, pidfile) of pg2's second mount
        self.cold_ok = True
        self.manifest: dict | None = None  # the ingest source tree's, made once
        self.set_cluster(args.configs[0])
        self.set_phase("start")

    # -- plumbing (supervise() reads phase, cluster, work, state, mnt; calls abort)

    def set_phase(self, name: str) -> None:
        self.phase = (name, time.monotonic(), self.args.phase_timeout)
        progress(name)

    def set_cluster(self, key: str) -> None:
        self.state, self.mnt = self.work / f"state-{key}", self.work / f"mnt-{key}"
        self.cluster = Cluster(self.state, self.mnt, nodes=2)
        self.cluster.up_args = CONFIGS[key][1]

    def abort(self) -> None:
        """From the supervisor thread: children killed, pg2's second mount unmounted."""
        self.children.kill_all()
        self.unmount_extras()

    def unmount_extras(self) -> None:
        for mnt, pidfile in self.extra_mounts:
            if os.path.ismount(mnt):
                subprocess.run(["fusermount3", "-u", "-z", str(mnt)], capture_output=True, timeout=30)
            pid = _read_pid(pidfile)
            for _ in range(50):  # an unmounted client ends by itself; one that does not is killed
                if not pid or proc_cpu(pid) is None:
                    break
                time.sleep(0.1)
            else:
                os.kill(pid, signal.SIGKILL)
        self.extra_mounts = []

    def cpu(self) -> dict[str, float]:
        """Cumulative CPU seconds of every stripefs process and of this one."""
        out = {**self.cluster.cpu(), "bench": _own_cpu()}
        if "postgres" in out:  # its backends do the database work: children of the server, alive
            out["postgres"] += sum(filter(None, map(proc_cpu, _children_of(self.cluster.pids["postgres"]))))
        for k, (_mnt, pidfile) in enumerate(self.extra_mounts):
            pid = _read_pid(pidfile)
            c = proc_cpu(pid) if pid else None
            if c is None:
                raise BenchError(f"the second mount (pid {pid}) is gone")
            out[f"mount-{k + 2}"] = c
        return out

    # -- the run

    def run(self) -> None:
        for i, key in enumerate(self.args.configs):
            groups = [g for g in GROUPS if g in self.args.only and (g == "ops" or i == 0 or g == "wire")]
            if groups:
                self.run_config(key, groups)
        self.set_phase("finish")

    def run_config(self, key: str, groups: list[str]) -> None:
        a = self.args
        label, _, clients = CONFIGS[key]
        res = self.results[key] = {"label": label, "clients": clients, "files": a.files // clients * clients,
                                   "loadavg": {}}
        if "ops" in groups:  # the local side first, with no cluster running
            self.set_phase(f"{label}: local disk, {clients} thread(s), {a.files // clients} files each")
            roots = [self.work / f"local-{key}-{c}" for c in range(clients)]
            res["local_ops_s"], cpu = meta_ops.run_ops(roots, a.files // clients, a.chains, a.depth,
                                                       lambda: {"bench": _own_cpu()})
            res["local_cpu_create_s"] = cpu
        self.set_cluster(key)
        try:
            self.set_phase(f"{label}: starting the cluster")
            self.cluster.up()
            mounts = [self.mnt]
            if clients == 2:
                mounts.append(self.mount_second())
            for group in groups:
                res["loadavg"][group] = round(os.getloadavg()[0], 2)
                getattr(self, f"group_{group}")(key, res, mounts)
        finally:
            self.unmount_extras()
            self.cluster.teardown()
        res["log_problems"] = self.cluster.log_problems()

    def mount_second(self) -> Path:
        """A second mount (its pid in a pidfile: CPU, and a kill if it stays): pg2's, on the second
        daemon; otherwise on the one daemon (the procs group's two mounts)."""
        mnt, pidfile = self.work / f"{self.mnt.name}-2", self.state / "mount-2.pid"
        mnt.mkdir()
        self.extra_mounts.append((mnt, pidfile))
        address = _meta_addresses(self.state)[-1]
        self.children.run(self.cluster.cli + ["mount", address, str(mnt), "--log", str(self.state / "logs" / "mount-2.log"),
                                              "--pidfile", str(pidfile)], timeout=120)
        return mnt

    def group_ops(self, key: str, res: dict, mounts: list[Path]) -> None:
        a = self.args
        label, _, clients = CONFIGS[key]
        per = a.files // clients
        roots = [m / f"c{c}" for c, m in enumerate(mounts)]
        res["stripefs_ops_s"], cpu = meta_ops.run_ops(roots, per, a.chains, a.depth, self.cpu,
                                                      lambda op: self.set_phase(f"{label}: stripefs {op}"))
        res["ratio"] = {op: res["stripefs_ops_s"][op] / res["local_ops_s"][op] for op in OPS}
        res["cpu_create_s"] = cpu
        creates = per * clients
        res["cpu_per_create_ms"] = {
            "daemon": 1e3 * sum(v for k, v in cpu.items() if k.startswith("meta")) / creates,
            "mount": 1e3 * sum(v for k, v in cpu.items() if k.startswith("mount")) / creates,
            "bench": 1e3 * cpu["bench"] / creates,
            "local": 1e3 * res["local_cpu_create_s"]["bench"] / creates,
        }

    def group_transport(self, key: str, res: dict, mounts: list[Path]) -> None:
        self.set_phase(f"transport: {self.args.rtt_n:,} round trips each, idle cluster")
        daemon_cpu = lambda: sum(v for k, v in self.cluster.cpu().items() if k.startswith("meta"))  # noqa: E731
        res["transport"] = transport.measure(_meta_addresses(self.state)[0], self.args.rtt_n, self.children, daemon_cpu)

    def group_procs(self, key: str, res: dict, mounts: list[Path]) -> None:
        """Two processes creating files at once: on one mount (issue 15), and each on a mount of its
        own (issue 30's row: two mount processes, no reader thread or GIL shared), each beside the
        local disk measured right before it."""
        n = self.args.files // 2
        out = res["procs"] = {"per_process": n}
        for side, root in (("local", self.work / f"local-procs-{key}"), ("stripefs", mounts[0] / "procs")):
            self.set_phase(f"{side}: 2 processes creating {n:,} files each")
            out[side] = procs.creates(self.children, [root / "p0", root / "p1"], n, self.args.phase_timeout)
        if len(mounts) == 1:
            mounts = [*mounts, self.mount_second()]
        two = out["two_mounts"] = {}
        self.set_phase(f"local: 2 processes creating {n:,} files each, again")
        root = self.work / f"local-procs2-{key}"
        two["local"] = procs.creates(self.children, [root / "p0", root / "p1"], n, self.args.phase_timeout)
        self.set_phase(f"stripefs: 2 processes creating {n:,} files each, one per mount")
        two["stripefs"] = procs.creates(self.children, [m / "procs2" / f"p{k}" for k, m in enumerate(mounts[:2])], n,
                                        self.args.phase_timeout)

    def group_mdtest(self, key: str, res: dict, mounts: list[Path]) -> None:
        """io500's mdtest-easy phases, 2 processes ("ranks") on one mount (issue 31), beside the local disk."""
        n = self.args.files // 2
        out = res["mdtest"] = {"per_process": n}
        for side, root in (("local", self.work / f"local-mdtest-{key}"), ("stripefs", mounts[0] / "mdtest")):
            self.set_phase(f"{side}: mdtest-easy, 2 processes, {n:,} files each: create, stat, remove")
            out[side] = procs.mdtest_easy(self.children, [root / "rank0", root / "rank1"], n, self.args.phase_timeout)

    def group_records(self, key: str, res: dict, mounts: list[Path]) -> None:
        count = self.args.records_mib * (1 << 20) // procs.RECORD
        out = res["records"] = {"records": count, "record_bytes": procs.RECORD}
        for side, path in (("local", self.work / f"local-records-{key}"), ("stripefs", mounts[0] / "records")):
            self.set_phase(f"{side}: 2 processes writing {count:,} interleaved records into one file")
            out[side] = procs.records(self.children, path, count, self.args.phase_timeout)

    def group_wire(self, key: str, res: dict, mounts: list[Path]) -> None:
        """BatchReqs of 64 creates straight to every daemon at once (no mount: the daemon side
        alone, issue 30), beside the local disk creating as many files with as many threads."""
        n = self.args.files * 2
        addresses = _meta_addresses(self.state)
        self.set_phase(f"wire: local disk, {len(addresses)} thread(s), {n:,} creates each")
        roots = [self.work / f"local-wire-{key}-{k}" for k in range(len(addresses))]
        for root in roots:
            root.mkdir()
        count, seconds = meta_ops.creates_in(roots, n)
        local = count / seconds
        self.set_phase(f"wire: {len(addresses)} daemon(s), BatchReq of 64 creates, {n:,} each")
        daemon_cpu = lambda: sum(v for k, v in self.cluster.cpu().items() if k.startswith("meta"))  # noqa: E731
        res["wire"] = {**transport.creates_at_once(addresses, n, 64, 4, daemon_cpu), "local_per_s": local}

    def group_ingest(self, key: str, res: dict, mounts: list[Path]) -> None:
        a = self.args
        src = self.work / "source"
        if self.manifest is None:
            self.set_phase(f"making the source tree: {a.ingest_files:,} files in {a.ingest_classes} folders")
            self.manifest = tree.make_source(src, a.ingest_files, a.ingest_classes)
        files = len(self.manifest)
        out = res["ingest"] = {"files": files, "classes": a.ingest_classes,
                               "bytes": sum(size for size, _ in self.manifest.values()), "walk": {}}
        dst = {"local": self.work / f"local-ingest-{key}", "stripefs": mounts[0] / "ingest"}
        for side in ("local", "stripefs"):
            self.set_phase(f"{side}: cp -r + sync -f of {files:,} files")
            cpu = self.ingest_cpu(side)
            s = tree.ingest(self.children, src, dst[side], a.phase_timeout)
            out.setdefault("cp", {})[side] = {"s": round(s, 4), "rate": files / s}
            self.set_phase(f"{side}: the copy settled (untimed: the write-back sent, FSYNCDIR of each directory)")
            tree.settle(dst[side])
            after = self.ingest_cpu(side)
            out.setdefault("cpu_per_file_ms", {})[side] = {k: round(1e3 * (v - cpu.get(k, 0.0)) / files, 4)
                                                           for k, v in after.items()}
        self.set_phase("stripefs: checking the copy, file by file")
        tree.verify(dst["stripefs"], self.manifest)
        self.walks("default", dst, out["walk"])
        self.cluster.options = ["dataset"]  # as bench/dataloader.py: each later `local up` mounts in dataset mode
        try:
            self.walks("dataset", dst, out["walk"])
        finally:
            self.cluster.options = []
        self.set_phase("back to the default mount (read-write) for rm -rf")
        self.cluster.down()
        self.cluster.up()
        tree.index_walk(dst["stripefs"])  # not timed: the fresh mount's kernel knows the tree, as the local disk's does
        self.cluster.past_restart_grace()  # the rm times rm, not the daemon's wait after its restart
        for side in ("local", "stripefs"):
            self.set_phase(f"{side}: rm -rf of {files:,} files")
            s = tree.remove(self.children, dst[side], a.phase_timeout)
            out.setdefault("rm", {})[side] = {"s": round(s, 4), "rate": files / s}

    def ingest_cpu(self, side: str) -> dict[str, float]:
        """CPU seconds so far of what an ingest runs: ``cp`` and ``sync`` (children of this process)
        and, for stripefs, every process of the cluster (the mount, the daemon, the storage nodes)."""
        out = {"cp": tree.children_cpu()}
        if side == "stripefs":
            out.update(self.cluster.cpu())
        return out

    def walks(self, mode: str, dst: dict[str, Path], out: dict) -> None:
        """Cold and warm index walks of both sides after one cold cycle: drop_caches 3 on the default mount;
        `local down`, drop_caches, `local up` (now in dataset mode) for the dataset mount."""
        self.set_phase(f"index walk, {mode} mount: cold cycle")
        self.cold_ok &= cold_cycle(self.cluster, "stripefs") if mode == "dataset" else drop_caches()
        expected = sorted(self.manifest)
        for side, temp in WALK_ORDER:
            self.set_phase(f"{side}: index walk, {temp}, {mode} mount")
            files = seconds = 0
            counted = side == "stripefs" and self.cluster.metrics.get("mount")
            before = tree.requests(self.cluster.metrics["mount"]) if counted else None
            while not files or (temp == "warm" and seconds < WALK_MIN_S):
                samples, s = tree.index_walk(dst[side])
                if samples != expected:
                    raise BenchError(f"{side} index walk ({temp}, {mode} mount): {len(samples)} samples, "
                                     f"{len(expected)} copied (or other names)")
                files, seconds = files + len(samples), seconds + s
            out.setdefault(f"{temp}@{mode}", {})[side] = {"s": round(seconds, 5), "files": files,
                                                          "rate": files / seconds}
            if before is not None:  # FUSE requests by opcode and the mount's requests to the cluster, per file
                after = tree.requests(self.cluster.metrics["mount"])
                out[f"{temp}@{mode}"]["requests_per_file"] = {
                    k: round((v - before.get(k, 0)) / files, 4) for k, v in sorted(after.items()) if v > before.get(k, 0)}


def _own_cpu() -> float:
    """This process's CPU seconds, to the microsecond (os.times() counts 10 ms ticks: a few hundred local creates)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _children_of(pid: int) -> list[int]:
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        found.append(int(entry.name))
            except (OSError, ValueError, IndexError):
                continue
    return found


def _read_pid(pidfile: Path) -> int | None:
    try:
        return int(pidfile.read_text().strip())
    except (OSError, ValueError):
        return None


def _meta_addresses(state: Path) -> list[str]:
    info = json.loads((state / "cluster.json").read_text())
    return [f"tcp://127.0.0.1:{p}" for p in info.get("meta_ports", [info["meta_port"]])]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", type=int, default=2000,
                    help="files per configuration for ops, all clients together; procs: half per process (default 2000)")
    ap.add_argument("--chains", type=int, default=200, help="mkdir -p: chains per configuration (default 200)")
    ap.add_argument("--depth", type=int, default=10, help="mkdir -p: directories per chain (default 10)")
    ap.add_argument("--ingest-files", type=int, default=2000, help="ingest: files of ~110 KiB (default 2000)")
    ap.add_argument("--ingest-classes", type=int, default=20, help="ingest: class folders (default 20)")
    ap.add_argument("--records-mib", type=int, default=64, help="records: the shared file's size (default 64 MiB)")
    ap.add_argument("--rtt-n", type=int, default=5000, help="transport: round trips per figure (default 5000)")
    ap.add_argument("--configs", default="sqlite,pg1,pg2", help="which of sqlite, pg1, pg2 (default all)")
    ap.add_argument("--only", default=",".join(GROUPS), help=f"groups to run (default all: {','.join(GROUPS)})")
    ap.add_argument("--workdir", default="/var/tmp", help="a real disk for the clusters and the local side (default /var/tmp)")
    ap.add_argument("--phase-timeout", type=float, default=900, help="abort when one phase takes longer (default 900 s)")
    ap.add_argument("--strict", action="store_true", help="exit 2 when a goal is BELOW")
    ap.add_argument("--keep", action="store_true", help="keep the tmp dir")
    ap.add_argument("--json", default=str(RESULTS / "meta.json"), help="results file (default bench/results/meta.json)")
    a = ap.parse_args(argv)
    a.configs = [k.strip() for k in a.configs.split(",") if k.strip()]
    a.only = [g.strip() for g in a.only.split(",") if g.strip()]
    unknown = [k for k in a.configs if k not in CONFIGS] + [g for g in a.only if g not in GROUPS]
    if unknown or not a.configs or a.files < 4 or a.chains < 2 or a.depth < 1 or a.ingest_files < a.ingest_classes:
        ap.error(f"unknown {unknown} (configs: {', '.join(CONFIGS)}; groups: {', '.join(GROUPS)}), --files < 4, "
                 "--chains < 2, --depth < 1 or fewer --ingest-files than --ingest-classes")
    try:
        check_workdir(a.workdir)
    except BenchError as exc:
        ap.error(str(exc))
    work = Path(tempfile.mkdtemp(prefix="stripefs-bench-meta-", dir=a.workdir))
    work.chmod(0o755)  # the throwaway PostgreSQL server's user must reach its directory
    bench = MetaBench(a, work)
    started = _dt.datetime.now().isoformat(timespec="seconds")

    def finish(total_s: float) -> int:
        text, rows = report(bench.results, a, total_s)
        print(text)
        write_results({"benchmark": "meta", "when": started, "commit": git_commit(), "host": socket.gethostname(),
                       "cpus": os.cpu_count(), "args": vars(a), "caches_dropped": bench.cold_ok,
                       "total_s": round(total_s, 1), "rows": rows, "results": bench.results}, a.json)
        below = [r for r in rows if r["pass"] is False]
        return 2 if a.strict and below else 0

    return supervise(bench, finish, keep=a.keep)


if __name__ == "__main__":
    sys.exit(main())
