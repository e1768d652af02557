"""The stripefs wire protocol: every message, the frame layout, the version.

Frames
------
A message is a ZeroMQ multipart message::

    frame 0      header: msgpack array [PROTOCOL_VERSION, request_id, body]
    frame 1..n   raw payload bytes (chunk data); never msgpack-encoded

``body`` is one of the structs below, msgpack-encoded as a map with a ``t``
tag naming the message type (``{"t": "read_chunk", ...}``). Servers bind a
ROUTER socket (which prepends the peer identity frame); clients connect a
DEALER socket and match replies to requests by ``request_id``, so any number
of requests may be in flight on one socket and replies may come back in any
order.

Rules
-----
* Every request gets exactly one reply: the message's ``...Rsp`` or an
  ``ErrorRsp`` carrying an ``ErrorCode`` (common/errors.py). A server never
  crashes on input: a header that does not decode, a wrong version, an unknown
  type or a bad field gets ``ErrorRsp(BAD_REQUEST | VERSION_MISMATCH |
  UNKNOWN_MESSAGE)`` and a log line. A header too broken to carry a
  request_id is answered with request_id 0.
* A version mismatch is refused, never guessed at: peers of different protocol
  versions do not talk.
* Clients time out every request (``rpc_timeout``) and retry idempotent ones.
  ZeroMQ reconnects by itself after a peer restarts; a request lost in the
  restart times out and is retried.
* Payload frames are listed in each message's docstring. Their integrity is
  carried in the header (``xxh3`` = xxh3_64 of the payload).
* Limits (common/limits.py): a request header of more than
  ``MAX_HEADER_BYTES`` (a reply's: ``MAX_REPLY_HEADER_BYTES``) is refused
  before decoding; a frame larger than a chunk or a header drops the
  connection (ZMQ_MAXMSGSIZE); lists that handlers iterate over have a
  ``max_length`` below (``Max``); a peer with too many requests waiting gets
  ``BUSY``; a handler running past the server's ``request_timeout_s`` is
  answered ``TIMEOUT``.

Versions
--------
* ``PROTOCOL_VERSION``: checked on every message, first. Element 0 of the
  header array is the protocol version in every version, past and future, and
  it is the only thing a peer may rely on: a server reads it before anything
  else (``_Version``, which ignores the rest of the array), so a newer peer
  whose header has another shape still gets ``ErrorRsp(VERSION_MISMATCH,
  "protocol version 2 is not 1: ...")``, encoded in the server's version with
  the request id when it can be read (0 otherwise). Change feed frames follow
  the same rule (``[version, event]``); a mount drops its cache on one.
* What needs a new version: any change to the frame layout, to the header
  array, to a field's type or meaning, or a removed field. What does not: a
  new message type (an old server answers ``UNKNOWN_MESSAGE``) and a new
  field with a default at the end of a message (old peers ignore unknown
  fields; new peers fill the default).
* Version 2 (issue 35, per-fragment versions): ``ChunkRef.version`` of an
  erasure-coded stripe became the stripe's newest, with ``fversions`` giving
  each fragment's own; a version-1 peer would read every fragment at
  ``version``, so the two do not talk.
* Chunk versions: every write session gets a fresh, cluster-wide increasing
  *epoch* from the metadata daemon (``AllocEpochReq``); data written in that
  session carries the epoch as its chunk version. The metadata daemon records
  each chunk's committed version at ``CommitReq``. A storage node refuses to
  serve a copy older than the version asked for (``STALE``), so a node that
  missed writes can never serve stale data. Version 0 means "no data" (a hole).

Chunk ids
---------
``ChunkId(ino, index, part)``: the ``index``-th chunk of file ``ino``; ``part``
is the copy's *slot* plus, for erasure-coded chunks, the fragment number:
copy or fragment ``j`` of version ``v`` is part ``j + 32 * (v & 1)``
(common/layout.py "Slots"; a replica is ``j = 0``, so part 0 or 32). A writer
puts a new version in the slot the committed version does not use, so the
committed copies are never overwritten before the commit (copy-on-write).
Inode numbers are never reused, so a chunk id names one piece of one file
forever.
"""

from __future__ import annotations

import re
from typing import Annotated, TypeVar, Union

import msgspec

PROTOCOL_VERSION = 2

#: requests larger than this (header frame) are refused before decoding
MAX_HEADER_BYTES = 1 << 20
#: replies may be larger (a directory listing with chunk maps); only clients decode them
MAX_REPLY_HEADER_BYTES = 64 << 20

#: the most items of a request list a handler walks through (chunk ids, inodes, chunk refs):
#: a 1 MiB header could otherwise expand to a million Python objects held while it waits
MAX_LIST = 65536
#: the most storage node addresses named in one request (repair sources)
MAX_SOURCES = 64
#: the most nodes of one chunk (replicas, or K+M fragments)
MAX_CHUNK_NODES = 64
#: paths resolved by one LookupPathsReq (the client sends 256 at a time)
MAX_LOOKUP_PATHS = 4096
#: names (path components) one LookupPathsReq may ask the daemon to look up, all paths together:
#: 16 per path of a full request. A 1 MiB header could otherwise name 500,000 ("a/a/a/...").
MAX_LOOKUP_NAMES = 65536
#: the metadata store's integers are signed 64-bit
INT64_MAX = (1 << 63) - 1
#: the longest path (PATH_MAX, including its NUL) and the longest name (NAME_MAX)
PATH_MAX = 4096
NAME_MAX = 255

_T = TypeVar("_T")
#: a request list of at most ``MAX_LIST`` items
Max = Annotated[list[_T], msgspec.Meta(max_length=MAX_LIST)]


class Msg(msgspec.Struct, tag_field="t", frozen=True, kw_only=True):
    """Base of every message body."""


class ChunkId(msgspec.Struct, frozen=True, array_like=True):
    ino: int
    index: int
    part: int = 0

    def __str__(self) -> str:
        return f"{self.ino}:{self.index}:{self.part}"


class Cap(msgspec.Struct, frozen=True, array_like=True):
    """A capability: the metadata daemon's signed word that ``key`` may read (``write``: and write)
    the chunks of inode ``ino`` until ``expires`` (Unix seconds). Issued only to subtree-restricted
    keys, checked by storage nodes for them only (common/capability.py)."""

    ino: int
    write: bool
    expires: int
    key: Annotated[str, msgspec.Meta(max_length=64)]  # the Z85 public key it was issued to
    mac: Annotated[bytes, msgspec.Meta(max_length=64)]


class Layout(msgspec.Struct, frozen=True):
    """How a file is cut and protected; fixed at creation, inherited from its directory.

    ``redundancy`` is ``"replicas=R"`` or ``"ec=K+M"`` (common/layout.py parses it).
    """

    chunk_size: int
    stripe_count: int
    redundancy: str


class Attr(msgspec.Struct, frozen=True, array_like=True):
    ino: int
    mode: int
    nlink: int
    uid: int
    gid: int
    rdev: int
    size: int
    atime_ns: int
    mtime_ns: int
    ctime_ns: int
    generation: int = 0


class ChunkRef(msgspec.Struct, frozen=True, array_like=True):
    """Where one chunk of a file lives, and its committed version (0: never written).

    ``fversions``: an erasure-coded stripe's version per fragment (position j's fragment is
    stored at ``fragment_part(j, fversions[j])``), for a stripe whose fragments did not all
    move with the last write; empty (the usual case, and every replicated chunk): every fragment
    is at ``version``. ``version`` is the stripe's newest (the last commit's); a fragment's own
    is never newer. Read it with ``fragment_version``, never from ``version`` alone.
    """

    index: int
    version: int
    nodes: Annotated[list[int], msgspec.Meta(max_length=MAX_CHUNK_NODES)]
    #: a snapshot's chunk still shared with the live file (daemon/snapshots.py): its bytes are the
    #: copies stored under this inode's chunk ids (``data_ino(ino, ref)``); 0: under the file's own
    data_ino: int = 0
    fversions: Annotated[list[int], msgspec.Meta(max_length=MAX_CHUNK_NODES)] = []

    def fragment_version(self, j: int) -> int:
        """The version fragment (or copy) ``j`` of this chunk is stored at."""
        return fragment_version(self.version, self.fversions, j)


def fragment_version(version: int, fversions, j: int) -> int:
    """Fragment ``j``'s own version in a chunk row of ``version`` with ``fversions`` (ChunkRef):
    its entry, or the row's version where the row lists none (every fragment moved together)."""
    return fversions[j] if j < len(fversions) else version


def uniform_fversions(version: int, fversions) -> list[int]:
    """``fversions`` as stored: empty when every fragment is at ``version`` (the common case costs nothing)."""
    return [] if all(v == version for v in fversions) else list(fversions)


