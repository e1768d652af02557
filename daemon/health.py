"""Who is alive: storage nodes (up/down) and client sessions (open files).

Storage nodes
-------------
A node registers (RegisterNodeReq) at start and whenever the daemon answers
its heartbeat with NOT_FOUND (the daemon restarted and does not know it yet).
Registration is stored in the ``nodes`` table so that chunk maps can name the
node's address while it is down. A node silent for ``node_timeout_s`` is
declared down (WARNING); its next heartbeat brings it back (INFO). At daemon
start every known node is down until it heartbeats: the daemon never places
data on a node it has not heard from in this boot.

Sessions
--------
A mount says HelloReq and gets a session id, never reused within this boot
(they start from a random base so ids of two boots rarely collide). Its
SessionHeartbeatReq carries the full set of inodes it has open and replaces
the previous one. A session silent for ``session_lease_s`` expires (INFO) and
its open set is dropped. Sessions live in memory only: after a restart the
daemon answers NOT_FOUND and mounts say hello again. ``is_open(ino)`` is what
keeps an unlinked inode (an orphan) alive; every method that can drop the
last reference to an inode returns those inodes so the caller can reclaim
orphans among them.

Both classes take ``now`` (monotonic seconds) as an argument so tests can
drive time by hand.
"""

from __future__ import annotations

import collections
import logging
import random
import time
from dataclasses import dataclass, field

from ..common import protocol
from ..common.errors import ErrorCode, StripefsError
from .placement import NodeView
from .store import SqliteStore

log = logging.getLogger(__name__)


@dataclass
class _Node:
    node_id: int
    address: str
    host: str
    capacity: int = 0
    free: int = 0
    used: int = 0
    chunks: int = 0
    last_heartbeat: float = float("-inf")  # monotonic seconds
    up: bool = False


