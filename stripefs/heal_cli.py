"""``stripefs node``, ``stripefs scrub``, ``stripefs fsck``: operating a self-healing cluster.

    stripefs node drain NODE [--no-wait]   move every copy off NODE (it keeps serving meanwhile)
    stripefs node undrain NODE             cancel a drain: NODE takes new chunks again
    stripefs node remove NODE              forget NODE; refused while it holds the only copy of anything
    stripefs scrub [--now] [PATH]          verify checksums: start a background pass on every node now,
                                           or verify PATH's files (--now: all files) here, with progress
    stripefs fsck [--repair] [PATH]        namespace against chunk stores: orphans, missing copies, redundancy

The metadata daemon decides and the storage nodes copy (daemon/repair.py,
storage_node/healing.py); these commands only ask and report. Long ones show a
progress bar on stderr. Exit codes as for every admin command: 0 ok, 1 usage,
2 cluster unreachable, 3 operation refused or failed (fsck: 3 when problems
remain after --repair, or are found without it; scrub: 3 when bad copies were
found that cannot be repaired).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from .cluster import add_cluster_args, call_each, meta_addresses, mount_of, rpc, status
from .common import protocol as p
from .common.errors import QuietError
from .common.layout import format_size
from .common.progress import Progress


def cmd_node(args) -> int:
    addresses = meta_addresses(args, args.path)
    rpc(addresses, p.NodeAdminReq(node_id=args.node, action=args.action))
    if args.action == "remove":
        print(f"node {args.node} removed; chunks that had a copy there are being re-replicated")
        return 0
    if args.action == "undrain":
        print(f"node {args.node} takes new chunks again")
        return 0
    print(f"node {args.node} is draining: its copies are moving to other nodes while it keeps serving")
    if args.no_wait:
        return 0
    first = None
    bar = None
    while True:
        rsp = status(addresses)
        node = next((n for n in rsp.nodes if n.node_id == args.node), None)
        if node is None or node.state not in ("draining", "down"):
            raise QuietError(f"node {args.node} is {node.state if node else 'gone'}: the drain stopped", 3)
        left = node.placed_chunks
        if left >= 0:
            if first is None:
                first = max(left, 1)
                bar = Progress(first, label=f"draining node {args.node}", unit="chunks", lines=True)
            bar.update(first - left, note=f"{left} chunk(s) left")
            if left == 0:
                bar.close()
                print(f"node {args.node} holds nothing any more; remove it with 'stripefs node remove {args.node}'")
                return 0
        time.sleep(0.5)


def _files_under(path: Path) -> list[int]:
    if path.is_file():
        return [path.stat().st_ino]
    inos = []
    for dirpath, _, files in os.walk(path):
        for f in files:
            try:
                st = os.lstat(os.path.join(dirpath, f))
            except OSError:
                continue
            if (st.st_mode & 0o170000) == 0o100000:
                inos.append(st.st_ino)
    return inos


def cmd_scrub(args) -> int:
    if not args.now and not args.path:
        addresses = meta_addresses(args)
        rsp = status(addresses)
        started = call_each([n.address for n in rsp.nodes if n.state in ("up", "suspect", "draining")], p.ScrubStartReq())
        print(f"background scrub pass started on {started} storage node(s); bad copies are repaired as they are found")
        return 0
    if args.path:
        found = mount_of(Path(args.path))
        if not found:
            raise QuietError(f"{args.path} is not inside a stripefs mount")
        addresses = meta_addresses(args, args.path)
        inos = _files_under(Path(args.path))
        batches = [p.ScrubReq(inos=inos[i : i + 64]) for i in range(0, len(inos), 64)]
        total = len(inos)
    else:
        addresses = meta_addresses(args)
        batches = None
        total = None
    bar = None
    files = copies = bad = nbytes = repairing = diverged = 0
    after = 0
    i = 0
    while True:
        if batches is not None:
            if i >= len(batches):
                break
            req = batches[i]
            i += 1
        else:
            req = p.ScrubReq(after_ino=after, limit=64)
        (rsp,) = rpc(addresses, req)
        files += rsp.files
        copies += rsp.copies
        bad += rsp.bad
        diverged += rsp.diverged
        repairing += rsp.repairing if rsp.repairing >= 0 else rsp.bad
        nbytes += rsp.bytes
        if bar is None:
            bar = Progress(total if total is not None else rsp.total_files, label="scrub", lines=True)
        bar.update(files, note=f"{copies} copies, {format_size(nbytes)}, {bad} bad")
        if batches is None:
            if not rsp.next_ino:
                break
            after = rsp.next_ino
    if bar:
        bar.close()
    from .status import count

    print(f"scrub: {count(files, 'file')}, {count(copies, 'chunk copy', 'chunk copies')}, {format_size(nbytes)} verified; "
          f"{count(bad, 'bad copy', 'bad copies')} found"
          + (f" ({diverged} of them replicas holding other bytes than the others of their version)" if diverged else "")
          + (scrub_outcome(bad, repairing) if bad else ""))
    return 3 if bad > repairing else 0


def scrub_outcome(bad: int, repairing: int) -> str:
    """What happens to the bad copies a scrub found: the part with a good copy elsewhere is re-replicated."""
    parts = []
    if repairing:
        parts.append(f"{repairing} being re-replicated from good copies")
    if bad > repairing:
        parts.append(f"{bad - repairing} NOT repaired: no good copy to repair from (kept as they are, those files may "
                     "fail to read; the metadata daemon's log names each chunk)")
    return ": " + "; ".join(parts)


def cmd_fsck(args) -> int:
    addresses = meta_addresses(args, args.path)
    rsp = status(addresses)
    nodes = [n for n in rsp.nodes if n.state in ("up", "suspect", "draining")]
    skipped = [n.node_id for n in rsp.nodes if n not in nodes and n.state != "removed"]
    bar = Progress(len(nodes) + 1, label="fsck", unit="steps", lines=True)
    totals = dict(checked=0, orphans=0, missing=0, repaired=0, unrepairable=0)
    problems: list[str] = []
    for i, node in enumerate(nodes):
        bar.update(i, note=f"node {node.node_id}")
        (r,) = rpc(addresses, p.FsckReq(node_id=node.node_id, repair=args.repair))
        for k in totals:
            totals[k] += getattr(r, k)
        problems += r.problems
    bar.update(len(nodes), note="redundancy")
    (red,) = rpc(addresses, p.FsckReq(node_id=0, repair=args.repair))
    bar.update(len(nodes) + 1)
    tier = None
    if rsp.tiering is not None and rsp.tiering.tiers:  # the buckets against the namespace (docs/tiering.md)
        bar.update(len(nodes) + 1, note="tiers")
        (tier,) = rpc(addresses, p.TierFsckReq(repair=args.repair))
    bar.close()
    totals["repaired"] += red.repaired
    problems = red.problems + problems  # what cannot be repaired first
    print(f"fsck: {totals['checked']} chunk copies on {len(nodes)} node(s), {red.checked} chunks in the namespace")
    print(f"  orphan copies (no file refers to them): {totals['orphans']}")
    print(f"  missing or stale copies:                {totals['missing']}")
    print(f"  under-replicated chunks:                {red.under_replicated} ({red.lost} without any live copy)")
    print(f"  over-replicated chunks:                 {red.over_replicated}")
    if red.unrepairable:
        print(f"  cannot be repaired now:                 {red.unrepairable} (no storage node up can take the copy they need)")
    if tier is not None:
        print(f"  cold chunks without their object:       {tier.missing} of {tier.checked} (lost data)")
        print(f"  objects no file needs:                  {tier.orphans}" + (" (queued for deletion)" if args.repair else ""))
        problems = tier.problems + problems
    if skipped:
        print(f"  not checked (down): node(s) {', '.join(map(str, skipped))}")
    for line in problems[:20]:
        print(f"  - {line}")
    found = totals["orphans"] + totals["missing"] + red.under_replicated + red.over_replicated
    if tier is not None:
        found += tier.missing + tier.orphans
        if tier.missing:
            return 3
    if args.repair:
        print(f"  repaired: {totals['repaired']} (copies are deleted and re-replicated in the background; see 'stripefs status')")
        if red.unrepairable:
            print(f"  not repaired: {red.unrepairable} chunk(s) want more copies than the storage nodes up can hold: "
                  "add nodes, or lower their layout (stripefs layout convert)")
        if totals["unrepairable"]:
            print(f"  not repaired: {totals['unrepairable']} orphan, missing or stale copies (why: above)")
        return 3 if red.lost or red.unrepairable or totals["unrepairable"] else 0
    if found:
        print("  run 'stripefs fsck --repair' to fix what can be fixed")
        return 3
    print("  clean")
    return 0


def _path_arg(parser) -> None:
    parser.add_argument("path", nargs="?", metavar="PATH", help="a path inside a mount of the cluster (default: the "
                        "current directory's mount, else --meta, $STRIPEFS_META or --dir)")


def add_parsers(sub) -> None:
    node = sub.add_parser(
        "node", help="drain, undrain or remove a storage node",
        description="Administrative states of a storage node. A drained node keeps serving reads while every copy "
        "on it moves elsewhere (copy, switch, then delete: redundancy never drops); a removed node is forgotten.",
    )
    nsub = node.add_subparsers(dest="action", metavar="ACTION", required=True)
    drain = nsub.add_parser("drain", help="move all data off NODE, with a progress bar", description="Move every chunk copy off NODE while it keeps serving; waits until it holds nothing (Ctrl-C stops waiting, not the drain).")
    drain.add_argument("node", type=int, metavar="NODE", help="storage node id (see 'stripefs status')")
    drain.add_argument("--no-wait", action="store_true", help="return at once; follow progress with 'stripefs status'")
    _path_arg(drain)
    add_cluster_args(drain)
    undrain = nsub.add_parser("undrain", help="cancel a drain", description="NODE takes new chunks again; copies already moved stay where they are.")
    undrain.add_argument("node", type=int, metavar="NODE", help="storage node id")
    _path_arg(undrain)
    add_cluster_args(undrain)
    remove = nsub.add_parser("remove", help="forget NODE (refused while it holds the only copy of anything)", description="Forget NODE for good (its id is never reused). Refused while it holds the only live copy of any chunk: drain it first. Chunks with a copy there are re-replicated.")
    remove.add_argument("node", type=int, metavar="NODE", help="storage node id")
    _path_arg(remove)
    add_cluster_args(remove)
    node.set_defaults(func=cmd_node, no_wait=True)
    drain.set_defaults(no_wait=False)

    scrub = sub.add_parser(
        "scrub", help="verify every block's checksum and repair bad copies",
        description="Without arguments: every storage node starts a background scrub pass now (at its configured "
        "scrub_bandwidth). With PATH: verify the copies of PATH's files immediately, with a progress bar; --now "
        "without PATH: the same for every file. Bad, stale or missing copies are re-replicated from good ones "
        "where a good one exists.",
    )
    scrub.add_argument("path", nargs="?", help="a file or directory inside a stripefs mount: verify its files now")
    scrub.add_argument("--now", action="store_true", help="verify here and now instead of starting background passes "
                       "(implied by PATH)")
    add_cluster_args(scrub)
    scrub.set_defaults(func=cmd_scrub)

    fsck = sub.add_parser(
        "fsck", help="check the namespace against the chunk stores",
        description="Compare the namespace with every live storage node's chunk inventory: orphan copies (no file "
        "refers to them), missing or stale copies, chunks with too few or too many copies. --repair queues orphans "
        "for deletion and missing copies for re-replication. Exit code 3 when problems are found (without --repair).",
    )
    fsck.add_argument("--repair", action="store_true", help="fix what can be fixed")
    _path_arg(fsck)
    add_cluster_args(fsck)
    fsck.set_defaults(func=cmd_fsck)
