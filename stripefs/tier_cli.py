"""``stripefs tier``: the cold tier on object storage (docs/tiering.md).

    stripefs tier add NAME s3://BUCKET/PREFIX --endpoint URL [--region R]
    stripefs tier list [--json]
    stripefs tier policy set DIR --to NAME --after 30d [--min-size 1M]
    stripefs tier policy clear DIR
    stripefs tier migrate [-r] PATH... [--to NAME] [-j N]
    stripefs tier recall [-r] PATH... [-j N]
    stripefs tier fsck [--repair]

The metadata daemon moves the bytes and holds the credentials; this command
only names files. Exit codes as for every admin command: 0 ok, 1 usage,
2 cluster unreachable, 3 refused or failed (some files not moved).
"""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path
from typing import NamedTuple

import trio
import zmq

from .cluster import add_cluster_args, meta_addresses, resolve_attr, rpc
from .common import protocol as p
from .common.errors import ErrorCode, QuietError, StripefsError
from .common.layout import format_size, parse_size
from .common.progress import Progress
from .common.transport import connect

#: a file's migration or recall may take this long (it waits for the bucket and the nodes)
FILE_TIMEOUT_S = 600.0

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_duration(text: str) -> int:
    """Seconds of ``30d``, ``12h``, ``90m``, ``45s``, ``2w`` or a plain number of seconds."""
    m = re.fullmatch(r"\s*(\d+)\s*([smhdw]?)\s*", text.lower())
    if not m:
        raise ValueError(f"{text!r} is not a duration: give a number with s, m, h, d or w (30d, 12h)")
    return int(m[1]) * _UNITS[m[2] or "s"]


def format_duration(seconds: int) -> str:
    for unit, n in (("w", 7 * 86400), ("d", 86400), ("h", 3600), ("m", 60)):
        if seconds and seconds % n == 0:
            return f"{seconds // n}{unit}"
    return f"{seconds}s"


# -- walking the namespace (no mount needed) ------------------------------------------------


async def _files(client, ino: int, recursive: bool, mode: int) -> list[tuple[int, int, bytes]]:
    """(ino, size, name) of the regular files at ``ino`` (itself when a file; below it with ``recursive``)."""
    if stat.S_ISREG(mode):
        rsp, _ = await client.call(p.GetattrReq(ino=ino))
        return [(ino, rsp.attr.size, b"")]
    if not stat.S_ISDIR(mode):
        return []
    out: list[tuple[int, int, bytes]] = []
    todo = [ino]
    while todo:
        d = todo.pop()
        after = 0
        while True:
            rsp, _ = await client.call(p.ReaddirReq(ino=d, after=after, limit=1000))
            for e in rsp.entries:
                if stat.S_ISREG(e.attr.mode):
                    out.append((e.attr.ino, e.attr.size, e.name))
                elif stat.S_ISDIR(e.attr.mode) and recursive and e.name not in (b".", b".."):
                    todo.append(e.attr.ino)
            if not rsp.more or not rsp.entries:
                break
            after = rsp.entries[-1].cookie
    return out


async def _with_daemon(addresses: list[str], fn):
    ctx = zmq.Context()
    try:
        last = None
        for address in addresses:
            async with connect(ctx, address, timeout=5) as client:
                try:
                    await client.call(p.PingReq())
                except StripefsError as exc:
                    last = exc
                    continue
                return await fn(client)
        raise QuietError(f"no metadata daemon answered at {', '.join(addresses)} ({last.message if last else '?'})", 2)
    finally:
        ctx.destroy(linger=0)


class Totals(NamedTuple):
    """What ``each_file`` did: files answered, chunks and bytes moved, failures (one line each), files
    deleted meanwhile, and files a migration left partly on storage nodes (written meanwhile: a
    changed chunk stays where it is, docs/tiering.md)."""

    done: int
    chunks: int
    nbytes: int
    failures: list[str]
    gone: int
    partly_hot: int


