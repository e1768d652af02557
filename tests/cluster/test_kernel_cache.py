"""The kernel-cache policy: the change feed, dataset mode, sampler-order prefetch.

A second mount in dataset mode caches names, attributes and pages in the
kernel for minutes; these tests check that changes made through the main
mount still reach it within the documented bound (client/kernel_cache.py),
also across a metadata daemon restart, and that prefetched files are served
without the storage nodes.
"""

import errno
import json
import mmap
import os
import stat
import subprocess
import time
import urllib.request

import pytest
from conftest import drop_caches, run_cli
from prometheus_client.parser import text_string_to_metric_families
from util import cache_drops, caches_kept

from stripefs.client import metrics as client_metrics

from stripefs.common.protocol import EVENTS_SILENCE_S
from stripefs.torch import PrefetchSampler

# what these tests assert lives in the kernel's caches (pages prefetched into them, names and attributes that
# spare requests): other test processes' drop_caches() waits while one runs (tests/util.py)
pytestmark = pytest.mark.warm_caches

#: a change elsewhere is visible to a dataset mount within this (documented bound + slack for a busy machine)
BOUND_S = EVENTS_SILENCE_S + 2.0


def _eventually(check, within: float = BOUND_S):
    """Poll ``check`` until it returns truthy; the seconds it took (fails after ``within``)."""
    start = time.monotonic()
    while True:
        result = check()
        if result:
            return time.monotonic() - start
        if time.monotonic() - start > within:
            pytest.fail(f"not visible within {within:.1f}s")
        time.sleep(0.05)


def _read(path):
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        return None


@pytest.fixture(scope="module")
def dataset(cluster):
    mnt = cluster.mount_again("dataset", "dataset")
    yield mnt
    cluster.unmount(mnt)
    cluster.extra_mounts.remove(mnt)


def test_dataset_mount_sees_changes_within_the_bound(cluster, mnt, dataset):
    theirs = dataset / mnt.name
    (mnt / "f").write_bytes(b"version 1")
    (mnt / "sub").mkdir()
    (mnt / "sub" / "g").write_bytes(b"in sub")
    assert _read(theirs / "f") == b"version 1"
    assert _read(theirs / "f") == b"version 1"  # warm: from the kernel's caches
    assert sorted(os.listdir(theirs)) == ["f", "sub"]

    (mnt / "f").write_bytes(b"version 2")  # same size: only the data changed
    _eventually(lambda: _read(theirs / "f") == b"version 2")

    with open(mnt / "f", "ab") as f:
        f.write(b" and more")
    _eventually(lambda: os.stat(theirs / "f").st_size == len(b"version 2 and more"))
    assert _read(theirs / "f") == b"version 2 and more"

    os.rename(mnt / "f", mnt / "renamed")
    _eventually(lambda: _read(theirs / "f") is None and _read(theirs / "renamed") == b"version 2 and more")

    (mnt / "sub" / "g").unlink()
    _eventually(lambda: not os.path.exists(theirs / "sub" / "g"))
    (mnt / "sub" / "new").write_bytes(b"created")
    _eventually(lambda: _read(theirs / "sub" / "new") == b"created")

    # no-opendir: the kernel keeps the listing; the feed's invalidation of the directory drops it
    assert sorted(os.listdir(theirs / "sub")) == ["new"]
    (mnt / "sub" / "newer").write_bytes(b"")
    _eventually(lambda: sorted(os.listdir(theirs / "sub")) == ["new", "newer"])
    (mnt / "sub" / "newer").unlink()
    _eventually(lambda: sorted(os.listdir(theirs / "sub")) == ["new"])

    os.chmod(mnt / "sub" / "new", 0o600)
    _eventually(lambda: os.stat(theirs / "sub" / "new").st_mode & 0o777 == 0o600)


def _requests_at(mountpoint=None, url: str = "", name: str = "stripefs_fuse_requests_total",
                 label: str = "opcode") -> dict[str, float]:
    """stripefs_fuse_requests_total by opcode: every request the mount's own FUSE session read
    (or another counter ``name`` of the mount, by ``label``)."""
    url = url or f"http://{client_metrics.find_state(mountpoint)['metrics']}/metrics"
    with urllib.request.urlopen(url, timeout=10) as rsp:
        text = rsp.read().decode()
    return {s.labels[label]: s.value for family in text_string_to_metric_families(text)
            for s in family.samples if s.name == name}


def test_a_warm_file_of_a_dataset_mount_is_read_with_no_request(mnt, dataset):
    """No-open: the dataset mount declines OPEN (ENOSYS, once per connection) and FLUSH, so a warm
    file is read by the kernel alone: counted in the session, requests no handler sees included."""
    data = os.urandom(150_000)
    (mnt / "warm").write_bytes(data)
    theirs = dataset / mnt.name / "warm"
    _eventually(lambda: _read(theirs) == data)
    with caches_kept():
        _read(theirs)  # the reader's fstat after the first read may ask a GETATTR (atime): before counting
        listing = os.listdir(theirs.parent)
        before = _requests_at(dataset)
        for _ in range(3):
            with open(theirs, "rb", buffering=0) as f:
                assert f.read() == data
            os.stat(theirs)
        after = _requests_at(dataset)
        for _ in range(3):
            assert os.listdir(theirs.parent) == listing
        listed = _requests_at(dataset)
    assert {op: n - before.get(op, 0) for op, n in after.items() if n != before.get(op, 0)} == {}
    # no-opendir: the kernel keeps the listing (it may check the directory's mtime: a GETATTR)
    assert not {op for op, n in listed.items() if n != after.get(op, 0)} - {"getattr"}, (after, listed)
    assert after.get("open", 0) <= 1 and "release" not in after  # OPEN declined for good at the first


def test_a_warm_file_of_a_per_open_mount_costs_an_open_and_a_release(cluster):
    """With per_open_handles the mount keeps OPEN (a handle per open file); a file opened for reading
    is closed with no FLUSH (FOPEN_NOFLUSH) and read from the kept page cache: per warm read one
    OPEN and one RELEASE, both answered on the session's reader thread. A buffered open() adds
    its isatty() IOCTL, which the session answers itself: no handler sees it."""
    mnt = cluster.mount_again("per_open", "per_open_handles=yes")
    try:
        _per_open_reads(mnt)
    finally:
        cluster.unmount(mnt)
        cluster.extra_mounts.remove(mnt)


def _per_open_reads(mnt) -> None:
    data = os.urandom(150_000)
    (mnt / "warm_default").write_bytes(data)
    path = mnt / "warm_default"
    url = f"http://{client_metrics.find_state(mnt)['metrics']}/metrics"
    with caches_kept():
        _read(path)
        _read(path)
        before = _all_released(url=url)  # the warm-up reads' RELEASEs may still be on their way
        for _ in range(3):
            with open(path, "rb", buffering=0) as f:
                assert f.read() == data
        after = _all_released(url=url)
        handled = _requests_at(url=url, name="stripefs_fuse_ops_total", label="op")
        for _ in range(3):
            assert _read(path) == data  # buffered
        buffered = _all_released(url=url)
        handled_buffered = _requests_at(url=url, name="stripefs_fuse_ops_total", label="op")
    sent = {op: n - before.get(op, 0) for op, n in after.items() if n != before.get(op, 0)}
    assert sent.get("open") == 3 and sent.get("release") == 3, sent
    assert not set(sent) - {"open", "release", "lookup", "getattr"}, sent  # no FLUSH, no READ
    sent = {op: n - after.get(op, 0) for op, n in buffered.items() if n != after.get(op, 0)}
    assert sent.get("open") == 3 and sent.get("release") == 3 and sent.get("ioctl") == 3, sent
    assert not set(sent) - {"open", "release", "ioctl", "lookup", "getattr"}, sent
    assert handled_buffered.get("ioctl", 0) == handled.get("ioctl", 0)  # answered by the session alone


