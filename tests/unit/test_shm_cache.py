"""The shared-memory directory of prefetched files (client/shm_cache.py)."""

import os
import subprocess

from stripefs.client.shm_cache import ShmCache
from stripefs.common import protocol as p


def test_shared_memory_directories_of_dead_mounts_are_swept(tmp_path):
    dead = subprocess.Popen(["true"])
    dead.wait()
    (tmp_path / f"stripefs-{dead.pid}").mkdir()
    (tmp_path / f"stripefs-{dead.pid}" / "1-2-3").write_bytes(b"x")
    alive = tmp_path / f"stripefs-{os.getppid()}"
    alive.mkdir()
    cache = ShmCache(tmp_path / f"stripefs-{os.getpid()}", 1 << 20)
    cache.open()
    assert not (tmp_path / f"stripefs-{dead.pid}").exists() and alive.exists() and cache.dir.is_dir()
    cache.close()
    assert not cache.dir.exists()


def test_copies_keep_the_owner_and_mode_and_respect_the_budget(tmp_path):
    cache = ShmCache(tmp_path / "stripefs-test", budget=25_000)
    cache.open()

    def info(ino, size):
        attr = p.Attr(ino=ino, mode=0o100640, nlink=1, uid=1234, gid=5678, rdev=0, size=size, atime_ns=0, mtime_ns=ino * 10, ctime_ns=0, generation=0)
        return p.OpenRsp(attr=attr, layout=p.Layout(chunk_size=1 << 20, stripe_count=1, redundancy="replicas=1"), chunks=[], nodes=[])

    assert cache.put(info(1, 10_000), b"a" * 10_000)
    st = os.stat(cache.dir / "1-10-10000")
    assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (1234, 5678, 0o640)
    assert cache.put(info(2, 10_000), b"b" * 10_000)
    os.unlink(cache.dir / "1-10-10000")  # a reader took it
    assert cache.put(info(3, 10_000), b"c" * 10_000)  # room again: the consumed copy no longer counts
    assert cache.put(info(4, 10_000), b"d" * 10_000)  # full: the oldest unread copy (2) goes
    assert sorted(os.listdir(cache.dir)) == ["3-30-10000", "4-40-10000"]
    assert not cache.put(info(5, 30_000), b"e" * 30_000)  # larger than the budget: not copied
    cache.close()
