"""Callbacks: regular files a mount may cache in the kernel, and the changes that wait for it.

Close-to-open says: once close() returned on one mount, an open() or stat()
that begins later on any other mount sees the closed data and size. The
change feed (daemon/events.py) cannot promise that alone, since an event may
still be on its way when the later open begins, so the default mount used to
cache regular-file names for 0 s and ask the daemon on every open. A callback
turns it around, as NFSv4 delegations and CephFS capabilities do: the daemon
remembers which sessions cache a file, and a change of that file waits until
each of them said it dropped it.

The rules
---------
* A mount following a healthy feed asks for a callback with its LookupReq
  (``callback``). If granted, the reply names the change log position the
  answer is as of (``AttrRsp.callback``, the grant's seq ``g``); the daemon
  records the session under two keys, the inode and the name
  ``(parent, name)``, and the mount caches both for ``cache_timeout_s``.
* A change numbered ``n`` (the change log's seq, daemon/change_log.py) that
  touches a key (its ``inodes`` or ``entries``) is answered only after every
  session holding that key with ``g < n`` acknowledged ``n`` (AckReq,
  sent once the mount's kernel dropped what the change touched), or
  ``WAIT_S`` passed. Then those holdings are gone, on both sides: the mount
  forgets a key when it applies an event ``n > g`` touching it, the daemon
  when it settled such a change. A holding granted at ``g >= n`` already saw
  the change and stays. A change waits only for sessions that still hold one
  of its keys (``_holds``): one whose holdings of them an earlier change ended
  (it acknowledged that one) or a penalty took owes no acknowledgement, since
  its mount acknowledges only events that end a grant it has, and every
  holding that ends wakes the waiting changes to look again.
* The session that made the change (its OnceReq ``client_id``, told at
  HelloReq) never waits for itself and keeps its holdings of names and
  directories: its own reply tells it, and the feed names the writer
  (``ChangeEvent.writer``), so its mount keeps them too. A file it changed
  through a name (unlink, rename) is held no more, on both sides (an unlinked
  one would otherwise stay an orphan for as long as its writer's session
  lives); a file it changed alone (a commit, a setattr: the change names no
  entry) stays held, on both sides, so its mount answers a stat after its
  write from the commit's reply. The race is the lookup grant's: another
  mount's later change ends the holding through the feed before the mount
  keeps that reply, and a reply kept after such an event is dropped (the
  mount keeps a commit's attributes only while it still holds the file). A session whose client id the daemon does not know (adopted
  after a restart, until its first AckReq) gets no callbacks.
* A directory's names: a mount that knows every name of a directory (it made
  it, or listed it in one page) holds ``("dir", ino)`` and answers lookups of
  other names ENOENT itself; any other mount's create, unlink or rename in it
  waits for that mount like a change of a held file.
* ``WAIT_S`` is safe for a mount that is alive but never answers: a mount
  that missed an event sees the gap at the next feed heartbeat and drops
  everything; one that hears nothing drops everything after
  ``EVENTS_SILENCE_S``.
* Holding a callback costs others (their changes wait), so it is a privilege
  of a key, bounded per key: a session that lets a wait run out, or
  acknowledges later than ``LATE_S`` after the change began waiting for it,
  is an offence of its *key* (its CURVE key; on a plain socket, where every
  peer is trusted, only a wait that ran out counts, against the session). The key's sessions lose every holding
  (no change waits for them any more) and get no callback for
  ``PENALTY_S``, twice as long at each offence within ``MAX_PENALTY_S``. A
  fresh HelloReq does not escape it, and acknowledging just inside
  ``WAIT_S`` costs a writer one wait, not one per change. An honest mount
  acknowledges in milliseconds; one that cannot keep up caches as before,
  without callbacks, instead. Callbacks are granted only on what the key may
  read: the daemon checks its requests against its subtree
  (daemon/access.py), and a subtree key holds none.
* A directory held whole by a session that creates there asynchronously
  (client/async_dirops.py: it answered creates the daemon may not have yet)
  is recalled before another session reads it (a lookup in it, a lookup that
  finds it, a getattr or a listing of it, ``recall_needed``): the read first logs a change naming the directory,
  which waits for the holder like any change; the holder sends its pending
  creates before it acknowledges (client/kernel_cache.py ``before_ack``), so
  the read sees them. Close-to-open holds for names made asynchronously too.
* A write mark (``("w", ino)``, ``grant_write``): a mount whose close sends nothing
  (docs/design.md "A close that sends nothing") commits a write session on its own, a
  moment after its last write, so a close may return before the daemon knows the new
  size. Its first write to a file it did not create in a directory it holds asks
  ``OpenReq(mark=True)`` before it is answered: the daemon records the mark, then, if
  other sessions hold the file, logs a change naming it (they drop what they cached
  and acknowledge first). While the mark stands, another session's read of the file
  (a lookup that finds it, a getattr, an open) first logs a change naming it
  (``written_elsewhere``), and a listing grants no callback on it; the writer
  commits what it wrote before it acknowledges (client/operations.py
  ``_before_ack``). A change naming the file waits for the mark's holder as for any
  holding, and ends the mark; the writer's own commits keep it. So once close()
  returned on the writer, any later open or stat elsewhere sees the data.
* Held files count as open (``held``): an unlink keeps the inode as an
  orphan until its holders let go, since a mount may open a held file
  without asking. An AckReq names the dropped files the mount has open;
  they join its open set before the holding goes.
* Only one daemon serves the namespace (SQLite): callbacks live in its
  memory. A restarted daemon knows none, so for ``GRACE_S`` after a restart
  on an existing database every change waits the grace out, and mounts drop
  what they cached when the feed names a new daemon (``ChangeEvent.daemon``).
* Several daemons sharing a database (PostgreSQL) grant directory callbacks
  only (``files`` False: a file, its name or a write mark gets -1), and every
  such holding is also a row of ``dir_holds`` (daemon/shared_holds.py), written
  in the transaction that reads what it covers (the whole listing, the mkdir).
  A change reads the rows of the directories it names in its own transaction
  (the grant marks the directory's own row, which every change of it writes: a
  grant and a change that miss each other conflict on it); finding
  one, it replies only once the row is gone or ``SHARED_WAIT_S`` passed. The
  holder's daemon settles the change with ``settle`` when its feed publishes it
  (the rules above, penalties included), and deletes the row when the holding
  ends. A read of a directory another session holds and creates in
  asynchronously recalls it the same way. No grace: a dead daemon's rows are
  waited for once, ``SHARED_WAIT_S`` at most, then deleted (docs/design.md,
  "Callbacks across daemons").
* Write marks die with a daemon too, and a mount may have closed a file whose
  session it has not committed yet. So during the grace a read that may see a
  file (a lookup, a getattr, an open other than a write mark's, a listing, a
  batch of path lookups) waits the grace out too, as NFSv4's grace holds
  opens: a mount drops what it held when the feed names the new daemon, or
  when it has heard nothing for ``EVENTS_SILENCE_S``, and before it
  acknowledges that it commits everything it wrote (client/operations.py
  ``_commit_written``); a commit is a change, applied at once and answered
  after the grace, so it is in before the waiting reads are answered. A write
  mark asked during the grace is granted at once.
* A write mark's holder may need longer than ``WAIT_S`` to commit (a storage
  node that died under the write: its request timeouts). While it does, it
  says so (``AckReq.committing``, every ``COMMITTING_S / 4``): a change
  waiting for it waits ``COMMITTING_S`` from each notice, up to
  ``COMMIT_WAIT_S``, and its acknowledgement is not late. A mount that stops
  saying so is waited for ``WAIT_S`` from the change's start, as any holder.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Callable, Iterable

import trio

from ..common import protocol as P

log = logging.getLogger(__name__)

#: the longest a change waits for a session's acknowledgement (see the rules above)
WAIT_S = P.EVENTS_SILENCE_S + 1.0
#: after a restart on an existing database: how long every change waits for mounts to drop what they cached
GRACE_S = P.EVENTS_SILENCE_S + 0.5
#: an acknowledgement that comes later than this after a change began waiting for it is an offence
LATE_S = 1.0
#: a key whose session let a wait run out (or acknowledged late) gets no callback for this long;
#: each later offence doubles it, up to MAX_PENALTY_S
PENALTY_S = 60.0
MAX_PENALTY_S = 3600.0
#: keys one session may hold (two per file); past it, no more callbacks for it
MAX_PER_SESSION = 524_288


class Callbacks:
    def __init__(self, *, enabled: bool, alive: Callable[[int], bool] = lambda sid: True,
                 last_seq: Callable[[], int] = lambda: 0, owner: Callable[[int], str | None] = lambda sid: None) -> None:
        self.enabled = enabled
        #: callbacks on files, their names and write marks too (one daemon); False: directories only
        #: (several daemons: daemon/shared_holds.py covers nothing else, so nothing else is granted)
        self.files = True
        #: ``on_dir_dropped(ino, session)``: a directory's holding ended (daemon/shared_holds.py deletes its row)
        self.on_dir_dropped: Callable[[int, int], None] | None = None
        self.alive = alive  # is this session still open (daemon/health.py Sessions)
        self.owner = owner  # the key a session belongs to (None: a plain socket): penalties are the key's
        self.last_seq = last_seq  # the newest change number logged: a granted answer is as of it (daemon/txn.py)
        self._holders: dict = {}  # key -> {session: grant seq}
        self._held: dict[int, set] = {}  # session -> its keys
        self._acked: dict[int, int] = {}  # session -> newest seq it acknowledged
        self._client: dict[int, int] = {}  # session -> its OnceReq client id
        self._penalty: dict[tuple, float] = {}  # offender (_offender) -> until when it gets no callback
        self._last_penalty: dict[tuple, float] = {}  # offender -> its last penalty's length (doubled next time)
        self._heard = trio.Event()  # set (and replaced) on every acknowledgement, while a change waits
        self._waiting = 0  # changes waiting in ``settle`` (none: nobody to wake, no Event made per revoke)
        self._committing: dict[int, float] = {}  # session -> until when a change waits for it (AckReq.committing)
        self.marks = 0  # write marks held (keys ("w", ino)): none, and no read looks for one
        self._grace_until = 0.0
        self._grace_until_mono = 0.0  # the same on time.monotonic(): read by the read lane's thread
        self.waits = 0  # changes that waited for another session
        self.timeouts = 0  # sessions that let a wait run out
        self.late = 0  # acknowledgements later than LATE_S

    def start_grace(self) -> None:
        """A restart on an existing database: changes wait ``GRACE_S`` (on the trio thread)."""
        if self.enabled:
            self._grace_until = trio.current_time() + GRACE_S
            self._grace_until_mono = time.monotonic() + GRACE_S

    def in_grace(self) -> bool:
        """The grace after a restart is not over (on the trio thread)."""
        return bool(self._grace_until) and trio.current_time() < self._grace_until

    def in_grace_now(self) -> bool:
        """``in_grace`` on any thread (daemon/read_lane.py)."""
        return bool(self._grace_until_mono) and time.monotonic() < self._grace_until_mono

    async def grace_over(self) -> None:
        """Return once the grace after a restart is over: a read of a file waits for it, since the
        write marks of mounts whose closes send nothing died with the old daemon (the rules above)."""
        if self.in_grace():
            await trio.sleep_until(self._grace_until)

    # ------------------------------------------------------------------ grants

    def hello(self, session: int, client_id: int) -> None:
        if client_id:
            self._client[session] = client_id

    def grant(self, session: int, ino: int, parent: int, name: bytes) -> int:
        """Record a callback for ``session`` on ``ino`` and its name; the grant's seq, or -1: none.
        None on a file another session holds a write mark on (as a listing grants none): the
        reads that recall the writer come before the operation, so the mark may be newer than
        that check (granted earlier in the same burst, or while the read waited its turn); the
        writer's close then sends nothing, and a cache here would answer a later open from before it."""
        if self.written_elsewhere(session, ino):
            return -1
        return self.grant_many(session, [(ino, parent, name)])

    def grant_many(self, session: int, files: list[tuple[int, int, bytes]]) -> int:
        """``grant`` for every (ino, parent, name) of ``files``, or for none of them: the seq or -1."""
        if not self.files or not self._may_hold(session, 2 * len(files)):
            return -1
        held = self._held.setdefault(session, set())
        seq = self.last_seq()
        for ino, parent, name in files:
            for key in (ino, (parent, name)):
                self._holders.setdefault(key, {})[session] = seq
                held.add(key)
        return seq

    def grant_dir(self, session: int, ino: int, as_of: int | None = None) -> int:
        """A callback on every name of directory ``ino``: the seq, or -1. ``as_of``: the position
        the grant is as of, when not ``last_seq()`` now (several daemons: read before the grant's
        transaction, daemon/shared_holds.py)."""
        return self._grant_key(session, ("dir", ino), as_of)

    def may_hold_dir(self, session: int) -> bool:
        """``grant_dir`` would grant now (its row is written before it is: daemon/shared_holds.py)."""
        return self._may_hold(session, 1)

    def grant_write(self, session: int, ino: int) -> int:
        """A write mark on ``ino`` for ``session``, a mount whose closes send nothing (the rules
        above): the seq, or -1 (none: the mount then commits as soon as it stops writing)."""
        if not self.files:
            return -1
        if ("w", ino) not in self._holders and self._may_hold(session, 1):
            self.marks += 1
        return self._grant_key(session, ("w", ino))

    def _may_hold(self, session: int, keys: int) -> bool:
        """``session`` may be granted ``keys`` more keys: not barred, within its bound, and its client id
        known (else its own changes could not be told from others': the rules above)."""
        if not (self.enabled and session) or session not in self._client or self._barred(session):
            return False
        return len(self._held.get(session, ())) + keys <= MAX_PER_SESSION

    def _grant_key(self, session: int, key, as_of: int | None = None) -> int:
        """One key (a directory's names, a write mark) for ``session``: the seq, or -1."""
        if not self._may_hold(session, 1):
            return -1
        seq = self.last_seq() if as_of is None else as_of
        self._holders.setdefault(key, {})[session] = seq
        self._held.setdefault(session, set()).add(key)
        return seq

    def written_elsewhere(self, session: int, ino: int) -> bool:
        """Another live session holds a write mark on ``ino``: a read of it by ``session`` first
        logs a change naming it, which the writer acknowledges once it committed what it wrote."""
        if not self.marks:
            return False
        holders = self._holders.get(("w", ino))
        return bool(holders) and any(sid != session and self.alive(sid) for sid in holders)

    def client_of(self, session: int) -> int:
        """The OnceReq client id ``session`` told at HelloReq (0: not known)."""
        return self._client.get(session, 0)

    def held_elsewhere(self, session: int, ino: int) -> bool:
        """Another live session caches ``ino`` under a callback."""
        return any(sid != session and self.alive(sid) for sid in self._holders.get(ino, ()))

    def recall_needed(self, session: int, parent: int, asynchronous: Callable[[int], bool]) -> bool:
        """A read of directory ``parent`` by ``session`` must first make another session that holds
        its names and creates there asynchronously (``asynchronous``: it has inode numbers
        delegated, daemon/inode_ranges.py) send what it answered and let go: the service logs a
        change naming the directory, which waits for that session as any change does."""
        holders = self._holders.get(("dir", parent))
        return bool(holders) and any(sid != session and asynchronous(sid) and self.alive(sid) for sid in holders)

    def held(self, ino: int) -> bool:
        """Some live session may open ``ino`` without asking (it counts as open)."""
        return any(self.alive(sid) for sid in self._holders.get(ino, ()))

    # ------------------------------------------------------------------ changes

    async def settle(self, seq: int, inodes: Iterable[int], entries: Iterable[tuple[int, bytes]], writer: int = 0,
                     tagged: bool = False) -> list[int]:
        """Wait until the holders of what change ``seq`` touched dropped it (or ``WAIT_S``).

        ``writer``: the client id that made the change (it does not wait for itself); ``tagged``:
        its writer tag instead (a change read from the log: daemon/shared_holds.py).
        Returns the inodes no session holds any more (orphans among them may go)."""
        if not self.enabled:
            return []
        if self._grace_until and trio.current_time() < self._grace_until:
            await trio.sleep_until(self._grace_until)  # a restart: callbacks granted before it are unknown
        entries = [tuple(e) for e in entries]
        keys, waiting, mine = self._holders_of(seq, inodes, entries, writer, tagged)
        freed: list[int] = []
        if waiting:
            self.waits += 1
            self._waiting += 1
            try:
                freed += await self._wait_for(seq, keys, waiting)
            finally:
                self._waiting -= 1
        return freed + self._revoke(keys, seq, mine, files_too=not entries)

    async def _wait_for(self, seq: int, keys: list, waiting: set[int]) -> list[int]:
        """``settle``'s wait for ``waiting`` (the rules above): the inodes penalties freed."""
        freed: list[int] = []
        start = trio.current_time()
        late: set[int] = set()
        while True:
            still = {sid for sid in waiting if self._acked.get(sid, 0) < seq and self.alive(sid) and self._holds(sid, keys, seq)}
            if trio.current_time() - start > LATE_S:  # (a plain socket's peers are trusted: slow, not hostile)
                late |= {sid for sid in waiting - still if self._acked.get(sid, 0) >= seq and self.owner(sid) is not None
                         and self._committing.get(sid, -math.inf) < start}  # (one that said it commits is not late)
            waiting = still
            if not waiting:
                break
            heard = self._heard
            with trio.move_on_at(self._deadline(waiting, start)):
                await heard.wait()
                continue
            for sid in waiting:
                self.timeouts += 1
                freed += self._penalize(sid, f"did not acknowledge change {seq} within {WAIT_S:.0f}s (answered without it)")
            break
        for sid in late:
            self.late += 1
            freed += self._penalize(sid, f"acknowledged change {seq} after more than {LATE_S:.0f}s")
        return freed

    def _holds(self, session: int, keys, seq: int) -> bool:
        """``session`` still holds one of ``keys`` granted before change ``seq``. One it held no
        more was ended by an earlier change it acknowledged, or by a penalty: its mount dropped the
        key at that earlier change's event, so it owes this change no acknowledgement (it sends
        one only for an event that ends a grant it has: client/kernel_cache.py)."""
        return any(self._holders.get(key, {}).get(session, seq) < seq for key in keys)

    def _wake(self) -> None:
        """Every waiting change looks again at who it waits for (an acknowledgement came, or a
        holding ended); nothing to do while none waits (a revoke per unlink of an ``rm -rf``)."""
        if self._waiting:
            self._heard.set()
            self._heard = trio.Event()

    def _deadline(self, waiting: set[int], start: float) -> float:
        """Until when a change that began waiting at ``start`` waits for ``waiting``: ``WAIT_S``, or
        longer while one of them says it is committing what it wrote (``committing``), up to
        ``COMMIT_WAIT_S``."""
        renewed = max((self._committing.get(sid, -math.inf) for sid in waiting), default=-math.inf)
        return max(start + WAIT_S, min(renewed, start + P.COMMIT_WAIT_S))

    def committing(self, session: int) -> None:
        """``session`` is committing what it wrote to a file a change waits for, and acknowledges
        after (a write mark's holder: the rules above): the changes waiting for it wait
        ``COMMITTING_S`` more from now, up to ``COMMIT_WAIT_S``, and its acknowledgement is not
        late. Without it, a commit held up by a dead storage node (its request timeouts) would
        let the reader in before the data, with the writer penalised."""
        if session in self._held:
            self._committing[session] = trio.current_time() + P.COMMITTING_S
            self._wake()

    def settle_now(self, seq: int, inodes: Iterable[int], entries: Iterable[tuple[int, bytes]], writer: int = 0) -> list[int] | None:
        """``settle`` when it has nobody to wait for (the request path without a task,
        daemon/burst.py): the inodes no session holds any more; None when it would wait (a
        holder that has not acknowledged ``seq``, or the grace after a restart): then ``settle``."""
        if not self.enabled:
            return []
        if self._grace_until and trio.current_time() < self._grace_until:
            return None
        entries = [tuple(e) for e in entries]
        keys, waiting, mine = self._holders_of(seq, inodes, entries, writer)
        if waiting:
            return None
        return self._revoke(keys, seq, mine, files_too=not entries)

    def must_wait(self, seq: int, inodes: Iterable[int], entries: Iterable[tuple[int, bytes]], tag: int) -> bool:
        """Change ``seq`` (made by the writer ``tag``) must wait for some session of this daemon."""
        return bool(self._holders_of(seq, inodes, entries, tag, True)[1])

    def _holders_of(self, seq: int, inodes: Iterable[int], entries: Iterable[tuple[int, bytes]], writer: int,
                    tagged: bool = False) -> tuple[list, set[int], set[int]]:
        """The keys change ``seq`` touches, the sessions it waits for, and the writer's own
        sessions (they keep their holdings of names and directories). ``tagged``: ``writer`` is a
        writer tag (``protocol.writer_tag``), not a client id."""
        entries = [tuple(e) for e in entries]
        inodes = list(inodes)
        keys = [*inodes, *(("w", ino) for ino in inodes)] if self.marks else inodes  # (no mark held: no ("w", ino) key)
        keys += entries
        keys += {("dir", parent) for parent, _ in entries}
        waiting: set[int] = set()
        mine: set[int] = set()
        for key in keys:
            for sid, granted in self._holders.get(key, {}).items():
                if writer and (P.writer_tag(self._client.get(sid, 0)) if tagged else self._client.get(sid)) == writer:
                    mine.add(sid)
                elif granted < seq and self.alive(sid):
                    waiting.add(sid)
        return keys, waiting, mine

    # ------------------------------------------------------------------ penalties

    def _offender(self, session: int) -> tuple:
        """Who pays for a session's offence: its key, or the session itself on a plain socket."""
        owner = self.owner(session)
        return ("key", owner) if owner is not None else ("session", session)

    def _barred(self, session: int) -> bool:
        """The session's key (or the session) is serving a penalty: no callback for it."""
        offender = self._offender(session)
        until = self._penalty.get(offender)
        if until is None:
            return False
        if trio.current_time() < until:
            return True
        del self._penalty[offender]
        return False

    def _penalize(self, session: int, why: str) -> list[int]:
        """An offence of ``session``: its key's sessions drop every holding and get no callback
        for a while (the rules above); the inodes nobody holds any more."""
        offender = self._offender(session)
        now = trio.current_time()
        if self._penalty.get(offender, 0.0) <= now:  # one offence, however many changes waited for it
            length = min(MAX_PENALTY_S, 2 * self._last_penalty[offender]) if offender in self._last_penalty else PENALTY_S
            self._last_penalty[offender] = length
            self._penalty[offender] = now + length
            who = f"key {offender[1]}" if offender[0] == "key" else f"session {session}"
            log.warning("session %d %s: %s gets no callbacks for %.0fs, and no change waits for it", session, why, who, length)
        freed: list[int] = []
        for sid in [sid for sid in self._held if self._offender(sid) == offender]:
            freed += self._drop(sid, self._held.get(sid, set()))
        return freed

    def _revoke(self, keys, seq: int, spare: set[int], files_too: bool = False) -> list[int]:
        """Holdings of ``keys`` granted before ``seq`` end, but the names and directories of
        ``spare`` (the writer's), and its files too when ``files_too`` (a change that named no
        entry: a commit or setattr; a file it unlinked or renamed over is not spared, nor by its
        mount); the inodes nobody holds after that."""
        freed = []
        ended = False
        for key in keys:
            holders = self._holders.get(key)
            if not holders:
                continue
            keep = spare if files_too or not isinstance(key, int) else ()
            for sid in [sid for sid, granted in holders.items() if granted < seq and sid not in keep]:
                del holders[sid]
                ended = True
                held = self._held.get(sid)
                if held is not None:
                    held.discard(key)
                self._dir_dropped(key, sid)
            if not holders:
                self._unheld(key, freed)
        if ended:  # a later change waiting for these holders of these keys waits no more (``_holds``)
            self._wake()
        return freed

    def _dir_dropped(self, key, session: int) -> None:
        if self.on_dir_dropped is not None and type(key) is tuple and key[0] == "dir":
            self.on_dir_dropped(key[1], session)

    def _unheld(self, key, freed: list[int]) -> None:
        """Nobody holds ``key`` any more; a file's inode joins ``freed``."""
        del self._holders[key]
        if isinstance(key, int):
            freed.append(key)
        elif key[0] == "w":
            self.marks -= 1

    # ----------------------------------------------------------- acknowledgements

    def ack(self, session: int, seq: int, *, everything: bool = False, client_id: int = 0) -> list[int]:
        """``session`` applied the feed up to ``seq``; the inodes nobody holds any more."""
        if client_id:
            self._client[session] = client_id
        if everything:  # it dropped all it cached: nothing of it is worth waiting for
            seq = max(seq, self.last_seq())
        if seq > self._acked.get(session, 0):
            self._acked[session] = seq
        freed = self._drop(session, self._held.get(session, set())) if everything else []
        self._wake()
        return freed

    def forget_dead(self) -> list[int]:
        """Holdings of sessions that closed or expired go; the inodes nobody holds any more."""
        freed = []
        for sid in [sid for sid in self._held if not self.alive(sid)]:
            freed += self.forget_session(sid)
        return freed

    def forget_session(self, session: int) -> list[int]:
        """The session closed or expired: everything it held goes."""
        freed = self._drop(session, self._held.get(session, set()))
        self._held.pop(session, None)
        self._acked.pop(session, None)
        self._committing.pop(session, None)
        self._client.pop(session, None)
        self._penalty.pop(("session", session), None)  # a key's penalty outlives its sessions
        self._last_penalty.pop(("session", session), None)
        self._wake()
        return freed

    def _drop(self, session: int, keys) -> list[int]:
        freed = []
        for key in list(keys):
            holders = self._holders.get(key)
            if holders is not None:
                if holders.pop(session, None) is not None:
                    self._dir_dropped(key, session)
                if not holders:
                    self._unheld(key, freed)
        if self._held.get(session):
            self._held[session] = set()
            self._wake()  # (a penalty's drop: the changes waiting for this session wait no more)
        return freed

    def counts(self) -> dict[str, int]:
        return {"sessions": sum(1 for keys in self._held.values() if keys), "keys": len(self._holders),
                "marks": self.marks, "waits": self.waits, "timeouts": self.timeouts, "late": self.late}