def each_file(args, paths: list[str], request, label: str, jobs: int) -> Totals:
    """Send ``request(ino)`` for every file named (directories with -r), ``jobs`` at a time, with a
    progress bar. A
    NOT_FOUND answer is a file deleted meanwhile only when the file is really gone (a getattr says
    so): the daemon answers NOT_FOUND for a tier that does not exist too."""
    targets = []
    for path in paths:
        addresses, ino, mode = resolve_attr(args, path)
        if stat.S_ISDIR(mode) and not args.recursive:
            raise QuietError(f"{path} is a directory: give -r to take every file below it")
        targets.append((addresses, ino, mode))

    async def run(client) -> Totals:
        files = []
        for _, ino, mode in targets:
            files += await _files(client, ino, args.recursive, mode)
        files = list({f[0]: f for f in files}.values())  # hard links and overlapping paths: once
        progress = Progress(len(files), label=label, total_bytes=sum(f[1] for f in files))
        done = chunks = nbytes = gone = partly_hot = 0
        failures: list[str] = []
        limiter = trio.CapacityLimiter(max(1, jobs))

        async def one(ino: int, size: int, name: bytes) -> None:
            nonlocal done, chunks, nbytes, gone, partly_hot
            async with limiter:
                try:
                    rsp, _ = await client.call(request(ino), timeout=FILE_TIMEOUT_S)
                    if isinstance(rsp, p.TierFileRsp):
                        chunks += rsp.chunks
                        nbytes += rsp.bytes
                        partly_hot += rsp.hot > 0
                    else:
                        chunks += len(rsp.chunks)
                        nbytes += size
                except StripefsError as exc:
                    if exc.code == ErrorCode.NOT_FOUND and await _gone(client, ino):
                        gone += 1
                    else:
                        failures.append(f"inode {ino} ({os.fsdecode(name) or 'file'}): {exc.message}")
                done += 1
                progress.update(done, nbytes)

        async with trio.open_nursery() as nursery:
            for f in files:
                nursery.start_soon(one, *f)
        progress.close()
        return Totals(done, chunks, nbytes, failures, gone, partly_hot)

    try:
        return trio.run(_with_daemon, targets[0][0], run)
    except StripefsError as exc:
        raise QuietError(exc.message or exc.code.name, 3) from None


async def _gone(client, ino: int) -> bool:
    """Whether inode ``ino`` no longer exists."""
    try:
        await client.call(p.GetattrReq(ino=ino))
    except StripefsError as exc:
        return exc.code == ErrorCode.NOT_FOUND
    return False


def recall_for_warmup(root: bytes, paths: list[str]) -> tuple[int, list[str]]:
    """``stripefs warmup``: bring the named files of the mount at ``root`` back from their tiers first
    (one TierRecallReq per file, only when a tier holds anything); (files asked, failures)."""
    from .cluster import mount_of, source_addresses

    found = mount_of(Path(os.fsdecode(root)))
    if not found or not paths:
        return 0, []
    addresses = source_addresses(found[0])

    async def run(client) -> tuple[int, list[str]]:
        rsp, _ = await client.call(p.TierListReq())
        if not any(t.objects for t in rsp.tiers):
            return 0, []
        inos = []
        for path in paths:
            try:
                inos.append(os.stat(path).st_ino)
            except OSError:
                continue
        progress = Progress(len(inos), label="recall")
        failures: list[str] = []
        done = 0
        limiter = trio.CapacityLimiter(8)

        async def one(ino: int) -> None:
            nonlocal done
            async with limiter:
                try:
                    await client.call(p.TierRecallReq(ino=ino), timeout=FILE_TIMEOUT_S)
                except StripefsError as exc:
                    if exc.code != ErrorCode.NOT_FOUND:
                        failures.append(f"inode {ino}: {exc.message}")
                done += 1
                progress.update(done)

        async with trio.open_nursery() as nursery:
            for ino in inos:
                nursery.start_soon(one, ino)
        progress.close()
        return len(inos), failures

    try:
        return trio.run(_with_daemon, addresses, run)
    except (StripefsError, QuietError) as exc:  # an older daemon without tiers, say: warmup goes on
        return 0, [f"recall from tiers skipped: {getattr(exc, 'message', exc)}"]


