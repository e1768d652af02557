"""The mount's metrics: FUSE operations, bytes, the chunk cache, read-ahead, network waits.

Instrumentation is additive and small:

* ``instrument(ops)`` wraps every FUSE handler of one ``Operations`` instance
  (instance attributes shadow the class's methods, and the session's bridge
  looks handlers up on the instance), counting calls, failures by errno (answers such as
  ENOENT from a lookup apart: ``ANSWER_ERRNOS``) and latency per op,
  and bytes for ``read``/``write``. ``client/operations.py`` is untouched.
* The chunk cache counts hits and misses, and reports how long a *reader*
  waited for chunk data from the network (``network_wait``).
* The data path marks chunks it prefetched; the cache tells whether a
  prefetched chunk was later read (used) or evicted unread (wasted).

"Is my GPU starving, and why?"  Each ``read`` op's time is split in two:
the time it spent waiting for chunk data from storage nodes (a miss, or a
chunk still in flight) and the rest (served from the cache, or copying).
``stripefs_read_seconds_total{source="network"|"cache"}`` add up to the total
time readers spent inside stripefs; ``stripefs top`` shows the split.

The split works through a context variable: the read wrapper puts a fresh
``_ReadTiming`` in it, the cache adds its waits to whatever timing is current.
Tasks spawned during a read (prefetches) inherit the variable, so the timing is
closed when the read returns and later waits are not charged to it.

The mount records where its endpoint is in a state file (``state_path``),
keyed by mountpoint, so ``stripefs top MOUNT`` can find it.
"""

from __future__ import annotations

import contextvars
import errno
import functools
import json
import logging
import os
import stat
import time
from pathlib import Path

from prometheus_client import REGISTRY, Counter, Gauge, Histogram

from ..common.metrics import LATENCY_BUCKETS
from .fuse.replies import FuseError

log = logging.getLogger(__name__)

class _FoldFast:
    """A collector that adds what the fast paths counted (``fast``) into FUSE_OPS and FUSE_SECONDS
    before they are read: registered before them, so a scrape sees every request answered so far."""

    def describe(self):
        return ()  # (no metrics of its own: the registry then never calls collect to find their names)

    def collect(self):
        fold_fast()
        return ()


REGISTRY.register(_FoldFast())


class _SessionRequests:
    """``stripefs_fuse_requests_total{opcode}``: every request the own FUSE session read from the
    kernel (client/fuse/session.py ``counts``), those no handler sees included (IOCTLs answered
    ENOSYS, FORGETs, INTERRUPTs): what "requests per warm file" counts."""

    def __init__(self):
        self.counts: list[int] | None = None

    def describe(self):
        return ()

    def collect(self):
        counts = self.counts
        if counts is None:
            return
        from prometheus_client.core import CounterMetricFamily  # (only where a session serves the mount)

        from .fuse.abi import Opcode

        family = CounterMetricFamily("stripefs_fuse_requests", "FUSE requests the kernel sent the mount's own "
                                     "session, by opcode (including those no handler sees)", labels=["opcode"])
        for code, n in enumerate(list(counts)):
            if n:
                try:
                    name = Opcode(code).name.lower()
                except ValueError:
                    name = str(code)
                family.add_metric([name], n)
        yield family


SESSION_REQUESTS = _SessionRequests()
REGISTRY.register(SESSION_REQUESTS)

