"""``stripefs mount META_ADDR MOUNTPOINT [-o opts]``: the FUSE client process.

Without ``--foreground`` the command forks: the child mounts and serves, the
parent waits until the mount answers (or fails) and exits 0 (or prints why and
exits non-zero). systemd units use ``--foreground`` (Type=notify: READY=1 is
sent once the mount is up).

One trio root nursery and one AsyncExitStack own everything: the ZeroMQ
context, the metadata session and its heartbeat task, the storage node
connections, background writes and prefetches, and the FUSE session. SIGTERM
and SIGINT end the FUSE loop; data that files still open in applications have
buffered is then committed (``_flush_open_files``; closed files were flushed by
the kernel's FLUSH/RELEASE calls already), and the mount is always unmounted on exit.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
from contextlib import AsyncExitStack
from pathlib import Path

import msgspec
import trio
import zmq

from ..common.arguments import ArgumentParser
from ..common import config as cfg
from ..common.errors import QuietError, StripefsError, leaves
from ..common.gc_tuning import tune_gc
from ..common.logs import add_debug_argument, debug_setting, setup_logging
from ..common.keyring import load_identity
from ..common.security import identity_of, split_address, use_identity
from ..common.systemd import notify
from ..common.metrics import serve as serve_metrics
from . import metrics as client_metrics
from . import fuse_backend
from .connect import open_client
from .fuse import mount as fuse_mount
from .fuse.device import Device
from .fuse.dispatch import Dispatcher
from .fuse.abi import InitFlag
from .fuse.session import DEFAULT_WANT, Options as SessionOptions, Session
from .jobs import Jobs
from .no_open_primer import NoOpenPrimer
from .operations_bridge import OperationsBridge
from .thread_meta import ThreadMeta
from .thread_reads import ThreadReads
from .kernel_cache import KernelCache
from .operations import SERVED_IOCTLS, Operations
from .passthrough import Passthrough
from .prefetch import Prefetcher
from .shm_cache import ShmCache

log = logging.getLogger(__name__)

#: -o options that are ours, not FUSE's
_OWN_OPTIONS = {"config", "dataset", "disk_cache_dir", "metrics", "key", "subdir", "root_squash", "op_timeout", "nonempty",
                "sync_close", "fuse_session", "per_open_handles", "passthrough", "read_threads"}
#: -o fuse_session=: the one value still accepted (pyfuse3 was the other until the mount's own session
#: served everything: docs/design.md, "The mount's own FUSE session"), so fstab lines that name it work
FUSE_SESSIONS = ("own",)


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="stripefs mount",
        description=(
            "Mount a stripefs cluster. Returns once the mount answers; the client keeps running in the "
            "background (use --foreground under systemd). Unmount with 'fusermount3 -u MOUNTPOINT' or "
            "'umount MOUNTPOINT'."
        ),
        epilog="Example: stripefs mount tcp://meta1:7100 /mnt/data -o allow_other",
    )
    parser.add_argument("meta", metavar="META_ADDR", help="metadata daemon address(es): tcp://HOST:PORT[,tcp://HOST:PORT...]")
    parser.add_argument("mountpoint", metavar="MOUNTPOINT", help="an existing, empty directory (-o nonempty: or one with files, hidden while mounted)")
    parser.add_argument(
        "-o",
        dest="options",
        action="append",
        default=[],
        metavar="OPT[,OPT...]",
        help=(
            "mount options: FUSE's (allow_other, ...) pass through; config=PATH reads client.toml; "
            "dataset: read-only dataset mode, mounted ro (warm opens are answered by the kernel; "
            "changes made elsewhere show within seconds); disk_cache_dir=DIR: keep chunk data on a local disk too "
            "(client.toml's key of that name); nonempty: mount over a directory that has files (hidden meanwhile); "
            "metrics=HOST:PORT: serve Prometheus metrics there; key=NAME.key_secret: this mount's CURVE key "
            "(META_ADDR then names the daemon's key: tcp://HOST:PORT?key=Z85); subdir=/DIR: show only that "
            "directory of the cluster; root_squash: root's new files and chowns become nobody's; "
            "op_timeout=SECONDS: the longest any file operation waits for the cluster before failing "
            "with EIO (default 60); read_threads=N: threads serving cold reads without the event loop (default 4, "
            "0: off); "
            "per_open_handles[=yes|no]: yes, OPEN, FLUSH and RELEASE per open file, a failed write reported to its "
            "own close (default no: the kernel sends no OPEN and no FLUSH, a warm read is no request at all); "
            "passthrough: (root, with disk_cache_dir) files cached whole on the local disk are read by the kernel "
            "from there, no request per read (implies per_open_handles=yes); "
            "sync_close: close() returns once what the file was written is stored and committed, and reports a "
            "write that could not be (one request per close). By default close() returns at once: the data is "
            "committed within 0.05-0.1 s of the last write, before another mount's open or stat of the file "
            "sees it, and fsync() waits for it and reports a failed write"
        ),
    )
    parser.add_argument("--config", help="client config file (see 'stripefs config example client')")
    parser.add_argument("-f", "--foreground", action="store_true", help="stay in the foreground (for systemd)")
    parser.add_argument(
        "--log",
        help="log file when running in the background (default: mount-PATH.log in a private runtime directory: "
        "/run/stripefs for root, $XDG_RUNTIME_DIR/stripefs or ~/.cache/stripefs otherwise); never followed if a symlink",
    )
    parser.add_argument("--pidfile", help="write the client's pid here once mounted")
    add_debug_argument(parser, "stripefs.client.striping")
    return parser


def _split_options(raw: list[str]) -> tuple[set[str], dict[str, str]]:
    fuse_opts: set[str] = set()
    own: dict[str, str] = {}
    for group in raw:
        for opt in filter(None, group.split(",")):
            key, _, value = opt.partition("=")
            if key == "cache_dir":  # the name this option had: a mount must not start without the cache asked for
                raise QuietError("-o cache_dir is called disk_cache_dir, as in client.toml: -o disk_cache_dir=DIR")
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
    if "dataset" in own:
        client_cfg = msgspec.structs.replace(client_cfg, dataset=True)
    if own.get("disk_cache_dir"):
        client_cfg = msgspec.structs.replace(client_cfg, disk_cache_dir=own["disk_cache_dir"])
    if client_cfg.disk_cache_dir and not Path(client_cfg.disk_cache_dir).is_dir():
        raise QuietError(f"disk cache directory {client_cfg.disk_cache_dir} does not exist; create it first")
    if "metrics" in own:  # -o metrics=HOST:PORT overrides the config's
        client_cfg = msgspec.structs.replace(client_cfg, metrics=own["metrics"])
    if own.get("key"):
        client_cfg = msgspec.structs.replace(client_cfg, curve_key=own["key"])
    if own.get("subdir"):
        client_cfg = msgspec.structs.replace(client_cfg, subdir=own["subdir"])
    if "root_squash" in own:
        client_cfg = msgspec.structs.replace(client_cfg, root_squash=True)
    if "sync_close" in own:
        client_cfg = msgspec.structs.replace(client_cfg, sync_close=True)
    if "read_threads" in own:
        try:
            client_cfg = msgspec.structs.replace(client_cfg, read_threads=int(own["read_threads"]))
        except ValueError:
            raise QuietError(f"read_threads={own['read_threads']}: give a number of threads, e.g. read_threads=4 (0: off)") from None
    if "op_timeout" in own:
        try:
            client_cfg = msgspec.structs.replace(client_cfg, op_timeout_s=float(own["op_timeout"]))
        except ValueError:
            raise QuietError(f"op_timeout={own['op_timeout']}: give a number of seconds, e.g. op_timeout=30") from None
    if "per_open_handles" in own:
        value = own["per_open_handles"] or "yes"
        if value not in ("yes", "no"):
            raise QuietError(f"per_open_handles={value}: give yes or no (per_open_handles alone means yes)")
        client_cfg = msgspec.structs.replace(client_cfg, per_open_handles=value == "yes")
    if "passthrough" in own:
        client_cfg = msgspec.structs.replace(client_cfg, passthrough=True)
    if client_cfg.passthrough:
        _check_passthrough(client_cfg)
        client_cfg = msgspec.structs.replace(client_cfg, per_open_handles=True)
    fuse_session = own.get("fuse_session") or "own"
    if fuse_session not in FUSE_SESSIONS:
        raise QuietError(f"fuse_session={fuse_session}: the mount has one FUSE session now, its own "
                         "(pyfuse3 was removed); drop the option")
    # a dataset mount is read-only in the kernel too (/proc/mounts says ro, writes never reach us);
    # its prefetch requests then come as ioctls (a read-only mount refuses setxattr)
    if client_cfg.dataset:
        fuse_opts.discard("rw")
        fuse_opts.add("ro")
    if not client_cfg.op_timeout_s > 0:
        raise QuietError(f"op_timeout_s = {client_cfg.op_timeout_s}: must be a positive number of seconds (default 60)")
    if client_cfg.subdir and not client_cfg.subdir.startswith("/"):
        raise QuietError(f"subdir={client_cfg.subdir} must be an absolute path in the cluster, like /team-a")
    if client_cfg.curve_key:
        load_identity(client_cfg.curve_key)  # a missing or unsafe key file is reported before forking
    addresses = [a.strip() for a in args.meta.split(",") if a.strip()]
    for a in addresses:
        if not a.startswith(("tcp://", "ipc://")):
            raise QuietError(f"metadata address {a!r} must look like tcp://HOST:PORT")
        if split_address(a)[1] and not client_cfg.curve_key and identity_of(None) is None:
            raise QuietError(f"{a} names a CURVE server key: give this mount its own key (-o key=NAME.key_secret)")
    mountpoint = Path(args.mountpoint).absolute()
    _check_mountpoint(mountpoint, nonempty="nonempty" in own)

    if args.foreground:
        setup_logging("mount", debug=debug_setting(args.debug))
        if args.pidfile:
            Path(args.pidfile).write_text(f"{os.getpid()}\n")
        return _serve(addresses, mountpoint, fuse_opts, client_cfg, ready_fd=None)

    try:
        log_dir = None if args.log else client_metrics.ensure_state_dir()
    except OSError as exc:
        raise QuietError(f"no private directory for the log ({exc}); give --log FILE") from None
    log_path = Path(args.log) if args.log else log_dir / f"mount-{str(mountpoint).strip('/').replace('/', '_') or 'root'}.log"
    try:
        log_fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise QuietError(f"cannot open the log file {log_path}: {exc.strerror} (a symlink is never followed; give --log FILE)") from None
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid:
        os.close(write_fd)
        os.close(log_fd)
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
    log_file = os.fdopen(log_fd, "a", buffering=1)
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
        log.error("mount failed: %s", exc)  # the log the parent's error points to says why
        _report(write_fd, str(exc))
        code = exc.exitcode
    except BaseException as exc:
        log.exception("mount client failed")
        _report(write_fd, f"{type(exc).__name__}: {exc}")
        code = 3
    os._exit(code)


def _check_passthrough(client_cfg: cfg.ClientConfig) -> None:
    """Passthrough's preconditions, refused with what to do (docs/design.md "Passthrough from the disk cache")."""
    if os.geteuid() != 0:
        raise QuietError("passthrough: the kernel registers backing files only for a mount run as root "
                         "(CAP_SYS_ADMIN); mount as root or drop the option")
    if not client_cfg.disk_cache_dir:
        raise QuietError("passthrough reads files from the disk cache: give -o disk_cache_dir=DIR too")
    if client_cfg.dataset:
        raise QuietError("passthrough needs OPEN, which a dataset mount declines (no-open); mount without "
                         "-o dataset for passthrough")


