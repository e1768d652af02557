"""The in-process tier: the mount's ``Operations`` driven directly from trio, without a kernel.

A real metadata daemon and 4 real storage node processes (as ``stripefs local up``
lays them out: 4 MiB chunks, stripe count 4, replicas=2), started once per
session on free ports; on PostgreSQL, a throwaway server and two metadata
daemons (the client talks to the first), as the cluster tier's ``pg_cluster``.
Each test builds a client as the mount does (client/connect.py: the metadata
session and its heartbeat, the node pool, the data path) and an ``Operations``
on it, and calls its handlers with the arguments its FUSE session passes (the syscall-like
helpers of ``fsapi.py``). What the session would hand the kernel (readdir replies,
invalidations, page-cache stores) is recorded instead (``Kernel``).

What this tier cannot show (the kernel's caches, mmap, atomic O_APPEND, the
kernel's own permission checks under default_permissions, several mounts, real
processes doing syscalls) stays in tests/cluster.

Logs are assertions, as in the cluster tier: an ERROR line or a traceback that a
daemon or storage node logs during a test, or an ERROR record the client logs in
this process, fails that test unless the test excused it (``rig.expect_log``) or
the rig's fixture did (``expected_log_patterns``). What the processes log outside
any test fails the rig's teardown.
"""

from __future__ import annotations

import logging
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import trio
import zmq

from stripefs.client.fuse.abi import ROOT_ID
from stripefs.common import config as cfg
from stripefs.common import protocol as P
from stripefs.common.errors import StripefsError
from stripefs.common.transport import connect
from stripefs.local_postgres import LocalPostgres, choose_dir
from util import configure, free_port

from fsapi import Kernel, open_fs

NODES = 4
BAD_LOG_LINE = re.compile(r" (ERROR|CRITICAL) |Traceback")


