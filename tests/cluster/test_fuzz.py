"""Property-based fuzzing of every socket of real daemon and storage-node processes.

A cluster of its own (a metadata daemon, 2 storage nodes, a mount) holds a
small dataset written before the fuzzing. Hypothesis then sends, over real
sockets: random frames, mutated valid messages (flipped, cut, inserted bytes,
frames dropped or repeated), valid headers with wrong versions, bodies with
wrong types, and well-typed requests with hostile values (negative sizes,
enormous offsets, out-of-range chunk indices, unknown node ids, bogus inode
numbers, names with NUL or '/', names and paths too long, non-UTF-8 bytes).

Properties: every message gets exactly one reply, never ``INTERNAL`` (a
handler that failed on input is a bug); the process stays up (it answers a
ping after every example); its RSS stays bounded; no stored data changes (the
dataset's checksums read back through the mount, and every chunk file that
existed before the fuzzing, are unchanged).

Requests that change state are only ever aimed at inodes, chunks and nodes
that do not exist (``BOGUS_INO``, ``BOGUS_NODE``), or create names in the
root directory: a well-formed request from an unauthenticated peer is
*allowed* to change things (keys are docs/security.md's subject), so the
fuzzer asks only what must fail or must leave the dataset alone.

Reproducible: ``derandomize=True`` in CI; ``make fuzz`` runs the same tests
with ``STRIPEFS_FUZZ_EXAMPLES`` many examples and random seeds, and the
metadata daemon's again on PostgreSQL (``STRIPEFS_FUZZ_META_STORE=postgresql``:
its burst transactions and the directory holds shared between daemons are a
request path of their own).
"""

from __future__ import annotations

import collections
import hashlib
import os
import time
from pathlib import Path

import msgspec
import pytest
import xxhash
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stripefs.common import protocol as P
from stripefs.common.errors import ErrorCode
from stripefs.common.security import split_address, with_key

from conftest import Cluster, cluster_root, run_cli, run_cluster

EXAMPLES = int(os.environ.get("STRIPEFS_FUZZ_EXAMPLES", "0"))
META_STORE = os.environ.get("STRIPEFS_FUZZ_META_STORE", "sqlite")  # or postgresql (the throwaway server of `local up`)
FUZZ = settings(
    deadline=None,
    derandomize=not EXAMPLES,  # CI: the same examples every run; make fuzz: new ones
    suppress_health_check=list(HealthCheck),
    database=None,
)
REPLY_TIMEOUT_MS = 20_000  # a loaded 2-core machine; a reply that never comes fails the test
RSS_GROWTH_MAX = 96 << 20
LEASE_S = 2.0  # the fuzz cluster's session lease

DATASET = b"dataset-\xe2\x9c\x93-\xff"  # a directory no fuzzed name can hit (non-UTF-8 on purpose)

# -- strategies ----------------------------------------------------------------------

EDGE_INTS = [0, -1, 1, 2**31 - 1, 2**31, 2**32, 2**53 + 1, 2**63 - 1, -(2**63), 2**64 - 1]
HOSTILE_INT = st.one_of(st.sampled_from(EDGE_INTS), st.integers(0, 70), st.integers(0, 2**64 - 1), st.integers(-(2**63), -1))
BOGUS_INO = st.one_of(st.sampled_from([0, -1, 2**63 - 1, 2**64 - 1, -(2**63)]), st.integers(1 << 40, 2**63 - 1))
BOGUS_NODE = st.one_of(st.sampled_from([0, -1, 2**31, 2**63 - 1, 2**64 - 1]), st.integers(10_000, 2**40))
HOSTILE_BYTES = st.one_of(
    st.binary(max_size=40),
    st.sampled_from([b"", b".", b"..", b"a/b", b"/", b"a\0b", b"\0", b"\xff\xfe\xfd", b"x" * 255, b"x" * 256, b"y" * 4096, b"z" * 70_000]),
)
HOSTILE_STR = st.one_of(
    st.text(max_size=30),
    st.sampled_from(["", "tcp://", "tcp://*:0", "tcp://127.0.0.1:1", "tcp://[::1", "ipc://", "udp://x:1", "replicas=0", "ec=0+0",
                     "ec=99+99", "replicas=-1", "drain", "remove", "x" * 5000, "tcp://127.0.0.1:99999"]),
)
BAD_ENDPOINTS = ["", "tcp://", "tcp://*:0", "tcp://[::1", "ipc://", "udp://x:1", "x" * 5000, "tcp://127.0.0.1:99999", "tcp://h:0"]
_real_addresses: list[str] = []  # the cluster's storage nodes, filled in by the fixture
_sessions: list[int] = []  # sessions opened for the fuzzer before it starts
WIRE_INT = st.integers(-(2**63), 2**64 - 1)  # what msgpack can carry
WRONG_TYPE = st.one_of(st.none(), st.booleans(), st.floats(), st.text(max_size=5), st.binary(max_size=5),
                       st.lists(WIRE_INT, max_size=3), st.dictionaries(st.text(max_size=3), WIRE_INT, max_size=2), WIRE_INT)

