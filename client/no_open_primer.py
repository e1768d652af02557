"""Sets the kernel's no-open early, so that files created on a fresh mount send no RELEASE.

Why: the default mount declines OPEN (ENOSYS, NO_OPEN_SUPPORT: docs/design.md, "No OPEN on
the read-write mount"), and once it has, the kernel (fs/fuse/file.c ``fuse_file_put``) sends
no RELEASE for any file of the connection, a created one included. But the kernel learns
no-open only from an OPEN answered ENOSYS, and a CREATE is no OPEN: a mount that only creates
(``cp -r`` onto a fresh mount, the create rows of bench/meta.py) never declined one, and every
created file's close costs a RELEASE the mount has nothing to do for (measured on 6.18: LOOKUP,
CREATE, FLUSH, RELEASE and the directory's GETATTR per empty file; after one declined OPEN the
same loop sends no RELEASE).

So at the first CREATE answered while no OPEN was declined yet, a thread of the mount opens that
new file read-only through the mountpoint and closes it: the kernel sends the OPEN, the
bridge declines it, and from then on no file of the connection sends RELEASE. The close's
FLUSH comes from the primer's thread (``own_flush``): it is answered with nothing done, since
the primer wrote nothing and must not commit, or queue, a file another process is still
writing. The kernel names a request's sender by its thread (``in.h.pid`` is
``task_pid(current)`` in fs/fuse/dev.c, a thread's own id), so the primer's FLUSH carries the
primer thread's id, not the mount's pid: compared with the process's pid, it was taken for a
writer's close and committed the file under a writer still writing (a clean-clone CI run's
test_secure_cluster: a 300,000-byte file's commit lacked the chunk of its last byte). A failed
try (the file renamed or unlinked before the thread got to it, a mode root may not read
through) is tried again at a later create, ``TRIES`` times at most; the mount then just keeps
receiving RELEASEs, as before. Only the real mount has a mountpoint to open
through: the in-process tests' FS never primes.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)

TRIES = 8  # creates that may start a try; each failed one is logged at DEBUG


class NoOpenPrimer:
    def __init__(self, mountpoint: str, path_of: Callable[[int], bytes | None]):
        self._mountpoint = os.fsencode(mountpoint)
        self._path_of = path_of  # an inode the kernel knows -> its path under the mountpoint
        self._tid = 0  # the primer thread's id while it opens and closes (the kernel's in.h.pid)
        self.declined = False  # an OPEN was declined: the kernel has no-open for good
        self.tries = 0
        self._busy = False

    def created(self, ino: int) -> None:
        """A CREATE of ``ino`` was answered (on the reader thread or a task: cheap, never blocks)."""
        if self.declined or self._busy or self.tries >= TRIES:
            return
        self._busy = True
        self.tries += 1
        threading.Thread(target=self._open_once, args=(ino,), name="no-open-primer", daemon=True).start()

    def open_declined(self) -> None:
        self.declined = True

    def own_flush(self, pid: int) -> bool:
        """Whether a FLUSH (its header's pid: the closing thread's id) is the primer's own close (the
        mount never opens its own files otherwise): answered with nothing to do."""
        return pid != 0 and pid == self._tid

    def _open_once(self, ino: int) -> None:
        self._tid = threading.get_native_id()
        try:
            rel = self._path_of(ino)
            if rel is None:
                log.debug("no-open primer: inode %d has no known path", ino)
                return
            fd = os.open(os.path.join(self._mountpoint, rel),
                         os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_NOCTTY | os.O_CLOEXEC)
            os.close(fd)
            if self.declined:
                log.debug("no-open primer: the kernel sends no RELEASE from now on")
        except OSError as exc:
            log.debug("no-open primer: opening inode %d failed: %s", ino, exc)
        finally:
            self._tid = 0  # closed: its FLUSH was answered (close(2) waits for it)
            self._busy = False