def _check_mountpoint(mountpoint: Path, *, nonempty: bool) -> None:
    """An existing directory, not mounted on, empty unless ``nonempty`` (as other FUSE file systems ask)."""
    if not mountpoint.exists() and not mountpoint.is_symlink():
        raise QuietError(f"mountpoint {mountpoint} does not exist; create it first (mkdir -p {mountpoint})")
    if not mountpoint.is_dir():
        raise QuietError(f"mountpoint {mountpoint} is not a directory; mount on a directory (an empty one)")
    if os.path.ismount(mountpoint):
        raise QuietError(f"{mountpoint} is already a mount point; unmount it first (fusermount3 -u {mountpoint})")
    if not nonempty:
        try:
            entries = len(os.listdir(mountpoint))
        except OSError as exc:
            raise QuietError(f"mountpoint {mountpoint}: {exc.strerror}") from None
        if entries:
            raise QuietError(f"mountpoint {mountpoint} is not empty ({entries} entries, hidden while mounted); "
                             "use an empty directory, or -o nonempty to mount over them")


def _report(fd: int | None, message: str) -> None:
    if fd is None:
        return
    try:
        os.write(fd, message.encode())
        os.close(fd)
    except OSError:
        pass


def _serve(addresses: list[str], mountpoint: Path, fuse_opts: set[str], client_cfg: cfg.ClientConfig,
           ready_fd: int | None) -> int:
    # the mount's source is its metadata address: admin commands find the cluster from a path
    options = {f"fsname={';'.join(addresses)}", "subtype=stripefs", "default_permissions"} | fuse_opts
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
    return next((e for e in leaves(exc) if isinstance(e, kinds)), None)


