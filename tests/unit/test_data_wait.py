"""A training loop's data wait (stripefs/data_wait.py), the mount's job table (client/jobs.py) and the
per-job verdict of ``stripefs top`` (stripefs/job_view.py), without a mount."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from stripefs.client import jobs as jobs_mod
from stripefs.client.jobs import Jobs
from stripefs.common import protocol as P
from stripefs.data_wait import DataWait, watch
from stripefs import job_view


def _slow_batches(n: int, each_s: float):
    for i in range(n):
        time.sleep(each_s)
        yield i


def test_watch_yields_what_the_loader_yields_and_splits_the_step_into_wait_and_compute(tmp_path):
    figures = DataWait()
    seen = []
    for batch in watch(_slow_batches(10, 0.03), tmp_path, figures=figures):  # not a stripefs mount: nothing sent
        seen.append(batch)
        time.sleep(0.01)  # the step's compute
    assert seen == list(range(10)) and figures.steps == 10 and not figures.gpu
    assert 0.25 <= figures.wait_s <= 0.6 and 0.08 <= figures.compute_s <= 0.3
    assert 0.6 <= figures.wait_share <= 0.85  # 30 ms waiting for 10 ms computing, give or take a loaded machine


def test_a_loop_that_breaks_early_still_ends_cleanly():
    figures = DataWait()
    for batch in watch(iter(range(100)), figures=figures):
        if batch == 4:
            break
    assert figures.steps == 5


def test_the_report_travels_in_an_attribute_name_the_kernel_accepts():
    name = P.encode_job_report("train.py --lr 0.1 " + "x" * 300, 123456789, 1234.5, 99999.25, True, True)
    assert len(name) <= 255  # XATTR_NAME_MAX
    rep = P.decode_job_report(name)
    assert (rep.steps, rep.wait_s, rep.compute_s, rep.gpu, rep.done) == (123456789, 1234.5, 99999.25, True, True)
    assert rep.name.startswith("train.py --lr 0.1 x")
    for bad in (b"user.stripefs.job.", b"user.stripefs.job.1.2.3", b"user.stripefs.job.a.2.3.0.x",
                b"user.stripefs.job.-1.2.3.0.x", b"user.stripefs.prefetch", b"user.stripefs.job.1.2.3.0" + b"9" * 30 + b".x"):
        assert P.decode_job_report(bad) is None, bad


class _Ctx:
    def __init__(self, pid):
        self.pid = pid


class _FileInfo:
    def __init__(self, fh):
        self.fh = fh


def _series(metric, *labels) -> float:
    return metric.labels(*labels)._value.get()


def test_the_mount_attributes_a_jobs_workers_requests_to_it_and_forgets_it_a_while_after_it_ends():
    table = Jobs()
    job = subprocess.Popen([sys.executable, "-c", "import subprocess, sys; subprocess.run(['sleep', '30'])"])
    try:
        deadline = time.monotonic() + 10
        worker = None
        while worker is None and time.monotonic() < deadline:  # the job's child: a DataLoader worker, say
            out = subprocess.run(["pgrep", "-P", str(job.pid)], capture_output=True, text=True).stdout.split()
            worker = int(out[0]) if out else None
            time.sleep(0.02)
        assert worker is not None
        assert not table.active and table.job_of(worker) is None
        assert table.report(job.pid, P.encode_job_report("train", 10, 2.0, 1.0, False))
        label = table.by_pid[job.pid].label
        assert label == f"{job.pid} train" and table.active
        assert table.job_of(worker) is table.by_pid[job.pid]
        assert table.job_of(os.getpid()) is None  # not a descendant
        table.account("lookup", (1, b"x", _Ctx(worker)), None, 0.004, 0.0)
        table.account("open", (7, os.O_RDONLY, _Ctx(worker)), _FileInfo(42), 0.001, 0.0)
        table.account("read", (42, 0, 4096), b"", 0.010, 0.006)  # no caller: the handle's opener's job
        table.account("release", (42,), None, 0.0005, 0.0)
        table.account("read", (42, 0, 4096), b"", 0.010, 0.006)  # released: nobody's
        assert _series(jobs_mod.JOB_REQUESTS, label) == 0  # published at the job's next report
        assert table.report(job.pid, P.encode_job_report("train", 20, 3.0, 1.5, False))
        assert _series(jobs_mod.JOB_REQUESTS, label) == 4
        assert _series(jobs_mod.JOB_SECONDS, label, "network") == pytest.approx(0.006)
        assert _series(jobs_mod.JOB_SECONDS, label, "memory") == pytest.approx(0.004)
        assert _series(jobs_mod.JOB_SECONDS, label, "metadata") == pytest.approx(0.005)
        assert not table.report(job.pid, b"user.stripefs.job.garbage")
    finally:
        job.kill()
        job.wait()
    table.sweep()  # its process is gone, but a job shorter than a scrape interval must still be seen once
    assert table.active and _series(jobs_mod.JOB_STEPS, label) == 20
    table.sweep(time.monotonic() + jobs_mod.LINGER_S + 0.1)
    assert not table.active
    assert label not in {s.labels.get("job") for m in jobs_mod.JOB_STEPS.collect() for s in m.samples}


def test_jobs_past_the_limit_are_not_tracked(monkeypatch):
    monkeypatch.setattr(jobs_mod, "MAX_JOBS", 1)
    table = Jobs()
    assert table.report(os.getpid(), P.encode_job_report("one", 1, 0, 0, False))
    assert table.report(os.getppid(), P.encode_job_report("two", 1, 0, 0, False))
    assert list(table.by_pid) == [os.getpid()]
    table._drop(table.by_pid[os.getpid()])


def _row(wait, compute, inside, steps=100.0, gpu=False):
    row = {"job": "1 train", "steps_per_s": steps, "data_wait_share": wait / (wait + compute), "gpu_measured": gpu,
           "fuse_requests_per_s": 0.0, "wait_s": wait, "inside_s": dict({"network": 0.0, "memory": 0.0, "metadata": 0.0,
                                                                         "other": 0.0, "requests": 0.0}, **inside)}
    return job_view.verdict(row)


def test_the_verdict_names_the_bottleneck():
    assert _row(0.03, 0.97, {}, gpu=True) == "GPU busy 97%: storage is not the bottleneck"
    assert _row(0.4, 0.6, {"network": 1.6, "memory": 0.4}).startswith("data wait 40% of step time: 80% of its time in stripefs is network")
    assert "metadata" in _row(0.5, 0.5, {"metadata": 2.0, "network": 0.1})
    assert "loader's own work" in _row(0.5, 0.5, {"network": 0.05})  # waiting, but not on the mount
    assert _row(0.5, 0.5, {}, steps=0.0) == "no training steps in this interval"
    assert "FUSE requests themselves" in _row(0.9, 0.1, {"requests": 0.5, "metadata": 0.03})
