"""The change log: every namespace change, in commit order, in the database.

Mounts cache names and attributes in the kernel and drop them when told
(client/kernel_cache.py). With several metadata daemons over one database, a
mount follows one daemon's feed but must hear of changes made through every
daemon, in order. So the change is not announced from memory: the operation
that makes it also appends a row to ``change_log`` in the same transaction
(``MetaService._write`` with ``change=``), numbered by the ``change_seq``
counter row (daemon/store.py ``log_change``). The counter's row lock makes
numbers follow commit order with no holes: a writer cannot take number n+1
before the holder of n has committed (or rolled back and given it back), so a
reader that sees n+1 already sees n.

Every daemon's feed (daemon/events.py) publishes the log in order, reading
``seq > last published``: on SQLite right after each group commit (the only
writer is this daemon, so nothing is polled and an event still goes out after
the commit that made it durable, before the replies); on a shared database
also every ``POLL_S``, which is how changes made through other daemons reach
its mounts. (PostgreSQL's LISTEN/NOTIFY could shorten that wait; correctness
never rests on it.)

A row holds ``msgpack([inodes, entries])``: the inodes whose attributes or data
changed and the (parent, name) entries created, removed or renamed.

Bound: the duties leader keeps the newest ``KEEP`` rows (daemon/duties.py). A
mount that falls further behind sees a gap and drops its whole cache, as for
any gap.
"""

from __future__ import annotations

from typing import Iterable

import msgspec

#: a shared database is read for other daemons' changes this often
POLL_S = 0.1
#: rows kept by the trimming duty
KEEP = 100_000
#: rows read per query
PAGE = 1000

_decoder = msgspec.msgpack.Decoder(tuple[list[int], list[tuple[int, bytes]]])


def encode(inodes: Iterable[int], entries: Iterable[tuple[int, bytes]]) -> bytes:
    return msgspec.msgpack.encode((sorted(set(inodes)), list(entries)))


def decode(blob: bytes) -> tuple[list[int], list[tuple[int, bytes]]]:
    return _decoder.decode(blob)
