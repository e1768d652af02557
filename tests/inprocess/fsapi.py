"""Calling the mount's ``Operations`` as its FUSE session does, for the in-process tier (tests/inprocess/conftest.py).

``FS`` wraps one ``Operations`` with the request sequences the kernel sends for
common system calls (``open(path, "wb")`` is LOOKUP, then CREATE or OPEN with
O_TRUNC, WRITEs, FLUSH, RELEASE), so a test reads like the syscalls it stands
for. Arguments are what client/operations_bridge.py passes: names as bytes, a
request context with uid, gid, pid and umask, the new ``st_*`` values and
``SetattrFields`` for SETATTR, a mkdir mode with S_IFDIR set (the kernel sets it),
xattr flags handled the way libfuse-based servers do (XATTR_CREATE asks GETXATTR
first). Results are the session's types: ``Entry`` from ``lookup``, ``Attr`` from
``getattr`` (its ``(Attr, valid)`` answer, or the same in wire form, decoded).

``Kernel`` stands in for what the session would hand the kernel: readdir replies go
into a buffer of ``READDIR_BUFFER`` entries (the kernel then asks again from the
last cookie), invalidations and page-cache stores are recorded.
"""

from __future__ import annotations

import errno
import os
import stat
import struct
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field, fields
from types import SimpleNamespace

import msgspec
import pytest
import trio
import zmq

from stripefs.client import fuse_backend
from stripefs.client.connect import open_client
from stripefs.client.fuse import abi
from stripefs.client.fuse.abi import ROOT_ID
from stripefs.client.fuse.replies import Attr, Encoded, Entry, FuseError, Statfs
from stripefs.client.kernel_cache import KernelCache
from stripefs.client.operations import Operations
from stripefs.client.prefetch import Prefetcher
from stripefs.common import config as cfg

#: bytes per WRITE and READ the kernel sends here (FUSE's max_write and max_read of 128 KiB)
IO_SIZE = 128 << 10
#: entries one READDIRPLUS reply holds (a 4 KiB buffer of short names)
READDIR_BUFFER = 64


@dataclass
class Ctx:
    """The request context a handler receives (client/operations_bridge.py ``_Ctx``)."""

    uid: int = 0
    gid: int = 0
    pid: int = field(default_factory=os.getpid)
    umask: int = 0o022


@dataclass
class SetattrFields:
    """The fields a SETATTR sets, as the handler receives them (client/operations_bridge.py)."""

    update_atime: bool = False
    update_mtime: bool = False
    update_ctime: bool = False
    update_mode: bool = False
    update_uid: bool = False
    update_gid: bool = False
    update_size: bool = False


def NewAttrs(**values) -> SimpleNamespace:
    """A SETATTR's new values (``st_size`` ...), as the bridge passes them (``_NewAttrs``); the rest 0."""
    fields_ = ("st_mode", "st_uid", "st_gid", "st_size", "st_atime_ns", "st_mtime_ns", "st_ctime_ns")
    assert set(values) <= set(fields_), values
    return SimpleNamespace(**{name: values.get(name, 0) for name in fields_})


