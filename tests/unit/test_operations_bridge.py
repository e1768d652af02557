"""client/operations_bridge.py: the mount's Operations served on its FUSE session.

A stand-in for Operations records the calls the bridge makes and answers with the session's
result types; the requests come from the session's parser, so what is checked is the
translation of each request into Operations' arguments, and that results and errors pass.
"""

from __future__ import annotations

import errno
import os
import stat
import struct
import threading

import pytest
import trio
from prometheus_client import REGISTRY

from stripefs.client import fuse_backend
from stripefs.client.fuse import abi, requests as rq
from stripefs.client.fuse.abi import Opcode
from stripefs.client.fuse.dispatch import MISS, Opened
from stripefs.client.fuse.replies import Attr, DirentBuffer, Entry, FuseError, Statfs, encode_attr_out
from stripefs.client.operations import FAST_PATH_MISS, _opened
from stripefs.client.operations_bridge import OperationsBridge

from test_fuse_wire import request, u32, u64


def parse(opcode, args, nodeid=5):
    data = request(opcode, args, nodeid=nodeid)
    return rq.parse(data, len(data))


def attrs(ino: int, mode: int = stat.S_IFREG | 0o644) -> Entry:
    a = Attr(ino, mode, nlink=1, size=10, uid=7, gid=8, mtime_ns=1_500_000_000_000_000_001)
    return Entry(ino, a, 2.0, 3.0, 4)


class FakeOps:
    def __init__(self, dataset=False):
        self.calls = []
        self.lock = threading.RLock()
        self.dataset = dataset
        self.no_open, self.per_inode = dataset, False  # (as Operations sets them)

    def _fast_open(self, inode, flags, ctx):
        return FAST_PATH_MISS

    def _fast_opendir(self, inode, ctx):
        return Opened(inode)

    async def read(self, fh, off, size):
        self.calls.append(("read", fh, off, size))
        return b"x" * size

    async def read_inode(self, inode, off, size, ctx):
        self.calls.append(("read_inode", inode, off, size, ctx.pid))
        return b"y" * size

    async def lookup(self, parent, name, ctx):
        self.calls.append(("lookup", parent, name, (ctx.uid, ctx.gid, ctx.pid)))
        if name == b"missing":
            raise FuseError(errno.ENOENT)
        return attrs(9)

    async def setattr(self, inode, attr, fields, fh, ctx):
        self.calls.append(("setattr", inode, fh, fields.update_size, fields.update_mode, fields.update_mtime,
                           attr.st_size, attr.st_mtime_ns))
        e = attrs(inode)
        return e.attr, e.attr_valid

    async def open(self, inode, flags, ctx):
        return _opened(77, True, flags)

    async def listxattr(self, inode, ctx):
        return [b"user.a", b"user.bb"]

    async def readdir(self, fh, start_id, buf):
        self.calls.append(("readdir", fh, start_id))
        for i in range(start_id, 1000):
            e = attrs(100 + i)
            if not buf.add(f"n{i}".encode(), i + 1, e.nodeid, e.attr.mode, e):
                return

    async def statfs(self, ctx):
        return Statfs(100, 50, 40, 10, 5, 4096, 255, 4096)

    def forget_now(self, forgets):
        self.calls.append(("forget", list(forgets)))


async def test_lookup_and_errors():
    ops = FakeOps()
    async with trio.open_nursery() as nursery:
        bridge = OperationsBridge(ops, trio.lowlevel.current_trio_token(), nursery)
        entry = await bridge.lookup(parse(Opcode.LOOKUP, b"name\0"))
        assert ops.calls[-1] == ("lookup", 5, b"name", (1000, 1001, 4242))
        assert (entry.nodeid, entry.generation, entry.entry_valid, entry.attr_valid) == (9, 4, 2.0, 3.0)
        assert (entry.attr.size, entry.attr.uid, entry.attr.gid, entry.attr.mtime_ns) == (10, 7, 8, 1_500_000_000_000_000_001)
        with pytest.raises(OSError) as err:
            await bridge.lookup(parse(Opcode.LOOKUP, b"missing\0"))
        assert err.value.errno == errno.ENOENT


