"""The data path of erasure-coded files (layout ``ec=K+M``): stripes <-> fragments.

``DataPath`` (client/striping.py) hands EC files to ``EcPath`` at a few
points: reads (after its own unsent data is sent), the sending of a dirty
chunk, the cut of the boundary chunk in a truncate, fsync, and the
prefetch of small files. Everything else (dirty buffering per chunk, write
parallelism, commits, epochs) is shared with replicated files. The codec
and the stripe/fragment arithmetic are in common/erasure.py.

Reads
    A healthy read decodes nothing: the code is systematic, so the byte range
    maps to offsets in data fragments, and only the fragments holding the
    range are fetched (whole fragments, cached by (ino, index, version, 1+j),
    so the kernel's next requests in the same fragment cost nothing). A
    sequential reader prefetches the data fragments of the stripes in its
    read-ahead window (client/readahead.py). A fragment that is missing, whose node is
    suspect, that is stale or fails its checksum, or that has not come within
    READ_DEADLINE_S (0.5 s) makes the read *degraded*: the other fragments are
    fetched until one version has K of them, which are decoded (worker
    threads), and the whole stripe is cached. Fewer than K readable: the
    fragments may have moved since the file was opened (drain, rebalance,
    reconstruction: copy, switch, delete), so the daemon is asked where the
    stripe is now and it is read once more there (client/placements.py). The late read is not cancelled:
    if its node is dead it times out and the node becomes suspect (skipped for
    15 s), and read-ahead then decodes the stripes that need it in the
    background. Up to M fragments can be lost that way with no error to the
    application.

Writes
    A dirty chunk becomes one stripe version. A partial write of a committed
    stripe (the session's first of it, every fragment reachable, at most half
    of the stripe's data touched) is a parity delta (``_send_delta``): only
    the touched columns of the touched data fragments and of the parity are
    read, new parity = old parity + coefficient x (new data - old data), and
    the new version is written to the other slot as partial writes of those
    columns, the untouched data fragments as empty writes that their nodes
    fill from the committed fragment; with the stripe held in the cache the
    parity is coded from the held columns and nothing is read. A later piece
    of a stripe the session wrote already, held in the cache, writes only its
    columns of the touched data fragments and of the parity over the
    session's own copies (``_rewrite_columns``). After a write the cache holds
    the new version (write-through). Otherwise dirty ranges that are not the
    whole chunk are merged into the current stripe, read first
    (read-modify-write); a stripe never written before is zeros. The stripe is
    coded in worker threads, 1 MiB of stripe per pyeclib call, one call at a
    time (pyeclib holds the GIL: parallel calls would only queue; between
    calls the FUSE loop runs), and
    its K+M fragments are written in parallel, each replacing its copy
    whole. The version is this write session's epoch, or, if that has the
    parity of the committed version, another epoch of the other parity: the
    new fragments go to the other *slot* (common/erasure.fragment_part), so the
    committed stripe stays intact until CommitReq, and a crash or a failed
    write never leaves a torn stripe. A fragment whose node is suspect or
    fails is moved by the daemon (ReplaceReplicaReq with its part) and
    written to the new node, even one this mount suspects too (suspicion
    orders nodes, it never leaves one out). If no node is left for it, the stripe is written
    degraded, with that fragment MISSING (node 0) in the committed placement
    and counted by the daemon as waiting for reconstruction, provided at
    least K + ``min_extra`` fragments are stored (client config
    ``ec_min_fragments_over_k``, default 1). Below that the write fails with
    UNAVAILABLE (EIO) and nothing is committed. A fragment whose copy the
    daemon moved since the open (drain, rebalance) is written where the map
    says all the same: every fragment write replaces its copy whole, so no
    node needs an older copy to take it, and the commit records the fragment
    there; the moved copy of the old version becomes garbage (the daemon
    drops the committed version's slot at every commit). Only the read of a
    read-modify-write, and the cut of a truncate, need the old stripe, and
    read it by the rule above.

fsync
    Fragments are written without fsync and remembered; ``sync`` sends
    SyncChunksReq for every fragment written since, to every node holding
    one, before DataPath.flush commits: fsync returns when all K+M (or the
    degraded number of) fragments are durable.

Atomicity: as in striping.py, an OpenFile's ``uncommitted``/``chunks`` maps
are only changed between awaits, after every fragment of the stripe is
acknowledged.
"""

from __future__ import annotations

import functools
import logging
import math
from collections import defaultdict
from collections.abc import Sequence

import trio
import xxhash

from ..common import protocol as p
from ..common.erasure import StripeCodec, codec, fragment_part, xor
from ..common.errors import ErrorCode, StripefsError
from ..common.layout import Extent, parse_redundancy
from ..common.log_limits import LogEvery
from .chunk_cache import ChunkCache
from .data_rpc import NodePool
from .meta_rpc import MetaClient
from .open_files import DirtyChunk, OpenFile
from . import metrics, placements
from .placements import fresh_epoch, placement, session_epoch, slot_version

log = logging.getLogger(__name__)

MISSING = 0  #: node id of a fragment without a node (daemon/redundancy.py)
_FAILOVER = {ErrorCode.TIMEOUT, ErrorCode.UNAVAILABLE, ErrorCode.STALE, ErrorCode.CORRUPT, ErrorCode.NOT_FOUND, ErrorCode.IO}
_MOVE_ATTEMPTS = 3
#: after the daemon said no node was free to take a fragment that has none (UNAVAILABLE), how long
#: such fragments are left MISSING without asking again (``EcPath._write_fragments``)
NO_SPARE_S = 1.0
#: degraded stripes are logged at most once in this long (the others counted: common/log_limits.py)
DEGRADED_LOG_EVERY_S = 10.0
#: a data fragment that has not come within this long makes the read decode from the others
READ_DEADLINE_S = 0.5


def layout_codec(layout: p.Layout) -> StripeCodec:
    red = parse_redundancy(layout.redundancy)
    return codec(red.ec_k, red.ec_m, layout.chunk_size)


