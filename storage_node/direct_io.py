"""Whole chunk files written with O_DIRECT from reused, aligned buffers.

Why: a buffered write copies every byte into newly allocated page-cache pages.
On a virtual machine whose free memory is handed back to the host (free page
reporting: Firecracker, many clouds), each newly allocated page costs a fault
on the host when it is first touched, and the copy runs at a fraction of memory
speed: measured here, writing 512 MiB of fresh 4 MiB files cost 2.2-2.5 s of
CPU per GiB buffered (0.2 s when the pages happened to be recycled at once),
against 0.1 s per GiB with O_DIRECT. Storage nodes write every replica, so
this copy was most of a sequential writer's cluster CPU (bench/run.py seq
write, ~60% of a node's samples in ``copy_folio_from_iter_atomic``).

How: the file is built in one page-aligned buffer (header, checksum table,
data; the on-disk format is unchanged, chunk_file.py), padded to a multiple of
``ALIGN`` and written with one O_DIRECT write from offset 0, then cut to its
exact size with ftruncate. Buffers are mmap'd once and kept in a small pool, so
their pages are touched once per process, not once per write. The copy into
the buffer is the only user-space copy, at memory speed.

Only files of at least ``DIRECT_MIN`` bytes go this way: small files stay
buffered, so that a read right after the write still finds the page cache
(storage_node/service.py answers small reads from it inline).

Durability is the caller's, as before: the file is a temp file renamed over
the chunk, and fsynced (with its directory) only when the request asks for
``sync``. O_DIRECT bypasses the page cache but not the disk's own cache, and
leaves the file's size and extents to the journal, so an fsync is still needed
for power loss. A file system that refuses O_DIRECT (EINVAL: tmpfs on older
kernels, ext4 data=journal) turns it off for the process, with one INFO line.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import threading
from typing import Sequence

log = logging.getLogger(__name__)

#: file offsets, lengths and buffer addresses of O_DIRECT I/O are multiples of this
#: (the page size: enough for every block device with logical blocks up to 4 KiB)
ALIGN = 4096

#: files smaller than this are written through the page cache
DIRECT_MIN = 1 << 20

#: buffers kept for reuse (one per concurrent writer: a node's io_threads)
POOL_MAX = 8


def round_up(n: int, align: int = ALIGN) -> int:
    return -(-n // align) * align


class DirectWriter:
    """Writes whole files with O_DIRECT; thread-safe. ``enabled`` turns False for good on EINVAL."""

    def __init__(self, *, enabled: bool = True, min_size: int = DIRECT_MIN, pool_max: int = POOL_MAX):
        self.enabled = enabled and hasattr(os, "O_DIRECT")
        self.min_size = min_size
        self.pool_max = pool_max
        self._pool: list[mmap.mmap] = []
        self._guard = threading.Lock()

    def wants(self, size: int) -> bool:
        """Whether a file of ``size`` bytes should be written with ``write_file``."""
        return self.enabled and size >= self.min_size

    def _take(self, size: int) -> mmap.mmap:
        with self._guard:
            for i, buf in enumerate(self._pool):
                if len(buf) >= size:
                    return self._pool.pop(i)
        return mmap.mmap(-1, round_up(size, 1 << 20))  # page-aligned; whole MiBs so sizes repeat

    def _give(self, buf: mmap.mmap) -> None:
        with self._guard:
            if len(self._pool) < self.pool_max:
                self._pool.append(buf)
                return
            smallest = min(range(len(self._pool)), key=lambda i: len(self._pool[i]))
            if len(self._pool[smallest]) < len(buf):  # keep the larger ones
                buf, self._pool[smallest] = self._pool[smallest], buf
        buf.close()

    def write_file(self, path: str | os.PathLike, parts: Sequence[bytes | bytearray | memoryview]) -> int | None:
        """Create (truncate) ``path`` holding ``parts`` one after another; the open fd, or None when
        the file system refuses O_DIRECT (then ``enabled`` is False and nothing was created).
        The caller fsyncs (if it wants) and closes the fd; OSError propagates with the fd closed."""
        total = sum(len(p) for p in parts)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_DIRECT, 0o600)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            self._refused(path, exc)
            return None
        try:
            if not self._write(fd, parts, total):
                os.close(fd)
                os.unlink(path)
                self._refused(path, OSError(errno.EINVAL, "O_DIRECT write refused"))
                return None
            os.ftruncate(fd, total)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _write(self, fd: int, parts: Sequence[bytes | bytearray | memoryview], total: int) -> bool:
        padded = round_up(total)
        buf = self._take(padded)
        try:
            with memoryview(buf) as view:
                pos = 0
                for part in parts:
                    n = len(part)
                    view[pos : pos + n] = part
                    pos += n
                view[total:padded] = bytes(padded - total)  # the tail past the end: never stale bytes on disk
                done = 0
                while done < padded:
                    try:
                        n = os.pwrite(fd, view[done:padded], done)
                    except OSError as exc:
                        if exc.errno == errno.EINVAL and done == 0:
                            return False
                        raise
                    if n <= 0 or n % ALIGN:  # a short write off the alignment cannot be continued directly
                        raise OSError(errno.EIO, f"O_DIRECT write stopped after {done + max(n, 0)} of {padded} bytes")
                    done += n
        finally:
            self._give(buf)
        return True

    def _refused(self, path, exc: OSError) -> None:
        if self.enabled:
            self.enabled = False
            log.info("the file system of %s refuses O_DIRECT (%s); chunk files are written through the page cache", path, exc.strerror)
