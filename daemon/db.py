"""The metadata database: its schema and its migrations (SQLite file or PostgreSQL).

This docstring is the schema's specification; ``_migrate_1`` is its code.

Tables
------
``meta(key TEXT PRIMARY KEY, value)``
    ``schema_version`` (int, the last migration applied), ``epoch_hwm``
    (int: every epoch handed out so far is below it; see namespace.alloc_epoch)
    and ``cluster_id`` (a random hex string set once, at the first start:
    mounts name their disk caches with it).

``inodes``
    ``ino INTEGER PRIMARY KEY AUTOINCREMENT``: AUTOINCREMENT makes SQLite keep
    the highest ino ever used in ``sqlite_sequence``, so an inode number is
    never reused, even after the row with the largest one is deleted. Chunk ids
    embed the ino, so a stale chunk copy can never be mistaken for a new file's.
    ``mode uid gid nlink rdev size atime_ns mtime_ns ctime_ns generation`` as
    stat(2) (times in ns). ``nlink`` of a directory is 2 + its subdirectories.
    An inode with ``nlink = 0`` is an *orphan*: unlinked while a session had it
    open; it is reclaimed when the last session lets go of it.
    Layout columns ``chunk_size stripe_count redundancy``: for a regular file
    its own (fixed at creation); for a directory the layout it gives new
    entries. ``stripe_seed``: a random 31-bit number per inode that spreads
    each file's chunk primaries over its own set of nodes (daemon/placement.py).

``dentries(cookie INTEGER PRIMARY KEY AUTOINCREMENT, parent, name BLOB, ino)``
    ``UNIQUE(parent, name)``. The cookie is the entry's stable, never reused
    position: readdir pages with ``WHERE parent=? AND cookie>? ORDER BY
    cookie`` over index ``dentries_page(parent, cookie)``, so a listing of
    100,000 entries never loads them all, and an entry keeps its cookie across
    a rename. ``dentries_ino`` finds a directory's parent (the subtree check of
    rename). The root (ino 1) has no dentry.

``symlinks(ino PRIMARY KEY, target BLOB)``, ``xattrs(ino, name BLOB, value BLOB, PK(ino, name))``

``chunks(ino, idx, version, nodes TEXT, PK(ino, idx))``
    One row per chunk that has a placement. ``nodes`` is the comma-separated
    node ids holding it, in part order (replicas: all part 0; ec=K+M: node i
    holds fragment i). ``version`` is the committed epoch, 0 = allocated but
    never written (a hole).

``nodes(node_id PRIMARY KEY, address, host, capacity, free, used, chunks, last_heartbeat_ns, state)``
    Storage nodes ever registered. ``state`` is informative only: at daemon
    start every node is down until it heartbeats (daemon/health.py).

``garbage(id INTEGER PRIMARY KEY, node_id, ino, idx, part)``
    Chunk copies to delete from storage nodes (truncated chunks, reclaimed
    files, replaced replicas). The collector in daemon/service.py sends
    DeleteChunksReq to nodes that are up and deletes the rows that succeeded.
    Placing a chunk on a node deletes that node's garbage rows for the chunk.

``quotas(ino PRIMARY KEY, max_bytes, max_inodes, used_bytes, used_inodes)``
    (schema version 2) One row per directory with a quota (daemon/quota.py):
    its limits (0: none) and the usage below it, kept up to date in the same
    transaction as every namespace change.

``daemons(boot_id PRIMARY KEY, until_ns)``, ``open_holds(boot_id, ino, PK(boot_id, ino))``
    (schema version 3) With PostgreSQL, the inodes each live daemon's sessions
    hold open, renewed every second (daemon/open_holds.py). Unused with SQLite.

``change_log(id PRIMARY KEY, seq UNIQUE, created_ns, event)``
    (schema version 4) Every namespace change, written in the transaction
    that made the change, numbered ``seq`` 1, 2, 3... in commit order (SQLite:
    at once; a shared database: by a sequencer after the commit, NULL until
    then); every daemon's change feed publishes it in order
    (daemon/change_log.py). ``counters(name, value)`` row ``change_seq`` is
    the last number handed out; ``meta.change_log_id`` names this log (mounts
    compare it).
    Trimmed to the newest rows by the duties leader.

``applied_ops(client_id, op_id, created_ns, result, PK(client_id, op_id))``
    Mutating requests applied on behalf of a client (OnceReq), with what the
    operation returned, written in the operation's transaction: a retry
    answers from here instead of applying twice (daemon/applied_ops.py).

``leases(name PRIMARY KEY, holder, expires_ns, term)``
    ``duties``: which daemon runs the cluster-wide duties (daemon/duties.py).

``tiers``, ``tier_policies``, ``tier_objects``, ``tier_garbage``
    (schema version 5) The cold tier on object storage: the buckets, the
    policy of each directory that has one, every object the cluster may hold
    in a bucket (one per chunk version; ``state`` 'uploading' or 'stored')
    and objects to delete. A chunk in a tier has its ``chunks`` row with no
    nodes. Specified in docs/tiering.md, used by daemon/tiering.py.

``trash(ino PRIMARY KEY, parent, name BLOB, deleted_ns, roots TEXT)``
    (schema version 6) Inodes removed while the trash is on (daemon/trash.py,
    docs/snapshots.md): no directory entry, nlink 0, kept until restored or
    purged. ``parent`` and ``name``: where it was; ``roots``: the quota roots
    it still counts against (comma-separated inode numbers). Nothing that
    reclaims nlink-0 inodes touches an inode with a trash row.

``snapshots(id PRIMARY KEY, dir, name BLOB, root, created_ns)``, ``inodes.snapshot``, ``chunks.data_ino``
    (schema version 7) Directory snapshots (daemon/snapshots.py, docs/snapshots.md).
    A row per snapshot: ``dir`` the directory it copies (ON DELETE CASCADE is
    not used: a snapshot outlives nothing, ``dir`` cannot be removed while its
    ``.snapshots`` holds one), ``name`` its name in ``dir/.snapshots``,
    ``root`` the snapshot's top directory inode. ``inodes.snapshot``: 0 for
    live inodes, the snapshot's id for its inodes, -1 for a ``.snapshots``
    directory (read-only, not copied). ``chunks.data_ino``: 0, or the inode
    whose chunk ids hold the row's bytes (a snapshot row sharing the live
    file's copies: a *pin* on ``(data_ino, idx, version)``); index
    ``chunks_pins(data_ino, idx)`` over the nonzero ones, ``inodes_snapshot``
    over snapshot inodes.

``chunks.fversions``
    (schema version 10) An erasure-coded stripe's version per fragment, comma-separated
    by position (common/protocol.ChunkRef ``fversions``); '' (every row the migration
    found, and every row whose fragments all moved together): each at the row's version.

``inode_ranges(session TEXT, first, last)``
    (schema version 8) Inode numbers delegated to a mount's session
    (daemon/inode_ranges.py): its creates may name them; gone with the session.

All tables referencing ``inodes`` do so with ``ON DELETE CASCADE`` (foreign
keys are on), except ``garbage``, which must outlive the inode.

Durability: WAL journal, ``synchronous=FULL``: a COMMIT returns after fsync.
The service keeps one transaction open and commits it in groups
(daemon/service.py); this module only opens, creates and migrates.

Migrations: ``MIGRATIONS[i]`` takes the schema from version ``i`` to ``i+1``;
each runs in its own transaction with the new ``schema_version``. A database
newer than this code is refused. A migration is a function ``(db, root_layout)``
whose ``db.execute(sql, params)`` takes the shared SQL text (SQLite's spelling,
``?`` placeholders; daemon/dialect.py rewrites it for PostgreSQL), so one
migration serves both engines; ``execute_script(db, text)`` runs several
statements. Where the engines really differ, branch on ``db.dialect`` (as
``_migrate_1`` does for the epoch sequence). On PostgreSQL several daemons may
start at once: each migration is one transaction (PostgreSQL's DDL is
transactional), and a daemon whose migration fails re-reads the version and
carries on if another daemon applied it meanwhile (``PgStore.migrate``).

PostgreSQL differences (the same tables otherwise): ``meta.value`` is TEXT
(readers convert: ``int(get_meta(...))``); integers are BIGINT; ``ino`` and
``cookie`` are identity columns (never reused); epochs come from the sequence
``epochs`` (strictly increasing across every daemon, see
namespace.alloc_epoch), not from ``epoch_hwm``.
"""

