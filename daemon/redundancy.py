"""The metadata daemon's side of erasure coding: placements with missing
fragments, refusing layouts the cluster cannot hold, space accounting per
layout, and the shadow-inode swap of online conversion. No network code.

Fragment placements
-------------------
A chunk row of an ``ec=K+M`` file lists K+M node ids in fragment order: node
``nodes[j]`` holds fragment ``j`` (``ChunkId(ino, index, part=j)``). A
fragment that has no node, because fewer than K+M nodes were up when it was
written, is ``MISSING`` (node id 0; storage nodes must have ids >= 1). A row
with a missing fragment is a *degraded stripe*: readers skip that fragment,
``stripefs status`` counts such stripes, and the repair work (a later issue)
finds them with ``SqliteStore.degraded_stripes``: that is the reconstruction
queue. Replicated chunks never contain MISSING: their rows just list fewer
nodes.

Layout checks
-------------
``ec=K+M`` needs K+M nodes that are up; when the nodes carry more than one
host label (failure domains), K+M distinct hosts, since two fragments on one
host would fail together. A cluster whose nodes all carry one label (a single
machine) is counted by nodes.

Space accounting
----------------
``layout_usage`` estimates raw bytes from the metadata alone: each chunk's
used length is what the file size leaves of it; a replicated chunk stores it
once per listed node, an EC stripe stores ``stored_payload(j)`` per
present fragment (common/erasure.py: trimmed fragments). Storage-node chunk
file headers and checksum tables (64 + 8 bytes per 64 KiB) are not counted;
holes inside a chunk count as stored.

Online conversion
-----------------
``create_shadow`` makes an inode with no name (nlink 0, an orphan) carrying
the file's attributes and the new redundancy, held open by the converting
session; the converter copies the data into it through the ordinary data
path. ``swap_shadow`` then, in one metadata transaction, checks that the file
did not change since the copy began (same size, mtime and chunk versions),
points every name of the file at the shadow, copies xattrs, and leaves the old
inode an orphan, reclaimed as soon as no session has it open (readers that
have it open keep reading the old copy). So at any moment each name resolves
to a complete file in either layout. If the converter dies, its session lapses
and the shadow, an orphan nobody holds, is reclaimed: the conversion rolls back.
The file's inode number changes, as with a copy and rename.
"""

from __future__ import annotations

import logging
import stat
from collections import defaultdict
from typing import Iterable, Sequence

from ..common.erasure import codec
from ..common.errors import ErrorCode, StripefsError
from ..common.layout import Redundancy, parse_redundancy
from . import placement

log = logging.getLogger(__name__)

#: node id of a fragment that has no node (a degraded stripe)
MISSING = 0


def check_fits(nodes: Iterable[placement.NodeView], redundancy: Redundancy) -> None:
    """Refuse a layout the up nodes (or hosts) cannot hold: R copies or K+M fragments, each on its own
    node, on distinct hosts where there are several. Accepted, every new file would stay
    under-replicated for good and repair would look for a node that does not exist."""
    up = [n for n in nodes if n.up]
    hosts = {n.host for n in up}
    need = redundancy.copies
    what, smaller = (f"{need} fragments", "a smaller K+M") if redundancy.is_ec else (f"{need} copies", "fewer replicas")
    if len(hosts) > 1 and len(hosts) < need:
        raise StripefsError(
            ErrorCode.INVALID,
            f"{redundancy} puts {what} on distinct hosts, but only {len(hosts)} host(s) have storage nodes up; "
            f"add hosts or choose {smaller}",
        )
    if len(up) < need:
        raise StripefsError(
            ErrorCode.INVALID,
            f"{redundancy} needs {need} storage nodes up, the cluster has {len(up)}; start more nodes or choose {smaller}",
        )


def pad_fragments(nodes: Sequence[int], redundancy: Redundancy) -> list[int]:
    """A placement in fragment order, MISSING where fewer nodes were available than fragments."""
    nodes = list(nodes)
    if redundancy.is_ec and len(nodes) < redundancy.copies:
        nodes += [MISSING] * (redundancy.copies - len(nodes))
    return nodes


def fragment_position(nodes: Sequence[int], failed_node: int, part: int) -> int | None:
    """Which fragment a ReplaceReplicaReq is about, or None if it was already moved."""
    if part >= 0:
        return part if part < len(nodes) and nodes[part] == failed_node else None
    return nodes.index(failed_node) if failed_node in nodes else None


# ------------------------------------------------------------------ accounting


def chunk_raw_bytes(redundancy: Redundancy, chunk_size: int, used: int, nodes: Sequence[int]) -> int:
    """Bytes the copies of one chunk occupy (see the module docstring)."""
    if used <= 0:
        return 0
    if not redundancy.is_ec:
        return used * len([n for n in nodes if n != MISSING])
    c = codec(redundancy.ec_k, redundancy.ec_m, chunk_size)
    return sum(c.stored_payload(j, used) for j, n in enumerate(nodes) if n != MISSING)


def layout_usage(rows: Iterable) -> dict[str, dict[str, int]]:
    """redundancy -> {files, logical_bytes, raw_bytes, degraded_stripes}.

    ``rows``: (ino, redundancy, chunk_size, size, idx, version, nodes) per chunk,
    with idx None for a file without chunks (SqliteStore.usage_rows).
    """
    out: dict[str, dict[str, int]] = defaultdict(lambda: {"files": 0, "logical_bytes": 0, "raw_bytes": 0, "degraded_stripes": 0})
    seen: set[int] = set()
    parsed: dict[str, Redundancy] = {}
    for ino, red_text, chunk_size, size, idx, version, nodes_text in rows:
        entry = out[red_text]
        if ino not in seen:
            seen.add(ino)
            entry["files"] += 1
            entry["logical_bytes"] += size
        if idx is None:
            continue
        red = parsed.get(red_text) or parsed.setdefault(red_text, parse_redundancy(red_text))
        nodes = [int(n) for n in nodes_text.split(",") if n]
        used = min(chunk_size, size - idx * chunk_size)
        if version:
            entry["raw_bytes"] += chunk_raw_bytes(red, chunk_size, used, nodes)
        if red.is_ec and MISSING in nodes and used > 0:
            entry["degraded_stripes"] += 1
    return dict(out)


# ------------------------------------------------------------------ conversion


def shadow_fields(row, redundancy: str, now: int) -> dict:
    """Inode fields of a conversion shadow of file ``row`` (an sqlite3.Row of inodes)."""
    if not stat.S_ISREG(row["mode"]):
        raise StripefsError(ErrorCode.INVALID, f"inode {row['ino']} is not a regular file: only files are converted")
    red = parse_redundancy(redundancy)
    return dict(
        mode=row["mode"], uid=row["uid"], gid=row["gid"], nlink=0, rdev=0, size=0,
        atime_ns=row["atime_ns"], mtime_ns=row["mtime_ns"], ctime_ns=now, generation=0,
        chunk_size=row["chunk_size"], stripe_count=row["stripe_count"], redundancy=str(red),
        stripe_seed=row["stripe_seed"] ^ 0x5A5A5A5,
    )
