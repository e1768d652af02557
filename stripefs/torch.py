"""Sampler-order prefetch for PyTorch DataLoaders reading from a stripefs mount.

A training job knows the exact order it will read files in this epoch: the
sampler's. ``PrefetchSampler`` wraps any sampler and, as the DataLoader draws
indices, tells the mount which files come next; the mount fetches them ahead
of the workers (all of them at once: the mount is shared) and pushes them into
the kernel's page cache, so the workers' open+read is answered by the kernel.

    from torch.utils.data import DataLoader, RandomSampler
    from stripefs.torch import PrefetchSampler

    sampler = PrefetchSampler(RandomSampler(dataset), paths=dataset.paths, lookahead=1024)
    loader = DataLoader(dataset, batch_size=32, sampler=sampler, num_workers=2)

``paths[i]`` is the file sample ``i`` reads. Nothing here imports torch: any
object with ``__iter__`` and ``__len__`` is a sampler to a DataLoader. Paths
outside a stripefs mount are simply not announced. The mount is told through
an extended attribute of its root (stripefs/prefetch_control.py), which needs
write permission on the mount's root directory.
"""

from __future__ import annotations

import logging
import os
from typing import Iterable, Iterator, Sequence

from .prefetch_control import MountRoots, announce, group_by_mount

log = logging.getLogger(__name__)


class PrefetchSampler:
    def __init__(self, sampler: Iterable[int], paths: Sequence[str | os.PathLike], *, lookahead: int = 1024, batch: int = 128):
        """Wrap ``sampler``; announce ``paths`` of the next ``lookahead`` samples, ``batch`` at a time."""
        self.sampler = sampler
        self.paths = paths
        self.lookahead = lookahead
        self.batch = max(1, batch)
        self._roots = MountRoots()
        self._disabled = False

    def __len__(self) -> int:
        return len(self.sampler)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[int]:
        order = list(self.sampler)  # this epoch's order, decided up front as the sampler would
        announced = 0
        for i, index in enumerate(order):
            if announced < min(len(order), i + self.lookahead):
                upto = min(len(order), max(i + self.lookahead, announced + self.batch))
                self.announce(order[announced:upto])
                announced = upto
            yield index

    def announce(self, indices: Sequence[int]) -> None:
        """Tell the mount(s) these samples come next, in this order."""
        if self._disabled:
            return
        for root, relative in group_by_mount((self.paths[i] for i in indices), self._roots).items():
            try:
                announce(root, relative)
            except OSError as exc:
                self._disabled = True
                log.warning("stripefs prefetch disabled: cannot tell the mount at %s (%s)", os.fsdecode(root), exc.strerror)
