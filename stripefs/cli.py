"""``stripefs``: the one command. Each subcommand family has its own module.

    stripefs meta     --config metad.toml        metadata daemon        (stripefs.daemon.cli)
    stripefs meta     backup|restore FILE        metadata database copy (stripefs.daemon.backup)
    stripefs storage  --config storage.toml      storage node           (stripefs.storage_node.cli)
    stripefs mount    META_ADDR MOUNTPOINT       FUSE client            (stripefs.client.mount)
    stripefs local    up|down|status             a whole cluster here   (stripefs.local_cluster)
    stripefs status   [--json]                   the cluster as the metadata daemon sees it (stripefs.status)
    stripefs top      MOUNT                      live view of one mount's metrics (stripefs.top)
    stripefs layout   get|set|convert            per-directory layouts; convert existing files
    stripefs config   example meta|storage|client
    stripefs node     drain|undrain|remove NODE  storage node states   (stripefs.heal_cli)
    stripefs scrub    [--now] [PATH]             verify checksums       (stripefs.heal_cli)
    stripefs fsck     [--repair]                 namespace vs chunks    (stripefs.heal_cli)
    stripefs quota    set|get|list|recount       directory-tree quotas  (stripefs.quota_cli)
    stripefs install-mount-helper                /sbin/mount.fuse.stripefs for mount(8) and fstab (stripefs.mount_helper)
    stripefs warmup   PATH... [--from-list FILE]  load files into a mount's caches (stripefs.warmup)
    stripefs keygen   NAME                       a CURVE keypair (stripefs.keys_cli; docs/security.md)
    stripefs cap-secret PATH [--rotate]          the capability secret of daemons and nodes (stripefs.keys_cli)

Admin commands find the cluster from a PATH inside a mount when given one
(the mount's source in /proc/mounts is its metadata address), else from
``--meta`` or ``$STRIPEFS_META``, else from the local cluster's ``--dir``.
Exit codes: 0 ok, 1 usage or config error, 2 cluster unreachable, 3 operation failed.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import re
import sys
from pathlib import Path

import trio
import zmq

from .common.arguments import ArgumentParser
from .common import config as cfg
from .common import protocol as p
from .common.errors import ErrorCode, QuietError, StripefsError
from .common.layout import format_size, parse_redundancy, parse_size
from .common.transport import connect

DEFAULT_STATE = "./.stripefs"


# --------------------------------------------------------------- finding the cluster


def _unescape(field: str) -> str:
    """A /proc/mounts field as it was given: the kernel writes space, tab, newline, backslash and '#' as octal escapes
    (a mount source naming a CURVE key may contain '#')."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def _mount_of(path: Path) -> tuple[str, Path] | None:
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


def _meta_addresses(args, path: str | None = None) -> list[str]:
    """The cluster's metadata addresses: from PATH's mount when a path is given (a path outside any
    stripefs mount is an error, never silently the local cluster), else --meta, $STRIPEFS_META, --dir."""
    if path:
        found = _mount_of(Path(path))
        if not found:
            raise QuietError(f"{path} is not inside a stripefs mount; give a path inside one, or no path "
                             "(then --meta ADDR, $STRIPEFS_META or a local cluster's --dir finds the cluster)")
        return [a for a in found[0].replace(";", ",").split(",") if a]
    spec = getattr(args, "meta", None) or os.environ.get("STRIPEFS_META")
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


def _rpc(addresses: list[str], *requests: p.Msg) -> list[p.Msg]:
    """Send requests to the first metadata daemon that answers."""

    async def run():
        ctx = zmq.Context()
        try:
            last: StripefsError | None = None
            for address in addresses:
                refused: StripefsError | None = None
                async with connect(ctx, address, timeout=5) as client:
                    try:
                        return [(await client.call(r))[0] for r in requests]
                    except StripefsError as exc:
                        if exc.code not in (ErrorCode.TIMEOUT, ErrorCode.UNAVAILABLE):
                            refused = exc  # raised outside the connection's nursery: not wrapped in an ExceptionGroup
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
    except BaseExceptionGroup as group:  # an error reply raised inside the connection's nursery
        leaf = group
        while isinstance(leaf, BaseExceptionGroup) and len(leaf.exceptions) == 1:
            leaf = leaf.exceptions[0]
        if isinstance(leaf, StripefsError):
            raise QuietError(leaf.message or leaf.code.name, 3) from None
        raise


def _print_names_as_bytes() -> None:
    """File names are bytes (not always UTF-8): argv holds them with surrogate escapes, and
    printing them must give the same bytes back, as ls does, not a UnicodeEncodeError."""
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="surrogateescape")


