"""Read hints: where a directory's small files live, so a read starts before its lookup answers.

A reader walking the files of a directory in any order (a training epoch, a
shuffled DataLoader) pays per cold file two round trips in series: the LOOKUP
at the metadata daemon (close-to-open consistency needs it, and it brings the
chunk map: operations.py), then the chunk read at a storage node. The second
depends on the first only for *where* the chunk is and *which version* is
current, and both are predictable: they are what a listing of the directory
said a moment ago.

So once a process has looked up and opened ``WALK_THRESHOLD`` files of one
directory (Lustre's statahead starts on the same pattern), the mount lists that
directory once in the background (``ReaddirReq`` with ``open_info`` and
``small_only``: the first chunk of every file of at most one chunk) and keeps
``name -> Hint``. On the LOOKUP of a hinted name it starts the chunk read at
once, beside the LookupReq (``DataPath.fetch_soon(Fetch.hinted(...))``); by the time the kernel
sends READ the data is usually there.

The lookup stays the authority. Chunk data is cached under (ino, index,
version), and a hinted read keeps only a copy of exactly the hinted version
(``Fetch.exact``), so the data is used only if the lookup names the
same inode and version. A hint that went out of date costs one wasted read,
never a stale byte; every lookup answer refreshes the hint of its name, so a
rewritten file is re-hinted at its next lookup. Nothing here needs the change
feed.

Memory: at most ``max_hints`` hints (least recently listed directories go
first); directories of more than ``MAX_LISTED`` entries are not listed (a
reader of a huge directory gets no hints, and the daemon no huge listing).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import NamedTuple

from ..common import protocol as p
from ..common.errors import StripefsError
from ..common.layout import is_ec, one_chunk

log = logging.getLogger(__name__)

#: lookup-then-opens in one directory before it is listed for hints
WALK_THRESHOLD = 3
#: directories with more entries than this are not listed
MAX_LISTED = 65_536
#: entries per ReaddirReq page (each costs the daemon a chunk-map query while it holds its lock)
PAGE = 256


class Hint(NamedTuple):
    ino: int
    ref: p.ChunkRef  # chunk 0: its version and nodes
    length: int  # the layout's chunk size: what a whole-chunk read asks for


def hint_of(info: p.OpenRsp) -> Hint | None:
    """The hint an open information gives: a replicated file of one chunk, written; else None."""
    ref = one_chunk(info)
    if ref is None or not ref.nodes or is_ec(info.layout):
        return None
    return Hint(info.attr.ino, ref, info.layout.chunk_size)


class DirHints:
    """name -> Hint per listed directory, bounded; what to list next (``should_list``)."""

    def __init__(self, max_hints: int = 262_144):
        self.max_hints = max_hints
        self._dirs: OrderedDict[int, dict[bytes, Hint]] = OrderedDict()  # dir ino -> its hints, least recent first
        self._count = 0
        self._walks: dict[int, int] = {}  # dir ino -> lookup-then-opens seen while it had no hints
        self._listing: set[int] = set()
        self.listed = 0  # directories listed so far (metrics, tests)

    def __len__(self) -> int:
        return self._count

    def get(self, parent: int, name: bytes) -> Hint | None:
        names = self._dirs.get(parent)
        return names.get(name) if names is not None else None

    def learn(self, parent: int, name: bytes, info: p.OpenRsp) -> None:
        """A lookup answered: the hint of ``name`` is what it says (in a listed directory)."""
        names = self._dirs.get(parent)
        if names is None:
            return
        hint = hint_of(info)
        old = names.pop(name, None) if hint is None else names.get(name)
        if hint is not None:
            names[name] = hint
        self._count += (hint is not None) - (old is not None)
        self._trim(parent)

    def forget(self, parent: int, name: bytes) -> None:
        """The name is gone (the lookup answered NOT_FOUND)."""
        names = self._dirs.get(parent)
        if names is not None and names.pop(name, None) is not None:
            self._count -= 1

    def should_list(self, parent: int) -> bool:
        """A process looked up and opened a file of ``parent``: True when it is time to list it."""
        if parent in self._dirs or parent in self._listing:
            return False
        if len(self._walks) > 4096:
            self._walks.clear()
        seen = self._walks[parent] = self._walks.get(parent, 0) + 1
        return seen >= WALK_THRESHOLD

    async def list_dir(self, meta, nodes, parent: int) -> None:
        """List ``parent`` (pages of PAGE) and keep the hints of its small files. Never raises."""
        self._listing.add(parent)
        names: dict[bytes, Hint] = {}
        try:
            after, seen = 0, 0
            while True:
                rsp = await meta.call(p.ReaddirReq(ino=parent, after=after, limit=PAGE, open_info=True, small_only=True))
                by_ino = {e.attr.ino: e.name for e in rsp.entries}
                for info in rsp.files:
                    hint = hint_of(info)
                    name = by_ino.get(info.attr.ino)
                    if hint is not None and name is not None:
                        nodes.learn(info.nodes)
                        names[name] = hint
                seen += len(rsp.entries)
                if not rsp.more or not rsp.entries:
                    break
                if seen >= MAX_LISTED:
                    log.debug("directory %d has more than %d entries: no read hints for it", parent, MAX_LISTED)
                    names = {}
                    break
                after = rsp.entries[-1].cookie
        except StripefsError as exc:
            log.debug("listing directory %d for read hints failed: %s", parent, exc)
            return
        finally:
            self._listing.discard(parent)
            self._walks.pop(parent, None)
        self._keep(parent, names)

    def _keep(self, parent: int, names: dict[bytes, Hint]) -> None:
        old = self._dirs.pop(parent, None)
        self._count -= len(old) if old else 0
        self._dirs[parent] = names
        self._count += len(names)
        self.listed += 1
        self._trim(parent)

    def _trim(self, keep: int) -> None:
        """Drop the least recently listed directories (never ``keep``) while over ``max_hints``."""
        while self._count > self.max_hints and len(self._dirs) > 1:
            oldest = next(iter(self._dirs))
            if oldest == keep:
                self._dirs.move_to_end(keep)
                continue
            self._count -= len(self._dirs.pop(oldest))
