"""The on-disk format of a storage node: where a chunk file lives and what it holds.

Pure definitions, no I/O but reading the ``fanout`` marker in ``chunk_path``:
storage_node/chunk_store.py reads, writes, verifies and accounts the files;
tools and tests find a chunk's file with ``chunk_path``.

On-disk layout
--------------
::

    DATA_DIR/
        .lock                     flock(2)ed while a node uses the directory
        node_id                   the node id that owns it (refuses another)
        fanout                    the fan-out scheme (below)
        slots                     present once replicated copies sit in their slot
        chunks/AA/BB/INO-INDEX-PART.chunk

``PART`` is the copy's slot (common/layout.py "Slots"): a replica of version v
is part ``32 * (v & 1)``, fragment j of an EC stripe version v part
``j + 32 * (v & 1)``. Data directories written before slots kept every replica
at part 0; the store moves the odd-versioned ones once at startup and then
writes ``slots`` (chunk_store.ChunkStore._move_to_slots).

``AA/BB`` name one of 65,536 fan-out directories, number ``d`` =
``0xAA | 0xBB << 8``; every part of one ``(ino, index)`` sits in the same
directory (``delete`` with ``all_parts`` lists one directory). Names are
decimal so that an operator can go from a log line ("chunk 1234:5:0") to the
file. Which directory (``DATA_DIR/fanout`` says; a data directory keeps the
scheme it started with):

``by-inode`` (new data directories): ``d = ((ino >> 6) + (index >> 12)) mod
65536``: 64 consecutive inodes share a directory, and a file's chunks move on
every 4,096. Files written together (a dataset) sit together, as they would
on a local disk: ext4 allocates a directory's inodes in its block group, so
one inode-table read-ahead serves the whole directory, and a cold read of a
small chunk costs about one disk read (with ``hashed`` it cost 3.5: the two
directory levels and an inode-table block per chunk, each directory in its
own block group; measured on this project's ext4 VM: 3.53 reads and 169 KiB
per cold 110 KiB chunk, against 1.06 reads for the same files on the local disk).

``hashed`` (data directories made before): the two low bytes of xxh3_64 of
``(ino, index)``.

Chunk file format (FORMAT_VERSION 1; all integers little-endian)
----------------------------------------------------------------
::

    offset  size  field
    0       8     magic b"STRIPECK"
    8       2     format version (1)
    10      2     flags (0)
    12      4     block size B (bytes covered by one checksum)
    16      8     chunk version (the writer's epoch; see common/protocol.py)
    24      8     logical length L of the data
    32      8     ino     \\
    40      8     index    > the chunk id, so a misplaced file is detected
    48      4     part    /
    52      4     reserved (0)
    56      8     xxh3_64 of bytes 0..55 followed by the checksum table
    64      8*N   checksum table: xxh3_64 of each data block, N = ceil(L / B)
    64+8N   L     data (the last block may be short; it is hashed as stored)

The file size is therefore exactly ``64 + 8*N + L``. Anything else - a bad
magic, an unknown format version, a header checksum mismatch, a wrong size,
another chunk's id - is CORRUPT.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import NamedTuple

import xxhash

from ..common.protocol import ChunkId

MAGIC = b"STRIPECK"
FORMAT_VERSION = 1
HEADER = struct.Struct("<8sHHIQQQQII")  # everything up to the header checksum
HEADER_CRC = struct.Struct("<Q")
HEADER_SIZE = HEADER.size + HEADER_CRC.size  # 64
SUM = 8  # bytes per block checksum

_xxh3 = xxhash.xxh3_64_intdigest


class Header(NamedTuple):
    """A chunk file's header, verified: what the reader needs of it."""

    version: int
    length: int
    block_size: int
    sums: tuple[int, ...]
    data_start: int


def block_sums(data: memoryview, block_size: int) -> list[int]:
    return [_xxh3(data[i : i + block_size]) for i in range(0, len(data), block_size)]


def encode_header(chunk: ChunkId, version: int, data: memoryview, block_size: int) -> bytes:
    """Header and checksum table of a chunk file holding ``data`` (the data follows them)."""
    sums = block_sums(data, block_size)
    fixed = HEADER.pack(MAGIC, FORMAT_VERSION, 0, block_size, version, len(data), chunk.ino, chunk.index, chunk.part, 0)
    table = struct.pack(f"<{len(sums)}Q", *sums)
    digest = xxhash.xxh3_64(fixed)
    digest.update(table)
    return fixed + HEADER_CRC.pack(digest.intdigest()) + table


def chunk_path(data_dir: Path, chunk: ChunkId) -> Path:
    """Where the node using ``data_dir`` keeps ``chunk``, without opening the store (tools, tests)."""
    d = FANOUT[(Path(data_dir) / "fanout").read_text().strip()](chunk.ino, chunk.index)
    return fanout_dir(Path(data_dir) / "chunks", d) / file_name(chunk)


def fanout_dir(chunks_dir: Path, d: int) -> Path:
    """Fan-out directory number ``d``: ``chunks/AA/BB`` with AA its low byte."""
    return chunks_dir / f"{d & 0xFF:02x}" / f"{(d >> 8) & 0xFF:02x}"


def file_name(chunk: ChunkId) -> str:
    return f"{chunk.ino}-{chunk.index}-{chunk.part}.chunk"


def dir_by_inode(ino: int, index: int) -> int:
    return ((ino >> 6) + (index >> 12)) & 0xFFFF


def dir_hashed(ino: int, index: int) -> int:
    return _xxh3(struct.pack("<QQ", ino, index)) & 0xFFFF


#: fan-out schemes (module docstring): chunk id -> directory number
FANOUT = {"by-inode": dir_by_inode, "hashed": dir_hashed}
