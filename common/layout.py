"""Layout math: sizes, redundancy specs, and offset -> chunk arithmetic.

A file's layout (chunk size, stripe count, redundancy) is fixed when it is
created, inherited from its directory. Reading an offset is pure arithmetic:
``chunk_index = offset // chunk_size``; the chunk's placement (which nodes
hold it) comes from the metadata daemon's chunk map.

Striping: the daemon places chunk ``i`` with its primary on the
``i % stripe_count``-th node of the file's stripe set, so a sequential reader
pulls consecutive chunks from ``stripe_count`` different nodes at once.

Slots: where a chunk version is stored. Every chunk, replicated or
erasure-coded, has two *slots* per copy, chosen by its version's parity: copy
(or fragment) ``j`` of version ``v`` is chunk part ``j + SLOT_STRIDE * (v & 1)``
(``slot_part``; a replica is "fragment 0": part 0 or 32). A writer always
writes a new version into the slot the committed version does not use (it
takes an epoch of the other parity, client/placements.slot_version), so the
committed bytes are never overwritten before the new version is committed: a
writer that dies, or a write session that fails half-way, leaves every copy of
the committed version as it was (copy-on-write). "The committed version" is the
daemon's answer, not the writer's request: while a commit is on its way, the
next session's first write of a chunk it carries waits for its answer
(client/open_files.py "Slots and a commit in flight"). The daemon queues the old
slot as garbage, bounded by the old version, when the new version is committed.
Within a session a chunk is rewritten at the session's version in that same
slot: a partial rewrite names the session's version as its base (a node
without that copy answers STALE rather than build on the committed slot), and a
write that may have torn it is followed by a whole rewrite or fails the session
(client/ec_path.py ``_rewrite_columns``). A snapshot's row may read a
committed slot of its live file (``ChunkRef.data_ino``): the commit that moves
the live row off that version copies it out first (daemon/snapshots.py).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Iterator

from .errors import ErrorCode, StripefsError
from .protocol import ChunkRef, Layout, OpenRsp

KiB, MiB, GiB, TiB = 1 << 10, 1 << 20, 1 << 30, 1 << 40
_UNITS = {"": 1, "K": KiB, "M": MiB, "G": GiB, "T": TiB, "P": 1 << 50}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGTP]?)(?:i?B)?\s*$", re.IGNORECASE)

MIN_CHUNK_SIZE = 64 * KiB
MAX_CHUNK_SIZE = 64 * MiB
MAX_STRIPE_COUNT = 256
MAX_REPLICAS = 8
#: copy or fragment j of a chunk version v is stored as chunk part ``j + SLOT_STRIDE * (v & 1)``: see slot_part
SLOT_STRIDE = 32

DEFAULT_LAYOUT = Layout(chunk_size=4 * MiB, stripe_count=4, redundancy="replicas=2")


def parse_size(text: str | int) -> int:
    """'4M' -> 4 MiB. Units are binary: K, M, G, T, P (an optional 'iB'/'B' suffix is accepted)."""
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"size {text} is negative")
        return text
    m = _SIZE_RE.match(str(text))
    if not m:
        raise ValueError(f"{text!r} is not a size; use a number with an optional binary unit, e.g. 64K, 4M, 1G")
    value = float(m.group(1)) * _UNITS[m.group(2).upper()]
    if value != int(value):
        raise ValueError(f"{text!r} is not a whole number of bytes")
    return int(value)


def format_size(n: float) -> str:
    """4194304 -> '4.0M', 22 -> '22B' (binary units, as parse_size reads them)."""
    for unit in ("", "K", "M", "G", "T"):
        if abs(n) < 1024 or unit == "T":
            return f"{n:.0f}B" if unit == "" else f"{n:.1f}{unit}"
        n /= 1024
    return f"{n:.1f}P"


@dataclass(frozen=True)
class Redundancy:
    """``replicas=R`` (ec_k == 0) or ``ec=K+M``."""

    replicas: int = 0
    ec_k: int = 0
    ec_m: int = 0

    @property
    def is_ec(self) -> bool:
        return self.ec_k > 0

    @property
    def copies(self) -> int:
        """Nodes each chunk occupies."""
        return self.ec_k + self.ec_m if self.is_ec else self.replicas

    def __str__(self) -> str:
        return f"ec={self.ec_k}+{self.ec_m}" if self.is_ec else f"replicas={self.replicas}"


@functools.lru_cache(maxsize=64)
def parse_redundancy(text: str) -> Redundancy:
    """``replicas=R`` or ``ec=K+M`` as a Redundancy; INVALID otherwise. Cached: every placement
    parses its file's layout (a handful of distinct texts; a refusal raises, so is not cached)."""
    text = text.strip().lower()
    m = re.fullmatch(r"replicas=(\d+)", text)
    if m:
        r = int(m.group(1))
        if not 1 <= r <= MAX_REPLICAS:
            raise StripefsError(ErrorCode.INVALID, f"replicas must be 1..{MAX_REPLICAS}, not {r}")
        return Redundancy(replicas=r)
    m = re.fullmatch(r"ec=(\d+)\+(\d+)", text)
    if m:
        k, mm = int(m.group(1)), int(m.group(2))
        if not (1 <= k <= 16 and 1 <= mm <= 4):
            raise StripefsError(ErrorCode.INVALID, f"ec=K+M needs K in 1..16 and M in 1..4, not {k}+{mm}")
        return Redundancy(ec_k=k, ec_m=mm)
    raise StripefsError(ErrorCode.INVALID, f"redundancy {text!r} is not 'replicas=R' or 'ec=K+M'")