from __future__ import annotations

import fcntl
import logging
import os
import random
import sqlite3
import stat
import time
import uuid
from pathlib import Path
from typing import Callable

from ..common.protocol import Layout

log = logging.getLogger(__name__)

ROOT_INO = 1
DB_NAME = "meta.sqlite3"


def _migrate_1(db, root_layout: Layout) -> None:
    execute_script(
        db,
        """
        CREATE TABLE meta (key TEXT PRIMARY KEY, value%s);
        CREATE TABLE inodes (
            ino INTEGER PRIMARY KEY AUTOINCREMENT,
            mode INTEGER NOT NULL,
            uid INTEGER NOT NULL,
            gid INTEGER NOT NULL,
            nlink INTEGER NOT NULL,
            rdev INTEGER NOT NULL DEFAULT 0,
            size INTEGER NOT NULL DEFAULT 0,
            atime_ns INTEGER NOT NULL,
            mtime_ns INTEGER NOT NULL,
            ctime_ns INTEGER NOT NULL,
            generation INTEGER NOT NULL DEFAULT 0,
            chunk_size INTEGER NOT NULL,
            stripe_count INTEGER NOT NULL,
            redundancy TEXT NOT NULL,
            stripe_seed INTEGER NOT NULL
        );
        CREATE INDEX inodes_orphans ON inodes(ino) WHERE nlink = 0;
        CREATE TABLE dentries (
            cookie INTEGER PRIMARY KEY AUTOINCREMENT,
            parent INTEGER NOT NULL REFERENCES inodes(ino) ON DELETE CASCADE,
            name BLOB NOT NULL,
            ino INTEGER NOT NULL REFERENCES inodes(ino) ON DELETE CASCADE,
            UNIQUE (parent, name)
        );
        CREATE INDEX dentries_page ON dentries(parent, cookie);
        CREATE INDEX dentries_ino ON dentries(ino);
        CREATE TABLE symlinks (
            ino INTEGER PRIMARY KEY REFERENCES inodes(ino) ON DELETE CASCADE,
            target BLOB NOT NULL
        );
        CREATE TABLE xattrs (
            ino INTEGER NOT NULL REFERENCES inodes(ino) ON DELETE CASCADE,
            name BLOB NOT NULL,
            value BLOB NOT NULL,
            PRIMARY KEY (ino, name)
        ) WITHOUT ROWID;
        CREATE TABLE chunks (
            ino INTEGER NOT NULL REFERENCES inodes(ino) ON DELETE CASCADE,
            idx INTEGER NOT NULL,
            version INTEGER NOT NULL DEFAULT 0,
            nodes TEXT NOT NULL,
            PRIMARY KEY (ino, idx)
        ) WITHOUT ROWID;
        CREATE TABLE nodes (
            node_id INTEGER PRIMARY KEY,
            address TEXT NOT NULL,
            host TEXT NOT NULL,
            capacity INTEGER NOT NULL DEFAULT 0,
            free INTEGER NOT NULL DEFAULT 0,
            used INTEGER NOT NULL DEFAULT 0,
            chunks INTEGER NOT NULL DEFAULT 0,
            last_heartbeat_ns INTEGER NOT NULL DEFAULT 0,
            state TEXT NOT NULL DEFAULT 'down'
        );
        CREATE TABLE garbage (
            id INTEGER PRIMARY KEY,
            node_id INTEGER NOT NULL,
            ino INTEGER NOT NULL,
            idx INTEGER NOT NULL,
            part INTEGER NOT NULL DEFAULT 0,
            max_version INTEGER NOT NULL DEFAULT 9223372036854775807
        );
        CREATE INDEX garbage_by_node ON garbage(node_id, id);
        CREATE INDEX garbage_by_chunk ON garbage(ino, idx);
        """
        % ("" if db.dialect.name == "sqlite" else " TEXT"),  # SQLite: untyped, values keep their type
    )
    if db.dialect.sequences:
        db.execute("CREATE SEQUENCE epochs START WITH 1")
    now = time.time_ns()
    # the first inode number of the table: the root, ROOT_INO, on both engines
    root = db.execute(
        "INSERT INTO inodes (mode, uid, gid, nlink, atime_ns, mtime_ns, ctime_ns,"
        " chunk_size, stripe_count, redundancy, stripe_seed) VALUES (?,?,?,?,?,?,?,?,?,?,?) RETURNING ino",
        (
            stat.S_IFDIR | 0o755,
            os.getuid(),
            os.getgid(),
            2,
            now,
            now,
            now,
            root_layout.chunk_size,
            root_layout.stripe_count,
            root_layout.redundancy,
            random.getrandbits(31),
        ),
    ).fetchone()[0]
    if root != ROOT_INO:
        raise RuntimeError(f"the root directory got inode {root}, not {ROOT_INO}: the inodes table was not empty")
    db.execute("INSERT INTO meta (key, value) VALUES ('epoch_hwm', ?)", (1,))


