"""Passthrough's pure parts: the disk cache's whole-file form (key, check, LRU, replacement) and the
backing-id bookkeeping of client/passthrough.py, with a recording stand-in for the /dev/fuse ioctls
(the real ioctls are exercised on real mounts: tests/cluster/test_passthrough.py)."""

import os

import pytest

from stripefs.client import passthrough as pt_mod
from stripefs.client.disk_cache import DiskCache, WholeKey, content_key
from stripefs.client.passthrough import Passthrough
from stripefs.common.protocol import ChunkRef


def _refs(*versions, data_ino=0):
    return {i: ChunkRef(i, v, [1], data_ino) for i, v in enumerate(versions)}


def test_the_key_names_one_version():
    key = content_key(7, 100, _refs(5, 6))
    assert key == content_key(7, 100, list(_refs(5, 6).values())[::-1])  # order does not matter
    assert key != content_key(7, 100, _refs(5, 7))  # a chunk rewritten
    assert key != content_key(7, 99, _refs(5, 6))  # truncated
    assert key != content_key(8, 100, _refs(5, 6))
    assert key != content_key(7, 100, _refs(5, 6, data_ino=3))  # a snapshot's shared chunk
    assert key != (7, 100, key.digest)  # never equal to a chunk entry's key


def _cache(tmp_path, capacity=1 << 30):
    cache = DiskCache(tmp_path, "c", capacity=capacity, min_free=0)
    cache.scan()
    return cache


def _read_fd(fd):
    try:
        return os.pread(fd, 1 << 24, 0)
    finally:
        os.close(fd)


def test_a_whole_file_round_trips_survives_a_remount_and_replaces_its_older_version(tmp_path):
    cache = _cache(tmp_path)
    data = os.urandom(300_000)
    key = content_key(1, len(data), _refs(1))
    assert not cache.has_whole(key) and cache.open_whole(key) is None
    assert cache.put_whole(key, data) and cache.has_whole(key)
    assert _read_fd(cache.open_whole(key)) == data

    again = _cache(tmp_path)  # a remount finds it, and its checksum
    assert again.has_whole(key) and _read_fd(again.open_whole(key)) == data and again.used == len(data)

    dropped = []
    again.on_whole_dropped = dropped.append
    newer = content_key(1, 10, _refs(2))
    assert again.put_whole(newer, b"0123456789")
    assert dropped == [key] and not again.has_whole(key) and again.used == 10
    assert [p.name.split(".")[2] for p in tmp_path.rglob("*.w.*")] == ["10"]
    with pytest.raises(ValueError):
        again.put_whole(content_key(2, 5, _refs(1)), b"1234")  # the bytes must be the whole file


@pytest.mark.parametrize("damage", ["flip", "short", "long", "gone"])
def test_a_damaged_whole_file_is_dropped_not_served(tmp_path, damage, caplog):
    cache = _cache(tmp_path)
    data = os.urandom(200_000)
    key = content_key(3, len(data), _refs(4))
    cache.put_whole(key, data)
    dropped = []
    cache.on_whole_dropped = dropped.append
    (path,) = tmp_path.rglob("*.w.*")
    raw = bytearray(path.read_bytes())
    if damage == "flip":
        raw[150_000] ^= 1
        path.write_bytes(raw)
    elif damage == "short":
        path.write_bytes(raw[:-1])
    elif damage == "long":
        path.write_bytes(raw + b"x")
    else:
        path.unlink()
    assert cache.open_whole(key) is None
    assert dropped == [key] and not cache.has_whole(key) and cache.used == 0 and not path.exists()
    assert "unusable" in caplog.text


def test_whole_files_share_the_lru_and_the_capacity(tmp_path):
    cache = _cache(tmp_path, capacity=250_000)
    dropped = []
    cache.on_whole_dropped = dropped.append
    keys = [content_key(i, 100_000, _refs(1)) for i in range(3)]
    for key in keys[:2]:
        cache.put_whole(key, os.urandom(100_000))
    os.close(cache.open_whole(keys[0]))  # 0 is now the most recently used
    cache.put_whole(keys[2], os.urandom(100_000))
    assert dropped == [keys[1]] and cache.has_whole(keys[0]) and cache.has_whole(keys[2])
    assert cache.used <= cache.capacity


