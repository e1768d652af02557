"""``stripefs status``: the cluster as the metadata daemon sees it, as a table or as JSON.

JSON keys (``stripefs status --json``) are a stable interface for scripts:
keys are only ever added, never renamed or removed. docs/operations.md lists
them; so does this table::

    meta               address of the daemon that answered
    boot_id            changes when the daemon restarts
    daemon, leader     the daemon that answered, and the one running the cluster-wide duties
                       (node health decisions, repair, garbage collection: daemon/duties.py),
                       both as "LISTEN_ADDRESS#BOOT"; leader "" while no daemon holds the lease
    health             "ok": every node up and every chunk at full redundancy;
                       "degraded": a node is down, a chunk has a copy on a down node or is
                       under-replicated; "no_nodes": no storage node is up
    files, directories, chunks, logical_bytes, sessions (mounts with a live session)
                       (files, directories and logical_bytes: live ones, not snapshots')
    snapshots, snapshot_bytes  directory snapshots, and the bytes only they hold (copied out when
                       the live side changed): what deleting them all would free, per copy
    nodes_up, nodes_total
    capacity_bytes, free_bytes    over the nodes that are up, a file system that several nodes
                       share counted once (common/space.py)
    used_bytes         what stripefs stores on the nodes that are up (their chunk files)
    degraded_chunks    chunks with a copy or fragment on a node that is down
    repair_backlog     chunks waiting for repair (= under_replicated)
    under_replicated   chunks below their target redundancy (daemon/repair.py)
    repair             under_replicated, lost (no live copy), backlog and backlog_bytes (copies
                       still to make: repair, drain, rebalance), copied and copied_bytes (since
                       the daemon started), failed, bandwidth (bytes/s, 0: unlimited), scanned_age_s
    garbage_copies     chunk copies waiting to be deleted from storage nodes
    layouts[]          per redundancy ("replicas=2", "ec=4+2", ...): redundancy, files,
                       logical_bytes, raw_bytes (copies or fragments, estimated from the
                       metadata), overhead (raw/logical), degraded_stripes (EC stripes with
                       a missing fragment, until repair reconstructs it)
    quotas[]           every directory quota: path, ino, max_bytes, max_inodes (0: no limit),
                       used_bytes, used_inodes (stripefs quota, daemon/quota.py)
    nodes[]            node_id, address, host, state, capacity_bytes, free_bytes, used_bytes,
                       chunks, last_heartbeat_age_s (-1: never), placed_chunks (chunk copies the
                       namespace places there), filesystem (MACHINE:DEV:FSID of its data: nodes
                       with the same one share a disk)

A node's state is "up", "suspect" (silent for ``node_suspect_s``, still used),
"down" (silent for ``node_timeout_s``), "draining" or "removed" (operator);
nodes_up counts the live ones (up, suspect, draining), nodes_total all but
the removed ones.
"""

from __future__ import annotations

import json

import msgspec

from .common import protocol as p
from . import quota_cli
from .cluster import add_cluster_args, meta_addresses, rpc
from .common.layout import format_size
from .common.space import shared_capacity

LIVE = ("up", "suspect", "draining")


def health(rsp: p.StatusRsp) -> str:
    up = sum(n.state in LIVE for n in rsp.nodes)
    if up == 0:
        return "no_nodes"
    if up < sum(n.state != "removed" for n in rsp.nodes) or rsp.degraded_chunks or rsp.under_replicated:
        return "degraded"
    return "ok"