def execute_script(db, script: str) -> None:
    """Run ``;``-separated statements (no ``;`` inside literals) through ``db.execute``."""
    # not sqlite3's executescript: that may COMMIT the caller's transaction first
    for statement in script.split(";"):
        if statement.strip():
            db.execute(statement)


def _migrate_2_quotas(db, root_layout: Layout) -> None:
    """Directory quotas (daemon/quota.py): limits and incrementally kept usage per quota root."""
    db.execute(
        "CREATE TABLE quotas ("
        " ino BIGINT PRIMARY KEY REFERENCES inodes(ino) ON DELETE CASCADE,"
        " max_bytes BIGINT NOT NULL DEFAULT 0,"
        " max_inodes BIGINT NOT NULL DEFAULT 0,"
        " used_bytes BIGINT NOT NULL DEFAULT 0,"
        " used_inodes BIGINT NOT NULL DEFAULT 0)"
    )


def _migrate_3_open_holds(db, root_layout: Layout) -> None:
    """Open files held through several daemons (daemon/open_holds.py; unused with SQLite)."""
    execute_script(
        db,
        """
        CREATE TABLE daemons (boot_id TEXT PRIMARY KEY, until_ns INTEGER NOT NULL);
        CREATE TABLE open_holds (boot_id TEXT NOT NULL, ino INTEGER NOT NULL, PRIMARY KEY (boot_id, ino));
        CREATE INDEX open_holds_ino ON open_holds(ino)
        """,
    )


