"""GETATTR misses asked on plain threads (client/thread_meta.py): taken, right, and falling back.

A second mount stats a directory the first one changes: each change reaches it through the
feed (its kernel drops the directory's attributes), so its next stat is a GETATTR miss, which
its worker threads ask the daemon with the blocking client (client/meta_blocking.py;
``stripefs_thread_meta_total``) and which must give what the writer's mount sees. A metadata
daemon killed and restarted between stats changes neither the answers nor the mount's answering.
"""

from __future__ import annotations

import os
import time

from stripefs.client import metrics as client_metrics

from test_ops import scrape, total


def _thread_meta(mountpoint) -> dict[str, float]:
    samples = scrape(f"http://{client_metrics.find_state(mountpoint)['metrics']}/metrics")
    return {o: total(samples, "stripefs_thread_meta_total", outcome=o) for o in ("served", "handed_back")}


def _seen(path, nlink: int, within_s: float = 10.0) -> os.stat_result:
    """stat ``path`` until it shows ``nlink`` (the feed's invalidation is on its way), at most ``within_s``."""
    deadline = time.monotonic() + within_s
    while True:
        st = os.stat(path)
        if st.st_nlink == nlink or time.monotonic() > deadline:
            return st
        time.sleep(0.02)


def _same(a: os.stat_result, b: os.stat_result) -> tuple:
    return (a.st_ino, a.st_mode, a.st_nlink, a.st_uid, a.st_gid, a.st_mtime_ns, a.st_ctime_ns) == \
           (b.st_ino, b.st_mode, b.st_nlink, b.st_uid, b.st_gid, b.st_mtime_ns, b.st_ctime_ns)


def test_a_getattr_miss_is_asked_on_a_thread_and_sees_another_mounts_change(cluster, mnt):
    d = mnt / "watched"
    d.mkdir()
    other = cluster.mount_again("thread_meta_watch")
    try:
        theirs = other / mnt.name / "watched"
        os.stat(theirs)  # known to the other mount's kernel from here on
        before = _thread_meta(other)
        for i in range(8):
            (d / f"sub{i}").mkdir()  # a change of the directory's nlink and times, made elsewhere
            st = _seen(theirs, 3 + i)
            assert _same(st, os.stat(d)), (i, st, os.stat(d))
        after = _thread_meta(other)
        assert after["served"] - before["served"] >= 4, (before, after)
    finally:
        cluster.unmount(other)


def test_a_daemon_restart_between_getattrs_falls_back_and_recovers(cluster, mnt):
    cluster.expect_log(r"not answering", r"failed", r"no reply", r"got no reply", r"retrying")
    d = mnt / "restarted"
    d.mkdir()
    other = cluster.mount_again("thread_meta_restart")
    try:
        theirs = other / mnt.name / "restarted"
        os.stat(theirs)
        (d / "a").mkdir()
        assert _same(_seen(theirs, 3), os.stat(d))
        cluster.kill_meta()
        cluster.restart()
        (d / "b").mkdir()  # through the restarted daemon
        before = _thread_meta(other)
        assert _same(_seen(theirs, 4, within_s=60), os.stat(d))
        for i in range(4):
            (d / f"c{i}").mkdir()
            assert _same(_seen(theirs, 5 + i), os.stat(d))
        after = _thread_meta(other)
        assert after["served"] > before["served"], (before, after)  # the threads answer again
    finally:
        cluster.unmount(other)