class Rig:
    """Metadata daemon(s) and storage nodes as processes, in a tmp dir; no mount."""

    def __init__(self, root: Path, *, store: str = "sqlite", metas: int = 1, nodes: int = NODES,
                 meta_settings: dict | None = None, client_settings: dict | None = None):
        self.root = root
        self.store = store
        self.meta_settings = meta_settings or {}  # MetaConfig values (the root directory's layout, timeouts)
        self.client_settings = client_settings or {}  # ClientConfig values of every client (fsapi.open_fs)
        self.logs = root / "logs"
        self.logs.mkdir(parents=True)
        self.meta_addresses = [f"tcp://127.0.0.1:{free_port()}" for _ in range(metas)]
        self.node_addresses = {i: f"tcp://127.0.0.1:{free_port()}" for i in range(1, nodes + 1)}
        self.procs: dict[str, subprocess.Popen] = {}
        self.postgres: LocalPostgres | None = None
        # excuse ERROR lines for the rig's whole life (its fixture sets them), or during the running test only
        self.expected_log_patterns: list[str] = []
        self.test_log_patterns: list[str] = []
        self._log_checked: dict[str, int] = {}
        self.untested_bad: list[str] = []  # unexpected lines logged between tests: fail the teardown

    @property
    def meta_address(self) -> str:
        return self.meta_addresses[0]

    def up(self) -> None:
        settings = {}
        if self.store == "postgresql":
            self.postgres = LocalPostgres(choose_dir(self.root), free_port())
            self.postgres.init()
            self.postgres.start()
            settings = {"store": "postgresql", "dsn": self.postgres.dsn}
        for i, address in enumerate(self.meta_addresses):
            d = self.root / f"meta{i + 1}"
            d.mkdir()
            # the trash is off unless a rig turns it on: the other tests check what a removal frees, at once
            meta = cfg.MetaConfig(**{"stripe_count": min(4, len(self.node_addresses)), "redundancy": "replicas=2",
                                     "trash_keep_s": 0.0, **self.meta_settings, "listen": address, "data_dir": str(d), "metrics": "", **settings})
            (d / "metad.toml").write_text(cfg.dumps(meta))
            self._spawn(f"meta{i + 1}", ["meta", "--config", str(d / "metad.toml")])
            if i == 0:  # the first creates the schema; the others find it
                trio.run(self._wait_pings, [(f"meta{i + 1}", address)])
        for node_id, address in self.node_addresses.items():
            d = self.root / f"storage-{node_id}"
            (d / "data").mkdir(parents=True)
            sc = cfg.StorageConfig(node_id=node_id, listen=address, data_dir=str(d / "data"), meta=self.meta_addresses,
                                   host=f"local-{node_id}", heartbeat_interval_s=1.0, metrics="")
            (d / "storage.toml").write_text(cfg.dumps(sc))
            self._start_node(node_id)
        trio.run(self._wait_ready)

    def _start_node(self, node_id: int) -> None:
        self._spawn(f"storage-{node_id}", ["storage", "--config", str(self.root / f"storage-{node_id}" / "storage.toml")])

    def kill_node(self, node_id: int) -> None:
        proc = self.procs[f"storage-{node_id}"]
        proc.kill()
        proc.wait(10)

    async def restart(self) -> None:
        """Start every storage node that is not running; return once all are up at every daemon."""
        for node_id in self.node_addresses:
            if self.procs[f"storage-{node_id}"].poll() is not None:
                self._start_node(node_id)
        await self._wait_ready()

    def _spawn(self, name: str, args: list[str]) -> None:
        with open(self.logs / f"{name}.log", "ab") as log:
            self.procs[name] = subprocess.Popen([sys.executable, "-m", "stripefs", *args], stdin=subprocess.DEVNULL,
                                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    async def _wait_pings(self, targets: list[tuple[str, str]], deadline: float | None = None) -> None:
        deadline = deadline or time.monotonic() + 60
        ctx = zmq.Context()
        try:
            for name, address in targets:
                async with connect(ctx, address, timeout=0.5) as client:
                    while True:
                        if self.procs[name].poll() is not None:
                            raise RuntimeError(f"{name} exited at start:\n{(self.logs / f'{name}.log').read_text()}")
                        if time.monotonic() > deadline:
                            raise RuntimeError(f"{name} did not answer at {address}")
                        try:
                            await client.call(P.PingReq())
                            break
                        except StripefsError:
                            await trio.sleep(0.05)
        finally:
            ctx.destroy(linger=0)

    async def _wait_ready(self) -> None:
        """Every process answers a ping, and every node is up at every daemon."""
        deadline = time.monotonic() + 60
        metas = [(f"meta{i + 1}", a) for i, a in enumerate(self.meta_addresses)]
        await self._wait_pings(metas + [(f"storage-{i}", a) for i, a in self.node_addresses.items()], deadline)
        ctx = zmq.Context()
        try:
            for _, address in metas:
                async with connect(ctx, address, timeout=2) as meta:
                    while True:
                        rsp, _ = await meta.call(P.StatusReq())
                        if set(self.node_addresses) <= {n.node_id for n in rsp.nodes if n.state == "up"}:
                            break
                        if time.monotonic() > deadline:
                            raise RuntimeError(f"storage nodes did not register with {address} in time")
                        await trio.sleep(0.05)
        finally:
            ctx.destroy(linger=0)

    def down(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        if self.postgres is not None:
            self.postgres.remove()

    # ------------------------------------------------------------------ logs

    def expect_log(self, *patterns: str) -> None:
        """Excuse ERROR lines matching any of ``patterns`` logged during the running test."""
        self.test_log_patterns += patterns

    def new_bad_lines(self, patterns: list[str]) -> list[str]:
        """Unexpected lines logged since the last call (a line being written is left for the next)."""
        bad = []
        for path in sorted(self.logs.glob("*.log")):
            with open(path, "rb") as f:
                f.seek(self._log_checked.get(path.name, 0))
                data = f.read()
            data = data[: data.rfind(b"\n") + 1]
            self._log_checked[path.name] = self._log_checked.get(path.name, 0) + len(data)
            for line in data.decode(errors="replace").splitlines():
                if BAD_LOG_LINE.search(line) and not any(re.search(p, line) for p in patterns + self.expected_log_patterns):
                    bad.append(f"{path.name}: {line}")
        return bad

    def print_logs(self) -> None:
        for path in sorted(self.logs.glob("*.log")):
            print(f"\n===== {path.name} =====\n{path.read_text(errors='replace')[-20000:]}")


def run_rig(request, store: str = "sqlite", metas: int = 1, *, expected_log_patterns: tuple[str, ...] = (), **settings):
    """The body of a rig fixture (``yield from``): up, then always down, its logs printed when a test
    failed; ``settings``: Rig's (nodes, meta_settings, client_settings)."""
    root = Path(tempfile.mkdtemp(prefix=f"stripefs-inprocess-{store}-"))
    rig = Rig(root, store=store, metas=metas, **settings)
    rig.expected_log_patterns += expected_log_patterns
    try:
        rig.up()
        yield rig
    finally:
        failed = request.session.testsfailed
        rig.down()
        if failed:
            rig.print_logs()
    bad = rig.untested_bad + rig.new_bad_lines([])
    shutil.rmtree(root, ignore_errors=True)
    assert not bad, "unexpected ERROR lines in process logs outside any test:\n" + "\n".join(bad[:30])


@pytest.fixture(scope="session")
def sqlite_rig(request):
    yield from run_rig(request, "sqlite", 1)


@pytest.fixture(scope="session")
def pg_rig(request):
    """Metadata on a throwaway PostgreSQL server, two metadata daemons; clients talk to the first."""
    yield from run_rig(request, "postgresql", 2)


@pytest.fixture
def rig(sqlite_rig) -> Rig:
    """The rig a test runs on: SQLite, unless its module asks for both (``both_stores``)."""
    return sqlite_rig


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.pg_rig)])
def both_stores(request) -> Rig:
    """Override a module's ``rig`` with this one (test_posix_ops.py): each of its tests runs on both stores."""
    return request.getfixturevalue("sqlite_rig" if request.param == "sqlite" else "pg_rig")


