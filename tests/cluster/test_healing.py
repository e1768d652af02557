"""Self-healing on a real cluster: re-replication, stale copies, scrub, leases, drain/remove, fsck.

A cluster of its own (the shared one keeps default timeouts), with short
timeouts and small chunks set through ``stripefs local up --set`` (the mount's
through its config file). The tests run in file order and share it: node 2
dies and comes back, node 3 is drained and removed. Every wait is a poll with
a generous deadline, never a timed assertion.
"""

from __future__ import annotations

import collections
import ctypes
import hashlib
import json
import os
import random
import re
import shutil
import sys
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from stripefs.common.keyring import load_public, write_keypair
from stripefs.common.security import with_key

from conftest import Cluster, _wait_dead, client_config, cluster_root, drop_caches, run_cli, run_cluster, sh, veth_namespace

_libc = ctypes.CDLL(None, use_errno=True)
KiB, MiB = 1 << 10, 1 << 20
CHUNK = 256 * KiB

from util import free_port as _free_port  # noqa: E402  (below the ephemeral range: tests/util.py)


META_PORT = _free_port()
SETTINGS = [
    f"meta.listen=tcp://0.0.0.0:{META_PORT}",  # reachable from the partition test's network namespace
    "meta.node_timeout_s=3",
    "meta.node_suspect_s=1.5",
    "meta.session_lease_s=4",
    "meta.repair_bandwidth=0",
    "meta.repair_scan_interval_s=5",
    "meta.trash_keep_s=0",  # removals free at once: what the orphan and collector tests count
    f"meta.chunk_size={CHUNK}",
    "storage.scrub_interval_s=3600",
    "storage.heartbeat_interval_s=0.5",
]


class HealCluster(Cluster):
    def up(self) -> None:
        # the mount's config: short timeouts here too, a request to a killed node is given up after 4 s
        # (default 10 s; test_node_killed_under_a_write_and_a_read_stream waits it out)
        client_toml = client_config(self.root / "client.toml", rpc_timeout_s=4.0)
        # --secure: the daemon listens beyond loopback (for the partition test), which needs CURVE
        args = ["local", "up", "--dir", str(self.state), "--mount", str(self.mnt), "--nodes", str(self.nodes), "-o", "allow_other",
                "-o", f"config={client_toml}", "--secure"]
        for s in SETTINGS:
            args += ["--set", s]
        run_cli(*args)

    def status(self) -> dict:
        return json.loads(run_cli("status", "--dir", str(self.state), "--json").stdout)

    def node(self, node_id: int) -> dict:
        return next(n for n in self.status()["nodes"] if n["node_id"] == node_id)

    def data_dir(self, node_id: int) -> Path:
        return self.state / f"storage-{node_id}" / "data" / "chunks"

    def chunk_files(self, node_id: int | None = None, ino: int | None = None) -> list[Path]:
        ids = [node_id] if node_id else [int(p.name.split("-")[1]) for p in self.state.glob("storage-*")]
        out = []
        for i in ids:
            pattern = f"{ino}-*.chunk" if ino else "*.chunk"
            out += sorted(self.data_dir(i).glob(f"*/*/{pattern}"))
        return out


#: what _full_redundancy saw last: a timed-out wait says what was still missing
_LAST_REDUNDANCY: dict = {}


def wait_for(what: str, check, timeout: float = 90.0, interval: float = 0.3):
    deadline = time.monotonic() + timeout
    last = None
    _LAST_REDUNDANCY.clear()
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(interval)
    seen = f"; redundancy last seen: {_LAST_REDUNDANCY}" if _LAST_REDUNDANCY else ""
    raise AssertionError(f"timed out waiting for {what} (last: {last!r}){seen}")


@pytest.fixture(scope="module")
def heal(request):
    c = HealCluster(cluster_root("stripefs-heal-"))
    c.expected_log_patterns += [r"no copy could be read", r"not answering", r"failed"]
    # admin commands given a path in the mount, and extra mounts, use the cluster's admin key (docs/security.md)
    def use_admin_key(c):
        os.environ["STRIPEFS_KEY"] = str(c.state / "keys" / "admin.key_secret")

    try:
        yield from run_cluster(request, c, after_up=use_admin_key, label="heal ")
    finally:
        os.environ.pop("STRIPEFS_KEY", None)


