"""Finding the cluster and calling it: what every admin command shares.

Admin commands find the cluster from a PATH inside a mount when given one
(the mount's source in /proc/mounts is its metadata address), else from
``--meta`` or ``$STRIPEFS_META``, else from the local cluster's ``--dir``
(``meta_addresses``). ``rpc`` sends requests to the first metadata daemon
that answers and turns failures into QuietErrors with the command's exit
codes: 2 cluster unreachable, 3 operation refused or failed.
"""

from __future__ import annotations

import argparse
import errno
import os
import re
import secrets
from pathlib import Path

import trio
import zmq

from .common import protocol as p
from .common.errors import ErrorCode, QuietError, StripefsError
from .common.transport import connect

DEFAULT_STATE = "./.stripefs"


def add_cluster_args(parser: argparse.ArgumentParser) -> None:
    """--meta and --dir: how a command finds the cluster when not given a path inside a mount."""
    parser.add_argument("--meta", help="metadata daemon address(es), tcp://HOST:PORT[,...] (default: $STRIPEFS_META)")
    parser.add_argument("--dir", help=f"state directory of a local cluster (default: {DEFAULT_STATE})")


def _unescape(field: str) -> str:
    """A /proc/mounts field as it was given: the kernel writes space, tab, newline, backslash and '#' as octal escapes
    (a mount source naming a CURVE key may contain '#')."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def mount_of(path: Path) -> tuple[str, Path] | None:
    """(metadata address, mountpoint) of the stripefs mount holding ``path``."""
    target = path.absolute()
    best = None
    try:
        with open("/proc/mounts") as f:
            for line in f:
                source, mnt, fstype = (_unescape(field) for field in line.split()[:3])
                if fstype != "fuse.stripefs":
                    continue
                mnt_path = Path(mnt.replace("\\040", " "))
                if (target == mnt_path or mnt_path in target.parents) and (best is None or len(str(mnt_path)) > len(str(best[1]))):
                    best = (source, mnt_path)
    except OSError:
        return None
    return best


def source_addresses(source: str) -> list[str]:
    """The metadata addresses a mount's source names (several separated by ',' or ';')."""
    return [a for a in source.replace(";", ",").split(",") if a]


def meta_addresses(args, path: str | None = None) -> list[str]:
    """The cluster's metadata addresses: from PATH's mount when a path is given (a path outside any
    stripefs mount is an error, never silently the local cluster), else --meta, $STRIPEFS_META, the
    mount holding the current directory, --dir (default ./.stripefs)."""
    if path:
        found = mount_of(Path(path))
        if not found:
            raise QuietError(f"{path} is not inside a stripefs mount; give a path inside one, or no path "
                             "(then --meta ADDR, $STRIPEFS_META or a local cluster's --dir finds the cluster)")
        return source_addresses(found[0])
    spec = getattr(args, "meta", None) or os.environ.get("STRIPEFS_META")
    if not spec and not getattr(args, "dir", None):
        try:
            here = mount_of(Path.cwd())  # run from inside a mount (cd /mnt/data/train; stripefs fsck): that cluster
        except OSError:  # the current directory is gone
            here = None
        if here:
            return source_addresses(here[0])
    if not spec:
        state = Path(getattr(args, "dir", None) or DEFAULT_STATE)
        if (state / "cluster.json").exists():
            from .local_cluster import LocalCluster

            cluster = LocalCluster(state)
            cluster.use_admin_key()  # a --secure cluster: its admin key, unless $STRIPEFS_KEY names one
            return cluster.meta_addresses
        raise QuietError(
            "cannot find the cluster: give a PATH inside a stripefs mount, --meta tcp://HOST:PORT, "
            "set $STRIPEFS_META, or --dir STATE of a local cluster"
        )
    return [a.strip() for a in spec.split(",") if a.strip()]


def _names_cluster(args) -> bool:
    """Whether the command line names a cluster (--meta, $STRIPEFS_META, --dir): then a path outside
    every mount is a path in that cluster's namespace."""
    return bool(getattr(args, "meta", None) or os.environ.get("STRIPEFS_META") or getattr(args, "dir", None))


