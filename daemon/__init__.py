"""The metadata daemon (``stripefs meta``): one process that owns the namespace.

Start reading at ``service.py`` (request dispatch; its background tasks are
in ``housekeeping.py``). The pieces, from the bottom up:

* storage: ``db.py`` (the schema, its docstring is the spec, and migrations),
  ``dialect.py`` (where SQLite and PostgreSQL differ), ``store.py`` (every SQL
  statement, behind ``SqliteStore``), ``pg_store.py`` (the same on PostgreSQL,
  one transaction per request), ``backup.py`` (``stripefs meta backup|restore``).
* the namespace: ``namespace.py`` (POSIX semantics over the store; plain
  synchronous Python), ``file_data.py`` (its other half: a file's chunk map,
  epochs, placement, commits, conversions), ``applied_ops.py`` (a retried request applied once),
  ``change_log.py`` (every change, in commit order), ``quota.py`` (directory
  quotas: what counts, how limits are enforced).
* where data lives: ``placement.py`` (which nodes hold each chunk; pure
  functions), ``redundancy.py`` (erasure coding: missing fragments, shadows),
  ``repair_plan.py`` (which copies to make, fewest first; pure), ``repair.py``
  (the healer executing those plans, bad copies), ``repair_admin.py`` (node
  drain/remove, scrub and fsck requests), ``tiering.py`` + ``tier_store.py`` (the cold tier
  on S3: migrate, recall, policies, object collection; docs/tiering.md).
* who is alive: ``health.py`` (storage nodes up/down, client sessions, their
  open files and the fences of expired ones), ``open_holds.py`` (open files across several daemons),
  ``duties.py`` (the lease that picks the daemon running cluster-wide duties),
  ``callbacks.py`` (what mounts may cache in the kernel, and the changes that
  wait until they dropped it).
* transactions: ``txn.py`` (the lock, savepoints, group commit on SQLite, a
  transaction per request on PostgreSQL; what every piece below gets instead
  of the service).
* serving: ``service.py`` (dispatch, start and stop), ``housekeeping.py``
  (health sweep, garbage collector, change feed poll, trims),
  ``access.py`` (who may send what), ``quota_service.py`` (the quota requests),
  ``events.py`` (the change feed to mounts), ``metrics.py`` (cluster gauges).
* ``cli.py``: ``main(argv)``, config, logging, signals, systemd readiness.

Nothing here imports the storage node or the client: they are reached only
over the wire (common/protocol.py).
"""
