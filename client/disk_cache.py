"""The optional local disk cache of chunk data (for an NVMe on the GPU node).

Below the memory cache (client/chunk_cache.py): a chunk missing from memory is
looked for here before the network, and every chunk fetched from the network
is written here in the background. It survives a remount.

Layout: ``DIR/CLUSTER_ID/XX/INO.INDEX.VERSION``, ``XX`` = ino % 256 in hex.
``CLUSTER_ID`` (from the metadata daemon's hello) keeps two clusters, or a
re-created one whose inode numbers start over, from ever sharing entries.

Correctness rests on the key: a chunk's version is the epoch of the write
session that wrote it, never reused, so a file changed elsewhere has new
versions and its old entries can never be returned; they just age out.

File format (little-endian)::

    0   8  magic b"SFSDC01\\0"
    8   8  ino      16  8  index     24  8  version
    32  8  length L of the data      40  4  block size B
    44  4  0 (reserved)
    48  8  xxh3_64 of bytes 0..47 followed by the checksum table
    56  8*N  xxh3_64 of each block of B bytes, N = ceil(L / B)
    ... the data

An entry that fails any check is deleted and treated as a miss (logged). New
entries are written to a temporary name and renamed, so a crash leaves no torn
entry.

Whole files (for FUSE passthrough, client/passthrough.py): the kernel reads a
backing file from offset 0 as the file's bytes, so a chunk entry (header first)
cannot be one. A whole-file entry holds exactly one version of one file, no
header: ``DIR/CLUSTER_ID/XX/INO.w.SIZE.MAP.SUM``, where ``MAP`` (hex) is
:func:`content_key`'s digest of the file's chunk map (every chunk's index,
version and data inode: versions are never reused, so another version of the
file has another name) and ``SUM`` (hex) the xxh3_64 of the bytes, checked
before the kernel is given the file (:meth:`DiskCache.open_whole`): a short or
damaged file is dropped and logged, and the open is answered the normal way.
Whole entries share the cache's index, LRU order and capacity with chunk
entries; writing one drops the file's other versions. Size: at most ``capacity`` bytes, and writes stop while the file system
has less than ``min_free`` free; the least recently used entries go first (the
order at start-up is the files' modification times).
"""

from __future__ import annotations

import logging
import os
import struct
import threading
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import trio
import xxhash

log = logging.getLogger(__name__)

Key = tuple[int, int, int]  # (ino, index, version)


@dataclass(frozen=True)
class WholeKey:
    """One version of one file in its whole-file form (never equal to a chunk entry's tuple key)."""

    ino: int
    size: int
    digest: int  # content_key's digest of the chunk map


def content_key(ino: int, size: int, chunks) -> WholeKey:
    """The whole-file key of the version of file ``ino`` whose committed chunk map is ``chunks``
    (index -> protocol.ChunkRef, or a list of them) and whose size is ``size``."""
    refs = chunks.values() if isinstance(chunks, dict) else chunks
    h = xxhash.xxh3_64()
    for ref in sorted(refs, key=lambda r: r.index):
        h.update(_MAP_ITEM.pack(ref.index, ref.version, ref.data_ino))
    return WholeKey(ino, size, h.intdigest())

MAGIC = b"SFSDC01\0"
BLOCK = 64 << 10
_HEAD = struct.Struct("<8sQQQQII")
_CRC = struct.Struct("<Q")
_MAP_ITEM = struct.Struct("<QQQ")
#: a whole file is read and checked in pieces of this size
_VERIFY_PIECE = 1 << 20
_xxh3 = xxhash.xxh3_64_intdigest


def encode(key: Key, data: bytes | memoryview) -> list[bytes | memoryview]:
    """The pieces of an entry file for ``data``."""
    view = memoryview(data)
    sums = [_xxh3(view[i : i + BLOCK]) for i in range(0, len(view), BLOCK)]
    head = _HEAD.pack(MAGIC, *key, len(view), BLOCK, 0)
    table = struct.pack(f"<{len(sums)}Q", *sums)
    return [head, _CRC.pack(_xxh3(head + table)), table, view]


