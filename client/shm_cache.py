"""Prefetched files in shared memory: the path around the kernel's per-file cost.

Even from the page cache, every open+read+close through FUSE costs the kernel
a round of FUSE requests (on these machines ~4,500 files/s at best, against
~18,000 from tmpfs). For sampler-order prefetch (stripefs.torch) the mount
also writes each prefetched file into a shared-memory directory, and the
DataLoader workers read it from there (``stripefs.torch.read_file``) instead of
through the mount: the model is 3FS's USRBIO, with plain files on tmpfs as
the shared buffer.

Naming and correctness: ``DIR/INO-MTIME_NS-SIZE``. A worker stats the path
through the mount first (answered by the kernel in dataset mode) and looks
for the name made of what it got: a file changed elsewhere has new attributes
(the change feed makes the kernel drop the old ones), so an old copy is never
found; it ages out. Copies take the original file's owner and mode, so no one
reads through the shared copy what the original would refuse them. A worker
deletes a copy once it has read it (each sample is read once per epoch), which
frees the memory at once; copies never read are deleted oldest first once
``budget`` bytes are in use, and the whole directory when the mount ends (or,
after a ``kill -9``, when the next mount on this machine starts).
"""

from __future__ import annotations

import logging
import os
import shutil
from collections import OrderedDict
from pathlib import Path

from ..common import protocol as p

log = logging.getLogger(__name__)


def copy_name(ino: int, mtime_ns: int, size: int) -> str:
    return f"{ino}-{mtime_ns}-{size}"


class ShmCache:
    def __init__(self, directory: str | Path, budget: int):
        self.dir = Path(directory)
        self.budget = budget
        self.used = 0
        self._copies: OrderedDict[str, int] = OrderedDict()  # name -> size, oldest first

    def open(self) -> None:
        self._sweep_dead_mounts()
        self.dir.mkdir(mode=0o755, parents=True, exist_ok=True)
        os.chmod(self.dir, 0o1777)  # workers of any user may delete the copies they own (sticky, as /tmp)

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)

    def _sweep_dead_mounts(self) -> None:
        """Remove what mounts killed without a chance to clean up left (``stripefs-PID`` of dead PIDs)."""
        for other in self.dir.parent.glob("stripefs-*"):
            pid = other.name.removeprefix("stripefs-")
            if not pid.isdigit() or other == self.dir:
                continue
            try:
                os.kill(int(pid), 0)
            except ProcessLookupError:
                log.info("removing %s, left by a mount that is gone", other)
                shutil.rmtree(other, ignore_errors=True)
            except PermissionError:
                pass  # alive, another user's

    def put(self, info: p.OpenRsp, data: bytes | memoryview) -> bool:
        """Write one prefetched file (in a worker thread); False when there is no room."""
        size = len(data)
        if size > self.budget:
            return False
        if self.used + size > self.budget:
            self._reclaim(size)
            if self.used + size > self.budget:
                return False
        attr = info.attr
        name = copy_name(attr.ino, attr.mtime_ns, attr.size)
        if name in self._copies:
            return True
        tmp = self.dir / f".{name}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
                os.fchown(fd, attr.uid, attr.gid)
                os.fchmod(fd, attr.mode & 0o777)
            finally:
                os.close(fd)
            os.rename(tmp, self.dir / name)
        except OSError as exc:
            log.warning("shared-memory prefetch: cannot write %s: %s", name, exc)
            try:
                os.unlink(tmp)
            except OSError:
                pass
            return False
        self._copies[name] = size
        self.used += size
        return True

    def _reclaim(self, wanted: int) -> None:
        """Forget copies the workers consumed; then delete the oldest until ``wanted`` fits."""
        present = set(os.listdir(self.dir)) if self.dir.exists() else set()
        for name in [n for n in self._copies if n not in present]:
            self.used -= self._copies.pop(name)
        while self._copies and self.used + wanted > self.budget:
            name, size = self._copies.popitem(last=False)
            self.used -= size
            try:
                os.unlink(self.dir / name)
            except FileNotFoundError:
                pass
