"""``stripefs top MOUNT``: a live view of one mount, from its Prometheus endpoint.

It answers "is my GPU starving, and why?": every interval it scrapes the
mount's /metrics (client/metrics.py), subtracts the previous scrape and shows
rates: reads/s, MiB/s read and written, cache hit rate, read-ahead used vs
wasted, FUSE latency percentiles per op, RPC latency per storage node, and
how the time readers spent inside stripefs divides into waiting on the
network (storage nodes) versus being served from memory. A verdict line sums
it up. Training jobs wrapped in ``stripefs.torch.watch`` get a line each: their
own data-wait share, where their time in the mount went, and a verdict of
their own (stripefs/job_view.py). ``--json`` prints the same for scripts.

The endpoint is found from the mount's state file (client.metrics.find_state,
written by the mount process) or given with ``--metrics HOST:PORT``. The
screen is redrawn with plain ANSI escapes (home, clear to end), so it works in
any terminal, tmux included; ``--once`` prints one frame without escapes.

Percentiles come from histogram bucket deltas, interpolated linearly inside
the bucket (as Prometheus' histogram_quantile does), so they describe only the
last interval.
"""

from __future__ import annotations

import json
import math
import sys
import time
import urllib.error
import urllib.request
from collections import defaultdict, deque
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from . import job_view
from .common.errors import QuietError

MiB = 1 << 20

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(url: str, timeout: float = 5.0) -> Samples:
    with urllib.request.urlopen(url, timeout=timeout) as rsp:
        text = rsp.read().decode()
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _sum(samples: Samples, name: str, **labels: str) -> float:
    want = set(labels.items())
    return sum(v for (n, lab), v in samples.items() if n == name and want <= set(lab))


def _delta(cur: Samples, prev: Samples, name: str, **labels: str) -> float:
    return max(0.0, _sum(cur, name, **labels) - _sum(prev, name, **labels))


def _buckets(cur: Samples, prev: Samples, name: str, **labels: str) -> list[tuple[float, float]]:
    """[(upper bound, cumulative count in the interval)] of a histogram, summed over the other labels."""
    want = set(labels.items())
    acc: dict[float, float] = defaultdict(float)
    for (n, lab), v in cur.items():
        if n == f"{name}_bucket" and want <= set(lab):
            le = dict(lab)["le"]
            bound = math.inf if le == "+Inf" else float(le)
            acc[bound] += v - prev.get((n, lab), 0.0)
    return sorted(acc.items())


def quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """The q-quantile of cumulative buckets, interpolated; None when empty."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower_bound  # beyond the last finite bucket: report its bound
            if count == lower_count:
                return bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (count - lower_count)
        lower_bound, lower_count = bound, count
    return lower_bound


def _ms(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds * 1000:.2f}" if seconds < 0.01 else f"{seconds * 1000:.1f}"


def verdict(network_share: float | None, reads: float, hit_rate: float | None, busy: float = 1.0, ops: float = 0.0) -> str:
    """One line: where readers' time goes. ``busy`` is the average number of reads in flight; ``ops``
    the FUSE requests of every kind in the interval (those the session answers itself included). A job
    reading what the kernel's page cache holds sends no reads: at most an isatty() IOCTL or a GETATTR
    per file, and on a no-open mount whose closes send nothing (unbuffered reads) no request at all."""
    if not reads or network_share is None:
        if ops:
            return (f"no reads reach stripefs, but {ops:,.0f} other requests did (getattr, ioctl, open, ...): "
                    "files are read from the kernel's page cache; stripefs answers only those")
        return ("idle: no requests in this interval (or reading only what the kernel's page cache holds, which "
                "sends none: stripefs.torch.watch shows such a job)")
    if busy < 0.05:
        if ops > 10 * reads:  # a warm epoch: a stray read beside thousands of opens is still the page cache's job
            return (f"files are read mostly from the kernel's page cache ({reads:,.0f} reads reach stripefs beside "
                    f"{ops - reads:,.0f} other requests): stripefs answers only those; the bottleneck is elsewhere")
        return f"readers are rarely inside stripefs ({busy:.2f} reads in flight on average): the bottleneck is elsewhere"
    if network_share >= 0.5:
        return (
            f"readers spend {network_share:.0%} of their time waiting on storage nodes: the network or the nodes "
            "are the bottleneck (see the slowest nodes below; more read-ahead or larger chunks may help)"
        )
    if hit_rate is not None and hit_rate >= 0.9:
        return f"served from memory ({network_share:.0%} of read time on the network): stripefs keeps up; look above it"
    return f"readers wait on the network {network_share:.0%} of their time: stripefs keeps up"


def render(cur: Samples, prev: Samples, dt: float, title: str, window: tuple[Samples, float] | None = None) -> list[str]:
    """The lines of one frame for the interval between ``prev`` and ``cur`` (``dt`` seconds);
    ``window``: (older samples, seconds) the training jobs' figures are taken over (``JOB_WINDOW_S``)."""
    dt = max(dt, 1e-6)
    reads = _delta(cur, prev, "stripefs_fuse_ops_total", op="read")
    writes = _delta(cur, prev, "stripefs_fuse_ops_total", op="write")
    rbytes = _delta(cur, prev, "stripefs_read_bytes_total")
    wbytes = _delta(cur, prev, "stripefs_write_bytes_total")
    hits = _delta(cur, prev, "stripefs_cache_hits_total")
    misses = _delta(cur, prev, "stripefs_cache_misses_total")
    hit_rate = hits / (hits + misses) if hits + misses else None
    net = _delta(cur, prev, "stripefs_read_seconds_total", source="network")
    mem = _delta(cur, prev, "stripefs_read_seconds_total", source="cache")
    network_share = net / (net + mem) if net + mem > 0 else None
    ra_fetched = _delta(cur, prev, "stripefs_readahead_chunks_total", outcome="fetched")
    ra_used = _delta(cur, prev, "stripefs_readahead_chunks_total", outcome="used")
    ra_wasted = _delta(cur, prev, "stripefs_readahead_chunks_total", outcome="wasted")
    errors = _delta(cur, prev, "stripefs_fuse_errors_total")  # failures only (client/metrics.py ANSWER_ERRNOS)
    answers = _delta(cur, prev, "stripefs_fuse_negative_answers_total")  # ENOENT to a lookup, ... : not errors

    lines = [
        f"stripefs top  {title}  (every {dt:.1f}s; Ctrl-C quits)",
        "",
        f"reads/s {reads / dt:>10.1f}   read  MiB/s {rbytes / dt / MiB:>9.1f}   cache hit rate "
        f"{'-' if hit_rate is None else f'{hit_rate:.1%}':>7}",
        f"writes/s {writes / dt:>9.1f}   write MiB/s {wbytes / dt / MiB:>9.1f}   FUSE errors/s {errors / dt:>8.1f}",
        f"read time: network {('-' if network_share is None else f'{network_share:.0%}'):>4}  "
        f"cache/memory {('-' if network_share is None else f'{1 - network_share:.0%}'):>4}   "
        f"readers busy {(net + mem) / dt:.2f} (average reads in flight)",
        f"read-ahead chunks: fetched {ra_fetched:.0f}, used {ra_used:.0f}, wasted {ra_wasted:.0f}   "
        f"negative answers/s {answers / dt:.1f} (ENOENT, ENODATA, ...: not errors)",
        "",
        "=> " + verdict(network_share, reads, hit_rate, (net + mem) / dt, _delta(cur, prev, "stripefs_fuse_requests_total")),
        "",
        f"{'FUSE op':<12}{'ops/s':>10}{'p50 ms':>10}{'p90 ms':>10}{'p99 ms':>10}",
    ]
    ops = sorted(
        {dict(lab)["op"] for (n, lab) in cur if n == "stripefs_fuse_ops_total"},
        key=lambda op: -_delta(cur, prev, "stripefs_fuse_ops_total", op=op),
    )
    shown = 0
    for op in ops:
        count = _delta(cur, prev, "stripefs_fuse_ops_total", op=op)
        if not count and op not in ("read", "write"):
            continue
        b = _buckets(cur, prev, "stripefs_fuse_op_seconds", op=op)
        lines.append(
            f"{op:<12}{count / dt:>10.1f}{_ms(quantile(0.5, b)):>10}{_ms(quantile(0.9, b)):>10}{_ms(quantile(0.99, b)):>10}"
        )
        shown += 1
        if shown >= 8:
            break
    peers = sorted({dict(lab)["peer"] for (n, lab) in cur if n == "stripefs_rpc_seconds_count"})
    rows = []
    for peer in peers:
        count = _delta(cur, prev, "stripefs_rpc_seconds_count", peer=peer, type="ReadChunkReq")
        if count:
            b = _buckets(cur, prev, "stripefs_rpc_seconds", peer=peer, type="ReadChunkReq")
            rows.append((quantile(0.99, b) or 0.0, peer, count, quantile(0.5, b)))
    lines += ["", "training jobs (stripefs.torch.watch):"] + job_view.render(jobs(cur, *(window or (prev, dt))))
    lines += ["", f"{'chunk reads from':<32}{'reads/s':>10}{'p50 ms':>10}{'p99 ms':>10}"]
    if not rows:
        lines.append("(no chunk reads from storage nodes in this interval)")
    for p99, peer, count, p50 in sorted(rows, reverse=True)[:6]:
        lines.append(f"{peer:<32}{count / dt:>10.1f}{_ms(p50):>10}{_ms(p99):>10}")
    return lines


def jobs(cur: Samples, prev: Samples, dt: float) -> list[dict]:
    """The per-job rows of the interval (stripefs/job_view.py): every job in ``cur`` (one that began
    within the interval counts from its start)."""
    labels = {dict(lab)["job"] for (n, lab) in cur if n == "stripefs_job_steps"}
    return job_view.job_rows(
        lambda name, **lab: _delta(cur, prev, name, **lab), lambda name, **lab: _sum(cur, name, **lab), labels, max(dt, 1e-6)
    )


