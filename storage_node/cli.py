"""``stripefs storage``: run one storage node (one per disk) in the foreground.

Exit codes: 0 after SIGTERM/SIGINT (a clean stop), 1 on a config or startup
problem (printed without a traceback). Under systemd (``Type=notify``) the
node sends READY=1 once its socket is bound and STOPPING=1 when asked to stop.
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
from ..common.config import StorageConfig, load
from ..common.errors import QuietError
from ..common.malloc_tuning import keep_freed_memory
from ..common.logs import add_debug_argument, debug_setting, setup_logging
from ..common.systemd import notify

from .chunk_store import ChunkStore
from .service import StorageService

log = logging.getLogger(__name__)

_DESCRIPTION = """\
Run a stripefs storage node. A storage node owns one local disk (its data_dir):
it keeps chunk files there, each block protected by an xxh3 checksum, serves
chunk reads and writes directly to mounted clients, and reports its capacity to
the metadata daemon by heartbeat. Run one per disk, usually as the systemd
template unit stripefs-storage@.service. Print a commented config with
`stripefs config example storage`.
"""


def _parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="stripefs storage", description=_DESCRIPTION)
    parser.add_argument("--config", required=True, metavar="FILE", help="the node's TOML config (storage.toml)")
    add_debug_argument(parser, "stripefs.storage_node.chunk_store")
    return parser


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    try:
        config = load(args.config, StorageConfig)
        try:
            Path(config.data_dir).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise QuietError(f"cannot create data_dir {config.data_dir}: {exc.strerror}") from None
        # CURVE settings checked before starting: a key, a keyring, loopback-only without them
        server_keyring(None, config.curve_key, config.keyring, [config.listen], source=args.config)
        setup_logging("storage", debug=debug_setting(args.debug))
        try:
            metrics.serve(config.metrics)
        except (OSError, ValueError) as exc:
            raise QuietError(f"cannot serve metrics at {config.metrics} (config {args.config}, key metrics): {exc}") from None
        store = ChunkStore(
            config.data_dir,
            block_size=config.block_size,
            capacity=config.capacity,
            reserved_space=config.reserved_space,
            node_id=config.node_id,
        )
    except QuietError as exc:
        print(f"stripefs storage: {exc}", file=sys.stderr)
        return exc.exitcode
    keep_freed_memory()  # a batch's replies reuse the last batch's memory (common/malloc_tuning.py)
    ctx = zmq.Context()
    try:
        return trio.run(_run, config, store, ctx)
    finally:
        store.close()
        ctx.destroy(linger=0)


async def _run(config: StorageConfig, store: ChunkStore, ctx: zmq.Context) -> int:
    service = StorageService(config, store, ctx=ctx)
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:
            try:
                await nursery.start(service.run, name=f"storage-{config.node_id}")
            except zmq.ZMQError as exc:  # address in use, bad endpoint
                print(f"stripefs storage: cannot listen on {config.listen}: {exc}", file=sys.stderr)
                return 1
            notify("READY=1")
            log.info("storage node %d serving on %s data %s", config.node_id, config.listen, config.data_dir)
            async for signum in signals:
                log.info("storage node %d: %s received, stopping", config.node_id, signal.Signals(signum).name)
                notify("STOPPING=1")
                nursery.cancel_scope.cancel()
                break
    return 0
