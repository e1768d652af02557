"""Prometheus metrics shared by every process, and the HTTP endpoint that serves them.

Every process (metadata daemon, storage node, mount) serves its metrics at the
``metrics`` address of its config (``HOST:PORT``; port 0 picks a free one; an
empty string turns the endpoint off) on ``/metrics``. The endpoint runs in
prometheus-client's own daemon thread and only reads counters, so it never
touches the trio loop. ``serve`` returns the address actually bound, which the
process logs and, for a mount, records in its state file (client.metrics).

Metric names (all prefixed ``stripefs_``) are documented in docs/operations.md.
This module holds what every role has (RPCs sent, requests served); each role's
own metrics live beside it: daemon/metrics.py (cluster gauges: nodes, repair
backlog), storage_node/metrics.py (the disk), client/metrics.py (FUSE ops,
cache, read-ahead, network waits). So a process exports only its own series.

Label cardinality is bounded: ``peer`` is a node or daemon address, ``type``
a protocol message name, ``op`` a FUSE operation name, ``node`` a node id.
"""

from __future__ import annotations

import logging

from prometheus_client import Counter, Histogram, disable_created_metrics, start_http_server

log = logging.getLogger(__name__)

#: latency buckets from 50 µs (a cached read) to 10 s (an RPC timeout)
LATENCY_BUCKETS = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)

# -- every process: RPCs it sends (common.transport.RpcClient.call) ------------------

RPC_SECONDS = Histogram(
    "stripefs_rpc_seconds", "Round-trip time of requests this process sent, by peer and message type",
    ["peer", "type"], buckets=LATENCY_BUCKETS,
)
RPC_ERRORS = Counter(
    "stripefs_rpc_errors_total", "Requests this process sent that failed (error reply or timeout), by peer and error",
    ["peer", "type", "code"],
)

# -- every server: requests it answered (common.transport.serve) ---------------------

REQUEST_SECONDS = Histogram(
    "stripefs_requests_seconds", "Time to handle a request, by server and message type",
    ["server", "type"], buckets=LATENCY_BUCKETS,
)
REQUEST_ERRORS = Counter(
    "stripefs_request_errors_total", "Requests answered with an error, by server, message type and error code",
    ["server", "type", "code"],
)
PAYLOAD_BYTES = Counter(
    "stripefs_payload_bytes_total", "Bulk payload bytes received (in) and sent (out) by a server",
    ["server", "direction"],
)

def serve(address: str) -> str | None:
    """Start the /metrics endpoint at ``HOST:PORT``; the address bound, or None when ``address`` is empty.

    Raises ValueError for a malformed address and OSError when it cannot bind.
    """
    if not address:
        return None
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"metrics address {address!r} must look like HOST:PORT (port 0: any free port)")
    host = host.strip("[]") or "0.0.0.0"
    disable_created_metrics()  # no *_created series: half the output, no use on a dashboard
    server, _ = start_http_server(int(port), addr=host)
    bound_host, bound_port = server.server_address[:2]
    bound = f"{bound_host}:{bound_port}"
    log.info("metrics at http://%s/metrics", bound)
    return bound
