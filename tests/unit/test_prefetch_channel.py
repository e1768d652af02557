"""The prefetch request's channels (stripefs/prefetch_control.py, common/protocol.py)."""

from stripefs.common import protocol as p
from stripefs.prefetch_control import split_blobs


def test_the_ioctl_numbers_are_linux_iow_of_their_buffer():
    for command, number in ((p.PREFETCH_IOC, 1), (p.PREFETCH_SHM_IOC, 2)):
        assert command >> 30 == 1  # _IOC_WRITE: the kernel copies the buffer in, nothing out
        assert (command >> 16) & 0x3FFF == p.PREFETCH_IOC_SIZE  # _IOC_SIZE: 14 bits, the whole buffer
        assert (command >> 8) & 0xFF == ord("S") and command & 0xFF == number


def testsplit_blobs_keep_the_order_and_never_pass_the_limit():
    paths = [b"d%d/sample-%05d.jpg" % (i % 7, i) for i in range(5_000)]
    blobs = list(split_blobs(paths, p.PREFETCH_IOC_MAX_PATHS))
    assert len(blobs) > 1 and all(len(b) <= p.PREFETCH_IOC_MAX_PATHS for b in blobs)
    assert b"\n".join(blobs).split(b"\n") == paths
    assert list(split_blobs([], 100)) == []


def test_paths_are_grouped_by_mount_with_one_relpath_per_directory(monkeypatch):
    """A sampler names every sample of every epoch from the DataLoader's main process: each
    directory's mount and relative path are worked out once, not per path."""
    import os

    from stripefs import prefetch_control as pc

    monkeypatch.setattr(pc, "_stripefs_mounts", lambda: {b"/m", b"/"})
    monkeypatch.setattr(pc.os.path, "ismount", lambda d: d in (b"/m", b"/"))
    calls = []
    real = os.path.relpath
    monkeypatch.setattr(pc.os.path, "relpath", lambda *a: calls.append(a) or real(*a))
    roots = pc.MountRoots()
    paths = [f"/m/c{i % 3}/s{i}.jpg" for i in range(30)] + ["/m/top", "/m/c0/../c1/x", "/elsewhere/f"]
    grouped = pc.group_by_mount(paths, roots)
    assert grouped == {
        b"/m": [b"c%d/s%d.jpg" % (i % 3, i) for i in range(30)] + [b"top", b"c1/x"],
        b"/": [b"elsewhere/f"],
    }
    assert len(calls) == 5  # /m/c0, /m/c1, /m/c2, /m itself and /elsewhere: once each
    assert pc.group_by_mount(paths, roots) == grouped and len(calls) == 5
    monkeypatch.setattr(pc, "_stripefs_mounts", lambda: {b"/m"})
    assert pc.group_by_mount(["/other/f", "/m/f"], pc.MountRoots()) == {b"/m": [b"f"]}  # not a stripefs mount: left out
