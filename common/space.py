"""Space over storage nodes: a file system shared by several nodes counts once.

Several storage nodes may keep their chunks on one file system (a one-machine
cluster, or several nodes per disk). Each reports the file system's size and
free space, so summing the nodes' figures counts that disk once per node. Each
node therefore also reports which file system its figures are of,
``MACHINE:DEV:FSID`` (the machine's id, ``st_dev`` of the data directory and
the file system id ``f_fsid`` from statvfs), and capacity and free space are
summed over distinct file systems. A node with a configured ``capacity`` owns a
slice of its disk: its figures are its own and it counts alone.

Used space is what stripefs stores (the nodes' chunk files), never the file
systems' used space, which includes whatever else is on those disks.
"""

from __future__ import annotations

import functools
import os
import socket
from collections.abc import Iterable


@functools.cache
def machine_id() -> str:
    """This machine's id (systemd's /etc/machine-id, else this boot's id, else the host name)."""
    for path in ("/etc/machine-id", "/proc/sys/kernel/random/boot_id"):
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text:
            return text
    return socket.gethostname()


def filesystem_id(path: str | os.PathLike, *, own: str = "") -> str:
    """``MACHINE:DEV:FSID`` of the file system holding ``path``; ``own`` (a node's name) makes it that node's alone."""
    st, vfs = os.stat(path), os.statvfs(path)
    key = f"{machine_id()}:{st.st_dev}:{vfs.f_fsid}"
    return f"{key}/{own}" if own else key


def shared_capacity(nodes: Iterable[tuple[str, int, int]]) -> tuple[int, int]:
    """(capacity, free) over ``nodes`` given as (filesystem, capacity, free): each file system once
    (its largest figures: nodes on it report the same disk at slightly different times); a node
    with an unknown file system ("") counts alone."""
    by_fs: dict[str, tuple[int, int]] = {}
    alone: list[tuple[int, int]] = []
    for fs, capacity, free in nodes:
        if not fs:
            alone.append((capacity, free))
            continue
        seen = by_fs.get(fs, (0, 0))
        by_fs[fs] = (max(seen[0], capacity), max(seen[1], free))
    counted = list(by_fs.values()) + alone
    return sum(c for c, _ in counted), sum(f for _, f in counted)
