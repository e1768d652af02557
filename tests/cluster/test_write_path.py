"""The sequential write path: what a large write costs the daemon, and what it must still do."""

from __future__ import annotations

import hashlib
import os
import time
import sqlite3
import struct

import pytest

from stripefs.daemon.db import DB_NAME

from conftest import drop_caches
from test_ops import _processes, scrape, total

MiB = 1 << 20

#: a valid struct vfs_cap_data (revision 2): CAP_NET_BIND_SERVICE permitted
CAPS = struct.pack("<IIIII", 0x02000000, 1 << 10, 0, 0, 0)


def _mount_metrics(cluster) -> dict:
    (url,) = [p["metrics"] for p in _processes(cluster) if p["role"] == "mount"]
    return scrape(url)


@pytest.mark.warm_caches  # counts requests that the kernel's cached inode spares (security.capability)
def test_sequential_write_asks_the_daemon_little_and_reads_back(cluster, mnt):
    chunks = 24  # default layout: 4 MiB chunks
    blocks = [os.urandom(MiB) for _ in range(8)]
    before = _mount_metrics(cluster)
    digest = hashlib.sha256()
    fd = os.open(mnt / "big", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for i in range(chunks * 4):
            block = blocks[i % len(blocks)]
            assert os.write(fd, block) == MiB
            digest.update(block)
        os.fsync(fd)
    finally:
        os.close(fd)
    after = _mount_metrics(cluster)

    def delta(name, **labels):
        return total(after, name, **labels) - total(before, name, **labels)

    writes = delta("stripefs_fuse_ops_total", op="write")
    assert writes >= chunks * 4
    # the kernel asks for security.capability before every WRITE; the daemon hears of it once
    assert delta("stripefs_rpc_seconds_count", type="GetxattrReq") <= 2
    # chunks are placed ahead of a sequential writer, not one request per chunk (5 for 24 chunks when each send
    # finds the one before placed; more when the kernel's writeback sends neighbours at once: 9 seen under load)
    assert 1 <= delta("stripefs_rpc_seconds_count", type="AllocChunksReq") <= chunks * 2 // 3
    assert delta("stripefs_rpc_seconds_count", type="WriteChunkReq") >= 2 * chunks  # every replica

    drop_caches()
    h = hashlib.sha256()
    with open(mnt / "big", "rb", buffering=0) as f:
        while piece := f.read(MiB):
            h.update(piece)
    assert h.digest() == digest.digest()
    assert (mnt / "big").stat().st_size == chunks * 4 * MiB

    # placements made ahead and not used were given back: every row is a written chunk
    ino = (mnt / "big").stat().st_ino
    assert _chunk_rows(cluster, ino) == [(i, True) for i in range(chunks)]

    # appending places ahead again (the chunk before is placed) and gives back what it did not use
    with open(mnt / "big", "ab") as f:
        f.write(b"tail")
    assert (mnt / "big").stat().st_size == chunks * 4 * MiB + 4
    with open(mnt / "big", "rb") as f:
        f.seek(chunks * 4 * MiB - 2)
        assert f.read() == blocks[(chunks * 4 - 1) % len(blocks)][-2:] + b"tail"
    # (the commit follows the close within 50 ms where closes send nothing: client/idle_commits.py)
    deadline = time.monotonic() + 10
    while _chunk_rows(cluster, ino) != [(i, True) for i in range(chunks + 1)] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _chunk_rows(cluster, ino) == [(i, True) for i in range(chunks + 1)]


def _chunk_rows(cluster, ino: int) -> list[tuple[int, bool]]:
    """(index, committed) of every chunk row of ``ino`` in the daemon's database."""
    db = sqlite3.connect(f"file:{cluster.state / 'meta' / DB_NAME}?mode=ro", uri=True)
    try:
        return [(i, v > 0) for i, v in db.execute("SELECT idx, version FROM chunks WHERE ino=? ORDER BY idx", (ino,))]
    finally:
        db.close()


def test_a_write_still_drops_file_capabilities(cluster, mnt):
    """The mount answers the kernel's security.capability question from memory while a file is
    open; setting the xattr through the mount must end that, or a write would keep capabilities."""
    p = mnt / "tool"
    p.write_bytes(b"x" * 100)
    with open(p, "r+b", buffering=0) as f:
        f.write(b"a")  # the mount learns: no capabilities
        os.setxattr(p, "security.capability", CAPS)
        assert os.getxattr(p, "security.capability") == CAPS
        f.write(b"b")  # the kernel asks again, finds them and removes them
        assert _no_caps(p)
    os.setxattr(p, "security.capability", CAPS)
    with open(p, "r+b", buffering=0) as f:  # a new open asks the daemon afresh
        f.write(b"c")
    assert _no_caps(p)
    assert p.read_bytes() == b"cb" + b"x" * 98  # the second handle wrote at 0 again


def _no_caps(path) -> bool:
    try:
        os.getxattr(path, "security.capability")
    except OSError as exc:
        return exc.errno == 61  # ENODATA
    return False