def data_ino(ino: int, ref: ChunkRef) -> int:
    """The inode whose chunk ids hold the bytes of chunk ``ref`` of file ``ino``."""
    return ref.data_ino or ino


#: a storage node address on the wire: a ZeroMQ TCP endpoint, or IPC for tests on one machine
#: (with CURVE, followed by ``?key=`` and the server's 40-character Z85 public key: common/security.py)
_ENDPOINT = re.compile(
    r"(tcp://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):([0-9]{1,5})|ipc://[^\0?]{1,100})"
    r"(\?key=[0-9a-zA-Z.\-:+=^!/*?&<>()\[\]{}@%$#]{40})?"
)


def is_endpoint(address: str) -> bool:
    """Whether ``address`` is an endpoint a peer may be told to connect to (tcp://HOST:PORT, ipc://PATH).

    Anything else (a wildcard, a bind-only form, garbage) would make libzmq's
    connect fail: addresses from the wire are checked with this first.
    """
    m = _ENDPOINT.fullmatch(address)
    return m is not None and (m.group(3) is None or 0 < int(m.group(3)) < 65536)


class NodeAddr(msgspec.Struct, frozen=True, array_like=True):
    node_id: int
    address: str


class DirEntry(msgspec.Struct, frozen=True, array_like=True):
    name: bytes
    attr: Attr
    cookie: int  # pass back as ReaddirReq.after to continue after this entry


class LayoutUsage(msgspec.Struct, frozen=True):
    """Space used by the files of one redundancy (StatusRsp)."""

    redundancy: str
    files: int
    logical_bytes: int
    raw_bytes: int  # estimated from the metadata: copies or fragments, without chunk file headers
    degraded_stripes: int = 0  # EC stripes with a missing fragment, waiting for reconstruction


class NodeInfo(msgspec.Struct, frozen=True):
    node_id: int
    address: str
    host: str
    state: str  # "up" | "suspect" | "down" | "draining" | "removed" (daemon/health.py)
    capacity_bytes: int
    free_bytes: int
    used_bytes: int  # bytes of chunk files stored
    chunks: int
    last_heartbeat_age_s: float
    placed_chunks: int = -1  # chunk copies the namespace places on it (last repair scan; -1 unknown)
    filesystem: str = ""  # the file system its data is on (common/space.py): shared ones count once


# --------------------------------------------------------------------------
# Generic
# --------------------------------------------------------------------------


class PingReq(Msg, tag="ping"):
    pass


class PingRsp(Msg, tag="ping_rsp"):
    role: str  # "meta" | "storage"
    node_id: int = 0
    boot_id: str = ""
    events_port: int = 0  # meta: its change feed (PUB), on the host of its address; 0: none
    events_seq: int = 0  # meta: the last change event published before this reply
    events_log: str = ""  # meta: the change log's id, ChangeEvent.boot_id on its feed (daemon/change_log.py)
    read_port: int = 0  # meta: its read lane (daemon/read_lane.py), on the host of its address; 0: none


class OkRsp(Msg, tag="ok"):
    pass


class ChangedRsp(Msg, tag="changed_rsp"):
    """Reply to a namespace change that returns no file (UnlinkReq, RmdirReq, RenameReq):
    the directories it changed, as AttrRsp.dir_attrs."""

    dir_attrs: list[Attr] = []
    seq: int = 0


class ErrorRsp(Msg, tag="error"):
    code: int  # common.errors.ErrorCode
    message: str = ""


# --------------------------------------------------------------------------
# Storage node: clients and the metadata daemon talk to it directly
# --------------------------------------------------------------------------

MAX_BATCH_READS = 64


class ReadChunkReq(Msg, tag="read_chunk"):
    """Read ``length`` bytes at ``offset`` of a chunk.

    Reply: ReadChunkRsp + 1 payload frame (may be shorter than asked: past the
    chunk's stored length the file is a hole; the client pads with zeros).
    Errors: NOT_FOUND (no copy), STALE (copy older than ``min_version``),
    CORRUPT (a block failed its checksum; the copy is reported bad).
    """

    chunk: ChunkId
    min_version: int
    offset: int
    length: int
    cap: Cap | None = None  # subtree keys: a capability for chunk.ino (common/capability.py)


class ReadChunkRsp(Msg, tag="read_chunk_rsp"):
    version: int
    xxh3: int  # xxh3_64 of the payload frame


class ReadChunksReq(Msg, tag="read_chunks"):
    """Several whole reads in one request (prefetch of small files: one round trip, not one each).

    Reply: ReadChunksRsp with one ``ChunkRead`` per read, in order, and one
    payload frame per read (empty for a read that failed: its ``code`` says why,
    as ErrorRsp would for a ReadChunkReq). At most ``MAX_BATCH_READS`` reads.
    """

    reads: Annotated[list[ReadChunkReq], msgspec.Meta(max_length=MAX_BATCH_READS)]


class ChunkRead(msgspec.Struct, frozen=True, array_like=True):
    version: int
    xxh3: int  # of its payload frame
    code: int = 0  # an ErrorCode when this read failed
    message: str = ""


class ReadChunksRsp(Msg, tag="read_chunks_rsp"):
    results: list[ChunkRead]


class WriteChunkReq(Msg, tag="write_chunk"):
    """Write payload frame 1 at ``offset`` into a chunk, making version ``version``.

    * ``replace``: the payload is the whole chunk content (offset must be 0);
      the node's previous copy, whatever its version, is discarded.
    * otherwise the node merges the payload into the chunk's current bytes:
      those of its copy of ``chunk`` when that copy is already at least
      ``version`` (an earlier range of the same session) or exactly
      ``base_version``; else those of the copy in the other slot of the same
      chunk (``part ^ 32``: the committed version, copy-on-write), which must
      be at least ``base_version`` (the committed version the writer read from
      the metadata daemon; 0 = the chunk may not exist yet, and a copy of
      another version in this slot - an abandoned session's - is not merged).
      No such copy -> STALE, and the writer then sends the whole chunk with
      ``replace``.
    * ``truncate`` >= 0: cut (or zero-extend) the chunk to that length after
      applying the payload.
    * ``sync``: fsync the chunk file and its directory before replying.

    The stored version becomes max(stored, ``version``). A chunk file is
    replaced atomically (write, fsync if asked, rename): never half-written.
    Reply: WriteChunkRsp. Errors: STALE, NO_SPACE, IO, BAD_REQUEST.
    """

    chunk: ChunkId
    version: int
    base_version: int
    offset: int
    xxh3: int  # xxh3_64 of the payload frame; checked before anything is written
    replace: bool = False
    truncate: int = -1
    sync: bool = False
    cap: Cap | None = None  # subtree keys: a writing capability for chunk.ino


class WriteChunkRsp(Msg, tag="write_chunk_rsp"):
    version: int
    length: int  # stored length of the chunk after the write


#: the most chunk writes one WriteChunksReq carries, and their payload bytes together
MAX_BATCH_WRITES = 64
MAX_BATCH_WRITE_BYTES = 16 << 20


class WriteChunksReq(Msg, tag="write_chunks"):
    """Several chunk writes in one request, made durable together (small files written back).

    Each item is a ``WriteChunkReq`` with its own header fields, applied as that
    request would be; payload frame ``i`` is item ``i``'s payload. At most
    ``MAX_BATCH_WRITES`` items and ``MAX_BATCH_WRITE_BYTES`` of payloads.
    ``sync`` (or any item's own ``sync``): the node writes every item without a
    sync of its own and then makes the whole batch durable with one ``syncfs``
    of its data file system before replying (an ``fsync`` per file where
    syncfs is missing). Every chunk file is still replaced atomically, so
    after a crash each item's chunk is its old or its new copy.

    Reply: WriteChunksRsp, one ``ChunkWritten`` per item in order; an item that
    failed carries its error code (STALE, NO_SPACE, IO, BAD_REQUEST: a payload
    failing its xxh3 writes nothing of that item) and the others are applied.
    A sync that fails answers IO for every item it covered. The request as a
    whole is refused (ErrorRsp) for a wrong number of payload frames, too many
    bytes, or a key or capability that may not write one of its chunks.
    """

    writes: Annotated[list[WriteChunkReq], msgspec.Meta(max_length=MAX_BATCH_WRITES)]
    sync: bool = False


class ChunkWritten(msgspec.Struct, frozen=True, array_like=True):
    version: int
    length: int  # stored length of the chunk after the write
    code: int = 0  # an ErrorCode when this write failed (then nothing of it was written)
    message: str = ""


class WriteChunksRsp(Msg, tag="write_chunks_rsp"):
    results: list[ChunkWritten]


class DeleteChunksReq(Msg, tag="delete_chunks"):
    """Delete chunk copies (all their parts when ``all_parts``). Missing ones are fine.

    ``max_versions`` (one per chunk, or empty for "any version"): a copy is
    deleted only if its stored version is at most the bound. A chunk id that was
    rewritten after it became garbage (truncate, then write again) carries a
    newer epoch, so a late delete cannot destroy it.
    """

    chunks: Max[ChunkId]
    all_parts: bool = True
    max_versions: Max[int] = []


