"""Every SQL statement of the metadata daemon, behind one small class per engine.

``SqlStore`` is the storage engine interface: namespace.py holds the POSIX
semantics and calls only these methods. Its SQL is written once, in SQLite's
spelling, and ``self.dialect`` (daemon/dialect.py) rewrites it for the engine:
``SqliteStore`` (below, the embedded default) and ``PgStore``
(daemon/pg_store.py, PostgreSQL) differ only in connections and transactions.
A new method is written once here, with ``self._x(sql, params)``, and works
on both. Rows come back indexable by position and by column name (``sqlite3.Row``
or pg_store's equivalent); an inode row has the columns of the ``inodes``
table (daemon/db.py).

Transactions, SQLite: the service keeps one transaction open (``begin``) and
commits it in groups (``commit``); each request runs inside ``savepoint()`` so
a failure undoes only that request's statements. PostgreSQL: each request is
its own transaction (``PgStore.run``), see daemon/pg_store.py.
"""

from __future__ import annotations

import contextlib
import logging
import re
import sqlite3
from typing import Callable, Iterable, Iterator, Sequence

from ..common.protocol import Attr
from .dialect import SQLITE, Dialect

log = logging.getLogger(__name__)

#: garbage bound for copies of a deleted inode: every version goes
ANY_VERSION = (1 << 63) - 1
#: a garbage row whose ``part`` has this bit deletes that part only (DeleteChunksReq ``all_parts=False``):
#: a slot that must go while the other slot of the same chunk holds the committed copy (``abandoned_slots``)
EXACT_PART = 1 << 20

#: directory rows ``dir_cache`` keeps at most
DIR_CACHE_MAX = 4096
#: values in one ``IN (...)`` list (``_select_in``)
IN_PART = 500
#: parameters of one multi-row INSERT (``_xm`` on a shared database; PostgreSQL takes 65,535)
INSERT_PARAMS = 30_000
#: an INSERT of one row of placeholders: its prefix, the row, what follows (ON CONFLICT, RETURNING)
_ONE_ROW_INSERT = re.compile(r"^(INSERT\s.+?\sVALUES\s*)(\([?,\s]*\))(.*)$", re.S | re.I)

_INODE_FIELDS = (
    "mode uid gid nlink rdev size atime_ns mtime_ns ctime_ns generation chunk_size stripe_count redundancy stripe_seed snapshot"
).split()


def _encode_nodes(nodes: Sequence[int]) -> str:
    return ",".join(str(int(n)) for n in nodes)


def decode_nodes(text: str) -> list[int]:
    return [int(n) for n in text.split(",") if n]


#: a stored ``chunks.fversions``: a fragment version per position, '' when all are at the row's
#: version (common/protocol.ChunkRef ``fversions``); the same text form as a node list
encode_fversions = _encode_nodes
decode_fversions = decode_nodes


