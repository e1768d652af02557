"""The metadata daemon's quota requests (QuotaSetReq, QuotaGetReq, QuotaRecountReq, QuotaRoomReq).

Dispatched like MetaService's own ``handle_*`` methods; the bookkeeping is
daemon/quota.py. Setting a quota on a large tree and recounting scan that tree
inside one operation (the daemon waits meanwhile): these are rare admin actions.
"""

from __future__ import annotations

import logging
import stat

from ..common import protocol as P
from ..common.errors import ErrorCode, StripefsError
from .quota import Quota

log = logging.getLogger(__name__)


class QuotaService:
    def __init__(self, txn, store, ns) -> None:
        self.txn = txn  # daemon/txn.py
        self.store = store
        self.ns = ns  # daemon/namespace.py

    @property
    def quotas(self):
        return self.ns.quotas

    def _path(self, ino: int) -> bytes:
        return self.ns.path_of(ino)

    def info(self, q: Quota) -> P.QuotaInfo:
        return P.QuotaInfo(
            ino=q.ino, path=self._path(q.ino), max_bytes=q.max_bytes, max_inodes=q.max_inodes,
            used_bytes=q.used_bytes, used_inodes=q.used_inodes,
        )

    def all_info(self) -> list[P.QuotaInfo]:
        """Every quota (for StatusRsp); call under the transaction lock."""
        return [self.info(q) for q in self.quotas.all()]

    async def handle_quota_set(self, req: P.QuotaSetReq) -> P.Msg:
        def set_quota():
            row = self.ns.directory(req.ino)
            q = self.quotas.set(row["ino"], req.max_bytes, req.max_inodes)
            return [] if q is None else [self.info(q)]

        return P.QuotaRsp(quotas=await self.txn.write(set_quota))

    async def handle_quota_get(self, req: P.QuotaGetReq) -> P.Msg:
        def get():
            if not req.ino:
                return self.all_info()
            row = self.ns.inode(req.ino)
            return [self.info(q) for q in self.quotas.applying(req.ino, stat.S_ISDIR(row["mode"]))]

        return P.QuotaRsp(quotas=await self.txn.read(get))

    async def handle_quota_recount(self, req: P.QuotaRecountReq) -> P.Msg:
        def recount():
            if req.ino and self.quotas.get(req.ino) is None:
                raise StripefsError(ErrorCode.NOT_FOUND, f"directory {req.ino} has no quota")
            fixed = self.quotas.recount(req.ino or None)
            return [self.info(before) for before, _ in fixed], self.all_info()

        corrected, quotas = await self.txn.write(recount)
        return P.QuotaRsp(quotas=quotas, corrected=corrected)

    async def handle_quota_room(self, req: P.QuotaRoomReq) -> P.Msg:
        def room():
            row = self.ns.regular_file(req.ino)
            return self.quotas.max_size(req.ino, row["size"])

        return P.QuotaRoomRsp(max_size=await self.txn.read(room))
