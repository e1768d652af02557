"""Python's cyclic garbage collector, tuned for a long-running stripefs process.

A daemon or a mount allocates a few objects per request and frees almost all of
them by reference counting (cycles are rare), while the collector, at its
defaults, runs a young collection every 700 allocations and a full one as soon
as the objects that survived grow by a quarter. Both processes keep state that
grows with the files they serve (the daemon's caches, the mount's per-file
state of every file it created), so the full collections walk more each time.
Measured with py-spy (issue 30): 15% of the daemon's CPU in a run of batched
creates; 15% of the mount's busy samples in 20,000 creates through the default
mount (``gc_collect_main`` on the FUSE reader thread and on the trio thread
alike), the reader waiting for it with a kernel request in hand.

So, once a process has started (its modules, configuration and services made),
what exists is frozen out of every later collection (``gc.freeze``), and the
youngest generation is collected every 20,000 allocations, not 700.
"""

from __future__ import annotations

import gc

#: (youngest, middle, oldest) thresholds: see the module docstring
THRESHOLDS = (20_000, 20, 20)


def tune_gc() -> None:
    """Freeze what the start made and collect less often (call once the process is up)."""
    gc.freeze()
    gc.set_threshold(*THRESHOLDS)
