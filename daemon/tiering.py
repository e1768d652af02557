"""The cold tier on object storage: migrate, recall, the policy pass, the object collector.

The specification (object names, schema, the states of a chunk, crash rules,
writers, verification) is docs/tiering.md; this module carries it out.

* ``migrate_chunk``: read the chunk from its nodes (EC: K fragments of exactly
  its version, decoded), upload it with its xxh3, HEAD it back, then one
  compare-and-swap transaction makes the row cold (no nodes) and queues the
  node copies as garbage. The intent ('uploading' row) is durable before the
  first byte goes, so every object the cluster may own has a row.
* ``recall_chunk``: GET, check against the store's length and xxh3, write the
  copies (or the K+M fragments, coded here) with the chunk's own version to
  nodes the placement rules choose, then a compare-and-swap gives the row
  its nodes back and queues the object for deletion. Concurrent recalls of
  one chunk in this daemon share one transfer.
* the duties (``run`` on the duties leader): resume 'uploading' rows (after a
  restart or a failed pass), apply policies every ``tier_scan_interval_s``
  (``tier_bandwidth`` throttled), sweep objects nobody needs into
  ``tier_garbage`` and delete them.

The node side of the moves reuses the healer's connections (repair.NodeClients)
and its token bucket (repair.Throttle). Blocking boto3 runs in worker threads
(daemon/tier_store.py).

Atomicity: each compare-and-swap is one synchronous function run with
``txn.write_locked`` under ``txn.lock``, no await inside.
"""

from __future__ import annotations

import logging
import stat
import time
from typing import TYPE_CHECKING, Callable

import trio

from ..common import protocol as P
from ..common.erasure import codec, fragment_part
from ..common.errors import ErrorCode, StripefsError
from ..common.layout import parse_redundancy, replica_part
from . import placement, redundancy
from .metrics import TIER_BYTES, TIER_OBJECTS, TIER_RECALL_SECONDS
from .db import ROOT_INO
from .repair import Throttle
from .snapshots import check_writable
from .tier_store import Bucket, checksum, object_name, parse_object_name, parse_url, to_signed, to_unsigned

if TYPE_CHECKING:
    from .repair import Healer

log = logging.getLogger(__name__)

#: 'uploading' rows the policy pass queues at most at once (the backlog shown by status)
TIER_QUEUE = 4096
#: orphan objects moved to tier_garbage, and garbage objects deleted, per round
GC_BATCH = 1000
#: the sweep for objects no file needs (a scan of tier_objects) runs when woken by a deletion or
#: truncation in the namespace, after GC_COALESCE_S, and at least every SWEEP_INTERVAL_S (orphans
#: reclaimed later, say); objects waiting for deletion are retried every GC_INTERVAL_S
GC_INTERVAL_S = 5.0
GC_COALESCE_S = 0.2
SWEEP_INTERVAL_S = 30.0
NODE_TIMEOUT_S = 10.0  # plus one second per MiB: one chunk read or one durable write on a node
RETRY_S = 5.0
#: a recall waits up to this many tenths of a second for pending deletions of the chunk's released
#: copies when too few other nodes could take its copies
RECALL_PLACE_TRIES = 50


# -- pure rules (tests/unit/test_tiering.py) ---------------------------------------------


def is_cold(version: int, nodes) -> bool:
    """A chunk in a tier: written, and on no storage node (docs/tiering.md)."""
    return version > 0 and not nodes


def policy_due(atime_ns: int, mtime_ns: int, size: int, now_ns: int, after_s: int, min_size: int) -> bool:
    """Whether a file falls under a policy: not read or written for ``after_s``, at least ``min_size`` bytes."""
    return size > 0 and size >= min_size and max(atime_ns, mtime_ns) < now_ns - after_s * 1_000_000_000


def nearest_policy(ino: int, parent_of: Callable[[int], int | None], policies: dict[int, object]):
    """The policy of the nearest directory over ``ino`` that has one (``ino`` itself first), or None."""
    seen = 0
    while ino is not None and seen < 4096:
        if ino in policies:
            return policies[ino]
        if ino == ROOT_INO:
            return None
        ino = parent_of(ino)
        seen += 1
    return None