# -- commands -------------------------------------------------------------------------------


def _print_tiers(rsp: p.TierListRsp, as_json: bool) -> None:
    if as_json:
        print(json.dumps({
            "tiers": [{"name": t.name, "url": t.url, "endpoint": t.endpoint, "region": t.region, "objects": t.objects,
                       "bytes": t.bytes} for t in rsp.tiers],
            "policies": [{"path": os.fsdecode(q.path), "ino": q.ino, "tier": q.tier, "after_s": q.after_s,
                          "min_size": q.min_size} for q in rsp.policies],
        }, indent=1))
        return
    if not rsp.tiers:
        print("no tiers: add one with 'stripefs tier add NAME s3://BUCKET/PREFIX --endpoint URL'")
    for t in rsp.tiers:
        print(f"{t.name}: {t.url} at {t.endpoint or 'the AWS default endpoint'}: {t.objects:,} object(s), {format_size(t.bytes)}")
    for q in rsp.policies:
        size = f", at least {format_size(q.min_size)}" if q.min_size else ""
        print(f"policy {os.fsdecode(q.path)}: to {q.tier} after {format_duration(q.after_s)} unused{size}")


def cmd_tier(args) -> int:
    if args.action == "add":
        (rsp,) = rpc(meta_addresses(args), p.TierAddReq(name=args.name, url=args.url, endpoint=args.endpoint or "",
                                                        region=args.region or ""))
        _print_tiers(rsp, False)
        return 0
    if args.action == "list":
        (rsp,) = rpc(meta_addresses(args, args.path), p.TierListReq())
        _print_tiers(rsp, args.json)
        return 0
    if args.action == "policy":
        addresses, ino, mode = resolve_attr(args, args.path)
        if not stat.S_ISDIR(mode):
            raise QuietError(f"{args.path} is not a directory: a policy applies to the files below a directory")
        if args.policy_action == "clear":
            (rsp,) = rpc(addresses, p.TierPolicySetReq(ino=ino, tier=""))
        else:
            try:
                after = parse_duration(args.after)
                min_size = parse_size(args.min_size) if args.min_size else 0
            except ValueError as exc:
                raise QuietError(str(exc)) from None
            (rsp,) = rpc(addresses, p.TierPolicySetReq(ino=ino, tier=args.to, after_s=after, min_size=min_size))
        _print_tiers(rsp, False)
        return 0
    if args.action == "fsck":
        (rsp,) = rpc(meta_addresses(args), p.TierFsckReq(repair=args.repair))
        for line in rsp.problems:
            print(line)
        print(f"tier fsck: {rsp.checked:,} cold chunk(s) checked, {rsp.missing} missing or damaged, "
              f"{rsp.orphans} object(s) no file needs" + (" (queued for deletion)" if args.repair and rsp.orphans else ""))
        return 3 if rsp.missing or (rsp.orphans and not args.repair) else 0
    if args.action == "migrate":
        t = each_file(args, args.paths, lambda ino: p.TierMigrateReq(ino=ino, tier=args.to or ""), "migrate", args.jobs)
        verb = f"moved to tier {args.to}" if args.to else "moved to their tiers"
    else:
        t = each_file(args, args.paths, lambda ino: p.TierRecallReq(ino=ino), "recall", args.jobs)
        verb = "back on storage nodes"
    for line in t.failures[:20]:
        print(line)
    print(f"{t.done - len(t.failures) - t.gone:,} file(s) {verb}; {t.chunks:,} chunk(s), {format_size(t.nbytes)} moved"
          + (f"; {t.partly_hot} partly still on storage nodes (written meanwhile: run again to move the rest)"
             if t.partly_hot else "")
          + (f"; {t.gone} deleted meanwhile" if t.gone else "")
          + (f"; {len(t.failures)} failed" + (" (run again to retry)" if len(t.failures) < t.done else "") if t.failures else ""))
    return 3 if t.failures else 0


