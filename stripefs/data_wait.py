"""Is my GPU starving? A training loop's own wait for data, measured where it happens.

``watch(loader)`` wraps a DataLoader (or any iterable of batches) and yields
exactly what it yields. Per step it measures two things:

* **data wait**: how long the loop was blocked asking for the next batch;
* **compute**: the rest of the step, from receiving a batch to asking for the
  next one.

With CUDA (torch importable, a GPU initialised) the loop's wall time says
little: kernels run asynchronously, so the loop asks for the next batch while
the GPU still computes, and a wall-clock "wait" overlaps GPU work. There the
wait is measured on the GPU instead, with two CUDA events per step on the
current stream: one recorded when the loop asks for the next batch (after
the step's kernels were queued), one when the batch arrives. The second
completes when the stream reaches it, so the time between the two events is
exactly the time the GPU sat idle waiting for data: ``max(0, batch arrival -
end of the step's kernels)``. Events are read back without blocking (a step
or two later), never synchronising the stream.

Every ``report_every`` seconds (and at the end) the figures go to the mount
the data comes from, so ``stripefs top`` can join them with what the mount
did for this job's reads (client/jobs.py). The channel is a ``getxattr`` whose
*name* carries the figures (``protocol.encode_job_report``): it needs only
read permission on the data, unlike ``setxattr``, and the kernel never caches
it. Outside a stripefs mount nothing is sent.

Cost: two ``perf_counter`` calls and a few additions per step without CUDA
(bench/data_wait.py measures it: the goal is under 20 us a step).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Iterable, Iterator, TypeVar

from .common import protocol as _p
from .prefetch_control import MountRoots

log = logging.getLogger(__name__)

T = TypeVar("T")

#: seconds between reports to the mount
REPORT_EVERY_S = 1.0


@dataclass
class DataWait:
    """A loop's figures so far (seconds, cumulative)."""

    steps: int = 0
    wait_s: float = 0.0  # blocked asking for the next batch (GPU idle for it, with CUDA)
    compute_s: float = 0.0  # the rest of the steps
    gpu: bool = False  # wait measured on the GPU (CUDA events)
    _pending: list = field(default_factory=list, repr=False)  # (start event, end event, wall wait) not read yet

    @property
    def wait_share(self) -> float | None:
        """The share of step time spent waiting for data; None before the first step."""
        total = self.wait_s + self.compute_s
        return self.wait_s / total if total > 0 else None


class _CudaClock:
    """Data wait measured as GPU idle time between two events (module docstring)."""

    def __init__(self, torch) -> None:
        self.cuda = torch.cuda

    def mark(self):
        event = self.cuda.Event(enable_timing=True)
        event.record()
        return event

    @staticmethod
    def settle(figures: DataWait, *, block: bool = False) -> None:
        """Move finished event pairs into ``figures``: the GPU-idle part of each wall wait."""
        still = []
        for start, end, wall in figures._pending:
            if block:
                end.synchronize()
            if not end.query():
                still.append((start, end, wall))
                continue
            idle = max(0.0, start.elapsed_time(end) / 1000.0)
            figures.wait_s += idle
            figures.compute_s += max(0.0, wall - idle)  # the wall wait the GPU spent computing
        figures._pending = still


def _cuda_clock(cuda: bool | None) -> _CudaClock | None:
    if cuda is False:
        return None
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available() or (cuda is None and not torch.cuda.is_initialized()):
        return None
    return _CudaClock(torch)


class _Reporter:
    """Sends a loop's figures to the mount holding ``path`` (nothing outside stripefs)."""

    def __init__(self, path: str | os.PathLike | None, name: str) -> None:
        self.root: bytes | None = None
        if path is not None:
            absolute = os.fsencode(os.path.abspath(path))
            roots = MountRoots()
            self.root = roots.of(absolute if os.path.isdir(absolute) else os.path.dirname(absolute))
        self.name = name
        self.last = time.perf_counter()

    def send(self, figures: DataWait, *, done: bool = False) -> None:
        self.last = time.perf_counter()
        if self.root is None:
            return
        name = _p.encode_job_report(self.name, figures.steps, figures.wait_s, figures.compute_s, figures.gpu, done)
        try:
            os.getxattr(self.root, name)
        except OSError as exc:  # an older mount (ENODATA), a mount going away: the loop goes on
            log.debug("data wait report to %s: %s", self.root, exc)


def _dataset_path(batches) -> str | None:
    """Where a DataLoader's data lives, if it says (torchvision datasets have ``root``)."""
    dataset = getattr(batches, "dataset", None)
    root = getattr(dataset, "root", None)
    return root if isinstance(root, (str, os.PathLike)) else None


def watch(batches: Iterable[T], mount: str | os.PathLike | None = None, *, name: str = "",
          figures: DataWait | None = None, cuda: bool | None = None, report_every: float = REPORT_EVERY_S) -> Iterator[T]:
    """Yield what ``batches`` yields, measuring the loop's data wait per step (module docstring).

    ``mount``: a path on the stripefs mount the data comes from (default: the dataset's ``root``,
    if it has one); ``name``: how ``stripefs top`` shows the job (default: the command line);
    ``figures``: a DataWait to fill (the caller may read it while the loop runs); ``cuda``: None
    measures on the GPU when CUDA is initialised, False never, True whenever it is available.
    """
    figures = figures if figures is not None else DataWait()
    clock = _cuda_clock(cuda)
    figures.gpu = clock is not None
    reporter = _Reporter(mount if mount is not None else _dataset_path(batches), name)
    reporter.send(figures)  # at once: the mount counts the workers' requests for the job from the first one
    perf = time.perf_counter
    iterator = iter(batches)
    received = None  # when the previous batch arrived
    try:
        while True:
            asked = perf()
            if received is not None and clock is None:
                figures.compute_s += asked - received
            start = clock.mark() if clock is not None else None
            try:
                batch = next(iterator)
            except StopIteration:
                return
            received = perf()
            figures.steps += 1
            if clock is None:
                figures.wait_s += received - asked
            else:
                figures._pending.append((start, clock.mark(), received - asked))
                if received - reporter.last >= report_every:
                    clock.settle(figures)
            if received - reporter.last >= report_every:
                reporter.send(figures)
            yield batch
            if clock is not None:  # the step's wall time that was not spent waiting: its CPU side
                figures.compute_s += perf() - received
    finally:
        if clock is not None:
            clock.settle(figures, block=True)
        reporter.send(figures, done=True)
