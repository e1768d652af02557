"""A ``stripefs local up --secure`` cluster: CURVE everywhere, keys from the launcher, extra mounts with their own keys.

Covers what only real processes and real mounts show: the secure cluster reads
and writes; raw clients without a listed key get nothing from the daemon or a
node; a read-only key's mount cannot write; a subtree key's mount sees only its
subtree, through ``..`` and symlinks too; a root-squash key's files are never
root's. Raw-request checks of every rule are in tests/unit/test_security.py;
CURVE across network namespaces is the partition test in test_healing.py.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import trio
import xxhash
import zmq

from stripefs.common import protocol as P
from stripefs.common.errors import ErrorCode, StripefsError
from stripefs.common.keyring import load_identity, load_public, write_keypair
from stripefs.common.layout import SLOT_STRIDE
from stripefs.common.security import split_address, use_identity, with_key
from stripefs.common.transport import connect

from conftest import Cluster, cluster_root, drop_caches, run_cli, run_cluster, veth_namespace

MiB = 1 << 20


class SecureCluster(Cluster):
    def up(self) -> None:
        run_cli("local", "up", "--dir", str(self.state), "--mount", str(self.mnt), "--nodes", str(self.nodes),
                "-o", "allow_other", "--secure", "--set", "meta.chunk_size=256K")

    @property
    def keys(self):
        return self.state / "keys"

    def add_key(self, name: str, role: str = "client", **rights) -> str:
        """A new keypair listed in the running cluster's keyring (re-read on change); its secret file."""
        public_path, secret_path = write_keypair(self.keys / name, force=True)
        lines = ["[[key]]", f'name = "{name}"', f'public = "{load_public(public_path)}"', f'role = "{role}"']
        lines += [f"{k} = {'true' if v is True else repr(v).replace(chr(39), chr(34))}" for k, v in rights.items()]
        with open(self.keys / "keyring.toml", "a") as f:
            f.write("\n".join(lines) + "\n\n")
        return str(secret_path)


@pytest.fixture(scope="module")
def secure(request):
    c = SecureCluster(cluster_root("stripefs-secure-"), nodes=2)
    yield from run_cluster(request, c, label="secure ")


def _raw_calls(address: str, key_file: str | None, *requests, timeout: float = 1.0):
    """Each request's reply, or its error code, from a client holding ``key_file`` (None: no key);
    a request may come as (request, payload frames)."""

    async def run():
        ctx = zmq.Context()
        if key_file:
            use_identity(ctx, load_identity(key_file))
        out = []
        try:
            async with connect(ctx, address, timeout=timeout) as client:
                for r in requests:
                    r, payloads = r if isinstance(r, tuple) else (r, ())
                    try:
                        out.append((await client.call(r, payloads))[0])
                    except StripefsError as exc:
                        out.append(exc.code)
        finally:
            ctx.destroy(linger=0)
        return out

    return trio.run(run)