# requests that only read: they may name real inodes and chunks
READ_ONLY = {
    "ping", "lookup", "lookup_paths", "getattr", "readlink", "readdir", "open", "getxattr", "listxattr", "get_layout",
    "statfs", "status", "alloc_epoch", "hello", "session_heartbeat", "session_end", "close", "read_chunk", "read_chunks", "stat_chunk",
    "node_stats", "verify_chunks", "list_chunks", "sync_chunks", "scrub",
}
# requests naming a parent directory and a name: the root (new names there) or nothing
NAMED = {"create", "mknod", "mkdir", "symlink"}
INO_FIELDS = {"ino", "parent", "new_parent", "parent_old", "parent_new", "shadow", "root"}
NODE_FIELDS = {"node_id", "failed_node"}
# the daemon serves these; the storage nodes serve the rest of P.Request
STORAGE_TAGS = {"ping", "read_chunk", "read_chunks", "write_chunk", "write_chunks", "delete_chunks", "sync_chunks", "stat_chunk", "node_stats",
                "copy_chunk", "reconstruct_fragment", "verify_chunks", "list_chunks", "scrub_start"}
REQUESTS = {cls.__struct_config__.tag: cls for cls in P.Request.__args__}
# what the metadata daemon may never be asked by a stranger, however bogus the target
META_SKIP = {"scrub_start"}


def _value(t, name: str, safe: bool, real_inos: list[int]) -> st.SearchStrategy:
    """A hostile value of msgspec type ``t`` (or, sometimes, of a wrong type)."""
    mi = msgspec.inspect
    if isinstance(t, mi.IntType):
        if name in INO_FIELDS or name == "inos":
            return st.sampled_from(real_inos) | BOGUS_INO if safe else BOGUS_INO
        if name in NODE_FIELDS:
            return BOGUS_NODE
        if name == "session_id" and _sessions:  # live sessions, often: their state outlives the request
            return st.sampled_from(_sessions) | HOSTILE_INT
        return HOSTILE_INT
    if isinstance(t, mi.BytesType):
        return HOSTILE_BYTES
    if isinstance(t, mi.StrType):
        if name in ("sources", "address"):  # a valid address that never answers costs a timeout by design
            return st.sampled_from(BAD_ENDPOINTS + _real_addresses)
        return HOSTILE_STR
    if isinstance(t, mi.BoolType):
        return st.booleans()
    if isinstance(t, mi.FloatType):
        return st.one_of(st.floats(), st.sampled_from([0.0, -1.0, 1e300]))
    if isinstance(t, mi.NoneType):
        return st.none()
    if isinstance(t, mi.UnionType):
        return st.one_of([_value(u, name, safe, real_inos) for u in t.types])
    if isinstance(t, mi.ListType):
        return st.lists(_value(t.item_type, name, safe, real_inos), max_size=6)
    if isinstance(t, mi.TupleType):
        return st.tuples(*[_value(u, name, safe, real_inos) for u in t.item_types])
    if isinstance(t, mi.StructType):
        if t.cls is P.ChunkId:  # a chunk of a real file only when the request cannot change it
            ino = st.sampled_from(real_inos) | BOGUS_INO if safe else BOGUS_INO
            return st.tuples(ino, HOSTILE_INT, HOSTILE_INT).map(list)
        fields = {f.name: _value(f.type, f.name, safe, real_inos) for f in t.fields}
        if t.array_like:
            return st.tuples(*fields.values()).map(list)
        return st.fixed_dictionaries(fields)
    return WRONG_TYPE


