"""Directory attributes a change made here left: GETATTR answered without a round trip.

After every create, mkdir, unlink or rename in a directory the kernel drops
that directory's attributes (fuse_dir_changed), and with ``default_permissions``
the next path walk through it asks GETATTR before anything else: one more
round trip to the daemon per namespace change. The daemon's reply to a change
carries the attributes of the directories it changed, read right after it, and
the change log position they are as of (``dir_attrs``, ``seq``: its own
change's number). The mount keeps them here and answers that GETATTR itself.

Rules (the kernel's own attribute cache follows the same feed, kernel_cache.py):

* Used only while the change feed is healthy, as long attribute timeouts are.
* Position: an entry is as of change ``seq``. A change event numbered above it
  that touches the directory drops it; events at or below it are already in it
  (this mount's own change among them, whichever of event and reply comes
  first). This mount's own events drop nothing: each of its changes drops the
  entry when sent (``begin``) or updates it (``made_here``). A reply older than an event already applied to the directory is not
  kept (``_touched``), nor one older than the last full drop (``_floor``; one as of the floor
  itself saw every change up to it, and the feed brings those after it).
* A listing's directories (``listed``): the directories a ReaddirRsp names are kept as of its
  callback's position, under the same rules, so a walk's listing answers the GETATTRs that
  ``rm -rf`` (or any stat after a readdir: the kernel then asks for the atime) sends of them.
* This mount's own changes in flight: a change sent for a directory drops its
  entry, and no reply is kept while another change of it is still unanswered
  (it may have been applied before or after the reply's position).
* A reply without a position (a shared database numbers changes later, a
  retry answered from applied_ops) keeps nothing.

So a change made elsewhere is seen here when its event is, as the kernel's
attribute cache does: within the feed's bound (kernel_cache.py).
"""

from __future__ import annotations

import stat
from collections import Counter, OrderedDict
from typing import Iterable

import msgspec

from ..common import protocol as p

#: directories kept (about 200 bytes each)
MAX_ENTRIES = 16384
#: how many directories touched by events are remembered one by one (older ones: ``_floor``)
_TOUCHED = 65536


