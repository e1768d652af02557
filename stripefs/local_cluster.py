"""``stripefs local up|down|status|add-node``: a whole cluster on one machine, in one directory.

State directory layout (everything the cluster owns lives here)::

    STATE/cluster.json        ports, node ids, mountpoint, mount options (fixed at first `up`)
    STATE/pids.json           pids of what `up` started; `down` stops these, and every process
                              whose command line names STATE (stripefs/local_processes.py), so
                              a cluster whose STATE was deleted while it ran is stopped too
    STATE/meta/metad.toml     metadata daemon config; STATE/meta/ holds its SQLite database
    STATE/meta-N/metad.toml   further metadata daemons (``--metas N``, PostgreSQL only)
    STATE/postgres/           the throwaway PostgreSQL server of ``--meta-store postgresql``
                              (or a dir in the temp dir named in cluster.json: stripefs/local_postgres.py)
    STATE/storage-N/storage.toml and STATE/storage-N/data/   one storage node each
    STATE/keys/               with --secure: NAME.key / NAME.key_secret for meta, admin, mount and
                              each storage node, keyring.toml listing them, and cap_secret (the
                              capability secret of daemons and nodes; docs/security.md)
    STATE/logs/*.log          one log per process
    STATE/lock                up, down and add-node hold an flock on it: one at a time (``exclusive``)

Running ``up`` again on a stopped STATE starts the same processes on the same
ports and data, so everything comes back. ``up --set ROLE.KEY=VALUE`` puts
config values into a new STATE's files (tests use it for short timeouts);
``add-node`` creates and starts one more storage node with the same settings.
``up --secure`` turns CURVE on everywhere: every process gets its own key, the
keyring lists them, addresses carry the servers' keys, and admin commands
given ``--dir STATE`` use the admin key. ``up --subdir /team-a`` mounts only
that directory (created if missing); with ``--secure`` the mount's key is
restricted to it too, so the daemon enforces it. The processes are started detached
(their own session), so they outlive the command that started them.

``up --meta-store postgresql --metas N`` keeps the metadata in a throwaway
PostgreSQL server and starts N metadata daemons over it, each on its own
port; storage nodes and the mount are given every daemon's address. ``down``
stops the server too. pids.json keeps the first daemon under ``meta`` (as
with SQLite) and the others under ``metas`` ({"2": pid, ...}).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import trio
import zmq

from .common import config as cfg
from .common import protocol as p
from .common.errors import ErrorCode, QuietError, StripefsError
from .common.capability import write_secret
from .common.keyring import load_identity, load_public, write_keypair
from .common.security import identity_of, use_identity, with_key
from .common.transport import connect
from .local_postgres import LocalPostgres, choose_dir
from .local_processes import is_mounted, mount_state, mounted_at, owned_by, owner_of, processes_of, unmount

log = logging.getLogger(__name__)


#: ``LOW-HIGH``: the ports local clusters (and stripefs's tests) pick from, instead of 10000 up to the
#: ephemeral range. Several clusters started at once on one machine (test runs side by side, pytest-xdist
#: workers) each given a range of their own cannot pick the same port.
PORTS_ENV = "STRIPEFS_LOCAL_PORTS"

_handed_out: set[int] = set()  # ports free_port returned in this process: not returned again


def port_range() -> tuple[int, int]:
    """[low, high) that ``free_port`` picks from: ``$STRIPEFS_LOCAL_PORTS`` (``LOW-HIGH``, inclusive),
    else 10000 up to the kernel's ephemeral range."""
    spec = os.environ.get(PORTS_ENV, "")
    if spec:
        try:
            low, high = (int(v) for v in spec.split("-"))
        except ValueError:
            raise QuietError(f"${PORTS_ENV}={spec!r}: use LOW-HIGH, e.g. 20000-24999") from None
        if not 1024 <= low <= high <= 65535:
            raise QuietError(f"${PORTS_ENV}={spec!r}: ports between 1024 and 65535, LOW first")
        return low, high + 1
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral = 32768
    return 10000, max(10001, ephemeral)


def free_port() -> int:
    """A free TCP port on 127.0.0.1 *below* the kernel's ephemeral range (or in ``$STRIPEFS_LOCAL_PORTS``).

    A client that keeps reconnecting to a stopped server's port in the ephemeral
    range can be given that very port as its own source port and connect to
    itself (TCP simultaneous open); the server then cannot bind it again
    ("Address already in use") when it restarts. Below the range that cannot happen.

    The port is free now, but nothing holds it until its server binds it: a port this process
    handed out before is never handed out again (a cluster's ports are all picked before any
    of its processes start), and processes picking at the same time should each have a range of
    their own (``$STRIPEFS_LOCAL_PORTS``).
    """
    low, high = port_range()
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(low, high)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    if os.environ.get(PORTS_ENV):
        raise QuietError(f"no free port in ${PORTS_ENV}={os.environ[PORTS_ENV]}")
    with socket.socket() as s:  # a crowded range: any free port
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def reserve_port(port: int) -> int:
    """``port``, chosen by the caller (``--set meta.listen``), never handed out by ``free_port`` in this
    process: the cluster's other ports are picked before its daemon binds it, so a check by binding
    would not see it taken (a test's fixed port was once given to the mount's metrics too)."""
    _handed_out.add(port)
    return port