def decode(key: Key, raw: bytes) -> memoryview:
    """The data of an entry file; ValueError saying what is wrong."""
    view = memoryview(raw)
    if len(view) < _HEAD.size + _CRC.size:
        raise ValueError("truncated header")
    magic, ino, index, version, length, block, _ = _HEAD.unpack_from(view)
    if magic != MAGIC:
        raise ValueError("not a stripefs disk-cache entry")
    if (ino, index, version) != key:
        raise ValueError(f"holds {(ino, index, version)}, not {key}")
    nblocks = -(-length // block) if block else -1
    if nblocks < 0:
        raise ValueError("bad block size")
    table_at = _HEAD.size + _CRC.size
    data_at = table_at + 8 * nblocks
    if len(view) != data_at + length:
        raise ValueError(f"{len(view)} bytes, expected {data_at + length}")
    table = view[table_at:data_at]
    if _xxh3(bytes(view[: _HEAD.size]) + bytes(table)) != _CRC.unpack_from(view, _HEAD.size)[0]:
        raise ValueError("header checksum mismatch")
    sums = struct.unpack(f"<{nblocks}Q", table)
    data = view[data_at:]
    for i, expected in enumerate(sums):
        if _xxh3(data[i * block : (i + 1) * block]) != expected:
            raise ValueError(f"block {i} checksum mismatch")
    return data


class DiskCache:
    def __init__(self, directory: str | Path, cluster_id: str, *, capacity: int, min_free: int):
        if not cluster_id:
            raise ValueError("the metadata daemon sent no cluster id; the disk cache needs one")
        self.root = Path(directory) / cluster_id
        self.capacity = capacity
        self.min_free = min_free
        self.used = 0
        self._entries: OrderedDict[Key | WholeKey, int] = OrderedDict()  # key -> file size, least recent first
        self._lock = threading.Lock()  # the index is used from worker threads
        self._writing: set[Key | WholeKey] = set()
        self._sums: dict[WholeKey, int] = {}  # whole entries: key -> xxh3_64 of the bytes (in the name)
        self._whole_of: dict[int, set[WholeKey]] = {}  # ino -> its whole entries
        #: called (from any thread) with a whole entry's key once it is gone: evicted, replaced, damaged
        self.on_whole_dropped: Callable[[WholeKey], None] = lambda key: None

    # ------------------------------------------------------------ start-up

    def scan(self) -> None:
        """Index what a previous mount left (in a worker thread: may be many files)."""
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self.root, 0o700)  # cached chunks are every user's files: the mount's user only, whatever the umask
        found = []
        for sub in self.root.iterdir():
            if not sub.is_dir():
                continue
            for entry in os.scandir(sub):
                if entry.name.startswith("."):  # a temporary file of a write that never finished
                    os.unlink(entry.path)
                    continue
                try:
                    parts = entry.name.split(".")
                    if len(parts) == 5 and parts[1] == "w":
                        key = WholeKey(int(parts[0]), int(parts[2]), int(parts[3], 16))
                        whole_sum = int(parts[4], 16)
                    else:
                        key, whole_sum = tuple(int(x) for x in parts), None
                    st = entry.stat()
                except (ValueError, OSError):
                    continue
                if whole_sum is not None or len(key) == 3:
                    found.append((st.st_mtime_ns, key, st.st_size, whole_sum))
        found.sort(key=lambda f: f[0])
        with self._lock:
            for _, key, size, whole_sum in found:
                self._entries[key] = size
                self.used += size
                if whole_sum is not None:
                    self._sums[key] = whole_sum
                    self._whole_of.setdefault(key.ino, set()).add(key)
        log.info("disk cache %s: %d entries, %.1f MiB", self.root, len(found), self.used / (1 << 20))
        self._evict()

    # ------------------------------------------------------------ lookups

    def _path(self, key: Key | WholeKey) -> Path:
        if isinstance(key, WholeKey):
            return self._whole_path(key, self._sums.get(key, 0))
        return self.root / f"{key[0] % 256:02x}" / f"{key[0]}.{key[1]}.{key[2]}"

    def _whole_path(self, key: WholeKey, whole_sum: int) -> Path:
        return self.root / f"{key.ino % 256:02x}" / f"{key.ino}.w.{key.size}.{key.digest:016x}.{whole_sum:016x}"

    async def get(self, key: Key) -> memoryview | None:
        with self._lock:
            if key not in self._entries:
                return None
            self._entries.move_to_end(key)
        return await trio.to_thread.run_sync(self._read, key)

    def _read(self, key: Key) -> memoryview | None:
        path = self._path(key)
        try:
            raw = path.read_bytes()
            data = decode(key, raw)
            os.utime(path)  # LRU order survives a remount
            return data
        except (OSError, ValueError) as exc:
            log.warning("disk cache entry %s is unusable (%s); dropped", path, exc)
            self._drop(key)
            return None

    # ------------------------------------------------------------ whole files

    def has_whole(self, key: WholeKey) -> bool:
        """Whether the whole-file form of this version is on disk (the index only: no I/O)."""
        return key in self._sums

    def open_whole(self, key: WholeKey) -> int | None:
        """A read-only descriptor of the whole-file entry, its size and checksum checked (in a
        worker thread: it reads the file); None, with the entry dropped and logged, if it is missing,
        short, long or damaged. The caller closes the descriptor."""
        with self._lock:
            whole_sum = self._sums.get(key)
            if whole_sum is None:
                return None
            self._entries.move_to_end(key)
        path = self._whole_path(key, whole_sum)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            log.warning("disk cache: whole file %s is unusable (%s); dropped", path, exc)
            self._drop(key)
            return None
        try:
            size = os.fstat(fd).st_size
            if size != key.size:
                raise ValueError(f"{size} bytes, the file has {key.size}")
            h = xxhash.xxh3_64()
            buf = bytearray(_VERIFY_PIECE)
            view, seen = memoryview(buf), 0
            while True:
                n = os.readv(fd, (buf,))
                if not n:
                    break
                h.update(view[:n])
                seen += n
            if seen != key.size:
                raise ValueError(f"read {seen} bytes, the file has {key.size}")
            if h.intdigest() != whole_sum:
                raise ValueError("checksum mismatch")
            os.utime(fd)  # LRU order survives a remount
            return fd
        except (OSError, ValueError) as exc:
            os.close(fd)
            log.warning("disk cache: whole file %s is unusable (%s); dropped", path, exc)
            self._drop(key)
            return None

    def put_whole(self, key: WholeKey, data: bytes | memoryview) -> bool:
        """Write the whole-file form of this version (in a worker thread); its other versions go.
        False if nothing was written (no room, an error: logged)."""
        if len(data) != key.size:
            raise ValueError(f"{len(data)} bytes for a whole file of {key.size}")
        with self._lock:
            if key in self._sums or key in self._writing:
                return False
            self._writing.add(key)
        whole_sum = xxhash.xxh3_64_intdigest(data)
        path = self._whole_path(key, whole_sum)
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}")
        try:
            if self._free_bytes() < self.min_free + len(data):
                self._evict(extra=len(data))
                if self._free_bytes() < self.min_free + len(data):
                    return False
            path.parent.mkdir(mode=0o700, exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            with open(fd, "wb") as f:
                f.write(data)
            os.rename(tmp, path)
            with self._lock:
                self._entries[key] = len(data)
                self.used += len(data)
                self._sums[key] = whole_sum
                older = self._whole_of.setdefault(key.ino, set())
                older.discard(key)
                older, self._whole_of[key.ino] = list(older), {key}
            for old in older:  # another version of the file: never served again, its room is free now
                self._drop(old)
            self._evict()
            return True
        except OSError as exc:
            _abandon(path, tmp, exc)
            return False
        finally:
            with self._lock:
                self._writing.discard(key)

    # ------------------------------------------------------------ filling

    def put_soon(self, nursery: trio.Nursery, key: Key, data: bytes | memoryview) -> None:
        """Write ``data`` in the background (the reader never waits for the disk)."""
        with self._lock:
            if key in self._entries or key in self._writing:
                return
            self._writing.add(key)
        nursery.start_soon(trio.to_thread.run_sync, self._write, key, data, name=f"disk-cache-{key}")

    def _write(self, key: Key, data: bytes | memoryview) -> None:
        path = self._path(key)
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}")
        try:
            if self._free_bytes() < self.min_free + len(data):
                self._evict(extra=len(data))
                if self._free_bytes() < self.min_free + len(data):
                    return  # the disk is needed by others: cache nothing more for now
            path.parent.mkdir(mode=0o700, exist_ok=True)
            pieces = encode(key, data)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            with open(fd, "wb") as f:
                f.writelines(pieces)
            os.rename(tmp, path)
            size = sum(len(p) for p in pieces)
            with self._lock:
                self._entries[key] = size
                self.used += size
            self._evict()
        except OSError as exc:
            _abandon(path, tmp, exc)
        finally:
            with self._lock:
                self._writing.discard(key)

    def _free_bytes(self) -> int:
        st = os.statvfs(self.root)
        return st.f_bavail * st.f_frsize

    def _evict(self, extra: int = 0) -> None:
        while True:
            with self._lock:
                if not self._entries or (self.used + extra <= self.capacity and self._free_bytes() >= self.min_free + extra):
                    return
                key = next(iter(self._entries))
            self._drop(key)

    def _drop(self, key: Key | WholeKey) -> None:
        with self._lock:
            path = self._path(key)
            size = self._entries.pop(key, None)
            if size is not None:
                self.used -= size
            whole = isinstance(key, WholeKey) and self._sums.pop(key, None) is not None
            if whole:
                versions = self._whole_of.get(key.ino)
                if versions is not None:
                    versions.discard(key)
                    if not versions:
                        del self._whole_of[key.ino]
        if whole:
            try:
                self.on_whole_dropped(key)
            except Exception:
                log.exception("disk cache: the drop of a whole file was not handled")
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("disk cache: cannot remove %s: %s", path, exc)


def _abandon(path, tmp, exc: OSError) -> None:
    """A cache file that could not be written: logged, its temporary copy removed (if it got that far)."""
    log.warning("disk cache: cannot write %s: %s", path, exc)
    try:
        os.unlink(tmp)
    except OSError:
        pass