class Kernel:
    """What ``Operations`` hands the session for the kernel, recorded (client/fuse_backend.py patched)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.invalidated_inodes: list[tuple[int, bool]] = []
        self.invalidated_entries: list[tuple[int, bytes]] = []
        self.stored: list[tuple[int, int, bytes]] = []
        monkeypatch.setattr(fuse_backend, "invalidate_inode", lambda ino, attr_only=False: self.invalidated_inodes.append((ino, attr_only)))
        monkeypatch.setattr(fuse_backend, "invalidate_entry", lambda parent, name: self.invalidated_entries.append((parent, name)))
        monkeypatch.setattr(fuse_backend, "notify_store", lambda ino, offset, data: self.stored.append((ino, offset, bytes(data))))


class DirBuffer(list):
    """A READDIRPLUS buffer of ``READDIR_BUFFER`` entries: ``(name, entry, cookie)`` records (as
    client/fuse/replies.py ``DirentBuffer.add`` takes them)."""

    plus = True

    def add(self, name: bytes, off: int, ino: int, mode: int, entry: Entry | None = None) -> bool:
        if len(self) >= READDIR_BUFFER:
            return False
        assert entry is not None and entry.nodeid == ino and entry.attr.mode == mode
        self.append((name, entry, off))
        return True

    def room(self) -> int:
        """Bytes free, as ``DirentBuffer.room``: a page answered from a kept listing (Operations._fill)."""
        return (READDIR_BUFFER - len(self)) * (abi.ENTRY_OUT_SIZE + abi.dirent_size(255, abi.FUSE_DIRENT.size))

    def extend(self, parts) -> None:
        """Entries in their READDIRPLUS wire form (``DirentBuffer.extend``), recorded as ``(name, None,
        cookie)`` (the entry's bytes are the kernel's to read)."""
        data, pos = b"".join(parts), 0
        while pos < len(data):
            ino, off, namelen, _ = abi.FUSE_DIRENT.unpack_from(data, pos + abi.ENTRY_OUT_SIZE)
            start = pos + abi.DIRENTPLUS_HEAD
            list.append(self, (data[start:start + namelen], None, off))
            pos += abi.ENTRY_OUT_SIZE + abi.dirent_size(namelen, abi.FUSE_DIRENT.size)


#: fuse_attr_out as the kernel reads it
_ATTR_OUT = struct.Struct(abi.FUSE_ATTR_OUT_HEAD.format + abi.FUSE_ATTR.format[1:])


#: fuse_entry_out as the kernel reads it
_ENTRY_OUT = struct.Struct(abi.FUSE_ENTRY_OUT_HEAD.format + abi.FUSE_ATTR.format[1:])
_NS = 1_000_000_000


def _attr(ino, size, blocks, asec, msec, csec, ansec, mnsec, cnsec, mode, nlink, uid, gid, rdev, blksize, flags) -> Attr:
    return Attr(ino, mode, nlink, uid, gid, size, blocks, asec * _NS + ansec, msec * _NS + mnsec, csec * _NS + cnsec,
                rdev, blksize, flags)


def attr_of(answer: tuple[Attr, float] | Encoded) -> Attr:
    """The attributes in a GETATTR or SETATTR answer, either form (the wire form decoded as the kernel does)."""
    if not isinstance(answer, Encoded):
        return answer[0]
    return _attr(*_ATTR_OUT.unpack(answer)[3:])


def entry_of(answer: Entry | Encoded) -> Entry:
    """A LOOKUP's (or MKDIR's ...) answer, either form: a held name is answered in wire form."""
    if not isinstance(answer, Encoded):
        return answer
    nodeid, generation, es, ats, ens, atns, *attr = _ENTRY_OUT.unpack(answer)
    return Entry(nodeid, _attr(*attr), es + ens / _NS, ats + atns / _NS, generation)


def fuse_errno(exc: BaseException) -> int:
    assert isinstance(exc, FuseError), f"expected a FuseError, got {exc!r}"
    return exc.errno


@asynccontextmanager
async def raises_errno(code: int):
    """``with raises_errno(errno.ENOENT): await fs...``: the handler answers that errno."""
    with pytest.raises(FuseError) as info:
        yield info
    assert info.value.errno == code, f"errno {errno.errorcode.get(info.value.errno)}, expected {errno.errorcode[code]}"


class FS:
    def __init__(self, ops, kernel: Kernel, rig):
        self.ops = ops
        self.kernel = kernel
        self.rig = rig
        self.dir = ROOT_ID  # the test's own directory (set by the fixture)
        self.dir_name = b""  # its name in the root
        self.open_handles: set[int] = set()
        self._open_counts: dict[int, int] = {}  # no-open: inode -> its open files here (the kernel's count)
        self._unlinked: set[int] = set()  # no-open: unlinked while open here: forgotten at the last close
        self.no_flush = False  # a FLUSH was answered ENOSYS: the kernel sends none any more (``flush``)

    # ----------------------------------------------------------- namespace

    async def lookup(self, parent: int, name: bytes, ctx: Ctx | None = None) -> Entry:
        return entry_of(await self.ops.lookup(parent, name, ctx or Ctx()))

    async def exists(self, parent: int, name: bytes) -> bool:
        try:
            await self.lookup(parent, name)
        except FuseError as exc:
            if exc.errno == errno.ENOENT:
                return False
            raise
        return True

    async def getattr(self, ino: int) -> Attr:
        return attr_of(await self.ops.getattr(ino, Ctx()))

    async def mkdir(self, parent: int, name: bytes, mode: int = 0o777, ctx: Ctx | None = None) -> int:
        ctx = ctx or Ctx()
        entry = await self.ops.mkdir(parent, name, (mode & ~ctx.umask & 0o7777) | stat.S_IFDIR, ctx)
        return entry.nodeid

    async def mknod(self, parent: int, name: bytes, mode: int, rdev: int = 0, ctx: Ctx | None = None) -> int:
        ctx = ctx or Ctx()
        entry = await self.ops.mknod(parent, name, (mode & ~ctx.umask & 0o7777) | stat.S_IFMT(mode), rdev, ctx)
        return entry.nodeid

    async def symlink(self, parent: int, name: bytes, target: bytes, ctx: Ctx | None = None) -> int:
        return (await self.ops.symlink(parent, name, target, ctx or Ctx())).nodeid

    async def link(self, ino: int, parent: int, name: bytes) -> Entry:
        return await self.ops.link(ino, parent, name, Ctx())

    async def readlink(self, ino: int) -> bytes:
        return await self.ops.readlink(ino, Ctx())

    async def unlink(self, parent: int, name: bytes) -> None:
        ino = self.ops.kcache.lookup_known(parent, name) if self.no_open else None
        await self.ops.unlink(parent, name, Ctx())
        if ino is not None:
            self._unlinked.add(ino)
            self._forget_if_closed(ino)

    def _forget_if_closed(self, ino: int) -> None:
        """No-open: the kernel's FORGET of an unlinked file once no open file holds it (the mount
        keeps a state per inode until then; its open set keeps the file's data at the daemon)."""
        if ino in self._unlinked and not self._open_counts.get(ino):
            self._unlinked.discard(ino)
            self.ops.forget_now([(ino, 1)])

    async def rmdir(self, parent: int, name: bytes) -> None:
        await self.ops.rmdir(parent, name, Ctx())

    async def rename(self, parent_old: int, old: bytes, parent_new: int, new: bytes, flags: int = 0) -> None:
        await self.ops.rename(parent_old, old, parent_new, new, flags, Ctx())

    async def listdir(self, ino: int) -> list[bytes]:
        """OPENDIR, READDIRPLUS until an empty reply (each from the last cookie), RELEASEDIR."""
        fh = (await self.ops.opendir(ino, Ctx())).fh
        names: list[bytes] = []
        start = 0
        try:
            while True:
                token = DirBuffer()
                await self.ops.readdir(fh, start, token)
                if not token:
                    return names
                names += [name for name, _, _ in token]
                start = token[-1][2]
        finally:
            await self.ops.releasedir(fh)

    async def setattr(self, ino: int, *, fh: int | None = None, ctx: Ctx | None = None, **values) -> Attr:
        """SETATTR of the given fields: st_size, st_mode, st_uid, st_gid, st_atime_ns, st_mtime_ns."""
        attr = NewAttrs(**values)
        update = SetattrFields()
        names = {"st_size": "update_size", "st_mode": "update_mode", "st_uid": "update_uid", "st_gid": "update_gid",
                 "st_atime_ns": "update_atime", "st_mtime_ns": "update_mtime"}
        for key in values:
            setattr(update, names[key], True)
        assert {f.name for f in fields(update) if getattr(update, f.name)} == {names[k] for k in values}
        return attr_of(await self.ops.setattr(ino, attr, update, fh, ctx or Ctx()))

    async def setxattr(self, ino: int, name: bytes, value: bytes, flags: int = 0) -> None:
        """As libfuse-based servers do: XATTR_CREATE and XATTR_REPLACE are checked with a GETXATTR first."""
        if flags & (os.XATTR_CREATE | os.XATTR_REPLACE):
            try:
                await self.ops.getxattr(ino, name, Ctx())
            except FuseError as exc:
                if exc.errno != errno.ENODATA:
                    raise
                if flags & os.XATTR_REPLACE:
                    raise
            else:
                if flags & os.XATTR_CREATE:
                    raise FuseError(errno.EEXIST)
        await self.ops.setxattr(ino, name, value, Ctx())

    async def getxattr(self, ino: int, name: bytes) -> bytes:
        return await self.ops.getxattr(ino, name, Ctx())

    async def listxattr(self, ino: int) -> list[bytes]:
        return await self.ops.listxattr(ino, Ctx())

    async def removexattr(self, ino: int, name: bytes) -> None:
        await self.ops.removexattr(ino, name, Ctx())

    async def statfs(self) -> Statfs:
        return await self.ops.statfs(Ctx())

    # ---------------------------------------------------------------- files

    @property
    def no_open(self) -> bool:
        """The kernel sends no OPEN (the default mount without per_open_handles): an open(2) sends
        nothing but an O_TRUNC's SETATTR, and READ, WRITE, FLUSH, FSYNC name the inode (fh 0; here
        the open file is ``-inode``); no RELEASE follows a close."""
        return self.ops.per_inode

    async def open(self, ino: int, flags: int = os.O_RDONLY, ctx: Ctx | None = None) -> int:
        if self.no_open:
            if flags & os.O_TRUNC:  # no atomic O_TRUNC (client/mount.py): the kernel truncates first
                await self.setattr(ino, st_size=0, ctx=ctx, **await self._killed_mode(ino, ctx or Ctx()))
            self._open_counts[ino] = self._open_counts.get(ino, 0) + 1
            return -ino
        info = await self.ops.open(ino, flags, ctx or Ctx())
        self.open_handles.add(info.fh)
        return info.fh

    async def _killed_mode(self, ino: int, ctx: Ctx) -> dict:
        """What fs/fuse/dir.c ``fuse_setattr`` adds to a truncate by a caller without CAP_FSETID
        (no HANDLE_KILLPRIV): a GETATTR, then the mode without set-uid (and set-gid with group exec)."""
        if ctx.uid == 0:
            return {}
        mode = (await self.getattr(ino)).mode
        kill = mode & stat.S_ISUID | (mode & stat.S_ISGID if mode & stat.S_IXGRP else 0)
        return {"st_mode": mode & ~kill} if kill and stat.S_ISREG(mode) else {}

    async def create(self, parent: int, name: bytes, mode: int = 0o666, flags: int = os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
                     ctx: Ctx | None = None) -> tuple[int, int]:
        """CREATE: (fh, inode)."""
        ctx = ctx or Ctx()
        entry, info = await self.ops.create(parent, name, (mode & ~ctx.umask & 0o7777) | stat.S_IFREG, flags, ctx)
        if info.fh == 0 and self.no_open:
            self._open_counts[entry.nodeid] = self._open_counts.get(entry.nodeid, 0) + 1
            return -entry.nodeid, entry.nodeid
        self.open_handles.add(info.fh)
        return info.fh, entry.nodeid

    async def open_path(self, parent: int, name: bytes, flags: int, ctx: Ctx | None = None) -> tuple[int, int]:
        """open(2) of a name: LOOKUP, then OPEN, or CREATE when O_CREAT and the name is missing. (fh, inode)."""
        ctx = ctx or Ctx()
        try:
            ino = (await self.lookup(parent, name, ctx)).nodeid
        except FuseError as exc:
            if exc.errno != errno.ENOENT or not flags & os.O_CREAT:
                raise
            return await self.create(parent, name, flags=flags, ctx=ctx)
        return await self.open(ino, flags & ~os.O_CREAT, ctx), ino

    async def read(self, fh: int, offset: int, size: int) -> bytes:
        if fh < 0:
            return bytes(await self.ops.read_inode(-fh, offset, size, Ctx()))
        return bytes(await self.ops.read(fh, offset, size))

    async def read_all(self, fh: int, offset: int = 0) -> bytes:
        """READs of IO_SIZE from ``offset`` until a short one."""
        out = bytearray()
        while True:
            piece = await self.read(fh, offset + len(out), IO_SIZE)
            out += piece
            if len(piece) < IO_SIZE:
                return bytes(out)

    async def write(self, fh: int, offset: int, data: bytes) -> int:
        """WRITEs of at most IO_SIZE; the bytes written (short at a quota's limit)."""
        done = 0
        view = memoryview(data)
        while done < len(data):
            piece = bytes(view[done : done + IO_SIZE])
            n = await (self.ops.write_inode(-fh, offset + done, piece, Ctx()) if fh < 0 else
                       self.ops.write(fh, offset + done, piece))
            done += n
            if n < len(piece):
                break
        return done

    async def flush(self, fh: int) -> None:
        """FLUSH, as the kernel sends it: never again once one was answered ENOSYS (connection-wide:
        a dataset mount, or closes that send nothing, client/idle_commits.py)."""
        if self.no_flush:
            return
        try:
            await (self.ops.flush_inode(-fh) if fh < 0 else self.ops.flush(fh))
        except FuseError as exc:
            if exc.errno != errno.ENOSYS:
                raise
            self.no_flush = True

    async def first_close(self) -> None:
        """The kernel's first FLUSH on this connection, whatever file it names (here the root's): on a
        mount whose closes send nothing it is the one answered ENOSYS (client/idle_commits.py), so the
        test's own closes begin on a mount that already sends none."""
        await self.flush(-ROOT_ID)

    async def fsync(self, fh: int) -> None:
        await (self.ops.fsync_inode(-fh, False) if fh < 0 else self.ops.fsync(fh, False))

    async def release(self, fh: int) -> None:
        if fh < 0:  # no-open: no RELEASE
            self._open_counts[-fh] = max(0, self._open_counts.get(-fh, 0) - 1)
            self._forget_if_closed(-fh)
            return
        self.open_handles.discard(fh)
        await self.ops.release(fh)

    async def close(self, fh: int) -> None:
        """close(2): FLUSH, then RELEASE (the last reference)."""
        try:
            await self.flush(fh)
        finally:
            await self.release(fh)

    async def write_file(self, parent: int, name: bytes, data: bytes) -> int:
        """``open(path, "wb").write(data)`` and close: the inode."""
        fh, ino = await self.open_path(parent, name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        try:
            assert await self.write(fh, 0, data) == len(data)
        finally:
            await self.close(fh)
        return ino

    async def read_file(self, parent: int, name: bytes) -> bytes:
        """``open(path, "rb").read()`` and close."""
        fh, _ = await self.open_path(parent, name, os.O_RDONLY)
        try:
            return await self.read_all(fh)
        finally:
            await self.close(fh)

    async def release_all(self) -> None:
        """What the kernel does for handles a test left open when its process exits."""
        for fh in list(self.open_handles):
            try:
                await self.release(fh)
            except FuseError:
                pass


#: mount options every test mount gets (``-o`` syntax), e.g. ``per_open_handles=no`` to run a suite
#: on the no-open default mount; the cluster tier passes them to its mounts (tests/cluster/conftest.py)
MOUNT_OPTIONS_ENV = "STRIPEFS_TEST_MOUNT_OPTIONS"


def env_client_settings() -> dict:
    """The ClientConfig values ``STRIPEFS_TEST_MOUNT_OPTIONS`` asks for (the options this tier knows)."""
    settings = {}
    for opt in filter(None, os.environ.get(MOUNT_OPTIONS_ENV, "").split(",")):
        key, _, value = opt.partition("=")
        if key != "per_open_handles" or value not in ("", "yes", "no"):
            raise ValueError(f"{MOUNT_OPTIONS_ENV}: {opt!r} is not an option the in-process tier applies")
        settings["per_open_handles"] = value != "no"
    return settings


@asynccontextmanager
async def open_fs(rig, kernel: Kernel, name: str, follow: bool = False, **settings):
    """A client of ``rig`` built as the mount builds it (client/mount.py: client/connect.py, the kernel
    cache, the prefetcher, the session heartbeat), its ``Operations`` wrapped in an ``FS``. ``settings``:
    ClientConfig values. ``follow``: it follows the change feed too, as a mount does (callbacks, and
    with them asynchronous creates, client/async_dirops.py). Its open handles are released, and its
    tasks cancelled, on the way out."""
    client_cfg = msgspec.structs.replace(cfg.ClientConfig(metrics="", shm_dir=""),
                                         **{**env_client_settings(), **rig.client_settings, **settings})
    ctx = zmq.Context()
    try:
        async with trio.open_nursery() as own, AsyncExitStack() as stack:
            client = await open_client(ctx, stack, own, client_cfg, [rig.meta_address], name=name)
            kcache = KernelCache()
            prefetcher = Prefetcher(client.meta, client.data, kcache, parallel=client_cfg.prefetch_parallel)
            ops = Operations(
                client.meta, client.data, attr_timeout=client_cfg.attr_timeout_s, entry_timeout=client_cfg.entry_timeout_s,
                cache_timeout=client_cfg.cache_timeout_s, dataset=client_cfg.dataset,
                per_open_handles=client_cfg.per_open_handles, kcache=kcache, prefetcher=prefetcher,
                op_timeout=client_cfg.op_timeout_s, sync_close=client_cfg.sync_close,
            )
            prefetcher.on_fetched = ops.prefetched
            own.start_soon(client.meta.heartbeat_loop, name, name="session-heartbeat")
            if follow:
                own.start_soon(kcache.follow, ctx, client.meta.feed_info, name="change-feed")
                with trio.fail_after(10):
                    await kcache.following.wait()
                    while not kcache.callbacks_possible:
                        await trio.sleep(0.01)
                await own.start(ops.dirops.run)
                if ops.writeback is not None:
                    await own.start(ops.writeback.run)
                if ops.idle is not None:
                    await own.start(ops.idle.run)
                prefetcher.before_resolve = ops.commit_pending
            fs = FS(ops, kernel, rig)
            try:
                yield fs
            finally:
                with trio.CancelScope(shield=True):
                    await fs.release_all()
                own.cancel_scope.cancel()
    finally:
        ctx.destroy(linger=0)


async def delegated_numbers(fs) -> None:
    """Wait until the daemon delegated inode numbers to this client (asked at its first create)."""
    fs.ops.dirops.take_ino()  # asks for a range (one number spent: holes cost nothing)
    with trio.fail_after(10):
        while not fs.ops.dirops.left():
            await trio.sleep(0.01)


async def in_held_directory(fs, body) -> None:
    """``body(d)`` in a new directory made here (held whole). A change feed silent for 3 s (a loaded
    machine) rightly drops every name and hold, and the changes then ask the daemon (and get the
    daemon's answer, an error among them, at once; a close commits at once instead of leaving the
    file to the write-back): a round that failed while the feed was out of step or dropped the cache
    runs again in another directory, at most three times, each once the feed is in step."""
    await delegated_numbers(fs)
    real = fs.ops.meta.call
    for attempt in range(3):
        with trio.fail_after(10):
            while not fs.ops.kcache.healthy:
                await trio.sleep(0.05)
        drops = fs.ops.kcache.drops
        fs.ops.meta.call = real
        try:
            await body(await fs.mkdir(fs.dir, b"round%d" % attempt))
            return
        except (AssertionError, OSError):  # OSError: the daemon's answer to a change it was asked
            if fs.ops.kcache.drops == drops and fs.ops.kcache.healthy:
                raise
    pytest.fail("the change feed dropped the mount's cache in each of 3 rounds")