class Tiering:
    """Tiers of one metadata daemon: requests (``handle_tier_*``) and, on the duties leader, ``run``."""

    def __init__(self, config, txn, store, nodes, *, ns, sessions, duties, healer: Healer, cluster_id: str,
                 wake_gc: Callable[[], None]):
        self.config = config
        self.txn = txn
        self.store = store
        self.nodes = nodes
        self.ns = ns
        self.sessions = sessions
        self.duties = duties
        self.healer = healer
        self.cluster_id = cluster_id
        self.wake_gc = wake_gc
        self.limiter = trio.CapacityLimiter(max(1, config.tier_parallelism))  # boto3 and checksum threads
        # chunks being moved at once, all requests together: each holds a chunk in memory, so a
        # migrate or recall of a 10 GiB file queues here instead of reading 2,560 chunks at once
        self.transfers = trio.CapacityLimiter(2 * max(1, config.tier_parallelism))
        self.throttle = Throttle(int(config.tier_bandwidth))
        self._buckets: dict[int, Bucket] = {}
        self._recalls: dict[tuple[int, int], trio.Event] = {}
        self._migrating: set[tuple[int, int, int]] = set()
        self._wake = trio.Event()
        self._sweep_wake = trio.Event()
        self._sweep_needed = True
        self._garbage_left = False
        self.migrated = self.migrated_bytes = self.recalled = self.recalled_bytes = 0
        self.failed = self.objects_deleted = 0

    # -- tiers ---------------------------------------------------------------------------

    def _tier_rows(self) -> dict[int, tuple]:
        return {r[0]: tuple(r) for r in self.store.tiers()}

    def bucket(self, tier_id: int) -> Bucket:
        """The bucket of a tier (rows are never changed once added: cached for good)."""
        b = self._buckets.get(tier_id)
        if b is None:
            row = self._tier_rows().get(tier_id)
            if row is None:
                raise StripefsError(ErrorCode.NOT_FOUND, f"tier {tier_id} is not defined (stripefs tier list)")
            _, name, bucket, prefix, endpoint, region = row
            b = self._buckets[tier_id] = Bucket(name, bucket, prefix, endpoint, region, self.config, self.limiter)
        return b

    def _tier_id(self, name: str) -> int:
        for tier_id, row in self._tier_rows().items():
            if row[1] == name:
                return tier_id
        raise StripefsError(ErrorCode.NOT_FOUND, f"no tier named {name!r}: add it with 'stripefs tier add {name} s3://BUCKET/PREFIX'")

    def _name(self, b: Bucket, ino: int, idx: int, version: int, stamp: int) -> str:
        return object_name(b.prefix, self.cluster_id, ino, idx, version, stamp)

    # -- requests ------------------------------------------------------------------------

    async def handle_tier_add(self, req: P.TierAddReq) -> P.Msg:
        try:
            bucket, prefix = parse_url(req.url)
        except ValueError as exc:
            raise StripefsError(ErrorCode.INVALID, str(exc)) from None
        if req.endpoint and not req.endpoint.startswith(("http://", "https://")):
            raise StripefsError(ErrorCode.INVALID, f"--endpoint {req.endpoint!r}: give http://HOST:PORT or https://HOST")
        names = await self.txn.read(lambda: {r[1] for r in self._tier_rows().values()})
        if req.name in names:
            raise StripefsError(ErrorCode.EXISTS, f"tier {req.name!r} exists (stripefs tier list)")
        probe = Bucket(req.name, bucket, prefix, req.endpoint, req.region, self.config, self.limiter)
        try:
            await probe.check()
        except StripefsError as exc:
            raise StripefsError(
                ErrorCode.UNAVAILABLE,
                f"{exc.message}; check the endpoint, that the bucket exists, and the daemon's credentials "
                "(AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY in its environment or tier_credentials in metad.toml)",
            ) from None
        await self.txn.write(self.store.add_tier, req.name, bucket, prefix, req.endpoint, req.region, time.time_ns())
        log.info("tier %s added: s3://%s/%s at %s", req.name, bucket, prefix, req.endpoint or "the AWS default endpoint")
        return await self.handle_tier_list(P.TierListReq())

    async def handle_tier_list(self, req: P.TierListReq) -> P.Msg:
        def read():
            usage = self.store.tier_usage()
            rows = self._tier_rows()
            tiers = [
                P.TierInfo(name=r[1], url=f"s3://{r[2]}/{r[3]}", endpoint=r[4], region=r[5],
                           objects=usage.get(t, (0, 0))[0], bytes=usage.get(t, (0, 0))[1])
                for t, r in rows.items()
            ]
            policies = [
                P.TierPolicy(ino=r[0], tier=rows[r[1]][1] if r[1] in rows else "?", after_s=r[2], min_size=r[3], path=self._path(r[0]))
                for r in self.store.tier_policies()
            ]
            return P.TierListRsp(tiers=tiers, policies=policies)

        return await self.txn.read(read)

    def _path(self, ino: int) -> bytes:
        return self.ns.path_of(ino)

    async def handle_tier_policy_set(self, req: P.TierPolicySetReq) -> P.Msg:
        def apply():
            row = self.store.get_inode(req.ino)
            if row is None:
                raise StripefsError(ErrorCode.NOT_FOUND, f"no inode {req.ino}")
            if not stat.S_ISDIR(row["mode"]):
                raise StripefsError(ErrorCode.NOT_DIR, "a policy is set on a directory (it applies to the files below)")
            if not req.tier:
                self.store.delete_tier_policy(req.ino)
                return
            self.store.set_tier_policy(req.ino, self._tier_id(req.tier), req.after_s, req.min_size)

        await self.txn.write(apply)
        log.info("directory %d: tier policy %s", req.ino,
                 f"to {req.tier} after {req.after_s}s, at least {req.min_size} bytes" if req.tier else "removed")
        self._wake.set()
        return await self.handle_tier_list(P.TierListReq())

    async def handle_tier_migrate(self, req: P.TierMigrateReq) -> P.Msg:
        def plan():
            row = self.store.get_inode(req.ino)
            if row is None:
                raise StripefsError(ErrorCode.NOT_FOUND, f"no inode {req.ino}")
            if not stat.S_ISREG(row["mode"]):
                raise StripefsError(ErrorCode.INVALID, f"inode {req.ino} is not a regular file: only files' data moves")
            check_writable(row)  # a snapshot's file stays where its rows point (docs/snapshots.md)
            if req.tier:
                tier_id = self._tier_id(req.tier)
            else:
                policies = {r[0]: r[1] for r in self.store.tier_policies()}
                tier_id = nearest_policy(req.ino, self.store.parent_of, policies)
                if tier_id is None:
                    raise StripefsError(ErrorCode.INVALID, "no policy applies to this file: name the tier (--to NAME)")
            chunks = self.store.get_chunks(req.ino)
            todo = [(req.ino, i, v, tier_id, time.time_ns()) for i, (v, n, _) in sorted(chunks.items()) if v > 0 and n]
            self.store.add_tier_objects(todo)
            return [(ino, i, v, t) for ino, i, v, t, _ in todo]

        todo = await self.txn.write(plan)  # the intents are durable before any upload
        moved = nbytes = 0
        async with trio.open_nursery() as nursery:
            results: list[int] = []

            async def one(item):
                results.append(await self.migrate_chunk(*item, throttled=False))

            for item in todo:
                nursery.start_soon(one, item)
        failed = sum(1 for r in results if r < 0)
        if failed:  # logged with the reason; the intents stay: the duties leader retries them (docs/tiering.md)
            raise StripefsError(
                ErrorCode.UNAVAILABLE,
                f"inode {req.ino}: {failed} of {len(todo)} chunk(s) could not be moved (the daemon's log says why; "
                "they stay on the storage nodes, and the daemon retries them by itself)",
            )
        moved, nbytes = sum(1 for r in results if r > 0), sum(r for r in results if r > 0)
        cold, hot = await self.txn.read(self._file_counts, req.ino)
        return P.TierFileRsp(chunks=moved, bytes=nbytes, cold=cold, hot=hot)

    def _file_counts(self, ino: int) -> tuple[int, int]:
        chunks = self.store.get_chunks(ino)
        cold = sum(1 for v, n, _ in chunks.values() if is_cold(v, n))
        hot = sum(1 for v, n, _ in chunks.values() if v > 0 and n)
        return cold, hot

    async def handle_tier_recall(self, req: P.TierRecallReq) -> P.Msg:
        def cold_indices():
            if self.store.get_inode(req.ino) is None:
                raise StripefsError(ErrorCode.NOT_FOUND, f"no inode {req.ino}")
            chunks = self.store.get_chunks(req.ino, req.indices or None)
            return [i for i, (v, n, _) in sorted(chunks.items()) if is_cold(v, n)]

        todo = await self.txn.read(cold_indices)
        if todo:
            errors: list[StripefsError] = []
            async with trio.open_nursery() as nursery:

                async def one(idx):
                    try:
                        await self.recall_chunk(req.ino, idx)
                    except StripefsError as exc:
                        errors.append(exc)

                for idx in todo:
                    nursery.start_soon(one, idx)
            if errors:
                raise StripefsError(ErrorCode.IO, errors[0].message)

        def chunk_map():
            chunks = self.store.get_chunks(req.ino, req.indices or None)
            refs, addrs = self.ns.chunk_map_of(self.ns.inode(req.ino), chunks)
            return P.ChunksRsp(chunks=refs, nodes=addrs)

        return await self.txn.read(chunk_map)

    # -- migrate -------------------------------------------------------------------------

    async def migrate_chunk(self, ino: int, idx: int, version: int, tier_id: int, *, throttled: bool) -> int:
        """Move one chunk version to its tier (its 'uploading' row exists); the bytes moved, 0 when
        there was nothing to move any more (the row changed: the intent is dropped), -1 on failure
        (logged; the row stays for the next try)."""
        key = (ino, idx, version)
        if key in self._migrating:
            return 0
        self._migrating.add(key)
        try:
            async with self.transfers:
                return await self._migrate(ino, idx, version, tier_id, throttled)
        except StripefsError as exc:
            self.failed += 1
            log.warning("chunk %d:%d v%d: migration to tier %d failed, will retry: %s", ino, idx, version, tier_id, exc)
            return -1
        finally:
            self._migrating.discard(key)

    async def _migrate(self, ino: int, idx: int, version: int, tier_id: int, throttled: bool) -> int:
        async with self.txn.lock:
            cur = self.store.get_chunks(ino, [idx]).get(idx)
            inode = self.store.get_inode(ino)
            obj = self.store.tier_objects_of(ino).get((idx, version))
            if obj is None or obj[3] != "uploading":
                return 0  # done (another request) or dropped meanwhile
            tier_id = obj[0]
            b = self.bucket(tier_id)
            name = self._name(b, ino, idx, version, obj[4])
            if cur is None or inode is None or cur[0] != version or not cur[1]:
                # written, cut, deleted meanwhile (or already cold): the intent goes, its object if any too
                self.txn.write_locked(self._drop_intent, ino, idx, version, tier_id, name)
                return 0
            nodes, fversions = list(cur[1]), cur[2]
            red = parse_redundancy(inode["redundancy"])
            chunk_size = inode["chunk_size"]
            addresses = {n: self.nodes.address(n) for n in nodes if n != redundancy.MISSING and self.nodes.is_up(n)}
        if red.is_ec:
            data = await self._read_stripe(ino, idx, version, nodes, fversions, addresses, red, chunk_size)
        else:
            data = await self._read_replica(ino, idx, version, nodes, addresses, chunk_size)
        if throttled:
            await self.throttle.consume(len(data))
        xxh3 = await trio.to_thread.run_sync(checksum, data, limiter=self.limiter)
        await b.put(name, data, xxh3)
        await b.verify(name, len(data), xxh3)
        async with self.txn.lock:
            # mounts drop what they cached of the file (its chunk map names the released copies)
            switched, batch = self.txn.write_locked(
                self._switch_cold, ino, idx, version, tier_id, name, len(data), xxh3, change=([ino], []),
            )
        await batch.wait()
        if not switched:
            log.info("chunk %d:%d v%d changed during its upload to %s: kept on its nodes", ino, idx, version, b)
            self.wake_collector(sweep=False)  # the upload is garbage
            return 0
        self.wake_gc()
        self.migrated += 1
        self.migrated_bytes += len(data)
        TIER_OBJECTS.labels("migrated").inc()
        TIER_BYTES.labels("migrated").inc(len(data))
        log.debug("chunk %d:%d v%d: %d bytes stored in %s as %s; node copies released", ino, idx, version, len(data), b, name)
        return max(1, len(data))

    def _drop_intent(self, ino: int, idx: int, version: int, tier_id: int, name: str) -> None:
        objs = self.store.tier_objects_of(ino)
        row = objs.get((idx, version))
        if row is not None and row[3] == "uploading":
            self.store.delete_tier_object(ino, idx, version)
            self.store.add_tier_garbage([(tier_id, name)])  # it may have been uploaded before a crash

    def _switch_cold(self, ino, idx, version, tier_id, name, length, xxh3) -> bool:
        """The compare-and-swap of a migration: the row still has the version the upload read, on
        storage nodes. A version's bytes never change (a write makes a new one), so the copies
        released are those the row names now: a repair or a move may have changed them meanwhile."""
        cur = self.store.get_chunks(ino, [idx]).get(idx)
        if cur is None or cur[0] != version or not cur[1]:
            self._drop_intent(ino, idx, version, tier_id, name)
            return False
        self.store.put_chunk(ino, idx, version, [], [])  # cold: the object holds the stripe whole
        self.store.add_garbage((n, ino, idx, 0, version) for n in cur[1] if n != redundancy.MISSING)
        self.store.set_object_stored(ino, idx, version, length, to_signed(xxh3))
        return True

    async def _node(self, address: str):
        return await (await self.healer.clients()).get(address)

    async def _read_replica(self, ino, idx, version, nodes, addresses, chunk_size) -> bytes:
        errors = []
        for n in nodes:
            if n not in addresses:
                errors.append(f"node {n} is down")
                continue
            try:
                client = await self._node(addresses[n])
                req = P.ReadChunkReq(chunk=P.ChunkId(ino, idx, replica_part(version)), min_version=version, offset=0, length=chunk_size)
                rsp, payloads = await client.call(req, timeout=NODE_TIMEOUT_S + chunk_size / (1 << 20), expect=P.ReadChunkRsp)
                data = bytes(payloads[0]) if payloads else b""
                if rsp.version != version:
                    raise StripefsError(ErrorCode.BUSY, f"node {n} holds version {rsp.version} (being written)")
                if checksum(data) != rsp.xxh3:
                    raise StripefsError(ErrorCode.CORRUPT, f"node {n}: payload does not match its checksum")
                return data
            except StripefsError as exc:
                if exc.code == ErrorCode.BUSY:
                    raise
                errors.append(f"node {n}: {exc}")
        raise StripefsError(ErrorCode.UNAVAILABLE, f"chunk {ino}:{idx} v{version}: no copy readable ({'; '.join(errors)})")

    async def _read_stripe(self, ino, idx, version, nodes, fversions, addresses, red, chunk_size) -> bytes:
        """The stripe's content: its K data fragments read at once (a healthy stripe decodes nothing
        costly), then the parity ones if some failed, each at its own version (``fversions``,
        common/protocol.ChunkRef); decoded, without its trailing zeros."""
        c = codec(red.ec_k, red.ec_m, chunk_size)
        got: dict[int, bytes] = {}
        errors: list[str] = []

        async def read(j: int, n: int) -> None:
            try:
                client = await self._node(addresses[n])
                fv = P.fragment_version(version, fversions, j)
                req = P.ReadChunkReq(chunk=P.ChunkId(ino, idx, fragment_part(j, fv)), min_version=fv, offset=0, length=c.fps)
                rsp, payloads = await client.call(req, timeout=NODE_TIMEOUT_S + c.fps / (1 << 20), expect=P.ReadChunkRsp)
                data = bytes(payloads[0]) if payloads else b""
                if rsp.version != fv or checksum(data) != rsp.xxh3:
                    raise StripefsError(ErrorCode.STALE, f"version {rsp.version} or a bad checksum")
                got[j] = data
            except StripefsError as exc:
                errors.append(f"fragment {j} on node {n}: {exc}")

        for wanted in (range(c.k), range(c.k, len(nodes))):  # data fragments, then parity if needed
            need = c.k - len(got)
            if need <= 0:
                break
            async with trio.open_nursery() as nursery:
                for j in [j for j in wanted if j < len(nodes) and nodes[j] in addresses][: max(need, len(wanted))]:
                    nursery.start_soon(read, j, nodes[j])
        if len(got) < c.k:
            raise StripefsError(ErrorCode.UNAVAILABLE, f"stripe {ino}:{idx} v{version}: {len(got)} of {c.k} fragments readable ({'; '.join(errors)})")
        stripe = await trio.to_thread.run_sync(c.decode, got, limiter=self.limiter)
        return bytes(stripe).rstrip(b"\0")

    # -- recall --------------------------------------------------------------------------

    async def recall_chunk(self, ino: int, idx: int) -> None:
        """Bring a cold chunk back onto storage nodes (one transfer however many ask at once)."""
        key = (ino, idx)
        running = self._recalls.get(key)
        if running is not None:
            await running.wait()
            return
        done = self._recalls[key] = trio.Event()
        started = trio.current_time()
        try:
            async with self.transfers:
                await self._recall(ino, idx)
        finally:
            done.set()
            del self._recalls[key]
            TIER_RECALL_SECONDS.observe(trio.current_time() - started)
            self.wake_collector(sweep=False)  # its object is queued for deletion

    async def _recall(self, ino: int, idx: int) -> None:
        for attempt in range(RECALL_PLACE_TRIES):
            async with self.txn.lock:
                cur = self.store.get_chunks(ino, [idx]).get(idx)
                inode = self.store.get_inode(ino)
                if cur is None or inode is None or not is_cold(cur[0], cur[1]):
                    return
                version = cur[0]
                # a snapshot's row may read its live file's object (daemon/snapshots.py): recalled
                # under the snapshot's own chunk ids
                src = (self.store.data_inos(ino).get(idx) if inode["snapshot"] > 0 else None) or ino
                obj = self.store.tier_objects_of(src).get((idx, version))
                if obj is None or obj[3] != "stored":
                    log.error("chunk %d:%d v%d is in no tier's records: its data is lost (stripefs fsck)", ino, idx, version)
                    raise StripefsError(ErrorCode.IO, f"chunk {ino}:{idx} v{version} is cold but no object is recorded for it")
                tier_id, length, xxh3 = obj[0], obj[1], to_unsigned(obj[2])
                b = self.bucket(tier_id)
                name = self._name(b, src, idx, version, obj[4])
                red = parse_redundancy(inode["redundancy"])
                # never a node whose deletion of this chunk's released copies (up to this very version)
                # is still pending: the collector's delete could land after our write and destroy it
                pending = self.store.garbage_nodes_of_chunk(ino, idx)
                views = [placement.NodeView(v.node_id, v.host, v.free_bytes, v.up and v.node_id not in pending)
                         for v in self.nodes.views()]
                enough = sum(v.up for v in views) >= red.copies
                if enough or attempt == RECALL_PLACE_TRIES - 1:
                    placed = placement.place_chunks(
                        views, [idx], copies=red.copies, stripe_count=inode["stripe_count"], stripe_seed=inode["stripe_seed"]
                    )[idx]
                    targets = redundancy.pad_fragments(placed, red)
                    addresses = {n: self.nodes.address(n) for n in targets if n != redundancy.MISSING}
                    chunk_size = inode["chunk_size"]
                    if red.is_ec and redundancy.MISSING in targets:  # a stripe comes back whole or not at all
                        raise StripefsError(
                            ErrorCode.UNAVAILABLE,
                            f"chunk {ino}:{idx}: {len(addresses)} storage node(s) can take fragments of its {red} stripe now; "
                            "it stays in the tier until enough are up",
                        )
                    break
            self.wake_gc()  # the released copies are being deleted: wait for that rather than place fewer copies
            await trio.sleep(0.1)
        try:
            data = await b.get(name, length, xxh3)
        except StripefsError as exc:
            log.error("chunk %d:%d v%d: recall from %s failed: %s", ino, idx, version, b, exc.message)
            raise
        if red.is_ec:
            c = codec(red.ec_k, red.ec_m, chunk_size)
            frags = await trio.to_thread.run_sync(c.encode, data, len(data), limiter=self.limiter)
            writes = [(n, fragment_part(j, version), frags[j]) for j, n in enumerate(targets) if n != redundancy.MISSING]
        else:
            writes = [(n, replica_part(version), data) for n in targets]
        stored: list[int] = []
        errors: list[str] = []

        async def write(node_id: int, part: int, payload: bytes) -> None:
            request = P.WriteChunkReq(
                chunk=P.ChunkId(ino, idx, part), version=version, base_version=0, offset=0, xxh3=checksum(payload),
                replace=True, sync=True,
            )
            try:
                client = await self._node(addresses[node_id])
                await client.call(request, [payload], timeout=NODE_TIMEOUT_S + len(payload) / (1 << 20), expect=P.WriteChunkRsp)
                stored.append(node_id)
            except StripefsError as exc:
                errors.append(f"node {node_id}: {exc}")

        async with trio.open_nursery() as nursery:
            for node_id, part, payload in writes:
                nursery.start_soon(write, node_id, part, payload)
        enough = len(stored) == len(writes)  # every copy or fragment placed, as a writer's commit needs
        async with self.txn.lock:
            if enough:
                nodes = list(targets)
                ok, batch = self.txn.write_locked(self._switch_hot, ino, idx, version, nodes, tier_id, name, src)
            else:
                ok, batch = self.txn.write_locked(self._forget_copies, ino, idx, version, stored)
        await batch.wait()
        self.wake_gc()
        if not enough:
            raise StripefsError(ErrorCode.IO, f"chunk {ino}:{idx} v{version}: recall could not store it on nodes ({'; '.join(errors)})")
        if ok:
            self.recalled += 1
            self.recalled_bytes += len(data)
            TIER_OBJECTS.labels("recalled").inc()
            TIER_BYTES.labels("recalled").inc(len(data))
            log.debug("chunk %d:%d v%d recalled from %s onto nodes %s", ino, idx, version, b, nodes)

    def _switch_hot(self, ino, idx, version, nodes, tier_id, name, src=None) -> bool:
        """The row takes the recalled copies; the object goes unless another row still reads it cold
        (a snapshot's, or the live file's: ``src`` is the inode the object belongs to)."""
        src = src or ino
        cur = self.store.get_chunks(ino, [idx]).get(idx)
        if cur is None or cur[0] != version or cur[1]:  # deleted, rewritten, or recalled by another daemon
            self._forget_copies(ino, idx, version, nodes)
            return False
        self.store.put_chunk(ino, idx, version, nodes, [])  # every fragment written at ``version``
        if src != ino:
            self.store.unpin(ino, idx, src, version)  # its own copies now
        if not self.store.cold_readers(src, idx, version):  # else the collector takes it once none is left
            self.store.delete_tier_object(src, idx, version)
            self.store.add_tier_garbage([(tier_id, name)])
        self.store.update_inode(ino, atime_ns=time.time_ns())  # read now: the policy's clock starts again
        return True

    def _forget_copies(self, ino, idx, version, written) -> None:
        """Copies a recall wrote that the row does not name (never one it does: the same node may hold both)."""
        cur = self.store.get_chunks(ino, [idx]).get(idx)
        keep = set(cur[1]) if cur is not None else set()
        self.store.add_garbage((n, ino, idx, 0, version) for n in written if n not in keep and n != redundancy.MISSING)

    # -- the duties ----------------------------------------------------------------------

    async def run(self) -> None:
        """On the duties leader: resume, policies, garbage (a duty task: cancelled when leading ends)."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._gc_loop, name="meta-tier-gc")
            # a daemon that just started knows every node as down until it heartbeats: wait for them
            with trio.move_on_after(self.config.node_timeout_s):
                while not any(v.up for v in self.nodes.views()):
                    await trio.sleep(0.2)
                await trio.sleep(min(2.0, self.config.node_timeout_s))  # ... and for the others to register
            while True:
                try:
                    await self._resume()
                    await self._policy_pass()
                    await self._resume()
                except StripefsError as exc:
                    log.warning("tier pass stopped: %s; next one in %.0fs", exc, self.config.tier_scan_interval_s)
                except Exception:
                    log.exception("tier pass failed")
                with trio.move_on_after(self.config.tier_scan_interval_s):
                    await self._wake.wait()
                self._wake = trio.Event()

    def poke(self) -> None:
        self._wake.set()

    async def _resume(self) -> None:
        """Migrate every 'uploading' row (queued by the policy pass, or left by a crash or a failure)."""
        after = (0, -1, -1)
        while True:
            rows = await self.txn.read(self.store.uploading_objects, 256, after)
            if not rows:
                return
            after = tuple(rows[-1][:3])
            results: list[int] = []
            send, recv = trio.open_memory_channel(0)
            async with trio.open_nursery() as nursery:
                for i in range(max(1, self.config.tier_parallelism)):
                    nursery.start_soon(self._worker, recv.clone(), results, name=f"tier-worker-{i}")
                recv.close()
                async with send:
                    for r in rows:
                        await send.send(tuple(r))
            if results and all(r < 0 for r in results):
                return  # nothing worked (the bucket is down?): the next pass tries again

    async def _worker(self, recv, results: list[int]) -> None:
        async with recv:
            async for ino, idx, version, tier_id in recv:
                results.append(await self.migrate_chunk(ino, idx, version, tier_id, throttled=True))

    async def _policy_pass(self) -> None:
        policies = await self.txn.read(self.store.tier_policies)
        if not policies:
            return
        now = time.time_ns()
        for top, tier_id, after_s, min_size in policies:

            def queue():
                free = TIER_QUEUE - self.store.tier_backlog()[0]
                if free <= 0:
                    return 0
                files = self.store.policy_candidates(top, now - after_s * 1_000_000_000, min_size, free)
                rows = []
                for ino in files:
                    # (files mounts hold open or cached are not skipped: under callbacks a data set a
                    # mount caches is "open" for as long as it is cached; the compare-and-swap at the
                    # switch and the version-bounded release keep concurrent writers' data: tiering.md)
                    rows += [(ino, i, v, tier_id, now) for i, (v, n, _) in sorted(self.store.get_chunks(ino).items()) if v > 0 and n]
                self.store.add_tier_objects(rows[:free])
                return len(rows[:free])

            queued = await self.txn.write(queue)
            if queued:
                log.info("tier policy of directory %d: %d chunk(s) queued for migration", top, queued)

    def wake_collector(self, *, sweep: bool = True) -> None:
        """Files were deleted or cut: their objects may be orphans now (MetaService._wake_gc); or
        (``sweep`` False) objects were queued for deletion by a recall or a dropped migration."""
        self._sweep_needed = self._sweep_needed or sweep
        self._sweep_wake.set()

    async def _gc_loop(self) -> None:
        last_sweep = -SWEEP_INTERVAL_S
        while True:
            try:
                sweep = self._sweep_needed or trio.current_time() - last_sweep >= SWEEP_INTERVAL_S
                self._sweep_needed = False
                if sweep:
                    last_sweep = trio.current_time()
                await self._collect(sweep)
            except StripefsError as exc:
                self._garbage_left = True
                log.warning("tier garbage collection: %s; retrying", exc)
            except Exception:
                log.exception("tier garbage collection failed")
            with trio.move_on_after(GC_INTERVAL_S if self._garbage_left else SWEEP_INTERVAL_S):
                await self._sweep_wake.wait()
                await trio.sleep(GC_COALESCE_S)  # an rm -rf: one sweep for many unlinks
            self._sweep_wake = trio.Event()

    async def _collect(self, sweep_first: bool = True) -> None:
        def sweep():
            rows = self.store.orphan_tier_objects(GC_BATCH)
            for ino, idx, version, tier_id, stamp in rows:
                self.store.delete_tier_object(ino, idx, version)
                self.store.add_tier_garbage([(tier_id, self._name(self.bucket(tier_id), ino, idx, version, stamp))])
            return len(rows)

        swept = await self.txn.write(sweep) if sweep_first else 0
        if swept:
            log.debug("%d object(s) no file needs any more queued for deletion", swept)
        rows = await self.txn.read(self.store.tier_garbage, GC_BATCH)
        self._garbage_left = len(rows) == GC_BATCH  # more to do: the next round comes soon
        by_tier: dict[int, list] = {}
        for r in rows:
            by_tier.setdefault(r[1], []).append((r[0], r[2]))
        for tier_id, items in by_tier.items():
            try:
                b = self.bucket(tier_id)
            except StripefsError:
                await self.txn.write(self.store.delete_tier_garbage, [i for i, _ in items])
                continue
            failed = set(await b.delete([n for _, n in items]))
            self._garbage_left = self._garbage_left or bool(failed)
            done = [i for i, n in items if n not in failed]
            await self.txn.write(self.store.delete_tier_garbage, done)
            self.objects_deleted += len(done)
            TIER_OBJECTS.labels("deleted").inc(len(done))
            if done:
                log.debug("%s: %d object(s) deleted", b, len(done))

    # -- status and fsck -------------------------------------------------------------------

    async def status(self) -> P.TierStatus:
        listing = await self.handle_tier_list(P.TierListReq())
        backlog, backlog_bytes = await self.txn.read(self.store.tier_backlog)
        garbage = await self.txn.read(self.store.count_tier_garbage)
        return P.TierStatus(
            tiers=listing.tiers, migrate_backlog=backlog, migrate_backlog_bytes=backlog_bytes,
            recalls_in_flight=len(self._recalls), migrated=self.migrated, migrated_bytes=self.migrated_bytes,
            recalled=self.recalled, recalled_bytes=self.recalled_bytes, failed=self.failed,
            objects_deleted=self.objects_deleted, garbage_objects=garbage, bandwidth=int(self.config.tier_bandwidth),
        )

    async def handle_tier_fsck(self, req: P.TierFsckReq) -> P.Msg:
        """Check every tier's bucket against the namespace (docs/tiering.md)."""
        checked = missing = orphans = 0
        problems: list[str] = []
        tiers = await self.txn.read(self._tier_rows)
        for tier_id in tiers:
            b = self.bucket(tier_id)
            listed = await b.list(f"{b.prefix}{self.cluster_id}/")
            after = (0, -1)
            expected: set[str] = set()
            while True:
                rows = await self.txn.read(self.store.cold_chunks_of, tier_id, after, 5000)
                for ino, idx, version, stamp, length in rows:
                    name = self._name(b, ino, idx, version, stamp)
                    expected.add(name)
                    checked += 1
                    if listed.get(name) != length:
                        missing += 1
                        if len(problems) < 20:
                            problems.append(f"{b}: chunk {ino}:{idx} v{version} is cold but {name} is "
                                            + ("missing" if name not in listed else f"{listed[name]} bytes, not {length}"))
                if len(rows) < 5000:
                    break
                after = (rows[-1][0], rows[-1][1])
            known = await self.txn.read(self._all_object_names, tier_id, b)
            for name in listed:
                if name not in expected and name not in known and parse_object_name(b.prefix, name) is not None:
                    orphans += 1
                    if len(problems) < 20:
                        problems.append(f"{b}: {name} belongs to no file" + (" (queued for deletion)" if req.repair else ""))
                    if req.repair:
                        await self.txn.write(self.store.add_tier_garbage, [(tier_id, name)])
        if missing:
            log.error("tier fsck: %d cold chunk(s) have no good object in their bucket: their data is lost", missing)
        return P.TierFsckRsp(checked=checked, missing=missing, orphans=orphans, problems=problems)

    def _all_object_names(self, tier_id: int, b: Bucket) -> set[str]:
        """Names of every object row of a tier (uploading ones too) and of its garbage."""
        names = {self._name(b, *r) for r in self.store.tier_object_keys(tier_id)}
        return names | set(self.store.tier_garbage_names(tier_id))
