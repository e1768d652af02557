"""One TOML file per role, read into a frozen, typed struct.

Unknown keys and bad values are errors that name the key and the file: a typo
must never silently become a default. Sizes are binary units (``"4M"`` = 4 MiB)
or plain integers of bytes. ``example(role)`` prints a commented template
(``stripefs config example meta|storage|client``).
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import TypeVar

import msgspec

from .errors import QuietError
from .layout import parse_size


class Size(int):
    """A byte count; in TOML either an integer or a string like "4M"."""


def _dec_hook(typ, obj):
    if typ is Size:
        return Size(parse_size(obj))  # msgspec adds the key's path to a ValueError
    raise NotImplementedError(typ)


class _Config(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    pass


class _ServerLimits(_Config, kw_only=True):
    """What one server admits from its peers (common/limits.py; docs/security.md)."""

    per_peer_inflight: int = 64  # requests of one connection handled at once
    per_peer_queue: int = 1024  # more of its requests waiting for a slot; past that: BUSY
    max_queued: int = 16384  # waiting requests of all connections together; past that: BUSY
    max_queued_bytes: Size = Size(256 << 20)  # their frames' bytes together; past that: BUSY
    request_timeout_s: float = 600.0  # a request still being handled after this is cancelled (TIMEOUT)
    # replies to one connection that its network has not taken yet (a peer that never reads them);
    # past that its requests wait in its queue until they leave. A mount reading as fast as the
    # network goes keeps far less queued; 64 MiB keeps a 10 Gb/s link busy for 50 ms
    per_peer_reply_bytes: Size = Size(64 << 20)

    def serve_limits(self):
        from .limits import ServeLimits

        return ServeLimits(
            per_peer_inflight=max(1, self.per_peer_inflight),
            per_peer_queue=max(0, self.per_peer_queue),
            max_queued=max(0, self.max_queued),
            max_queued_bytes=int(self.max_queued_bytes),
            request_timeout_s=self.request_timeout_s if self.request_timeout_s > 0 else 600.0,
            per_peer_reply_bytes=max(1, int(self.per_peer_reply_bytes)),
        )


class MetaConfig(_ServerLimits, kw_only=True):
    listen: str = "tcp://127.0.0.1:7100"
    data_dir: str = "/var/lib/stripefs/meta"
    store: str = "sqlite"  # "sqlite" (a file in data_dir, one daemon) or "postgresql" (dsn; several daemons)
    dsn: str = ""  # PostgreSQL connection string (libpq), for store = "postgresql"
    pool_size: int = 8  # PostgreSQL connections, i.e. metadata transactions in flight at once (store = "postgresql")
    node_timeout_s: float = 10.0  # a storage node silent this long is declared down
    session_lease_s: float = 15.0  # a mount silent this long loses its open files
    # a mount's open set is the files it has open plus those it looked up in the last second (an open
    # then needs no request); 262,144 is the most a SessionHeartbeatReq can carry (4 x MAX_LIST), far
    # above both, and about 15 MiB of daemon memory. Past it an open is refused LIMIT (EMFILE)
    max_open_per_session: int = 262144
    # sessions of one key (mounts using it, plus those of the last session_lease_s that did not say
    # goodbye); without CURVE every peer counts as one key. Past it a hello is refused LIMIT.
    # A key's sessions hold at most max_sessions_per_key * max_open_per_session inodes (~60 bytes each)
    max_sessions_per_key: int = 256
    group_commit_ms: float = 0.0  # extra wait before a commit; changes arriving during an fsync share the next one anyway
    events_listen: str = ""  # the change feed mounts subscribe to (PUB); default: listen's interface, a free port
    # the read lane (daemon/read_lane.py: lone getattrs and lookups of the mounts' plain threads, SQLite
    # only); default: listen's interface, a free port; "off": none
    read_listen: str = ""
    chunk_size: Size = Size(4 << 20)  # layout of the root directory, inherited by new ones
    stripe_count: int = 4
    redundancy: str = "replicas=2"
    metrics: str = "127.0.0.1:0"  # Prometheus /metrics at HOST:PORT (port 0: any free port; "": off)
    # self-healing (daemon/repair.py)
    node_suspect_s: float = 5.0  # a storage node silent this long is suspect (still used, logged)
    repair_bandwidth: Size = Size(64 << 20)  # bytes/s of repair, drain and rebalance copies, cluster-wide; 0 = unlimited
    repair_parallelism: int = 4  # chunk copies in flight at once
    repair_scan_interval_s: float = 60.0  # full redundancy scan at least this often (and at once on any node change)
    rebalance_tolerance: float = 0.10  # rebalance until every node's use is within this fraction of the mean
    # the trash (daemon/trash.py, docs/snapshots.md): removed files and directories are kept this long; 0: off
    trash_keep_s: float = 86400.0
    # the cold tier on object storage (daemon/tiering.py, docs/tiering.md)
    tier_bandwidth: Size = Size(64 << 20)  # bytes/s the background pass migrates to tiers; 0 = unlimited (recalls: never throttled)
    tier_parallelism: int = 4  # chunks moved to or from a bucket at once (worker threads running boto3)
    tier_scan_interval_s: float = 60.0  # the policy pass runs this often on the duties leader
    tier_timeout_s: float = 5.0  # one bucket request gives up after this (connect and read); readers then get EIO
    tier_credentials: str = ""  # an AWS shared-credentials file; "": the standard AWS environment variables and files
    tier_profile: str = ""  # its profile ("": default)
    # CURVE (docs/security.md): this daemon's NAME.key_secret and the keys it accepts; required off loopback
    curve_key: str = ""
    keyring: str = ""
    # capabilities for subtree keys (common/capability.py): the secret shared with the storage nodes
    cap_secret: str = ""
    cap_ttl_s: float = 3600.0  # a capability's lifetime; mounts refresh theirs before it ends


class StorageConfig(_ServerLimits, kw_only=True):
    node_id: int
    listen: str = "tcp://127.0.0.1:7101"
    advertise: str = ""  # the address clients connect to; default: listen
    data_dir: str = "/var/lib/stripefs/storage"
    meta: list[str] = msgspec.field(default_factory=lambda: ["tcp://127.0.0.1:7100"])
    host: str = ""  # failure-domain label; default: this machine's hostname
    heartbeat_interval_s: float = 2.0
    block_size: Size = Size(64 << 10)  # checksum granularity
    capacity: Size = Size(0)  # 0: the whole file system holding data_dir
    reserved_space: Size = Size(64 << 20)  # refuse writes (ENOSPC) below this much free space
    io_threads: int = 8
    metrics: str = "127.0.0.1:0"  # Prometheus /metrics at HOST:PORT (port 0: any free port; "": off)
    scrub_bandwidth: Size = Size(16 << 20)  # bytes/s the background scrub verifies; 0 = no background scrub
    scrub_interval_s: float = 7 * 86400.0  # a new background scrub pass starts this long after the previous one began
    # CURVE (docs/security.md): this node's NAME.key_secret and the keys it accepts; meta addresses then
    # name the daemon's key (tcp://HOST:PORT?key=Z85)
    curve_key: str = ""
    keyring: str = ""
    cap_secret: str = ""  # the daemons' capability secret: subtree keys' chunk requests need a Cap signed with it

    @property
    def address(self) -> str:
        return self.advertise or self.listen

    @property
    def host_label(self) -> str:
        return self.host or socket.gethostname()


class ClientConfig(_Config):
    meta: list[str] = msgspec.field(default_factory=lambda: ["tcp://127.0.0.1:7100"])
    rpc_timeout_s: float = 10.0
    # the longest any filesystem call waits for the cluster, retries included (a daemon restart or
    # failover is ridden out); then it fails with EIO: nothing waits forever (client/operations.py)
    op_timeout_s: float = 60.0
    # close() of a small new file returns before its data is stored (client/write_back.py: committed
    # within 0.1 s, or at its fsync); true: every close commits first (also -o sync_close)
    sync_close: bool = False
    cache_size: Size = Size(1 << 30)  # memory for chunk data read ahead / prefetched / recently read
    readahead_chunks: int = 8  # most chunks a sequential reader's window grows to (from 1, doubling)
    write_parallelism: int = 4  # chunks being written to storage at once per file
    ec_min_fragments_over_k: int = 1  # an EC stripe write succeeds with K + this many fragments stored (0..M)
    write_inflight: int = 16  # chunks being written to storage at once, all files together
    attr_timeout_s: float = 1.0  # kernel attribute cache while the change feed is down
    entry_timeout_s: float = 1.0  # kernel name cache while the change feed is down
    cache_timeout_s: float = 300.0  # kernel name/attribute cache while the change feed is healthy
    dataset: bool = False  # read-only dataset mode (also -o dataset): see client/operations.py
    #: the default mount's OPEN: False (the default), no-open: the kernel sends no OPEN, a warm read is
    #: one FLUSH (docs/design.md "No OPEN on the read-write mount"); True, one handle per open (OPEN and
    #: RELEASE per open file; a failed write is reported to its own close): also -o per_open_handles
    per_open_handles: bool = False
    #: FUSE passthrough from the disk cache (root only, needs disk_cache_dir; implies per_open_handles):
    #: a file whose version sits whole in disk_cache_dir is read by the kernel from the local disk,
    #: no request per read (docs/design.md "Passthrough from the disk cache"); also -o passthrough
    passthrough: bool = False
    prefetch_parallel: int = 16  # files fetched at once by sampler-order prefetch
    max_background: int = 64  # FUSE requests the kernel keeps in flight (fusectl); the kernel default is 12
    disk_cache_dir: str = ""  # a local disk cache of chunk data (e.g. on NVMe); empty: none (also -o disk_cache_dir=)
    disk_cache_size: Size = Size(64 << 30)  # most bytes the disk cache holds
    disk_cache_min_free: Size = Size(4 << 30)  # the disk cache stops growing when its file system has less free
    shm_dir: str = "/dev/shm"  # where prefetched files wait for stripefs.torch readers; empty: nowhere
    shm_size: Size = Size(512 << 20)  # most bytes of prefetched files waiting there
    metrics: str = "127.0.0.1:0"  # Prometheus /metrics at HOST:PORT (port 0: any free port; "": off)
    hedge_after_s: float = 0.5  # a replica read not answered by then is also asked of the next replica; 0 = never
    #: threads serving cold READs without trio (client/thread_reads.py); 0: every READ in trio (also -o read_threads=);
    #: while > 0, GETATTR misses are asked on plain threads too (client/thread_meta.py)
    read_threads: int = 4
    curve_key: str = ""  # this mount's NAME.key_secret (also -o key=); the meta address names the daemon's key
    subdir: str = ""  # expose only this directory of the cluster (also -o subdir=/team-a)
    root_squash: bool = False  # files root creates through this mount are nobody's (also -o root_squash)


C = TypeVar("C", bound=_Config)

ROLES: dict[str, type[_Config]] = {"meta": MetaConfig, "storage": StorageConfig, "client": ClientConfig}


def load(path: str | Path, kind: type[C]) -> C:
    """Read a config file; QuietError naming the file and the key on any problem."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise QuietError(f"cannot read config {path}: {exc.strerror}") from None
    return loads(data, kind, source=str(path))