def _migrate_4_several_daemons(db, root_layout: Layout) -> None:
    """Several daemons over one database: change log, applied operations, leases.

    Portable SQL only (SQLite, PostgreSQL, CockroachDB), in the shared
    spelling of daemon/dialect.py (the change log's numbers come from the
    ``change_seq`` row of ``counters``, see daemon/change_log.py).
    """
    for statement in (
        # id: the row's identity; seq: its place in the log (daemon/change_log.py), NULL until numbered
        "CREATE TABLE change_log (id INTEGER PRIMARY KEY AUTOINCREMENT, seq BIGINT UNIQUE,"
        " created_ns BIGINT NOT NULL, event BLOB NOT NULL)",
        "CREATE TABLE applied_ops (client_id BIGINT NOT NULL, op_id BIGINT NOT NULL,"
        " created_ns BIGINT NOT NULL, result BLOB NOT NULL, PRIMARY KEY (client_id, op_id))",
        "CREATE INDEX applied_ops_age ON applied_ops(created_ns)",
        "CREATE TABLE leases (name TEXT PRIMARY KEY, holder TEXT NOT NULL, expires_ns BIGINT NOT NULL, term BIGINT NOT NULL)",
        "INSERT INTO leases (name, holder, expires_ns, term) VALUES ('duties', '', 0, 0)",
        "CREATE TABLE counters (name TEXT PRIMARY KEY, value BIGINT NOT NULL)",
        "INSERT INTO counters (name, value) VALUES ('change_seq', 0)",
    ):
        db.execute(statement)
    db.execute("INSERT INTO meta (key, value) VALUES ('change_log_id', ?)", (uuid.uuid4().hex,))


