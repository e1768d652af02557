"""The mount's ``Operations``: thin handlers that delegate, answering in the FUSE session's types.

Namespace operations go to the metadata daemon (meta_rpc), data operations to
``DataPath`` (striping). Handlers take what the kernel names (inodes, handles, names as
bytes, the request context) and answer in client/fuse's own results: ``Entry`` (LOOKUP,
CREATE, MKDIR, ...), ``(Attr, valid)`` or its ``Encoded`` form (GETATTR, SETATTR),
``Opened`` (OPEN), ``Statfs``; client/operations_bridge.py feeds them the requests.
Every handler runs under ``_fuse_errors``: a handler answers an error only with
``FuseError(errno)``, so StripefsError becomes its errno (one table:
common.errors.ERRNO_BY_CODE) and anything else is logged with its traceback and
answered EIO. The mount stays up; the ERROR line makes tests fail.

Nothing waits forever (a "soft" mount, as NFS calls it): every handler runs
under ``op_timeout_s`` (ClientConfig; 60 s by default, long enough to ride out
a metadata daemon restart or failover). A call the cluster cannot serve in
that time (no storage node up, no daemon answering) fails with EIO and a log
line; a write cut short that way fails its write session (open_files.py), so
the close or fsync that follows reports it. Unmounting gives open files the
same bound to commit what they buffer (client/mount.py).

Close-to-open without an open round trip
-----------------------------------------
An open must see every change closed elsewhere before the open() began. Under
a callback (daemon/callbacks.py) the kernel caches a regular file's name and
attributes for ``cache_timeout_s`` and ``open`` uses the open information kept
with it (``_held_info``): the daemon answers a change of that file made
elsewhere only after this mount dropped it (client/kernel_cache.py
acknowledges). Without one, the kernel caches directory entries of *regular
files* for 0 s (directories and symlinks for ``entry_timeout_s``), so every
path-based open() walks through a LOOKUP of the file inside the same syscall. That LOOKUP asks the daemon for the
open information too (layout, chunk map), and ``open`` uses the newest lookup
answer if it is younger than ``OPEN_INFO_FRESH_S``: it was answered after the
open() began, so it is as fresh as an OpenReq would be. Opens that walk no path
(reopening /proc/PID/fd/N) fall back to an OpenReq once that answer is older.
Cold small-file reads cost one metadata and one storage round trip, at the same
time once the directory has read hints (client/dir_hints.py).

If the data changed since the kernel's pages were filled (the last open here),
the page cache is dropped (``keep_cache`` False).

Long kernel caching (client/kernel_cache.py)
--------------------------------------------
While the daemon's change feed is healthy, directory and symlink names and all
attributes are cached for ``cache_timeout_s`` and dropped explicitly when they
change elsewhere. Regular-file names stay at 0 s in the default mode unless
held under a callback (above).

Dataset mode (``-o dataset``): a read-only mount for training data
-------------------------------------------------------------------
Every name and attribute is cached for ``cache_timeout_s`` while the feed is
healthy; ``open`` and ``flush`` are declined with ENOSYS (no-open: the kernel
sends neither, nor RELEASE, again on the connection; a READ names the inode,
``read_inode``) and the kernel keeps the page cache (the feed drops pages of
files that change). So a warm file costs no request and no network; a
buffered ``open()``'s isatty IOCTL is answered ENOTTY by the mount's FUSE
session itself (``SERVED_IOCTLS``), before any handler. A change made elsewhere
becomes visible within the feed's bound (kernel_cache.py: 3 s plus delivery),
not at the next open.
Writes of any kind answer EROFS.

Sampler-order prefetch: ``setxattr(DIR, "user.stripefs.prefetch", PATHS)`` with
newline-separated paths relative to DIR queues those files for prefetch
(client/prefetch.py, stripefs.torch.PrefetchSampler).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import inspect
import logging
import os
import stat
import struct
import time
from collections import OrderedDict, deque
from itertools import repeat
from typing import Awaitable, Callable, NamedTuple

import msgspec
import trio

from ..common import protocol as p
from ..common.errors import ErrorCode, StripefsError
from . import fuse_backend, idle_commits
from .async_dirops import AsyncDirops, Pending
from .dir_hints import DirHints
from .dir_listings import CONTINUE_S, PAGES_KEPT, KeptListings, Listing
from .fetch import Fetch
from .fuse.abi import ENTRY_OUT_SIZE, OpenFlag
from .fuse.dispatch import Opened
from .fuse.replies import (ZERO_ENTRY, Attr, Encoded, Entry, Failed, FuseError, Statfs, encode_attr_out, encode_entry,
                           encode_held_entry)
from .idle_commits import IdleCommits
from .jobs import Jobs
from .kernel_cache import KernelCache
from .meta_rpc import MetaClient
from .open_files import OpenFile
from .passthrough import Passthrough
from .placements import took_pair
from .prefetch import Prefetcher
from .readahead import ReadStream
from .striping import DataPath
from .write_back import WriteBack

log = logging.getLogger(__name__)

#: bytes written to a file created here before the daemon answered its create that the mount keeps
#: (Operations._early); more, and the write waits for the answer
EARLY_MAX = 1 << 20

#: the layout an asynchronously created file has until the daemon's answer gives its own (never used:
#: what reads or writes its data waits for that answer first, ``_settle``)
_PENDING_LAYOUT = p.Layout(chunk_size=1 << 22, stripe_count=1, redundancy="replicas=1")

#: the xattr the kernel asks for before every write to a FUSE file (file_remove_privs: may the
#: write keep file capabilities?); its absence is remembered while the file is open
KILLPRIV_XATTR = b"security.capability"

#: an open may use a LOOKUP's answer this young instead of asking the daemon again
OPEN_INFO_FRESH_S = 1.0
#: OpenReqs an open sends while each answer raced a change of the file (``Operations._ask_open``)
OPEN_ASKS = 3
#: the longest an acknowledgement of another mount's change waits for the commits of what this mount
#: wrote to the files it touched (closes that send nothing: ``_commit_written``), inside the daemon's
#: wait for it while this mount says it is committing (daemon/callbacks.py ``committing``)
ACK_COMMIT_S = p.COMMIT_WAIT_S - 2.0

RENAME_NOREPLACE_FLAG = 1  # renameat2(2)
RENAME_EXCHANGE_FLAG = 2  # renameat2(2)

#: directories whose every name a mount keeps (callbacks on their names), and names in one
COMPLETE_DIRS = 4096
COMPLETE_DIR_NAMES = 100_000

#: dataset mode: open information kept per inode (until the feed says it changed); default
#: mode: the same for files held under a callback (daemon/callbacks.py)
DATASET_OPEN_INFO_ENTRIES = 262_144

#: the ioctls the mount serves (prefetch announcements on a read-only mount); every other is
#: answered ENOTTY by the FUSE session itself (client/mount.py, client/fuse/session.py Options.ioctls)
SERVED_IOCTLS = frozenset({p.PREFETCH_IOC, p.PREFETCH_SHM_IOC})

#: st_blksize the kernel reports for every file: reads and writes of 1 MiB
BLKSIZE = 1 << 20


#: a fast path's answer "not from here": the handler itself runs
_SLOW = object()
#: the same, for who calls the ``_fast_*`` paths from outside (client/operations_bridge.py)
FAST_PATH_MISS = _SLOW
#: a held directory's LOOKUP of a name it does not have (every create's first request): returned,
#: not raised (client/fuse/replies.py ``Failed``)
_NO_SUCH_NAME = Failed(errno.ENOENT)


def _fuse_errors(fn, fast=None):
    """``fast``: a plain function with the handler's arguments that answers from what the mount
    knows, with nothing to wait for, or returns _SLOW. It runs without the op_timeout cancel
    scope (~15-45 us each here, the most of a warm OPEN, RELEASE or GETATTR)."""

    @functools.wraps(fn)
    async def wrapper(self, *args, **kwargs):
        try:
            if fast is not None:
                result = fast(self, *args, **kwargs)
                if result is not _SLOW:
                    if result.__class__ is Failed:  # (the session answers it as it is: client/fuse/dispatch.py)
                        raise FuseError(result)
                    return result
            with trio.fail_after(self.op_timeout):
                return await fn(self, *args, **kwargs)
        except trio.TooSlowError:
            log.warning("%s: the cluster did not answer within %.0fs (op_timeout_s); answering EIO", fn.__name__, self.op_timeout)
            raise FuseError(errno.EIO) from None
        except FuseError:
            raise
        except StripefsError as exc:
            log.debug("%s: %s", fn.__name__, exc)
            raise FuseError(exc.errno) from None
        except Exception:
            log.exception("%s failed", fn.__name__)
            raise FuseError(errno.EIO) from None

    return wrapper


def _wrap_handlers(cls):
    for name, fn in list(vars(cls).items()):
        if not name.startswith("_") and inspect.iscoroutinefunction(fn):
            setattr(cls, name, _fuse_errors(fn, vars(cls).get(f"_fast_{name}")))
    return cls


@_wrap_handlers
class Operations:
    def __init__(
        self,
        meta: MetaClient,
        data: DataPath,
        *,
        attr_timeout: float,
        entry_timeout: float,
        cache_timeout: float = 0.0,
        dataset: bool = False,
        per_open_handles: bool = True,
        kcache: KernelCache | None = None,
        prefetcher: Prefetcher | None = None,
        op_timeout: float = 60.0,
        sync_close: bool = False,
    ):
        self.meta = meta
        self.data = data
        self.op_timeout = op_timeout  # the longest any handler waits for the cluster (module docstring)
        data.on_discard = self._session_discarded
        data.on_commit = self._committed
        self.attr_timeout = attr_timeout
        self.entry_timeout = entry_timeout
        self.cache_timeout = max(cache_timeout, attr_timeout, entry_timeout)
        self.dataset = dataset
        #: the kernel sends no OPEN (the session's bridge declines it, client/operations_bridge.py):
        #: always on a dataset mount; on the default mount unless ``per_open_handles`` (docs/design.md,
        #: "No OPEN on the read-write mount"). READ, WRITE, FLUSH and FSYNC then name the inode.
        self.no_open = dataset or not per_open_handles
        #: no-open on the read-write mount: one handle per inode, kept until FORGET (``_inode_file``)
        self.per_inode = self.no_open and not dataset
        self.kcache = kcache or KernelCache()
        self.kcache.on_change = self._changed_elsewhere
        # what the _fast_* paths read and the handle bookkeeping they change: they may run on the
        # FUSE session's reader thread (client/operations_bridge.py), which takes this lock around
        # a fast path and its reply; here it is taken around every change of that state that
        # makes a fast answer wrong or that a fast path makes too (handles, open counts)
        self.lock = self.kcache.state_lock
        self.prefetcher = prefetcher
        self.jobs: Jobs | None = None  # training jobs reporting their data wait (client/jobs.py), set by the mount
        # dataset mode: ino -> OpenRsp, kept until the feed says the file changed
        self._dataset_info: OrderedDict[int, p.OpenRsp] = OrderedDict()
        # default mode: ino -> what this mount knows of a file held under a callback
        # (daemon/callbacks.py): its OpenRsp when the lookup carried one, else its Attr; kept until
        # the feed says it changed (the daemon answers such a change only after that)
        self._held_info: OrderedDict[int, p.OpenRsp | p.Attr] = OrderedDict()
        #: directories a file created here was told a quota applies in: their new files' data is not
        #: kept before the create's answer nor written back after close, so a write past the quota is
        #: cut short at once (EDQUOT), as without write-back (``_note_quota``)
        self._quota_dirs: set[int] = set()
        self.files: dict[int, OpenFile] = {}  # ino -> open file state
        # directory -> every name in it, while this mount holds a callback on its names
        # (daemon/callbacks.py): a lookup of another name is answered ENOENT without asking
        self._names_complete: OrderedDict[int, set[bytes]] = OrderedDict()
        #: listings the daemon gave, pages of them answered from memory (client/dir_listings.py)
        self.listings = KeptListings()
        if not dataset:  # a dataset mount caches everything within the feed's bound instead
            self.kcache.send_ack = self._send_ack
            self.kcache.is_open = self.files.__contains__
            self.kcache.own_writer = meta.writer
        self.handles: dict[int, OpenFile] = {}  # fh -> open file state
        self._inode_handles: dict[int, int] = {}  # ino -> the handle reads without OPEN use (read_inode)
        #: ino -> set once the request asking the daemon for its open information is answered
        #: (``_asking``: one at a time, the others wait for its answer)
        self._inode_asking: dict[int, trio.Event] = {}
        self.streams: dict[int, ReadStream] = {}  # fh -> its read pattern (read-ahead)
        self._next_fh = 1
        # ino -> (mtime_ns, size) of the data the kernel's page cache holds (as of the last open)
        self._kernel_view: dict[int, tuple[int, int]] = {}
        # ino -> (the Attr, the size answered, its fuse_attr_out / fuse_entry_out bytes): a hot
        # GETATTR's and LOOKUP's answers, encoded once per Attr (_encoded); dropped with what they
        # were made from
        self._attr_bytes: dict[int, tuple[p.Attr, int, Encoded]] = {}
        #: ino -> state of every file that may hold a write mark or writes not committed
        #: (``_may_hold_writes``): what an acknowledgement or a settle looks through
        #: (``_marked_or_written``), not ``files``, which on a no-open mount keeps a state per
        #: inode the kernel knows (40,000 after as many creates, each acknowledgement scanning
        #: them all under ``lock``: ~30% of the trio thread; docs/design.md, issue 30 round b)
        self._unclean: dict[int, OpenFile] = {}
        self._unclean_bound = 1024  # past this many, the next look through prunes it all (``_marked_or_written``)
        #: dataset mount: directories being listed ahead of the kernel (``_list_subdirs_ahead``), and
        #: those waiting for their turn
        self._listing_ahead: dict[int, trio.Event] = {}
        self._ahead_queue: deque[int] = deque()
        #: the kernel's READDIRPLUS buffer at a listing's start (the connection's, the same each time;
        #: 0: none seen yet): the page ``_page_ahead`` makes
        self._plus_size = 0
        self._entry_bytes: dict[int, tuple[p.Attr, int, Encoded]] = {}
        # ino -> (when, OpenRsp) from LOOKUPs, oldest first; see the module docstring
        self._open_info: OrderedDict[int, tuple[float, p.OpenRsp]] = OrderedDict()
        # ino -> (when, Attr) of the newest LOOKUP answers, oldest first: what a shared-memory
        # copy is checked against in the default mode (getxattr of SHM_COPY_XATTR)
        self._looked_up: OrderedDict[int, tuple[float, p.Attr]] = OrderedDict()
        meta.open_inodes = self._held_inodes
        #: FUSE passthrough from the disk cache (client/passthrough.py), set by a ``-o passthrough`` mount
        self.passthrough: Passthrough | None = None
        self._pt_handles: dict[int, tuple[int, int]] = {}  # fh -> (ino, backing id) of a passthrough open
        self._pt_open: dict[int, list[int]] = {}  # ino -> [backing id, open files using it]
        # pid -> (inode it looked up last, whether it then opened it): drives prefetch on lookup
        self._last_lookup: dict[int, tuple[int, bool]] = {}
        self.hints = DirHints()  # where small files of directories being walked live (client/dir_hints.py)
        # creates answered here in directories this mount holds whole (client/async_dirops.py); the
        # mount starts its flusher (``run``); None: every create asks the daemon
        self.dirops: AsyncDirops | None = None if dataset else AsyncDirops(meta, on_reply=self._async_answered, lock=self.lock)
        # small new files closed here and committed after their close (client/write_back.py); the mount
        # starts its flusher (``run``); None (dataset mode, -o sync_close): every close commits
        self.writeback: WriteBack | None = None if dataset or sync_close else WriteBack(
            data, on_done=self._written_back, prepare=self._before_write_back)
        if self.dirops is not None:
            self.kcache.before_ack = self._before_ack
        #: closes send nothing (docs/design.md "A close that sends nothing"): once set (``_go_silent``,
        #: at the first FLUSH that finds the change feed followed), FLUSH is declined, for good;
        #: write sessions are committed when the writing stops (client/idle_commits.py), and another
        #: mount's read of a file written here waits for this mount's acknowledgement (a write mark,
        #: daemon/callbacks.py), which commits first. Only where the daemon grants callbacks and
        #: write marks (SQLite), and not with ``-o sync_close``.
        self.silent_close = False
        self._may_go_silent = (self.per_inode and not sync_close and meta.callbacks and getattr(meta, "marks", True)
                               and self.kcache.callbacks_wanted)  # (no write marks from PostgreSQL daemons)
        self.idle: IdleCommits | None = IdleCommits(self._commit_idle) if self._may_go_silent else None
        self._unmarked_told = False
        self._quiet_commits = 0  # ``_commit_quietly`` calls under way: the unmount waits for them
        self._no_quiet_commit = trio.Event()
        self._no_quiet_commit.set()

    async def _before_ack(self, touched: set[int] | None) -> None:
        """Before this mount acknowledges another's change or read (client/kernel_cache.py): what it
        answered and has not sent yet goes first, creates before the files written back; with closes
        that send nothing, the write sessions of what the change touched too (``_commit_written``).
        Only the write-back of what the change touched is waited for (``WriteBack.busy``: the files,
        or files in the directories, whose grants it ended; anything, after a full drop): an
        acknowledgement that waited for every small file queued here (up to MAX_QUEUED_BYTES on
        their way to the nodes) ran past the daemon's ``WAIT_S`` on a loaded machine, and the mount
        was penalised (no callbacks for a minute, every later change elsewhere seen only once its
        event arrives)."""
        await self.dirops.flush()
        work = self._commits_written(touched) if self.silent_close else []
        if self.writeback is not None and self.writeback.busy(*(touched or ())):
            work.append(self.writeback.flush)
        await self._finish_before_ack(work)

    async def _commit_written(self, touched: set[int] | None) -> None:
        """Commit the write sessions of ``touched`` (``_commits_written``), as before an acknowledgement."""
        await self._finish_before_ack(self._commits_written(touched))

    def _commits_written(self, touched: set[int] | None) -> list[Callable[[], Awaitable[None]]]:
        """Before this mount acknowledges changes that ended its grants on ``touched`` (files, and
        directories it created files in; None: anything): the write sessions of those files are
        committed, since the acknowledgement ends their write marks (or the directory's hold that
        covered them) and a read elsewhere follows it. Their marks are dropped first, so a WRITE from
        here on marks its file again before it is answered (``_mark``). A commit already on its way
        counts as written: its session was handed over, so nothing of it is written here any more,
        but the daemon has not recorded it either, and the read the acknowledgement lets go would
        see the file from before the close (``_commit_quietly`` waits for it, then commits what
        came after). The commits, to run."""
        pending = []
        with self.lock:
            for of in self._marked_or_written(touched, by_ino=True):
                of.marked = False
                if _written(of) or of.committing:
                    pending.append(of)
                else:
                    del self._unclean[of.ino]  # neither marked nor written now (``_may_hold_writes``)
        return [functools.partial(self._commit_quietly, of) for of in pending]

    async def _finish_before_ack(self, work: list[Callable[[], Awaitable[None]]]) -> None:
        """Run ``work`` (commits, the write-back's flush) before an acknowledgement. Work that takes
        long (a storage node that died under the write: its request timeouts) is told to the daemon
        every ``COMMITTING_S / 4`` (AckReq.committing), which then waits on for this mount past its
        usual ``WAIT_S``; past ``ACK_COMMIT_S`` the acknowledgement goes without it, it goes on, and
        the reader sees what was last committed until it lands."""
        if not work:
            return
        # each in a task of its own, waited for at most ACK_COMMIT_S: a commit cut short would
        # throw its write session away (client/striping.py), so one that takes longer goes on after
        # the acknowledgement instead
        done, left = trio.Event(), [len(work)]

        async def run(job) -> None:
            try:
                await job()
            finally:
                left[0] -= 1
                if not left[0]:
                    done.set()

        for job in work:
            self.data.nursery.start_soon(run, job, name="before-ack")
        give_up = trio.current_time() + ACK_COMMIT_S
        while True:
            with trio.move_on_after(p.COMMITTING_S / 4):
                await done.wait()
            if done.is_set():
                return
            if trio.current_time() > give_up:
                log.warning("acknowledging a change of another mount after %.0fs without the commit of what this mount "
                            "wrote to the files it touched: the cluster did not take it in time (it follows)", ACK_COMMIT_S)
                return
            with trio.move_on_after(p.COMMITTING_S / 4):
                try:
                    await self.meta.call(p.AckReq(session_id=self.meta.session_id, seq=0, committing=True), retry=False)
                except StripefsError as exc:  # the daemon's wait for this mount runs out instead
                    log.debug("telling the daemon a commit before an acknowledgement is under way: %s", exc)

    async def _commit_idle(self, ino: int) -> None:
        """``IDLE_S`` after the last WRITE of ``ino`` (client/idle_commits.py): commit its session, as
        the close's FLUSH did. An error is logged and kept for the file's next fsync here."""
        of = self.files.get(ino)
        if of is None or not self.silent_close:
            return  # (not silent yet: the close's FLUSH commits)
        of.created_open = False  # its writer stopped: as far as this mount can tell, the creator's close
        if _written(of):
            await self._commit_quietly(of)

    async def _commit_quietly(self, of: OpenFile) -> None:
        """Commit ``of``'s write session with no caller to tell: a failure is logged, and the session's
        error is the result of the file's next fsync here (client/striping.py ``DataPath.flush``). A
        session that failed already is left as it is: committing it would report (and so consume) the
        error that fsync must report. A state the kernel forgot meanwhile goes once nothing is left to
        commit (``forget_now`` and ``_drop_handle`` kept it for this)."""
        if not self._quiet_commits:
            self._no_quiet_commit = trio.Event()
        self._quiet_commits += 1
        try:
            if of.committing:  # another commit of it is on its way (the idle timer's, an acknowledgement's,
                async with of.commit_lock:  # the unmount's): its answer first, then only what it did not take
                    pass
            if of.write_error is not None or not _written(of):
                return
            try:
                with trio.fail_after(self.op_timeout):
                    with self._ended_if_cut(of):
                        await self._flush_file(of)
            except (StripefsError, trio.TooSlowError) as exc:
                log.warning("inode %d: what was written could not be committed: %s (its next fsync reports it)", of.ino, exc)
                if of.write_error is None:  # (raising it cleared it: kept for the fsync, once)
                    of.write_error = exc if isinstance(exc, StripefsError) else StripefsError(
                        ErrorCode.IO, f"inode {of.ino}: its commit took over {self.op_timeout:.0f}s")
        finally:
            with self.lock:
                if of.open_count == 0 and not self._uncommitted(of) and self.files.get(of.ino) is of:
                    del self.files[of.ino]
            self._quiet_commits -= 1
            if not self._quiet_commits:
                self._no_quiet_commit.set()

    async def quiet_commits_done(self) -> None:
        """Return once no commit of ``_commit_quietly`` is under way (the unmount, before the nursery
        that runs them is cancelled: a commit cut there throws its session away)."""
        while self._quiet_commits:
            await self._no_quiet_commit.wait()

    def _entry(self, attr: p.Attr, *, cacheable: bool = True, held: bool = False) -> Entry:
        """The kernel's entry for ``attr``; ``cacheable`` False: the answer may already be old;
        ``held``: a regular file's name under a callback (cached long like a directory's)."""
        long = self.cache_timeout if cacheable and self.kcache.healthy else 0.0
        if stat.S_ISREG(attr.mode) and not self.dataset and not held:
            entry_timeout = 0.0  # every open() looks the file up (close-to-open, above)
        else:
            entry_timeout = long or (self.entry_timeout if cacheable else 0.0)
        return Entry(attr.ino, self._attr(attr), entry_timeout, long or (self.attr_timeout if cacheable else 0.0),
                     attr.generation)

    def _attr(self, attr: p.Attr) -> Attr:
        """The kernel's attributes of ``attr``, the size of the file as open here (it may be longer)."""
        size = self._size_here(attr)
        return Attr(attr.ino, attr.mode, attr.nlink, attr.uid, attr.gid, size, (size + 511) // 512, attr.atime_ns,
                    attr.mtime_ns, attr.ctime_ns, attr.rdev, BLKSIZE)

    def _size_here(self, attr: p.Attr) -> int:
        """The size of the file as this mount has it: longer than ``attr``'s while writes made here
        are not committed. A state with nothing of its own (a no-open mount keeps one per inode
        until FORGET) says nothing: another mount may have cut the file since it was taken."""
        of = self.files.get(attr.ino)
        if of is None or (of.size == of.attr.size and not of.has_unflushed):
            return attr.size
        return max(attr.size, of.size)

    def _attr_out(self, attr: p.Attr, *, cacheable: bool = True) -> tuple[Attr, float]:
        """GETATTR's and SETATTR's answer for ``attr``: the attributes and how long they hold (as
        ``_entry`` gives them, without making the entry: a held directory's GETATTR after every
        create asks this on the reader thread)."""
        long = self.cache_timeout if cacheable and self.kcache.healthy else 0.0
        return self._attr(attr), long or (self.attr_timeout if cacheable else 0.0)

    def _fresh_open_info(self, ino: int) -> p.OpenRsp | None:
        """The open information of a LOOKUP younger than OPEN_INFO_FRESH_S, if any."""
        oldest = time.monotonic() - OPEN_INFO_FRESH_S
        with self.lock:  # (iterating: no other thread may change it meanwhile)
            while self._open_info and next(iter(self._open_info.values()))[0] < oldest:
                self._open_info.popitem(last=False)
        entry = self._open_info.get(ino)
        return entry[1] if entry else None

    async def _send_ack(self, seq: int, everything: bool, opened: list[int]) -> None:
        """Tell the daemon the kernel dropped what the feed changed up to ``seq`` (client/kernel_cache.py)."""
        await self.meta.call(p.AckReq(session_id=self.meta.session_id, seq=seq, everything=everything,
                                      open_inodes=opened, client_id=self.meta.client_id))

    def _keep_held(self, ino: int, known: p.OpenRsp | p.Attr) -> None:
        if isinstance(known, p.Attr):
            kept = self._held_info.get(ino)
            if isinstance(kept, p.OpenRsp) and kept.attr == known:
                known = kept  # a listing of what a lookup told: the open information stays
        self._held_info[ino] = known
        self._held_info.move_to_end(ino)
        if len(self._held_info) > DATASET_OPEN_INFO_ENTRIES:
            self._held_info.popitem(last=False)

    def _names_of_dir(self, parent: int) -> set[bytes] | None:
        """Every name in ``parent``, if this mount holds them all (a callback on its names)."""
        names = self._names_complete.get(parent)
        if names is None:
            return None
        if ("dir", parent) not in self.kcache.grants or not self.kcache.healthy:
            self._names_complete.pop(parent, None)  # another mount changed its names, or the feed broke
            return None
        return names

    def _all_names(self, parent: int, names, seq: int) -> None:
        """The daemon granted a callback on every name of ``parent``: ``names`` (as of change ``seq``)."""
        self.kcache.granted_dir(parent, seq)
        self._names_complete[parent] = set(names)
        self._names_complete.move_to_end(parent)
        while len(self._names_complete) > COMPLETE_DIRS:
            self._names_complete.popitem(last=False)

    def _name_made(self, parent: int, name: bytes) -> None:
        self.listings.drop(parent)
        names = self._names_complete.get(parent)
        if names is not None:
            names.add(name)
            if len(names) > COMPLETE_DIR_NAMES:
                del self._names_complete[parent]

    def _name_gone(self, parent: int, name: bytes) -> None:
        self.listings.drop(parent)
        names = self._names_complete.get(parent)
        if names is not None:
            names.discard(name)

    def _fast_lookup(self, parent_inode, name, ctx=None):
        names = self._names_of_dir(parent_inode)
        if names is not None and name not in names and len(name) <= p.NAME_MAX:  # a longer one: the daemon's ENAMETOOLONG
            return _NO_SUCH_NAME  # the daemon would wait for this mount before adding it
        if self.kcache.healthy:
            # a name the kernel held and let expire (cache_timeout), of a file whose attributes
            # the mount holds: what the kernel kept until now is still true (the feed, or the
            # callback, would have dropped the name and the attributes together)
            ino = self.kcache.lookup_known(parent_inode, name)
            kept = False
            if ino is None:  # the kernel forgot it (drop_caches, memory pressure), the mount did not
                ino = self.kcache.lookup_kept(parent_inode, name)
                kept = True
            attr = self._held_long(ino) if ino is not None else None
            if attr is not None:
                if kept:
                    self.kcache.remember(parent_inode, name, ino)
                return self._encoded(attr, self._entry_bytes, encode_entry)
        return _SLOW

    def _held_inodes(self) -> list[int]:
        """Inodes the daemon must keep: open here, or looked up for an open about to happen."""
        self._fresh_open_info(0)  # prune
        with self.lock:  # (iterating: the reader thread's opens add files)
            return list(self.files.keys() | self._open_info.keys())

    async def _attr_reply(self, request: p.Msg, changes: tuple[int, ...] = ()) -> tuple[Attr, float]:
        stamp = self.kcache.stamp()
        rsp = await self._change(request, changes)
        return self._attr_out(rsp.attr, cacheable=not self.kcache.changed_since(stamp, rsp.attr.ino))

    async def _change(self, request: p.Msg, inodes) -> p.Msg:
        """Send a request that changes ``inodes``; the directories' attributes its reply
        carries answer the kernel's next GETATTR of them (client/dir_attrs.py). Creates answered
        here go first (client/async_dirops.py): this change may name them, and changes keep their order."""
        await self._settle()
        if not inodes:
            return await self.meta.call(request)
        inodes = [ino for ino in inodes if ino]
        rsp = None
        self.kcache.dir_attrs.begin(inodes)
        try:
            rsp = await self.meta.call(request)
            return rsp
        finally:
            self.kcache.dir_attrs.end(inodes, rsp)

    async def _new_name(self, parent: int, name: bytes, request: p.Msg) -> Entry:
        self._writable()
        stamp = self.kcache.stamp()
        try:
            rsp = await self._change(request, (parent,))
        except StripefsError as exc:
            if exc.code == ErrorCode.EXISTS:
                self._names_complete.pop(parent, None)  # it was there after all: ask from now on
            raise
        entry = self._entry(rsp.attr, cacheable=not self.kcache.changed_since(stamp, rsp.attr.ino))
        self._name_made(parent, name)
        if isinstance(request, p.MkdirReq) and rsp.callback >= 0:
            self._all_names(rsp.attr.ino, (), rsp.callback)  # a new directory: this mount knows all its names
        self.kcache.remember(parent, name, entry.nodeid)
        return entry

    async def _settle(self, *inodes: int) -> None:
        """Before a request that must see them at the daemon: the creates answered here of these
        inodes or in these directories are sent and answered (client/async_dirops.py); one of them
        the daemon refused fails this operation, once (the CephFS rule)."""
        d = self.dirops
        if d is None:
            return
        if d.unanswered:
            await d.settle(*inodes)
        if self.idle is not None and self.idle.pending():
            await self._commit_in(inodes)
        if self.writeback is not None:
            await self.writeback.settle(*inodes)
        for ino in inodes:
            of = self.files.get(ino)
            if of is not None and of.early:
                await self._replay(of)
        if d.failed:
            for ino in inodes:
                exc = d.take_error(ino)
                if exc is not None:
                    raise exc

    async def commit_pending(self) -> None:
        """Closes that send nothing: every write session not committed yet is committed now, and the
        write-back sent (before the prefetcher resolves paths: what it reads is what was written)."""
        if self.idle is None or not self.idle.pending():
            return
        await self._commit_in(None)
        if self.writeback is not None:
            await self.writeback.flush()

    async def _commit_in(self, dirs) -> None:
        """Closes that send nothing: the files this mount created in ``dirs`` (None: every file) and
        wrote since their last commit are committed now (as if closed: with a FLUSH their close would
        have queued them), so a listing, a lookup or a change there finds them as written."""
        if dirs is not None and not dirs:
            return  # (a settle naming nothing: no file of a directory named)
        with self.lock:
            files = [of for of in self._marked_or_written(dirs) if _written(of)]
        for of in files:
            await self._commit_quietly(of)

    def _may_hold_writes(self, of: OpenFile) -> None:
        """``of`` is marked, or written to: ``_marked_or_written`` finds it. Called wherever a mark is
        set (``_create_here``, ``_marked``) and wherever a write lands without one being set just
        before (an early write, ``_keep_early``; a WRITE whose mark an acknowledgement dropped while
        it was sent, ``write_inode``): a file neither marked nor written becomes either only there."""
        self._unclean[of.ino] = of

    def _marked_or_written(self, touched=None, *, by_ino: bool = False) -> list[OpenFile]:
        """(under ``lock``, or on the trio thread with no await) The files of ``files`` that are marked,
        hold writes not committed or are committing, among those created in a directory ``touched``
        names (with ``by_ino``, also those it names; None: all): every such file is in ``_unclean``
        (``_may_hold_writes``). A file looked at that is none of these, or that ``files`` no longer
        holds, leaves the index; the whole index is looked through once it doubled since the last
        time, so that states the kernel forgot do not pile up in it. ``touched`` is checked first:
        a settle's scan costs one membership test per file still marked here (a ``cp -r`` marks
        every file it creates, and no acknowledgement comes to drop the marks)."""
        index = self._unclean
        if touched is None or len(index) > self._unclean_bound:
            for of in list(index.values()):
                self._still_unclean(of)
            self._unclean_bound = 2 * len(index) + 1024
            if touched is None:
                return list(index.values())
        if by_ino:
            return [of for of in list(index.values()) if (of.ino in touched or of.parent in touched) and self._still_unclean(of)]
        return [of for of in list(index.values()) if of.parent and of.parent in touched and self._still_unclean(of)]

    def _still_unclean(self, of: OpenFile) -> bool:
        """(``_marked_or_written``) Whether ``of`` is still one of ``files`` marked or written; if not, it leaves the index."""
        if self.files.get(of.ino) is of and (of.marked or of.committing or _written(of)):
            return True
        if self._unclean.get(of.ino) is of:
            del self._unclean[of.ino]
        return False

    def _fast_failed(self, ino: int) -> None:
        """(reader thread) A fast answer about ``ino`` is the error its refused create left, once."""
        d = self.dirops
        if d is not None and d.failed:
            exc = d.take_error(ino)
            if exc is not None:
                raise FuseError(exc.errno)

    def _number_here(self, parent: int, name: bytes) -> int | None:
        """The inode number of an asynchronous create or mkdir of ``name`` (client/async_dirops.py),
        or None (the daemon is asked): only a free name of a directory whose every name this mount
        holds, while numbers are delegated."""
        d = self.dirops
        if d is None or not d.enabled or len(name) > p.NAME_MAX or not self.kcache.callbacks_possible:
            return None
        names = self._names_of_dir(parent)
        if names is None or name in names or b"/" in name or name in (b".", b".."):
            return None
        return d.take_ino()

    def _mkdir_here(self, parent: int, name: bytes, mode: int, ctx):
        """An asynchronous mkdir: answered here, or None. The new directory is held whole at once
        (it has no names), so what is made in it is answered here too."""
        ino = self._number_here(parent, name)
        if ino is None:
            return None
        now = time.time_ns()
        attr = p.Attr(ino=ino, mode=stat.S_IFDIR | (mode & 0o7777), nlink=2, uid=ctx.uid, gid=ctx.gid, rdev=0, size=0,
                      atime_ns=now, mtime_ns=now, ctime_ns=now)
        request = p.MkdirReq(parent=parent, name=name, mode=mode, uid=ctx.uid, gid=ctx.gid, session_id=self.meta.session_id,
                             callback=True, new_ino=ino)
        self.kcache.dir_attrs.made_here(parent, now, nlink=1)
        self.kcache.dir_attrs.keep_new(attr)
        self.dirops.add(Pending(request, parent, name, ino))
        self._name_made(parent, name)
        self.kcache.held_here(ino, parent, name, whole=True)
        self._names_complete[ino] = set()
        self.kcache.remember(parent, name, ino)
        return self._entry(attr)

    def _create_here(self, parent: int, name: bytes, mode: int, flags: int, ctx):
        """An asynchronous create (client/async_dirops.py): answered from what this mount holds, or
        None (the daemon is asked). Only in a directory whose every name this mount holds."""
        ino = self._number_here(parent, name)
        if ino is None:
            return None
        d = self.dirops
        now = time.time_ns()
        attr = p.Attr(ino=ino, mode=stat.S_IFREG | (mode & 0o7777), nlink=1, uid=ctx.uid, gid=ctx.gid, rdev=0, size=0,
                      atime_ns=now, mtime_ns=now, ctime_ns=now)
        request = p.CreateReq(parent=parent, name=name, mode=mode, uid=ctx.uid, gid=ctx.gid, session_id=self.meta.session_id,
                              callback=True, new_ino=ino)
        self.kcache.dir_attrs.made_here(parent, now)  # its next GETATTR is still answered here
        d.add(Pending(request, parent, name, ino))
        self._name_made(parent, name)
        with self.lock:
            of = self.files[ino] = OpenFile(ino, attr, _PENDING_LAYOUT, {}, parent=parent)
            of.marked = True  # the directory's hold covers it: another's lookup there recalls this mount first
            self._unclean[ino] = of  # (``_may_hold_writes``)
            self.kcache.held_here(ino, parent, name)
            self._keep_held(ino, attr)
        fh = self._new_handle(of)
        of.killpriv_absent = True
        self.kcache.remember(parent, name, ino)
        return self._entry(attr, held=True), self._created(fh, flags)

    def _known_here(self, parent: int, name: bytes) -> int | None:
        """The inode of ``name``, for an asynchronous unlink or rmdir (client/async_dirops.py): a name
        this mount knows in a directory it holds whole, while numbers are delegated; else None."""
        d = self.dirops
        if d is None or not d.enabled or not self.kcache.callbacks_possible:
            return None
        names = self._names_of_dir(parent)
        return self.kcache.lookup_known(parent, name) if names is not None and name in names else None

    def _open_here(self, ino: int) -> bool:
        """Whether ``ino`` counts as open here for an asynchronous unlink. With OPEN sent, a state
        in ``files`` is an open file. Without (no-open), the mount keeps a state per inode until
        the kernel forgets it and cannot tell an open file from a cached inode: only a write
        session (bytes not committed, or an epoch taken) counts, and a file created here until the
        first close's FLUSH (``created_open``: the creator's open file). With closes that send nothing
        there is no such FLUSH, and none is needed: the create put the file in this session's open set
        at the daemon, and the heartbeat keeps it there while the kernel knows the inode, so an
        unlink applied later keeps its data as an orphan as long as the creator may still use it;
        the same holds for an epoch taken and not written with (a create's answer brings one, and
        with no FLUSH nothing ends it: every empty file made here was unlinked synchronously, one
        UnlinkReq and one fsync each). A reader's file unlinked here
        keeps its data all the same: ``files`` stays the heartbeat's open set and the acknowledgement's
        (kernel_cache.py ``is_open``), which the daemon reads before it reclaims anything."""
        of = self.files.get(ino)
        if of is None:
            return False
        return (not self.per_inode or _written(of)
                or (not self.silent_close and (bool(of.epoch) or of.created_open)))

    def _rmdir_here(self, parent: int, name: bytes) -> bool:
        """An asynchronous rmdir of a directory this mount holds whole and knows empty; False: asked."""
        ino = self._known_here(parent, name)
        if ino is None or self._names_of_dir(ino) != set():
            return False
        self.dirops.add(Pending(p.RmdirReq(parent=parent, name=name), parent, name, ino))
        self._name_gone(parent, name)
        self.kcache.name_gone(parent, name)
        self._names_complete.pop(ino, None)
        self.kcache.dir_attrs.made_here(parent, time.time_ns(), nlink=-1)
        return True

    def _unlink_here(self, parent: int, name: bytes) -> bool:
        """An asynchronous unlink of a file not open here (the daemon must learn of those: the AckReq
        rule of client/kernel_cache.py); False: the daemon is asked."""
        ino = self._known_here(parent, name)
        if ino is None or self._open_here(ino):
            return False
        self.dirops.add(Pending(p.UnlinkReq(parent=parent, name=name), parent, name, ino))
        self._name_gone(parent, name)
        self.kcache.name_gone(parent, name)
        self.kcache.dir_attrs.made_here(parent, time.time_ns())
        with self.lock:
            self._held_info.pop(ino, None)  # its nlink changed: a stat through an open handle elsewhere asks
            self._open_info.pop(ino, None)
        return True

    def _rename_here(self, parent_old: int, name_old: bytes, parent_new: int, name_new: bytes, flags: int) -> bool:
        """An asynchronous rename (docs/design.md, "Rename"): a file, not a directory, whose name this
        mount knows in a directory it holds whole, to a name free in what it knows of another held
        directory (a replaced target may be open elsewhere: asked); False: the daemon is asked."""
        if flags not in (0, RENAME_NOREPLACE_FLAG) or len(name_new) > p.NAME_MAX or b"/" in name_new or name_new in (b".", b".."):
            return False
        ino = self._known_here(parent_old, name_old)
        names_new = self._names_of_dir(parent_new)
        if ino is None or names_new is None or name_new in names_new:
            return False
        of = self.files.get(ino)
        attr = of.attr if of is not None and not of.stale else self._held_attr(ino)
        if attr is None or stat.S_ISDIR(attr.mode) or attr.nlink != 1:
            return False  # (a hard-linked file cannot move to another quota tree: EXDEV, which mv must see)
        request = p.RenameReq(parent_old=parent_old, name_old=name_old, parent_new=parent_new, name_new=name_new, flags=flags)
        pending = Pending(request, parent_old, name_old, ino, new_parent=parent_new, new_name=name_new)
        self.dirops.add(pending)
        self._name_gone(parent_old, name_old)
        self._name_made(parent_new, name_new)
        self.kcache.name_gone(parent_old, name_old)
        self.kcache.remember(parent_new, name_new, ino)  # the kernel moved its entry itself
        now = time.time_ns()
        for parent in pending.dirs:
            self.kcache.dir_attrs.made_here(parent, now)
        return True

    def _async_answered(self, q: Pending) -> None:
        """The daemon answered a create or unlink answered here before (client/async_dirops.py).
        The kernel drops the directory's attributes (once per directory and flush): it was told
        this mount's times, and asks again for the daemon's (``dir_attrs`` keeps them)."""
        rsp = q.reply
        for parent in q.dirs:
            self.kcache.drop_inode(parent)
            self.kcache.dir_attrs.answered_here(parent, None if isinstance(rsp, p.ErrorRsp) else rsp)
        if isinstance(q.request, p.RenameReq):
            self._async_renamed(q)
            return
        if isinstance(q.request, (p.UnlinkReq, p.RmdirReq)):
            self._async_unlinked(q)
            return
        if isinstance(q.request, p.MkdirReq):
            self._async_made_dir(q)
            return
        with self.lock:
            of = self.files.get(q.ino)
            if isinstance(rsp, p.ErrorRsp):  # refused: the kernel forgets the file; its next operation fails
                self._held_info.pop(q.ino, None)
                self.kcache.let_go(q.ino, q.parent, q.name)
                self._names_complete.pop(q.parent, None)  # a name this mount could not see: ask from now on
                if of is not None and of.open_count == 0:
                    del self.files[q.ino]
            elif of is not None:
                of.attr, of.layout, of.chunks = rsp.attr, rsp.layout, {c.index: c for c in rsp.chunks}
                of.epoch = of.epoch or rsp.epoch
                of.quota_max = rsp.quota_max_size
                self._note_quota(of)
            if not isinstance(rsp, p.ErrorRsp):
                if rsp.callback >= 0 and self.kcache.healthy:
                    self.kcache.granted(q.ino, q.parent, q.name, rsp.callback)
                    self._keep_held(q.ino, rsp.attr)
                else:
                    # no callback (the session is penalised or at its bound, the feed fell behind):
                    # nothing will wait for this mount when another changes the name, which the
                    # kernel was told to keep as long as a held one (``_entry``): it forgets it, and
                    # the next lookup caches it as any unheld file's name
                    self.kcache.let_go(q.ino, q.parent, q.name)
                    self._held_info.pop(q.ino, None)
                    self.kcache.drop_name(q.parent, q.name)
        if isinstance(rsp, p.ErrorRsp):
            self.kcache.drop_name(q.parent, q.name)
            self.kcache.drop_inode(q.ino)
        else:
            self.data.nodes.learn(rsp.nodes)

    def _async_made_dir(self, q: Pending) -> None:
        rsp = q.reply
        if isinstance(rsp, p.ErrorRsp):  # the kernel forgets it; its next operation fails (async_dirops.py)
            self.kcache.dir_attrs.begin((q.ino,))
            self.kcache.dir_attrs.end((q.ino,), None)
            self.kcache.let_go(q.ino, q.parent, q.name, whole=True)
            self._names_complete.pop(q.parent, None)
            self._names_complete.pop(q.ino, None)
            self.kcache.drop_name(q.parent, q.name)
            self.kcache.drop_inode(q.ino)
            return
        if rsp.callback >= 0 and self.kcache.healthy:
            self.kcache.granted_dir(q.ino, rsp.callback)
            self.kcache.grants.pop((q.parent, q.name), None)  # (a directory's name is held by its parent's names)
        else:
            self.kcache.let_go(q.ino, q.parent, q.name, whole=True)
            self._names_complete.pop(q.ino, None)

    def _async_renamed(self, q: Pending) -> None:
        """Refused (the CephFS rule, as for a create): the kernel forgets both names, both directories
        are asked again, and the file's next operation fails once (async_dirops.py ``failed``)."""
        if not isinstance(q.reply, p.ErrorRsp):
            return
        for parent, name in ((q.parent, q.name), (q.new_parent, q.new_name)):
            self._names_complete.pop(parent, None)
            self.kcache.name_gone(parent, name)
            self.kcache.drop_name(parent, name)
        self.kcache.drop_inode(q.ino)

    def _async_unlinked(self, q: Pending) -> None:
        if isinstance(q.reply, p.ErrorRsp):
            self._names_complete.pop(q.parent, None)  # the name is there again: lookups ask from now on

    def _committed(self, ino: int, rsp: p.AttrRsp) -> None:
        """This mount changed the file (a commit or a truncate, whichever request made it): what a
        LOOKUP or a listing said of it before is old. Without this, an open within OPEN_INFO_FRESH_S
        of an fsync took the size and chunk map from before it. A file this mount holds under a
        callback stays held (daemon/callbacks.py: the writer keeps its own files), so the reply's
        attributes answer the next stat here; unless a grant newer than the change came meanwhile
        (its own answer is kept instead) or the holding ended (another mount changed the file)."""
        with self.lock:
            self._open_info.pop(ino, None)
            self._held_info.pop(ino, None)
            self._looked_up.pop(ino, None)
            self.kcache.changed_here(ino)  # answers in flight now are older than this commit: _ask_open
            granted = self.kcache.grants.get(ino)
            if granted is not None and 0 < rsp.seq and granted <= rsp.seq and self.kcache.healthy:
                self._keep_held(ino, rsp.attr)

    def _session_discarded(self, ino: int) -> None:
        """A write session of ``ino`` failed and was thrown away: the kernel's pages and size
        may hold what was never stored. Dropped from a worker thread, in the background: the
        kernel may hold page locks of this inode until the failing WRITE is answered."""
        with self.lock:
            self._open_info.pop(ino, None)
            self._kernel_view.pop(ino, None)
        self.data.nursery.start_soon(trio.to_thread.run_sync, _invalidate_attr, ino, False, name=f"invalidate-{ino}")

    def _writable(self) -> None:
        if self.dataset:
            raise FuseError(errno.EROFS)

    def _changed_elsewhere(self, inodes) -> None:
        """The change feed says these inodes changed (None: anything may have)."""
        if self.passthrough is not None:
            self.passthrough.forget_inodes(inodes)  # (new opens name the new version anyway)
        if self.per_inode:
            with self.lock:
                for of in (self.files.values() if inodes is None else filter(None, map(self.files.get, inodes))):
                    of.stale = True  # refreshed before its next READ or WRITE (_inode_file)
        if inodes is None:
            self._open_info.clear()
            self._looked_up.clear()
            self._dataset_info.clear()
            self._held_info.clear()
            self._kernel_view.clear()
            self._attr_bytes.clear()
            self._entry_bytes.clear()
            for ino in list(self._inode_handles):
                if not self.per_inode:
                    self._drop_inode_handle(ino)
            return
        for ino in inodes:
            if ino in self._inode_handles and not self.per_inode:
                self._drop_inode_handle(ino)
            self._open_info.pop(ino, None)
            self._looked_up.pop(ino, None)
            self._dataset_info.pop(ino, None)
            if ino not in self.kcache.grants:  # still held: the change was this mount's own commit (_committed)
                self._held_info.pop(ino, None)
            self._kernel_view.pop(ino, None)
            self._attr_bytes.pop(ino, None)
            self._entry_bytes.pop(ino, None)
            if self.prefetcher is not None and self.prefetcher.shm is not None:
                self.prefetcher.shm.forget(ino)

    def _attrs_changed_here(self, *inodes: int) -> None:
        """A change the daemon answered changed these inodes' own attributes (a rename's ctime, a
        replaced file's links): what this mount holds of them is dropped at its reply,
        not at its change event, which may come later (the next GETATTR asks the daemon). Their
        grants stay until that event, as for any change of this mount's own (``_changed_elsewhere``
        drops the rest then). A clean-clone CI run caught the writer's own stat of a file renamed
        over another answering the ctime from before the rename, the event not in yet."""
        with self.lock:
            for ino in inodes:
                if ino:
                    self._held_info.pop(ino, None)
                    self._open_info.pop(ino, None)
                    self._attr_bytes.pop(ino, None)
                    self._entry_bytes.pop(ino, None)

    def _keep_dataset_info(self, rsp: p.OpenRsp) -> None:
        self._dataset_info[rsp.attr.ino] = rsp
        self._dataset_info.move_to_end(rsp.attr.ino)
        if len(self._dataset_info) > DATASET_OPEN_INFO_ENTRIES:
            self._dataset_info.popitem(last=False)

    def in_page_cache(self, rsp: p.OpenRsp) -> bool:
        """Whether the kernel holds the pages of this version of the file: the prefetcher pushed
        them (or this mount's own commit left them), and since then neither the feed said it
        changed nor the kernel forgot the inode (either drops ``_kernel_view``). Pages the kernel
        dropped on its own (memory pressure, drop_caches 1) are not seen: the read then asks the
        mount, as without a prefetch. A wrong yes costs only a prefetch: the read goes through the
        kernel and the mount, whose rules keep it correct, either way."""
        return self._pages_hold(rsp.attr)

    def path_in_page_cache(self, root: int, path: bytes) -> bool:
        """``in_page_cache`` of the file at ``path`` (relative to directory ``root``), answered
        from memory: every name on the way known to the kernel (names a change elsewhere drops:
        kernel_cache.py), and the file's version the one the mount keeps true until it hears
        otherwise (``_held_long``: dataset mode, the feed's; default mode, a callback's). A later
        epoch's announcement of a file still warm then costs no LookupPathsReq (the daemon's
        ~45 us a path) and no fetch. False when anything is not known: the prefetcher asks."""
        ino = self._known_path(root, path)
        attr = self._held_long(ino) if ino is not None else None
        return attr is not None and self._pages_hold(attr)

    def _pages_hold(self, attr: p.Attr) -> bool:
        """The kernel's pages of ``attr.ino`` are of this version (``_kernel_view``) and it knows the inode."""
        return self._kernel_view.get(attr.ino) == (attr.mtime_ns, attr.size) and self.kcache.knows(attr.ino)

    def known_open_info(self, root: int, path: bytes) -> p.OpenRsp | None:
        """The open information of the file at ``path`` (relative to directory ``root``) that the
        mount keeps true, or None: what a ``LookupPathsReq`` would answer, for the prefetcher's
        cold epoch after the tree scan (a listing kept it: dataset mode, every file, kept true by
        the feed; default mode, each small file held under the listing's callback, which the
        daemon waits for before changing it). Not a file written here since (``_held_long``)."""
        ino = self._known_path(root, path)
        if ino is None:
            return None
        info = self._dataset_info.get(ino) if self.dataset else self._held_info.get(ino)
        if not isinstance(info, p.OpenRsp) or self._held_long(ino) != info.attr:
            return None
        return info

    def _known_path(self, root: int, path: bytes) -> int | None:
        """The inode at ``path`` by the names the kernel knows (the feed keeps them true), or None."""
        if not self.kcache.healthy:
            return None
        ino = root
        for name in path.split(b"/"):
            if name and name != b".":
                if name == b"..":
                    return None
                ino = self.kcache.lookup_known(ino, name)
                if ino is None:
                    return None
        return ino

    def prefetched(self, rsp: p.OpenRsp, in_page_cache: bool) -> None:
        """The prefetcher fetched this file (and pushed it into the page cache)."""
        if in_page_cache:
            self._kernel_view[rsp.attr.ino] = (rsp.attr.mtime_ns, rsp.attr.size)
        if self.dataset:
            self._keep_dataset_info(rsp)

    # -------------------------------------------------------------- namespace

    async def lookup(self, parent_inode, name, ctx=None):
        if self.dirops is not None and self.dirops.naming(parent_inode, name):
            await self._settle(parent_inode)  # a change of this very name is on its way: the daemon has it first
        elif self.writeback is not None and self.writeback.busy(parent_inode):
            # files closed here wait to be sent in this directory: the daemon's answer (the size the
            # kernel reads up to) must include them (a name the kernel forgot, asked again)
            await self._settle(parent_inode)
            again = self._fast_lookup(parent_inode, name, ctx)  # sent and held now: memory answers
            if again.__class__ is Failed:
                raise FuseError(again)
            if again is not _SLOW:
                return again
        previous = self._last_lookup.get(ctx.pid)
        # open information costs the daemon a little: ask for it unless this process
        # looked its last file up without opening it (``du`` and ``find`` do that)
        want_open_info = previous is None or previous[1]
        walking = previous is not None and previous[1]  # it opened what it looked up before: a reader walking its files
        if walking:
            hint = self.hints.get(parent_inode, name)
            if hint is not None:
                self.data.fetch_soon(Fetch.hinted(hint))  # beside the lookup, which decides whether it is used (dir_hints.py)
                await trio.lowlevel.checkpoint()  # let it send first: its round trip is the longer one (a disk read)
        stamp = self.kcache.stamp()
        callback = not self.dataset and self.kcache.callbacks_possible
        try:
            rsp = await self.meta.call(
                p.LookupReq(parent=parent_inode, name=name, open_info=want_open_info, session_id=self.meta.session_id,
                            callback=callback)
            )
        except StripefsError as exc:
            if exc.code == ErrorCode.NOT_FOUND:
                self.hints.forget(parent_inode, name)
            raise
        ino = rsp.attr.ino
        with self.lock:  # what the reader thread's fast paths read
            self._record_lookup(ctx.pid, ino, rsp.attr)
            cacheable, held = self._lookup_held(stamp, parent_inode, name, rsp, _call_now)
            if isinstance(rsp, p.OpenRsp):
                if not self.kcache.changed_since(stamp, ino, as_of=rsp.callback):  # else it may predate a commit here (_ask_open)
                    self._open_info[ino] = (time.monotonic(), rsp)
                if self.dataset and cacheable:
                    self._keep_dataset_info(rsp)
        if isinstance(rsp, p.OpenRsp):
            self.hints.learn(parent_inode, name, rsp)
            if walking:
                small = Fetch.small_file(rsp)
                if small is not None:
                    self.data.fetch_soon(small)  # fetch while the kernel sends OPEN and READ
                if self.hints.should_list(parent_inode):
                    self.data.nursery.start_soon(self.hints.list_dir, self.meta, self.data.nodes, parent_inode, name=f"hints-{parent_inode}")
        self.kcache.remember(parent_inode, name, ino)
        return self._entry(rsp.attr, cacheable=cacheable, held=held)

    def _fast_getattr(self, inode, ctx=None):
        self._fast_failed(inode)
        if self.kcache.healthy:
            # the kernel asks again at the end of every whole-file read (a read past its
            # i_size); what a listing or lookup said is still true unless the feed said otherwise
            # (dataset mode), or than the daemon waits for this mount before changing it (callbacks)
            attr = self._held_long(inode)
            if attr is not None:
                return self._encoded(attr, self._attr_bytes, _attr_out_bytes)
            known = self.kcache.dir_attrs.get(inode)  # what this mount's last change there left
            if known is not None:
                return self._attr_out(known)
            written = self._written_back_attr(inode) or self._written_attr(inode)  # a stat right after a close
            if written is not None:
                return written
        return _SLOW

    def _lane_getattr(self, inode: int) -> bytes | None:
        """(reader thread, under ``lock``) GETATTR's reply body for the session's GETATTR lane
        (client/fuse/session.py): ``_fast_getattr``'s first answer, the attributes held long in
        their wire form, or None (every other answer, and a refused create's error, take the
        ordinary way). The warm file's one request on the default mount (docs/design.md, "What a
        warm sample still sends on the default mount"); and ``_fast_getattr``'s second answer, the
        attributes a change of a directory left (``dir_attrs``): the GETATTR the kernel sends of
        a directory after every create, mkdir or unlink in it (default_permissions, after
        fuse_dir_changed; docs/design.md, "Tenth round"), encoded here each time (every change
        made here replaces them)."""
        d = self.dirops
        if not self.kcache.healthy or (d is not None and d.failed):
            return None
        attr = self._held_long(inode)
        if attr is not None:
            return self._encoded(attr, self._attr_bytes, _attr_out_bytes)
        known = self.kcache.dir_attrs.get(inode)
        return None if known is None else encode_attr_out(*self._attr_out(known))

    def _written_attr(self, inode: int) -> tuple[Attr, float] | None:
        """(Closes that send nothing) GETATTR's answer for a file written here, its session not
        committed yet: its size and the time of its last write, as its commit will record them, held
        for no time. Only while no other mount can change the file without this one's commit first
        (``OpenFile.marked``: its write mark, or the hold of the directory it was created in)."""
        if not self.silent_close:
            return None
        of = self.files.get(inode)
        if of is None or not of.marked or of.write_error is not None or not _written(of) or of.committing:
            return None  # (committing: its session's mtime is the commit's now; the handler waits for it)
        mtime = of.mtime_ns or of.attr.mtime_ns
        attr = msgspec.structs.replace(of.attr, size=of.size, mtime_ns=mtime, ctime_ns=max(of.attr.ctime_ns, mtime))
        return self._attr_out(attr, cacheable=False)

    def _held_long(self, inode: int) -> p.Attr | None:
        """(While the feed is healthy) a file's attributes that stay true until the mount hears
        otherwise: dataset mode, what the feed keeps; default mode, a file held under a callback
        (the daemon waits for this mount before changing it), unless written here."""
        if self.dataset:
            known = self._dataset_info.get(inode)
            return known.attr if known is not None else None
        of = self.files.get(inode)
        if of is not None and _written(of):
            return None  # written here: the handler asks
        wb = self.writeback
        if wb is not None and wb.holds(inode):
            return None  # closed here, its data not sent yet: what the create's answer held is old
        return self._held_attr(inode)

    def _written_back_attr(self, inode: int) -> tuple[Attr, float] | None:
        """(While the feed is healthy) GETATTR's answer for a file closed here and waiting in the
        write-back (client/write_back.py ``attr_of``): the size and mtime its commit will give, held
        for no time. The commit's answer replaces it; its ctime is the daemon's (as an NFS
        client's attributes after a flush), the rest is the same."""
        wb = self.writeback
        if wb is None or not self.kcache.healthy:
            return None
        attr = wb.attr_of(inode)
        return self._attr_out(attr, cacheable=False) if attr is not None else None

    def _encoded(self, attr: p.Attr, cache: dict, encode) -> Encoded:
        """An answer for ``attr`` held long (``_entry(attr, held=True)``) in its wire form
        (``encode``), kept in ``cache``: encoded the first time, then a dict get. Keyed by the Attr
        itself (the feed, a lookup or a listing replaces it, never changes it) and the size
        answered (a file open here may be longer), so a changed file is never answered from old
        bytes; only called while the feed is healthy, so the timeouts are always ``cache_timeout``."""
        size = self._size_here(attr)
        hit = cache.get(attr.ino)
        if hit is not None and hit[0] is attr and hit[1] == size:
            return hit[2]
        if encode is encode_entry and self.kcache.healthy:  # (both timeouts cache_timeout: one pack)
            encoded = Encoded(encode_held_entry(attr, size, self.cache_timeout, BLKSIZE))
        else:
            encoded = Encoded(encode(self._entry(attr, held=True)))
        cache[attr.ino] = (attr, size, encoded)
        return encoded

    async def getattr(self, inode, ctx=None):
        # what the mount knows was answered by _fast_getattr already
        await self._settle(inode)
        of = self.files.get(inode)
        if self.silent_close and of is not None and of.committing:
            async with of.commit_lock:  # a commit of this mount's in flight (closes that send nothing): its
                pass  # answer, not the daemon's attributes from before it (a stat right after a close)
        if self.writeback is not None and self.kcache.healthy:
            attr = self._held_long(inode)  # a file just written back here: its commit's answer is held
            if attr is not None:
                return self._attr_out(attr)
        return await self._attr_reply(p.GetattrReq(ino=inode, session_id=self.meta.session_id))

    async def fsyncdir(self, fh, datasync):
        """The creates answered here in this directory are durable once this returns."""
        await self._settle(fh)

    async def setattr(self, inode, attr, fields, fh, ctx):
        self._writable()
        await self._settle(inode)
        self._open_info.pop(inode, None)  # whatever a lookup said before this change is old now
        self._held_info.pop(inode, None)
        result = None
        if fields.update_size:
            of = self.files.get(inode)
            if of is not None and self.per_inode and inode in self._inode_handles:
                of, _ = await self._inode_file(inode, ctx, write=True)  # (no-open: an open(O_TRUNC) too)
            if of is None:
                # not open here: a short-lived state just for the truncate (the
                # daemon's open set forgets it at the next session heartbeat)
                rsp = await self.meta.call(p.OpenReq(ino=inode, session_id=self.meta.session_id, write=True))
                self.data.nodes.learn(rsp.nodes)
                of = OpenFile(inode, rsp.attr, rsp.layout, {c.index: c for c in rsp.chunks})
            result = await self.data.truncate(of, attr.st_size)
        changes = dict(
            mode=stat.S_IMODE(attr.st_mode) if fields.update_mode else None,
            uid=attr.st_uid if fields.update_uid else None,
            gid=attr.st_gid if fields.update_gid else None,
            atime_ns=attr.st_atime_ns if fields.update_atime else None,
            mtime_ns=attr.st_mtime_ns if fields.update_mtime else None,
        )
        if result is None or any(v is not None for v in changes.values()):
            result = (await self._change(p.SetattrReq(ino=inode, **changes), (inode,))).attr
        return self._attr_out(result)

    async def readlink(self, inode, ctx):
        rsp = await self.meta.call(p.ReadlinkReq(ino=inode))
        return rsp.target

    async def mknod(self, parent_inode, name, mode, rdev, ctx):
        request = p.MknodReq(parent=parent_inode, name=name, mode=mode, rdev=rdev, uid=ctx.uid, gid=ctx.gid)
        return await self._new_name(parent_inode, name, request)

    def _fast_mkdir(self, parent_inode, name, mode, ctx):
        with self.lock:
            return (None if self.dataset else self._mkdir_here(parent_inode, name, mode, ctx)) or _SLOW

    async def mkdir(self, parent_inode, name, mode, ctx):
        self._writable()
        request = p.MkdirReq(parent=parent_inode, name=name, mode=mode, uid=ctx.uid, gid=ctx.gid,
                             session_id=self.meta.session_id, callback=self.kcache.callbacks_possible and not self.dataset)
        return await self._new_name(parent_inode, name, request)

    async def symlink(self, parent_inode, name, target, ctx):
        request = p.SymlinkReq(parent=parent_inode, name=name, target=target, uid=ctx.uid, gid=ctx.gid)
        return await self._new_name(parent_inode, name, request)

    async def link(self, inode, new_parent_inode, new_name, ctx):
        entry = await self._new_name(new_parent_inode, new_name, p.LinkReq(ino=inode, new_parent=new_parent_inode, new_name=new_name))
        with self.lock:  # its link count changed: what a lookup held of it is old (as setattr's)
            self._held_info.pop(inode, None)
        return entry

    def _fast_unlink(self, parent_inode, name, ctx):
        with self.lock:
            return None if not self.dataset and self._unlink_here(parent_inode, name) else _SLOW

    async def unlink(self, parent_inode, name, ctx):
        self._writable()
        await self._change(p.UnlinkReq(parent=parent_inode, name=name), (parent_inode,))
        self._name_gone(parent_inode, name)
        self.kcache.name_gone(parent_inode, name)

    def _fast_rmdir(self, parent_inode, name, ctx):
        with self.lock:
            return None if not self.dataset and self._rmdir_here(parent_inode, name) else _SLOW

    async def rmdir(self, parent_inode, name, ctx):
        self._writable()
        removed = self.kcache.lookup_known(parent_inode, name) or 0
        await self._change(p.RmdirReq(parent=parent_inode, name=name), (parent_inode, removed))
        self._name_gone(parent_inode, name)
        self.kcache.name_gone(parent_inode, name)
        self._names_complete.pop(removed, None)

    def _fast_rename(self, parent_inode_old, name_old, parent_inode_new, name_new, flags, ctx):
        with self.lock:
            renamed = not self.dataset and self._rename_here(parent_inode_old, name_old, parent_inode_new, name_new, flags)
            return None if renamed else _SLOW

    async def rename(self, parent_inode_old, name_old, parent_inode_new, name_new, flags, ctx):
        self._writable()
        # a directory moved changes its own ctime and "..", one replaced its nlink
        moved = (self.kcache.lookup_known(parent_inode_old, name_old) or 0, self.kcache.lookup_known(parent_inode_new, name_new) or 0)
        request = p.RenameReq(parent_old=parent_inode_old, name_old=name_old, parent_new=parent_inode_new, name_new=name_new, flags=flags)
        await self._change(request, (parent_inode_old, parent_inode_new, *moved))
        self._attrs_changed_here(*moved)
        exchange = flags & RENAME_EXCHANGE_FLAG  # an exchange keeps both names
        if exchange:  # (each name now names the other inode)
            self.listings.drop(parent_inode_old)
            self.listings.drop(parent_inode_new)
        if not exchange:
            self._name_gone(parent_inode_old, name_old)
            self._name_made(parent_inode_new, name_new)
        self.kcache.name_gone(parent_inode_old, name_old)
        if not exchange and moved[0] and self._names_of_dir(parent_inode_new) is not None:
            # this mount holds every name of the new directory: the moved name stays true until it
            # hears otherwise, so the kernel keeps it, and an unlink of it is answered here
            # (_known_here) without a LOOKUP first
            self.kcache.remember(parent_inode_new, name_new, moved[0])
            return
        # the kernel keeps the moved name as long as the old one was cached, maybe under a callback
        # that covered the old name only: it asks again
        self.kcache.drop_name(parent_inode_new, name_new)
        self.kcache.name_gone(parent_inode_new, name_new)

    async def opendir(self, inode, ctx):
        return self._fast_opendir(inode, ctx)  # (the wrapper's fast path answers first, always)

    def _fast_opendir(self, inode, ctx):
        """OPENDIR, on the reader thread: the handle is the inode. While this mount holds every
        name of the directory (a directory callback, the feed healthy: ``_names_of_dir``), the
        kernel keeps its listing (FOPEN_CACHE_DIR) from one open to the next (FOPEN_KEEP_CACHE),
        and a warm ``ls`` or ImageFolder walk sends no READDIR. The kernel checks the kept listing
        at each listing's start (fs/fuse/readdir.c): a change made through this mount bumps the
        directory's version; one made elsewhere recalls the callback first, and its change event
        invalidates the directory's inode, whose pages hold the listing. Otherwise each open asks
        the daemon, and the kernel keeps nothing."""
        if self._names_of_dir(inode) is not None:
            return Opened(inode, OpenFlag.KEEP_CACHE | OpenFlag.CACHE_DIR)
        return Opened(inode)

    def _fast_readdir(self, fh, offset, buf):
        """READDIR(PLUS) on the reader thread from the listing kept of directory ``fh``
        (client/dir_listings.py) where it may answer; else the daemon is asked (``readdir``)."""
        listing = self.listings.get(fh)
        if listing is None or not self.kcache.healthy:
            return _SLOW
        # held whole since the listing came (the default mount): another mount's change waits for
        # this one to give the callback up, which drops the grant; a change made here drops the
        # listing. Else the feed says whether the directory changed since the listing was asked
        held = (not self.dataset and listing.dir_grant >= 0 and self._names_of_dir(fh) is not None
                and self.kcache.grants.get(("dir", fh)) == listing.dir_grant)
        if not held and self.kcache.changed_since(listing.stamp, fh):
            return _SLOW
        if offset == 0:
            # a new listing: only what nothing could change unseen (a dataset mount: the feed; the
            # default mount: the directory held whole)
            if not (self.dataset or held):
                return _SLOW
        elif not (self.dataset or held) and time.monotonic() - listing.asked > CONTINUE_S:
            return _SLOW
        first = listing.page(offset)
        if first is None:
            return _SLOW
        self._fill(fh, listing, first, buf)
        return None

    def _fill(self, fh: int, listing: Listing, first: int, buf) -> None:
        """``listing``'s entries from index ``first`` into ``buf`` until it is full, from their
        wire form kept with the listing. A READDIRPLUS entry carries the name's entry only where
        its attributes are known true: a file's held (``_held_long``), a directory's as the
        listing or this mount's last change there left them, unless the feed or a change made
        here since says otherwise (as the kernel's cache would have kept them); any other is a
        zero entry (nodeid 0: the kernel lists the name and makes no inode; a stat of it then
        looks it up)."""
        records, entries = listing.records(), listing.entries
        if not buf.plus:
            add = buf.add_record
            for k in range(first, len(records)):
                if not add(records[k]):
                    return
            return
        if first >= len(records):
            return  # the end: an empty page (the kernel's EOF)
        if self.kcache.healthy and self._fill_again(fh, listing, first, buf):
            return
        room = buf.room()
        if not self.kcache.healthy:  # nothing known true: every name a zero entry
            parts, size = [], ENTRY_OUT_SIZE
            add = parts.append
            for k in range(first, len(records)):
                record = records[k]
                room -= size + len(record)
                if room < 0:
                    break
                add(ZERO_ENTRY)
                add(record)
            buf.extend(parts)
            return
        if self._plus_size == 0 and first == 0:
            self._plus_size = room  # the kernel's READDIRPLUS size (the same each time): ``_page_ahead``'s
        page = self._plus_page(fh, listing, first, room)
        buf.extend((page.data,))
        if page.named:
            self.kcache.remember_all(page.keys, page.named)  # readdirplus: the kernel now holds these names
        if page.inos:
            self._keep_page(listing, (first, room), page)

    def _plus_page(self, fh: int, listing: Listing, first: int, room: int) -> _PlusPage:
        """(Feed healthy, under ``lock``) The READDIRPLUS page of ``listing`` from index ``first`` that
        fits ``room`` bytes: each entry's answer and record gathered, joined once. ``inos`` is empty
        where the page may not be kept (it lists a directory, whose answer is not a held file's)."""
        parts, keys, named = [], [], []
        add, size = parts.append, ENTRY_OUT_SIZE
        records, entries = listing.records(), listing.entries
        plus, held_long, encoded, is_dir = listing.plus, self._held_long, self._encoded, stat.S_ISDIR
        inos, dirs = [], False
        for k in range(first, len(records)):
            record = records[k]
            room -= size + len(record)
            if room < 0:
                break
            entry = entries[k]
            attr = entry.attr
            ino = attr.ino
            inos.append(ino)
            if is_dir(attr.mode):
                dirs = True
                attr = self.kcache.dir_attrs.get(ino)
                if attr is None and not (self.kcache.changed_since(listing.stamp, ino)
                                         or self.listings.changed_here_since(listing, ino)):
                    attr = entry.attr
            else:
                attr = held_long(ino)
            if attr is None:
                add(ZERO_ENTRY)
            else:
                add(encoded(attr, plus, encode_entry))
                keys.append((fh, entry.name))
                named.append(ino)
            add(record)
        data = b"".join(parts)
        held = self._held_map().get
        return _PlusPage([] if dirs else inos, [] if dirs else list(map(held, inos)), data, keys, named)

    @staticmethod
    def _keep_page(listing: Listing, key: tuple[int, int], page: _PlusPage) -> None:
        if key in listing.pages or len(listing.pages) < PAGES_KEPT:
            listing.pages[key] = page

    def _page_ahead(self, fh: int) -> None:
        """(Feed healthy) The first READDIRPLUS page of directory ``fh``'s listing, just kept, made
        now and kept with it (not given to the kernel: no name is remembered), so the kernel's
        READDIRPLUS of it is answered as it is on the reader thread (``_fill_again``, under the same
        checks as any page kept: every file's held object the same, none open here or in the
        write-back). A listing asked by the daemon path (``readdir``'s own, one listed ahead) left
        no page, and a cold walk after drop_caches made every page anew on the reader thread (a
        quarter of its CPU there)."""
        size = self._plus_size
        with self.lock:
            listing = self.listings.get(fh)
            if not size or listing is None or listing.after or not self.kcache.healthy or (0, size) in listing.pages:
                return
            page = self._plus_page(fh, listing, 0, size)
            if page.inos:
                self._keep_page(listing, (0, size), page)

    def _held_map(self) -> OrderedDict:
        """What the mount holds of files, as a kept READDIRPLUS page compares it (``_fill_again``)."""
        return self._dataset_info if self.dataset else self._held_info

    def _fill_again(self, fh: int, listing: Listing, first: int, buf) -> bool:
        """(Feed healthy) Answer a READDIRPLUS page of files answered before (``Listing.pages``) with
        its bytes as they were, if every answer in it would be made the same now: what the mount
        holds of each file is the same (equal, one pass in C) and none of them is open here or
        waits in the write-back (what ``_held_long`` and ``_size_here`` would look at). A cold
        walk's page of 100 held files then costs a few checks in C, not an answer made per entry
        (bench/fuse_session_cpu.py --only-hot-path, "readdirplus" rows). False: made anew."""
        page = listing.pages.get((first, buf.room()))
        if page is None:
            return False
        inos = page.inos
        held = self._held_map().get
        if list(map(held, inos)) != page.held:
            return False
        wb = self.writeback
        if any(map(self.files.__contains__, inos)) or (wb is not None and any(map(wb.holds, inos))):
            return False
        buf.extend((page.data,))
        if page.named:
            self.kcache.remember_all(page.keys, page.named)
        return True

    async def readdir(self, fh, start_id, buf):
        """Entries of directory ``fh`` (its inode) after cookie ``start_id`` into ``buf`` (a
        ``replies.DirentBuffer``: READDIRPLUS entries carry a LOOKUP's answer) until it is full.
        Each answer of the daemon (up to 1,000 entries) is kept (``self.listings``): the next pages
        of this listing are answered from it (``_fast_readdir``)."""
        await self._settle(fh)
        ahead = self._listing_ahead.get(fh) if not start_id else None
        if ahead is not None:  # being listed ahead (``_list_ahead``): its answer, not a second ReaddirReq
            with trio.move_on_after(self.op_timeout):
                await ahead.wait()
            with self.lock:
                if self._fast_readdir(fh, start_id, buf) is not _SLOW:
                    return
        after = start_id
        while True:
            rsp, stamp, stale_dir, held_ok = await self._list(fh, after)
            if self.dataset and not after:
                self._list_subdirs_ahead(rsp)
            if after == start_id and not stale_dir:
                # answered from the listing just kept where the reader thread would answer from it
                # with the same entries (READDIRPLUS pages made and kept with it: ``_fill``), so a cold
                # walk after drop_caches finds this page made (``_fill_again``), not every entry to encode
                with self.lock:
                    kept = self.listings.get(fh)
                    if (kept is not None and kept.stamp == stamp and kept.after == after
                            and self._held_whole(rsp, stamp) and self._fast_readdir(fh, start_id, buf) is not _SLOW):
                        return
            for entry in rsp.entries:
                ino = entry.attr.ino
                cacheable = not (stale_dir or self.kcache.changed_since(stamp, ino))
                held = held_ok and stat.S_ISREG(entry.attr.mode) and cacheable
                if not buf.add(entry.name, entry.cookie, ino, entry.attr.mode,
                               self._entry(entry.attr, cacheable=cacheable, held=held) if buf.plus else None):
                    return
                self.kcache.remember(fh, entry.name, ino)  # readdirplus: the kernel now holds this name
            if not rsp.more or not rsp.entries:
                return
            after = rsp.entries[-1].cookie

    def _held_whole(self, rsp: p.ReaddirRsp, stamp: int) -> bool:
        """(Under ``lock``) Whether ``_fill`` answers every entry of ``rsp`` with its attributes, as
        the loop of ``readdir`` does: none changed since ``stamp`` (the feed), every one not a
        directory held (``_held_long``). Otherwise ``_fill`` would answer a zero entry (nodeid 0:
        the kernel makes no inode, and an open of the name is a LOOKUP) where the loop gives the
        entry for no time: a file changed while its listing was asked (cluster test_thread_reads's
        listed directory on a loaded machine: each read then came after a LOOKUP's fetch ahead)."""
        changed, held_long, is_dir = self.kcache.changed_since, self._held_long, stat.S_ISDIR
        for entry in rsp.entries:
            ino = entry.attr.ino
            if changed(stamp, ino) or not (is_dir(entry.attr.mode) or held_long(ino) is not None):
                return False
        return True

    async def _list(self, fh: int, after: int):
        """One ``ReaddirReq`` of directory ``fh`` after cookie ``after``, and what its answer leaves
        in the mount (open information, callbacks, held files, directory attributes, the listing
        kept): ``(rsp, stamp, stale_dir, held_ok)``, the stamp it was asked at, whether the feed
        reported a change of the directory meanwhile, whether its files are held."""
        stamp, generation, since = self.kcache.stamp(), self.listings.generation, self.kcache.dir_attrs.stamp()
        callback = not self.dataset and self.kcache.callbacks_possible
        # open information with the listing: a dataset mount's for every file; the default
        # mount's for its small files (one chunk: a data set's samples), kept while it holds them
        # under the callback the listing asks, so the first read of a listed file needs no OpenReq
        rsp = await self.meta.call(p.ReaddirReq(ino=fh, after=after, limit=1000, open_info=self.dataset or callback,
                                                small_only=not self.dataset,
                                                session_id=self.meta.session_id, callback=callback))
        stale_dir = self.kcache.changed_since(stamp, fh)
        opened = {}
        for info in rsp.files:  # opens of listed files need no round trip
            if not (stale_dir or self.kcache.changed_since(stamp, info.attr.ino)):
                if self.dataset:
                    self._keep_dataset_info(info)
                else:
                    opened[info.attr.ino] = info
        if rsp.callback >= 0:  # granted on every file listed, also those the kernel has no room for now
            for entry in rsp.entries:
                if stat.S_ISREG(entry.attr.mode):
                    self.kcache.granted(entry.attr.ino, fh, entry.name, rsp.callback)
        if rsp.dir_callback >= 0:  # the whole directory: lookups of other names need not ask
            self._all_names(fh, (e.name for e in rsp.entries), rsp.dir_callback)
        held_ok = rsp.callback >= 0 and self.kcache.healthy
        at = rsp.callback if rsp.callback >= 0 else rsp.dir_callback  # the listing's position (-1: none)
        with self.lock:  # what the reader thread's fast paths read
            if at > 0 and not stale_dir and self.kcache.healthy:  # its directories' GETATTRs answered here
                self.kcache.dir_attrs.listed((e.attr for e in rsp.entries if stat.S_ISDIR(e.attr.mode)
                                              and not self.kcache.changed_since(stamp, e.attr.ino)), at, since)
            for entry in rsp.entries:
                ino = entry.attr.ino
                if held_ok and stat.S_ISREG(entry.attr.mode) and not (stale_dir or self.kcache.changed_since(stamp, ino)):
                    self._keep_held(ino, opened.get(ino) or entry.attr)
            if not stale_dir and (rsp.entries or not after):  # (an empty tail keeps what it follows)
                self.listings.keep(fh, Listing(after, list(rsp.entries), not rsp.more, stamp, rsp.dir_callback),
                                   generation)
        return rsp, stamp, stale_dir, held_ok

    def _list_subdirs_ahead(self, rsp: p.ReaddirRsp) -> None:
        """(Dataset mount) The subdirectories of a directory just listed from its start are listed
        too, ahead of the kernel asking (an index walk: ImageFolder's class folders), ``LIST_AHEAD``
        at a time in their listing's order, at most ``AHEAD_QUEUED`` waiting, each kept as the
        kernel's own READDIR would keep it; the walk's READDIRPLUS of each is then a page from
        memory on the reader thread, or waits for the listing already asked (``readdir``). A fresh
        dataset mount's cold walk was one ReaddirReq round trip in series per directory. Only
        subdirectories with no listing kept."""
        queue, asking = self._ahead_queue, self._listing_ahead
        for entry in rsp.entries:
            ino = entry.attr.ino
            if len(queue) >= AHEAD_QUEUED:
                break
            if stat.S_ISDIR(entry.attr.mode) and ino not in asking and self.listings.get(ino) is None:
                queue.append(ino)
        self._start_ahead()

    def _start_ahead(self) -> None:
        queue, asking = self._ahead_queue, self._listing_ahead
        while queue and len(asking) < LIST_AHEAD:
            ino = queue.popleft()
            if ino in asking or self.listings.get(ino) is not None:
                continue  # the kernel asked it meanwhile, or it is being listed
            asking[ino] = trio.Event()
            try:
                self.data.nursery.start_soon(self._list_ahead, ino, name=f"list-ahead-{ino}")
            except RuntimeError:  # the nursery is closed: the mount is stopping
                asking.pop(ino).set()
                queue.clear()
                return

    async def _list_ahead(self, ino: int) -> None:
        try:
            with trio.move_on_after(self.op_timeout):
                await self._list(ino, 0)
            self._page_ahead(ino)
        except Exception as exc:  # the kernel's own READDIR asks again and reports it
            log.debug("listing directory %d ahead failed: %s", ino, exc)
        finally:
            self._listing_ahead.pop(ino).set()
            self._start_ahead()

    async def releasedir(self, fh):
        pass

    def _fast_releasedir(self, fh):
        return None  # nothing is kept per open directory (its handle is its inode): on the reader thread

    async def statfs(self, ctx):
        rsp = await self.meta.call(p.StatfsReq())
        bsize = rsp.block_size
        blocks = rsp.total_bytes // bsize
        # df's "used" is blocks - bfree: what stripefs stores, not what other programs use on those disks
        used = rsp.used_bytes if rsp.used_bytes >= 0 else rsp.total_bytes - rsp.free_bytes
        bfree = max(0, blocks - -(-used // bsize))
        return Statfs(blocks=blocks, bfree=bfree, bavail=rsp.free_bytes // bsize, files=rsp.files + bfree // 16,
                      ffree=bfree // 16, bsize=bsize, namelen=rsp.name_max, frsize=bsize)

    async def setxattr(self, inode, name, value, ctx):
        if name in (p.PREFETCH_XATTR, p.PREFETCH_SHM_XATTR):
            self._prefetch(inode, value, name == p.PREFETCH_SHM_XATTR, ctx)
            return
        self._writable()
        self._forget_killpriv(inode)
        await self._change(p.SetxattrReq(ino=inode, name=name, value=value), (inode,))  # its ctime

    def _prefetch(self, inode: int, paths: bytes, shm: bool, ctx) -> None:
        """A prefetch request, by either channel (setxattr, or the ioctl a read-only mount allows)."""
        if self.prefetcher is None:
            raise FuseError(errno.ENOTSUP)
        self.prefetcher.submit(inode, paths, shm=shm and self._shm_copies, user=ctx.uid)

    def _fast_ioctl(self, inode, cmd, data, ctx):
        """Every ioctl but ours is answered at once: a buffered ``open()`` asks isatty() of each file."""
        if cmd not in SERVED_IOCTLS:
            raise FuseError(errno.ENOTTY)  # not a terminal, no such ioctl (the mount's session answers
            # these itself: client/mount.py gives it SERVED_IOCTLS)
        return FAST_PATH_MISS

    async def ioctl(self, inode, cmd, data, ctx):
        """Prefetch requests (``protocol.PREFETCH_IOC``): the channel a read-only mount allows."""
        if self.prefetcher is None:
            raise FuseError(errno.ENOTSUP)  # before the buffer's check, as setxattr answers
        (length,) = struct.unpack_from("<I", data) if len(data) >= 4 else (-1,)
        if not 0 <= length <= len(data) - 4:
            raise FuseError(errno.EINVAL)
        self._prefetch(inode, bytes(data[4:4 + length]), cmd == p.PREFETCH_SHM_IOC, ctx)
        return 0

    def _fast_getxattr(self, inode, name, ctx):
        if name.startswith(p.JOB_XATTR) and self.jobs is not None:  # a training job's report (client/jobs.py)
            if not self.jobs.report(ctx.pid, name):
                raise FuseError(errno.EINVAL)
            return b"ok"
        if name == KILLPRIV_XATTR:
            # asked before every write(2) to a FUSE file (the kernel sets no S_NOSEC on FUSE inodes):
            # for a file this mount made or already asked, the absence it knows is answered on the
            # reader thread, not in a task (one of a copied file's requests: docs/design.md)
            of = self.files.get(inode)
            if of is not None and of.open_count and of.killpriv_absent:
                raise FuseError(errno.ENODATA)
            return _SLOW
        return self._mount_xattr(inode, name) if self._is_mount_xattr(name) else _SLOW

    @property
    def _shm_copies(self) -> bool:
        """Whether prefetched files are also copied to shared memory for stripefs.torch.read_file.
        Not on a dataset mount: there a prefetched file is pushed into the kernel's page cache
        and then read with no request at all (no-open), while read_file's copy costs a getxattr
        per sample (bench/dataloader.py: 0.11x the local disk warm, against 1.11x for the plain
        read); read_file then reads through the mount."""
        return not self.dataset

    def _is_mount_xattr(self, name: bytes) -> bool:
        return name == p.SHM_COPY_XATTR or (self.prefetcher is not None and name in (p.PREFETCH_XATTR, p.SHM_DIR_XATTR))

    def _mount_xattr(self, inode: int, name: bytes) -> bytes:
        """The mount's own extended attributes (prefetch counters, shared memory)."""
        if name == p.PREFETCH_XATTR and self.prefetcher is not None:
            return self.prefetcher.report().encode()
        if name == p.SHM_DIR_XATTR and self.prefetcher is not None:
            return os.fsencode(self.prefetcher.shm.dir) if self.prefetcher.shm and self._shm_copies else b""
        if name == p.SHM_COPY_XATTR:
            # the kernel checked that the caller may read this file (client/shm_cache.py)
            attr = self._current_attr(inode)
            found = (self.prefetcher.shm.lookup(inode, attr)
                     if attr is not None and self.prefetcher is not None and self.prefetcher.shm else None)
            if found is not None:
                return found
        raise FuseError(errno.ENODATA)

    async def getxattr(self, inode, name, ctx):
        # the mount's own attributes were answered by _fast_getxattr already
        of = self.files.get(inode) if name == KILLPRIV_XATTR else None
        if of is not None and of.open_count and of.killpriv_absent:
            raise FuseError(errno.ENODATA)  # asked before every write: answered here (OpenFile.killpriv_absent)
        try:
            rsp = await self.meta.call(p.GetxattrReq(ino=inode, name=name))
        except StripefsError as exc:
            if of is not None and of.open_count and exc.code == ErrorCode.NO_ATTR:
                of.killpriv_absent = True
            raise
        return rsp.value

    def _current_attr(self, inode: int) -> p.Attr | None:
        """The file's attributes as of after the request began, or None. Default mode: the
        LOOKUP of this request's own path walk (regular-file names are cached 0 s: it asked the
        daemon; close-to-open), if younger than OPEN_INFO_FRESH_S. Dataset mode: what the
        feed keeps true (its bound)."""
        if self.dataset and self.kcache.healthy:
            known = self._dataset_info.get(inode)
            if known is not None:
                return known.attr
        held = self._held_attr(inode)
        if held is not None:  # the daemon waits for this mount before changing it (callbacks)
            return held
        entry = self._looked_up.get(inode)
        if entry is not None and entry[0] >= time.monotonic() - OPEN_INFO_FRESH_S:
            return entry[1]
        return None

    async def listxattr(self, inode, ctx):
        rsp = await self.meta.call(p.ListxattrReq(ino=inode))
        return rsp.names

    async def removexattr(self, inode, name, ctx):
        self._writable()
        self._forget_killpriv(inode)
        await self._change(p.RemovexattrReq(ino=inode, name=name), (inode,))  # its ctime

    def _forget_killpriv(self, inode: int) -> None:
        of = self.files.get(inode)
        if of is not None:
            of.killpriv_absent = False

    # ------------------------------------------------------------------ files

    def _new_handle(self, of: OpenFile) -> int:
        of.killpriv_absent = False  # every open asks the daemon afresh (close-to-open)
        with self.lock:
            fh = self._next_fh
            self._next_fh += 1
            of.open_count += 1
            self.handles[fh] = of  # (its ReadStream is made at its first read: ``_stream``)
        return fh

    def _stream(self, fh: int) -> tuple[OpenFile, ReadStream]:
        """Handle ``fh``'s file and read pattern, made at the first read: most handles of a busy
        mount are creates that never read, and each object a create keeps is the cyclic collector's
        to walk again and again (common/gc_tuning.py)."""
        with self.lock:  # (a handle dropped on the reader thread meanwhile: KeyError, no stream left behind)
            of = self.handles[fh]
            stream = self.streams.get(fh)
            if stream is None:
                stream = self.streams[fh] = ReadStream()
        return of, stream

    def _drop_handle(self, fh: int) -> OpenFile:
        """Forget handle ``fh``; its file's state too when no other handle holds it (its own
        unsent data, if any, is the caller's to send first: ``release``)."""
        with self.lock:
            of = self.handles.pop(fh)
            self.streams.pop(fh, None)
            self._pt_closed(fh)
            of.open_count -= 1
            if of.open_count == 0 and not of.has_unflushed and not self._uncommitted(of) and self.files.get(of.ino) is of:
                del self.files[of.ino]  # (no CloseReq: see release)
        return of

    def _record_open(self, rsp: p.OpenRsp, fresh_attrs: bool, raced: bool = False) -> tuple[OpenFile, bool, bool]:
        """Record an OpenRsp: (the file's state, whether the kernel may keep its page cache, whether
        the kernel's attributes are old). Take the handle (``_new_handle``) before anything waits.
        ``raced``: the answer may predate a change made meanwhile (``_ask_open``): a state the mount
        holds stays as it is, and the answer's epoch is not this write session's."""
        self.data.nodes.learn(rsp.nodes)
        ino = rsp.attr.ino
        with self.lock:
            of = self.files.get(ino)
            if of is None:
                of = self.files[ino] = OpenFile(ino, rsp.attr, rsp.layout, {c.index: c for c in rsp.chunks})
            elif not raced:
                of.refresh(rsp)
            if rsp.epoch and not of.epoch and not raced:
                of.epoch = rsp.epoch  # this write session's version, without an AllocEpochReq
                took_pair(of, rsp.epoch, rsp.epoch_pair)
            of.quota_max = rsp.quota_max_size
            view = (rsp.attr.mtime_ns, rsp.attr.size)
            before = self._kernel_view.get(ino)
            keep = before == view or of.has_unflushed
            if not keep:
                self._kernel_view[ino] = view
        return of, keep, not keep and before is not None and not fresh_attrs

    def _fast_open(self, inode, flags, ctx):
        """A read-only open the newest LOOKUP (default mode) or the feed-kept open information
        (dataset mode) answers: nothing to wait for. Anything else: the handler."""
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_TRUNC):
            return _SLOW
        if self.dataset:
            rsp = self._dataset_info.get(inode) or self._fresh_open_info(inode)
            if rsp is None:
                return _SLOW
            self._opening(inode, ctx)
            return _opened(self._dataset_handle(inode, rsp), True, flags)
        rsp = self._fresh_open_info(inode) or self._held(inode)
        if rsp is None:
            return _SLOW
        pt, known = self.passthrough, None
        if pt is not None and pt.active:
            key = pt.key_of_info(rsp)
            known = (rsp.attr, key)
            if pt.needs_registering(key):
                return _SLOW  # its whole file is on disk, not checked yet: that reads it (open)
            shared = self._pt_open.get(inode)
            if shared is not None and pt.backing_id(key) != shared[0]:
                return _SLOW  # passthrough opens of another version: the handler waits for their RELEASE
        self._opening(inode, ctx)
        of, keep, _ = self._record_open(rsp, fresh_attrs=True)  # the LOOKUP gave the kernel these attributes
        return self._open_answer(self._new_handle(of), of, keep, flags, known)

    def _open_answer(self, fh: int, of: OpenFile, keep: bool, flags: int, known: tuple | None = None) -> Opened:
        """OPEN's answer for handle ``fh``: on a passthrough mount, a read-only open of a version
        registered with the kernel names its backing file (client/passthrough.py); otherwise
        ``_opened``'s. The kernel lets an inode's open files be either passthrough, all with one
        backing file, or not, never both at once (fs/fuse/iomode.c: any other open fails EIO, a
        direct-I/O one too; checked on 6.18): so passthrough is given only while no other open of
        the inode here is cached, and an open that cannot share the open passthrough files' backing
        file (a write, another version) is refused ETXTBSY (``_pt_conflict``: the handler waits for
        their RELEASE first)."""
        pt = self.passthrough
        if pt is None or not pt.active:
            return _opened(fh, keep, flags)
        with self.lock:
            shared = self._pt_open.get(of.ino)
            others = of.open_count - 1 - (shared[1] if shared else 0)  # cached opens besides this one
            bid = 0
            if not flags & (_WRITING | os.O_TRUNC) and others == 0 \
                    and not (self.writeback is not None and self.writeback.holds(of.ino)):
                key = pt.key_of(of, known)  # (known: the fast path's, from the answer ``of`` took)
                bid = pt.backing_id(key)
                if bid and (shared is None or shared[0] == bid):
                    if shared is None:
                        self._pt_open[of.ino] = [bid, 1]
                    else:
                        shared[1] += 1
                    self._pt_handles[fh] = (of.ino, bid)
                    pt.opens += 1
                    return Opened(fh, _NOFLUSH | _PASSTHROUGH, bid)
                if not bid:
                    pt.want(key, of)  # its whole file, written in the background: the next open passes through
            if shared is not None:
                self._drop_handle(fh)
                log.warning("open of inode %d refused (ETXTBSY): %s while this mount has it open by passthrough "
                            "(the kernel allows no other open beside those)", of.ino,
                            "for writing" if flags & (_WRITING | os.O_TRUNC) else "another version")
                raise FuseError(errno.ETXTBSY)
        return _opened(fh, keep, flags)

    def _pt_conflict(self, of: OpenFile, flags: int) -> bool:
        """Whether an open of ``of`` with ``flags`` could not share the inode's open passthrough files."""
        pt = self.passthrough
        with self.lock:
            shared = self._pt_open.get(of.ino)
            if shared is None or pt is None:
                return False
            return bool(flags & (_WRITING | os.O_TRUNC)) or pt.backing_id(pt.key_of(of)) != shared[0]

    async def _pt_drained(self, of: OpenFile, flags: int) -> None:
        """Wait (at most ``PT_RELEASE_WAIT_S``) for a conflicting passthrough open of ``of`` to go:
        the kernel sends RELEASE after close() returns, so a reopen for writing right after a
        passthrough read is not refused for a RELEASE still on its way."""
        deadline = trio.current_time() + PT_RELEASE_WAIT_S
        while self._pt_conflict(of, flags) and trio.current_time() < deadline:
            await trio.sleep(0.005)

    def _pt_closed(self, fh: int) -> None:
        """A handle goes: one passthrough open of its inode less (under ``lock``)."""
        held = self._pt_handles.pop(fh, None)
        if held is not None:
            shared = self._pt_open.get(held[0])
            if shared is not None:
                shared[1] -= 1
                if shared[1] <= 0:
                    del self._pt_open[held[0]]

    def _held(self, inode: int) -> p.OpenRsp | None:
        """The open information of a file held under a callback, while the feed is in order."""
        known = self._held_info.get(inode) if self.kcache.healthy else None
        return known if isinstance(known, p.OpenRsp) else None

    def _held_attr(self, inode: int) -> p.Attr | None:
        """The attributes of a file held under a callback, while the feed is in order."""
        known = self._held_info.get(inode) if self.kcache.healthy else None
        return known.attr if isinstance(known, p.OpenRsp) else known

    def _opening(self, inode: int, ctx) -> None:
        if self._last_lookup.get(ctx.pid, (0,))[0] == inode:
            self._last_lookup[ctx.pid] = (inode, True)

    async def open(self, inode, flags, ctx):
        await self._settle(inode)
        self._opening(inode, ctx)
        if self.dataset:
            return await self._open_dataset(inode, flags)
        write = bool(flags & (os.O_WRONLY | os.O_RDWR))
        # a write open asks unless a lookup just answered: the epoch and the quota room are the daemon's now
        rsp = self._fresh_open_info(inode) or (None if write else self._held(inode))
        raced = False
        if rsp is None:
            listed = self._held_info.get(inode)  # held since a listing: attributes, no open information yet
            rsp, raced = await self._ask_open(inode, write)
            if isinstance(listed, p.Attr) and not write and not raced:
                self._keep_held(inode, rsp)  # the next opens need no round trip
            fresh_attrs = rsp.attr == listed
        else:
            fresh_attrs = True  # the LOOKUP just gave the kernel these attributes
        of, keep, stale_attrs = self._record_open(rsp, fresh_attrs, raced=raced)
        # The handle holds the file's state from here on, before anything below waits: a RELEASE of
        # the file's last other handle meanwhile would otherwise drop that state from ``files``, and
        # the next open would make a second one, older than this handle's writes.
        fh = self._new_handle(of)
        try:
            if self.passthrough is not None:
                if not write and not flags & os.O_TRUNC:
                    await self.passthrough.register(self.passthrough.key_of(of))  # (checks its whole file: reads it)
                await self._pt_drained(of, flags)  # (before an O_TRUNC below truncates anything)
            if stale_attrs:
                # the kernel may hold old attributes (size!): make it ask again
                await trio.to_thread.run_sync(_invalidate_attr, inode)
            if flags & os.O_TRUNC and of.size:
                # libfuse negotiates atomic O_TRUNC: the kernel sends no SETATTR, the open truncates
                with self.lock:
                    self._open_info.pop(inode, None)
                    self._held_info.pop(inode, None)
                await self.data.truncate(of, 0)
                keep = False
            if flags & os.O_TRUNC and ctx.uid != 0 and _privileges_to_kill(of.attr.mode):
                # ... and so also kills set-id bits itself, as a truncate by anyone without
                # CAP_FSETID does on ext4 and tmpfs (should_remove_suid)
                mode = stat.S_IMODE(of.attr.mode) & ~_privileges_to_kill(of.attr.mode)
                of.attr = (await self.meta.call(p.SetattrReq(ino=inode, mode=mode))).attr
                await trio.to_thread.run_sync(_invalidate_attr, inode)
        except BaseException:
            self._drop_handle(fh)  # the open failed: the kernel never learns this handle
            raise
        return self._open_answer(fh, of, keep, flags)

    async def _ask_open(self, inode: int, write: bool, mark: bool = False) -> tuple[p.OpenRsp, bool]:
        """An OpenReq's answer, and whether it raced a change of the file.

        The file may be open here already, with another handle committing: a commit (or a
        truncate) whose reply comes while this answer is on its way makes the answer older than
        this mount's state of the file, and taking its size and chunk map would undo the commit
        here (the bytes it added read as missing; an erasure-coded stripe's older version is
        deleted by then: EIO). Such an answer is asked again, up to ``OPEN_ASKS`` times; the
        last one, still raced, is taken only for what the mount does not hold (``_record_open``).
        """
        for _ in range(OPEN_ASKS):
            stamp = self.kcache.stamp()
            rsp = await self.meta.call(p.OpenReq(ino=inode, session_id=self.meta.session_id, write=write, mark=mark, pair=write))
            if not self.kcache.changed_since(stamp, inode, as_of=rsp.seq if mark else -1):  # (a mark's: as of its recall)
                return rsp, False
        return rsp, True

    async def _open_dataset(self, inode: int, flags: int) -> Opened:
        """Dataset mode: no round trip when the open information is known; the page cache always stays."""
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_TRUNC):
            raise FuseError(errno.EROFS)
        rsp = self._dataset_info.get(inode) or self._fresh_open_info(inode)
        if rsp is None:
            stamp = self.kcache.stamp()
            rsp = await self.meta.call(p.OpenReq(ino=inode, session_id=self.meta.session_id))
            if not self.kcache.changed_since(stamp, inode):
                self._keep_dataset_info(rsp)
        return _opened(self._dataset_handle(inode, rsp), True, flags)

    def _dataset_handle(self, inode: int, rsp: p.OpenRsp) -> int:
        """A new handle of ``inode`` (dataset mode), its state refreshed from ``rsp``."""
        self.data.nodes.learn(rsp.nodes)
        with self.lock:
            of = self.files.get(inode)
            if of is None:
                of = self.files[inode] = OpenFile(inode, rsp.attr, rsp.layout, {c.index: c for c in rsp.chunks})
            elif of.attr != rsp.attr:
                of.refresh(rsp)
        return self._new_handle(of)

    def _fast_create(self, parent_inode, name, mode, flags, ctx):
        with self.lock:
            return (None if self.dataset else self._create_here(parent_inode, name, mode, flags, ctx)) or _SLOW

    async def create(self, parent_inode, name, mode, flags, ctx):
        # one answered here (client/async_dirops.py) was answered by _fast_create already
        self._writable()
        stamp = self.kcache.stamp()
        try:
            rsp = await self._change(
                p.CreateReq(parent=parent_inode, name=name, mode=mode, uid=ctx.uid, gid=ctx.gid, session_id=self.meta.session_id,
                            callback=self.kcache.callbacks_possible and not self.dataset),
                (parent_inode,),
            )
        except StripefsError as exc:
            if exc.code == ErrorCode.EXISTS:
                self._names_complete.pop(parent_inode, None)  # it was there after all: ask from now on
            raise
        self._name_made(parent_inode, name)
        held = False
        if rsp.callback >= 0:  # the new file is held: a stat after its writes is answered here (_committed)
            self.kcache.granted(rsp.attr.ino, parent_inode, name, rsp.callback)
            held = self.kcache.healthy and not self.kcache.changed_since(stamp, rsp.attr.ino)
            if held:
                with self.lock:
                    self._keep_held(rsp.attr.ino, rsp.attr)
        of, _, _ = self._record_open(rsp, fresh_attrs=True)
        of.parent = parent_inode
        self._note_quota(of)
        fh = self._new_handle(of)
        of.killpriv_absent = True  # a file this request made has no extended attributes: its first WRITE asks nothing
        self.kcache.remember(parent_inode, name, rsp.attr.ino)
        return self._entry(rsp.attr, held=held), self._created(fh, flags)

    def thread_getattr(self, inode: int) -> int | None:
        """(reader thread, under ``lock``) A GETATTR miss that a plain thread may ask the daemon
        (client/thread_meta.py): the kernel cache's stamp to answer it against
        (``thread_attr_out``), or None: ``getattr`` runs in trio. Only one whose handler would
        send nothing but its GetattrReq: no create or commit here waiting for the daemon, nothing
        of it in the write-back, the file not open here (its commit, replay and size are the
        handler's)."""
        d = self.dirops
        if (d is not None and (d.unanswered or d.failed)) or (self.idle is not None and self.idle.pending()) \
                or inode in self.files or (self.writeback is not None and (self.writeback.busy(inode) or self.writeback.holds(inode))):
            return None
        return self.kcache.stamp()

    def thread_lookup(self, parent_inode: int, name: bytes, pid: int) -> tuple[int, bool] | None:
        """(reader thread, under ``lock``) A LOOKUP miss that a plain thread may ask the daemon
        (client/thread_meta.py): (the kernel cache's stamp to answer it against, whether its
        LookupReq asks a callback: ``lookup``'s rule), or None: ``lookup`` runs in trio. Only one
        whose LookupReq asks no ``open_info`` (no open information to keep, no hint or prefetch to
        start): asked by a process that did not open what it looked up last (``stat``, ``ls -l``,
        ``du``, ``find``), with nothing of this mount's own to settle first (as ``thread_getattr``:
        no change answered here waits for the daemon, so none of this very name; no files closed
        here wait in the directory). A default mount's asks a callback: the grant that comes back
        is recorded by ``thread_entry_out`` as ``lookup`` records it (``_lookup_held``)."""
        previous = self._last_lookup.get(pid)
        if previous is None or previous[1]:
            return None  # ``lookup`` asks open information for it (and may prefetch)
        d = self.dirops
        if (d is not None and (d.unanswered or d.failed)) \
                or (self.idle is not None and self.idle.pending()) \
                or (self.writeback is not None and self.writeback.busy(parent_inode)):
            return None
        return self.kcache.stamp(), not self.dataset and self.kcache.callbacks_possible

    def thread_entry_out(self, stamp: int, parent_inode: int, name: bytes, pid: int, rsp: p.AttrRsp,
                         to_trio: Callable) -> Entry:
        """(a worker thread, under ``lock``) LOOKUP's answer for the daemon's ``rsp`` (an AttrRsp: no
        open information), recorded as ``lookup`` records it: cached only if no change of the
        directory or the file was applied since ``stamp``, a grant recorded (``_lookup_held``;
        ``to_trio(fn, *args)``: runs what must run in trio there, soon)."""
        ino = rsp.attr.ino
        self._record_lookup(pid, ino, rsp.attr)
        cacheable, held = self._lookup_held(stamp, parent_inode, name, rsp, to_trio)
        self.kcache.remember(parent_inode, name, ino)
        return self._entry(rsp.attr, cacheable=cacheable, held=held)

    def _lookup_held(self, stamp: int, parent_inode: int, name: bytes, rsp: p.AttrRsp | p.OpenRsp,
                     to_trio: Callable) -> tuple[bool, bool]:
        """(under ``lock``, after ``_record_lookup``) Whether a LOOKUP answer may be cached, and held
        long under the callback it carries, in ``lookup`` and on a worker thread alike: cacheable
        unless a change of the directory or the file was applied since ``stamp`` that the answer
        does not include (one numbered at or below its grant is in it); a grant recorded even when
        not cacheable (the daemon holds it: KernelCache.record_grant), its acknowledgement part run
        in trio (``to_trio``: at once in trio, handed over from a worker thread). Under ``lock``,
        which every change applied takes, so a change is applied wholly before this (seen here) or
        after it (it ends the grant and drops the kernel's entry, which this answer reached first)."""
        ino = rsp.attr.ino
        cacheable = not self.kcache.changed_since(stamp, parent_inode, ino, as_of=rsp.callback)
        if rsp.callback < 0:
            return cacheable, False
        if self.kcache.record_grant(ino, parent_inode, name, rsp.callback):
            to_trio(self.kcache.granted_as_of, rsp.callback)
        held = cacheable and self.kcache.healthy
        if held:
            self._keep_held(ino, rsp if isinstance(rsp, p.OpenRsp) else rsp.attr)
        return cacheable, held

    def _record_lookup(self, pid: int, ino: int, attr: p.Attr) -> None:
        """(under ``lock``) What every daemon answer to a LOOKUP leaves, in ``lookup`` and on a worker
        thread (``thread_entry_out``) alike: the asking process's last lookup (not opened yet); the
        inode's open and held information dropped (only the newest lookup's answer may stand in for
        an OpenReq); the lookup kept for the shared-memory prefetches; an open file marked stale."""
        if len(self._last_lookup) > 4096:
            self._last_lookup.clear()
        self._last_lookup[pid] = (ino, False)
        self._open_info.pop(ino, None)
        if self.prefetcher is not None and self.prefetcher.shm is not None:
            now = time.monotonic()
            self._looked_up.pop(ino, None)
            self._looked_up[ino] = (now, attr)
            while next(iter(self._looked_up.values()))[0] < now - OPEN_INFO_FRESH_S:
                self._looked_up.popitem(last=False)
        self._held_info.pop(ino, None)
        of = self.files.get(ino) if self.per_inode else None
        if of is not None and of.attr != attr:
            of.stale = True  # no OPEN will refresh it (close-to-open): its next READ or WRITE does

    def thread_attr_out(self, stamp: int, attr: p.Attr) -> tuple[Attr, float]:
        """(a worker thread, under ``lock``) GETATTR's answer for the daemon's ``attr``, as
        ``_attr_reply`` makes it: held only if no change of it was applied since ``stamp``."""
        return self._attr_out(attr, cacheable=not self.kcache.changed_since(stamp, attr.ino))

    def thread_read_file(self, fh: int, inode: int, ctx) -> OpenFile | None:
        """(reader thread, under ``lock``) The file a READ may be served from on a plain thread
        (client/thread_reads.py), or None: ``read``/``read_inode`` run in trio. Only what needs
        nothing settled first and nothing of this mount's own: no write of it here in any stage
        (buffered, in flight, not committed, kept for its create, failed), no create or commit
        here waiting for the daemon, no state to refresh.
        On a no-open mount, the inode's handle is made here when its open information is known
        (a LOOKUP's, a held file's, a dataset mount's) and the mount has no state of it yet; any
        other first READ makes it in trio, as before."""
        d = self.dirops
        if (d is not None and (d.unanswered or d.failed)) or (self.idle is not None and self.idle.pending()) \
                or (self.writeback is not None and self.writeback.busy(inode)):
            return None
        if fh == 0:
            fh = self._inode_handles.get(inode)
            if fh is None:
                fh = self._inode_handle_here(inode, ctx)
                if fh is None:
                    return None
        of = self.handles.get(fh)
        if of is None or of.stale or of.has_unflushed or of.committing:
            return None
        return of

    def _inode_handle_here(self, inode: int, ctx) -> int | None:
        """(reader thread, under ``lock``) ``_inode_file``'s new handle, when it needs no round trip
        and no state of the file exists (one that does is trio's to refresh)."""
        if inode in self._inode_asking or inode in self.files:
            return None
        if self.dataset:
            rsp = self._dataset_info.get(inode) or self._fresh_open_info(inode)
        else:
            rsp = self._fresh_open_info(inode) or self._held(inode)
        if rsp is None or rsp.attr.ino != inode:
            return None
        self._opening(inode, ctx)
        if self.dataset:
            fh = self._dataset_handle(inode, rsp)
        else:
            of, _, _ = self._record_open(rsp, fresh_attrs=True)
            fh = self._new_handle(of)
        self._inode_handles[inode] = fh
        return fh

    async def read(self, fh, off, size):
        await self._settle(self.handles[fh].ino)
        of, stream = self._stream(fh)
        return await self.data.read(of, off, size, stream)

    async def read_inode(self, inode, off, size, ctx):
        """READ of a file the kernel never sent OPEN for (no-open: client/operations_bridge.py
        declines OPEN on a dataset mount, and on the default mount without ``per_open_handles``):
        read through this mount's one handle of ``inode`` (``_inode_file``)."""
        await self._settle(inode)
        of, stream = await self._inode_file(inode, ctx)
        return await self.data.read(of, off, size, stream)  # (counted and timed as a read: client/metrics.py)

    def _write_here(self, inode: int, fh: int, off: int, buf) -> int | object:
        """WRITE on the FUSE session's reader thread (under ``lock``): a write to a file whose create
        this mount answered and has not sent (``_early``) is kept as it comes, which needs nothing of
        trio (the write-back sends the create, the data and the commit together); anything else is
        ``_SLOW``. The trio task, its hand-off and its reply cost a copied small file more than the
        keeping itself (docs/design.md, "What a copied file costs"). Ordering: the kernel sends the
        next WRITE of an inode only after this one's answer (the inode lock of the write path), and
        ``_early`` cannot become true again once false, so a slow write is never overtaken. The idle
        commit's timer is set on the trio thread, queued before any later request's slow path."""
        if self.dataset:
            return _SLOW  # (the slow path answers EROFS)
        if fh:
            of = self.handles.get(fh)
        else:
            of = self.files.get(inode)
            if of is not None and inode not in self._inode_handles:
                of = None
        if of is None or not self._early(of, len(buf)):
            return _SLOW
        n = self._keep_early(of, off, buf)
        if not fh and self.idle is not None:
            self.dirops.in_trio(self.idle.touched, inode)  # (``_early``: dirops is there)
        return n

    async def write_inode(self, inode, off, buf, ctx):
        """WRITE with no OPEN sent (no-open on the default mount): into the inode's one state; the
        first write of a write session asks for the open information for writing (``_inode_file``)."""
        self._writable()
        if self.idle is not None:
            self.idle.touched(inode)
        of = self.files.get(inode)
        if of is not None and inode in self._inode_handles and self._early(of, len(buf)):
            return self._keep_early(of, off, buf)  # a file created here, its create not sent yet
        await self._settle(inode)  # a file created here: its layout and chunk map are the daemon's answer
        of, _ = await self._inode_file(inode, ctx, write=True)
        of.mtime_ns = time.time_ns()
        self._may_hold_writes(of)
        n = await self.data.write(of, off, buf)
        self._may_hold_writes(of)  # (again: an acknowledgement during the write may have let it go)
        if self.silent_close and not of.marked:
            await self._mark(of)  # (an acknowledgement while it was written dropped the mark)
        return n

    async def _mark(self, of: OpenFile) -> None:
        """Closes that send nothing: before a WRITE of ``of`` is answered, the daemon holds this
        mount's write mark on it (daemon/callbacks.py), so that another mount's later open or stat
        waits for this one to commit. Asked with the open information when the file's state is
        refreshed anyway (``_inode_file``); here when it holds writes not committed yet."""
        rsp, raced = await self._ask_open(of.ino, False, mark=True)
        self._marked(of, rsp, raced)

    def _marked(self, of: OpenFile, rsp: p.OpenRsp, raced: bool) -> None:
        if rsp.callback < 0 and not self._unmarked_told:
            self._unmarked_told = True
            log.info("the metadata daemon grants this mount no write marks (a penalty, or no callbacks): a close "
                     "here may be seen elsewhere up to %.0f ms late", 1000 * idle_commits.IDLE_S)
        # raced: another mount's change of the file came meanwhile, which may have ended the mark
        of.marked = rsp.callback < 0 or not raced
        self._may_hold_writes(of)  # (marked, or about to be written: a WRITE asks a mark first)
        if rsp.callback >= 0:
            self.kcache.marked(of.ino, rsp.callback)

    def _fast_flush_inode(self, inode):
        if self.silent_close:
            # closes send nothing from here on (connection-wide): the file's session, if any, is
            # committed when its writing stops (client/idle_commits.py)
            raise FuseError(errno.ENOSYS)
        if self._may_go_silent and self.kcache.callbacks_possible:
            return _SLOW  # the handler goes silent
        of = self.files.get(inode)
        if of is None:
            return None
        # a close, maybe not the creator's: the file no longer counts as open for an asynchronous
        # unlink (_open_here); its data stays kept by ``files``, the heartbeat's open set
        of.created_open = False
        return _SLOW if _written(of) else None

    async def flush_inode(self, inode):
        """FLUSH with no OPEN sent: any close of the file on this mount commits what the inode
        holds, whichever process wrote it (a cached write's WRITE names no closer); a failed write
        session is reported to that close, once. Nothing to commit: answered on the reader thread."""
        of = self.files.get(inode)
        if of is not None and _written(of):  # (else: here to go silent)
            with self._ended_if_cut(of):
                await self._flush_file(of)
        if not self.silent_close and self._may_go_silent and self.kcache.callbacks_possible:
            await self._go_silent()
            raise FuseError(errno.ENOSYS)  # (after its own commit: the close returns 0)

    async def _go_silent(self) -> None:
        """From the first FLUSH that finds the change feed followed: closes send nothing. The kernel is
        told at this FLUSH's answer (ENOSYS: never again on this connection). Write sessions not
        committed yet had no write mark: they are committed now; from here a WRITE is answered only
        once its file is marked (``_mark``)."""
        self.silent_close = True
        log.info("closes send nothing from now on: write sessions are committed %.0f ms after their last write "
                 "(-o sync_close: at close)", 1000 * idle_commits.IDLE_S)
        await self._commit_written(None)

    async def fsync_inode(self, inode, datasync):
        await self._settle(inode)  # a file created here is durable once this returns
        of = self.files.get(inode)
        if of is not None:
            with self._ended_if_cut(of):
                await self._flush(of, sync=True)
        if self.writeback is not None:  # its data written back after an earlier close, unsynced
            await self.writeback.sync(inode)

    @contextlib.contextmanager
    def _ended_if_cut(self, of: OpenFile):
        """A FLUSH or FSYNC by inode cut short by ``op_timeout_s`` (answered EIO) leaves its failed
        write session to the next flush (open_files.py): with OPEN, the RELEASE that follows the
        close is that flush. With none sent, it runs here, in the background: the session is thrown
        away (its error was this request's answer), and the kernel's next GETATTR sees the size
        the daemon committed, not the one the failed writes made."""
        try:
            yield
        except BaseException:  # (the deadline's Cancelled, maybe in a group with the sends')
            if of.has_unflushed:
                self.data.nursery.start_soon(self._end_failed_session, of, name=f"end-session-{of.ino}")
            raise

    async def _end_failed_session(self, of: OpenFile) -> None:
        with trio.move_on_after(self.op_timeout):
            try:
                await self.data.flush(of)
            except Exception as exc:  # the error the cut request answered (EIO), or a later one
                log.debug("inode %d: the write session after a cut flush: %s", of.ino, exc)

    async def _inode_file(self, inode: int, ctx, write: bool = False):
        """The one state and read pattern of ``inode`` on a no-open mount: (OpenFile, ReadStream).

        Made at the file's first READ or WRITE from what a LOOKUP or the callback left, else an
        OpenReq, and kept until the kernel forgets the inode (``forget_now``). A dataset mount
        drops it when the feed says the file changed; the default mount marks it ``stale``
        instead (a writer may be using it) and refreshes it here, before the next READ or WRITE,
        while it holds nothing of its own (``OpenFile.refresh``). The first WRITE of a write
        session asks ``write=True`` (an OpenReq, even after a LOOKUP): the epoch, a snapshot's
        refusal, the quota room."""
        fh = self._inode_handles.get(inode)
        while fh is None:
            if await self._asked_elsewhere(inode):  # another request of it made the handle
                fh = self._inode_handles.get(inode)
                continue
            with self._asking(inode):
                self._opening(inode, ctx)  # read without OPEN: the lookup that led here was for reading
                fh = await self._open_inode(inode)
            with self.lock:
                kept = self._inode_handles.setdefault(inode, fh)
            if kept != fh:
                self._drop_handle(fh)  # a CREATE of it made one meanwhile
                fh = kept
        of, stream = self._stream(fh)
        while self.per_inode and (of.stale or (write and not (of.writable and (of.marked or not self.silent_close)))) \
                and not of.has_unflushed and not of.committing:
            if await self._asked_elsewhere(inode):  # its answer, then look again
                continue
            # a write session asks the daemon (its epoch, and EROFS for a snapshot's file at the
            # first WRITE: the open(O_WRONLY) itself sent nothing); a reader takes what it was told
            rsp = None if write else self._fresh_open_info(inode) or self._held(inode)
            raced = False
            if rsp is None:
                with self._asking(inode):
                    rsp, raced = await self._ask_open(inode, write, mark=write and self.silent_close)
            if not of.has_unflushed:  # (a write may have come meanwhile: its state stays)
                self._record_open(rsp, fresh_attrs=True, raced=raced)
                of.stale = False
            of.writable = of.writable or write
            if write and self.silent_close:
                self._marked(of, rsp, raced)
            break
        return of, stream

    @contextlib.contextmanager
    def _asking(self, inode: int):
        """Around a request asking the daemon for ``inode``'s open information on a no-open mount
        (a handle's making, a stale state's refresh): one at a time. The kernel's readahead sends
        a cold file's READs side by side, and each asked an OpenReq (32 for a 5 MiB file)."""
        self._inode_asking[inode] = answered = trio.Event()
        try:
            yield
        finally:
            del self._inode_asking[inode]
            answered.set()

    async def _asked_elsewhere(self, inode: int) -> bool:
        """Whether another request was asking for ``inode`` (``_asking``): waited for its answer."""
        asking = self._inode_asking.get(inode)
        if asking is None:
            return False
        await asking.wait()
        return True

    async def _open_inode(self, inode: int) -> int:
        """A new handle of ``inode`` with no OPEN (no-open): as a read-only ``open`` would make it."""
        if self.dataset:
            return (await self._open_dataset(inode, os.O_RDONLY)).fh
        rsp = self._fresh_open_info(inode) or self._held(inode)
        raced = False
        if rsp is None:
            listed = self._held_info.get(inode)
            rsp, raced = await self._ask_open(inode, False)
            if isinstance(listed, p.Attr) and not raced:
                self._keep_held(inode, rsp)  # the next opens need no round trip
        of, _, _ = self._record_open(rsp, fresh_attrs=True, raced=raced)
        return self._new_handle(of)

    def _created(self, fh: int, flags: int) -> Opened:
        """CREATE's open file. No-open on the default mount: the handle becomes the inode's one
        (``_inode_file``) and the kernel is given fh 0, so every request of the file names its
        inode (a RELEASE of it, which some kernels send, then finds nothing to drop)."""
        if not self.per_inode:
            return _opened(fh, True, flags)
        of = self.handles[fh]
        of.writable = True  # the daemon's answer to the create was for writing (its epoch)
        of.created_open = True  # until a FLUSH: the creator's close (_open_here)
        with self.lock:
            kept = self._inode_handles.setdefault(of.ino, fh)
        if kept != fh:
            self._drop_handle(fh)
        return Opened(0, _KEEP_CACHE)

    def _drop_inode_handle(self, ino: int) -> None:
        """(under ``lock``) The handle ``read_inode`` keeps for ``ino`` is old: the next read opens anew."""
        fh = self._inode_handles.pop(ino, None)
        if fh is not None:
            self._drop_handle(fh)

    async def write(self, fh, off, buf):
        self._writable()
        of = self.handles[fh]
        if self._early(of, len(buf)):
            return self._keep_early(of, off, buf)
        await self._settle(of.ino)  # a file created here: its layout and chunk map are the daemon's answer
        of.mtime_ns = time.time_ns()
        self._may_hold_writes(of)  # (a file created here writes through its CREATE's handle)
        try:
            return await self.data.write(of, off, buf)  # short at a directory quota's limit
        finally:
            self._may_hold_writes(of)

    def _keep_early(self, of: OpenFile, off: int, buf) -> int:
        """A write to a file whose create is not sent yet: kept until it is (the write-back sends
        both), no round trip here."""
        self._may_hold_writes(of)
        of.keep_early(off, bytearray(buf))  # (the one copy: ``_replay`` adopts it as the chunk's buffer)
        of.size = max(of.size, off + len(buf))
        of.mtime_ns = time.time_ns()
        return len(buf)

    def _early(self, of: OpenFile, n: int) -> bool:
        """Whether a write of ``n`` bytes to ``of`` waits for its create (``OpenFile.early``): a small
        file created here, its create not answered, written back after its close (client/write_back.py)."""
        return (of.layout is _PENDING_LAYOUT and of.write_error is None and of.early_bytes + n <= EARLY_MAX
                and of.parent not in self._quota_dirs
                and self.writeback is not None and self.writeback.running and self.dirops.pending(of.ino))

    async def _replay(self, of: OpenFile) -> None:
        """Apply the writes kept while ``of``'s create was not answered (``_early``), now that it is; a
        refused create or a quota's cut fails the write session: its next close or fsync reports it."""
        if not of.early:
            return
        with self.lock:  # the reader thread keeps early writes too (``_write_here``)
            early, of.early, of.early_bytes = of.early, (), 0
        d = self.dirops
        refused = d.failed.get(of.ino) if d is not None else None
        if refused is not None or of.layout is _PENDING_LAYOUT:
            of.write_error = refused or StripefsError(ErrorCode.IO, f"inode {of.ino}: its create was not answered")
            of.size = of.attr.size
            return
        try:
            if len(early) == 1 and early[0][0] == 0 and self.data.adopt(of, early[0][1]):
                return  # a small file's one write: its buffer becomes the chunk's, not copied again
            for off, data in early:
                if await self.data.write(of, off, data) < len(data):
                    raise StripefsError(ErrorCode.QUOTA_EXCEEDED, f"inode {of.ino}: a directory quota cut what was written")
        except StripefsError as exc:
            self.data._fail(of, exc)
            await self.data._settle(of)

    def _fast_flush(self, fh):
        if self.dataset:
            # nothing to commit on a read-only mount; ENOSYS stops FLUSH for good (connection-wide)
            raise FuseError(errno.ENOSYS)
        of = self.handles[fh]
        return _SLOW if _written(of) else None

    async def flush(self, fh):
        # a dataset mount's FLUSH and a clean file's were answered by _fast_flush already
        await self._flush_file(self.handles[fh])

    async def _flush_file(self, of: OpenFile) -> None:
        """A close's FLUSH, by handle or (no-open) by inode: commit what ``of`` holds, or leave it
        to the write-back (client/write_back.py) when its data can wait."""
        wb = self.writeback
        if of.early and of.open_count == 1 and self._may_write_back(of):
            wb.add(of)  # its create, its data and its commit follow together (client/write_back.py)
            await wb.room()
            return
        await self._settle(of.ino)
        if _written(of):  # has_unflushed: also an error to report
            with self.lock:
                self._open_info.pop(of.ino, None)
                self._held_info.pop(of.ino, None)
            if self._may_write_back(of) and wb.eligible(of):
                wb.add(of)  # committed within write_back.DELAY_S, or before anything that must see it
                await wb.room()
                return
            await self._flush(of)
            self._kernel_view[of.ino] = (of.attr.mtime_ns, of.attr.size)

    def _note_quota(self, of: OpenFile) -> None:
        if of.quota_max >= 0 and of.parent:
            self._quota_dirs.add(of.parent)

    def _may_write_back(self, of: OpenFile) -> bool:
        """Whether ``of``'s commit may follow its close: only in a directory this mount holds whole, with
        inode numbers delegated (as for an asynchronous create), and the file held too: another mount's
        lookup in that directory, or open of the file, then waits for this mount's acknowledgement,
        which sends it first (close-to-open). A file this mount merely holds is not enough: another
        mount's open of it does not wait for this one."""
        wb, d = self.writeback, self.dirops
        return (wb is not None and wb.running and d is not None and d.enabled and d.left() > 0 and self.kcache.healthy
                and of.ino in self.kcache.grants and self._names_of_dir(of.parent) is not None
                and of.parent not in self._quota_dirs)

    async def _before_write_back(self, files: list[OpenFile]) -> None:
        """The write-back is about to send ``files``: their creates go first, then their kept writes."""
        if self.dirops is not None and any(of.early for of in files):
            await self.dirops.flush()
        for of in files:
            await self._replay(of)

    def _written_back(self, of: OpenFile) -> None:
        """A file closed here was committed by the write-back (or failed: its state stays, holding
        the error for its next close or fsync here)."""
        with self.lock:
            if of.write_error is None:
                self._kernel_view[of.ino] = (of.attr.mtime_ns, of.attr.size)
            if of.open_count == 0 and not of.has_unflushed and self.files.get(of.ino) is of:
                del self.files[of.ino]

    async def fsync(self, fh, datasync):
        await self._settle(self.handles[fh].ino)  # a file created here is durable once this returns
        await self._flush(self.handles[fh], sync=True)
        if self.writeback is not None:  # its data written back after an earlier close, unsynced
            await self.writeback.sync(self.handles[fh].ino)

    async def _flush(self, of: OpenFile, sync: bool = False) -> None:
        try:
            await self.data.flush(of, sync=sync)
        except StripefsError as exc:
            if exc.code == ErrorCode.QUOTA_EXCEEDED:
                # a directory quota cut the file below what the kernel wrote: drop its size and pages
                await trio.to_thread.run_sync(_invalidate_attr, of.ino, False)
            raise

    def _fast_release(self, fh):
        of = self.handles.get(fh)
        if of is not None and self.writeback is not None and self.writeback.holds(of.ino):
            self._drop_handle(fh)  # its data is the write-back's to send (it keeps the file's state)
            return None
        if of is None or (of.open_count == 1 and _written(of)):
            return _SLOW  # the last close of a file with unsent data: the handler sends it
        self._drop_handle(fh)
        return None

    async def release(self, fh):
        with self.lock:
            of = self.handles.pop(fh)
            self.streams.pop(fh, None)
            self._pt_closed(fh)
            of.open_count -= 1
            if of.open_count:
                return
        held = self.writeback is not None and self.writeback.holds(of.ino)  # its data is the write-back's to send
        try:
            if not held and _written(of):
                await self._settle(of.ino)  # (a create not answered yet, and writes kept for it)
                await self.data.flush(of)
        finally:
            # No CloseReq: the next session heartbeat carries the open set without
            # this inode, which is when an unlinked file's data is reclaimed. One
            # round trip less per file read matters more than reclaiming a few
            # seconds earlier.
            with self.lock:
                if of.open_count == 0 and self.files.get(of.ino) is of and not held:
                    del self.files[of.ino]

    def _uncommitted(self, of: OpenFile) -> bool:
        """``of`` holds what a commit still has to send: the write-back's, or (closes that send
        nothing) a write session not committed yet."""
        if self.writeback is not None and self.writeback.holds(of.ino):
            return True
        return self.silent_close and (_written(of) or of.committing)

    def forget_now(self, inode_list) -> None:
        """FORGET, synchronously: on the FUSE session's reader thread (client/operations_bridge.py),
        under ``lock``. A batch at once: drop_caches (or memory pressure) makes the kernel forget
        every inode of a walked tree, thousands in a few BATCH_FORGETs that the kernel hands out
        before any other request; the per-inode dict drops run in C (``_drop_each``), the kernel
        cache's under one lock (``KernelCache.forget_all``). Where the reader thread dropped
        them one by one, the forgets of a 2,000-file walk cost it 16-24 ms, two fifths of its
        samples around a cold walk (docs/design.md, "What a cold walk costs")."""
        inos = [ino for ino, _ in inode_list]
        with self.lock:
            handles = self._inode_handles
            if handles:
                for ino in inos:
                    if ino in handles:
                        self._drop_inode_handle(ino)
                        of = self.files.get(ino)
                        if of is not None and of.open_count == 0 and not self._uncommitted(of):
                            # no open file is left to send what it holds (no-open: every close's FLUSH
                            # committed it, or reported why not); one the write-back still holds stays
                            # (it answers a stat until its commit: _held_long), and goes once sent, and so
                            # does one whose writes are not committed yet (closes that send nothing: the
                            # kernel may forget a file between its close and its commit, _commit_idle)
                            del self.files[ino]
            for kept in (self._kernel_view, self._dataset_info, self._attr_bytes, self._entry_bytes):
                if kept:
                    _drop_each(kept, inos)
            self.kcache.forget_all(inos)


def _drop_each(kept: dict, keys: list) -> None:
    """Each of ``keys`` out of ``kept``, those it holds (the loop in C)."""
    deque(map(kept.pop, keys, repeat(None, len(keys))), maxlen=0)


def _call_now(fn, *args) -> None:
    """``to_trio`` for what runs in trio already (Operations._lookup_held)."""
    fn(*args)


def _written(of: OpenFile) -> bool:
    """``of`` holds writes (or a size) its daemon has not committed, or an error to report."""
    return of.has_unflushed or of.size != of.attr.size


#: a dataset mount's subdirectories listed ahead of the kernel at once (``_list_subdirs_ahead``),
#: and at most waiting for their turn (half the listings kept: client/dir_listings.py)
LIST_AHEAD = 16
AHEAD_QUEUED = 512


class _PlusPage(NamedTuple):
    """A READDIRPLUS page of files answered whole (``Operations._fill``), kept with its listing."""

    inos: list  # its entries' inodes, in order
    held: list  # what the mount held of each when it was made (_held_info's or _dataset_info's)
    data: bytes  # the page as answered
    keys: list  # (directory, name) of the entries answered with an inode (the kernel holds them)
    named: list  # their inodes


def _attr_out_bytes(e: Entry) -> bytes:
    return encode_attr_out(e.attr, e.attr_valid)


def _opened(fh: int, keep_cache: bool, flags: int) -> Opened:
    """OPEN's (and CREATE's) answer for handle ``fh`` of an open(2) with ``flags``. A file opened
    only for reading is closed with no FLUSH (FOPEN_NOFLUSH): such a handle has nothing to commit,
    and the mount keeps no POSIX locks of its own (the kernel does), so the request would only
    cost the close a round to the mount."""
    open_flags = _KEEP_CACHE if keep_cache else 0
    if not flags & _WRITING:
        open_flags |= _NOFLUSH
    return Opened(fh, open_flags)


# plain ints: an IntFlag's ``|`` costs more than the rest of a hot OPEN's answer
_KEEP_CACHE, _NOFLUSH, _WRITING = int(OpenFlag.KEEP_CACHE), int(OpenFlag.NOFLUSH), os.O_WRONLY | os.O_RDWR
_PASSTHROUGH = int(OpenFlag.PASSTHROUGH)
#: how long an open that conflicts with passthrough opens of its inode waits for their RELEASE
PT_RELEASE_WAIT_S = 1.0


def _privileges_to_kill(mode: int) -> int:
    """The set-id bits a change of a file's data by an unprivileged caller removes."""
    kill = mode & stat.S_ISUID
    if mode & stat.S_ISGID and mode & stat.S_IXGRP:
        kill |= stat.S_ISGID
    return kill if stat.S_ISREG(mode) else 0


def _invalidate_attr(ino: int, attr_only: bool = True) -> None:
    try:
        fuse_backend.invalidate_inode(ino, attr_only=attr_only)
    except OSError as exc:
        if exc.errno != errno.ENOENT:
            log.warning("invalidating attributes of inode %d: %s", ino, exc)
