"""common/malloc_tuning.py: a storage node's batch of chunk replies reuses the last batch's memory.

A process allocates 16 blocks of ~110 KiB on a thread (a ReadChunksReq's reads on a node's worker
thread), frees them, and again, 40 times; its page faults are counted (getrusage). At glibc's
defaults each free hands the memory back and each batch faults its pages in again (~27 a block);
with ``keep_freed_memory`` the batches after the first fault almost nothing.
"""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import resource, sys, threading
from stripefs.common.malloc_tuning import keep_freed_memory
if sys.argv[1] == "kept":
    assert keep_freed_memory()
out = {}
def batches():
    held = [b"x" * 110_000 for _ in range(16)]  # the first batch: the heap grows once
    del held
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(40):
        held = [b"x" * 110_000 for _ in range(16)]
        del held
    out["faults"] = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
t = threading.Thread(target=batches)
t.start()
t.join()
print(out["faults"])
"""


def _faults(mode: str) -> int:
    return int(subprocess.run([sys.executable, "-c", SCRIPT, mode], check=True, capture_output=True, text=True).stdout)


def test_freed_batches_are_reused_not_faulted_in_again():
    default, kept = _faults("default"), _faults("kept")
    # 640 blocks of 27 pages: at the defaults most are fresh pages; kept, (almost) none are
    assert default > 640 * 10, default
    assert kept < 640, (kept, default)
