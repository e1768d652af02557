"""Is my GPU starving? (issue 32): a real training-shaped loop over the mount, and what ``stripefs top`` says of it.

The loop is a job process with a pool of worker processes reading files
through the mount (as a DataLoader's workers do), wrapped in
``stripefs.torch.watch``, and a fake step that sleeps a known time. ``stripefs
top --json`` runs beside it. Checked: the data-wait share the mount reports
matches the job's known split (the step's sleep is known) within 0.15; an
I/O-bound loop is called I/O-bound and a compute-bound one compute-bound; the
workers' requests are counted for the job; top survives the job being killed
mid-epoch, and the job leaves the view (a while later: its final figures linger).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from util import drop_caches

JOB = r'''
import functools, json, os, sys, time
from multiprocessing import Pool
from stripefs.torch import DataWait, watch

def load(batch, cold=False):
    total = 0
    for path in batch:
        with open(path, "rb", buffering=0) as f:
            total += len(f.read())
            if cold:  # the next read of it goes to the mount again, not to the page cache
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    return total

def batches(pool, paths, per_batch, epochs):
    """Batches loaded by the workers ahead of the loop, from its first step on, as a DataLoader's workers do."""
    order = [paths[i:i + per_batch] for i in range(0, len(paths), per_batch)]
    yield from pool.imap(functools.partial(load, cold=COLD), (b for _ in range(epochs) for b in order))

if __name__ == "__main__":
    root, step_s, per_batch, epochs = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    COLD = sys.argv[5:] == ["cold"]
    paths = sorted(os.path.join(root, n) for n in os.listdir(root))
    figures = DataWait()
    with Pool(2) as pool:
        # reports 4 times a second, not once: the I/O-bound run lasts ~1.5 s, and top (every 0.5 s) once saw
        # only its first report (no step yet) and its last (the job gone): a frame between them was missed
        for batch in watch(batches(pool, paths, per_batch, epochs), root, name="fake-train", figures=figures,
                           report_every=0.25):
            time.sleep(step_s)  # the step's compute
    print(json.dumps({"steps": figures.steps, "wait_s": figures.wait_s, "compute_s": figures.compute_s}))
'''


def _start_top(mnt) -> subprocess.Popen:
    """``stripefs top --json`` on ``mnt``, once it printed its first frame (it scrapes from then on)."""
    top = subprocess.Popen([sys.executable, "-m", "stripefs", "top", str(mnt), "--json", "--interval", "0.5"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert top.stdout.readline(), f"top ended: {top.stderr.read()}"
    return top


def _frames(top: subprocess.Popen, until, timeout: float = 60.0) -> list[dict]:
    """Frames of ``top`` until ``until(frames)`` holds (it must: the test fails otherwise)."""
    frames: list[dict] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = top.stdout.readline()
        assert line, f"top ended: {top.stderr.read()}"
        frames.append(json.loads(line))
        if until(frames):
            return frames
    raise AssertionError(f"top never showed it: {frames}")


def _job_rows(frames: list[dict]) -> list[dict]:
    return [row for f in frames for row in f["jobs"] if row["job"].endswith("fake-train") and row["steps_per_s"]]


def test_top_tells_a_compute_bound_loop_from_an_io_bound_one(cluster, mnt, tmp_path):
    data = mnt / "samples"
    data.mkdir()
    for i in range(64):
        (data / f"{i:03d}.jpg").write_bytes(os.urandom(32 << 10))
    script = tmp_path / "train.py"
    script.write_text(JOB)
    top = _start_top(cluster.mnt)
    try:
        # compute-bound: 40 ms of compute a step, 8 warm files a batch loaded ahead by 2 workers: once the
        # workers are running the loop never waits (known split: wait 0, compute 1)
        step_s = 0.04
        job = subprocess.run([sys.executable, str(script), str(data), str(step_s), "8", "10"], capture_output=True,
                             text=True, timeout=120)
        assert job.returncode == 0, job.stderr
        own = json.loads(job.stdout)
        assert own["steps"] == 80
        assert abs(own["compute_s"] - own["steps"] * step_s) < 0.25 * own["steps"] * step_s, own  # its own figures
        # the last window of the run (JOB_WINDOW_S, whole reports): the steady state, start-up behind it
        rows = _job_rows(_frames(top, lambda fs: _job_rows(fs) and not _job_rows(fs[-1:])))
        assert rows[-1]["data_wait_share"] < 0.15, rows[-1]
        assert "storage is not the bottleneck" in rows[-1]["verdict"], rows[-1]
        assert max(r["fuse_requests_per_s"] for r in rows) > 0  # the workers' opens and reads are the job's

        # I/O-bound: no compute, every batch read through the mount: the whole directory a step, each file
        # dropped from the page cache after its read (warm 8-file batches take the own session ~1 ms, not
        # far above the loop's own ~0.3 ms a step: the split was no longer the known one)
        job = subprocess.run([sys.executable, str(script), str(data), "0", "64", "40", "cold"], capture_output=True,
                             text=True, timeout=120)
        assert job.returncode == 0, job.stderr
        own = json.loads(job.stdout)
        assert own["wait_s"] / (own["wait_s"] + own["compute_s"]) > 0.85, own  # known split: wait 1, compute 0
        rows = _job_rows(_frames(top, lambda fs: _job_rows(fs) and not _job_rows(fs[-1:])))
        assert rows[-1]["data_wait_share"] > 0.85, rows[-1]
        assert rows[-1]["verdict"].startswith("data wait"), rows[-1]
        assert sum(rows[-1]["inside_s"].values()) > 0, rows[-1]
    finally:
        top.kill()
        top.wait()


def test_cold_reads_show_up_as_network(cluster, mnt, tmp_path):
    """The same loop over data no cache of the mount holds (a second mount, the page cache dropped):
    its wait is put down to the network."""
    data = mnt / "cold"
    data.mkdir()
    for i in range(160):
        (data / f"{i:03d}.jpg").write_bytes(os.urandom(128 << 10))
    second = cluster.mount_again("cold-reader")
    try:
        drop_caches()
        script = tmp_path / "train.py"
        script.write_text(JOB)
        top = _start_top(second)
        try:
            job = subprocess.run([sys.executable, str(script), str(second / mnt.name / "cold"), "0", "2", "1"],
                                 capture_output=True, text=True, timeout=120)
            assert job.returncode == 0, job.stderr
            rows = _job_rows(_frames(top, lambda fs: _job_rows(fs) and not _job_rows(fs[-1:])))
            assert any("is network: cold reads" in r["verdict"] for r in rows), rows
        finally:
            top.kill()
            top.wait()
    finally:
        cluster.unmount(second)


def test_top_survives_a_job_killed_mid_epoch(cluster, mnt, tmp_path):
    data = mnt / "samples"
    data.mkdir()
    for i in range(16):
        (data / f"{i:03d}.jpg").write_bytes(os.urandom(8 << 10))
    script = tmp_path / "train.py"
    script.write_text(JOB)
    top = _start_top(cluster.mnt)
    job = subprocess.Popen([sys.executable, str(script), str(data), "0.01", "4", "100000"], stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, start_new_session=True)
    try:
        _frames(top, lambda fs: _job_rows(fs[-1:]))
        os.killpg(job.pid, signal.SIGKILL)  # the job and its workers, mid-epoch
        job.wait()
        # gone from the view once the mount sweeps it: LINGER_S after its last report, at the next sweep
        _frames(top, lambda fs: not any(r["job"].endswith("fake-train") for r in fs[-1]["jobs"]), timeout=45)
        assert top.poll() is None
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
        top.kill()
        top.wait()
