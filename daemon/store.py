"""Every SQL statement of the metadata daemon, behind one small class.

``SqliteStore`` is the storage engine interface: namespace.py holds the POSIX
semantics and calls only these methods, so another engine (a replicated KV
store, say) can be added later by writing another class with the same
methods. Rows come back as ``sqlite3.Row`` (indexable by column name); an
inode row has the columns of the ``inodes`` table (daemon/db.py).

Transactions: the service keeps one transaction open (``begin``) and commits
it in groups (``commit``); each request runs inside ``savepoint()`` so a
failure undoes only that request's statements.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import sqlite3
from typing import Iterable, Iterator, Sequence

log = logging.getLogger(__name__)

#: garbage bound for copies of a deleted inode: every version goes
ANY_VERSION = (1 << 63) - 1

_INODE_FIELDS = (
    "mode uid gid nlink rdev size atime_ns mtime_ns ctime_ns generation chunk_size stripe_count redundancy stripe_seed"
).split()


def _encode_nodes(nodes: Sequence[int]) -> str:
    return ",".join(str(int(n)) for n in nodes)


def decode_nodes(text: str) -> list[int]:
    return [int(n) for n in text.split(",") if n]


class SqliteStore:
    """SQL over one connection from daemon.db.open_database."""

    def __init__(self, conn: sqlite3.Connection):
        self.conn = conn
        self._savepoints = itertools.count(1)

    # -- transactions ------------------------------------------------------

    @property
    def in_transaction(self) -> bool:
        return self.conn.in_transaction

    def begin(self) -> None:
        self.conn.execute("BEGIN")

    def commit(self) -> None:
        """COMMIT (an fsync with synchronous=FULL) and open the next transaction."""
        self.conn.execute("COMMIT")
        self.conn.execute("BEGIN")

    def rollback(self) -> None:
        if self.conn.in_transaction:
            self.conn.execute("ROLLBACK")

    def close(self) -> None:
        if self.conn.in_transaction:
            self.conn.execute("COMMIT")
        self.conn.close()

    @contextlib.contextmanager
    def savepoint(self) -> Iterator[None]:
        """Statements in the block are undone together if it raises."""
        name = f"sp{next(self._savepoints)}"
        self.conn.execute(f"SAVEPOINT {name}")
        try:
            yield
        except BaseException:
            self.conn.execute(f"ROLLBACK TO {name}")
            self.conn.execute(f"RELEASE {name}")
            raise
        self.conn.execute(f"RELEASE {name}")

    # -- meta --------------------------------------------------------------

    def get_meta(self, key: str, default=None):
        row = self.conn.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
        return default if row is None else row[0]

    def set_meta(self, key: str, value) -> None:
        self.conn.execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", (key, value))

    # -- inodes ------------------------------------------------------------

    def get_inode(self, ino: int) -> sqlite3.Row | None:
        return self.conn.execute("SELECT * FROM inodes WHERE ino=?", (ino,)).fetchone()

    def insert_inode(self, **fields) -> int:
        cols = [f for f in _INODE_FIELDS if f in fields]
        cur = self.conn.execute(
            f"INSERT INTO inodes ({','.join(cols)}) VALUES ({','.join('?' * len(cols))})",
            [fields[c] for c in cols],
        )
        return cur.lastrowid

    def update_inode(self, ino: int, **fields) -> None:
        for key in fields:
            if key not in _INODE_FIELDS:
                raise KeyError(key)
        assignments = ",".join(f"{k}=?" for k in fields)
        self.conn.execute(f"UPDATE inodes SET {assignments} WHERE ino=?", [*fields.values(), ino])

    def add_nlink(self, ino: int, delta: int, ctime_ns: int) -> None:
        self.conn.execute("UPDATE inodes SET nlink=nlink+?, ctime_ns=? WHERE ino=?", (delta, ctime_ns, ino))

    def delete_inode(self, ino: int) -> None:
        self.conn.execute("DELETE FROM inodes WHERE ino=?", (ino,))

    def orphans(self) -> list[int]:
        return [r[0] for r in self.conn.execute("SELECT ino FROM inodes WHERE nlink=0")]

    def counts(self) -> dict[str, int]:
        """files, directories, all inodes and logical bytes of regular files."""
        row = self.conn.execute(
            "SELECT count(*),"
            " coalesce(sum((mode & 0xF000) = 0x8000), 0),"
            " coalesce(sum((mode & 0xF000) = 0x4000), 0),"
            " coalesce(sum(CASE WHEN (mode & 0xF000) = 0x8000 THEN size ELSE 0 END), 0)"
            " FROM inodes"
        ).fetchone()
        chunks = self.conn.execute("SELECT count(*) FROM chunks").fetchone()[0]
        return {"inodes": row[0], "files": row[1], "directories": row[2], "logical_bytes": row[3], "chunks": chunks}

    # -- directory entries -------------------------------------------------

    def get_dentry(self, parent: int, name: bytes) -> sqlite3.Row | None:
        return self.conn.execute("SELECT * FROM dentries WHERE parent=? AND name=?", (parent, name)).fetchone()

    def insert_dentry(self, parent: int, name: bytes, ino: int) -> int:
        cur = self.conn.execute("INSERT INTO dentries (parent, name, ino) VALUES (?,?,?)", (parent, name, ino))
        return cur.lastrowid

    def delete_dentry(self, cookie: int) -> None:
        self.conn.execute("DELETE FROM dentries WHERE cookie=?", (cookie,))

    def move_dentry(self, cookie: int, parent: int, name: bytes) -> None:
        self.conn.execute("UPDATE dentries SET parent=?, name=? WHERE cookie=?", (parent, name, cookie))

    def set_dentry_ino(self, cookie: int, ino: int) -> None:
        self.conn.execute("UPDATE dentries SET ino=? WHERE cookie=?", (ino, cookie))

    def dentries_of(self, ino: int) -> list[tuple[int, int, bytes]]:
        """(cookie, parent, name) of every directory entry naming ``ino`` (its hard links)."""
        return [(r[0], r[1], bytes(r[2])) for r in self.conn.execute("SELECT cookie, parent, name FROM dentries WHERE ino=?", (ino,))]

    def has_children(self, ino: int) -> bool:
        return self.conn.execute("SELECT 1 FROM dentries WHERE parent=? LIMIT 1", (ino,)).fetchone() is not None

    def parent_of(self, ino: int) -> int | None:
        """The parent of a directory (directories have exactly one name)."""
        row = self.conn.execute("SELECT parent FROM dentries WHERE ino=? LIMIT 1", (ino,)).fetchone()
        return None if row is None else row[0]

    def list_dentries(self, parent: int, after: int, limit: int) -> list[sqlite3.Row]:
        """Entries after cookie ``after`` joined with their inode rows."""
        return self.conn.execute(
            "SELECT d.cookie AS cookie, d.name AS name, i.* FROM dentries d JOIN inodes i ON i.ino = d.ino"
            " WHERE d.parent=? AND d.cookie>? ORDER BY d.cookie LIMIT ?",
            (parent, after, limit),
        ).fetchall()

    # -- symlinks and xattrs -----------------------------------------------

    def insert_symlink(self, ino: int, target: bytes) -> None:
        self.conn.execute("INSERT INTO symlinks (ino, target) VALUES (?,?)", (ino, target))

    def get_symlink(self, ino: int) -> bytes | None:
        row = self.conn.execute("SELECT target FROM symlinks WHERE ino=?", (ino,)).fetchone()
        return None if row is None else bytes(row[0])

    def get_xattr(self, ino: int, name: bytes) -> bytes | None:
        row = self.conn.execute("SELECT value FROM xattrs WHERE ino=? AND name=?", (ino, name)).fetchone()
        return None if row is None else bytes(row[0])

    def set_xattr(self, ino: int, name: bytes, value: bytes) -> None:
        self.conn.execute("INSERT OR REPLACE INTO xattrs (ino, name, value) VALUES (?,?,?)", (ino, name, value))

    def list_xattrs(self, ino: int) -> list[bytes]:
        return [bytes(r[0]) for r in self.conn.execute("SELECT name FROM xattrs WHERE ino=? ORDER BY name", (ino,))]

    def delete_xattr(self, ino: int, name: bytes) -> bool:
        return self.conn.execute("DELETE FROM xattrs WHERE ino=? AND name=?", (ino, name)).rowcount > 0

    # -- chunks and garbage ------------------------------------------------

    def get_chunks(self, ino: int, indices: Iterable[int] | None = None) -> dict[int, tuple[int, list[int]]]:
        """index -> (version, nodes), for all chunks of ``ino`` or only ``indices``."""
        if indices is None:
            rows = self.conn.execute("SELECT idx, version, nodes FROM chunks WHERE ino=? ORDER BY idx", (ino,))
        else:
            wanted = sorted(set(indices))
            rows = itertools.chain.from_iterable(
                self.conn.execute(
                    f"SELECT idx, version, nodes FROM chunks WHERE ino=? AND idx IN ({','.join('?' * len(part))})",
                    (ino, *part),
                )
                for part in (wanted[i : i + 500] for i in range(0, len(wanted), 500))
            )
        return {r[0]: (r[1], decode_nodes(r[2])) for r in rows}

    def put_chunk(self, ino: int, idx: int, version: int, nodes: Sequence[int]) -> None:
        """Insert or replace a chunk row; its nodes' pending deletions of this chunk are cancelled."""
        self.conn.execute(
            "INSERT OR REPLACE INTO chunks (ino, idx, version, nodes) VALUES (?,?,?,?)",
            (ino, idx, version, _encode_nodes(nodes)),
        )
        if nodes:
            self.conn.execute(
                f"DELETE FROM garbage WHERE ino=? AND idx=? AND node_id IN ({','.join('?' * len(nodes))})",
                (ino, idx, *nodes),
            )

    def drop_chunks(self, ino: int, from_index: int = 0, max_version: int = ANY_VERSION) -> int:
        """Move chunk rows with index >= ``from_index`` into garbage; the number moved.

        ``max_version``: copies newer than this (written after the drop) must survive the deletion.
        """
        rows = self.conn.execute(
            "SELECT idx, nodes FROM chunks WHERE ino=? AND idx>=?", (ino, from_index)
        ).fetchall()
        for idx, nodes in rows:
            # node 0 marks a missing EC fragment (daemon/redundancy.py): nothing to delete
            self.add_garbage((node, ino, idx, 0, max_version) for node in decode_nodes(nodes) if node)
        self.conn.execute("DELETE FROM chunks WHERE ino=? AND idx>=?", (ino, from_index))
        return len(rows)

    def add_garbage(self, rows: Iterable[tuple[int, int, int, int, int]]) -> None:
        """Rows of (node_id, ino, idx, part, max_version)."""
        self.conn.executemany("INSERT INTO garbage (node_id, ino, idx, part, max_version) VALUES (?,?,?,?,?)", rows)

    def garbage_for_node(self, node_id: int, limit: int) -> list[sqlite3.Row]:
        return self.conn.execute(
            "SELECT id, ino, idx, part, max_version FROM garbage WHERE node_id=? ORDER BY id LIMIT ?", (node_id, limit)
        ).fetchall()

    def garbage_nodes(self) -> list[int]:
        return [r[0] for r in self.conn.execute("SELECT DISTINCT node_id FROM garbage")]

    def delete_garbage(self, ids: Sequence[int]) -> None:
        self.conn.executemany("DELETE FROM garbage WHERE id=?", ((i,) for i in ids))

    def count_garbage(self) -> int:
        return self.conn.execute("SELECT count(*) FROM garbage").fetchone()[0]

    def usage_rows(self) -> Iterator[tuple]:
        """(ino, redundancy, chunk_size, size, idx, version, nodes) of every chunk of every regular file
        with a name (idx None for a file without chunks): daemon.redundancy.layout_usage."""
        return self.conn.execute(
            "SELECT i.ino, i.redundancy, i.chunk_size, i.size, c.idx, c.version, c.nodes FROM inodes i"
            " LEFT JOIN chunks c ON c.ino = i.ino WHERE (i.mode & 0xF000) = 0x8000 AND i.nlink > 0"
        )

    def degraded_stripes(self, limit: int = 1000) -> list[tuple[int, int]]:
        """(ino, idx) of committed EC stripes with a missing fragment: the reconstruction queue."""
        return [
            (r[0], r[1])
            for r in self.conn.execute(
                "SELECT ino, idx FROM chunks WHERE version > 0 AND (',' || nodes || ',') LIKE '%,0,%' LIMIT ?", (limit,)
            )
        ]

    def count_chunks_on(self, node_ids: Iterable[int]) -> int:
        """Chunks with a copy or fragment on any of ``node_ids`` (a full scan: for status and metrics only)."""
        ids = [int(n) for n in node_ids]
        if not ids:
            return 0
        match = " OR ".join("instr(',' || nodes || ',', ?) > 0" for _ in ids)
        return self.conn.execute(f"SELECT count(*) FROM chunks WHERE {match}", [f",{n}," for n in ids]).fetchone()[0]
    # -- self-healing (daemon/repair.py) -----------------------------------

    def chunk_rows_page(self, after: tuple[int, int], limit: int) -> list[tuple[int, int, int, str, str, int]]:
        """(ino, idx, version, nodes, redundancy, chunk_size) of chunks after ``after`` = (ino, idx), in order."""
        return self.conn.execute(
            "SELECT c.ino, c.idx, c.version, c.nodes, i.redundancy, i.chunk_size FROM chunks c"
            " JOIN inodes i ON i.ino = c.ino WHERE (c.ino, c.idx) > (?, ?) ORDER BY c.ino, c.idx LIMIT ?",
            (after[0], after[1], limit),
        ).fetchall()

    def chunk_rows_of(self, inos: Sequence[int]) -> list[tuple[int, int, int, str, str, int]]:
        """The same rows for the chunks of some files."""
        out = []
        for i in range(0, len(inos), 500):
            part = list(inos[i : i + 500])
            out += self.conn.execute(
                "SELECT c.ino, c.idx, c.version, c.nodes, i.redundancy, i.chunk_size FROM chunks c"
                f" JOIN inodes i ON i.ino = c.ino WHERE c.ino IN ({','.join('?' * len(part))}) ORDER BY c.ino, c.idx",
                part,
            ).fetchall()
        return out

    def regular_files_after(self, after_ino: int, limit: int) -> list[int]:
        return [
            r[0]
            for r in self.conn.execute(
                "SELECT ino FROM inodes WHERE ino > ? AND (mode & 0xF000) = 0x8000 ORDER BY ino LIMIT ?", (after_ino, limit)
            )
        ]

    def garbage_nodes_of_chunk(self, ino: int, idx: int) -> set[int]:
        """Nodes with a pending deletion of chunk (ino, idx): never a repair target for it."""
        return {r[0] for r in self.conn.execute("SELECT node_id FROM garbage WHERE ino=? AND idx=?", (ino, idx))}

    def pending_garbage(self, node_id: int) -> set[tuple[int, int]]:
        """(ino, idx) of every pending deletion on a node (fsck: those copies are not orphans)."""
        return {(r[0], r[1]) for r in self.conn.execute("SELECT ino, idx FROM garbage WHERE node_id=?", (node_id,))}

    def forget_node_garbage(self, node_id: int) -> int:
        return self.conn.execute("DELETE FROM garbage WHERE node_id=?", (node_id,)).rowcount

    def drop_uncommitted_chunks(self, ino: int, max_version: int) -> int:
        """Chunk rows never committed (version 0) of ``ino`` go; copies their writer may
        have stored become garbage up to ``max_version``. The number dropped."""
        rows = self.conn.execute("SELECT idx, nodes FROM chunks WHERE ino=? AND version=0", (ino,)).fetchall()
        for idx, nodes in rows:
            self.add_garbage((node, ino, idx, 0, max_version) for node in decode_nodes(nodes))
        self.conn.execute("DELETE FROM chunks WHERE ino=? AND version=0", (ino,))
        return len(rows)

    # -- storage nodes -----------------------------------------------------

    def upsert_node(self, node_id: int, address: str, host: str, capacity: int, free: int, used: int, chunks: int, now_ns: int) -> None:
        self.conn.execute(
            "INSERT INTO nodes (node_id, address, host, capacity, free, used, chunks, last_heartbeat_ns, state)"
            " VALUES (?,?,?,?,?,?,?,?, 'up') ON CONFLICT(node_id) DO UPDATE SET address=excluded.address,"
            " host=excluded.host, capacity=excluded.capacity, free=excluded.free, used=excluded.used,"
            " chunks=excluded.chunks, last_heartbeat_ns=excluded.last_heartbeat_ns, state='up'",
            (node_id, address, host, capacity, free, used, chunks, now_ns),
        )

    def set_node_state(self, node_id: int, state: str) -> None:
        self.conn.execute("UPDATE nodes SET state=? WHERE node_id=?", (state, node_id))

    def all_nodes(self) -> list[sqlite3.Row]:
        return self.conn.execute("SELECT * FROM nodes ORDER BY node_id").fetchall()

    # -- directory quotas (daemon/quota.py) --------------------------------
    # portable SQL: plain INSERT/UPDATE/DELETE, WITH RECURSIVE, decimal bit masks

    def quota_roots(self) -> list[int]:
        return [r[0] for r in self.conn.execute("SELECT ino FROM quotas")]

    def get_quotas(self, inos: Sequence[int]) -> list[tuple[int, int, int, int, int]]:
        """(ino, max_bytes, max_inodes, used_bytes, used_inodes) of the quotas on ``inos``, by ino."""
        inos = list(inos)
        if not inos:
            return []
        return [
            tuple(r)
            for r in self.conn.execute(
                "SELECT ino, max_bytes, max_inodes, used_bytes, used_inodes FROM quotas"
                f" WHERE ino IN ({','.join('?' * len(inos))}) ORDER BY ino",
                inos,
            )
        ]

    def insert_quota(self, ino: int, max_bytes: int, max_inodes: int, used_bytes: int, used_inodes: int) -> None:
        self.conn.execute(
            "INSERT INTO quotas (ino, max_bytes, max_inodes, used_bytes, used_inodes) VALUES (?,?,?,?,?)",
            (ino, max_bytes, max_inodes, used_bytes, used_inodes),
        )

    def set_quota_limits(self, ino: int, max_bytes: int, max_inodes: int) -> None:
        self.conn.execute("UPDATE quotas SET max_bytes=?, max_inodes=? WHERE ino=?", (max_bytes, max_inodes, ino))

    def set_quota_usage(self, ino: int, used_bytes: int, used_inodes: int) -> None:
        self.conn.execute("UPDATE quotas SET used_bytes=?, used_inodes=? WHERE ino=?", (used_bytes, used_inodes, ino))

    def delete_quota(self, ino: int) -> None:
        self.conn.execute("DELETE FROM quotas WHERE ino=?", (ino,))

    def add_quota_usage(self, inos: Sequence[int], nbytes: int, ninodes: int) -> None:
        """One UPDATE for every quota root a change lies under."""
        inos = list(inos)
        self.conn.execute(
            f"UPDATE quotas SET used_bytes=used_bytes+?, used_inodes=used_inodes+? WHERE ino IN ({','.join('?' * len(inos))})",
            (nbytes, ninodes, *inos),
        )

    def subtree_usage(self, ino: int) -> tuple[int, int]:
        """(bytes, inodes) below directory ``ino``: sizes of non-directories and every inode, each inode once."""
        row = self.conn.execute(
            "WITH RECURSIVE tree(ino) AS ("
            " SELECT ino FROM dentries WHERE parent=?"
            " UNION SELECT d.ino FROM dentries d JOIN tree t ON d.parent = t.ino)"
            " SELECT count(*), coalesce(sum(CASE WHEN (i.mode & 61440) = 16384 THEN 0 ELSE i.size END), 0)"
            " FROM inodes i WHERE i.ino IN (SELECT ino FROM tree)",
            (ino,),
        ).fetchone()
        return int(row[1]), int(row[0])
