"""The metadata daemon's trash requests (TrashListReq, TrashRestoreReq, TrashPurgeReq).

Dispatched like MetaService's own ``handle_*`` methods; the bookkeeping is
daemon/trash.py, the subtree filter daemon/access.py (``trash_scope``). A
restore is a namespace change like a create: logged with its entries, so
every mount's kernel cache (a negative entry for the old name) is told.
"""

from __future__ import annotations

import logging

from ..common import protocol as P

log = logging.getLogger(__name__)


class TrashService:
    def __init__(self, txn, ns, wake_gc) -> None:
        self.txn = txn  # daemon/txn.py
        self.ns = ns  # daemon/namespace.py (ns.trash: daemon/trash.py)
        self.wake_gc = wake_gc  # purged files' chunks are garbage now

    @property
    def trash(self):
        return self.ns.trash

    def entries(self, limit: int = 100_000) -> list[P.TrashEntry]:
        """Every trashed inode, oldest first (call under the transaction lock, or in a read)."""
        return [self.trash.entry(r, self.trash.path_of(r.ino)) for r in self.trash.rows(limit)]

    async def handle_trash_list(self, req: P.TrashListReq) -> P.Msg:
        return P.TrashRsp(entries=await self.txn.read(self.entries, max(1, min(req.limit, 100_000))))

    async def handle_trash_restore(self, req: P.TrashRestoreReq) -> P.Msg:
        def restore():
            return self.trash.restore(req.item, req.new_parent, req.new_name or None)

        def change(result):
            restored, _ = result
            return [*{parent for _, parent, _ in restored}, *(ino for ino, _, _ in restored)], [(parent, name) for _, parent, name in restored]

        (restored, left), _, _ = await self.txn.write_reporting(restore, report=None, change=change)
        return P.TrashRsp(done=[ino for ino, _, _ in restored], left=left)

    async def handle_trash_purge(self, req: P.TrashPurgeReq) -> P.Msg:
        def purge():
            items = [r.ino for r in self.trash.rows()] if req.everything else list(dict.fromkeys(req.items))
            done = []
            for ino in items:
                if self.trash.holds(ino):  # not freed with a directory purged before it
                    self.trash.purge(ino)
                    done.append(ino)
            return done

        done = await self.txn.write(purge)
        if done:
            self.wake_gc()
        return P.TrashRsp(done=done)