@st.composite
def hostile_body(draw, tags: list[str], real_inos: list[int]) -> dict:
    """A request body: the right tag, fields of the right types with hostile values, now and then
    a field of a wrong type, missing or unknown."""
    tag = draw(st.sampled_from(tags))
    if tag == "once":  # a retry wrapper: hostile ids around a hostile inner body (the same rules apply to it)
        inner = draw(hostile_body([t for t in tags if t not in ("once", "batch")], real_inos))
        return {"t": "once", "client_id": draw(HOSTILE_INT), "op_id": draw(HOSTILE_INT),
                "done_below": draw(HOSTILE_INT), "body": inner}
    if tag == "batch":  # many hostile bodies in one message (each checked as if alone; a nested batch refused)
        items = draw(st.lists(hostile_body([t for t in tags if t != "batch"], real_inos), max_size=4))
        if draw(st.integers(0, 9)) == 0:
            items.append({"t": "batch", "items": []})
        return {"t": "batch", "items": items}
    cls = REQUESTS[tag]
    safe = tag in READ_ONLY
    body = {"t": tag}
    for f in msgspec.inspect.type_info(cls).fields:
        if tag in NAMED and f.name == "parent":
            body[f.name] = draw(st.just(1) | BOGUS_INO)  # new names in the root, or nowhere
            continue
        if not f.required and draw(st.integers(0, 3)) == 0:
            continue  # left to its default
        body[f.name] = draw(_value(f.type, f.name, safe, real_inos))
    if tag in NAMED and isinstance(body.get("name"), bytes) and body["name"] == DATASET:
        body["name"] = b"not-the-dataset"
    mutation = draw(st.integers(0, 9))
    if mutation == 0 and len(body) > 1:
        del body[draw(st.sampled_from(sorted(k for k in body if k != "t")))]
    elif mutation == 1 and len(body) > 1 and not safe:
        body[draw(st.sampled_from(sorted(k for k in body if k != "t")))] = draw(WRONG_TYPE)
    elif mutation == 2:
        body[draw(st.text(max_size=8))] = draw(WRONG_TYPE)
    return body


def _encode(version, request_id, body) -> bytes:
    return msgspec.msgpack.encode([version, request_id, body])


@st.composite
def hostile_message(draw, tags: list[str], real_inos: list[int]) -> list[bytes]:
    """The frames of one message (without the identity, which the DEALER adds)."""
    kind = draw(st.integers(0, 13))  # 7..13: well-formed, hostile only in its values
    request_id = draw(st.integers(1, 2**62))
    body = draw(hostile_body(tags, real_inos))
    payloads = draw(st.lists(st.binary(max_size=2048), max_size=2)) if draw(st.booleans()) else []
    if kind == 0:  # random frames
        return draw(st.lists(st.binary(max_size=300), min_size=1, max_size=4))
    if kind == 1:  # another protocol version, maybe another header shape
        version = draw(st.sampled_from([0, 2, 3, -1, 2**63 - 1, 255]))
        extra = draw(st.lists(WRONG_TYPE, max_size=2))
        return [msgspec.msgpack.encode([version, request_id, body, *extra]), *payloads]
    if kind == 2:  # a header that is not [version, id, body]
        return [msgspec.msgpack.encode(draw(WRONG_TYPE)), *payloads]
    if body["t"] == "write_chunk" and draw(st.booleans()):  # a payload that passes its checksum: into the chunk store
        payloads = [draw(st.binary(max_size=70_000))]
        body["xxh3"] = xxhash.xxh3_64_intdigest(payloads[0])
    writes = body.get("writes") if body["t"] == "write_chunks" else None
    if isinstance(writes, list) and draw(st.booleans()):  # a payload per write, each passing its checksum
        payloads = [draw(st.binary(max_size=20_000)) for _ in writes]
        for write, data in zip(writes, payloads):
            if isinstance(write, dict):
                write["xxh3"] = xxhash.xxh3_64_intdigest(data)
    frame = bytearray(_encode(P.PROTOCOL_VERSION, request_id, body))
    if kind == 3 and frame:  # flipped bytes
        for _ in range(draw(st.integers(1, 4))):
            i = draw(st.integers(0, len(frame) - 1))
            frame[i] ^= draw(st.integers(1, 255))
    elif kind == 4:  # truncated
        frame = frame[: draw(st.integers(0, max(0, len(frame) - 1)))]
    elif kind == 5:  # inserted bytes (a msgpack length claiming more than is there, often)
        i = draw(st.integers(0, len(frame)))
        frame[i:i] = draw(st.sampled_from([b"\xdd\xff\xff\xff\xff", b"\xc6\x7f\xff\xff\xff", b"\xdb\xff\xff\xff\xf0"]) | st.binary(min_size=1, max_size=8))
    frames = [bytes(frame), *payloads]
    if kind == 6:  # a multipart message cut short, or padded with extra frames
        frames = frames[:1] if draw(st.booleans()) else frames + [b""] * draw(st.integers(1, 9))
    return frames


