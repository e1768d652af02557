"""Chunk files on one local disk: the storage node's core, with no network code.

A storage node keeps one file per chunk copy (``ChunkId(ino, index, part)``).
``ChunkStore`` reads, writes, deletes and stats them; ``service.py`` decodes
wire messages and calls it from worker threads. Everything here is plain
synchronous Python so that it can be tested (and kill -9'ed) directly.

The on-disk format (where a chunk file lives, what its header holds) is
defined in storage_node/chunk_file.py; this module is what the node does with
those files.

Reads verify the header (and the whole table, at most 8 KiB for a 64 MiB chunk)
and then every data block they touch, on every read: a mismatch raises
``StripefsError(CORRUPT)`` and logs a WARNING naming the chunk and the block,
and the bytes are never returned. The copy is bad; the client reads another
copy and the metadata daemon repairs this one.

Copy-on-write across slots (common/layout.py "Slots"): a writer stores a new
version of a chunk in the other slot (part) than the committed one, so a write
session that fails leaves the committed copy untouched. A partial write to a
slot that holds no copy of the session yet takes the bytes it does not cover
from the other slot's copy (``_merge``), which must be at least the writer's
``base_version`` (else STALE: the writer sends the whole chunk). Data
directories from before slots are moved once at startup (``_move_to_slots``).

Writes never modify a chunk file in place. Every write builds the complete new
file under ``NAME.tmp`` in the same directory (fsynced when the request asks
for ``sync``), puts it in place of ``NAME`` (renameat2's exchange, then the old
copy unlinked: ``_swap_in`` says why not a rename over it; then fsyncs the
directory when ``sync``). After kill -9 at any moment the chunk is therefore either the old
or the new file; leftover ``*.tmp`` files are removed at startup. A partial
write reads the old copy (verifying it), merges and writes a whole new file:
simple, crash-safe, and cheap for the chunk sizes used (a few MiB).
Files of ``direct_io.DIRECT_MIN`` (1 MiB) or more are written with O_DIRECT
from a reused aligned buffer (storage_node/direct_io.py: the page-cache copy
was most of a sequential writer's CPU on a virtual machine); smaller ones
through the page cache, where reads right after the write find them. A new
fan-out directory's entry is fsynced at once by a ``sync`` write, else by the
next ``sync`` call, which fsyncs every such parent made since (chunk files
written without ``sync`` are not durable before it anyway).

Concurrency: calls may come from many threads at once. Writes and deletes of
one chunk are serialised by a per-chunk lock (read-merge-rename is otherwise a
lost update); reads take no lock, because a reader's open file descriptor keeps
the file it opened, old or new, whole. A caller that must not wait (the node's
fast lane) writes with ``wait=False`` and ``max_bytes`` and asks ``busy`` before
a delete: it never waits behind a worker thread's write of the same chunk.

Space: ``used`` is the sum of the chunk file sizes, counted by a scan at
startup and kept up to date by writes and deletes. A write is refused with
NO_SPACE, leaving the stored copy intact, when it would take the store past
``capacity`` (if nonzero) or leave less than ``reserved_space`` free on the
file system; a real ENOSPC/EDQUOT while writing is answered the same way. The
file system's free space is asked (statvfs) at most once a second while a write
leaves more than ``_FREE_MARGIN`` (256 MiB) over the reserve, and by every write
nearer to it (``_fs_free``): another process filling the disk within that second
is noticed at the next statvfs or as a real ENOSPC.

File system calls per operation (issue 35; bench/node_write_syscalls.py counts
them): a write opens the copy in its slot once (``_stored``: its size, version
and, for a merge over it, its bytes), a merge reads a small source in one pread,
a delete lists each fan-out directory once per request and opens each copy once.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import os
import struct
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, NamedTuple, Sequence

import xxhash

from ..common.errors import ErrorCode, QuietError, StripefsError
from ..common.layout import MAX_CHUNK_SIZE, replica_part, sibling_part
from ..common.protocol import ChunkId
from ..common.space import filesystem_id

from .chunk_file import FANOUT, FORMAT_VERSION, HEADER, HEADER_CRC, HEADER_SIZE, MAGIC, SUM, Header, encode_header, fanout_dir, file_name
from .chunk_file import chunk_path  # noqa: F401  (tools and tests find it here too)
from .direct_io import DirectWriter

log = logging.getLogger(__name__)

_FIRST_READ = 4096  # header + 504 checksums: the whole table of a 31.5 MiB chunk at 64 KiB blocks
_DIR_NAMES_KEPT = 4096  # fan-out directory names kept by ChunkStore._file (of at most 65,536)
_WHOLE_READ_MAX = 1 << 20  # a read from the start of a file this small takes all of it in one pread
_U64 = (1 << 64) - 1
_U32 = (1 << 32) - 1
_NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_FREE_KEEP_S = 1.0  # a statvfs's free bytes are reused this long by the writes' space check (_fs_free)
_FREE_MARGIN = 256 << 20  # ... while they leave at least this much over the reserve

_xxh3 = xxhash.xxh3_64_intdigest


def _pread(fd: int, n: int, offset: int, file_size: int, nowait: bool) -> bytes | bytearray:
    """``os.pread``; with ``nowait`` only what the page cache holds (BlockingIOError otherwise)."""
    if not nowait:
        return os.pread(fd, n, offset)
    buf = bytearray(n)
    try:
        got = os.preadv(fd, [buf], offset, os.RWF_NOWAIT)
    except OSError as exc:  # EAGAIN: not cached; EOPNOTSUPP: this file system cannot say
        raise BlockingIOError(exc.errno, exc.strerror) from None
    if got < n and offset + got < file_size:
        raise BlockingIOError("only part of the range is in the page cache")
    del buf[got:]
    return buf


class ChunkMeta(NamedTuple):
    version: int
    length: int


class CopyCheck(NamedTuple):
    """A verified copy, as ``ChunkStore.check`` saw it."""

    version: int
    length: int
    digest: int  # xxh3_64 of the data
    written_ns: int  # the chunk file's mtime: when this copy was last written


class _Stored(NamedTuple):
    """The copy a write replaces, read once under the chunk's lock (``ChunkStore._stored``)."""

    fd: int
    size: int
    hdr: Header | None  # None: the copy is corrupt (it has no version; it is replaced whole)
    head: bytes


