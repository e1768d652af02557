"""Metadata rates through the mount: create, stat, rename and unlink, with the
metadata in SQLite, in PostgreSQL behind one daemon, and in PostgreSQL behind
two daemons with two clients (two mounts, one per daemon, working at once),
each beside the local disk doing the same operations with as many threads in
the same run. Figures are ratios to the local disk (higher is better; the local
disk is far ahead: every stripefs operation is a network round trip and a
durable database commit).

Each configuration: a fresh `stripefs local` cluster (2 storage nodes; the
PostgreSQL server is the throwaway one of `--meta-store postgresql`), then per
client thread FILES/THREADS empty files created in its own directories, the
dentry and inode caches dropped (stat must ask the metadata daemon), every file
stat'ed, stat'ed again (warm: what the kernel caches), renamed into another
directory, unlinked; then as many directories made and removed.

    python bench/meta.py [--files 2000] [--configs sqlite,pg1,pg2] [--workdir /var/tmp]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, BenchError, Cluster, check_workdir, git_commit, progress, write_results  # noqa: E402

OPS = ("create", "stat", "stat warm", "rename", "unlink", "mkdir", "rmdir")
DIRS_PER_CLIENT = 4
CONFIGS = {
    "sqlite": ("SQLite, 1 daemon, 1 client", [], 1),
    "pg1": ("PostgreSQL, 1 daemon, 1 client", ["--meta-store", "postgresql"], 1),
    "pg2": ("PostgreSQL, 2 daemons, 2 clients", ["--meta-store", "postgresql", "--metas", "2"], 2),
}


def _drop_dentries() -> None:
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("2\n")  # dentries and inodes: FUSE forgets them, the next stat is a LOOKUP
    except OSError as exc:
        progress(f"WARNING: cannot drop dentries ({exc}): stat rates are kernel cache hits")


def _phase(roots: list[Path], n: int, op: str) -> float:
    """Run ``op`` on n files under each root, one thread per root, at once; operations per second (all threads)."""
    errors: list[BaseException] = []

    def work(root: Path) -> None:
        try:
            for i in range(n):
                d = root / f"d{i % DIRS_PER_CLIENT}"
                name = f"f{i:06d}"
                if op == "create":
                    os.close(os.open(d / name, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
                elif op in ("stat", "stat warm"):
                    os.stat(d / name)
                elif op == "mkdir":
                    os.mkdir(d / f"m{i:06d}")
                elif op == "rmdir":
                    os.rmdir(d / f"m{i:06d}")
                elif op == "rename":
                    os.rename(d / name, root / f"d{(i + 1) % DIRS_PER_CLIENT}" / f"r{i:06d}")
                else:
                    os.unlink(root / f"d{(i + 1) % DIRS_PER_CLIENT}" / f"r{i:06d}")
        except BaseException as exc:  # reported by the caller
            errors.append(exc)

    if op == "stat":
        _drop_dentries()
    threads = [threading.Thread(target=work, args=(r,)) for r in roots]
    t = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    elapsed = time.perf_counter() - t
    if errors:
        raise BenchError(f"{op} failed: {errors[0]!r}")
    return n * len(roots) / elapsed


def _run_ops(roots: list[Path], n: int) -> dict[str, float]:
    for r in roots:
        for k in range(DIRS_PER_CLIENT):
            (r / f"d{k}").mkdir(parents=True)
    return {op: _phase(roots, n, op) for op in OPS}


def _measure(key: str, work: Path, files: int) -> dict:
    label, up_args, clients = CONFIGS[key]
    per_client = files // clients
    local_roots = [work / f"local-{key}-{c}" for c in range(clients)]
    progress(f"{label}: local disk, {clients} thread(s), {per_client} files each")
    local = _run_ops(local_roots, per_client)
    for r in local_roots:
        shutil.rmtree(r)
    state, mnt = work / f"state-{key}", work / f"mnt-{key}"
    cluster = Cluster(state, mnt, nodes=2)
    cluster.up_args = up_args
    extra: list[Path] = []
    try:
        progress(f"{label}: starting the cluster")
        cluster.up()
        roots = [mnt / "c0"]
        if clients == 2:
            second = work / f"mnt-{key}-2"
            second.mkdir()
            addresses = _meta_addresses(state)
            subprocess.run(cluster.cli + ["mount", addresses[1], str(second), "--log", str(state / "logs" / "mount-2.log")],
                           check=True, capture_output=True, timeout=120)
            extra.append(second)
            roots.append(second / "c1")
        progress(f"{label}: stripefs, {clients} client(s), {per_client} files each")
        fs = _run_ops(roots, per_client)
    finally:
        for m in extra:
            subprocess.run(["fusermount3", "-u", "-z", str(m)], capture_output=True)
        cluster.teardown()
    problems = cluster.log_problems()
    return {"label": label, "files": per_client * clients, "clients": clients, "local_ops_s": local,
            "stripefs_ops_s": fs, "ratio": {op: fs[op] / local[op] for op in OPS}, "log_problems": problems}


def _meta_addresses(state: Path) -> list[str]:
    import json

    info = json.loads((state / "cluster.json").read_text())
    return [f"tcp://127.0.0.1:{p}" for p in info.get("meta_ports", [info["meta_port"]])]


def _report(results: dict) -> str:
    lines = ["", "metadata rates through the mount (ops/s; ratio = stripefs / local disk, same run, same threads)", ""]
    lines.append(f"{'configuration':36}" + "".join(f"{op:>20}" for op in OPS))
    for r in results.values():
        cells = "".join(f"{r['stripefs_ops_s'][op]:>8,.0f} ({r['ratio'][op]:.3f}x)".rjust(20) for op in OPS)
        lines.append(f"{r['label']:36}{cells}")
        lines.append(f"{'  local disk, same threads':36}" + "".join(f"{r['local_ops_s'][op]:>20,.0f}" for op in OPS))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", type=int, default=2000, help="files per configuration, all clients together (default 2000)")
    ap.add_argument("--configs", default="sqlite,pg1,pg2", help="which of sqlite, pg1, pg2 (default all)")
    ap.add_argument("--workdir", default="/var/tmp", help="a real disk for the clusters and the local side (default /var/tmp)")
    ap.add_argument("--json", default=str(RESULTS / "meta.json"), help="results file (default bench/results/meta.json)")
    a = ap.parse_args(argv)
    keys = [k.strip() for k in a.configs.split(",") if k.strip()]
    unknown = [k for k in keys if k not in CONFIGS]
    if unknown or a.files < 2:
        ap.error(f"unknown config {unknown} (choose from {', '.join(CONFIGS)}) or --files < 2")
    try:
        check_workdir(a.workdir)
    except BenchError as exc:
        ap.error(str(exc))
    work = Path(tempfile.mkdtemp(prefix="stripefs-bench-meta-", dir=a.workdir))
    work.chmod(0o755)  # the throwaway PostgreSQL server's user must reach its directory
    results = {}
    try:
        for key in keys:
            results[key] = _measure(key, work, a.files)
    except BenchError as exc:
        print(f"\nBENCHMARK FAILED: {exc}", file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(_report(results))
    write_results({"benchmark": "meta", "commit": git_commit(), "results": results}, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