def _populate(d: Path, n: int, seed: int) -> dict[str, str]:
    rng = random.Random(seed)
    d.mkdir(exist_ok=True)
    sums = {}
    for i in range(n):
        data = rng.randbytes(rng.choice([3000, 200 * KiB, 700 * KiB]))
        (d / f"f{i}").write_bytes(data)
        sums[f"f{i}"] = hashlib.sha256(data).hexdigest()
    return sums


def _check(d: Path, sums: dict[str, str]) -> None:
    for name, digest in sums.items():
        assert hashlib.sha256((d / name).read_bytes()).hexdigest() == digest, name


def _full_redundancy(heal: HealCluster):
    st = heal.status()
    _LAST_REDUNDANCY.update(under_replicated=st["under_replicated"], repair=st["repair"],
                            nodes={n["node_id"]: n["state"] for n in st["nodes"]})
    return st if st["under_replicated"] == 0 and st["repair"]["backlog"] == 0 else None


def _story_of(heal: HealCluster, ino: int, victim: int) -> str:
    """The chunk rows of ``ino`` and of every chunk on node ``victim`` (read from the daemon's SQLite
    database), and every log line naming ``ino`` or a lost chunk: what a failed redundancy wait
    needs to be understood from a CI log."""
    import sqlite3

    lines = []
    con = sqlite3.connect(f"file:{heal.state / 'meta' / 'meta.sqlite3'}?mode=ro", uri=True, timeout=5)
    try:
        rows = con.execute("SELECT c.ino, c.idx, c.version, c.nodes, i.redundancy FROM chunks c JOIN inodes i USING (ino)").fetchall()
    finally:
        con.close()
    lines += [f"row {r}" for r in rows if r[0] == ino or str(victim) in r[3].split(",")]
    pattern = re.compile(rf"(\b{ino}[:-]\d|inode {ino}\b|lost|reconstruct|degraded|moved to node)")
    for name, text in heal.logs().items():
        lines += [f"{name}: {line}" for line in text.splitlines() if pattern.search(line)][-60:]
    return "\n".join(lines)


FILES: dict[str, str] = {}


def test_node_down_is_rereplicated_and_data_reads_without_it(heal):
    d = heal.mnt / "a"
    FILES.update(_populate(d, 12, seed=1))
    assert heal.node(2)["placed_chunks"] > 0
    heal.kill_node(2)
    wait_for("node 2 declared down", lambda: heal.node(2)["state"] == "down")
    st = wait_for("full redundancy", lambda: _full_redundancy(heal))
    assert {n["node_id"]: n["placed_chunks"] for n in st["nodes"]}[2] == 0
    assert st["repair"]["copied"] > 0
    local = json.loads(run_cli("local", "status", "--dir", str(heal.state), "--json").stdout)
    assert local["under_replicated"] == 0
    text = run_cli("status", "--dir", str(heal.state)).stdout
    assert "redundancy  full" in text and "down" in text
    drop_caches()
    _check(d, FILES)
    assert "node 2 (" in heal.logs()["meta.log"] and "up -> suspect" in heal.logs()["meta.log"]


def test_returning_node_never_serves_stale_copies_and_they_are_collected(heal):
    d = heal.mnt / "a"
    old_on_2 = heal.chunk_files(2)
    assert old_on_2, "node 2 kept its old copies on disk"
    # while node 2 is down: overwrite half the files in place (new versions of the same chunks), delete a few
    rng = random.Random(2)
    for name in list(FILES)[:6]:
        data = rng.randbytes((d / name).stat().st_size)
        with open(d / name, "r+b") as f:
            f.write(data)
        FILES[name] = hashlib.sha256(data).hexdigest()
    for name in list(FILES)[6:8]:
        (d / name).unlink()
        del FILES[name]
    returned = time.time_ns()
    heal.restart()
    wait_for("node 2 up", lambda: heal.node(2)["state"] == "up")
    for _ in range(3):
        drop_caches()
        _check(d, FILES)

    def obsolete_left():  # every copy node 2 held is obsolete (repaired elsewhere, rewritten or deleted)
        left = []
        for path in old_on_2:
            try:
                if path.stat().st_mtime_ns < returned:  # not a fresh copy rebalance brought back
                    left.append(path)
            except FileNotFoundError:
                pass
        return left

    wait_for("node 2's obsolete copies deleted", lambda: not obsolete_left(), timeout=60)
    _check(d, FILES)