def _all_released(mountpoint=None, url: str = "") -> dict:
    """The request counts once every OPEN and CREATE so far has had its RELEASE: the kernel sends a
    close's RELEASE after close() returned (fs/fuse/file.c fuse_file_put), so without this wait a
    count could miss the last one or a later count take in an earlier one."""
    counts = {}

    def settled():
        counts.update(_requests_at(mountpoint, url))
        return counts.get("release", 0) >= counts.get("open", 0) + counts.get("create", 0)

    _eventually(settled)
    return counts


def _sent(before: dict, after: dict) -> dict:
    return {op: n - before.get(op, 0) for op, n in after.items() if n != before.get(op, 0)}


def test_a_warm_file_of_a_no_open_default_mount_costs_no_request(cluster, mnt):
    """per_open_handles=no: the mount declines OPEN (ENOSYS, once per connection), so a warm read
    sends no OPEN and no RELEASE, and its first FLUSH too (closes that send nothing: docs/design.md),
    so a warm read sends nothing at all; a buffered open() sends its isatty() IOCTL, which the
    session answers itself. Close-to-open holds both ways with the main mount."""
    theirs = cluster.mount_again("no_open", "per_open_handles=no")
    try:
        data = os.urandom(150_000)
        path = theirs / mnt.name / "warm_no_open"  # (``mnt`` is the test's directory of the main mount)
        path.write_bytes(data)
        assert (mnt / "warm_no_open").read_bytes() == data  # committed at its close
        with caches_kept():
            _read(path)
            _read(path)
            rounds = []
            for _ in range(3):  # (ci70: the first round once sent a GETATTR. The writer's own commit, made
                # when the main mount's read recalled it, comes back on the feed and has the kernel drop
                # the inode's attributes; on a loaded machine that event can land after the two reads
                # above. Once applied, a round sends nothing)
                before = _requests_at(theirs)
                for _ in range(3):
                    with open(path, "rb", buffering=0) as f:
                        assert f.read() == data
                after = _requests_at(theirs)
                rounds.append(_sent(before, after))
                if not rounds[-1]:
                    break
            handled = _requests_at(theirs, name="stripefs_fuse_ops_total", label="op")
            for _ in range(3):
                assert _read(path) == data  # buffered
            buffered = _requests_at(theirs)
            handled_buffered = _requests_at(theirs, name="stripefs_fuse_ops_total", label="op")
        print("unbuffered, rounds of 3 warm reads:", rounds, "buffered:", _sent(after, buffered))
        assert rounds[-1] == {} and all(set(r) <= {"getattr"} for r in rounds), rounds
        assert _sent(after, buffered) == {"ioctl": 3}
        # declined for good at the first that finds the feed followed (one before it may commit as before)
        assert buffered.get("flush", 0) <= 2, buffered
        assert handled_buffered.get("ioctl", 0) == handled.get("ioctl", 0)  # answered by the session alone
        # OPEN declined for good at the first; a RELEASE only of the CREATE's open file (fh 0, this kernel sends it)
        assert after.get("open", 0) <= 1 and after.get("release", 0) <= 1, after
        (mnt / "warm_no_open").write_bytes(b"changed elsewhere")  # close-to-open the other way
        assert _read(path) == b"changed elsewhere"
        _first_warm_epoch(mnt, theirs)
    finally:
        cluster.unmount(theirs)
        cluster.extra_mounts.remove(theirs)


def _first_warm_epoch(mnt, theirs) -> None:
    """A DataLoader's first warm epoch on the no-open default mount: the cold read's READ made the
    kernel mark the inode's atime stale (fs/fuse/file.c fuse_invalidate_atime: every READ answered,
    unless the superblock is read-only), so the next read's fstat (Python's open() and readall())
    asks one GETATTR; its answer clears the mark, and later reads send nothing (no FLUSH either).
    Nothing else: the name and attributes are held under the callback (no LOOKUP), the pages kept
    (no READ). A dataset mount (``ro``) sends none of these (docs/design.md, issue 29's count)."""
    data = os.urandom(110_000)  # one sample of bench/dataloader.py's raw workload
    (mnt / "first_warm").write_bytes(data)  # written by the other mount: these pages are not here
    path = theirs / mnt.name / "first_warm"
    with caches_kept():
        counts = [_requests_at(theirs)]
        for _ in range(3):
            with open(path, "rb", buffering=0) as f:
                assert f.read() == data
            counts.append(_requests_at(theirs))
    cold, first_warm, warm = (_sent(a, b) for a, b in zip(counts, counts[1:]))
    print("cold:", cold, "first warm:", first_warm, "warm:", warm)
    assert cold.get("read", 0) >= 1 and "flush" not in cold, cold
    assert first_warm == {"getattr": 1}, first_warm  # the atime mark's GETATTR
    assert warm == {}, warm