def test_secure_cluster_reads_and_writes(secure):
    d = secure.mnt / "rw"
    d.mkdir()
    sums = {}
    for i in range(4):
        data = os.urandom(MiB // 2 + i * 1000)
        (d / f"f{i}").write_bytes(data)
        sums[f"f{i}"] = hashlib.sha256(data).hexdigest()
    drop_caches()
    for name, digest in sums.items():
        assert hashlib.sha256((d / name).read_bytes()).hexdigest() == digest
    assert secure.meta_address.split("?key=")[1] == load_public(secure.keys / "meta.key")
    status = run_cli("status", "--dir", str(secure.state)).stdout  # admin commands use the cluster's admin key
    assert "2/2 storage nodes up" in status


def test_clients_without_a_listed_key_get_nothing(secure):
    (secure.mnt / "private").write_bytes(b"not for strangers")
    node = next(p for p in secure.local.status()["processes"] if p["role"] == "storage")
    node_address = node["address"]
    assert node_address == with_key(node_address, load_public(secure.keys / f"storage-{node['node_id']}.key"))
    stranger = str(write_keypair(secure.root / "stranger")[1])  # a valid key nobody listed
    ino = os.stat(secure.mnt / "private").st_ino
    read = P.ReadChunkReq(chunk=P.ChunkId(ino, 0, 0), min_version=0, offset=0, length=100)
    asks = []  # (address, key file, request)
    for key_file in (None, stranger):
        meta = secure.meta_address if key_file else split_address(secure.meta_address)[0]
        nodeaddr = node_address if key_file else split_address(node_address)[0]
        asks += [(meta, key_file, P.LookupReq(parent=1, name=b"private")), (meta, key_file, P.GetattrReq(ino=ino)),
                 (nodeaddr, key_file, read), (nodeaddr, key_file, P.PingReq())]
    with ThreadPoolExecutor(len(asks)) as pool:  # all at once: each client waits out its own 1 s timeout
        answers = list(pool.map(lambda ask: _raw_calls(*ask), asks))
    assert answers == [[ErrorCode.TIMEOUT]] * len(asks), list(zip(asks, answers))
    assert "not in the keyring" in secure.logs()["meta.log"]
    # the cluster's own mount key does get through (the checks above could not pass by accident)
    got = _raw_calls(secure.meta_address, str(secure.keys / "mount.key_secret"), P.LookupReq(parent=1, name=b"private"))
    assert got[0].attr.ino == ino


def test_a_read_only_key_mount_cannot_write(secure):
    (secure.mnt / "ro-data").mkdir()
    (secure.mnt / "ro-data" / "f").write_bytes(b"readable")
    key = secure.add_key("reader", read_only=True)
    mnt = secure.mount_again("ro-mnt", f"key={key}")
    try:
        assert (mnt / "ro-data" / "f").read_bytes() == b"readable"
        for attempt in (
            lambda: (mnt / "ro-data" / "new").write_bytes(b"x"),
            lambda: (mnt / "ro-data" / "d").mkdir(),
            lambda: (mnt / "ro-data" / "f").unlink(),
            lambda: os.truncate(mnt / "ro-data" / "f", 0),
            lambda: os.rename(mnt / "ro-data" / "f", mnt / "ro-data" / "g"),
            lambda: os.chmod(mnt / "ro-data" / "f", 0o600),
        ):
            with pytest.raises(OSError) as e:
                attempt()
            assert e.value.errno in (errno.EROFS, errno.EACCES, errno.EPERM), e.value
        with pytest.raises(OSError) as e:  # a write epoch is refused: at the OPEN, or with none sent (no-open,
            with open(mnt / "ro-data" / "f", "r+b") as f:  # docs/design.md) at the first WRITE, which close sends
                f.write(b"x")
        assert e.value.errno == errno.EROFS
        assert (secure.mnt / "ro-data" / "f").read_bytes() == b"readable"
        assert sorted(os.listdir(secure.mnt / "ro-data")) == ["f"]
    finally:
        secure.unmount(mnt)


def test_a_subdir_mount_cannot_reach_outside(secure):
    (secure.mnt / "team-a").mkdir()
    (secure.mnt / "team-b").mkdir()
    (secure.mnt / "team-b" / "secret").write_bytes(b"team b only")
    (secure.mnt / "team-a" / "up").symlink_to("../team-b/secret")
    (secure.mnt / "team-a" / "abs").symlink_to("/team-b/secret")
    key = secure.add_key("team-a", subdir="/team-a")
    mnt = secure.mount_again("team-a-mnt", f"key={key}")  # no subdir option: the key's subtree is the root
    try:
        assert sorted(os.listdir(mnt)) == ["abs", "up"]
        (mnt / "mine").write_bytes(b"a's")
        assert (secure.mnt / "team-a" / "mine").read_bytes() == b"a's"
        # '..' at the mount's root is the mountpoint's parent on this machine, never the cluster's root
        assert sorted(os.listdir(mnt / "..")) == sorted(os.listdir(mnt.parent))
        assert not os.path.exists(mnt / ".." / "team-b")
        for link in ("up", "abs"):  # symlinks resolve on this machine: outside the subtree is not the cluster
            with pytest.raises(OSError):
                (mnt / link).read_bytes()
        assert os.stat(mnt).st_ino == 1
    finally:
        secure.unmount(mnt)
    # asking for another team's directory with this key fails at the daemon
    res = run_cli("mount", secure.meta_address, str(secure.root / "team-a-mnt"), "-o", f"key={key},subdir=/team-b", check=False)
    assert res.returncode != 0 and "outside" in (res.stderr + res.stdout)
    # an unrestricted key may mount a subdir for convenience
    full = secure.mount_again("sub-mnt", f"key={secure.keys / 'mount.key_secret'},subdir=/team-b")
    try:
        assert os.listdir(full) == ["secret"] and (full / "secret").read_bytes() == b"team b only"
    finally:
        secure.unmount(full)


@pytest.mark.parametrize("how", ["key", "mount-option"])
def test_root_squash_never_creates_roots_files(secure, how):
    if how == "key":  # enforced by the daemon for every mount of that key
        options = f"key={secure.add_key('squashed', root_squash=True)}"
    else:  # the mount's own choice
        options = f"key={secure.keys / 'mount.key_secret'},root_squash"
    mnt = secure.mount_again(f"squash-{how}", options)
    try:
        (mnt / f"squash-{how}").mkdir()
        (mnt / f"squash-{how}" / "f").write_bytes(b"x")
        os.chown(mnt / f"squash-{how}" / "f", 0, 0)
        for p in (secure.mnt / f"squash-{how}", secure.mnt / f"squash-{how}" / "f"):
            st = os.stat(p)
            assert (st.st_uid, st.st_gid) == (65534, 65534), p
    finally:
        secure.unmount(mnt)


# -- across network namespaces: a storage node bound beyond loopback ------------------------------

NS = f"sfs-sec-{os.getpid() % 100000}"
SUBNET = f"10.{150 + os.getpid() % 50}.{os.getpid() % 250}"

_PROBE = """
import json, sys, trio, zmq
from stripefs.common import protocol as P
from stripefs.common.errors import StripefsError
from stripefs.common.keyring import load_identity
from stripefs.common.security import use_identity
from stripefs.common.transport import connect
address, key_file, ino = sys.argv[1], sys.argv[2], int(sys.argv[3])
async def main():
    ctx = zmq.Context()
    if key_file:
        use_identity(ctx, load_identity(key_file))
    requests = (P.PingReq(), P.ReadChunkReq(chunk=P.ChunkId(ino, 0, 0), min_version=0, offset=0, length=64))
    out = [None] * len(requests)
    async with connect(ctx, address, timeout=3.0) as node:
        async def ask(i, req):
            try:
                rsp, frames = await node.call(req)
                out[i] = bytes(frames[0]).decode() if frames else type(rsp).__name__
            except StripefsError as exc:
                out[i] = exc.code.name
        async with trio.open_nursery() as nursery:  # both at once: an unanswered one waits out its timeout
            for i, req in enumerate(requests):
                nursery.start_soon(ask, i, req)
    ctx.destroy(linger=0)
    print(json.dumps(out))
trio.run(main)
"""


from util import free_port as _free_port  # noqa: E402  (below the ephemeral range: tests/util.py)


@pytest.fixture
def netns():
    """A network namespace joined to this one by a veth pair: SUBNET.1 here, SUBNET.2 there. Always removed."""
    with veth_namespace(NS, SUBNET, "s"):
        yield NS


@pytest.mark.skipif(shutil.which("ip") is None or os.geteuid() != 0, reason="needs root and iproute2 for a network namespace")
def test_a_node_beyond_loopback_needs_curve_and_serves_only_listed_keys_across_namespaces(secure, netns):
    from conftest import _wait_dead

    port = _free_port()
    node_dir = secure.state / "storage-7"
    (node_dir / "data").mkdir(parents=True)
    plain = (f'node_id = 7\nlisten = "tcp://{SUBNET}.1:{port}"\ndata_dir = "{node_dir / "data"}"\n'
             f'meta = ["{secure.meta_address}"]\nhost = "veth"\nheartbeat_interval_s = 0.5\nreserved_space = 0\nmetrics = ""\n')
    (node_dir / "plain.toml").write_text(plain)
    res = run_cli("storage", "--config", str(node_dir / "plain.toml"), check=False)  # no key: refused, with what to do
    assert res.returncode != 0 and "CURVE is required" in res.stderr and "stripefs keygen" in res.stderr
    key = secure.add_key("storage-7", role="storage")
    (node_dir / "storage.toml").write_text(plain + f'curve_key = "{key}"\nkeyring = "{secure.keys / "keyring.toml"}"\n')
    log = open(secure.state / "logs" / "storage-7.log", "ab")
    proc = subprocess.Popen([sys.executable, "-m", "stripefs", "storage", "--config", str(node_dir / "storage.toml")],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    try:
        address = with_key(f"tcp://{SUBNET}.1:{port}", load_public(secure.keys / "storage-7.key"))
        data = b"across the veth, encrypted" * 2
        ino = 900_000  # a chunk put there directly: the node answers any listed client key
        assert _raw_calls(address, str(secure.keys / "mount.key_secret"), P.PingReq(), timeout=10)[0].role == "storage"
        write = P.WriteChunkReq(chunk=P.ChunkId(ino, 0, 0), version=1, base_version=0, offset=0,
                                xxh3=xxhash.xxh3_64_intdigest(data), replace=True)
        assert isinstance(_raw_calls(address, str(secure.keys / "mount.key_secret"), (write, [data]))[0], P.WriteChunkRsp)
        stranger = str(write_keypair(secure.root / "ns-stranger", force=True)[1])

        def probe(addr, key_file):
            out = subprocess.run(["ip", "netns", "exec", netns, sys.executable, "-c", _PROBE, addr, key_file or "", str(ino)],
                                 capture_output=True, text=True, timeout=60)
            assert out.returncode == 0, out.stderr
            return json.loads(out.stdout)

        with ThreadPoolExecutor(3) as pool:  # the three probes at once: two of them wait out their timeouts
            listed, unlisted, keyless = pool.map(lambda args: probe(*args), [
                (address, str(secure.keys / "mount.key_secret")), (address, stranger), (split_address(address)[0], None)])
        assert listed == ["PingRsp", data[:64].decode()]
        assert unlisted == ["TIMEOUT", "TIMEOUT"]
        assert keyless == ["TIMEOUT", "TIMEOUT"]
        deadline = time.monotonic() + 30  # it registered over CURVE, with its own key in its address
        while not any(n["node_id"] == 7 and n["state"] == "up" and n["address"] == address
                      for n in json.loads(run_cli("status", "--dir", str(secure.state), "--json").stdout)["nodes"]):
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.2)
    finally:
        proc.terminate()
        _wait_dead(proc.pid, timeout=10, kill=True)
        proc.wait()


# -- capabilities: a --subdir cluster whose mount key is restricted to /team-a ---------------------


class SubtreeCluster(SecureCluster):
    def up(self) -> None:  # capabilities live 3 s here, so a test sees them expire and renew
        run_cli("local", "up", "--dir", str(self.state), "--mount", str(self.mnt), "--nodes", str(self.nodes),
                "-o", "allow_other", "--secure", "--subdir", "/team-a", "--set", "meta.chunk_size=256K",
                "--set", "meta.cap_ttl_s=3")


@pytest.fixture(scope="module")
def subtree(request):
    c = SubtreeCluster(cluster_root("stripefs-subtree-"), nodes=2)
    yield from run_cluster(request, c, label="subtree ")


def _chunk_files(state) -> dict[str, str]:
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in state.glob("storage-*/data/**/*") if p.is_file()}


