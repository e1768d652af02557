"""A tiny in-memory file system on the mount's own FUSE session (stripefs.client.fuse), for tests.

One flat directory of read-only files, everything answered on the reader thread (fast paths
only). With ``noopen`` (the default) OPEN, OPENDIR and FLUSH answer ENOSYS, so the kernel stops
sending them: a warm file is then read with no request at all.

    python tests/fuse_memfs.py [--via=fusermount3] MOUNTPOINT [NAME=TEXT ...]

mounts, prints "ready" once INIT is answered, serves until SIGTERM/SIGINT (then unmounts) or
until unmounted.
"""

from __future__ import annotations

import errno
import signal
import stat
import sys
import threading
import time

from stripefs.client.fuse import abi
from stripefs.client.fuse.dispatch import Opened
from stripefs.client.fuse.mount import mount, unmount
from stripefs.client.fuse.device import Device
from stripefs.client.fuse.dispatch import Dispatcher
from stripefs.client.fuse.replies import Attr, Entry, Statfs
from stripefs.client.fuse.session import Session

TIMEOUT = 3600.0


class MemFS:
    def __init__(self, files: dict[bytes, bytes], noopen: bool = True):
        now = time.time_ns()
        self.noopen = noopen
        self.attrs = {abi.ROOT_ID: Attr(abi.ROOT_ID, stat.S_IFDIR | 0o755, nlink=2, atime_ns=now, mtime_ns=now,
                                        ctime_ns=now)}
        self.names: dict[bytes, int] = {}
        self.data: dict[int, bytes] = {}
        self.forgotten: list[tuple[int, int]] = []
        for ino, (name, data) in enumerate(sorted(files.items()), start=2):
            self.names[name], self.data[ino] = ino, data
            self.attrs[ino] = Attr(ino, stat.S_IFREG | 0o644, size=len(data), blocks=(len(data) + 511) // 512,
                                   atime_ns=now, mtime_ns=now, ctime_ns=now)

    def fast_lookup(self, req):
        ino = self.names.get(req.name) if req.header.nodeid == abi.ROOT_ID else None
        if ino is None:
            raise FileNotFoundError(errno.ENOENT, "no such file")
        return Entry(ino, self.attrs[ino], TIMEOUT, TIMEOUT)

    def fast_getattr(self, req):
        return self.attrs[req.header.nodeid], TIMEOUT

    def fast_open(self, req):
        if self.noopen:
            raise OSError(errno.ENOSYS, "no-open")
        return Opened(0, abi.OpenFlag.KEEP_CACHE)

    def fast_opendir(self, req):
        if self.noopen:
            raise OSError(errno.ENOSYS, "no-opendir")
        return Opened(0, abi.OpenFlag.KEEP_CACHE | abi.OpenFlag.CACHE_DIR)

    def fast_flush(self, req):
        if self.noopen:
            raise OSError(errno.ENOSYS, "no flush")

    def fast_release(self, req):
        return None

    def fast_releasedir(self, req):
        return None

    def fast_read(self, req):
        data = self.data.get(req.header.nodeid)
        if data is None:
            raise IsADirectoryError(errno.EISDIR, "a directory")
        return data[req.offset:req.offset + req.size]

    def fast_readdir(self, req, buf):
        if req.header.nodeid != abi.ROOT_ID:
            raise NotADirectoryError(errno.ENOTDIR, "not a directory")
        listing = [(b".", abi.ROOT_ID), (b"..", abi.ROOT_ID), *sorted(self.names.items())]
        for off, (name, ino) in enumerate(listing[req.offset:], start=req.offset + 1):
            entry = Entry(ino, self.attrs[ino], TIMEOUT, TIMEOUT) if name not in (b".", b"..") else None
            if not buf.add(name, off, ino, self.attrs[ino].mode, entry):
                break

    def fast_ioctl(self, req):
        # io.open's isatty() (TCGETS) on every open(): answered here, on the reader thread
        raise OSError(errno.ENOTTY, "not a terminal")

    def fast_statfs(self, req):
        return Statfs(blocks=1000, bfree=0, bavail=0, files=len(self.attrs), ffree=0, bsize=4096)

    def forget(self, forgets):
        self.forgotten.extend(forgets)


def serve(mountpoint: str, fs: MemFS, options=(), via: str | None = None) -> tuple[Session, object]:
    """Mount ``fs`` at ``mountpoint`` and start serving it; the session (whose close() unmounts)."""
    m = mount(mountpoint, options, fsname="memfs", subtype="memfs", via=via)
    dev = Device(m.fd)
    session = Session(dev, Dispatcher(fs), on_close=lambda: unmount(m, dev))
    try:
        session.start()
    except BaseException:
        unmount(m)
        raise
    return session, m


def main(argv: list[str]) -> int:
    via = None
    if argv[0].startswith("--via="):
        via, argv = argv[0].split("=", 1)[1], argv[1:]
    mountpoint, files = argv[0], dict(a.encode().split(b"=", 1) for a in argv[1:])
    session, _ = serve(mountpoint, MemFS(files), via=via)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    print("ready", flush=True)
    while not stop.is_set() and not session.wait(0.2):
        pass
    session.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
