#!/usr/bin/env python3
"""Model-based random tester of the data path: real mounts of a real local cluster.

A seeded random sequence of operations on a few files is run through a real
FUSE mount; every file has an in-memory model (a ``bytearray``) and every read
(``pread``, a read through ``mmap``, a whole-file read through a *second* mount
after close) is compared with it. Operations, with their rates
(``OPS`` below): ``pwrite`` at random offsets and sizes (unaligned, across
chunk and stripe boundaries, beyond EOF leaving holes), ``pread``,
``ftruncate`` up and down, ``mmap`` writes followed by ``msync`` and
``munmap`` and ``mmap`` reads (within the current size, page-aligned map
offset), ``os.copy_file_range`` within a file (non-overlapping) and between
files, ``fsync``, close and reopen, ``O_APPEND`` appends through a second
descriptor, an open with ``O_TRUNC``, and close-to-open: the file is closed,
opened through a second mount of the same cluster and read whole. Optionally
a storage node is killed with SIGKILL in the middle of a run and restarted
later (reads must stay right all along: replicas fail over, EC decodes).

Replayable: everything random (operations, offsets, sizes, *data bytes*,
which node is killed) comes from ``random.Random`` seeded by ``--seed``, so
``--seed N --ops M`` with the same flags runs the same sequence again (a bug
that is a race may need a few replays to show). On the first mismatch, or an
operation failing (EIO...), it reports the seed, the operation number, the
operation, the last ~30 operations, where the first wrong byte is (its chunk,
EC stripe, offset in it), whether the wrong bytes are zeros, stale (bytes a
recent operation wrote, or truncated away, at that place) or misplaced, and
the command line that replays it; the CLI then exits 1. It also fails on an
ERROR line in its cluster's logs (``--allow-log REGEX`` excuses one).

Where it lives: this file is the engine (``Engine``, ``Target``) and the CLI.
The ``make test`` run, ``tests/cluster/test_datapath_model.py``, puts
``tests/`` on ``sys.path`` and imports it; both start clusters with the
cluster tests' helpers (``tests/cluster/conftest.py``: ``Cluster``,
``cluster_root``, ``run_cli``, i.e. ``stripefs local up``; the CLI puts
``tests/cluster`` on ``sys.path`` for that), 6 storage nodes, a directory
``rep`` (replicas=2, 64 KiB chunks) and ``ec`` (ec=4+2, 64 KiB chunks), a
second mount, short node and request timeouts (``new_cluster``,
``set_up``). The CLI tears its clusters down whatever happens (a failure,
Ctrl-C, SIGTERM) and keeps their logs when something failed.

CLI (``make fuzz`` runs a million operations per layout)::

    .venv/bin/python tests/datapath_model.py --layout ec --mmap off --seed 1 --ops 20000   # a cluster of its own
    .venv/bin/python tests/datapath_model.py --layout both --parallel --mmap both --kill-every 5000 --ops 100000
    .venv/bin/python tests/datapath_model.py ... --checkpoint DIR   # saves each run's state every 10,000 ops
    .venv/bin/python tests/datapath_model.py --resume DIR --parallel  # a run stopped (Ctrl-C, a reboot) goes on

A checkpoint holds the run's random generators, its models and the file the next
operation is on: a resumed run performs exactly the operations the unbroken run
would have (tests/unit/test_datapath_checkpoint.py), on a new cluster, after
writing each file from its model.
    .venv/bin/python tests/datapath_model.py --mount ./mnt/somedir --ops 20000   # a running cluster, that dir's layout
    .venv/bin/python tests/datapath_model.py --local-dir /tmp/x --ops 20000      # the model itself, on a local fs
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import fcntl
import json
import mmap
import os
import pickle
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

KiB = 1 << 10
PAGE = mmap.PAGESIZE
CHUNK = 64 * KiB  # the cluster layouts' chunk size (and the EC fragment size): offsets are drawn near its multiples
FILE_MAX = (256 * KiB, 1024 * KiB, 192 * KiB + 4321)  # per file: the largest offset an operation reaches
IO_MAX = 64 * KiB  # most operations' sizes; some are up to 4x that (a whole EC stripe and more)

# operation kind -> weight (like the sample: 25% writes, 10% copies, 10% mmap writes,
# 10% truncates, the rest reads, plus the extra kinds). Without mmap its kinds are left out; mmap on an empty
# file reads instead.
OPS = {
    "pwrite": 25,
    "copy": 10,
    "mmap_write": 10,
    "truncate": 10,
    "pread": 35,
    "mmap_read": 4,
    "append": 2,
    "fsync": 1,
    "reopen": 0.5,
    "otrunc": 0.3,
    "close_to_open": 0.5,
}
STICKY = 0.85  # the chance that an operation is on the same file as the one before: runs of operations on one
# open file (as one writer does) keep a write session and the client's caches and read-ahead busy


class Mismatch(AssertionError):
    """A read differed from the model, or an operation failed: the message says where and how to replay."""


class Stopped(Exception):
    """Another run failed or the user pressed Ctrl-C: this run stops (and tears down its cluster)."""


@dataclass
class Target:
    """Where the files live and what the engine may do to the cluster.

    ``other_view(path)``: the same file through a second mount (close-to-open
    reads), or None to read through the same path; ``kill(rng)`` kills a
    storage node (returns a description), ``restart()`` starts what is not
    running; ``chunk``: the layout's chunk size, for reports."""

    dir: Path
    other_view: Callable[[Path], Path] | None = None
    kill: Callable[[random.Random], str] | None = None
    restart: Callable[[], None] | None = None
    chunk: int = CHUNK
    stripe: int = 0  # an EC layout's stripe (data fragments x chunk), for reports
    replay: str = ""  # what the CLI needs to replay a run here, besides mmap, seed and counts (e.g. " --layout ec")
    label: str = ""
    snapshot: Callable[[str], Path] | None = None  # ``stripefs snapshot create DIR NAME``: the snapshot's directory
    drop_snapshot: Callable[[str], None] | None = None  # ``stripefs snapshot delete DIR NAME``


@dataclass
class FileState:
    path: Path
    max: int
    model: bytearray = field(default_factory=bytearray)
    fd: int = -1


