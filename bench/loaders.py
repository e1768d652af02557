"""PyTorch side of the DataLoader benchmark: the datasets a training job would
use, and one epoch through a DataLoader with every sample checked.

- ImageTree: an ImageFolder-style tree indexed by hand (class = folder name,
  sorted; samples sorted by name), no torchvision. ``paths[i]`` is the
  absolute path of sample i (what stripefs.torch.PrefetchSampler is given).
  mode "raw" reads the bytes only (the stress test: the filesystem is all
  there is); mode "decode" opens the file the way torchvision's pil_loader
  does, converts to RGB and resizes to 224x224 (a training transform).
- TarShards: an IterableDataset streaming ~64 MiB tar shards with the stdlib
  tarfile module; worker i of n reads shards i, i+n, ... in a seeded order.

Raw samples travel to the main process as one uint8 tensor per batch (plus
index, length and xxh3-64 of each sample), the way a loader ships tensors;
the main process checks every length and checksum against the manifest.
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

    def __init__(self, root: Path, mode: str):
        if mode not in ("raw", "decode"):
            raise ValueError(f"mode must be raw or decode, not {mode!r}")
        self.root, self.mode = Path(root), mode
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
            return i, len(data), _signed64(xxhash.xxh3_64_intdigest(data)), data
        with open(path, "rb") as f:  # torchvision.datasets.folder.pil_loader
            img = Image.open(f)
            img = img.convert("RGB")
        img = img.resize(DECODE_SIZE, Image.Resampling.BILINEAR)
        pixels = torch.frombuffer(bytearray(img.tobytes()), dtype=torch.uint8).view(DECODE_SIZE[1], DECODE_SIZE[0], 3)
        return i, self.targets[i], pixels


class TarShards(IterableDataset):
    """Streams every member of every shard; yields what ImageTree raw does."""

    def __init__(self, shard_dir: Path, index: dict[str, int], seed: int):
        self.shards = sorted(str(p) for p in Path(shard_dir).glob("*.tar"))
        self.index, self.seed = index, seed

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
                    yield self.index[member.name], len(data), _signed64(xxhash.xxh3_64_intdigest(data)), data


def collate_raw(batch):
    """(indices, lengths, hashes, one uint8 tensor of every sample's bytes)."""
    total = sum(n for _, n, _, _ in batch)
    buf = bytearray(total)
    o = 0
    for _, n, _, data in batch:
        buf[o:o + n] = data
        o += n
    return (torch.tensor([b[0] for b in batch]), torch.tensor([b[1] for b in batch]),
            torch.tensor([b[2] for b in batch], dtype=torch.int64), torch.frombuffer(buf, dtype=torch.uint8))


def make_loader(ds, *, seed: int, batch_size: int, workers: int, sampler=None):
    kw = dict(batch_size=batch_size, num_workers=workers, persistent_workers=False)
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


def run_epoch(loader, rels: list[str], manifest: dict[str, tuple[int, int]], mode: str) -> dict:
    """Iterate the loader once; every sample checked; returns samples and bytes.

    Raises ValueError on a wrong length or checksum, a sample seen twice or
    one never seen (the caller turns it into a benchmark failure)."""
    seen = bytearray(len(rels))
    nbytes = 0
    bad: list[str] = []
    for batch in loader:
        if mode == "raw":
            idx, lens, hashes, data = batch
            if int(lens.sum()) != data.numel():
                raise ValueError(f"batch carries {data.numel()} bytes, its lengths add up to {int(lens.sum())}")
            for i, n, h in zip(idx.tolist(), lens.tolist(), hashes.tolist()):
                size, digest = manifest[rels[i]]
                if n != size or h != _signed64(digest):
                    bad.append(f"{rels[i]} (read {n} bytes, expected {size}{'' if n != size else ', checksum differs'})")
                seen[i] += 1
                nbytes += n
        else:
            idx, _target, pixels = batch
            if tuple(pixels.shape[1:]) != (DECODE_SIZE[1], DECODE_SIZE[0], 3):
                raise ValueError(f"decoded batch has shape {tuple(pixels.shape)}")
            for i in idx.tolist():
                seen[i] += 1
                nbytes += manifest[rels[i]][0]
    if bad:
        raise ValueError(f"DATA MISMATCH in {len(bad)} samples, e.g. " + ", ".join(bad[:5]))
    dup = [rels[i] for i, c in enumerate(seen) if c > 1]
    missing = [rels[i] for i, c in enumerate(seen) if c == 0]
    if dup or missing:
        raise ValueError(f"epoch saw {len(dup)} samples twice and missed {len(missing)}, e.g. "
                         + ", ".join((dup + missing)[:5]))
    return {"samples": len(rels), "bytes": nbytes}
