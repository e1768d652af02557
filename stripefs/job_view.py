"""``stripefs top``'s per-job view: is each training job's GPU starving, and if so, on what?

Built from two scrapes of a mount's metrics (client/jobs.py): what each job
reported of its own loop (steps, data wait, compute: stripefs/data_wait.py)
and what the mount did for that job's processes (requests, and their time
split into network, memory, metadata, other), over the interval between the
scrapes. The verdict reads them in this order:

1. No steps in the interval: the job is not training (loading, evaluating, done).
2. Data wait under ``STARVING`` of step time: storage is not the bottleneck.
3. Otherwise the wait is the bottleneck, and its cause is where the job's
   readers spent their time: mostly outside stripefs (its time inside the
   mount is under ``INSIDE`` of the wait) means the loader's own work
   (decoding, augmenting, too few workers); else the largest of network
   (cold reads from storage nodes), metadata (opens, lookups, listings),
   memory (bytes the mount serves from its caches) and requests.

"Requests" is what the handlers' own times miss: every FUSE request also costs
a round trip through the kernel and the mount's dispatch before a handler
runs, ``REQUEST_COST_S`` each as bench/fuse_floor.py measured it ("The FUSE
wall", bench/README.md). A warm small-file loader can spend most of its wait
there while the handlers look idle, so the view counts the job's requests at
that cost, and says it is an estimate.
"""

from __future__ import annotations

from typing import Callable

#: data wait share above which the job is called I/O-bound
STARVING = 0.10
#: the job's time inside the mount, as a share of its data wait, below which the mount is not the cause
INSIDE = 0.25
#: the mount's cost of one FUSE request before and after its handler (measured through pyfuse3 + trio on a 2-core machine; less on the own session's fast paths)
REQUEST_COST_S = 44e-6

ADVICE = {
    "network": "cold reads from storage nodes: prefetch in sampler order (stripefs.torch.PrefetchSampler), "
               "warm the data set (stripefs warmup), or a larger disk_cache_dir",
    "metadata": "opens, lookups and listings: mount the data set in dataset mode (-o dataset)",
    "memory": "per-file requests the mount answers from memory: dataset mode keeps warm files in the kernel, "
              "and stripefs.torch.read_file takes prefetched files from shared memory",
    "other": "writes and other requests of the job",
    "requests": "FUSE requests themselves (about {per_step:.0f} a step, ~44 us each besides their handlers, an "
                "estimate): dataset mode (-o dataset) lets the kernel answer warm files alone, and "
                "stripefs.torch.read_file with PrefetchSampler takes prefetched files from shared memory",
}


def job_rows(delta: Callable[..., float], value: Callable[..., float], labels: set[str], dt: float) -> list[dict]:
    """One row per job: ``delta(name, **labels)`` is a counter's increase over the interval, ``value``
    a gauge's value now (and ``delta`` works on gauges too: the job's figures are cumulative)."""
    rows = []
    for job in sorted(labels):
        steps = delta("stripefs_job_steps", job=job)
        wait = delta("stripefs_job_data_wait_seconds", job=job)
        compute = delta("stripefs_job_compute_seconds", job=job)
        inside = {kind: delta("stripefs_job_fuse_seconds", job=job, kind=kind)
                  for kind in ("network", "memory", "metadata", "other")}
        total = wait + compute
        requests = delta("stripefs_job_fuse_requests", job=job)
        inside["requests"] = requests * REQUEST_COST_S
        row = {
            "job": job,
            "requests_per_step": requests / steps if steps else 0.0,
            "steps_per_s": steps / dt if dt > 0 else 0.0,
            "data_wait_share": wait / total if total > 0 else None,
            "gpu_measured": bool(value("stripefs_job_gpu_measured", job=job)),
            "fuse_requests_per_s": requests / dt if dt > 0 else 0.0,
            "wait_s": wait,
            "inside_s": inside,
        }
        row["verdict"] = verdict(row)
        rows.append(row)
    return rows


def verdict(row: dict) -> str:
    share = row["data_wait_share"]
    if not row["steps_per_s"] or share is None:
        return "no training steps in this interval"
    busy = "GPU busy" if row["gpu_measured"] else "compute"
    if share < STARVING:
        return f"{busy} {1 - share:.0%}: storage is not the bottleneck"
    inside = row["inside_s"]
    total_inside = sum(inside.values())
    head = f"data wait {share:.0%} of step time"
    if total_inside < INSIDE * row["wait_s"]:
        return (f"{head}, but the job's readers spent only {total_inside:.2f}s inside stripefs for {row['wait_s']:.2f}s "
                "of waiting: the loader's own work (decoding, augmenting) is the bottleneck; more DataLoader workers")
    cause = max(inside, key=inside.get)
    advice = ADVICE[cause].format(per_step=row.get("requests_per_step", 0.0))
    return f"{head}: {inside[cause] / total_inside:.0%} of its time in stripefs is {cause}: {advice}"


def render(rows: list[dict]) -> list[str]:
    if not rows:
        return ["(no training job reports its data wait: wrap the loader in stripefs.torch.watch)"]
    lines = [f"{'job':<28}{'steps/s':>9}{'data wait':>11}{'FUSE req/s':>12}  network  memory  metadata  requests"]
    for r in rows:
        share = "-" if r["data_wait_share"] is None else f"{r['data_wait_share']:.0%}" + (" gpu" if r["gpu_measured"] else "")
        inside = r["inside_s"]
        total = sum(inside.values()) or 1.0
        split = "  ".join(f"{inside[k] / total:>{w}.0%}" for k, w in (("network", 7), ("memory", 6), ("metadata", 8),
                                                                            ("requests", 8)))
        lines.append(f"{r['job'][:27]:<28}{r['steps_per_s']:>9.1f}{share:>11}{r['fuse_requests_per_s']:>12.1f}  {split}")
        lines.append(f"  => {r['verdict']}")
    return lines
