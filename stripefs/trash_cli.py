"""``stripefs trash``: what rm removed, kept for ``trash_keep_s`` (default a day), listed, restored, purged.

    stripefs trash list [PATH] [--json]            id, when, where from, size, time left
    stripefs trash restore ID [NEWPATH]            back under its old name (a directory with its tree), or as NEWPATH
    stripefs trash purge ID... | --all             free now

The trash itself is daemon/trash.py (docs/snapshots.md). A key restricted to a
subtree sees and restores only what was removed inside it. Exit codes as for
every admin command: 0 ok, 1 usage, 2 cluster unreachable, 3 refused or failed
(restore: 3 when part of a tree was left in the trash, named).
"""

from __future__ import annotations

import json
import os
import stat
import time

from .cluster import add_cluster_args, meta_addresses, resolve_attr, rpc, rpc_once
from .common import protocol as p
from .common.errors import QuietError
from .common.layout import format_size


def _age(ns: int) -> str:
    seconds = max(0, int(ns / 1e9))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds}s"


def to_json(e: p.TrashEntry) -> dict:
    return {
        "id": e.ino, "path": os.fsdecode(e.path), "deleted_ns": e.deleted_ns, "expires_ns": e.expires_ns,
        "directory": stat.S_ISDIR(e.mode), "size": e.size, "uid": e.uid,
    }


def render(e: p.TrashEntry, now_ns: int) -> str:
    kind = "dir " if stat.S_ISDIR(e.mode) else "file"
    left = f"{_age(e.expires_ns - now_ns)} left" if e.expires_ns else "freed at the next collection"
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(e.deleted_ns / 1e9))
    return f"{e.ino:>12}  {when}  {kind} {format_size(e.size) if not stat.S_ISDIR(e.mode) else '-':>8}  {left:>14}  {os.fsdecode(e.path)}"


def cmd_trash(args) -> int:
    if args.action == "list":
        (rsp,) = rpc(meta_addresses(args, args.path), p.TrashListReq())
        if args.json:
            print(json.dumps([to_json(e) for e in rsp.entries], indent=1))
        elif not rsp.entries:
            print("the trash is empty")
        else:
            now = time.time_ns()
            print(f"{'ID':>12}  {'REMOVED':19}  KIND {'SIZE':>8}  {'KEPT':>14}  WAS")
            for e in rsp.entries:
                print(render(e, now))
        return 0
    if args.action == "restore":
        new_parent, new_name = None, b""
        if args.newpath:
            head, tail = os.path.split(args.newpath.rstrip("/"))
            if not tail:
                raise QuietError(f"{args.newpath}: give the new name too (DIR/NAME)")
            addresses, new_parent, mode = resolve_attr(args, head or "/")
            if not stat.S_ISDIR(mode):
                raise QuietError(f"{head} is not a directory")
            new_name = os.fsencode(tail)
        else:
            addresses = meta_addresses(args)
        rsp = rpc_once(addresses, p.TrashRestoreReq(item=args.id, new_parent=new_parent, new_name=new_name))
        print(f"restored {len(rsp.done)} file(s) and director(ies)")
        for why in rsp.left:
            print(f"left in the trash: {why}")
        return 3 if rsp.left else 0
    if not args.ids and not args.all:
        raise QuietError("give the ids to purge (stripefs trash list), or --all")
    (rsp,) = rpc(meta_addresses(args), p.TrashPurgeReq(items=args.ids, everything=args.all))
    print(f"purged {len(rsp.done)}")
    return 0


def add_parser(sub) -> None:
    trash = sub.add_parser(
        "trash", help="list, restore or purge what rm removed",
        description="With trash_keep_s > 0 in metad.toml (default 86400: a day; 0: off), removing a file's last "
        "name or a directory keeps it in the trash, still counted against its directory's quota, until it "
        "expires or is purged. An rm -rf comes back whole by restoring its top directory.",
    )
    tsub = trash.add_subparsers(dest="action", metavar="ACTION", required=True)
    tlist = tsub.add_parser("list", help="what the trash holds, oldest first")
    tlist.add_argument("path", nargs="?", help="a path inside a stripefs mount (finds the cluster)")
    tlist.add_argument("--json", action="store_true", help='print [{"id", "path", "deleted_ns", "expires_ns", "directory", "size", "uid"}, ...]')
    trestore = tsub.add_parser(
        "restore", help="put something back",
        description="Put ID back under its old name, or as NEWPATH; a directory brings back what was removed out "
        "of it (an rm -rf), depth first. What cannot go back (its name is taken again) stays and is named (exit 3).",
    )
    trestore.add_argument("id", type=int, help="its id in 'stripefs trash list'")
    trestore.add_argument("newpath", nargs="?", help="where to put it instead (inside a mount, or a namespace path with --meta or --dir)")
    tpurge = tsub.add_parser("purge", help="free now", description="Free trashed ids now (their data is deleted).")
    tpurge.add_argument("ids", nargs="*", type=int, help="ids from 'stripefs trash list'")
    tpurge.add_argument("--all", action="store_true", help="everything this key may see in the trash")
    for parser in (tlist, trestore, tpurge):
        add_cluster_args(parser)
    trash.set_defaults(func=cmd_trash)