async def test_setattr_fields_and_times():
    ops = FakeOps()
    valid = abi.SetattrValid.SIZE | abi.SetattrValid.MTIME | abi.SetattrValid.FH
    args = (u32(valid) + u32(0) + u64(66) + u64(4096) + u64(0) + u64(0) + u64(12) + u64(0)
            + u32(0) + u32(5) + u32(0) + u32(0) + u32(0) + u32(0) + u32(0) + u32(0))
    async with trio.open_nursery() as nursery:
        bridge = OperationsBridge(ops, trio.lowlevel.current_trio_token(), nursery)
        attr, valid_s = await bridge.setattr(parse(Opcode.SETATTR, args))
    assert ops.calls[-1] == ("setattr", 5, 66, True, False, True, 4096, 12_000_000_005)
    assert attr.ino == 5 and valid_s == 3.0


async def test_open_listxattr_statfs_readdir_forget():
    ops = FakeOps()
    async with trio.open_nursery() as nursery:
        token = trio.lowlevel.current_trio_token()
        bridge = OperationsBridge(ops, token, nursery)
        opened = await bridge.open(parse(Opcode.OPEN, u32(os.O_RDWR) + u32(0)))
        assert opened.fh == 77 and opened.open_flags == abi.OpenFlag.KEEP_CACHE
        opened = await bridge.open(parse(Opcode.OPEN, u32(os.O_RDONLY) + u32(0)))
        assert opened.open_flags == abi.OpenFlag.KEEP_CACHE | abi.OpenFlag.NOFLUSH  # no FLUSH at its close
        assert await bridge.listxattr(parse(Opcode.LISTXATTR, u32(0) + u32(0))) == b"user.a\0user.bb\0"
        s = await bridge.statfs(parse(Opcode.STATFS, b""))
        assert (s.blocks, s.bfree, s.bavail, s.files, s.ffree, s.bsize, s.namelen) == (100, 50, 40, 10, 5, 4096, 255)
        req = parse(Opcode.READDIRPLUS, u64(3) + u64(2) + u32(400) + u32(0) + u64(0) + u32(0) + u32(0))
        buf = DirentBuffer(req.size, plus=True)
        await bridge.readdir(req, buf)
        assert ops.calls[-1] == ("readdir", 3, 2)
        assert len(buf) == 2 * 160  # direntplus of a 2-byte name: 152 + 2, padded to 160; a third does not fit
        bridge.forget([(9, 1)])  # on the reader thread in the mount: applied there, no task
        assert ops.calls[-1] == ("forget", [(9, 1)])


def test_fuse_backend_routes_to_the_session():
    class FakeSession:
        def __init__(self):
            self.sent, self.ok = [], True

        def notify(self, parts):
            self.sent.append(b"".join(parts))
            return self.ok

    s = FakeSession()
    fuse_backend.use_session(s)
    try:
        fuse_backend.invalidate_inode(42, attr_only=True)
        fuse_backend.invalidate_entry(1, b"name")
        fuse_backend.notify_store(42, 0, b"data")
        assert [int.from_bytes(m[4:8], "little") for m in s.sent] == [2, 3, 4]  # INVAL_INODE, INVAL_ENTRY, STORE
        assert s.sent[0][24:32] == u64(-1)  # attributes only: offset -1
        s.ok = False  # the kernel holds no such inode: ENOENT
        with pytest.raises(OSError) as err:
            fuse_backend.invalidate_inode(43)
        assert err.value.errno == errno.ENOENT
    finally:
        fuse_backend.use_session(None)
    with pytest.raises(OSError) as err:  # no session serves: nothing is cached, ENOENT too
        fuse_backend.invalidate_entry(1, b"name")
    assert err.value.errno == errno.ENOENT


