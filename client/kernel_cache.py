"""What the kernel caches of this mount's namespace, and keeping it true.

The fastest request is the one the kernel answers alone, so names, attributes
and file pages are cached in the kernel for long (``cache_timeout_s``) and
dropped explicitly when the metadata daemon's change feed (daemon/events.py)
says they changed elsewhere. This module follows the feed and does the
dropping; ``Operations`` asks it how long an answer may be cached.

Rules
-----
* Long timeouts only while the feed is *healthy*: connected, and every change
  since the last full drop seen in order. Otherwise answers get the short
  configured timeouts (``entry_timeout_s``/``attr_timeout_s``).
* A gap in the sequence numbers, another change log, an undecodable event or
  ``EVENTS_SILENCE_S`` without even a heartbeat: drop everything (every known
  inode's attributes and pages, every known name) and start over.
* A reply that raced a change: a lookup answered before a change but handed to
  the kernel after the change's invalidation would re-install the old answer
  for long. ``stamp()`` before the request and ``changed_since()`` after it
  catch that; such a reply is cached for 0 s. This mount's own commits and
  truncates count as changes from the moment their reply comes
  (``changed_here``): an open's answer asked before one is older than the
  mount's own state of the file (client/operations.py).
* Invalidations run in a worker thread, never inside a request handler: the
  kernel may hold locks that the pending request needs (go-fuse's notify docs). A
  change is noted at once (``changed_since`` sees it) and its invalidations
  are queued; one task sends whatever has queued up in one thread hop, so a
  burst of changes elsewhere costs this mount a few thread hops, not one each.

The visibility bound this gives a dataset mount: a change made elsewhere is
seen once its event arrives (milliseconds); if the event is lost, at the next
heartbeat (``EVENTS_HEARTBEAT_S``) the gap is seen; if the feed goes silent,
after ``EVENTS_SILENCE_S``. So within ``EVENTS_SILENCE_S`` (3 s) plus delivery.

Callbacks (daemon/callbacks.py): a default mount may cache a regular file's
name and attributes for long when the daemon granted a callback on them
(``granted``): the daemon then answers a change of them made elsewhere only
after this mount acknowledged it. An event numbered above a grant's seq ends
the grant, unless this mount made the change (``ChangeEvent.writer`` is
``own_writer``: the daemon keeps those grants too; of a file, only when the
change named no entry: a commit or a setattr, so a stat after a write is
answered here, while an unlink or rename ends it); once the kernel dropped
what the event changed, the flusher sends one AckReq for everything applied so
far (``send_ack``). A grant on ``("dir", ino)`` says this mount knows every
name of that directory (``granted_dir``); an event creating, removing or
renaming a name in it ends it. A full drop ends every
grant and says so (``everything``); so does a new daemon naming itself in the
feed (it knows no callbacks: what was cached under them is dropped).
"""

from __future__ import annotations

import errno
import logging
import threading
from collections import OrderedDict
from typing import Awaitable, Callable, Iterable

import trio
import zmq

from ..common import protocol as p
from ..common.errors import StripefsError
from ..common.transport import open_socket
from . import fuse_backend
from .dir_attrs import DirAttrs
from .fuse.abi import ROOT_ID
from .metrics import KERNEL_CACHE_DROPS

log = logging.getLogger(__name__)

#: how many recent changes ``changed_since`` remembers one by one
_RECENT_CHANGES = 65536
#: change events taken off the feed's socket at once, at most (``_follow_one``)
FEED_BURST = 256
#: names of files the kernel forgot that the mount keeps answering LOOKUP from (``lookup_kept``)
_KEPT_NAMES = 262_144