def _alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie child of ours counts as dead
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


_is_mounted = is_mounted  # tests import it from here


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""



#: the names processes_of gives a cluster's mounts (stripefs/local_processes.py)
MOUNT_NAMES = frozenset({"mount", "dataset-mount"})


def _stop(procs: list[tuple[str, int]], grace_s: float = 10.0) -> None:
    """SIGTERM ``procs`` (name, pid) and wait for them; SIGKILL what is still alive after ``grace_s``."""
    for _, pid in procs:
        if _alive(pid):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for name, pid in procs:
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if _alive(pid):
            print(f"{name} (pid {pid}) ignored SIGTERM; killing it", file=sys.stderr)
            os.kill(pid, signal.SIGKILL)


class LocalCluster:
    def __init__(self, state: str | Path):
        self.state = Path(state).absolute()
        self.info_path = self.state / "cluster.json"
        self.pids_path = self.state / "pids.json"

    # ----------------------------------------------------------------- state

    def info(self) -> dict:
        try:
            return json.loads(self.info_path.read_text())
        except FileNotFoundError:
            raise QuietError(f"{self.state} holds no local cluster; start one with 'stripefs local up --dir {self.state}'") from None

    def pids(self) -> dict:
        try:
            return json.loads(self.pids_path.read_text())
        except FileNotFoundError:
            return {}

    def _save_pids(self, pids: dict) -> None:
        tmp = self.pids_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(pids, indent=1))
        tmp.replace(self.pids_path)

    @property
    def meta_address(self) -> str:
        return self._keyed(f"tcp://127.0.0.1:{self.info()['meta_port']}", "meta")

    # ------------------------------------------------------------------ keys

    @property
    def keys(self) -> Path:
        return self.state / "keys"

    def _keyed(self, endpoint: str, name: str) -> str:
        """``endpoint`` with the public key of process ``name`` when the cluster is --secure."""
        if not self.info().get("secure"):
            return endpoint
        return with_key(endpoint, load_public(self.keys / f"{name}.key"))

    def use_admin_key(self) -> None:
        """Admin connections of this process use the cluster's admin key (unless $STRIPEFS_KEY set one)."""
        if self.info_path.exists() and self.info().get("secure") and identity_of(None) is None:
            use_identity(None, load_identity(self.keys / "admin.key_secret"))

    def _new_key(self, name: str, role: str, **rights) -> None:
        """A keypair for process ``name``, appended to the keyring."""
        public_path, _ = write_keypair(self.keys / name, force=True)
        lines = ["[[key]]", f"name = {json.dumps(name)}", f"public = {json.dumps(load_public(public_path))}",
                 f"role = {json.dumps(role)}"]
        lines += [f"{k} = {json.dumps(v)}" for k, v in rights.items() if v]
        with open(self.keys / "keyring.toml", "a") as f:
            f.write("\n".join(lines) + "\n\n")

    def _curve_settings(self, name: str) -> dict:
        if not self.info().get("secure"):
            return {}
        return {"curve_key": str(self.keys / f"{name}.key_secret"), "keyring": str(self.keys / "keyring.toml"),
                "cap_secret": str(self.keys / "cap_secret")}  # daemons and nodes only (common/capability.py)

    # ------------------------------------------------------------------ metadata daemons

    @property
    def meta_addresses(self) -> list[str]:
        """Every metadata daemon's address, the first one first (all share the key named meta)."""
        info = self.info()
        return [self._keyed(f"tcp://127.0.0.1:{port}", "meta") for port in info.get("meta_ports", [info["meta_port"]])]

    def _meta_names(self, info: dict) -> list[str]:
        """Process and directory names of the metadata daemons: meta, meta-2, ..."""
        return ["meta"] + [f"meta-{i}" for i in range(2, len(info.get("meta_ports", [0])) + 1)]

    def _postgres(self, info: dict) -> LocalPostgres | None:
        pg = info.get("postgres")
        return LocalPostgres(pg["dir"], pg["port"]) if pg else None

    def _create(self, mount: Path, nodes: int, options: list[str], settings: list[str] = (), *,
                secure: bool = False, subdir: str = "", meta_store: str = "sqlite", metas: int = 1, tier: str = "") -> dict:
        if meta_store not in ("sqlite", "postgresql"):
            raise QuietError(f"--meta-store {meta_store}: use sqlite or postgresql")
        if metas < 1 or (metas > 1 and meta_store != "postgresql"):
            raise QuietError("--metas N > 1 needs --meta-store postgresql: an SQLite database has exactly one daemon")
        parsed = _parse_settings(settings)
        listen = str(parsed.get("meta", {}).get("listen", ""))
        info = {
            # --set meta.listen=tcp://0.0.0.0:PORT (reachable from other hosts or namespaces) fixes the port
            "meta_port": reserve_port(int(listen.rsplit(":", 1)[1])) if listen.rsplit(":", 1)[-1].isdigit() else free_port(),
            "nodes": [{"node_id": i, "port": free_port()} for i in range(1, nodes + 1)],
            "mount": str(mount),
            "options": options,
            "settings": parsed,
            "secure": secure,  # CURVE on every socket, keys in STATE/keys
            "subdir": subdir,  # the mount shows only this directory
            # Prometheus endpoints (HOST:PORT) of the daemon, each node and the mount
            "metrics": {"meta": f"127.0.0.1:{free_port()}", "mount": f"127.0.0.1:{free_port()}",
                        **{f"storage-{i}": f"127.0.0.1:{free_port()}" for i in range(1, nodes + 1)}},
            "meta_store": meta_store,
        }
        if metas > 1:
            info["meta_ports"] = [info["meta_port"]] + [free_port() for _ in range(metas - 1)]
            info["metrics"].update({name: f"127.0.0.1:{free_port()}" for name in self._meta_names(info)[1:]})
        (self.state / "logs").mkdir(parents=True, exist_ok=True)
        self.info_path.write_text(json.dumps(info, indent=1))  # _keyed and _curve_settings read it
        if secure:
            self.keys.mkdir(mode=0o700, exist_ok=True)
            (self.keys / "keyring.toml").write_text("# who may talk to this cluster (docs/security.md)\n\n")
            self._new_key("meta", "meta")  # every metadata daemon of the cluster uses it
            write_secret(self.keys / "cap_secret", force=True)  # capabilities for subtree keys, shared by daemons and nodes
            self._new_key("admin", "admin")
            self._new_key("mount", "client", subdir=subdir)
            for node in info["nodes"]:
                self._new_key(f"storage-{node['node_id']}", "storage")
        store = {}
        if tier == "s3":  # a local S3 server and its dummy credentials (stripefs/local_s3.py)
            from . import local_s3

            local_s3.check_available()
            info["s3"] = {"port": free_port(), "bucket": local_s3.BUCKET}
            store["tier_credentials"] = str(local_s3.write_credentials(self.state))
        if meta_store == "postgresql":
            server = LocalPostgres(choose_dir(self.state), free_port())
            info["postgres"] = {"dir": str(server.base), "port": server.port}
            server.init()
            store.update({"store": "postgresql", "dsn": server.dsn})
        ports = info.get("meta_ports", [info["meta_port"]])
        for name, port in zip(self._meta_names(info), ports):
            meta_dir = self.state / name
            meta_dir.mkdir(exist_ok=True)
            meta = cfg.MetaConfig(
                listen=f"tcp://127.0.0.1:{port}",
                data_dir=str(meta_dir),
                stripe_count=min(4, nodes),
                redundancy=f"replicas={min(2, nodes)}",
                metrics=info["metrics"][name],
                **store,
                **self._curve_settings("meta"),
            )
            (meta_dir / "metad.toml").write_text(_with_settings(meta, info["settings"].get("meta", {})))
        for node in info["nodes"]:
            self._write_storage_config(info, node)
        self.info_path.write_text(json.dumps(info, indent=1))
        return info

    def _write_storage_config(self, info: dict, node: dict) -> None:
        d = self.state / f"storage-{node['node_id']}"
        (d / "data").mkdir(parents=True, exist_ok=True)
        sc = cfg.StorageConfig(
            node_id=node["node_id"],
            listen=f"tcp://127.0.0.1:{node['port']}",
            data_dir=str(d / "data"),
            meta=self.meta_addresses,
            host=f"local-{node['node_id']}",  # one failure domain per node on a one-machine cluster
            heartbeat_interval_s=1.0,
            metrics=info.get("metrics", {}).get(f"storage-{node['node_id']}", ""),
            **self._curve_settings(f"storage-{node['node_id']}"),
        )
        (d / "storage.toml").write_text(_with_settings(sc, info.get("settings", {}).get("storage", {})))

    def add_node(self, *, timeout: float = 60.0) -> int:
        """One more storage node: configured like the others, started, registered."""
        with self.exclusive():
            return self._add_node(timeout=timeout)

    def _add_node(self, *, timeout: float) -> int:
        info = self.info()
        pids = self.pids()
        if not _alive(pids.get("meta")):
            raise QuietError(f"the local cluster in {self.state} is not running; start it with 'stripefs local up'", 3)
        node = {"node_id": max(n["node_id"] for n in info["nodes"]) + 1, "port": free_port()}
        info.setdefault("metrics", {})[f"storage-{node['node_id']}"] = f"127.0.0.1:{free_port()}"
        if info.get("secure"):  # the keyring is re-read by the running daemon and nodes
            self.use_admin_key()
            self._new_key(f"storage-{node['node_id']}", "storage")
        self._write_storage_config(info, node)
        info["nodes"].append(node)
        self.info_path.write_text(json.dumps(info, indent=1))
        key = str(node["node_id"])
        pids.setdefault("storage", {})[key] = self._spawn(
            f"storage-{key}", ["storage", "--config", str(self.state / f"storage-{key}" / "storage.toml")]
        )
        self._save_pids(pids)
        self._wait_ready({**info, "nodes": [node]}, pids, time.monotonic() + timeout)  # the new node only
        print(f"storage node {key} started at tcp://127.0.0.1:{node['port']} and registered")
        return 0

    # -------------------------------------------------------------------- up

    def _spawn(self, name: str, args: list[str]) -> int:
        log_file = open(self.state / "logs" / f"{name}.log", "ab")
        proc = subprocess.Popen(
            [sys.executable, "-m", "stripefs", *args],
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log_file.close()
        return proc.pid

    def up(self, mount: str | Path, nodes: int | None, options: list[str], *, timeout: float = 60.0, settings: list[str] = (),
           secure: bool = False, subdir: str = "", meta_store: str = "sqlite", metas: int = 1, tier: str = "",
           dataset_mount: str | Path = "") -> int:
        mount = Path(mount).absolute()
        if not self.info_path.exists():
            orphans = processes_of(self.state)
            if orphans:  # its state directory was deleted while it ran: a new cluster beside it would be a mess
                raise QuietError(
                    f"{len(orphans)} process(es) of a local cluster in {self.state} still run though its state is gone "
                    f"(pids {' '.join(str(o.pid) for o in orphans)}); stop them with 'stripefs local down --dir {self.state}'", 3)
        self.state.mkdir(parents=True, exist_ok=True)
        with self.exclusive():
            return self._up(mount, nodes, options, timeout=timeout, settings=settings, secure=secure, subdir=subdir,
                            meta_store=meta_store, metas=metas, tier=tier, dataset_mount=dataset_mount)

    @contextlib.contextmanager
    def exclusive(self):
        """One ``local up``, ``down`` or ``add-node`` at a time on a STATE (an flock on STATE/lock): a second
        ``up`` started beside a first on a new directory waits for it and then finds the cluster running,
        instead of starting a second set of processes on the same ports ("storage-2 exited at start")."""
        if not self.state.is_dir():  # down of a deleted state directory: nothing to share
            yield
            return
        fd = os.open(self.state / "lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                print(f"waiting for another 'stripefs local' command on {self.state} to finish", file=sys.stderr)
                fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def _up(self, mount: Path, nodes: int | None, options: list[str], *, timeout: float, settings, secure: bool, subdir: str,
            meta_store: str, metas: int, tier: str, dataset_mount: str | Path) -> int:
        if self.info_path.exists():
            info = json.loads(self.info_path.read_text())
            if settings:
                print(f"note: {self.state} exists; --set applies only when a cluster is created", file=sys.stderr)
            if tier and not info.get("s3"):  # a local S3 server needs credentials in metad.toml, written at creation
                raise QuietError(f"{self.state} exists without a tier: --tier {tier} applies only when a cluster is created; "
                                 f"add a tier to this one with 'stripefs tier add NAME s3://BUCKET --endpoint URL' "
                                 f"(docs/tiering.md), or create a new cluster with --tier {tier} in another --dir")
        else:
            info = self._create(mount, 4 if nodes is None else nodes, options, settings, secure=secure, subdir=subdir, meta_store=meta_store, metas=metas,
                                tier=tier)
        if (secure and not info.get("secure")) or (subdir and subdir != info.get("subdir", "")):
            print(f"note: {self.state} exists; --secure and --subdir apply only when a cluster is created", file=sys.stderr)
        self.use_admin_key()
        if Path(info["mount"]) != mount:
            raise QuietError(f"{self.state} was created for mountpoint {info['mount']}, not {mount}")
        if nodes is not None and len(info["nodes"]) != nodes:
            print(f"note: {self.state} has {len(info['nodes'])} storage nodes; --nodes {nodes} is ignored", file=sys.stderr)
        if dataset_mount and str(Path(dataset_mount).absolute()) != info.get("dataset_mount"):
            if Path(dataset_mount).absolute() == mount:
                raise QuietError(f"--dataset-mount {dataset_mount} is the cluster's mountpoint: give another directory")
            info["dataset_mount"] = str(Path(dataset_mount).absolute())  # remembered: every later up mounts it too
            saved = json.loads(self.info_path.read_text())
            saved["dataset_mount"] = info["dataset_mount"]
            self.info_path.write_text(json.dumps(saved, indent=1))
        dmount = Path(info["dataset_mount"]) if info.get("dataset_mount") else None
        pids = self.pids()
        metas = self._meta_names(info)
        removed = self._removed_nodes(info, pids)
        expected = len(metas) + 1 + len(info["nodes"]) - len(removed)  # metas, storage nodes (not removed), mount
        expected += 1 if info.get("s3") else 0  # the local S3 server
        expected += 1 if dmount else 0  # the dataset mount
        alive = [name for name, pid in self._flat_pids(pids) if _alive(pid) and name not in removed]
        server = self._postgres(info)
        mounted = self._check_mount(mount, pids)
        dmounted = self._check_mount(dmount, pids, "dataset_mount") if dmount else True
        if len(alive) == expected and mounted and dmounted and (server is None or server.running()):
            print(f"stripefs local cluster in {self.state} is already running, mounted at {mount}")
            return 0
        if alive:
            print(f"restarting what is not running in {self.state} ({len(alive)} of {expected} processes are up)")
        if not mounted:  # touching a live mount would wait for the daemons we are about to start
            mount.mkdir(parents=True, exist_ok=True)
        if not dmounted:
            dmount.mkdir(parents=True, exist_ok=True)
        deadline = time.monotonic() + timeout

        if server is not None:
            server.start(timeout=max(1.0, deadline - time.monotonic()))
            pids["postgres"] = server.pid()
        if info.get("s3") and not _alive(pids.get("s3")):
            from . import local_s3

            if pids.get("s3"):
                print("note: the local S3 server had stopped; its objects are gone (it keeps them in memory)", file=sys.stderr)
            pids["s3"] = self._spawn("s3", ["local", "s3-server", "--dir", str(self.state.absolute()),
                                            "--port", str(info["s3"]["port"])])
            self._save_pids(pids)
            local_s3.wait_ready(info["s3"]["port"], max(1.0, deadline - time.monotonic()))
        for i, name in enumerate(metas):
            current = pids.get("meta") if i == 0 else pids.get("metas", {}).get(str(i + 1))
            if _alive(current):
                continue
            pid = self._spawn(name, ["meta", "--config", str(self.state / name / "metad.toml")])
            if i == 0:
                pids["meta"] = pid
            else:
                pids.setdefault("metas", {})[str(i + 1)] = pid
            self._save_pids(pids)
            if i == 0 and len(metas) > 1:  # the first creates the schema; the others find it
                self._wait_ready({**info, "nodes": []}, pids, deadline, metas_only=True)
        if len(metas) == 1:  # the daemon answers before the nodes start: it knows which were removed
            self._wait_ready({**info, "nodes": []}, pids, deadline, metas_only=True)
        removed = self._removed_nodes(info, pids)
        info = {**info, "nodes": [n for n in info["nodes"] if f"storage-{n['node_id']}" not in removed]}
        storage = pids.setdefault("storage", {})
        for node in info["nodes"]:
            key = str(node["node_id"])
            if not _alive(storage.get(key)):
                storage[key] = self._spawn(
                    f"storage-{key}", ["storage", "--config", str(self.state / f"storage-{key}" / "storage.toml")]
                )
        self._save_pids(pids)
        self._wait_ready(info, pids, deadline)
        if info.get("subdir"):
            self._make_dirs(info["subdir"])
        if info.get("s3"):
            self._add_local_tier(info)

        if not mounted:
            self._mount(info, options, pids, mount, "mount")
        if not dmounted:
            self._mount(info, options, pids, dmount, "dataset_mount")
        store = f" on PostgreSQL at 127.0.0.1:{info['postgres']['port']}" if server is not None else ""
        gone = f" ({len(removed)} removed: not started)" if removed else ""
        dataset = f", and read-only (dataset mode) at {dmount}" if dmount else ""
        print(f"stripefs local cluster up: metadata {', '.join(self.meta_addresses)}{store}, "
              f"{len(info['nodes'])} storage nodes{gone}, mounted at {mount}{dataset}")
        return 0

    def _mount(self, info: dict, options: list[str], pids: dict, mount: Path, key: str) -> None:
        """Mount the cluster at ``mount``: key "mount" (the read-write mount) or "dataset_mount" (the
        same in dataset mode, read-only: ``up --dataset-mount``); its pid and FUSE connection go to pids.json."""
        name = key.replace("_", "-")  # mount, dataset-mount: its pidfile and log (local_processes finds it by the pidfile)
        args = ["mount", ",".join(self.meta_addresses), str(mount), "--log", str(self.state / "logs" / f"{name}.log"),
                "--pidfile", str(self.state / f"{name}.pid")]
        for opt in info.get("options", []) + [o for o in options if o not in info.get("options", [])]:
            args += ["-o", opt]
        if key == "mount" and info.get("metrics", {}).get("mount"):
            args += ["-o", f"metrics={info['metrics']['mount']}"]
        if key == "dataset_mount":
            args += ["-o", "dataset"]
        if info.get("secure"):
            args += ["-o", f"key={self.keys / 'mount.key_secret'}"]
        if info.get("subdir"):
            args += ["-o", f"subdir={info['subdir']}"]
        res = subprocess.run([sys.executable, "-m", "stripefs", *args], capture_output=True, text=True)
        if res.returncode:
            raise QuietError(f"mount at {mount} failed: {res.stderr.strip() or res.stdout.strip()}", 3)
        pids[key] = int((self.state / f"{name}.pid").read_text())
        entry = mounted_at(mount)  # its FUSE connection: how a dead mount is known later (local_processes)
        pids[f"{key}_device"] = entry.device if entry is not None else None
        self._save_pids(pids)

    def _check_mount(self, mount: Path, pids: dict, key: str = "mount") -> bool:
        """Whether the cluster's mount (``key``: mount, dataset_mount) is live; a dead one (its client
        killed) is unmounted first, something else mounted there is an error."""
        state = mount_state(mount, pids.get(key) if _alive(pids.get(key)) else None, pids.get(f"{key}_device"))
        if state == "dead":
            why = unmount(mount)
            if why:
                raise QuietError(f"{mount} is a dead mount (its client exited) and cannot be unmounted: {why}; "
                                 f"try 'fusermount3 -u -z {mount}'", 3)
            print(f"{mount} was a dead mount (its client had exited): unmounted it; mounting again")
        elif state == "foreign":
            raise QuietError(f"something else is mounted at {mount}; unmount it first (fusermount3 -u {mount})", 3)
        return state == "live"

    def _removed_nodes(self, info: dict, pids: dict) -> set[str]:
        """Names (storage-N) of the nodes an operator removed (stripefs node remove): not started again.
        Asked of the metadata daemon when it runs, and kept in cluster.json for when it does not."""
        known = set(info.get("removed", []))
        if _alive(pids.get("meta")):
            states = self._node_states()
            if states is not None:
                now = {n for n, st in states.items() if st == "removed"}
                if now != known:
                    saved = json.loads(self.info_path.read_text())
                    saved["removed"] = sorted(now)
                    self.info_path.write_text(json.dumps(saved, indent=1))
                known = now
        return {f"storage-{n}" for n in known}

    def _node_states(self) -> dict[int, str] | None:
        """node id -> state as the metadata daemon says (None: it does not answer)."""

        async def ask():
            ctx = zmq.Context()
            try:
                async with connect(ctx, self.meta_address, timeout=3) as meta:
                    rsp, _ = await meta.call(p.StatusReq())
                    return {n.node_id: n.state for n in rsp.nodes}
            except StripefsError:
                return None
            finally:
                ctx.destroy(linger=0)

        self.use_admin_key()
        return trio.run(ask)

    def _wait_ready(self, info: dict, pids: dict, deadline: float, *, metas_only: bool = False) -> None:
        """Wait for every process to answer a ping and every node to be up at every daemon."""
        names = self._meta_names(info)
        meta_pids = [pids.get("meta")] + [pids.get("metas", {}).get(str(i)) for i in range(2, len(names) + 1)]
        meta_targets = [t for t in zip(names, meta_pids, self.meta_addresses) if t[1]]
        if metas_only:
            meta_targets = meta_targets[:1]

        async def wait() -> None:
            ctx = zmq.Context()
            try:
                targets = meta_targets + [
                    (f"storage-{n['node_id']}", pids["storage"][str(n["node_id"])],
                     self._keyed(f"tcp://127.0.0.1:{n['port']}", f"storage-{n['node_id']}"))
                    for n in info["nodes"]
                ]
                for name, pid, address in targets:
                    async with connect(ctx, address, timeout=0.5) as client:
                        while True:
                            if not _alive(pid):
                                raise QuietError(f"{name} exited at start; see {self.state / 'logs' / (name + '.log')}", 3)
                            if time.monotonic() > deadline:
                                raise QuietError(f"{name} did not answer at {address}; see its log in {self.state / 'logs'}", 3)
                            try:
                                await client.call(p.PingReq())
                                break
                            except StripefsError:
                                await trio.sleep(0.1)
                want = {n["node_id"] for n in info["nodes"]}
                for _, _, address in meta_targets if want else ():
                    async with connect(ctx, address, timeout=2) as meta:
                        while True:
                            try:
                                rsp, _ = await meta.call(p.StatusReq())
                            except StripefsError as exc:  # a busy machine: slow, not gone (the deadline decides)
                                if time.monotonic() > deadline:
                                    raise QuietError(f"the metadata daemon {address} did not answer in time: {exc}", 3) from None
                                continue
                            if want <= {n.node_id for n in rsp.nodes if n.state in ("up", "removed")}:  # removed: by an operator
                                break
                            if time.monotonic() > deadline:
                                raise QuietError(f"storage nodes did not register with the metadata daemon {address} in time", 3)
                            await trio.sleep(0.1)
            finally:
                ctx.destroy(linger=0)

        trio.run(wait)  # (a QuietError raised inside a connection leaves it as itself: transport.connect)

    def _make_dirs(self, path: str) -> None:
        """mkdir -p ``path`` in the cluster (as the admin): a --subdir mount needs its directory."""

        async def make() -> None:
            ctx = zmq.Context()
            try:
                async with connect(ctx, self.meta_address, timeout=5) as meta:
                    ino = 1
                    for name in filter(None, path.encode().split(b"/")):
                        try:
                            rsp, _ = await meta.call(p.MkdirReq(parent=ino, name=name, mode=0o40755, uid=0, gid=0))
                        except StripefsError as exc:
                            if exc.code != ErrorCode.EXISTS:
                                raise
                            rsp, _ = await meta.call(p.LookupReq(parent=ino, name=name))
                        ino = rsp.attr.ino
            finally:
                ctx.destroy(linger=0)

        trio.run(make)

    # ------------------------------------------------------------------ down

    @staticmethod
    def _flat_pids(pids: dict) -> list[tuple[str, int]]:
        out = []
        if pids.get("mount"):
            out.append(("mount", pids["mount"]))
        if pids.get("dataset_mount"):
            out.append(("dataset-mount", pids["dataset_mount"]))
        for k, v in sorted(pids.get("storage", {}).items()):
            out.append((f"storage-{k}", v))
        if pids.get("meta"):
            out.append(("meta", pids["meta"]))
        for k, v in sorted(pids.get("metas", {}).items()):
            out.append((f"meta-{k}", v))
        if pids.get("s3"):
            out.append(("s3", pids["s3"]))
        return out

    def _add_local_tier(self, info: dict) -> None:
        """Tier 'cold' on the local S3 server, unless the cluster has it already."""
        from . import local_s3

        async def add() -> bool:
            ctx = zmq.Context()
            try:
                async with connect(ctx, self.meta_address, timeout=10) as meta:
                    listing, _ = await meta.call(p.TierListReq())
                    if any(t.name == local_s3.TIER for t in listing.tiers):
                        return False
                    await meta.call(p.TierAddReq(name=local_s3.TIER, url=f"s3://{info['s3']['bucket']}",
                                                 endpoint=local_s3.endpoint(info["s3"]["port"])))
                    return True
            finally:
                ctx.destroy(linger=0)

        self.use_admin_key()
        try:
            if not trio.run(add):
                return
        except StripefsError as exc:
            raise QuietError(f"cannot add tier {local_s3.TIER} on the local S3 server: {exc.message or exc.code.name}", 3) from None
        print(f"tier {local_s3.TIER}: s3://{info['s3']['bucket']} on the local S3 server at {local_s3.endpoint(info['s3']['port'])}")

    def down(self) -> int:
        with self.exclusive():
            return self._down()

    def _down(self) -> int:
        """Unmount and stop what ``up`` started: the pids in pids.json and every process whose command
        line names this state directory (stripefs/local_processes.py), so a cluster whose pids.json, or
        whole state directory, was deleted while it ran is stopped too. 0 when nothing runs any more
        (also when nothing ran), 3 when something could not be stopped or unmounted."""
        info = json.loads(self.info_path.read_text()) if self.info_path.exists() else None
        found = processes_of(self.state)
        if info is None and not found:
            print(f"no local cluster runs from {self.state}: nothing to stop")
            return 0
        if info is None:
            print(f"{self.state} is gone, but {len(found)} of its processes still run: stopping them", file=sys.stderr)
        # Only stripefs mounts at the cluster's own mountpoint (cluster.json), or at one its own mount
        # process serves (processes_of: the owner's processes only) are unmounted: never what a command
        # line of another user names, never a mount of another kind (local_processes.unmount).
        mounts = {Path(info["mount"])} if info else set()
        mounts |= {Path(info["dataset_mount"])} if info and info.get("dataset_mount") else set()
        mounts |= {proc.mountpoint for proc in found if proc.mountpoint is not None}
        failed = []
        for mount in sorted(mounts):
            entry = mounted_at(mount)
            if entry is None:
                continue
            if entry.fstype != "fuse.stripefs":
                print(f"{mount}: a {entry.fstype} mount is there, not this cluster's: left alone", file=sys.stderr)
                continue
            res = subprocess.run(["fusermount3", "-u", str(mount)], capture_output=True, text=True)
            if res.returncode and _is_mounted(mount):
                print(f"{mount} is busy ({res.stderr.strip()}); detaching it lazily", file=sys.stderr)
                why = unmount(mount)
                if why:
                    failed.append(f"{mount} is still mounted ({why})")
        pids = self.pids()
        owner = owner_of(self.state)
        flat = [(proc.name, proc.pid) for proc in found if proc.name != "postgres"]
        # pids.json's too (a state directory named by another path: a symlink), if still a stripefs process of the owner
        flat += [(name, pid) for name, pid in self._flat_pids(pids)
                 if _alive(pid) and pid not in {p for _, p in flat} and "stripefs" in _cmdline(pid) and owned_by(pid, owner)]
        # the mounts first: at unmount a mount sends what it still holds (changes answered at once,
        # its session's end) to the daemon and the nodes, which must still run
        _stop([(name, pid) for name, pid in flat if name in MOUNT_NAMES])
        _stop([(name, pid) for name, pid in flat if name not in MOUNT_NAMES])
        server = self._postgres(info) if info else None
        if server is not None:
            server.stop()
        for proc in found:  # a PostgreSQL server of a deleted state directory: pg_ctl cannot find it, SIGINT is its fast stop
            if proc.name == "postgres" and _alive(proc.pid):
                os.kill(proc.pid, signal.SIGINT)
        time.sleep(0.1)
        failed += [f"{proc.name} (pid {proc.pid}) still runs" for proc in processes_of(self.state)]
        if failed:
            raise QuietError(f"the local cluster in {self.state} is not fully stopped: {'; '.join(failed)}", 3)
        self.pids_path.unlink(missing_ok=True)
        print(f"stripefs local cluster in {self.state} stopped")
        return 0

    # ---------------------------------------------------------------- status

    def status(self) -> dict:
        """Every process: role, node_id, pid, address, state, bytes_stored, metrics (http://.../metrics or None)."""
        info = self.info()
        pids = self.pids()
        removed = self._removed_nodes(info, pids)
        endpoints = info.get("metrics", {})

        def metrics_url(name: str) -> str | None:
            return f"http://{endpoints[name]}/metrics" if endpoints.get(name) else None

        procs = []
        for i, (name, address) in enumerate(zip(self._meta_names(info), self.meta_addresses)):
            pid = pids.get("meta") if i == 0 else pids.get("metas", {}).get(str(i + 1))
            procs.append({"role": "meta", "node_id": None, "pid": pid if _alive(pid) else None, "address": address,
                          "state": "up" if _alive(pid) else "down", "bytes_stored": None,
                          "metrics": metrics_url(name)})
        server = self._postgres(info)
        if server is not None:  # role "postgres": the database the daemons share (no metrics endpoint)
            up = server.running()
            procs.append({"role": "postgres", "node_id": None, "pid": server.pid() if up else None,
                          "address": f"postgresql://127.0.0.1:{server.port}/",
                          "state": "up" if up else "down", "bytes_stored": None, "metrics": None})
        if info.get("s3"):  # role "s3": the local S3 server of --tier s3 (objects in its memory)
            spid = pids.get("s3")
            procs.append({"role": "s3", "node_id": None, "pid": spid if _alive(spid) else None,
                          "address": f"http://127.0.0.1:{info['s3']['port']}/{info['s3']['bucket']}",
                          "state": "up" if _alive(spid) else "down", "bytes_stored": None, "metrics": None})
        for node in info["nodes"]:
            pid = pids.get("storage", {}).get(str(node["node_id"]))
            procs.append({
                "role": "storage",
                "node_id": node["node_id"],
                "pid": pid if _alive(pid) else None,
                "address": self._keyed(f"tcp://127.0.0.1:{node['port']}", f"storage-{node['node_id']}"),
                "state": "up" if _alive(pid) else "removed" if f"storage-{node['node_id']}" in removed else "down",
                "bytes_stored": _tree_bytes(self.state / f"storage-{node['node_id']}" / "data"),
                "metrics": metrics_url(f"storage-{node['node_id']}"),
            })
        mpid = pids.get("mount")
        mstate = mount_state(Path(info["mount"]), mpid if _alive(mpid) else None, pids.get("mount_device"))
        procs.append({
            "role": "mount", "node_id": None, "pid": mpid if _alive(mpid) else None, "address": None,
            # "dead": still in /proc/mounts, its client gone (every access fails: 'stripefs local up' mounts again)
            "state": {"live": "up", "dead": "dead"}.get(mstate, "down"),
            "bytes_stored": None, "mountpoint": info["mount"], "metrics": metrics_url("mount"),
        })
        if info.get("dataset_mount"):  # role "dataset-mount": the read-only mount of 'up --dataset-mount'
            dpid = pids.get("dataset_mount")
            dstate = mount_state(Path(info["dataset_mount"]), dpid if _alive(dpid) else None, pids.get("dataset_mount_device"))
            procs.append({
                "role": "dataset-mount", "node_id": None, "pid": dpid if _alive(dpid) else None, "address": None,
                "state": {"live": "up", "dead": "dead"}.get(dstate, "down"), "bytes_stored": None,
                "mountpoint": info["dataset_mount"], "metrics": None,
            })
        return {"state_dir": str(self.state), "processes": procs, "under_replicated": self._under_replicated()}

    def _under_replicated(self) -> int | None:
        """Chunks below their target redundancy, as the metadata daemon says (None: it does not answer)."""

        async def ask():
            ctx = zmq.Context()
            try:
                async with connect(ctx, self.meta_address, timeout=3) as meta:
                    rsp, _ = await meta.call(p.StatusReq())
                    return rsp.under_replicated
            except StripefsError:
                return None
            finally:
                ctx.destroy(linger=0)

        if not _alive(self.pids().get("meta")):
            return None
        self.use_admin_key()
        return trio.run(ask)


def _tree_bytes(root: Path) -> int:
    total = 0
    for dirpath, _, files in os.walk(root):
        for f in files:
            try:
                total += os.stat(os.path.join(dirpath, f)).st_size
            except OSError:
                pass
    return total


def _parse_settings(settings) -> dict[str, dict[str, object]]:
    """["meta.node_timeout_s=3", ...] -> {"meta": {"node_timeout_s": 3}}; values are TOML (bare words: strings)."""
    import tomllib

    out: dict[str, dict[str, object]] = {}
    for item in settings:
        key, sep, value = item.partition("=")
        role, dot, name = key.strip().partition(".")
        if not sep or not dot or role not in cfg.ROLES or not name:
            raise QuietError(f"--set {item!r}: expected ROLE.KEY=VALUE with ROLE one of {', '.join(sorted(cfg.ROLES))}")
        try:
            parsed = tomllib.loads(f"v = {value.strip()}")["v"]
        except tomllib.TOMLDecodeError:
            parsed = value.strip()
        out.setdefault(role, {})[name] = parsed
    return out


def _with_settings(config, values: dict[str, object]) -> str:
    """The config's TOML with ``values`` put in, checked by the role's own loader."""
    lines = [line for line in cfg.dumps(config).splitlines() if line.split(" = ")[0] not in values]
    lines += [f"{k} = {json.dumps(v)}" for k, v in values.items()]
    text = "\n".join(lines) + "\n"
    cfg.loads(text, type(config), source="--set")  # unknown keys and bad values are errors here
    return text