def validate_layout(layout: Layout) -> Layout:
    """Raise INVALID with a message naming the bad field; return the layout unchanged."""
    cs = layout.chunk_size
    if not MIN_CHUNK_SIZE <= cs <= MAX_CHUNK_SIZE or cs % (4 * KiB):
        raise StripefsError(
            ErrorCode.INVALID,
            f"chunk_size {cs} must be a multiple of 4K between {format_size(MIN_CHUNK_SIZE)} and {format_size(MAX_CHUNK_SIZE)}",
        )
    if not 1 <= layout.stripe_count <= MAX_STRIPE_COUNT:
        raise StripefsError(ErrorCode.INVALID, f"stripe_count must be 1..{MAX_STRIPE_COUNT}, not {layout.stripe_count}")
    parse_redundancy(layout.redundancy)
    return layout


@dataclass(frozen=True)
class Extent:
    """The part of a byte range that falls in one chunk."""

    index: int  # chunk index in the file
    offset: int  # offset inside the chunk
    length: int
    file_offset: int  # where this extent starts in the file


def chunk_extents(offset: int, length: int, chunk_size: int) -> Iterator[Extent]:
    """Split [offset, offset+length) of a file into per-chunk extents, in order."""
    end = offset + length
    pos = offset
    while pos < end:
        index, inner = divmod(pos, chunk_size)
        n = min(chunk_size - inner, end - pos)
        yield Extent(index, inner, n, pos)
        pos += n


def chunk_count(size: int, chunk_size: int) -> int:
    """Chunks needed to hold ``size`` bytes."""
    return -(-size // chunk_size)


def slot_part(j: int, version: int) -> int:
    """The chunk ``part`` holding copy or fragment ``j`` of chunk version ``version`` (Slots, above)."""
    return j + SLOT_STRIDE * (version & 1)


def replica_part(version: int) -> int:
    """The chunk ``part`` holding a replica of version ``version`` of a replicated chunk: 0 or 32."""
    return SLOT_STRIDE * (version & 1)


def sibling_part(part: int) -> int:
    """The other slot of ``part`` (the committed version's, while a new one is written), or -1."""
    return part ^ SLOT_STRIDE if part < 2 * SLOT_STRIDE else -1


def is_ec(layout: Layout) -> bool:
    """Whether files of ``layout`` are erasure-coded (``ec=K+M``) rather than replicated."""
    return layout.redundancy.startswith("ec=")


def one_chunk(info: OpenRsp) -> ChunkRef | None:
    """Chunk 0 of a written file that fits in one chunk (0 < size <= chunk size), else None: the files
    fetched whole ahead of their reader (client/dir_hints.py, client/striping.py, client/prefetch.py)."""
    if not 0 < info.attr.size <= info.layout.chunk_size or not info.chunks:
        return None
    ref = info.chunks[0]
    if ref.index != 0 or not ref.version or not ref.nodes:  # no nodes: in a tier (docs/tiering.md), read through a recall
        return None
    return ref