def _piece(data: bytes | memoryview, offset: int, length: int) -> bytes | memoryview:
    piece = data[offset : offset + length]
    if len(piece) == length:
        return piece
    return bytes(piece) + bytes(length - len(piece))


def _covers(ranges, a: int, b: int) -> bool:
    """Whether the sorted, disjoint ``ranges`` (lo, hi) cover ``[a, b)`` whole."""
    for lo, hi in ranges:
        if lo <= a < hi:
            a = hi
        if a >= b:
            return True
    return False


def _written(ref: p.ChunkRef, versions: list[int], payloads) -> p.ChunkRef:
    """Stripe ``ref`` after a write of the fragments in ``payloads``, each at ``versions[j]``; the
    others keep the version they have in ``ref`` (ChunkRef ``fversions``)."""
    fversions = [versions[j] if j in payloads else ref.fragment_version(j) for j in range(len(ref.nodes))]
    version = max(fversions)
    return p.ChunkRef(index=ref.index, version=version, nodes=list(ref.nodes), fversions=p.uniform_fversions(version, fversions))


class EcPath:
    def __init__(self, meta: MetaClient, nodes: NodePool, cache: ChunkCache, nursery: trio.Nursery, *, min_extra: int = 1):
        self.meta = meta
        self.nodes = nodes
        self.cache = cache
        self.nursery = nursery
        self.min_extra = min_extra
        self.read_deadline_s = READ_DEADLINE_S
        #: one coding call at a time (the GIL; see common/erasure.py)
        self.coding = trio.CapacityLimiter(1)
        #: ino -> fragments written without fsync: node -> chunk ids
        self._unsynced: dict[int, dict[int, set[p.ChunkId]]] = {}
        #: stripe versions (ino, index, version) loaded by decoding: a data fragment that was not read
        #: may be missing or bad on its node, so a write of such a stripe keeps none (``_unchanged``)
        self._decoded: set[tuple[int, int, int]] = set()
        #: (trio time until which, why): a fragment with no node stays MISSING without a ReplaceReplicaReq.
        #: With a node down and no spare (k+m nodes), every stripe written has such a fragment, and the
        #: daemon answered each ask with the same UNAVAILABLE, a write transaction rolled back (~30 a
        #: second in the model run's degraded half: more than all its other requests together)
        self._no_spare: tuple[float, str] = (-math.inf, "")
        self._degraded_log = LogEvery(log, DEGRADED_LOG_EVERY_S)

    # ------------------------------------------------------------------ reads

    async def read(self, of: OpenFile, extents: list[Extent], ahead: int) -> bytes | memoryview:
        """The bytes of ``extents``; ``ahead``: stripes to have fetched ahead (client/readahead.py)."""
        c = layout_codec(of.layout)
        if len(extents) == 1:
            out = await self._extent(of, c, extents[0])
        else:
            parts: list[bytes | memoryview] = [b""] * len(extents)

            async def fetch(i: int, ext: Extent) -> None:
                parts[i] = await self._extent(of, c, ext)

            async with trio.open_nursery() as nursery:
                for i, ext in enumerate(extents):
                    nursery.start_soon(fetch, i, ext)
            out = b"".join(parts)
        if ahead:
            ahead = min(ahead, max(1, self.cache.budget // 4 // of.chunk_size))
            last = extents[-1]
            self._read_ahead(of, c, last.file_offset + last.length, ahead)
        return out

    def _read_ahead(self, of: OpenFile, c: StripeCodec, end: int, ahead: int) -> None:
        """Fetch, in the background, the data fragments after ``end`` up to ``ahead`` stripes on.

        A stripe with a data fragment on a suspect node or without a node is
        decoded in the background instead (the whole stripe lands in the cache).
        """
        cs = of.chunk_size
        stop = min(of.size, (end // cs + 1 + ahead) * cs)
        pos = end
        cache = self.cache
        while pos < stop:
            index, inner = divmod(pos, cs)
            ref = of.chunks.get(index)
            if ref is None or not ref.version or not ref.nodes or (of.ino, index, ref.version) in cache:  # no nodes: in a tier
                pos = (index + 1) * cs
                continue
            parts = range(inner // c.fps, -(-min(cs, stop - index * cs) // c.fps))
            if any(self._unreachable(ref, j) for j in parts):
                self.nursery.start_soon(self._prefetch_stripe, of.ino, c, ref, name=f"ec-decode-{of.ino}-{index}")
            else:
                for j in parts:
                    if (of.ino, index, ref.version, 1 + j) not in cache:
                        self.nursery.start_soon(self._prefetch, of.ino, c, ref, j, name=f"ec-prefetch-{of.ino}-{index}-{j}")
            pos = (index + 1) * cs

    def _unreachable(self, ref: p.ChunkRef, part: int) -> bool:
        node = ref.nodes[part] if part < len(ref.nodes) else MISSING
        return node == MISSING or self.nodes.is_suspect(node)

    async def _prefetch_stripe(self, ino: int, c: StripeCodec, ref: p.ChunkRef) -> None:
        try:
            await self.stripe(ino, c, ref, quiet=True)
        except StripefsError as exc:
            log.debug("background decode of stripe %d:%d failed: %s", ino, ref.index, exc)

    async def _prefetch(self, ino: int, c: StripeCodec, ref: p.ChunkRef, part: int) -> None:
        try:
            await self._fragment(ino, c, ref, part, ahead=True)
        except StripefsError as exc:
            # a degraded stripe, or the file changed meanwhile: the real read will decode or say so
            log.debug("prefetch of fragment %d of stripe %d:%d failed: %s", part, ino, ref.index, exc)

    def prefetch_small_file(self, info: p.OpenRsp) -> None:
        """Fetch the fragments of a one-stripe file about to be opened (DataPath.fetch_soon of a Fetch.small_file)."""
        ref = info.chunks[0]
        c = layout_codec(info.layout)
        self.nodes.learn(info.nodes)
        for r in c.data_ranges(0, info.attr.size):
            if (info.attr.ino, 0, ref.version, 1 + r.part) not in self.cache:
                self.nursery.start_soon(self._prefetch, info.attr.ino, c, ref, r.part, name=f"ec-prefetch-{info.attr.ino}")

    async def _extent(self, of: OpenFile, c: StripeCodec, ext: Extent) -> bytes | memoryview:
        ref = of.chunks.get(ext.index)
        if ref is None or ref.version == 0:
            return bytes(ext.length)
        whole = self.cache.get((of.ino, ext.index, ref.version))
        if whole is not None:
            return _piece(whole, ext.offset, ext.length)
        ranges = c.data_ranges(ext.offset, ext.length)
        calls = {i: functools.partial(self._fragment, of.ino, c, ref, r.part) for i, r in enumerate(ranges)}
        got, failed = await self._gather(calls, deadline=self.read_deadline_s)
        if len(got) == len(ranges):
            pieces = [_piece(got[i], r.offset, r.length) for i, r in enumerate(ranges)]
            return pieces[0] if len(pieces) == 1 else b"".join(pieces)
        why = next(iter(failed.values()), None) or f"no answer within {self.read_deadline_s}s"
        log.info("stripe %d:%d v%d: a data fragment is unreadable (%s); decoding", of.ino, ext.index, ref.version, why)
        return _piece(await self.stripe(of.ino, c, ref), ext.offset, ext.length)

    async def _gather(self, calls: dict, *, deadline: float = math.inf, enough=None) -> tuple[dict, dict]:
        """Run ``calls`` (key -> async function) at once; (results, StripefsErrors) by key.

        Returns when all are done, when ``deadline`` seconds have passed, or when
        ``enough(results)`` says so. The calls run in the mount's nursery, so one
        left behind is not cancelled: a read of a dead node still times out and
        marks the node suspect, and a late fragment still lands in the cache.
        """
        results: dict = {}
        failures: dict = {}
        pending = len(calls)
        wake = trio.Event()

        async def run(key, fn) -> None:
            nonlocal pending
            try:
                results[key] = await fn()
            except StripefsError as exc:
                failures[key] = exc
            finally:
                pending -= 1
                if pending == 0 or (enough is not None and enough(results)):
                    wake.set()

        for key, fn in calls.items():
            self.nursery.start_soon(run, key, fn)
        if calls:
            with trio.move_on_after(deadline):
                await wake.wait()
        return dict(results), dict(failures)

    async def _fragment(self, ino: int, c: StripeCodec, ref: p.ChunkRef, part: int, *, ahead: bool = False) -> bytes | memoryview:
        """Data fragment ``part``'s stored payload (maybe shorter than fps: the rest is zeros), cached;
        ``ahead``: fetched before any read asked (the cache's read-ahead accounting)."""
        nodes = self.nodes

        async def load():
            node = ref.nodes[part] if part < len(ref.nodes) else MISSING
            if node == MISSING:
                raise StripefsError(ErrorCode.UNAVAILABLE, f"fragment {part} of stripe {ino}:{ref.index} has no node")
            if nodes.is_suspect(node):
                raise StripefsError(ErrorCode.UNAVAILABLE, f"node {node} holding fragment {part} is suspect")
            version = ref.fragment_version(part)  # its own: a delta may have left it at an older one
            chunk = p.ChunkId(p.data_ino(ino, ref), ref.index, fragment_part(part, version))
            _, data = await nodes.read_versioned(node, chunk, version, 0, c.fps, last_try=False)
            return data

        return await self.cache.fetch((ino, ref.index, ref.version, 1 + part), load, prefetch=ahead)

    async def stripe(self, ino: int, c: StripeCodec, ref: p.ChunkRef, *, quiet: bool = False) -> bytes | memoryview:
        """The whole stripe (chunk_size bytes), cached: from the data fragments, or decoded."""
        return await self.cache.fetch((ino, ref.index, ref.version), lambda: self._load_stripe(ino, c, ref, quiet))

    async def _load_stripe(self, ino: int, c: StripeCodec, ref: p.ChunkRef, quiet: bool, *, refreshed: bool = False) -> bytes:
        held = self._held(ino, c, ref)  # every data fragment read already: no decoding
        if held is not None:
            return held
        got, _ = await self._gather(self._part_reads(ino, c, ref, range(c.k)), deadline=self.read_deadline_s)
        frags = self._decodable(c, ref, got) if len(got) == c.k else None
        if frags is not None:
            return c.decode(frags)
        # degraded: the other fragments too, until one version has K of them
        frags = None
        for suspects in (False, True):  # nodes we suspect may be back: asked last
            rest = self._part_reads(ino, c, ref, [j for j in range(c.n) if j not in got], suspects=suspects)
            more, _ = await self._gather(rest, enough=lambda r: self._decodable(c, ref, {**got, **r}) is not None)
            got.update(more)
            frags = self._decodable(c, ref, got)
            if frags is not None:
                break
        if frags is not None:
            log.info("stripe %d:%d v%d: decoding from fragments %s", ino, ref.index, ref.version, sorted(frags))
            if len(self._decoded) >= 4096:
                self._decoded.clear()
            self._decoded.add((ino, ref.index, ref.version))
            return await self._run(c.decode_job(frags))
        if not refreshed:
            now = await self._where_now(ino, ref)
            if now is not None:  # fragments moved since the open (drain, rebalance, reconstruction)
                log.info("stripe %d:%d v%d: fragments moved from nodes %s to %s since the file was opened", ino, ref.index, ref.version, ref.nodes, now.nodes)
                return await self._load_stripe(ino, c, now, quiet, refreshed=True)
        by_version: dict[int, list[int]] = defaultdict(list)
        for j, (version, _) in got.items():
            by_version[version].append(j)
        counts = {v: sorted(f) for v, f in by_version.items()}  # version -> parts read
        log.log(
            logging.DEBUG if quiet else logging.ERROR,
            "stripe %d:%d v%d: fewer than %d fragments of one version readable (%s)", ino, ref.index, ref.version, c.k, counts,
        )
        raise StripefsError(ErrorCode.IO, f"stripe {ino}:{ref.index}: fewer than {c.k} fragments readable")

    async def _where_now(self, ino: int, ref: p.ChunkRef) -> p.ChunkRef | None:
        """Stripe ``ref``'s fragments where the daemon has them now, when that differs from ``ref``
        (same version: a newer one's fragments are in the other slot); else None."""
        now = await placements.current(self.meta, self.nodes, ino, ref.index)
        if now is None or now.version != ref.version or now.fversions != ref.fversions or list(now.nodes) == list(ref.nodes):
            return None
        return now

    @staticmethod
    def _decodable(c: StripeCodec, ref: p.ChunkRef, got: dict[int, tuple[int, memoryview]]) -> dict[int, memoryview] | None:
        """K or more payloads that belong to one stripe, if ``got`` (part -> (version, payload)) has
        them: the fragments at their own version in ``ref`` (``fragment_version``: not all need
        share one), else the newest version that K fragments share (a stripe written whole since)."""
        current = {j: data for j, (version, data) in got.items() if version == ref.fragment_version(j)}
        if len(current) >= c.k:
            return current
        by_version: dict[int, dict[int, memoryview]] = defaultdict(dict)
        for j, (version, data) in got.items():
            by_version[version][j] = data
        for version in sorted(by_version, reverse=True):
            if len(by_version[version]) >= c.k:
                return by_version[version]
        return None

    def _part_reads(self, ino: int, c: StripeCodec, ref: p.ChunkRef, parts, *, suspects: bool = False) -> dict:
        """part -> async function reading (version, payload) of that fragment, for the nodes worth asking."""
        nodes = self.nodes
        calls = {}
        for j in parts:
            node = ref.nodes[j] if j < len(ref.nodes) else MISSING
            if node == MISSING or (nodes.is_suspect(node) and not suspects):
                continue
            calls[j] = functools.partial(self._read_part, ino, c, ref, j, node)
        return calls

    async def _read_part(self, ino: int, c: StripeCodec, ref: p.ChunkRef, j: int, node: int) -> tuple[int, memoryview]:
        version = ref.fragment_version(j)
        chunk = p.ChunkId(p.data_ino(ino, ref), ref.index, fragment_part(j, version))  # a snapshot may share the live fragments
        try:
            return await self.nodes.read_versioned(node, chunk, version, 0, c.fps, last_try=False)
        except StripefsError as exc:
            log.log(
                logging.WARNING if exc.code == ErrorCode.CORRUPT else logging.INFO,
                "fragment %s v%d on node %d unreadable: %s", chunk, version, node, exc,
            )
            raise

    async def _run(self, job):
        """Run a coding job's steps in worker threads, one at a time: the loop gets the GIL back between
        steps. A small job (a 64 KiB stripe: ``Job.small``) runs here: coding it costs less than the
        two thread hand-offs, and it holds the GIL either way (common/erasure.py)."""
        if job.small:
            return job.run()
        for step in job.steps:
            await trio.to_thread.run_sync(step, limiter=self.coding)
        return job.result()

    # ----------------------------------------------------------------- writes

    async def send_stripe(self, of: OpenFile, dc: DirtyChunk, *, sync: bool) -> None:
        """Write one dirty chunk as a new stripe version (read-modify-write when partial)."""
        c = layout_codec(of.layout)
        epoch = await session_epoch(self.meta, of)
        ref = await placement(self.meta, self.nodes, of, dc.index)
        mine = of.uncommitted.get(dc.index)
        versions = await self._session_versions(of, epoch, ref, mine, c.n)
        cs = of.chunk_size
        old = known = None  # the stripe this write changes, when known: its unchanged data fragments are kept
        if dc.contiguous and dc.lo == 0 and dc.hi >= cs:
            stripe: bytes | bytearray | memoryview = memoryview(dc.buf)[:cs]
            if ref.version:
                old = self.cache.get((of.ino, ref.index, ref.version))
        else:
            if mine is None and ref.version and await self._send_delta(of, c, ref, versions, dc, sync=sync):
                return
            if mine is not None and mine.version == ref.version and await self._rewrite_columns(of, c, ref, versions, dc, sync=sync):
                return
            stripe = bytearray(cs)
            if ref.version:
                old, known = await self._base(of.ino, c, ref, dc)
                stripe[: len(old)] = old
            for lo, hi in dc.ranges:
                stripe[lo:hi] = memoryview(dc.buf)[lo:hi]
        metrics.EC_STRIPE_WRITES.labels("full").inc()
        # a stripe read for this write (read-modify-write: the file is written in pieces) is kept as
        # written, so the next piece and the reads after it need no fragment reads (write-through);
        # a whole-chunk write (a streaming writer) is not, to keep its readers' cache
        await self._write_stripe(of, c, ref, versions, stripe, sync=sync, keep=isinstance(stripe, bytearray), old=old, known=known)

    async def _base(self, ino: int, c: StripeCodec, ref: p.ChunkRef, dc: DirtyChunk) -> tuple[bytes | bytearray | memoryview, set[int] | None]:
        """What a read-modify-write of committed stripe ``ref`` needs of it: the stripe, when cached;
        else only the data fragments the dirty ranges do not cover whole (a fragment written over
        entirely is neither read nor coded from its old bytes), zeros in place of the others, and
        the set of fragments read. When one of those cannot be read, the whole stripe (decoded)."""
        whole = self.cache.get((ino, ref.index, ref.version))
        if whole is not None:
            return whole, None
        fps, cs = c.fps, c.chunk_size
        covered = []
        for j in range(c.k):
            a, b = j * fps, min((j + 1) * fps, cs)
            if a < b and _covers(dc.ranges, a, b):
                covered.append(j)
        if not covered:
            return await self.stripe(ino, c, ref), None
        need = [j for j in range(c.k) if j not in covered]
        got, _ = await self._gather({j: functools.partial(self._fragment, ino, c, ref, j) for j in need}, deadline=self.read_deadline_s)
        if len(got) != len(need):
            return await self.stripe(ino, c, ref), None
        old = bytearray(cs)
        for j, data in got.items():
            data = memoryview(data)[: max(0, min(fps, cs - j * fps))]
            old[j * fps : j * fps + len(data)] = data
        metrics.EC_FRAGMENT_READS_SPARED.inc(len(covered))
        return old, set(need)

    async def _session_versions(self, of: OpenFile, epoch: int, ref: p.ChunkRef, mine: p.ChunkRef | None, n: int) -> list[int]:
        """The version each fragment of stripe ``ref`` is written at in this write session: a fragment
        the session wrote already keeps its version (rewritten in its slot, as before); any other
        one takes a version newer than its committed one and of the other parity (``slot_version``:
        the committed fragment stays in its slot until the commit). A stripe's fragments need not
        share a committed version (ChunkRef ``fversions``: a parity delta leaves the untouched data
        fragments where they are), so the numbers may be the two of the session's epoch pair."""
        committed = of.before_session.get(ref.index) if mine is not None else ref
        out = []
        for j in range(n):
            base = committed.fragment_version(j) if committed is not None else 0
            if mine is not None and mine.fragment_version(j) != base:
                out.append(mine.fragment_version(j))  # the session's own
            else:
                out.append(await slot_version(self.meta, of, epoch, base))
        return out

    async def _send_delta(self, of: OpenFile, c: StripeCodec, ref: p.ChunkRef, versions: list[int], dc: DirtyChunk, *,
                          sync: bool) -> bool:
        """A partial write of a committed stripe as a parity delta; False when it is not worth it
        (most of the stripe changes), not possible (a fragment missing or on a suspect node), or
        failed (then nothing of the committed slot changed and the caller writes the stripe whole).

        Only the columns ``[a, b)`` that the dirty ranges touch, in any data fragment, are read:
        the touched data fragments' and every parity fragment's, at the committed version. New
        parity = old parity + coefficient x (new data - old data) (StripeCodec.parity_delta_job).
        The touched data fragments and the parity fragments go to the other slot (``versions``),
        as partial writes of those columns: each node builds its fragment of the new version from
        its committed one (storage_node/chunk_store.py ``_merge``), so the unchanged bytes never
        cross the network and the committed slot stays whole until the commit. The untouched data
        fragments are not written at all: they keep their committed version (ChunkRef
        ``fversions``; counted in stripefs_ec_fragments_kept_total)."""
        touched, a, b = self._touched(c, dc, of.chunk_size)
        if not self._columns_pay(c, ref, touched, a, b):
            return False
        w = b - a
        buf = memoryview(dc.buf)
        held = self._held(of.ino, c, ref)
        if held is not None:  # every data column is known: the new parity is coded from them, nothing is read
            _, cols, parity = await self._coded_columns(c, held, dc, of.chunk_size, a, b)
            changes = {j: (None, cols[j]) for j in touched}
        else:
            old, failed = await self._gather(
                {j: functools.partial(self._old_columns, of.ino, c, ref, j, a, w) for j in [*touched, *range(c.k, c.n)]},
                deadline=self.read_deadline_s,
            )
            if len(old) != len(touched) + c.m:
                log.info("stripe %d:%d: a delta write could not read the old columns (%s); coding the stripe whole",
                         of.ino, ref.index, next(iter(failed.values()), "too slow"))
                metrics.EC_STRIPE_WRITES.labels("delta_fallback").inc()
                return False
            changes = {}
            for j, pieces in touched.items():
                new = bytearray(old[j])
                for r in pieces:
                    new[r.offset - a : r.offset - a + r.length] = buf[r.stripe_offset : r.stripe_offset + r.length]
                changes[j] = (old[j], bytes(new))
            deltas = await self._run(c.parity_delta_job(changes, a, b))
            parity = [xor(old[c.k + i], deltas[i]) for i in range(c.m)]
        payloads: dict[int, tuple[int, bytes]] = {j: (a, new) for j, (_, new) in changes.items()}
        payloads.update({c.k + i: (a, parity[i]) for i in range(c.m)})
        errors = await self._write_columns(of, ref, versions, payloads, sync)  # each on its committed fragment
        if errors:
            log.info("stripe %d:%d: a delta write failed on fragment(s) %s (%s); writing the stripe whole",
                     of.ino, ref.index, sorted(errors), next(iter(errors.values())))
            metrics.EC_STRIPE_WRITES.labels("delta_fallback").inc()
            return False
        new_ref = _written(ref, versions, payloads)
        # the fragments left where they are become part of this version: the next fsync makes them
        # durable too, as it did their copies when every fragment was written (a commit without fsync
        # did not sync them)
        pending = self._unsynced.setdefault(of.ino, {})
        for j in range(c.k):
            if j not in changes:
                pending.setdefault(ref.nodes[j], set()).add(p.ChunkId(of.ino, ref.index, fragment_part(j, ref.fragment_version(j))))
        kept = self._delta_kept(of.ino, c, ref, new_ref.version, dc, changes, a, b)
        self.cache.drop_chunk(of.ino, ref.index)  # as _write_stripe: what the cache holds of the stripe is old now
        of.record(new_ref)
        for key, data in kept.items():  # no await since the drop: no load can have started in between
            self.cache.put(key, data)
        metrics.EC_STRIPE_WRITES.labels("delta").inc()
        metrics.EC_FRAGMENTS_KEPT.inc(c.k - len(changes))
        return True

    def _held(self, ino: int, c: StripeCodec, ref: p.ChunkRef) -> bytes | memoryview | None:
        """Stripe ``ref`` as the cache holds it (whole, or every data fragment), or None: no read."""
        whole = self.cache.get((ino, ref.index, ref.version))
        if whole is not None:
            return whole
        frags = {j: self.cache.get((ino, ref.index, ref.version, 1 + j)) for j in range(c.k)}
        return None if any(d is None for d in frags.values()) else c.decode(frags)

    async def _old_columns(self, ino: int, c: StripeCodec, ref: p.ChunkRef, j: int, a: int, w: int) -> bytes | memoryview:
        """Columns ``[a, a+w)`` of fragment ``j`` of committed stripe ``ref``: cached, or read exactly at its version."""
        if j < c.k:
            held = self.cache.get((ino, ref.index, ref.version, 1 + j))
            if held is not None:
                return _piece(held, a, w)
        version = ref.fragment_version(j)
        chunk = p.ChunkId(ino, ref.index, fragment_part(j, version))
        got_version, data = await self.nodes.read_versioned(ref.nodes[j], chunk, version, a, w, last_try=False)
        if got_version != version:
            raise StripefsError(ErrorCode.STALE, f"fragment {chunk} is v{got_version}, not the committed v{version}")
        return _piece(data, 0, w)

    @staticmethod
    def _touched(c: StripeCodec, dc: DirtyChunk, cs: int) -> tuple[dict[int, list], int, int]:
        """The data fragments the dirty ranges touch (fragment -> its pieces) and the columns ``[a, b)``
        that cover them all."""
        touched: dict[int, list] = defaultdict(list)
        a, b = c.fps, 0
        for lo, hi in dc.ranges:
            hi = min(hi, cs)
            for r in c.data_ranges(lo, hi - lo) if hi > lo else ():
                touched[r.part].append(r)
                a, b = min(a, r.offset), max(b, r.offset + r.length)
        return touched, a, b

    def _columns_pay(self, c: StripeCodec, ref: p.ChunkRef, touched: dict, a: int, b: int) -> bool:
        """Whether writing only columns ``[a, b)`` of the ``touched`` fragments is worth it (less than
        half the stripe; coding it whole costs no more) and possible (every fragment on a node not suspect)."""
        if not touched or len(touched) * (b - a) * 2 > c.k * c.fps:
            return False
        return len(ref.nodes) >= c.n and not any(self._unreachable(ref, j) for j in range(c.n))

    async def _coded_columns(self, c: StripeCodec, held: bytes | memoryview, dc: DirtyChunk, cs: int, a: int,
                             b: int) -> tuple[bytearray, dict[int, bytes], list[bytes]]:
        """Stripe ``held`` with the dirty ranges put in, its data columns ``[a, b)`` by fragment, and
        the parity of those columns (coded from them: nothing read)."""
        stripe = bytearray(bytes(held).ljust(cs, b"\0"))
        for lo, hi in dc.ranges:
            hi = min(hi, cs)
            stripe[lo:hi] = memoryview(dc.buf)[lo:hi]
        w = b - a
        cols = {j: bytes(stripe[j * c.fps + a : j * c.fps + b]).ljust(w, b"\0") for j in range(c.k)}
        parity = await self._run(c.parity_delta_job({j: (bytes(w), cols[j]) for j in range(c.k)}, a, b))
        return stripe, cols, parity

    async def _rewrite_columns(self, of: OpenFile, c: StripeCodec, ref: p.ChunkRef, versions: list[int], dc: DirtyChunk, *,
                               sync: bool) -> bool:
        """A later piece of a stripe this session wrote already (``ref``: the session's version, not
        committed) as a write of the touched columns only, when the mount holds that stripe (the
        write-through cache): the touched data fragments' and the parity fragments' columns
        ``[a, b)`` are written over the session's own fragments (each node merges the range into its
        copy of that version: ``base_version`` is the session's, so a node without it answers STALE
        rather than build on the committed slot), or, for a data fragment an earlier delta of the
        session left at its committed version, to the other slot on that one (``versions``), the
        parity coded from the stripe held, so nothing is read and the untouched data fragments are
        not written at all. The committed slot is not
        touched, so copy-on-write is as for a whole stripe. A fragment write that fails leaves the
        session's version torn: the stripe is then written whole (every fragment replaced) from the
        stripe held. False when not worth it or not possible (not held, a fragment missing or on a
        suspect node): the caller reads and writes the stripe whole."""
        touched, a, b = self._touched(c, dc, of.chunk_size)
        if not self._columns_pay(c, ref, touched, a, b):
            return False
        old = self._held(of.ino, c, ref)
        if old is None:
            return False
        stripe, new, parity = await self._coded_columns(c, old, dc, of.chunk_size, a, b)
        payloads = {j: (a, new[j]) for j in touched}
        payloads.update({c.k + i: (a, parity[i]) for i in range(c.m)})
        errors = await self._write_columns(of, ref, versions, payloads, sync)  # based on the session's own copy
        if errors:
            log.info("stripe %d:%d: a column write failed on fragment(s) %s (%s); writing the stripe whole",
                     of.ino, ref.index, sorted(errors), next(iter(errors.values())))
            metrics.EC_STRIPE_WRITES.labels("delta_fallback").inc()
            await self._write_stripe(of, c, ref, versions, stripe, sync=sync, keep=True)
            return True
        new_ref = _written(ref, versions, payloads)
        self.cache.drop_chunk(of.ino, ref.index)
        of.record(new_ref)
        self.cache.put((of.ino, ref.index, new_ref.version), bytes(stripe))  # no await since the drop
        metrics.EC_STRIPE_WRITES.labels("columns").inc()
        return True

    async def _write_columns(self, of: OpenFile, ref: p.ChunkRef, versions: list[int],
                            payloads: dict[int, tuple[int, bytes]], sync: bool) -> dict[int, StripefsError]:
        """Write fragment ``j``'s bytes at its offset for each ``j: (offset, data)`` of ``payloads``, all at
        once, as ``versions[j]`` built on the fragment's version in ``ref`` (ChunkRef.fragment_version:
        the committed one's, in the other slot, or the session's own, in place); the errors by
        fragment (empty: all written)."""
        errors: dict[int, StripefsError] = {}

        async def one(j: int) -> None:
            offset, data = payloads[j]
            version = versions[j]
            request = p.WriteChunkReq(
                chunk=p.ChunkId(of.ino, ref.index, fragment_part(j, version)), version=version, base_version=ref.fragment_version(j),
                offset=offset, xxh3=xxhash.xxh3_64_intdigest(data), sync=sync,
            )
            try:
                await self.nodes.write(ref.nodes[j], request, data)
            except StripefsError as exc:
                errors[j] = exc

        async with trio.open_nursery() as nursery:
            for j in payloads:
                nursery.start_soon(one, j)
        if not errors and not sync:  # the next fsync syncs them
            pending = self._unsynced.setdefault(of.ino, {})
            for j in payloads:
                pending.setdefault(ref.nodes[j], set()).add(p.ChunkId(of.ino, ref.index, fragment_part(j, versions[j])))
        return errors

    def _delta_kept(self, ino: int, c: StripeCodec, ref: p.ChunkRef, version: int, dc: DirtyChunk, changes: dict, a: int, b: int) -> dict:
        """What the cache holds of committed stripe ``ref``, as the new ``version`` a parity delta wrote
        (write-through): the whole stripe with the dirty ranges put in; data fragments the write did not
        touch, unchanged; touched ones with their new columns ``[a, b)``. Reads and the next writes of
        the stripe then load nothing. Built from the committed version's entries, which never change."""
        kept: dict = {}
        whole = self.cache.get((ino, ref.index, ref.version))
        if whole is not None:
            stripe = bytearray(whole)
            for lo, hi in dc.ranges:
                hi = min(hi, len(stripe))
                stripe[lo:hi] = memoryview(dc.buf)[lo:hi]
            kept[(ino, ref.index, version)] = bytes(stripe)
        for j in range(c.k):
            held = self.cache.get((ino, ref.index, ref.version, 1 + j))
            if held is None:
                continue
            if j in changes:
                frag = bytearray(bytes(held).ljust(b, b"\0"))
                frag[a:b] = changes[j][1]
                held = bytes(frag)
            kept[(ino, ref.index, version, 1 + j)] = held
        return kept

    async def cut_stripe(self, of: OpenFile, ref: p.ChunkRef, inner: int) -> p.ChunkRef:
        """The boundary stripe of a truncate, cut to ``inner`` bytes as a new version; its ref for SetattrReq."""
        c = layout_codec(of.layout)
        epoch = await fresh_epoch(self.meta, of)
        versions = [await slot_version(self.meta, of, epoch, ref.fragment_version(j)) for j in range(c.n)]
        old = await self.stripe(of.ino, c, ref)
        return await self._write_stripe(of, c, ref, versions, memoryview(old)[:inner], sync=False, record=False, old=old)

    def _unchanged(self, ino: int, c: StripeCodec, ref: p.ChunkRef, old, stripe, known: set[int] | None = None) -> list[int]:
        """The data fragments of ``stripe`` whose bytes equal those of ``old``, stripe ``ref`` as read
        (zeros past either's end), on a node not suspect: a whole-stripe write leaves each at its
        version in ``ref`` and does not send it, as a parity delta leaves the fragments it does not
        touch (ChunkRef ``fversions``; the parity, coded from every data fragment, is the same as if
        it were rewritten). None of a stripe that was decoded (a fragment not read may be bad), and
        none without ``old`` (a first write of a stripe: nothing stored to keep); with ``known``, only
        those fragments of ``old`` are its bytes (``_base``: the others were not read)."""
        if old is None or not ref.version or (ino, ref.index, ref.version) in self._decoded:
            return []
        o, s, fps = memoryview(old), memoryview(stripe), c.fps
        out = []
        for j in range(c.k):
            if self._unreachable(ref, j) or not ref.fragment_version(j) or (known is not None and j not in known):
                continue
            a, b = j * fps, (j + 1) * fps
            if bytes(o[a:b]).ljust(fps, b"\0") == bytes(s[a:b]).ljust(fps, b"\0"):
                out.append(j)
        return out

    async def _write_stripe(self, of, c: StripeCodec, ref: p.ChunkRef, versions: list[int], stripe, *, sync: bool,
                            record: bool = True, keep: bool = False, old=None, known: set[int] | None = None) -> p.ChunkRef:
        """Code and write ``stripe`` (chunk_size bytes), fragment j as version ``versions[j]``; ``keep``:
        and cache it under the new stripe version (``record`` only: the version this session's reads
        then ask for). ``old``: stripe ``ref``'s bytes that ``stripe`` was made from, if known: the data
        fragments it does not change are not written (``_unchanged``)."""
        used = len(bytes(stripe).rstrip(b"\0"))  # trailing zeros need not be stored (common/erasure.py)
        frags = await self._run(c.encode_job(stripe, used))
        same = self._unchanged(of.ino, c, ref, old, stripe, known)
        if same:
            versions = list(versions)
            for j in same:
                versions[j] = ref.fragment_version(j)
        nodes = await self._write_fragments(of.ino, c, ref, versions, frags, sync, same)
        if same:
            # part of this version now: the next fsync makes them durable too (as after a delta)
            pending = self._unsynced.setdefault(of.ino, {})
            for j in same:
                pending.setdefault(ref.nodes[j], set()).add(p.ChunkId(of.ino, ref.index, fragment_part(j, versions[j])))
            metrics.EC_FRAGMENTS_UNCHANGED.inc(len(same))
        version = max(versions)
        new_ref = p.ChunkRef(index=ref.index, version=version, nodes=nodes, fversions=p.uniform_fversions(version, versions))
        # the cache may hold what this stripe version held before this write (a rewrite in one
        # session), and reads in flight may bring it back: both are dropped (chunk_cache.py)
        self.cache.drop_chunk(of.ino, ref.index)
        if record:
            of.record(new_ref)
            if keep:  # no await since the drop: no load can have started in between
                self.cache.put((of.ino, ref.index, version), bytes(stripe))
        return new_ref

    async def _write_fragments(self, ino: int, c: StripeCodec, ref: p.ChunkRef, versions: list[int], frags: list[bytes],
                               sync: bool, same: Sequence[int] = ()) -> list[int]:
        """Write every fragment but ``same`` (stored already at ``versions[j]`` on its node in ``ref``),
        moving the ones whose node fails; the placement, MISSING where none took it."""
        nodes = list(ref.nodes) + [MISSING] * (c.n - len(ref.nodes))
        stored = [j in same for j in range(c.n)]
        errors: dict[int, str] = {}

        async def one(j: int) -> None:
            node = nodes[j]
            version = versions[j]
            chunk = p.ChunkId(ino, ref.index, fragment_part(j, version))
            request = p.WriteChunkReq(
                chunk=chunk, version=version, base_version=0, offset=0, xxh3=xxhash.xxh3_64_intdigest(frags[j]), replace=True, sync=sync
            )
            tried: set[int] = set()
            # A node this mount suspects (it timed out, or a hedged read found it slow) is left out
            # once: the fragment is moved. The node the daemon gives instead (or keeps: it
            # heartbeats, and no other is free) is written to even if it is suspect too (every node
            # may be, after a busy minute of hedged reads): a suspect node is asked last, never
            # left out, or a healthy cluster would take degraded stripes.
            for attempt in range(_MOVE_ATTEMPTS):
                if node != MISSING and node not in tried and (attempt or not self.nodes.is_suspect(node)):
                    tried.add(node)
                    try:
                        await self.nodes.write(node, request, frags[j])
                        nodes[j], stored[j] = node, True
                        return
                    except StripefsError as exc:
                        errors[j] = f"node {node}: {exc}"
                        log.warning("fragment %s: write to node %d failed (%s); moving it", chunk, node, exc)
                until, why = self._no_spare
                if node == MISSING and trio.current_time() < until:
                    errors[j] = why  # the daemon had no node for one a moment ago
                    break
                try:
                    # not retried on UNAVAILABLE (the daemon's "no node left"): that fragment stays missing
                    rsp = await self.meta.call(p.ReplaceReplicaReq(ino=ino, index=ref.index, failed_node=node, part=j), retry=False)
                except StripefsError as exc:
                    if exc.code != ErrorCode.UNAVAILABLE:
                        raise
                    errors[j] = exc.message
                    if node == MISSING:
                        self._no_spare = (trio.current_time() + NO_SPARE_S, exc.message)
                    break
                self.nodes.learn(rsp.nodes)
                new = rsp.chunks[0].nodes[j] if j < len(rsp.chunks[0].nodes) else MISSING
                if new == node:  # kept: tried on the next attempt, unless it failed already
                    if node == MISSING or node in tried:
                        break
                    continue
                node = new
            nodes[j] = MISSING

        async with trio.open_nursery() as nursery:
            for j in range(c.n):
                if j not in same:
                    nursery.start_soon(one, j)
        count = sum(stored)
        need = min(c.n, c.k + max(0, self.min_extra))  # never fewer than K: that would lose the stripe
        if count < need:
            log.error(
                "stripe %d:%d: only %d of %d fragments could be written, %d needed; nothing committed (%s)",
                ino, ref.index, count, c.n, need, "; ".join(f"fragment {j}: {e}" for j, e in sorted(errors.items())),
            )
            raise StripefsError(
                ErrorCode.UNAVAILABLE,
                f"stripe {ino}:{ref.index}: only {count} of {c.n} fragments could be stored, {need} needed: "
                f"too few storage nodes are up for {c.k}+{c.m}",
            )
        if count < c.n:
            self._degraded_log.log(logging.WARNING, "degraded", "stripe %d:%d v%d written with %d of %d fragments (degraded): %s",
                                   ino, ref.index, max(versions), count, c.n, errors)
        if not sync:
            if len(self._unsynced) > 4096:  # files closed without fsync: forget the oldest
                del self._unsynced[next(iter(self._unsynced))]
            pending = self._unsynced.setdefault(ino, {})
            for j, node in enumerate(nodes):
                if stored[j]:
                    pending.setdefault(node, set()).add(p.ChunkId(ino, ref.index, fragment_part(j, versions[j])))
        return [n if stored[j] else MISSING for j, n in enumerate(nodes)]

    def forget_unsynced(self, ino: int) -> None:
        """A discarded write session's fragments need no fsync."""
        self._unsynced.pop(ino, None)

    async def sync(self, of: OpenFile) -> None:
        """fsync every fragment written since the last sync, on every node holding one.

        A node that fails makes its fragments MISSING in the commit, as a failed write does
        (reconstructed by the daemon), while each stripe keeps K + ``min_extra`` durable ones;
        below that the sync fails."""
        pending = self._unsynced.pop(of.ino, None)
        if not pending:
            return
        by_node = {node: sorted(chunks, key=lambda ch: (ch.index, ch.part)) for node, chunks in pending.items()}
        failed = await self.nodes.sync_each(by_node)
        if not failed:
            return
        c = layout_codec(of.layout)
        need = min(c.n, c.k + max(0, self.min_extra))
        stripes = sorted({chunk.index for node in failed for chunk in pending[node]})
        for index in stripes:
            ref = of.uncommitted.get(index) or of.chunks.get(index)
            if ref is None:
                continue
            parts = {j for j, n in enumerate(ref.nodes) if n in failed}  # the version to commit: older ones do not matter
            if not parts:
                continue
            durable = sum(1 for n in ref.nodes if n != MISSING and n not in failed)
            if durable < need:
                error = next(iter(failed.values()))
                raise StripefsError(
                    ErrorCode.UNAVAILABLE,
                    f"stripe {of.ino}:{index}: only {durable} of {c.n} fragments are durable, {need} needed: {error.message}",
                )
            log.warning(
                "stripe %d:%d: fragment(s) %s not durable (%s); committed with %d of %d, the daemon reconstructs the rest",
                of.ino, index, sorted(parts), "; ".join(f"node {n}: {e}" for n, e in failed.items()), durable, c.n,
            )
            if index in of.uncommitted:
                of.record(p.ChunkRef(index=index, version=ref.version, nodes=[MISSING if j in parts else n for j, n in enumerate(ref.nodes)],
                                     fversions=ref.fversions))
