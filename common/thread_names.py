"""The OS name of a plain Python thread (``/proc/PID/task/TID/comm``), so that per-thread figures
(bench/dataloader.py's CPU by thread, ``top -H``, py-spy, perf) can tell the threads apart.

Python before 3.14 leaves every thread it starts with the process's name; trio names its worker
threads ("Trio thread N") and libzmq its own ("ZMQbg/IO/0"). A thread calls :func:`name_os_thread`
first thing with its ``threading`` name; the kernel keeps 15 bytes of it. Best effort: on a
platform without ``pthread_setname_np`` nothing happens.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading

_setname = None
try:
    _libpthread = ctypes.CDLL(ctypes.util.find_library("pthread") or "libc.so.6")
    _setname = _libpthread.pthread_setname_np
    _setname.argtypes = [ctypes.c_ulong, ctypes.c_char_p]
    _setname.restype = ctypes.c_int
    _self = _libpthread.pthread_self
    _self.restype = ctypes.c_ulong
except (OSError, AttributeError):  # not glibc: no names, nothing else changes
    _setname = None


def name_os_thread(name: str | None = None) -> None:
    """Give the calling thread the OS name ``name`` (default: its ``threading`` name), cut to 15 bytes."""
    if _setname is None:
        return
    name = threading.current_thread().name if name is None else name
    _setname(_self(), name.encode("ascii", "replace")[:15])