def _resolve(args, path: str) -> tuple[list[str], int]:
    """Metadata addresses and inode of PATH (inside a mount, or a namespace path with --meta or --dir)."""
    return _resolve_attr(args, path)[:2]


def _resolve_attr(args, path: str) -> tuple[list[str], int, int]:
    """Metadata addresses, inode and mode of PATH (inside a mount, or a namespace path with --meta or --dir)."""
    if len(os.fsencode(path)) >= p.PATH_MAX:
        raise QuietError(f"{path[:80]}...: {os.strerror(errno.ENAMETOOLONG)} ({len(os.fsencode(path))} bytes; at most {p.PATH_MAX - 1})")
    found = _mount_of(Path(path))
    if found:
        try:
            st = os.stat(path)
        except OSError as exc:
            raise QuietError(f"{path}: {exc.strerror}") from None
        return [a for a in found[0].replace(";", ",").split(",") if a], st.st_ino, st.st_mode
    if not _names_cluster(args):
        raise QuietError(f"{path} is not inside a stripefs mount; give a path inside one (or, with --meta ADDR "
                         "or --dir STATE, a path in the cluster's namespace such as /dataset)")
    addresses = _meta_addresses(args)
    ino, mode = 1, 0o40755
    for part in [x for x in path.split("/") if x]:
        try:
            (rsp,) = _rpc(addresses, p.LookupReq(parent=ino, name=os.fsencode(part)))
        except QuietError as exc:
            if exc.exitcode != 3:
                raise
            raise QuietError(f"{path}: no such file or directory in the cluster's namespace ({part!r} not found)", 3) from None
        ino, mode = rsp.attr.ino, rsp.attr.mode
    return addresses, ino, mode


# ----------------------------------------------------------------------- commands


def cmd_layout(args) -> int:
    if args.action == "convert":
        return cmd_layout_convert(args)
    if args.action == "set":
        try:
            chunk_size = parse_size(args.chunk_size) if args.chunk_size else None
        except ValueError as exc:
            raise QuietError(f"--chunk-size: {exc}") from None
    addresses, ino = _resolve(args, args.path)
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
        (rsp,) = _rpc(addresses, req)
    else:
        (rsp,) = _rpc(addresses, p.GetLayoutReq(ino=ino))
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
    mounts = {_mount_of(Path(path)) for path in args.paths}
    if None in mounts:
        raise QuietError("layout convert works on paths inside a stripefs mount (it reads and writes the files there)")
    if len(mounts) > 1:
        raise QuietError("give paths of one stripefs mount at a time")
    (found,) = mounts
    from .client.convert import run

    return run([a for a in found[0].replace(";", ",").split(",") if a], args.paths, redundancy, recursive=args.recursive)


def cmd_status(args) -> int:
    from . import status

    addresses = _meta_addresses(args, args.path)
    (rsp,) = _rpc(addresses, p.StatusReq())
    if args.json:
        print(json.dumps(status.to_json(rsp, addresses[0]), indent=1))
    else:
        print(status.render(rsp, addresses[0]))
    return 0


def cmd_local(args) -> int:
    from .local_cluster import LocalCluster

    cluster = LocalCluster(args.dir)
    if args.action == "up":
        return cluster.up(args.mount, args.nodes, args.options, settings=args.settings, secure=args.secure, subdir=args.subdir,
                          meta_store=args.meta_store, metas=args.metas)
    if args.action == "down":
        return cluster.down()
    if args.action == "add-node":
        return cluster.add_node()
    status = cluster.status()
    if args.json:
        print(json.dumps(status, indent=1))
    else:
        from .status import render_local

        print(render_local(status))
    return 0


def cmd_install_mount_helper(args) -> int:
    from .mount_helper import install

    try:
        target = install(args.dir, force=args.force)
    except (OSError, FileExistsError) as exc:
        raise QuietError(f"cannot install the mount helper: {exc} (run as root, or choose --dir)") from None
    print(f"installed {target}: 'mount -t fuse.stripefs META_ADDR MOUNTPOINT' and fstab entries now work")
    return 0


def cmd_config(args) -> int:
    print(cfg.example(args.role), end="")
    return 0


# ------------------------------------------------------------------------- parser