class _Device:
    """Records BACKING_OPEN/CLOSE as the kernel's table would."""

    def __init__(self):
        self.open_ids: dict[int, int] = {}  # id -> inode of the file registered
        self.next = 1
        self.refuse = None

    def backing_open(self, fd):
        if self.refuse:
            raise OSError(self.refuse, os.strerror(self.refuse))
        bid, self.next = self.next, self.next + 1
        self.open_ids[bid] = os.fstat(fd).st_ino
        return bid

    def backing_close(self, bid):
        del self.open_ids[bid]


def _passthrough(tmp_path, capacity=1 << 30):
    pt = Passthrough(_cache(tmp_path, capacity), data=None)
    pt.device = _Device()
    return pt


def test_an_id_is_registered_once_checked_and_retired_when_the_file_changes(tmp_path):
    pt = _passthrough(tmp_path)
    v1, v2 = content_key(5, 1000, _refs(1)), content_key(5, 1000, _refs(2))
    assert pt.backing_id(v1) == 0 and not pt.needs_registering(v1)  # nothing on disk: assemble, not register
    pt.disk.put_whole(v1, os.urandom(1000))
    assert pt.needs_registering(v1)
    bid = pt._register(v1)
    assert bid and pt.backing_id(v1) == bid and not pt.needs_registering(v1)
    assert pt.backing_id(v2) == 0  # another version never gets this id

    pt.forget_inodes([5])  # the feed: inode 5 changed
    assert pt.backing_id(v1) == 0
    assert pt.close_retired(grace=10.0) == 0 and bid in pt.device.open_ids  # kept while an opener may wake
    assert pt.close_retired(grace=0.0) == 1 and bid not in pt.device.open_ids

    bid = pt._register(v1)
    pt.disk.put_whole(v2, os.urandom(1000))  # a newer version written: the old whole file and its id go
    assert pt.backing_id(v1) == 0 and pt._register(v2)
    pt.close_retired(grace=0.0)
    assert bid not in pt.device.open_ids and len(pt.device.open_ids) == 1
    pt.forget_inodes(None)  # the feed lost its place: every id
    pt.close_retired(grace=0.0)
    assert pt.device.open_ids == {}


def test_eviction_damage_and_refusal_retire_or_skip(tmp_path, monkeypatch):
    pt = _passthrough(tmp_path, capacity=2500)
    keys = [content_key(i, 1000, _refs(1)) for i in range(3)]
    pt.disk.put_whole(keys[0], os.urandom(1000))
    bid = pt._register(keys[0])
    pt.disk.put_whole(keys[1], os.urandom(1000))
    pt.disk.put_whole(keys[2], os.urandom(1000))  # over the capacity: keys[0], least recently used, goes
    assert not pt.disk.has_whole(keys[0]) and pt.backing_id(keys[0]) == 0
    pt.close_retired(grace=0.0)
    assert bid not in pt.device.open_ids

    (path,) = [p for p in tmp_path.rglob("*.w.*") if p.name.startswith("1.")]
    path.write_bytes(b"y" * 1000)  # same size, other bytes
    assert pt._register(keys[1]) == 0 and pt.rejected == 1 and not pt.disk.has_whole(keys[1])

    pt.device.refuse = 40  # ELOOP: a backing file on a stacked file system
    assert pt._register(keys[2]) == 0 and pt.rejected == 2 and pt.device.open_ids == {}


def test_ids_are_bounded(tmp_path, monkeypatch):
    monkeypatch.setattr(pt_mod, "MAX_IDS", 2)
    pt = _passthrough(tmp_path)
    keys = [content_key(i, 10, _refs(1)) for i in range(3)]
    for key in keys:
        pt.disk.put_whole(key, b"0123456789")
        pt._register(key)
    pt.close_retired(grace=0.0)
    assert pt.backing_id(keys[0]) == 0 and all(pt.backing_id(k) for k in keys[1:])
    assert len(pt.device.open_ids) == 2


