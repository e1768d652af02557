"""The metadata daemon's cluster gauges, refreshed by one task.

Every ``PUBLISH_INTERVAL_S`` the task reads the node registry (memory, on the
trio thread) and the database counts: files, chunks, copies awaiting deletion
and the repair backlog (chunks with a copy or fragment on a node that is down,
a full scan of the chunks table). The database part runs in a worker thread
on a second, read-only connection: in WAL mode it reads the last committed
state without taking the service lock, so a long scan never delays metadata
requests. The HTTP scrape thread only reads the gauges.

``StatusReq`` uses the same ``cluster_health`` (on the daemon's own
connection, under the lock), so ``stripefs status`` and Prometheus agree on
what "degraded" means.
"""

from __future__ import annotations

import functools
import logging
import sqlite3

import trio
from prometheus_client import Counter, Gauge, Histogram

from ..common.errors import StripefsError
from .store import SqliteStore

log = logging.getLogger(__name__)

NODE_UP = Gauge("stripefs_node_up", "1 while a storage node is up (heartbeating), 0 once declared down", ["node", "host"])
NODE_CAPACITY = Gauge("stripefs_node_capacity_bytes", "Bytes a storage node offers", ["node"])
NODE_USED = Gauge("stripefs_node_used_bytes", "Bytes of chunk data a storage node holds", ["node"])
NODE_FREE = Gauge("stripefs_node_free_bytes", "Bytes a storage node can still take", ["node"])
NODE_CHUNKS = Gauge("stripefs_node_chunks", "Chunk files a storage node holds", ["node"])
FILES = Gauge("stripefs_files", "Regular files in the namespace")
CHUNKS = Gauge("stripefs_chunks", "Chunks in the namespace (each stored as one or more copies or fragments)")
SESSIONS = Gauge("stripefs_sessions", "Mounts with a live session")
DEGRADED_CHUNKS = Gauge(
    "stripefs_degraded_chunks", "Chunks with at least one copy or fragment on a node that is down: the repair backlog"
)
GARBAGE_COPIES = Gauge("stripefs_garbage_copies", "Chunk copies waiting to be deleted from storage nodes")
UNDER_REPLICATED = Gauge(
    "stripefs_under_replicated_chunks", "Chunks below their target redundancy, as of the last repair scan (daemon/repair.py)"
)
LOST_CHUNKS = Gauge("stripefs_lost_chunks", "Chunks without any live copy, as of the last repair scan")
REPAIR_BACKLOG = Gauge("stripefs_repair_backlog_copies", "Copies the running repair, drain or rebalance pass still has to make")
CALLBACK_FILES = Gauge("stripefs_callback_keys", "Files and names mounts cache under callbacks (daemon/callbacks.py)")
CALLBACK_WAITS = Gauge("stripefs_callback_waits", "Changes that waited for another mount's acknowledgement since the daemon started")
CALLBACK_TIMEOUTS = Gauge("stripefs_callback_timeouts", "Waits for a mount's acknowledgement that ran out (WAIT_S) since the daemon started")
CALLBACK_LATE = Gauge("stripefs_callback_late_acks", "Acknowledgements later than LATE_S (an offence: the key loses its callbacks) since the daemon started")
REPAIR_COPIED = Gauge("stripefs_repair_copied_bytes", "Bytes copied by repair, drain and rebalance since the daemon started")

# the cold tier (daemon/tiering.py): counted where it happens; the backlog by the publishing task
TIER_OBJECTS = Counter(
    "stripefs_tier_objects", "Chunk objects moved to a tier (migrated), back from one (recalled), or deleted there", ["direction"]
)
COMMIT_RUNS = Counter("stripefs_commit_runs", "Runs of a BatchReq's commits done in one savepoint (daemon/burst.py _commits)")
COMMITS_IN_RUNS = Counter("stripefs_commits_in_runs", "Commits done in such runs (those answered from their OnceReq records too)")
TIER_BYTES = Counter("stripefs_tier_bytes", "Bytes moved to a tier (migrated) and back from one (recalled)", ["direction"])
TIER_RECALL_SECONDS = Histogram(
    "stripefs_tier_recall_seconds", "How long bringing one chunk back from its tier took (a reader waits that long)",
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
TIER_BACKLOG = Gauge("stripefs_tier_migrate_backlog_chunks", "Chunks queued for migration to a tier (policy pass, resumed ones)")

PUBLISH_INTERVAL_S = 2.0


def cluster_health(store: SqliteStore, nodes: list) -> dict[str, int]:
    """Counts for status and metrics from ``store`` and the registry's ``nodes`` (NodeInfo list)."""
    down = [n.node_id for n in nodes if n.state not in ("up", "suspect", "draining")]  # copies there are not live
    counts = store.counts()
    return {
        "files": counts["files"],
        "chunks": counts["chunks"],
        "degraded_chunks": store.count_chunks_on(down),
        "garbage_copies": store.count_garbage(),
        "tier_backlog": store.tier_backlog()[0],
    }


async def publish_cluster_metrics(service, *, interval: float = PUBLISH_INTERVAL_S) -> None:
    """Refresh the daemon's gauges until cancelled."""
    if service.store.group_commit:
        conn = sqlite3.connect(f"file:{service.db_path}?mode=ro", uri=True, check_same_thread=False)
        reader = SqliteStore(conn)
        read_health = functools.partial(cluster_health, reader)
    else:  # PostgreSQL: a read-only transaction on the service's pool
        conn = None
        read_health = functools.partial(service.store.run, cluster_health, service.store, readonly=True)
    limiter = trio.CapacityLimiter(1)
    try:
        while True:
            nodes = service.nodes.info()
            for n in nodes:
                node = str(n.node_id)
                NODE_UP.labels(node, n.host).set(1 if n.state in ("up", "suspect", "draining") else 0)
                NODE_CAPACITY.labels(node).set(n.capacity_bytes)
                NODE_USED.labels(node).set(n.used_bytes)
                NODE_FREE.labels(node).set(n.free_bytes)
                NODE_CHUNKS.labels(node).set(n.chunks)
            SESSIONS.set(len(service.sessions))
            callbacks = service.callbacks.counts()
            CALLBACK_FILES.set(callbacks["keys"])
            CALLBACK_WAITS.set(callbacks["waits"])
            CALLBACK_TIMEOUTS.set(callbacks["timeouts"])
            CALLBACK_LATE.set(callbacks["late"])
            repair = service.healer.info()
            UNDER_REPLICATED.set(repair.under_replicated)
            LOST_CHUNKS.set(repair.lost)
            REPAIR_BACKLOG.set(repair.backlog)
            REPAIR_COPIED.set(repair.copied_bytes)
            try:
                health = await trio.to_thread.run_sync(read_health, nodes, limiter=limiter)
            except (*service.store.errors, StripefsError) as exc:
                log.warning("metrics: cannot read counts from %s: %s", service.db_name(), exc)
            else:
                FILES.set(health["files"])
                CHUNKS.set(health["chunks"])
                DEGRADED_CHUNKS.set(health["degraded_chunks"])
                GARBAGE_COPIES.set(health["garbage_copies"])
                TIER_BACKLOG.set(health["tier_backlog"])
            await trio.sleep(interval)
    finally:
        if conn is not None:
            conn.close()
