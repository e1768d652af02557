"""``stripefs layout convert``: re-write existing files to another redundancy, online.

The converter is a small client of its own (client/connect.py): a metadata session, a NodePool
and a ``DataPath``, the same data path the mount uses, without FUSE. For
each file it:

1. opens the file (OpenReq, held by its session) and asks the daemon for a
   *shadow*: a nameless inode with the new redundancy (CreateShadowReq);
2. copies the data chunk by chunk through the data path (all-zero chunks
   are skipped: holes stay holes), then fsyncs the shadow: every fragment or
   replica is durable before step 3;
3. swaps (SwapShadowReq): in one metadata transaction every name of the file
   leads to the shadow, provided the file did not change since step 1; if it
   did (BUSY), the copy is started again, up to three times.

The file stays readable all along, in its old layout until the swap and its
new one after. A converter killed at any point (``kill -9``) leaves the old
file as it was; its shadow is an orphan held by nobody once the session's
lease lapses, and the daemon reclaims it (daemon/redundancy.py). Running the
command again resumes: files already in the target layout are skipped.

With ``--recursive`` directories are walked through the mount and also get
the new redundancy for files created later.
"""

from __future__ import annotations

import logging
import os
import signal
import stat
import sys
from contextlib import AsyncExitStack

import trio
import zmq

from ..common import protocol as p
from ..common.config import ClientConfig, Size
from ..common.errors import ErrorCode, QuietError, StripefsError
from ..common.progress import Progress
from .connect import open_client
from .meta_rpc import MetaClient
from .open_files import OpenFile
from .striping import DataPath

log = logging.getLogger(__name__)

BUSY_RETRIES = 3


class _Tally:
    """What happened to each file, and the shared progress bar (common/progress.py).

    When stderr is not a terminal, a line per file is printed instead of a bar.
    """

    def __init__(self, files: int, total_bytes: int):
        self.files = files
        self.bar = Progress(files, label="converting", total_bytes=total_bytes)
        self.done_files = 0
        self.done_bytes = 0
        self.converted = 0
        self.skipped = 0
        self.failed: list[str] = []

    def advance(self, nbytes: int) -> None:
        self.done_bytes += nbytes
        self.bar.update(self.done_files, self.done_bytes)

    def file_done(self, path: str, outcome: str) -> None:
        self.done_files += 1
        self.bar.update(self.done_files, self.done_bytes)
        if not self.bar.tty:
            print(f"[{self.done_files}/{self.files}] {path}: {outcome}", file=sys.stderr, flush=True)

    def finish(self) -> None:
        self.bar.close()


def _targets(paths: list[str], recursive: bool) -> tuple[list[tuple[str, int]], list[str]]:
    """(path, size) of the regular files to convert, and the directories met (for --recursive)."""
    files, dirs = [], []
    for path in paths:
        try:
            st = os.stat(path)
        except OSError as exc:
            raise QuietError(f"{path}: {exc.strerror}") from None
        if stat.S_ISDIR(st.st_mode):
            if not recursive:
                raise QuietError(f"{path} is a directory: add --recursive to convert every file under it")
            dirs.append(path)
            for root, subdirs, names in os.walk(path):
                dirs += [os.path.join(root, d) for d in subdirs]
                for name in names:
                    full = os.path.join(root, name)
                    st2 = os.lstat(full)
                    if stat.S_ISREG(st2.st_mode):
                        files.append((full, st2.st_size))
        elif stat.S_ISREG(st.st_mode):
            files.append((path, st.st_size))
        else:
            raise QuietError(f"{path} is not a regular file or directory")
    return files, dirs


