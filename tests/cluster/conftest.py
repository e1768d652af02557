"""A real cluster for the cluster tests: metadata daemon, 4 storage nodes, a FUSE mount.

Processes are started by the same launcher users run (``stripefs local up``),
in a tmp dir, on free ports. The session fixture waits for pings (never a
sleep), offers ``kill_node``/``restart_node``/``kill_meta``, and on teardown
unmounts (lazily if busy), stops every process (TERM, then KILL) and prints
every process's log if a test failed. Logs are assertions: an ERROR line or a
traceback in any log not declared expected fails the session.
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
from contextlib import contextmanager
from pathlib import Path

import pytest

from stripefs.local_cluster import LocalCluster, _alive, _is_mounted

REPO = Path(__file__).resolve().parents[2]


def run_cli(*args: str, check: bool = True, **kw) -> subprocess.CompletedProcess:
    res = subprocess.run([sys.executable, "-m", "stripefs", *args], capture_output=True, text=True, timeout=120, **kw)
    if check and res.returncode:
        raise AssertionError(f"stripefs {' '.join(args)} exited {res.returncode}:\n{res.stdout}\n{res.stderr}")
    return res


class Cluster:
    def __init__(self, root: Path, nodes: int = 4, up_args: tuple[str, ...] = ()):
        self.root = root
        self.up_args = up_args
        self.state = root / "state"
        self.mnt = root / "mnt"
        self.nodes = nodes
        self.local = LocalCluster(self.state)
        self.extra_mounts: list[Path] = []
        self.expected_log_patterns: list[str] = []

    def up(self) -> None:
        run_cli("local", "up", "--dir", str(self.state), "--mount", str(self.mnt), "--nodes", str(self.nodes), "-o", "allow_other",
                *self.up_args)

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
                "--pidfile", str(self.state / f"{name}.pid"), "-o", ",".join(filter(None, ["allow_other", options])))
        self.extra_mounts.append(mnt)
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

    def bad_log_lines(self) -> list[str]:
        bad = []
        for name, text in self.logs().items():
            for line in text.splitlines():
                if re.search(r" (ERROR|CRITICAL) |Traceback", line) and not any(re.search(pat, line) for pat in self.expected_log_patterns):
                    bad.append(f"{name}: {line}")
        return bad

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
    its logs printed when a test failed; any unexpected ERROR line fails the run."""
    try:
        c.up()
        if after_up is not None:
            after_up(c)
        yield c
    finally:
        failed = request.session.testsfailed
        c.teardown()
        if failed:
            for name, text in c.logs().items():
                print(f"\n===== {label}{name} =====\n{text[-20000:]}")
    bad = c.bad_log_lines()
    if not any(_is_mounted(m) for m in [c.mnt, *c.extra_mounts]):
        shutil.rmtree(c.root, ignore_errors=True)
    assert not bad, "unexpected ERROR lines in process logs:\n" + "\n".join(bad[:30])


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
