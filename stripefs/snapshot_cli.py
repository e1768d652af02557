"""``stripefs snapshot``: read-only, point-in-time copies of a directory tree that cost metadata only.

    stripefs snapshot create DIR NAME     DIR/.snapshots/NAME: DIR's tree as of now (no data copied)
    stripefs snapshot list DIR [--json]   DIR's snapshots, oldest first
    stripefs snapshot delete DIR NAME     free a snapshot (the data it alone holds is deleted)

The snapshots themselves are daemon/snapshots.py (docs/snapshots.md). A snapshot
shares every chunk with the live tree; the first change of a shared chunk on the
live side copies that chunk once. Nobody's quota pays for a snapshot. Creating and
deleting need an admin key (a subtree admin key: inside its subtree). Exit codes
as for every admin command: 0 ok, 1 usage, 2 cluster unreachable, 3 refused or failed.
"""

from __future__ import annotations

import json
import os
import stat
import time

from .cluster import add_cluster_args, resolve_attr, rpc, rpc_once
from .common import protocol as p
from .common.errors import QuietError


def cmd_snapshot(args) -> int:
    addresses, ino, mode = resolve_attr(args, args.path)
    if not stat.S_ISDIR(mode):
        raise QuietError(f"{args.path} is not a directory")
    if args.action == "list":
        (rsp,) = rpc(addresses, p.SnapshotListReq(ino=ino))
        if args.json:
            print(json.dumps([{"id": s.id, "name": os.fsdecode(s.name), "ino": s.ino, "created_ns": s.created_ns}
                              for s in rsp.snapshots], indent=1))
        elif not rsp.snapshots:
            print(f"{args.path} has no snapshots")
        else:
            print(f"{'ID':>8}  {'CREATED':19}  PATH")
            for s in rsp.snapshots:
                when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(s.created_ns / 1e9))
                print(f"{s.id:>8}  {when}  {os.path.join(args.path, '.snapshots', os.fsdecode(s.name))}")
        return 0
    name = os.fsencode(args.name)
    if args.action == "create":
        started = time.monotonic()
        rpc_once(addresses, p.SnapshotCreateReq(ino=ino, name=name))
        print(f"snapshot {os.path.join(args.path, '.snapshots', args.name)} made in {time.monotonic() - started:.2f}s")
        return 0
    rpc_once(addresses, p.SnapshotDeleteReq(ino=ino, name=name))
    print(f"snapshot {args.name} of {args.path} deleted")
    return 0


def add_parser(sub) -> None:
    snap = sub.add_parser(
        "snapshot", help="read-only copies of a directory tree (DIR/.snapshots/NAME)",
        description="A snapshot is DIR's tree as of one moment, read-only, at DIR/.snapshots/NAME. It costs "
        "metadata only: it shares every chunk with the live tree, and a chunk is copied once, the first time "
        "the live side changes it. Nobody's quota pays for it. An rm -rf DIR stops at DIR/.snapshots until "
        "its snapshots are deleted.",
    )
    ssub = snap.add_subparsers(dest="action", metavar="ACTION", required=True)
    screate = ssub.add_parser("create", help="snapshot DIR as DIR/.snapshots/NAME (metadata only, one transaction)")
    slist = ssub.add_parser("list", help="DIR's snapshots, oldest first")
    slist.add_argument("--json", action="store_true", help='print [{"id", "name", "ino", "created_ns"}, ...]')
    sdelete = ssub.add_parser("delete", help="delete snapshot NAME of DIR (what only it holds is freed)")
    for parser in (screate, slist, sdelete):
        parser.add_argument("path", metavar="DIR", help="a directory inside a mount (or a namespace path with --meta or --dir)")
        if parser is not slist:
            parser.add_argument("name", metavar="NAME", help="the snapshot's name in DIR/.snapshots")
        add_cluster_args(parser)
    snap.set_defaults(func=cmd_snapshot)
