"""The storage node role: one process per disk keeping chunk files on that disk.

``chunk_store.ChunkStore`` is the core (plain synchronous Python, no network):
checksummed chunk files, replaced atomically, with space accounting; the
on-disk format it keeps (where a chunk file lives, what it holds) is
``chunk_file.py``, whose docstring is its spec. ``service.StorageService`` answers the
storage messages of common/protocol.py on a ROUTER socket, running disk work in
worker threads, and heartbeats the metadata daemon. ``cli.main`` is
``stripefs storage --config storage.toml``. Clients read and write chunks here
directly; the metadata daemon only decides which node holds which chunk.

Beside them: ``access.py`` (who may send what), ``healing.py`` (peer copies,
scrub, inventory and bad-copy reports: the node's side of self-healing),
``direct_io.py`` (whole chunk files written with O_DIRECT) and ``metrics.py``
(the node's disk gauges).
"""
