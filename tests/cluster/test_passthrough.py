"""FUSE passthrough from the disk cache (-o passthrough, root): a file whose current version sits
whole in disk_cache_dir is read by the kernel from the local disk, with no READ request to the
mount; a change made elsewhere is never read from the old backing file (client/passthrough.py,
docs/design.md "Passthrough from the disk cache")."""

import errno
import mmap
import os
import time

import pytest
from conftest import drop_caches
from test_kernel_cache import _all_released, _eventually, _read, _requests_at, _sent

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="passthrough needs a mount run as root")


def _whole_files(cache_dir):
    return sorted(p.name for p in cache_dir.rglob("*.w.*") if not p.name.startswith("."))


def _read_unbuffered(path):
    with open(path, "rb", buffering=0) as f:
        return f.read()


def _until_passed_through(mount, path, data, within: float = 20.0):
    """Open and read ``path`` until a read after drop_caches sends no READ (its whole file was
    written, then checked and registered at an open); the requests of that last read."""
    deadline = time.monotonic() + within
    while True:
        drop_caches()
        before = _requests_at(mount)
        assert _read_unbuffered(path) == data
        sent = _sent(before, _requests_at(mount))
        if "read" not in sent:
            return sent
        if time.monotonic() > deadline:
            pytest.fail(f"{path} still read through the mount: {sent}")
        time.sleep(0.1)


@pytest.fixture
def pt_mount(cluster, tmp_path):
    cache_dir = tmp_path / "nvme"
    cache_dir.mkdir()
    mount = cluster.mount_again("passthrough", f"passthrough,disk_cache_dir={cache_dir}")
    yield mount, cache_dir
    cluster.unmount(mount)
    cluster.extra_mounts.remove(mount)


def test_a_file_cached_whole_is_read_with_no_read_request(cluster, mnt, pt_mount):
    mount, cache_dir = pt_mount
    data = os.urandom(3 * 1024 * 1024 + 12345)  # several chunks, not a page multiple
    (mnt / "pt").write_bytes(data)
    path = mount / mnt.name / "pt"
    assert _read_unbuffered(path) == data  # read the normal way; its whole form is written after
    _eventually(lambda: _whole_files(cache_dir), within=20)
    _until_passed_through(mount, path, data)

    drop_caches()
    before = _all_released(mount)  # RELEASEs come after close() returned: none late on either side
    for _ in range(3):
        assert _read_unbuffered(path) == data
    with open(path, "rb") as f:  # a mapping goes to the backing file too
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            assert m[:4096] == data[:4096] and m[-100:] == data[-100:]
    with open(path, "rb") as f:
        f.seek(len(data) - 5000)
        assert f.read(10_000) == data[-5000:]  # a read past the end stops at the file's size
    sent = _sent(before, _all_released(mount))
    print("warm passthrough reads:", sent)
    assert "read" not in sent and "flush" not in sent, sent  # no READ; FOPEN_NOFLUSH: no FLUSH either
    assert sent.get("open") == 5 and sent.get("release") == 5, sent


def test_a_file_changed_through_another_mount_reads_its_new_bytes(cluster, mnt, pt_mount):
    mount, cache_dir = pt_mount
    old, new, shorter = os.urandom(500_000), os.urandom(700_000), os.urandom(1000)
    (mnt / "changing").write_bytes(old)
    path = mount / mnt.name / "changing"
    assert _read_unbuffered(path) == old
    _until_passed_through(mount, path, old)

    (mnt / "changing").write_bytes(new)  # another mount's change: new chunk versions, another size
    assert _read_unbuffered(path) == new  # never the old backing file
    _until_passed_through(mount, path, new)  # and the new version passes through once cached whole
    assert len(_whole_files(cache_dir)) == 1  # the old version's whole file went with it

    with open(mnt / "changing", "r+b") as f:  # same size, one chunk rewritten
        f.write(b"x" * 100)
    expect = b"x" * 100 + new[100:]
    assert _read_unbuffered(path) == expect

    os.truncate(mnt / "changing", 1000)  # truncated elsewhere
    assert _read_unbuffered(path) == expect[:1000]
    (mnt / "changing").write_bytes(shorter)
    assert _read_unbuffered(path) == shorter
    _until_passed_through(mount, path, shorter)


def test_a_damaged_or_short_whole_file_is_never_served(cluster, mnt, pt_mount):
    mount, cache_dir = pt_mount
    files = {name: os.urandom(200_000) for name in ("damaged", "short")}
    for name, data in files.items():
        (mnt / name).write_bytes(data)
        assert _read_unbuffered(mount / mnt.name / name) == data
    _eventually(lambda: len(_whole_files(cache_dir)) == 2, within=20)
    # each whole file is checked at its first open after it is written: spoil them before that
    for p in cache_dir.rglob("*.w.*"):
        raw = bytearray(p.read_bytes())
        if p.name.split(".")[0] == str(os.stat(mnt / "damaged").st_ino):
            raw[1000] ^= 0xFF
            p.write_bytes(raw)
        else:
            p.write_bytes(raw[:-1])
    drop_caches()
    for name, data in files.items():
        before = _requests_at(mount)
        assert _read_unbuffered(mount / mnt.name / name) == data  # the normal path, never the bad bytes
        assert "read" in _sent(before, _requests_at(mount))
    for name, data in files.items():
        _until_passed_through(mount, mount / mnt.name / name, data)  # written again from the chunks