def test_fast_paths_translate_and_count():
    from stripefs.client import metrics
    from stripefs.client.fuse.dispatch import MISS, Opened
    from stripefs.client.operations import FAST_PATH_MISS

    class Ops:
        lock = threading.RLock()
        per_inode = False  # (a dataset mount: it declines FLUSH)

        def _fast_getattr(self, inode):
            if inode == 1:
                return FAST_PATH_MISS
            if inode == 2:
                raise FuseError(errno.ENOENT)
            e = attrs(inode)
            return e.attr, e.attr_valid

        def _fast_flush(self, fh):
            raise FuseError(errno.ENOSYS)

    bridge = OperationsBridge(Ops(), None, None)
    def scraped():  # as the mount's endpoint reads it: the fast paths' plain counts folded in first
        return REGISTRY.get_sample_value("stripefs_fuse_ops_total", {"op": "getattr"}) or 0

    def answered_enoent():
        return REGISTRY.get_sample_value("stripefs_fuse_negative_answers_total",
                                         {"op": "getattr", "errno": str(errno.ENOENT)}) or 0

    before, enoent_before = scraped(), answered_enoent()
    assert bridge.fast_getattr(parse(Opcode.GETATTR, bytes(16), nodeid=1)) is MISS
    attr, valid = bridge.fast_getattr(parse(Opcode.GETATTR, bytes(16), nodeid=9))
    assert attr.ino == 9 and valid == 3.0
    with pytest.raises(OSError) as err:
        bridge.fast_getattr(parse(Opcode.GETATTR, bytes(16), nodeid=2))
    assert err.value.errno == errno.ENOENT
    assert scraped() == before + 2  # a MISS is counted by the handler
    assert answered_enoent() == enoent_before + 1  # counted in plain ints, folded in at the scrape
    with pytest.raises(OSError) as err:
        bridge.fast_flush(parse(Opcode.FLUSH, bytes(24)))
    assert err.value.errno == errno.ENOSYS


def read_args(fh: int, offset: int, size: int) -> bytes:
    return u64(fh) + u64(offset) + u32(size) + u32(0) + u64(0) + u32(0) + u32(0)


async def test_a_dataset_mount_declines_open_and_reads_by_inode():
    """No-open: a dataset mount answers a read-only OPEN ENOSYS (the kernel then sends no OPEN and
    no RELEASE for the rest of the connection), and a READ with no handle (fh 0) reads by inode."""
    ops = FakeOps(dataset=True)
    async with trio.open_nursery() as nursery:
        bridge = OperationsBridge(ops, trio.lowlevel.current_trio_token(), nursery)
        with pytest.raises(OSError) as err:
            bridge.fast_open(parse(Opcode.OPEN, u32(0) + u32(0)))
        assert err.value.errno == errno.ENOSYS
        assert await bridge.read(parse(Opcode.READ, read_args(0, 4096, 3), nodeid=12)) == b"yyy"
        assert ops.calls[-1] == ("read_inode", 12, 4096, 3, 4242)
        assert await bridge.read(parse(Opcode.READ, read_args(7, 0, 2))) == b"xx"  # a handle: as before
        assert ops.calls[-1] == ("read", 7, 0, 2)
        with pytest.raises(OSError) as err:
            bridge.fast_opendir(parse(Opcode.OPENDIR, u32(0) + u32(0)))
        assert err.value.errno == errno.ENOSYS  # no-opendir: the kernel keeps listings
        req = parse(Opcode.READDIRPLUS, u64(0) + u64(0) + u32(400) + u32(0) + u64(0) + u32(0) + u32(0), nodeid=33)
        await bridge.readdir(req, DirentBuffer(req.size, plus=True))
        assert ops.calls[-1] == ("readdir", 33, 0)  # no handle: the directory's inode
    default = OperationsBridge(FakeOps(dataset=False), None, None)
    assert default.fast_opendir(parse(Opcode.OPENDIR, u32(0) + u32(0), nodeid=33)) == Opened(33)  # on the reader thread
    assert default.fast_open(parse(Opcode.OPEN, u32(0) + u32(0))) is MISS  # a default mount keeps OPEN
    writer = OperationsBridge(FakeOps(dataset=True), None, None)
    assert writer.fast_open(parse(Opcode.OPEN, u32(os.O_WRONLY) + u32(0))) is MISS  # EROFS from the handler


