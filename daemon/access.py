"""Who may send what to the metadata daemon: roles, read-only keys, subtrees, root squash.

``MetaAccess.handle`` wraps every request handler (daemon/service.py). On a
CURVE socket ``serve()`` knows the sending key (common/security.py); the
keyring (common/keyring.py) gives its ``Grant``. On a plain socket (a local
cluster without ``--secure``) every peer is trusted as before.

* Role: every request type is in exactly one class below (a unit test checks
  that each request the daemon serves is classified). ``storage`` keys send
  only node requests, ``client`` keys no node or admin requests, ``admin``
  and ``meta`` keys anything.
* Read-only keys: every request that changes something (and an open for
  writing) is refused READ_ONLY (EROFS), before the handler runs.
* Subtree keys (``subdir``): every inode number in a request must lie inside
  the subtree: a directory whose chain of parents reaches the subtree's root,
  a file with a name inside it, or a file with no name left that this key
  unlinked (or replaced by a rename) there, while it may still be open, or
  whose chunks a snapshot inside the subtree still reads (``data_ino``).
  Access follows where a file is now: one with a name anywhere is judged by
  its names only, so a file an administrator moved (or linked) out of the
  subtree is out of reach however the key touched it before. Anything else is
  ACCESS (EACCES); a number naming no inode is NOT_FOUND. ``..`` is no directory entry, so names never climb.
  HelloRsp.root_ino tells the mount its root (the subtree, or the mount's own
  ``subdir`` inside it), and the mount maps FUSE's root inode to it.
* Root squash: uid or gid 0 in a request becomes 65534 (nobody), so files a
  squashed client creates or chowns are never root's.
* Capabilities: every reply that hands a subtree key chunk locations (an
  OpenRsp, alone or in lookups, readdir, LookupPathsRsp; a ChunksRsp) gets a
  ``Cap`` for its inode signed with ``cap_secret``, which storage nodes demand
  of that key (common/capability.py); ``CapsReq`` renews them. Other keys get
  none.

Checks and the operation take the daemon's lock separately: an administrator
moving a directory out of a subtree while a request of that subtree is in
flight may let that one request through (docs/security.md).
"""

from __future__ import annotations

import logging
import stat
from typing import Awaitable, Callable

import msgspec

from ..common import protocol as P
from ..common.errors import ErrorCode, StripefsError
from ..common.keyring import TRUSTED, Grant, Keyring, squash
from ..common.security import current_peer, split_address

log = logging.getLogger(__name__)

#: only storage nodes send these
NODE_REQUESTS = frozenset({P.RegisterNodeReq, P.NodeHeartbeatReq, P.ReportBadChunksReq})
#: only admin (and meta) keys send these
ADMIN_REQUESTS = frozenset({
    P.NodeAdminReq, P.ScrubReq, P.FsckReq, P.QuotaSetReq, P.QuotaRecountReq,
    P.TierAddReq, P.TierPolicySetReq, P.TierMigrateReq, P.TierFsckReq,
    P.SnapshotCreateReq, P.SnapshotDeleteReq,  # a snapshot holds space nobody is charged for (docs/snapshots.md)
})
#: the cluster's tiers themselves (buckets, endpoints, every bucket's objects): admin keys of no subtree
CLUSTER_ADMIN_REQUESTS = frozenset({P.TierAddReq, P.TierFsckReq})
#: change the namespace or data: refused to read-only keys
CHANGING_REQUESTS = frozenset({
    P.CreateReq, P.MknodReq, P.MkdirReq, P.SymlinkReq, P.LinkReq, P.UnlinkReq, P.RmdirReq, P.RenameReq,
    P.SetattrReq, P.SetxattrReq, P.RemovexattrReq, P.SetLayoutReq, P.AllocEpochReq, P.AllocChunksReq,
    P.ReplaceReplicaReq, P.CommitReq, P.CreateShadowReq, P.SwapShadowReq, P.ReleaseChunksReq,
    P.TrashRestoreReq, P.TrashPurgeReq, P.DelegateInodesReq,
    P.OnceReq,  # carries only changing requests; what it carries is checked again on its own (handle_once)
    P.BatchReq,  # the same, item by item (handle_batch)
})
#: read or keep a session; OpenReq with ``write`` counts as changing
READING_REQUESTS = frozenset({
    P.PingReq, P.StatusReq, P.HelloReq, P.SessionHeartbeatReq, P.SessionEndReq, P.LookupReq, P.LookupPathsReq, P.GetattrReq,
    P.ReadlinkReq, P.ReaddirReq, P.OpenReq, P.CloseReq, P.StatfsReq, P.GetxattrReq, P.ListxattrReq, P.GetLayoutReq,
    P.QuotaGetReq, P.QuotaRoomReq, P.CapsReq, P.AckReq, P.TierListReq,
    P.TierRecallReq,  # a reader of a cold file brings its data back (docs/tiering.md)
    P.TrashListReq, P.SnapshotListReq,
})
#: request fields holding inode numbers (checked against a key's subtree)
INODE_FIELDS = ("ino", "parent", "new_parent", "parent_old", "parent_new", "root", "shadow")