def test_a_subtree_key_reaches_only_its_own_chunks_at_the_nodes(subtree):
    full = subtree.mount_again("admin-mnt", f"key={subtree.keys / 'admin.key_secret'}")  # sees the whole cluster
    try:
        (full / "team-b").mkdir()
        secret = os.urandom(300_000)
        (full / "team-b" / "secret").write_bytes(secret)
        outside = os.stat(full / "team-b" / "secret").st_ino
    finally:
        subtree.unmount(full)
    mine = os.urandom(200_000)
    (subtree.mnt / "mine").write_bytes(mine)  # the --subdir mount's root is /team-a
    own = os.stat(subtree.mnt / "mine").st_ino
    key = str(subtree.keys / "mount.key_secret")
    opened = _raw_calls(subtree.meta_address, key, P.OpenReq(ino=own, session_id=0), P.OpenReq(ino=outside, session_id=0))
    assert opened[0].cap is not None and opened[0].cap.ino == own and opened[1] == ErrorCode.ACCESS
    cap = opened[0].cap
    before = _chunk_files(subtree.state)
    data = b"overwritten by team a" * 10
    nodes = [with_key(f"tcp://127.0.0.1:{n['port']}", load_public(subtree.keys / f"storage-{n['node_id']}.key"))
             for n in subtree.local.info()["nodes"]]  # (status() would ask with the first cluster's admin key)
    for address in nodes:  # a guessed chunk id: with no capability, and with the key's capability for its own file
        chunk = P.ChunkId(outside, 0, 0)
        got = _raw_calls(address, key,
                         P.ReadChunkReq(chunk=chunk, min_version=0, offset=0, length=100),
                         P.ReadChunkReq(chunk=chunk, min_version=0, offset=0, length=100, cap=cap),
                         (P.WriteChunkReq(chunk=chunk, version=1 << 40, base_version=0, offset=0, replace=True,
                                          xxh3=xxhash.xxh3_64_intdigest(data)), [data]),
                         (P.WriteChunkReq(chunk=chunk, version=1 << 40, base_version=0, offset=0, replace=True,
                                          xxh3=xxhash.xxh3_64_intdigest(data), cap=cap), [data]),
                         P.SyncChunksReq(chunks=[chunk], caps=[cap]),
                         P.StatChunkReq(chunk=chunk, cap=cap), timeout=10)
        assert got == [ErrorCode.ACCESS] * 6, got
    assert _chunk_files(subtree.state) == before  # no chunk file changed
    # the admin key (unrestricted) needs no capability: the chunk is there to be read (in the slot of
    # its version's parity, part 0 or 32: common/layout.py "Slots")
    admin = [r for a in nodes for r in _raw_calls(
        a, str(subtree.keys / "admin.key_secret"),
        *(P.ReadChunkReq(chunk=P.ChunkId(outside, 0, part), min_version=0, offset=0, length=100) for part in (0, SLOT_STRIDE)),
        timeout=10)]
    assert any(isinstance(r, P.ReadChunkRsp) for r in admin), admin
    assert "capability" in "".join(text for name, text in subtree.logs().items() if name.startswith("storage"))
    # its own files work through the mount, also past the capabilities' expiry (3 s here): renewed
    first, second = os.urandom(300_000), os.urandom(300_000)
    with open(subtree.mnt / "long", "wb") as f:
        f.write(first)
        f.flush()
        os.fsync(f.fileno())
        time.sleep(4)  # the capability from the create has expired
        f.write(second)
        f.flush()
        os.fsync(f.fileno())
    drop_caches()
    assert (subtree.mnt / "long").read_bytes() == first + second
    assert (subtree.mnt / "mine").read_bytes() == mine
    assert "renewing capabilities" not in subtree.logs().get("mount.log", "")