def _add_cluster_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--meta", help="metadata daemon address(es), tcp://HOST:PORT[,...] (default: $STRIPEFS_META)")
    parser.add_argument("--dir", help=f"state directory of a local cluster (default: {DEFAULT_STATE})")


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="stripefs",
        description="stripefs: a striped, replicated filesystem that keeps GPU training jobs fed.",
        epilog="Start here: 'stripefs local up --dir ./.stripefs --mount ./mnt --nodes 4' runs a whole cluster on this machine.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    sub.add_parser("meta", help="run the metadata daemon", add_help=False)
    sub.add_parser("storage", help="run a storage node", add_help=False)
    sub.add_parser("mount", help="mount a cluster", add_help=False)

    local = sub.add_parser("local", help="run a whole cluster on this machine", description="Start, stop and inspect a one-machine cluster.")
    lsub = local.add_subparsers(dest="action", metavar="ACTION", required=True)
    up = lsub.add_parser("up", help="start (or restart) the cluster and mount it",
                         description="Start a metadata daemon, N storage nodes and the mount. Running it again on a "
                         "stopped STATE brings the same data back; it starts what is not running (not the nodes an "
                         "operator removed) and mounts again over a dead mount (its client killed).")
    up.add_argument("--dir", default=DEFAULT_STATE, help="state directory: configs, data, logs, pids (default: %(default)s)")
    up.add_argument("--mount", default="./mnt", help="mountpoint (default: %(default)s)")
    up.add_argument("--nodes", type=int, default=4, help="storage nodes (default: %(default)s)")
    up.add_argument("-o", dest="options", action="append", default=[], help="FUSE mount option, e.g. -o allow_other (repeatable)")
    up.add_argument("--set", dest="settings", action="append", default=[], metavar="ROLE.KEY=VALUE",
                    help="config value for a new cluster, e.g. --set meta.node_timeout_s=3 --set storage.scrub_bandwidth=64M "
                    "(TOML value; roles meta, storage, client; repeatable; used when STATE is created)")
    up.add_argument("--secure", action="store_true",
                    help="CURVE on every socket: keys for the daemon, each node, the mount and an admin in STATE/keys, "
                         "listed in STATE/keys/keyring.toml (new clusters only; docs/security.md)")
    up.add_argument("--subdir", default="", metavar="/DIR",
                    help="mount only this directory of the cluster (created if missing); with --secure the mount's key "
                         "is restricted to it at the daemon")
    up.add_argument("--meta-store", choices=("sqlite", "postgresql"), default="sqlite",
                    help="where metadata lives: an SQLite file (one daemon), or a throwaway PostgreSQL server started "
                    "in STATE (needs Debian's postgresql package; several daemons) (default: %(default)s; used when STATE is created)")
    up.add_argument("--metas", type=int, default=1, metavar="N",
                    help="metadata daemons, each on its own port, all given to the storage nodes and the mount "
                    "(N > 1 needs --meta-store postgresql) (default: %(default)s; used when STATE is created)")
    add = lsub.add_parser("add-node", help="start one more storage node", description="Create, start and register one more storage node in a running local cluster (then data rebalances onto it).")
    add.add_argument("--dir", default=DEFAULT_STATE, help="state directory (default: %(default)s)")
    down = lsub.add_parser("down", help="unmount and stop everything 'up' started",
                           description="Unmount and stop the processes 'up' started: those in STATE/pids.json and every "
                           "process whose command line names STATE (so a cluster whose state directory was deleted "
                           "while it ran is stopped too; never a name match). Data stays in the state directory. "
                           "Exit 0 when nothing of it runs any more (also when nothing ran), 3 when something could "
                           "not be stopped or unmounted.")
    down.add_argument("--dir", default=DEFAULT_STATE, help="state directory (default: %(default)s)")
    st = lsub.add_parser("status", help="which local processes are running",
                         description="List the cluster's processes: role, node id, pid, address, state (up, down; "
                         "a storage node 'removed' by an operator; the mount 'dead' when its client is gone but the "
                         "mount point is still there: 'local up' mounts again) and bytes stored.")
    st.add_argument("--dir", default=DEFAULT_STATE, help="state directory (default: %(default)s)")
    st.add_argument("--json", action="store_true", help='machine-readable: {"processes": [{role, node_id, pid, address, state, bytes_stored, metrics}, ...], "under_replicated": N}')
    local.set_defaults(func=cmd_local)

    status = sub.add_parser(
        "status",
        help="the cluster as the metadata daemon sees it",
        description="Health, storage nodes with their state, capacity, use and chunks, redundancy (degraded chunks, "
        "repair backlog), file and chunk counts. --json keys are stable (see docs/operations.md).",
    )
    status.add_argument("path", nargs="?", help="a path inside a stripefs mount (finds the cluster; a path outside every mount is an error)")
    status.add_argument("--json", action="store_true", help="machine-readable output")
    _add_cluster_args(status)
    status.set_defaults(func=cmd_status)

    layout = sub.add_parser("layout", help="show or set a directory's layout", description="New files inherit their directory's layout: chunk size, stripe count, redundancy.")
    lysub = layout.add_subparsers(dest="action", metavar="ACTION", required=True)
    get = lysub.add_parser("get", help="show the layout of a file or directory")
    get.add_argument("path", help="a path inside a stripefs mount, or a namespace path (/dataset) with --meta or --dir")
    get.add_argument("--json", action="store_true", help="print {chunk_size, stripe_count, redundancy}")
    _add_cluster_args(get)
    lset = lysub.add_parser("set", help="change a directory's layout for files created from now on", description="Each flag alone changes only that field. Existing files keep their layout.")
    lset.add_argument("path", help="a directory inside a stripefs mount, or a namespace path (/dataset) with --meta or --dir")
    lset.add_argument("--chunk-size", help="e.g. 4M (binary units; 64K..64M)")
    lset.add_argument("--stripe-count", type=int, help="how many nodes consecutive chunks rotate over")
    lset.add_argument("--replicas", type=int, help="copies of each chunk, on distinct nodes (refused beyond the nodes up)")
    lset.add_argument("--ec", help="erasure code K+M, e.g. 4+2")
    lset.add_argument("--json", action="store_true", help="print the resulting layout as JSON")
    _add_cluster_args(lset)
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

    from .top import add_parser as add_top_parser

    add_top_parser(sub)

    helper = sub.add_parser(
        "install-mount-helper",
        help="let mount(8), fstab and .mount units mount stripefs (writes /sbin/mount.fuse.stripefs)",
        description="Write /sbin/mount.fuse.stripefs, which mount(8) runs for 'mount -t fuse.stripefs META_ADDR MOUNTPOINT -o OPTS' "
        "(and so for fstab lines and systemd .mount units). It runs 'stripefs mount' with this installation's Python. "
        "See deploy/fstab.example and deploy/mnt-data.mount.",
    )
    helper.add_argument("--dir", default="/sbin", help="where mount(8) looks for helpers (default: %(default)s)")
    helper.add_argument("--force", action="store_true", help="replace a mount.fuse.stripefs that stripefs did not write")
    helper.set_defaults(func=cmd_install_mount_helper)

    from .warmup import add_parser as add_warmup

    add_warmup(sub)

    from .heal_cli import add_parsers as add_heal_parsers

    add_heal_parsers(sub, _add_cluster_args)

    from .quota_cli import add_parser as add_quota_parser

    add_quota_parser(sub, _add_cluster_args)

    from .keys_cli import add_parsers as add_key_parsers

    add_key_parsers(sub)

    config = sub.add_parser("config", help="print a commented config template", description="Print a commented config file for a role.")
    csub = config.add_subparsers(dest="action", metavar="ACTION", required=True)
    ex = csub.add_parser("example", help="print an example config")
    ex.add_argument("role", choices=sorted(cfg.ROLES), help="meta, storage or client")
    config.set_defaults(func=cmd_config)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    _print_names_as_bytes()
    try:
        code = _dispatch(argv)
        sys.stdout.flush()  # a closed pipe (stripefs status | head -1) is seen here, not at exit
        return code
    except QuietError as exc:
        print(f"stripefs: {exc}", file=sys.stderr)
        return exc.exitcode
    except BrokenPipeError:
        # the reader went away: what was left unprinted is not wanted; nothing to report
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except KeyboardInterrupt:
        return 130
    except BaseExceptionGroup as group:  # a user error raised inside a nursery (trio wraps it)
        leaf = _user_error(group)
        if leaf is None:
            raise
        print(f"stripefs: {leaf}", file=sys.stderr)
        return leaf.exitcode


