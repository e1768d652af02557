"""The metadata daemon's cluster gauges, refreshed by one task.

Every ``PUBLISH_INTERVAL_S`` the task takes the service lock once, reads the
node registry, the namespace counts, the garbage count and the repair backlog
(chunks with a copy or fragment on a node that is down), and sets the gauges.
Reading on the trio thread, between operations, keeps the HTTP scrape thread
away from SQLite and from the registry's dicts. The backlog query is a full
scan of the chunks table, which is why it runs here every few seconds and not
per scrape; with every node up it costs nothing.

The same numbers answer ``StatusReq`` (``cluster_health``), so ``stripefs
status`` and Prometheus never disagree about what "degraded" means.
"""

from __future__ import annotations

import logging

import trio
from prometheus_client import Gauge

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

PUBLISH_INTERVAL_S = 2.0


def cluster_health(service) -> dict[str, int]:
    """Counts for status and metrics; the caller holds the service lock."""
    down = [n.node_id for n in service.nodes.info() if n.state != "up"]
    counts = service.store.counts()
    return {
        "files": counts["files"],
        "chunks": counts["chunks"],
        "degraded_chunks": service.store.count_chunks_on(down),
        "garbage_copies": service.store.count_garbage(),
    }


async def publish_cluster_metrics(service, *, interval: float = PUBLISH_INTERVAL_S) -> None:
    """Refresh the daemon's gauges until cancelled."""
    while True:
        health = await service._read(cluster_health, service)
        for n in service.nodes.info():
            node = str(n.node_id)
            NODE_UP.labels(node, n.host).set(1 if n.state == "up" else 0)
            NODE_CAPACITY.labels(node).set(n.capacity_bytes)
            NODE_USED.labels(node).set(n.used_bytes)
            NODE_FREE.labels(node).set(n.free_bytes)
            NODE_CHUNKS.labels(node).set(n.chunks)
        FILES.set(health["files"])
        CHUNKS.set(health["chunks"])
        DEGRADED_CHUNKS.set(health["degraded_chunks"])
        GARBAGE_COPIES.set(health["garbage_copies"])
        SESSIONS.set(len(service.sessions))
        await trio.sleep(interval)
