#!/usr/bin/env python3
"""A storage node making small chunk writes durable: an fsync per file against one syncfs per batch.

    .venv/bin/python bench/node_sync.py                        # 640 chunks of 110 KiB, batches of 64
    .venv/bin/python bench/node_sync.py --files 2000 --size 4096 --dir /var/tmp

Four ways of storing ``--files`` new chunks of ``--size`` random bytes durably, on
the same disk (``--dir``, default /var/tmp), each in a fresh data directory:

* ``local fdatasync``: plain files, write + fdatasync each (no checksums,
  no rename): what the local disk costs for one durable small file;
* ``store, fsync each``: ChunkStore.write(sync=True), today's WriteChunkReq
  with ``sync`` (temp file, fsync, rename, fsync of the directory);
* ``store, syncfs per batch``: ChunkStore.write without sync for each chunk
  of a batch of ``--batch``, then one ``sync_batch`` (syncfs), as a
  WriteChunksReq with ``sync`` does;
* ``node, WriteChunkReq each`` / ``node, WriteChunksReq``: the same two over
  ZeroMQ to a StorageService in this process (its handler and worker thread).

Printed: ms per file (wall) and CPU ms per file of this process, with the
ratio to the fsync-per-file figure. A syncfs flushes everything dirty on the
file system, so other writers on the same disk (the other engineers' runs on a
shared machine) weigh on it: repeat, and give the range and ``uptime``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import trio
import xxhash
import zmq

from stripefs.common import protocol as p
from stripefs.common.config import StorageConfig
from stripefs.common.transport import connect
from stripefs.local_cluster import free_port
from stripefs.storage_node.chunk_store import ChunkStore
from stripefs.storage_node.service import StorageService


def free_address() -> str:
    return f"tcp://127.0.0.1:{free_port()}"  # in STRIPEFS_LOCAL_PORTS


def _timed(fn) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def local_fdatasync(root: Path, blobs: list[bytes], batch: int) -> None:
    for i, data in enumerate(blobs):
        fd = os.open(root / f"f{i}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, data)
            os.fdatasync(fd)
        finally:
            os.close(fd)


def store_fsync_each(root: Path, blobs: list[bytes], batch: int) -> None:
    with ChunkStore(root, reserved_space=0) as store:
        for i, data in enumerate(blobs):
            store.write(p.ChunkId(1000 + i, 0, 0), 1, 0, 0, data, replace=True, sync=True)


def store_syncfs_batch(root: Path, blobs: list[bytes], batch: int) -> None:
    with ChunkStore(root, reserved_space=0) as store:
        for start in range(0, len(blobs), batch):
            chunks = []
            for i in range(start, min(start + batch, len(blobs))):
                chunk = p.ChunkId(1000 + i, 0, 0)
                store.write(chunk, 1, 0, 0, blobs[i], replace=True)
                chunks.append(chunk)
            store.sync_batch(chunks)


def _over_the_wire(root: Path, blobs: list[bytes], batch: int, batched: bool) -> None:
    async def main():
        ctx = zmq.Context()
        config = StorageConfig(node_id=1, listen=free_address(), data_dir=str(root), meta=[free_address()],
                               heartbeat_interval_s=60, reserved_space=0)
        store = ChunkStore(root, reserved_space=0, node_id=1)
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(StorageService(config, store, ctx=ctx).run)
                async with connect(ctx, config.listen, timeout=60) as node:
                    writes = [p.WriteChunkReq(chunk=p.ChunkId(1000 + i, 0, 0), version=1, base_version=0, offset=0,
                                              xxh3=xxhash.xxh3_64_intdigest(d), replace=True, sync=not batched)
                              for i, d in enumerate(blobs)]
                    if batched:
                        for start in range(0, len(blobs), batch):
                            rsp, _ = await node.call(p.WriteChunksReq(writes=writes[start : start + batch], sync=True),
                                                     blobs[start : start + batch])
                            assert not any(r.code for r in rsp.results), rsp
                    else:
                        for write, data in zip(writes, blobs):
                            await node.call(write, [data])
                nursery.cancel_scope.cancel()
        finally:
            store.close()
            ctx.destroy(linger=0)

    trio.run(main)


def node_write_each(root: Path, blobs: list[bytes], batch: int) -> None:
    _over_the_wire(root, blobs, batch, batched=False)


def node_write_batch(root: Path, blobs: list[bytes], batch: int) -> None:
    _over_the_wire(root, blobs, batch, batched=True)


WAYS = [
    ("local fdatasync", local_fdatasync, None),
    ("store, fsync each", store_fsync_each, None),
    ("store, syncfs per batch", store_syncfs_batch, "store, fsync each"),
    ("node, WriteChunkReq each", node_write_each, None),
    ("node, WriteChunksReq", node_write_batch, "node, WriteChunkReq each"),
]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", type=int, default=640)
    parser.add_argument("--size", type=int, default=110 << 10)
    parser.add_argument("--batch", type=int, default=p.MAX_BATCH_WRITES)
    parser.add_argument("--dir", default="/var/tmp", help="where the data directories go (a disk, not tmpfs)")
    args = parser.parse_args(argv)
    if not 1 <= args.batch <= p.MAX_BATCH_WRITES:
        parser.error(f"--batch must be 1..{p.MAX_BATCH_WRITES}")
    blobs = [os.urandom(args.size) for _ in range(args.files)]
    print(f"{args.files} files of {args.size} bytes, batches of {args.batch}, under {args.dir}; {os.getloadavg()[0]:.2f} load")
    results = {}
    for name, fn, _ in WAYS:
        root = Path(tempfile.mkdtemp(prefix="node-sync-", dir=args.dir))
        try:
            os.sync()  # start each from a clean file system
            wall, cpu = _timed(lambda: fn(root, blobs, args.batch))
        finally:
            shutil.rmtree(root, ignore_errors=True)
        results[name] = (wall * 1000 / args.files, cpu * 1000 / args.files)
    print(f"{'':28} {'ms/file':>9} {'CPU ms/file':>12} {'ratio (wall)':>13}")
    for name, _, baseline in WAYS:
        wall, cpu = results[name]
        ratio = f"{results[baseline][0] / wall:.1f}x faster" if baseline else ""
        print(f"{name:28} {wall:9.2f} {cpu:12.3f} {ratio:>13}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
