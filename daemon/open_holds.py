"""Open files held across several metadata daemons (PostgreSQL only).

With SQLite one daemon knows every session, so ``Sessions.is_open`` decides
whether an unlinked inode must stay as an orphan. With several daemons a
mount may hold a file open through daemon A while daemon B unlinks its last
name; B alone would reclaim it under A's reader. So, with PostgreSQL:

* every daemon writes, once a second (``SYNC_INTERVAL_S``), the set of
  inodes its sessions hold open into ``open_holds(boot_id, ino)`` (only the
  difference since the last write) and renews its row in ``daemons(boot_id,
  until_ns)``; a daemon that stops renewing (killed) loses its holds once
  ``until_ns`` has passed (a few session leases), and any daemon deletes them;
* ``is_open(ino)`` is true when a session of this daemon holds the inode, when
  a live daemon's row in ``open_holds`` names it, or when the inode changed
  less than ``GRACE_S`` ago (a hold taken through another daemon in the last
  moments may not be written yet). Unlinking the last name therefore always
  leaves an orphan (the unlink itself is the change), and
* the daemon leading the cluster duties (daemon/duties.py) sweeps orphans
  every ``SWEEP_INTERVAL_S`` and reclaims those that nobody holds (each
  reclaim is one SERIALIZABLE transaction, so even two daemons sweeping at
  once around a change of leader reclaim an inode once).

A hold is thus visible to every daemon within ``SYNC_INTERVAL_S`` plus one
transaction, well inside ``GRACE_S``; clocks of the daemons' machines may
differ by less than ``GRACE_S - SYNC_INTERVAL_S`` (NTP does far better).
"""

from __future__ import annotations

import logging
import time

import trio

log = logging.getLogger(__name__)

SYNC_INTERVAL_S = 1.0
SWEEP_INTERVAL_S = 2.0
GRACE_S = 5.0


class OpenHolds:
    def __init__(self, txn, store, sessions, boot_id: str, *, lease_s: float, duties, wake_gc) -> None:
        self.txn = txn  # daemon/txn.py
        self.store = store
        self.sessions = sessions  # daemon/health.py Sessions
        self.boot_id = boot_id
        self.lease_s = lease_s
        self.duties = duties  # daemon/duties.py
        self.wake_gc = wake_gc  # orphans reclaimed: the collector runs soon
        self._written: set[int] = set()

    def is_open(self, ino: int) -> bool:
        """Called inside a namespace transaction (a worker thread)."""
        if self.sessions.is_open(ino):
            return True
        now = time.time_ns()
        return self.store.held_elsewhere(ino, self.boot_id, now, now - int(GRACE_S * 1e9))

    def _sync(self, held: set[int], until_ns: int, now_ns: int) -> None:
        store = self.store
        store.renew_daemon(self.boot_id, until_ns)
        store.add_holds(self.boot_id, sorted(held - self._written))
        store.drop_holds(self.boot_id, sorted(self._written - held))
        store.forget_dead_daemons(now_ns)

    async def run(self, reclaim_orphans) -> None:
        """Write this daemon's holds; while leading, sweep orphans with ``reclaim_orphans`` (Namespace)."""
        lease_ns = int(max(3 * self.lease_s, 10.0) * 1e9)
        last_sweep = 0.0
        while True:
            held = self.sessions.open_inodes()
            now = time.time_ns()
            try:
                await self.txn.write(self._sync, held, now + lease_ns, now)
                self._written = held
            except Exception as exc:  # a database error (logged by the store): retried next round
                log.warning("open files of this daemon's sessions not written to the database: %s", exc)
            if self.duties.leading and time.monotonic() - last_sweep >= SWEEP_INTERVAL_S:  # a cluster duty
                last_sweep = time.monotonic()
                try:
                    reclaimed = await self.txn.write(reclaim_orphans)
                except Exception as exc:
                    log.warning("orphan sweep failed, will retry: %s", exc)
                else:
                    if reclaimed:
                        self.wake_gc()
            await trio.sleep(SYNC_INTERVAL_S)
