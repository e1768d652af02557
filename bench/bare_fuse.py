#!/usr/bin/env python3
"""The thinnest read-only FUSE server on stripefs's library stack (pyfuse3 + trio):
the floor that bench/fuse_floor.py measures stripefs's mounts against.

    python bench/bare_fuse.py SRC MOUNTPOINT [--noflush] [--noopen]

Mirrors the directory tree under SRC (read at start: every name and attribute
in dicts, one prebuilt EntryAttributes per inode). LOOKUP and GETATTR answer
from those with hour-long entry and attribute timeouts; OPEN answers
keep_cache=True (fh = inode); READ passes through to SRC with os.pread (only
a page-cache miss gets here); FLUSH and RELEASE answer at once, or with
--noflush FLUSH answers ENOSYS, after which the kernel stops sending it on
this connection (what a stripefs `-o dataset` mount does). With --noopen, once
setxattr(MOUNTPOINT, "user.fuse_floor.noopen") was called, OPEN answers ENOSYS:
FUSE's no-open, after which the kernel sends no OPEN and no RELEASE on this
connection and keeps the page cache. A READ then carries file handle 0 and
pyfuse3 3.5 passes `read` nothing else (why stripefs cannot decline OPEN), so
it fails with EIO here: that setxattr, and "user.fuse_floor.store", push every
file into the kernel's page cache first (notify_store; files whose inode the
kernel dropped are skipped). Mount options are
stripefs's (pyfuse3.default_options, i.e. default_permissions); not `ro`, as a
dataset mount is not (docs/design.md: the reader's fstat after a read then
asks a GETATTR).

Every request is counted per op (a dict increment); getxattr(MOUNTPOINT,
"user.fuse_floor.ops") answers the counts as JSON. Prints "ready" on stdout
once mounted; ends when unmounted (fusermount3 -u) or on SIGTERM/SIGINT.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import stat
import sys

import pyfuse3
import trio

TIMEOUT = 3600.0  # entry and attribute timeouts: nothing expires during a benchmark
COUNTS_XATTR = b"user.fuse_floor.ops"
NOOPEN_XATTR = b"user.fuse_floor.noopen"
STORE_XATTR = b"user.fuse_floor.store"


class BareFS(pyfuse3.Operations):
    supports_dot_lookup = False  # as stripefs's Operations
    enable_writeback_cache = False

    def __init__(self, src: str, noflush: bool, noopen: bool):
        super().__init__()
        self.noflush, self.noopen, self.decline_open = noflush, noopen, False
        self.n = dict.fromkeys(("lookup", "getattr", "open", "read", "flush", "release", "opendir", "readdir",
                                "releasedir", "getxattr", "setxattr", "statfs", "forget"), 0)
        self.paths: dict[int, str] = {pyfuse3.ROOT_INODE: src}
        self.attrs: dict[int, pyfuse3.EntryAttributes] = {}
        self.names: dict[tuple[int, bytes], int] = {}
        self.listing: dict[int, list[tuple[bytes, int]]] = {}
        self._add(pyfuse3.ROOT_INODE, src)

    def _add(self, ino: int, path: str) -> None:
        st = os.lstat(path)
        e = pyfuse3.EntryAttributes()
        e.st_ino = ino
        e.entry_timeout = e.attr_timeout = TIMEOUT
        for field in ("st_mode", "st_nlink", "st_uid", "st_gid", "st_size", "st_blksize", "st_blocks",
                      "st_atime_ns", "st_mtime_ns", "st_ctime_ns"):
            setattr(e, field, getattr(st, field))
        self.attrs[ino] = e
        if stat.S_ISDIR(st.st_mode):
            self.listing[ino] = []
            for name in sorted(os.listdir(path)):
                child = len(self.paths) + 1
                self.paths[child] = os.path.join(path, name)
                self.names[(ino, os.fsencode(name))] = child
                self.listing[ino].append((os.fsencode(name), child))
                self._add(child, self.paths[child])

    async def lookup(self, parent_inode, name, ctx=None):
        self.n["lookup"] += 1
        ino = self.names.get((parent_inode, name))
        if ino is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return self.attrs[ino]

    async def forget(self, inode_list):
        self.n["forget"] += 1

    async def getattr(self, inode, ctx=None):
        self.n["getattr"] += 1
        return self.attrs[inode]

    async def open(self, inode, flags, ctx):
        self.n["open"] += 1
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_TRUNC):
            raise pyfuse3.FUSEError(errno.EROFS)
        if self.decline_open:
            raise pyfuse3.FUSEError(errno.ENOSYS)
        return pyfuse3.FileInfo(fh=inode, keep_cache=True)

    async def read(self, fh, off, size):
        self.n["read"] += 1
        if fh == 0:  # no-open: the kernel does not say which file
            raise pyfuse3.FUSEError(errno.EIO)
        fd = os.open(self.paths[fh], os.O_RDONLY)
        try:
            return os.pread(fd, size, off)
        finally:
            os.close(fd)

    async def flush(self, fh):
        self.n["flush"] += 1
        if self.noflush:
            raise pyfuse3.FUSEError(errno.ENOSYS)

    async def release(self, fh):
        self.n["release"] += 1

    async def opendir(self, inode, ctx):
        self.n["opendir"] += 1
        return inode

    async def readdir(self, fh, start_id, token):
        self.n["readdir"] += 1
        for i, (name, ino) in enumerate(self.listing[fh][start_id:], start_id + 1):
            if not pyfuse3.readdir_reply(token, name, self.attrs[ino], i):
                break

    async def releasedir(self, fh):
        self.n["releasedir"] += 1

    async def getxattr(self, inode, name, ctx):
        self.n["getxattr"] += 1
        if inode == pyfuse3.ROOT_INODE and name == COUNTS_XATTR:
            return json.dumps(self.n).encode()
        raise pyfuse3.FUSEError(errno.ENODATA)

    async def setxattr(self, inode, name, value, ctx):
        self.n["setxattr"] += 1
        if not (self.noopen and inode == pyfuse3.ROOT_INODE and name in (NOOPEN_XATTR, STORE_XATTR)):
            raise pyfuse3.FUSEError(errno.ENOTSUP)
        self.decline_open |= name == NOOPEN_XATTR
        await trio.to_thread.run_sync(self._store_all)

    def _store_all(self) -> None:
        for ino, path in self.paths.items():
            if stat.S_ISREG(self.attrs[ino].st_mode):
                with open(path, "rb") as f:
                    try:
                        pyfuse3.notify_store(ino, 0, f.read())
                    except OSError:  # ENOENT: the kernel forgot the inode; its next use is a LOOKUP
                        pass

    async def statfs(self, ctx):
        self.n["statfs"] += 1
        return pyfuse3.StatvfsData()


async def serve(ops: BareFS, mountpoint: str) -> None:
    pyfuse3.init(ops, mountpoint, set(pyfuse3.default_options) | {"fsname=bare_fuse", "subtype=bare_fuse"})
    try:
        print("ready", flush=True)
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async with trio.open_nursery() as nursery:
                async def stop_on_signal():
                    async for _ in signals:
                        pyfuse3.terminate()
                        return

                nursery.start_soon(stop_on_signal)
                await pyfuse3.main()
                nursery.cancel_scope.cancel()
    finally:
        pyfuse3.close(unmount=True)


def main() -> int:
    args = [a for a in sys.argv[1:] if a not in ("--noflush", "--noopen")]
    if len(args) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    trio.run(serve, BareFS(args[0], "--noflush" in sys.argv, "--noopen" in sys.argv), args[1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