def _migrate_5_tiers(db, root_layout: Layout) -> None:
    """The cold tier on object storage (daemon/tiering.py, docs/tiering.md)."""
    for statement in (
        "CREATE TABLE tiers (tier_id INTEGER PRIMARY KEY AUTOINCREMENT, name TEXT NOT NULL UNIQUE,"
        " bucket TEXT NOT NULL, prefix TEXT NOT NULL, endpoint TEXT NOT NULL, region TEXT NOT NULL,"
        " created_ns BIGINT NOT NULL)",
        "CREATE TABLE tier_policies (ino BIGINT PRIMARY KEY REFERENCES inodes(ino) ON DELETE CASCADE,"
        " tier_id BIGINT NOT NULL, after_s BIGINT NOT NULL, min_size BIGINT NOT NULL DEFAULT 0)",
        # no foreign key: a row outlives its file, so that its object gets deleted
        "CREATE TABLE tier_objects (ino BIGINT NOT NULL, idx BIGINT NOT NULL, version BIGINT NOT NULL,"
        " tier_id BIGINT NOT NULL, length BIGINT NOT NULL DEFAULT 0, xxh3 BIGINT NOT NULL DEFAULT 0,"
        " state TEXT NOT NULL, created_ns BIGINT NOT NULL, PRIMARY KEY (ino, idx, version))",
        "CREATE INDEX tier_objects_state ON tier_objects(state, tier_id)",
        "CREATE TABLE tier_garbage (id INTEGER PRIMARY KEY AUTOINCREMENT, tier_id BIGINT NOT NULL, name TEXT NOT NULL)",
    ):
        db.execute(statement)


def _migrate_6_trash(db, root_layout: Layout) -> None:
    """The trash (daemon/trash.py): removed inodes kept for ``trash_keep_s``."""
    for statement in (
        "CREATE TABLE trash (ino BIGINT PRIMARY KEY REFERENCES inodes(ino) ON DELETE CASCADE,"
        " parent BIGINT NOT NULL, name BLOB NOT NULL, deleted_ns BIGINT NOT NULL, roots TEXT NOT NULL DEFAULT '')",
        "CREATE INDEX trash_by_parent ON trash(parent)",
        "CREATE INDEX trash_by_age ON trash(deleted_ns)",
    ):
        db.execute(statement)


def _migrate_7_snapshots(db, root_layout: Layout) -> None:
    """Directory snapshots (daemon/snapshots.py): read-only inodes sharing the live files' chunks."""
    for statement in (
        "ALTER TABLE inodes ADD COLUMN snapshot INTEGER NOT NULL DEFAULT 0",
        "ALTER TABLE chunks ADD COLUMN data_ino INTEGER NOT NULL DEFAULT 0",
        "CREATE INDEX chunks_pins ON chunks(data_ino, idx) WHERE data_ino <> 0",
        "CREATE INDEX inodes_snapshot ON inodes(snapshot) WHERE snapshot <> 0",
        "CREATE TABLE snapshots (id INTEGER PRIMARY KEY AUTOINCREMENT, dir BIGINT NOT NULL, name BLOB NOT NULL,"
        " root BIGINT NOT NULL, created_ns BIGINT NOT NULL, UNIQUE (dir, name))",
    ):
        db.execute(statement)


def _migrate_8_inode_ranges(db, root_layout: Layout) -> None:
    """Inode numbers delegated to sessions for asynchronous creates (daemon/inode_ranges.py)."""
    db.execute("CREATE TABLE inode_ranges (session TEXT NOT NULL, first BIGINT NOT NULL, last BIGINT NOT NULL)")


def _migrate_9_dir_holds(db, root_layout: Layout) -> None:
    """Directories held by sessions of several daemons (daemon/shared_holds.py; unused with SQLite),
    and the sequence delegated inode numbers come from on PostgreSQL (daemon/inode_ranges.py)."""
    # no unique key: an INSERT ... ON CONFLICT probes the index, a read that SERIALIZABLE locks by page,
    # and every grant's probe of that one small page made concurrent grants abort each other (a
    # grant's row is named by its grant_id; a re-grant adds a row and deletes the older one)
    db.execute("CREATE TABLE dir_holds (ino BIGINT NOT NULL, boot_id TEXT NOT NULL, session BIGINT NOT NULL,"
               " grant_id BIGINT NOT NULL, writer BIGINT NOT NULL, holder TEXT NOT NULL)")
    db.execute("CREATE INDEX dir_holds_ino ON dir_holds(ino)")
    # a directory's holders at a glance: 0 none, a writer tag its only holder's, -1 several (or unknown)
    db.execute("ALTER TABLE inodes ADD COLUMN held_by INTEGER NOT NULL DEFAULT 0")
    if getattr(getattr(db, "dialect", None), "name", "sqlite") != "sqlite":
        db.execute("CREATE SEQUENCE inode_blocks INCREMENT BY 65536 START WITH 1099511627776")


