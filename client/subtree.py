"""A mount of one directory of the cluster (``-o subdir=/team-a``, or a key restricted to it).

The daemon answers the mount's HelloReq with ``root_ino``, the inode of that
directory. The kernel knows the mount's root as inode 1 (``fuse.abi.ROOT_ID``),
so ``Subtree`` maps 1 to ``root_ino`` in every request and back in every reply
and change event; nothing else in the client sees the difference. The
directory's own ``..`` never reaches the daemon: at the mount's root the
kernel climbs into the mountpoint's parent. Whether a key may see more than
its subtree is decided by the daemon (daemon/access.py), not here.
"""

from __future__ import annotations

import msgspec

from ..common import protocol as p

_INODE_FIELDS = ("ino", "parent", "new_parent", "parent_old", "parent_new", "root", "shadow")


class Subtree:
    def __init__(self, root_ino: int):
        self.root = root_ino

    def request(self, req: p.Msg) -> p.Msg:
        changes = {f: self.root for f in _INODE_FIELDS if getattr(req, f, None) == 1}
        return msgspec.structs.replace(req, **changes) if changes else req

    def _attr(self, attr: p.Attr) -> p.Attr:
        return msgspec.structs.replace(attr, ino=1) if attr.ino == self.root else attr

    def reply(self, rsp: p.Msg) -> p.Msg:
        if isinstance(rsp, (p.AttrRsp, p.OpenRsp)) and rsp.attr.ino == self.root:
            rsp = msgspec.structs.replace(rsp, attr=self._attr(rsp.attr))
        dirs = getattr(rsp, "dir_attrs", None)
        if dirs and any(a.ino == self.root for a in dirs):
            rsp = msgspec.structs.replace(rsp, dir_attrs=[self._attr(a) for a in dirs])
        return rsp

    def event(self, inodes: list[int], entries: list[tuple[int, bytes]]) -> tuple[list[int], list[tuple[int, bytes]]]:
        return ([1 if i == self.root else i for i in inodes],
                [(1 if parent == self.root else parent, name) for parent, name in entries])
