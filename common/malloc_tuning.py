"""glibc's malloc, tuned so a storage node keeps the memory of its last replies for the next ones.

A node answers a prefetcher's ``ReadChunksReq`` with 16 chunks of ~110 KiB at once: 1.7 MiB read
into fresh ``bytes`` on a worker thread, held until libzmq's I/O thread has sent them, then freed.
At glibc's defaults (``M_TRIM_THRESHOLD`` 128 KiB, as long as nothing above ``M_MMAP_THRESHOLD``
was ever freed) every such free that leaves more than 128 KiB free at the top of a heap hands it
back to the kernel (``brk``, or ``madvise(MADV_DONTNEED)`` in a thread's arena), so the next
batch's reads land in fresh pages again: a page fault and the kernel zeroing each 4 KiB. Measured
(bench/dataloader.py --quick --only prefetch, 1,000 files of ~110 KiB, issue 29): 32-33 page
faults per sample over the nodes in a cold stripefs.torch epoch, 11-15 with the thresholds below
set for every process (``GLIBC_TUNABLES``), against 0.8 for the raw cold epoch (one chunk a
request: its memory is reused).

So a node sets the thresholds where glibc's own rule takes them once a block of 32 MiB has been
freed (``M_MMAP_THRESHOLD`` 32 MiB, its ceiling, and ``M_TRIM_THRESHOLD`` twice that) from the
start: blocks up to ``MMAP_BYTES`` (a chunk of the default 4 MiB, a batch's frames) come from its
heaps rather than a fresh ``mmap`` each, and up to ``TRIM_BYTES`` free at the top of a heap stay for
the next request. What this costs: up to ``TRIM_BYTES`` of memory a heap (an arena: one per thread
that allocated, at most 8 per core) stays with the process after a burst.
The mount is left at the defaults: its faults in the same epoch (7-9 per sample) are its heap
growing once to the prefetch's working set, which these thresholds do not change.
"""

from __future__ import annotations

import ctypes
import logging

log = logging.getLogger(__name__)

#: blocks up to this size come from a heap, not a fresh mmap each (glibc's default: 128 KiB, raised by
#: glibc itself up to 32 MiB, this value, as larger blocks are freed: a 4 MiB chunk's read then no longer
#: waits for that)
MMAP_BYTES = 32 << 20
#: free memory kept at the top of a heap (glibc's default: 128 KiB, raised with the other to twice it)
TRIM_BYTES = 2 * MMAP_BYTES

# mallopt's parameters (glibc's malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3


def keep_freed_memory(trim_bytes: int = TRIM_BYTES, mmap_bytes: int = MMAP_BYTES) -> bool:
    """Set the thresholds (see the module docstring); False where the C library has no ``mallopt``
    (not glibc) or refused them: the process then runs at its defaults, as before."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    ok = bool(mallopt(M_MMAP_THRESHOLD, mmap_bytes)) and bool(mallopt(M_TRIM_THRESHOLD, trim_bytes))
    if not ok:
        log.info("mallopt refused the trim and mmap thresholds: the C library's defaults stay")
    return ok
