"""``stripefs meta``: run the metadata daemon in the foreground.

Exit codes: 0 after a clean stop (SIGTERM/SIGINT), 1 for a usage or config
error (printed without a traceback). Under systemd (Type=notify) READY=1 is
sent once the socket is bound and the database is open, STOPPING=1 when a
signal arrives; the pending group commit is flushed before exit.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from pathlib import Path

import trio
import zmq

from ..common.arguments import ArgumentParser
from ..common.keyring import server_keyring
from ..common import metrics
from ..common.config import MetaConfig, load
from ..common.errors import QuietError, StripefsError
from ..common.gc_tuning import tune_gc
from ..common.layout import validate_layout
from ..common.protocol import Layout
from ..common.logs import add_debug_argument, debug_setting, setup_logging
from ..common.systemd import notify
from .metrics import publish_cluster_metrics
from .service import MetaService

log = logging.getLogger(__name__)

_DESCRIPTION = """\
Run the stripefs metadata daemon: the one process that owns the namespace
(inodes, directories, attributes, xattrs, symlinks, hard links), file layouts,
chunk placement and the membership and health of storage nodes. Clients and
storage nodes reach it over ZeroMQ at the config's `listen` address; its state
is an SQLite database (WAL, fsync on every group commit) in `data_dir`, or,
with `store = "postgresql"` and a `dsn`, a PostgreSQL database that several
daemons serve at once (docs/postgresql.md). Bulk data never flows through it.

Write a config with `stripefs config example meta > metad.toml`.

Also:
  stripefs meta backup FILE [--config PATH | --dir STATE]    online copy of the metadata database
  stripefs meta restore FILE [--config PATH | --dir STATE]   put a copy back (the daemon stopped)
(`stripefs meta backup --help`; docs/operations.md, "Metadata backup and restore")
"""


def _parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="stripefs meta", description=_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", required=True, metavar="PATH", help="the daemon's TOML config (metad.toml)")
    add_debug_argument(parser, "stripefs.daemon.namespace")
    return parser


async def _serve(config: MetaConfig) -> None:
    ctx = zmq.Context()
    try:
        service = MetaService(config, zmq_context=ctx)
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async with trio.open_nursery() as nursery:
                await nursery.start(service.run)
                tune_gc()
                nursery.start_soon(publish_cluster_metrics, service, name="meta-metrics")
                notify("READY=1")
                log.info("metadata daemon serving on %s, database %s, boot %s", config.listen, service.db_name(), service.boot_id)
                async for signum in signals:
                    log.info("%s received: stopping", signal.Signals(signum).name)
                    notify("STOPPING=1")
                    nursery.cancel_scope.cancel()
                    break
    finally:
        ctx.term()


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    try:
        config = load(args.config, MetaConfig)
        try:
            validate_layout(Layout(int(config.chunk_size), config.stripe_count, config.redundancy))
        except StripefsError as exc:
            raise QuietError(f"{args.config}: root layout: {exc.message}") from None
        if config.store not in ("sqlite", "postgresql"):
            raise QuietError(f'{args.config}: store = "{config.store}": use "sqlite" or "postgresql"')
        if config.store == "postgresql" and not config.dsn:
            raise QuietError(f'{args.config}: store = "postgresql" needs dsn = "host=... dbname=... user=..."')
        try:
            Path(config.data_dir).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise QuietError(f"cannot create data_dir {config.data_dir}: {exc.strerror}") from None
        # CURVE settings checked before starting: a key, a keyring, loopback-only without them
        server_keyring(None, config.curve_key, config.keyring, [config.listen, config.events_listen,
                       "" if config.read_listen == "off" else config.read_listen], source=args.config)
    except QuietError as exc:
        print(f"stripefs meta: {exc}", file=sys.stderr)
        return exc.exitcode
    setup_logging("meta", debug=debug_setting(args.debug))
    try:
        metrics.serve(config.metrics)
    except (OSError, ValueError) as exc:
        log.error("cannot serve metrics at %s (config %s, key metrics): %s", config.metrics, args.config, exc)
        return 1
    rc = 0
    try:
        trio.run(_serve, config)
    except* zmq.ZMQError as group:
        log.error("cannot listen on %s: %s", config.listen, group.exceptions[0])
        rc = 1
    except* RuntimeError as group:  # e.g. a database with a newer schema
        log.error("cannot start: %s", group.exceptions[0])
        rc = 1
    return rc
