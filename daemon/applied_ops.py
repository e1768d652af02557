"""Idempotent retries: a mutating request is applied at most once, however often it is sent.

A client times a request out and resends it, to the same metadata daemon or,
after a failover, to another (client/meta_rpc.py). When the first attempt was
applied and only its reply was lost, applying the retry would create a second
file, rename twice, unlink whatever took the name meanwhile. So clients wrap
every mutating request (``protocol.ONCE_MESSAGES``) in ``OnceReq(client_id,
op_id, done_below, body)`` and resend the very same OnceReq on a retry.

The daemon runs ``body``'s handler with the key ``(client_id, op_id)`` in
effect (``once``, a context variable). The one namespace operation the handler
makes (``Txn.write``, daemon/txn.py) is then, in the same transaction as the change:

* ``applied_ops`` has a row for the key: the operation is *not* run; the
  result it returned the first time is returned instead (the handler builds the
  same reply from it). If the row is not durable yet (the first attempt is
  still waiting for its group commit) the retry waits for that commit too.
* no row: the operation runs, and its result is recorded under the key in
  the same savepoint or transaction. An operation that fails records nothing
  (it changed nothing, so running the retry is running it for the first time).

What is recorded is the operation's return value (``Attr``, chunk maps, ...),
pickled: the reply is rebuilt from it by unchanged handler code, and only
this daemon code ever reads it back. Side effects outside the database that a
handler performs after the operation (publishing nothing: the change feed
reads the database; waking the garbage collector) are harmless to repeat; the
session's in-memory open set is rebuilt by the client's next heartbeat.

Several daemons: two attempts of one op on two daemons at once both miss the
row; the second to commit fails on the primary key (or a serialization
failure) and, retried as a whole, finds the row. That rests on the store
retrying transactions on conflicts, which the PostgreSQL store does.

Whose retry it is: a stored result answers only the key that made it. The
daemon never uses a client id as sent: ``bind`` hashes it with the sending
key's public key (BLAKE2b), and that *bound* id names the rows here, the
callbacks' writer (daemon/callbacks.py) and, hashed once more, the change
feed's writer tag (``protocol.writer_tag``). Another key sending the same
client id gets another bound id, so it can neither read a victim's stored
replies (and the capabilities signed with them) nor plant a reply the
victim's next request would be answered with (docs/security.md). Without
CURVE every peer is trusted and the id is used as sent.

Bounds: a client's op ids below its ``done_below`` are never retried, so the
daemon deletes them (every ``TRIM_EVERY`` ops of that client, in the op's
transaction: one indexed range delete); rows older than ``RETENTION_S`` (a
client that died, say) are deleted by the duties leader (daemon/duties.py).
``RETENTION_S`` must exceed the clients' retry window (``retry_window_s``,
120 s by default): a row must outlive every retry of its op.
"""

from __future__ import annotations

import contextvars
import hashlib
import logging
import pickle
import time
from dataclasses import dataclass

log = logging.getLogger(__name__)

RETENTION_S = 600.0
TRIM_EVERY = 32


@dataclass
class OnceKey:
    client_id: int
    op_id: int
    done_below: int
    used: bool = False  # set by the caller once the request's one operation is over: a second write is not deduplicated


#: the OnceReq being handled in this task, if any
once: contextvars.ContextVar[OnceKey | None] = contextvars.ContextVar("once", default=None)

_MISSING = object()


def bind(client_id: int, key: str | None) -> int:
    """The id the daemon knows the client sending ``client_id`` with public key ``key`` by
    (None: no CURVE, the id as sent). One-way and different for every key, so no other key
    can name this client's stored results or its callbacks (module docstring)."""
    if key is None or not client_id:
        return client_id
    digest = hashlib.blake2b(key.encode() + client_id.to_bytes(8, "little"), digest_size=8, person=b"stripefs-client").digest()
    return int.from_bytes(digest, "little") & 0x7FFF_FFFF_FFFF_FFFF or 1


def applied_result(store, key: OnceKey):
    """What the operation returned when it was applied, or ``MISSING``."""
    blob = store.get_applied(key.client_id, key.op_id)
    if blob is None:
        return _MISSING
    log.info("client %x op %d was applied already: answering what it answered then", key.client_id, key.op_id)
    return pickle.loads(blob)


def record(store, key: OnceKey, result) -> None:
    """Record ``result`` under ``key`` (call inside the operation's transaction, after it succeeded)."""
    store.put_applied(key.client_id, key.op_id, time.time_ns(), pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL))
    if key.op_id % TRIM_EVERY == 0:
        store.forget_applied(key.client_id, key.done_below)


def recorded(store, client_id: int, op_ids: list[int]) -> dict[int, object]:
    """``applied_result`` of many ops of one client at once: op_id -> result, for those applied."""
    found = {op_id: pickle.loads(blob) for op_id, blob in store.applied_in(client_id, op_ids).items()} if op_ids else {}
    if found:
        log.info("client %x ops %s were applied already: answering what they answered then", client_id, sorted(found))
    return found


def record_many(store, done: list[tuple[OnceKey, object]]) -> None:
    """``record`` of many (key, result) pairs in one statement (inside their transaction)."""
    now = time.time_ns()
    store.put_applied_many((key.client_id, key.op_id, now, pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL))
                           for key, result in done)
    for key in {key.client_id: key for key, _ in done if key.op_id % TRIM_EVERY == 0}.values():
        store.forget_applied(key.client_id, key.done_below)


def run_once(store, fn, *args, **kwargs) -> tuple[object, bool]:
    """Run ``fn`` at most once for the OnceReq in effect: (result, whether it ran now).

    Call inside the transaction (or savepoint) that ``fn``'s statements are in;
    a transaction retried after a conflict calls it again (it checks again).
    The caller sets ``once.get().used`` when the operation is over. Without a OnceReq in effect this is just ``fn(*args, **kwargs)``.
    """
    key = once.get()
    if key is None or key.used:
        return fn(*args, **kwargs), True
    result = applied_result(store, key)
    if result is not _MISSING:
        return result, False
    result = fn(*args, **kwargs)
    record(store, key, result)
    return result, True


def expire(store, now_ns: int | None = None) -> int:
    """Forget applied ops older than RETENTION_S (a duty of the leader)."""
    now_ns = time.time_ns() if now_ns is None else now_ns
    return store.expire_applied(now_ns - int(RETENTION_S * 1e9))
