"""Creates (and unlinks) of many files in one directory as one namespace operation (issue 30).

A mount sends the creates it answered itself (client/async_dirops.py) in
``BatchReq``s, most of them a run of creates in one directory. One by one,
each costs a savepoint, a read of its inode number back, a statement per
table, its own placement and its own change of the directory's times.
``create_many`` makes the whole run at once, over the store's statements for
many rows (daemon/store.py ``names_in``, ``insert_inodes``,
``insert_dentries``, ``put_new_chunks``):

* every check first, nothing written until all are made, each file's outcome
  its own: a bad name (INVALID, NAME_TOO_LONG), the directory's own error
  (NOT_FOUND, NOT_DIR, READ_ONLY in a snapshot), a delegated number in use or
  named twice (EXISTS), a name taken or named twice (EXISTS). The order of
  these checks, and which of two same names wins (the first), are those of
  ``Namespace.create_open`` run one after another;
* then one statement per table: the inodes (numbers delegated to the
  session as sent, the others taken in one block off the counter:
  ``reserve_inos``), their entries, their first chunk's placement
  (``place_new_files``), and one change of the directory's times;
* a directory under a quota is not made here (``ManyNotHere``): each create
  is checked and charged on its own there (daemon/quota.py); nothing was
  written when it is raised.

The caller runs it in one savepoint (daemon/burst.py ``_many``): an error
that is no file's own (a constraint, a number out of range) undoes the
whole, and the caller makes the creates one by one instead, each with its
own outcome. On PostgreSQL the savepoint is the run's within the burst's
transaction (daemon/burst.py ``_transaction``).

``unlink_many`` does the same for a run of unlinks in one directory (a
mount's ``rm -rf`` answered by the mount arrives as BatchReqs of them): each
unlink keeps its own checks, writes and change log row (the events the
mounts get are those of the unlinks one by one; the rows are written at once
after the last unlink, ``Txn.log_many_in_run``: the change counter moved once
for the run, its numbers consecutive in the order of the unlinks), but the run shares one
savepoint, one look-up and one insert of its OnceReq records
(daemon/burst.py ``_unlinks``), one change of the directory's times and one
report of its attributes, after the last. SQLite only. Its reads and writes go by
the run too: the entries of all its names in one statement (``entry_inodes_in``;
a name sent twice, a missing one or a file with hard links is read again on its
own), and the trash's writes of all of it (entries deleted, nlink 0, the trash
rows: ``Trash.take_many``) one statement per table, after the last check.
"""

from __future__ import annotations

import logging
import stat
from typing import Callable, NamedTuple, Sequence

from ..common.errors import ErrorCode, StripefsError
from ..common.protocol import Attr, ChunkRef, Layout, NodeAddr
from .namespace import Namespace, check_name, to_attr, to_layout

log = logging.getLogger(__name__)


class NewFile(NamedTuple):
    """One create of ``create_many``."""

    name: bytes
    mode: int  # permission bits (a regular file is made)
    uid: int
    gid: int
    ino: int = 0  # a number delegated to the creating session (checked by the caller), 0: the next


class ManyNotHere(Exception):
    """These creates must be made one by one (``Namespace.create_open``); nothing was written."""


Made = tuple[Attr, Layout, list[ChunkRef], list[NodeAddr]]