class Converter:
    def __init__(self, meta: MetaClient, data: DataPath, redundancy: str, progress: _Tally):
        self.meta = meta
        self.data = data
        self.redundancy = redundancy
        self.progress = progress
        self.held: set[int] = set()
        meta.open_inodes = lambda: sorted(self.held)

    async def convert(self, path: str) -> str:
        """Convert one file; a word saying what happened."""
        ino = os.stat(path).st_ino
        for attempt in range(BUSY_RETRIES):
            try:
                return await self._convert_once(ino)
            except StripefsError as exc:
                if exc.code != ErrorCode.BUSY or attempt == BUSY_RETRIES - 1:
                    raise
                log.info("%s changed while it was copied; copying again", path)
        raise AssertionError("unreachable")

    async def _convert_once(self, ino: int) -> str:
        self.held.add(ino)
        try:
            rsp = await self.meta.call(p.OpenReq(ino=ino, session_id=self.meta.session_id))
            if rsp.layout.redundancy == self.redundancy:
                self.progress.advance(rsp.attr.size)
                return "already " + self.redundancy
            self.data.nodes.learn(rsp.nodes)
            src = OpenFile(ino, rsp.attr, rsp.layout, {c.index: c for c in rsp.chunks})
            shadow_rsp = await self.meta.call(
                p.CreateShadowReq(ino=ino, redundancy=self.redundancy, session_id=self.meta.session_id)
            )
            self.held.add(shadow_rsp.attr.ino)
            try:
                return await self._copy_and_swap(src, shadow_rsp)
            finally:
                self.held.discard(shadow_rsp.attr.ino)
        finally:
            self.held.discard(ino)

    async def _copy_and_swap(self, src: OpenFile, shadow_rsp: p.OpenRsp) -> str:
        self.data.nodes.learn(shadow_rsp.nodes)
        dst = OpenFile(shadow_rsp.attr.ino, shadow_rsp.attr, shadow_rsp.layout, {c.index: c for c in shadow_rsp.chunks})
        dst.epoch = shadow_rsp.epoch
        cs = src.chunk_size
        size = src.attr.size
        for offset in range(0, size, cs):
            ref = src.chunks.get(offset // cs)
            n = min(cs, size - offset)
            if ref is not None and ref.version:
                piece = await self.data.read(src, offset, n)
                if any(piece):
                    await self.data.write(dst, offset, bytes(piece))
            self.progress.advance(n)
        dst.size = size  # a trailing hole is part of the size
        await self.data.flush(dst, sync=True)
        copied = [p.ChunkRef(index=c.index, version=c.version, nodes=[]) for c in src.chunks.values() if c.version]
        await self.meta.call(
            p.SwapShadowReq(ino=src.ino, shadow=dst.ino, size=size, mtime_ns=src.attr.mtime_ns, chunks=copied)
        )
        self.data.cache.drop_inode(src.ino)
        return f"{src.layout.redundancy} -> {self.redundancy}"


#: the converter's client: a small cache and read-ahead (it reads each file once), half a minute of retries
CONVERTER_CONFIG = ClientConfig(op_timeout_s=30.0, cache_size=Size(128 << 20), readahead_chunks=2, write_parallelism=4, shm_dir="", metrics="")


def run(addresses: list[str], paths: list[str], redundancy: str, *, recursive: bool, config: ClientConfig = CONVERTER_CONFIG) -> int:
    """Convert ``paths``; the exit code (0: all converted or already so, 3: some failed)."""
    files, dirs = _targets(paths, recursive)
    progress = _Tally(len(files), sum(size for _, size in files))

    interrupted = False

    async def stop_on_ctrl_c(scope: trio.CancelScope) -> None:
        """Ctrl-C (SIGINT) cancels the run: the file being converted keeps its old layout (its shadow is
        reclaimed with the session), and the summary says how far it got. Received here, it is never a
        KeyboardInterrupt raised in whatever task runs (a write would report it as the file's failure)."""
        nonlocal interrupted
        with trio.open_signal_receiver(signal.SIGINT) as signals:
            async for _ in signals:
                interrupted = True
                scope.cancel()
                return

    async def main() -> None:
        ctx = zmq.Context()
        try:
            async with AsyncExitStack() as stack:
                nursery = await stack.enter_async_context(trio.open_nursery())
                stack.callback(nursery.cancel_scope.cancel)
                nursery.start_soon(stop_on_ctrl_c, nursery.cancel_scope, name="ctrl-c")
                client = await open_client(ctx, stack, nursery, config, addresses, name=f"layout convert pid {os.getpid()}")
                meta, data = client.meta, client.data
                converter = Converter(meta, data, redundancy, progress)
                nursery.start_soon(meta.heartbeat_loop, "", name="session-heartbeat")
                for d in dirs:
                    await meta.call(p.SetLayoutReq(ino=os.stat(d).st_ino, redundancy=redundancy))
                for path, _ in files:
                    try:
                        outcome = await converter.convert(path)
                        if outcome.startswith("already"):
                            progress.skipped += 1
                        else:
                            progress.converted += 1
                    except StripefsError as exc:
                        outcome = f"FAILED: {exc.message or exc.code.name}"
                        progress.failed.append(path)
                    except OSError as exc:
                        outcome = f"FAILED: {exc.strerror}"
                        progress.failed.append(path)
                    progress.file_done(path, outcome)
        finally:
            ctx.destroy(linger=0)

    trio.run(main)
    progress.finish()
    if interrupted:
        print(f"interrupted after {progress.done_files:,} of {progress.files:,} file(s): {progress.converted} converted to "
              f"{redundancy}, {progress.skipped} already were" + (f", {len(progress.failed)} failed" if progress.failed else "")
              + "; the others keep their layout: run the command again to finish")
        return 130
    print(
        f"{progress.converted} file(s) converted to {redundancy}, {progress.skipped} already were"
        + (f", {len(progress.failed)} failed (run the command again to retry them)" if progress.failed else ""),
    )
    return 3 if progress.failed else 0
