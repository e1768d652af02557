"""What the mount knows about a file it has open: attributes, layout, chunk map, dirty data.

One ``OpenFile`` per inode, shared by every handle of that inode on this mount,
so two file descriptors of one process see each other's writes.

Dirty data is kept per chunk as one contiguous byte range (``DirtyChunk``).
A write that is not contiguous with a chunk's dirty range first sends that
range to storage. A chunk whose range becomes the whole chunk is sent in the
background at once (sequential writers stream). ``flush`` sends the rest,
waits for everything in flight and commits the new chunk versions and size to
the metadata daemon: only then can another mount see the data (close-to-open).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import trio

from ..common import protocol as p

log = logging.getLogger(__name__)


@dataclass
class DirtyChunk:
    index: int
    buf: bytearray  # bytes [lo, hi) are meaningful; the rest is padding
    lo: int
    hi: int

    def contiguous_with(self, offset: int, length: int) -> bool:
        return offset <= self.hi and offset + length >= self.lo

    def merge(self, offset: int, data: bytes | memoryview) -> None:
        """Copy ``data`` in at ``offset`` (``contiguous_with`` holds): the new bytes are copied once."""
        end = offset + len(data)
        n = len(self.buf)
        if offset == n:  # appending, as sequential writers do: amortised growth, no zero fill
            self.buf += data
        else:
            if n < offset:  # the first bytes of a range starting mid-chunk: padding in front
                self.buf += bytes(offset - n)
            self.buf[offset:end] = data  # grows the buffer when ``end`` is past it
        self.lo = min(self.lo, offset)
        self.hi = max(self.hi, end)


@dataclass
class OpenFile:
    ino: int
    attr: p.Attr
    layout: p.Layout
    chunks: dict[int, p.ChunkRef]
    open_count: int = 0
    #: size including writes not yet committed
    size: int = 0
    dirty: dict[int, DirtyChunk] = field(default_factory=dict)
    #: chunks sent to storage but not yet committed: index -> ref with the new version
    uncommitted: dict[int, p.ChunkRef] = field(default_factory=dict)
    #: chunks placed ahead of a sequential writer and not written yet (striping.alloc_indices)
    placed_ahead: set[int] = field(default_factory=set)
    #: chunks written without fsync since the last fsync: index -> nodes
    unsynced: dict[int, list[int]] = field(default_factory=dict)
    epoch: int = 0  # version for this write session; 0 until the first write
    inflight: int = 0
    idle: trio.Event = field(default_factory=trio.Event)
    write_error: BaseException | None = None
    write_slots: trio.Semaphore | None = None
    #: the size writes may make the file reach under its directory quotas (OpenRsp.quota_max_size); -1: none applies
    quota_max: int = -1
    #: the daemon said this file has no ``security.capability`` since it was last opened here.
    #: The kernel asks before every WRITE (FUSE file systems have no SB_NOSEC): one daemon round
    #: trip per 1 MiB written, otherwise. Another mount adding the xattr meanwhile is seen at
    #: the next open, like any other change (close-to-open); setxattr/removexattr here forget it.
    killpriv_absent: bool = False

    def __post_init__(self) -> None:
        self.size = self.attr.size
        self.idle.set()

    @property
    def chunk_size(self) -> int:
        return self.layout.chunk_size

    @property
    def has_unflushed(self) -> bool:
        return bool(self.dirty or self.uncommitted or self.inflight)

    def refresh(self, rsp: p.OpenRsp) -> None:
        """Take fresh metadata from an OpenRsp, unless local writes are pending (ours are newer)."""
        if self.has_unflushed:
            return
        self.attr = rsp.attr
        self.layout = rsp.layout
        self.chunks = {c.index: c for c in rsp.chunks}
        self.size = rsp.attr.size

    def start_io(self) -> None:
        if self.inflight == 0:
            self.idle = trio.Event()
        self.inflight += 1

    def end_io(self) -> None:
        self.inflight -= 1
        if self.inflight == 0:
            self.idle.set()