# -- the cluster and its dataset --------------------------------------------------------


class FuzzCluster(Cluster):
    def __init__(self):
        super().__init__(cluster_root("stripefs-fuzz-"), nodes=2)
        self.dataset: dict[str, str] = {}
        self.chunk_files: dict[Path, str] = {}
        self.real_inos: list[int] = [1]
        # the fuzzer's garbage is logged (WARNING) by design; ERROR lines stay failures
        self.expected_log_patterns = []

    def up(self) -> None:
        # short leases: state a hostile request left behind (sessions, nodes) expires during the test,
        # so a background task that chokes on it fails here, not an hour later in production
        run_cli("local", "up", "--dir", str(self.state), "--mount", str(self.mnt), "--nodes", str(self.nodes),
                "--set", f"meta.session_lease_s={LEASE_S}", "--set", "meta.node_suspect_s=2", "--set", "meta.node_timeout_s=4",
                "--set", "storage.heartbeat_interval_s=0.5", *(("--meta-store", META_STORE) if META_STORE != "sqlite" else ()))

    def data_dirs(self) -> list[Path]:
        return sorted(self.state.glob("storage-*/data"))

    def storage_addresses(self) -> list[str]:
        return [f"tcp://127.0.0.1:{node['port']}" for node in self.local.info()["nodes"]]


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _write_dataset(c: FuzzCluster) -> None:
    root = c.mnt / os.fsdecode(DATASET)
    root.mkdir()
    sizes = [0, 1, 4095, 65_536 + 3, 300_000, 5 << 20]
    for i, size in enumerate(sizes):
        data = hashlib.shake_256(str(i).encode()).digest(size) if size else b""
        (root / f"file-{i}").write_bytes(data)
    os.symlink(b"file-\xff-target", os.fsencode(root) + b"/link-\xfe")
    (root / "sub").mkdir()
    (root / "sub" / "nested").write_bytes(b"nested" * 1000)
    os.sync()
    for path in sorted(root.rglob("*")):
        if path.is_file() and not path.is_symlink():
            c.dataset[str(path)] = _sha(path)
        c.real_inos.append(os.lstat(path).st_ino)
    c.real_inos.append(os.stat(root).st_ino)
    for d in c.data_dirs():
        for f in sorted((d / "chunks").rglob("*")):
            if f.is_file():
                c.chunk_files[f] = _sha(f)
    assert c.chunk_files, "the dataset left no chunk files on the storage nodes"
    _real_addresses[:] = c.storage_addresses()


@pytest.fixture(scope="module")
def fuzz_cluster(request):
    yield from run_cluster(request, FuzzCluster(), after_up=_write_dataset, label="fuzz ")


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


class Peer:
    """A raw DEALER socket: sends any frames, waits for the one reply (blocking pyzmq)."""

    def __init__(self, ctx: zmq.Context, address: str):
        self.address = address
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVTIMEO, REPLY_TIMEOUT_MS)
        self.sock.connect(address)

    def ask(self, frames: list[bytes]) -> P.Msg:
        self.sock.send_multipart(frames)
        try:
            reply = self.sock.recv_multipart()
        except zmq.Again:
            raise AssertionError(f"no reply from {self.address} within {REPLY_TIMEOUT_MS} ms to {frames!r:.300}") from None
        _, body = P.decode_reply(reply[0])
        return body

    def ping(self) -> P.Msg:
        body = self.ask([P.encode(1, P.PingReq())])
        assert isinstance(body, P.PingRsp), body
        return body

    def close(self) -> None:
        self.sock.close(linger=0)


def _check_reply(body: P.Msg, frames: list[bytes]) -> str:
    if isinstance(body, P.ErrorRsp):
        assert body.code != ErrorCode.INTERNAL, f"INTERNAL error for {frames!r:.400}: {body.message}"
        return getattr(ErrorCode(body.code), "name", str(body.code)) if body.code in ErrorCode._value2member_map_ else str(body.code)
    return type(body).__name__