def test_a_held_files_getattr_is_answered_from_bytes_encoded_once():
    """A GETATTR of a file the mount holds (here: under a callback, the feed in order) is answered
    from its fuse_attr_out bytes, encoded at the first GETATTR and reused until its attributes
    change; the new attributes are answered at once, never the old bytes."""
    from types import SimpleNamespace

    from stripefs.client.fuse.replies import Encoded, encode_attr_out
    from stripefs.client.operations import BLKSIZE, Operations
    from stripefs.common import protocol as P

    ops = Operations(SimpleNamespace(writer=0), SimpleNamespace(), attr_timeout=1.0, entry_timeout=1.0,
                     cache_timeout=30.0)
    ops.kcache.healthy = True  # the change feed is followed
    bridge = OperationsBridge(ops, None, None)
    getattr_ = parse(Opcode.GETATTR, bytes(16), nodeid=9)
    assert bridge.fast_getattr(getattr_) is MISS  # nothing held: the handler asks the daemon
    old = P.Attr(ino=9, mode=stat.S_IFREG | 0o644, nlink=1, uid=7, gid=8, rdev=0, size=10, atime_ns=1,
                 mtime_ns=2_000_000_001, ctime_ns=3)
    ops._keep_held(9, old)
    first = bridge.fast_getattr(getattr_)
    assert type(first) is Encoded
    assert first == encode_attr_out(Attr(9, old.mode, 1, 7, 8, 10, 1, 1, 2_000_000_001, 3, 0, BLKSIZE), 30.0)
    assert bridge.fast_getattr(getattr_) is first  # encoded once
    new = P.Attr(ino=9, mode=stat.S_IFREG | 0o644, nlink=1, uid=7, gid=8, rdev=0, size=5000, atime_ns=1,
                 mtime_ns=4_000_000_000, ctime_ns=4_000_000_000)
    ops._keep_held(9, new)  # what a lookup or the feed leaves after a change elsewhere
    assert bridge.fast_getattr(getattr_) == encode_attr_out(
        Attr(9, new.mode, 1, 7, 8, 5000, 10, 1, 4_000_000_000, 4_000_000_000, 0, BLKSIZE), 30.0)
    ops.forget_now([(9, 1)])
    assert 9 not in ops._attr_bytes  # dropped with the kernel's inode


def test_a_name_the_kernel_let_expire_is_answered_from_what_the_mount_holds():
    """After cache_timeout the kernel looks a held name up again: answered from memory (the
    entry's bytes encoded once) while the feed keeps the file's attributes true; not once the
    feed is down or says the file changed, nor after this mount removed the name."""
    from types import SimpleNamespace

    from stripefs.client.fuse.replies import Encoded, encode_entry
    from stripefs.client.operations import BLKSIZE, Operations
    from stripefs.common import protocol as P

    ops = Operations(SimpleNamespace(writer=0), SimpleNamespace(), attr_timeout=1.0, entry_timeout=1.0,
                     cache_timeout=30.0, dataset=True)
    ops.kcache.healthy = True
    bridge = OperationsBridge(ops, None, None)
    lookup = parse(Opcode.LOOKUP, b"f\0", nodeid=1)
    attr = P.Attr(ino=9, mode=stat.S_IFREG | 0o644, nlink=1, uid=7, gid=8, rdev=0, size=10, atime_ns=1,
                  mtime_ns=2, ctime_ns=3, generation=5)
    ops._keep_dataset_info(P.OpenRsp(attr=attr, layout=P.Layout(chunk_size=1 << 22, stripe_count=1,
                                                                  redundancy="replicas=1"), chunks=[], nodes=[]))
    assert bridge.fast_lookup(lookup) is MISS  # the kernel never held the name: the daemon answers
    ops.kcache.remember(1, b"f", 9)  # a lookup or a listing gave the kernel this name
    first = bridge.fast_lookup(lookup)
    assert type(first) is Encoded
    assert first == encode_entry(Entry(9, Attr(9, attr.mode, 1, 7, 8, 10, 1, 1, 2, 3, 0, BLKSIZE), 30.0, 30.0, 5))
    assert bridge.fast_lookup(lookup) is first
    ops.kcache.healthy = False  # the feed broke: nothing is known to be true any more
    assert bridge.fast_lookup(lookup) is MISS
    ops.kcache.healthy = True
    ops.kcache.name_gone(1, b"f")  # this mount unlinked or renamed it
    assert bridge.fast_lookup(lookup) is MISS
    ops.kcache.remember(1, b"f", 9)
    ops._changed_elsewhere([9])  # the feed: the file changed
    assert bridge.fast_lookup(lookup) is MISS


