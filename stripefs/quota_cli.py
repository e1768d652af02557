"""``stripefs quota``: directory-tree quotas (bytes and inodes), set, shown and recounted.

    stripefs quota set PATH [--bytes 10G] [--inodes 100000]   0 or 'none' removes that limit
    stripefs quota get PATH [--json]                          every quota over PATH, with usage
    stripefs quota list [PATH] [--json]                       every quota of the cluster
    stripefs quota recount [PATH] [--json]                    count the trees again, correct drifted usage

What counts and how limits are enforced: daemon/quota.py. Exit codes as for
every admin command: 0 ok, 1 usage, 2 cluster unreachable, 3 refused or failed
(recount: 3 when usage had drifted and was corrected).
"""

from __future__ import annotations

import json
import os
import stat

from .cluster import add_cluster_args, meta_addresses, resolve, resolve_attr, rpc
from .common import protocol as p
from .common.errors import QuietError
from .common.layout import format_size, parse_size


def _limit(text: str | None, what: str) -> int | None:
    if text is None:
        return None
    if text.strip().lower() in ("none", "0", "unlimited"):
        return 0
    try:
        value = parse_size(text) if what == "bytes" else int(text)
    except ValueError as exc:
        raise QuietError(f"--{what} {text!r}: {exc if what == 'bytes' else 'give a whole number'} (0 or 'none' removes the limit)") from None
    if value < 0:
        raise QuietError(f"--{what} cannot be negative (0 or 'none' removes the limit)")
    if value > p.INT64_MAX:  # what the daemon's database holds
        most = format_size(p.INT64_MAX) if what == "bytes" else f"{p.INT64_MAX:,}"
        raise QuietError(f"--{what} {text}: at most {most} (0 or 'none' removes the limit)")
    return value


def to_json(q: p.QuotaInfo) -> dict:
    return {
        "path": os.fsdecode(q.path), "ino": q.ino, "max_bytes": q.max_bytes, "max_inodes": q.max_inodes,
        "used_bytes": q.used_bytes, "used_inodes": q.used_inodes,
    }


def render(q: p.QuotaInfo) -> str:
    def part(used: int, limit: int, fmt) -> str:
        if not limit:
            return f"{fmt(used)} (no limit)"
        return f"{fmt(used)} of {fmt(limit)} ({100 * used / limit:.0f}%){'  OVER' if used > limit else ''}"

    return f"{os.fsdecode(q.path)}: bytes {part(q.used_bytes, q.max_bytes, format_size)}, inodes {part(q.used_inodes, q.max_inodes, str)}"


def _print(quotas: list[p.QuotaInfo], as_json: bool, empty: str) -> None:
    if as_json:
        print(json.dumps([to_json(q) for q in quotas], indent=1))
    elif not quotas:
        print(empty)
    else:
        for q in quotas:
            print(render(q))


def cmd_quota(args) -> int:
    if args.action == "set":
        max_bytes, max_inodes = _limit(args.bytes, "bytes"), _limit(args.inodes, "inodes")
        if max_bytes is None and max_inodes is None:
            raise QuietError("give --bytes SIZE and/or --inodes N (0 or 'none' removes a limit)")
        addresses, ino, mode = resolve_attr(args, args.path)
        if not stat.S_ISDIR(mode):
            raise QuietError(f"{args.path} is not a directory: a quota limits a directory tree; give the directory")
        (rsp,) = rpc(addresses, p.QuotaSetReq(ino=ino, max_bytes=max_bytes, max_inodes=max_inodes))
        _print(rsp.quotas, args.json, f"{args.path}: no quota")
        return 0
    if args.action == "get":
        addresses, ino = resolve(args, args.path)
        (rsp,) = rpc(addresses, p.QuotaGetReq(ino=ino))
        _print(rsp.quotas, args.json, f"{args.path}: no quota applies")
        return 0
    if args.action == "list":
        (rsp,) = rpc(meta_addresses(args, args.path), p.QuotaGetReq(ino=0))
        _print(rsp.quotas, args.json, "no quotas")
        return 0
    ino = 0
    if args.path:
        addresses, ino = resolve(args, args.path)
    else:
        addresses = meta_addresses(args)
    (rsp,) = rpc(addresses, p.QuotaRecountReq(ino=ino))
    if args.json:
        print(json.dumps({"quotas": [to_json(q) for q in rsp.quotas], "corrected": [to_json(q) for q in rsp.corrected]}, indent=1))
    else:
        for q in rsp.corrected:
            print(f"corrected {os.fsdecode(q.path)}: usage had drifted to {q.used_bytes} bytes, {q.used_inodes} inodes")
        _print(rsp.quotas, False, "no quotas")
    return 3 if rsp.corrected else 0


def add_parser(sub) -> None:
    quota = sub.add_parser(
        "quota", help="limit the bytes and inodes under a directory",
        description="Directory-tree quotas, as GPFS filesets and CephFS quotas: a quota on a directory limits the "
        "logical bytes (du --apparent-size) and inodes below it; nested quotas all apply. Creates past the inode "
        "limit and writes past the byte limit fail with EDQUOT ('Disk quota exceeded'); nothing past the limit is "
        "kept. Directories (and hard links) cannot be renamed between different quota trees: EXDEV, 'mv' copies.",
    )
    qsub = quota.add_subparsers(dest="action", metavar="ACTION", required=True)
    qset = qsub.add_parser("set", help="set or remove a directory's limits", description="Set the limits of a directory; a flag left out keeps its limit. A new quota counts the tree once (a scan). Limits below the current usage refuse growth; nothing is deleted.")
    qset.add_argument("path", help="a directory inside a stripefs mount, or a namespace path (/team-a) with --meta or --dir")
    qset.add_argument("--bytes", help="logical bytes, binary units (10G, 500M); 0 or 'none' removes the limit")
    qset.add_argument("--inodes", help="files, directories, symlinks... below it; 0 or 'none' removes the limit")
    qset.add_argument("--json", action="store_true", help="print the quota as JSON")
    qget = qsub.add_parser("get", help="the quotas over a path, with usage", description="Every quota that applies to PATH, nearest first (PATH's own first): limits and usage.")
    qget.add_argument("path", help="a path inside a stripefs mount, or a namespace path with --meta or --dir")
    qget.add_argument("--json", action="store_true", help='print [{"path", "ino", "max_bytes", "max_inodes", "used_bytes", "used_inodes"}, ...] (0: no limit)')
    qlist = qsub.add_parser("list", help="every quota of the cluster", description="Every quota with its limits and usage.")
    qlist.add_argument("path", nargs="?", help="a path inside a stripefs mount (finds the cluster)")
    qlist.add_argument("--json", action="store_true", help="print the quotas as JSON, as 'get' does")
    qre = qsub.add_parser(
        "recount", help="count quota trees again and correct their usage",
        description="Usage is kept up to date with every change; this counts the trees again (a scan of each, "
        "during which the metadata daemon waits) and corrects usage that drifted. Exit code 3 when something was corrected.",
    )
    qre.add_argument("path", nargs="?", help="recount only the quota on this directory")
    qre.add_argument("--json", action="store_true", help='print {"quotas": [...], "corrected": [... as they were]}')
    for parser in (qset, qget, qlist, qre):
        add_cluster_args(parser)
    quota.set_defaults(func=cmd_quota)
