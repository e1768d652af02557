"""``stripefs meta backup FILE`` and ``stripefs meta restore FILE``: the metadata database, copied.

Only metadata is copied: the namespace, layouts, chunk maps, node registrations.
Chunk data stays on the storage nodes, where a restored chunk map finds it.

Backup (online)
    Runs on the metadata daemon's machine while the daemon serves. It opens the
    live database read-only, a second SQLite connection beside the daemon's,
    and copies it with SQLite's online backup API in one step. In WAL mode a
    reader sees the last committed state and neither blocks nor is blocked by
    the daemon's writer, so the copy is a consistent snapshot containing every
    change the daemon has acknowledged (replies are sent only after their
    group commit) and nothing half done (each commit holds whole operations).
    The copy is written to ``FILE.tmp``, switched to a single-file journal
    mode, checked with ``PRAGMA integrity_check`` and renamed to FILE.

Restore (offline)
    The daemon must be stopped: restore takes the lock the daemon holds on its
    database while it runs (``db.lock_database``) and refuses if it cannot. It checks the
    backup (integrity, schema version), moves the live database aside as
    ``meta.sqlite3.before-restore-TIMESTAMP`` (never deletes it), and copies
    the backup in. Then it raises two counters by ``RESTORE_GAP`` so nothing
    handed out after the backup was taken is handed out again: the epoch
    high-water mark (chunk versions on storage nodes written after the backup
    stay older than any new write) and the inode sequence (chunk ids embed the
    inode number, so a new file never meets a later-deleted file's chunks).

What a restore loses: every change after the backup. Files created after it
are gone (their chunks stay on the nodes as unreferenced data); files
rewritten after it may read as an error where their old chunk versions were
overwritten. Files unchanged since the backup read back as they were.
"""

from __future__ import annotations

import argparse
import os
import sqlite3
import sys
import time
from pathlib import Path

from ..common.arguments import ArgumentParser
from ..common.config import MetaConfig, load
from ..common.errors import QuietError
from .db import DB_NAME, SCHEMA_VERSION, lock_database

#: how far restore moves the epoch high-water mark and the inode sequence past the backup's
RESTORE_GAP = 1 << 32

_DESCRIPTION = """\
Copy the metadata database (namespace, layouts, chunk maps) to FILE while the
daemon serves (backup), or replace the database with such a copy while the
daemon is stopped (restore). Chunk data is not copied: it stays on the storage
nodes. Run on the metadata daemon's machine. The database is found from the
daemon's config (--config; without it /etc/stripefs/metad.toml, else the local
cluster in ./.stripefs) or from a local cluster's state directory (--dir).
"""


def _parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="stripefs meta", description=_DESCRIPTION)  # "stripefs meta backup|restore ..." only
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    backup = sub.add_parser("backup", help="copy the live database to FILE (online, consistent)", description=_DESCRIPTION)
    restore = sub.add_parser(
        "restore", help="replace the database with FILE (the daemon must be stopped)", description=_DESCRIPTION
    )
    for p in (backup, restore):
        p.add_argument("file", metavar="FILE", help="the backup file")
        where = p.add_mutually_exclusive_group()
        where.add_argument("--config", default=None, help="the daemon's config (default: /etc/stripefs/metad.toml, else ./.stripefs/meta/metad.toml)")
        where.add_argument("--dir", help="state directory of a local cluster (stripefs local up --dir)")
    backup.add_argument("--force", action="store_true", help="overwrite FILE if it exists")
    return parser


#: where the config is looked for without --config or --dir, in this order: a systemd install, then
#: the local cluster ``stripefs local up`` (and ``make run``) starts by default
SYSTEM_CONFIG = Path("/etc/stripefs/metad.toml")
LOCAL_STATE = Path(".stripefs")


def config_path(config: str | None, state: str | None) -> Path:
    """The daemon's config: --config, --dir STATE's, else /etc/stripefs/metad.toml or ./.stripefs's."""
    if state:
        return Path(state) / "meta" / "metad.toml"
    if config:
        return Path(config)
    for candidate in (SYSTEM_CONFIG, LOCAL_STATE / "meta" / "metad.toml"):
        if candidate.exists():
            return candidate
    raise QuietError(f"cannot find the metadata daemon's config (neither {SYSTEM_CONFIG} nor "
                     f"./{LOCAL_STATE}/meta/metad.toml exists): give --config metad.toml, or --dir STATE of a local cluster")


def _database(args) -> Path:
    config = config_path(args.config, args.dir)
    meta = load(config, MetaConfig)
    if meta.store == "postgresql":
        raise QuietError(
            f"{config}: the metadata is in PostgreSQL; back it up with PostgreSQL's own tools "
            "(pg_dump, or pg_basebackup with WAL archiving; see docs/postgresql.md)"
        )
    return Path(meta.data_dir) / DB_NAME


