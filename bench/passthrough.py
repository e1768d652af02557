#!/usr/bin/env python3
"""A data set warm in disk_cache_dir, read with the page cache dropped: passthrough (root) against
the default mount's disk cache and against the local disk, in one run, as ratios (issue 29's row
"a data set larger than the page cache, warm in disk_cache_dir, root mount (passthrough) >= 0.7x").

    .venv/bin/python bench/passthrough.py            # make bench runs this
    .venv/bin/python bench/passthrough.py --quick    # a smoke run

"Larger than the page cache" is emulated: this machine's memory holds the data set, so every
timed epoch starts with sync + drop_caches (the page cache, dentries and inodes), on both sides,
and the mounts' memory chunk cache is cut to 16 MiB (cache_size), so neither the kernel nor the
mount holds the bytes and each read comes from the local disk: the disk cache's files
(stripefs) or the data set's files (local). Both are on the same file system (--workdir).

Per file size (--sets): N files written through a plain mount and onto the local disk. Then per
mode, a fresh mount (`local down`/`up`) with ``disk_cache_dir`` and:

* ``passthrough``: -o passthrough (root): warmed until an epoch sends no READ (the first epoch
  reads from the nodes and fills the disk cache, whole files are written in the background, the
  next opens check and register them);
* ``disk cache``: the default mount, no passthrough: warmed by one epoch (chunk entries written
  in the background), so each timed read is a READ the mount answers from a chunk entry.

Timed: ``--rounds`` rounds of (stripefs epoch, local epoch), each after drop_caches, shuffled
order, ``--readers`` threads each doing ``open(p, "rb", buffering=0).read()`` per file (the raw
DataLoader's read); the ratio is the local epoch's time over the stripefs one's in the same
round. Printed: best..worst of the rounds, the FUSE requests per file of the stripefs epochs
(stripefs_fuse_requests_total), and the load. Every byte is checked after the timed rounds.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import random
import tempfile
import time
import urllib.request
from pathlib import Path

from stripefs import page_cache

from common import BenchError, Cluster, check_workdir, proc_cpu, progress

#: what drop_caches drops before each timed epoch (--drop): 3, pages, dentries and inodes; 1, pages only
DROP = "3"


def drop_caches() -> None:
    page_cache.drop(DROP, note=progress)  # synced first, once no test keeps the caches (stripefs/page_cache.py)

GOAL = 0.7
GOAL_ROW = "passthrough"


def _requests(cluster: Cluster, name: str = "stripefs_fuse_requests_total", label: str = "opcode") -> dict[str, float]:
    """A counter of the mount by one label: by default the FUSE requests it read, by opcode."""
    from prometheus_client.parser import text_string_to_metric_families

    url = cluster.metrics["mount"]
    url = url if url.startswith("http") else f"http://{url}/metrics"
    with urllib.request.urlopen(url, timeout=10) as rsp:
        text = rsp.read().decode()
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name:
                out[s.labels[label]] = out.get(s.labels[label], 0) + s.value
    return out


def _rpcs(cluster: Cluster) -> dict[str, float]:
    """Requests the mount sent to the cluster (daemon and nodes), by message type."""
    return _requests(cluster, "stripefs_rpc_seconds_count", "type")


def _epoch(paths: list[Path], readers: int, seed: int) -> tuple[float, int]:
    """Seconds to read every file once (shuffled, ``readers`` threads), and the bytes read."""
    order = paths[:]
    random.Random(seed).shuffle(order)

    def read(p: Path) -> int:
        with open(p, "rb", buffering=0) as f:
            return len(f.read())

    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(readers) as pool:
        total = sum(pool.map(read, order, chunksize=8))
    return time.perf_counter() - started, total


def _whole_files(cache_dir: Path) -> int:
    return sum(1 for p in cache_dir.rglob("*.w.*") if not p.name.startswith("."))


class Bench:
    def __init__(self, args):
        self.args = args
        self.work = Path(tempfile.mkdtemp(prefix="stripefs-passthrough-", dir=args.workdir))
        self.state, self.mnt = self.work / "state", self.work / "mnt"
        self.cluster = Cluster(self.state, self.mnt, nodes=args.nodes)
        self.rows: list[dict] = []
        self.profiles: list[str] = []

    def config(self, cache_dir: Path, passthrough: bool) -> list[str]:
        from stripefs.common import config as cfg
        import msgspec

        toml = self.work / f"client-{cache_dir.name}.toml"
        toml.write_text(cfg.dumps(msgspec.structs.replace(cfg.ClientConfig(), cache_size=cfg.Size(16 << 20))))
        opts = f"config={toml},disk_cache_dir={cache_dir}"
        return [opts + (",passthrough" if passthrough else "")]

    def run(self) -> None:
        args = self.args
        self.mnt.mkdir()
        self.cluster.up()
        sets = []
        for spec in args.sets.split(","):
            count, size = spec.split("x")
            count, size = int(count), int(float(size[:-1]) * (1 << 10 if size.endswith("K") else 1 << 20))
            name = f"{count} x {size >> 10} KiB"
            local = self.work / "local" / f"{count}x{size}"
            local.mkdir(parents=True)
            theirs = self.mnt / f"{count}x{size}"
            theirs.mkdir()
            rnd = random.Random(size)
            for i in range(count):
                data = rnd.randbytes(size - (i % 7) * 100)
                (local / f"{i:05d}.bin").write_bytes(data)
                (theirs / f"{i:05d}.bin").write_bytes(data)
            sets.append((name, count, local, f"{count}x{size}"))
            progress(f"{name}: written through the mount and to the local disk")
        os.sync()
        modes = [m for m in (("passthrough", True), ("disk cache", False)) if m[0] in args.modes.split(",")]
        for mode, passthrough in modes:
            cache_dir = self.work / f"nvme-{'pt' if passthrough else 'dc'}"
            cache_dir.mkdir()
            self.cluster.down()
            self.cluster.options = self.config(cache_dir, passthrough)
            self.cluster.up()
            for name, count, local, sub in sets:
                self.measure(mode, passthrough, name, count, local, self.mnt / sub, cache_dir)

    def warm(self, passthrough: bool, paths: list[Path], cache_dir: Path) -> int:
        """Epochs until the mode's steady state: passthrough, until an epoch after drop_caches sends
        no READ; the disk cache, one epoch and its background writes. How many epochs."""
        epochs = 0
        while True:
            drop_caches()
            before = _requests(self.cluster)
            _epoch(paths, self.args.readers, seed=epochs)
            epochs += 1
            reads = _requests(self.cluster).get("read", 0) - before.get("read", 0)
            if not passthrough:
                time.sleep(2.0)  # the chunk entries are written in the background
                return epochs
            if reads == 0:
                return epochs
            if epochs >= 6:
                raise BenchError(f"passthrough: still {reads:.0f} READs in warm epoch {epochs} "
                                 f"({_whole_files(cache_dir)} whole files of {len(paths)})")
            # whole files are written in the background (at most ASSEMBLE_QUEUE waiting): until they stop coming
            seen, deadline = -1, time.monotonic() + 60
            while (n := _whole_files(cache_dir)) != seen and n < len(paths) and time.monotonic() < deadline:
                seen = n
                time.sleep(1.0)

    def measure(self, mode: str, passthrough: bool, name: str, count: int, local: Path, theirs: Path,
                cache_dir: Path) -> None:
        args = self.args
        paths = sorted(theirs.iterdir())
        local_paths = sorted(local.iterdir())
        warm_epochs = self.warm(passthrough, paths, cache_dir)
        ours, locals_, ratios, sent, rpcs, cpu = [], [], [], {}, {}, 0.0
        mount_pid = self.cluster.pids["mount"]
        for r in range(args.rounds):
            drop_caches()
            before, rpc_before, cpu_before = _requests(self.cluster), _rpcs(self.cluster), proc_cpu(mount_pid)
            t, total = _epoch(paths, args.readers, seed=100 + r)
            after, rpc_after = _requests(self.cluster), _rpcs(self.cluster)
            cpu += proc_cpu(mount_pid) - cpu_before
            for op, n in after.items():
                sent[op] = sent.get(op, 0) + n - before.get(op, 0)
            for op, n in rpc_after.items():
                rpcs[op] = rpcs.get(op, 0) + n - rpc_before.get(op, 0)
            drop_caches()
            t_local, total_local = _epoch(local_paths, args.readers, seed=100 + r)
            if total != total_local:
                raise BenchError(f"{mode} {name}: read {total} bytes, the local disk {total_local}")
            ours.append(total / t)
            locals_.append(total_local / t_local)
            ratios.append(t_local / t)
        if args.profile:
            self.profile(mode, name, paths)
        for p, q in zip(paths, local_paths):
            if p.read_bytes() != q.read_bytes():
                raise BenchError(f"{mode}: {p} differs from {q}")
        per_file = {op: n / (count * args.rounds) for op, n in sorted(sent.items()) if n}
        rpc_per_file = {op: n / (count * args.rounds) for op, n in sorted(rpcs.items()) if n}
        row = {"mode": mode, "set": name, "ratios": ratios, "stripefs_MiBps": [b / (1 << 20) for b in ours],
               "local_MiBps": [b / (1 << 20) for b in locals_], "requests_per_file": per_file,
               "rpcs_per_file": rpc_per_file, "mount_cpu_us_per_file": cpu / (count * args.rounds) * 1e6,
               "warm_epochs": warm_epochs, "load": os.getloadavg()[0]}
        self.rows.append(row)
        progress(f"{mode:12} {name}: {min(ratios):.2f}x..{max(ratios):.2f}x the local disk, "
                 f"requests per file {per_file}")

    def profile(self, mode: str, name: str, paths: list[Path]) -> None:
        """One more epoch (untimed) with py-spy on the mount: where its CPU per file goes."""
        import shutil
        import sys

        import profiling

        exe = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
        prefix = Path(__file__).resolve().parent / "results" / f"passthrough-profile-{mode.replace(' ', '-')}"
        drop_caches()
        with profiling.Recorder(exe, {"mount": self.cluster.pids["mount"]}, prefix, gil=True) as rec:
            t, _ = _epoch(paths, self.args.readers, seed=999)
        path, why = rec.results["mount"]
        if path is None:
            progress(f"profile: {why}")
            return
        prof = profiling.summarise(path, t)
        prof.update(process="mount", epoch="warm (page cache dropped)", workload=f"{mode} {name}")
        self.profiles.extend(profiling.format_summary("mount", prof))

    def report(self) -> None:
        dropped = "page cache, dentries and inodes" if DROP == "3" else "page cache (dentries and inodes kept)"
        print(f"\nA data set warm in disk_cache_dir, {dropped} dropped before every epoch (emulating a data set "
              f"larger than the page cache on this {os.sysconf('SC_PHYS_PAGES') * os.sysconf('SC_PAGE_SIZE') >> 30}"
              f" GiB machine: drop_caches={DROP}), {self.args.readers} readers, {self.args.rounds} rounds; load now "
              f"{os.getloadavg()[0]:.1f} (1 min), {os.cpu_count()} cpus")
        print(f"{'mode':13} {'files':18} {'stripefs MiB/s':>16} {'local MiB/s':>16} {'ratio (range)':>16}  "
              f"FUSE requests per file")
        for row in self.rows:
            s, l, rt = row["stripefs_MiBps"], row["local_MiBps"], row["ratios"]
            reqs = ", ".join(f"{op.upper()} {n:.2f}" for op, n in row["requests_per_file"].items()) or "none"
            print(f"{row['mode']:13} {row['set']:18} {f'{min(s):.0f}..{max(s):.0f}':>16} "
                  f"{f'{min(l):.0f}..{max(l):.0f}':>16} {f'{min(rt):.2f}..{max(rt):.2f}x':>16}  {reqs}")
        print("per file, the stripefs epochs: mount CPU and requests to the cluster")
        for row in self.rows:
            rpcs = ", ".join(f"{op} {n:.2f}" for op, n in row["rpcs_per_file"].items()) or "none"
            print(f"  {row['mode']:13} {row['set']:18} {row['mount_cpu_us_per_file']:.0f} us; {rpcs}")
        for line in self.profiles:
            print(line)
        for row in self.rows:
            if row["mode"] == GOAL_ROW:
                verdict = "PASS" if min(row["ratios"]) >= GOAL else "BELOW"
                print(f"goal: {row['set']} warm in disk_cache_dir, root mount (passthrough) >= {GOAL}x the local "
                      f"disk: {min(row['ratios']):.2f}..{max(row['ratios']):.2f}x  {verdict}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sets", default="400x1M,2000x110K",
                    help="comma-separated COUNTxSIZE file sets (SIZE with K or M), default %(default)s")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--readers", type=int, default=2)
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--workdir", default=os.environ.get("BENCH_TMP", "/var/tmp"))
    ap.add_argument("--quick", action="store_true", help="--sets 100x1M,500x110K --rounds 2")
    ap.add_argument("--json", help="also write the rows here")
    ap.add_argument("--modes", default="passthrough,disk cache", help="which of: passthrough,disk cache")
    ap.add_argument("--profile", action="store_true", help="py-spy on the mount during one more epoch per row")
    ap.add_argument("--drop", choices=("1", "3"), default="3",
                    help="drop_caches before each epoch: 3 (default) pages, dentries and inodes, as a cold cache; "
                         "1, pages only, as memory pressure on a data set larger than the page cache does first")
    args = ap.parse_args()
    global DROP
    DROP = args.drop
    if args.quick:
        args.sets, args.rounds = "100x1M,500x110K", 2
    if os.geteuid() != 0:
        print("passthrough needs root (and drop_caches too): skipped")
        return 0
    check_workdir(args.workdir)
    bench = Bench(args)
    try:
        bench.run()
        bench.report()
        if args.json:
            Path(args.json).write_text(json.dumps(bench.rows, indent=1) + "\n")
    except BenchError as exc:
        print(f"BENCHMARK FAILED: {exc}")
        for line in bench.cluster.log_problems():
            print("  ", line)
        return 1
    finally:
        bench.cluster.teardown()
        import shutil

        if not os.path.ismount(bench.mnt):
            shutil.rmtree(bench.work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
