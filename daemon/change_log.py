"""The change log: every namespace change, in commit order, in the database.

Mounts cache names and attributes in the kernel and drop them when told
(client/kernel_cache.py). With several metadata daemons over one database, a
mount follows one daemon's feed but must hear of changes made through every
daemon, in order. So the change is not announced from memory: the operation
that makes it also appends a row to ``change_log`` in the same transaction
(``Txn.write`` with ``change=``, daemon/txn.py), and every daemon's feed
(daemon/events.py) publishes the log by its number ``seq``, reading
``seq > last published``. Numbers follow commit order with no holes:

* SQLite (one writer, group commit): ``log_change`` numbers the row at once
  from the ``change_seq`` counter row; the feed reads the new rows right
  after each group commit, before the replies (nothing is polled).
* A shared database (PostgreSQL): a counter row taken by every writer would
  make every two concurrent namespace transactions conflict (SERIALIZABLE
  aborts one; under a create storm some ran out of retries). So writers only
  insert the row, unnumbered, and a *sequencer* (``number_changes``, run by
  every daemon's feed loop every ``POLL_S`` and after its own writes, one
  short transaction) numbers the rows that have committed, after the last
  number. A row is visible to it only once its writer committed, so the
  order follows commit order (rows committed between two runs are numbered
  together, by id: their relative order does not matter to invalidations),
  and a run's numbers become visible all at once with its commit: a reader
  never sees a hole. Sequencers of two daemons racing conflict on the
  counter row and one is retried. (LISTEN/NOTIFY could shorten the poll;
  correctness never rests on it.)

A row holds ``msgpack([inodes, entries, writer])``: the inodes whose attributes
or data changed, the (parent, name) entries created, removed or renamed, and
the writer's tag (``protocol.writer_tag`` of the OnceReq client id that made
the change, 0: none; rows without it decode as 0): a mount ends its callbacks
only on others' changes (daemon/callbacks.py).

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

class _Row(msgspec.Struct, array_like=True):
    inodes: list[int]
    entries: list[tuple[int, bytes]]
    writer: int = 0


class _RawRow(msgspec.Struct, array_like=True):
    inodes: msgspec.Raw
    entries: msgspec.Raw
    writer: int = 0


_decoder = msgspec.msgpack.Decoder(_Row)
_raw_decoder = msgspec.msgpack.Decoder(_RawRow)


def encode(inodes: Iterable[int], entries: Iterable[tuple[int, bytes]], writer: int = 0) -> bytes:
    row = (sorted(set(inodes)), list(entries))
    return msgspec.msgpack.encode((*row, writer) if writer else row)


def decode(blob: bytes) -> tuple[list[int], list[tuple[int, bytes]]]:
    row = _decoder.decode(blob)
    return row.inodes, row.entries


def decode_writer(blob: bytes) -> tuple[list[int], list[tuple[int, bytes]], int]:
    """``decode``, and the writer's tag."""
    row = _decoder.decode(blob)
    return row.inodes, row.entries, row.writer


def decode_raw(blob: bytes) -> tuple[msgspec.Raw, msgspec.Raw, int]:
    """``decode_writer`` with the lists left as msgpack (what the plain feed sends on as they are:
    ``protocol.encode_event_raw``)."""
    row = _raw_decoder.decode(blob)
    return row.inodes, row.entries, row.writer