async def _run(addresses, mountpoint: str, options: set[str], client_cfg: cfg.ClientConfig, ready_fd: int | None) -> None:
    ctx = zmq.Context()
    if client_cfg.curve_key:
        use_identity(ctx, load_identity(client_cfg.curve_key))
    try:
        async with AsyncExitStack() as stack:
            nursery = await stack.enter_async_context(trio.open_nursery())
            stack.callback(nursery.cancel_scope.cancel)
            client = await open_client(ctx, stack, nursery, client_cfg, addresses, name=mountpoint)
            meta, data = client.meta, client.data
            kcache = KernelCache()
            client_metrics.FEED_HEALTHY.set_function(lambda: kcache.healthy)
            if meta.subtree is not None:  # a subdir mount: the kernel's root is that directory
                kcache.map_event = meta.subtree.event
                kcache.callbacks_wanted = False  # its feed is a view (client/kernel_cache.py)
            prefetcher = Prefetcher(meta, data, kcache, parallel=client_cfg.prefetch_parallel)
            ops = Operations(
                meta,
                data,
                attr_timeout=client_cfg.attr_timeout_s,
                entry_timeout=client_cfg.entry_timeout_s,
                cache_timeout=client_cfg.cache_timeout_s,
                dataset=client_cfg.dataset,
                per_open_handles=client_cfg.per_open_handles,
                kcache=kcache,
                prefetcher=prefetcher,
                op_timeout=client_cfg.op_timeout_s,
                sync_close=client_cfg.sync_close,
            )
            if client_cfg.passthrough:
                if data.disk_cache is None:
                    raise QuietError("passthrough: no disk cache (disk_cache_dir)", 1)
                ops.passthrough = Passthrough(data.disk_cache, data)
                ops.passthrough.token, ops.passthrough.nursery = trio.lowlevel.current_trio_token(), nursery
            prefetcher.on_fetched = ops.prefetched
            prefetcher.before_resolve = ops.commit_pending
            prefetcher.in_page_cache = ops.in_page_cache
            prefetcher.path_in_page_cache = ops.path_in_page_cache
            prefetcher.known_open_info = ops.known_open_info
            ops.jobs = Jobs()  # training jobs that report their data wait: stripefs top's per-job view
            client_metrics.instrument(ops, ops.jobs)
            try:
                metrics_address = serve_metrics(client_cfg.metrics)
            except (OSError, ValueError) as exc:
                raise QuietError(f"cannot serve metrics at {client_cfg.metrics!r} (key metrics): {exc}", 1) from None
            if client_cfg.shm_dir and os.path.isdir(client_cfg.shm_dir):
                shm = ShmCache(client_cfg.shm_dir, client_cfg.shm_size)
                try:
                    shm.open()
                except OSError as exc:
                    log.warning("no shared-memory prefetch (read_file reads through the mount): %s", exc)
                else:
                    prefetcher.shm = shm
                    stack.callback(shm.close)
            nursery.start_soon(meta.heartbeat_loop, mountpoint, name="session-heartbeat")
            nursery.start_soon(ops.jobs.sweep_loop, name="jobs-sweep")  # ended jobs leave the metrics
            reads = None
            if client_cfg.read_threads > 0:  # cold READs on plain threads (client/thread_reads.py)
                reads = ThreadReads(ctx, data.nodes, data.cache, trio.lowlevel.current_trio_token(),
                                    hedge_after_s=data.hedge_after_s, workers=client_cfg.read_threads)
                stack.callback(reads.close)  # (after the session's close below: nothing is taken any more)
                data.thread_fetch = reads.fetch_soon  # a LOOKUP's fetch of a small file: where its READ looks
            metas = None
            if client_cfg.read_threads > 0:  # GETATTR misses on plain threads too (client/thread_meta.py)
                metas = ThreadMeta(ctx, meta, missing=ops.hints.forget)  # (a LOOKUP's ENOENT: Operations.lookup)
                stack.callback(metas.close)  # (after the session's close below: nothing is taken any more)
            session = await _start_session(ops, mountpoint, options, client_cfg, nursery, reads, metas)
            if ops.passthrough is not None:
                if session.connection.passthrough:
                    ops.passthrough.device = session.device
                    nursery.start_soon(ops.passthrough.run, name="passthrough-retire")
                else:
                    log.warning("passthrough: the kernel did not accept FUSE_PASSTHROUGH at INIT (it needs Linux 6.9 "
                                "and CONFIG_FUSE_PASSTHROUGH); files are read the normal way")
            stop = trio.CancelScope()
            try:
                nursery.start_soon(_signals, stop, name="signals")
                nursery.start_soon(_tune_kernel, mountpoint, name="tune-kernel")
                nursery.start_soon(kcache.follow, ctx, meta.feed_info, name="change-feed")
                with trio.move_on_after(2.0):  # so that a listing right after the mount is cached long
                    await kcache.following.wait()
                nursery.start_soon(prefetcher.run, name="prefetch")
                if ops.dirops is not None:
                    await nursery.start(ops.dirops.run, name="async-dirops")  # creates answered here (client/async_dirops.py)
                if ops.writeback is not None:
                    await nursery.start(ops.writeback.run, name="write-back")  # small files after close (client/write_back.py)
                if ops.idle is not None:
                    await nursery.start(ops.idle.run, name="idle-commits")  # closes that send nothing (client/idle_commits.py)
                tune_gc()  # the start's objects frozen out of collections (common/gc_tuning.py)
                mode = "dataset mode (read-only), " if client_cfg.dataset else ""
                log.info("mounted %s from %s (%soptions %s)", mountpoint, ",".join(addresses), mode, ",".join(sorted(options)))
                client_metrics.write_state(mountpoint, metrics_address)
                notify("READY=1")
                _report(ready_fd, "ok")
                with stop:
                    await trio.to_thread.run_sync(session.wait, abandon_on_cancel=True)  # until unmounted
            finally:
                notify("STOPPING=1")
                client_metrics.remove_state(mountpoint)
                await _flush_open_files(ops, client_cfg.op_timeout_s)
                await trio.to_thread.run_sync(session.close)  # unmounts; the reader ends (the kernel frees backing ids)
                if ops.passthrough is not None:
                    log.info("passthrough: %s", ops.passthrough.stats())
                fuse_backend.use_session(None)
                await meta.end_session()
                log.info("unmounted %s", mountpoint)
    finally:
        ctx.term()