def backup(db: Path, target: Path, *, force: bool = False) -> dict:
    """Copy the live database ``db`` to ``target``; counts of what it holds."""
    if not db.exists():
        raise QuietError(f"no metadata database at {db}; is this the metadata daemon's machine and config?")
    if target.exists() and not force:
        raise QuietError(f"{target} exists; choose another name or pass --force")
    tmp = target.with_name(target.name + ".tmp")
    tmp.unlink(missing_ok=True)
    src = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        dst = sqlite3.connect(tmp)
        try:
            src.backup(dst)  # one step: one read transaction, one snapshot
            dst.execute("PRAGMA journal_mode=DELETE")  # a single self-contained file
            info = _check(dst, tmp)
        finally:
            dst.close()
    except sqlite3.Error as exc:
        tmp.unlink(missing_ok=True)
        raise QuietError(f"backup of {db} failed: {exc}", 3) from None
    finally:
        src.close()
    os.replace(tmp, target)
    return info


def _check(conn: sqlite3.Connection, path: Path) -> dict:
    try:
        result = conn.execute("PRAGMA integrity_check").fetchone()[0]
        version = int(conn.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()[0])
        inodes = conn.execute("SELECT count(*) FROM inodes").fetchone()[0]
        chunks = conn.execute("SELECT count(*) FROM chunks").fetchone()[0]
    except (sqlite3.Error, TypeError) as exc:
        raise QuietError(f"{path} is not a stripefs metadata database: {exc}", 3) from None
    if result != "ok":
        raise QuietError(f"{path} is damaged: {result}", 3)
    if version > SCHEMA_VERSION:
        raise QuietError(f"{path} has schema version {version}; this stripefs knows only up to {SCHEMA_VERSION}", 3)
    return {"inodes": inodes, "chunks": chunks, "schema_version": version}


def _take_database(db: Path):
    """The daemon's lock on the database (db.lock_database), or a QuietError saying to stop the daemon."""
    try:
        return lock_database(db)
    except RuntimeError as exc:
        raise QuietError(f"{exc}: stop the metadata daemon first (systemctl stop stripefs-meta, or stripefs local down)", 3) from None
    except OSError as exc:
        raise QuietError(f"cannot lock {db}: {exc}", 3) from None


def restore(source: Path, db: Path) -> tuple[dict, Path | None]:
    """Replace ``db`` with the backup ``source``; (counts, where the old database went)."""
    try:
        src = sqlite3.connect(f"file:{source}?mode=ro", uri=True)
    except sqlite3.Error as exc:
        raise QuietError(f"cannot open {source}: {exc}", 3) from None
    try:
        info = _check(src, source)
        db.parent.mkdir(parents=True, exist_ok=True)
        held = _take_database(db)  # held until this process exits: no daemon starts meanwhile
        live_epoch, live_ino = _counters(db) if db.exists() else (0, 0)
        moved = None
        if db.exists():
            moved = db.with_name(f"{db.name}.before-restore-{time.strftime('%Y%m%d-%H%M%S')}")
            for suffix in ("-wal", "-shm", ""):
                part = Path(str(db) + suffix)
                if part.exists():
                    os.replace(part, Path(str(moved) + suffix))
        dst = sqlite3.connect(db, isolation_level=None)
        try:
            src.backup(dst)
            epoch, ino = _counters_of(dst)
            dst.execute("BEGIN IMMEDIATE")
            dst.execute("UPDATE meta SET value=? WHERE key='epoch_hwm'", (max(epoch, live_epoch) + RESTORE_GAP,))
            dst.execute("UPDATE sqlite_sequence SET seq=? WHERE name='inodes'", (max(ino, live_ino) + RESTORE_GAP,))
            dst.execute("COMMIT")
            dst.execute("PRAGMA journal_mode=WAL")
        finally:
            dst.close()
            held.close()
    finally:
        src.close()
    return info, moved


def _counters(db: Path) -> tuple[int, int]:
    try:
        conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
        try:
            return _counters_of(conn)
        finally:
            conn.close()
    except sqlite3.Error:
        return 0, 0  # a damaged live database: the backup's counters plus the gap must do


def _counters_of(conn: sqlite3.Connection) -> tuple[int, int]:
    epoch = conn.execute("SELECT value FROM meta WHERE key='epoch_hwm'").fetchone()
    ino = conn.execute("SELECT seq FROM sqlite_sequence WHERE name='inodes'").fetchone()
    return int(epoch[0]) if epoch else 0, int(ino[0]) if ino else 0


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    try:
        db = _database(args)
        target = Path(args.file)
        if args.action == "backup":
            started = time.monotonic()
            info = backup(db, target, force=args.force)
            print(
                f"backed up {db} to {target}: {info['inodes']} inodes, {info['chunks']} chunks, "
                f"{target.stat().st_size} bytes in {time.monotonic() - started:.1f}s"
            )
        else:
            info, moved = restore(target, db)
            print(f"restored {db} from {target}: {info['inodes']} inodes, {info['chunks']} chunks")
            if moved:
                print(f"the previous database is kept as {moved}")
            print("start the metadata daemon now (systemctl start stripefs-meta, or stripefs local up)")
    except QuietError as exc:
        print(f"stripefs meta {args.action}: {exc}", file=sys.stderr)
        return exc.exitcode
    return 0