def loads(data: bytes | str, kind: type[C], *, source: str = "<config>") -> C:
    try:
        return msgspec.toml.decode(data, type=kind, dec_hook=_dec_hook)
    except msgspec.ValidationError as exc:
        raise QuietError(f"{source}: {exc}") from None
    except msgspec.DecodeError as exc:
        raise QuietError(f"{source}: not valid TOML: {exc}") from None


def dumps(config: _Config) -> str:
    """TOML for a config (the local launcher writes its files with it).

    Configs are flat (strings, numbers, booleans, lists of strings), and JSON's
    quoting of those is valid TOML, so no TOML writer is needed.
    """
    lines = []
    for key, value in msgspec.structs.asdict(config).items():
        lines.append(f"{key} = {msgspec.json.encode(value, enc_hook=int).decode()}")
    return "\n".join(lines) + "\n"


_EXAMPLES = {
    "meta": '''\
# stripefs metadata daemon: stripefs meta --config /etc/stripefs/metad.toml
listen = "tcp://0.0.0.0:7100"        # ZeroMQ endpoint for clients and storage nodes
data_dir = "/var/lib/stripefs/meta"  # the SQLite database (WAL) lives here
store = "sqlite"                     # or "postgresql": metadata in PostgreSQL, several daemons (docs/postgresql.md)
dsn = ""                             # e.g. "host=db1,db2 dbname=stripefs user=stripefs target_session_attrs=read-write"
pool_size = 8                        # PostgreSQL connections (transactions in flight) of this daemon
node_timeout_s = 10.0                # storage node declared down after this much silence
session_lease_s = 15.0               # a mount's open files are released after this much silence
max_open_per_session = 262144        # inodes one mount's session may hold open (EMFILE past it); the heartbeat's own maximum
max_sessions_per_key = 256           # mounts (sessions) of one key at once; without CURVE, of all peers together
group_commit_ms = 0.0                # extra wait before each commit; changes arriving during an fsync share the next one
events_listen = "tcp://0.0.0.0:7102" # change feed (PUB) that keeps every mount's kernel cache true; default: a free port
read_listen = "tcp://0.0.0.0:7099"   # read lane: the mounts' plain threads' getattrs (SQLite); default: a free port; "off"
# layout of the root directory; new directories inherit their parent's
chunk_size = "4M"
stripe_count = 4
redundancy = "replicas=2"            # or "ec=4+2"
metrics = "127.0.0.1:9710"           # Prometheus /metrics, plain HTTP: loopback; for a remote Prometheus bind an address it reaches ("": off)
# self-healing
node_suspect_s = 5.0                 # storage node suspect after this much silence (down after node_timeout_s)
repair_bandwidth = "64M"             # bytes/s of re-replication, drain and rebalance copies; 0 = unlimited
repair_parallelism = 4               # chunk copies in flight at once
repair_scan_interval_s = 60.0        # full redundancy scan at least this often (at once after any node change)
rebalance_tolerance = 0.10           # move data until every node is within 10% of the mean utilisation
trash_keep_s = 86400.0               # removed files and directories are kept this long (stripefs trash); 0: off
# the cold tier on object storage (docs/tiering.md); credentials never go here, only the file naming them
tier_bandwidth = "64M"               # bytes/s the policy pass migrates; 0 = unlimited (recalls are never throttled)
tier_parallelism = 4                 # chunks moved to or from a bucket at once
tier_scan_interval_s = 60.0          # how often the policy pass runs (on the daemon running the duties)
tier_timeout_s = 5.0                 # a bucket request gives up after this; readers of cold data then get EIO
tier_credentials = ""                # an AWS shared-credentials file (0600); "": AWS_ACCESS_KEY_ID etc. of the daemon
tier_profile = ""                    # the profile in it ("": default)
# limits on what one peer may ask at once (docs/security.md)
per_peer_inflight = 64               # requests of one connection handled at once
per_peer_queue = 1024                # more of its requests waiting; past that they are answered BUSY
max_queued = 16384                   # waiting requests of all connections together; past that: BUSY
max_queued_bytes = "256M"            # their bytes together; past that: BUSY
request_timeout_s = 600.0            # a request still being handled after this is cancelled (TIMEOUT)
per_peer_reply_bytes = "64M"         # replies to one connection not yet taken by the network; past that its requests wait
# CURVE authentication and encryption (docs/security.md); required when listening beyond loopback
curve_key = "/etc/stripefs/keys/meta.key_secret"   # stripefs keygen /etc/stripefs/keys/meta
keyring = "/etc/stripefs/keyring.toml"             # the public keys allowed in, with their roles and rights
cap_secret = "/etc/stripefs/keys/cap_secret"       # stripefs cap-secret PATH; the same file on every daemon and node
cap_ttl_s = 3600.0                                 # capabilities for subtree keys live this long (mounts renew them)
''',
    "storage": '''\
# stripefs storage node: stripefs storage --config /etc/stripefs/storage-nvme0.toml
node_id = 1                          # unique in the cluster, never reused
listen = "tcp://0.0.0.0:7101"
advertise = "tcp://storage1.example:7101"  # what clients connect to (default: listen)
data_dir = "/srv/nvme0/stripefs"     # chunk files live here
meta = ["tcp://meta.example:7100?key=META_PUBLIC_KEY_40_CHARACTERS_OF_Z85_TEXT"]  # daemon(s), with its public key
host = ""                            # failure domain; default the hostname: replicas go to distinct hosts
heartbeat_interval_s = 2.0
block_size = "64K"                   # checksum granularity (xxh3 per block)
capacity = 0                         # bytes to offer; 0 = the whole file system
reserved_space = "64M"               # answer ENOSPC rather than fill the disk completely
io_threads = 8
metrics = "127.0.0.1:9711"           # Prometheus /metrics (plain HTTP: loopback unless a remote Prometheus must reach it); one port per node
scrub_bandwidth = "16M"              # bytes/s of background checksum verification; 0 = off
scrub_interval_s = 604800.0          # start a new scrub pass a week after the previous one began
# limits on what one peer may ask at once (docs/security.md)
per_peer_inflight = 64               # requests of one connection handled at once
per_peer_queue = 1024                # more of its requests waiting; past that they are answered BUSY
max_queued = 16384                   # waiting requests of all connections together; past that: BUSY
max_queued_bytes = "256M"            # their bytes together; past that: BUSY
request_timeout_s = 600.0            # a request still being handled after this is cancelled (TIMEOUT)
per_peer_reply_bytes = "64M"         # replies to one connection not yet taken by the network; past that its requests wait
# CURVE (docs/security.md): then meta addresses carry the daemon's public key: "tcp://meta.example:7100?key=Z85"
curve_key = "/etc/stripefs/keys/storage-nvme0.key_secret"
keyring = "/etc/stripefs/keyring.toml"
cap_secret = "/etc/stripefs/keys/cap_secret"       # the daemons' capability secret: subtree keys need capabilities
''',
    "client": '''\
# stripefs mount options: stripefs mount --config /etc/stripefs/client.toml META_ADDR MOUNTPOINT
meta = ["tcp://meta.example:7100?key=META_PUBLIC_KEY_40_CHARACTERS_OF_Z85_TEXT"]  # or META_ADDR on the command line
rpc_timeout_s = 10.0                 # every request to the daemon or a node gives up after this (never waits forever)
op_timeout_s = 60.0                  # a filesystem call the cluster cannot serve in this long fails (EIO); close reports lost writes
sync_close = false                   # true: close() of a small new file waits for its data (default: within 0.1 s after; fsync waits)
cache_size = "1G"                    # memory for chunks read ahead, prefetched and recently read
readahead_chunks = 8                 # the read-ahead window of a sequential reader grows to this many chunks
write_parallelism = 4                # chunks in flight to storage per file being written
ec_min_fragments_over_k = 1          # an ec=K+M stripe write succeeds with K+this fragments stored, nodes being down
write_inflight = 16                  # chunks in flight to storage, all files together (bounds memory)
attr_timeout_s = 1.0                 # kernel attribute cache lifetime while the change feed is down
entry_timeout_s = 1.0                # kernel name cache lifetime while the change feed is down
cache_timeout_s = 300.0              # ... while the feed is healthy (changes elsewhere invalidate at once)
dataset = false                      # read-only dataset mode: warm opens never leave the kernel (or -o dataset)
per_open_handles = false             # true: OPEN and RELEASE per open file, a write error goes to its own close (or -o per_open_handles)
passthrough = false                  # true (root, with disk_cache_dir): the kernel reads files cached whole from the local disk itself (or -o passthrough)
prefetch_parallel = 16               # files fetched at once by sampler-order prefetch (stripefs.torch)
max_background = 64                  # FUSE requests in flight (set through /sys/fs/fuse/connections)
disk_cache_dir = ""                  # e.g. "/nvme/stripefs-cache": chunk data kept across remounts; "" = none
disk_cache_size = "64G"              # most bytes the disk cache holds
disk_cache_min_free = "4G"           # stop caching when the disk has less than this free
shm_dir = "/dev/shm"                 # prefetched files wait here for stripefs.torch.read_file; "" = off
shm_size = "512M"                    # most bytes waiting there (each copy is deleted once read)
metrics = "127.0.0.1:9720"           # Prometheus /metrics (plain HTTP: loopback unless a remote Prometheus must reach it); one port per mount
hedge_after_s = 0.5                  # a replica slower than this: ask the next one too, take the first good answer
read_threads = 4                     # threads serving cold reads of small files without the event loop; 0 = off (or -o read_threads=)
curve_key = "/etc/stripefs/keys/client.key_secret"  # this mount's key (stripefs keygen; or -o key=)
subdir = ""                          # e.g. "/team-a": the mount shows only that directory (also -o subdir=)
root_squash = false                  # uid/gid 0 of new files and chowns become 65534 (also -o root_squash)
''',
}


def example(role: str) -> str:
    """A commented template for ``role`` (meta, storage, client)."""
    return _EXAMPLES[role]
