#!/usr/bin/env python3
"""Cold tier benchmark: migration and recall throughput beside a plain boto3 copy of the same
bytes to the same S3 endpoint, in one run (docs/tiering.md).

    make bench                         # runs bench/run.py, bench/ec.py, this, bench/dataloader.py
    .venv/bin/python bench/tier.py     # 128 MiB: 3 files of 32 MiB and 256 of 128 KiB
    .venv/bin/python bench/tier.py --mib 32 --small 64

On a fresh ``stripefs local up --tier s3`` cluster (4 nodes, replicas=2, 4 MiB
chunks, moto's S3 server on loopback):

1. write the files (large ones and small ones) into the mount;
2. ``stripefs tier migrate -r`` (read from the nodes, upload, verify, release):
   MB/s of file data;
3. ``stripefs tier recall -r`` (download, verify, write to the nodes): MB/s;
4. migrate again, drop caches, read every file through the mount (the
   recall a reader triggers, chunk by chunk): MB/s;
5. the yardstick: the same bytes, cut into the same chunks, PUT with boto3
   from this process to the same endpoint, ``tier_parallelism`` (4) at a
   time, then GET back: MB/s each way.

Figures are ratios against the plain copy measured minutes apart in the same
run (machines here are shared and noisy). Results: bench/results/tier.json.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from stripefs import page_cache

BENCH = Path(__file__).resolve().parent
MiB = 1 << 20
CHUNK = 4 * MiB
PARALLEL = 4  # the daemon's tier_parallelism default


def cli(*args: str, timeout: float = 900) -> str:
    res = subprocess.run([sys.executable, "-m", "stripefs", *args], capture_output=True, text=True, timeout=timeout,
                         stdin=subprocess.DEVNULL)
    if res.returncode:
        raise SystemExit(f"stripefs {' '.join(args)} failed (rc {res.returncode}): {(res.stderr or res.stdout).strip()}")
    return res.stdout


def drop_caches() -> None:
    try:
        page_cache.drop("3")  # synced first, once no test keeps the caches (stripefs/page_cache.py)
    except OSError:
        print("WARNING: cannot drop caches (not root): the read-triggered recall may be served by the page cache",
              file=sys.stderr)


def timed(fn) -> float:
    t = time.monotonic()
    fn()
    return time.monotonic() - t


def plain_copy(endpoint: str, files: dict[Path, bytes]) -> tuple[float, float]:
    """Seconds to PUT, then GET, every chunk of every file with boto3, PARALLEL at a time."""
    import boto3
    from botocore.config import Config

    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")  # moto takes any keys
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                      config=Config(max_pool_connections=PARALLEL * 2, s3={"addressing_style": "path"}))
    bucket = "stripefs-bench-plain"
    s3.create_bucket(Bucket=bucket)
    pieces = [(f"plain/{i}/{off}", data[off : off + CHUNK]) for i, data in enumerate(files.values())
              for off in range(0, len(data), CHUNK)]

    def put(item):
        s3.put_object(Bucket=bucket, Key=item[0], Body=item[1])

    def get(item):
        assert s3.get_object(Bucket=bucket, Key=item[0])["Body"].read() == item[1]

    with ThreadPoolExecutor(PARALLEL) as pool:
        put_s = timed(lambda: list(pool.map(put, pieces)))
        get_s = timed(lambda: list(pool.map(get, pieces)))
    return put_s, get_s


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=96, help="MiB in large files of 32 MiB (default: %(default)s)")
    ap.add_argument("--small", type=int, default=256, help="small files of 128 KiB (default: %(default)s)")
    ap.add_argument("--keep", action="store_true", help="leave the cluster's directory behind")
    a = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="stripefs-bench-tier-"))
    state, mnt = root / "state", root / "mnt"
    print("starting a local cluster with a local S3 server ...", file=sys.stderr)
    cli("local", "up", "--dir", str(state), "--mount", str(mnt), "--nodes", "4", "--tier", "s3",
        "--set", "meta.chunk_size=4M", "--set", "meta.tier_bandwidth=0")
    try:
        info = json.loads((state / "cluster.json").read_text())
        endpoint = f"http://127.0.0.1:{info['s3']['port']}"
        d = mnt / "data"
        d.mkdir()
        files: dict[Path, bytes] = {}
        rnd = random.Random(1)
        for i in range(max(0, a.mib // 32)):
            files[d / f"large-{i}"] = rnd.randbytes(32 * MiB)
        for i in range(a.small):
            files[d / f"small-{i:04d}"] = rnd.randbytes(128 << 10)
        total = sum(len(v) for v in files.values())
        for path, data in files.items():
            path.write_bytes(data)
        os.sync()
        print(f"{len(files)} files, {total / MiB:.0f} MiB written", file=sys.stderr)

        migrate_s = timed(lambda: cli("tier", "migrate", "-r", str(d), "--to", "cold", "--dir", str(state)))
        recall_s = timed(lambda: cli("tier", "recall", "-r", str(d), "--dir", str(state)))
        cli("tier", "migrate", "-r", str(d), "--to", "cold", "--dir", str(state))
        drop_caches()

        def read_all():
            for path, data in files.items():
                if hashlib.md5(path.read_bytes()).digest() != hashlib.md5(data).digest():
                    raise SystemExit(f"{path}: read back different bytes")

        read_s = timed(read_all)
        put_s, get_s = plain_copy(endpoint, files)
        mbs = lambda s: total / s / 1e6  # noqa: E731
        result = {
            "files": len(files), "bytes": total, "chunk_size": CHUNK, "parallel": PARALLEL,
            "migrate_mb_s": round(mbs(migrate_s), 1), "recall_mb_s": round(mbs(recall_s), 1),
            "recall_by_read_mb_s": round(mbs(read_s), 1),
            "plain_put_mb_s": round(mbs(put_s), 1), "plain_get_mb_s": round(mbs(get_s), 1),
            "migrate_vs_plain_put": round(put_s / migrate_s, 2), "recall_vs_plain_get": round(get_s / recall_s, 2),
            "recall_by_read_vs_plain_get": round(get_s / read_s, 2),
        }
        print(f"\ncold tier, {len(files)} files, {total / MiB:.0f} MiB, moto on loopback, {PARALLEL} in parallel:")
        print(f"  {'':<28} {'MB/s':>8} {'vs plain boto3':>15}")
        print(f"  {'plain boto3 PUT':<28} {result['plain_put_mb_s']:>8} {'1.00':>15}")
        print(f"  {'tier migrate -r':<28} {result['migrate_mb_s']:>8} {result['migrate_vs_plain_put']:>15}")
        print(f"  {'plain boto3 GET':<28} {result['plain_get_mb_s']:>8} {'1.00':>15}")
        print(f"  {'tier recall -r':<28} {result['recall_mb_s']:>8} {result['recall_vs_plain_get']:>15}")
        print(f"  {'recall by reading (cold)':<28} {result['recall_by_read_mb_s']:>8} {result['recall_by_read_vs_plain_get']:>15}")
        out = BENCH / "results"
        out.mkdir(exist_ok=True)
        (out / "tier.json").write_text(json.dumps(result, indent=1) + "\n")
        return 0
    finally:
        subprocess.run([sys.executable, "-m", "stripefs", "local", "down", "--dir", str(state)], capture_output=True)
        if not a.keep:
            subprocess.run(["rm", "-rf", str(root)])


if __name__ == "__main__":
    sys.exit(main())
