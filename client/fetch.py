"""What the data path fetches ahead of a read: ``Fetch``, one chunk wanted in the chunk cache.

Fetches start in three places, all through ``DataPath.fetch`` (client/striping.py):

* a LOOKUP by a process walking a directory's files (Operations.lookup): the
  chunk a read hint names, beside the lookup (``Fetch.hinted``,
  client/dir_hints.py), and a one-chunk file about to be opened
  (``Fetch.small_file``), while the kernel sends OPEN and READ;
* a sequential read: the chunks after it, within its read-ahead window
  (``Fetch.ahead``, client/readahead.py);
* the sampler-order prefetcher (client/prefetch.py): small files of one node in
  one request (``DataPath.fetch(..., node=N)``).

Every one is a load of the chunk cache under (ino, index, version), so a
fetch and a read of the same chunk share one network read
(ChunkCache.fetch), and nothing fetched is ever served for another version.
A fetch that fails is no error: the read that follows retries and reports.
"""

from __future__ import annotations

from typing import NamedTuple

from ..common import protocol as p
from ..common.layout import one_chunk
from .dir_hints import Hint
from .open_files import OpenFile


class Fetch(NamedTuple):
    ino: int
    index: int
    #: the chunk's version and nodes; None for read-ahead: taken from ``of`` when the fetch runs
    #: (the chunk map may change between a read and its read-ahead)
    ref: p.ChunkRef | None
    #: a whole chunk's bytes (the layout's chunk size)
    length: int
    #: counted as read-ahead (fetched, then used or wasted: client/metrics.py)
    ahead: bool = True
    #: a read hint's guess: exactly ``ref.version``, from the replica a read would ask first, one try
    exact: bool = False
    of: OpenFile | None = None
    #: a file about to be opened: the nodes it names are learnt; erasure-coded, the fragments holding
    #: its data are fetched instead of the chunk (client/ec_path.py)
    info: p.OpenRsp | None = None

    @property
    def key(self) -> tuple[int, int, int] | None:
        """Its chunk cache key (None: a read-ahead whose chunk is unwritten now)."""
        ref = self.current_ref()
        return (self.ino, self.index, ref.version) if ref is not None else None

    def current_ref(self) -> p.ChunkRef | None:
        """The chunk to read: ``ref``, or for read-ahead the open file's entry now; None when unwritten,
        or in a cold tier (no nodes: the read itself recalls it, with its read-ahead window; docs/tiering.md)."""
        ref = self.ref if self.of is None else self.of.chunks.get(self.index)
        return ref if ref is not None and ref.version and ref.nodes else None

    @classmethod
    def ahead_of(cls, of: OpenFile, index: int) -> "Fetch":
        """Chunk ``index`` of an open file, ahead of its sequential reader."""
        return cls(of.ino, index, None, of.chunk_size, of=of)

    @classmethod
    def small_file(cls, info: p.OpenRsp) -> "Fetch | None":
        """The one chunk of a file about to be opened (None: not a written one-chunk file)."""
        ref = one_chunk(info)
        if ref is None:
            return None
        return cls(info.attr.ino, 0, ref, info.layout.chunk_size, ahead=False, info=info)

    @classmethod
    def hinted(cls, hint: Hint) -> "Fetch":
        return cls(hint.ino, 0, hint.ref, hint.length, exact=True)