def _migrate_10_fragment_versions(db, root_layout: Layout) -> None:
    """An erasure-coded stripe's version per fragment (common/protocol.ChunkRef ``fversions``):
    '' (every existing row) means every fragment is at the row's version, as before."""
    db.execute("ALTER TABLE chunks ADD COLUMN fversions TEXT NOT NULL DEFAULT ''")


#: ``(db, root_layout)`` functions, see the module docstring; append, never edit a released one
MIGRATIONS: list[Callable[..., None]] = [
    _migrate_1, _migrate_2_quotas, _migrate_3_open_holds, _migrate_4_several_daemons, _migrate_5_tiers,
    _migrate_6_trash, _migrate_7_snapshots, _migrate_8_inode_ranges, _migrate_9_dir_holds,
    _migrate_10_fragment_versions,
]
SCHEMA_VERSION = len(MIGRATIONS)


def schema_version(db) -> int:
    """The version of a database (0: empty); ``db`` is a store or a sqlite3 connection."""
    if getattr(getattr(db, "dialect", None), "name", "sqlite") == "sqlite":
        found = db.execute("SELECT 1 FROM sqlite_master WHERE type='table' AND name='meta'").fetchone()
    else:
        found = db.execute("SELECT 1 FROM information_schema.tables WHERE table_name='meta' AND table_schema=current_schema()").fetchone()
    if not found:
        return 0
    row = db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
    return int(row[0]) if row else 0


def set_schema_version(db, version: int) -> None:
    db.execute(
        "INSERT INTO meta (key, value) VALUES ('schema_version', ?) ON CONFLICT (key) DO UPDATE SET value=excluded.value",
        (version,),
    )


def lock_database(path: str | Path):
    """Hold ``PATH.lock`` exclusively (flock) while the file returned stays open; RuntimeError if another holds it.

    One process owns a database: the daemon for as long as it runs, ``stripefs
    meta restore`` while it replaces it. (SQLite's own locks cannot tell: the
    daemon's open transaction takes no lock until it writes.)
    """
    lock_path = Path(str(path) + ".lock")
    f = open(lock_path, "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "another process"
        f.close()
        raise RuntimeError(f"{path} is in use by {holder} (lock {lock_path})") from None
    f.seek(0)
    f.truncate()
    f.write(f"pid {os.getpid()}\n")
    f.flush()
    return f


def open_database(path: str | Path, root_layout: Layout) -> sqlite3.Connection:
    """Open (creating and migrating as needed) the database at ``path``.

    The connection is in autocommit mode (``isolation_level=None``): the caller
    issues BEGIN/COMMIT itself. ``check_same_thread=False`` because the service
    runs COMMIT (the fsync) in a worker thread while holding its lock.
    ``root_layout`` is used only when the database is created.
    """
    path = Path(path)
    # names, owners and xattrs of every file: the daemon's user only, whatever the umask (SQLite
    # creates the -wal and -shm files with the database file's permissions)
    os.close(os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600))
    os.chmod(path, 0o600)
    os.chmod(path.parent, 0o700)
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    conn.row_factory = sqlite3.Row
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=FULL")
    conn.execute("PRAGMA foreign_keys=ON")
    # savepoints' statement journals in memory: every operation of a burst runs in a savepoint of
    # one long transaction, and each journals the pages it touches first; past 64 KiB SQLite spilled
    # that journal to a temporary file (a pwrite per page: 10% of the daemon's CPU per create)
    conn.execute("PRAGMA temp_store=MEMORY")
    version = schema_version(conn)
    if version > SCHEMA_VERSION:
        conn.close()
        raise RuntimeError(f"{path} has schema version {version}; this stripefs knows only up to {SCHEMA_VERSION}")
    from .store import SqliteStore

    db = SqliteStore(conn)
    for target in range(version + 1, SCHEMA_VERSION + 1):
        log.info("database %s: migrating schema to version %d", path, target)
        conn.execute("BEGIN IMMEDIATE")
        try:
            MIGRATIONS[target - 1](db, root_layout)
            set_schema_version(db, target)
        except BaseException:
            conn.execute("ROLLBACK")
            conn.close()
            raise
        conn.execute("COMMIT")
    return conn