def create_many(ns: Namespace, parent: int, files: Sequence[NewFile]) -> list[Made | StripefsError]:
    """Create regular files ``files`` in directory ``parent``: each one's ``open_info`` (as
    ``Namespace.create_open`` gives a new file's) or its error, in order (module docstring)."""
    if ns.quotas.roots:
        raise ManyNotHere("directory quotas are checked and charged create by create")
    out: list[Made | StripefsError | None] = [None] * len(files)
    try:
        parent_row = ns.live_directory(parent)
        parent_error = None
    except StripefsError as exc:
        parent_row, parent_error = None, exc
    for i, f in enumerate(files):
        try:
            check_name(f.name)
        except StripefsError as exc:
            out[i] = exc
            continue
        if parent_error is not None:
            out[i] = parent_error
    todo = [i for i in range(len(files)) if out[i] is None]
    if not todo:
        return out
    taken_inos = ns.store.inodes_in([files[i].ino for i in todo if files[i].ino])
    taken_names = ns.store.names_in(parent, [files[i].name for i in todo])
    now = ns.clock()
    rows: list[dict] = []
    made: list[int] = []
    for i in todo:
        f = files[i]
        if f.ino in taken_inos:
            out[i] = StripefsError(ErrorCode.EXISTS, f"inode {f.ino} exists already")
        elif f.name in taken_names:
            out[i] = StripefsError(ErrorCode.EXISTS, f"{f.name!r} exists in directory {parent}")
        else:
            if f.ino:
                taken_inos.add(f.ino)
            taken_names.add(f.name)
            row = ns.new_inode_row(parent_row, stat.S_IFREG | (f.mode & 0o7777), f.uid, f.gid, now=now)
            row["ino"] = f.ino
            rows.append(row)
            made.append(i)
    if not rows:
        return out
    numbered = [row for row in rows if not row["ino"]]
    for row, ino in zip(numbered, ns.store.reserve_inos(len(numbered)) if numbered else ()):
        row["ino"] = ino
    ns.store.insert_inodes(rows)
    ns.store.insert_dentries(parent, ((files[i].name, row["ino"]) for i, row in zip(made, rows)))
    ns.store.touch_dir(parent, now)
    for i, row, (refs, addrs) in zip(made, rows, ns.place_new_files(rows)):
        out[i] = (to_attr(row), to_layout(row), refs, addrs)
    log.debug("%d file(s) created in directory %d at once (%d refused)", len(rows), parent, len(files) - len(rows))
    return out


def unlink_many(ns: Namespace, parent: int, names: Sequence[bytes],
                log_changes: Callable[[list[tuple[list, list]]], list[tuple]]) -> list[tuple | StripefsError]:
    """Unlink ``names`` of directory ``parent`` in order, in the caller's one savepoint: each one's
    change as ``log_changes([(inodes, entries), ...])`` logged it (after_change's arguments; the
    run's rows at once, after the last unlink, each its own number in the order of the unlinks),
    or the error its checks failed with (``Namespace.unlink_checked``: nothing of it written).
    The directory's times change once, after the last. An error past an unlink's checks is raised: the caller
    undoes the run and unlinks one by one. A directory under a quota is not done here
    (``ManyNotHere``: each unlink is charged on its own, daemon/quota.py)."""
    if ns.quotas.roots:
        raise ManyNotHere("directory quotas are charged unlink by unlink")
    out: list[tuple | StripefsError | None] = []
    changes: list[tuple[list, list]] = []  # the unlinks' changes, in order: logged at once, after the last
    now = 0
    found = ns.store.entry_inodes_in(parent, names)  # every name's row in one statement
    trashed: list[tuple] = []  # (parent, name, row, now) going to the trash, written at once
    for name in names:
        ns.unlinked = []
        row = found.pop(name, None)  # popped: a name sent twice is read again (NOT_FOUND)
        try:
            if row is not None and row["nlink"] <= 1:  # its one name: nothing else in the run changes it
                ns.unlink_checked(parent, name, row)
            else:  # absent (the precise error), or hard links (the run may change its nlink)
                ns.trash.take_many(trashed)
                trashed = []
                row = ns.unlink_checked(parent, name)
        except StripefsError as exc:
            out.append(exc)
            continue
        now = ns.clock()
        if row["nlink"] <= 1 and ns.trash.keep_ns:
            ns.unlinked.append(row["ino"])  # nlink changed, as in Namespace.unlink_row
            trashed.append((parent, name, row, now))
        else:
            ns.unlink_row(parent, name, row, now)
        changes.append(([parent, *ns.take_unlinked()], [(parent, name)]))
        out.append(None)
    ns.trash.take_many(trashed)
    if now:
        ns.store.touch_dir(parent, now)
    logged = iter(log_changes(changes) if changes else ())
    return [next(logged) if outcome is None else outcome for outcome in out]