class DeleteChunksRsp(Msg, tag="delete_chunks_rsp"):
    deleted: int


class SyncChunksReq(Msg, tag="sync_chunks"):
    """fsync chunk files written earlier without ``sync`` (the client's fsync()). Reply: OkRsp.

    Chunks this node does not hold are ignored (a later read fails over anyway).
    """

    chunks: Max[ChunkId]
    caps: Max[Cap] = []  # subtree keys: a writing capability for each inode in ``chunks``


class StatChunkReq(Msg, tag="stat_chunk"):
    chunk: ChunkId
    cap: Cap | None = None  # subtree keys: a capability for chunk.ino


class StatChunkRsp(Msg, tag="stat_chunk_rsp"):
    version: int
    length: int


class NodeStatsReq(Msg, tag="node_stats"):
    pass


class NodeStatsRsp(Msg, tag="node_stats_rsp"):
    node_id: int
    capacity_bytes: int
    free_bytes: int
    used_bytes: int
    chunks: int
    filesystem: str = ""  # as in RegisterNodeReq


# --------------------------------------------------------------------------
# Metadata daemon: storage nodes
# --------------------------------------------------------------------------


class RegisterNodeReq(Msg, tag="register_node"):
    """A storage node announces itself at start and after the daemon restarts."""

    node_id: int
    address: str  # where clients reach it, e.g. tcp://127.0.0.1:7101
    host: str  # failure domain label: replicas go to distinct hosts
    capacity_bytes: int
    free_bytes: int
    used_bytes: int
    chunks: int
    filesystem: str = ""  # which file system capacity and free are of (common/space.py); "" unknown


class NodeHeartbeatReq(Msg, tag="node_heartbeat"):
    node_id: int
    capacity_bytes: int
    free_bytes: int
    used_bytes: int
    chunks: int
    filesystem: str = ""  # as in RegisterNodeReq


# replies: OkRsp


# --------------------------------------------------------------------------
# Metadata daemon: clients (the namespace)
# --------------------------------------------------------------------------


class HelloReq(Msg, tag="hello"):
    """A mount opens a session. Its open files are reported by SessionHeartbeatReq."""

    host: str
    pid: int
    mountpoint: str = ""
    subdir: bytes = b""  # expose only this directory (absolute path); HelloRsp.root_ino is its inode
    client_id: int = 0  # the OnceReq client id of this mount: its own changes never wait for its callbacks


class HelloRsp(Msg, tag="hello_rsp"):
    session_id: int
    lease_s: float  # send SessionHeartbeatReq at least this often
    boot_id: str  # changes when the daemon restarts
    root_ino: int = 1
    cluster_id: str = ""  # fixed when the metadata database is created (names the mount's disk cache)
    writer: int = 0  # the change feed's name for this mount's own changes (ChangeEvent.writer, writer_tag)
    callbacks: bool = False  # this daemon grants callbacks (SQLite: files too; PostgreSQL: directories only)
    marks: bool = True  # ... and write marks (closes may send nothing); not on PostgreSQL


class SessionHeartbeatReq(Msg, tag="session_heartbeat"):
    """The full set of inodes this session has open; replaces the previous set."""

    session_id: int
    # kept by the daemon and reclaimed later: checked now, not when the session expires
    open_inodes: Annotated[list[Annotated[int, msgspec.Meta(ge=1, le=INT64_MAX)]], msgspec.Meta(max_length=4 * MAX_LIST)]


class SessionEndReq(Msg, tag="session_end"):
    """The mount unmounted: its session ends now rather than at its lease's end (its open files,
    callbacks and delegated inode numbers go at once; daemon/health.py). Reply: OkRsp."""

    session_id: int


class LookupReq(Msg, tag="lookup"):
    """Resolve a name. Reply: AttrRsp, or OpenRsp for a regular file when ``open_info``.

    With ``open_info`` the reply carries everything an open needs (layout, chunk
    map, node addresses), and the inode joins the session's open set until the
    session's next heartbeat says otherwise: a mount that opens a file right
    after looking it up needs no OpenReq, and the data stays while it reads.
    """

    parent: int
    name: bytes
    open_info: bool = False
    session_id: int = 0
    # ask for a callback on a regular file (daemon/callbacks.py): the reply's ``callback``
    # says whether the daemon will wait for this session before changing the file or its name
    callback: bool = False


class AckReq(Msg, tag="ack"):
    """The session applied the change feed up to ``seq`` and dropped from the kernel what it
    changed (daemon/callbacks.py). ``everything``: it dropped all it cached (a gap, a restart)
    and holds no callback any more. ``open_inodes``: files among those just dropped that it
    has open (they join its open set, as after an OpenReq). Reply: OkRsp."""

    session_id: int
    seq: Annotated[int, msgspec.Meta(ge=0, le=INT64_MAX)]
    everything: bool = False
    open_inodes: Annotated[list[Annotated[int, msgspec.Meta(ge=1, le=INT64_MAX)]], msgspec.Meta(max_length=MAX_LIST)] = []
    client_id: int = 0
    #: not an acknowledgement yet: the session is committing what it wrote to files a change waits
    #: for (a close that sent nothing) and acknowledges once that is stored; the daemon waits on
    #: for it, ``COMMITTING_S`` from each such notice, up to ``COMMIT_WAIT_S`` (daemon/callbacks.py)
    committing: bool = False


class LookupPathsReq(Msg, tag="lookup_paths"):
    """Resolve many paths (relative to ``root``) at once: sampler-order prefetch.

    Reply: LookupPathsRsp with one entry per path: the OpenRsp of a regular
    file, or None (missing, not a regular file, not resolvable). Nothing joins
    the session's open set: a prefetch of a file deleted meanwhile just fails.
    """

    root: int
    paths: Annotated[list[bytes], msgspec.Meta(max_length=MAX_LOOKUP_PATHS)]


class LookupPathsRsp(Msg, tag="lookup_paths_rsp"):
    files: list[Union[OpenRsp, None]]


class GetattrReq(Msg, tag="getattr"):
    ino: int
    # the asking mount's session: a directory another session creates in asynchronously is
    # recalled first (daemon/callbacks.py ``recall_needed``), not one this session holds
    session_id: int = 0


class SetattrReq(Msg, tag="setattr"):
    """Change attributes; fields left None are unchanged.

    ``size``: truncation. Chunks wholly past the new size are dropped by the
    daemon; the client has already cut the boundary chunk on its replicas and
    passes its new version in ``chunks``.
    """

    ino: int
    mode: int | None = None  # permission bits only; the file type never changes
    uid: int | None = None
    gid: int | None = None
    size: int | None = None
    atime_ns: int | None = None
    mtime_ns: int | None = None
    ctime_ns: int | None = None
    chunks: Max[ChunkRef] = []


class AttrRsp(Msg, tag="attr_rsp"):
    attr: Attr
    # replies to a change (MkdirReq, SetattrReq...): the attributes of the directories it changed,
    # read right after it, and the change log position they are as of (its own change's number;
    # 0: unknown, e.g. a retry answered from applied_ops or a shared database). A mount answers
    # GETATTR of those directories from them until the change feed says otherwise (client/dir_attrs.py)
    dir_attrs: list[Attr] = []
    seq: int = 0
    # LookupReq with ``callback``: the change log position this answer is as of, granted a
    # callback (the daemon waits for this session's AckReq before a later change of the file
    # or its name is answered); -1: no callback, cache as before (daemon/callbacks.py)
    callback: int = -1


class CreateReq(Msg, tag="create"):
    """Create and open a regular file. Reply: OpenRsp (with chunk 0 allocated)."""

    parent: int
    name: bytes
    mode: int
    uid: int
    gid: int
    session_id: int
    exclusive: bool = True
    # ask for a callback on the new file and its name (as LookupReq.callback): OpenRsp.callback
    callback: bool = False
    # the new file's inode number, from a range delegated to ``session_id`` (DelegateInodesReq);
    # 0: the daemon's next. A number outside the session's ranges is refused (INVALID). (Not
    # ``ino``: daemon/access.py checks those fields as inodes that exist.)
    new_ino: int = 0


class MknodReq(Msg, tag="mknod"):
    """Regular files, FIFOs, sockets and device nodes. Reply: AttrRsp."""

    parent: int
    name: bytes
    mode: int
    rdev: int
    uid: int
    gid: int


class MkdirReq(Msg, tag="mkdir"):
    parent: int
    name: bytes
    mode: int
    uid: int
    gid: int
    # a callback on the new directory's names for this session (it knows them all: none);
    # AttrRsp.callback is its seq (daemon/callbacks.py)
    session_id: int = 0
    callback: bool = False
    new_ino: int = 0  # as CreateReq.new_ino: a number delegated to ``session_id``