def to_json(rsp: p.StatusRsp, address: str) -> dict:
    up = [n for n in rsp.nodes if n.state in LIVE]
    capacity, free = shared_capacity((n.filesystem, n.capacity_bytes, n.free_bytes) for n in up)
    return {
        "meta": address,
        "boot_id": rsp.boot_id,
        "daemon": rsp.daemon,
        "leader": rsp.leader,
        "health": health(rsp),
        "files": rsp.files,
        "directories": rsp.directories,
        "chunks": rsp.chunks,
        "logical_bytes": rsp.logical_bytes,
        "snapshots": rsp.snapshots,
        "snapshot_bytes": rsp.snapshot_bytes,
        "sessions": rsp.sessions,
        "nodes_up": len(up),
        "nodes_total": sum(n.state != "removed" for n in rsp.nodes),
        "capacity_bytes": capacity,
        "used_bytes": sum(n.used_bytes for n in up),
        "free_bytes": free,
        "degraded_chunks": rsp.degraded_chunks,
        "repair_backlog": rsp.under_replicated if rsp.repair is not None else rsp.degraded_chunks,
        "under_replicated": rsp.under_replicated,
        "repair": msgspec.structs.asdict(rsp.repair) if rsp.repair is not None else None,
        "garbage_copies": rsp.garbage_copies,
        "layouts": [
            {
                "redundancy": u.redundancy, "files": u.files, "logical_bytes": u.logical_bytes, "raw_bytes": u.raw_bytes,
                "overhead": round(u.raw_bytes / u.logical_bytes, 3) if u.logical_bytes else None,
                "degraded_stripes": u.degraded_stripes,
            }
            for u in rsp.layouts
        ],
        "quotas": [quota_cli.to_json(q) for q in rsp.quotas],
        "tiering": msgspec.to_builtins(rsp.tiering) if rsp.tiering is not None else None,  # docs/tiering.md
        "nodes": [
            {
                "node_id": n.node_id, "address": n.address, "host": n.host, "state": n.state,
                "capacity_bytes": n.capacity_bytes, "free_bytes": n.free_bytes, "used_bytes": n.used_bytes,
                "chunks": n.chunks, "last_heartbeat_age_s": round(n.last_heartbeat_age_s, 1),
                "placed_chunks": n.placed_chunks, "filesystem": n.filesystem,
            }
            for n in rsp.nodes
        ],
    }


