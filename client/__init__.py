"""The FUSE client (``stripefs mount``): one process per mount, its own FUSE session beside trio.

Start reading at ``mount.py`` (the process: config, signals, the root nursery),
``fuse/`` (the kernel's protocol: the session, its reader thread) and
``operations.py`` (the ``Operations``: thin handlers that delegate, fed by
``operations_bridge.py``). The pieces:

* building a client: ``connect.py`` wires the metadata session, the node pool
  and the data path from a ClientConfig (the mount and ``convert.py`` use it).
* talking to the cluster: ``meta_rpc.py`` (the metadata daemon: session,
  failover, retries), ``data_rpc.py`` (storage nodes, straight), ``caps.py``
  (a subtree key's capabilities), ``subtree.py`` (a mount of one directory).
* the data path: ``striping.py`` (byte ranges <-> replicated chunks, write
  sessions, commits), ``ec_path.py`` (erasure-coded stripes <-> fragments),
  ``placements.py`` (epochs and chunk placements of a write session),
  ``open_files.py`` (what the mount knows of an open file).
* caches and fetching ahead: ``fetch.py`` (one chunk wanted ahead of a read:
  every fetch goes through ``DataPath.fetch``), ``chunk_cache.py`` (memory), ``disk_cache.py``
  (local disk), ``readahead.py`` (per handle), ``dir_hints.py`` (small files of
  a directory being walked), ``prefetch.py`` (sampler order),
  ``shm_cache.py`` (prefetched files in shared memory).
* the kernel's caches: ``kernel_cache.py`` (invalidation from the change feed),
  ``dir_attrs.py`` (directory attributes answered without a round trip).
* ``metrics.py`` (what ``stripefs top`` shows), ``convert.py``
  (``stripefs layout convert``).

Nothing here imports the daemon or the storage node: they are reached only over
the wire (common/protocol.py).
"""