def add_parser(sub) -> None:
    tier = sub.add_parser(
        "tier", help="move idle data to object storage (S3) and back",
        description="A cold tier, as Spectrum Scale's transparent cloud tiering and Lustre's HSM: a file's data moves to an "
        "S3 bucket, its name, attributes, quota charge and layout stay; reading it brings the data back (the reader sees "
        "only latency). The metadata daemon moves the bytes and holds the credentials (AWS_ACCESS_KEY_ID/"
        "AWS_SECRET_ACCESS_KEY in its environment, or tier_credentials in metad.toml); never give them here. "
        "See docs/tiering.md.",
    )
    tsub = tier.add_subparsers(dest="action", metavar="ACTION", required=True)
    add = tsub.add_parser("add", help="add a bucket as a tier", description="Add a tier. The daemon checks it can reach the "
                          "bucket with its own credentials first; create the bucket beforehand.")
    add.add_argument("name", help="the tier's name (letters, digits, '.', '_', '-')")
    add.add_argument("url", help="s3://BUCKET[/PREFIX]: objects are named PREFIX/CLUSTER_ID/INO/INDEX.VERSION")
    add.add_argument("--endpoint", help="the S3 endpoint, http(s)://HOST[:PORT] (default: AWS's for the region)")
    add.add_argument("--region", help="the bucket's region (default: us-east-1)")
    lst = tsub.add_parser("list", help="tiers, what they hold, and the policies", description="Every tier with its objects "
                          "and bytes, and every directory policy.")
    lst.add_argument("path", nargs="?", help="a path inside a stripefs mount (finds the cluster)")
    lst.add_argument("--json", action="store_true", help="print tiers and policies as JSON")
    pol = tsub.add_parser("policy", help="move a directory's idle files by themselves", description="A policy on a directory "
                          "applies to every file below it, down to directories with their own (nearest wins). The daemon "
                          "running the cluster duties applies it every tier_scan_interval_s, at most tier_bandwidth bytes/s.")
    psub = pol.add_subparsers(dest="policy_action", metavar="ACTION", required=True)
    pset = psub.add_parser("set", help="set a directory's policy")
    pset.add_argument("path", metavar="DIR", help="a directory inside a stripefs mount, or a namespace path with --meta or --dir")
    pset.add_argument("--to", required=True, metavar="NAME", help="the tier")
    pset.add_argument("--after", required=True, metavar="AGE", help="files not read or written for this long: 30d, 12h, 90m, 45s")
    pset.add_argument("--min-size", metavar="SIZE", help="only files of at least SIZE (1M, 64K); default: any")
    pclr = psub.add_parser("clear", help="remove a directory's policy (its files stay where they are)")
    pclr.add_argument("path", metavar="DIR", help="the directory")
    for cmd, text in (("migrate", "move files to a tier now"), ("recall", "bring files back onto storage nodes now")):
        c = tsub.add_parser(cmd, help=text, description=(
            "Move the files' data to a tier now (the tier named by --to, else the policy over each file), waiting "
            "until every chunk is stored and verified in the bucket; only then are the node copies released."
            if cmd == "migrate" else
            "Bring the files' data back onto storage nodes now, in parallel: before a job reads a cold data set. "
            "'stripefs warmup' does it too."))
        c.add_argument("paths", nargs="+", metavar="PATH", help="files (directories with -r) inside a mount, or namespace paths with --meta or --dir")
        c.add_argument("-r", "--recursive", action="store_true", help="every file below the directories given")
        c.add_argument("-j", "--jobs", type=int, default=8, help="files in flight at once (default: %(default)s)")
        if cmd == "migrate":
            c.add_argument("--to", metavar="NAME", help="the tier (default: the tier of the policy over each file)")
        add_cluster_args(c)
    fsck = tsub.add_parser("fsck", help="check the buckets against the namespace", description="Every cold chunk must have "
                           "its object, of its length; objects no file needs are counted. Exit 3 on lost data or orphans.")
    fsck.add_argument("--repair", action="store_true", help="queue objects no file needs for deletion")
    for c in (add, lst, pset, pclr, fsck):
        add_cluster_args(c)
    tier.set_defaults(func=cmd_tier)
