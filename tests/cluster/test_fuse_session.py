"""The mount's own FUSE session (stripefs.client.fuse) on real mounts: what needs the kernel.

A tiny in-memory file system (tests/fuse_memfs.py) is mounted by the session itself: once in
this process (its request counters read directly), and as a server process for the exits a
process can take: SIGTERM (it unmounts), SIGKILL (the reaper unmounts). Nothing stays mounted.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from stripefs.client.fuse.abi import Opcode
from stripefs.client.fuse.mount import mounts
from util import caches_kept, eventually

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fuse_memfs import MemFS, serve  # noqa: E402

MEMFS = Path(__file__).resolve().parents[1] / "fuse_memfs.py"


def mounted_at(path: Path) -> bool:
    return any(p == str(path) for _, p, _ in mounts())


def delta(session, fn) -> dict[str, int]:
    before = list(session.counts)
    fn()
    return {Opcode(i).name: a - b for i, (a, b) in enumerate(zip(session.counts, before)) if a != b}


def test_a_warm_file_is_read_with_no_request(tmp_path):
    """No-open (OPEN answered ENOSYS), no flush (FLUSH answered ENOSYS), the page cache kept: the
    second read of a file reaches the kernel only. A read-only mount: a read-write one invalidates
    atime on every read, and the reader's fstat then asks a GETATTR."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    session, m = serve(str(mnt), MemFS({b"a.txt": b"hello world\n", b"b.txt": b"x" * 100_000}), options=["ro"])
    try:
        p = mnt / "a.txt"
        with caches_kept():
            first = delta(session, lambda: open(p, "rb").read())
            assert first.get("OPEN") == 1 and first.get("FLUSH") == 1 and first.get("READ") == 1, first
            assert delta(session, lambda: open(p, "rb", buffering=0).read()) == {}
            assert delta(session, lambda: os.stat(p)) == {}
            # io.open's isatty() (TCGETS) reaches the file system on every buffered open on Python 3.11:
            # the kernel forwards it and does not remember the answer (answered on the reader thread)
            assert delta(session, lambda: open(p, "rb").read()) in ({}, {"IOCTL": 1})
            # the second file: no OPEN or FLUSH any more, whatever the file
            second = delta(session, lambda: open(mnt / "b.txt", "rb", buffering=0).read())
            assert "OPEN" not in second and "FLUSH" not in second and second.get("READ", 0) >= 1, second
            assert delta(session, lambda: open(mnt / "b.txt", "rb", buffering=0).read()) == {}
            assert sorted(os.listdir(mnt)) == ["a.txt", "b.txt"]
            assert delta(session, lambda: os.listdir(mnt)) == {}  # no-opendir: the kernel keeps the listing
        assert open(p, "rb").read() == b"hello world\n"
    finally:
        session.close()
    assert not mounted_at(mnt) and not session.running


def start_server(mnt: Path, *args: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, str(MEMFS), *args, str(mnt), "a.txt=hello"], stdout=subprocess.PIPE,
                            text=True)
    line = proc.stdout.readline()
    if line.strip() != "ready":
        proc.kill()
        pytest.fail(f"the memfs server did not start: {line!r}, exit {proc.wait()}")
    return proc


@pytest.mark.parametrize("via", ["mount(2)", "fusermount3"])
def test_sigterm_unmounts(tmp_path, via):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    proc = start_server(mnt, *(["--via=fusermount3"] if via == "fusermount3" else []))
    try:
        assert (mnt / "a.txt").read_bytes() == b"hello"
        assert mounted_at(mnt)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
        assert not mounted_at(mnt)
    finally:
        proc.kill()
        proc.wait()
        if mounted_at(mnt):
            subprocess.run(["umount", "-l", str(mnt)])


def test_sigkill_leaves_nothing_mounted(tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    proc = start_server(mnt)
    try:
        assert (mnt / "a.txt").read_bytes() == b"hello"
        proc.kill()
        proc.wait()
        eventually(lambda: not mounted_at(mnt), what="the reaper unmounts the dead server's mount")
        assert os.listdir(mnt) == []  # the directory beneath, not a dead mount (ENOTCONN)
    finally:
        if mounted_at(mnt):
            subprocess.run(["umount", "-l", str(mnt)])
