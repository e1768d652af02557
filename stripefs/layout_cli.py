"""``stripefs layout get|set|convert``: per-directory layouts, and converting existing files.

    stripefs layout get PATH [--json]                               a file's or directory's layout
    stripefs layout set DIR [--chunk-size] [--stripe-count] [--replicas R | --ec K+M]
    stripefs layout convert PATH... (--ec K+M | --replicas R) [-r]  re-write files to another redundancy

New files inherit their directory's layout (daemon/namespace.py); ``set``
changes it for files created from then on. ``convert`` copies each file into
its new layout through a mount's data path (client/convert.py).
"""

from __future__ import annotations

import json
from pathlib import Path

from .cluster import add_cluster_args, mount_of, resolve, rpc, source_addresses
from .common import protocol as p
from .common.errors import QuietError, StripefsError
from .common.layout import format_size, parse_redundancy, parse_size


def cmd_layout(args) -> int:
    if args.action == "convert":
        return cmd_layout_convert(args)
    if args.action == "set":
        try:
            chunk_size = parse_size(args.chunk_size) if args.chunk_size else None
        except ValueError as exc:
            raise QuietError(f"--chunk-size: {exc}") from None
    addresses, ino = resolve(args, args.path)
    if args.action == "set":
        redundancy = None
        if args.replicas is not None:
            redundancy = f"replicas={args.replicas}"
        if args.ec:
            redundancy = f"ec={args.ec}"
        if redundancy:
            try:
                parse_redundancy(redundancy)
            except StripefsError as exc:
                raise QuietError(exc.message) from None
        req = p.SetLayoutReq(
            ino=ino,
            chunk_size=chunk_size,
            stripe_count=args.stripe_count,
            redundancy=redundancy,
        )
        (rsp,) = rpc(addresses, req)
    else:
        (rsp,) = rpc(addresses, p.GetLayoutReq(ino=ino))
    layout = rsp.layout
    if getattr(args, "json", False):
        print(json.dumps({"chunk_size": layout.chunk_size, "stripe_count": layout.stripe_count, "redundancy": layout.redundancy}))
    else:
        print(f"{args.path}: chunk_size={format_size(layout.chunk_size)} stripe_count={layout.stripe_count} {layout.redundancy}")
    return 0


def cmd_layout_convert(args) -> int:
    if (args.ec is None) == (args.replicas is None):
        raise QuietError("give the target redundancy: --ec K+M or --replicas R")
    redundancy = f"ec={args.ec}" if args.ec else f"replicas={args.replicas}"
    try:
        redundancy = str(parse_redundancy(redundancy))
    except StripefsError as exc:
        raise QuietError(exc.message) from None
    mounts = {mount_of(Path(path)) for path in args.paths}
    if None in mounts:
        raise QuietError("layout convert works on paths inside a stripefs mount (it reads and writes the files there)")
    if len(mounts) > 1:
        raise QuietError("give paths of one stripefs mount at a time")
    (found,) = mounts
    from .client.convert import run

    return run(source_addresses(found[0]), args.paths, redundancy, recursive=args.recursive)


def add_parser(sub) -> None:
    layout = sub.add_parser("layout", help="show or set a directory's layout", description="New files inherit their directory's layout: chunk size, stripe count, redundancy.")
    lysub = layout.add_subparsers(dest="action", metavar="ACTION", required=True)
    get = lysub.add_parser("get", help="show the layout of a file or directory")
    get.add_argument("path", help="a path inside a stripefs mount, or a namespace path (/dataset) with --meta or --dir")
    get.add_argument("--json", action="store_true", help="print {chunk_size, stripe_count, redundancy}")
    add_cluster_args(get)
    lset = lysub.add_parser("set", help="change a directory's layout for files created from now on", description="Each flag alone changes only that field. Existing files keep their layout.")
    lset.add_argument("path", help="a directory inside a stripefs mount, or a namespace path (/dataset) with --meta or --dir")
    lset.add_argument("--chunk-size", help="e.g. 4M (binary units; 64K..64M)")
    lset.add_argument("--stripe-count", type=int, help="how many nodes consecutive chunks rotate over")
    lset.add_argument("--replicas", type=int, help="copies of each chunk, on distinct nodes (refused beyond the nodes up)")
    lset.add_argument("--ec", help="erasure code K+M, e.g. 4+2")
    lset.add_argument("--json", action="store_true", help="print the resulting layout as JSON")
    add_cluster_args(lset)
    conv = lysub.add_parser(
        "convert",
        help="re-write existing files to another redundancy, online",
        description="Copy each file into its new layout through the data path, then switch it over atomically. "
        "Files stay readable throughout. An interrupted run leaves every file whole in its old or new layout; "
        "run it again to finish (files already converted are skipped).",
    )
    conv.add_argument("paths", nargs="+", metavar="PATH", help="files (or directories with --recursive) inside a stripefs mount")
    conv.add_argument("--recursive", "-r", action="store_true", help="convert every file under directories; the directories get the new redundancy for new files too")
    target = conv.add_mutually_exclusive_group(required=True)
    target.add_argument("--ec", help="erasure code K+M, e.g. 4+2")
    target.add_argument("--replicas", type=int, help="copies of each chunk")
    layout.set_defaults(func=cmd_layout)
