"""A tree of small files, the shape of an image data set: copied in with the
real `cp -r` plus `sync`, indexed the way torchvision's ImageFolder does,
removed with the real `rm -rf`. Each is what a user does with a data set on
a filesystem, and each costs a metadata operation or more per file.

- ``make_source``: FILES files of random bytes (100-120 KiB, ~110 KiB like a
  JPEG of the DataLoader benchmark) in CLASSES folders, on the local disk,
  synced (the timed `sync` must not flush it), with a manifest (size, xxh3).
- ``ingest``: `cp -r SRC DST` then `sync -f DST` (the filesystem of DST),
  both timed: the data set is on the target's disk when it returns.
- ``verify``: the copy, file by file, against the manifest (not timed).
- ``index_walk``: ImageFolder's index (find_classes + make_dataset):
  scandir of the root keeping folders, then per class folder isdir() and a
  scandir keeping entries whose is_file() holds; the list is checked after.
- ``remove``: `rm -rf DST`, timed; DST must be gone.
- ``requests``: a mount's FUSE requests by opcode and its requests to the cluster by type
  (bench/meta.py prints them per file for each stripefs walk).
"""

from __future__ import annotations

import os
import random
import resource
import time
import urllib.request
from pathlib import Path

import xxhash
from common import KiB, BenchError, syncfs


def make_source(root: Path, files: int, classes: int, seed: int = 15) -> dict[str, tuple[int, int]]:
    """The tree under root; its manifest {"cNNN/img_NNNNNN.bin": (size, xxh3_64)}."""
    rng = random.Random(seed)
    manifest = {}
    for i in range(files):
        rel = f"c{i % classes:03d}/img_{i:06d}.bin"
        data = os.urandom(rng.randint(100 * KiB, 120 * KiB))
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        manifest[rel] = (len(data), xxhash.xxh3_64_intdigest(data))
    syncfs(root)
    return manifest


#: ``settle``: longer than the mount's idle commit (50 ms) and write-back (100 ms) bounds together
SETTLE_WAIT_S = 0.5


def ingest(children, src: Path, dst: Path, timeout: float) -> float:
    """Seconds for `cp -r src dst` and `sync -f dst`."""
    t = time.perf_counter()
    children.run(["cp", "-r", str(src), str(dst)], timeout)
    children.run(["sync", "-f", str(dst)], timeout)
    return time.perf_counter() - t


def settle(root: Path, wait_s: float = SETTLE_WAIT_S) -> None:
    """Untimed, after ``ingest``: whatever the copy left for later is done. ``sync -f`` does not reach
    a FUSE mount (the kernel sends no SYNCFS but to virtiofs), so a stripefs mount may still hold
    files in its write-back (client/write_back.py: committed within 100 ms of their close, or 50 ms
    after their last write, client/idle_commits.py); after ``wait_s`` an fsync of every directory
    of the copy (FSYNCDIR) sends what is left. The CPU figure read after it then counts every file's
    whole path to the nodes and the daemon (issue 31's "CPU per 110 KiB file ingested")."""
    time.sleep(wait_s)
    dirs = [root] + [Path(e.path) for e in os.scandir(root) if e.is_dir(follow_symlinks=False)]
    for d in dirs:
        fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def children_cpu() -> float:
    """CPU seconds (user + system) of this process's waited-for children so far: ``cp`` and ``sync``
    (the kernel's work on their side of the mount included; a stripefs cluster's processes are not
    children: `stripefs local up` starts them detached)."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def verify(root: Path, manifest: dict[str, tuple[int, int]]) -> None:
    listed = sorted(f"{d.name}/{f.name}" for d in os.scandir(root) for f in os.scandir(d.path))
    if listed != sorted(manifest):
        raise BenchError(f"{root}: {len(listed)} files listed, {len(manifest)} copied (or other names)")
    for rel, (size, digest) in manifest.items():
        with open(root / rel, "rb", buffering=0) as f:
            data = f.read()
        if len(data) != size or xxhash.xxh3_64_intdigest(data) != digest:
            raise BenchError(f"{root / rel}: {len(data):,} bytes that differ from the {size:,} copied")


def index_walk(root: Path) -> tuple[list[str], float]:
    """ImageFolder's index of root: (the samples "class/name", seconds)."""
    t = time.perf_counter()
    with os.scandir(root) as it:
        classes = sorted(e.name for e in it if e.is_dir())
    samples = []
    for c in classes:
        d = os.path.join(root, c)
        if not os.path.isdir(d):
            continue
        with os.scandir(d) as it:
            samples.extend(f"{c}/{e.name}" for e in it if e.is_file())
    s = time.perf_counter() - t
    return sorted(samples), s


def requests(metrics: str) -> dict[str, float]:
    """A mount's counts from its Prometheus endpoint (``host:port`` or a URL): every FUSE request its
    session read, by opcode ("fuse:OPCODE"), and its requests to the cluster, by type ("rpc:TYPE")."""
    url = metrics if metrics.startswith("http") else f"http://{metrics}/metrics"
    with urllib.request.urlopen(url, timeout=10) as rsp:
        text = rsp.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("stripefs_fuse_requests_total{"):
            key = "fuse:" + line.split('opcode="', 1)[1].split('"', 1)[0]
        elif line.startswith("stripefs_rpc_seconds_count{") and 'type="' in line:
            key = "rpc:" + line.split('type="', 1)[1].split('"', 1)[0]
        else:
            continue
        out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def remove(children, dst: Path, timeout: float) -> float:
    t = time.perf_counter()
    children.run(["rm", "-rf", str(dst)], timeout)
    s = time.perf_counter() - t
    if os.path.lexists(dst):
        raise BenchError(f"{dst} still exists after rm -rf")
    return s