class SymlinkReq(Msg, tag="symlink"):
    parent: int
    name: bytes
    target: bytes
    uid: int
    gid: int


class LinkReq(Msg, tag="link"):
    ino: int
    new_parent: int
    new_name: bytes


class UnlinkReq(Msg, tag="unlink"):
    """Remove a name. The inode's data is reclaimed once no name and no session refers to it."""

    parent: int
    name: bytes


class RmdirReq(Msg, tag="rmdir"):
    parent: int
    name: bytes


class RenameReq(Msg, tag="rename"):
    """flags: 0, RENAME_NOREPLACE (1) or RENAME_EXCHANGE (2), as renameat2(2)."""

    parent_old: int
    name_old: bytes
    parent_new: int
    name_new: bytes
    flags: int = 0


class ReadlinkReq(Msg, tag="readlink"):
    ino: int


class ReadlinkRsp(Msg, tag="readlink_rsp"):
    target: bytes


class ReaddirReq(Msg, tag="readdir"):
    """Entries of directory ``ino`` after cookie ``after`` (0: from the start).

    ``open_info``: also the open information (layout, chunk map) of every
    regular file listed, in ``ReaddirRsp.files``: a dataset mount that lists a
    tree then opens its files without one round trip each. ``small_only``:
    only of files of at most one chunk (a mount's read hints, client/dir_hints.py).
    """

    ino: int
    after: int = 0
    limit: int = 1000
    open_info: bool = False
    small_only: bool = False
    # callbacks on the regular files listed (daemon/callbacks.py), for this session
    session_id: int = 0
    callback: bool = False


class ReaddirRsp(Msg, tag="readdir_rsp"):
    entries: list[DirEntry]
    more: bool
    files: list[OpenRsp] = []  # with open_info: one per regular file in ``entries``
    callback: int = -1  # ReaddirReq with ``callback``: every regular file listed is held, as AttrRsp.callback
    # ... and, when the whole directory fits in this reply (``after`` 0, not ``more``), its names too
    dir_callback: int = -1


class OpenReq(Msg, tag="open"):
    """Open a file: fresh attributes and chunk map (close-to-open consistency).

    The inode joins the session's open set, so unlinking it elsewhere keeps
    its data until the session closes it. Reply: OpenRsp.
    """

    ino: int
    session_id: int
    write: bool = False
    # a mount whose closes send nothing (daemon/callbacks.py, write marks): record a write mark on
    # ``ino`` for the session before answering; OpenRsp.callback is its seq (-1: none)
    mark: bool = False
    pair: bool = False  # with ``write``: an epoch pair (AllocEpochReq.pair), OpenRsp.epoch_pair says if given


class OpenRsp(Msg, tag="open_rsp"):
    attr: Attr
    layout: Layout
    chunks: list[ChunkRef]  # every chunk with a placement, ordered by index
    nodes: list[NodeAddr]  # addresses of every node named in ``chunks``
    epoch: int = 0  # a fresh write epoch when opened for writing or created (saves an AllocEpochReq)
    quota_max_size: int = -1  # the size the file may grow to under its directory quotas now; -1: no quota applies
    cap: Cap | None = None  # subtree keys: what storage nodes ask of them for this file's chunks
    dir_attrs: list[Attr] = []  # CreateReq: the parent's attributes after it, as AttrRsp.dir_attrs
    seq: int = 0  # ... as of this change log position
    callback: int = -1  # LookupReq or CreateReq with ``callback``: as AttrRsp.callback
    epoch_pair: bool = False  # OpenReq.pair was granted: ``epoch + 1`` is the session's too


class CloseReq(Msg, tag="close"):
    """The session closed its last handle on ``ino`` (lets an unlinked file go at once)."""

    ino: int
    session_id: int


class AllocEpochReq(Msg, tag="alloc_epoch"):
    """A fresh write epoch. ``pair``: ask for two, ``epoch`` and ``epoch + 1`` (one of each parity:
    a copy-on-write version must have the other parity than the committed one, common/layout.py
    "Slots"); EpochRsp.pair says whether the daemon gave them (not from a PostgreSQL sequence)."""

    pair: bool = False


class DelegateInodesReq(Msg, tag="delegate_inodes"):
    """Hand ``count`` inode numbers to the session, for CreateReqs and MkdirReqs that name
    their ``ino`` (asynchronous creates, daemon/inode_ranges.py). Reply: InodesRsp; a store
    that cannot delegate (PostgreSQL) answers NOT_SUPPORTED."""

    session_id: int
    count: int


class InodesRsp(Msg, tag="inodes_rsp"):
    first: int  # the numbers first .. first + count - 1 are the session's until it ends
    count: int


class EpochRsp(Msg, tag="epoch_rsp"):
    epoch: int
    pair: bool = False  # ``epoch + 1`` is the asker's too (AllocEpochReq.pair)


class AllocChunksReq(Msg, tag="alloc_chunks"):
    """Choose nodes for chunks that have no placement yet (existing ones are returned as is)."""

    ino: int
    indices: Max[int]


class ChunksRsp(Msg, tag="chunks_rsp"):
    chunks: list[ChunkRef]
    nodes: list[NodeAddr]
    cap: Cap | None = None  # subtree keys: a capability for the request's inode


class ReplaceReplicaReq(Msg, tag="replace_replica"):
    """A write to ``failed_node`` failed: move that copy of the chunk to another healthy node."""

    ino: int
    index: int
    failed_node: int
    part: int = -1  # erasure-coded files: the fragment to move (failed_node may be 0: a missing one)


class CommitReq(Msg, tag="commit"):
    """Make written chunks visible: record their versions and extend the size.

    ``size`` is a lower bound: the file's size becomes max(current, size).
    Reply: AttrRsp.
    """

    ino: int
    size: int
    mtime_ns: int
    chunks: Max[ChunkRef]


class StatfsReq(Msg, tag="statfs"):
    pass


class StatfsRsp(Msg, tag="statfs_rsp"):
    total_bytes: int  # capacity of the nodes that take chunks, a file system shared by several counted once
    free_bytes: int  # what they can still take, counted the same way
    files: int
    block_size: int = 4096
    name_max: int = 255
    used_bytes: int = -1  # bytes stripefs stores on those nodes (chunk files); -1: unknown (total - free)


class SetxattrReq(Msg, tag="setxattr"):
    ino: int
    name: bytes
    value: bytes
    flags: int = 0  # XATTR_CREATE (1) / XATTR_REPLACE (2)


class GetxattrReq(Msg, tag="getxattr"):
    ino: int
    name: bytes


class XattrRsp(Msg, tag="xattr_rsp"):
    value: bytes


class ListxattrReq(Msg, tag="listxattr"):
    ino: int


class ListxattrRsp(Msg, tag="listxattr_rsp"):
    names: list[bytes]


class RemovexattrReq(Msg, tag="removexattr"):
    ino: int
    name: bytes


class GetLayoutReq(Msg, tag="get_layout"):
    """The layout of a file, or the layout a directory gives new files."""

    ino: int


class SetLayoutReq(Msg, tag="set_layout"):
    """Change a directory's layout for files created from now on; None = unchanged."""

    ino: int
    chunk_size: int | None = None
    stripe_count: int | None = None
    redundancy: str | None = None


class LayoutRsp(Msg, tag="layout_rsp"):
    layout: Layout


class StatusReq(Msg, tag="status"):
    pass


class StatusRsp(Msg, tag="status_rsp"):
    nodes: list[NodeInfo]
    files: int
    directories: int
    chunks: int
    logical_bytes: int
    sessions: int
    boot_id: str
    degraded_chunks: int = 0  # chunks with a copy or fragment on a down node: the repair backlog
    garbage_copies: int = 0  # chunk copies waiting for deletion on storage nodes
    layouts: list[LayoutUsage] = []  # per redundancy: logical and raw bytes (daemon/redundancy.py)
    under_replicated: int = 0  # chunks below their target redundancy (see ``repair``)
    repair: RepairInfo | None = None
    leader: str = ""  # the metadata daemon running the cluster-wide duties (daemon/duties.py); "" none yet
    daemon: str = ""  # the metadata daemon that answered, named as in ``leader``
    quotas: list[QuotaInfo] = []  # every directory quota (daemon/quota.py)
    tiering: "TierStatus | None" = None  # the cold tier (daemon/tiering.py)
    snapshots: int = 0  # directory snapshots (daemon/snapshots.py); their inodes are not in files or logical_bytes
    snapshot_bytes: int = 0  # bytes of chunks only snapshots hold (copied out): what deleting them all would free


# --------------------------------------------------------------------------
# Erasure coding and online conversion (daemon/redundancy.py, client/ec_path.py)
# --------------------------------------------------------------------------