class NodeRegistry:
    """Storage nodes known to this daemon, in memory, registrations persisted in the store."""

    def __init__(self, store: SqliteStore, node_timeout_s: float):
        self._store = store
        self._timeout = node_timeout_s
        self._nodes: dict[int, _Node] = {}
        for row in store.all_nodes():
            self._nodes[row["node_id"]] = _Node(
                row["node_id"], row["address"], row["host"], row["capacity"], row["free"], row["used"], row["chunks"]
            )
        if self._nodes:
            log.info("%d known storage node(s), all down until they heartbeat: %s", len(self._nodes), sorted(self._nodes))

    def register(self, req: protocol.RegisterNodeReq, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if req.node_id < 1:  # 0 marks a missing EC fragment in chunk rows (daemon/redundancy.py)
            raise StripefsError(ErrorCode.INVALID, f"storage node id {req.node_id} is invalid: ids start at 1")
        node = self._nodes.get(req.node_id)
        if node is None:
            node = self._nodes[req.node_id] = _Node(req.node_id, req.address, req.host)
            log.info("node %d registered: %s, host %s", req.node_id, req.address, req.host)
        elif not node.up or node.address != req.address or node.host != req.host:
            log.info("node %d is up: %s, host %s", req.node_id, req.address, req.host)
        node.address, node.host = req.address, req.host
        node.capacity, node.free, node.used, node.chunks = req.capacity_bytes, req.free_bytes, req.used_bytes, req.chunks
        node.last_heartbeat = now
        node.up = True
        self._store.upsert_node(
            req.node_id, req.address, req.host, req.capacity_bytes, req.free_bytes, req.used_bytes, req.chunks, time.time_ns()
        )

    def heartbeat(self, req: protocol.NodeHeartbeatReq, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if req.node_id < 1:  # 0 marks a missing EC fragment in chunk rows (daemon/redundancy.py)
            raise StripefsError(ErrorCode.INVALID, f"storage node id {req.node_id} is invalid: ids start at 1")
        node = self._nodes.get(req.node_id)
        if node is None:
            raise StripefsError(ErrorCode.NOT_FOUND, f"node {req.node_id} is not registered; register again")
        node.capacity, node.free, node.used, node.chunks = req.capacity_bytes, req.free_bytes, req.used_bytes, req.chunks
        node.last_heartbeat = now
        if not node.up:
            node.up = True
            log.info("node %d is up again (%s)", req.node_id, node.address)

    def sweep(self, now: float | None = None) -> list[int]:
        """Declare silent nodes down; the ids that just went down."""
        now = time.monotonic() if now is None else now
        went_down = []
        for node in self._nodes.values():
            if node.up and now - node.last_heartbeat > self._timeout:
                node.up = False
                went_down.append(node.node_id)
                log.warning(
                    "node %d (%s) is down: no heartbeat for %.1fs", node.node_id, node.address, now - node.last_heartbeat
                )
        return went_down

    def is_up(self, node_id: int) -> bool:
        node = self._nodes.get(node_id)
        return node is not None and node.up

    def address(self, node_id: int) -> str:
        node = self._nodes.get(node_id)
        return node.address if node else ""

    def up_ids(self) -> list[int]:
        return [n.node_id for n in self._nodes.values() if n.up]

    def views(self) -> list[NodeView]:
        """Every node, for placement (which uses only the up ones)."""
        return [NodeView(n.node_id, n.host, n.free, n.up) for n in self._nodes.values()]

    def capacity(self) -> tuple[int, int]:
        """(total, free) bytes over the nodes that are up."""
        up = [n for n in self._nodes.values() if n.up]
        return sum(n.capacity for n in up), sum(n.free for n in up)

    def info(self, now: float | None = None) -> list[protocol.NodeInfo]:
        now = time.monotonic() if now is None else now
        return [
            protocol.NodeInfo(
                node_id=n.node_id,
                address=n.address,
                host=n.host,
                state="up" if n.up else "down",
                capacity_bytes=n.capacity,
                free_bytes=n.free,
                used_bytes=n.used,
                chunks=n.chunks,
                last_heartbeat_age_s=max(0.0, now - n.last_heartbeat) if n.last_heartbeat > float("-inf") else -1.0,
            )
            for n in sorted(self._nodes.values(), key=lambda n: n.node_id)
        ]


@dataclass
class _Session:
    session_id: int
    host: str
    pid: int
    mountpoint: str
    last_seen: float
    open: set[int] = field(default_factory=set)


class Sessions:
    """Mounts and the inodes they hold open, with an open count per inode."""

    def __init__(self, lease_s: float):
        self.lease_s = lease_s
        self._sessions: dict[int, _Session] = {}
        self._next_id = random.randrange(1, 1 << 30) << 16
        self._open_count: collections.Counter[int] = collections.Counter()

    def __len__(self) -> int:
        return len(self._sessions)

    def hello(self, host: str, pid: int, mountpoint: str, now: float | None = None) -> int:
        now = time.monotonic() if now is None else now
        self._next_id += 1
        sid = self._next_id
        self._sessions[sid] = _Session(sid, host, pid, mountpoint, now)
        log.info("session %d opened by %s pid %d (%s)", sid, host, pid, mountpoint or "no mountpoint")
        return sid

    def _get(self, session_id: int, now: float | None, *, adopt: bool = False) -> _Session:
        """The session, lease renewed. ``adopt``: a session this daemon does not know
        (it restarted) is taken back under its old id rather than failing the request:
        sessions are soft state that mounts rebuild, and an open() must not fail for it."""
        now = time.monotonic() if now is None else now
        session = self._sessions.get(session_id)
        if session is None:
            if not adopt:
                raise StripefsError(ErrorCode.NOT_FOUND, f"session {session_id} is unknown or expired; say hello again")
            session = self._sessions[session_id] = _Session(session_id, "?", 0, "", now)
            log.info("session %d adopted (opened before this daemon started)", session_id)
        session.last_seen = now
        return session

    def _set_open(self, session: _Session, inos: set[int]) -> list[int]:
        """Replace the open set; the inodes nobody has open any more."""
        for ino in inos - session.open:
            self._open_count[ino] += 1
        released = []
        for ino in session.open - inos:
            self._open_count[ino] -= 1
            if self._open_count[ino] <= 0:
                del self._open_count[ino]
                released.append(ino)
        session.open = inos
        return released

    def heartbeat(self, session_id: int, open_inodes: list[int], now: float | None = None) -> list[int]:
        return self._set_open(self._get(session_id, now), set(open_inodes))

    def touch(self, session_id: int, now: float | None = None) -> None:
        """Renew the session's lease (adopting it if this daemon restarted since it began)."""
        self._get(session_id, now, adopt=True)

    def open(self, session_id: int, ino: int, now: float | None = None) -> None:
        session = self._get(session_id, now, adopt=True)
        if ino not in session.open:
            self._set_open(session, session.open | {ino})

    def close(self, session_id: int, ino: int, now: float | None = None) -> list[int]:
        session = self._get(session_id, now)
        return self._set_open(session, session.open - {ino})

    def expire(self, now: float | None = None) -> list[int]:
        """Drop sessions silent for longer than the lease; the inodes nobody has open any more."""
        now = time.monotonic() if now is None else now
        released: list[int] = []
        for sid, session in list(self._sessions.items()):
            if now - session.last_seen > self.lease_s:
                log.info(
                    "session %d (%s pid %d) expired after %.1fs of silence; releasing %d open inode(s)",
                    sid, session.host, session.pid, now - session.last_seen, len(session.open),
                )
                released += self._set_open(session, set())
                del self._sessions[sid]
        return released

    def is_open(self, ino: int) -> bool:
        return self._open_count.get(ino, 0) > 0
