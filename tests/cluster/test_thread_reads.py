"""Cold READs served on plain threads (client/thread_reads.py): taken, right, and falling back.

The files are written through the session's mount and read through a second one (a default and a
dataset mount: the reader's LOOKUPs then carry the open information, as for any data set written
elsewhere), whose ``stripefs_thread_reads_total`` is counted: a cold read of a small replicated
file must be served there (not in trio) and give the file's bytes, and a storage node killed
between reads must change neither the bytes nor the mount's answering.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import random
import time

import pytest

from stripefs.client import metrics as client_metrics

from conftest import drop_caches
from test_ops import scrape, total


def _thread_reads(mountpoint) -> dict[str, float]:
    samples = scrape(f"http://{client_metrics.find_state(mountpoint)['metrics']}/metrics")
    return {o: total(samples, "stripefs_thread_reads_total", outcome=o) for o in ("served", "handed_back", "reader")}


def _populate(d, n: int, seed: int) -> dict[str, str]:
    rng = random.Random(seed)
    sums = {}
    for i in range(n):
        data = rng.randbytes(rng.choice([1, 4096, 110_000, 300_000, 1_000_000]))
        (d / f"f{i}").write_bytes(data)
        sums[f"f{i}"] = hashlib.sha256(data).hexdigest()
    return sums


def _check(d, names, sums) -> None:
    for name in names:
        assert hashlib.sha256((d / name).read_bytes()).hexdigest() == sums[name], name


@pytest.mark.parametrize("options", ["", "dataset"])
def test_a_cold_read_of_a_small_file_is_served_on_a_thread(cluster, mnt, options):
    sums = _populate(mnt, 40, seed=29)
    reader = cluster.mount_again(f"thread_reads_{options or 'default'}", options)
    try:
        theirs = reader / mnt.name
        drop_caches()
        before = _thread_reads(reader)
        _check(theirs, sorted(sums), sums)
        after = _thread_reads(reader)
        # every file is one chunk: a cold read is one READ, which the threads take unless the chunk
        # is in the chunk cache already or being loaded (a walked directory's small files are
        # fetched ahead: client/dir_hints.py)
        assert after["served"] - before["served"] >= 10, (before, after)
        # again, from the chunk cache (the page cache dropped): the same bytes
        drop_caches()
        _check(theirs, sorted(sums), sums)
    finally:
        cluster.unmount(reader)


@pytest.mark.parametrize("options", ["", "dataset"])
def test_a_listed_directory_s_cold_reads_are_loaded_by_the_fuse_reader_thread(cluster, mnt, options):
    """A READ that finds no load under way (the names came with a listing, so no LOOKUP fetched the
    file ahead) is sent by the FUSE reader thread itself (client/reader_loads.py)."""
    sums = _populate(mnt / "listed", 40, seed=2930) if (mnt / "listed").mkdir() is None else {}
    reader = cluster.mount_again(f"reader_loads_{options or 'default'}", options)
    try:
        theirs = reader / mnt.name / "listed"
        drop_caches()
        assert len(list(os.scandir(theirs))) == 40  # READDIRPLUS: the kernel holds the names
        before = _thread_reads(reader)
        _check(theirs, sorted(sums), sums)
        after = _thread_reads(reader)
        assert after["reader"] - before["reader"] >= 10, (before, after)
        assert after["served"] - before["served"] >= after["reader"] - before["reader"], (before, after)
    finally:
        cluster.unmount(reader)


def test_a_node_killed_mid_epoch_falls_back_and_every_file_reads_right(cluster, mnt):
    cluster.expect_log(r"not answering", r"failed", r"no reply")
    sums = _populate(mnt, 36, seed=2929)
    names = sorted(sums)
    reader = cluster.mount_again("thread_reads_kill")
    try:
        theirs = reader / mnt.name
        drop_caches()
        before = _thread_reads(reader)
        _check(theirs, names[:12], sums)
        cluster.kill_node(1)
        try:
            drop_caches()
            _check(theirs, names[12:], sums)  # the dead node's copies: another replica, on a thread or in trio
            drop_caches()
            _check(theirs, names, sums)
            after = _thread_reads(reader)
            assert after["served"] - before["served"] >= 5, (before, after)
        finally:
            cluster.restart()
        drop_caches()
        _check(theirs, names, sums)
    finally:
        cluster.unmount(reader)


def test_a_chunk_read_whole_is_left_to_the_kernel_s_page_cache(cluster, mnt):
    """A cold READ that gives the kernel all of a chunk leaves it to the kernel's page cache, not the
    chunk cache (thread_reads.kernel_holds_all: memory the mount keeps is memory libzmq cannot reuse
    for the next reply): with the page cache dropped, the next read loads it from a node again. A
    read of a file opened O_DIRECT bypasses the page cache, so its chunk is kept: read again, it
    loads nothing."""
    d = mnt / "whole"
    d.mkdir()
    rng = random.Random(2931)
    sums = {}
    for i in range(30):
        data = rng.randbytes(110_000)
        (d / f"f{i}").write_bytes(data)
        sums[f"f{i}"] = hashlib.sha256(data).hexdigest()
    names = sorted(sums)
    reader = cluster.mount_again("thread_reads_whole")
    try:
        theirs = reader / mnt.name / "whole"
        for _ in range(2):
            drop_caches()
            assert len(list(os.scandir(theirs))) == 30  # READDIRPLUS: the kernel holds the names
            before = _thread_reads(reader)
            _check(theirs, names, sums)
            after = _thread_reads(reader)
            # the second time too: loaded again, not answered from the chunk cache
            assert after["reader"] - before["reader"] >= 10, (before, after)
        direct = names[:10]
        drop_caches()
        assert len(list(os.scandir(theirs))) == 30

        def read_direct() -> None:
            buf = mmap.mmap(-1, 1 << 17)  # page-aligned, as O_DIRECT may want
            for name in direct:
                fd = os.open(theirs / name, os.O_RDONLY | os.O_DIRECT)
                try:
                    n = os.readv(fd, [buf])
                finally:
                    os.close(fd)
                assert hashlib.sha256(buf[:n]).hexdigest() == sums[name], name

        before = _thread_reads(reader)
        read_direct()
        middle = _thread_reads(reader)
        read_direct()
        after = _thread_reads(reader)
        assert middle["served"] - before["served"] >= 5, (before, middle)  # loaded, on a thread
        assert after["served"] == middle["served"] and after["handed_back"] == middle["handed_back"], (middle, after)
    finally:
        cluster.unmount(reader)


def test_a_prefetched_file_pushed_into_the_page_cache_leaves_the_chunk_cache(cluster, mnt):
    """The prefetcher's chunks, once pushed whole into the kernel's page cache (NOTIFY_STORE), are let
    go by the chunk cache (ChunkCache.release: a second copy is memory libzmq cannot reuse for the next
    reply, so each lands in fresh pages): with the page cache dropped, the next read loads each file
    from a node again, not from the mount's memory. Its bytes are the file's either way."""
    from stripefs.torch import PrefetchSampler

    d = mnt / "pushed"
    d.mkdir()
    rng = random.Random(2932)
    sums = {}
    for i in range(30):
        data = rng.randbytes(110_000 + i)
        (d / f"f{i}").write_bytes(data)
        sums[f"f{i}"] = hashlib.sha256(data).hexdigest()
    names = sorted(sums)
    reader = cluster.mount_again("prefetch_release")
    try:
        theirs = reader / mnt.name / "pushed"

        def report() -> dict[str, int]:
            text = os.getxattr(reader, "user.stripefs.prefetch").decode()
            return {k: int(v) for k, v in (item.split("=") for item in text.split())}

        drop_caches()
        assert len(list(os.scandir(theirs))) == 30  # READDIRPLUS: the kernel knows the inodes, pages can be pushed
        before = report()
        paths = [theirs / name for name in names]
        next(iter(PrefetchSampler(range(len(paths)), paths=paths, lookahead=len(paths), batch=7)))
        deadline = time.monotonic() + 60
        while report()["pending"] and time.monotonic() < deadline:
            time.sleep(0.05)
        pushed = report()
        assert pushed["pending"] == 0 and pushed["stored"] - before["stored"] == 30, (before, pushed)

        drop_caches()  # the pushed pages go; the mount's chunk cache is not touched by that
        assert len(list(os.scandir(theirs))) == 30
        before = _thread_reads(reader)
        _check(theirs, names, sums)
        after = _thread_reads(reader)
        # loaded from a node again (on the reader thread), not answered from the chunk cache
        assert after["reader"] - before["reader"] >= 10, (before, after)
    finally:
        cluster.unmount(reader)
