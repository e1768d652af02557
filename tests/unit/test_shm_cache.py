"""The shared-memory directory of prefetched files (client/shm_cache.py): a root-owned mount
writing into a world-writable place must trust no name there (docs/security.md)."""

import os
import stat
import subprocess

import pytest
import xxhash

from stripefs.client import shm_cache
from stripefs.client.shm_cache import ShmCache
from stripefs.common import protocol as p

NOBODY = 65534


def _info(ino, size, mode=0o100640, uid=1234, gid=5678):
    attr = p.Attr(ino=ino, mode=mode, nlink=1, uid=uid, gid=gid, rdev=0, size=size, atime_ns=0, mtime_ns=ino * 10, ctime_ns=0, generation=0)
    return p.OpenRsp(attr=attr, layout=p.Layout(chunk_size=1 << 20, stripe_count=1, redundancy="replicas=1"), chunks=[], nodes=[])


def _as_nobody(script: str) -> subprocess.CompletedProcess:
    return subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "sh", "-c", script],
                          capture_output=True, text=True, timeout=30)


@pytest.fixture
def base(tmp_path):
    tmp_path.chmod(0o1777)  # as /dev/shm
    return tmp_path


def test_the_directory_is_fresh_private_and_never_adopted(base, monkeypatch):
    cache = ShmCache(base, 1 << 20)
    cache.open()
    st = os.lstat(cache.dir)
    assert stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) == 0o711
    # another user can neither list it nor put anything in it (a symlink to plant, a fake copy)
    res = _as_nobody(f"ls {cache.dir}; ln -s /etc/shadow {cache.dir}/x; echo planted > {cache.dir}/y")
    assert "Permission denied" in res.stderr and not os.listdir(cache.dir), res
    cache.close()
    assert not cache.dir.exists()
    # a name made ready in advance (a symlink to a root-owned directory, or a directory) is never used
    target = base / "roots"
    target.mkdir(mode=0o700)
    monkeypatch.setattr(shm_cache.secrets, "token_hex", lambda n=8: "ab" * n)
    os.symlink(target, base / f"stripefs-{os.getpid()}-{'ab' * 8}")
    with pytest.raises(OSError):
        ShmCache(base, 1 << 20).open()
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o700


def test_only_own_directories_of_dead_mounts_are_swept(base):
    dead = subprocess.Popen(["true"])
    dead.wait()
    mine = base / f"stripefs-{dead.pid}-0011"
    mine.mkdir(mode=0o711)
    (mine / "copy").write_bytes(b"x")
    theirs = base / f"stripefs-{dead.pid}-0022"
    theirs.mkdir()
    os.chown(theirs, NOBODY, NOBODY)
    (base / "victim").mkdir()
    (base / "victim" / "keep").write_bytes(b"k")
    os.symlink(base / "victim", base / f"stripefs-{dead.pid}-0033")
    alive = base / f"stripefs-{os.getppid()}-0044"
    alive.mkdir(mode=0o711)
    cache = ShmCache(base, 1 << 20)
    cache.open()
    assert not mine.exists() and theirs.exists() and alive.exists()
    assert (base / "victim" / "keep").exists()  # a symlink is never followed
    cache.close()


def test_copies_are_exclusive_files_with_the_originals_owner_and_mode(base, monkeypatch):
    cache = ShmCache(base, budget=25_000)
    cache.open()
    info = _info(1, 10_000, mode=0o104755)
    assert cache.put(info, b"a" * 10_000)
    name, size, mtime_ns, digest, uid, gid, mode = cache.lookup(1, info.attr).split()
    assert name.isalnum() and len(name) == 32 and (int(size), int(mtime_ns)) == (10_000, 10)
    assert int(digest, 16) == xxhash.xxh3_64_intdigest(b"a" * 10_000)
    assert (int(uid), int(gid), int(mode, 8)) == (1234, 5678, 0o755)  # the original's, as the mount knows them now
    st = os.lstat(cache.dir / name.decode())
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (1234, 5678, 0o755)  # no set-id bits
    assert cache.lookup(2, _info(2, 10_000).attr) is None
    assert cache.put(_info(2, 10_000), b"b" * 10_000)
    monkeypatch.setattr(shm_cache, "HANDED_OUT_S", 0.0)
    # copies stay while they fit, handed out or not: a later epoch need not fetch them again
    assert cache.has(1, 10, 10_000) and cache.has(2, 20, 10_000) and not cache.has(1, 11, 10_000)
    assert cache.lookup(1, info.attr) and len(os.listdir(cache.dir)) == 2
    # when room is needed, 1 (handed out) goes first; 2, never asked for, is the oldest after it
    assert cache.put(_info(3, 10_000), b"c" * 10_000)
    assert len(os.listdir(cache.dir)) == 2 and cache.lookup(1, info.attr) is None
    assert cache.put(_info(4, 10_000), b"d" * 10_000)  # full: 2 goes
    assert cache.lookup(2, _info(2, 10_000).attr) is None
    assert cache.lookup(3, _info(3, 10_000).attr) and cache.lookup(4, _info(4, 10_000).attr)
    cache.forget(4)  # the file changed elsewhere
    assert cache.lookup(4, _info(4, 10_000).attr) is None and len(os.listdir(cache.dir)) == 1
    # a copy of another version than the mount's newest attributes say is never named, and goes
    assert cache.lookup(3, _info(3, 10_001).attr) is None and len(os.listdir(cache.dir)) == 0
    assert not cache.put(_info(5, 30_000), b"e" * 30_000)  # larger than the budget: not copied
    cache.close()


def test_one_user_cannot_evict_another_below_an_equal_share(base):
    """Security review, round 3: the budget was the mount's, so anyone who may announce prefetches
    could evict every other user's copies. Now a user evicts only users holding more than it."""
    cache = ShmCache(base, budget=100_000)
    cache.open()
    victim, attacker = 1000, 2000
    for ino in range(1, 7):  # the victim's epoch: 60 KB of copies
        assert cache.put(_info(ino, 10_000), b"v" * 10_000, victim)
    for ino in range(100, 200):  # the attacker announces 1 MB
        cache.put(_info(ino, 10_000), b"a" * 10_000, attacker)
    assert cache.held(victim) == 50_000 and cache.held(attacker) == 50_000  # halves: the victim kept its share
    assert cache.used == 100_000 == sum(os.stat(cache.dir / n).st_size for n in os.listdir(cache.dir))
    assert all(cache.has(ino, ino * 10, 10_000) for ino in range(2, 7))  # its newest five copies
    # and the attacker's own copies make room for its next ones, never the victim's
    assert cache.put(_info(300, 10_000), b"a" * 10_000, attacker) and cache.held(victim) == 50_000
    cache.close()


def test_bytes_are_reserved_before_a_copy_is_written(base, monkeypatch):
    """Two copies written at once used to be counted only once written: both fit the same room."""
    import threading

    cache = ShmCache(base, budget=15_000)
    cache.open()
    both_writing = threading.Barrier(2, timeout=2.0)
    fchown = os.fchown

    def slow_fchown(fd, uid, gid):
        try:
            both_writing.wait()  # with reservations the second put never gets here: the first goes on alone
        except threading.BrokenBarrierError:
            pass
        fchown(fd, uid, gid)

    monkeypatch.setattr(shm_cache.os, "fchown", slow_fchown)
    results = []
    threads = [threading.Thread(target=lambda i=i: results.append(cache.put(_info(i, 10_000), b"x" * 10_000, 1000)))
               for i in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == [False, True]
    assert cache.used == 10_000 == sum(os.stat(cache.dir / n).st_size for n in os.listdir(cache.dir))
    cache.close()