def count(n: int, noun: str, plural: str | None = None) -> str:
    """'1 file', '2 files', '0 files'."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"


def render(rsp: p.StatusRsp, address: str) -> str:
    s = to_json(rsp, address)
    lines = [
        f"metadata daemon {address}: {s['health'].upper()}, {s['nodes_up']}/{s['nodes_total']} storage nodes up, "
        f"{count(s['sessions'], 'mount')}",
        f"  data        {count(s['files'], 'file')}, {count(s['directories'], 'directory', 'directories')}, "
        f"{count(s['chunks'], 'chunk')}, "
        f"{format_size(s['logical_bytes'])} of file data"
        + (f"; {count(s['snapshots'], 'snapshot')} holding {format_size(s['snapshot_bytes'])} of their own" if s["snapshots"] else ""),
        f"  capacity    {format_size(s['used_bytes'])} used by stripefs, {format_size(s['free_bytes'])} free of "
        f"{format_size(s['capacity_bytes'])} on the nodes that are up (a disk shared by nodes counted once)",
        f"  redundancy  {_redundancy(rsp)}, {count(s['degraded_chunks'], 'chunk')} degraded (a copy on a down node), "
        f"{count(s['garbage_copies'], 'copy', 'copies')} awaiting deletion",
    ]
    if rsp.daemon:
        leader = rsp.leader or "no daemon yet (the lease is being taken)"
        here = " (this daemon)" if rsp.leader == rsp.daemon else ""
        lines.append(f"  duties      led by {leader}{here}")
    if rsp.repair is not None:
        r = rsp.repair
        limit = f"{format_size(r.bandwidth)}/s" if r.bandwidth else "unlimited"
        lines.append(
            f"  repair      backlog {r.backlog} copies ({format_size(r.backlog_bytes)}), {r.copied} copies "
            f"({format_size(r.copied_bytes)}) made since the daemon started, {r.failed} failed, limit {limit}"
        )
    for u in s["layouts"]:
        overhead = f"{u['overhead']:.2f}x" if u["overhead"] else "-"
        degraded = f", {u['degraded_stripes']} degraded stripe(s) being reconstructed" if u["degraded_stripes"] else ""
        lines.append(
            f"  {u['redundancy']:<11} {count(u['files'], 'file')}, {format_size(u['logical_bytes'])} logical, "
            f"{format_size(u['raw_bytes'])} raw, overhead {overhead}{degraded}"
        )
    for q in rsp.quotas:
        lines.append(f"  quota       {quota_cli.render(q)}")
    t = rsp.tiering
    if t is not None and t.tiers:
        for tier in t.tiers:
            lines.append(f"  tier        {tier.name}: {tier.objects} object(s), {format_size(tier.bytes)} in {tier.url}")
        limit = f"{format_size(t.bandwidth)}/s" if t.bandwidth else "unlimited"
        lines.append(
            f"  tiering     backlog {t.migrate_backlog} chunk(s) to migrate ({format_size(t.migrate_backlog_bytes)}), "
            f"{t.recalls_in_flight} recall(s) in flight; since start {t.migrated} migrated ({format_size(t.migrated_bytes)}), "
            f"{t.recalled} recalled ({format_size(t.recalled_bytes)}), {t.failed} failed, "
            f"{t.garbage_objects} object(s) awaiting deletion; policy limit {limit}"
        )
    lines += [
        "",
        f"  {'node':>5} {'state':<8} {'host':<14} {'used':>9} {'free':>9} {'capacity':>9} {'chunks':>8} {'heartbeat':>9}  address",
    ]
    for n in rsp.nodes:
        beat = "never" if n.last_heartbeat_age_s < 0 else f"{n.last_heartbeat_age_s:.0f}s ago"
        lines.append(
            f"  {n.node_id:>5} {n.state:<8} {n.host[:14]:<14} {format_size(n.used_bytes):>9} {format_size(n.free_bytes):>9} "
            f"{format_size(n.capacity_bytes):>9} {n.chunks:>8} {beat:>9}  {n.address}"
        )
    if not rsp.nodes:
        lines.append("  (no storage node has registered yet)")
    return "\n".join(lines)


def _redundancy(rsp: p.StatusRsp) -> str:
    if rsp.repair is None:
        return "unknown"
    if not rsp.under_replicated:
        return "full"
    lost = f", {rsp.repair.lost} WITHOUT ANY LIVE COPY" if rsp.repair.lost else ""
    return f"{count(rsp.under_replicated, 'chunk')} under-replicated{lost}"


def render_local(status: dict) -> str:
    """``stripefs local status``: one line per process of a local cluster (LocalCluster.status())."""
    lines = []
    for proc in status["processes"]:
        where = proc["address"] or proc.get("mountpoint")
        stored = "" if proc["bytes_stored"] is None else f"  {format_size(proc['bytes_stored'])} stored"
        node = f" {proc['node_id']}" if proc["node_id"] else ""
        metrics = f"  metrics {proc['metrics']}" if proc.get("metrics") else ""
        pid = f"pid {proc['pid']}" if proc["pid"] else "not running"
        lines.append(f"{proc['role']}{node:<4} {proc['state']:<7} {pid:<11}  {where}{stored}{metrics}")
    if status.get("under_replicated") is not None:
        lines.append(f"under-replicated chunks: {status['under_replicated']}")
    return "\n".join(lines)


def cmd_status(args) -> int:
    addresses = meta_addresses(args, args.path)
    (rsp,) = rpc(addresses, p.StatusReq())
    if args.json:
        print(json.dumps(to_json(rsp, addresses[0]), indent=1))
    else:
        print(render(rsp, addresses[0]))
    return 0


def add_parser(sub) -> None:
    status = sub.add_parser(
        "status",
        help="the cluster as the metadata daemon sees it",
        description="Health, storage nodes with their state, capacity, use and chunks, redundancy (degraded chunks, "
        "repair backlog), file and chunk counts. --json keys are stable (see docs/operations.md).",
    )
    status.add_argument("path", nargs="?", help="a path inside a stripefs mount (finds the cluster; a path outside every mount is an error)")
    status.add_argument("--json", action="store_true", help="machine-readable output")
    add_cluster_args(status)
    status.set_defaults(func=cmd_status)