class Engine:
    """One seeded run over ``nfiles`` files in ``target.dir``.

    ``mmap``: use mmap reads and writes. ``kills``: (kill at op, restart at op) pairs.
    ``progress``: seconds between progress lines (0: none). ``checkpoint``: a file where the run's state
    is saved every ``checkpoint_every`` operations (or as soon after as no node is killed), and at its end (``save``);
    ``restore`` continues a run from one."""

    def __init__(self, target: Target, seed: int, *, use_mmap: bool = True, nfiles: int = 3,
                 kills: list[tuple[int, int]] = (), progress: float = 0.0, history: int = 30, out=sys.stdout,
                 stop: threading.Event | None = None, checkpoint: Path | None = None, checkpoint_every: int = 10000,
                 snapshot_every: int = 0):
        self.t = target
        self.seed = seed
        self.use_mmap = use_mmap
        self.rng = random.Random(seed)  # operations, offsets, sizes, data
        self.kill_rng = random.Random(f"kill-{seed}")  # which node: runs with and without kills draw the same ops
        # snapshots (docs/snapshots.md): every ``snapshot_every`` operations, with a generator of their own (runs
        # with and without snapshots draw the same ops); each is checked against the models as they were then
        self.snapshot_every = snapshot_every if target.snapshot else 0
        self.snap_rng = random.Random(f"snapshot-{seed}")
        self.snapshots: list[tuple[str, Path, dict[int, bytes]]] = []  # (name, its directory, file index -> bytes)
        self.kills = {k: r for k, r in kills}
        self.restarts = {r for _, r in kills}
        self.progress = progress
        self.stop = stop
        self.out = out
        self.recent: collections.deque[str] = collections.deque(maxlen=history)
        # (op, file index, offset, data) of recent writes, and of data cut off by truncates (its old place):
        # a mismatch report says whose bytes were read
        self.writes: collections.deque[tuple[int, int, int, bytes]] = collections.deque(maxlen=300)
        self.copy_sources: dict[int, tuple[int, int]] = {}  # op of a copy in ``writes`` -> (source file, offset)
        self.files = [FileState(target.dir / f"model-{seed}-{i}", FILE_MAX[i % len(FILE_MAX)]) for i in range(nfiles)]
        kinds = [k for k in OPS if use_mmap or not k.startswith("mmap")]
        self.kinds, self.weights = kinds, [OPS[k] for k in kinds]
        self.counts: collections.Counter[str] = collections.Counter()
        self.times: collections.Counter[str] = collections.Counter()  # seconds spent per kind
        self.op = -1
        self.desc = ""
        self.op_began = ""  # wall-clock time the current operation began (as the cluster's logs write it)
        self.checkpoint, self.checkpoint_every = checkpoint, checkpoint_every
        self.start = 0  # the first operation this process runs (0, or where a checkpoint left off)
        self.file_index = 0  # the file the next operation is on (unless it moves): part of a checkpoint
        self.seconds_before = 0.0  # time the run took in earlier processes (resumed from a checkpoint)
        self.segments = 1  # how many processes the run took

    # -- helpers ---------------------------------------------------------------------

    def _print(self, msg: str) -> None:
        print(msg, file=self.out, flush=True)

    def _offset(self, limit: int) -> int:
        """An offset in [0, limit): often within a few bytes of a chunk or page boundary."""
        if limit <= 0:
            return 0
        r = self.rng.random()
        if r < 0.25:
            step = self.t.chunk if r < 0.15 else PAGE
            off = self.rng.randrange(0, limit // step + 1) * step + self.rng.randint(-3, 3)
            return min(max(off, 0), limit - 1)
        return self.rng.randrange(0, limit)

    def _size(self) -> int:
        r = self.rng.random()
        if r < 0.15:
            return self.rng.randint(1, 16)
        if r < 0.9:
            return self.rng.randint(1, IO_MAX)
        return self.rng.randint(IO_MAX, 4 * IO_MAX + 17)

    def _data(self, n: int) -> bytes:
        return self.rng.randbytes(n)

    @staticmethod
    def _put(model: bytearray, off: int, data: bytes) -> None:
        if off > len(model):
            model.extend(bytes(off - len(model)))
        model[off:off + len(data)] = data

    def _open(self, f: FileState, flags: int = 0) -> None:
        f.fd = os.open(f.path, os.O_RDWR | flags)

    def _compare(self, f: FileState, off: int, got: bytes, n: int, how: str, view: Path | None = None) -> None:
        """``got`` (read at ``off``, ``n`` asked) against the model; ``view``: it was read through
        that path of the second mount, not through ``f``."""
        want = bytes(f.model[off:off + n])
        if got == want:
            return
        look = self._second_look(f, off, n, got, want, view)
        if len(got) < len(want):  # stopped early: the size the kernel has, what the mount has past it
            look += "\n" + self._size_look(f, off + len(got), len(want) - len(got))
        self._fail(self._diff(f, off, got, want, how) + "\n" + look)

    def _second_look(self, f: FileState, off: int, n: int, got: bytes, want: bytes, view: Path | None = None) -> str:
        """Where the wrong bytes live (a race that does not replay needs this from the failing run):
        the same read again through the kernel's page cache, then with O_DIRECT (the mount answers:
        its own state), each compared with the model and with the first read; through the second
        mount first when the read was its (``view``): its page cache, then its own state. When the
        first wrong byte was last written by a copy_file_range, the same two reads of the copy's source."""
        out = []
        if view is not None:
            out += [f"  read again through the second mount (a new open, its page cache): {_verdict(_read_path(view, off, n), want, got)}",
                    f"  read with O_DIRECT through the second mount (a new open: that mount's state): {_verdict(_read_direct(view, off, n), want, got)}"]
        out += [f"  read again (the kernel's page cache): {_verdict(_read_cached(f, off, n), want, got)}",
                f"  read with O_DIRECT on the same descriptor (the mount, this handle): {_verdict(_read_direct_fd(f, off, n), want, got)}",
                f"  read with O_DIRECT after a new open (the mount, what it opens now): {_verdict(_read_direct(f.path, off, n), want, got)}"]
        bad = next((k for k in range(min(len(got), len(want))) if got[k] != want[k]), None)
        if bad is None:
            return "\n".join(out)
        pos, i = off + bad, self.files.index(f)
        for op, j, woff, data in reversed(self.writes):
            if j == i and woff <= pos < woff + len(data):
                if op in self.copy_sources:
                    k, src = self.copy_sources[op]
                    g, spos = self.files[k], src + pos - woff
                    length = min(len(data) - (pos - woff), n - bad)
                    swant = bytes(g.model[spos:spos + length])  # the source now (ops since may have changed it)
                    out.append(f"  the first wrong byte was written by op {op}, a copy from f{k} {src:#x}; f{k} at {spos:#x}+{length:#x} now:")
                    out.append(f"    through the page cache: {_verdict(_read_cached(g, spos, length), swant, got[bad:bad + length])}")
                    out.append(f"    with O_DIRECT: {_verdict(_read_direct(g.path, spos, length), swant, got[bad:bad + length])}")
                break
        return "\n".join(out)

    def _size_look(self, f: FileState, off: int, n: int) -> str:
        """For a read or copy that stopped early at ``off``: the size the kernel has for the file
        (fstat: its cached i_size), and what the mount answers past it (O_DIRECT)."""
        want = bytes(f.model[off:off + n])
        try:
            kernel = f"{os.fstat(f.fd).st_size:#x}" if f.fd >= 0 else "not open"
        except OSError as e:
            kernel = repr(e)
        got = _read_direct(f.path, off, n)
        direct = got if isinstance(got, str) else f"{len(got):#x} bytes, {'the model' if got == want else 'not the model'}'s bytes"
        return f"  the file's size for the kernel (fstat): {kernel}; read with O_DIRECT at {off:#x}+{n:#x}: {direct}"

    def _whose(self, f: FileState, pos: int, wrong: bytes) -> str:
        """What the wrong bytes read at ``pos`` are: zeros, or bytes of a recent write (which one, where)."""
        nonzero = sum(1 for b in wrong if b)
        if not nonzero:
            return "zeros"
        if len(wrong) >= 64 and nonzero <= max(4, len(wrong) // 256):
            return f"zeros but for {nonzero} bytes"
        i = self.files.index(f)
        probe = wrong[:32]
        for op, j, off, data in reversed(self.writes):  # the same place first: stale data
            if j == i and off <= pos and pos + len(wrong) <= off + len(data) and data[pos - off:pos - off + len(wrong)] == wrong:
                return f"stale: the bytes op {op} wrote (or truncated away) here"
        for op, j, off, data in reversed(self.writes):
            if j == i and off <= pos and pos + len(probe) <= off + len(data) and data[pos - off:pos - off + len(probe)] == probe:
                return f"partly stale: begins with the bytes op {op} wrote (or truncated away) here"
        if len(probe) >= 8:
            for op, j, off, data in reversed(self.writes):
                at = data.find(probe)
                if at >= 0:
                    return (f"misplaced: the bytes op {op} wrote (or truncated away) at f{j} {off + at:#x} "
                            f"(shift {pos - off - at:+#x})")
            for j, g in enumerate(self.files):
                at = g.model.find(probe)
                if at >= 0:
                    return f"misplaced: f{j}'s current bytes at {at:#x} (shift {pos - at:+#x})"
        return "unknown bytes"

    def _diff(self, f: FileState, off: int, got: bytes, want: bytes, how: str) -> str:
        lines = [f"{how} of {f.path.name} at {off:#x}+{len(want):#x} differs from the model (file size {len(f.model):#x})"]
        if len(got) != len(want):
            lines.append(f"  got {len(got):#x} bytes, expected {len(want):#x}")
        common = min(len(got), len(want))
        bad = [i for i in range(common) if got[i] != want[i]]
        if bad:
            first, last = bad[0], bad[-1]
            pos = off + first
            wrong = [got[i] for i in bad]
            zeros = all(b == 0 for b in wrong)
            lines.append(f"  first differing byte at {pos:#x} (chunk {pos // self.t.chunk}, {pos % self.t.chunk:#x} into it"
                         f"{f'; stripe {pos // self.t.stripe}, {pos % self.t.stripe:#x} into it' if self.t.stripe else ''})"
                         f", last at {off + last:#x}; "
                         f"{len(bad)} bytes differ, the wrong bytes are {'ALL ZEROS' if zeros else 'not all zeros'}"
                         f"{' (' + str(sum(b == 0 for b in wrong)) + ' of them zero)' if not zeros else ''}")
            lines.append(f"  got      {got[first:first + 16].hex(' ')}")
            lines.append(f"  expected {want[first:first + 16].hex(' ')}")
            runs, start = [], bad[0]  # ranges of wrong bytes; a few equal bytes by chance do not split one
            for a, b in zip(bad, bad[1:] + [None]):
                if b is None or b > a + 16:
                    runs.append((start, a + 1))
                    start = b
            lines.append(f"  wrong ranges ({len(runs)}):")
            for s, e in runs[:12]:
                lines.append(f"    {off + s:#x}-{off + e:#x} ({e - s:#x} bytes): {self._whose(f, off + s, got[s:e])}")
            if len(runs) > 12:
                lines.append("    ...")
        elif len(got) < len(want):
            lines.append(f"  short read: the first {len(got):#x} bytes are right, it stops at {off + len(got):#x}")
        return "\n".join(lines)

    def _fail(self, what: str) -> None:
        hist = "\n".join(f"    {line}" for line in self.recent)
        hist += f"\n    {self.op} [{self.op_began}]: {self.desc}, failed at {_clock()}"
        raise Mismatch(
            f"{self.t.label}seed {self.seed}, operation {self.op} ({'mmap on' if self.use_mmap else 'mmap off'}): {self.desc}\n"
            f"{what}\n  last {len(self.recent) + 1} operations (each with the time it began, as the cluster's logs write it; the failing one last):\n{hist}\n"
            f"  replay: .venv/bin/python tests/datapath_model.py{self.t.replay} --mmap {'on' if self.use_mmap else 'off'}"
            f"{f' --files {len(self.files)}' if len(self.files) != 3 else ''} --seed {self.seed} --ops {self.op + 1}"
        )

    # -- operations ------------------------------------------------------------------

    def _do_pwrite(self, f: FileState, i: int) -> str:
        off = self._offset(f.max)
        n = min(self._size(), f.max - off) or 1
        data = self._data(n)
        self.desc = f"pwrite f{i} {off:#x}+{n:#x}" + (f" (hole {len(f.model):#x}-{off:#x})" if off > len(f.model) else "")
        done = os.pwrite(f.fd, data, off)
        if done != n:
            self._fail(f"short write: {done:#x} of {n:#x}")
        self._put(f.model, off, data)
        self.writes.append((self.op, i, off, data))
        return self.desc

    def _do_pread(self, f: FileState, i: int) -> str:
        size = len(f.model)
        off = self._offset(size + 2 * KiB if self.rng.random() < 0.1 else size) if size else 0
        n = self._size()
        self.desc = f"pread f{i} {off:#x}+{n:#x}" + (" (past EOF)" if off + n > size else "")
        got = os.pread(f.fd, n, off)
        self._compare(f, off, got, max(0, min(n, size - off)), "pread")
        return self.desc

    def _do_truncate(self, f: FileState, i: int) -> str:
        size = len(f.model)
        r = self.rng.random()
        new = max(0, size + self.rng.randint(-300, 300)) if r < 0.3 else self._offset(f.max)
        self.desc = f"ftruncate f{i} {size:#x} -> {new:#x}"
        os.ftruncate(f.fd, new)
        if new < size:
            self.writes.append((self.op, i, new, bytes(f.model[new:])))
        del f.model[new:]
        f.model.extend(bytes(new - len(f.model)))
        return self.desc

    def _do_copy(self, f: FileState, i: int) -> str:
        if self.rng.random() < 0.5 and len(self.files) > 1:
            j = self.rng.choice([k for k in range(len(self.files)) if k != i])
        else:
            j = i
        src_f, dst_f = self.files[j], f  # copy from file j into this file
        size = len(src_f.model)
        if not size:
            self.desc = f"copy f{j}->f{i} skipped (f{j} is empty)"
            return self.desc
        src = self._offset(size)
        n = min(self._size(), size - src)
        dst = self._offset(max(1, dst_f.max - n))
        if j == i and dst + n > src and src + n > dst:  # overlapping ranges in one file: undefined, shift past
            dst = src + n if src + 2 * n <= dst_f.max else max(0, src - n)
            if dst + n > src and src + n > dst:
                self.desc = f"copy f{j}->f{i} skipped (no room)"
                return self.desc
        self.desc = f"copy_file_range f{j} {src:#x}+{n:#x} -> f{i} {dst:#x}"
        done = 0
        while done < n:
            c = os.copy_file_range(src_f.fd, dst_f.fd, n - done, src + done, dst + done)
            if c <= 0:
                break
            done += c
        if done != n:
            self._fail(f"copy_file_range copied {done:#x} of {n:#x} bytes (source size {size:#x})\n"
                       + self._size_look(src_f, src + done, n - done))
        data = bytes(src_f.model[src:src + n])
        self._put(dst_f.model, dst, data)
        self.writes.append((self.op, i, dst, data))
        self.copy_sources[self.op] = (j, src)
        if len(self.copy_sources) > 300:
            del self.copy_sources[next(iter(self.copy_sources))]
        return self.desc

    def _map(self, f: FileState, off: int, n: int) -> tuple[mmap.mmap, int]:
        pg = off & ~(PAGE - 1)
        return mmap.mmap(f.fd, off + n - pg, offset=pg), off - pg

    def _do_mmap_write(self, f: FileState, i: int) -> str:
        size = len(f.model)
        off = self._offset(size)
        n = min(self._size(), size - off)
        data = self._data(n)
        self.desc = f"mmap write f{i} {off:#x}+{n:#x}, msync, munmap"
        m, at = self._map(f, off, n)
        try:
            _store_and_msync(m, at, data)
        finally:
            m.close()
        self._put(f.model, off, data)
        self.writes.append((self.op, i, off, data))
        return self.desc

    def _do_mmap_read(self, f: FileState, i: int) -> str:
        size = len(f.model)
        off = self._offset(size)
        n = min(self._size(), size - off)
        self.desc = f"mmap read f{i} {off:#x}+{n:#x}"
        m, at = self._map(f, off, n)
        try:
            got = _load(m, at, n)
        finally:
            m.close()
        self._compare(f, off, got, n, "mmap read")
        return self.desc

    def _do_append(self, f: FileState, i: int) -> str:
        n = min(self._size(), max(1, f.max - len(f.model))) if len(f.model) < f.max else self.rng.randint(1, 100)
        data = self._data(n)
        self.desc = f"open O_APPEND f{i}, append {n:#x} at {len(f.model):#x}, close"
        fd = os.open(f.path, os.O_WRONLY | os.O_APPEND)
        try:
            done = os.write(fd, data)
        finally:
            os.close(fd)
        if done != n:
            self._fail(f"short append: {done:#x} of {n:#x}")
        self.writes.append((self.op, i, len(f.model), data))
        self._put(f.model, len(f.model), data)
        return self.desc

    def _do_fsync(self, f: FileState, i: int) -> str:
        self.desc = f"fsync f{i}"
        os.fsync(f.fd)
        return self.desc

    def _do_reopen(self, f: FileState, i: int) -> str:
        self.desc = f"close f{i}, reopen"
        os.close(f.fd)
        f.fd = -1
        self._open(f)
        return self.desc

    def _do_otrunc(self, f: FileState, i: int) -> str:
        self.desc = f"open f{i} O_TRUNC (size {len(f.model):#x} -> 0), close the old descriptor"
        fd = os.open(f.path, os.O_RDWR | os.O_TRUNC)
        os.close(f.fd)
        f.fd = fd
        self.writes.append((self.op, i, 0, bytes(f.model)))
        del f.model[:]
        return self.desc

    def _do_close_to_open(self, f: FileState, i: int) -> str:
        other = self.t.other_view(f.path) if self.t.other_view else f.path
        self.desc = f"close f{i}, read it whole through {'the second mount' if self.t.other_view else 'the same path'}, reopen"
        os.close(f.fd)
        f.fd = -1
        with open(other, "rb") as g:
            got = g.read()
        self._compare(f, 0, got, len(f.model), "close-to-open read (second mount)", other if self.t.other_view else None)
        self._open(f)
        return self.desc

    # -- snapshots: taken at fixed points, each checked against the models' history ------

    SNAPSHOTS_KEPT = 3

    def _snapshot(self) -> None:
        """fsync every open file (a snapshot holds what is committed), snapshot the directory, check an
        older one (at random) against the models as they were; keep the newest few. A snapshot is read
        first only after the live files changed (a mount keeps what it read: a later read of the same
        snapshot file may come from its caches), through either mount."""
        self.desc = f"snapshot op{self.op}"
        for f in self.files:
            if f.fd >= 0:
                os.fsync(f.fd)
        name = f"op{self.op}"
        taken = {i: bytes(f.model) for i, f in enumerate(self.files)}
        if self.snapshots:
            self._check_snapshot(self.snap_rng.choice(self.snapshots))
        self.snapshots.append((name, self.t.snapshot(name), taken))
        self.recent.append(f"{self.op} [{_clock()}]: -- snapshot {name}")
        if len(self.snapshots) > self.SNAPSHOTS_KEPT:
            self._drop_snapshot(self.snapshots.pop(0))

    def _check_snapshot(self, snap: tuple[str, Path, dict[int, bytes]]) -> None:
        name, where, taken = snap
        if self.t.other_view and self.snap_rng.random() < 0.5:
            where = self.t.other_view(where)
        for i, f in enumerate(self.files):
            with open(where / f.path.name, "rb") as g:
                got = g.read()
            if got != taken[i]:
                bad = next((k for k in range(min(len(got), len(taken[i]))) if got[k] != taken[i][k]), min(len(got), len(taken[i])))
                self._fail(f"snapshot {name} of f{i}: {len(got):#x} bytes read, {len(taken[i]):#x} taken; first difference at "
                           f"{bad:#x} (chunk {bad // self.t.chunk}); now the file has {len(f.model):#x} bytes")

    def _drop_snapshot(self, snap: tuple[str, Path, dict[int, bytes]]) -> None:
        self._check_snapshot(snap)
        self.t.drop_snapshot(snap[0])
        self.recent.append(f"{self.op} [{_clock()}]: -- snapshot {snap[0]} deleted")

    # -- the run ---------------------------------------------------------------------

    def _restart(self, killed: str) -> None:
        t = time.monotonic()
        self.t.restart()
        self.recent.append(f"{self.op} [{_clock()}]: -- restarted ({killed})")
        self._print(f"{self.t.label}op {self.op}: restarted what was killed ({time.monotonic() - t:.1f} s)")
        return None

    def run(self, ops: int) -> dict:
        for f in self.files:
            f.fd = os.open(f.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            if f.model:  # resumed: the file starts as the checkpoint's model of it
                _write_whole(f.fd, f.model)
        t0 = last = time.monotonic()
        last_op, i = self.start, self.file_index
        next_checkpoint = (self.start // self.checkpoint_every + 1) * self.checkpoint_every
        killed = None
        try:
            for self.op in range(self.start, ops):
                if self.stop is not None and self.stop.is_set():
                    raise Stopped(f"{self.t.label}stopped at operation {self.op}")
                if self.checkpoint and self.op >= next_checkpoint and not killed:
                    self.file_index = i
                    self.save(ops, time.monotonic() - t0)
                    next_checkpoint = (self.op // self.checkpoint_every + 1) * self.checkpoint_every
                if self.op in self.kills and self.t.kill:
                    self.desc = "kill a storage node"
                    killed = self.t.kill(self.kill_rng)
                    self.recent.append(f"{self.op} [{_clock()}]: -- {killed}")
                    self._print(f"{self.t.label}op {self.op}: {killed}")
                if self.op in self.restarts and killed:
                    self.desc = "restart the killed node"
                    killed = self._restart(killed)
                if self.snapshot_every and self.op and self.op % self.snapshot_every == 0:
                    self._snapshot()
                if self.op == 0 or self.rng.random() >= STICKY:
                    i = self.rng.randrange(len(self.files))
                f = self.files[i]
                kind = self.rng.choices(self.kinds, self.weights)[0]
                if not f.model and kind in ("mmap_write", "mmap_read"):
                    kind = "pread"  # nothing to map
                self.desc = kind
                t_op, self.op_began = time.monotonic(), _clock()
                try:
                    desc = getattr(self, f"_do_{kind}")(f, i)
                except Mismatch:
                    raise
                except OSError as e:
                    self._fail(f"{kind} failed: {e!r}")
                self.recent.append(f"{self.op} [{self.op_began}]: {desc}")
                self.counts[kind] += 1
                self.times[kind] += time.monotonic() - t_op
                if self.progress and (now := time.monotonic()) - last >= self.progress:
                    rate = (self.op + 1 - last_op) / (now - last)
                    self._print(f"{self.t.label}seed {self.seed}: {self.op + 1}/{ops} ops, {rate:.0f} ops/s, "
                                f"sizes {', '.join(f'{len(g.model) // KiB}K' for g in self.files)}")
                    last, last_op = now, self.op + 1
            if killed:
                killed = self._restart(killed)
            # the end: every file read whole, through this mount and the other one
            self.op, self.desc, self.op_began = ops, "final check: every file read whole", _clock()
            for i, f in enumerate(self.files):
                self._do_close_to_open(f, i)
            self.desc = "final check: every snapshot read whole, then deleted"
            while self.snapshots:
                self._drop_snapshot(self.snapshots.pop(0))
        finally:
            for f in self.files:
                if f.fd >= 0:
                    os.close(f.fd)
                    f.fd = -1
            if killed:  # a failure while a node was down: the next run finds the cluster whole
                try:
                    self._restart(killed)
                except Exception as e:  # noqa: BLE001  (the failure that got us here is the one to report)
                    self._print(f"{self.t.label}could not restart after {killed}: {e!r}")
        elapsed = self.seconds_before + time.monotonic() - t0
        if self.checkpoint:
            self.save(ops, time.monotonic() - t0, done=True)
        return {"seed": self.seed, "ops": ops, "seconds": elapsed, "ops_per_s": ops / elapsed if elapsed else 0.0,
                "counts": dict(self.counts), "times": dict(self.times), "segments": self.segments}

    # -- checkpoints: a long run goes on in a later process ---------------------------

    def save(self, ops: int, seconds: float, done: bool = False) -> None:
        """Write the run's state to ``self.checkpoint`` (atomically): what ``restore`` needs to run
        operation ``self.op`` onward exactly as this process would have (the random generators' states,
        the models, the file the next operation is on), plus counts and times for the report."""
        state = {
            "format": CHECKPOINT_FORMAT, "seed": self.seed, "use_mmap": self.use_mmap, "ops": ops, "op": self.op,
            "done": done, "file_index": self.file_index, "rng": self.rng.getstate(), "kill_rng": self.kill_rng.getstate(),
            "models": [bytes(f.model) for f in self.files], "counts": dict(self.counts), "times": dict(self.times),
            "seconds": self.seconds_before + seconds, "segments": self.segments, "recent": list(self.recent),
            "label": self.t.label, "replay": self.t.replay,
        }
        tmp = self.checkpoint.with_name(self.checkpoint.name + ".tmp")
        with open(tmp, "wb") as out:
            pickle.dump(state, out, protocol=pickle.HIGHEST_PROTOCOL)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, self.checkpoint)

    def restore(self, state: dict) -> None:
        """Continue the run a checkpoint saved (``save``): the next ``run`` starts at its operation,
        its files rewritten from its models first (on whatever cluster this engine's target is)."""
        if state["seed"] != self.seed or len(state["models"]) != len(self.files):
            raise ValueError(f"checkpoint of seed {state['seed']} ({len(state['models'])} files) does not fit this run")
        self.rng.setstate(state["rng"])
        self.kill_rng.setstate(state["kill_rng"])
        for f, model in zip(self.files, state["models"]):
            f.model[:] = model
        self.start, self.file_index = state["op"], state["file_index"]
        self.counts.update(state["counts"])
        self.times.update(state["times"])
        self.seconds_before, self.segments = state["seconds"], state["segments"] + 1
        self.recent.extend(state["recent"])
        self.recent.append(f"{self.start}: -- resumed from a checkpoint: files rewritten from the model")


CHECKPOINT_FORMAT = 1


def _clock() -> str:
    """The wall-clock time as the cluster's log lines show it (HH:MM:SS.mmm): which log lines an operation saw."""
    now = time.time()
    return time.strftime("%H:%M:%S", time.localtime(now)) + f".{int(now % 1 * 1000):03d}"


def _verdict(again: bytes | str, want: bytes, got: bytes) -> str:
    if isinstance(again, str):
        return again  # the read failed: why
    return "matches the model" if again == want else "the same wrong bytes" if again == got else "other wrong bytes"


# The mmap operations' copies and msync with the GIL released. CPython's mmap slice assignment and
# slice read hold the GIL while the copy faults the pages in through the mount (FUSE reads), and
# mmap.flush() holds it through msync(MS_SYNC) (the mount's writes, commit and node syncs: 60-90 ms
# under load): with --parallel the runs are threads of one process, and each mmap write stopped the
# three other runs for that long (a py-spy --gil profile of the CLI during the four-run command: 90% of
# its GIL samples in those two lines). ctypes' memmove and a CDLL call release it; the same copy,
# page faults and msync(MS_SYNC) of the whole mapping happen as before.
_libc = ctypes.CDLL(None, use_errno=True)
_libc.msync.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_MS_SYNC = 4  # Linux's; what mmap.flush() passes


def _store_and_msync(m: mmap.mmap, at: int, data: bytes) -> None:
    """``m[at:at + len(data)] = data; m.flush()`` without the GIL (the note above)."""
    base = ctypes.addressof(ctypes.c_char.from_buffer(m))  # the export ends with the temporary
    ctypes.memmove(base + at, data, len(data))
    if _libc.msync(base, len(m), _MS_SYNC) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"msync: {os.strerror(err)}")


def _load(m: mmap.mmap, at: int, n: int) -> bytes:
    """``m[at:at + n]`` without the GIL (the note above)."""
    out = ctypes.create_string_buffer(n)
    ctypes.memmove(out, ctypes.addressof(ctypes.c_char.from_buffer(m)) + at, n)
    return out.raw


def _read_cached(f: FileState, off: int, n: int) -> bytes | str:
    """``n`` bytes at ``off`` through ``f``'s own descriptor (an open could drop the kernel's pages)."""
    if f.fd < 0:
        return "not open"
    try:
        return os.pread(f.fd, n, off)
    except OSError as e:
        return repr(e)


def _aligned_pread(fd: int, off: int, n: int) -> bytes:
    """``n`` bytes at ``off`` as O_DIRECT needs them read: whole pages, into a page-aligned buffer."""
    start, end = off & ~(PAGE - 1), -(-(off + n) // PAGE) * PAGE
    with mmap.mmap(-1, max(end - start, PAGE)) as buf:
        count = os.preadv(fd, [buf], start)
        return buf[off - start:min(off - start + n, count)]


def _read_direct_fd(f: FileState, off: int, n: int) -> bytes | str:
    """``_read_direct`` through ``f``'s own descriptor (O_DIRECT set with fcntl): the mount answers
    with the state of this handle's open, with no new open to refresh it."""
    if f.fd < 0:
        return "not open"
    flags = fcntl.fcntl(f.fd, fcntl.F_GETFL)
    try:
        fcntl.fcntl(f.fd, fcntl.F_SETFL, flags | os.O_DIRECT)
        return _aligned_pread(f.fd, off, n)
    except OSError as e:
        return repr(e)
    finally:
        fcntl.fcntl(f.fd, fcntl.F_SETFL, flags)


def _read_path(path: Path, off: int, n: int) -> bytes | str:
    """``n`` bytes at ``off`` read through the page cache after a new open."""
    try:
        with open(path, "rb") as g:
            g.seek(off)
            return g.read(n)
    except OSError as e:
        return repr(e)


def _read_direct(path: Path, off: int, n: int) -> bytes | str:
    """``n`` bytes at ``off`` read with O_DIRECT after a new open: what the mount answers."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        try:
            return _aligned_pread(fd, off, n)
        finally:
            os.close(fd)
    except OSError as e:
        return repr(e)


PLAN = "run.json"  # in a checkpoint directory: the CLI's settings and runs (layout, mmap, seed)


def _checkpoint_path(d: Path, layout: str, use_mmap: bool, seed: int) -> Path:
    return d / f"{layout}-mmap-{'on' if use_mmap else 'off'}-{seed}.ckpt"


def _checkpoint_done(d: Path, layout: str, use_mmap: bool, seed: int) -> bool:
    try:
        return load_checkpoint(_checkpoint_path(d, layout, use_mmap, seed))["done"]
    except (OSError, ValueError, pickle.UnpicklingError, EOFError):
        return False


def load_checkpoint(path: Path) -> dict:
    with open(path, "rb") as f:
        state = pickle.load(f)  # our own file, written by Engine.save
    if state.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"{path}: not a checkpoint of this version of the tester")
    return state


def _write_whole(fd: int, data: bytes | bytearray) -> None:
    view, done = memoryview(data), 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], done)
    os.fsync(fd)


def kill_schedule(ops: int, every: int) -> list[tuple[int, int]]:
    """Every ``every`` operations: a node killed a quarter in, restarted three quarters in."""
    if every <= 0:
        return []
    return [(p + every // 4, p + 3 * every // 4) for p in range(0, ops - every // 4, every)]


# -- the CLI: its own cluster --------------------------------------------------------

LAYOUTS = {"rep": ("--replicas", "2", "--chunk-size", "64K"), "ec": ("--ec", "4+2", "--chunk-size", "64K")}
NODES = 6
# the CLI's own cluster and the pytest one: a dead node is declared down after 3 s, and the mounts'
# requests to it give up after 3 s, not 10 (a write to a chunk with a copy there waits that long).
# The mounts read that from a client config (-o config=...): local up's --set does not reach the mount.
CLUSTER_SETTINGS = ("--set", "meta.node_timeout_s=3", "--set", "meta.session_lease_s=6")
CLIENT_TOML = "rpc_timeout_s = 3.0\n"


def cluster_cpu(state: Path) -> dict[str, float]:
    """CPU seconds (user + system) so far of the cluster's processes, by role (meta, storage, mount)."""
    from stripefs.local_processes import processes_of

    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = collections.defaultdict(float)
    for proc in processes_of(state):
        try:
            with open(f"/proc/{proc.pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[-1].split()
        except OSError:
            continue
        out[proc.name.split("-")[0]] += (int(fields[11]) + int(fields[12])) / tick
    return dict(out)


def new_cluster(conftest, prefix: str = "stripefs-datapath-"):
    """A conftest ``Cluster`` (not started) of NODES nodes with the settings above."""
    root = conftest.cluster_root(prefix)
    (root / "client.toml").write_text(CLIENT_TOML)
    return conftest.Cluster(root, nodes=NODES, up_args=(*CLUSTER_SETTINGS, "-o", f"config={root / 'client.toml'}"))


def set_up(cluster, run_cli) -> Path:
    """The two layout directories and the second mount (returned)."""
    for layout, args in LAYOUTS.items():
        (cluster.mnt / layout).mkdir()
        run_cli("layout", "set", "--dir", str(cluster.state), *args, str(cluster.mnt / layout))
    return cluster.mount_again("second", options=f"config={cluster.root / 'client.toml'}")


def _cluster_helpers():
    sys.path.insert(0, str(Path(__file__).resolve().parent / "cluster"))
    import conftest  # noqa: E402  (the cluster tests' launcher helpers)
    return conftest


def cluster_target(cluster, d: Path, other_mnt: Path, label: str, kill_every: int = 0, snapshot_every: int = 0) -> Target:
    """A Target on ``cluster`` (conftest's ``Cluster``) for directory ``d`` of its mount."""
    from stripefs.local_cluster import _alive

    def kill(rng: random.Random) -> str:
        alive = sorted((n for n, pid in cluster.pids()["storage"].items() if _alive(pid)), key=int)
        node = rng.choice(alive)
        cluster.kill_node(int(node))
        return f"storage node {node} killed (SIGKILL)"
    def snapshot(name: str) -> Path:
        _snapshot_request(d, "create", name)
        return d / ".snapshots" / name

    return Target(dir=d, other_view=lambda p: other_mnt / p.relative_to(cluster.mnt), kill=kill, restart=cluster.restart,
                  chunk=CHUNK, stripe=4 * CHUNK if label.startswith("ec") else 0, label=label,
                  replay=f" --layout {label.strip()}" + (f" --kill-every {kill_every}" if kill_every else "")
                  + (f" --snapshot-every {snapshot_every}" if snapshot_every else ""),
                  snapshot=snapshot, drop_snapshot=lambda name: _snapshot_request(d, "delete", name))


def _snapshot_request(d: Path, action: str, name: str) -> None:
    """``stripefs snapshot create|delete D NAME``'s request, sent from this process as the command sends it
    (stripefs/snapshot_cli.py: the mount's daemon addresses, the directory's inode, one OnceReq); raises
    Mismatch with the daemon's answer when it fails. Not the command itself: a Python start is ~0.3 s of
    CPU, and a million-operation run with a snapshot every 2,000 takes 2,000 of them."""
    from stripefs.cluster import resolve_attr, rpc_once
    from stripefs.common import protocol as p
    from stripefs.common.errors import QuietError, StripefsError
    from stripefs.keys_cli import use_env_key

    use_env_key()
    kind = p.SnapshotCreateReq if action == "create" else p.SnapshotDeleteReq
    try:
        addresses, ino, _ = resolve_attr(None, str(d))
        rpc_once(addresses, kind(ino=ino, name=os.fsencode(name)))
    except (QuietError, StripefsError) as e:
        raise Mismatch(f"stripefs snapshot {action} {d} {name} failed: {e}") from None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="A failure prints the command line that replays it.")
    ap.add_argument("--layout", choices=["rep", "ec", "both"], default="both",
                    help="replicas=2 or ec=4+2, both 64K chunks (default both)")
    ap.add_argument("--ops", type=int, default=20000, help="operations per layout and mmap mode (default 20000)")
    ap.add_argument("--seed", type=int, help="the first run's seed, the next runs' count up from it (default: random, printed)")
    ap.add_argument("--mmap", choices=["on", "off", "both"], default="on",
                    help="mmap reads and writes (default on; both: a run with, then one without)")
    ap.add_argument("--no-mmap", dest="mmap", action="store_const", const="off", help="same as --mmap off")
    ap.add_argument("--files", type=int, default=3, help="files per run (default 3)")
    ap.add_argument("--kill-every", type=int, default=0, metavar="N", help="every N operations kill -9 a storage node (a quarter in) "
                    "and restart it (three quarters in)")
    ap.add_argument("--parallel", action="store_true", help="every run (layout x mmap mode) at once, each on a cluster of its own")
    ap.add_argument("--split", type=int, default=1, metavar="K", help="each layout x mmap mode's --ops as K runs of ops/K, each "
                    "with a seed of its own; with --parallel the clusters (one per mode) take them from a queue, the "
                    "heaviest first, and end close together instead of one heavy run alone at the end (default 1)")
    ap.add_argument("--mount", type=Path, help="a directory in an existing stripefs mount: run in a new directory there, with the "
                    "layout it has (no cluster started, no kills; close-to-open through the same mount)")
    ap.add_argument("--local-dir", type=Path, help="run on a local directory instead (checks the model itself)")
    ap.add_argument("--allow-log", action="append", default=[], metavar="REGEX", help="an ERROR line in the cluster's logs that "
                    "does not fail the run (any other does; repeatable)")
    ap.add_argument("--keep-going", action="store_true", help="with --parallel: a run that fails does not stop the others "
                    "(each has a cluster of its own)")
    ap.add_argument("--keep", action="store_true", help="keep the cluster's state directory (logs) even when everything passed")
    ap.add_argument("--verbose", "-v", action="store_true", help="at the end of each run: operations per kind and their mean time")
    ap.add_argument("--progress", type=float, default=5.0, help="seconds between progress lines (default 5; 0: none)")
    ap.add_argument("--checkpoint", type=Path, metavar="DIR", help="save each run's state in DIR every 10,000 operations "
                    "(while no node is killed), so that --resume DIR can finish a long run in a later process")
    ap.add_argument("--resume", type=Path, metavar="DIR", help="finish the run whose checkpoints are in DIR (its settings "
                    "come from there): each unfinished run goes on where its last checkpoint left it, on a new cluster, its "
                    "files rewritten from the model first")
    ap.add_argument("--checkpoint-every", type=int, default=10000, metavar="N", help="operations between checkpoints (default 10000)")
    ap.add_argument("--snapshot-every", type=int, default=0, metavar="N", help="every N operations fsync the files, snapshot the "
                    "directory (stripefs snapshot create) and check it and an older one against the models as they were "
                    "then; three are kept, each checked again when deleted and at the end (default 0: none; not "
                    "saved in checkpoints: a resumed run takes none)")
    args = ap.parse_args(argv)
    if args.resume:
        try:
            plan = json.loads((args.resume / PLAN).read_text())
        except (OSError, ValueError) as e:
            ap.error(f"--resume {args.resume}: no run's checkpoints there ({e})")
        args.checkpoint = args.resume
        run_ops, args.kill_every, args.files = plan["ops"], plan["kill_every"], plan["files"]
        runs = [tuple(r) for r in plan["runs"]]
        layouts = sorted({lo for lo, _, _ in runs}, key=["rep", "ec"].index)
    else:
        seed0 = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 31)
        modes = {"on": [True], "off": [False], "both": [True, False]}[args.mmap]
        layouts = ["rep", "ec"] if args.layout == "both" else [args.layout]
        if args.local_dir or args.mount:
            layouts = ["local" if args.local_dir else "mount"]
        if args.split < 1 or args.ops % args.split:
            ap.error(f"--split {args.split}: a positive number that divides --ops {args.ops}")
        run_ops = args.ops // args.split
        runs = [(layout, use_mmap, seed0 + k) for k, (layout, use_mmap)
                in enumerate((lo, m) for lo in layouts for m in modes for _ in range(args.split))]
    modes_n = len({(lo, m) for lo, m, _ in runs})  # layout x mmap modes: with --parallel, a cluster each
    if args.checkpoint and (args.local_dir or args.mount):
        ap.error("--checkpoint and --resume are for the CLI's own clusters (not --mount or --local-dir)")
    if args.checkpoint and not args.resume:
        try:
            old = json.loads((args.checkpoint / PLAN).read_text())
        except (OSError, ValueError):
            old = None
        if old and not all(_checkpoint_done(args.checkpoint, *r) for r in old["runs"]):
            ap.error(f"{args.checkpoint} holds a run that has not finished: --resume {args.checkpoint} finishes it "
                     "(or delete the directory to start afresh)")
        shutil.rmtree(args.checkpoint, ignore_errors=True)
        args.checkpoint.mkdir(parents=True)
        (args.checkpoint / PLAN).write_text(json.dumps(
            {"ops": run_ops, "kill_every": args.kill_every, "files": args.files, "runs": runs,
             "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, indent=1) + "\n")
    results: list[tuple[str, dict]] = []
    failures: list[str] = []
    stop = threading.Event()
    starting = threading.Lock()
    print("seeds: " + ", ".join(f"{lo} mmap {'on' if m else 'off'}: {s}" for lo, m, s in runs), flush=True)
    if args.resume:  # the runs that had finished are reported, not run again
        for lo, m, seed in [r for r in runs if _checkpoint_done(args.checkpoint, *r)]:
            st = load_checkpoint(_checkpoint_path(args.checkpoint, lo, m, seed))
            results.append((f"{lo} mmap {'on' if m else 'off'}", {"seed": seed, "ops": st["ops"], "seconds": st["seconds"],
                            "ops_per_s": st["ops"] / st["seconds"], "segments": st["segments"]}))
            print(f"== {results[-1][0]}: seed {seed}: had finished, {st['ops']} ops OK in {st['seconds']:.0f} s", flush=True)
            runs.remove((lo, m, seed))

    def run_one(target: Target, layout: str, use_mmap: bool, seed: int, kills=(), state: Path | None = None) -> None:
        name = f"{target.label}mmap {'on' if use_mmap else 'off'}"
        cpu_before = cluster_cpu(state) if state is not None else None
        own_cpu = time.thread_time()  # this run's thread: the tester's own share of the machine (its syscalls included)
        print(f"== {name}: seed {seed}, {run_ops} ops, {args.files} files in {target.dir}", flush=True)
        ckpt = _checkpoint_path(args.checkpoint, layout, use_mmap, seed) if args.checkpoint else None
        engine = Engine(target, seed, use_mmap=use_mmap, nfiles=args.files, kills=kills, progress=args.progress, stop=stop,
                        checkpoint=ckpt, checkpoint_every=args.checkpoint_every,
                        snapshot_every=0 if args.resume else args.snapshot_every)
        if args.resume and ckpt.exists():
            engine.restore(load_checkpoint(ckpt))
            print(f"== {name}: seed {seed}: resumed at operation {engine.start} ({engine.seconds_before:.0f} s before)", flush=True)
        try:
            res = engine.run(run_ops)
        except Mismatch as e:
            failures.append(f"{name} FAILED: {e}")
            print(f"\n{failures[-1]}\n", flush=True)
            if not args.keep_going:
                stop.set()
            raise
        results.append((name, res))
        if args.verbose:
            print("   " + ", ".join(f"{k} {res['counts'][k]} ({1e3 * res['times'][k] / res['counts'][k]:.1f} ms)"
                                   for k in sorted(res["counts"], key=lambda k: -res["times"][k])), flush=True)
        if cpu_before is not None:
            used = {role: t - cpu_before.get(role, 0.0) for role, t in cluster_cpu(state).items()}
            print(f"   cluster CPU per operation: {1e3 * sum(used.values()) / run_ops:.2f} ms ("
                  + ", ".join(f"{role} {1e3 * t / run_ops:.2f}" for role, t in sorted(used.items()))
                  + f"; the tester itself {1e3 * (time.thread_time() - own_cpu) / run_ops:.2f})", flush=True)
        took = f" in {res['segments']} processes" if res["segments"] > 1 else ""
        print(f"== {name}: seed {seed}: {run_ops} ops OK in {res['seconds']:.0f} s{took} ({res['ops_per_s']:.0f} ops/s)", flush=True)

    def on_cluster(name: str, take: Callable[[], tuple[str, bool, int] | None]) -> None:
        """The runs that ``take()`` hands out (None: no more), one after the other on a cluster of their own,
        always torn down; a run whose layout's directory an earlier run here used gets a fresh one inside it."""
        c = _cluster_helpers()
        cluster = new_cluster(c)
        cluster.expected_log_patterns += args.allow_log
        ok = False
        try:
            t = time.monotonic()
            with starting:  # one at a time: each `local up` picks free ports, and two at once can pick the same
                cluster.up()
                other = set_up(cluster, c.run_cli)
            print(f"{name}: cluster of {NODES} nodes up in {time.monotonic() - t:.1f} s at {cluster.root}", flush=True)
            used: set[str] = set()
            while not stop.is_set() and (run := take()) is not None:
                layout, use_mmap, seed = run
                d = cluster.mnt / layout
                if layout in used:
                    d = d / f"run-{seed}"
                    d.mkdir()
                used.add(layout)
                run_one(cluster_target(cluster, d, other, f"{layout} ", args.kill_every, args.snapshot_every),
                        layout, use_mmap, seed, kill_schedule(run_ops, args.kill_every), state=cluster.state)
            ok = True
        finally:
            cluster.teardown()
            bad = cluster.bad_log_lines()
            if bad:
                failures.append(f"{name}: unexpected ERROR lines in the cluster's logs (--allow-log REGEX excuses one):\n"
                                + "\n".join(bad[:20]))
                print(failures[-1], flush=True)
                ok = False
            if ok and not args.keep:
                shutil.rmtree(cluster.root, ignore_errors=True)
            else:
                print(f"{name}: cluster state and logs kept in {cluster.state}", flush=True)

    def guarded(name: str, take: Callable[[], tuple[str, bool, int] | None]) -> None:
        try:
            on_cluster(name, take)
        except Mismatch:
            pass
        except Stopped as e:
            print(f"{e} (another run failed, or the CLI was interrupted)", flush=True)
        except BaseException as e:  # noqa: BLE001  (a thread's error ends every run, reported)
            failures.append(f"{name}: {e!r}")
            stop.set()

    # SIGTERM / SIGHUP: unwind like Ctrl-C so the clusters are always torn down
    def _term(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _term)

    try:
        if args.local_dir or args.mount:
            base = (args.local_dir or args.mount).resolve()
            d = Path(tempfile.mkdtemp(prefix="datapath-model-", dir=base))
            try:
                for layout, use_mmap, seed in runs:
                    run_one(Target(dir=d, label=f"{layout} ", replay=f" --{layout.replace('local', 'local-dir')} {base}"),
                            layout, use_mmap, seed)
            except Mismatch:
                pass
            finally:
                shutil.rmtree(d, ignore_errors=True)
        elif args.parallel and len(runs) > 1:
            # a cluster for each layout x mmap mode, each taking the next run from one queue, the heaviest first
            # (EC costs more CPU per operation than replicas, mmap on more than off): with --split the runs end
            # close together instead of the heaviest one alone at the end
            queue = collections.deque(sorted(runs, key=lambda r: (r[0] != "ec", not r[1])))
            taking = threading.Lock()

            def take() -> tuple[str, bool, int] | None:
                with taking:
                    return queue.popleft() if queue else None
            workers = min(len(runs), modes_n)
            threads = [threading.Thread(target=guarded, args=(f"cluster {k + 1}", take), name=f"cluster-{k + 1}")
                       for k in range(workers)]
            for t in threads:
                t.start()
            try:
                while any(t.is_alive() for t in threads):
                    for t in threads:
                        t.join(0.2)
            except KeyboardInterrupt:
                stop.set()
                print("\ninterrupted: stopping the runs, tearing the clusters down", flush=True)
                for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # a second signal must not leave clusters up
                    signal.signal(sig, lambda signum, frame: print("still tearing the clusters down: wait", flush=True))
                for t in threads:
                    t.join()
                return 130
        else:
            for layout in layouts:
                if mine := [r for r in runs if r[0] == layout]:
                    guarded(layout, lambda it=iter(mine): next(it, None))
                if stop.is_set():
                    break
        return 1 if failures else 0
    except KeyboardInterrupt:
        stop.set()
        print("\ninterrupted", flush=True)
        return 130
    finally:
        print("\nseeds used:", flush=True)
        for name, res in results:
            took = f", {res['segments']} processes" if res.get("segments", 1) > 1 else ""
            print(f"  {name}: seed {res['seed']}, {res['ops']} ops OK in {res['seconds']:.0f} s{took} ({res['ops_per_s']:.0f} ops/s)")
        for f in failures:
            print(f"  {f.splitlines()[0]}" + "".join(f"\n  {line.strip()}" for line in f.splitlines() if "replay:" in line))
        print("FAILED" if failures else "OK" if results else "", flush=True)


if __name__ == "__main__":
    sys.exit(main())
