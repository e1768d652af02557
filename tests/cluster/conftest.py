"""A real cluster for the cluster tests: metadata daemon, 4 storage nodes, a FUSE mount.

Processes are started by the same launcher users run (``stripefs local up``),
in a tmp dir, on free ports. The session fixture waits for pings (never a
sleep), offers ``kill_node``/``kill_meta``/``restart``, and on teardown
unmounts (lazily if busy), stops every process (TERM, then KILL) and prints
every process's log if a test failed.

Logs are assertions, checked per test: an autouse fixture notes where each log
of every cluster fixture ends before a test, and after it reads only what was
logged during the test. An ERROR/CRITICAL line or a traceback there fails that
test (an error at its teardown, with the lines) unless a pattern excuses it:
one the test declared with ``cluster.expect_log(r"...")`` (forgotten after the
test), or one of the cluster's own ``expected_log_patterns``, which a fixture
sets for a cluster it owns, for the cluster's whole life. What is logged
outside any test (start-up, background work between tests, shutdown) is
checked against the cluster's own patterns only, when the cluster is torn down.

``drop_caches()`` makes the next read cold (and fails the test if it cannot).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import msgspec
import pytest

from stripefs.client import metrics as client_metrics
from stripefs.common import config as cfg
from stripefs.local_cluster import LocalCluster, _alive, _is_mounted
from util import configure, drop_caches  # noqa: F401  (the tests import drop_caches from here too)

REPO = Path(__file__).resolve().parents[2]


def run_cli(*args: str, check: bool = True, **kw) -> subprocess.CompletedProcess:
    res = subprocess.run([sys.executable, "-m", "stripefs", *args], capture_output=True, text=True, timeout=120, **kw)
    if check and res.returncode:
        raise AssertionError(f"stripefs {' '.join(args)} exited {res.returncode}:\n{res.stdout}\n{res.stderr}")
    return res


def _feed_followed(mnt: Path, within: float = 20.0) -> None:
    """Return once the mount at ``mnt`` follows the change feed (``stripefs_change_feed_healthy``), or
    after ``within``. Until then it keeps nothing long in the kernel and asks no callbacks
    (client/kernel_cache.py), so a test counting requests from its first stat would count the ones a
    late subscription costs. The mount waits 2 s for it itself (client/mount.py); a loaded machine
    can take longer. A mount with no metrics address, or one that never follows, is left as it is."""
    state = client_metrics.find_state(mnt)
    if not state or not state.get("metrics"):
        return
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://{state['metrics']}/metrics", timeout=5) as rsp:
                if re.search(rb"^stripefs_change_feed_healthy 1(\.0)?$", rsp.read(), re.M):
                    return
        except OSError:
            pass
        time.sleep(0.05)


def _env_mount_options() -> list[str]:
    """``-o`` options every mount of these tests gets from STRIPEFS_TEST_MOUNT_OPTIONS (e.g.
    ``per_open_handles=no``: a suite on the no-open default mount)."""
    opts = os.environ.get("STRIPEFS_TEST_MOUNT_OPTIONS", "")
    return ["-o", opts] if opts else []


def client_config(path: Path, **settings) -> Path:
    """A mount's config file (for ``-o config=PATH``): the defaults, with ``settings`` put in."""
    path.write_text(cfg.dumps(msgspec.structs.replace(cfg.ClientConfig(), **settings)))
    return path


BAD_LOG_LINE = re.compile(r" (ERROR|CRITICAL) |Traceback")

# clusters that are up (run_cluster): the per-test log check marks their logs before every test
_live_clusters: list["Cluster"] = []