class Usage(NamedTuple):
    capacity_bytes: int
    free_bytes: int
    used_bytes: int
    chunks: int
    filesystem: str = ""  # which file system capacity and free are of (common/space.py)


def _bad_request(message: str) -> StripefsError:
    return StripefsError(ErrorCode.BAD_REQUEST, message)


def _check_chunk_id(chunk: ChunkId) -> None:
    if not (0 <= chunk.ino <= _U64 and 0 <= chunk.index <= _U64 and 0 <= chunk.part <= _U32):
        raise _bad_request(f"chunk id {chunk} out of range")


class ChunkStore:
    """The chunk files under ``data_dir``; safe to call from several threads."""

    def __init__(
        self,
        data_dir: str | Path,
        *,
        block_size: int = 64 << 10,
        capacity: int = 0,
        reserved_space: int = 64 << 20,
        node_id: int | None = None,
        direct_io: bool = True,
    ):
        if not (512 <= block_size <= MAX_CHUNK_SIZE):
            raise QuietError(f"block_size {block_size} must be between 512 bytes and {MAX_CHUNK_SIZE} bytes")
        self.data_dir = Path(data_dir)
        self.block_size = block_size
        self.capacity = capacity
        self.reserved_space = reserved_space
        self.node_id = node_id
        self._chunks_dir = self.data_dir / "chunks"
        self._dir_names: dict[int, str] = {}  # fan-out directory number -> its path and a "/" (``_file``)
        self._locks: dict[ChunkId, list] = {}  # chunk -> [lock, users]
        self._locks_guard = threading.Lock()
        self._usage_guard = threading.Lock()
        self._unsynced_dirs: set[Path] = set()  # parents of fan-out directories made by non-sync writes (_make_dirs)
        self._free_seen = (float("-inf"), 0, 0)  # (monotonic time, free bytes, self._used) of the last statvfs (_fs_free)
        self._direct = DirectWriter(enabled=direct_io)  # large chunk files bypass the page cache (direct_io.py)
        self._lock_fd = self._lock_data_dir()
        try:
            # chunk data is every user's files: only the node's own user may read it, whatever
            # the umask (files 0600, directories 0700; docs/security.md)
            os.chmod(self.data_dir, 0o700)
            if node_id is not None:
                self._claim(node_id)
            self._chunks_dir.mkdir(mode=0o700, exist_ok=True)
            self._used, self._count = self._scan()
            self._dir_number = FANOUT[self._fanout_scheme()]
            self._move_to_slots()
        except BaseException:
            self.close()
            raise

    # -- lifecycle --------------------------------------------------------

    def _lock_data_dir(self) -> int:
        fd = os.open(self.data_dir / ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise QuietError(f"{self.data_dir} is in use by another storage node") from None
        return fd

    def _claim(self, node_id: int) -> None:
        marker = self.data_dir / "node_id"
        try:
            owner = int(marker.read_text().strip())
        except FileNotFoundError:
            _write_durably(marker, f"{node_id}\n")
            return
        except ValueError:
            raise QuietError(f"{marker} is not a node id; remove it only if you know this disk's history") from None
        if owner != node_id:
            raise QuietError(f"{self.data_dir} belongs to storage node {owner}, not {node_id}")

    def _fanout_scheme(self) -> str:
        """The fan-out scheme of this data directory: as recorded; a new one gets ``by-inode``."""
        marker = self.data_dir / "fanout"
        try:
            scheme = marker.read_text().strip()
        except FileNotFoundError:
            scheme = "hashed" if self._count else "by-inode"  # chunks from before the marker: hashed
            _write_durably(marker, f"{scheme}\n")
            return scheme
        if scheme not in FANOUT:
            raise QuietError(f"{marker} says {scheme!r}; known fan-out schemes: {', '.join(FANOUT)}")
        return scheme

    def _scan(self) -> tuple[int, int]:
        """Sum the chunk files and remove temp files left by a crash."""
        used = count = removed = 0
        for top in os.scandir(self._chunks_dir):
            if not top.is_dir(follow_symlinks=False):
                continue
            for sub in os.scandir(top.path):
                if not sub.is_dir(follow_symlinks=False):
                    continue
                for entry in os.scandir(sub.path):
                    if entry.name.endswith(".tmp"):
                        os.unlink(entry.path)
                        removed += 1
                    elif entry.name.endswith(".chunk"):
                        used += entry.stat(follow_symlinks=False).st_size
                        count += 1
        if removed:
            log.info("removed %d temp files left by an interrupted write in %s", removed, self.data_dir)
        log.info("%s holds %d chunks, %d bytes", self.data_dir, count, used)
        return used, count

    def _move_to_slots(self) -> None:
        """Once per data directory: move replicated copies written before slots to their slot.

        Replicated chunks used to live at part 0 whatever their version; now a version is
        stored in the slot of its parity (common/layout.py "Slots"). A part-0 copy at an odd
        version can only be such an old replica (an EC fragment at part 0 has an even
        version), so it is rewritten as part 32. ``DATA_DIR/slots`` records that it is done."""
        marker = self.data_dir / "slots"
        if marker.exists():
            return
        moved = 0
        if self._count:
            for d in self.existing_dirs():
                for chunk in self.chunks_in_dir(d):
                    if chunk.part != 0:
                        continue
                    try:
                        if not self.stat(chunk).version & 1:
                            continue
                        version, data = self.read(chunk, 0, 0, MAX_CHUNK_SIZE)
                        target = ChunkId(chunk.ino, chunk.index, replica_part(version))
                        self.write(target, version, 0, 0, data, replace=True, if_newer=True, sync=True)
                        self._delete_one(chunk)
                        moved += 1
                    except StripefsError as exc:  # a corrupt copy stays where it is: scrub reports it
                        log.warning("chunk %s: not moved to its slot: %s", chunk, exc)
        _write_durably(marker, "1\n")
        if moved:
            log.info("%s: %d replicated copies moved to the slot of their version", self.data_dir, moved)

    def close(self) -> None:
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = -1

    def __enter__(self) -> ChunkStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- paths and locks ----------------------------------------------------

    def _dir(self, ino: int, index: int) -> Path:
        return fanout_dir(self._chunks_dir, self._dir_number(ino, index))

    def path(self, chunk: ChunkId) -> Path:
        """The file holding ``chunk`` (tests corrupt it on purpose)."""
        return Path(self._file(chunk))

    def _file(self, chunk: ChunkId) -> str:
        """``path(chunk)`` as a string, its directory's string kept: the reads' hot path (pathlib's
        three joins cost ~7 us of a storage node's ~50 us for a small read from the page cache)."""
        d = self._dir_number(chunk.ino, chunk.index)
        prefix = self._dir_names.get(d)
        if prefix is None:
            if len(self._dir_names) >= _DIR_NAMES_KEPT:
                self._dir_names.clear()
            prefix = self._dir_names[d] = f"{fanout_dir(self._chunks_dir, d)}/"
        return prefix + file_name(chunk)

    @contextmanager
    def _chunk_lock(self, chunk: ChunkId, wait: bool = True) -> Iterator[None]:
        """The chunk's write lock; ``wait=False``: BlockingIOError when another thread holds it (the
        fast lane's caller then hands the request to a worker thread, which may wait)."""
        with self._locks_guard:
            slot = self._locks.setdefault(chunk, [threading.Lock(), 0])
            slot[1] += 1
        try:
            if not slot[0].acquire(blocking=wait):
                raise BlockingIOError(f"chunk {chunk} is being written by another thread")
            try:
                yield
            finally:
                slot[0].release()
        finally:
            with self._locks_guard:
                slot[1] -= 1
                if not slot[1]:
                    del self._locks[chunk]

    def busy(self, chunks: Sequence[ChunkId]) -> bool:
        """Whether a thread is writing or deleting a copy of any of ``chunks``' (ino, index) right now
        (any part): a delete that would wait for it is left to a worker thread (service.py)."""
        wanted = {(c.ino, c.index) for c in chunks}
        with self._locks_guard:
            return any((c.ino, c.index) in wanted for c in self._locks)

    # -- reading --------------------------------------------------------------

    def _corrupt(self, chunk: ChunkId, what: str) -> StripefsError:
        log.warning("chunk %s is corrupt: %s (%s)", chunk, what, self.path(chunk))
        return StripefsError(ErrorCode.CORRUPT, f"chunk {chunk}: {what}")

    def _read_header(
        self, fd: int, chunk: ChunkId, nowait: bool = False, *, whole: bool = False, size: int = -1
    ) -> tuple[Header, bytes]:
        """The verified header of an open chunk file, and the bytes read so far (``whole``: all of
        a small file, so that reading a small chunk from its start costs one pread, not two).
        ``size``: the file's size when the caller has it already (its fstat), else -1."""
        if size < 0:
            size = os.fstat(fd).st_size
        head = _pread(fd, size if whole and size <= _WHOLE_READ_MAX else _FIRST_READ, 0, size, nowait)
        if len(head) < HEADER_SIZE:
            raise self._corrupt(chunk, f"file of {size} bytes is shorter than a header")
        magic, fmt, _flags, block_size, version, length, ino, index, part, _ = HEADER.unpack_from(head)
        if magic != MAGIC:
            raise self._corrupt(chunk, f"bad magic {magic!r}")
        if fmt != FORMAT_VERSION:
            raise self._corrupt(chunk, f"unknown format version {fmt}")
        if not (0 < block_size and length <= MAX_CHUNK_SIZE):
            raise self._corrupt(chunk, f"impossible block size {block_size} or length {length}")
        nblocks = -(-length // block_size)
        data_start = HEADER_SIZE + SUM * nblocks
        if size != data_start + length:
            raise self._corrupt(chunk, f"file is {size} bytes, header says {data_start + length}")
        if len(head) < data_start:
            head += _pread(fd, data_start - len(head), len(head), size, nowait)
        table = memoryview(head)[HEADER_SIZE:data_start]
        digest = xxhash.xxh3_64(memoryview(head)[: HEADER.size])
        digest.update(table)
        if digest.intdigest() != HEADER_CRC.unpack_from(head, HEADER.size)[0]:
            raise self._corrupt(chunk, "header checksum mismatch")
        if ChunkId(ino, index, part) != chunk:
            raise self._corrupt(chunk, f"file holds chunk {ino}:{index}:{part}")
        sums = struct.unpack(f"<{nblocks}Q", table)
        return Header(version, length, block_size, sums, data_start), head

    def _read_blocks(
        self, fd: int, chunk: ChunkId, hdr: Header, head: bytes, start: int, end: int, nowait: bool = False
    ) -> tuple[bytes | memoryview, int]:
        """Verified data of the blocks covering [start, end); returns (bytes, offset of its first byte)."""
        bs = hdr.block_size
        first, last = start // bs, (end - 1) // bs
        span_start, span_end = first * bs, min((last + 1) * bs, hdr.length)
        if hdr.data_start + span_end <= len(head):  # small chunk: already read with the header
            # a view, not a copy: a copy of a small file's bytes (and the fresh pages it faults in)
            # was ~8% of a storage node's CPU in a cold prefetch epoch (perf, issue 29)
            span = memoryview(head)[hdr.data_start + span_start : hdr.data_start + span_end]
        else:
            file_size = hdr.data_start + hdr.length
            span = _pread(fd, span_end - span_start, hdr.data_start + span_start, file_size, nowait)
        if len(span) != span_end - span_start:
            raise self._corrupt(chunk, "short read")
        view = memoryview(span)
        for block in range(first, last + 1):
            pos = (block - first) * bs
            if _xxh3(view[pos : pos + bs]) != hdr.sums[block]:
                raise self._corrupt(chunk, f"block {block} (bytes {block * bs}..) failed its checksum")
        return span, span_start

    def read(
        self,
        chunk: ChunkId,
        min_version: int,
        offset: int,
        length: int,
        *,
        nowait: bool = False,
        max_bytes: int | None = None,
    ) -> tuple[int, bytes | bytearray | memoryview]:
        """``(version, data)`` for ``length`` bytes at ``offset``; short or empty past the stored length.
        ``data`` is a bytes-like object (a view into the file's read buffer for a small chunk: no copy).

        NOT_FOUND: no copy. STALE: the copy is older than ``min_version``.
        CORRUPT: the header or a block in the range failed its checksum.
        ``nowait``: only from the page cache (preadv RWF_NOWAIT); BlockingIOError
        when the disk would be needed. ``max_bytes``: BlockingIOError when the
        range holds more (known only once the header is read; a caller asks for a
        whole chunk by its layout's chunk size). Either way the caller can retry
        in a worker thread.
        """
        _check_chunk_id(chunk)
        if offset < 0 or length < 0 or length > MAX_CHUNK_SIZE:
            raise _bad_request(f"read of chunk {chunk}: bad range offset={offset} length={length}")
        with self._open(chunk) as fd:
            hdr, head = self._read_header(fd, chunk, nowait, whole=offset == 0)
            if hdr.version < min_version:
                raise StripefsError(ErrorCode.STALE, f"chunk {chunk} is version {hdr.version} < {min_version}")
            end = min(offset + length, hdr.length)
            if end <= offset:
                return hdr.version, b""
            if max_bytes is not None and end - offset > max_bytes:
                raise BlockingIOError("a large read: for a worker thread")
            span, span_start = self._read_blocks(fd, chunk, hdr, head, offset, end, nowait)
        if span_start == offset and len(span) == end - offset:
            return hdr.version, span  # block-aligned: no copy
        return hdr.version, span[offset - span_start : end - span_start]

    @contextmanager
    def _open(self, chunk: ChunkId) -> Iterator[int]:
        try:
            fd = os.open(self._file(chunk), os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise StripefsError(ErrorCode.NOT_FOUND, f"no copy of chunk {chunk}") from None
        except OSError as exc:
            raise self._io_error(chunk, "open", exc) from None
        try:
            yield fd
        except BlockingIOError:
            raise  # a nowait read that needs the disk: not an error
        except OSError as exc:
            raise self._io_error(chunk, "read", exc) from None
        finally:
            os.close(fd)

    def _io_error(self, chunk: ChunkId, what: str, exc: OSError) -> StripefsError:
        log.error("chunk %s: %s failed: %s", chunk, what, exc)
        return StripefsError(ErrorCode.IO, f"chunk {chunk}: {what} failed: {exc.strerror}")

    def stat(self, chunk: ChunkId) -> ChunkMeta:
        """Version and length of the stored copy (header verified). NOT_FOUND, CORRUPT."""
        _check_chunk_id(chunk)
        with self._open(chunk) as fd:
            hdr, _ = self._read_header(fd, chunk)
        return ChunkMeta(hdr.version, hdr.length)

    # -- writing --------------------------------------------------------------

    def write(
        self,
        chunk: ChunkId,
        version: int,
        base_version: int,
        offset: int,
        data: bytes | bytearray | memoryview,
        *,
        replace: bool = False,
        truncate: int = -1,
        sync: bool = False,
        if_newer: bool = False,
        max_bytes: int | None = None,
        wait: bool = True,
    ) -> ChunkMeta:
        """Apply one WriteChunkReq (see its docstring); returns the stored (version, length).

        ``if_newer`` (with ``replace``; a repair copy): keep a stored copy that is
        at least ``version`` and return it instead; checked under the chunk's lock,
        so a writer's newer copy is never overwritten by an older one.

        For a caller that must not wait (the fast lane, service.py): ``max_bytes``: BlockingIOError,
        before anything is written, when the new content would be larger (known for a merge once
        the old copy's header is read); ``wait=False``: BlockingIOError when another thread holds
        the chunk's lock. Either way the caller retries in a worker thread.
        """
        _check_chunk_id(chunk)
        data = memoryview(data)
        if data.format != "B" or data.ndim != 1:
            data = data.cast("B")
        if not 0 <= version <= _U64:
            raise _bad_request(f"write of chunk {chunk}: version {version} out of range")
        if offset < 0 or offset + len(data) > MAX_CHUNK_SIZE:
            raise _bad_request(f"write of chunk {chunk}: range {offset}+{len(data)} outside 0..{MAX_CHUNK_SIZE}")
        if replace and offset != 0:
            raise _bad_request(f"write of chunk {chunk}: replace at offset {offset}, must be 0")
        if truncate < -1 or truncate > MAX_CHUNK_SIZE:
            raise _bad_request(f"write of chunk {chunk}: truncate {truncate} outside -1..{MAX_CHUNK_SIZE}")
        if max_bytes is not None and max(offset + len(data), truncate) > max_bytes:
            raise BlockingIOError("a large write: for a worker thread")
        path = self._file(chunk)
        with self._chunk_lock(chunk, wait):
            stored = self._stored(chunk, path)
            try:
                old_size = stored.size if stored else -1
                if replace:
                    old_version = stored.hdr.version if stored and stored.hdr else 0
                    if if_newer and stored and old_version >= version:
                        return ChunkMeta(stored.hdr.version, stored.hdr.length) if stored.hdr else self.stat(chunk)
                    content: memoryview | bytearray = data
                else:
                    old_version, content = self._merge(chunk, version, base_version, offset, data, truncate, stored, max_bytes)
            finally:
                if stored:
                    os.close(stored.fd)
            if truncate >= 0 and len(content) != truncate:
                if len(content) > truncate:
                    content = content[:truncate]
                else:
                    content = bytearray(content)
                    content.extend(bytes(truncate - len(content)))
            new_version = max(old_version, version)
            header = encode_header(chunk, new_version, memoryview(content), self.block_size)
            new_size = len(header) + len(content)
            self._check_space(chunk, max(old_size, 0), new_size)
            self._replace_file(chunk, path, (header, content), sync, old_size >= 0)
            with self._usage_guard:
                self._used += new_size - max(old_size, 0)
                self._count += old_size < 0
        log.debug("chunk %s: wrote %d bytes at %d, now version %d length %d", chunk, len(data), offset, new_version, len(content))
        return ChunkMeta(new_version, len(content))

    def _stored(self, chunk: ChunkId, path: str) -> _Stored | None:
        """The copy a write replaces, opened and its header read once (None: no copy): its size for
        the space accounting, its version for the copy-on-write rules and, for a merge over it, its
        bytes. Three file system calls where a stat, a second open and a second header read were
        (issue 35, the node's write path). A corrupt copy has no version (``hdr`` None): it is
        replaced whole, as before."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise self._io_error(chunk, "open", exc) from None
        try:
            size = os.fstat(fd).st_size
            try:
                hdr, head = self._read_header(fd, chunk, size=size)
            except StripefsError as exc:
                if exc.code != ErrorCode.CORRUPT:
                    raise
                hdr, head = None, b""
            return _Stored(fd, size, hdr, head)
        except BaseException as exc:
            os.close(fd)
            if isinstance(exc, OSError) and not isinstance(exc, BlockingIOError):
                raise self._io_error(chunk, "read", exc) from None
            raise

    def _merge(
        self, chunk: ChunkId, version: int, base_version: int, offset: int, data: memoryview, truncate: int,
        stored: _Stored | None, max_bytes: int | None = None,
    ) -> tuple[int, memoryview | bytearray]:
        """The version the write builds on and the merged content of a partial write.

        Copy-on-write (common/layout.py "Slots"): the bytes under the range come from this
        slot's copy only when it already holds this write's version or newer (an earlier range
        of the same session) or exactly ``base_version`` (a writer that does not use slots);
        otherwise from the other slot, which holds the committed version the writer named.
        A copy in this slot of any other version is a failed or abandoned session's (or an old
        version's, garbage not collected yet): its bytes are never merged, it is replaced whole.
        ``stored``: this slot's copy as ``write`` read it (``_stored``), used as it is.
        """
        source = chunk if stored else None
        if stored:
            version_here = stored.hdr.version if stored.hdr else 0
            if not (version_here >= version or (base_version and version_here == base_version)):
                source = None
        if source is None and base_version > 0:
            sibling = sibling_part(chunk.part)
            if sibling >= 0:
                source = ChunkId(chunk.ino, chunk.index, sibling)
            else:
                raise StripefsError(ErrorCode.STALE, f"no copy of chunk {chunk} at version {base_version} to write over")
        if source is None:  # no committed data under this write: a hole before it
            if offset == 0:
                return 0, data
            content = bytearray(offset)
            content += data
            return 0, content
        end = offset + len(data)
        try:
            if source == chunk and stored.hdr is not None:
                try:
                    old = self._old_bytes(stored.fd, source, stored.hdr, stored.head, base_version, offset, end, truncate, max_bytes)
                except BlockingIOError:
                    raise
                except OSError as exc:
                    raise self._io_error(chunk, "read", exc) from None
            else:
                with self._open(source) as fd:
                    # the whole file in one pread when its old bytes are likely wanted: a write
                    # that starts at 0 and covers what it keeps (a replacing write) needs none
                    whole = offset > 0 or truncate < 0 or end < truncate
                    hdr, head = self._read_header(fd, source, whole=whole)
                    old = self._old_bytes(fd, source, hdr, head, base_version, offset, end, truncate, max_bytes)
        except StripefsError as exc:
            if exc.code != ErrorCode.NOT_FOUND:
                raise
            raise StripefsError(ErrorCode.STALE, f"no copy of chunk {chunk} at version {base_version} to write over") from None
        base = old[0] if source == chunk else 0  # a copy from the other slot keeps its own version
        if old[1] is None:  # the old bytes that survive are all overwritten
            return base, data
        content = bytearray(old[1])
        if len(content) < offset:
            content.extend(bytes(offset - len(content)))
        content[offset:end] = data
        return base, content

    def _old_bytes(
        self, fd: int, source: ChunkId, hdr: Header, head: bytes, base_version: int, offset: int, end: int,
        truncate: int, max_bytes: int | None,
    ) -> tuple[int, bytes | memoryview | None]:
        """A merge's source copy's version and the old bytes it keeps (None: the write covers them all)."""
        if hdr.version < base_version:
            raise StripefsError(ErrorCode.STALE, f"chunk {source} is version {hdr.version} < base {base_version}")
        keep = hdr.length if truncate < 0 else min(hdr.length, truncate)
        if offset == 0 and end >= keep:
            return hdr.version, None
        if max_bytes is not None and keep > max_bytes:
            raise BlockingIOError("a merge into a large chunk: for a worker thread")
        old: bytes | memoryview = b""
        if hdr.length:
            old, _ = self._read_blocks(fd, source, hdr, head, 0, hdr.length)
        return hdr.version, old

    def _check_space(self, chunk: ChunkId, old_size: int, new_size: int) -> None:
        if self.capacity and self._used - old_size + new_size > self.capacity:
            raise StripefsError(
                ErrorCode.NO_SPACE, f"chunk {chunk}: {new_size} bytes would exceed the capacity of {self.capacity}"
            )
        free = self._fs_free(new_size)
        if free - new_size < self.reserved_space:  # the temp file exists beside the old copy
            raise StripefsError(
                ErrorCode.NO_SPACE,
                f"chunk {chunk}: {new_size} bytes would leave less than the reserved {self.reserved_space} free",
            )

    def _fs_free(self, new_size: int = 0) -> int:
        """The file system's free bytes for a write's space check. A statvfs was one of a write's
        ~10 file system calls (issue 35), so its answer is kept for ``_FREE_KEEP_S`` less what this
        store has grown since; asked again when older, or when the estimate leaves less than
        ``_FREE_MARGIN`` over the reserve after the write (near the reserve every write asks)."""
        now = time.monotonic()
        with self._usage_guard:
            taken, free_then, used_then = self._free_seen
            grown = self._used - used_then
        estimate = free_then - max(grown, 0)
        if now - taken < _FREE_KEEP_S and estimate - new_size >= self.reserved_space + _FREE_MARGIN:
            return estimate
        st = os.statvfs(self._chunks_dir)
        free = st.f_bavail * st.f_frsize
        with self._usage_guard:
            self._free_seen = (now, free, self._used)
        return free

    def _replace_file(
        self, chunk: ChunkId, path: str, parts: Sequence[bytes | bytearray | memoryview], sync: bool, replacing: bool
    ) -> None:
        """Write ``path`` (a string: ``_file``) as a new file put in the old one's place (``_swap_in``;
        ``replacing``: a copy is there)."""
        tmp = path + ".tmp"
        try:
            fd = self._write_new(tmp, parts, sync)
            try:
                if sync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            _swap_in(tmp, path, replacing)
            if sync:
                _fsync_dir(os.path.dirname(path))
        except OSError as exc:
            _unlink_quietly(tmp)
            if exc.errno in _NO_SPACE_ERRNOS:
                log.warning("chunk %s: disk full while writing: %s", chunk, exc)
                raise StripefsError(ErrorCode.NO_SPACE, f"chunk {chunk}: {exc.strerror}") from None
            raise self._io_error(chunk, "write", exc) from None
        except BaseException:
            _unlink_quietly(tmp)
            raise

    def _write_new(self, tmp: str, parts: Sequence[bytes | bytearray | memoryview], sync: bool) -> int:
        """Create ``tmp`` holding ``parts``; its open fd. Large files with O_DIRECT (direct_io.py)."""
        for attempt in range(2):
            try:
                if self._direct.wants(sum(len(p) for p in parts)):
                    fd = self._direct.write_file(tmp, parts)
                    if fd is not None:
                        return fd
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            except FileNotFoundError:
                if attempt:
                    raise
                self._make_dirs(Path(tmp).parent, sync)
                continue
            try:
                _write_all(fd, parts)
            except BaseException:
                os.close(fd)
                raise
            return fd
        raise AssertionError("unreachable")

    def _make_dirs(self, directory: Path, sync: bool) -> None:
        """Create a fan-out directory (65,792 at most). Its entry in its parent is fsynced now for a
        ``sync`` write, else by the next ``sync``: an fsync is a journal commit, and with the
        ``hashed`` fan-out a young node made one or two directories for almost every chunk."""
        for d in (directory.parent, directory):
            try:
                d.mkdir(mode=0o700)
            except FileExistsError:
                continue
            if sync:
                _fsync_dir(d.parent)
            else:
                with self._usage_guard:
                    self._unsynced_dirs.add(d.parent)

    def sync(self, chunks: Sequence[ChunkId]) -> int:
        """fsync chunk files written earlier without ``sync``, and their directories (the
        rename must be durable too). Chunks not held are skipped; returns how many were synced."""
        synced = 0
        directories: set[Path] = set()
        for chunk in chunks:
            _check_chunk_id(chunk)
            path = self.path(chunk)
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                continue
            try:
                os.fsync(fd)
            except OSError as exc:
                raise self._io_error(chunk, "fsync", exc) from None
            finally:
                os.close(fd)
            directories.add(path.parent)
            synced += 1
        if synced:
            with self._usage_guard:
                parents, self._unsynced_dirs = self._unsynced_dirs, set()
            directories |= parents  # fan-out directories created since: their entries too
        try:
            for directory in directories:
                _fsync_dir(directory)
        except BaseException:
            if synced:
                with self._usage_guard:
                    self._unsynced_dirs |= parents  # the next sync tries them again
            raise
        return synced

    def sync_batch(self, chunks: Sequence[ChunkId]) -> None:
        """Make ``chunks``, written just now without ``sync``, durable together (a WriteChunksReq).

        One ``syncfs`` of the data file system commits every file's data and every
        rename (and the fan-out directories made since) in one journal commit, where
        an fsync per file is one each: 0.6-1.7 ms a file against 2.2-9.0 ms
        (bench/node_sync.py). It also flushes whatever else is dirty on that file
        system, which a node's own disk does not have. Without syncfs (not Linux,
        or a libc without it): ``sync`` of each chunk."""
        if not chunks:
            return
        with self._usage_guard:
            parents, self._unsynced_dirs = self._unsynced_dirs, set()
        try:
            if _syncfs(self._chunks_dir):
                return
        except OSError as exc:
            with self._usage_guard:
                self._unsynced_dirs |= parents
            raise self._io_error(chunks[0], f"syncfs of the batch of {len(chunks)}", exc) from None
        with self._usage_guard:
            self._unsynced_dirs |= parents  # sync() below takes them
        self.sync(chunks)

    # -- deleting and accounting ----------------------------------------------

    def delete(self, chunks: Sequence[ChunkId], all_parts: bool = True, max_versions: Sequence[int] = ()) -> int:
        """Remove copies (every part of each ``(ino, index)`` when ``all_parts``); returns how many.

        With ``max_versions`` (one per chunk), a copy newer than its bound is kept.
        """
        for chunk in chunks:
            _check_chunk_id(chunk)
        parts_of: dict[str, list[int]] = {}  # "INO-INDEX-" -> the parts stored (all_parts)
        if all_parts:
            wanted: dict[str, set[str]] = {}  # a fan-out directory -> the prefixes asked in it
            for chunk in chunks:
                wanted.setdefault(os.path.dirname(self._file(chunk)), set()).add(f"{chunk.ino}-{chunk.index}-")
            for directory, prefixes in wanted.items():
                parts_of.update(_parts_in(directory, prefixes))
        deleted = 0
        for i, chunk in enumerate(chunks):
            bound = max_versions[i] if max_versions else None
            if all_parts:
                parts = parts_of.get(f"{chunk.ino}-{chunk.index}-", ())
                targets = [ChunkId(chunk.ino, chunk.index, part) for part in parts]
            else:
                targets = [chunk]
            for target in targets:
                deleted += self._delete_one(target, bound)
        return deleted

    def _delete_one(self, chunk: ChunkId, bound: int | None = None) -> int:
        """Remove one copy, unless ``bound`` is given and the copy is newer. The copy is opened
        once: its size (for the accounting) and, with a bound, its version from that one open
        (a stat, an open and a header read each were, issue 35)."""
        path = self._file(chunk)
        with self._chunk_lock(chunk):
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                return 0
            except OSError as exc:
                raise self._io_error(chunk, "delete", exc) from None
            try:
                size = os.fstat(fd).st_size
                if bound is not None:
                    try:
                        version = self._read_header(fd, chunk, size=size)[0].version
                    except StripefsError as exc:
                        if exc.code != ErrorCode.CORRUPT:
                            raise
                        version = 0  # a corrupt copy is garbage whatever its version
                    if version > bound:
                        log.info("chunk %s: kept v%d, newer than the delete's bound v%d", chunk, version, bound)
                        return 0
                os.unlink(path)
            except FileNotFoundError:
                return 0
            except OSError as exc:
                raise self._io_error(chunk, "delete", exc) from None
            finally:
                os.close(fd)
            with self._usage_guard:
                self._used -= size
                self._count -= 1
        log.debug("chunk %s deleted", chunk)
        return 1

    # -- inventory and verification (scrub, fsck: storage_node/healing.py) ----

    FANOUT_DIRS = 1 << 16

    def existing_dirs(self) -> list[int]:
        """Numbers of the fan-out directories that exist, in order (most are absent on a young node)."""
        out = []
        with os.scandir(self._chunks_dir) as tops:
            for top in tops:
                if len(top.name) != 2 or not top.is_dir(follow_symlinks=False):
                    continue
                with os.scandir(top.path) as subs:
                    for sub in subs:
                        if len(sub.name) == 2 and sub.is_dir(follow_symlinks=False):
                            try:
                                out.append(int(top.name, 16) | int(sub.name, 16) << 8)
                            except ValueError:
                                continue
        return sorted(out)

    def chunks_in_dir(self, d: int) -> list[ChunkId]:
        """Copies in fan-out directory number ``d`` (``chunks/{d & 0xFF:02x}/{d >> 8:02x}``)."""
        directory = fanout_dir(self._chunks_dir, d)
        try:
            names = os.listdir(directory)
        except FileNotFoundError:
            return []
        out = []
        for name in names:
            if not name.endswith(".chunk"):
                continue
            try:
                ino, index, part = (int(x) for x in name[: -len(".chunk")].split("-"))
            except ValueError:
                continue
            out.append(ChunkId(ino, index, part))
        return sorted(out, key=lambda c: (c.ino, c.index, c.part))

    def verify(self, chunk: ChunkId, min_version: int = 0) -> int:
        """Read and check every block of a copy; its data length. NOT_FOUND, STALE, CORRUPT."""
        return self.check(chunk, min_version).length

    def check(self, chunk: ChunkId, min_version: int = 0) -> CopyCheck:
        """``verify``, and what the daemon's scrub compares across replicas: the copy's version,
        an xxh3 of its data (independent of the block size, which may differ between nodes)
        and when it was written."""
        _check_chunk_id(chunk)
        digest = xxhash.xxh3_64()
        with self._open(chunk) as fd:
            hdr, head = self._read_header(fd, chunk)
            if hdr.version < min_version:
                raise StripefsError(ErrorCode.STALE, f"chunk {chunk} is version {hdr.version} < {min_version}")
            step = max(hdr.block_size, (4 << 20) // hdr.block_size * hdr.block_size)  # a few MiB per read
            for start in range(0, hdr.length, step):
                span, _ = self._read_blocks(fd, chunk, hdr, head, start, min(start + step, hdr.length))
                digest.update(span)
            written_ns = os.fstat(fd).st_mtime_ns
        return CopyCheck(hdr.version, hdr.length, digest.intdigest(), written_ns)

    def usage(self) -> Usage:
        """What the node offers: capacity, free (what it will still accept), used (chunk files), chunks."""
        st = os.statvfs(self._chunks_dir)
        fs_free = max(0, st.f_bavail * st.f_frsize - self.reserved_space)
        with self._usage_guard:
            used, count = self._used, self._count
        if self.capacity:  # a slice of the disk: this node's alone
            fs = filesystem_id(self._chunks_dir, own=f"node-{self.node_id}")
            return Usage(self.capacity, max(0, min(self.capacity - used, fs_free)), used, count, fs)
        return Usage(st.f_blocks * st.f_frsize, fs_free, used, count, filesystem_id(self._chunks_dir))


def _parts_in(directory: str, prefixes: set[str]) -> dict[str, list[int]]:
    """The parts stored in a fan-out directory of the chunks named by ``prefixes`` ("INO-INDEX-"),
    by prefix: the directory listed once for a whole DeleteChunksReq (issue 35; it was listed and
    every name matched once per chunk, and by-inode fan-out puts up to 4,096 chunks of a file, two
    slots each, in one directory: a truncate's request of 64 chunks matched 64 x 8,192 names)."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return {}
    out: dict[str, list[int]] = {}
    for name in names:
        cut = name.rfind("-") + 1
        if cut and name[:cut] in prefixes and name.endswith(".chunk") and name[cut:-6].isdigit():
            out.setdefault(name[:cut], []).append(int(name[cut:-6]))
    return out


def _write_all(fd: int, parts: Sequence[bytes | bytearray | memoryview]) -> None:
    """writev until every byte is written (one system call in the usual case)."""
    views = [memoryview(p) for p in parts if len(p)]
    while views:
        n = os.writev(fd, views)
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]


def _write_durably(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600), "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _libc(name: str, argtypes: list):
    """libc's function ``name`` through ctypes (errno kept for ctypes.get_errno), or False where libc has none:
    the system calls Python 3.11's os module lacks (syncfs, renameat2), each looked up once."""
    try:
        fn = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return False
    fn.argtypes = argtypes
    return fn


_libc_syncfs = None  # ctypes' syncfs(2) of libc, looked up once; False where there is none


def _syncfs(directory: Path) -> bool:
    """syncfs(2) of the file system holding ``directory`` (os.syncfs is not in Python 3.11);
    False where libc has none. Raises OSError on a writeback error (Linux >= 5.8 reports them)."""
    global _libc_syncfs
    if _libc_syncfs is None:
        _libc_syncfs = _libc("syncfs", [ctypes.c_int])
    if _libc_syncfs is False:
        return False
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        if _libc_syncfs(fd) != 0:
            err = ctypes.get_errno()
            if err == errno.ENOSYS:
                _libc_syncfs = False
                return False
            raise OSError(err, os.strerror(err))
    finally:
        os.close(fd)
    return True


_RENAME_EXCHANGE = 2  # renameat2(2): swap the two names atomically
_AT_FDCWD = -100
_libc_renameat2 = None  # ctypes' renameat2(2) of libc, looked up once; False where there is none or it is refused


def _swap_in(tmp: str, path: str, replacing: bool) -> None:
    """Put the new copy ``tmp`` under ``path`` atomically, as rename(2) would, without renaming over the old copy.

    ext4 (its default ``auto_da_alloc``) starts a file's writeback inside a rename(2) that replaces
    another file (fs/ext4/namei.c ``ext4_rename``: ``ext4_alloc_da_blocks``): measured here, 160-170 us of
    the node's CPU per 16 KiB copy instead of 60-90, and a disk write of every version, most of which the
    next write replaces within seconds. renameat2's RENAME_EXCHANGE swaps the two names instead (no such
    flush), then the old copy, now under ``tmp``, is unlinked. Kill -9 between the two leaves the new copy
    under ``path`` and the old one under ``tmp``, which the startup scan removes. A copy written without
    ``sync`` is not durable before a ``sync`` anyway (it fsyncs the file, then its name counts); after
    a power loss before that, ext4's flush made it old-or-new, the exchange may leave it empty: a CORRUPT
    copy (its header), repaired like any other, where the old one was STALE. File systems without the
    flag (EINVAL) get rename(2) from then on, as does a ``path`` with no copy (nothing to flush for); any
    other failure of the exchange is retried as a rename, whose error (if it fails too) is the one reported."""
    global _libc_renameat2
    if replacing and _libc_renameat2 is None:
        _libc_renameat2 = _libc("renameat2", [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint])
    if replacing and _libc_renameat2 is not False:
        if _libc_renameat2(_AT_FDCWD, tmp.encode(), _AT_FDCWD, path.encode(), _RENAME_EXCHANGE) == 0:
            _unlink_quietly(tmp)
            return
        err = ctypes.get_errno()
        if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EXDEV):  # EXDEV: an overlayfs lower layer
            log.info("renameat2(RENAME_EXCHANGE) refused (%s): chunk copies are renamed over the old ones", os.strerror(err))
            _libc_renameat2 = False
    os.rename(tmp, path)  # no copy there, or the exchange failed (ENOENT: the copy went meanwhile): rename(2), its error if any


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _unlink_quietly(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:  # the startup scan removes it later
        log.warning("could not remove temp file %s: %s", path, exc)
