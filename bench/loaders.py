"""PyTorch side of the DataLoader benchmark: the datasets a training job would
use, and one epoch through a DataLoader.

- ImageTree: an ImageFolder-style tree indexed by hand (class = folder name,
  sorted; samples sorted by name), no torchvision. ``paths[i]`` is the
  absolute path of sample i (what stripefs.torch.PrefetchSampler is given).
  mode "raw" reads the bytes only (the stress test: the filesystem is all
  there is); mode "decode" opens the file the way torchvision's pil_loader
  does, converts to RGB and resizes to 224x224 (a training transform).
- TarShards: an IterableDataset streaming ~64 MiB tar shards with the stdlib
  tarfile module; worker i of n reads shards i, i+n, ... in a seeded order.

Timed epochs are minimal: a raw sample is one ``open(path, "rb").read()`` (or
the dataset's ``reader``) in a worker, which hands back only its index and
length; nothing else is done per sample, and the main process only keeps the
batches. What an epoch saw (every sample once, every length right) is checked
after it, outside the timing (``run_epoch`` returns the check). Checksums are
verified by a separate, untimed epoch (``verify=True``: the worker hashes
each sample with xxh3 and the main process compares with the manifest).
Loaders keep their workers across epochs (``persistent_workers``), as a
training job does.
"""

from __future__ import annotations

import os
import random
import tarfile
import warnings
from pathlib import Path

import xxhash

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")  # torch imports fine without numpy
import torch  # noqa: E402
from PIL import Image  # noqa: E402
from torch.utils.data import DataLoader, IterableDataset, RandomSampler, get_worker_info  # noqa: E402

DECODE_SIZE = (224, 224)


def _signed64(h: int) -> int:
    return h - (1 << 64) if h >= 1 << 63 else h


class ImageTree:
    """Map-style dataset over ROOT/<class>/<file>.jpg."""

    def __init__(self, root: Path, mode: str, verify: bool = False):
        if mode not in ("raw", "decode"):
            raise ValueError(f"mode must be raw or decode, not {mode!r}")
        self.root, self.mode, self.verify = Path(root), mode, verify
        self.classes = sorted(e.name for e in os.scandir(self.root) if e.is_dir())
        self.rels: list[str] = []
        self.targets: list[int] = []
        for c, name in enumerate(self.classes):
            for f in sorted(os.listdir(self.root / name)):
                if f.endswith(".jpg"):
                    self.rels.append(f"{name}/{f}")
                    self.targets.append(c)
        self.paths = [self.root / r for r in self.rels]
        self.reader = None  # raw mode: a function path -> bytes instead of open+read (stripefs.torch.read_file)

    def __len__(self) -> int:
        return len(self.rels)

    def __getitem__(self, i: int):
        path = self.paths[i]
        if self.mode == "raw":
            if self.reader is not None:
                data = self.reader(path)
            else:
                with open(path, "rb", buffering=0) as f:
                    data = f.read()
            if self.verify:
                return i, len(data), _signed64(xxhash.xxh3_64_intdigest(data))
            return i, len(data)
        with open(path, "rb") as f:  # torchvision.datasets.folder.pil_loader
            img = Image.open(f)
            img = img.convert("RGB")
        img = img.resize(DECODE_SIZE, Image.Resampling.BILINEAR)
        pixels = torch.frombuffer(bytearray(img.tobytes()), dtype=torch.uint8).view(DECODE_SIZE[1], DECODE_SIZE[0], 3)
        return i, self.targets[i], pixels


class TarShards(IterableDataset):
    """Streams every member of every shard; yields what ImageTree raw does."""

    def __init__(self, shard_dir: Path, index: dict[str, int], seed: int, verify: bool = False):
        self.shards = sorted(str(p) for p in Path(shard_dir).glob("*.tar"))
        self.index, self.seed, self.verify = index, seed, verify

    def __iter__(self):
        info = get_worker_info()
        wid, n = (info.id, info.num_workers) if info else (0, 1)
        order = list(self.shards)
        random.Random(self.seed).shuffle(order)
        for shard in order[wid::n]:
            with tarfile.open(shard, mode="r|", bufsize=1 << 20) as tf:
                for member in tf:
                    if not member.isfile():
                        continue
                    data = tf.extractfile(member).read()
                    if self.verify:
                        yield self.index[member.name], len(data), _signed64(xxhash.xxh3_64_intdigest(data))
                    else:
                        yield self.index[member.name], len(data)


def collate_raw(batch):
    """A batch of raw samples as the workers made them: a list of (index, length[, xxh3]) tuples."""
    return batch


def make_loader(ds, *, seed: int, batch_size: int, workers: int, sampler=None, persistent: bool = True):
    kw = dict(batch_size=batch_size, num_workers=workers, persistent_workers=persistent and workers > 0)
    if workers:
        kw["multiprocessing_context"] = "fork"
    if isinstance(ds, IterableDataset):
        return DataLoader(ds, collate_fn=collate_raw, **kw)
    if sampler is None:
        sampler = RandomSampler(ds, generator=torch.Generator().manual_seed(seed))
    collate = collate_raw if ds.mode == "raw" else None
    return DataLoader(ds, sampler=sampler, collate_fn=collate, **kw)


def random_sampler(ds, seed: int):
    return RandomSampler(ds, generator=torch.Generator().manual_seed(seed))


def run_epoch(loader, rels: list[str], manifest: dict[str, tuple[int, int]], mode: str):
    """Iterate the loader once, keeping only what identifies each sample.

    Returns ({"samples", "bytes"}, check): check() raises ValueError on a
    wrong length or checksum (when the workers hashed), a sample seen twice
    or one never seen; call it after the timing (the caller turns it into a
    benchmark failure)."""
    kept = []
    if mode == "raw":
        for batch in loader:
            kept.append(batch)
    else:
        for idx, _target, pixels in loader:
            kept.append((idx, tuple(pixels.shape)))  # the pixels are dropped at once
    nbytes = 0
    if mode == "raw":
        nbytes = sum(s[1] for batch in kept for s in batch)
    else:
        nbytes = sum(manifest[rels[i]][0] for idx, _ in kept for i in idx.tolist())

    def check() -> None:
        seen = bytearray(len(rels))
        bad: list[str] = []
        for batch in kept:
            if mode == "raw":
                for sample in batch:
                    i, n = sample[0], sample[1]
                    size, digest = manifest[rels[i]]
                    if n != size or (len(sample) > 2 and sample[2] != _signed64(digest)):
                        bad.append(f"{rels[i]} (read {n} bytes, expected {size}"
                                   f"{'' if n != size else ', checksum differs'})")
                    seen[i] += 1
            else:
                idx, shape = batch
                if shape[1:] != (DECODE_SIZE[1], DECODE_SIZE[0], 3):
                    raise ValueError(f"decoded batch has shape {shape}")
                for i in idx.tolist():
                    seen[i] += 1
        if bad:
            raise ValueError(f"DATA MISMATCH in {len(bad)} samples, e.g. " + ", ".join(bad[:5]))
        dup = [rels[i] for i, c in enumerate(seen) if c > 1]
        missing = [rels[i] for i, c in enumerate(seen) if c == 0]
        if dup or missing:
            raise ValueError(f"epoch saw {len(dup)} samples twice and missed {len(missing)}, e.g. "
                             + ", ".join((dup + missing)[:5]))

    return {"samples": len(rels), "bytes": nbytes}, check
