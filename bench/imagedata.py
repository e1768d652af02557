"""The DataLoader benchmark's dataset, generated once and cached.

An ImageFolder-style tree ``tree/class_NNN/img_KKKKKK.jpg`` of real JPEG files
(500x375 RGB, quality 90: a gradient blended with noise whose strength varies
per image, which lands at ~110 KiB per file, the size of an average ImageNet
sample), sample k in class k % classes; and the same samples, in a seeded
shuffled order, packed into ~64 MiB tar shards ``shards/shard-NNNNNN.tar``
whose member names are the tree's relative paths (WebDataset's layout).

``manifest.json`` maps every relative path to its size and xxh3-64, so every
sample a DataLoader reads, through the mount or from the local disk, is
checked. The cache directory is keyed by every parameter and by GEN_VERSION
(bump it when the generator changes); it is written under a temporary name
and renamed when complete, so an interrupted generation is never reused.
"""

from __future__ import annotations

import io
import json
import os
import random
import shutil
import signal
import sys
import tarfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from multiprocessing import Pool
from pathlib import Path

import xxhash

GEN_VERSION = 1
WIDTH, HEIGHT, QUALITY = 500, 375, 90
NOISE = (0.30, 0.45)  # blend weight of the noise: ~99..118 KiB per file at quality 90

#: set by the benchmark's supervisor (Ctrl-C, timeout): generation and copies stop at the next file
cancel = threading.Event()


def _progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class Bar:
    """A one-line progress bar on stderr (a plain line every 10% when stderr is not a terminal)."""

    def __init__(self, label: str, total: int):
        self.label, self.total, self.done = label, max(total, 1), 0
        self.t0 = time.monotonic()
        self.tty = sys.stderr.isatty()
        self.shown = -1

    def add(self, n: int = 1) -> None:
        if cancel.is_set():
            raise InterruptedError(f"{self.label}: cancelled")
        self.done += n
        pct = self.done * 100 // self.total
        if self.tty:
            if pct != self.shown:
                fill = pct // 4
                print(f"\r  {self.label} [{'#' * fill}{'.' * (25 - fill)}] {pct:3d}% {self.done}/{self.total}",
                      end="", file=sys.stderr, flush=True)
        elif pct // 10 != self.shown // 10:
            _progress(f"  {self.label}: {pct}% ({self.done}/{self.total})")
        self.shown = pct

    def close(self) -> None:
        if self.tty:
            print(file=sys.stderr)
        _progress(f"  {self.label}: {self.done}/{self.total} in {time.monotonic() - self.t0:.1f}s")


def jpeg_bytes(seed: int) -> bytes:
    """One deterministic ~110 KiB JPEG."""
    from PIL import Image

    rnd = random.Random(seed)
    w, h = (WIDTH, HEIGHT) if rnd.random() < 0.75 else (HEIGHT, WIDTH)
    grad = Image.linear_gradient("L").rotate(rnd.randrange(360)).resize((w, h))
    radial = Image.radial_gradient("L").resize((w, h))
    base = Image.merge("RGB", (grad, radial, grad.transpose(Image.Transpose.FLIP_LEFT_RIGHT)))
    noise = Image.frombytes("RGB", (w, h), rnd.randbytes(w * h * 3))
    img = Image.blend(base, noise, rnd.uniform(*NOISE))
    out = io.BytesIO()
    img.save(out, "JPEG", quality=QUALITY)
    return out.getvalue()