def test_files_created_on_a_fresh_no_open_mount_send_no_release(cluster):
    """A created file's close sends a RELEASE only while the kernel has not learned no-open, which
    only an OPEN answered ENOSYS teaches it (a CREATE does not): on a fresh mount that only creates,
    the mount opens its first created file itself (client/no_open_primer.py). Per empty file then:
    LOOKUP (the name is new), CREATE and the directory's GETATTR (the kernel drops its attributes at
    every create: default_permissions asks them again); no FLUSH (closes that send nothing).
    Without the primer, one RELEASE per file more."""
    theirs = cluster.mount_again("fresh_creates", "per_open_handles=no")
    try:
        d = theirs / "creates"
        d.mkdir()
        os.close(os.open(d / "first", os.O_CREAT | os.O_WRONLY, 0o644))
        _eventually(lambda: _requests_at(theirs).get("open", 0) >= 1)  # the primer's OPEN, declined
        before = _requests_at(theirs)
        n = 100
        for i in range(n):
            os.close(os.open(d / f"f{i}", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
        after = _requests_at(theirs)
        sent = _sent(before, after)
        print(f"{n} creates:", sent)
        assert "release" not in sent, sent
        assert {op for op, k in sent.items() if k >= n // 2} == {"lookup", "create", "getattr"}, sent
        assert sum(sent.values()) <= 4 * n + 5, sent
        assert sorted(os.listdir(d)) == sorted(["first"] + [f"f{i}" for i in range(n)])
    finally:
        cluster.unmount(theirs)
        cluster.extra_mounts.remove(theirs)


def _write_at_once(path) -> None:
    fd = os.open(path, os.O_RDWR)
    try:
        os.write(fd, b"x")
    finally:
        os.close(fd)


def test_dataset_mount_is_read_only(mnt, dataset):
    (mnt / "f").write_bytes(b"data")
    theirs = dataset / mnt.name
    _eventually(lambda: os.path.exists(theirs / "f"))
    attempts = [
        lambda: open(theirs / "new", "wb"),
        lambda: _write_at_once(theirs / "f"),  # a ro mount: the kernel refuses the open itself
        lambda: open(theirs / "f", "wb"),
        lambda: os.mkdir(theirs / "d"),
        lambda: os.unlink(theirs / "f"),
        lambda: os.rename(theirs / "f", theirs / "g"),
        lambda: os.chmod(theirs / "f", 0o600),
        lambda: os.truncate(theirs / "f", 0),
        lambda: os.symlink("f", theirs / "l"),
        lambda: os.setxattr(theirs / "f", "user.k", b"v"),
    ]
    for attempt in attempts:
        with pytest.raises(OSError) as exc:
            attempt()
        assert exc.value.errno == errno.EROFS
    assert _read(mnt / "f") == b"data"
    assert _read(theirs / "f") == b"data"
    with open("/proc/self/mounts") as f:
        options = next(line.split()[3] for line in f if line.split()[1] == str(dataset))
    assert "ro" in options.split(","), options  # read-only in the kernel, not only in its answers


def test_prefetch_reaches_a_read_only_dataset_mount(mnt, dataset):
    """A read-only mount refuses setxattr: the sampler's announcement goes as an ioctl there."""
    paths = []
    for i in range(6):
        (mnt / f"ro{i}").write_bytes(os.urandom(30_000 + i))
        paths.append(dataset / mnt.name / f"ro{i}")
    _eventually(lambda: all(os.path.exists(p) for p in paths))

    before = _prefetch_report(dataset)["fetched"]
    assert list(PrefetchSampler(range(len(paths)), paths=paths, lookahead=len(paths))) == list(range(len(paths)))
    _eventually(lambda: (r := _prefetch_report(dataset))["pending"] == 0 and r["fetched"] >= before + len(paths), within=30)


def test_dataset_mount_follows_a_metadata_daemon_restart(cluster, mnt, dataset):
    theirs = dataset / mnt.name
    (mnt / "f").write_bytes(b"before")
    _eventually(lambda: _read(theirs / "f") == b"before")
    cluster.kill_meta()
    cluster.restart()
    (mnt / "f").write_bytes(b"after!")  # the new daemon boot numbers its changes from 1 again
    _eventually(lambda: _read(theirs / "f") == b"after!", within=BOUND_S + 10)
    # the mount noticed (silence, then a new boot) rather than trusting its cache
    _eventually(lambda: "dropping the kernel's cache" in cluster.logs()["dataset.log"], within=BOUND_S + 10)
    # and follows the new daemon's feed (maybe on another port): later changes arrive as events again
    (mnt / "f").write_bytes(b"again!")
    _eventually(lambda: _read(theirs / "f") == b"again!")


def _samples(mnt, folder: str, folders: int, count: int, size: int) -> dict:
    """``count`` files of random bytes (``size + i`` each) spread over ``folders`` folders: path -> bytes."""
    contents = {}
    for i in range(count):
        path = mnt / f"{folder}{i % folders}" / f"sample{i}.bin"
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(os.urandom(size + i))
        contents[path] = path.read_bytes()
    for d in {path.parent for path in contents}:  # committed now, not within 0.1 s of the last write:
        fd = os.open(d, os.O_RDONLY)  # their commits' events would land in the prefetch (not pushed then)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    return contents


def _dropped_meanwhile(sent: dict, drops: int) -> str:
    """A failed count of requests, and whether the machine's caches were dropped since ``drops``
    (``cache_drops()``): a program that ignores the tests' lock did it (stripefs/page_cache.py; a drop
    of pages only leaves exactly one READ a pushed file)."""
    meanwhile = cache_drops() - drops
    return f"{sent}; caches dropped {meanwhile} time(s) meanwhile by something that ignores the lock" if meanwhile else str(sent)


def _prefetch_report(mnt) -> dict[str, int]:
    """The prefetcher's counters, from the mount root's ``user.stripefs.prefetch`` xattr."""
    text = os.getxattr(mnt, "user.stripefs.prefetch").decode()
    return {k: int(v) for k, v in (item.split("=") for item in text.split())}


def test_sampler_order_prefetch_serves_without_storage_nodes(cluster, mnt):
    contents = _samples(mnt, "d", 4, 40, 50_000)
    files = list(contents)
    drop_caches()
    os.listdir(mnt)  # the kernel knows the directories again
    for d in range(4):
        os.listdir(mnt / f"d{d}")  # readdirplus: the kernel knows the files, so they can go into its page cache

    drops = cache_drops()  # pages pushed into the page cache are gone after a drop_caches, by anyone
    order = list(reversed(range(len(files))))
    sampler = PrefetchSampler(order, paths=files, lookahead=len(files))
    assert len(sampler) == len(files)
    first = next(iter(sampler))  # announces everything (lookahead covers the epoch)
    assert first == order[0]

    _eventually(lambda: _prefetch_report(cluster.mnt)["pending"] == 0, within=30)
    assert _prefetch_report(cluster.mnt)["fetched"] >= len(files)
    assert _prefetch_report(cluster.mnt)["stored"] >= len(files)  # the kernel knew every inode: all went into its page cache

    # every prefetched byte is now local: reads must not need a storage node
    stopped = list(cluster.pids()["storage"].values())
    for pid in stopped:
        os.kill(pid, 19)  # SIGSTOP: a node that answers nothing
    try:
        with caches_kept():
            before = _requests_at(cluster.mnt)
            for path in files:
                with open(path, "rb", buffering=0) as f:
                    assert f.read() == contents[path]
            after = _requests_at(cluster.mnt)
    finally:
        for pid in stopped:
            os.kill(pid, 18)  # SIGCONT
    # pages pushed by NOTIFY_STORE came without a READ, so the kernel never marked the files' atime
    # stale: their first read asks no GETATTR either, as a READ-filled file's next read does
    # (docs/design.md, "What a warm sample still sends on the default mount")
    sent = _sent(before, after)
    print("first reads of 40 pushed files:", sent)
    assert not {"read", "getattr"} & set(sent), _dropped_meanwhile(sent, drops)


def test_a_later_epoch_costs_no_resolution_and_read_file_reads_the_pushed_pages(cluster, mnt):
    """The default mount: the first epoch after a listing resolves nothing (the listing's open
    information, Operations.known_open_info), and a second epoch's announcement of files whose
    pushed pages the kernel still holds is answered from what the mount knows
    (Operations.path_in_page_cache): no LookupPathsReq, no fetch. read_file reads through the mount, where those pages answer it:
    no request at all (no GETXATTR, no READ, and no FLUSH: closes that send nothing)."""
    from stripefs import torch as sft

    contents = _samples(mnt, "e", 3, 30, 40_000)
    files = list(contents)

    def report():  # (the mount's counters now)
        return _prefetch_report(cluster.mnt)

    def lookups():
        return _requests_at(cluster.mnt, name="stripefs_rpc_seconds_count", label="type").get("LookupPathsReq", 0)

    drop_caches()  # the pages written go: the prefetch fetches them
    with caches_kept():
        for d in range(3):
            os.listdir(mnt / f"e{d}")  # readdirplus: the kernel knows the files, so they can go into its page cache
        before, resolved, drops = report(), lookups(), cache_drops()
        sampler = sft.PrefetchSampler(range(len(files)), paths=files, lookahead=len(files), batch=7)
        next(iter(sampler))  # the first epoch: announces everything, 7 paths an ioctl
        _eventually(lambda: report()["pending"] == 0, within=30)
        first = report()
        assert first["fetched"] - before["fetched"] == len(files) and first["stored"] - before["stored"] == len(files)
        # the listings kept every file's open information under their callbacks: nothing to resolve
        assert lookups() == resolved

        next(iter(sampler))  # the next epoch: the same files, their pages still in the kernel
        _eventually(lambda: report()["pending"] == 0, within=30)
        second = report()
        assert second["kept"] - first["kept"] == len(files), second
        assert second["fetched"] == first["fetched"]  # nothing fetched again
        assert lookups() == resolved  # nor resolved: the mount knew every name and version

        sent_before = _requests_at(cluster.mnt)
        for path in files:
            assert sft.read_file(path) == contents[path]
        sent = _sent(sent_before, _requests_at(cluster.mnt))
    print("read_file of 30 pushed files:", sent)
    assert not {"getxattr", "read", "open", "flush"} & set(sent), _dropped_meanwhile(sent, drops)


def test_prefetch_of_missing_paths_is_harmless(cluster, mnt):
    (mnt / "real").write_bytes(b"x" * 1000)
    sampler = PrefetchSampler([0, 1], paths=[mnt / "missing", mnt / "real"])
    assert list(sampler) == [0, 1]
    assert (mnt / "real").read_bytes() == b"x" * 1000


def test_disk_cache_survives_a_remount_and_never_serves_old_versions(cluster, mnt, tmp_path):
    cache_dir = tmp_path / "nvme"
    cache_dir.mkdir()
    files = {mnt / f"f{i}": os.urandom(300_000 + i) for i in range(5)}
    for path, data in files.items():
        path.write_bytes(data)

    cached = cluster.mount_again("cached", f"disk_cache_dir={cache_dir}")
    theirs = {cached / mnt.name / p.name: data for p, data in files.items()}
    for path, data in theirs.items():
        assert path.read_bytes() == data
    _eventually(lambda: len(list(cache_dir.rglob("*.*.*"))) >= len(files))  # written in the background
    cluster.unmount(cached)

    stopped = list(cluster.pids()["storage"].values())
    for pid in stopped:
        os.kill(pid, 19)  # SIGSTOP: nothing can come from the network now
    try:
        cluster.mount_again("cached", f"disk_cache_dir={cache_dir}")
        for path, data in theirs.items():
            assert path.read_bytes() == data  # from the disk cache, after a remount
    finally:
        for pid in stopped:
            os.kill(pid, 18)

    first = next(iter(files))
    first.write_bytes(b"new version")
    assert _read(first) == b"new version"
    _eventually(lambda: _read(cached / mnt.name / first.name) == b"new version")
    cluster.unmount(cached)
    cluster.extra_mounts.remove(cached)
    cluster.extra_mounts.remove(cached)


def test_the_disk_cache_never_keeps_a_chunk_of_an_open_write_session(cluster, mnt, tmp_path):
    """A read during a write session sends the session's bytes and reads them back at the session's
    version; later sends of the same chunk store other bytes under that version. Such a read must
    not fill the disk cache (keyed by version, kept across remounts): the committed version would
    be served from it with the bytes of the read (tests/datapath_model.py found it: zeros)."""
    cache_dir = tmp_path / "nvme"
    cache_dir.mkdir()
    writer = cluster.mount_again("dc_writer", f"disk_cache_dir={cache_dir}")
    path = writer / mnt.name / "session"
    path.write_bytes(b"0" * (6 << 20))  # not a small file (the write-back sends those after close)
    fd = os.open(path, os.O_RDWR)
    direct = os.open(path, os.O_RDONLY | os.O_DIRECT)  # (closed last: on this no-open mount every close commits)
    try:
        os.pwrite(fd, b"A" * 1000, 0)
        buf = mmap.mmap(-1, 8192)
        assert os.preadv(direct, [buf], 0) == 8192 and buf[:1000] == b"A" * 1000  # sends A, reads it back
        time.sleep(1.0)  # (the disk cache is written in the background)
        os.pwrite(fd, b"B" * 1000, 2000)  # the same chunk, the same session: sent again at its version
        os.close(fd)  # commits
    finally:
        os.close(direct)
    expect = b"A" * 1000 + b"0" * 1000 + b"B" * 1000 + b"0" * ((6 << 20) - 3000)
    cluster.unmount(writer)
    cluster.extra_mounts.remove(writer)
    again = cluster.mount_again("dc_writer", f"disk_cache_dir={cache_dir}")  # a fresh memory cache, the same disk
    try:
        assert (again / mnt.name / "session").read_bytes() == expect
    finally:
        cluster.unmount(again)
        cluster.extra_mounts.remove(again)


def test_warmup_loads_a_tree_so_reads_need_no_storage_node(cluster, mnt):
    data = {}
    for i in range(30):
        path = mnt / f"c{i % 3}" / f"img{i}.jpg"
        path.parent.mkdir(exist_ok=True)
        data[path] = os.urandom(20_000 + 7 * i)
        path.write_bytes(data[path])
    big = mnt / "shard.tar"
    data[big] = os.urandom(20 << 20)  # above the prefetcher's limit: warmup reads it itself
    big.write_bytes(data[big])
    drop_caches()

    result = run_cli("warmup", str(mnt))
    assert f"warmed {len(data)} of {len(data)} files" in result.stdout, result.stdout + result.stderr
    stopped = list(cluster.pids()["storage"].values())
    for pid in stopped:
        os.kill(pid, 19)
    try:
        for path, content in data.items():
            assert path.read_bytes() == content
    finally:
        for pid in stopped:
            os.kill(pid, 18)

    missing = run_cli("warmup", str(mnt / "nope"), check=False)
    assert missing.returncode == 1 and "No such file" in missing.stderr


def test_shared_memory_prefetch_hands_files_to_readers_and_never_old_ones(cluster, mnt, second, dataset):
    from stripefs import torch as sft

    # a dataset mount keeps no copies: a prefetched file is in the kernel's page cache there, read
    # with no request at all, so read_file reads through it (Operations._shm_copies)
    assert os.getxattr(dataset, "user.stripefs.shm_dir") == b""
    for i in range(20):
        (mnt / f"s{i}").write_bytes(os.urandom(10_000 + i))
    theirs_root, _port = second
    theirs = theirs_root / mnt.name
    _eventually(lambda: len(os.listdir(theirs)) == 20)
    paths = [theirs / f"s{i}" for i in range(20)]
    expected = {p: (mnt / p.name).read_bytes() for p in paths}
    shm = os.getxattr(theirs_root, "user.stripefs.shm_dir").decode()
    assert os.path.isdir(shm) and stat.S_IMODE(os.stat(shm).st_mode) == 0o711  # nobody else lists or plants

    sampler = sft.PrefetchSampler(range(20), paths=paths, lookahead=20, shm=True)
    order = iter(sampler)
    next(order)  # announces all 20

    def copied(path):
        try:
            return os.path.exists(os.path.join(shm, os.getxattr(path, "user.stripefs.shm_copy").split()[0].decode()))
        except OSError:
            return False

    _eventually(lambda: all(copied(p) for p in paths), within=30)  # other tests' copies may be there too
    for copy in os.listdir(shm):
        assert os.stat(os.path.join(shm, copy)).st_mode & 0o777 == 0o644  # the original's mode

    (mnt / "s0").write_bytes(b"changed after the prefetch")
    _eventually(lambda: os.stat(paths[0]).st_size == len(b"changed after the prefetch"))
    assert sft.read_file(paths[0], shm=True) == b"changed after the prefetch"  # the old copy is never used
    for p in paths[1:]:
        name = os.getxattr(p, "user.stripefs.shm_copy").split()[0].decode()
        assert os.path.exists(os.path.join(shm, name))  # prefetched: read_file takes it from there
        assert sft.read_file(p, shm=True) == expected[p]
    # a planted or changed copy is never returned: read_file checks size, owner, mode and checksum
    victim = paths[5]
    name = os.getxattr(victim, "user.stripefs.shm_copy").split()[0].decode()
    with open(os.path.join(shm, name), "r+b") as f:
        f.write(b"tampered")
    assert sft.read_file(victim, shm=True) == expected[victim]


def test_shared_memory_copies_are_for_those_who_may_read_the_original(cluster, mnt, second):
    """The attacks of the security review, as another local user (uid 65534) on an allow_other
    mount: list or plant in the shared-memory directory, learn where the copy of a file they may
    not read is, or of a readable file inside a directory they may not enter."""
    from stripefs import torch as sft

    (mnt / "secret").write_bytes(b"root's secret")
    (mnt / "secret").chmod(0o600)
    (mnt / "closed").mkdir(mode=0o700)
    (mnt / "closed" / "open").write_bytes(b"readable, in a closed directory")
    (mnt / "closed" / "open").chmod(0o644)
    (mnt / "public").write_bytes(b"for everyone")
    (mnt / "public").chmod(0o644)
    theirs_root, _port = second
    theirs = theirs_root / mnt.name
    _eventually(lambda: (theirs / "public").exists())
    paths = [theirs / "secret", theirs / "closed" / "open", theirs / "public"]
    shm = os.getxattr(theirs_root, "user.stripefs.shm_dir").decode()
    before = set(os.listdir(shm))
    next(iter(sft.PrefetchSampler(range(3), paths=paths, lookahead=3, shm=True)))
    _eventually(lambda: len(set(os.listdir(shm)) - before) == 3, within=30)
    names = {p.name: os.getxattr(p, "user.stripefs.shm_copy").split()[0].decode() for p in paths}
    script = f"""
import os, sys
out = []
for path in {[str(p) for p in paths]!r}:
    try:
        out.append(os.getxattr(path, "user.stripefs.shm_copy").split()[0].decode())
    except OSError as exc:
        out.append(exc.strerror)
try:
    out.append(str(len(os.listdir({shm!r}))))
except OSError as exc:
    out.append(exc.strerror)
for name in ("planted", {names["secret"]!r}):
    try:
        os.symlink("/etc/shadow", os.path.join({shm!r}, name))
        out.append("planted")
    except OSError as exc:
        out.append(exc.strerror)
try:
    out.append(open(os.path.join({shm!r}, {names["secret"]!r}), "rb").read().decode())
except OSError as exc:
    out.append(exc.strerror)
print("|".join(out))
"""
    res = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "/usr/bin/python3", "-c", script],
                         capture_output=True, text=True, timeout=30)
    secret, closed, public, listing, plant, over, read = res.stdout.strip().split("|")
    assert (secret, closed, listing, plant, read) == ("Permission denied",) * 5, res
    assert over in ("Permission denied", "File exists"), res  # the name is there, and not theirs to replace
    assert public == names["public"]  # a file they may read: they are told where its copy is
    assert sft.read_file(paths[0], shm=True) == b"root's secret"  # root still gets its copy


@pytest.fixture(scope="module")
def second(cluster):
    """Another default (read-write, close-to-open) mount, with its metrics served."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mnt = cluster.mount_again("second", f"metrics=127.0.0.1:{port}")
    yield mnt, port
    cluster.unmount(mnt)
    cluster.extra_mounts.remove(mnt)


def _rpcs(port: int) -> float:
    """Requests the mount sent to the metadata daemon so far (its Prometheus counters)."""
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("stripefs_rpc_seconds_count{"))


def test_directory_attributes_a_change_left_are_those_of_the_daemon_and_follow_other_mounts(cluster, mnt, second):
    """A mount answers GETATTR of a directory it just changed from the change's reply
    (client/dir_attrs.py): its own changes show at once, another mount's within the bound."""
    second, port = second
    mine = second / mnt.name
    (mine / "d").mkdir()
    before = _rpcs(port)
    for i in range(20):
        (mine / "d" / f"f{i}").write_bytes(b"")
        os.mkdir(mine / "d" / f"sub{i}")
        st = os.stat(mine / "d")  # the kernel dropped the directory's attributes: asked of the mount
        assert st.st_nlink == 2 + i + 1  # its own change, at once
    calls = _rpcs(port) - before
    # at most per file: LookupReq + CreateReq, per directory: LookupReq + MkdirReq; no GetattrReq of "d"
    # (the mount holds "d" whole: none at all, creates and mkdirs answered here and sent in batches)
    assert calls < 20 * 4 + 10, calls

    theirs = os.stat(mnt / "d")  # (the second mount creates asynchronously there: recalled first)
    assert theirs.st_nlink == st.st_nlink  # what the daemon has
    # its times were the second mount's own until the daemon answered (client/async_dirops.py)
    _eventually(lambda: os.stat(mine / "d").st_mtime_ns == theirs.st_mtime_ns)

    os.chmod(mnt / "d", 0o700)  # elsewhere: the second mount's kept attributes are old now
    _eventually(lambda: stat.S_IMODE(os.stat(mine / "d").st_mode) == 0o700)
    os.mkdir(mnt / "d" / "theirs")
    _eventually(lambda: os.stat(mine / "d").st_nlink == st.st_nlink + 1)
    (mine / "d" / "f0").unlink()  # and the second mount's next change keeps its reply again
    assert os.stat(mine / "d").st_nlink == st.st_nlink + 1
    # the first mount hears of the second's change through the feed: within the bound, not at once
    _eventually(lambda: os.stat(mine / "d").st_mtime_ns == os.stat(mnt / "d").st_mtime_ns)
    os.rename(mine / "d" / "sub0", mine / "d" / "sub0-renamed")
    os.rmdir(mine / "d" / "sub1")
    assert os.stat(mine / "d").st_nlink == st.st_nlink
    _eventually(lambda: os.stat(mnt / "d").st_nlink == st.st_nlink)


def test_shared_memory_copies_keep_close_to_open_on_a_default_mount(cluster, mnt, second):
    """read_file asks the mount once per file (getxattr, no stat): the mount names a copy only
    of the version the getxattr's own lookup found at the daemon, so a change closed on
    another mount is seen by the next read_file at once, not within the feed's bound."""
    from stripefs import torch as sft

    theirs_root, _port = second
    names = [f"c2o{i}" for i in range(8)]
    for n in names:
        (mnt / n).write_bytes(os.urandom(20_000))
    theirs = [theirs_root / mnt.name / n for n in names]
    expected = {p: (mnt / p.name).read_bytes() for p in theirs}
    shm = os.getxattr(theirs_root, "user.stripefs.shm_dir").decode()
    next(iter(sft.PrefetchSampler(range(len(theirs)), paths=theirs, lookahead=len(theirs), shm=True)))
    _eventually(lambda: all(_has_copy(p) for p in theirs), within=30)
    for p in theirs[1:]:
        name = os.getxattr(p, "user.stripefs.shm_copy").split()[0].decode()
        assert os.path.exists(os.path.join(shm, name))
        assert sft.read_file(p, shm=True) == expected[p]  # from shared memory
    current = expected[theirs[0]]
    for rnd in range(4):  # the same size, another version: only the version tells them apart
        if rnd:  # a copy of the current version again
            next(iter(sft.PrefetchSampler([0], paths=theirs, lookahead=1, shm=True)))
            _eventually(lambda: _has_copy(theirs[0]), within=30)
        assert _has_copy(theirs[0])
        new = os.urandom(20_000)
        with open(mnt / names[0], "r+b") as f:
            f.write(new)
        # closed on this mount: the other mount's very next read_file sees it, whatever its feed says
        assert sft.read_file(theirs[0], shm=True) == new, f"round {rnd}: an old copy was handed out after close"
        assert current != new
        current = new


def _has_copy(path) -> bool:
    try:
        return bool(os.getxattr(path, "user.stripefs.shm_copy"))
    except OSError:
        return False


def _lookups(port: int, kind: str = "LookupReq") -> float:
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("stripefs_rpc_seconds_count{") and f'type="{kind}"' in line)


