"""``stripefs mount META_ADDR MOUNTPOINT [-o opts]``: the FUSE client process.

Without ``--foreground`` the command forks: the child mounts and serves, the
parent waits until the mount answers (or fails) and exits 0 (or prints why and
exits non-zero). systemd units use ``--foreground`` (Type=notify: READY=1 is
sent once the mount is up).

One trio root nursery and one AsyncExitStack own everything: the ZeroMQ
context, the metadata session and its heartbeat task, the storage node
connections, background writes and prefetches, and the FUSE session. SIGTERM
and SIGINT end the FUSE loop (pending data is flushed by the kernel's release
calls before unmount completes); the mount is always unmounted on exit.
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import signal
import sys
from contextlib import AsyncExitStack
from pathlib import Path

import pyfuse3
import trio
import zmq

from ..common import config as cfg
from ..common.errors import QuietError, StripefsError
from ..common.logs import add_debug_argument, debug_setting, setup_logging
from ..common.systemd import notify
from .chunk_cache import ChunkCache
from .data_rpc import NodePool
from .meta_rpc import MetaClient
from .operations import Operations
from .striping import DataPath

log = logging.getLogger(__name__)

#: -o options that are ours, not FUSE's
_OWN_OPTIONS = {"config"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="stripefs mount",
        description=(
            "Mount a stripefs cluster. Returns once the mount answers; the client keeps running in the "
            "background (use --foreground under systemd). Unmount with 'fusermount3 -u MOUNTPOINT' or "
            "'umount MOUNTPOINT'."
        ),
        epilog="Example: stripefs mount tcp://meta1:7100 /mnt/data -o allow_other",
    )
    parser.add_argument("meta", metavar="META_ADDR", help="metadata daemon address(es): tcp://HOST:PORT[,tcp://HOST:PORT...]")
    parser.add_argument("mountpoint", metavar="MOUNTPOINT", help="an existing, empty directory")
    parser.add_argument(
        "-o",
        dest="options",
        action="append",
        default=[],
        metavar="OPT[,OPT...]",
        help="mount options: FUSE's (allow_other, ro, ...) pass through; config=PATH reads client.toml",
    )
    parser.add_argument("--config", help="client config file (see 'stripefs config example client')")
    parser.add_argument("-f", "--foreground", action="store_true", help="stay in the foreground (for systemd)")
    parser.add_argument("--log", help="log file when running in the background (default: syslog-style file under /tmp)")
    parser.add_argument("--pidfile", help="write the client's pid here once mounted")
    add_debug_argument(parser, "stripefs.client.striping")
    return parser


def _split_options(raw: list[str]) -> tuple[set[str], dict[str, str]]:
    fuse_opts: set[str] = set()
    own: dict[str, str] = {}
    for group in raw:
        for opt in filter(None, group.split(",")):
            key, _, value = opt.partition("=")
            if key in _OWN_OPTIONS:
                own[key] = value
            elif key in ("rw", "defaults", "_netdev", "auto", "noauto", "user", "nouser", "nofail"):
                continue  # fstab/mount(8) words that mean nothing to FUSE
            else:
                fuse_opts.add(opt)
    return fuse_opts, own


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    fuse_opts, own = _split_options(args.options)
    config_path = args.config or own.get("config")
    client_cfg = cfg.load(config_path, cfg.ClientConfig) if config_path else cfg.ClientConfig()
    addresses = [a.strip() for a in args.meta.split(",") if a.strip()]
    for a in addresses:
        if not a.startswith(("tcp://", "ipc://")):
            raise QuietError(f"metadata address {a!r} must look like tcp://HOST:PORT")
    mountpoint = Path(args.mountpoint).absolute()
    if not mountpoint.is_dir():
        raise QuietError(f"mountpoint {mountpoint} is not a directory; create it first (mkdir -p {mountpoint})")
    if os.path.ismount(mountpoint):
        raise QuietError(f"{mountpoint} is already a mount point; unmount it first (fusermount3 -u {mountpoint})")

    if args.foreground:
        setup_logging("mount", debug=debug_setting(args.debug))
        if args.pidfile:
            Path(args.pidfile).write_text(f"{os.getpid()}\n")
        return _serve(addresses, mountpoint, fuse_opts, client_cfg, ready_fd=None)

    log_path = Path(args.log or f"/tmp/stripefs-mount-{str(mountpoint).strip('/').replace('/', '_') or 'root'}.log")
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid:
        os.close(write_fd)
        with os.fdopen(read_fd, "rb") as pipe:
            message = pipe.read().decode(errors="replace")
        if message.startswith("ok"):
            os.stat(mountpoint)  # answers once the loop runs
            print(f"stripefs mounted at {mountpoint} (client pid {pid}, log {log_path})")
            return 0
        _, status = os.waitpid(pid, 0)
        raise QuietError(f"mount failed: {message.strip() or 'the client exited'} (log: {log_path})", 3)
    # child: detach, log to a file
    os.close(read_fd)
    os.setsid()
    log_file = open(log_path, "a", buffering=1)
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(log_file.fileno(), 1)
    os.dup2(log_file.fileno(), 2)
    setup_logging("mount", debug=debug_setting(args.debug), stream=log_file)
    if args.pidfile:
        Path(args.pidfile).write_text(f"{os.getpid()}\n")
    try:
        code = _serve(addresses, mountpoint, fuse_opts, client_cfg, ready_fd=write_fd)
    except QuietError as exc:
        _report(write_fd, str(exc))
        code = exc.exitcode
    except BaseException as exc:
        log.exception("mount client failed")
        _report(write_fd, f"{type(exc).__name__}: {exc}")
        code = 3
    os._exit(code)


def _report(fd: int | None, message: str) -> None:
    if fd is None:
        return
    try:
        os.write(fd, message.encode())
        os.close(fd)
    except OSError:
        pass


def _serve(addresses: list[str], mountpoint: Path, fuse_opts: set[str], client_cfg: cfg.ClientConfig, ready_fd: int | None) -> int:
    options = set(pyfuse3.default_options)
    # the mount's source is its metadata address: admin commands find the cluster from a path
    options |= {f"fsname={';'.join(addresses)}", "subtype=stripefs", "default_permissions"}
    options |= fuse_opts
    try:
        trio.run(_run, addresses, str(mountpoint), options, client_cfg, ready_fd)
    except BaseException as exc:
        # nurseries wrap what failed in exception groups: a user error inside one is still a user error
        user_error = _first_of(exc, (QuietError, StripefsError))
        if isinstance(user_error, QuietError):
            raise user_error from None
        if isinstance(user_error, StripefsError):
            raise QuietError(user_error.message, 2) from None
        raise
    return 0


def _first_of(exc: BaseException, kinds: tuple[type[BaseException], ...]) -> BaseException | None:
    if isinstance(exc, kinds):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            found = _first_of(inner, kinds)
            if found is not None:
                return found
    return None


async def _run(addresses, mountpoint: str, options: set[str], client_cfg: cfg.ClientConfig, ready_fd: int | None) -> None:
    ctx = zmq.Context()
    try:
        async with AsyncExitStack() as stack:
            nursery = await stack.enter_async_context(trio.open_nursery())
            stack.callback(nursery.cancel_scope.cancel)
            meta = MetaClient(ctx, addresses, timeout=client_cfg.rpc_timeout_s)
            await meta.open(stack)
            await meta.hello(mountpoint, patience_s=max(client_cfg.rpc_timeout_s, 10.0))
            nodes = NodePool(ctx, nursery, timeout=client_cfg.rpc_timeout_s, read_timeout=min(3.0, client_cfg.rpc_timeout_s))
            data = DataPath(
                meta,
                nodes,
                ChunkCache(client_cfg.cache_size),
                nursery,
                readahead_chunks=client_cfg.readahead_chunks,
                write_parallelism=client_cfg.write_parallelism,
            )
            data.hedge_after_s = client_cfg.hedge_after_s
            ops = Operations(meta, data, attr_timeout=client_cfg.attr_timeout_s, entry_timeout=client_cfg.entry_timeout_s)
            nursery.start_soon(meta.heartbeat_loop, mountpoint, name="session-heartbeat")
            try:
                pyfuse3.init(ops, mountpoint, options)
            except RuntimeError as exc:
                raise QuietError(f"cannot mount {mountpoint}: {exc} (is /dev/fuse available, fuse3 installed?)", 3) from None
            try:
                nursery.start_soon(_signals, name="signals")
                nursery.start_soon(_tune_kernel, mountpoint, name="tune-kernel")
                log.info("mounted %s from %s (options %s)", mountpoint, ",".join(addresses), ",".join(sorted(options)))
                notify("READY=1")
                _report(ready_fd, "ok")
                await pyfuse3.main()
            finally:
                notify("STOPPING=1")
                pyfuse3.close(unmount=True)
                log.info("unmounted %s", mountpoint)
    finally:
        ctx.term()


#: the kernel reads ahead this much on sequential reads (the FUSE default is 128 KiB,
#: which turns a 1 GiB read into 8,192 requests to Python)
READ_AHEAD_KB = 4096


async def _tune_kernel(mountpoint: str) -> None:
    # The kernel sets read-ahead from the FUSE INIT reply, so change it only after
    # INIT: a stat() of the root from a thread returns once the loop has answered it.
    await trio.to_thread.run_sync(os.stat, mountpoint)
    _raise_readahead(mountpoint)


def _raise_readahead(mountpoint: str) -> None:
    """Raise the mount's backing-device read-ahead (/sys/class/bdi/MAJ:MIN/read_ahead_kb).

    The device number comes from /proc/self/mountinfo: stat() on the mountpoint
    would wait for this very process to answer.
    """
    try:
        with open("/proc/self/mountinfo") as f:
            devices = [line.split()[2] for line in f if line.split()[4] == mountpoint]
        if not devices:
            raise OSError(f"{mountpoint} not in /proc/self/mountinfo")
        with open(f"/sys/class/bdi/{devices[-1]}/read_ahead_kb", "w") as f:
            f.write(str(READ_AHEAD_KB))
        log.debug("read-ahead of %s (bdi %s) set to %d KiB", mountpoint, devices[-1], READ_AHEAD_KB)
    except OSError as exc:
        log.warning("cannot raise the kernel read-ahead of %s (sequential reads will be slower): %s", mountpoint, exc)


async def _signals() -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
        async for signum in signals:
            log.info("signal %d: unmounting", signum)
            pyfuse3.terminate()
            return