class Cluster:
    def __init__(self, root: Path, nodes: int = 4, up_args: tuple[str, ...] = ()):
        self.root = root
        self.up_args = up_args
        self.state = root / "state"
        self.mnt = root / "mnt"
        self.nodes = nodes
        self.local = LocalCluster(self.state)
        self.extra_mounts: list[Path] = []
        # excuse ERROR lines for the cluster's whole life: set by the fixture that owns the cluster
        self.expected_log_patterns: list[str] = []
        # excuse ERROR lines logged during the running test only (expect_log); cleared after it
        self.test_log_patterns: list[str] = []
        self._log_checked: dict[str, int] = {}  # log file name -> bytes already checked
        self._untested_bad: list[str] = []  # unexpected lines logged outside any test, reported at teardown

    def up(self) -> None:
        # the trash is off unless a test turns it on: the other tests check what a removal frees, at once
        trash = () if any("trash_keep_s" in a for a in self.up_args) else ("--set", "meta.trash_keep_s=0")
        run_cli("local", "up", "--dir", str(self.state), "--mount", str(self.mnt), "--nodes", str(self.nodes), "-o", "allow_other",
                *_env_mount_options(), *trash, *self.up_args)

    @property
    def meta_address(self) -> str:
        return self.local.meta_address

    def pids(self) -> dict:
        return self.local.pids()

    def kill_node(self, node_id: int, sig: int = signal.SIGKILL) -> None:
        pid = self.pids()["storage"][str(node_id)]
        os.kill(pid, sig)
        _wait_dead(pid)

    def kill_meta(self, sig: int = signal.SIGKILL) -> None:
        pid = self.pids()["meta"]
        os.kill(pid, sig)
        _wait_dead(pid)

    def restart(self) -> None:
        """Start whatever is not running (the launcher's own restart path)."""
        self.up()

    def mount_again(self, name: str, options: str = "", meta: str = "") -> Path:
        """Another mount of the cluster (``meta``: its metadata address list; default the first daemon)."""
        mnt = self.root / name
        mnt.mkdir(exist_ok=True)
        run_cli("mount", meta or self.meta_address, str(mnt), "--log", str(self.state / "logs" / f"{name}.log"),
                "--pidfile", str(self.state / f"{name}.pid"),
                *_env_mount_options(), "-o", ",".join(filter(None, ["allow_other", options])))  # (the test's win)
        self.extra_mounts.append(mnt)
        _feed_followed(mnt)
        return mnt

    def unmount(self, mnt: Path) -> None:
        subprocess.run(["fusermount3", "-u", str(mnt)], capture_output=True)
        if _is_mounted(mnt):
            subprocess.run(["fusermount3", "-u", "-z", str(mnt)], capture_output=True)
        pidfile = self.state / f"{mnt.name}.pid"
        if pidfile.exists():
            pid = int(pidfile.read_text())
            _wait_dead(pid, timeout=10, kill=True)

    def logs(self) -> dict[str, str]:
        return {p.name: p.read_text(errors="replace") for p in sorted((self.state / "logs").glob("*.log"))}

    def expect_log(self, *patterns: str) -> None:
        """Excuse ERROR lines matching any of ``patterns`` (regular expressions) logged
        during the running test; forgotten when the test ends."""
        self.test_log_patterns += patterns

    def bad_log_lines(self) -> list[str]:
        """Every unexpected ERROR line in every log, from the start (the cluster's own patterns only)."""
        return self._scan({}, self.expected_log_patterns)[0]

    def _scan(self, start: dict[str, int], patterns: list[str]) -> tuple[list[str], dict[str, int]]:
        """Unexpected lines in each log after ``start[name]`` bytes, and where the scan stopped:
        after the last complete line (one being written is left for the next scan)."""
        bad, ends = [], {}
        for path in sorted((self.state / "logs").glob("*.log")):
            with open(path, "rb") as f:
                offset = start.get(path.name, 0)
                if offset > os.fstat(f.fileno()).st_size:  # truncated or replaced: read it all
                    offset = 0
                f.seek(offset)
                data = f.read()
            data = data[: data.rfind(b"\n") + 1]
            ends[path.name] = offset + len(data)
            for line in data.decode(errors="replace").splitlines():
                if BAD_LOG_LINE.search(line) and not any(re.search(pat, line) for pat in patterns):
                    bad.append(f"{path.name}: {line}")
        return bad, ends

    def begin_test(self) -> None:
        """Before a test: what was logged since the last check was logged between tests (its
        unexpected lines fail the cluster's teardown); the test's own lines start here."""
        self.test_log_patterns.clear()
        bad, self._log_checked = self._scan(self._log_checked, self.expected_log_patterns)
        self._untested_bad += bad

    def end_test(self) -> list[str]:
        """After a test: unexpected lines it logged, excused by its own and the cluster's patterns."""
        try:
            bad, self._log_checked = self._scan(self._log_checked, self.expected_log_patterns + self.test_log_patterns)
        finally:
            self.test_log_patterns.clear()
        return bad

    def untested_bad_log_lines(self) -> list[str]:
        """Unexpected lines logged outside any test (the cluster's own patterns only)."""
        return self._untested_bad + self._scan(self._log_checked, self.expected_log_patterns)[0]

    def teardown(self) -> None:
        for mnt in self.extra_mounts:
            self.unmount(mnt)
        if self.local.info_path.exists():
            try:
                self.local.down()
            finally:
                if _is_mounted(self.mnt):
                    subprocess.run(["fusermount3", "-u", "-z", str(self.mnt)], capture_output=True)
                for _, pid in self.local._flat_pids(self.pids()):
                    _wait_dead(pid, timeout=0, kill=True)


def sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True)


@contextmanager
def veth_namespace(ns: str, subnet: str, tag: str):
    """Network namespace ``ns`` joined to this one by a veth pair: SUBNET.1 here, SUBNET.2 in it.

    Yields the host side's interface name (``{tag}h{pid}``); the pair and the namespace are
    removed on the way out, whatever happened."""
    host_if, ns_if = f"{tag}h{os.getpid() % 100000}", f"{tag}n{os.getpid() % 100000}"
    try:
        sh("ip", "netns", "add", ns)
        sh("ip", "link", "add", host_if, "type", "veth", "peer", "name", ns_if)
        sh("ip", "link", "set", ns_if, "netns", ns)
        sh("ip", "addr", "add", f"{subnet}.1/30", "dev", host_if)
        sh("ip", "link", "set", host_if, "up")
        sh("ip", "netns", "exec", ns, "ip", "addr", "add", f"{subnet}.2/30", "dev", ns_if)
        sh("ip", "netns", "exec", ns, "ip", "link", "set", ns_if, "up")
        sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
        yield host_if
    finally:
        subprocess.run(["ip", "link", "del", host_if], capture_output=True)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def _wait_dead(pid: int, timeout: float = 10, kill: bool = False) -> None:
    deadline = time.monotonic() + timeout
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    if _alive(pid) and kill:
        os.kill(pid, signal.SIGKILL)
        while _alive(pid):
            time.sleep(0.02)
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def cluster_root(prefix: str) -> Path:
    """A directory for a cluster. Not under pytest's tmp dir: that is 0700, and
    the permission tests need other users to reach the mountpoint."""
    root = Path(tempfile.mkdtemp(prefix=prefix))
    root.chmod(0o755)
    return root


def run_cluster(request, c: "Cluster", *, after_up=None, label: str = ""):
    """The body of a cluster fixture (``yield from``): up, then always torn down;
    its logs printed when a test failed. Its logs are checked per test (``check_logs``);
    an unexpected ERROR line logged outside any test fails the teardown."""
    _live_clusters.append(c)
    try:
        c.up()
        if after_up is not None:
            after_up(c)
        yield c
    finally:
        _live_clusters.remove(c)
        failed = request.session.testsfailed
        c.teardown()
        if failed:
            for name, text in c.logs().items():
                print(f"\n===== {label}{name} =====\n{text[-20000:]}")
    bad = c.untested_bad_log_lines()
    if not any(_is_mounted(m) for m in [c.mnt, *c.extra_mounts]):
        shutil.rmtree(c.root, ignore_errors=True)
    assert not bad, f"unexpected ERROR lines in {label}process logs outside any test:\n" + "\n".join(bad[:30])


def pytest_configure(config):
    configure(config)  # tests/util.py: under pytest-xdist, ports of this worker's own; the warm_caches mark
    config.addinivalue_line("markers", "pg_cluster: the test uses pg_cluster (run last: see pytest_collection_modifyitems)")


