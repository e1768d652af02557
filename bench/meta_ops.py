"""Namespace operations one at a time, one thread per client root, all roots
at once: the rates a single-threaded program (a `cp`, a `tar x`, a training
script writing its outputs) gets, and with two roots on two mounts, what two
clients get together.

Per root, in this order (names precomputed outside the timing, so both sides
time the syscalls and little Python):

    create       N empty files (open O_CREAT|O_EXCL, close) in 4 directories
    stat         every file, dentries and inodes dropped first (drop_caches 2):
                 on the mount every stat is a LOOKUP at the metadata daemon
    stat warm    every file again: what the kernel's caches answer
    readdir warm scandir of the 4 directories, passes repeated for at least
                 READDIR_MIN_S after one untimed pass (which checks the names)
    rename       every file into the next directory under a new name
    unlink       every renamed file
    mkdir        N directories, then rmdir of each
    mkdir -p     CHAINS chains of DEPTH directories with os.makedirs (each
                 level a stat then a mkdir); dirs/s; every leaf checked after
    stat written N files of WRITTEN_BYTES written and closed (untimed), then a
                 stat of each (issue 31: answered by the writer's mount)

``cpu`` (a function returning cumulative CPU seconds by process) is read
around the create phase: CPU per create of the metadata daemon and the mount.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Callable

from stripefs import page_cache

from common import BenchError, progress

DIRS = 4
READDIR_MIN_S = 0.5
OPS = ("create", "stat", "stat warm", "readdir warm", "rename", "unlink", "mkdir", "rmdir", "mkdir -p", "stat written")
WRITTEN_BYTES = 4096  # stat written: each file gets this much, written and closed just before (untimed)


def _drop_dentries() -> None:
    try:  # dentries and inodes: FUSE forgets them, the next stat is a LOOKUP (once no test keeps them)
        page_cache.drop("2", note=progress, sync=False)
    except OSError as exc:
        progress(f"WARNING: cannot drop dentries ({exc}): stat rates are kernel cache hits")


def at_once(roots: list, fn: Callable[..., int]) -> tuple[int, float]:
    """fn(root) in one thread per root, started together: (sum of what they return, seconds to the last end)."""
    counts, errors = [], []

    def work(root: Path) -> None:
        try:
            counts.append(fn(root))
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(r,)) for r in roots]
    t = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    elapsed = time.perf_counter() - t
    if errors:
        raise BenchError(f"{errors[0]!r}")
    return sum(counts), elapsed


def _names(root: Path, n: int, fmt: str, shift: int = 0) -> list[str]:
    return [os.fspath(root / f"d{(i + shift) % DIRS}" / fmt.format(i)) for i in range(n)]


def _loop(op: Callable[[object], object], args: list) -> int:
    for arg in args:
        op(arg)
    return len(args)


def _create(name: str) -> None:
    os.close(os.open(name, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))


def _write_small(name: str) -> None:
    with open(name, "wb") as f:
        f.write(b"w" * WRITTEN_BYTES)


def _rename(pair: tuple[str, str]) -> None:
    os.rename(*pair)


def _readdir(root: Path, n: int) -> int:
    dirs = [os.fspath(root / f"d{k}") for k in range(DIRS)]
    for k, d in enumerate(dirs):  # the untimed pass: every name there, nothing else
        names = sorted(e.name for e in os.scandir(d))
        if names != sorted(f"f{i:06d}" for i in range(k, n, DIRS)):
            raise BenchError(f"{d} lists {len(names)} entries, not the {len(range(k, n, DIRS))} files created")
    count, t = 0, time.perf_counter()
    while time.perf_counter() - t < READDIR_MIN_S:
        for d in dirs:
            with os.scandir(d) as it:
                for _ in it:
                    count += 1
    return count


def _chains(root: Path, chains: int, depth: int) -> list[str]:
    return [os.fspath(root / "p" / f"c{i:04d}" / "/".join(f"l{k}" for k in range(1, depth))) for i in range(chains)]


def creates_in(roots: list[Path], n: int) -> tuple[int, float]:
    """n files created in each of ``roots`` (existing directories), a thread per root, at once:
    (files, seconds to the last end)."""
    names = {r: [os.fspath(r / f"f{i:06d}") for i in range(n)] for r in roots}
    return at_once(roots, lambda r: _loop(_create, names[r]))


def run_ops(roots: list[Path], n: int, chains: int, depth: int, cpu: Callable[[], dict[str, float]],
            phase: Callable[[str], None] = lambda _: None) -> tuple[dict[str, float], dict[str, float]]:
    """Every operation of OPS on n files per root: (ops/s of all roots together by op, CPU s by process in create)."""
    for r in roots:
        for k in range(DIRS):
            (r / f"d{k}").mkdir(parents=True)
        (r / "p").mkdir()
    per_root = max(chains // len(roots), 1)
    files = {r: _names(r, n, "f{:06d}") for r in roots}
    renamed = {r: _names(r, n, "r{:06d}", shift=1) for r in roots}
    moves = {r: list(zip(files[r], renamed[r])) for r in roots}
    made = {r: _names(r, n, "m{:06d}") for r in roots}
    leaves = {r: _chains(r, per_root, depth) for r in roots}
    written = {r: _names(r, n, "w{:06d}") for r in roots}
    work = {
        "create": lambda r: _loop(_create, files[r]),
        "stat": lambda r: _loop(os.stat, files[r]),
        "stat warm": lambda r: _loop(os.stat, files[r]),
        "readdir warm": lambda r: _readdir(r, n),
        "rename": lambda r: _loop(_rename, moves[r]),
        "unlink": lambda r: _loop(os.unlink, renamed[r]),
        "mkdir": lambda r: _loop(os.mkdir, made[r]),
        "rmdir": lambda r: _loop(os.rmdir, made[r]),
        "mkdir -p": lambda r: _loop(os.makedirs, leaves[r]) * depth,
        "stat written": lambda r: _loop(os.stat, written[r]),
    }
    rates, cpu_create = {}, {}
    for op in OPS:
        phase(op)
        if op == "stat":
            _drop_dentries()
        if op == "stat written":
            at_once(roots, lambda r: _loop(_write_small, written[r]))
        before = cpu() if op == "create" else None
        count, s = at_once(roots, work[op])
        if before is not None:
            after = cpu()
            cpu_create = {k: round(after[k] - before[k], 4) for k in after}
        rates[op] = count / s
    for r in roots:
        missing = [p for p in leaves[r] if not os.path.isdir(p)]
        if missing:
            raise BenchError(f"mkdir -p: {len(missing)} of {len(leaves[r])} chains lack their leaf, e.g. {missing[0]}")
    return rates, cpu_create