def test_node_killed_under_a_write_and_a_read_stream(heal):
    """kill -9 a storage node while a writer and a reader are half way: neither sees an error."""
    d = heal.mnt / "streams"
    d.mkdir()
    sources = {f"in{i}": random.Random(100 + i).randbytes(512 * KiB) for i in range(12)}
    for name, data in sources.items():
        (d / name).write_bytes(data)
    drop_caches()
    half_written, half_read, killed = threading.Event(), threading.Event(), threading.Event()
    errors: list[BaseException] = []
    big = random.Random(7).randbytes(6 * MiB)

    def writer():
        try:
            with open(d / "stream", "wb") as f:
                for pos in range(0, len(big), 64 * KiB):
                    if pos == 2 * MiB:
                        half_written.set()
                        killed.wait(60)
                    f.write(big[pos : pos + 64 * KiB])
        except BaseException as exc:  # noqa: BLE001 - the test reports it
            errors.append(exc)

    def reader():
        try:
            for i, (name, data) in enumerate(sources.items()):
                if i == 4:
                    half_read.set()
                    killed.wait(60)
                assert (d / name).read_bytes() == data, name
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=writer), threading.Thread(target=reader)]
    for t in threads:
        t.start()
    assert half_written.wait(60) and half_read.wait(60)
    heal.kill_node(4)
    killed.set()
    for t in threads:
        t.join(180)
    assert not any(t.is_alive() for t in threads) and not errors, errors
    drop_caches()
    assert (d / "stream").read_bytes() == big
    wait_for("node 4 declared down", lambda: heal.node(4)["state"] == "down")
    wait_for("full redundancy without node 4", lambda: _full_redundancy(heal))
    drop_caches()
    assert (d / "stream").read_bytes() == big
    _check(heal.mnt / "a", FILES)
    heal.restart()
    wait_for("node 4 up", lambda: heal.node(4)["state"] == "up")


def _flip_bytes(path: Path) -> None:
    with open(path, "r+b") as f:
        f.seek(-100, os.SEEK_END)
        data = f.read(10)
        f.seek(-100, os.SEEK_END)
        f.write(bytes(b ^ 0xFF for b in data))


def test_corrupt_copies_are_found_and_repaired(heal):
    d = heal.mnt / "scrub"
    d.mkdir()
    sums = {}
    for i in range(3):
        data = random.Random(30 + i).randbytes(600 * KiB)
        (d / f"s{i}").write_bytes(data)
        sums[f"s{i}"] = hashlib.sha256(data).hexdigest()
    inos = [(d / f"s{i}").stat().st_ino for i in range(3)]
    # 1. on-demand scrub of a path finds a flipped byte and repairs it
    victim = heal.chunk_files(ino=inos[0])[0]
    _flip_bytes(victim)
    out = run_cli("scrub", "--now", str(d)).stdout
    assert "1 bad" in out, out
    wait_for("repair of the scrubbed copy", lambda: _full_redundancy(heal))
    assert "0 bad" in run_cli("scrub", "--now", str(d)).stdout
    # 2. the background scrub finds one on its own (started now instead of next week)
    victim = heal.chunk_files(ino=inos[1])[0]
    _flip_bytes(victim)
    assert "started on" in run_cli("scrub", "--dir", str(heal.state)).stdout
    wait_for("background scrub report", lambda: f"chunk {inos[1]}:" in heal.logs()["meta.log"])
    wait_for("repair of the background-scrubbed copy", lambda: _full_redundancy(heal))
    # 3. a client read hitting a bad copy gets good data, and the copy is repaired
    for victim in heal.chunk_files(ino=inos[2]):
        _flip_bytes(victim)
        break
    drop_caches()
    _check(d, sums)
    wait_for("scrub of everything is clean", lambda: "0 bad" in run_cli("scrub", "--now", "--dir", str(heal.state)).stdout)
    _check(d, sums)