def test_a_dataset_mounts_prefetch_skips_a_version_the_kernel_holds():
    """A later epoch announces files again: one whose pushed version the kernel still holds is
    not fetched again (Prefetcher.in_page_cache); another version, a change the feed reported or
    an inode the kernel forgot is."""
    from types import SimpleNamespace

    from stripefs.client.operations import Operations
    from stripefs.common import protocol as P

    def rsp(size: int, mtime_ns: int) -> P.OpenRsp:
        attr = P.Attr(ino=9, mode=stat.S_IFREG | 0o644, nlink=1, uid=0, gid=0, rdev=0, size=size, atime_ns=1,
                      mtime_ns=mtime_ns, ctime_ns=1)
        return P.OpenRsp(attr=attr, layout=P.Layout(chunk_size=1 << 22, stripe_count=1, redundancy="replicas=1"),
                         chunks=[], nodes=[])

    ops = Operations(SimpleNamespace(writer=0), SimpleNamespace(), attr_timeout=1.0, entry_timeout=1.0,
                     cache_timeout=30.0, dataset=True)
    ops.kcache.remember(1, b"f", 9)  # the kernel knows the inode (a listing)
    assert not ops.in_page_cache(rsp(10, 5))
    ops.prefetched(rsp(10, 5), True)  # pushed into the page cache
    assert ops.in_page_cache(rsp(10, 5))
    assert not ops.in_page_cache(rsp(10, 6))  # another version
    ops._changed_elsewhere([9])
    assert not ops.in_page_cache(rsp(10, 5))
    ops.prefetched(rsp(10, 5), True)
    ops.forget_now([(9, 1)])  # the kernel forgot the inode, and its pages with it
    assert not ops.in_page_cache(rsp(10, 5))


