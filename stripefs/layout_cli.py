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
import stat
from pathlib import Path

from .cluster import add_cluster_args, mount_of, resolve_attr, rpc, source_addresses
from .common import protocol as p
from .common.errors import QuietError, StripefsError
from .common.layout import (KiB, MAX_CHUNK_SIZE, MAX_STRIPE_COUNT, MIN_CHUNK_SIZE, Redundancy, format_size,
                            parse_redundancy, parse_size)


def ec_cost(redundancy: Redundancy, chunk_size: int) -> str:
    """Where an ``ec=K+M`` layout pays, in one line. A stripe is coded as ``chunk_size`` bytes cut
    into K fragments of chunk_size/K (common/erasure.py): a stripe holding L bytes stores L bytes of
    data fragments and M parity fragments of min(L, chunk_size/K) each. So (K+M)/K holds from
    chunk_size up, and a file of chunk_size/K or less costs (1+M)x, as many bytes as M+1 replicas."""
    k, m = redundancy.ec_k, redundancy.ec_m
    fps = -(-chunk_size // k)
    return (f"ec={k}+{m} with {format_size(chunk_size)} chunks: a file (or a file's last stripe) of L bytes stores "
            f"L + {m} x min(L, {format_size(fps)}): {(k + m) / k:.2f}x from {format_size(chunk_size)} up, but "
            f"{1 + m:.2f}x (as much as replicas={1 + m}) for files of {format_size(fps)} or less; for small files "
            f"choose a chunk size near K x their size (--chunk-size), or replicas")


def _check_set_args(args) -> int | None:
    """--chunk-size, --stripe-count and --replicas/--ec checked here (exit 1, as every usage mistake);
    the chunk size in bytes, if given."""
    chunk_size = None
    if args.chunk_size:
        try:
            chunk_size = parse_size(args.chunk_size)
        except ValueError as exc:
            raise QuietError(f"--chunk-size: {exc}") from None
        if not MIN_CHUNK_SIZE <= chunk_size <= MAX_CHUNK_SIZE or chunk_size % (4 * KiB):
            raise QuietError(f"--chunk-size {args.chunk_size}: chunk_size must be a multiple of 4K between {format_size(MIN_CHUNK_SIZE)} "
                             f"and {format_size(MAX_CHUNK_SIZE)}, e.g. 4M")
    if args.stripe_count is not None and not 1 <= args.stripe_count <= MAX_STRIPE_COUNT:
        raise QuietError(f"--stripe-count {args.stripe_count}: between 1 and {MAX_STRIPE_COUNT}")
    for redundancy in ([f"replicas={args.replicas}"] if args.replicas is not None else []) + ([f"ec={args.ec}"] if args.ec else []):
        try:
            parse_redundancy(redundancy)
        except StripefsError as exc:
            raise QuietError(exc.message) from None
    return chunk_size


def cmd_layout(args) -> int:
    if args.action == "convert":
        return cmd_layout_convert(args)
    chunk_size = _check_set_args(args) if args.action == "set" else None
    addresses, ino, mode = resolve_attr(args, args.path)
    if args.action == "set":
        if not stat.S_ISDIR(mode):
            raise QuietError(f"{args.path} is not a directory: a layout is set on a directory, for the files created in it "
                             "from then on (to re-write existing files: stripefs layout convert)")
        redundancy = None
        if args.replicas is not None:
            redundancy = f"replicas={args.replicas}"
        if args.ec:
            redundancy = f"ec={args.ec}"
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
        red = parse_redundancy(layout.redundancy)
        if args.action == "set" and red.is_ec:
            print(f"note: {ec_cost(red, layout.chunk_size)}")
    return 0


def cmd_layout_convert(args) -> int:
    if (args.ec is None) == (args.replicas is None):
        raise QuietError("give the target redundancy: --ec K+M or --replicas R")
    redundancy = f"ec={args.ec}" if args.ec else f"replicas={args.replicas}"
    try:
        red = parse_redundancy(redundancy)
    except StripefsError as exc:
        raise QuietError(exc.message) from None
    redundancy = str(red)
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
    lset.add_argument("--ec", help="erasure code K+M, e.g. 4+2: saves space on files of a chunk or more ((K+M)/K); a file "
                      "under chunk_size/K costs (1+M)x, as much as M+1 replicas")
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
    target.add_argument("--ec", help="erasure code K+M, e.g. 4+2: (K+M)/K only for files of a chunk or more; a file "
                        "under chunk_size/K costs (1+M)x (see 'layout set')")
    target.add_argument("--replicas", type=int, help="copies of each chunk")
    layout.set_defaults(func=cmd_layout)
