"""What the mount knows about a file it has open: attributes, layout, chunk map, dirty data.

One ``OpenFile`` per inode, shared by every handle of that inode on this mount,
so two file descriptors of one process see each other's writes.

Dirty data is kept per chunk as a few byte ranges in one buffer
(``DirtyChunk``; one range for a contiguous writer). A write that would add a
range past ``MAX_DIRTY_RANGES`` first sends the chunk's ranges to storage. A
chunk whose ranges become the whole chunk is sent in the background at once
(sequential writers stream; interleaved writers whose records fill each
other's gaps too). ``flush`` sends the rest,
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

Slots and a commit in flight
----------------------------
A session writes a chunk's new version into the slot its committed version
does not use (common/layout.py "Slots"; placements.slot_version picks it from
the version in ``chunks``). A commit hands its session over before its round
trip (striping.commit_request): writes arriving meanwhile belong to the next
session, and ``chunks`` already names the handed versions. Their slot choice
is right only once the daemon has answered: until then the *other* slot holds
the committed version, which a snapshot may still pin (the daemon copies it
out before it applies the commit, daemon/snapshot_service.py) and which is the
file's content again if the commit fails. So the next session's first send of
a chunk the commit carries waits for the answer (``commit_settled``); a
streaming writer's new chunks do not wait.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import trio

from ..common import protocol as p

log = logging.getLogger(__name__)


#: byte ranges one chunk's dirty data may have before a write that would add another sends them:
#: writers that leave gaps and fill them later (interleaved records, mmap writeback out of
#: order) are coalesced into one send instead of one read-merge-rename per write
MAX_DIRTY_RANGES = 64

#: ``OpenFile.placed_ahead`` of a file with none (shared: a set is made at the first)
_NONE_PLACED: frozenset[int] = frozenset()


@dataclass
class DirtyChunk:
    index: int
    buf: bytearray  # the bytes of ``ranges`` at their offsets; zeros elsewhere
    lo: int  # the first dirty byte
    hi: int  # one past the last
    #: the dirty byte ranges [start, end), sorted, disjoint and not touching; [(lo, hi)] for a
    #: contiguous writer. Bytes between them are not ours: they are whatever storage holds.
    ranges: list[tuple[int, int]] = field(default_factory=list)
    #: set when the range is taken for sending (OpenFile.take): the send waits for ``after``
    #: (the chunk's previous send) and sets ``done`` when it has finished, stored or not
    after: trio.Event | None = None
    done: trio.Event | None = None

    def __post_init__(self) -> None:
        if not self.ranges and self.hi > self.lo:
            self.ranges = [(self.lo, self.hi)]  # made with one range (a test, a truncate's cut)

    def takes(self, offset: int, length: int) -> bool:
        """Whether a write of [offset, offset+length) can join the buffered ranges."""
        if len(self.ranges) < MAX_DIRTY_RANGES:
            return True
        end = offset + length
        return any(offset <= hi and end >= lo for lo, hi in self.ranges)  # touches one: no range added

    def merge(self, offset: int, data: bytes | memoryview) -> None:
        """Copy ``data`` in at ``offset`` (``takes`` holds): the new bytes are copied once."""
        end = offset + len(data)
        n = len(self.buf)
        if offset == n:  # appending, as sequential writers do: amortised growth, no zero fill
            self.buf += data
        else:
            if n < offset:  # the first bytes of a range starting past the buffer: padding in front
                self.buf += bytes(offset - n)
            self.buf[offset:end] = data  # grows the buffer when ``end`` is past it
        if self.ranges and self.ranges[-1][1] == offset:  # the common case: extending the last range
            self.ranges[-1] = (self.ranges[-1][0], end)
        else:
            self.ranges = _add_range(self.ranges, offset, end)
        self.lo, self.hi = self.ranges[0][0], self.ranges[-1][1]

    @property
    def contiguous(self) -> bool:
        return len(self.ranges) == 1

    def pieces(self) -> list[DirtyChunk]:
        """One DirtyChunk per range (sharing the buffer), for sends that cannot fill the gaps."""
        return [DirtyChunk(self.index, self.buf, lo, hi, [(lo, hi)]) for lo, hi in self.ranges]


def _add_range(ranges: list[tuple[int, int]], start: int, end: int) -> list[tuple[int, int]]:
    """``ranges`` with [start, end) added, overlapping and touching ones merged into it."""
    out: list[tuple[int, int]] = []
    for lo, hi in ranges:
        if hi < start or lo > end:
            out.append((lo, hi))
        else:
            start, end = min(start, lo), max(end, hi)
    out.append((start, end))
    out.sort()
    return out


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
    #: chunks placed ahead of a sequential writer and not written yet (striping.alloc_indices);
    #: the shared empty one until the first (``place_ahead``)
    placed_ahead: set[int] | frozenset[int] = _NONE_PLACED
    #: chunks written without fsync since the last fsync: index -> nodes
    unsynced: dict[int, list[int]] = field(default_factory=dict)
    epoch: int = 0  # version for this write session; 0 until the first write
    #: (session epoch, committed parity) -> the version chunks of that parity get (placements.slot_version)
    slot_epochs: dict[tuple[int, int], int] = field(default_factory=dict)
    #: the epoch of the session that last took the daemon's current placements (placements.refresh)
    placements_checked: int = -1
    #: the end of the furthest write of this session: what the commit makes the size at least
    written_end: int = 0
    #: when the last write of this session came (the commit's mtime, so what a stat answered from
    #: the write-back before the commit is what the commit records); 0: none (the commit's time)
    mtime_ns: int = 0
    #: committed refs that this session's sends replaced in ``chunks`` (None: there was none)
    before_session: dict[int, p.ChunkRef | None] = field(default_factory=dict)
    #: index -> the ``done`` event of the chunk's last send taken (sends of a chunk run in order)
    send_tail: dict[int, trio.Event] = field(default_factory=dict)
    inflight: int = 0
    #: ``idle``'s event once made (None: nothing was ever in flight, so idle)
    _idle: trio.Event | None = None
    write_error: BaseException | None = None
    #: while a commit's round trip is in flight: index -> the event its answer sets, for each chunk
    #: it carries (``commit_sent``/``commit_answered``); None: none in flight. The next session's
    #: first send of such a chunk waits for the answer (``commit_settled``): the module docstring,
    #: "Slots and a commit in flight"
    in_commit: dict[int, trio.Event] | None = None
    #: ``commit_lock`` once made (None: never taken)
    _commit_lock: trio.Lock | None = None
    write_slots: trio.Semaphore | None = None
    #: the size writes may make the file reach under its directory quotas (OpenRsp.quota_max_size); -1: none applies
    quota_max: int = -1
    #: the daemon said this file has no ``security.capability`` since it was last opened here.
    #: The kernel asks before every WRITE (FUSE file systems have no SB_NOSEC): one daemon round
    #: trip per 1 MiB written, otherwise. Another mount adding the xattr meanwhile is seen at
    #: the next open, like any other change (close-to-open); setxattr/removexattr here forget it.
    killpriv_absent: bool = False
    #: no-open (Operations.no_open): the file changed elsewhere, or a LOOKUP answered other
    #: attributes, since this state was taken: the next READ or WRITE refreshes it first
    stale: bool = False
    #: no-open: the daemon was asked (or a fresh LOOKUP told) the open information for writing
    #: since this state was made; the first WRITE asks otherwise (the epoch, a snapshot's EROFS)
    writable: bool = False
    #: closes that send nothing (Operations.silent_close): the daemon holds this mount's write mark
    #: on the file (daemon/callbacks.py), or the file was created here in a directory it holds
    #: whole; a WRITE is answered only once it is so (Operations._mark)
    marked: bool = False
    #: no-open: made by a CREATE of this mount and no FLUSH of it came since (Operations._open_here)
    created_open: bool = False
    #: the directory this mount created the file in (0: opened, not created here): small-file
    #: write-back (client/write_back.py) flushes a directory's files before a request naming it
    parent: int = 0
    #: writes to a file created here whose create the daemon has not answered yet (its layout and
    #: chunk map unknown): (offset, bytes), applied in order once it has (Operations._replay);
    #: the shared empty tuple until the first (``keep_early``)
    early: list[tuple[int, bytes]] | tuple = ()
    early_bytes: int = 0

    # A mount keeps one OpenFile per file it created until the kernel forgets the inode, and an
    # empty file's create is answered on the FUSE reader thread (client/async_dirops.py): what is
    # needed only once the file is written, read or committed (the events and lock of its sends
    # and commits, its early writes, its chunks placed ahead) is made then, not per create. Each
    # object a state keeps is also one more for the cyclic collector to walk at every full
    # collection (common/gc_tuning.py).

    def __post_init__(self) -> None:
        self.size = self.attr.size

    @property
    def idle(self) -> trio.Event:
        """Set while nothing is in flight (``start_io``/``end_io``): readers and flush wait on it."""
        if self._idle is None:
            self._idle = trio.Event()
            if self.inflight == 0:
                self._idle.set()
        return self._idle

    @property
    def commit_lock(self) -> trio.Lock:
        """Held by a flush (send, commit) and a truncate (flush, cut): a commit's reply sets the size
        and attributes the daemon had when it answered, so no truncate may run between its request
        and its reply."""
        if self._commit_lock is None:
            self._commit_lock = trio.Lock()
        return self._commit_lock

    @property
    def committing(self) -> bool:
        """``commit_lock`` is held (without making one)."""
        return self._commit_lock is not None and self._commit_lock.locked()

    def keep_early(self, offset: int, data: bytes) -> None:
        """A write kept until the file's create is answered (``early``)."""
        if not self.early:
            self.early = []
        self.early.append((offset, data))
        self.early_bytes += len(data)

    def place_ahead(self, index: int) -> None:
        """Chunk ``index`` was placed ahead of the writer (``placed_ahead``)."""
        if not self.placed_ahead:
            self.placed_ahead = set()
        self.placed_ahead.add(index)

    @property
    def chunk_size(self) -> int:
        return self.layout.chunk_size

    @property
    def has_unflushed(self) -> bool:
        return bool(self.dirty or self.uncommitted or self.inflight or self.write_error or self.early)

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

    def commit_sent(self, indices) -> trio.Event:
        """A commit carrying chunks ``indices`` is on its way: the event ``commit_answered`` sets."""
        event = trio.Event()
        if self.in_commit is None:
            self.in_commit = {}
        for index in indices:
            self.in_commit[index] = event
        return event

    def commit_answered(self, event: trio.Event) -> None:
        """The commit of ``event`` was answered, or failed: sends of its chunks go on."""
        if self.in_commit is not None:
            for index in [i for i, e in self.in_commit.items() if e is event]:
                del self.in_commit[index]
            if not self.in_commit:
                self.in_commit = None
        event.set()

    async def commit_settled(self, index: int) -> None:
        """Wait until no commit in flight carries chunk ``index`` (the slot its next version takes
        is known only then: "Slots and a commit in flight" above)."""
        while self.in_commit is not None and (event := self.in_commit.get(index)) is not None:
            await event.wait()

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
        self.placed_ahead = _NONE_PLACED
        self.size = self.attr.size
        self.written_end = 0
        self.mtime_ns = 0
        self.epoch = 0

    def refresh(self, rsp: p.OpenRsp) -> None:
        """Take fresh metadata from an OpenRsp, unless local writes are pending or being committed
        (ours are newer: during a commit the session is handed over, but the daemon may have
        answered the OpenRsp before it had it)."""
        if self.has_unflushed or self.committing:
            return
        if any(0 < c.version < self.chunks[c.index].version for c in rsp.chunks if c.index in self.chunks):
            # older than what this mount holds (its own commit came after the answer): never go
            # back. The daemon never lowers a committed version (a truncated and rewritten chunk
            # gets a newer epoch), and an older stripe's slot may still be on the nodes until the
            # garbage collector's next round: taking it would read, and read-modify-write from,
            # the bytes the newer version replaced, with no error (issue 35)
            return
        self.attr = rsp.attr
        self.layout = rsp.layout
        self.chunks = {c.index: c for c in rsp.chunks}
        self.size = rsp.attr.size

    def start_io(self) -> None:
        if self.inflight == 0:
            self._idle = trio.Event()
        self.inflight += 1

    def end_io(self) -> None:
        self.inflight -= 1
        if self.inflight == 0:
            self.idle.set()