def _fuzz_endpoint(c: FuzzCluster, address: str, pid: int, tags: list[str], examples: int) -> None:
    ctx = zmq.Context()
    peer = Peer(ctx, address)
    try:
        peer.ping()
        rss_before = _rss(pid)

        seen = collections.Counter()

        @settings(FUZZ, max_examples=EXAMPLES or examples)
        @given(hostile_message(tags, c.real_inos))
        def fuzz(frames):
            seen[_check_reply(peer.ask(frames), frames)] += 1

        fuzz()
        print(f"fuzzing {address}: replies {dict(seen.most_common())}")
        # the fuzzer got past decoding into the handlers: they refused on the values, or answered
        reached = {k for k in seen if k not in ("BAD_REQUEST", "VERSION_MISMATCH", "UNKNOWN_MESSAGE")}
        assert len(reached) >= 3, f"the fuzzer hardly reached the handlers: {dict(seen)}"
        peer.ping()  # still up, still answering
        growth = _rss(pid) - rss_before
        assert growth < RSS_GROWTH_MAX, f"RSS of pid {pid} grew by {growth >> 20} MiB during fuzzing"
    finally:
        peer.close()
        ctx.term()


def _assert_dataset_unchanged(c: FuzzCluster) -> None:
    for path, digest in c.dataset.items():
        assert _sha(Path(path)) == digest, f"{path} changed"
    for f, digest in c.chunk_files.items():
        assert f.exists() and _sha(f) == digest, f"chunk file {f} changed"


def test_metadata_daemon_survives_hostile_input(fuzz_cluster):
    c = fuzz_cluster
    tags = sorted(t for t in REQUESTS if t not in META_SKIP)  # every request type: the daemon must refuse storage ones too
    ctx = zmq.Context()
    try:
        peer = Peer(ctx, c.meta_address)
        _sessions[:] = [peer.ask([P.encode(1, P.HelloReq(host="fuzz", pid=i))]).session_id for i in range(3)]
        peer.close()
    finally:
        ctx.term()
    _fuzz_endpoint(c, c.meta_address, c.pids()["meta"], tags, examples=2000)
    # the sessions and nodes the fuzzer made up expire, their inodes are released: the daemon lives on
    time.sleep(2 * LEASE_S + 1.5)
    ctx = zmq.Context()
    try:
        peer = Peer(ctx, c.meta_address)
        peer.ping()
        peer.close()
    finally:
        ctx.term()
    _assert_dataset_unchanged(c)


def test_metadata_read_lane_survives_hostile_input(fuzz_cluster):
    """The daemon's read lane (daemon/read_lane.py: a socket and thread of its own, common/fast_lane.py)
    answers lone reads itself and forwards everything else to serve(): hostile frames there too."""
    c = fuzz_cluster
    ctx = zmq.Context()
    try:
        peer = Peer(ctx, c.meta_address)
        port = peer.ping().read_port
        peer.close()
    finally:
        ctx.term()
    if not port:
        pytest.skip("this daemon has no read lane (PostgreSQL)")
    endpoint, key = split_address(c.meta_address)
    lane = with_key(f"{endpoint.rsplit(':', 1)[0]}:{port}", key)
    tags = sorted(t for t in REQUESTS if t not in META_SKIP)
    _fuzz_endpoint(c, lane, c.pids()["meta"], tags, examples=1000)
    _assert_dataset_unchanged(c)


def test_storage_node_survives_hostile_input(fuzz_cluster):
    c = fuzz_cluster
    tags = sorted(STORAGE_TAGS)
    _fuzz_endpoint(c, c.storage_addresses()[0], c.pids()["storage"]["1"], tags, examples=1000)
    _assert_dataset_unchanged(c)


def test_a_flooding_peer_does_not_starve_others(fuzz_cluster):
    """One connection sends thousands of requests without reading a reply: another peer's
    ping is still answered, and the flooder gets BUSY for what exceeds its queue."""
    c = fuzz_cluster
    ctx = zmq.Context()
    flood = ctx.socket(zmq.DEALER)
    flood.setsockopt(zmq.LINGER, 0)
    flood.setsockopt(zmq.SNDHWM, 0)
    flood.connect(c.meta_address)
    other = Peer(ctx, c.meta_address)
    try:
        pid = c.pids()["meta"]
        rss_before = _rss(pid)
        request = P.encode(7, P.GetattrReq(ino=1))
        for _ in range(3000):
            flood.send_multipart([request])
        assert isinstance(other.ping(), P.PingRsp)
        codes = []
        flood.setsockopt(zmq.RCVTIMEO, REPLY_TIMEOUT_MS)
        for _ in range(3000):
            _, body = P.decode_reply(flood.recv_multipart()[0])
            codes.append(getattr(body, "code", 0))
        assert ErrorCode.INTERNAL not in codes
        assert _rss(pid) - rss_before < RSS_GROWTH_MAX
        other.ping()
    finally:
        flood.close(linger=0)
        other.close()
        ctx.term()
    _assert_dataset_unchanged(c)