class CreateShadowReq(Msg, tag="create_shadow"):
    """Start converting file ``ino`` to ``redundancy``: a nameless inode to copy into.

    The shadow is held open by ``session_id``; if that session lapses before
    SwapShadowReq, the shadow is reclaimed (the conversion rolls back).
    Reply: OpenRsp of the shadow (with a write epoch).
    """

    ino: int
    redundancy: str
    session_id: int


class SwapShadowReq(Msg, tag="swap_shadow"):
    """Finish a conversion: every name of ``ino`` now leads to ``shadow``, atomically.

    ``size``, ``mtime_ns`` and ``chunks`` (index and version of each chunk) are
    what the copy read from ``ino``; if ``ino`` changed since, BUSY and nothing
    changes. Reply: AttrRsp of the shadow, now the file.
    """

    ino: int
    shadow: int
    size: int
    mtime_ns: int
    chunks: Max[ChunkRef]


# --------------------------------------------------------------------------
# Self-healing (daemon/repair.py, storage_node/healing.py): repair, scrub,
# fsck, drain. Data always flows storage node to storage node; the metadata
# daemon only decides and records.
# --------------------------------------------------------------------------


class CopyChunkReq(Msg, tag="copy_chunk"):
    """Metadata daemon -> the node that must gain a copy: pull ``chunk`` from a source.

    The node reads the whole chunk (``ReadChunkReq`` with ``min_version``) from
    the first of ``sources`` (storage node addresses) that answers, checks the
    payload's xxh3, and stores it with ``replace`` and ``sync`` (temp file,
    fsync, rename): the copy is durable before the reply. Reply: CopyChunkRsp
    with the version actually stored (a source may hold a newer, uncommitted
    version). Errors: UNAVAILABLE (no source could be read), NO_SPACE, IO,
    TIMEOUT (past ``deadline_s``: nothing was stored, so a daemon that gave up
    waiting can delete the target's copy without racing a late store).
    With ``source`` the node copies its own copy of another chunk id instead
    (a snapshot's copy-out, daemon/snapshots.py): NOT_FOUND or STALE when it
    holds no copy of ``source`` of exactly ``min_version``.
    """

    chunk: ChunkId
    min_version: int
    sources: Annotated[list[str], msgspec.Meta(max_length=MAX_SOURCES)]
    length: int  # the file's chunk size: the most a copy can hold
    deadline_s: float = 0.0  # > 0: a copy not ready to be stored this long after arrival is discarded (TIMEOUT)
    #: a snapshot's copy-out (daemon/snapshots.py): copy this node's own copy of ``source``, of
    #: exactly ``min_version`` (STALE otherwise), to ``chunk``; ``sources`` is not used
    source: ChunkId | None = None


class CopyChunkRsp(Msg, tag="copy_chunk_rsp"):
    version: int
    length: int


class FragmentSource(msgspec.Struct, frozen=True, array_like=True):
    index: int  # fragment number j of the stripe
    part: int  # the chunk part holding it (common/erasure.fragment_part)
    address: str  # the storage node holding it
    version: int = 0  # the version it is stored at (ChunkRef ``fversions``); 0: the request's ``version``


class ReconstructFragmentReq(Msg, tag="reconstruct_fragment"):
    """Metadata daemon -> the node that must gain fragment ``fragment`` of an EC stripe.

    The node reads at least K fragments from ``sources``, each at its ``version`` exactly
    (a source's 0: ``version``; a stripe's fragments need not share one, ChunkRef ``fversions``),
    decodes the stripe (common/erasure.py, ``k``+``m``, ``chunk_size``), codes
    fragment ``fragment`` for a stripe whose first ``used`` bytes may be nonzero,
    and stores it as ``chunk`` like CopyChunkReq stores a copy (durable, never
    over a newer copy, not after ``deadline_s``). Reply: CopyChunkRsp.
    Errors: UNAVAILABLE (fewer than K fragments readable), TIMEOUT, NO_SPACE, IO.
    """

    chunk: ChunkId
    version: int
    k: int
    m: int
    chunk_size: int
    used: int
    fragment: int
    sources: Annotated[list[FragmentSource], msgspec.Meta(max_length=MAX_SOURCES)]
    deadline_s: float = 0.0


class VerifyChunksReq(Msg, tag="verify_chunks"):
    """Read and check every block of each chunk now (an on-demand scrub).

    ``min_versions``: one per chunk; a copy older than its bound counts as bad
    (it missed a write). Reply: VerifyChunksRsp. Bad copies are also reported
    by the node itself (ReportBadChunksReq), like those its background scrub finds.
    """

    chunks: Max[ChunkId]
    min_versions: Max[int] = []


class VerifyChunksRsp(Msg, tag="verify_chunks_rsp"):
    bad: list[ChunkId]  # corrupt, or older than asked
    missing: list[ChunkId]
    bytes: int  # data bytes verified
    # one per chunk asked, 0 for a bad or missing one: what the daemon's scrub compares across
    # the replicas of one version (daemon/repair_admin.py): the stored version, an xxh3_64 of the
    # data, the copy file's mtime (empty from a node that predates them)
    versions: list[int] = []
    digests: list[int] = []
    written_ns: list[int] = []


class ListChunksReq(Msg, tag="list_chunks"):
    """The node's chunk inventory, one slice of its 65,536 fan-out directories at a time.

    Directory number d is ``chunks/{d & 0xFF:02x}/{d >> 8:02x}``. Reply: ListChunksRsp;
    ``next_dir`` is -1 when the listing is complete.
    """

    start_dir: int = 0
    max_dirs: int = 4096


class ListChunksRsp(Msg, tag="list_chunks_rsp"):
    chunks: list[ChunkId]
    versions: list[int]  # 0 for a copy whose header is unreadable (corrupt)
    next_dir: int


class ScrubStartReq(Msg, tag="scrub_start"):
    """Start a new background scrub pass on this storage node now. Reply: OkRsp."""


class ReportBadChunksReq(Msg, tag="report_bad_chunks"):
    """Storage node -> metadata daemon: these copies failed their checksums here.

    The daemon treats each as a missing copy (re-replicated from a good one) and
    queues the bad one for deletion. Reply: OkRsp.
    """

    node_id: int
    chunks: Max[ChunkId]


class NodeAdminReq(Msg, tag="node_admin"):
    """Administrative state of a storage node. Reply: OkRsp.

    ``action``: ``"drain"`` (move every copy off it while it keeps serving;
    no new chunks go there), ``"undrain"``, or ``"remove"`` (forget it: refused
    with NOT_EMPTY while it holds the only live copy of any chunk).
    """

    node_id: int
    action: str


class ScrubReq(Msg, tag="scrub"):
    """Verify every copy of the chunks of some files now (``stripefs scrub --now``).

    ``inos``: those files; empty: files with ino > ``after_ino``, up to ``limit``
    of them (the caller pages through the namespace with ``next_ino``).
    Bad or missing copies are treated as missing and repaired. Reply: ScrubRsp.
    """

    inos: Max[int] = []
    after_ino: int = 0
    limit: int = 64


class ScrubRsp(Msg, tag="scrub_rsp"):
    files: int
    copies: int  # chunk copies verified
    bad: int  # corrupt, stale or missing copies found (queued for repair)
    bytes: int
    next_ino: int  # 0: no more files
    total_files: int  # files in the namespace (for a progress bar)
    repairing: int = -1  # of ``bad``: copies being re-replicated from a good copy (the rest have none now); -1 unknown
    diverged: int = 0  # of ``bad``: replicas whose bytes differ from the other replicas of the same version


class FsckReq(Msg, tag="fsck"):
    """Check the namespace against one storage node's chunk store, or (``node_id`` 0)
    the redundancy of every chunk. ``repair``: fix what can be fixed
    (orphans deleted, missing copies re-replicated). Reply: FsckRsp."""

    node_id: int = 0
    repair: bool = False


class FsckRsp(Msg, tag="fsck_rsp"):
    checked: int  # copies (node) or chunks (redundancy) looked at
    orphans: int  # copies no file refers to
    missing: int  # copies the namespace expects that the node lacks (or holds stale)
    under_replicated: int
    over_replicated: int
    lost: int  # chunks without any live copy
    repaired: int  # repairs queued that can be made now
    problems: list[str]  # the first few, for the operator
    unrepairable: int = 0  # chunks that want more copies than there are nodes up to hold them


class RepairInfo(msgspec.Struct, frozen=True):
    """Redundancy and repair progress, as of the last scan (StatusRsp.repair)."""

    under_replicated: int = 0  # chunks below their target redundancy
    lost: int = 0  # chunks with no live copy at all
    backlog: int = 0  # copies still to make (repair, drain, rebalance)
    backlog_bytes: int = 0
    copied: int = 0  # copies made since the daemon started
    copied_bytes: int = 0
    failed: int = 0
    bandwidth: int = 0  # bytes/s limit, 0 = none
    scanned_age_s: float = -1.0