class MetaAccess:
    def __init__(self, txn, store, nodes, ns, sessions) -> None:
        self.txn = txn  # daemon/txn.py
        self.store = store
        self.nodes = nodes  # daemon/health.py NodeRegistry
        self.ns = ns  # daemon/namespace.py
        self.sessions = sessions  # daemon/health.py Sessions
        self.keyring: Keyring | None = None  # None: CURVE off, every peer trusted
        self._kept: dict[str, set[int]] = {}  # per subtree key: inodes it unlinked inside its subtree
        self.caps = None  # common.capability.Capabilities: signs capabilities for subtree keys (cap_secret)
        self._warned_no_caps = False

    def grant(self) -> Grant:
        peer = current_peer()
        if peer is None:
            return TRUSTED
        grant = self.keyring.grant(peer) if self.keyring is not None else None
        if grant is None:  # accepted at connect time, removed from the keyring since
            log.warning("request from key %s refused: it is no longer in the keyring", peer)
            raise StripefsError(ErrorCode.ACCESS, "this key is not in the cluster's keyring")
        return grant

    def admit_now(self, body: P.Msg) -> P.Msg | None:
        """The request path without a task (daemon/burst.py): ``body`` as ``handle`` would hand
        it to its handler, when that needs only the key's grant (role, read-only, squash: the
        same checks, raising the same errors). None when ``handle`` must take it: a subtree key
        (its inodes are checked under the lock and its replies signed) or a HelloReq naming a
        subdir. A OnceReq or BatchReq comes back as it is; what it carries is admitted on its own."""
        grant = self.grant()
        if grant.subdir or (isinstance(body, P.HelloReq) and body.subdir):
            return None
        return self._admit(grant, body)

    def _admit(self, grant: Grant, body: P.Msg) -> P.Msg:
        """Role and read-only checks, root squash, node keys: what every request passes first."""
        self._check_role(grant, body)
        if isinstance(body, (P.OnceReq, P.BatchReq)):  # what it carries is checked on its own (handle_once, handle_batch)
            return body
        if grant.root_squash:
            body = squash(body)
        if type(body) in NODE_REQUESTS and grant is not TRUSTED:
            self._check_node_key(grant, body)
        return body

    async def handle(self, body: P.Msg, handler: Callable[[P.Msg], Awaitable[P.Msg]]) -> P.Msg:
        grant = self.grant()
        body = self._admit(grant, body)
        if isinstance(body, (P.OnceReq, P.BatchReq)):  # signed (if at all) item by item
            return await handler(body)
        if not grant.subdir and not (isinstance(body, P.HelloReq) and body.subdir):
            return await handler(body)
        top = await self.txn.read(self._subtree_root, grant.subdir.encode())  # ino 1 when unrestricted
        if isinstance(body, P.HelloReq):
            root = top
            if body.subdir:
                root = await self.txn.read(self._subtree_root, body.subdir, top)
            rsp = await handler(body)
            log.info("session %d (key %s) sees only %s", rsp.session_id, grant.name, (body.subdir or grant.subdir.encode()).decode(errors="replace"))
            return msgspec.structs.replace(rsp, root_ino=root)
        await self.txn.read(self._check_inodes, grant, top, body)
        if isinstance(body, (P.TrashRestoreReq, P.TrashPurgeReq)):
            body = await self.txn.read(self._trash_scope, grant, top, body)
        if isinstance(body, P.SessionHeartbeatReq) and body.open_inodes:
            body = await self.txn.read(self._open_inside, grant, top, body)
        if isinstance(body, P.AckReq) and body.open_inodes:  # a subtree mount holds no callbacks (client/kernel_cache.py)
            body = msgspec.structs.replace(body, open_inodes=[])
        rsp = await handler(body)
        named = self._capped_inodes(body, rsp) if self.caps is not None else []
        if named:  # what a capability is signed for must lie inside the subtree, whatever the reply says
            await self.txn.read(self._check_named, grant, top, body, named)
        if isinstance(rsp, P.TierListRsp):
            rsp = await self.txn.read(self._visible_tiers, grant, top, rsp)
        if isinstance(body, P.TrashListReq):
            rsp = await self.txn.read(self._visible_trash, grant, top, rsp)
        return self._with_caps(grant, body, rsp)

    # -- roles ---------------------------------------------------------------------

    def _check_role(self, grant: Grant, body: P.Msg) -> None:
        kind = type(body)
        if grant.role == "meta":
            return
        if kind in NODE_REQUESTS:
            if grant.role != "storage":
                raise self._refuse(grant, body, ErrorCode.ACCESS, "only storage node keys send this")
            return
        if grant.role == "storage":
            if kind not in (P.PingReq, P.StatusReq):
                raise self._refuse(grant, body, ErrorCode.ACCESS, "a storage node key sends only node requests")
            return
        if kind in ADMIN_REQUESTS and grant.role != "admin":
            raise self._refuse(grant, body, ErrorCode.ACCESS, "this needs an admin key")
        if kind in CLUSTER_ADMIN_REQUESTS and grant.subdir:
            raise self._refuse(grant, body, ErrorCode.ACCESS, "this needs an admin key restricted to no subtree")
        if grant.read_only and (kind in CHANGING_REQUESTS or (kind is P.OpenReq and body.write)):
            raise self._refuse(grant, body, ErrorCode.READ_ONLY, "this key is read-only")

    @staticmethod
    def _refuse(grant: Grant, body: P.Msg, code: ErrorCode, why: str) -> StripefsError:
        log.warning("refused %s from key %r (role %s): %s", type(body).__name__, grant.name, grant.role, why)
        return StripefsError(code, f"{type(body).__name__} refused: {why}")

    def _check_node_key(self, grant: Grant, req: P.Msg) -> None:
        """A node id belongs to the key that registered it, while the keyring lists that key: a
        storage key cannot take over another node's id (and its clients' reads and writes)."""
        if isinstance(req, P.RegisterNodeReq):
            if split_address(req.address)[1] != grant.public:
                log.warning("node %d registered %s with key %r, not its own: refused", req.node_id, req.address, grant.name)
                raise StripefsError(ErrorCode.ACCESS, "a node must register its address with its own key (ADDRESS?key=PUBLIC)")
            self.check_registration(grant, req)
            return
        owner = split_address(self.nodes.address(req.node_id))[1] if self.nodes else None
        if owner and owner != grant.public:
            log.warning("key %r sent %s for node %d, which key %s registered: refused", grant.name, type(req).__name__,
                        req.node_id, owner)
            raise StripefsError(ErrorCode.ACCESS, f"node {req.node_id} is registered with another key")

    def check_registration(self, grant: Grant, req: P.RegisterNodeReq) -> None:
        """Whether ``grant``'s key may register ``req.node_id``: no id another listed key holds, and
        for a storage key at most ``node_ids`` ids (keyring, default 1): those it registered first,
        until an operator removes one. The handler asks again under the registry's lock, with the
        registration, since registrations of one key run concurrently (daemon/service.py)."""
        nodes = self.nodes
        if grant is TRUSTED or not nodes:
            return
        owner = split_address(nodes.address(req.node_id))[1]
        if owner and owner != grant.public and self.keyring.grant(owner) is not None:
            log.warning("key %r sent %s for node %d, which key %s registered: refused", grant.name, type(req).__name__,
                        req.node_id, owner)
            raise StripefsError(ErrorCode.ACCESS, f"node {req.node_id} is registered with another key")
        if grant.role == "storage":
            held = nodes.held_by(grant.public)
            if req.node_id not in held and len(held) >= grant.node_ids:
                log.warning("key %r registered node %d but already holds node id(s) %s (node_ids = %d): refused",
                            grant.name, req.node_id, sorted(held)[:10], grant.node_ids)
                raise StripefsError(ErrorCode.ACCESS, f"this key already holds {len(held)} node id(s), its limit: remove one "
                                    "(stripefs node remove) or raise node_ids in the keyring")

    # -- capabilities (common/capability.py) ----------------------------------------------

    async def handle_caps(self, req: P.CapsReq) -> P.Msg:
        """Fresh capabilities; the inodes were checked against the key's subtree by ``handle``."""
        grant = self.grant()
        if not grant.subdir or self.caps is None:
            return P.CapsRsp(caps=[])
        return P.CapsRsp(caps=[self.caps.issue(ino, not grant.read_only, grant.public) for ino in req.inos])

    @staticmethod
    def _capped_inodes(body: P.Msg, rsp: P.Msg) -> list[int]:
        """The files ``_with_caps`` would sign a capability for in ``rsp``."""
        if isinstance(rsp, P.OpenRsp):
            return [rsp.attr.ino] if stat.S_ISREG(rsp.attr.mode) else []
        if isinstance(rsp, P.ChunksRsp):
            return [body.ino]
        if isinstance(rsp, (P.ReaddirRsp, P.LookupPathsRsp)) and rsp.files:
            return [f.attr.ino for f in rsp.files if f is not None and stat.S_ISREG(f.attr.mode)]
        return []

    def _check_named(self, grant: Grant, top: int, body: P.Msg, inodes: list[int]) -> None:
        """Every inode a reply hands a subtree key chunk locations of is inside its subtree (a
        reply built from anything but the request's own inodes, a stored retry result say,
        must not become a capability for another team's file)."""
        for ino in dict.fromkeys(inodes):
            try:
                inside = self._inside(grant, top, ino)
            except StripefsError:  # gone meanwhile: nothing to sign for
                continue
            if not inside:
                log.warning("refused %s from key %r: its reply names inode %d, outside %s", type(body).__name__,
                            grant.name, ino, grant.subdir)
                raise StripefsError(ErrorCode.ACCESS, f"inode {ino} is outside this key's subtree")

    def _with_caps(self, grant: Grant, body: P.Msg, rsp: P.Msg) -> P.Msg:
        """``rsp`` with a capability for each file whose chunk locations it hands out."""
        if self.caps is None:
            if not self._warned_no_caps and isinstance(rsp, (P.OpenRsp, P.ChunksRsp, P.ReaddirRsp, P.LookupPathsRsp)):
                self._warned_no_caps = True
                log.warning("key %r is restricted to %s but this daemon has no cap_secret: storage nodes will refuse "
                            "its chunk requests; set cap_secret in metad.toml and storage.toml (docs/security.md)",
                            grant.name, grant.subdir)
            return rsp
        write, key = not grant.read_only, grant.public

        def signed(info):
            if info is None or not stat.S_ISREG(info.attr.mode):
                return info
            return msgspec.structs.replace(info, cap=self.caps.issue(info.attr.ino, write, key))

        if isinstance(rsp, P.OpenRsp):
            return signed(rsp)
        if isinstance(rsp, P.ChunksRsp):
            return msgspec.structs.replace(rsp, cap=self.caps.issue(body.ino, write, key))
        if isinstance(rsp, (P.ReaddirRsp, P.LookupPathsRsp)) and rsp.files:
            return msgspec.structs.replace(rsp, files=[signed(f) for f in rsp.files])
        return rsp

    # -- status ----------------------------------------------------------------------------------

    def visible_quotas(self, grant: Grant, quotas: list[P.QuotaInfo]) -> list[P.QuotaInfo]:
        """The quotas of StatusRsp a key may see (under the lock): none for a storage key; for a
        subtree key those on its subtree and below, with paths as its mounts see them ("/" is the
        subtree); all for the others."""
        if grant.role == "storage":
            return []
        if not grant.subdir:
            return quotas
        try:
            top = self._subtree_root(grant.subdir.encode())
        except StripefsError:  # the subtree is gone: nothing of it to show
            return []
        base = grant.subdir.encode().rstrip(b"/")
        shown = []
        for q in quotas:
            if q.ino != top and not (q.ino != 1 and self.ns.is_ancestor(top, q.ino)):
                continue
            path = q.path[len(base):] if q.path.startswith(base + b"/") else b""
            shown.append(msgspec.structs.replace(q, path=path or b"/"))
        return shown

    def _visible_tiers(self, grant: Grant, top: int, rsp: P.TierListRsp) -> P.TierListRsp:
        """What a subtree key sees of the tiers (under the lock): their names and usage, not where
        they are (bucket, endpoint, region: the cluster's, not the team's), and only the policies
        on its subtree and below, with paths as its mounts see them ("/" is the subtree)."""
        base = grant.subdir.encode().rstrip(b"/")
        policies = []
        for p in rsp.policies:
            if p.ino != top and not (p.ino != 1 and self.ns.is_ancestor(top, p.ino)):
                continue
            path = p.path[len(base):] if p.path.startswith(base + b"/") else b""
            policies.append(msgspec.structs.replace(p, path=path or b"/"))
        tiers = [msgspec.structs.replace(t, url="", endpoint="", region="") for t in rsp.tiers]
        return P.TierListRsp(tiers=tiers, policies=policies)

    # -- the trash (daemon/trash.py): a subtree key reaches what was removed inside its subtree --

    def _trash_scope(self, grant: Grant, top: int, body: P.Msg) -> P.Msg:
        """A restore or purge of a subtree key names only what was removed inside its subtree;
        a purge of everything becomes one of those. Another team's items are NOT_FOUND, as if
        they were not there (their numbers say nothing)."""
        trash = self.ns.trash
        if isinstance(body, P.TrashPurgeReq) and body.everything:
            mine = [r.ino for r in trash.rows() if trash.origin_inside(top, r.ino)]
            return P.TrashPurgeReq(items=mine)
        items = [body.item] if isinstance(body, P.TrashRestoreReq) else body.items
        for ino in items:
            if not (trash.holds(ino) and trash.origin_inside(top, ino)):
                log.warning("refused %s from key %r: %d is not in the trash of %s", type(body).__name__, grant.name, ino, grant.subdir)
                raise StripefsError(ErrorCode.NOT_FOUND, f"{ino} is not in this subtree's trash (see stripefs trash list)")
        return body

    def _visible_trash(self, grant: Grant, top: int, rsp: P.TrashRsp) -> P.TrashRsp:
        """What a subtree key sees of the trash: what was removed inside its subtree, with paths
        as its mounts see them ("/" is the subtree)."""
        base = self.ns.path_of(top).rstrip(b"/")
        shown = []
        for e in rsp.entries:
            if not self.ns.trash.origin_inside(top, e.ino):
                continue
            path = e.path[len(base):] if base and e.path.startswith(base + b"/") else e.path
            shown.append(msgspec.structs.replace(e, path=path))
        return msgspec.structs.replace(rsp, entries=shown)

    # -- the change feed (daemon/events.py) ---------------------------------------------------

    def feed_views(self, rows: list[tuple[int, bytes]], subdirs: set[str]) -> dict[str, dict]:
        """What a key restricted to each of ``subdirs`` may hear of change-log ``rows``: per
        subtree, seq -> (inodes, entries) inside it as the namespace stands now (under the lock,
        or in the read transaction). A subtree that does not exist hears of nothing."""
        from . import change_log

        store = self.store
        chains: dict[int, frozenset[int]] = {}  # directory -> itself and its ancestors (empty: detached)

        def chain(ino: int) -> frozenset[int]:
            path, cur = [], ino
            while cur not in chains:
                path.append(cur)
                if cur == 1:
                    above = frozenset()  # the root: nothing above it
                    break
                parent = store.parent_of(cur)
                if parent is None or len(path) > 100_000:  # removed meanwhile (or a loop): reaches no subtree
                    chains.update(dict.fromkeys(path, frozenset()))
                    return chains[ino]
                cur = parent
            else:
                above = chains[cur]
                if not above:  # below a detached directory
                    chains.update(dict.fromkeys(path, above))
                    return chains[ino]
            for d in reversed(path):
                above = above | {d}
                chains[d] = above
            return chains[ino]

        holders: dict[int, list[int]] = {}  # inode -> the directories holding it (itself for a directory)

        def holding(ino: int) -> list[int]:
            if ino not in holders:
                row = store.get_inode(ino)
                if row is None:
                    holders[ino] = []
                elif stat.S_ISDIR(row["mode"]):
                    holders[ino] = [ino]
                else:
                    holders[ino] = [parent for _, parent, _ in store.dentries_of(ino)]
            return holders[ino]

        tops = {}
        for subdir in subdirs:
            try:
                tops[subdir] = self._subtree_root(subdir.encode())
            except StripefsError:  # the subtree is gone (or not made yet)
                tops[subdir] = None
        views: dict[str, dict] = {subdir: {} for subdir in subdirs}
        for seq, blob in rows:
            inodes, entries = change_log.decode(blob)
            for subdir, top in tops.items():
                if top is None:
                    views[subdir][seq] = ([], [])
                    continue
                seen = [i for i in inodes if i == top or any(top in chain(d) for d in holding(i))]
                named = [(parent, name) for parent, name in entries if top in chain(parent)]
                views[subdir][seq] = (seen, named)
        return views

    # -- subtrees (called under the transaction lock) ----------------------------------------

    def _subtree_root(self, path: bytes, start: int = 1) -> int:
        """The directory inode of absolute ``path`` (below ``start`` when given one)."""
        ns = self.ns
        ino = 1
        for name in filter(None, path.split(b"/")):
            if name in (b".", b".."):
                raise StripefsError(ErrorCode.INVALID, f"subdir {path!r} may not contain . or ..")
            try:
                ino = ns.lookup(ino, name).ino
            except StripefsError as exc:
                raise StripefsError(exc.code, f"subdir {path.decode(errors='replace')}: {exc.message}") from None
        if not stat.S_ISDIR(ns.getattr(ino).mode):
            raise StripefsError(ErrorCode.NOT_DIR, f"subdir {path.decode(errors='replace')} is not a directory")
        if start != 1 and not ns.is_ancestor(start, ino):
            raise StripefsError(ErrorCode.ACCESS, f"subdir {path.decode(errors='replace')} is outside this key's subtree")
        return ino

    def _check_inodes(self, grant: Grant, top: int, body: P.Msg) -> None:
        for field in INODE_FIELDS:
            ino = getattr(body, field, None)
            if isinstance(ino, int) and not self._inside(grant, top, ino):
                log.warning("refused %s from key %r: inode %d is outside %s", type(body).__name__, grant.name, ino, grant.subdir)
                raise StripefsError(ErrorCode.ACCESS, f"inode {ino} is outside this key's subtree")
        for inos in (getattr(body, "inos", None),):
            if inos and any(not self._inside(grant, top, i) for i in inos):
                raise StripefsError(ErrorCode.ACCESS, "an inode is outside this key's subtree")
        if isinstance(body, (P.UnlinkReq, P.RenameReq)):  # the inode that may become an open orphan stays reachable
            # (while it has no name: _inside); a renamed file keeps its name, so only a replaced one is noted
            victims = [(body.parent, body.name)] if isinstance(body, P.UnlinkReq) else [(body.parent_new, body.name_new)]
            kept = self._kept.setdefault(grant.public, set())
            for parent, name in victims:
                row = self.store.get_dentry(parent, name)
                if row is not None and len(self.store.dentries_of(row["ino"])) == 1:  # its last name goes
                    kept.add(row["ino"])
            if len(kept) > 100_000:  # forget inodes that are gone
                self._kept[grant.public] = {i for i in kept if self.store.get_inode(i) is not None}

    def _open_inside(self, grant: Grant, top: int, req: P.SessionHeartbeatReq) -> P.SessionHeartbeatReq:
        """A heartbeat holding only inodes of the subtree: those the session did not hold yet are
        checked (the others were, when it opened them), those outside (or gone) are left out."""
        held = self.sessions.holding(req.session_id)
        keep = []
        for ino in req.open_inodes:
            try:
                inside = ino in held or self._inside(grant, top, ino)
            except StripefsError:  # no such inode
                inside = False
            if inside:
                keep.append(ino)
        if len(keep) == len(req.open_inodes):
            return req
        log.warning("key %r: session %d named %d open inode(s) outside %s; not held", grant.name, req.session_id,
                    len(req.open_inodes) - len(keep), grant.subdir)
        return msgspec.structs.replace(req, open_inodes=keep)

    def _inside(self, grant: Grant, top: int, ino: int) -> bool:
        if ino == top:
            return True
        store, ns = self.store, self.ns
        row = store.get_inode(ino)
        if row is None:
            snapshots = store.pinned_by(ino)  # freed, but a snapshot still reads its chunks (daemon/snapshots.py)
            if not snapshots:
                raise StripefsError(ErrorCode.NOT_FOUND, f"no inode {ino}")
            return any(self._inside(grant, top, s) for s in snapshots)
        if stat.S_ISDIR(row["mode"]):
            return ino != 1 and ns.is_ancestor(top, ino)
        names = store.dentries_of(ino)
        if names:  # where the file is now, whatever this key did to it before
            return any(ns.is_ancestor(top, parent) for _, parent, _ in names)
        if ino in self._kept.get(grant.public, ()):  # an orphan this key unlinked, maybe still open
            return True
        # a removed file (in the trash, say) whose chunks a snapshot inside the subtree still reads
        # (daemon/snapshots.py): the snapshot's readers need capabilities for its chunk ids
        return any(self._inside(grant, top, s) for s in store.pinned_by(ino))