def test_dead_client_leaks_nothing(heal):
    m2 = heal.mount_again("m2")
    d = m2 / "lease"
    d.mkdir()
    held = open(d / "unlinked", "wb")
    held.write(os.urandom(700 * KiB))
    held.flush()
    os.fsync(held.fileno())
    ino_unlinked = os.fstat(held.fileno()).st_ino
    os.unlink(d / "unlinked")
    partial = open(d / "uncommitted", "wb")
    partial.write(os.urandom(3 * CHUNK))
    partial.flush()
    # write the pages back (no fsync: nothing is committed); full chunks go to storage at once
    _libc.sync_file_range(partial.fileno(), ctypes.c_long(0), ctypes.c_long(0), 2)  # SYNC_FILE_RANGE_WRITE
    ino_partial = os.fstat(partial.fileno()).st_ino
    wait_for("uncommitted chunks on storage", lambda: len(heal.chunk_files(ino=ino_partial)) >= 4)
    assert heal.chunk_files(ino=ino_unlinked)
    pid = int((heal.state / "m2.pid").read_text())
    os.kill(pid, signal.SIGKILL)
    _wait_dead(pid)
    for f in (held, partial):
        try:
            f.close()
        except OSError:
            pass
    heal.unmount(m2)
    heal.extra_mounts.remove(m2)
    wait_for("the dead mount's chunks reclaimed",
             lambda: not heal.chunk_files(ino=ino_unlinked) and not heal.chunk_files(ino=ino_partial), timeout=60)
    log = heal.logs()["meta.log"]
    assert "expired" in log and "never committed" in log


def test_drain_then_remove(heal):
    d = heal.mnt / "single"
    d.mkdir()
    run_cli("layout", "set", str(d), "--replicas", "1")
    sums = _populate(d, 10, seed=5)
    assert heal.node(3)["placed_chunks"] > 0
    held = {name: open(d / name, "rb") for name in sums}  # opened before the drain: their chunk maps go stale
    refused = run_cli("node", "remove", "3", "--dir", str(heal.state), check=False)
    assert refused.returncode == 3 and "only live copy" in refused.stderr and "drain" in refused.stderr
    drained = run_cli("node", "drain", "3", "--dir", str(heal.state))
    assert "holds nothing" in drained.stdout
    assert heal.node(3)["placed_chunks"] == 0
    try:
        wait_for("node 3's moved copies deleted", lambda: not heal.chunk_files(3))
    except AssertionError:
        import sqlite3

        db = sqlite3.connect(heal.state / "meta" / "meta.sqlite3")
        left = [p.name for p in heal.chunk_files(3)]
        rows = {n: db.execute("SELECT * FROM chunks WHERE ino=? AND idx=?", n.split("-")[:2]).fetchall() for n in left}
        garbage = db.execute("SELECT * FROM garbage WHERE node_id=3").fetchall()
        raise AssertionError(f"left on node 3: {rows}; garbage for node 3: {garbage}")
    drop_caches()
    for name, f in held.items():  # the only copy moved while the file was open: the mount finds it again
        assert hashlib.sha256(f.read()).hexdigest() == sums[name], name
        f.close()
    _check(d, sums)
    _check(heal.mnt / "a", FILES)
    run_cli("node", "remove", "3", "--dir", str(heal.state))
    assert heal.node(3)["state"] == "removed"
    heal.kill_node(3, signal.SIGTERM)
    drop_caches()
    _check(d, sums)
    _check(heal.mnt / "a", FILES)
    (d / "new").write_bytes(b"x" * 100_000)
    assert (d / "new").read_bytes() == b"x" * 100_000
    # one copy each: the later tests kill nodes, and a rebalance may have moved these onto one of them
    # (CI: "lost: 1" after test_lost_fragments_are_reconstructed's kill, its own stripes all whole)
    shutil.rmtree(d)