def _feed_drops(port: int) -> float:
    """Times the mount dropped its kernel cache and its callbacks (stripefs_kernel_cache_drops_total)."""
    return sum(_requests_at(url=f"http://127.0.0.1:{port}/metrics", name="stripefs_kernel_cache_drops_total",
                            label="cause").values())


def test_a_default_mount_caches_files_under_callbacks_and_keeps_close_to_open(cluster, mnt, second):
    """A looked-up file's name and attributes are cached by the kernel (daemon/callbacks.py):
    repeated stat() and open() of it ask nothing; a change closed on another mount is seen by
    the very next stat(), open() and read, since that close waited for this mount to drop it."""
    second, port = second
    mine = second / mnt.name
    (mnt / "held").write_bytes(b"v" * 100)
    assert os.stat(mine / "held").st_size == 100
    before = _lookups(port)
    for _ in range(50):
        assert os.stat(mine / "held").st_size == 100
        assert _read(mine / "held") == b"v" * 100
    assert _lookups(port) - before <= 2, "the kernel should answer a held file's stat and open"
    for i in range(30):
        with open(mnt / "held", "ab") as f:
            f.write(b"w")
        size = 101 + i
        assert os.stat(mine / "held").st_size == size, f"round {i}: an old size after close elsewhere"
        assert _read(mine / "held") == b"v" * 100 + b"w" * (i + 1)
    os.rename(mnt / "held", mnt / "held-renamed")
    assert not os.path.exists(mine / "held")  # the name held too
    os.unlink(mnt / "held-renamed")
    assert not os.path.exists(mine / "held-renamed")


