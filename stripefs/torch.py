"""Sampler-order prefetch for PyTorch DataLoaders reading from a stripefs mount.

A training job knows the exact order it will read files in this epoch: the
sampler's. ``PrefetchSampler`` wraps any sampler and, as the DataLoader draws
indices, tells the mount which files come next; the mount fetches them ahead
of the workers (all of them at once: the mount is shared) and pushes them into
the kernel's page cache, so the workers' open+read is answered by the kernel.

    from torch.utils.data import DataLoader, RandomSampler
    from stripefs.torch import PrefetchSampler

    sampler = PrefetchSampler(RandomSampler(dataset), paths=dataset.paths, lookahead=1024)
    loader = DataLoader(dataset, batch_size=32, sampler=sampler, num_workers=2)

    # in the dataset's __getitem__, instead of open(path, "rb").read():
    data = stripefs.torch.read_file(path)

``read_file`` reads the file through the mount, unbuffered (no isatty ioctl),
where the prefetcher's pages answer it: on a dataset mount with no request at
all, on the default mount with one (the close's FLUSH). That is the fastest
read measured for a prefetched file (docs/design.md, "stripefs.torch: which
read"). The mount can also leave each prefetched file in a shared-memory
directory (``PrefetchSampler(..., shm=True)``, client/shm_cache.py), read with
``read_file(path, shm=True)``: one getxattr through the mount a sample instead
of the open, read and close. It measured slower than the page cache on the
default mount (a GETXATTR costs the mount as much as a FLUSH, and the copy and
its checksum come on top) and a dataset mount keeps no copies; it is kept for
files whose pages cannot be pushed (the kernel does not know the inode yet).
Either way is correct.

Is the GPU waiting for data? ``watch`` wraps the loader and measures, per step,
the loop's wait for its next batch (on the GPU, with CUDA events, when CUDA
is in use) and reports it to the mount, where ``stripefs top`` shows it per
job beside what the mount did for that job (stripefs/data_wait.py):

    for images, labels in stripefs.torch.watch(loader):
        ...

``paths[i]`` is the file sample ``i`` reads. Nothing here imports torch: any
object with ``__iter__`` and ``__len__`` is a sampler to a DataLoader. Paths
outside a stripefs mount are simply not announced. The mount is told through
an extended attribute of its root (stripefs/prefetch_control.py), which needs
write permission on the mount's root directory.
"""

from __future__ import annotations

import logging
import os
import stat
from typing import Iterable, Iterator, Sequence

import xxhash

from .data_wait import DataWait, watch
from .prefetch_control import SHM_COPY_XATTR, MountRoots, announce, group_by_mount, shm_dir

__all__ = ["PrefetchSampler", "read_file", "watch", "DataWait"]

log = logging.getLogger(__name__)


class PrefetchSampler:
    def __init__(
        self,
        sampler: Iterable[int],
        paths: Sequence[str | os.PathLike],
        *,
        lookahead: int = 1024,
        batch: int = 128,
        shm: bool = False,
    ):
        """Wrap ``sampler``; announce ``paths`` of the next ``lookahead`` samples, ``batch`` at a time.

        ``shm``: have the mount also leave them in shared memory for ``read_file(path, shm=True)``
        (instead of pushing them into the page cache only: the module docstring says when).
        """
        self.sampler = sampler
        self.shm = shm
        self.paths = paths
        self.lookahead = lookahead
        self.batch = max(1, batch)
        self._roots = MountRoots()
        self._disabled = False

    def __len__(self) -> int:
        return len(self.sampler)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[int]:
        order = list(self.sampler)  # this epoch's order, decided up front as the sampler would
        announced = 0
        for i, index in enumerate(order):
            if announced < min(len(order), i + self.lookahead):
                upto = min(len(order), max(i + self.lookahead, announced + self.batch))
                self.announce(order[announced:upto])
                announced = upto
            yield index

    def announce(self, indices: Sequence[int]) -> None:
        """Tell the mount(s) these samples come next, in this order, ``batch`` at a time: the
        mount starts fetching the first ones while the later ones are still being named."""
        for start in range(0, len(indices), self.batch):
            if self._disabled:
                return
            chunk = indices[start:start + self.batch]
            for root, relative in group_by_mount((self.paths[i] for i in chunk), self._roots).items():
                try:
                    announce(root, relative, shm=self.shm)
                except OSError as exc:
                    self._disabled = True
                    log.warning("stripefs prefetch disabled: cannot tell the mount at %s (%s)", os.fsdecode(root),
                                exc.strerror)


_shm_dirs: dict[bytes, bytes | None] = {}  # mount root -> its shared-memory directory
_roots = MountRoots()


def read_file(path: str | os.PathLike, *, shm: bool = False) -> bytes:
    """The bytes of ``path``, read through the mount (the prefetcher's pages in the kernel answer it).

    ``shm``: first look for the mount's shared-memory copy (announced with ``shm=True``). The
    mount names the copy only to a caller the kernel lets read ``path``
    (``getxattr`` of ``user.stripefs.shm_copy``, client/shm_cache.py), and only
    a copy of the file's current version (close-to-open on the default mount:
    the getxattr's own lookup asked the daemon), with its checksum and the
    original's owner, group and mode: a copy of another owner or mode, or
    whose bytes do not match, is never returned; the file is then read
    through the mount.
    """
    root = _roots.of(os.path.dirname(os.fsencode(os.path.abspath(path)))) if shm else None
    if root is not None:
        directory = _shm_dirs.get(root, b"?")
        if directory == b"?":
            directory = _shm_dirs[root] = shm_dir(root)
        if directory:
            data = _from_shm(path, directory)
            if data is not None:
                return data
    # unbuffered: a buffered open() asks isatty(), an ioctl every FUSE open sends to the mount
    # for nothing (bench/README.md, "The FUSE wall")
    with open(path, "rb", buffering=0) as f:
        return f.readall()


def _from_shm(path, directory: bytes) -> bytes | None:
    try:
        name, size, _mtime_ns, digest, uid, gid, mode = os.getxattr(path, SHM_COPY_XATTR).split()
        size, owner, digest = int(size), (int(uid), int(gid), int(mode, 8)), int(digest, 16)
    except (OSError, ValueError):
        return None  # no copy (ENODATA), or not ours to read: the mount decides, as for the file
    if not name.isalnum():
        return None
    try:
        fd = os.open(os.path.join(directory, name), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None  # deleted meanwhile
    try:
        cs = os.fstat(fd)
        if not stat.S_ISREG(cs.st_mode) or cs.st_size != size or (cs.st_uid, cs.st_gid, stat.S_IMODE(cs.st_mode)) != owner:
            return None
        data = os.read(fd, size + 1)
        while len(data) < size:
            more = os.read(fd, size + 1 - len(data))
            if not more:
                break
            data += more
    except OSError:
        return None
    finally:
        os.close(fd)
    if len(data) != size or xxhash.xxh3_64_intdigest(data) != digest:
        return None
    return data