# --------------------------------------------------------------------------
# Directory quotas (daemon/quota.py, stripefs/quota_cli.py)
# --------------------------------------------------------------------------


class QuotaInfo(msgspec.Struct, frozen=True):
    """One quota root: limits (0: none) and usage below it. ``path`` is for display only."""

    ino: int
    path: bytes
    max_bytes: int
    max_inodes: int
    used_bytes: int
    used_inodes: int


class QuotaSetReq(Msg, tag="quota_set"):
    """Set the limits of directory ``ino`` (None: leave as is; 0: no limit; both 0 removes the quota).
    Reply: QuotaRsp with the quota (none when removed)."""

    ino: int
    max_bytes: int | None = None
    max_inodes: int | None = None


class QuotaGetReq(Msg, tag="quota_get"):
    """Every quota that applies to ``ino`` (a directory's own first), nearest first; ``ino`` 0: all quotas.
    Reply: QuotaRsp."""

    ino: int = 0


class QuotaRecountReq(Msg, tag="quota_recount"):
    """Count the trees of every quota (or of the one on ``ino``) again and correct usage that drifted.
    Reply: QuotaRsp (all quotas after the count) with ``corrected`` (the quotas that were wrong, as they were)."""

    ino: int = 0


class QuotaRsp(Msg, tag="quota_rsp"):
    quotas: list[QuotaInfo]
    corrected: list[QuotaInfo] = []


class QuotaRoomReq(Msg, tag="quota_room"):
    """The size file ``ino`` may grow to now (a writer about to cross ``OpenRsp.quota_max_size``). Reply: QuotaRoomRsp."""

    ino: int


class QuotaRoomRsp(Msg, tag="quota_room_rsp"):
    max_size: int  # -1: no quota applies


class TrashEntry(msgspec.Struct, frozen=True):
    """One inode in the trash (daemon/trash.py). ``ino`` is its id for restore and purge; ``path``
    where it was, for display (a subtree key's relative to its subtree)."""

    ino: int
    path: bytes
    deleted_ns: int
    expires_ns: int  # 0: kept until purged (the trash is off now; the next collector round frees it)
    mode: int
    size: int
    uid: int


class TrashListReq(Msg, tag="trash_list"):
    """What the trash holds, oldest first (a subtree key: what was removed inside its subtree). Reply: TrashRsp."""

    limit: int = 100_000


class TrashRestoreReq(Msg, tag="trash_restore"):
    """Put trashed inode ``item`` back under its old name, or as ``new_name`` in ``new_parent``; a
    directory brings back what was trashed out of it. Reply: TrashRsp with ``done`` (the inodes
    restored) and ``left`` (why each one left in the trash was left). ``item`` is not in
    ``INODE_FIELDS``: it has no name, so daemon/access.py checks where it was removed instead."""

    item: int
    new_parent: int | None = None
    new_name: bytes = b""


class TrashPurgeReq(Msg, tag="trash_purge"):
    """Free trashed inodes now: ``items``, or everything the key may see with ``everything``. Reply: TrashRsp (``done``)."""

    items: Max[int] = []
    everything: bool = False


class TrashRsp(Msg, tag="trash_rsp"):
    entries: list[TrashEntry] = []
    done: list[int] = []
    left: list[str] = []


class SnapshotInfo(msgspec.Struct, frozen=True):
    """One snapshot of a directory (daemon/snapshots.py): ``ino`` its top directory, ``DIR/.snapshots/NAME``."""

    id: int
    name: bytes
    ino: int
    created_ns: int


class SnapshotCreateReq(Msg, tag="snapshot_create"):
    """Snapshot directory ``ino`` as ``ino/.snapshots/name``: a read-only copy of its tree as of one
    transaction, sharing every chunk (no data is copied). Reply: SnapshotRsp with the new one.
    Errors: EXISTS (the name is taken, or ``.snapshots`` is something else), READ_ONLY (a snapshot's
    directory), NOT_DIR, NOT_FOUND."""

    ino: int
    name: bytes


class SnapshotListReq(Msg, tag="snapshot_list"):
    """The snapshots of directory ``ino``, oldest first. Reply: SnapshotRsp."""

    ino: int


class SnapshotDeleteReq(Msg, tag="snapshot_delete"):
    """Delete snapshot ``name`` of directory ``ino`` (its own copies are freed; shared ones stay
    with the live files). Reply: SnapshotRsp (empty). Errors: NOT_FOUND."""

    ino: int
    name: bytes


class SnapshotRsp(Msg, tag="snapshot_rsp"):
    snapshots: list[SnapshotInfo] = []


class CapsReq(Msg, tag="caps"):
    """Fresh capabilities for inodes (a mount whose capabilities near expiry, or that a storage node
    refused). Reply: CapsRsp, one Cap per inode; empty for a key that needs none (not subtree-restricted).
    An inode outside the key's subtree: ACCESS (common/capability.py)."""

    inos: Max[int]


class CapsRsp(Msg, tag="caps_rsp"):
    caps: list[Cap]


# --------------------------------------------------------------------------
# Idempotent retries (daemon/applied_ops.py): a mutating request wrapped once
# --------------------------------------------------------------------------


class OnceReq(Msg, tag="once"):
    """Apply ``body`` (a mutating request, one of ``ONCE_MESSAGES``) at most once.

    ``client_id`` is a random 63-bit id the client picks at start; ``op_id``
    numbers its wrapped requests 1, 2, 3... A retry (after a timeout, on the
    same or another metadata daemon) resends the same OnceReq: if the first
    attempt was applied, the daemon answers what it answered then instead of
    applying it again. ``done_below``: every op id below it has been answered
    (the daemon may forget those). Reply: the reply of ``body``.
    """

    client_id: int
    op_id: int
    done_below: int
    body: "Request"


#: the most requests one BatchReq carries
MAX_BATCH = 1024


class BatchReq(Msg, tag="batch"):
    """Many changes of one client in one message: ``items`` (each one of ``BATCH_MESSAGES``,
    or a OnceReq carrying one) are applied in order, each on its own (one failing leaves
    the others), in one transaction: one commit for them all (daemon/burst.py). Each item
    passes the access checks and quotas it would pass alone. Reply: BatchRsp, one result
    per item, in order: its reply, or the ErrorRsp it failed with."""

    items: Annotated[list["Request"], msgspec.Meta(max_length=MAX_BATCH)]


class BatchRsp(Msg, tag="batch_rsp"):
    results: list["Reply"]


#: what a BatchReq may carry (bare or in a OnceReq): the changes a tree walk makes many of at once
BATCH_MESSAGES: frozenset[str] = frozenset(
    "CreateReq MknodReq MkdirReq SymlinkReq LinkReq UnlinkReq RmdirReq RenameReq SetattrReq CommitReq".split()
)


def kind(msg: Msg) -> str:
    """The message's type name for metrics and logs: a OnceReq counts as what it carries."""
    return type(msg.body).__name__ if isinstance(msg, OnceReq) else type(msg).__name__


#: requests a client wraps in OnceReq (they change the namespace and are not naturally idempotent)
ONCE_MESSAGES: frozenset[str] = frozenset(
    "SetattrReq CreateReq MknodReq MkdirReq SymlinkReq LinkReq UnlinkReq RmdirReq RenameReq"
    " SetxattrReq RemovexattrReq SetLayoutReq AllocChunksReq ReplaceReplicaReq CommitReq"
    " CreateShadowReq SwapShadowReq"
    " TrashRestoreReq SnapshotCreateReq SnapshotDeleteReq"  # the admin commands' changes (stripefs/cluster.py rpc_once)
    .split()
)


# --------------------------------------------------------------------------
# Metadata daemon -> mounts: the change feed (ZeroMQ PUB/SUB, not a request)
# --------------------------------------------------------------------------


class ChangeEvent(msgspec.Struct, frozen=True, array_like=True):
    """One frame on the daemon's PUB socket (client/kernel_cache.py applies it).

    ``seq`` numbers the changes of one daemon boot: 1, 2, 3... A heartbeat
    (every ``EVENTS_HEARTBEAT_S``) repeats the last ``seq`` with no changes.
    PUB/SUB drops messages silently (high-water marks, reconnects), so a mount
    that sees a ``seq`` other than last+1 (or last, for a heartbeat), another
    ``boot_id``, or nothing for ``EVENTS_SILENCE_S`` drops everything the
    kernel caches of the namespace instead of trusting it.
    """

    boot_id: str
    seq: int
    inodes: list[int]  # attributes or data changed
    entries: list[tuple[int, bytes]]  # (parent, name) names created, removed or renamed
    # the publishing daemon's own boot id: a new one means its callbacks are forgotten, so a
    # mount drops what it cached under them (daemon/callbacks.py)
    daemon: str = ""
    writer: int = 0  # writer_tag of the mount that made the change (0: unknown): its callbacks stay