FUSE_OPS = Counter("stripefs_fuse_ops_total", "FUSE requests answered, by operation", ["op"])
FUSE_ERRORS = Counter(
    "stripefs_fuse_errors_total", "FUSE requests that failed (EIO, ETIMEDOUT, ENOSPC, EDQUOT, ...), by operation and errno",
    ["op", "errno"],
)
FUSE_ANSWERS = Counter(
    "stripefs_fuse_negative_answers_total",
    "FUSE requests answered with an errno that is an answer, not a failure (ENOENT from lookup, ENODATA from "
    "getxattr, ENOSYS for a declined open, EEXIST, EACCES, ...), by operation and errno",
    ["op", "errno"],
)
FUSE_SECONDS = Histogram("stripefs_fuse_op_seconds", "Time to answer a FUSE request, by operation", ["op"], buckets=LATENCY_BUCKETS)
READ_BYTES = Counter("stripefs_read_bytes_total", "Bytes returned to readers")
WRITE_BYTES = Counter("stripefs_write_bytes_total", "Bytes accepted from writers")
READ_SECONDS = Counter(
    "stripefs_read_seconds_total",
    "Time readers spent in read(): waiting on storage nodes (network) or served from memory (cache)",
    ["source"],
)
ASYNC_CREATES = Counter("stripefs_async_creates_total", "Creates answered by the mount and sent to the daemon after (client/async_dirops.py)")
ASYNC_REFUSED = Counter(
    "stripefs_async_refused_total", "Creates answered by the mount that the daemon then refused (their next operation fails)"
)
KERNEL_CACHE_DROPS = Counter(
    "stripefs_kernel_cache_drops_total",
    "Times the mount dropped everything it had told the kernel to keep, and every callback it held "
    "(client/kernel_cache.py drop_all), by cause: silence (the change feed said nothing for "
    "EVENTS_SILENCE_S), gap (a change number missed), change_log (another change log: a restored database, "
    "a new daemon's first event), undecodable, daemon (another daemon publishes the feed); until it "
    "follows the feed again the kernel asks about every name",
    ["cause"],
)
FEED_HEALTHY = Gauge(
    "stripefs_change_feed_healthy",
    "1 while the mount follows the change feed in order (names, attributes and callbacks may be kept long in the "
    "kernel), 0 before it has subscribed and after a silence, until it follows again (client/kernel_cache.py)",
)
CACHE_HITS = Counter("stripefs_cache_hits_total", "Chunk lookups answered from the client's chunk cache")
CACHE_MISSES = Counter("stripefs_cache_misses_total", "Chunk lookups that had to fetch from a storage node")
THREAD_READS = Counter(
    "stripefs_thread_reads_total",
    "Cold READs taken by the plain-thread path (client/thread_reads.py): answered there (served), or handed to "
    "trio's path after all (handed_back: a failure, a timeout, the mount stopping); and the loads the FUSE reader "
    "thread sent itself (reader: client/reader_loads.py), whose READs count as served too",
    ["outcome"],
)
THREAD_META = Counter(
    "stripefs_thread_meta_total",
    "GETATTR and LOOKUP misses taken by the plain-thread path (client/thread_meta.py): answered there (served, "
    "lookup_served), or handed to trio's path after all (handed_back, lookup_handed_back: no answer in time, no "
    "daemon, the mount stopping, a lookup's name not found); held: a request the daemon held past the threads' "
    "2 s, then waited for without a worker (no second request), counted again as served or handed back",
    ["outcome"],
)
EC_STRIPE_WRITES = Counter(
    "stripefs_ec_stripe_writes_total",
    "Erasure-coded stripe versions written, by how: delta (a partial write: only the changed columns of the "
    "touched data fragments and of the parity, new parity = old parity + coefficient x (new - old data)), "
    "full (the whole stripe coded and written), columns (a later piece of a stripe the session wrote already, "
    "held by the mount: only the touched columns of the touched data fragments and of the parity are written, "
    "nothing read), delta_fallback (a delta or columns write that could not read or write a "
    "fragment and was written full instead)",
    ["path"],
)
EC_FRAGMENTS_KEPT = Counter(
    "stripefs_ec_fragments_kept_total",
    "Data fragments a parity delta did not touch and left at their committed version (common/protocol.ChunkRef "
    "fversions): each an empty copy-on-write write not sent",
)
EC_FRAGMENT_READS_SPARED = Counter(
    "stripefs_ec_fragment_reads_spared_total",
    "Data fragments a read-modify-write of a stripe did not read: its dirty ranges cover them whole",
)
EC_FRAGMENTS_UNCHANGED = Counter(
    "stripefs_ec_fragments_unchanged_total",
    "Data fragments of a whole-stripe write (read-modify-write, a truncate's cut, a rewrite of a held stripe) "
    "whose bytes the write did not change: left at their version (ChunkRef fversions), not sent",
)
PREFETCH_RACE = Counter(
    "stripefs_prefetch_race_total",
    "READs of a chunk the prefetcher's batch (a ReadChunksReq, client/prefetch.py) was fetching at the time: "
    "loaded_again (the READ sent a load of its own to a node), waited (it waited for the batch's bytes, "
    "ChunkCache.claim)",
    ["outcome"],
)
PREFETCH_PUSH_SECONDS = Counter(
    "stripefs_prefetch_push_seconds",
    "Seconds from a prefetched file's bytes landing (its batch's reply) to its push into the page cache "
    "(NOTIFY_STORE, client/prefetch.py), summed over the files pushed, by stage: landed_to_thread (until the "
    "pushing thread took its batch: the batches queued before it), thread_to_push (until its own push began: "
    "the files before it in its batch, the kernel lock), push (its own writev)",
    ["stage"],
)
PREFETCH_PUSH = Counter(
    "stripefs_prefetch_push",
    "The prefetcher's pushes into the page cache: files pushed, and hops (the pushing thread's turns, each "
    "with the batches queued, reported to the trio thread once)",
    ["what"],
)
READAHEAD = Counter(
    "stripefs_readahead_chunks_total",
    "Chunks prefetched (fetched), later read (used), or evicted or dropped unread (wasted)",
    ["outcome"],
)