def test_csi_plugin_keys_come_from_secrets(secure):
    """The CSI plugin on a secure cluster: its own key from a file ($STRIPEFS_KEY, as the manifests mount a
    Secret), a pod's key from NodePublishVolume's secrets (kubelet reads the StorageClass's or the inline
    volume's nodePublishSecretRef). The pod's key is a subtree key: it mounts its volumes and nothing else,
    and its text is never on a command line, in a log, or left in a file."""
    from pathlib import Path

    import grpc

    from stripefs.csi import csi_pb2 as pb

    from csi_plugin import code, run_plugin

    gen = run_plugin(secure, key=str(secure.keys / "admin.key_secret"))
    plugin = next(gen)
    try:
        (secure.mnt / plugin.volumes.lstrip("/")).mkdir()
        (secure.mnt / "other-team").mkdir()
        team_key = Path(secure.add_key("csi-team", subdir=plugin.volumes)).read_text()
        secret_line = next(line for line in team_key.splitlines() if "secret-key" in line)
        vol = plugin.create("pvc-secure", 16 * MiB)
        target = plugin.target("pod-secure")
        plugin.publish(vol.volume_id, target, secrets={"key": team_key})
        try:
            Path(target, "out").write_bytes(b"team data")
            assert (secure.mnt / vol.volume_id.lstrip("/") / "out").read_bytes() == b"team data"
            secret = secret_line.split('"')[1].encode()
            for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
                try:
                    assert secret not in cmdline.read_bytes(), f"the key is on the command line of {cmdline.parent.name}"
                except OSError:
                    pass
            assert not list((plugin.state / "keys").iterdir()), "the key's file stays after the mount started"
            # the team's key reaches no other directory, whatever a pod's author names in an inline volume
            ephemeral = {"csi.storage.k8s.io/ephemeral": "true", "path": "/other-team"}
            outside = plugin.target("pod-outside")
            assert code(lambda: plugin.publish("csi-e1", outside, context=ephemeral, secrets={"key": team_key})) != grpc.StatusCode.OK
            assert not os.path.ismount(outside)
            # and an inline volume without a key of its own is refused: the node's key reaches everything
            assert code(lambda: plugin.publish("csi-e2", plugin.target("pod-nokey"), context=ephemeral)) == grpc.StatusCode.PERMISSION_DENIED
            usage = plugin.stats(vol.volume_id, target)[pb.VolumeUsage.BYTES]
            assert usage.used == len(b"team data") and usage.total == 16 * MiB
        finally:
            plugin.unpublish(vol.volume_id, target)
        plugin.controller.DeleteVolume(pb.DeleteVolumeRequest(volume_id=vol.volume_id))
        assert secret not in plugin.log.read_bytes()
        for log in (plugin.state / "logs").glob("*.log"):
            assert secret not in log.read_bytes(), log
    finally:
        gen.close()