class DirAttrs:
    def __init__(self) -> None:
        self._attrs: OrderedDict[int, tuple[int, p.Attr]] = OrderedDict()  # ino -> (seq, attr)
        self._touched: OrderedDict[int, int] = OrderedDict()  # ino -> seq of the last event touching it
        self._floor = 0  # replies at or below this position are never kept
        self._busy: Counter[int] = Counter()  # ino -> changes of it sent and not answered yet
        self._mine: Counter[int] = Counter()  # ino -> changes answered here (made_here), not yet by the daemon
        self._clock = 0  # counts this mount's changes of directories (``begin``, ``made_here``)
        self._local: dict[int, int] = {}  # ino -> ``_clock`` at this mount's last change of it
        self._local_floor = 0  # listings asked before this clock keep nothing (``_local`` was emptied)

    def get(self, ino: int) -> p.Attr | None:
        entry = self._attrs.get(ino)
        return entry[1] if entry else None

    # ------------------------------------------------------- this mount's changes

    def stamp(self) -> int:
        """Taken before a listing is asked, given back to ``listed``."""
        return self._clock

    def _changing(self, ino: int) -> None:
        """This mount changes directory ``ino`` now: a listing asked before is not kept for it (its
        position may precede the change, and this mount's own event never drops an entry)."""
        self._clock += 1
        if len(self._local) >= MAX_ENTRIES:
            self._local.clear()
            self._local_floor = self._clock
        self._local[ino] = self._clock

    def begin(self, inodes: Iterable[int]) -> None:
        """A change of these directories is about to be sent."""
        for ino in inodes:
            self._busy[ino] += 1
            self._attrs.pop(ino, None)
            self._changing(ino)

    def end(self, inodes: Iterable[int], rsp: p.Msg | None) -> None:
        """Its reply came (None: it failed); keep what it says where nothing else is in flight."""
        for ino in inodes:
            self._busy[ino] -= 1
            if self._busy[ino] <= 0:
                del self._busy[ino]
        self._keep(getattr(rsp, "dir_attrs", ()), getattr(rsp, "seq", 0))  # (an ErrorRsp has neither)

    def listed(self, attrs: Iterable[p.Attr], seq: int, since: int) -> None:
        """A listing as of change ``seq`` (its callback's position), asked at ``stamp()`` ``since``,
        named these directories: their attributes are kept as a change's reply's are, under the same
        rules, except a directory this mount changed since it asked (so a directory walked before
        is answered here at ``rm -rf``'s stat of it and at the GETATTR after its first unlink)."""
        if since < self._local_floor:
            return
        local = self._local
        self._keep([a for a in attrs if local.get(a.ino, 0) <= since], seq)

    def _keep(self, attrs: Iterable[p.Attr], seq: int) -> None:
        """Keep ``attrs`` as of change ``seq``: not a position already passed (``_floor``), not a
        directory with a change of this mount's in flight or answered here (it may have been applied
        before or after ``seq``), not one an event after ``seq`` touched, nor over a newer entry."""
        if not seq or seq < self._floor:  # (an answer as of the floor itself saw every change up to it)
            return
        for attr in attrs:
            ino = attr.ino
            if not stat.S_ISDIR(attr.mode) or self._busy[ino] or self._mine[ino] or self._touched.get(ino, 0) > seq:
                continue
            known = self._attrs.get(ino)
            if known is not None and known[0] > seq:
                continue
            self._attrs[ino] = (seq, attr)
            self._attrs.move_to_end(ino)
            if len(self._attrs) > MAX_ENTRIES:
                self._attrs.popitem(last=False)

    def made_here(self, ino: int, now_ns: int, nlink: int = 0) -> None:
        """A change answered by this mount (client/async_dirops.py) changed directory ``ino`` now:
        what is kept of it gets the new times and ``nlink`` more links (a mkdir's ".."), so the
        kernel's next GETATTR of it is still answered here. The daemon's reply replaces it
        (``end``); this mount's own change events never drop it (kernel_cache.py)."""
        self._mine[ino] += 1
        self._changing(ino)
        entry = self._attrs.get(ino)
        if entry is not None:
            attr = entry[1]
            self._attrs[ino] = (entry[0], msgspec.structs.replace(attr, mtime_ns=now_ns, ctime_ns=now_ns, nlink=attr.nlink + nlink))

    def answered_here(self, ino: int, rsp: p.Msg | None) -> None:
        """The daemon answered a change ``made_here`` in directory ``ino`` (None: refused). Its reply
        is kept only once every such change of the directory is answered (an earlier one's would
        undo what later ones made here); a refused one drops what is kept."""
        self._mine[ino] -= 1
        if self._mine[ino] <= 0:
            del self._mine[ino]
        if rsp is None:
            self._attrs.pop(ino, None)
            return
        self.end((), rsp)

    def keep_new(self, attr: p.Attr) -> None:
        """A directory this mount made and answered itself: its attributes until the daemon's reply."""
        self._attrs[attr.ino] = (0, attr)
        if len(self._attrs) > MAX_ENTRIES:
            self._attrs.popitem(last=False)

    # ------------------------------------------------------------- the feed

    def changed(self, inodes: Iterable[int], seq: int) -> None:
        """Change event ``seq`` touched these inodes."""
        for ino in inodes:
            known = self._attrs.get(ino)
            if known is not None and known[0] < seq:
                del self._attrs[ino]
            self._touched.pop(ino, None)
            self._touched[ino] = seq
        while len(self._touched) > _TOUCHED:
            _, old = self._touched.popitem(last=False)
            self._floor = max(self._floor, old)

    def clear(self, floor: int | None = None) -> None:
        """Forget everything; keep no reply at or below ``floor`` (None: none at all until told)."""
        self._attrs.clear()
        self._touched.clear()
        self._floor = (1 << 63) if floor is None else floor

    def resume(self, floor: int) -> None:
        """The feed is followed again from position ``floor`` (changes up to it were not seen one by one)."""
        self._attrs.clear()
        self._touched.clear()
        self._floor = floor