async def _flush_open_files(ops: Operations, bound_s: float) -> None:
    """Commit data that files still open in applications have buffered: a SIGTERM loses no
    acknowledged write that the cluster can store within ``bound_s`` (op_timeout_s). Creates
    answered here and not sent yet go first (client/async_dirops.py)."""
    if ops.dirops is not None:
        with trio.move_on_after(bound_s, shield=True):
            await ops.dirops.flush()
    with trio.move_on_after(bound_s, shield=True):  # commits already under way (closes that send nothing)
        await ops.quiet_commits_done()
    if ops.writeback is not None:  # files closed here, their data not sent yet
        with trio.move_on_after(bound_s, shield=True):
            await ops.writeback.flush()
    with ops.lock:  # (iterating: the FUSE reader thread's opens add files)
        pending = [of for of in ops.files.values() if of.has_unflushed or of.size != of.attr.size]
    if not pending:
        return
    log.info("flushing %d file(s) still open before unmounting", len(pending))
    with trio.move_on_after(bound_s, shield=True) as scope:
        for of in pending:
            try:
                await ops._replay(of)  # writes kept for a create answered since
                await ops.data.flush(of)
            except StripefsError as exc:
                log.error("inode %d: data written before the stop could not be stored: %s", of.ino, exc)
    if scope.cancelled_caught:
        log.error("flushing open files took over %.0fs; unmounting anyway (unflushed writes are lost)", bound_s)
    with trio.move_on_after(bound_s, shield=True):  # (an idle commit that fired meanwhile)
        await ops.quiet_commits_done()