class SqlStore:
    """The SQL of every engine; subclasses give ``conn`` and the transaction methods."""

    dialect: Dialect = SQLITE
    #: True: the service group-commits one long transaction (SQLite); False: one transaction per request
    group_commit = True
    #: what the engine raises for a failed statement or commit
    errors: tuple[type[BaseException], ...] = (sqlite3.Error,)
    conn = None
    #: directory rows read while a burst holds the lock (``SqliteStore.dir_cache``), else None
    _dirs: dict[int, dict] | None = None

    @contextlib.contextmanager
    def dir_cache(self) -> Iterator[None]:
        """Directory rows read in the block are kept, so a burst reads a directory once, not once
        per operation (its check and its reported attributes): daemon/burst.py, per hold of the
        lock (SQLite) or in the burst's transaction (PostgreSQL: this thread's), when nothing else
        writes. Every write of an inode row goes through this class (``update_inode``,
        ``add_nlink``, ``touch_dir``, written through, ``delete_inode``), and a rolled-back
        savepoint empties it. Rows come back as dicts (by column name only)."""
        self._dirs = {}
        try:
            yield
        finally:
            self._dirs = None

    def _x(self, sql: str, params: Sequence = ()):
        """Execute one statement of the shared SQL text on the current connection."""
        return self.conn.execute(self.dialect.sql(sql), params)

    def _xm(self, sql: str, rows: Iterable[Sequence]) -> None:
        """``sql`` for each of ``rows``. On a shared database psycopg's executemany is never used:
        it runs in a pipeline of its own, and when the transaction's serialization failure (SQLSTATE
        40001, which the store retries) comes inside it, psycopg logs "error ignored terminating
        Pipeline: pipeline aborted" as it leaves (tests/unit/test_pg_burst.py: two daemons' bursts
        creating in one directory; the pg2 bench's shared directory holds, whose DELETE and UPDATE
        conflict by design). An INSERT of several rows is one statement of them all
        (``INSERT_PARAMS`` at most); any other statement runs once per row (an UPDATE or DELETE
        here names a few rows: a sequencer run's changes, a session's directory holds)."""
        rows = list(rows)
        if not rows:
            return
        if self.dialect is SQLITE:
            self.conn.cursor().executemany(self.dialect.sql(sql), rows)
            return
        one_row = _ONE_ROW_INSERT.match(sql) if len(rows) > 1 else None
        if one_row is None:
            for r in rows:
                self._x(sql, r)
            return
        head, row, tail = one_row.groups()
        per = max(1, INSERT_PARAMS // max(1, len(rows[0])))
        for i in range(0, len(rows), per):
            part = rows[i : i + per]
            self._x(head + ",".join([row] * len(part)) + tail, [v for r in part for v in r])

    def _select_in(self, sql: str, params: Sequence, values: Sequence) -> list:
        """The rows of ``sql``, whose ``IN ({})`` takes ``values``, after ``params``: one statement
        per ``IN_PART`` values (under SQLite's and PostgreSQL's limits on parameters)."""
        rows = []
        for i in range(0, len(values), IN_PART):
            part = list(values[i : i + IN_PART])
            rows += self._x(sql.format(",".join("?" * len(part))), (*params, *part)).fetchall()
        return rows

    execute = _x  # for migrations (daemon/db.py) and tests

    # -- epochs (PgStore overrides: a database sequence) -----------------------

    def next_epoch(self) -> int:
        raise NotImplementedError("epochs of this store come from a block in memory (daemon/namespace.py)")

    def last_epoch(self) -> int:
        raise NotImplementedError


    # -- meta --------------------------------------------------------------

    def get_meta(self, key: str, default=None):
        row = self._x("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
        return default if row is None else row[0]

    def init_meta(self, key: str, value):
        """Set ``key`` unless it is set; the value it has now."""
        self._x("INSERT INTO meta (key, value) VALUES (?, ?) ON CONFLICT (key) DO NOTHING", (key, value))
        return self.get_meta(key)

    def set_meta(self, key: str, value) -> None:
        self._x("INSERT INTO meta (key, value) VALUES (?, ?) ON CONFLICT (key) DO UPDATE SET value=excluded.value", (key, value))

    # -- inodes ------------------------------------------------------------

    def get_inode(self, ino: int) -> sqlite3.Row | dict | None:
        dirs = self._dirs
        if dirs is None:
            return self._x("SELECT * FROM inodes WHERE ino=?", (ino,)).fetchone()
        row = dirs.get(ino)
        if row is None:
            row = self._x("SELECT * FROM inodes WHERE ino=?", (ino,)).fetchone()
            if row is not None and row["mode"] & 0xF000 == 0x4000 and len(dirs) < DIR_CACHE_MAX:
                row = dirs[ino] = dict(zip(row.keys(), row))
        return row

    def insert_inode(self, **fields) -> int:
        """The new inode's number: ``fields["ino"]`` when given (one delegated to a session,
        daemon/inode_ranges.py; a number in use is EXISTS), else the next one."""
        cols = [f for f in ("ino", *_INODE_FIELDS) if f in fields]
        return self._x(
            f"INSERT INTO inodes ({','.join(cols)}) VALUES ({','.join('?' * len(cols))}) RETURNING ino",
            [fields[c] for c in cols],
        ).fetchone()[0]

    def update_inode(self, ino: int, **fields) -> None:
        for key in fields:
            if key not in _INODE_FIELDS:
                raise KeyError(key)
        assignments = ",".join(f"{k}=?" for k in fields)
        if self._dirs is not None:
            self._dirs.pop(ino, None)
        self._x(f"UPDATE inodes SET {assignments} WHERE ino=?", [*fields.values(), ino])

    def add_nlink(self, ino: int, delta: int, ctime_ns: int) -> None:
        if self._dirs is not None:
            self._dirs.pop(ino, None)
        self._x("UPDATE inodes SET nlink=nlink+?, ctime_ns=? WHERE ino=?", (delta, ctime_ns, ino))

    def touch_dir(self, ino: int, now: int, nlink: int = 0) -> None:
        """A directory's entries changed at ``now`` (mtime and ctime), its subdirectories by ``nlink``:
        one statement for what an entry change does to its directory."""
        self._x("UPDATE inodes SET mtime_ns=?, ctime_ns=?, nlink=nlink+? WHERE ino=?", (now, now, nlink, ino))
        if self._dirs is not None:
            row = self._dirs.get(ino)
            if row is not None:  # written through: a new dict (a caller may hold the old one)
                self._dirs[ino] = {**row, "mtime_ns": now, "ctime_ns": now, "nlink": row["nlink"] + nlink}

    def delete_inode(self, ino: int) -> None:
        if self._dirs is not None:
            self._dirs.pop(ino, None)
        self._x("DELETE FROM inodes WHERE ino=?", (ino,))

    def orphans(self) -> list[int]:
        """Inodes with no name left, except those kept in the trash (daemon/trash.py)."""
        return [
            r[0]
            for r in self._x("SELECT ino FROM inodes i WHERE nlink=0 AND NOT EXISTS (SELECT 1 FROM trash t WHERE t.ino = i.ino)")
        ]

    def nameless_in(self, inos: Sequence[int]) -> list[int]:
        """Those of ``inos`` with no name left (nlink 0) that the trash does not hold: the orphans
        among files sessions let go. A trashed file is freed by the trash's purge, never here (an
        ``rm -rf`` with the trash on settles thousands of them: they cost no reclaim attempt each)."""
        return [r[0] for r in self._select_in(
            "SELECT ino FROM inodes WHERE nlink=0 AND ino IN ({}) AND ino NOT IN (SELECT ino FROM trash)", (), inos)]

    def counts(self) -> dict[str, int]:
        """files, directories and logical bytes of regular files (live ones: not a snapshot's), all inodes."""
        row = self._x(
            "SELECT count(*),"
            " CAST(coalesce(sum(CASE WHEN (mode & 0xF000) = 0x8000 AND snapshot = 0 THEN 1 ELSE 0 END), 0) AS INTEGER),"
            " CAST(coalesce(sum(CASE WHEN (mode & 0xF000) = 0x4000 AND snapshot = 0 THEN 1 ELSE 0 END), 0) AS INTEGER),"
            " CAST(coalesce(sum(CASE WHEN (mode & 0xF000) = 0x8000 AND snapshot = 0 THEN size ELSE 0 END), 0) AS INTEGER)"
            " FROM inodes"
        ).fetchone()
        chunks = self._x("SELECT count(*) FROM chunks").fetchone()[0]
        return {"inodes": row[0], "files": row[1], "directories": row[2], "logical_bytes": row[3], "chunks": chunks}

    # -- directory entries -------------------------------------------------

    def lookup_inode(self, parent: int, name: bytes) -> sqlite3.Row | None:
        """The inode row ``name`` in ``parent`` names, in one query (a lookup's hot path)."""
        return self._x("SELECT inodes.* FROM dentries JOIN inodes ON inodes.ino = dentries.ino WHERE dentries.parent=? AND dentries.name=?", (parent, name)).fetchone()

    def entry_inode(self, parent: int, name: bytes) -> sqlite3.Row | None:
        """The inode row ``name`` in ``parent`` names plus its entry's ``cookie``, in one query
        (what unlink, rmdir and rename read of the name they change)."""
        return self._x(
            "SELECT dentries.cookie AS cookie, inodes.* FROM dentries JOIN inodes ON inodes.ino = dentries.ino"
            " WHERE dentries.parent=? AND dentries.name=?", (parent, name)).fetchone()

    def entry_inodes_in(self, parent: int, names: Sequence[bytes]) -> dict[bytes, sqlite3.Row]:
        """``entry_inode`` of each of ``names`` in ``parent`` that exists, by name, in one statement
        per ``IN_PART`` names (a run of unlinks, daemon/namespace_bulk.py ``unlink_many``)."""
        rows = self._select_in(
            "SELECT dentries.name AS name, dentries.cookie AS cookie, inodes.* FROM dentries JOIN inodes ON inodes.ino = dentries.ino"
            " WHERE dentries.parent=? AND dentries.name IN ({})", (parent,), list(dict.fromkeys(names)))
        return {bytes(r["name"]): r for r in rows}

    def get_dentry(self, parent: int, name: bytes) -> sqlite3.Row | None:
        return self._x("SELECT * FROM dentries WHERE parent=? AND name=?", (parent, name)).fetchone()

    def names_in(self, parent: int, names: Sequence[bytes]) -> set[bytes]:
        """Which of ``names`` exist in ``parent`` (a batch of creates checks its names at once)."""
        return {bytes(r[0]) for r in self._select_in("SELECT name FROM dentries WHERE parent=? AND name IN ({})", (parent,), names)}

    def inodes_in(self, inos: Sequence[int]) -> set[int]:
        """Which of ``inos`` exist."""
        return {r[0] for r in self._select_in("SELECT ino FROM inodes WHERE ino IN ({})", (), inos)}

    def insert_inodes(self, rows: Sequence[dict]) -> None:
        """Inodes with their numbers given (``ino``; the other columns as ``insert_inode``'s,
        the same in every row), in one statement."""
        if rows:
            cols = [f for f in ("ino", *_INODE_FIELDS) if f in rows[0]]
            self._xm(f"INSERT INTO inodes ({','.join(cols)}) VALUES ({','.join('?' * len(cols))})",
                     ([row[c] for c in cols] for row in rows))

    def insert_dentries(self, parent: int, entries: Iterable[tuple[bytes, int]]) -> None:
        """Entries (name, ino) of ``parent`` whose names are free (checked: ``names_in``), in one statement."""
        self._xm("INSERT INTO dentries (parent, name, ino) VALUES (?,?,?)", ((parent, name, ino) for name, ino in entries))

    def insert_dentry(self, parent: int, name: bytes, ino: int) -> int:
        return self._x(
            "INSERT INTO dentries (parent, name, ino) VALUES (?,?,?) RETURNING cookie", (parent, name, ino)
        ).fetchone()[0]

    def insert_new_dentry(self, parent: int, name: bytes, ino: int) -> int | None:
        """``insert_dentry`` unless ``name`` exists in ``parent`` (its UNIQUE constraint answers:
        no lookup first); the new cookie, or None when it exists and nothing was inserted."""
        row = self._x(
            "INSERT INTO dentries (parent, name, ino) VALUES (?,?,?) ON CONFLICT (parent, name) DO NOTHING RETURNING cookie",
            (parent, name, ino),
        ).fetchone()
        return None if row is None else row[0]

    def delete_dentry(self, cookie: int) -> None:
        self._x("DELETE FROM dentries WHERE cookie=?", (cookie,))

    def move_dentry(self, cookie: int, parent: int, name: bytes) -> None:
        self._x("UPDATE dentries SET parent=?, name=? WHERE cookie=?", (parent, name, cookie))

    def set_dentry_ino(self, cookie: int, ino: int) -> None:
        self._x("UPDATE dentries SET ino=? WHERE cookie=?", (ino, cookie))

    def dentries_of(self, ino: int) -> list[tuple[int, int, bytes]]:
        """(cookie, parent, name) of every directory entry naming ``ino`` (its hard links)."""
        return [(r[0], r[1], bytes(r[2])) for r in self._x("SELECT cookie, parent, name FROM dentries WHERE ino=?", (ino,))]

    def dentries_in(self, parent: int) -> list[tuple[int, int]]:
        """(cookie, ino) of every entry of directory ``parent``."""
        return [(r[0], r[1]) for r in self._x("SELECT cookie, ino FROM dentries WHERE parent=?", (parent,))]

    def has_children(self, ino: int) -> bool:
        return self._x("SELECT 1 FROM dentries WHERE parent=? LIMIT 1", (ino,)).fetchone() is not None

    def parent_of(self, ino: int) -> int | None:
        """The parent of a directory (directories have exactly one name)."""
        row = self._x("SELECT parent FROM dentries WHERE ino=? LIMIT 1", (ino,)).fetchone()
        return None if row is None else row[0]

    def list_dentries(self, parent: int, after: int, limit: int) -> list[sqlite3.Row]:
        """Entries after cookie ``after`` joined with their inode rows."""
        return self._x(
            "SELECT d.cookie AS cookie, d.name AS name, i.* FROM dentries d JOIN inodes i ON i.ino = d.ino"
            " WHERE d.parent=? AND d.cookie>? ORDER BY d.cookie LIMIT ?",
            (parent, after, limit),
        ).fetchall()

    #: ``list_dentries_open``'s columns: cookie, name, Attr's fields in order, the layout's, snapshot
    OPEN_COLUMNS = ("d.cookie, d.name, " + ", ".join(f"i.{f}" for f in Attr.__struct_fields__)
                    + ", i.chunk_size, i.stripe_count, i.redundancy, i.snapshot")

    def list_dentries_open(self, parent: int, after: int, limit: int) -> list:
        """``list_dentries`` with the columns of ``OPEN_COLUMNS`` in that order, read by position: a
        listing with open information builds each entry's Attr and Layout from slices of its row
        (``Attr(*row[2:13])``), not eleven lookups by name (issue 30: a dataset mount's cold walk)."""
        return self._x(
            f"SELECT {self.OPEN_COLUMNS} FROM dentries d JOIN inodes i ON i.ino = d.ino"
            " WHERE d.parent=? AND d.cookie>? ORDER BY d.cookie LIMIT ?",
            (parent, after, limit),
        ).fetchall()

    # -- symlinks and xattrs -----------------------------------------------

    def insert_symlink(self, ino: int, target: bytes) -> None:
        self._x("INSERT INTO symlinks (ino, target) VALUES (?,?)", (ino, target))

    def get_symlink(self, ino: int) -> bytes | None:
        row = self._x("SELECT target FROM symlinks WHERE ino=?", (ino,)).fetchone()
        return None if row is None else bytes(row[0])

    def get_xattr(self, ino: int, name: bytes) -> bytes | None:
        row = self._x("SELECT value FROM xattrs WHERE ino=? AND name=?", (ino, name)).fetchone()
        return None if row is None else bytes(row[0])

    def set_xattr(self, ino: int, name: bytes, value: bytes) -> None:
        self._x("INSERT INTO xattrs (ino, name, value) VALUES (?,?,?) ON CONFLICT (ino, name) DO UPDATE SET value=excluded.value", (ino, name, value))

    def list_xattrs(self, ino: int) -> list[bytes]:
        return [bytes(r[0]) for r in self._x("SELECT name FROM xattrs WHERE ino=? ORDER BY name", (ino,))]

    def delete_xattr(self, ino: int, name: bytes) -> bool:
        return self._x("DELETE FROM xattrs WHERE ino=? AND name=?", (ino, name)).rowcount > 0

    # -- chunks and garbage ------------------------------------------------

    def get_chunks(self, ino: int, indices: Iterable[int] | None = None) -> dict[int, tuple[int, list[int], list[int]]]:
        """index -> (version, nodes, fversions), for all chunks of ``ino`` or only ``indices``
        (``fversions``: each fragment's version, empty when all are at ``version``)."""
        if indices is None:
            rows = self._x("SELECT idx, version, nodes, fversions FROM chunks WHERE ino=? ORDER BY idx", (ino,))
        else:
            rows = self._select_in(
                "SELECT idx, version, nodes, fversions FROM chunks WHERE ino=? AND idx IN ({})", (ino,), sorted(set(indices))
            )
        return {r[0]: (r[1], decode_nodes(r[2]), decode_fversions(r[3])) for r in rows}

    def chunks_of(self, inos: Sequence[int]) -> dict[int, dict[int, tuple[int, list[int], list[int]]]]:
        """``get_chunks`` of many files in one statement per ``IN_PART`` of them (a listing's open
        information): ino -> index -> (version, nodes, fversions); a file without chunks is absent."""
        out: dict[int, dict[int, tuple[int, list[int], list[int]]]] = {}
        for r in self._select_in("SELECT ino, idx, version, nodes, fversions FROM chunks WHERE ino IN ({}) ORDER BY ino, idx", (), inos):
            out.setdefault(r[0], {})[r[1]] = (r[2], decode_nodes(r[3]), decode_fversions(r[4]))
        return out

    def chunk_maps_of(self, inos: Sequence[int]) -> list:
        """The chunk rows ``(ino, idx, version, nodes, fversions)`` of many files, by ino and index,
        their nodes and fragment versions as stored (text: ``decode_nodes``, ``decode_fversions``):
        a listing decodes each distinct node list once."""
        return self._select_in("SELECT ino, idx, version, nodes, fversions FROM chunks WHERE ino IN ({}) ORDER BY ino, idx", (), inos)

    def put_new_chunks(self, rows: Iterable[tuple[int, int, int, Sequence[int]]]) -> None:
        """Chunk rows (ino, idx, version, nodes) of files created in this transaction (``put_chunk``
        with ``fresh``), in one statement."""
        self._xm("INSERT INTO chunks (ino, idx, version, nodes) VALUES (?,?,?,?)",
                 ((ino, idx, version, _encode_nodes(nodes)) for ino, idx, version, nodes in rows))

    def put_chunk(self, ino: int, idx: int, version: int, nodes: Sequence[int], fversions: Sequence[int] | None = None,
                  *, fresh: bool = False) -> None:
        """Insert or replace a chunk row; its nodes' pending deletions of this chunk are cancelled.
        ``fversions``: the fragments' versions (empty: all at ``version``); None keeps the stored
        ones (only a node changed: a repair, a move), which a caller changing ``version`` never
        passes. ``fresh``: the file was created in this transaction (an inode number is never
        reused, daemon/db.py), so no deletion of it can be pending."""
        fv = encode_fversions(fversions or ())
        if fresh:
            self._x("INSERT INTO chunks (ino, idx, version, nodes, fversions) VALUES (?,?,?,?,?)",
                    (ino, idx, version, _encode_nodes(nodes), fv))
            return
        keep = fversions is None
        self._x(
            "INSERT INTO chunks (ino, idx, version, nodes, fversions) VALUES (?,?,?,?,?)"
            " ON CONFLICT (ino, idx) DO UPDATE SET version=excluded.version, nodes=excluded.nodes"
            + ("" if keep else ", fversions=excluded.fversions"),
            (ino, idx, version, _encode_nodes(nodes), fv),
        )
        if nodes:
            self._x(
                f"DELETE FROM garbage WHERE ino=? AND idx=? AND node_id IN ({','.join('?' * len(nodes))})",
                (ino, idx, *nodes),
            )

    def drop_chunks(self, ino: int, from_index: int = 0, max_version: int = ANY_VERSION) -> int:
        """Move chunk rows with index >= ``from_index`` into garbage; the number moved.

        ``max_version``: copies newer than this (written after the drop) must survive the deletion.
        """
        rows = self._x(
            "SELECT idx, nodes FROM chunks WHERE ino=? AND idx>=?", (ino, from_index)
        ).fetchall()
        for idx, nodes in rows:
            # node 0 marks a missing EC fragment (daemon/redundancy.py): nothing to delete
            self.add_garbage((node, ino, idx, 0, max_version) for node in decode_nodes(nodes) if node)
        self._x("DELETE FROM chunks WHERE ino=? AND idx>=?", (ino, from_index))
        return len(rows)

    def add_garbage(self, rows: Iterable[tuple[int, int, int, int, int]]) -> None:
        """Rows of (node_id, ino, idx, part, max_version)."""
        self._xm("INSERT INTO garbage (node_id, ino, idx, part, max_version) VALUES (?,?,?,?,?)", rows)

    def garbage_for_node(self, node_id: int, limit: int) -> list[sqlite3.Row]:
        """The next deletions for a node; never a chunk a snapshot's row still reads through
        ``data_ino`` (daemon/snapshots.py: it waits, queued, until no row names it)."""
        return self._x(
            "SELECT id, ino, idx, part, max_version FROM garbage g WHERE node_id=?"
            " AND NOT EXISTS (SELECT 1 FROM chunks c WHERE c.data_ino = g.ino AND c.idx = g.idx AND c.data_ino <> 0)"
            " ORDER BY id LIMIT ?", (node_id, limit)
        ).fetchall()

    def garbage_nodes(self) -> list[int]:
        return [r[0] for r in self._x("SELECT DISTINCT node_id FROM garbage")]

    def delete_chunk(self, ino: int, idx: int) -> None:
        self._x("DELETE FROM chunks WHERE ino=? AND idx=?", (ino, idx))

    def delete_garbage(self, ids: Sequence[int]) -> None:
        self._xm("DELETE FROM garbage WHERE id=?", ((i,) for i in ids))

    def count_garbage(self) -> int:
        return self._x("SELECT count(*) FROM garbage").fetchone()[0]

    def usage_rows(self) -> Iterator[tuple]:
        """(ino, redundancy, chunk_size, size, idx, version, nodes) of every chunk of every regular file
        with a name (idx None for a file without chunks): daemon.redundancy.layout_usage."""
        return self._x(
            "SELECT i.ino, i.redundancy, i.chunk_size, i.size, c.idx, c.version, c.nodes FROM inodes i"
            " LEFT JOIN chunks c ON c.ino = i.ino WHERE (i.mode & 0xF000) = 0x8000 AND i.nlink > 0 AND i.snapshot = 0"
        )

    def degraded_stripes(self, limit: int = 1000) -> list[tuple[int, int]]:
        """(ino, idx) of committed EC stripes with a missing fragment: the reconstruction queue."""
        return [
            (r[0], r[1])
            for r in self._x(
                "SELECT ino, idx FROM chunks WHERE version > 0 AND (',' || nodes || ',') LIKE '%,0,%' LIMIT ?", (limit,)
            )
        ]

    def count_chunks_on(self, node_ids: Iterable[int]) -> int:
        """Chunks with a copy or fragment on any of ``node_ids`` (a full scan: for status and metrics only)."""
        ids = [int(n) for n in node_ids]
        if not ids:
            return 0
        match = " OR ".join("(',' || nodes || ',') LIKE ?" for _ in ids)
        return self._x(f"SELECT count(*) FROM chunks WHERE {match}", [f"%,{n},%" for n in ids]).fetchone()[0]
    # -- self-healing (daemon/repair.py) -----------------------------------

    def chunk_rows_page(self, after: tuple[int, int], limit: int) -> list[tuple[int, int, int, str, str, int, int, int, str]]:
        """(ino, idx, version, nodes, redundancy, chunk_size, file size, data_ino, fversions) of chunks after
        ``after`` = (ino, idx), in order (daemon/repair_plan.ChunkRow.from_sql)."""
        return self._x(
            "SELECT c.ino, c.idx, c.version, c.nodes, i.redundancy, i.chunk_size, i.size, c.data_ino, c.fversions FROM chunks c"
            " JOIN inodes i ON i.ino = c.ino WHERE (c.ino, c.idx) > (?, ?) ORDER BY c.ino, c.idx LIMIT ?",
            (after[0], after[1], limit),
        ).fetchall()

    def chunk_rows_of(self, inos: Sequence[int]) -> list[tuple[int, int, int, str, str, int, int, int, str]]:
        """The same rows for the chunks of some files (in order within each part of ``IN_PART`` files)."""
        return self._select_in(
            "SELECT c.ino, c.idx, c.version, c.nodes, i.redundancy, i.chunk_size, i.size, c.data_ino, c.fversions FROM chunks c"
            " JOIN inodes i ON i.ino = c.ino WHERE c.ino IN ({}) ORDER BY c.ino, c.idx", (), inos,
        )

    def regular_files_after(self, after_ino: int, limit: int) -> list[int]:
        return [
            r[0]
            for r in self._x(
                "SELECT ino FROM inodes WHERE ino > ? AND (mode & 0xF000) = 0x8000 ORDER BY ino LIMIT ?", (after_ino, limit)
            )
        ]

    def garbage_nodes_of_chunk(self, ino: int, idx: int) -> set[int]:
        """Nodes with a pending deletion of chunk (ino, idx): never a repair target for it."""
        return {r[0] for r in self._x("SELECT node_id FROM garbage WHERE ino=? AND idx=?", (ino, idx))}

    def pending_garbage(self, node_id: int) -> set[tuple[int, int]]:
        """(ino, idx) of every pending deletion on a node (fsck: those copies are not orphans)."""
        return {(r[0], r[1]) for r in self._x("SELECT ino, idx FROM garbage WHERE node_id=?", (node_id,))}

    def forget_node_garbage(self, node_id: int) -> int:
        return self._x("DELETE FROM garbage WHERE node_id=?", (node_id,)).rowcount

    def drop_unwritten_chunks(self, ino: int, indices: Iterable[int]) -> int:
        """Delete the rows of ``indices`` still at version 0 (no copy was ever committed); how many."""
        wanted = sorted(set(indices))
        return sum(
            self._x(
                f"DELETE FROM chunks WHERE ino=? AND version=0 AND idx IN ({','.join('?' * len(part))})", (ino, *part)
            ).rowcount
            for part in (wanted[i : i + IN_PART] for i in range(0, len(wanted), IN_PART))
        )

    def abandoned_slots(self, ino: int, max_version: int,
                        slot_parts: Callable[[int, list[int], list[int]], list[tuple[int, int]]]) -> int:
        """Queue the slot each committed chunk of ``ino`` does not use, on each of its nodes, for
        deletion up to ``max_version`` (that part only, ``EXACT_PART``): a write session that never
        committed left its copies there (common/layout.py "Slots"). ``slot_parts(version, nodes,
        fversions)`` names the (node, part) pairs. The number of rows queued."""
        rows = []
        for idx, version, nodes, fv in self._x(
            "SELECT idx, version, nodes, fversions FROM chunks WHERE ino=? AND version>0", (ino,)
        ).fetchall():
            rows += [(node, ino, idx, part | EXACT_PART, max_version)
                     for node, part in slot_parts(version, decode_nodes(nodes), decode_fversions(fv))]
        self.add_garbage(rows)
        return len(rows)

    def drop_uncommitted_chunks(self, ino: int, max_version: int) -> int:
        """Chunk rows never committed (version 0) of ``ino`` go; copies their writer may
        have stored become garbage up to ``max_version``. The number dropped."""
        rows = self._x("SELECT idx, nodes FROM chunks WHERE ino=? AND version=0", (ino,)).fetchall()
        for idx, nodes in rows:
            self.add_garbage((node, ino, idx, 0, max_version) for node in decode_nodes(nodes))
        self._x("DELETE FROM chunks WHERE ino=? AND version=0", (ino,))
        return len(rows)

    # -- open files held through several daemons (daemon/open_holds.py) ------

    def renew_daemon(self, boot_id: str, until_ns: int) -> None:
        self._x(
            "INSERT INTO daemons (boot_id, until_ns) VALUES (?,?) ON CONFLICT (boot_id) DO UPDATE SET until_ns=excluded.until_ns",
            (boot_id, until_ns),
        )

    def add_holds(self, boot_id: str, inos: Sequence[int]) -> None:
        self._xm("INSERT OR IGNORE INTO open_holds (boot_id, ino) VALUES (?,?)", ((boot_id, ino) for ino in inos))

    def drop_holds(self, boot_id: str, inos: Sequence[int]) -> None:
        self._xm("DELETE FROM open_holds WHERE boot_id=? AND ino=?", ((boot_id, ino) for ino in inos))

    def forget_dead_daemons(self, now_ns: int) -> None:
        """Holds of daemons that stopped renewing go (open files, and directories: daemon/shared_holds.py)."""
        self._x("DELETE FROM open_holds WHERE boot_id IN (SELECT boot_id FROM daemons WHERE until_ns < ?)", (now_ns,))
        dead = "SELECT boot_id FROM daemons WHERE until_ns < ?"
        inos = [r[0] for r in self._x(f"SELECT DISTINCT ino FROM dir_holds WHERE boot_id IN ({dead})", (now_ns,))]
        if inos:
            self._x(f"DELETE FROM dir_holds WHERE boot_id IN ({dead})", (now_ns,))
            self._recount_held(inos)
        self._x("DELETE FROM daemons WHERE until_ns < ?", (now_ns,))

    def held_inodes(self, now_ns: int) -> set[int]:
        """Every inode a live daemon's sessions hold."""
        return {
            r[0]
            for r in self._x(
                "SELECT DISTINCT h.ino FROM open_holds h JOIN daemons d ON d.boot_id = h.boot_id WHERE d.until_ns > ?", (now_ns,)
            )
        }

    def held_elsewhere(self, ino: int, boot_id: str, now_ns: int, changed_after_ns: int) -> bool:
        """Another live daemon's session holds ``ino``, or it changed after ``changed_after_ns``."""
        return (
            self._x(
                "SELECT 1 FROM inodes WHERE ino=? AND ctime_ns > ? UNION ALL"
                " SELECT 1 FROM open_holds h JOIN daemons d ON d.boot_id = h.boot_id"
                " WHERE h.ino=? AND h.boot_id<>? AND d.until_ns > ? LIMIT 1",
                (ino, changed_after_ns, ino, boot_id, now_ns),
            ).fetchone()
            is not None
        )

    # -- storage nodes -----------------------------------------------------

    def upsert_node(self, node_id: int, address: str, host: str, capacity: int, free: int, used: int, chunks: int, now_ns: int) -> None:
        self._x(
            "INSERT INTO nodes (node_id, address, host, capacity, free, used, chunks, last_heartbeat_ns, state)"
            " VALUES (?,?,?,?,?,?,?,?, 'up') ON CONFLICT(node_id) DO UPDATE SET address=excluded.address,"
            " host=excluded.host, capacity=excluded.capacity, free=excluded.free, used=excluded.used,"
            " chunks=excluded.chunks, last_heartbeat_ns=excluded.last_heartbeat_ns, state='up'",
            (node_id, address, host, capacity, free, used, chunks, now_ns),
        )

    def set_node_state(self, node_id: int, state: str) -> None:
        self._x("UPDATE nodes SET state=? WHERE node_id=?", (state, node_id))

    def all_nodes(self) -> list[sqlite3.Row]:
        return self._x("SELECT * FROM nodes ORDER BY node_id").fetchall()

    # -- several daemons over one database (daemon/change_log.py, applied_ops.py, duties.py) --

    def log_change(self, created_ns: int, event: bytes) -> int | None:
        """Append to the change log in the caller's transaction; its number, or None until numbered.

        One writer (SQLite, group commit): numbered at once from the counter row, in commit
        order by construction. Several daemons: the row waits for ``number_changes`` (a
        counter row taken by every writer would make every two concurrent writes conflict)."""
        if not self.group_commit:
            self._x("INSERT INTO change_log (created_ns, event) VALUES (?, ?)", (created_ns, event))
            return None
        seq = self._next_change_seq()
        self._x("INSERT INTO change_log (seq, created_ns, event) VALUES (?, ?, ?)", (seq, created_ns, event))
        return seq

    def log_changes(self, created_ns: int, events: Sequence[bytes]) -> list[int | None]:
        """``log_change`` of each of ``events``, in order: the counter moved once for all of them
        (each keeps its own number, consecutive, as one by one) and one executemany of the rows (a run of unlinks, daemon/namespace_bulk.py ``unlink_many``)."""
        if not events:
            return []
        if not self.group_commit:
            self._xm("INSERT INTO change_log (created_ns, event) VALUES (?, ?)", [(created_ns, e) for e in events])
            return [None] * len(events)
        last = self._next_change_seqs(len(events))
        seqs = list(range(last - len(events) + 1, last + 1))
        self._xm("INSERT INTO change_log (seq, created_ns, event) VALUES (?, ?, ?)",
                 [(seq, created_ns, e) for seq, e in zip(seqs, events)])
        return seqs

    def _next_change_seqs(self, count: int) -> int:
        """``count`` numbers off the counter: the last of them."""
        return self._x("UPDATE counters SET value = value + ? WHERE name = 'change_seq' RETURNING value", (count,)).fetchone()[0]

    def _next_change_seq(self) -> int:
        return self._x("UPDATE counters SET value = value + 1 WHERE name = 'change_seq' RETURNING value").fetchone()[0]

    def number_changes(self, limit: int) -> int:
        """The sequencer: number committed, unnumbered rows after the last number (one transaction).

        Rows become visible to it only once their writers committed, so numbers follow commit
        order (rows committed between two runs are numbered together, by id); a reader never
        sees a hole, since a run's numbers appear all at once with its commit."""
        ids = [r[0] for r in self._x("SELECT id FROM change_log WHERE seq IS NULL ORDER BY id LIMIT ?", (limit,))]
        if not ids:
            return 0
        first = self.last_change_seq() + 1
        self._x("UPDATE counters SET value = value + ? WHERE name = 'change_seq'", (len(ids),))
        numbered = [(first + i, row_id) for i, row_id in enumerate(ids)]
        if self.dialect is SQLITE:
            self._xm("UPDATE change_log SET seq = ? WHERE id = ?", numbered)
        else:  # one statement per INSERT_PARAMS values, not a row each (_xm: no executemany here)
            per = INSERT_PARAMS // 2
            for i in range(0, len(numbered), per):
                part = numbered[i : i + per]
                self._x("UPDATE change_log SET seq = v.seq FROM (VALUES " + ",".join(["(?::bigint, ?::bigint)"] * len(part))
                        + ") AS v(seq, id) WHERE change_log.id = v.id", [x for pair in part for x in pair])
        return len(ids)

    def feed_behind(self, seq: int) -> bool:
        """Whether the log has rows to number, or numbered rows after ``seq`` (the idle feed's cheap probe)."""
        return bool(self._x(
            "SELECT EXISTS (SELECT 1 FROM change_log WHERE seq IS NULL) OR EXISTS (SELECT 1 FROM change_log WHERE seq > ?)", (seq,)
        ).fetchone()[0])

    def last_change_seq(self) -> int:
        return self._x("SELECT value FROM counters WHERE name = 'change_seq'").fetchone()[0]

    def changes_after(self, seq: int, limit: int) -> list[tuple[int, bytes]]:
        return [
            (r[0], bytes(r[1]))
            for r in self._x("SELECT seq, event FROM change_log WHERE seq > ? ORDER BY seq LIMIT ?", (seq, limit))
        ]

    def trim_change_log(self, keep: int) -> int:
        """Forget all but the newest ``keep`` changes; how many went."""
        return self._x("DELETE FROM change_log WHERE seq <= ?", (self.last_change_seq() - keep,)).rowcount

    def get_applied(self, client_id: int, op_id: int) -> bytes | None:
        row = self._x("SELECT result FROM applied_ops WHERE client_id=? AND op_id=?", (client_id, op_id)).fetchone()
        return None if row is None else bytes(row[0])

    def put_applied(self, client_id: int, op_id: int, created_ns: int, result: bytes) -> None:
        self._x(
            "INSERT INTO applied_ops (client_id, op_id, created_ns, result) VALUES (?,?,?,?)", (client_id, op_id, created_ns, result)
        )

    def applied_in(self, client_id: int, op_ids: Sequence[int]) -> dict[int, bytes]:
        """op_id -> result of those of ``op_ids`` applied for ``client_id`` (``get_applied`` of many)."""
        return {r[0]: bytes(r[1]) for r in self._select_in(
            "SELECT op_id, result FROM applied_ops WHERE client_id=? AND op_id IN ({})", (client_id,), op_ids)}

    def put_applied_many(self, rows: Iterable[tuple[int, int, int, bytes]]) -> None:
        """Rows (client_id, op_id, created_ns, result): ``put_applied`` of many."""
        self._xm("INSERT INTO applied_ops (client_id, op_id, created_ns, result) VALUES (?,?,?,?)", rows)

    def forget_applied(self, client_id: int, below: int) -> int:
        """The client has its answers to every op below ``below``: they are never retried."""
        return self._x("DELETE FROM applied_ops WHERE client_id=? AND op_id<?", (client_id, below)).rowcount

    def expire_applied(self, before_ns: int) -> int:
        return self._x("DELETE FROM applied_ops WHERE created_ns<?", (before_ns,)).rowcount

    def count_applied(self) -> int:
        return self._x("SELECT count(*) FROM applied_ops").fetchone()[0]

    def take_lease(self, name: str, holder: str, now_ns: int, ttl_ns: int) -> tuple[str, int, int]:
        """Renew the lease if ``holder`` has it, take it if it expired; (holder, expires_ns, term) after.
        ``term`` counts the changes of holder."""
        self._x(
            "UPDATE leases SET term = term + (CASE WHEN holder = ? THEN 0 ELSE 1 END), holder = ?, expires_ns = ?"
            " WHERE name = ? AND (holder = ? OR expires_ns < ?)",
            (holder, holder, now_ns + ttl_ns, name, holder, now_ns),
        )
        return self.get_lease(name)

    def release_lease(self, name: str, holder: str) -> None:
        """Give the lease up at once (a clean stop): another daemon takes it at its next try."""
        self._x("UPDATE leases SET expires_ns = 0 WHERE name = ? AND holder = ?", (name, holder))

    def get_lease(self, name: str) -> tuple[str, int, int]:
        row = self._x("SELECT holder, expires_ns, term FROM leases WHERE name = ?", (name,)).fetchone()
        return (row[0], row[1], row[2]) if row else ("", 0, 0)

    # -- directories held across daemons (daemon/shared_holds.py) ---------------

    def put_dir_hold(self, ino: int, boot_id: str, session: int, grant_id: int, writer: int) -> None:
        """``session`` of daemon ``boot_id`` holds directory ``ino`` whole (in the grant's transaction)."""
        self._x(
            "INSERT INTO dir_holds (ino, boot_id, session, grant_id, writer, holder) VALUES (?,?,?,?,?,?)",
            (ino, boot_id, session, grant_id, writer, f"{session:x}"),
        )
        # the directory's own row says it is held (and by whom, if by one writer): a change of it
        # writes that row too, so a grant and a change that miss each other conflict on it
        self._x("UPDATE inodes SET held_by = CASE WHEN held_by = 0 OR held_by = ? THEN ? ELSE -1 END WHERE ino=?",
                (writer, writer, ino))

    def drop_dir_holds(self, rows: Sequence[tuple[int, str, int, int]]) -> None:
        """The holds ``(ino, boot_id, session, grant_id)`` ended (a newer grant's row stays); the
        directories' ``held_by`` from the rows left."""
        self._xm("DELETE FROM dir_holds WHERE ino=? AND boot_id=? AND session=? AND grant_id=?", rows)
        self._recount_held(sorted({row[0] for row in rows}))

    def _recount_held(self, inos: Sequence[int]) -> None:
        """``held_by`` of directories ``inos`` from their rows left in ``dir_holds``."""
        self._xm(
            "UPDATE inodes SET held_by = (SELECT CASE WHEN count(*) = 0 THEN 0 WHEN count(DISTINCT writer) = 1"
            " THEN min(writer) ELSE -1 END FROM dir_holds WHERE dir_holds.ino = inodes.ino) WHERE ino=?",
            [(ino,) for ino in inos],
        )

    def drop_dir_holds_of(self, boot_id: str) -> None:
        """Every hold of daemon ``boot_id`` (its clean stop); ``held_by`` of those directories recomputed."""
        inos = [r[0] for r in self._x("SELECT DISTINCT ino FROM dir_holds WHERE boot_id=?", (boot_id,))]
        self._x("DELETE FROM dir_holds WHERE boot_id=?", (boot_id,))
        self._recount_held(inos)

    def dir_holds_left(self, inos: Sequence[int], now_ns: int) -> set[tuple[int, str, int, int]]:
        """The holds of directories ``inos``, as (ino, boot_id, session, grant_id), but those of daemons
        whose ``daemons`` row expired (one not written yet, a daemon just started, counts as alive)."""
        marks = ",".join("?" * len(inos))
        return {
            (r[0], r[1], r[2], r[3]) for r in self._x(
                f"SELECT h.ino, h.boot_id, h.session, h.grant_id FROM dir_holds h WHERE h.ino IN ({marks}) AND NOT EXISTS"
                " (SELECT 1 FROM daemons d WHERE d.boot_id = h.boot_id AND d.until_ns <= ?)", (*inos, now_ns))
        }

    def async_holders(self, inos: Sequence[int], session: int) -> list[int]:
        """Those of directories ``inos`` held by a session other than ``session`` that has inode
        numbers delegated (it may create there asynchronously: a read recalls it first)."""
        marks = ",".join("?" * len(inos))
        return [r[0] for r in self._x(
            f"SELECT DISTINCT h.ino FROM dir_holds h WHERE h.ino IN ({marks}) AND h.session <> ?"
            " AND EXISTS (SELECT 1 FROM inode_ranges r WHERE r.session = h.holder)", (*inos, session))]

    # -- inode numbers delegated to sessions (daemon/inode_ranges.py) ------------

    def inode_range_of(self, session: int, ino: int) -> tuple[int, int] | None:
        """The range delegated to ``session`` that holds ``ino``, if any."""
        row = self._x("SELECT first, last FROM inode_ranges WHERE session=? AND first <= ? AND last >= ?",
                      (f"{session:x}", ino, ino)).fetchone()
        return (row[0], row[1]) if row else None

    def put_inode_range(self, session: int, first: int, last: int) -> None:
        self._x("INSERT INTO inode_ranges (session, first, last) VALUES (?,?,?)", (f"{session:x}", first, last))

    def inode_ranges(self) -> list[tuple[int, int, int]]:
        """(session, first, last) of every delegated range."""
        return [(int(r[0], 16), r[1], r[2]) for r in self._x("SELECT session, first, last FROM inode_ranges")]

    def drop_inode_ranges(self, session: int, last: int | None = None) -> None:
        """The session's ranges, or its one ending at ``last``."""
        if last is None:
            self._x("DELETE FROM inode_ranges WHERE session=?", (f"{session:x}",))
        else:
            self._x("DELETE FROM inode_ranges WHERE session=? AND last=?", (f"{session:x}", last))

    # -- the trash (daemon/trash.py) ------------------------------------------

    def put_trash(self, ino: int, parent: int, name: bytes, deleted_ns: int, roots: Sequence[int]) -> None:
        self._x(
            "INSERT INTO trash (ino, parent, name, deleted_ns, roots) VALUES (?,?,?,?,?)",
            (ino, parent, name, deleted_ns, _encode_nodes(roots)),
        )

    def trash_many(self, taken: Sequence[tuple[int, int, bytes, int, Sequence[int]]]) -> None:
        """``put_trash`` of each (ino, parent, name, deleted_ns, roots) and its inode's nlink 0 and
        ctime set, as ``Trash.take`` writes them one by one: one executemany per table
        (``Trash.take_many``, which deletes the entries first)."""
        if self._dirs is not None:
            for t in taken:
                self._dirs.pop(t[0], None)
        self._xm("UPDATE inodes SET nlink=0, ctime_ns=? WHERE ino=?", [(t[3], t[0]) for t in taken])
        self._xm("INSERT INTO trash (ino, parent, name, deleted_ns, roots) VALUES (?,?,?,?,?)",
                 [(t[0], t[1], t[2], t[3], _encode_nodes(t[4])) for t in taken])

    def delete_dentries(self, cookies: Sequence[int]) -> None:
        self._xm("DELETE FROM dentries WHERE cookie=?", [(c,) for c in cookies])

    def get_trash(self, ino: int):
        """(ino, parent, name, deleted_ns, roots) of a trashed inode, or None."""
        row = self._x("SELECT ino, parent, name, deleted_ns, roots FROM trash WHERE ino=?", (ino,)).fetchone()
        return None if row is None else (row[0], row[1], bytes(row[2]), row[3], decode_nodes(row[4]))

    def delete_trash(self, ino: int) -> None:
        self._x("DELETE FROM trash WHERE ino=?", (ino,))

    def trash_rows(self, *, parent: int | None = None, before_ns: int | None = None, limit: int = 100_000) -> list[tuple]:
        """(ino, parent, name, deleted_ns, roots, mode, size, uid) of trashed inodes, oldest first:
        all, those removed from directory ``parent``, or those removed before ``before_ns``."""
        where, params = [], []
        if parent is not None:
            where.append("t.parent=?")
            params.append(parent)
        if before_ns is not None:
            where.append("t.deleted_ns<?")
            params.append(before_ns)
        sql = (
            "SELECT t.ino, t.parent, t.name, t.deleted_ns, t.roots, i.mode, i.size, i.uid FROM trash t"
            " JOIN inodes i ON i.ino = t.ino" + (" WHERE " + " AND ".join(where) if where else "")
            + " ORDER BY t.deleted_ns, t.ino LIMIT ?"
        )
        return [
            (r[0], r[1], bytes(r[2]), r[3], decode_nodes(r[4]), r[5], r[6], r[7])
            for r in self._x(sql, (*params, limit))
        ]

    # -- directory snapshots (daemon/snapshots.py) ---------------------------

    def reserve_inos(self, n: int) -> list[int]:
        """``n`` inode numbers nobody holds or will be handed (rows inserted with them explicitly)."""
        seq = self._x("UPDATE sqlite_sequence SET seq = seq + ? WHERE name = 'inodes' RETURNING seq", (n,)).fetchone()[0]
        return list(range(seq - n + 1, seq + 1))

    def live_tree(self, top: int) -> list[tuple[int, bytes, int]]:
        """(parent, name, ino) of every entry below directory ``top`` that leads to a live inode
        (``snapshot`` 0: no ``.snapshots`` directory nor what it holds), in one recursive query."""
        return [
            (r[0], bytes(r[1]), r[2])
            for r in self._x(
                "WITH RECURSIVE tree(parent, name, ino) AS ("
                " SELECT d.parent, d.name, d.ino FROM dentries d JOIN inodes i ON i.ino = d.ino WHERE d.parent=? AND i.snapshot=0"
                " UNION ALL SELECT d.parent, d.name, d.ino FROM tree t JOIN dentries d ON d.parent = t.ino"
                " JOIN inodes i ON i.ino = d.ino WHERE i.snapshot=0)"
                " SELECT parent, name, ino FROM tree",
                (top,),
            )
        ]

    def rows_in(self, table: str, columns: str, inos: Sequence[int]) -> list:
        """``columns`` of the rows of ``table`` whose ``ino`` is one of ``inos``."""
        return self._select_in(f"SELECT {columns} FROM {table} WHERE ino IN ({{}})", (), inos)

    def insert_rows(self, table: str, columns: str, rows: Iterable[Sequence]) -> None:
        """Insert many rows into ``table`` in one executemany."""
        n = len(columns.split(","))
        self._xm(f"INSERT INTO {table} ({columns}) VALUES ({','.join('?' * n)})", rows)

    def add_snapshot(self, dir_ino: int, name: bytes, root: int, now_ns: int) -> int:
        return self._x(
            "INSERT INTO snapshots (dir, name, root, created_ns) VALUES (?,?,?,?) RETURNING id", (dir_ino, name, root, now_ns)
        ).fetchone()[0]

    def snapshots_of(self, dir_ino: int | None = None) -> list[tuple[int, int, bytes, int, int]]:
        """(id, dir, name, root, created_ns) of the snapshots of ``dir_ino`` (all: None), oldest first."""
        where, params = ("WHERE dir=?", (dir_ino,)) if dir_ino is not None else ("", ())
        return [
            (r[0], r[1], bytes(r[2]), r[3], r[4])
            for r in self._x(f"SELECT id, dir, name, root, created_ns FROM snapshots {where} ORDER BY id", params)
        ]

    def count_snapshots(self) -> int:
        return self._x("SELECT count(*) FROM snapshots").fetchone()[0]

    def delete_snapshot(self, snap_id: int) -> None:
        self._x("DELETE FROM snapshots WHERE id=?", (snap_id,))

    def snapshot_usage(self) -> tuple[int, int]:
        """(snapshots, bytes of the chunks only snapshots hold): each copied-out chunk row counted for
        the file's bytes in it."""
        count = self.count_snapshots()
        held = self._x(
            "SELECT CAST(coalesce(sum(CASE WHEN i.size - c.idx * i.chunk_size >= i.chunk_size THEN i.chunk_size"
            " WHEN i.size > c.idx * i.chunk_size THEN i.size - c.idx * i.chunk_size ELSE 0 END), 0) AS INTEGER)"
            " FROM chunks c JOIN inodes i ON i.ino = c.ino WHERE i.snapshot > 0 AND c.data_ino = 0 AND c.version > 0"
        ).fetchone()[0]
        return count, int(held)

    def snapshot_chunks(self, snap_id: int) -> list[tuple[int, int, int, str]]:
        """(ino, idx, version, nodes) of the chunk rows of a snapshot that read their own copies
        (their garbage is every part, bounded by ``version``: the fragments' own are never newer)."""
        return self._x(
            "SELECT c.ino, c.idx, c.version, c.nodes FROM chunks c JOIN inodes i ON i.ino = c.ino"
            " WHERE i.snapshot=? AND c.data_ino=0", (snap_id,)
        ).fetchall()

    def shared_rows(self, snap_id: int) -> list[tuple]:
        """(data_ino, idx, version, nodes, redundancy, the live row's nodes or None, fversions) of a
        snapshot's chunk rows that read another inode's copies."""
        return self._x(
            "SELECT s.data_ino, s.idx, s.version, s.nodes, i.redundancy, l.nodes, s.fversions FROM chunks s"
            " JOIN inodes i ON i.ino = s.ino"
            " LEFT JOIN chunks l ON l.ino = s.data_ino AND l.idx = s.idx WHERE i.snapshot=? AND s.data_ino<>0", (snap_id,)
        ).fetchall()

    def delete_snapshot_inodes(self, snap_id: int) -> None:
        """Every inode of a snapshot, with its entries, xattrs, symlink and chunk rows (cascade)."""
        if self._dirs is not None:
            self._dirs.clear()
        self._x("DELETE FROM inodes WHERE snapshot=?", (snap_id,))

    def pins(self, data_ino: int, indices: Iterable[int] | None = None, from_index: int = 0) -> list[tuple[int, int, int, str]]:
        """(ino, idx, version, nodes, fversions) of the chunk rows sharing copies of file ``data_ino``: at
        ``indices``, or at every index from ``from_index`` (index ``chunks_pins``)."""
        if indices is None:
            return self._x(
                "SELECT ino, idx, version, nodes, fversions FROM chunks WHERE data_ino=? AND idx>=?", (data_ino, from_index)
            ).fetchall()
        return self._select_in(
            "SELECT ino, idx, version, nodes, fversions FROM chunks WHERE data_ino=? AND idx IN ({})", (data_ino,),
            sorted(set(indices)),
        )

    def pinned_by(self, data_ino: int, limit: int = 8) -> list[int]:
        """Snapshot inodes (a few) whose chunk rows read copies of file ``data_ino``."""
        return [r[0] for r in self._x("SELECT DISTINCT ino FROM chunks WHERE data_ino=? LIMIT ?", (data_ino, limit))]

    def cold_readers(self, ino: int, idx: int, version: int) -> bool:
        """Whether a cold row (no nodes) still reads object (ino, idx, version): the file's own, or a
        snapshot's through ``data_ino``."""
        return self._x(
            "SELECT 1 FROM chunks WHERE idx=? AND version=? AND nodes='' AND ((ino=? AND data_ino=0) OR data_ino=?) LIMIT 1",
            (idx, version, ino, ino),
        ).fetchone() is not None

    def set_chunk_nodes(self, ino: int, idx: int, nodes: Sequence[int]) -> None:
        self._x("UPDATE chunks SET nodes=? WHERE ino=? AND idx=?", (_encode_nodes(nodes), ino, idx))

    def data_inos(self, ino: int) -> dict[int, int]:
        """index -> data_ino of the chunks of ``ino`` that read another inode's copies."""
        return {r[0]: r[1] for r in self._x("SELECT idx, data_ino FROM chunks WHERE ino=? AND data_ino<>0", (ino,))}

    def unpin(self, ino: int, idx: int, data_ino: int, version: int) -> int:
        """Row (ino, idx) holds its own copies now (copied out, daemon/snapshots.py): 1, or 0 if it changed."""
        return self._x(
            "UPDATE chunks SET data_ino=0 WHERE ino=? AND idx=? AND data_ino=? AND version=?", (ino, idx, data_ino, version)
        ).rowcount

    # -- directory quotas (daemon/quota.py) --------------------------------
    # portable SQL: plain INSERT/UPDATE/DELETE, WITH RECURSIVE, decimal bit masks

    def quota_roots(self) -> list[int]:
        return [r[0] for r in self._x("SELECT ino FROM quotas")]

    def get_quotas(self, inos: Sequence[int]) -> list[tuple[int, int, int, int, int]]:
        """(ino, max_bytes, max_inodes, used_bytes, used_inodes) of the quotas on ``inos``, by ino."""
        inos = list(inos)
        if not inos:
            return []
        return [
            tuple(r)
            for r in self._x(
                "SELECT ino, max_bytes, max_inodes, used_bytes, used_inodes FROM quotas"
                f" WHERE ino IN ({','.join('?' * len(inos))}) ORDER BY ino",
                inos,
            )
        ]

    def insert_quota(self, ino: int, max_bytes: int, max_inodes: int, used_bytes: int, used_inodes: int) -> None:
        self._x(
            "INSERT INTO quotas (ino, max_bytes, max_inodes, used_bytes, used_inodes) VALUES (?,?,?,?,?)",
            (ino, max_bytes, max_inodes, used_bytes, used_inodes),
        )

    def set_quota_limits(self, ino: int, max_bytes: int, max_inodes: int) -> None:
        self._x("UPDATE quotas SET max_bytes=?, max_inodes=? WHERE ino=?", (max_bytes, max_inodes, ino))

    def set_quota_usage(self, ino: int, used_bytes: int, used_inodes: int) -> None:
        self._x("UPDATE quotas SET used_bytes=?, used_inodes=? WHERE ino=?", (used_bytes, used_inodes, ino))

    def delete_quota(self, ino: int) -> None:
        self._x("DELETE FROM quotas WHERE ino=?", (ino,))

    def add_quota_usage(self, inos: Sequence[int], nbytes: int, ninodes: int) -> None:
        """One UPDATE for every quota root a change lies under."""
        inos = list(inos)
        self._x(
            f"UPDATE quotas SET used_bytes=used_bytes+?, used_inodes=used_inodes+? WHERE ino IN ({','.join('?' * len(inos))})",
            (nbytes, ninodes, *inos),
        )

    def subtree_usage(self, ino: int) -> tuple[int, int]:
        """(bytes, inodes) below directory ``ino``: sizes of non-directories and every inode, each inode once."""
        row = self._x(
            "WITH RECURSIVE tree(ino) AS ("
            " SELECT ino FROM dentries WHERE parent=?"
            " UNION SELECT d.ino FROM dentries d JOIN tree t ON d.parent = t.ino)"
            " SELECT count(*), coalesce(sum(CASE WHEN (i.mode & 61440) = 16384 THEN 0 ELSE i.size END), 0)"
            " FROM inodes i WHERE i.ino IN (SELECT ino FROM tree) AND i.snapshot = 0",  # snapshots: nobody pays
            (ino,),
        ).fetchone()
        return int(row[1]), int(row[0])

    # -- the cold tier (daemon/tiering.py, docs/tiering.md) ------------------------

    def add_tier(self, name: str, bucket: str, prefix: str, endpoint: str, region: str, now_ns: int) -> int:
        return self._x(
            "INSERT INTO tiers (name, bucket, prefix, endpoint, region, created_ns) VALUES (?,?,?,?,?,?) RETURNING tier_id",
            (name, bucket, prefix, endpoint, region, now_ns),
        ).fetchone()[0]

    def tiers(self) -> list:
        return self._x("SELECT tier_id, name, bucket, prefix, endpoint, region FROM tiers ORDER BY tier_id").fetchall()

    def set_tier_policy(self, ino: int, tier_id: int, after_s: int, min_size: int) -> None:
        self._x(
            "INSERT INTO tier_policies (ino, tier_id, after_s, min_size) VALUES (?,?,?,?) ON CONFLICT (ino)"
            " DO UPDATE SET tier_id=excluded.tier_id, after_s=excluded.after_s, min_size=excluded.min_size",
            (ino, tier_id, after_s, min_size),
        )

    def delete_tier_policy(self, ino: int) -> None:
        self._x("DELETE FROM tier_policies WHERE ino=?", (ino,))

    def tier_policies(self) -> list:
        return self._x("SELECT ino, tier_id, after_s, min_size FROM tier_policies ORDER BY ino").fetchall()

    def policy_candidates(self, top: int, older_ns: int, min_size: int, limit: int) -> list[int]:
        """Regular files below directory ``top`` (not below a directory with a policy of its own)
        neither read nor written since ``older_ns``, of at least ``min_size`` bytes, with chunks
        on storage nodes: the files policy ``top`` moves (at most ``limit``)."""
        return [
            r[0]
            for r in self._x(
                "WITH RECURSIVE tree(ino) AS ("
                " SELECT ino FROM dentries WHERE parent=?"
                " UNION SELECT d.ino FROM dentries d JOIN tree t ON d.parent = t.ino"
                " WHERE t.ino NOT IN (SELECT ino FROM tier_policies))"
                " SELECT i.ino FROM inodes i WHERE i.ino IN (SELECT ino FROM tree) AND (i.mode & 61440) = 32768"
                " AND i.nlink > 0 AND i.snapshot = 0 AND i.size >= ? AND i.size > 0 AND i.atime_ns < ? AND i.mtime_ns < ?"
                " AND EXISTS (SELECT 1 FROM chunks c WHERE c.ino = i.ino AND c.version > 0 AND c.nodes != '')"
                " ORDER BY i.ino LIMIT ?",
                (top, min_size, older_ns, older_ns, limit),
            )
        ]

    def add_tier_objects(self, rows: Iterable[tuple[int, int, int, int, int]]) -> None:
        """Rows (ino, idx, version, tier_id, created_ns) in state 'uploading'; existing ones stay as they are."""
        self._xm(
            "INSERT INTO tier_objects (ino, idx, version, tier_id, state, created_ns) VALUES (?,?,?,?,'uploading',?)"
            " ON CONFLICT (ino, idx, version) DO NOTHING",
            rows,
        )

    def tier_objects_of(self, ino: int) -> dict[tuple[int, int], tuple]:
        """(idx, version) -> (tier_id, length, xxh3, state, created_ns) of every object row of file ``ino``."""
        return {
            (r[0], r[1]): (r[2], r[3], r[4], r[5], r[6])
            for r in self._x(
                "SELECT idx, version, tier_id, length, xxh3, state, created_ns FROM tier_objects WHERE ino=?", (ino,)
            )
        }

    def uploading_objects(self, limit: int, after: tuple[int, int, int] = (0, -1, -1)) -> list:
        """(ino, idx, version, tier_id) of rows still 'uploading' (a migration to do or resume), in order."""
        return self._x(
            "SELECT ino, idx, version, tier_id FROM tier_objects WHERE state='uploading' AND (ino, idx, version) > (?,?,?)"
            " ORDER BY ino, idx, version LIMIT ?",
            (*after, limit),
        ).fetchall()

    def set_object_stored(self, ino: int, idx: int, version: int, length: int, xxh3: int) -> None:
        self._x(
            "UPDATE tier_objects SET state='stored', length=?, xxh3=? WHERE ino=? AND idx=? AND version=?",
            (length, xxh3, ino, idx, version),
        )

    def delete_tier_object(self, ino: int, idx: int, version: int) -> None:
        self._x("DELETE FROM tier_objects WHERE ino=? AND idx=? AND version=?", (ino, idx, version))

    def tier_usage(self) -> dict[int, tuple[int, int]]:
        """tier_id -> (objects, bytes) stored."""
        return {
            r[0]: (r[1], int(r[2]))
            for r in self._x(
                "SELECT tier_id, count(*), coalesce(sum(length), 0) FROM tier_objects WHERE state='stored' GROUP BY tier_id"
            )
        }

    def tier_backlog(self) -> tuple[int, int]:
        """(chunks, bytes) queued for migration: 'uploading' rows, bytes estimated by chunk size."""
        row = self._x(
            "SELECT count(*), coalesce(sum(i.chunk_size), 0) FROM tier_objects o LEFT JOIN inodes i ON i.ino = o.ino"
            " WHERE o.state='uploading'"
        ).fetchone()
        return int(row[0]), int(row[1])

    def orphan_tier_objects(self, limit: int) -> list:
        """(ino, idx, version, tier_id) of stored objects no chunk row needs any more: the file is
        gone, the chunk was cut or rewritten (another version), or it is back on nodes; and no
        snapshot's cold row reads it through ``data_ino``."""
        return self._x(
            "SELECT o.ino, o.idx, o.version, o.tier_id, o.created_ns FROM tier_objects o"
            " LEFT JOIN chunks c ON c.ino = o.ino AND c.idx = o.idx"
            " WHERE o.state='stored' AND (c.ino IS NULL OR c.version != o.version OR c.nodes != '')"
            # a snapshot's row still reading this object (data_ino: its live file's, daemon/snapshots.py)
            " AND NOT EXISTS (SELECT 1 FROM chunks s WHERE s.data_ino = o.ino AND s.idx = o.idx AND s.version = o.version"
            " AND s.nodes = '') LIMIT ?",
            (limit,),
        ).fetchall()

    def add_tier_garbage(self, rows: Iterable[tuple[int, str]]) -> None:
        """Objects to delete: rows of (tier_id, object name)."""
        self._xm("INSERT INTO tier_garbage (tier_id, name) VALUES (?,?)", rows)

    def tier_garbage(self, limit: int) -> list:
        return self._x("SELECT id, tier_id, name FROM tier_garbage ORDER BY id LIMIT ?", (limit,)).fetchall()

    def delete_tier_garbage(self, ids: Sequence[int]) -> None:
        self._xm("DELETE FROM tier_garbage WHERE id=?", ((i,) for i in ids))

    def count_tier_garbage(self) -> int:
        return self._x("SELECT count(*) FROM tier_garbage").fetchone()[0]

    def tier_object_keys(self, tier_id: int) -> list:
        """(ino, idx, version, created_ns) of every object row of a tier, uploading ones too (fsck)."""
        return self._x("SELECT ino, idx, version, created_ns FROM tier_objects WHERE tier_id=?", (tier_id,)).fetchall()

    def tier_garbage_names(self, tier_id: int) -> list[str]:
        return [r[0] for r in self._x("SELECT name FROM tier_garbage WHERE tier_id=?", (tier_id,))]

    def cold_chunks_of(self, tier_id: int, after: tuple[int, int], limit: int) -> list:
        """(ino, idx, version, created_ns, length) of stored objects of ``tier_id`` whose chunk is cold, in order (fsck)."""
        return self._x(
            "SELECT o.ino, o.idx, o.version, o.created_ns, o.length FROM tier_objects o JOIN chunks c ON c.ino = o.ino AND c.idx = o.idx"
            " AND c.version = o.version WHERE o.tier_id=? AND o.state='stored' AND c.nodes = '' AND (o.ino, o.idx) > (?,?)"
            " ORDER BY o.ino, o.idx LIMIT ?",
            (tier_id, *after, limit),
        ).fetchall()


class SqliteStore(SqlStore):
    """SQL over one connection from daemon.db.open_database."""

    def __init__(self, conn: sqlite3.Connection):
        self.conn = conn
        #: the change log's counter as this transaction has it, written to its row once at COMMIT
        #: (not once per change); None: read it from the row
        self._seq: int | None = None
        self._seq_stored: int | None = None  # the value the row holds (in this transaction)

    def _next_change_seq(self) -> int:
        if not self.conn.in_transaction:  # autocommit (start-up): the row at once
            self._seq = self._seq_stored = None
            return super()._next_change_seq()
        if self._seq is None:
            self._seq = self._seq_stored = super().last_change_seq()
        self._seq += 1
        return self._seq

    def _next_change_seqs(self, count: int) -> int:
        if not self.conn.in_transaction:
            self._seq = self._seq_stored = None
            return super()._next_change_seqs(count)
        if self._seq is None:
            self._seq = self._seq_stored = super().last_change_seq()
        self._seq += count
        return self._seq

    def last_change_seq(self) -> int:
        return super().last_change_seq() if self._seq is None else self._seq

    def skip_inodes(self, count: int) -> int:
        """Take ``count`` inode numbers off the counter (AUTOINCREMENT never hands out a number at
        or below ``sqlite_sequence``'s): the first of them (daemon/inode_ranges.py)."""
        row = self.conn.execute(
            "UPDATE sqlite_sequence SET seq = seq + ? WHERE name = 'inodes' RETURNING seq", (count,)).fetchone()
        return row[0] - count + 1

    def _store_change_seq(self) -> None:
        if self._seq is not None and self._seq != self._seq_stored:
            self.conn.execute("UPDATE counters SET value = ? WHERE name = 'change_seq'", (self._seq,))
            self._seq_stored = self._seq

    # -- transactions ------------------------------------------------------

    @property
    def in_transaction(self) -> bool:
        return self.conn.in_transaction

    def begin(self) -> None:
        self.conn.execute("BEGIN")

    def commit(self) -> None:
        """COMMIT (an fsync with synchronous=FULL) and open the next transaction."""
        self._store_change_seq()
        self.conn.execute("COMMIT")
        self.conn.execute("BEGIN")

    def rollback(self) -> None:
        self._dirs = None if self._dirs is None else {}
        self._seq = self._seq_stored = None
        if self.conn.in_transaction:
            self.conn.execute("ROLLBACK")

    def close(self) -> None:
        if self.conn.in_transaction:
            self._store_change_seq()
            self.conn.execute("COMMIT")
        self.conn.close()

    @contextlib.contextmanager
    def savepoint(self) -> Iterator[None]:
        """Statements in the block are undone together if it raises."""
        # one name for all: SQLite releases or rolls back to the innermost savepoint of a name, which
        # is this block's however they nest, and the statements stay in sqlite3's statement cache
        # (a name per block compiled every SAVEPOINT and RELEASE anew: ~20 us each)
        execute = self.conn.execute
        outermost = not self.conn.in_transaction  # then its RELEASE commits
        execute("SAVEPOINT op")
        seq = self._seq
        try:
            yield
        except BaseException:
            if self._dirs:
                self._dirs = {}  # rows written in the block may be undone
            self._seq = seq  # its changes' numbers too
            execute("ROLLBACK TO op")
            execute("RELEASE op")
            raise
        if outermost:
            self._store_change_seq()
        execute("RELEASE op")