@pytest.mark.parametrize("dataset", [True, False])
def test_a_later_epochs_announcement_of_a_file_the_kernel_holds_is_answered_from_memory(dataset):
    """Prefetch of a path whose pushed version the kernel still holds is skipped without asking the
    daemon (Operations.path_in_page_cache): every name on the way known to the kernel, the version
    one the mount keeps true (dataset: the feed's; default: a callback's). Anything not known,
    changed or forgotten: the prefetcher resolves it as before. Both mount modes."""
    from types import SimpleNamespace

    from stripefs.client.operations import Operations
    from stripefs.common import protocol as P

    attr = P.Attr(ino=9, mode=stat.S_IFREG | 0o644, nlink=1, uid=0, gid=0, rdev=0, size=10, atime_ns=1,
                  mtime_ns=5, ctime_ns=1)
    rsp = P.OpenRsp(attr=attr, layout=P.Layout(chunk_size=1 << 22, stripe_count=1, redundancy="replicas=1"),
                    chunks=[], nodes=[])
    ops = Operations(SimpleNamespace(writer=0), SimpleNamespace(), attr_timeout=1.0, entry_timeout=1.0,
                     cache_timeout=30.0, dataset=dataset)
    ops.kcache.healthy = True
    ops.kcache.remember(1, b"d", 4)  # a listing: the kernel knows d and d/f
    ops.kcache.remember(4, b"f", 9)
    if dataset:
        ops._keep_dataset_info(rsp)
    else:
        ops.kcache.granted(9, 4, b"f", 1)  # held under a callback
        ops._keep_held(9, rsp)
    assert not ops.in_page_cache(rsp) and not ops.path_in_page_cache(1, b"d/f")  # nothing pushed yet
    # what a cold epoch's LookupPathsReq would answer, from the listing the mount kept
    assert ops.known_open_info(1, b"d/f") is rsp and ops.known_open_info(1, b"d/g") is None
    ops.prefetched(rsp, True)
    assert ops.in_page_cache(rsp)
    assert ops.path_in_page_cache(1, b"d/f") and ops.path_in_page_cache(1, b"./d//f") and ops.path_in_page_cache(4, b"f")
    assert not ops.path_in_page_cache(1, b"d/g") and not ops.path_in_page_cache(1, b"d/../d/f")
    assert not ops.path_in_page_cache(1, b"d")  # a directory: no pages
    ops.kcache.healthy = False  # the feed broke: nothing known is true any more
    assert not ops.path_in_page_cache(1, b"d/f")
    ops.kcache.healthy = True
    ops.kcache.apply([9], [], seq=5)  # the feed: the file changed elsewhere (a grant ends with it)
    assert not ops.in_page_cache(rsp) and not ops.path_in_page_cache(1, b"d/f")
    assert ops.known_open_info(1, b"d/f") is None
    if not dataset:  # the grant's end dropped the name too: a new lookup brings both back
        ops.kcache.granted(9, 4, b"f", 6)
        ops.kcache.remember(4, b"f", 9)
    if dataset:
        ops._keep_dataset_info(rsp)
    else:
        ops._keep_held(9, rsp)
    ops.prefetched(rsp, True)
    assert ops.path_in_page_cache(1, b"d/f")
    ops.forget_now([(9, 1)])  # the kernel forgot the inode, and its pages with it
    assert not ops.in_page_cache(rsp) and not ops.path_in_page_cache(1, b"d/f")


def test_the_getattr_lane_answers_only_what_fast_getattr_answers_from_held_bytes():
    """The session's GETATTR lane (lane_getattr): the bytes fast_getattr answers for a file the mount
    holds long, the new ones once its attributes change, and None wherever fast_getattr answers
    otherwise (nothing held, the feed broken):
    those take the ordinary way); and a directory's attributes this mount's last change left
    (dir_attrs: the GETATTR the kernel sends after every create, mkdir or unlink there), the same bytes
    as the ordinary way's. Counted as fast_getattr's answers are."""
    from types import SimpleNamespace

    from stripefs.client import metrics as client_metrics
    from stripefs.client.operations import Operations
    from stripefs.common import protocol as P

    ops = Operations(SimpleNamespace(writer=0), SimpleNamespace(), attr_timeout=1.0, entry_timeout=1.0,
                     cache_timeout=30.0)
    ops.kcache.healthy = True
    bridge = OperationsBridge(ops, None, None)
    getattr_ = parse(Opcode.GETATTR, bytes(16), nodeid=9)
    assert bridge.lane_getattr(9) is None and bridge.fast_getattr(getattr_) is MISS
    old = P.Attr(ino=9, mode=stat.S_IFREG | 0o644, nlink=1, uid=7, gid=8, rdev=0, size=10, atime_ns=1,
                 mtime_ns=2_000_000_001, ctime_ns=3)
    ops._keep_held(9, old)
    counted = client_metrics.fast("getattr")[0]
    assert bridge.lane_getattr(9) == bridge.fast_getattr(getattr_)
    assert client_metrics.fast("getattr")[0] == counted + 2
    new = P.Attr(ino=9, mode=stat.S_IFREG | 0o644, nlink=1, uid=7, gid=8, rdev=0, size=5000, atime_ns=1,
                 mtime_ns=4_000_000_000, ctime_ns=4_000_000_000)
    ops._keep_held(9, new)
    assert bridge.lane_getattr(9) == bridge.fast_getattr(getattr_)
    assert b"\x88\x13" in bridge.lane_getattr(9)  # size 5000, not the old bytes
    dir_attr = P.Attr(ino=4, mode=stat.S_IFDIR | 0o755, nlink=2, uid=0, gid=0, rdev=0, size=0, atime_ns=1,
                      mtime_ns=2, ctime_ns=3)
    ops.kcache.dir_attrs.keep_new(dir_attr)
    dir_getattr = parse(Opcode.GETATTR, bytes(16), nodeid=4)
    assert bridge.lane_getattr(4) == encode_attr_out(*bridge.fast_getattr(dir_getattr))  # (a directory's: not kept encoded)
    ops.kcache.dir_attrs.made_here(4, 7_000_000_005, nlink=1)  # a mkdir answered here: new times, one more link
    body = bridge.lane_getattr(4)
    assert body == encode_attr_out(*bridge.fast_getattr(dir_getattr))
    assert struct.unpack_from("<Q", body, 16 + 32)[0] == 7 and struct.unpack_from("<I", body, 16 + 64)[0] == 3  # mtime s, nlink
    ops.kcache.healthy = False  # the feed broke: nothing held is known true
    assert bridge.lane_getattr(9) is None and bridge.fast_getattr(getattr_) is MISS