#: the kernel reads ahead this much on sequential reads (the FUSE default is 128 KiB,
#: which turns a 1 GiB read into 8,192 requests to Python)
READ_AHEAD_KB = 4096


async def _tune_kernel(mountpoint: str) -> None:
    # The kernel sets read-ahead from the FUSE INIT reply, so change it only after INIT: a
    # stat() of the root from a thread returns once the session has answered it. (The
    # session sets max_background at INIT itself.)
    await trio.to_thread.run_sync(os.stat, mountpoint)
    device = _device_of(mountpoint)
    if device is None:
        log.warning("%s is not in /proc/self/mountinfo; kernel settings left at their defaults", mountpoint)
        return
    _raise_readahead(mountpoint, device)


def _device_of(mountpoint: str) -> str | None:
    """MAJ:MIN of the mount, from /proc/self/mountinfo (stat() on it would wait for this very process)."""
    with open("/proc/self/mountinfo") as f:
        devices = [line.split()[2] for line in f if line.split()[4] == mountpoint]
    return devices[-1] if devices else None


def _raise_readahead(mountpoint: str, device: str) -> None:
    """Raise the mount's backing-device read-ahead (/sys/class/bdi/MAJ:MIN/read_ahead_kb)."""
    try:
        with open(f"/sys/class/bdi/{device}/read_ahead_kb", "w") as f:
            f.write(str(READ_AHEAD_KB))
        log.debug("read-ahead of %s (bdi %s) set to %d KiB", mountpoint, device, READ_AHEAD_KB)
    except OSError as exc:
        log.warning("cannot raise the kernel read-ahead of %s (sequential reads will be slower): %s", mountpoint, exc)