def test_closes_send_nothing_and_every_close_is_seen_by_the_next_open_elsewhere(cluster, mnt, second):
    """docs/design.md "A close that sends nothing": the default mount declines its first FLUSH, so no
    close sends a request; a write session is committed when its writing stops, before another
    mount's open or stat of the file (its write mark, daemon/callbacks.py: the reader's request waits
    for the writer's commit), and at unmount. ``second`` writes here, the main mount reads."""
    theirs, port = second
    writer = theirs / mnt.name
    url = f"http://127.0.0.1:{port}/metrics"
    (mnt / "theirs").write_bytes(b"made by the main mount\n")  # a file the writer did not create
    assert (writer / "theirs").read_bytes() == b"made by the main mount\n"
    before = _requests_at(url=url)
    for i in range(20):  # a file made elsewhere, appended to; another made here (its directory is not held)
        with open(writer / "theirs", "ab") as f:
            f.write(b"line %d\n" % i)
        assert (mnt / "theirs").read_bytes().endswith(b"line %d\n" % i), i  # the very next open elsewhere
        with open(writer / "mine", "wb") as f:
            f.write(b"round %d" % i)
        assert os.stat(mnt / "mine").st_size == len(b"round %d" % i), i  # and stat
    sent = _sent(before, _requests_at(url=url))
    assert sent.get("flush", 0) <= 1, sent  # the first, declined for good (before this test, as a rule)
    # nobody reads: committed all the same, once the writing stops
    commits = _lookups(port, "CommitReq")
    with open(writer / "quiet", "wb") as f:
        f.write(b"q" * 1000)
    _eventually(lambda: _lookups(port, "CommitReq") > commits)
    # written, closed and unmounted at once: the unmount commits it
    with open(writer / "last", "wb") as f:
        f.write(b"written just before the unmount")
    cluster.unmount(theirs)
    cluster.extra_mounts.remove(theirs)
    assert (mnt / "last").read_bytes() == b"written just before the unmount"
    cluster.mount_again("second", f"metrics=127.0.0.1:{port}")  # (the fixture unmounts it)