def test_the_lookup_lane_answers_what_fast_lookup_answers_from_memory():
    """The session's LOOKUP lane (lane_lookup): a new name in a directory the mount holds whole is
    ENOENT (a create's or mkdir's LOOKUP of its name: answered without the daemon, as fast_lookup
    does), a name held long its entry's bytes, anything else None (the ordinary way: the daemon is
    asked). Counted as fast_lookup's answers are, the errno among them."""
    from types import SimpleNamespace

    from stripefs.client import metrics as client_metrics
    from stripefs.client.operations import Operations
    from stripefs.common import protocol as P

    ops = Operations(SimpleNamespace(writer=0), SimpleNamespace(), attr_timeout=1.0, entry_timeout=1.0,
                     cache_timeout=30.0)
    ops.kcache.healthy = True
    bridge = OperationsBridge(ops, None, None)
    assert bridge.lane_lookup(4, b"new") is None  # the directory is not held: asked
    ops.kcache.granted_dir(4, 1)
    ops._names_complete[4] = {b"old"}
    counted, errs = client_metrics.fast("lookup")[0], client_metrics._fast_errnos.get(("lookup", errno.ENOENT), [0])[0]
    assert bridge.lane_lookup(4, b"new") == errno.ENOENT == bridge.fast_lookup(parse(Opcode.LOOKUP, b"new\0", nodeid=4))
    assert client_metrics.fast("lookup")[0] == counted + 2
    assert client_metrics._fast_errnos[("lookup", errno.ENOENT)][0] == errs + 2
    assert bridge.lane_lookup(4, b"old") is None  # there, not held long: asked
    attr = P.Attr(ino=9, mode=stat.S_IFREG | 0o644, nlink=1, uid=7, gid=8, rdev=0, size=10, atime_ns=1, mtime_ns=2,
                  ctime_ns=3)
    ops._keep_held(9, attr)
    ops.kcache.remember(4, b"old", 9)
    body = bridge.lane_lookup(4, b"old")
    assert body == bridge.fast_lookup(parse(Opcode.LOOKUP, b"old\0", nodeid=4)) and struct.unpack_from("<Q", body)[0] == 9
    ops.kcache.healthy = False  # the feed broke: nothing held is known true
    assert bridge.lane_lookup(4, b"new") is None and bridge.lane_lookup(4, b"old") is None
