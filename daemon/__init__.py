"""The metadata daemon (``stripefs meta``): one process that owns the namespace.

Start reading at ``service.py`` (request dispatch, group commit, background
tasks). The pieces, from the bottom up:

* ``db.py``: the SQLite schema (its docstring is the spec) and migrations.
* ``store.py``: every SQL statement, behind ``SqliteStore``.
* ``namespace.py``: POSIX semantics over the store; plain synchronous Python.
* ``placement.py``: which storage nodes hold each chunk (pure functions).
* ``health.py``: storage nodes up/down, client sessions and their open files.
* ``cli.py``: ``main(argv)``, config, logging, signals, systemd readiness.

Nothing here imports the storage node or the client: they are reached only
over the wire (common/protocol.py).
"""