def test_empty_files_made_on_a_mount_whose_closes_send_nothing_are_unlinked_there_asynchronously(cluster, mnt, second):
    """An asynchronous create's answer gives the new file a write epoch; with no FLUSH nothing ended
    it, and a file with an epoch counted as open (client/operations.py ``_open_here``): every unlink
    of an empty file made there went to the daemon, one UnlinkReq and one fsync each (mdtest-easy's
    remove phase: ~300-1,700 files/s). The other mount sees them gone at once all the same."""
    theirs, port = second
    d = theirs / mnt.name / "empties"
    os.mkdir(d)  # made by that mount: held whole
    for i in range(20):
        os.close(os.open(d / f"e{i}", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
    (theirs / mnt.name / "closed").write_bytes(b"x")  # (a close: that mount's FLUSH is declined by now)
    before, drops = _lookups(port, "UnlinkReq"), _feed_drops(port)
    for i in range(20):
        os.unlink(d / f"e{i}")
    # (a feed silence on a loaded machine ends every hold: the unlinks after it go to the daemon, rightly)
    assert _lookups(port, "UnlinkReq") == before or _feed_drops(port) > drops
    assert os.listdir(mnt / "empties") == []


def test_a_mount_that_does_not_acknowledge_delays_a_change_only_by_the_bound(cluster, mnt):
    """A stopped mount cannot acknowledge: the change waits WAIT_S, then is answered; that
    mount gets no callbacks for a while (a later change does not wait), and sees the change
    when it runs again. (A mount of its own: the one stopped is penalised for a minute.)"""
    import signal

    from stripefs.daemon.callbacks import WAIT_S

    stopped = cluster.mount_again("stopped")
    try:
        mine = stopped / mnt.name
        (mnt / "stopped").write_bytes(b"1")
        assert _read(mine / "stopped") == b"1"  # held by that mount now
        pid = int((cluster.state / "stopped.pid").read_text())
        os.kill(pid, signal.SIGSTOP)
        try:
            start = time.monotonic()
            (mnt / "stopped").write_bytes(b"22")
            waited = time.monotonic() - start
            start = time.monotonic()
            (mnt / "stopped").write_bytes(b"333")
            again = time.monotonic() - start
        finally:
            os.kill(pid, signal.SIGCONT)
        assert WAIT_S - 0.5 < waited < WAIT_S + 5, waited
        assert again < 2.0, again
        _eventually(lambda: _read(mine / "stopped") == b"333")
        assert "did not acknowledge change" in cluster.logs()["meta.log"]
    finally:
        cluster.unmount(stopped)
        cluster.extra_mounts.remove(stopped)


def test_an_unmounted_mount_ends_its_session_at_once(cluster, mnt):
    """At unmount the mount ends its session (SessionEndReq): its callbacks and open files go then,
    not at the lease's end, so a change another mount makes to what it held does not wait for
    an acknowledgement that can no longer come."""

    def sessions() -> int:
        return json.loads(run_cli("status", "--json", "--dir", str(cluster.state)).stdout)["sessions"]

    gone = cluster.mount_again("gone")
    try:
        before = sessions()
        (mnt / "gone").write_bytes(b"1")
        assert _read(gone / mnt.name / "gone") == b"1"  # held by that mount now
    finally:
        cluster.unmount(gone)
        cluster.extra_mounts.remove(gone)
    assert sessions() == before - 1  # at once: the lease is 15 s
    assert "ended by its mount" in cluster.logs()["meta.log"]
    (mnt / "gone").write_bytes(b"22")  # held by no live session: nothing to wait for
    assert "did not acknowledge change" not in cluster.logs()["meta.log"].split("ended by its mount")[-1]


def test_a_listing_holds_the_files_it_lists(cluster, mnt, second):
    """readdir grants callbacks on the files it lists: stat() of each asks nothing afterwards
    (an ImageFolder index walk, ls -l), and a change closed elsewhere is still seen at once."""
    second, port = second
    (mnt / "listed").mkdir()
    for i in range(40):
        (mnt / "listed" / f"f{i}").write_bytes(b"x" * i)
    mine = second / mnt.name / "listed"
    names = sorted(e.name for e in os.scandir(mine))
    before = _lookups(port)
    sizes = [os.stat(mine / n).st_size for n in names]
    assert _lookups(port) - before <= 2, "the listing should have given the kernel every file"
    assert sorted(sizes) == list(range(40))
    (mnt / "listed" / "f7").write_bytes(b"changed elsewhere")
    assert os.stat(mine / "f7").st_size == len(b"changed elsewhere")
    assert _read(mine / "f7") == b"changed elsewhere"
    os.unlink(mnt / "listed" / "f8")
    assert not os.path.exists(mine / "f8")


def test_a_listed_small_file_is_read_with_no_open_request(cluster, mnt, second):
    """The default mount's listing brings the open information of the small files it holds
    (ReaddirReq open_info, small_only): a first read of a listed file is one ReadChunkReq, with no
    OpenReq before it (a DataLoader's cold epoch after its index walk); a file rewritten elsewhere
    is read new at once, and a large file is still opened (its chunk map is not listed)."""
    second, port = second
    (mnt / "samples").mkdir()
    data = {f"s{i:02d}": os.urandom(1000 + i) for i in range(30)}
    for name, body in data.items():
        (mnt / "samples" / name).write_bytes(body)
    (mnt / "samples" / "big").write_bytes(os.urandom(5 << 20))  # more than one 4 MiB chunk
    mine = second / mnt.name / "samples"
    assert sorted(os.listdir(mine)) == sorted([*data, "big"])
    before = _lookups(port, "OpenReq")
    for name, body in data.items():
        assert _read(mine / name) == body
    assert _lookups(port, "OpenReq") == before, "a listed small file was opened at the daemon"
    (mnt / "samples" / "s07").write_bytes(b"rewritten elsewhere")
    assert _read(mine / "s07") == b"rewritten elsewhere"
    before = _lookups(port, "OpenReq")
    assert len(_read(mine / "big")) == 5 << 20
    assert _lookups(port, "OpenReq") == before + 1


def test_a_mount_that_knows_every_name_of_a_directory_creates_without_a_lookup(cluster, mnt, second):
    """A directory this mount made (or listed whole) is held by name: a lookup of a new name is
    answered ENOENT by the mount, so a create costs one round trip; another mount's create,
    unlink or rename in it waits for this mount, which sees it at once."""
    second, port = second
    mine = second / mnt.name / "made-here"
    os.mkdir(mine)
    before = _lookups(port)
    for i in range(30):
        (mine / f"f{i}").write_bytes(b"")
        os.mkdir(mine / f"d{i}")
    assert _lookups(port) - before <= 2, "lookups of new names in a directory made here should not ask"
    theirs = mnt / "made-here"
    (theirs / "from-the-other-mount").write_bytes(b"x")
    assert os.path.exists(mine / "from-the-other-mount")  # at once: that create waited for this mount
    assert (mine / "from-the-other-mount").read_bytes() == b"x"
    os.unlink(theirs / "f3")
    assert not os.path.exists(mine / "f3")
    os.rename(theirs / "f4", theirs / "f4-moved")
    assert sorted(os.listdir(mine)) == sorted(os.listdir(theirs))  # a listing holds all the names again
    listing = sorted(os.listdir(mine))  # held whole again (the other mount's listing recalled it)
    assert sorted(os.listdir(mine)) == listing  # opened held: the kernel keeps it (FOPEN_CACHE_DIR)
    url = f"http://127.0.0.1:{port}/metrics"
    before = _requests_at(url=url)
    assert sorted(os.listdir(mine)) == listing
    assert _requests_at(url=url).get("readdirplus", 0) == before.get("readdirplus", 0), "a warm listing asked the mount"
    (theirs / "listed-elsewhere").write_bytes(b"")  # recalls this mount's hold: the kept listing goes
    assert sorted(os.listdir(mine)) == sorted(listing + ["listed-elsewhere"])
    before = _lookups(port)
    (mine / "after-listing").write_bytes(b"")
    assert _lookups(port) - before <= 1
    assert "after-listing" in os.listdir(mine)  # a change made here: the kernel drops its kept listing
    with pytest.raises(FileExistsError):  # a name made elsewhere is never answered "absent"
        (theirs / "clash").write_bytes(b"")
        os.open(mine / "clash", os.O_CREAT | os.O_EXCL | os.O_WRONLY)


def test_unlinking_a_held_file_frees_it(cluster, mnt, second):
    """A held file counts as open (a mount may open it without asking), but an unlink takes it
    from every holder, its own mount's included: nothing is left as an orphan."""
    second, _port = second
    (mnt / "gone").mkdir()
    for i in range(6):
        (mnt / "gone" / f"f{i}").write_bytes(b"x" * 1000)
        os.stat(mnt / "gone" / f"f{i}")
        assert _read(second / mnt.name / "gone" / f"f{i}") == b"x" * 1000  # held by both mounts
    inodes = [os.stat(mnt / "gone" / f"f{i}").st_ino for i in (0, 1, 3)]
    chunks = lambda ino: list(cluster.state.glob(f"storage-*/data/**/{ino}-*.chunk"))  # noqa: E731
    assert all(chunks(ino) for ino in inodes)
    os.unlink(mnt / "gone" / "f0")  # by a mount holding it
    os.unlink(second / mnt.name / "gone" / "f1")  # by the other one
    os.rename(mnt / "gone" / "f2", mnt / "gone" / "f3")  # over a held file
    # reclaimed once no session holds them (the lookups' open sets go at the next heartbeat, lease/3),
    # then their chunk copies are collected
    _eventually(lambda: not any(chunks(ino) for ino in inodes), within=20)


def test_a_stat_of_files_this_mount_just_wrote_asks_nothing(cluster, mnt, second):
    """Issue 31: a create holds the new file under a callback and the writer keeps it through its
    own commit (daemon/callbacks.py), so stat() after writing is answered by the kernel and the
    mount (a file still waiting in the write-back: with what its commit will record); another
    mount's change is still seen by the very next stat()."""
    second, port = second
    mine = second / mnt.name / "written"
    mine.mkdir()
    for i in range(20):
        (mine / f"f{i}").write_bytes(b"x" * i)
    before = _lookups(port) + _lookups(port, "GetattrReq")
    assert [os.stat(mine / f"f{i}").st_size for i in range(20)] == list(range(20))
    assert _lookups(port) + _lookups(port, "GetattrReq") - before == 0, "a stat of a file written here asked the daemon"
    fd = os.open(mine, os.O_RDONLY)  # keeps the directory's own dentry (it was made elsewhere's parent)
    try:
        # the files still wait in the write-back (answered from it above): FSYNCDIR sends them,
        # durable, and the directory's GETATTRs during those changes of it may ask the daemon
        os.fsync(fd)
        before = _lookups(port) + _lookups(port, "GetattrReq")
        drop_caches()  # the kernel forgets the files' names and inodes; the mount, holding them, does not
        assert [os.stat(f"f{i}", dir_fd=fd).st_size for i in range(20)] == list(range(20))
    finally:
        os.close(fd)
    assert _lookups(port) + _lookups(port, "GetattrReq") - before == 0, "a cold stat of a held file asked the daemon"
    (mnt / "written" / "f3").write_bytes(b"changed elsewhere")
    assert os.stat(mine / "f3").st_size == len(b"changed elsewhere")
    assert (mine / "f3").read_bytes() == b"changed elsewhere"


def _walk(root) -> list[str]:
    """ImageFolder's index (bench/tree.py): class folders, then the files of each."""
    with os.scandir(root) as it:
        classes = sorted(e.name for e in it if e.is_dir())
    return sorted(f"{c}/{e.name}" for c in classes if os.path.isdir(os.path.join(root, c))
                  for e in os.scandir(os.path.join(root, c)) if e.is_file())


def test_a_cold_walk_of_held_directories_asks_the_daemon_nothing(cluster, mnt, second):
    """Issue 29: a directory this mount holds whole keeps its listing in mount memory
    (client/dir_listings.py), so a cold index walk (drop_caches) costs no round trip to the daemon
    and about two FUSE requests per directory page; a change made by another mount is still seen
    by the very next walk, cold or warm (its change waits for this mount to give the directory up)."""
    second, port = second
    mine = second / mnt.name / "tree"
    expected = []
    for c in range(3):
        (mine / f"c{c}").mkdir(parents=True)
        for i in range(60):  # more than one READDIRPLUS page (about 24 entries) per folder
            (mine / f"c{c}" / f"img_{i:03d}.bin").write_bytes(b"x" * (i + 1))
            expected.append(f"c{c}/img_{i:03d}.bin")
    assert _walk(mine) == sorted(expected)  # the listings the daemon gives (untimed in bench/tree.py)
    url = f"http://127.0.0.1:{port}/metrics"
    fd = os.open(mine, os.O_RDONLY)  # keeps the walk's root dentry: the path above it is not what is counted
    try:
        drop_caches()
        asked = {k: _lookups(port, k) for k in ("ReaddirReq", "LookupReq", "GetattrReq")}
        requests = _requests_at(url=url)
        assert _walk(f"/proc/self/fd/{fd}") == sorted(expected)
        after = _requests_at(url=url)
    finally:
        os.close(fd)
    assert {k: _lookups(port, k) - v for k, v in asked.items()} == {k: 0 for k in asked}, \
        "a cold walk of held directories asked the daemon"
    per_file = sum(after.values()) - sum(requests.values())
    assert per_file / len(expected) <= 0.15, f"{per_file} FUSE requests for {len(expected)} files: {after}"
    # warm: the kernel keeps every listing (no-opendir: no OPENDIR, no RELEASEDIR) and the held
    # folders' attributes; what reaches the mount is at most a GETATTR per directory: a listing
    # marks the directory's atime stale on a read-write mount (fs/fuse/readdir.c
    # fuse_invalidate_atime), and the walk's isdir() stat asks for it
    warm = _listing_requests(url, lambda: _walk(mine) == sorted(expected))
    assert set(warm) <= {"getattr"} and warm.get("getattr", 0) <= 4, warm
    # another mount's changes: a new file, a removed one, a new folder, seen by the next walk
    (mnt / "tree" / "c1" / "new.bin").write_bytes(b"made elsewhere")
    os.unlink(mnt / "tree" / "c2" / "img_007.bin")
    (mnt / "tree" / "c9").mkdir()
    (mnt / "tree" / "c9" / "late.bin").write_bytes(b"")
    expected = sorted(set(expected) - {"c2/img_007.bin"} | {"c1/new.bin", "c9/late.bin"})
    assert _walk(mine) == expected
    drop_caches()
    assert _walk(mine) == expected
    # and a change made here is in the next walk too
    os.unlink(mine / "c0" / "img_000.bin")
    (mine / "c0" / "here.bin").write_bytes(b"")
    expected = sorted(set(expected) - {"c0/img_000.bin"} | {"c0/here.bin"})
    assert _walk(mine) == expected
    drop_caches()
    assert _walk(mine) == expected


def test_rm_rf_of_a_walked_tree_asks_the_daemon_no_directory_attributes(cluster, mnt, second):
    """rm -rf after a walk: the listings gave the directories' attributes (as of their callback's
    position: client/dir_attrs.py ``listed``), so neither the stat of each directory (its listing
    marked its atime stale) nor the GETATTR after its first unlink (answered here from what the
    listing left, updated) waits for the daemon; another mount sees the tree gone."""
    second, port = second
    for c in range(3):
        (mnt / "rmtree" / f"c{c}").mkdir(parents=True)
        for i in range(20):
            (mnt / "rmtree" / f"c{c}" / f"f{i:02d}").write_bytes(b"x")
    mine = second / mnt.name
    expected = sorted(f"c{c}/f{i:02d}" for c in range(3) for i in range(20))
    assert sorted(_walk(mine / "rmtree")) == expected  # recalls the first mount's holdings (events naming the folders)
    (mine / "rmtree" / "tmp").write_bytes(b"")  # a change here: "rmtree" is listed anew, after those events,
    os.unlink(mine / "rmtree" / "tmp")  # and its reply leaves rmtree's own attributes
    assert sorted(_walk(mine / "rmtree")) == expected
    asked = _lookups(port, "GetattrReq")
    subprocess.run(["rm", "-rf", *(str(mine / "rmtree" / f"c{c}") for c in range(3))], check=True)
    assert _lookups(port, "GetattrReq") - asked == 0, "rm -rf of a walked tree asked the daemon for attributes"
    assert os.listdir(mine / "rmtree") == [] and os.stat(mine / "rmtree").st_nlink == 2
    assert os.listdir(mnt / "rmtree") == [] and os.stat(mnt / "rmtree").st_nlink == 2  # elsewhere: recalled first
    os.rmdir(mnt / "rmtree")


def _listing_requests(url: str, listing) -> dict[str, float]:
    """The FUSE requests (by opcode, FORGETs left out: the kernel's own housekeeping) that reached
    the mount whose metrics are at ``url`` while ``listing()`` ran; it must return True."""
    before = _requests_at(url=url)
    assert listing()
    after = _requests_at(url=url)
    return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0) and "FORGET" not in k}