#: errnos that answer a question rather than report a failure: "no such name" to a lookup, "no such
#: attribute" to getxattr, "not implemented" to the open/flush the mount declines on purpose (the kernel
#: then stops sending them), a refused permission, an existing name, ... Every other errno (EIO,
#: ETIMEDOUT, ENOSPC, EDQUOT, ENOTCONN, EBADF, ...) is a failure: stripefs_fuse_errors_total.
ANSWER_ERRNOS = frozenset({
    errno.ENOENT, errno.ENODATA, errno.ENOSYS, errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR,
    errno.ERANGE, errno.EACCES, errno.EPERM, errno.EROFS, errno.EXDEV, errno.ENAMETOOLONG, errno.EINVAL,
    errno.ENOTSUP, errno.EOPNOTSUPP, errno.ELOOP, errno.EMLINK, errno.E2BIG, errno.EFBIG, errno.ENOTTY,
})


def is_failure(err: int) -> bool:
    """Whether a FUSE reply with ``err`` reports a failure (counted as an error), not an answer."""
    return err not in ANSWER_ERRNOS


#: FUSE handlers that are wrapped (every request handler client/operations_bridge.py calls)
OPS = (
    "lookup getattr setattr readlink mknod mkdir symlink link unlink rmdir rename opendir readdir releasedir "
    "statfs setxattr getxattr listxattr removexattr open create read write flush fsync release access "
    "fsyncdir ioctl"
).split()
#: handlers of requests that name the inode, sent without OPEN (no-open), counted as the request they answer
BY_INODE = {"read_inode": "read", "write_inode": "write", "flush_inode": "flush", "fsync_inode": "fsync"}


class _ReadTiming:
    __slots__ = ("network", "open")

    def __init__(self) -> None:
        self.network = 0.0
        self.open = True


_current_read: contextvars.ContextVar[_ReadTiming | None] = contextvars.ContextVar("stripefs_read_timing", default=None)


def network_wait(seconds: float) -> None:
    """The current reader waited ``seconds`` for chunk data from the network (called by the chunk cache)."""
    timing = _current_read.get()
    if timing is not None and timing.open:
        timing.network += seconds


def _timed(op: str, fn, jobs=None, by_inode: bool = False):
    ops, latency = FUSE_OPS.labels(op), FUSE_SECONDS.labels(op)  # label children resolved once
    read_network, read_cache = READ_SECONDS.labels("network"), READ_SECONDS.labels("cache")

    @functools.wraps(fn)
    async def wrapper(*args, **kwargs):
        timing = token = result = None
        if op == "read":
            timing = _ReadTiming()
            token = _current_read.set(timing)
        started = time.perf_counter()
        try:
            result = await fn(*args, **kwargs)
        except FuseError as exc:
            (FUSE_ERRORS if is_failure(exc.errno) else FUSE_ANSWERS).labels(op, str(exc.errno)).inc()
            raise
        finally:
            elapsed = time.perf_counter() - started
            ops.inc()
            latency.observe(elapsed)
            network = 0.0
            if timing is not None:
                timing.open = False
                _current_read.reset(token)
                network = min(timing.network, elapsed)  # parallel chunk fetches overlap
                read_network.inc(network)
                read_cache.inc(elapsed - network)
            if jobs is not None and jobs.active:  # training jobs that report (client/jobs.py)
                jobs.account(op, args, result, elapsed, network, by_inode)
        if op == "read":
            READ_BYTES.inc(len(result))
        elif op == "write":
            WRITE_BYTES.inc(result)
        return result

    return wrapper


#: op -> [requests, seconds, of them already in FUSE_OPS/FUSE_SECONDS (fold_fast): requests, seconds]
_fast: dict[str, list] = {}
#: (op, errno) -> [answers, of them already in FUSE_ERRORS/FUSE_ANSWERS (fold_fast)]
_fast_errnos: dict[tuple[str, int], list] = {}


def fast(op: str) -> list:
    """The plain counters of ``op``'s fast path (the own FUSE session's, client/operations_bridge.py):
    the caller adds 1 to ``[0]`` and the seconds it took to ``[1]`` per request it answered. Plain
    ints, no lock and no prometheus call per request (those cost more than the answer itself);
    one thread writes them (the session's reader, under the bridge's fast_lock), ``fold_fast``
    reads them at each scrape."""
    counts = _fast.get(op)
    if counts is None:
        counts = _fast[op] = [0, 0.0, 0, 0.0]
    return counts