def writer_tag(client_id: int) -> int:
    """What the feed names a change's writer by: a one-way hash of the client id the daemon
    knows the writer by (daemon/applied_ops.py ``bind``). The id itself names the client's
    retries and must stay its own: other mounts (other keys) hear the tag, and a tag cannot
    be turned back into the id (BLAKE2b; xxh64 of 8 bytes could be inverted exactly). The
    daemon tells a mount its own tag in HelloRsp.writer."""
    import hashlib

    if not client_id:
        return 0
    digest = hashlib.blake2b(client_id.to_bytes(8, "little"), digest_size=8, person=b"stripefs-writer").digest()
    return int.from_bytes(digest, "little") & INT64_MAX or 1


EVENTS_HEARTBEAT_S = 1.0
EVENTS_SILENCE_S = 3.0

#: a change waiting for a session that said it is committing (AckReq.committing) waits this long from
#: each such notice (the mount repeats it every ``COMMITTING_S / 4`` while its commit runs) ...
COMMITTING_S = 2.0
#: ... and this long at most from when the change began to wait (a commit held up by a dead storage
#: node needs its request timeouts; the mount then acknowledges without it)
COMMIT_WAIT_S = 60.0

_event_decoder = msgspec.msgpack.Decoder(ChangeEvent)


def encode_event(event: ChangeEvent) -> bytes:
    return msgspec.msgpack.encode((PROTOCOL_VERSION, event))


class _EventOfRaw(msgspec.Struct, frozen=True, array_like=True):
    """``ChangeEvent``'s wire form with its lists as msgpack already made (``encode_event_raw``)."""

    boot_id: str
    seq: int
    inodes: msgspec.Raw
    entries: msgspec.Raw
    daemon: str
    writer: int


_event_encoder = msgspec.msgpack.Encoder()


def encode_event_raw(boot_id: str, seq: int, inodes: msgspec.Raw, entries: msgspec.Raw, daemon: str, writer: int) -> bytes:
    """``encode_event(ChangeEvent(boot_id, seq, inodes, entries, daemon, writer))``, the same bytes,
    from ``inodes`` and ``entries`` as msgpack (a change log row's, daemon/change_log.py
    ``decode_raw``): the feed publishes a row per change without decoding its lists and making
    them again (daemon/events.py)."""
    return _event_encoder.encode((PROTOCOL_VERSION, _EventOfRaw(boot_id, seq, inodes, entries, daemon, writer)))


def decode_event(frame: bytes) -> ChangeEvent:
    """Raises ProtocolError on anything but a ChangeEvent of this protocol version."""
    from .errors import ErrorCode

    try:
        version = _version_decoder.decode(frame).version  # first, whatever the rest looks like
        if version != PROTOCOL_VERSION:
            raise ProtocolError(ErrorCode.VERSION_MISMATCH, f"change event of protocol version {version}, not {PROTOCOL_VERSION}")
        _, raw = msgspec.msgpack.decode(frame, type=tuple[int, msgspec.Raw])
        return _event_decoder.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"undecodable change event: {exc}") from None


# --------------------------------------------------------------------------
# Applications -> the mount: the prefetch control xattr
# --------------------------------------------------------------------------

#: ``setxattr(DIR, PREFETCH_XATTR, b"\n".join(paths))`` queues files (paths relative to DIR)
#: for prefetch; ``getxattr`` reports ``pending=N fetched=N stored=N failed=N``. Never stored.
PREFETCH_XATTR = b"user.stripefs.prefetch"
#: the same, and also put each file in the mount's shared-memory directory (client/shm_cache.py)
PREFETCH_SHM_XATTR = b"user.stripefs.prefetch.shm"
#: ``ioctl(fd of a directory, PREFETCH_IOC or PREFETCH_SHM_IOC, buf)``: the same requests through a
#: channel a read-only mount allows (the kernel refuses setxattr there, as Lustre's ``ladvise`` hints
#: are ioctls). ``buf`` is ``PREFETCH_IOC_SIZE`` bytes: a little-endian u32 length, then that many
#: bytes of newline-separated paths relative to the directory; the rest is padding. A restricted
#: FUSE ioctl carries exactly ``_IOC_SIZE(cmd)`` bytes, at most 16,383: a longer list takes
#: several calls. Answered by the mount's own FUSE session (older mounts, on pyfuse3, answer ENOTTY).
PREFETCH_IOC_SIZE = 16_383
PREFETCH_IOC_MAX_PATHS = PREFETCH_IOC_SIZE - 4


def _iow(kind: str, number: int, size: int) -> int:
    """Linux's ``_IOW(kind, number, size)``: an ioctl that writes ``size`` bytes into the kernel."""
    return (1 << 30) | (size << 16) | (ord(kind) << 8) | number


PREFETCH_IOC = _iow("S", 1, PREFETCH_IOC_SIZE)
PREFETCH_SHM_IOC = _iow("S", 2, PREFETCH_IOC_SIZE)
#: ``getxattr`` of the mount's root: that directory (empty when the mount has none)
SHM_DIR_XATTR = b"user.stripefs.shm_dir"
#: ``getxattr`` of a file: its copy there, ``NAME SIZE MTIME_NS XXH3HEX`` (ENODATA: none). The
#: kernel asks the mount only for callers that may read the file: the copy's access check
SHM_COPY_XATTR = b"user.stripefs.shm_copy"
#: ``getxattr(PATH, JOB_XATTR + figures)``: a training job's data wait so far (stripefs/data_wait.py,
#: client/jobs.py); the figures ride in the attribute's name, so any reader of the data may report
JOB_XATTR = b"user.stripefs.job."
_JOB_NAME_MAX = 64


def encode_job_report(name: str, steps: int, wait_s: float, compute_s: float, gpu: bool, done: bool = False) -> bytes:
    """The attribute name carrying a job's figures: ``JOB_XATTR`` + ``STEPS.WAIT_US.COMPUTE_US.FLAGS.NAME``
    (flags: 1 GPU-measured, 2 the loop ended); under the kernel's 255-byte limit on names."""
    label = name.encode("utf-8", "replace")[:_JOB_NAME_MAX]
    flags = (1 if gpu else 0) | (2 if done else 0)
    return JOB_XATTR + b"%d.%d.%d.%d." % (steps, int(wait_s * 1e6), int(compute_s * 1e6), flags) + label


class JobReport(msgspec.Struct, frozen=True):
    steps: int
    wait_s: float
    compute_s: float
    gpu: bool
    done: bool
    name: str


def decode_job_report(attr_name: bytes) -> JobReport | None:
    """``encode_job_report``'s figures, or None when ``attr_name`` is not one (or is malformed)."""
    if not attr_name.startswith(JOB_XATTR):
        return None
    parts = attr_name[len(JOB_XATTR):].split(b".", 4)
    if len(parts) != 5 or not all(p.isdigit() and len(p) <= 18 for p in parts[:4]):
        return None
    steps, wait_us, compute_us, flags = (int(p) for p in parts[:4])
    return JobReport(steps, wait_us / 1e6, compute_us / 1e6, bool(flags & 1), bool(flags & 2),
                     parts[4][:_JOB_NAME_MAX].decode("utf-8", "replace"))


# --------------------------------------------------------------------------
# Mount -> metadata daemon, appended: placements a sequential writer did not use
# --------------------------------------------------------------------------


class ReleaseChunksReq(Msg, tag="release_chunks"):
    """Chunks this writer had placed ahead (AllocChunksReq) and did not write. Rows past the
    file's end still at version 0 go; anything else is left alone. Idempotent. Reply: OkRsp.

    A writer that did store copies under such a placement recreates the row with its
    CommitReq (the ref names its nodes), so a release never loses a concurrent write."""

    ino: int
    indices: Max[int]


# --------------------------------------------------------------------------
# The cold tier on object storage (daemon/tiering.py, docs/tiering.md)
# --------------------------------------------------------------------------

#: a tier's name: a word an operator types
TIER_NAME = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")]
_SHORT = Annotated[str, msgspec.Meta(max_length=1024)]


class TierInfo(msgspec.Struct, frozen=True):
    """One tier and what it holds (TierListRsp). No credentials: the daemon never sends them."""

    name: str
    url: str  # s3://BUCKET/PREFIX
    endpoint: str  # "" : the AWS default endpoint of the region
    region: str = ""
    objects: int = 0  # chunk versions stored there now
    bytes: int = 0


class TierAddReq(Msg, tag="tier_add"):
    """Add a tier: a bucket (and key prefix) on an S3 endpoint. The daemon checks that it can
    reach the bucket with its own credentials (docs/tiering.md) before recording it. Reply: TierListRsp."""

    name: TIER_NAME
    url: _SHORT  # s3://BUCKET[/PREFIX]
    endpoint: _SHORT = ""
    region: Annotated[str, msgspec.Meta(max_length=64)] = ""