def test_opens_beside_a_passthrough_one_and_writes_through_this_mount(cluster, mnt, pt_mount):
    """The kernel lets an inode's open files be passthrough (one backing file) or not, never both
    (any other open fails EIO): an open for writing beside passthrough ones is refused ETXTBSY (after
    waiting for a RELEASE on its way), and a read open beside a cached one is not passed through."""
    mount, _ = pt_mount
    data = os.urandom(400_000)
    (mnt / "shared").write_bytes(data)
    path = mount / mnt.name / "shared"
    assert _read_unbuffered(path) == data
    _until_passed_through(mount, path, data)

    with open(path, "rb", buffering=0) as reader:  # passthrough
        with pytest.raises(OSError) as refused:
            open(path, "r+b", buffering=0)  # the kernel allows no cached or direct open beside it
        assert refused.value.errno == errno.ETXTBSY
        assert reader.read(20) == data[:20]
    with open(path, "r+b", buffering=0) as writer:  # right after the reader's close (its RELEASE may be on its way)
        assert writer.read(10) == data[:10]
        writer.seek(0)
        writer.write(b"z" * 10)
    expect = b"z" * 10 + data[10:]
    assert _read_unbuffered(path) == expect and _read_unbuffered(mnt / "shared") == expect

    with open(path, "rb", buffering=0) as cached:  # not registered yet (a new version): a cached open
        assert cached.read(100) == expect[:100]
        _until_whole = time.monotonic() + 20
        while not any(str(os.stat(path).st_ino) == n.split(".")[0] for n in _whole_files(pt_mount[1])):
            assert time.monotonic() < _until_whole
            time.sleep(0.05)
        assert _read_unbuffered(path) == expect  # registered now, but a cached open is there: not passed through
        assert cached.read() == expect[100:]
    _until_passed_through(mount, path, expect)


def test_an_evicted_whole_file_is_read_the_normal_way(cluster, mnt, tmp_path):
    from conftest import client_config
    from stripefs.common import config as cfg

    cache_dir = tmp_path / "small-nvme"
    cache_dir.mkdir()
    toml = client_config(tmp_path / "client.toml", disk_cache_size=cfg.Size(8 << 20))  # whole files up to 1 MiB
    mount = cluster.mount_again("pt_small", f"passthrough,disk_cache_dir={cache_dir},config={toml}")
    try:
        first = os.urandom(600_000)
        (mnt / "first").write_bytes(first)
        path = mount / mnt.name / "first"
        assert _read_unbuffered(path) == first
        _until_passed_through(mount, path, first)
        ino = str(os.stat(path).st_ino)

        others = {}
        for i in range(30):  # other files' chunks and whole files push the first one's out (LRU)
            others[i] = os.urandom(600_000)
            (mnt / f"other{i}").write_bytes(others[i])
            assert _read_unbuffered(mount / mnt.name / f"other{i}") == others[i]
            time.sleep(0.1)
            if not any(n.split(".")[0] == ino for n in _whole_files(cache_dir)):
                break
        else:
            pytest.fail("the first file's whole form was never evicted")
        drop_caches()
        before = _requests_at(mount)
        assert _read_unbuffered(path) == first
        assert "read" in _sent(before, _requests_at(mount))  # its backing id went with it
        _until_passed_through(mount, path, first)
    finally:
        cluster.unmount(mount)
        cluster.extra_mounts.remove(mount)


def test_passthrough_is_refused_without_what_it_needs(cluster, tmp_path):
    from conftest import run_cli

    target = tmp_path / "m"
    target.mkdir()
    res = run_cli("mount", cluster.meta_address, str(target), "-o", "passthrough", check=False)
    assert res.returncode != 0 and "disk_cache_dir" in res.stderr
    res = run_cli("mount", cluster.meta_address, str(target), "-o", f"passthrough,dataset,disk_cache_dir={tmp_path}",
                  check=False)
    assert res.returncode != 0 and "dataset" in res.stderr


def test_whole_files_survive_a_remount_and_need_no_storage_node(cluster, mnt, tmp_path):
    cache_dir = tmp_path / "nvme-kept"
    cache_dir.mkdir()
    options = f"passthrough,disk_cache_dir={cache_dir}"
    files = {f"kept{i}": os.urandom(100_000 + i) for i in range(3)}
    for name, data in files.items():
        (mnt / name).write_bytes(data)
    mount = cluster.mount_again("pt_kept", options)
    try:
        for name, data in files.items():
            assert _read_unbuffered(mount / mnt.name / name) == data
        _eventually(lambda: len(_whole_files(cache_dir)) == len(files), within=20)
    finally:
        cluster.unmount(mount)
        cluster.extra_mounts.remove(mount)

    mount = cluster.mount_again("pt_kept", options)  # a new mount finds them (scan), checks them at the first open
    stopped = list(cluster.pids()["storage"].values())
    for pid in stopped:
        os.kill(pid, 19)  # SIGSTOP: nothing can come from the network now
    try:
        for name, data in files.items():  # (the listing and open information come from the daemon)
            assert _read_unbuffered(mount / mnt.name / name) == data
        drop_caches()
        before = _requests_at(mount)
        for name, data in files.items():
            assert _read_unbuffered(mount / mnt.name / name) == data
        sent = _sent(before, _requests_at(mount))
        assert "read" not in sent and sent.get("open") == len(files), sent
    finally:
        for pid in stopped:
            os.kill(pid, 18)
        cluster.unmount(mount)
        cluster.extra_mounts.remove(mount)