def _user_error(group: BaseExceptionGroup) -> QuietError | None:
    """The first user error (QuietError, or an error reply) in ``group``, as a QuietError; None if
    anything else (a bug) is in it, so that the bug keeps its traceback."""
    leaves: list[BaseException] = []

    def walk(exc: BaseException) -> None:
        if isinstance(exc, BaseExceptionGroup):
            for inner in exc.exceptions:
                walk(inner)
        else:
            leaves.append(exc)

    walk(group)
    if not leaves or not all(isinstance(e, (QuietError, StripefsError)) for e in leaves):
        return None
    first = leaves[0]
    more = f" (and {len(leaves) - 1} more failure(s))" if len(leaves) > 1 else ""
    if isinstance(first, QuietError):
        return QuietError(f"{first}{more}", first.exitcode)
    return QuietError(f"{first.message or first.code.name}{more}", 3)


def _dispatch(argv: list[str]) -> int:
    from .keys_cli import use_env_key

    use_env_key()
    if argv[:1] == ["meta"] and argv[1:2] in (["backup"], ["restore"]):
        from .daemon.backup import main as backup_main

        return backup_main(argv[1:])
    if argv and argv[0] in ("meta", "storage", "mount"):
        if argv[0] == "meta":
            from .daemon.cli import main as role_main
        elif argv[0] == "storage":
            from .storage_node.cli import main as role_main
        else:
            from .client.mount import main as role_main
        return role_main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 1
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
