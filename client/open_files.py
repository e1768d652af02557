"""What the mount knows about a file it has open: attributes, layout, chunk map, dirty data.

One ``OpenFile`` per inode, shared by every handle of that inode on this mount,
so two file descriptors of one process see each other's writes.

Dirty data is kept per chunk as one contiguous byte range (``DirtyChunk``).
A write that is not contiguous with a chunk's dirty range first sends that
range to storage. A chunk whose range becomes the whole chunk is sent in the
background at once (sequential writers stream). ``flush`` sends the rest,
waits for everything in flight and commits the new chunk versions and size to
the metadata daemon: only then can another mount see the data (close-to-open).

Write sessions and their failure
--------------------------------
The writes between two commits form a *write session*: its chunks carry the
session's epoch as their version, and they are recorded in ``uncommitted`` as
their sends complete. Sends of one chunk are applied in the order their dirty
ranges were taken (``DirtyChunk.after``), whichever task sends them. When any
send fails (or is cancelled by the operation deadline), the session has lost
data: ``write_error`` is set, later writes are refused with it, and once
nothing is in flight the session is thrown away (``discard_session``): no
commit, the size and chunk map go back to what the daemon committed. The next
``flush`` or ``fsync`` (close) reports the error to the application, which is
the rule the metadata daemon relies on: a length or chunk version is committed
only after every byte it covers was stored.
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
    #: set when the range is taken for sending (OpenFile.take): the send waits for ``after``
    #: (the chunk's previous send) and sets ``done`` when it has finished, stored or not
    after: trio.Event | None = None
    done: trio.Event | None = None

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
    #: the epoch of the session that last took the daemon's current placements (placements.refresh)
    placements_checked: int = -1
    #: the end of the furthest write of this session: what the commit makes the size at least
    written_end: int = 0
    #: committed refs that this session's sends replaced in ``chunks`` (None: there was none)
    before_session: dict[int, p.ChunkRef | None] = field(default_factory=dict)
    #: index -> the ``done`` event of the chunk's last send taken (sends of a chunk run in order)
    send_tail: dict[int, trio.Event] = field(default_factory=dict)
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
        return bool(self.dirty or self.uncommitted or self.inflight or self.write_error)

    def take(self, index: int) -> DirtyChunk:
        """Remove chunk ``index``'s dirty range for sending: counted in flight from now on (readers
        and flush wait for it) and ordered after the chunk's earlier sends."""
        dc = self.dirty.pop(index)
        dc.after = self.send_tail.get(index)
        dc.done = self.send_tail[index] = trio.Event()
        self.start_io()
        return dc

    def sent(self, dc: DirtyChunk) -> None:
        """A taken range's send has finished, stored or not."""
        assert dc.done is not None
        dc.done.set()
        if self.send_tail.get(dc.index) is dc.done:
            del self.send_tail[dc.index]
        self.end_io()

    def record(self, ref: p.ChunkRef) -> None:
        """A chunk version this session stored: readable here now, committed by flush."""
        if ref.index not in self.before_session:
            self.before_session[ref.index] = self.chunks.get(ref.index)
        self.uncommitted[ref.index] = ref
        self.chunks[ref.index] = ref

    def discard_session(self) -> None:
        """Forget a failed write session (nothing in flight): back to what the daemon committed."""
        for index, old in self.before_session.items():
            if old is None:
                self.chunks.pop(index, None)
            else:
                self.chunks[index] = old
        self.before_session.clear()
        self.dirty.clear()
        self.uncommitted.clear()
        self.unsynced.clear()
        self.placed_ahead.clear()
        self.size = self.attr.size
        self.written_end = 0
        self.epoch = 0

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