def _default_signals() -> None:
    """In a pool worker: SIGTERM and SIGINT end it again. It is forked from the benchmark, whose
    handlers (bench/common.py supervise) it inherits; Pool.terminate() then waited forever."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _make_one(job: tuple[str, str, int]) -> tuple[str, int, int]:
    tree, rel, seed = job
    data = jpeg_bytes(seed)
    with open(os.path.join(tree, rel), "wb") as f:
        f.write(data)
    return rel, len(data), xxhash.xxh3_64_intdigest(data)


def rel_path(k: int, classes: int) -> str:
    return f"class_{k % classes:03d}/img_{k:06d}.jpg"


def ensure(cache_root: Path, files: int, classes: int, shard_bytes: int, seed: int) -> Path:
    """The cache directory of this dataset, generated if it is not there yet."""
    key = f"jpeg-v{GEN_VERSION}-{files}f-{classes}c-{shard_bytes >> 20}m-s{seed}"
    final = cache_root / key
    if (final / "manifest.json").exists():
        _progress(f"dataset: cached in {final}")
        return final
    cache_root.mkdir(parents=True, exist_ok=True)
    for stale in cache_root.glob(f"{key}.tmp-*"):  # left by an interrupted run
        if not Path(f"/proc/{stale.name.rsplit('-', 1)[1]}").exists():
            shutil.rmtree(stale, ignore_errors=True)
    tmp = cache_root / f"{key}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tree = tmp / "tree"
        for c in range(classes):
            (tree / f"class_{c:03d}").mkdir(parents=True)
        jobs = [(str(tree), rel_path(k, classes), seed * 1_000_003 + k) for k in range(files)]
        manifest: dict[str, list[int]] = {}
        bar = Bar(f"generating {files:,} JPEG files", files)
        with Pool(os.cpu_count() or 1, initializer=_default_signals) as pool:
            for rel, size, digest in pool.imap_unordered(_make_one, jobs, chunksize=32):
                manifest[rel] = [size, digest]
                bar.add()
        bar.close()
        _pack_shards(tree, tmp / "shards", sorted(manifest), manifest, shard_bytes, seed)
        (tmp / "manifest.json").write_text(json.dumps({"version": GEN_VERSION, "files": manifest}))
        tmp.rename(final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    total = sum(s for s, _ in manifest.values())
    _progress(f"dataset: {files:,} files, {total / files / 1024:.0f} KiB average, in {final}")
    return final


def _pack_shards(tree: Path, out: Path, rels: list[str], manifest: dict, shard_bytes: int, seed: int) -> None:
    order = list(rels)
    random.Random(seed).shuffle(order)  # a shard mixes classes, as a real shard writer does
    out.mkdir()
    bar = Bar("packing tar shards", len(order))
    n, tf, size = 0, None, 0
    for rel in order:
        if tf is None or size >= shard_bytes:
            if tf is not None:
                tf.close()
            tf = tarfile.open(out / f"shard-{n:06d}.tar", "w", format=tarfile.USTAR_FORMAT)
            n, size = n + 1, 0
        data = (tree / rel).read_bytes()
        info = tarfile.TarInfo(rel)
        info.size, info.mode, info.mtime = len(data), 0o644, 0
        tf.addfile(info, io.BytesIO(data))
        size += 512 + (len(data) + 511) // 512 * 512
        bar.add()
    if tf is not None:
        tf.close()
    bar.close()


def load_manifest(cache: Path) -> dict[str, tuple[int, int]]:
    doc = json.loads((cache / "manifest.json").read_text())
    return {rel: (size, digest) for rel, (size, digest) in doc["files"].items()}


def copy_tree(src: Path, dst: Path, label: str, threads: int = 4) -> int:
    """Copy every file under src to dst (created), in parallel: a few writers
    overlap the mount's round trips. Content only (no utime/chmod). Returns bytes."""
    files = [p for p in src.rglob("*") if p.is_file()]
    for d in sorted({p.parent for p in files}):
        (dst / d.relative_to(src)).mkdir(parents=True, exist_ok=True)
    bar = Bar(label, len(files))

    def one(p: Path) -> int:
        data = p.read_bytes()
        with open(dst / p.relative_to(src), "wb") as f:
            f.write(data)
        return len(data)

    total = 0
    with ThreadPoolExecutor(threads) as ex:
        for n in ex.map(one, files):
            total += n
            bar.add()
    bar.close()
    return total
