"""A storage node's own gauges (the disk it owns), set at every heartbeat.

Requests served and payload bytes in and out are counted for every server in
common/metrics.py (``stripefs_requests_seconds{server="storage-N"}``,
``stripefs_payload_bytes_total``).
"""

from __future__ import annotations

from prometheus_client import Gauge

STORE_CAPACITY = Gauge("stripefs_store_capacity_bytes", "Bytes this storage node offers")
STORE_FREE = Gauge("stripefs_store_free_bytes", "Bytes this storage node can still take")
STORE_USED = Gauge("stripefs_store_used_bytes", "Bytes of chunk data on this storage node")
STORE_CHUNKS = Gauge("stripefs_store_chunks", "Chunk files on this storage node")


def set_store_usage(usage) -> None:
    """A storage node's usage (ChunkStore.usage()), published at every heartbeat."""
    STORE_CAPACITY.set(usage.capacity_bytes)
    STORE_FREE.set(usage.free_bytes)
    STORE_USED.set(usage.used_bytes)
    STORE_CHUNKS.set(usage.chunks)
