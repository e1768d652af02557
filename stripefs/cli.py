"""``stripefs``: the one command. Each subcommand family has its own module.

    stripefs meta     --config metad.toml        metadata daemon        (stripefs.daemon.cli)
    stripefs meta     backup|restore FILE        metadata database copy (stripefs.daemon.backup)
    stripefs storage  --config storage.toml      storage node           (stripefs.storage_node.cli)
    stripefs mount    META_ADDR MOUNTPOINT       FUSE client            (stripefs.client.mount)
    stripefs local    up|down|status             a whole cluster here   (stripefs.local_cli, stripefs.local_cluster)
    stripefs status   [--json]                   the cluster as the metadata daemon sees it (stripefs.status)
    stripefs top      MOUNT                      live view of one mount's metrics (stripefs.top)
    stripefs layout   get|set|convert            per-directory layouts; convert existing files (stripefs.layout_cli)
    stripefs config   example meta|storage|client
    stripefs node     drain|undrain|remove NODE  storage node states   (stripefs.heal_cli)
    stripefs scrub    [--now] [PATH]             verify checksums       (stripefs.heal_cli)
    stripefs fsck     [--repair]                 namespace vs chunks    (stripefs.heal_cli)
    stripefs quota    set|get|list|recount       directory-tree quotas  (stripefs.quota_cli)
    stripefs trash    list|restore|purge         what rm removed, kept a day  (stripefs.trash_cli)
    stripefs snapshot create|list|delete DIR     read-only copies of a tree, metadata only (stripefs.snapshot_cli)
    stripefs tier     add|list|policy|migrate|recall|fsck  the cold tier on S3 (stripefs.tier_cli; docs/tiering.md)
    stripefs install-mount-helper                /sbin/mount.fuse.stripefs for mount(8) and fstab (stripefs.mount_helper)
    stripefs warmup   PATH... [--from-list FILE]  load files into a mount's caches (stripefs.warmup)
    stripefs keygen   NAME                       a CURVE keypair (stripefs.keys_cli; docs/security.md)
    stripefs cap-secret PATH [--rotate]          the capability secret of daemons and nodes (stripefs.keys_cli)
    stripefs csi      --endpoint unix://SOCK     the Kubernetes CSI plugin (stripefs.csi; docs/kubernetes.md)

This module only dispatches. Admin commands find the cluster from a PATH
inside a mount when given one (the mount's source in /proc/mounts is its
metadata address), else from ``--meta`` or ``$STRIPEFS_META``, else from the
local cluster's ``--dir`` (stripefs.cluster, which also calls it).
Exit codes: 0 ok, 1 usage or config error, 2 cluster unreachable, 3 operation failed.
"""

from __future__ import annotations

import argparse
import os
import sys

from .common.arguments import ArgumentParser
from .common import config as cfg
from .common.errors import QuietError, StripefsError, leaves


def _print_names_as_bytes() -> None:
    """File names are bytes (not always UTF-8): argv holds them with surrogate escapes, and
    printing them must give the same bytes back, as ls does, not a UnicodeEncodeError."""
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="surrogateescape")


def cmd_config(args) -> int:
    print(cfg.example(args.role), end="")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="stripefs",
        description="stripefs: a striped, replicated filesystem that keeps GPU training jobs fed.",
        epilog="Start here: 'stripefs local up --dir ./.stripefs --mount ./mnt --nodes 4' runs a whole cluster on this machine.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    # the roles parse their own arguments (_dispatch); listed here for --help
    sub.add_parser("meta", help="run the metadata daemon", add_help=False)
    sub.add_parser("storage", help="run a storage node", add_help=False)
    sub.add_parser("mount", help="mount a cluster", add_help=False)

    from . import heal_cli, keys_cli, layout_cli, local_cli, mount_helper, quota_cli, snapshot_cli, status, tier_cli, top, trash_cli, warmup

    local_cli.add_parser(sub)
    status.add_parser(sub)
    layout_cli.add_parser(sub)
    top.add_parser(sub)
    mount_helper.add_parser(sub)
    warmup.add_parser(sub)
    heal_cli.add_parsers(sub)
    quota_cli.add_parser(sub)
    trash_cli.add_parser(sub)
    snapshot_cli.add_parser(sub)
    tier_cli.add_parser(sub)
    keys_cli.add_parsers(sub)
    from .csi import server as csi_server  # imports nothing of grpc until it runs

    csi_server.add_parser(sub)

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
        return _interrupted()
    except BaseExceptionGroup as group:  # a user error raised inside a nursery (trio wraps it)
        if any(isinstance(e, KeyboardInterrupt) for e in leaves(group)):  # Ctrl-C inside a nursery
            return _interrupted()
        leaf = _user_error(group)
        if leaf is None:
            raise
        print(f"stripefs: {leaf}", file=sys.stderr)
        return leaf.exitcode


def _interrupted() -> int:
    """Ctrl-C: one line saying how far the command got (its progress bar's count), no traceback."""
    from .common.progress import Progress

    bar = Progress.current
    where = f" after {bar.how_far()}" if bar is not None else ""
    if bar is not None and bar.tty:
        bar.stream.write("\n")
    print(f"stripefs: interrupted{where}; what was done stays done: run the command again to finish", file=sys.stderr)
    return 130


def _user_error(group: BaseExceptionGroup) -> QuietError | None:
    """The first user error (QuietError, or an error reply) in ``group``, as a QuietError; None if
    anything else (a bug) is in it, so that the bug keeps its traceback."""
    found = leaves(group)
    if not found or not all(isinstance(e, (QuietError, StripefsError)) for e in found):
        return None
    first = found[0]
    more = f" (and {len(found) - 1} more failure(s))" if len(found) > 1 else ""
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