def rpc(addresses: list[str], *requests: p.Msg, rounds: int = 1) -> list[p.Msg]:
    """Send requests to the first metadata daemon that answers; their replies in order. ``rounds``:
    times the addresses are tried in turn (more than one only for requests safe to resend: rpc_once)."""

    async def run():
        ctx = zmq.Context()
        try:
            last: StripefsError | None = None
            for address in addresses * rounds:
                refused: StripefsError | None = None
                async with connect(ctx, address, timeout=5) as client:
                    try:
                        return [(await client.call(r))[0] for r in requests]
                    except StripefsError as exc:
                        if exc.code not in (ErrorCode.TIMEOUT, ErrorCode.UNAVAILABLE):
                            refused = exc
                        last = exc
                if refused is not None:
                    raise refused
            raise QuietError(f"no metadata daemon answered at {', '.join(addresses)} ({last.message})", 2)
        finally:
            ctx.destroy(linger=0)

    try:
        return trio.run(run)
    except StripefsError as exc:
        raise QuietError(exc.message or exc.code.name, 3) from None


def rpc_once(addresses: list[str], request: p.Msg) -> p.Msg:
    """A changing admin request (one of ``protocol.ONCE_MESSAGES``) applied at most once however often
    it is resent: wrapped in a OnceReq of its own (daemon/applied_ops.py), so a reply lost to a timeout
    is answered from the first attempt's result when the same OnceReq is sent again, to any daemon."""
    once = p.OnceReq(client_id=secrets.randbits(63), op_id=1, done_below=0, body=request)
    (rsp,) = rpc(addresses, once, rounds=3)
    return rsp


def status(addresses: list[str]) -> p.StatusRsp:
    """The cluster's status as the metadata daemon sees it."""
    (rsp,) = rpc(addresses, p.StatusReq())
    return rsp


def call_each(addresses: list[str], request: p.Msg) -> int:
    """Send ``request`` to every address in turn (storage nodes, say); how many answered."""

    async def run() -> int:
        ctx = zmq.Context()
        n = 0
        try:
            for address in addresses:
                async with connect(ctx, address, timeout=5) as client:
                    await client.call(request)
                    n += 1
        finally:
            ctx.destroy(linger=0)
        return n

    return trio.run(run)


def resolve(args, path: str) -> tuple[list[str], int]:
    """Metadata addresses and inode of PATH (inside a mount, or a namespace path with --meta or --dir)."""
    return resolve_attr(args, path)[:2]


def resolve_attr(args, path: str) -> tuple[list[str], int, int]:
    """Metadata addresses, inode and mode of PATH (inside a mount, or a namespace path with --meta or --dir)."""
    if len(os.fsencode(path)) >= p.PATH_MAX:
        raise QuietError(f"{path[:80]}...: {os.strerror(errno.ENAMETOOLONG)} ({len(os.fsencode(path))} bytes; at most {p.PATH_MAX - 1})")
    found = mount_of(Path(path))
    if found:
        try:
            st = os.stat(path)
        except OSError as exc:
            raise QuietError(f"{path}: {exc.strerror}") from None
        return source_addresses(found[0]), st.st_ino, st.st_mode
    if not _names_cluster(args):
        raise QuietError(f"{path} is not inside a stripefs mount; give a path inside one (or, with --meta ADDR "
                         "or --dir STATE, a path in the cluster's namespace such as /dataset)")
    addresses = meta_addresses(args)
    ino, mode = 1, 0o40755
    for part in [x for x in path.split("/") if x]:
        try:
            (rsp,) = rpc(addresses, p.LookupReq(parent=ino, name=os.fsencode(part)))
        except QuietError as exc:
            if exc.exitcode != 3:
                raise
            raise QuietError(f"{path}: no such file or directory in the cluster's namespace ({part!r} not found)", 3) from None
        ino, mode = rsp.attr.ino, rsp.attr.mode
    return addresses, ino, mode
