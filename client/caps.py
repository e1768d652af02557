"""The mount's capabilities: what a subtree-restricted key shows storage nodes (common/capability.py).

The metadata daemon puts a ``Cap`` in every reply that hands out a file's
chunk locations (``OpenRsp.cap``, ``ChunksRsp.cap``; OpenRsps inside
ReaddirRsp and LookupPathsRsp too). ``MetaClient.call`` passes each reply to
``take``; NodePool (client/data_rpc.py) attaches ``await fresh(ino)`` to every
chunk request. A Cap within a quarter of its lifetime (at most a minute) of
expiring is renewed first with one ``CapsReq``; a node that refuses a request
with ACCESS gets it once more after ``refresh``. A mount whose key needs no
capabilities never receives one: ``active`` stays False and nothing here runs.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict

import trio

from ..common import protocol as p
from ..common.errors import StripefsError

log = logging.getLogger(__name__)

#: capabilities kept (one per file; an old one is asked for again when needed)
MAX_CAPS = 200_000
#: renew this long before expiry at most (less for short lifetimes: a quarter of it)
RENEW_BEFORE_S = 60.0


class CapStore:
    def __init__(self) -> None:
        self.meta = None  # the MetaClient that renews them (set by the mount)
        self._caps: OrderedDict[int, tuple[p.Cap, float]] = OrderedDict()  # ino -> (cap, renew after, wall clock)
        self._lock = trio.Lock()

    @property
    def active(self) -> bool:
        """Whether this mount's key has been given capabilities (so it needs them)."""
        return bool(self._caps)

    def _keep(self, cap: p.Cap | None) -> None:
        if cap is None:
            return
        now = time.time()
        renew_at = cap.expires - min(RENEW_BEFORE_S, max(cap.expires - now, 0) / 4)
        self._caps[cap.ino] = (cap, renew_at)
        self._caps.move_to_end(cap.ino)
        while len(self._caps) > MAX_CAPS:
            self._caps.popitem(last=False)

    def take(self, rsp: p.Msg) -> None:
        """Keep the capabilities a reply of the metadata daemon carries."""
        if isinstance(rsp, (p.OpenRsp, p.ChunksRsp)):
            self._keep(rsp.cap)
        elif isinstance(rsp, (p.ReaddirRsp, p.LookupPathsRsp)):
            for info in rsp.files:
                if info is not None:
                    self._keep(info.cap)
        elif isinstance(rsp, p.CapsRsp):
            for cap in rsp.caps:
                self._keep(cap)

    def get(self, ino: int) -> p.Cap | None:
        entry = self._caps.get(ino)
        return entry[0] if entry else None

    def held(self, ino: int) -> p.Cap | None | bool:
        """(any thread) What ``fresh`` would show without waiting: the capability, None (none is
        held: none is shown), or False (it must be renewed first, which only ``fresh`` does)."""
        entry = self._caps.get(ino) if self._caps else None
        if entry is None:
            return None
        return entry[0] if time.time() < entry[1] else False

    async def fresh(self, ino: int) -> p.Cap | None:
        """The capability to show for ``ino``, renewed first when it nears its expiry."""
        entry = self._caps.get(ino) if self._caps else None
        if entry is None:
            return None
        if time.time() >= entry[1]:
            await self.refresh([ino])
            entry = self._caps.get(ino, entry)
        return entry[0]

    async def refresh(self, inos, *, force: bool = False) -> bool:
        """Ask the daemon for new capabilities (``force``: even for ones that look fresh, a node having
        refused them); whether it gave any (False: this key needs none, or asking failed)."""
        if self.meta is None:
            return False
        wanted = sorted(set(inos))[: p.MAX_LIST]
        async with self._lock:  # one renewal at a time; a second caller finds the first one's result
            now = time.time()
            if not force:  # another task may have renewed them while this one waited
                wanted = [i for i in wanted if (e := self._caps.get(i)) is None or now >= e[1]]
                if not wanted:
                    return True
            try:
                rsp = await self.meta.call(p.CapsReq(inos=wanted))
            except StripefsError as exc:
                log.warning("renewing capabilities for %d file(s) failed: %s", len(wanted), exc.message)
                return False
        if isinstance(rsp, p.CapsRsp) and rsp.caps:  # MetaClient.call kept them already
            return True
        return False