def test_ineligible_files_have_no_key(tmp_path):
    pt = _passthrough(tmp_path, capacity=8 << 20)  # limit: capacity / 8
    from stripefs.client.open_files import OpenFile
    from stripefs.common import protocol as p

    def of(size):
        attr = p.Attr(ino=9, mode=0o100644, nlink=1, uid=0, gid=0, rdev=0, size=size, atime_ns=0, mtime_ns=0, ctime_ns=0)
        return OpenFile(9, attr, None, _refs(1))

    assert pt.key_of(of(1000)) == content_key(9, 1000, _refs(1))
    assert pt.key_of(of(0)) is None and pt.key_of(of((1 << 20) + 1)) is None
    written = of(1000)
    written.size = 2000  # a write session of this mount: bytes not committed
    assert pt.key_of(written) is None
    assert isinstance(pt.key_of(of(1 << 20)), WholeKey)


def test_a_key_known_from_the_answer_the_file_took_is_reused_and_only_then(tmp_path):
    pt = _passthrough(tmp_path)
    from stripefs.client.open_files import OpenFile
    from stripefs.common import protocol as p

    attr = p.Attr(ino=9, mode=0o100644, nlink=1, uid=0, gid=0, rdev=0, size=10, atime_ns=0, mtime_ns=0, ctime_ns=0)
    of = OpenFile(9, attr, None, _refs(1))
    marker = WholeKey(9, 10, 12345)
    assert pt.key_of(of, (attr, marker)) is marker  # ``of`` holds that very answer
    other = p.Attr(ino=9, mode=0o100644, nlink=1, uid=0, gid=0, rdev=0, size=10, atime_ns=0, mtime_ns=0, ctime_ns=0)
    assert pt.key_of(of, (other, marker)) == content_key(9, 10, _refs(1))  # an equal but other answer: computed


def test_assembly_waits_in_a_bounded_queue(tmp_path, monkeypatch):
    monkeypatch.setattr(pt_mod, "ASSEMBLE_QUEUE", 2)
    pt = _passthrough(tmp_path)
    scheduled = []

    class _Token:
        def run_sync_soon(self, fn, *args):
            scheduled.append(args[0])

    pt.token = _Token()
    from stripefs.client.open_files import OpenFile
    from stripefs.common import protocol as p

    for ino in (1, 2, 3, 1):
        attr = p.Attr(ino=ino, mode=0o100644, nlink=1, uid=0, gid=0, rdev=0, size=10, atime_ns=0, mtime_ns=0,
                      ctime_ns=0)
        of = OpenFile(ino, attr, None, _refs(1))
        pt.want(pt.key_of(of), of)
    assert [k.ino for k in scheduled] == [1, 2]  # the third waits for room; a second open of 1 adds nothing


def test_the_mount_refuses_passthrough_without_root_or_a_disk_cache(monkeypatch):
    from stripefs.client import mount as mount_mod
    from stripefs.common import config as cfg
    from stripefs.common.errors import QuietError

    ok = cfg.ClientConfig(passthrough=True, disk_cache_dir="/nvme")
    monkeypatch.setattr(mount_mod.os, "geteuid", lambda: 0)
    mount_mod._check_passthrough(ok)
    for bad, says in ((cfg.ClientConfig(passthrough=True), "disk_cache_dir"),
                      (cfg.ClientConfig(passthrough=True, disk_cache_dir="/nvme", dataset=True), "dataset")):
        with pytest.raises(QuietError, match=says):
            mount_mod._check_passthrough(bad)
    monkeypatch.setattr(mount_mod.os, "geteuid", lambda: 1000)
    with pytest.raises(QuietError, match="root"):
        mount_mod._check_passthrough(ok)
