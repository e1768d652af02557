"""A throwaway PostgreSQL server for the unit tests of the PostgreSQL store (stripefs/local_postgres.py).

One server per test session (per pytest-xdist worker), started on first use; each
test gets its own empty schema (``pg_dsn``), so tests never see each other's tables.
"""

from __future__ import annotations

import itertools
import tempfile
from pathlib import Path

import psycopg
import pytest
import zmq

from util import configure, free_port
from stripefs.local_postgres import LocalPostgres, choose_dir

_schemas = itertools.count(1)


def pytest_configure(config):
    configure(config)  # tests/util.py: under pytest-xdist, ports of this worker's own; the warm_caches mark


@pytest.fixture(scope="session")
def pg_server():
    root = Path(tempfile.mkdtemp(prefix="stripefs-unit-pg-"))
    server = LocalPostgres(choose_dir(root), free_port())
    try:
        server.init()
        server.start()
        yield server
    finally:
        server.remove()
        root.rmdir() if root.exists() and not any(root.iterdir()) else None


@pytest.fixture
def pg_dsn(pg_server) -> str:
    """A DSN whose search_path is a new, empty schema."""
    schema = f"t{next(_schemas)}"
    with psycopg.connect(pg_server.dsn, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
    return f"{pg_server.dsn} options='-csearch_path={schema}'"


@pytest.fixture
def ctx():
    """A ZeroMQ context for a test's sockets, terminated after it (a test that leaves a socket open
    hangs here: what its teardown forgot)."""
    c = zmq.Context()
    yield c
    c.term()