class TierListReq(Msg, tag="tier_list"):
    """Every tier, with its objects and bytes. Reply: TierListRsp."""


class TierListRsp(Msg, tag="tier_list_rsp"):
    tiers: list[TierInfo]
    policies: list["TierPolicy"] = []


class TierPolicy(msgspec.Struct, frozen=True):
    """Files below directory ``ino`` not read or written for ``after_s`` seconds, of at least
    ``min_size`` bytes, move to tier ``tier``. ``path`` is for display only."""

    ino: int
    tier: str
    after_s: int
    min_size: int = 0
    path: bytes = b""


class TierPolicySetReq(Msg, tag="tier_policy_set"):
    """Set (or, with ``tier`` "", remove) the policy of directory ``ino``. Reply: TierListRsp."""

    ino: int
    tier: Annotated[str, msgspec.Meta(max_length=63)]
    after_s: Annotated[int, msgspec.Meta(ge=0)] = 0
    min_size: Annotated[int, msgspec.Meta(ge=0)] = 0


class TierMigrateReq(Msg, tag="tier_migrate"):
    """Move file ``ino``'s chunks to tier ``tier`` now ("" : the tier of the policy over it),
    waiting until they are stored and verified there and the node copies are released.
    A file open for writing is refused BUSY. Reply: TierFileRsp."""

    ino: int
    tier: Annotated[str, msgspec.Meta(max_length=63)] = ""


class TierRecallReq(Msg, tag="tier_recall"):
    """Bring chunks of file ``ino`` back from its tier onto storage nodes (``indices`` empty: all
    of them), waiting until they are there. Reply: ChunksRsp with the placement of the chunks
    asked for. An unreachable bucket: IO (EIO to the reader), and the daemon logs the tier."""

    ino: int
    indices: Max[int] = []


class TierFileRsp(Msg, tag="tier_file_rsp"):
    chunks: int  # chunks moved by this request
    bytes: int
    cold: int  # chunks of the file in a tier now
    hot: int  # chunks of the file on storage nodes now


class TierFsckReq(Msg, tag="tier_fsck"):
    """Check every tier's bucket against the namespace: each cold chunk has its object, of its
    length; objects no file needs are counted (``repair``: queued for deletion). Reply: TierFsckRsp."""

    repair: bool = False


class TierFsckRsp(Msg, tag="tier_fsck_rsp"):
    checked: int  # cold chunks looked for
    missing: int  # cold chunks whose object is missing or of the wrong length: lost data
    orphans: int  # objects of this cluster that no file needs
    problems: list[str]  # the first few, for the operator


class TierStatus(msgspec.Struct, frozen=True):
    """The tiering figures in StatusRsp."""

    tiers: list[TierInfo] = []
    migrate_backlog: int = 0  # chunks queued for migration (uploading rows)
    migrate_backlog_bytes: int = 0
    recalls_in_flight: int = 0
    migrated: int = 0  # chunks moved to a tier since this daemon started
    migrated_bytes: int = 0
    recalled: int = 0
    recalled_bytes: int = 0
    failed: int = 0
    objects_deleted: int = 0
    garbage_objects: int = 0  # objects waiting for deletion
    bandwidth: int = 0  # tier_bandwidth, bytes/s; 0: none


def _messages(suffix: str) -> tuple[type[Msg], ...]:
    # the naming rule (FooReq / FooRsp) is the registry: no second list to keep in step
    return tuple(cls for cls in Msg.__subclasses__() if cls.__name__.endswith(suffix))


Request = Union[_messages("Req")]
Reply = Union[_messages("Rsp")]


class _Version(msgspec.Struct, array_like=True):
    """Element 0 of every header, in every protocol version (the rest of the array is skipped)."""

    version: int


class _Header(msgspec.Struct, array_like=True):
    version: int
    request_id: Annotated[int, msgspec.Meta(ge=0)]
    body: msgspec.Raw


class _RequestId(msgspec.Struct, array_like=True):
    version: int
    request_id: int


_encoder = msgspec.msgpack.Encoder()
_version_decoder = msgspec.msgpack.Decoder(_Version)
_header_decoder = msgspec.msgpack.Decoder(_Header)
_request_id_decoder = msgspec.msgpack.Decoder(_RequestId)
_tags = frozenset(cls.__struct_config__.tag for cls in Msg.__subclasses__())
_request_decoder = msgspec.msgpack.Decoder(Request)
_reply_decoder = msgspec.msgpack.Decoder(Reply)


class _RequestHeader(msgspec.Struct, array_like=True):
    """A whole request header in one pass (``_decode``'s fast path)."""

    version: int
    request_id: Annotated[int, msgspec.Meta(ge=0)]
    body: Request


class _ReplyHeader(msgspec.Struct, array_like=True):
    version: int
    request_id: Annotated[int, msgspec.Meta(ge=0)]
    body: Reply


_whole_request_decoder = msgspec.msgpack.Decoder(_RequestHeader)
_whole_reply_decoder = msgspec.msgpack.Decoder(_ReplyHeader)


class ProtocolError(Exception):
    """A frame that is not a valid stripefs message; ``code`` says why."""

    def __init__(self, code: int, message: str, request_id: int = 0):
        super().__init__(message)
        self.code = code
        self.request_id = request_id


def encode(request_id: int, body: Msg) -> bytes:
    """The header frame for ``body``."""
    return _encoder.encode((PROTOCOL_VERSION, request_id, body))


def _decode(frame: bytes, decoder: msgspec.msgpack.Decoder, max_bytes: int, whole: msgspec.msgpack.Decoder) -> tuple[int, Msg]:
    """The request id and body of a header frame, or ProtocolError saying what is wrong with it.

    Every frame is first decoded in one pass (``whole``: version, id and body at once, a few
    tenths of a microsecond; the three passes below cost 2-2.5 us, paid by every request and
    reply, issue 30); only a frame that pass refuses, or of another version, takes the passes
    that find out what is wrong, in the order that words the error (the version first)."""
    if len(frame) <= max_bytes:
        try:
            header = whole.decode(frame)
        except (msgspec.DecodeError, TypeError):
            pass
        else:
            if header.version == PROTOCOL_VERSION:
                return header.request_id, header.body
    return _decode_carefully(frame, decoder, max_bytes)


def _decode_carefully(frame: bytes, decoder: msgspec.msgpack.Decoder, max_bytes: int) -> tuple[int, Msg]:
    from .errors import ErrorCode  # local: keeps this module importable alone

    if len(frame) > max_bytes:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"header frame of {len(frame)} bytes is larger than {max_bytes}")
    try:
        version = _version_decoder.decode(frame).version
    except msgspec.DecodeError as exc:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"undecodable header (expected [version, request_id, body]): {exc}") from None
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            ErrorCode.VERSION_MISMATCH,
            f"protocol version {version} is not {PROTOCOL_VERSION}: peers of different versions do not talk; "
            "upgrade or downgrade one side",
            _request_id_or_zero(frame),
        )
    try:
        header = _header_decoder.decode(frame)
    except msgspec.DecodeError as exc:
        raise ProtocolError(
            ErrorCode.BAD_REQUEST, f"undecodable header (expected [version, request_id, body]): {exc}", _request_id_or_zero(frame)
        ) from None
    try:
        body = decoder.decode(header.body)
    except msgspec.ValidationError as exc:
        code = ErrorCode.UNKNOWN_MESSAGE if _unknown_tag(header.body) else ErrorCode.BAD_REQUEST
        raise ProtocolError(code, f"invalid message: {exc}", header.request_id) from None
    except msgspec.DecodeError as exc:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"undecodable body: {exc}", header.request_id) from None
    return header.request_id, body


def _request_id_or_zero(frame: bytes) -> int:
    try:
        request_id = _request_id_decoder.decode(frame).request_id
    except msgspec.DecodeError:
        return 0
    return request_id if 0 <= request_id < 1 << 64 else 0  # it must fit the reply's header


def _unknown_tag(body: msgspec.Raw) -> bool:
    """Whether ``body`` is a map whose tag names no message of this version."""
    try:
        tag = msgspec.msgpack.decode(body, type=dict[str, msgspec.Raw]).get("t")
        return tag is not None and msgspec.msgpack.decode(tag, type=str) not in _tags
    except msgspec.DecodeError:
        return False


def decode_request(frame: bytes) -> tuple[int, Msg]:
    return _decode(frame, _request_decoder, MAX_HEADER_BYTES, _whole_request_decoder)


def decode_reply(frame: bytes) -> tuple[int, Msg]:
    return _decode(frame, _reply_decoder, MAX_REPLY_HEADER_BYTES, _whole_reply_decoder)