def test_a_listing_of_a_directory_not_held_is_kept_by_the_kernel_and_follows_changes(cluster, mnt, second):
    """No-opendir on the default mount too (client/operations_bridge.py): the kernel keeps every
    directory's listing, also of one this mount does not hold whole (more names than one listing
    answer: 1,000), so a warm listing reaches the mount not at all. A change made through this
    mount is in its very next listing (the kernel checks the directory's version at each listing's
    start); one made elsewhere once the feed's event invalidated the directory, whose pages hold
    the listing (docs/design.md "Listings kept by the kernel")."""
    second, port = second
    url = f"http://127.0.0.1:{port}/metrics"
    theirs = mnt / "big"  # made and filled by the other mount: this one lists it in pages, never whole
    theirs.mkdir()
    names = [f"f{i:04d}" for i in range(1100)]
    for name in names:
        (theirs / name).write_bytes(b"")
    mine = second / mnt.name / "big"
    assert sorted(os.listdir(mine)) == names
    # once the feed's events of those creates are applied here, a listing is the kernel's alone
    _eventually(lambda: _listing_requests(url, lambda: sorted(os.listdir(mine)) == names) == {})
    (theirs / "made-elsewhere").write_bytes(b"")
    names = sorted(names + ["made-elsewhere"])
    _eventually(lambda: sorted(os.listdir(mine)) == names)
    (mine / "made-here").write_bytes(b"")
    os.unlink(mine / "f0000")
    names = sorted(set(names) - {"f0000"} | {"made-here"})
    assert sorted(os.listdir(mine)) == names  # at once
    assert sorted(os.listdir(theirs)) == names


