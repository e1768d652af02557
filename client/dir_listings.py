"""Directory listings kept in mount memory: READDIR(PLUS) answered without the daemon.

A ``ReaddirReq`` answers up to 1,000 entries, but the kernel asks one page at a time (about 24
READDIRPLUS entries, 100 plain ones a page): without this, each page of a listing was one round
trip to the daemon, which listed the directory again from the page's cookie. Here the entries of
each answer are kept (``Listing``), so a listing costs the daemon one request per 1,000 entries,
and the pages after the first are answered on the session's reader thread (Operations._fast_readdir).

Whether a kept listing may answer is Operations' rule (docs/design.md, "Listings kept in mount
memory"): a listing's first page only while nothing could have changed the directory unseen (a
dataset mount while the feed is healthy; the default mount while it holds the directory whole
under a callback) and the feed reported no change of it since the listing was asked; a later
page of a listing also within ``CONTINUE_S`` of its asking (one ``readdir`` of a directory read
as one snapshot, which POSIX allows). A change this mount makes in the directory drops its
listing (``drop``, from Operations' ``_name_made`` / ``_name_gone``), and a listing asked while
such a drop happened is not kept (``generation``).
"""

from __future__ import annotations

import bisect
import time
from collections import OrderedDict

from .fuse.replies import dirent_record

#: directories whose listings are kept (least recently used first out)
KEPT_DIRS = 1024
#: a later page of a listing is answered from memory this long after the listing was asked
CONTINUE_S = 5.0
#: READDIRPLUS pages kept whole per listing (``Listing.pages``)
PAGES_KEPT = 2
#: directories whose last change here is remembered (``changed_here_since``); older ones: "changed"
TOUCHED_DIRS = 65_536


class Listing:
    """Entries (``protocol.DirEntry``: name, cookie, attr) of one directory after cookie
    ``after``, in cookie order, as the daemon listed them at change stamp ``stamp`` (the kernel
    cache model's clock, kernel_cache.py); ``complete``: nothing follows the last one."""

    __slots__ = ("after", "entries", "cookies", "complete", "stamp", "dir_grant", "asked", "generation", "_records",
                 "plus", "pages")

    def __init__(self, after: int, entries: list, complete: bool, stamp: int, dir_grant: int = -1):
        self.after, self.entries, self.complete, self.stamp = after, entries, complete, stamp
        self.dir_grant = dir_grant  # the directory callback that came with it (its change number), -1: none
        self.cookies = [e.cookie for e in entries]
        self.asked = time.monotonic()
        self.generation = 0  # KeptListings.generation when kept
        self._records: list[bytes] | None = None
        #: READDIRPLUS answers of its entries in their wire form, kept by the mount's ``_encoded``
        #: (inode -> (the attributes answered, the size answered, the bytes)): kept with the listing,
        #: not with the kernel's inode, so a cold walk after drop_caches (which FORGETs every inode)
        #: encodes nothing again (a fifth of a cold walk's mount CPU was encoding)
        self.plus: dict = {}
        #: READDIRPLUS pages answered whole, by (first entry, buffer size): Operations._fill's
        #: ``PlusPage``, answered again as they are while what each entry's answer was made of is
        #: the same (at most ``PAGES_KEPT``: a walk asks the same pages each time)
        self.pages: dict = {}

    def records(self) -> list[bytes]:
        """Each entry's ``fuse_dirent`` in its wire form (replies.dirent_record), made once."""
        if self._records is None:
            self._records = [dirent_record(e.name, e.cookie, e.attr.ino, e.attr.mode) for e in self.entries]
        return self._records

    def page(self, offset: int) -> int | None:
        """The index of the first entry after cookie ``offset`` (``len(entries)``: the end), or
        None where this listing does not cover ``offset`` (before its start, or at its end with
        more to come)."""
        if offset == self.after:
            return 0 if self.entries or self.complete else None
        k = bisect.bisect_left(self.cookies, offset)
        if k == len(self.cookies) or self.cookies[k] != offset:
            return None  # not a cookie this listing gave
        if k + 1 == len(self.cookies) and not self.complete:
            return None
        return k + 1


class KeptListings:
    """The last ``Listing`` of each directory (by inode), at most ``KEPT_DIRS`` of them."""

    def __init__(self, dirs: int = KEPT_DIRS):
        self._kept: OrderedDict[int, Listing] = OrderedDict()
        self._dirs = dirs
        #: bumped by every drop: a listing of a directory asked before a drop of it may predate a change made here
        self.generation = 0
        #: directory -> the generation of the last change made here in it (its own attributes,
        #: which its parent's listing carries, changed then)
        self._touched: OrderedDict[int, int] = OrderedDict()
        self._touched_floor = 0

    def get(self, ino: int) -> Listing | None:
        return self._kept.get(ino)

    def keep(self, ino: int, listing: Listing, generation: int) -> None:
        """Keep ``listing`` of ``ino`` unless a change was made here in it since ``generation`` was read."""
        if self.changed_here_after(generation, ino):
            return
        listing.generation = generation
        self._kept[ino] = listing
        self._kept.move_to_end(ino)
        while len(self._kept) > self._dirs:
            self._kept.popitem(last=False)

    def drop(self, ino: int) -> None:
        """A change made here in directory ``ino``: its listing, and its attributes in its parent's, are old."""
        self.generation += 1
        self._kept.pop(ino, None)
        self._touched.pop(ino, None)
        self._touched[ino] = self.generation
        while len(self._touched) > TOUCHED_DIRS:
            self._touched_floor = self._touched.popitem(last=False)[1]

    def changed_here_since(self, listing: Listing, ino: int) -> bool:
        """Whether a change made here in directory ``ino`` may postdate ``listing``."""
        return self.changed_here_after(listing.generation, ino)

    def changed_here_after(self, generation: int, ino: int) -> bool:
        """Whether a change made here in directory ``ino`` may have come after ``generation`` was read."""
        return generation < self._touched_floor or self._touched.get(ino, 0) > generation

    def clear(self) -> None:
        self.generation += 1
        self._kept.clear()
        self._touched.clear()
        self._touched_floor = self.generation

    def __len__(self) -> int:
        return len(self._kept)