#: the order in which files are handed to pytest-xdist workers: the longest first (seconds, run one at a
#: time on a 2-core machine), so that no worker starts a long one while the others run out of work.
#: PG_GROUP: every test on pg_cluster (below). Files not named here go last.
PG_GROUP = "pg_cluster"
LONGEST_FIRST = [
    "test_healing.py",  # 90
    "test_datapath_model.py",  # 88
    "test_tier.py",  # 45
    "test_cli.py",  # 41
    "test_failures.py",  # 37
    "test_fuzz.py",  # 36
    "test_erasure.py",  # 33
    "test_kernel_cache.py",  # 28
    "test_data.py",  # 24
    "test_operator.py",  # 23
    "test_ops.py",  # 22
    "test_secure_cluster.py",  # 35
    "test_csi.py",  # 25
    "test_write_errors.py",  # 19
    PG_GROUP,  # 70: test_multi_meta.py, test_pg_multi.py, test_posix.py[postgresql]; short files follow it
    "test_backup.py",  # 12
    "test_quota.py",  # 8
    "test_deploy.py",  # 4
    "test_posix.py",  # 2
    "test_write_path.py",  # 2
    "test_names.py",  # 2
]


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own, which reads the xdist_group marks
def pytest_collection_modifyitems(session, config, items):
    """The order of the files (``LONGEST_FIRST``), and what pytest-xdist keeps together on one worker.

    The Makefile runs this tier with ``-n 2 --dist loadgroup --no-loadscope-reorder``: every worker has
    its own session clusters, a unit of work goes whole to one worker, and units are handed out in
    this order. A unit is a file (its module-scoped clusters and mounts start once), except the
    tests on ``pg_cluster``: one unit of their own (``xdist_group`` marks), so that one worker
    starts that cluster, as late as it can.

    A session fixture is torn down at the end of the session, not after its last user: started by
    the first of them, the PostgreSQL cluster would otherwise run through every file after it. Idle,
    its two metadata daemons poll the shared database (change feed, duties lease) and with
    PostgreSQL take about 0.6 of a core: a third of a 2-core CI machine, taken from every other
    test. So its unit comes after the long files, and only short ones follow it (to keep the other
    worker busy meanwhile). A test gets there by asking for ``pg_cluster`` or by the ``pg_cluster``
    mark (a fixture that picks the cluster at run time, like test_posix.py's ``mnt``, marks its parameter)."""
    def on_pg(item) -> bool:
        return "pg_cluster" in getattr(item, "fixturenames", ()) or item.get_closest_marker("pg_cluster") is not None

    def unit(item) -> str:
        return PG_GROUP if on_pg(item) else item.path.name

    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(unit(item), len(rank)))  # stable: a file's own order stays
    for item in items:
        item.add_marker(pytest.mark.xdist_group(unit(item)))


@pytest.fixture(autouse=True)
def check_logs(request):
    """Fail the test (at its teardown) on ERROR lines it made a cluster it uses log, unless
    the test declared them (``cluster.expect_log``) or the cluster's fixture did."""
    marked = list(_live_clusters)  # every cluster fixture a test uses is up before this runs (wider scope)
    for c in marked:
        c.begin_test()
    yield
    used = [c for c in marked if any(v is c for v in request.node.funcargs.values())]
    bad = [line for c in used for line in c.end_test()]
    for c in marked:
        c.test_log_patterns.clear()
    if bad:
        pytest.fail("unexpected ERROR lines in process logs during this test "
                    "(declare the expected ones with cluster.expect_log):\n" + "\n".join(bad[:30]), pytrace=False)


@pytest.fixture(scope="session")
def cluster(request):
    yield from run_cluster(request, Cluster(cluster_root("stripefs-cluster-")))


@pytest.fixture(scope="session")
def pg_cluster(request):
    """Metadata on a throwaway PostgreSQL server, two metadata daemons, 3 storage nodes; the mount knows both daemons."""
    yield from run_cluster(
        request,
        Cluster(cluster_root("stripefs-pg-cluster-"), nodes=3, up_args=("--meta-store", "postgresql", "--metas", "2")),
        label="pg: ",
    )


@pytest.fixture
def mnt(cluster, request) -> Path:
    """A fresh directory inside the mount for one test."""
    d = cluster.mnt / re.sub(r"[^A-Za-z0-9_]", "_", request.node.name)
    d.mkdir()
    return d
