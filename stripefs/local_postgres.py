"""A throwaway PostgreSQL server for ``stripefs local up --meta-store postgresql`` and the tests.

Debian's server binaries (``initdb``, ``pg_ctl``, ``postgres``) live in
``/usr/lib/postgresql/<version>/bin``, off PATH; the newest version there is
used (``$STRIPEFS_PG_BIN`` overrides). PostgreSQL refuses to run as root, so
as root every server command runs as the ``postgres`` user (``runuser``),
from a data directory that user owns and can reach: ``STATE/postgres`` when
every parent of STATE is enterable by others, else a directory under the
system temp dir (pytest's tmp dirs are 0700) whose path is kept in
cluster.json. The server listens on 127.0.0.1 at a free port, its Unix socket
in that same directory; authentication is ``trust`` (a local test server, never
for production: see docs/postgresql.md). fsync stays on: the same durability
as production, so the tests and benchmarks measure what users get.
"""

from __future__ import annotations

import logging
import os
import pwd
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from .common.errors import QuietError

log = logging.getLogger(__name__)

DB_NAME = "stripefs"
SERVER_USER = "postgres"
_CONF = """\
listen_addresses = '127.0.0.1'
port = {port}
unix_socket_directories = '{socket_dir}'
max_connections = 200
shared_buffers = 64MB
log_min_messages = warning
"""


def pg_bin() -> Path:
    """The directory of initdb and pg_ctl; QuietError saying how to install them if there is none."""
    override = os.environ.get("STRIPEFS_PG_BIN")
    if override:
        return Path(override)
    candidates = sorted(Path("/usr/lib/postgresql").glob("*/bin/pg_ctl"), key=lambda p: _version_key(p.parent.parent.name))
    if candidates:
        return candidates[-1].parent
    found = shutil.which("pg_ctl")
    if found:
        return Path(found).parent
    raise QuietError(
        "PostgreSQL server binaries (initdb, pg_ctl) not found: install them with "
        "'apt-get install postgresql' (make install does), or set STRIPEFS_PG_BIN to their directory"
    )


def _version_key(name: str) -> tuple:
    return tuple(int(x) if x.isdigit() else 0 for x in name.split("."))


def _as_root() -> bool:
    return os.geteuid() == 0


def _enterable_by_others(path: Path) -> bool:
    for parent in [path, *path.parents]:
        if parent.exists() and not os.stat(parent).st_mode & 0o001:
            return False
    return True


def choose_dir(state: Path) -> Path:
    """Where the server's files go (created, owned by the server's user)."""
    if not _as_root() or _enterable_by_others(state):
        base = state / "postgres"
        base.mkdir(parents=True, exist_ok=True)
    else:
        base = Path(tempfile.mkdtemp(prefix="stripefs-pg-"))
    if _as_root():
        pw = pwd.getpwnam(SERVER_USER)
        os.chown(base, pw.pw_uid, pw.pw_gid)
        base.chmod(0o700)
    return base


def _run(args: list[str], *, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
    if _as_root():
        args = ["runuser", "-u", SERVER_USER, "--", *args]
    res = subprocess.run(args, capture_output=True, text=True, timeout=timeout, cwd="/")
    if check and res.returncode:
        raise QuietError(f"{' '.join(args)} failed ({res.returncode}): {(res.stderr or res.stdout).strip()[-2000:]}", 3)
    return res


class LocalPostgres:
    """One server: ``init`` once, then ``start``/``stop``; ``dsn`` for the daemons."""

    def __init__(self, base: str | Path, port: int):
        self.base = Path(base)
        self.port = port
        self.data = self.base / "data"
        self.log_file = self.base / "server.log"

    @property
    def dsn(self) -> str:
        return f"host=127.0.0.1 port={self.port} dbname={DB_NAME} user={SERVER_USER} connect_timeout=5"

    def init(self) -> None:
        if (self.data / "PG_VERSION").exists():
            return
        _run([str(pg_bin() / "initdb"), "-D", str(self.data), "-U", SERVER_USER, "--auth=trust", "-E", "UTF8", "--no-locale"])
        with open(self.data / "postgresql.conf", "a") as f:
            f.write(_CONF.format(port=self.port, socket_dir=self.base))

    def running(self) -> bool:
        return _run([str(pg_bin() / "pg_ctl"), "-D", str(self.data), "status"], check=False).returncode == 0

    def pid(self) -> int | None:
        try:
            return int((self.data / "postmaster.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def start(self, timeout: float = 60) -> None:
        if not self.running():
            _run([str(pg_bin() / "pg_ctl"), "-D", str(self.data), "-l", str(self.log_file), "-w", "-t", str(int(timeout)), "start"])
        self._create_database(timeout)

    def _create_database(self, timeout: float) -> None:
        import psycopg

        deadline = time.monotonic() + timeout
        while True:
            try:
                with psycopg.connect(self.dsn.replace(f"dbname={DB_NAME}", "dbname=postgres"), autocommit=True) as conn:
                    if not conn.execute("SELECT 1 FROM pg_database WHERE datname=%s", (DB_NAME,)).fetchone():
                        conn.execute(f"CREATE DATABASE {DB_NAME}")
                    return
            except psycopg.OperationalError as exc:
                if time.monotonic() > deadline:
                    raise QuietError(f"PostgreSQL at 127.0.0.1:{self.port} does not answer: {exc}; see {self.log_file}", 3) from None
                time.sleep(0.2)

    def stop(self) -> None:
        if self.data.exists() and self.running():
            _run([str(pg_bin() / "pg_ctl"), "-D", str(self.data), "-m", "fast", "-w", "stop"], check=False)

    def remove(self) -> None:
        """Stop and delete everything (tests)."""
        self.stop()
        shutil.rmtree(self.base, ignore_errors=True)
