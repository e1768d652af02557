"""Cluster-wide duties run on exactly one metadata daemon: the lease that chooses it.

Several daemons may serve one database, but some work must be done once for
the whole cluster: persisting node health decisions, repair, drain and
rebalance scheduling (daemon/repair.py), garbage collection, the orphan sweep,
trimming the change log and the applied-ops table. The daemon that holds the
``duties`` row of the ``leases`` table does it; the others only serve
requests.

The lease
---------
A row ``(holder, expires_ns, term)``. Every ``RENEW_S`` each daemon runs, in
a transaction of its own, "take it if I hold it or it has expired"
(daemon/store.py ``take_lease``: one conditional UPDATE, portable SQL, no
advisory locks), setting ``expires_ns`` to its wall clock plus ``TTL_S``. The
holder renews; the others find it unexpired and stay followers. When the
holder dies its row expires and the next daemon to try takes it: duties move
within ``TTL_S + RENEW_S`` (4 s). ``term`` counts changes of holder.

Losing it: a daemon leads only until ``TTL_S - MAX_SKEW_S`` after the start
of its last successful renewal (measured on its own monotonic clock). If a
renewal fails (the database is unreachable, the row names another holder)
and that deadline passes, it stops its duties at once (their tasks are
cancelled; a watchdog checks the deadline even while a renewal is stuck in a
database call) before any other daemon can take the row, as long as the daemons'
wall clocks differ by less than ``MAX_SKEW_S`` (run NTP). A clean stop gives
the lease back (``release``) so the next daemon takes over at its next try.

SQLite: the database file is locked by one daemon, so that daemon always
leads and the lease row is not used (``Duties(shared=False)``).

``Duties`` holds the state and the transitions (``apply``, ``expire``; pure,
driven by tests with a hand clock); ``run`` is the renewal loop and
``run_while_leading`` runs the duty tasks during each term.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Awaitable, Callable

import trio

log = logging.getLogger(__name__)

LEASE = "duties"
TTL_S = 3.0
RENEW_S = 1.0
MAX_SKEW_S = 0.5

Take = Callable[[str, str, int, int], Awaitable[tuple[str, int, int]]]


class Duties:
    def __init__(self, holder: str, *, shared: bool, ttl_s: float = TTL_S, renew_s: float = RENEW_S):
        self.holder = holder  # this daemon's name in the lease row
        self.shared = shared
        self.ttl_s = ttl_s
        self.renew_s = renew_s
        self.leading = not shared
        self.leader = "" if shared else holder  # who leads, as far as this daemon knows
        self.term = 0
        self._valid_until = -math.inf if shared else math.inf  # monotonic
        self._changed = trio.Event()
        self._scope: trio.CancelScope | None = None
        self.on_lost: list[Callable[[], None]] = []  # called when this daemon stops leading

    # -- transitions (pure) ------------------------------------------------------

    def apply(self, row: tuple[str, int, int], started: float) -> None:
        """The lease row after a take attempt that began at monotonic ``started``."""
        holder, _expires_ns, term = row
        if holder != self.leader:
            log.info("duties: %s leads (term %d)%s", holder or "nobody", term, " (this daemon)" if holder == self.holder else "")
        self.leader, self.term = holder, term
        if holder == self.holder:
            self._valid_until = started + self.ttl_s - MAX_SKEW_S
            self._set(True)
        else:
            self._set(False, f"{holder} holds the lease")

    def expire(self, now: float) -> None:
        """No renewal succeeded in time: stop leading."""
        if self.shared and self.leading and now >= self._valid_until:
            self._set(False, f"the lease was not renewed within {self.ttl_s - MAX_SKEW_S:.1f}s")

    def _set(self, leading: bool, why: str = "") -> None:
        if leading == self.leading:
            return
        self.leading = leading
        self._changed.set()
        self._changed = trio.Event()
        if leading:
            log.info("duties: this daemon (%s) leads now, term %d", self.holder, self.term)
            return
        log.warning("duties: this daemon (%s) stops its cluster duties: %s", self.holder, why)
        if self._scope is not None:
            self._scope.cancel()
        for callback in self.on_lost:
            callback()

    # -- running -----------------------------------------------------------------

    async def wait_leading(self) -> None:
        while not self.leading:
            await self._changed.wait()

    async def run(self, take: Take, release: Callable[[str, str], Awaitable[None]]) -> None:
        """Take or renew the lease every ``renew_s``, forever (a shared database only).

        ``take(name, holder, now_ns, ttl_ns)`` runs store.take_lease in a transaction of its own."""
        if not self.shared:
            return
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._watchdog, name="duties-watchdog")
                await self._renew_forever(take)
        finally:
            if self.leading:
                with trio.CancelScope(shield=True), trio.move_on_after(2.0):
                    try:
                        await release(LEASE, self.holder)
                        log.info("duties: lease given back")
                    except Exception as exc:
                        log.warning("duties: cannot give the lease back (it expires in %.0fs): %s", self.ttl_s, exc)

    async def _watchdog(self) -> None:
        """Stop leading at the deadline even while a renewal hangs (a database call cannot be abandoned)."""
        while True:
            await trio.sleep(min(0.1, self.renew_s / 4))
            self.expire(time.monotonic())

    async def _renew_forever(self, take: Take) -> None:
        while True:
            started = time.monotonic()
            row = None
            with trio.move_on_after(self.renew_s):
                try:
                    row = await take(LEASE, self.holder, time.time_ns(), int(self.ttl_s * 1e9))
                except Exception as exc:  # the database is unreachable or refused: try again
                    log.warning("duties: cannot renew the lease: %s", exc)
            if row is not None:
                self.apply(row, started)
            self.expire(time.monotonic())
            # time.monotonic() is not trio's clock (offset at random): wait what is left of the period
            await trio.sleep(max(0.0, started + self.renew_s - time.monotonic()))

    async def run_while_leading(self, tasks: list[tuple[Callable[[], Awaitable[None]], str]]) -> None:
        """Run ``tasks`` during every term this daemon leads; they are cancelled when it stops."""
        while True:
            await self.wait_leading()
            async with trio.open_nursery() as nursery:
                self._scope = nursery.cancel_scope
                if not self.leading:  # lost while the nursery opened
                    nursery.cancel_scope.cancel()
                for fn, name in tasks:
                    nursery.start_soon(fn, name=name)
            self._scope = None