def _readdir_reqs(mountpoint) -> float:
    """ReaddirReqs the mount has sent so far (stripefs_rpc_seconds_count, every label set of the type)."""
    url = f"http://{client_metrics.find_state(mountpoint)['metrics']}/metrics"
    with urllib.request.urlopen(url, timeout=10) as rsp:
        text = rsp.read().decode()
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.name == "stripefs_rpc_seconds_count" and s.labels.get("type") == "ReaddirReq")


def test_a_dataset_mount_lists_the_subdirectories_of_a_listing_ahead(cluster, mnt, dataset):
    """A dataset mount that lists a directory from its start lists its subdirectories too, ahead
    of the kernel (Operations._list_subdirs_ahead): an index walk's READDIRPLUS of each class folder
    is then answered from memory, with no ReaddirReq of its own, and says what the folder holds."""
    writer = cluster.mount_again("ahead_writer")  # gone before the walk: no mount holds these folders
    try:
        top = writer / mnt.name / "ahead"
        for k in range(4):
            (top / f"class{k}").mkdir(parents=True)
            for i in range(3):
                (top / f"class{k}" / f"s{i}").write_bytes(b"x" * (k + 1))
        os.sync()
    finally:
        cluster.unmount(writer)
        cluster.extra_mounts.remove(writer)
    theirs = dataset / mnt.name / "ahead"
    _eventually(lambda: (theirs / "class3" / "s2").exists())  # lookups: nothing listed yet
    # the feed's events of these changes reach the dataset mount within the bound; one arriving after
    # a listing was asked makes the next READDIR ask again (its directory changed since): let them pass
    time.sleep(BOUND_S)
    with caches_kept():
        before = _readdir_reqs(dataset)
        assert sorted(os.listdir(theirs)) == [f"class{k}" for k in range(4)]
        _eventually(lambda: _readdir_reqs(dataset) >= before + 5, within=10)  # the folder and its 4 subfolders
        listed = _readdir_reqs(dataset)
        for k in range(4):
            with os.scandir(theirs / f"class{k}") as it:
                assert sorted((e.name, e.is_file()) for e in it) == [(f"s{i}", True) for i in range(3)]
        assert _readdir_reqs(dataset) == listed == before + 5
        assert (theirs / "class2" / "s1").read_bytes() == b"xxx"