def test_fsck_finds_and_repairs_an_orphan(heal):
    from stripefs.common.protocol import ChunkId
    from stripefs.storage_node.chunk_file import chunk_path, encode_header

    # clean first: copies the tests before left (a node killed under a write) are reclaimed in the background,
    # and writes nobody can commit any more (never-committed rows of files no session holds) by fsck --repair
    def clean() -> bool:
        if run_cli("fsck", "--dir", str(heal.state), check=False).returncode == 0:
            return True
        run_cli("fsck", "--repair", "--dir", str(heal.state), check=False)
        return False

    wait_for("fsck clean before the orphan", clean, timeout=60, interval=1.0)
    orphan = ChunkId(10**9, 0, 0)
    path = chunk_path(heal.data_dir(1).parent, orphan)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = os.urandom(5000)
    path.write_bytes(encode_header(orphan, 5, memoryview(data), 64 * KiB) + data)
    found = run_cli("fsck", "--dir", str(heal.state), check=False)
    assert found.returncode == 3 and "orphan copies (no file refers to them): 1" in found.stdout, found.stdout
    repaired = run_cli("fsck", "--repair", "--dir", str(heal.state), check=False)
    # the planted orphan is repaired; a copy that a background move is placing meanwhile (an earlier test's
    # repairs) may be reported too, "not repaired: placed there meanwhile or being copied", exit 3 (ci81)
    left = [line for line in repaired.stdout.splitlines() if "not repaired:" in line]
    assert repaired.returncode in (0, 3) and f"orphan copy {orphan.ino}:0:0 v5 on node 1" in repaired.stdout, repaired.stdout
    assert all("placed there meanwhile or being copied" in line and f"{orphan.ino}:" not in line for line in left), repaired.stdout
    wait_for("the orphan deleted", lambda: not path.exists(), timeout=30)
    wait_for("fsck clean after the repair", lambda: run_cli("fsck", "--dir", str(heal.state), check=False).returncode == 0,
             timeout=60, interval=1.0)


def test_restarted_daemon_does_not_repair_nodes_that_merely_have_not_registered_yet(heal):
    before = len(heal.logs()["meta.log"])
    heal.kill_meta()
    heal.restart()
    live = [n["node_id"] for n in heal.status()["nodes"] if n["state"] != "removed"]
    wait_for("every node registered again and full redundancy",
             lambda: all(heal.node(i)["state"] == "up" for i in live) and _full_redundancy(heal))
    time.sleep(4)  # past node_timeout_s: the grace is over, and still nothing to repair
    assert _full_redundancy(heal)
    after = heal.logs()["meta.log"][before:]
    assert "(repair, replacing" not in after and "dropped copies on gone node" not in after, after[-3000:]


def test_new_nodes_get_data_until_utilisation_is_even(heal):
    """Also with the mount up and holding every file (issue 36 item 2): files it read stay held under
    callbacks, and rebalance must move them (the mount follows), not drop every move as 'opened'."""
    d = heal.mnt / "rebalance"
    d.mkdir()
    for i in range(16):
        (d / f"r{i}").write_bytes(random.Random(60 + i).randbytes(1 * MiB))
    drop_caches()
    for i in range(16):  # read back, as an operator checking them: the mount now holds each one
        assert (d / f"r{i}").read_bytes() == random.Random(60 + i).randbytes(1 * MiB)
    before = len(heal.logs()["meta.log"])
    up = sum(n["state"] == "up" for n in heal.status()["nodes"])
    added = [int(re.search(r"storage node (\d+) started", run_cli("local", "add-node", "--dir", str(heal.state)).stdout)[1])
             for _ in range(2)]

    def balanced():
        st = heal.status()
        placed = [n["placed_chunks"] for n in st["nodes"] if n["state"] == "up"]
        mean = sum(placed) / len(placed)
        ok = len(placed) == up + 2 and all(abs(x - mean) <= 0.1 * mean for x in placed) and st["under_replicated"] == 0
        return ok or placed

    wait_for("utilisation within 10% of the mean", lambda: balanced() is True, timeout=120)
    placed = {n["node_id"]: n["placed_chunks"] for n in heal.status()["nodes"]}
    assert all(placed[n] > 0 for n in added), placed
    assert "dropped, the file was opened" not in heal.logs()["meta.log"][before:]
    drop_caches()
    if (heal.mnt / "a").exists():  # the earlier tests' files (this test also runs alone)
        _check(heal.mnt / "a", FILES)
    for i in range(16):
        assert (d / f"r{i}").read_bytes() == random.Random(60 + i).randbytes(1 * MiB)


