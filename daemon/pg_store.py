"""The metadata store on PostgreSQL: the same SQL as SQLite, one transaction per request.

``store = "postgresql"`` and ``dsn = "..."`` in metad.toml select it. Every
statement is ``SqlStore``'s (daemon/store.py), rewritten by
daemon/dialect.py; this module adds only connections and transactions.

Transaction model (docs/design.md, "Metadata transactions")
-----------------------------------------------------------
* ``run(fn, *args)`` is one namespace operation: it borrows a connection from
  the pool (psycopg_pool, ``pool_size`` connections), runs ``BEGIN ISOLATION
  LEVEL SERIALIZABLE``, calls ``fn`` (synchronous namespace code, whose
  ``self.conn`` is that connection for this thread), then COMMIT. The service
  calls it through ``trio.to_thread.run_sync``: the trio thread never waits on
  the network for a request. The reply is sent only after COMMIT returned.
* Read-only operations use ``REPEATABLE READ READ ONLY``: one snapshot for
  all their statements (a lookup and the chunk map it returns agree), no
  serialization failures.
* SERIALIZABLE is what makes several daemons over one database correct
  without locks of our own: two creates of one name conflict (one commits, the
  other is retried, finds the entry and answers EEXIST); two cross-directory
  renames that would together make a cycle each read the other's ancestors,
  so one of them is aborted and retried, and its retry sees the first and
  answers EINVAL; the ``nlink`` and times of a shared parent are updated by
  one transaction at a time.
* Serialization failures (SQLSTATE 40001), deadlocks (40P01) and unique
  violations met under SERIALIZABLE (23505: the loser of a concurrent insert)
  are retried, up to ``MAX_ATTEMPTS`` times, after a short random backoff
  that doubles. ``fn`` must therefore be safe to run again: namespace code is
  (it only talks to the database); in-memory side effects of the service's
  callbacks (holding an open file for a session) are idempotent.
* A data exception (SQLSTATE class 22: a number from the wire beyond BIGINT)
  is BAD_REQUEST, as SQLite's OverflowError is. Any other database error is
  an IO error for the client (and an ERROR log line); a lost connection is
  dropped by the pool and replaced.
* Background work of the service that calls store methods directly on the trio
  thread (repair scans, garbage collection) runs them on one extra
  connection in autocommit mode, one statement per transaction;
  ``_write_locked`` callers get a real transaction through ``run``.

Epochs come from the sequence ``epochs`` (``nextval``): unique and increasing
across every daemon, never rolled back, so no high-water mark needs to be
made durable before an epoch is used.

The database must be PostgreSQL 12+ (or a PostgreSQL-compatible engine); no
LISTEN/NOTIFY, advisory lock or other PostgreSQL-only feature is relied upon
(``= ANY(array)`` in ``log_change_holders`` and a sequence for delegated inode
numbers excepted; CockroachDB has both).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import random
import threading
import time
from typing import Callable, Iterator, Sequence, TypeVar

import psycopg
import psycopg_pool

from ..common.errors import ErrorCode, StripefsError
from ..common.protocol import Layout
from .db import MIGRATIONS, SCHEMA_VERSION, schema_version, set_schema_version
from .dialect import POSTGRES
from .store import SqlStore

log = logging.getLogger(__name__)

T = TypeVar("T")

MAX_ATTEMPTS = 30
_RETRY_SQLSTATES = frozenset({"40001", "40P01"})
_UNIQUE_VIOLATION = "23505"
_BEGIN_WRITE = "BEGIN ISOLATION LEVEL SERIALIZABLE"
_BEGIN_READ = "BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY"


class Row:
    """A result row indexable by position and by column name, like ``sqlite3.Row``."""

    __slots__ = ("_values", "_index")

    def __init__(self, values: Sequence, index: dict[str, int]):
        self._values = values
        self._index = index

    def __getitem__(self, key):
        if isinstance(key, str):
            return self._values[self._index[key]]
        return self._values[key]

    def __len__(self) -> int:
        return len(self._values)

    def __iter__(self):
        return iter(self._values)

    def keys(self) -> list[str]:
        return list(self._index)

    def __repr__(self) -> str:
        return f"Row({dict(zip(self._index, self._values))})"


def _row_factory(cursor: psycopg.Cursor):
    index = {col.name: i for i, col in enumerate(cursor.description or ())}
    return lambda values: Row(values, index)


def _connect_kwargs() -> dict:
    return {"autocommit": True, "row_factory": _row_factory}


class PgStore(SqlStore):
    """The store over a psycopg connection pool; see the module docstring."""

    dialect = POSTGRES
    group_commit = False
    errors = (psycopg.Error,)

    def __init__(self, dsn: str, *, pool_size: int = 8):
        self.dsn = dsn
        self._local = threading.local()
        self.retries = 0  # transactions retried after a serialization failure (tests and metrics read it)
        #: called at the start of every transaction, in its thread (daemon/quota.py reads the quota roots afresh)
        self.begin_hooks: list[Callable[[], None]] = []
        try:
            self._main = psycopg.connect(dsn, **_connect_kwargs())
        except psycopg.Error as exc:
            raise RuntimeError(f"cannot connect to PostgreSQL ({_redact(dsn)}): {exc}".strip()) from None
        # the service's worker threads (at most pool_size), the metrics reader and the trio thread's own
        # transactions (``_write_locked``) each have a connection: the trio thread never waits behind
        # workers that wait for the trio thread
        self.pool = psycopg_pool.ConnectionPool(
            dsn, min_size=1, max_size=max(1, pool_size) + 2, kwargs=_connect_kwargs(), open=True, name="stripefs-meta"
        )

    # -- connections -------------------------------------------------------

    @property
    def conn(self) -> psycopg.Connection:
        """This thread's transaction's connection, else the autocommit one (the trio thread's background work)."""
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            return conn
        if self._main.closed:
            log.warning("PostgreSQL connection lost; reconnecting")
            self._main = psycopg.connect(self.dsn, **_connect_kwargs())
        return self._main

    @property
    def _dirs(self) -> dict | None:
        """``SqlStore.dir_cache``'s rows: this thread's transaction's own (a burst's, daemon/burst.py)."""
        return getattr(self._local, "dirs", None)

    @_dirs.setter
    def _dirs(self, value: dict | None) -> None:
        self._local.dirs = value

    def close(self) -> None:
        self.pool.close()
        self._main.close()

    # -- transactions --------------------------------------------------------

    def run(self, fn: Callable[..., T], *args, readonly: bool = False, hooks: bool = True, quiet: bool = False, **kwargs) -> T:
        """``fn(*args, **kwargs)`` as one transaction, committed before returning; retried on conflicts.
        ``hooks`` False: without the begin hooks (a probe that touches no quota). ``quiet``: conflicts
        that outlast the retries raise ``Conflicted``, not logged (the caller has a way out)."""
        delay = 0.001
        for attempt in itertools.count(1):
            try:
                with self.pool.connection() as conn:
                    self._local.conn = conn
                    try:
                        conn.execute(_BEGIN_READ if readonly else _BEGIN_WRITE)
                        for hook in self.begin_hooks if hooks else ():
                            hook()
                        result = fn(*args, **kwargs)
                        conn.execute("COMMIT")
                        return result
                    except BaseException:
                        _rollback(conn)
                        raise
                    finally:
                        self._local.conn = None
            except psycopg_pool.PoolClosed:  # the daemon is stopping: a late task (a metrics scrape, a sweep)
                log.info("transaction %s not run: the daemon is stopping", getattr(fn, "__name__", fn))
                raise StripefsError(ErrorCode.UNAVAILABLE, "the metadata daemon is stopping") from None
            except psycopg.Error as exc:
                if _rerun(exc, readonly):
                    if attempt < MAX_ATTEMPTS:
                        self.retries += 1
                        log.debug("transaction %s retried (attempt %d): %s", getattr(fn, "__name__", fn), attempt, exc.sqlstate)
                        time.sleep(random.uniform(0, delay))
                        delay = min(delay * 2, 0.05)
                        continue
                    if not quiet:
                        raise _refusal(exc, getattr(fn, "__name__", fn)) from None
                    raise Conflicted(ErrorCode.IO, f"metadata database: {exc}") from None
                raise _refusal(exc, getattr(fn, "__name__", fn)) from None
        raise AssertionError("unreachable")

    @contextlib.contextmanager
    def savepoint(self) -> Iterator[None]:
        """Statements in the block are undone together if it raises (one operation of a burst,
        daemon/burst.py). A database error of its own becomes the operation's StripefsError, the
        others of the transaction going on; a conflict (``_rerun``) is raised as it is: the whole
        transaction is run again (``run``)."""
        execute = self.conn.execute
        execute("SAVEPOINT op")
        try:
            yield
        except BaseException as exc:
            if self._dirs:
                self._dirs = {}  # rows written in the block may be undone
            execute("ROLLBACK TO op")
            if isinstance(exc, psycopg.Error) and not _rerun(exc, False):
                raise _refusal(exc, "an operation") from None
            raise
        execute("RELEASE op")

    # -- meta and epochs ---------------------------------------------------

    def get_meta(self, key: str, default=None):
        """The value as text (meta.value is TEXT here): readers convert, ``int(get_meta(...))``."""
        return super().get_meta(key, default)

    def set_meta(self, key: str, value) -> None:
        super().set_meta(key, None if value is None else str(value))

    def reserve_inos(self, n: int) -> list[int]:
        return [r[0] for r in self._x("SELECT nextval(pg_get_serial_sequence('inodes', 'ino')) FROM generate_series(1, ?)", (n,))]

    def skip_inodes(self, count: int) -> int:
        """``count`` inode numbers for a session (daemon/inode_ranges.py): a block of the
        ``inode_blocks`` sequence (from 2^40 up, 65,536 a block), the first of them. A sequence
        cannot hand out a contiguous range of the inodes' own without racing other daemons'
        creates; the identity column never reaches 2^40."""
        if count > 65_536:
            raise ValueError(f"at most 65,536 inode numbers a block, not {count}")
        return self._x("SELECT nextval('inode_blocks')").fetchone()[0]

    def log_change_holders(self, created_ns: int, event: bytes, dirs: Sequence[int], writer: int) -> list[tuple]:
        """``log_change`` (the row unnumbered), returning in the same statement the holds of
        directories ``dirs`` by sessions of another writer tag than ``writer``, as (ino, boot_id,
        session, grant_id): read in the change's SERIALIZABLE transaction, so a grant committed
        concurrently that this change does not see conflicts with it (daemon/shared_holds.py)."""
        # the directories' own rows first (``held_by``: a change writes them anyway): ``dir_holds`` is
        # read only when another writer holds one, so changes in directories held by nobody else
        # take no predicate lock on that small table (a page shared by every directory's rows)
        others = self._x(
            "INSERT INTO change_log (created_ns, event) VALUES (?, ?) RETURNING"
            " (SELECT count(*) FROM inodes WHERE ino = ANY(?) AND held_by <> 0 AND held_by <> ?)",
            (created_ns, event, list(dirs), writer),
        ).fetchone()[0]
        if not others:
            return []
        return [(r[0], r[1], r[2], r[3]) for r in self._x(
            "SELECT ino, boot_id, session, grant_id FROM dir_holds WHERE ino = ANY(?) AND writer <> ?", (list(dirs), writer))]

    def next_epoch(self) -> int:
        return self._x("SELECT nextval('epochs')").fetchone()[0]

    def last_epoch(self) -> int:
        """The newest epoch handed out by any daemon so far (0: none yet)."""
        return self._x("SELECT CASE WHEN is_called THEN last_value ELSE last_value - 1 END FROM epochs").fetchone()[0]

    # -- schema --------------------------------------------------------------

    def migrate(self, root_layout: Layout) -> int:
        """Bring the schema to SCHEMA_VERSION (daemons starting together: each migration applied once)."""
        failures: dict[int, int] = {}  # target version -> attempts that failed (a concurrent daemon's step)
        for _ in itertools.count(1):
            version = schema_version(self)
            if version > SCHEMA_VERSION:
                raise RuntimeError(
                    f"the PostgreSQL database has schema version {version}; this stripefs knows only up to {SCHEMA_VERSION}"
                )
            if version == SCHEMA_VERSION:
                return version
            target = version + 1

            def step():
                if schema_version(self) >= target:
                    return  # another daemon applied it while this one waited
                MIGRATIONS[target - 1](self, root_layout)
                set_schema_version(self, target)

            log.info("PostgreSQL database: migrating schema to version %d", target)
            try:
                self.run(step)
            except StripefsError:
                attempt = failures[target] = failures.get(target, 0) + 1
                if attempt >= 5:
                    raise
                time.sleep(0.2 * attempt)  # another daemon's migration: wait for it and look again
        raise AssertionError("unreachable")


class Conflicted(StripefsError):
    """Conflicts with other transactions outlasted ``MAX_ATTEMPTS`` (``run(quiet=True)``)."""


def _rerun(exc: psycopg.Error, readonly: bool) -> bool:
    """A conflict with another transaction: run the whole transaction again. Unique violations
    met under SERIALIZABLE are the loser of a concurrent insert (namespace code looks first)."""
    return exc.sqlstate in _RETRY_SQLSTATES or (exc.sqlstate == _UNIQUE_VIOLATION and not readonly)


def _refusal(exc: psycopg.Error, what) -> StripefsError:
    """A database error that a rerun does not cure, as the client's error (and a log line)."""
    if (exc.sqlstate or "").startswith("22"):  # data exception: a number from the wire out of BIGINT range
        log.warning("refusing %s: %s (SQLSTATE %s)", what, exc, exc.sqlstate)
        return StripefsError(ErrorCode.BAD_REQUEST, f"a value is out of range for the database: {exc}")
    log.error("metadata transaction %s failed: %s (SQLSTATE %s)", what, exc, exc.sqlstate)
    return StripefsError(ErrorCode.IO, f"metadata database: {exc}")


def _rollback(conn: psycopg.Connection) -> None:
    if conn.closed or conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE:
        return
    try:
        conn.execute("ROLLBACK")
    except psycopg.Error as exc:  # the connection is gone: the pool discards it
        log.warning("ROLLBACK failed: %s", exc)


def _redact(dsn: str) -> str:
    """The DSN without its password, for messages."""
    try:
        parts = psycopg.conninfo.conninfo_to_dict(dsn)
    except psycopg.Error:
        return "dsn not parsable"
    parts.pop("password", None)
    return psycopg.conninfo.make_conninfo(**parts)


def open_pg_store(dsn: str, root_layout: Layout, *, pool_size: int = 8) -> PgStore:
    store = PgStore(dsn, pool_size=pool_size)
    try:
        store.migrate(root_layout)
    except BaseException:
        store.close()
        raise
    return store