def pytest_configure(config):
    configure(config)  # tests/util.py: under pytest-xdist, ports of this worker's own; the warm_caches mark
    config.addinivalue_line("markers", "pg_rig: the test runs on the PostgreSQL rig (run last: pytest_collection_modifyitems)")
    config.addinivalue_line("markers", "per_open: the test is about per-open handles (OPEN, RELEASE): its ``fs`` "
                                       "has per_open_handles on, whatever the default or STRIPEFS_TEST_MOUNT_OPTIONS say")


#: handed to pytest-xdist workers first (loadgroup scheduling hands out units in collection order): the
#: longest test (~60 s of the tier's ~80 s run one at a time), so that it never starts last
FIRST = ["test_data_ops.py::test_thousands_of_small_files"]


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own, which reads the xdist_group marks
def pytest_collection_modifyitems(session, config, items):
    """Tests on the PostgreSQL rig run last, so that its server and daemons are up only while they run
    (a session fixture is torn down at the end of the session, not after its last user).

    Under pytest-xdist (the Makefile: ``-n 2 --dist loadgroup --no-loadscope-reorder``) every worker
    has its own session rigs, units of work go whole to one worker in this order, and a unit is a
    test, except: the tests on the PostgreSQL rig are one unit (one worker starts that rig, last),
    and so are a module's tests on a rig of the module's own (test_erasure_ops.py's 6 nodes)."""
    def on_pg(item) -> bool:
        return item.get_closest_marker("pg_rig") is not None or "pg_rig" in getattr(item, "fixturenames", ())

    def rank(item) -> int:
        if on_pg(item):
            return 2
        return 0 if item.nodeid.split("/")[-1].split("[")[0] in FIRST else 1

    items.sort(key=rank)  # stable: the rest keep their order
    for item in items:
        if on_pg(item):
            item.add_marker(pytest.mark.xdist_group("pg_rig"))
        elif any(fixture in getattr(item, "fixturenames", ()) for fixture in MODULE_RIGS):
            item.add_marker(pytest.mark.xdist_group(item.path.name))


#: rig fixtures of a module's own (module scope): that module's tests are one unit of pytest-xdist's work
MODULE_RIGS = ("ec_rig", "trash_rig")


class _ClientErrors(logging.Handler):
    """ERROR records this process's client logs during a test."""

    def __init__(self):
        super().__init__(logging.ERROR)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"client: {record.name} {record.levelname} {record.getMessage()}")


@pytest.fixture
async def fs(rig, request, monkeypatch):
    """An ``Operations`` on a fresh client of ``rig``, and a fresh directory for the test (``fs.dir``)."""
    kernel = Kernel(monkeypatch)
    errors = _ClientErrors()
    logging.getLogger("stripefs").addHandler(errors)
    rig.test_log_patterns.clear()
    rig.untested_bad += rig.new_bad_lines([])  # logged before this test: not its doing, but checked at teardown
    try:
        settings = {"per_open_handles": True} if request.node.get_closest_marker("per_open") else {}
        async with open_fs(rig, kernel, f"inprocess:{request.node.name}", **settings) as fs:
            fs.dir_name = re.sub(r"[^A-Za-z0-9_]", "_", request.node.name).encode()
            fs.dir = await fs.mkdir(ROOT_ID, fs.dir_name)
            yield fs
    finally:
        logging.getLogger("stripefs").removeHandler(errors)
    patterns = rig.test_log_patterns
    excused = patterns + rig.expected_log_patterns
    bad = [line for line in errors.lines if not any(re.search(p, line) for p in excused)] + rig.new_bad_lines(patterns)
    rig.test_log_patterns = []
    if bad:
        pytest.fail("unexpected ERROR lines during this test (declare the expected ones with fs.rig.expect_log):\n"
                    + "\n".join(bad[:30]), pytrace=False)