def test_lost_fragments_are_reconstructed(heal):
    d = heal.mnt / "ec"
    d.mkdir()
    run_cli("layout", "set", str(d), "--ec", "2+1")
    data = random.Random(77).randbytes(700 * KiB)  # 3 stripes of 256 KiB chunks
    (d / "e").write_bytes(data)
    ino = (d / "e").stat().st_ino
    stripes = collections.defaultdict(set)  # index -> nodes holding one of its fragments
    for f in heal.chunk_files(ino=ino):
        stripes[int(f.name.split("-")[1])].add(int(f.parents[4].name.split("-")[1]))
    # every stripe whole before a node is killed: none of them failed, so none was written degraded
    # (a mount that found nodes slow on reads once left them out: only 0-2 of 3 fragments stored)
    assert sorted(stripes) == [0, 1, 2] and all(len(n) == 3 for n in stripes.values()), dict(stripes)
    holders = set().union(*stripes.values())
    victim = max(holders)
    heal.kill_node(victim)
    wait_for(f"node {victim} declared down", lambda: heal.node(victim)["state"] == "down")
    try:
        wait_for("every stripe whole again", lambda: _full_redundancy(heal))
    except AssertionError as exc:  # CI saw a stripe 'lost' after this one kill: say what the rows and logs held
        raise AssertionError(f"{exc}\nbefore the kill on disk: {dict(stripes)}, victim {victim}\n{_story_of(heal, ino, victim)}") from None
    assert "reconstructed" in heal.logs()["meta.log"]
    drop_caches()
    assert (d / "e").read_bytes() == data
    heal.restart()
    wait_for(f"node {victim} up", lambda: heal.node(victim)["state"] == "up")
    # a fragment that rots on disk: the scrub finds it, and it is rebuilt from the others
    rotten = next(f for f in heal.chunk_files(ino=ino) if int(f.parents[4].name.split("-")[1]) != victim)
    _flip_bytes(rotten)
    out = run_cli("scrub", "--now", str(d)).stdout
    assert "1 bad" in out, out
    wait_for("the rotten fragment rebuilt", lambda: "reconstructing it from the others" in heal.logs()["meta.log"]
             and _full_redundancy(heal))
    assert "0 bad" in run_cli("scrub", "--now", str(d)).stdout
    drop_caches()
    assert (d / "e").read_bytes() == data


NS = f"sfs-heal-{os.getpid() % 100000}"
SUBNET = f"10.{200 + os.getpid() % 50}.{os.getpid() % 250}"


@pytest.fixture
def partitioned_node(heal):
    """Storage node 9 in a network namespace of its own, joined to this one by a veth pair.

    ``cut()`` takes the link down (the node keeps running, unreachable); ``heal()`` brings it back.
    """
    with veth_namespace(NS, SUBNET, "v") as host_if:
        proc = None
        try:
            node_dir = heal.state / "storage-9"
            (node_dir / "data").mkdir(parents=True)
            port = _free_port()
            keys = heal.state / "keys"  # CURVE across the veth: node 9 gets a key in the cluster's keyring
            public_path, secret_path = write_keypair(keys / "storage-9")
            with open(keys / "keyring.toml", "a") as f:
                f.write(f'[[key]]\nname = "storage-9"\npublic = "{load_public(public_path)}"\nrole = "storage"\n')
            meta = with_key(f"tcp://{SUBNET}.1:{META_PORT}", load_public(keys / "meta.key"))
            (node_dir / "storage.toml").write_text(
                f'node_id = 9\nlisten = "tcp://{SUBNET}.2:{port}"\ndata_dir = "{node_dir / "data"}"\n'
                f'meta = ["{meta}"]\nhost = "netns"\nheartbeat_interval_s = 0.5\n'
                'scrub_interval_s = 3600.0\nreserved_space = 0\n'
                f'curve_key = "{secret_path}"\nkeyring = "{keys / "keyring.toml"}"\n'
            )
            log = open(heal.state / "logs" / "storage-9.log", "ab")
            proc = subprocess.Popen(
                ["ip", "netns", "exec", NS, sys.executable, "-m", "stripefs", "storage", "--config", str(node_dir / "storage.toml")],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )
            log.close()
            wait_for("node 9 up", lambda: any(n["node_id"] == 9 and n["state"] == "up" for n in heal.status()["nodes"]))

            class Link:
                def cut(self):
                    sh("ip", "link", "set", host_if, "down")

                def heal(self):
                    sh("ip", "link", "set", host_if, "up")

            yield Link()
        finally:
            if proc is not None:
                proc.terminate()
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