async def _signals(stop: trio.CancelScope) -> None:
    """End the mount on SIGTERM/SIGINT/SIGHUP: ``stop`` cancels the wait for the session's end."""
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
        async for signum in signals:
            log.info("signal %d: unmounting", signum)
            stop.cancel()
            return


async def _start_session(ops: Operations, mountpoint: str, options: set[str], client_cfg: cfg.ClientConfig,
                         nursery: trio.Nursery, reads: ThreadReads | None = None, metas: ThreadMeta | None = None) -> Session:
    """Mount and answer INIT with the mount's FUSE session (client/fuse/), every request served by
    ``ops`` (client/operations_bridge.py); the calls the mount makes into its session go there too."""
    fsname = next((o.split("=", 1)[1] for o in options if o.startswith("fsname=")), "stripefs")
    kernel_opts = [o for o in options if not o.startswith(("fsname=", "subtype="))]
    try:
        m = await trio.to_thread.run_sync(lambda: fuse_mount.mount(mountpoint, kernel_opts, fsname=fsname, subtype="stripefs"))
    except fuse_mount.MountError as exc:
        raise QuietError(f"cannot mount {mountpoint}: {exc}", 3) from None
    token = trio.lowlevel.current_trio_token()
    bridge = OperationsBridge(ops, token, nursery)
    bridge.thread_reads = reads
    bridge.thread_meta = metas
    if ops.no_open and not ops.dataset:  # a created file's close then sends no RELEASE either
        bridge.primer = NoOpenPrimer(mountpoint, ops.kcache.path_of)
    # max_write 128 KiB, libfuse's default: with 1 MiB writes, a sequential writer
    # of 24 chunks asked the daemon for placements 14 times instead of at most 8
    # (tests/cluster/test_write_path.py; why is not understood yet: client/placements.py alloc_indices)
    want = DEFAULT_WANT
    if ops.passthrough is not None:
        want |= InitFlag.PASSTHROUGH  # (the session sends max_stack_depth 1 with it; no WRITEBACK_CACHE is asked)
    if ops.no_open:
        # no-open (the bridge declines OPEN): the kernel then asks nothing at an open, even for writing;
        # without atomic O_TRUNC an open(O_TRUNC) sends SETATTR (size 0), which truncates (EROFS on a
        # dataset mount), instead of the kernel setting the file's size to 0 by itself
        want &= ~InitFlag.ATOMIC_O_TRUNC
    options_ = SessionOptions(want=want, max_background=client_cfg.max_background, max_write=1 << 17,
                              ioctls=SERVED_IOCTLS)
    dev = Device(m.fd)
    session = Session(dev, Dispatcher(bridge, token, nursery), options_, on_close=lambda: fuse_mount.unmount(m, dev))
    if reads is not None:
        session.side = reads.reader  # cold READs loaded by the reader thread itself (client/reader_loads.py)
    try:
        await trio.to_thread.run_sync(session.start)
    except BaseException:
        await trio.to_thread.run_sync(fuse_mount.unmount, m)
        raise
    fuse_backend.use_session(session)
    client_metrics.SESSION_REQUESTS.counts = session.counts  # stripefs_fuse_requests_total
    return session