def as_json(cur: Samples, prev: Samples, dt: float, window: tuple[Samples, float] | None = None) -> dict:
    """``--json``: one frame's figures for scripts (``window``: as for ``render``)."""
    dt = max(dt, 1e-6)
    net = _delta(cur, prev, "stripefs_read_seconds_total", source="network")
    mem = _delta(cur, prev, "stripefs_read_seconds_total", source="cache")
    return {
        "interval_s": dt,
        "reads_per_s": _delta(cur, prev, "stripefs_fuse_ops_total", op="read") / dt,
        "read_bytes_per_s": _delta(cur, prev, "stripefs_read_bytes_total") / dt,
        "network_share": net / (net + mem) if net + mem > 0 else None,
        "jobs": jobs(cur, *(window or (prev, dt))),
    }


#: jobs report every second (stripefs/data_wait.py): their rows cover at least this long, so that
#: every row holds whole reports, whatever the refresh interval
JOB_WINDOW_S = 2.0


def _window(history: deque, now: float) -> tuple[Samples, float]:
    """(samples, seconds before ``now``) of the newest scrape at least JOB_WINDOW_S old (else the oldest)."""
    while len(history) > 1 and now - history[1][0] >= JOB_WINDOW_S:
        history.popleft()
    then, samples = history[0]
    return samples, max(now - then, 1e-6)


def _endpoint(args) -> tuple[str, str]:
    """(metrics URL, title)."""
    if args.metrics:
        address = args.metrics.removeprefix("http://").removesuffix("/metrics")
        return f"http://{address}/metrics", args.metrics
    from .client.metrics import find_state

    mount = Path(args.mount).absolute()
    state = find_state(mount)
    if not state or not state.get("metrics"):
        raise QuietError(
            f"no running stripefs mount at {mount} has recorded a metrics endpoint "
            "(state files in /run/stripefs or $XDG_RUNTIME_DIR/stripefs); is it mounted, with metrics on? "
            "Otherwise give --metrics HOST:PORT"
        )
    return f"http://{state['metrics']}/metrics", f"{mount} (pid {state['pid']}, {state['metrics']})"


def main(args) -> int:
    url, title = _endpoint(args)
    try:
        prev = scrape(url)
    except (OSError, urllib.error.URLError) as exc:
        raise QuietError(f"cannot read {url}: {exc}", 2) from None
    last = time.monotonic()
    history = deque([(last, prev)])  # for the jobs' window
    frames = 0
    try:
        while True:
            time.sleep(args.interval)
            try:
                cur = scrape(url)
            except (OSError, urllib.error.URLError) as exc:
                raise QuietError(f"{url} stopped answering ({exc}); was the mount unmounted?", 2) from None
            now = time.monotonic()
            window = _window(history, now)
            history.append((now, cur))
            if args.json:
                print(json.dumps(as_json(cur, prev, now - last, window)), flush=True)
                prev, last = cur, now
                frames += 1
                if args.once or (args.iterations and frames >= args.iterations):
                    return 0
                continue
            lines = render(cur, prev, now - last, title, window)
            if args.once:
                print("\n".join(lines))
                return 0
            sys.stdout.write("\x1b[H\x1b[2J" + "\n".join(lines) + "\n")
            sys.stdout.flush()
            prev, last = cur, now
            frames += 1
            if args.iterations and frames >= args.iterations:
                return 0
    except KeyboardInterrupt:
        return 0


def _positive_seconds(text: str) -> float:
    import argparse

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value > 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"{text}: give a number of seconds above 0, e.g. 1 or 0.5")
    return value


def add_parser(sub) -> None:
    top = sub.add_parser(
        "top",
        help="live view of one mount: reads/s, MiB/s, cache hits, latencies, network vs cache time",
        description="Watch one mount: reads/s, MiB/s, cache hit rate, read-ahead use, FUSE latency percentiles, "
        "chunk-read latency per storage node, and how much of readers' time goes to waiting on the network "
        "versus being served from memory (is the GPU starving, and why?). Reads the mount's Prometheus endpoint.",
    )
    top.add_argument("mount", metavar="MOUNT", nargs="?", default=".", help="the mountpoint (default: the current directory)")
    top.add_argument("--metrics", metavar="HOST:PORT", help="the mount's metrics address, if it cannot be found from MOUNT")
    top.add_argument("-n", "--interval", type=_positive_seconds, default=1.0, help="seconds between refreshes (default: %(default)s)")
    top.add_argument("--once", action="store_true", help="print one frame (after one interval) without screen control, then exit")
    top.add_argument("--iterations", type=int, default=0, help="stop after this many frames (default: run until Ctrl-C)")
    top.add_argument("--json", action="store_true", help="print each frame as one line of JSON (rates, and per training "
                     "job its data-wait share, the split of its time in the mount and the verdict) instead of the screen")
    top.set_defaults(func=main)