@pytest.mark.skipif(shutil.which("ip") is None or os.geteuid() != 0, reason="needs root and iproute2 for a network namespace")
def test_partitioned_node_is_repaired_around_and_its_stale_copies_never_served(heal, partitioned_node):
    d = heal.mnt / "partition"
    d.mkdir()
    sums = _populate(d, 16, seed=9)
    wait_for("copies on the namespaced node", lambda: heal.node(9)["placed_chunks"] > 0 or None)
    old_on_9 = heal.chunk_files(9)
    assert old_on_9
    partitioned_node.cut()  # node 9 keeps running: only the network is gone
    wait_for("node 9 declared down", lambda: heal.node(9)["state"] == "down")
    wait_for("full redundancy around the partition", lambda: _full_redundancy(heal))
    drop_caches()
    _check(d, sums)
    rng = random.Random(10)
    for name in list(sums)[:8]:  # new versions of the chunks node 9 holds old copies of
        data = rng.randbytes((d / name).stat().st_size)
        with open(d / name, "r+b") as f:
            f.write(data)
        sums[name] = hashlib.sha256(data).hexdigest()
    rejoined = time.time_ns()
    partitioned_node.heal()
    wait_for("node 9 up again", lambda: heal.node(9)["state"] == "up")
    for _ in range(3):
        drop_caches()
        _check(d, sums)

    def obsolete_left():
        left = []
        for path in old_on_9:
            try:
                if path.stat().st_mtime_ns < rejoined:
                    left.append(path)
            except FileNotFoundError:
                pass
        return left

    left: list = []

    def none_left():
        left[:] = obsolete_left()
        return not left

    # the rejoined node's stale copies go through the garbage collector's rounds: over 60 s at load 8-10
    try:
        wait_for("node 9's obsolete copies deleted", none_left, timeout=120)
    except AssertionError as e:
        raise AssertionError(f"{e}: {len(left)} of {len(old_on_9)} still there, e.g. {left[:3]}") from None
    _check(d, sums)


@pytest.mark.parametrize(
    "args,words",
    [
        (["node", "drain"], ["NODE", "--no-wait", "keeps serving"]),
        (["node", "remove"], ["only live copy", "drain"]),
        (["scrub"], ["--now", "PATH", "background"]),
        (["fsck"], ["--repair", "orphan"]),
        (["local", "add-node"], ["storage node", "--dir"]),
        (["local", "up"], ["--set", "ROLE.KEY=VALUE"]),
    ],
)
def test_healing_commands_explain_themselves(args, words):
    out = " ".join(run_cli(*args, "--help").stdout.split())
    for w in words:
        assert w in out, (args, w)


def test_healing_commands_say_what_to_do(tmp_path):
    res = run_cli("scrub", "somewhere", "--dir", str(tmp_path), check=False)
    assert res.returncode == 1 and "somewhere is not inside a stripefs mount" in res.stderr and "Traceback" not in res.stderr
    res = run_cli("local", "up", "--dir", str(tmp_path / "s"), "--set", "meta.no_such_key=1", check=False)
    assert res.returncode == 1 and "no_such_key" in res.stderr and "Traceback" not in res.stderr
