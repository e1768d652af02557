"""A write the cluster cannot store: the writer is told, nothing is committed, nothing waits forever.

With every storage node dead, a mount mounted with ``-o op_timeout=4,sync_close`` must
answer a close() of written data with EIO within that bound, and the file must
keep the size and content it had (no length committed without its data). Once
the nodes are back the file reads as before and takes writes again. (Without
``sync_close`` a small new file's close may return before its data is stored,
client/write_back.py: tests/inprocess/test_write_back_ops.py shows its error at
the next close, and nothing of it committed.)
"""

import errno
import os
import time

import pytest

from conftest import drop_caches

BOUND_S = 4.0
SLACK_S = 6.0  # process scheduling on a loaded 2-core machine, the kernel's own round trips


def _timed_oserror(fn) -> tuple[OSError, float]:
    start = time.monotonic()
    with pytest.raises(OSError) as caught:
        fn()
    return caught.value, time.monotonic() - start


def test_every_node_down_close_reports_eio_within_the_bound_and_commits_nothing(cluster, mnt):
    cluster.expect_log(r"could not be stored", r"not answering", r"no reply", r"failed", r"no storage node", r"was not stored",
                       r"flushing open files took")
    old = b"old content\n"
    (mnt / "f").write_bytes(old)
    quick = cluster.mount_again("bounded", "op_timeout=4,sync_close")
    d = quick / mnt.name
    assert (d / "f").read_bytes() == old
    nodes = sorted(int(n) for n in cluster.pids()["storage"])
    for node_id in nodes:
        cluster.kill_node(node_id)
    try:

        def grow_existing():
            with open(d / "f", "r+b") as f:
                f.write(b"new content, longer than the old one\n")  # buffered by the mount; close sends it

        exc, took = _timed_oserror(grow_existing)
        assert exc.errno == errno.EIO and took < BOUND_S + SLACK_S, (exc, took)

        def create_new():
            with open(d / "g", "wb") as f:
                f.write(b"x" * 100_000)

        exc, took = _timed_oserror(create_new)
        assert exc.errno == errno.EIO and took < BOUND_S + SLACK_S, (exc, took)

        def fsync_new():
            with open(d / "h", "wb") as f:
                f.write(b"y" * 10)
                f.flush()
                os.fsync(f.fileno())

        exc, took = _timed_oserror(fsync_new)
        assert exc.errno == errno.EIO and took < 2 * (BOUND_S + SLACK_S), (exc, took)
        # no length without its data, on this mount and on another one
        for m in (d, mnt):
            assert (m / "f").stat().st_size == len(old)
            assert (m / "g").stat().st_size == 0
            assert (m / "h").stat().st_size == 0
    finally:
        cluster.restart()
        cluster.unmount(quick)
        cluster.extra_mounts.remove(quick)
    drop_caches()
    assert (mnt / "f").read_bytes() == old
    (mnt / "f").write_bytes(b"the nodes are back\n")
    assert (mnt / "f").read_bytes() == b"the nodes are back\n"