class KernelCache:
    def __init__(self, *, on_change: Callable[[Iterable[int] | None], None] = lambda inodes: None):
        self.healthy = False  # the feed is connected and in order: long timeouts allowed
        self.on_change = on_change  # inodes changed (None: everything); Operations drops its own caches
        self.map_event = lambda inodes, entries: (inodes, entries)  # a subdir mount's (client/subtree.py)
        self._names: dict[tuple[int, bytes], int] = {}  # names the kernel knows: (parent, name) -> ino
        self._names_of: dict[int, list[tuple[int, bytes]]] = {}  # ino -> its known names
        # names the kernel forgot (FORGET: memory pressure, drop_caches) of files this mount still
        # holds under callbacks: (parent, name) -> ino, the oldest dropped first (``lookup_kept``)
        self._kept: OrderedDict[tuple[int, bytes], int] = OrderedDict()
        self._clock = 0  # counts applied changes, locally
        self._floor = 0  # changes at or before this are not remembered one by one
        self._recent: OrderedDict[int, int] = OrderedDict()  # ino -> clock of its last change
        self._recent_seq: dict[int, int] = {}  # ino -> its last change's number in the log (0: not known)
        self.drops = 0  # full drops so far (gaps, silences, restarts)
        self.events_heard = 0  # frames received from the feed, heartbeats included
        self.following = trio.Event()  # set once subscribed (the mount waits a moment for it)
        # held by worker threads while they invalidate, or push pages (notify_store): a push
        # checks changed_since under it, so it either sees the change or precedes its invalidation
        self.kernel_lock = threading.Lock()
        # held while an answer is made from memory on the FUSE session's reader thread (client/fuse,
        # client/operations_bridge.py) and sent, and while a change drops what such answers are made
        # of (``apply``, ``drop_all``, names remembered and forgotten): so a fast answer either is
        # sent before the change's invalidation reaches the kernel (which then drops it) or sees the
        # change. Never held while talking to the kernel (invalidations run in a worker thread, after).
        self.state_lock = threading.RLock()
        self._pending_inodes: set[int] = set()  # invalidations noted, not yet sent to the kernel
        self._pending_names: set[tuple[int, bytes]] = set()
        self._pending = trio.Event()
        #: held while queued invalidations are taken and sent: a caller of ``flush_pending`` returns
        #: only once the flusher's invalidations in flight are in the kernel too, not beside them
        self._invalidating = trio.Lock()
        self._subscribed = 0  # subscriptions made so far
        self.dir_attrs = DirAttrs()  # directory attributes from this mount's change replies (client/dir_attrs.py)
        self.dir_attrs.clear()  # none kept until the feed is followed
        # callbacks (module docstring): False on a subdir mount (its feed is a view, its inodes mapped)
        self.callbacks_wanted = True
        self.grants: dict = {}  # ino, (parent, name) or ("dir", ino) -> the seq of the answer it was granted with
        self.own_writer = 0  # protocol.writer_tag of this mount: the feed's name for its own changes
        self.send_ack: Callable[[int, bool, list[int]], Awaitable[object]] | None = None  # (seq, everything, open inodes)
        self.is_open: Callable[[int], bool] = lambda ino: False  # open here (Operations)
        self._ack_seq = 0  # the newest event that ended a grant
        self._acked = 0  # the newest seq acknowledged
        self._ack_all = False  # a full drop ended every grant: say so
        self._ack_open: set[int] = set()  # files whose grant ended that are open here
        #: what must reach the daemon before an AckReq, given the inodes and directories whose grants
        #: the acknowledged events ended (None: any, after a full drop)
        self.before_ack: Callable[[set[int] | None], Awaitable[None]] = _nothing
        self._ack_touched: set[int] | None = set()  # (for before_ack) since the last acknowledgement
        self._daemon = ""  # the daemon publishing the feed (its boot id)
        self._seq = 0  # the newest change applied in order
        self._others_seq = 0  # the newest change applied that another mount made (or of unknown writer)

    # ----------------------------------------------------- what the kernel knows

    def remember(self, parent: int, name: bytes, ino: int) -> None:
        """The kernel got an entry for ``name`` (lookup, readdirplus, create...)."""
        key = (parent, name)
        if self._names.get(key) == ino:
            return
        with self.state_lock:
            self._kept.pop(key, None)
            self._names[key] = ino
            self._names_of.setdefault(ino, []).append(key)

    def remember_all(self, keys: list, inos: list) -> None:
        """``remember`` of each name ``keys[k]`` (``(parent, name)``) as ``inos[k]`` (a READDIRPLUS
        page): nothing when the kernel holds them all already (one pass in C), else the state lock
        taken once for the page, not once a name (a cold walk after drop_caches remembers every
        name again: a third of its page's time was this lock)."""
        names = self._names
        if list(map(names.get, keys)) == inos:
            return
        with self.state_lock:
            kept, names_of = self._kept, self._names_of
            for key, ino in zip(keys, inos):
                if names.get(key) != ino:
                    kept.pop(key, None)
                    names[key] = ino
                    names_of.setdefault(ino, []).append(key)

    def forget(self, ino: int) -> None:
        """The kernel forgot ``ino`` (FORGET with its lookup count at zero). Its names stay known
        (``lookup_kept``) while this mount holds the file and the name under callbacks."""
        self.forget_all((ino,))

    def forget_all(self, inos) -> None:
        """``forget`` of each of ``inos`` (a BATCH_FORGET's), under one hold of the lock."""
        with self.state_lock:
            names_of, names, grants, kept = self._names_of, self._names, self.grants, self._kept
            for ino in inos:
                keys = names_of.pop(ino, None)
                if not keys:
                    continue
                held = ino in grants
                for key in keys:
                    if names.get(key) == ino:
                        del names[key]
                        if held and self._name_held(key):
                            kept[key] = ino
            while len(kept) > _KEPT_NAMES:
                kept.popitem(last=False)

    def _name_held(self, key: tuple[int, bytes]) -> bool:
        return key in self.grants or ("dir", key[0]) in self.grants

    def lookup_kept(self, parent: int, name: bytes) -> int | None:
        """The inode of a name the kernel forgot, while this mount still holds it and the file
        under callbacks (a change of either elsewhere ends the grant first, an event naming the
        entry drops it here): a LOOKUP after drop_caches or memory pressure is answered from memory
        (client/operations.py ``_fast_lookup``) instead of asking the daemon."""
        key = (parent, name)
        ino = self._kept.get(key)
        if ino is None or ino not in self.grants or not self._name_held(key):
            return None
        return ino

    def drop_name(self, parent: int, name: bytes) -> None:
        """Make the kernel forget ``name`` soon (from the flusher, never inside a request): a name
        this mount's own rename made, cached as long as the one it replaced, but held by nobody."""
        self._pending_names.add((parent, name))
        self._pending.set()

    def drop_inode(self, ino: int) -> None:
        """Make the kernel forget ``ino``'s attributes and pages soon (from the flusher): an
        asynchronous create the daemon refused (client/async_dirops.py)."""
        self._pending_inodes.add(ino)
        self._pending.set()

    def name_gone(self, parent: int, name: bytes) -> None:
        """This mount removed ``name`` (unlink, rmdir, either name of a rename): the kernel dropped
        or moved it itself, and a LOOKUP of it must not be answered from what it named
        (Operations._fast_lookup). The inode stays known while the kernel holds it."""
        with self.state_lock:
            self._kept.pop((parent, name), None)
            ino = self._names.pop((parent, name), None)
            keys = self._names_of.get(ino) if ino is not None else None
            if keys is not None and (parent, name) in keys:
                keys.remove((parent, name))

    def path_of(self, ino: int) -> bytes | None:
        """``ino``'s path under the mount's root by the names the kernel knows (the first of each
        inode's), or None where a name on the way is not known (client/no_open_primer.py)."""
        parts: list[bytes] = []
        with self.state_lock:
            while ino != ROOT_ID:
                keys = self._names_of.get(ino)
                if not keys or len(parts) > 4096:
                    return None
                ino, name = keys[0]
                parts.append(name)
        return b"/".join(reversed(parts))

    def knows(self, ino: int) -> bool:
        return ino in self._names_of

    def lookup_known(self, parent: int, name: bytes) -> int | None:
        return self._names.get((parent, name))

    @property
    def callbacks_possible(self) -> bool:
        """Ask for callbacks now: the feed is in order and this is not a subdir mount."""
        return self.healthy and self.callbacks_wanted and self.send_ack is not None

    def granted(self, ino: int, parent: int, name: bytes, seq: int) -> None:
        """(trio thread) The daemon granted a callback on ``ino`` and its name, as of change ``seq``.
        Kept even when the answer raced a change (then not cached long): the daemon holds the grant,
        so an event above ``seq`` touching it must be acknowledged; one at or below does not end it."""
        if self.record_grant(ino, parent, name, seq):
            self.granted_as_of(seq)

    def record_grant(self, ino: int, parent: int, name: bytes, seq: int) -> bool:
        """(any thread) ``granted``'s first half: the grant recorded under ``state_lock``, which every
        change applied takes (``apply``, ``drop_all``), so the change is applied wholly before it (and
        ``changed_since`` says so, and ``granted_as_of`` owes an acknowledgement) or after it (and ends
        it). True: an event of another mount above ``seq`` was applied already, so the second half,
        ``granted_as_of(seq)``, is owed; it wakes the flusher, a trio event, so a worker thread
        (client/thread_meta.py) hands it to trio, where it runs a moment later (it only ever
        acknowledges more, never less: ``_others_seq`` and ``_seq`` only grow)."""
        with self.state_lock:
            self.grants[ino] = seq
            self.grants[(parent, name)] = seq
            return seq < self._others_seq

    def marked(self, ino: int, seq: int) -> None:
        """The daemon recorded this mount's write mark on ``ino`` as of ``seq`` (daemon/callbacks.py):
        another mount's change of the file waits for this one as for a held file, so it is one."""
        held = self.grants.get(ino)
        self.grants[ino] = seq if held is None else min(held, seq)
        self.granted_as_of(seq)

    def held_here(self, ino: int, parent: int, name: bytes, whole: bool = False) -> None:
        """A file (``whole``: a directory, every name of it) this mount made and answered itself
        (client/async_dirops.py): held until the daemon's answer says as of which change
        (``granted``); nothing of anyone else can touch it before, since the daemon has not got it."""
        self.grants.setdefault(("dir", ino) if whole else ino, 0)
        self.grants.setdefault((parent, name), 0)

    def let_go(self, ino: int, parent: int, name: bytes, whole: bool = False) -> None:
        """``held_here``'s file or directory was refused by the daemon, or granted no callback."""
        self.grants.pop(("dir", ino) if whole else ino, None)
        self.grants.pop((parent, name), None)

    def granted_dir(self, ino: int, seq: int) -> None:
        """The daemon granted a callback on every name of directory ``ino``, as of change ``seq``."""
        self.grants[("dir", ino)] = seq
        self.granted_as_of(seq)

    def granted_as_of(self, seq: int) -> None:
        """(trio thread) A grant as of ``seq`` was recorded: acknowledge what was applied since."""
        if seq < self._others_seq:
            # events of other mounts above the grant were applied before its answer came: one may
            # have touched these keys (the daemon then waits for this mount), so acknowledge what
            # was applied. This mount's own changes are never waited for: an rm -rf's lookups
            # would otherwise each send an AckReq (and flush the asynchronous unlinks with it)
            self._ack_seq = max(self._ack_seq, self._seq)
            self._ack_touched = None  # (which keys those events touched is not kept)
            self._pending.set()

    def _end_grants(self, inodes, entries, seq: int, mine: bool, keep_files: bool = False) -> list[int]:
        """Event ``seq`` ends the grants it touches that are older than it; the files among them.

        ``mine``: this mount made the change. The daemon waited for nobody here and already ended
        its holdings of the files the change touched (daemon/callbacks.py): no acknowledgement is
        owed for them (an ``rm -rf`` would send one AckReq per file), unless such a file is open
        here, which the acknowledgement must tell (it then counts as open at the daemon).
        ``keep_files``: this mount's own change of files alone (a commit, a setattr: no name
        changed): the daemon kept its holdings of them, and so does the mount (a stat after a
        write is answered here)."""
        ended = []
        for key in (*inodes, *entries, *{("dir", parent) for parent, _ in entries}):
            granted = self.grants.get(key)
            if keep_files and isinstance(key, int):
                continue
            if granted is not None and granted < seq:
                del self.grants[key]
                if isinstance(key, tuple) and key[0] == "dir" and not mine:
                    # the kernel keeps the directory's listing (no-opendir) and checks only its
                    # version and mtime: held no more, it must ask again, so the next listing is
                    # the daemon's (and is held again) instead of one kept from before this change
                    self._pending_inodes.add(key[1])
                if isinstance(key, int):
                    ended.append(key)
                    if self.is_open(key):
                        self._ack_open.add(key)
                    elif mine:
                        continue  # the daemon ended this holding itself
                self._ack_seq = seq
                if self._ack_touched is not None:  # the file, or the directory of the name
                    self._ack_touched.add(key if isinstance(key, int) else key[1] if key[0] == "dir" else key[0])
        return ended

    # ------------------------------------------------------------ reply races

    def stamp(self) -> int:
        return self._clock

    def changed_since(self, stamp: int, *inodes: int, as_of: int = -1) -> bool:
        """Whether a change of ``inodes`` was noted since ``stamp``; ``as_of``: the change log position
        the answer in hand is as of (a grant's seq), so a change the feed numbered at or below it is
        in the answer already and does not count (one the mount made itself, numbered later, does)."""
        if stamp < self._floor:
            return True
        recent, numbered = self._recent, self._recent_seq
        return any(recent.get(ino, 0) > stamp and not (0 < numbered.get(ino, 0) <= as_of) for ino in inodes)

    def changed_here(self, ino: int) -> None:
        """This mount changed ``ino`` (a commit, a truncate): an answer asked before now may
        predate the change, which ``changed_since`` says as for a change the feed reports (the
        feed's own event for it comes later)."""
        self._note((ino,))

    def _note(self, inodes: Iterable[int], seq: int = 0) -> None:
        """``inodes`` changed now: change ``seq`` of the log (0: not numbered yet, a change made here)."""
        self._clock += 1
        for ino in inodes:
            self._recent.pop(ino, None)
            self._recent[ino] = self._clock
            self._recent_seq[ino] = seq
        while len(self._recent) > _RECENT_CHANGES:
            ino, when = self._recent.popitem(last=False)
            self._recent_seq.pop(ino, None)
            self._floor = max(self._floor, when)

    # ------------------------------------------------------------ invalidation

    def apply(self, inodes: list[int], entries: list[tuple[int, bytes]], seq: int = 0, writer: int = 0) -> None:
        """One change made elsewhere or here: note it, queue its invalidations.

        ``seq``: its number in the change log (0: unknown); ``writer``: who made it (0: unknown).

        This mount's own change: the files its entries name (made, moved or removed here) are what
        the mount made them when it answered, so only the change's ``inodes`` count as changed (a
        file created here was marked stale, and its kept answers dropped, by the event of its own
        create: one more thing per create on the trio thread, and a refresh at its first write)."""
        mine = writer != 0 and writer == self.own_writer  # its own change: it keeps its names and directories
        with self.state_lock:
            touched = set(inodes) if mine else set(inodes) | {self._names[e] for e in entries if e in self._names}
            self._note(touched | {parent for parent, _ in entries}, seq)
            if seq:
                self._seq = seq
            if not mine:  # a name changed elsewhere: what was kept of it is not known any more (its own
                for e in entries:  # removals dropped theirs when answered: ``name_gone``)
                    self._kept.pop(tuple(e), None)
            if seq and not mine:
                self._others_seq = seq
            kept = mine and not entries  # its own commit or setattr: it keeps its holdings of the files
            ended = self._end_grants(inodes, [] if mine else [tuple(e) for e in entries], seq, mine, kept) if self.grants and seq else ()
            if seq:
                if not mine:  # its own changes dropped or updated what they changed (client/dir_attrs.py)
                    self.dir_attrs.changed(touched | {parent for parent, _ in entries}, seq)
            else:
                self.dir_attrs.clear()
            self.on_change(touched)
            # This mount's own change: the kernel changed its names itself (the change came through
            # it), so they stay, and a stat after a create asks nothing. Another's: a name held under a
            # grant as of this change or later is already the kernel's newest answer.
            names = [] if mine else [e for e in entries if e in self._names and not (seq and self.grants.get(tuple(e), -1) >= seq)]
            self._queue_invalidations(names, ended, inodes)

    def _queue_invalidations(self, names: list[tuple[int, bytes]], ended, inodes) -> None:
        """(Under ``state_lock``) queue for the kernel ``names``, the names of the files in ``ended``
        (a file whose grant ended: cached long under it; the next path walk looks it up again, a
        fresh answer and a new grant, instead of trusting kept attributes) and those of ``inodes``
        it knows; wake the flusher for them, or for an acknowledgement owed."""
        names += [key for ino in ended for key in self._names_of.get(ino, ()) if key not in names]
        known = [ino for ino in inodes if ino in self._names_of or ino == ROOT_ID]
        for key in names:
            ino = self._names.pop(key, None)  # (None: a name another inode's list still had)
            if key in self._names_of.get(ino, ()):
                self._names_of[ino].remove(key)
        if names or known:
            self._pending_names.update(names)
            self._pending_inodes.update(known)
            self._pending.set()
        elif self._ack_seq > self._acked:
            self._pending.set()

    def apply_own(self, changes: list[tuple[list[int], list[tuple[int, bytes]], int]]) -> None:
        """A run of this mount's own changes, (inodes, entries, seq) in feed order, applied as one:
        what ``apply`` does with each of them in turn, with one lock, one note, one ``on_change``
        (a flush's batch of creates comes back as one event per file, each naming its directory:
        ~200 events and 4 directories). A grant ends at the first change of the run that would
        have ended it (the same seq, the same acknowledgement), so the outcome is that of applying
        them one by one with nothing in between; nothing else can see the state halfway anyway."""
        if len(changes) == 1:
            inodes, entries, seq = changes[0]
            self.apply(inodes, entries, seq, self.own_writer)
            return
        touched: dict[int, None] = {}  # the run's inodes, in order
        parents: set[int] = set()
        naming: dict[int, list[int]] = {}  # inode -> the seqs of the run's changes naming entries that touch it
        for inodes, entries, seq in changes:
            for ino in inodes:
                touched[ino] = None
                if entries:  # a change of no entry (its own commit, setattr) keeps the files' grants
                    naming.setdefault(ino, []).append(seq)
            for parent, _ in entries:
                parents.add(parent)
        last = changes[-1][2]
        with self.state_lock:
            self._note(touched.keys() | parents, last)  # (numbered as the run's last: never older than any)
            if last:
                self._seq = last
            ended = []
            if self.grants and last:
                for ino, seqs in naming.items():
                    granted = self.grants.get(ino)
                    if granted is None:
                        continue
                    ending = next((seq for seq in seqs if granted < seq), 0)
                    if ending:
                        del self.grants[ino]
                        ended.append(ino)
                        if self.is_open(ino):  # its own change of a file open here: the daemon must hear it
                            self._ack_open.add(ino)
                            self._ack_seq = max(self._ack_seq, ending)
                            if self._ack_touched is not None:
                                self._ack_touched.add(ino)
            if not last:
                self.dir_attrs.clear()
            self.on_change(set(touched))
            self._queue_invalidations([], ended, touched)  # as ``apply``: no name of its own changes

    async def flush_pending(self) -> None:
        """Send the queued invalidations to the kernel, all in one worker-thread hop; then
        acknowledge the events that ended grants (the daemon holds their changes' replies).

        The flusher calls this when woken; a caller that needs the kernel told now may too. It
        leaves the flusher's wake-up alone: replacing it here once left the flusher waiting on an
        event nobody would set again, so the mount stopped acknowledging (the daemon waited 4 s
        per change for it, then took its callbacks away)."""
        async with self._invalidating:
            inodes, names = list(self._pending_inodes), list(self._pending_names)
            self._pending_inodes.clear()
            self._pending_names.clear()
            ack, everything, opened = self._ack_seq, self._ack_all, sorted(self._ack_open)
            self._ack_all = False
            self._ack_open.clear()
            if inodes or names:
                await trio.to_thread.run_sync(_invalidate, inodes, names, self.kernel_lock)
        if (ack > self._acked or everything) and self.send_ack is not None:
            # the change waiting for this acknowledgement may be another mount's in a directory
            # where creates answered here are not sent yet: they go first (client/async_dirops.py)
            touched, self._ack_touched = (None if everything else self._ack_touched), set()
            await self.before_ack(touched)
            self._acked = max(self._acked, ack)
            try:
                await self.send_ack(ack, everything, opened[: p.MAX_LIST])
            except StripefsError as exc:  # the daemon's wait runs out instead (daemon/callbacks.py)
                log.debug("change feed: acknowledging change %d: %s", ack, exc)

    async def _flusher(self) -> None:
        while True:
            await self._pending.wait()
            self._pending = trio.Event()  # what is queued from here on wakes it again
            await self.flush_pending()

    async def drop_all(self, why: str, floor: int | None = None, cause: str = "other") -> None:
        """Drop everything told to the kernel; ``floor``: the change log position from which
        the feed is followed again in order (None: not known yet); ``cause``: the metric's label."""
        KERNEL_CACHE_DROPS.labels(cause).inc()
        with self.state_lock:
            self.drops += 1
            self.dir_attrs.clear(floor)
            self._clock += 1
            self._floor = self._clock
            self._recent.clear()
            self._recent_seq.clear()
            self._pending_inodes.clear()
            self._pending_names.clear()
            self.on_change(None)
            names = list(self._names)
            inodes = list(self._names_of) + [ROOT_ID]
            self._names.clear()
            self._names_of.clear()
            self._kept.clear()
            had_grants = bool(self.grants)
            self.grants.clear()
            self._others_seq = max(self._others_seq, self._seq, floor or 0)  # unseen changes: anyone's
        log.info("change feed: %s; dropping the kernel's cache of %d name(s) and %d inode(s)", why, len(names), len(inodes))
        await trio.to_thread.run_sync(_invalidate, inodes, names, self.kernel_lock)
        if had_grants:  # dropped: every grant ended (acknowledged by the flusher)
            self._ack_seq = max(self._ack_seq, floor or 0, self._seq)
            self._ack_all = True
            self._pending.set()

    # ------------------------------------------------------------- the feed

    async def follow(self, ctx: zmq.Context, feed_info: Callable[[], Awaitable[tuple[str, str, int]]]) -> None:
        """Subscribe to the daemon's change feed and apply it, forever.

        ``feed_info()`` asks the daemon where its feed is: (address, boot id,
        last seq). It is asked at start and whenever the feed goes silent (the
        daemon restarted, maybe on another port, or the network broke).
        """
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._flusher, name="kernel-invalidations")
            await self._follow_forever(ctx, feed_info)

    async def _follow_forever(self, ctx: zmq.Context, feed_info) -> None:
        while True:
            try:
                where, boot, seq = await feed_info()
            except StripefsError as exc:
                log.debug("change feed: cannot ask where it is: %s", exc)
                await trio.sleep(p.EVENTS_HEARTBEAT_S)
                continue
            if not where:
                await trio.sleep(p.EVENTS_SILENCE_S)
                continue
            if not p.is_endpoint(where):  # libzmq would refuse to connect: never the end of the follower
                log.warning("change feed: the metadata daemon named %r, which is not an address; asking again", where[:100])
                await trio.sleep(p.EVENTS_SILENCE_S)
                continue
            self.dir_attrs.resume(seq)  # changes up to seq were not seen one by one
            async with open_socket(ctx, zmq.SUB, connect=where, hwm=1_000_000) as sock:
                log.debug("change feed: following %s (boot %s) from seq %d", where, boot, seq)
                if not self._subscribed:
                    # Trust it at once, not after the first heartbeat: a mount that is listed right
                    # after it starts (a DataLoader indexing its dataset) gets long timeouts. A change
                    # missed while the subscription settles shows as a gap at the next heartbeat (1 s),
                    # which drops everything: within the documented bound.
                    self.healthy = True
                self._subscribed += 1
                self.following.set()
                heard = await self._follow_one(sock, boot, seq)
                if not heard:
                    log.warning(
                        "change feed at %s sent nothing for %.0fs: is that port reachable from here? "
                        "The kernel caches names and attributes only briefly until it is", where, p.EVENTS_SILENCE_S,
                    )

    async def _follow_one(self, sock, boot: str, seq: int) -> bool:
        """Apply events until the feed is silent for EVENTS_SILENCE_S (then the caller asks again).

        Returns whether anything at all was heard."""
        heard = False
        while True:
            # every event already queued comes with the first (a batch of this mount's creates is
            # one event each): one wait, one cancel scope and one socket refresh per burst, not per event
            with trio.move_on_after(p.EVENTS_SILENCE_S) as silence:
                burst = await sock.recv_waiting(FEED_BURST)
            if silence.cancelled_caught:
                if self.healthy:
                    self.healthy = False
                    await self.drop_all(f"nothing heard for {p.EVENTS_SILENCE_S:.0f}s", cause="silence")
                return heard
            heard = True
            self.events_heard += len(burst)
            # this mount's own changes next to each other in the burst are applied together
            # (``apply_own``), before anything else is: the feed's order holds
            own: list[tuple[list[int], list[tuple[int, bytes]], int]] = []
            for frames in burst:
                try:
                    event = p.decode_event(frames[-1].bytes)  # a secure feed sends [topic, event] (daemon/events.py)
                except p.ProtocolError as exc:
                    log.warning("change feed: %s", exc)
                    own = self._apply_own_run(own)
                    self.healthy = False
                    await self.drop_all("undecodable event", seq + 1, cause="undecodable")
                    continue
                if event.boot_id == boot and event.seq == seq + 1 and event.daemon == self._daemon \
                        and event.writer and event.writer == self.own_writer:
                    seq = event.seq
                    own.append((*self.map_event(event.inodes, event.entries), seq))
                    self.healthy = True
                    continue
                own = self._apply_own_run(own)
                if event.daemon != self._daemon:
                    if self._daemon and self.grants:  # it knows none of the callbacks granted before
                        await self.drop_all(f"another metadata daemon ({event.daemon[:8]}) publishes the feed", seq, cause="daemon")
                    self._daemon = event.daemon
                if event.boot_id == boot and event.seq == seq and not (event.inodes or event.entries):
                    self.healthy = True  # a heartbeat: nothing missed
                elif event.boot_id == boot and event.seq == seq + 1:
                    seq = event.seq
                    self.apply(*self.map_event(event.inodes, event.entries), seq, event.writer)
                    self.healthy = True
                else:
                    if event.boot_id != boot:
                        why, cause = "another change log (a restored database?)", "change_log"
                    else:
                        why, cause = f"missed changes {seq + 1}..{event.seq - 1}", "gap"
                    boot, seq = event.boot_id, event.seq
                    await self.drop_all(why, seq, cause)  # covers this event's changes too
                    self.healthy = True
            self._apply_own_run(own)

    def _apply_own_run(self, own: list) -> list:
        """Apply the follower's run of own changes, if any (``apply_own``); the next run's list."""
        if own:
            self.apply_own(own)
            return []
        return own


async def _nothing(*_) -> None:
    pass


def _invalidate(inodes: list[int], names: list[tuple[int, bytes]], lock: threading.Lock) -> None:
    """Drop names and inodes (attributes and pages) from the kernel. In a worker thread."""
    with lock:
        _invalidate_locked(inodes, names)


def _invalidate_locked(inodes: list[int], names: list[tuple[int, bytes]]) -> None:
    for parent, name in names:
        try:
            fuse_backend.invalidate_entry(parent, name)
        except OSError as exc:
            if exc.errno != errno.ENOENT:
                log.warning("invalidating name %r in inode %d: %s", name, parent, exc)
    for ino in inodes:
        try:
            fuse_backend.invalidate_inode(ino)
        except OSError as exc:
            if exc.errno != errno.ENOENT:
                log.warning("invalidating inode %d: %s", ino, exc)