def fold_fast() -> None:
    """Add what the fast paths counted since the last fold into FUSE_OPS and FUSE_SECONDS (each
    fold's requests go to the histogram bucket of their mean time), and their errnos into
    FUSE_ERRORS and FUSE_ANSWERS."""
    for op, counts in list(_fast.items()):
        n, seconds = counts[0] - counts[2], counts[1] - counts[3]
        if n <= 0:
            continue
        counts[2] += n
        counts[3] += seconds
        FUSE_OPS.labels(op).inc(n)
        hist = FUSE_SECONDS.labels(op)
        hist._sum.inc(seconds)
        mean = seconds / n
        for i, bound in enumerate(hist._upper_bounds):
            if mean <= bound:
                hist._buckets[i].inc(n)
                break
    for (op, err), counts in list(_fast_errnos.items()):
        n = counts[0] - counts[1]
        if n > 0:
            counts[1] += n
            (FUSE_ERRORS if is_failure(err) else FUSE_ANSWERS).labels(op, str(err)).inc(n)


def observe(op: str, seconds: float, err: int | None = None) -> None:
    """Count and time one FUSE request answered outside the handlers this module wraps (the own
    FUSE session's fast paths, client/operations_bridge.py); ``err``: the errno it was answered."""
    counts = fast(op)
    counts[0] += 1
    counts[1] += seconds
    if err is not None:  # (a prometheus labels().inc() here cost a hot IOCTL a fifth of its time)
        errs = _fast_errnos.get((op, err))
        if errs is None:
            errs = _fast_errnos[(op, err)] = [0, 0]
        errs[0] += 1


def instrument(ops, jobs=None) -> None:
    """Count and time every FUSE handler of ``ops`` (an Operations instance); with ``jobs``
    (client/jobs.py), also per training job."""
    for name, op in (*((op, op) for op in OPS), *BY_INODE.items()):
        fn = getattr(ops, name, None)
        if fn is not None:
            setattr(ops, name, _timed(op, fn, jobs, by_inode=name in BY_INODE))
    for outcome in ("fetched", "used", "wasted"):
        READAHEAD.labels(outcome)  # exported as 0 from the start
    for source in ("network", "cache"):
        READ_SECONDS.labels(source)


# -- where a mount's endpoint is --------------------------------------------------


def state_dir() -> Path:
    """Per-user runtime directory for mount state files and default logs: /run/stripefs for root,
    else under $XDG_RUNTIME_DIR (or ~/.cache). Never /tmp: a name there can be planted by anyone."""
    if os.geteuid() == 0:
        return Path("/run/stripefs")
    return Path(os.environ.get("XDG_RUNTIME_DIR") or Path.home() / ".cache") / "stripefs"


def ensure_state_dir() -> Path:
    """``state_dir()``, created if missing; OSError unless it is a directory only this user can write."""
    path = state_dir()
    path.mkdir(mode=0o755 if os.geteuid() == 0 else 0o700, parents=True, exist_ok=True)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise OSError(f"{path} is not a directory only this user can write to")
    return path


def state_path(mountpoint: str | Path, directory: Path | None = None) -> Path:
    name = str(Path(mountpoint).absolute()).strip("/").replace("/", "_") or "root"
    return (directory or state_dir()) / f"mount-{name}.json"


def write_state(mountpoint: str, metrics_address: str | None) -> Path | None:
    """Record this mount's pid and metrics address; None (and a warning) when that is impossible."""
    try:
        path = state_path(mountpoint, ensure_state_dir())
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"mountpoint": str(mountpoint), "pid": os.getpid(), "metrics": metrics_address}))
        tmp.replace(path)
    except OSError as exc:
        log.warning("cannot write the mount state file ('stripefs top' will need --metrics): %s", exc)
        return None
    return path


def remove_state(mountpoint: str) -> None:
    path = state_path(mountpoint)
    try:
        if json.loads(path.read_text()).get("pid") == os.getpid():
            path.unlink()
    except (OSError, ValueError):
        pass


def find_state(mountpoint: str | Path) -> dict | None:
    """The state a live mount at ``mountpoint`` recorded (root's or this user's), or None."""
    candidates = [state_path(mountpoint), state_path(mountpoint, Path("/run/stripefs"))]
    for path in candidates:
        try:
            state = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        try:
            os.kill(int(state["pid"]), 0)
        except ProcessLookupError:
            continue
        except (PermissionError, KeyError, TypeError, ValueError):
            pass
        return state
    return None
