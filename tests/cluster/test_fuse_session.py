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
    return any(e.path == str(path) for e in mounts())


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


def test_a_failed_init_leaves_nothing_mounted(tmp_path, monkeypatch):
    from stripefs.client.fuse import session as session_mod

    def refuse(*args):
        raise session_mod.SessionError("refused by the test")

    monkeypatch.setattr(session_mod, "negotiate", refuse)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    with pytest.raises(session_mod.SessionError, match="refused by the test"):
        serve(str(mnt), MemFS({b"a": b"x"}))
    assert not mounted_at(mnt)
    assert os.listdir(mnt) == []


def test_notifications_reach_the_kernel(tmp_path):
    """store fills the page cache (the next read sends no READ), inval_inode drops it (the next read
    asks again), inval_entry forgets a name the file system no longer has."""
    from stripefs.client.fuse import notify

    mnt = tmp_path / "mnt"
    mnt.mkdir()
    fs = MemFS({b"a.txt": b"hello world\n", b"b.txt": b"other"})
    session, m = serve(str(mnt), fs, options=["ro"])
    try:
        with caches_kept():
            assert (mnt / "b.txt").read_bytes() == b"other"  # OPEN and FLUSH declined once for the connection
            ino = os.stat(mnt / "a.txt").st_ino
            assert session.notify(notify.store(ino, 0, b"hello world\n"))
            assert delta(session, lambda: open(mnt / "a.txt", "rb", buffering=0).read()) == {}
            fs.data[ino] = b"HELLO WORLD\n"  # same size: only the bytes changed
            assert open(mnt / "a.txt", "rb", buffering=0).read() == b"hello world\n"  # still the kept page
            assert session.notify(notify.inval_inode(ino, 0, 0))
            got = []
            assert delta(session, lambda: got.append(open(mnt / "a.txt", "rb", buffering=0).read())).get("READ") == 1
            assert got == [b"HELLO WORLD\n"]
            fs.names[b"c.txt"] = fs.names.pop(b"a.txt")  # renamed behind the kernel's back
            assert os.path.exists(mnt / "a.txt")  # the kernel keeps the name an hour...
            assert session.notify(notify.inval_entry(1, b"a.txt"))
            assert not os.path.exists(mnt / "a.txt")  # ...until told
            assert (mnt / "c.txt").read_bytes() == b"HELLO WORLD\n"
    finally:
        session.close()
    assert not mounted_at(mnt)


async def test_interrupt_of_a_blocked_caller(tmp_path):
    """A caller killed while its request waits in trio: the kernel sends INTERRUPT, the request's
    task is cancelled and answered EINTR, and the caller is gone."""
    import errno as _errno

    import trio

    from stripefs.client.fuse.dispatch import MISS, Dispatcher
    from stripefs.client.fuse.device import Device
    from stripefs.client.fuse.mount import mount, unmount
    from stripefs.client.fuse.session import Session

    started, cancelled = trio.Event(), []

    class SlowFS(MemFS):
        def fast_getxattr(self, req):
            if req.name == b"user.slow":
                return MISS
            raise OSError(_errno.ENODATA, "no such attribute")

        async def getxattr(self, req):
            started.set()
            try:
                await trio.sleep_forever()
            except trio.Cancelled:
                cancelled.append(req.header.unique)
                raise

    mnt = tmp_path / "mnt"
    mnt.mkdir()
    m = await trio.to_thread.run_sync(lambda: mount(str(mnt), (), fsname="memfs", subtype="memfs"))
    async with trio.open_nursery() as nursery:
        dev = Device(m.fd)
        session = Session(dev, Dispatcher(SlowFS({b"a": b"x"}), trio.lowlevel.current_trio_token(), nursery),
                          on_close=lambda: unmount(m, dev))
        try:
            await trio.to_thread.run_sync(session.start)
            caller = subprocess.Popen([sys.executable, "-c", f"import os; os.getxattr({str(mnt / 'a')!r}, 'user.slow')"])
            with trio.fail_after(20):
                await started.wait()
            caller.kill()
            assert await trio.to_thread.run_sync(caller.wait, 20) == -signal.SIGKILL
            with trio.fail_after(20):
                while not cancelled:
                    await trio.sleep(0.01)
            assert session.counts[Opcode.INTERRUPT] >= 1
        finally:
            await trio.to_thread.run_sync(session.close)
    assert not mounted_at(mnt)


def test_a_cloned_device_and_liveness(tmp_path):
    """FUSE_DEV_IOC_CLONE attaches a second descriptor to the connection; once unmounted, the kernel
    says so on it (POLLERR), which is what keeps an unmount by path from hitting someone else's mount."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    session, m = serve(str(mnt), MemFS({b"a": b"x"}))
    clone = session.device.clone()
    try:
        assert clone.alive() and session.device.alive()
        assert (mnt / "a").read_bytes() == b"x"
    finally:
        session.close()
    try:
        assert not clone.alive()
    finally:
        clone.close()
    assert not mounted_at(mnt)


def test_an_unrelated_mount_at_the_path_is_left_alone(tmp_path):
    """Unmounting is by path, so it checks first that the path still holds this mount (its device in
    mountinfo): after this mount went and another file system came to the same path, it does nothing."""
    from stripefs.client.fuse.mount import unmount

    mnt = tmp_path / "mnt"
    mnt.mkdir()
    session, m = serve(str(mnt), MemFS({b"a": b"x"}))
    session.close()
    assert not mounted_at(mnt)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "other", str(mnt)], check=True)
    try:
        assert unmount(m) is False  # the Mount of the session that is gone
        assert mounted_at(mnt)
    finally:
        subprocess.run(["umount", str(mnt)], check=True)
