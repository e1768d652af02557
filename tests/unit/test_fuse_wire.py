"""The FUSE wire format (stripefs.client.fuse: abi, requests, replies, notify), byte for byte.

Expected bytes are spelled here field by field from the kernel's fuse.h (``u32``/``u64`` below),
not with the package's own structs, so a wrong struct in abi.py fails these tests instead of
agreeing with itself. Every opcode the package parses has a golden request, and every proper
prefix of its arguments is checked against the failure policy (requests.py docstring).
"""

from __future__ import annotations

import errno
import stat

import pytest

from stripefs.client.fuse import abi, notify, requests as rq
from stripefs.client.fuse.abi import InitFlag, Opcode
from stripefs.client.fuse.replies import (AlreadyAnswered, Attr, DirentBuffer, Entry, Reply, Statfs,
                                          encode_init, encode_init_version_only)
from stripefs.client.fuse.session import Options, SessionError, negotiate


def u16(v: int) -> bytes:
    return v.to_bytes(2, "little")


def u32(v: int) -> bytes:
    return v.to_bytes(4, "little", signed=v < 0)


def u64(v: int) -> bytes:
    return v.to_bytes(8, "little", signed=v < 0)


UNIQUE, NODEID, UID, GID, PID = 0x1122334455667788, 42, 1000, 1001, 4242


def request(opcode: int, args: bytes, *, unique: int = UNIQUE, nodeid: int = NODEID, extlen: int = 0) -> bytes:
    """fuse_in_header (len opcode unique nodeid uid gid pid total_extlen padding) and the arguments."""
    return (u32(40 + len(args)) + u32(opcode) + u64(unique) + u64(nodeid) + u32(UID) + u32(GID) + u32(PID)
            + u16(extlen) + u16(0) + args)


def header(opcode: int, args_len: int, unique: int = UNIQUE, nodeid: int = NODEID, extlen: int = 0) -> rq.InHeader:
    return rq.InHeader(40 + args_len, opcode, unique, nodeid, UID, GID, PID, extlen)


def parse(data: bytes, ctx: rq.ParseContext = rq.ParseContext()):
    return rq.parse(data, len(data), ctx)


# (opcode, argument bytes, the request they parse to, given the header) for every opcode parsed
GOLDEN = [
    (Opcode.LOOKUP, b"name\0", lambda h: rq.Lookup(h, b"name")),
    (Opcode.FORGET, u64(7), lambda h: rq.Forget(h, 7)),
    (Opcode.GETATTR, u32(1) + u32(0) + u64(99), lambda h: rq.Getattr(h, 1, 99)),
    (Opcode.SETATTR, u32(0x3F) + u32(0) + u64(5) + u64(4096) + u64(77) + u64(10) + u64(20) + u64(30)
     + u32(1) + u32(2) + u32(3) + u32(0o100644) + u32(0) + u32(11) + u32(12) + u32(0),
     lambda h: rq.Setattr(h, 0x3F, 5, 4096, 77, 10, 20, 30, 1, 2, 3, 0o100644, 11, 12)),
    (Opcode.READLINK, b"", lambda h: rq.Readlink(h)),
    (Opcode.SYMLINK, b"link\0target/x\0", lambda h: rq.Symlink(h, b"link", b"target/x")),
    (Opcode.MKNOD, u32(0o10644) + u32(3) + u32(0o022) + u32(0) + b"fifo\0", lambda h: rq.Mknod(h, 0o10644, 3, 0o022, b"fifo")),
    (Opcode.MKDIR, u32(0o755) + u32(0o022) + b"d\0", lambda h: rq.Mkdir(h, 0o755, 0o022, b"d")),
    (Opcode.UNLINK, b"f\0", lambda h: rq.Unlink(h, b"f")),
    (Opcode.RMDIR, b"d\0", lambda h: rq.Unlink(h, b"d")),
    (Opcode.RENAME, u64(9) + b"a\0b\0", lambda h: rq.Rename(h, 9, 0, b"a", b"b")),
    (Opcode.RENAME2, u64(9) + u32(1) + u32(0) + b"a\0b\0", lambda h: rq.Rename(h, 9, 1, b"a", b"b")),
    (Opcode.LINK, u64(8) + b"hard\0", lambda h: rq.Link(h, 8, b"hard")),
    (Opcode.OPEN, u32(0o100002) + u32(1), lambda h: rq.Open(h, 0o100002, 1)),
    (Opcode.READ, u64(3) + u64(8192) + u32(4096) + u32(2) + u64(55) + u32(0o100000) + u32(0),
     lambda h: rq.Read(h, 3, 8192, 4096, 2, 55, 0o100000)),
    (Opcode.WRITE, u64(3) + u64(10) + u32(5) + u32(1) + u64(0) + u32(2) + u32(0) + b"hello",
     lambda h: rq.Write(h, 3, 10, 5, 1, 0, 2, b"hello")),
    (Opcode.STATFS, b"", lambda h: rq.Statfs(h)),
    (Opcode.RELEASE, u64(3) + u32(0o100000) + u32(1) + u64(66), lambda h: rq.Release(h, 3, 0o100000, 1, 66)),
    (Opcode.FSYNC, u64(3) + u32(1) + u32(0), lambda h: rq.Fsync(h, 3, 1)),
    (Opcode.SETXATTR, u32(3) + u32(1) + b"user.a\0xyz", lambda h: rq.Setxattr(h, 3, 1, 0, b"user.a", b"xyz")),
    (Opcode.GETXATTR, u32(64) + u32(0) + b"user.a\0", lambda h: rq.Getxattr(h, 64, b"user.a")),
    (Opcode.LISTXATTR, u32(0) + u32(0), lambda h: rq.Listxattr(h, 0)),
    (Opcode.REMOVEXATTR, b"user.a\0", lambda h: rq.Removexattr(h, b"user.a")),
    (Opcode.FLUSH, u64(3) + u32(0) + u32(0) + u64(66), lambda h: rq.Flush(h, 3, 66)),
    (Opcode.INIT, u32(7) + u32(45) + u32(131072) + u32(InitFlag.INIT_EXT | InitFlag.ASYNC_READ)
     + u32(1 << (37 - 32)) + bytes(44),
     lambda h: rq.Init(h, 7, 45, 131072, InitFlag.INIT_EXT | InitFlag.ASYNC_READ | InitFlag.PASSTHROUGH)),
    (Opcode.OPENDIR, u32(0o200000) + u32(0), lambda h: rq.Open(h, 0o200000, 0)),
    (Opcode.READDIR, u64(4) + u64(2) + u32(4096) + u32(0) + u64(0) + u32(0) + u32(0),
     lambda h: rq.Read(h, 4, 2, 4096, 0, 0, 0)),
    (Opcode.RELEASEDIR, u64(4) + u32(0) + u32(0) + u64(0), lambda h: rq.Release(h, 4, 0, 0, 0)),
    (Opcode.FSYNCDIR, u64(4) + u32(0) + u32(0), lambda h: rq.Fsync(h, 4, 0)),
    (Opcode.GETLK, u64(3) + u64(0xAB) + u64(0) + u64(100) + u32(1) + u32(77) + u32(0) + u32(0),
     lambda h: rq.Lk(h, 3, 0xAB, 0, 100, 1, 77, 0)),
    (Opcode.SETLK, u64(3) + u64(0xAB) + u64(0) + u64(100) + u32(1) + u32(77) + u32(1) + u32(0),
     lambda h: rq.Lk(h, 3, 0xAB, 0, 100, 1, 77, 1)),
    (Opcode.SETLKW, u64(3) + u64(0xAB) + u64(5) + u64(6) + u32(2) + u32(78) + u32(0) + u32(0),
     lambda h: rq.Lk(h, 3, 0xAB, 5, 6, 2, 78, 0)),
    (Opcode.ACCESS, u32(4) + u32(0), lambda h: rq.Access(h, 4)),
    (Opcode.CREATE, u32(0o100101) + u32(0o100644) + u32(0o022) + u32(0) + b"new\0",
     lambda h: rq.Create(h, 0o100101, 0o100644, 0o022, 0, b"new")),
    (Opcode.INTERRUPT, u64(UNIQUE - 2), lambda h: rq.Interrupt(h, UNIQUE - 2)),
    (Opcode.BMAP, u64(12) + u32(4096) + u32(0), lambda h: rq.Bmap(h, 12, 4096)),
    (Opcode.DESTROY, b"", lambda h: rq.Destroy(h)),
    (Opcode.IOCTL, u64(3) + u32(0) + u32(0x5401) + u64(0xFFFF0000) + u32(2) + u32(60) + b"ab",
     lambda h: rq.Ioctl(h, 3, 0, 0x5401, 0xFFFF0000, 2, 60, b"ab")),
    (Opcode.POLL, u64(3) + u64(9) + u32(1) + u32(0x41), lambda h: rq.Poll(h, 3, 9, 1, 0x41)),
    (Opcode.NOTIFY_REPLY, u64(0) + u64(4096) + u32(3) + u32(0) + u64(0) + u64(0) + b"abc",
     lambda h: rq.NotifyReply(h, 4096, 3, b"abc")),
    (Opcode.BATCH_FORGET, u32(2) + u32(0) + u64(5) + u64(1) + u64(6) + u64(2),
     lambda h: rq.BatchForget(h, ((5, 1), (6, 2)), True)),
    (Opcode.FALLOCATE, u64(3) + u64(0) + u64(1 << 20) + u32(1) + u32(0), lambda h: rq.Fallocate(h, 3, 0, 1 << 20, 1)),
    (Opcode.READDIRPLUS, u64(4) + u64(0) + u32(4096) + u32(0) + u64(0) + u32(0) + u32(0),
     lambda h: rq.Read(h, 4, 0, 4096, 0, 0, 0)),
    (Opcode.LSEEK, u64(3) + u64(100) + u32(3) + u32(0), lambda h: rq.Lseek(h, 3, 100, 3)),
    (Opcode.COPY_FILE_RANGE, u64(1) + u64(2) + u64(3) + u64(4) + u64(5) + u64(6) + u64(0),
     lambda h: rq.CopyFileRange(h, 1, 2, 3, 4, 5, 6, 0)),
    (Opcode.SYNCFS, u64(0), lambda h: rq.Syncfs(h)),
]


def test_every_parsed_opcode_has_a_golden_request():
    parsed = {op for op, parser in enumerate(rq.PARSERS) if parser is not None}
    assert parsed == {op for op, _, _ in GOLDEN}


@pytest.mark.parametrize("opcode,args,expected", GOLDEN, ids=[op.name for op, _, _ in GOLDEN])
def test_golden_request(opcode, args, expected):
    assert parse(request(opcode, args)) == expected(header(opcode, len(args)))


def _prefix_parses(opcode: int, k: int) -> bool:
    """Which proper prefixes of the golden arguments are still a whole request (the failure policy)."""
    if opcode == Opcode.INIT:
        return k >= 16  # a kernel before 7.36 sends the 16-byte fuse_init_in
    if opcode == Opcode.BATCH_FORGET:
        return k >= 8  # applied as far as it goes
    return False


@pytest.mark.parametrize("opcode,args,expected", GOLDEN, ids=[op.name for op, _, _ in GOLDEN])
def test_every_truncated_prefix(opcode, args, expected):
    for k in range(len(args)):
        got = parse(request(opcode, args[:k]))
        if _prefix_parses(opcode, k):
            assert not isinstance(got, rq.Malformed), (k, got)
        else:
            assert isinstance(got, rq.Malformed) and got.errno == errno.EIO, (k, got)
            assert got.header.unique == UNIQUE  # answered to that request alone


def test_truncated_batch_forget_is_applied_as_far_as_it_goes():
    args = u32(3) + u32(0) + u64(5) + u64(1) + u64(6) + u64(2) + u64(7)[:4]
    assert parse(request(Opcode.BATCH_FORGET, args)) == rq.BatchForget(header(Opcode.BATCH_FORGET, len(args)),
                                                                        ((5, 1), (6, 2)), False)


def test_init_before_7_36_has_no_flags2():
    args = u32(7) + u32(31) + u32(65536) + u32(InitFlag.ASYNC_READ | InitFlag.PARALLEL_DIROPS)
    assert parse(request(Opcode.INIT, args)) == rq.Init(header(Opcode.INIT, 16), 7, 31, 65536,
                                                        InitFlag.ASYNC_READ | InitFlag.PARALLEL_DIROPS)


def test_bad_headers_end_the_session():
    good = request(Opcode.GETATTR, bytes(16))
    for k in range(40):
        with pytest.raises(rq.BadHeader):
            rq.parse(good[:k], k)
    with pytest.raises(rq.BadHeader):  # len says 56, 40 bytes read
        rq.parse(good[:40], 40)
    with pytest.raises(rq.BadHeader):  # more extension bytes than the request holds
        parse(request(Opcode.GETATTR, bytes(16), extlen=3))


def test_unknown_and_unserved_opcodes_are_unsupported():
    for opcode in (7, 19, Opcode.STATX, Opcode.TMPFILE, Opcode.SETUPMAPPING, Opcode.COPY_FILE_RANGE_64, 4096, 99999):
        got = parse(request(opcode, bytes(24)))
        assert got == rq.Unsupported(header(opcode, 24))


def test_offsets_past_2_63_are_einval():
    big = 1 << 63
    cases = [
        (Opcode.READ, u64(3) + u64(big) + u32(1) + u32(0) + u64(0) + u32(0) + u32(0)),
        (Opcode.WRITE, u64(3) + u64(big - 2) + u32(5) + u32(0) + u64(0) + u32(0) + u32(0) + b"hello"),
        (Opcode.LSEEK, u64(3) + u64(big) + u32(0) + u32(0)),
        (Opcode.FALLOCATE, u64(3) + u64(big - 1) + u64(2) + u32(0) + u32(0)),
    ]
    for opcode, args in cases:
        got = parse(request(opcode, args))
        assert isinstance(got, rq.Malformed) and got.errno == errno.EINVAL, opcode


def test_payload_size_mismatches_are_eio():
    long_write = u64(3) + u64(0) + u32(4) + u32(0) + u64(0) + u32(0) + u32(0) + b"hello"
    assert parse(request(Opcode.WRITE, long_write)).errno == errno.EIO
    long_value = u32(2) + u32(0) + b"user.a\0xyz"
    assert parse(request(Opcode.SETXATTR, long_value)).errno == errno.EIO


def test_extensions_are_stripped():
    args = b"name\0" + bytes(3)  # padded to 8, then one 8-byte extension
    got = parse(request(Opcode.LOOKUP, args + bytes(8), extlen=1))
    assert got.name == b"name" and got.header.total_extlen == 1


def test_setxattr_ext_layout():
    args = u32(3) + u32(1) + u32(1) + u32(0) + b"user.a\0xyz"
    got = parse(request(Opcode.SETXATTR, args), rq.ParseContext(setxattr_ext=True))
    assert got == rq.Setxattr(header(Opcode.SETXATTR, len(args)), 3, 1, 1, b"user.a", b"xyz")


def test_requests_outlive_the_buffer():
    buf = bytearray(request(Opcode.WRITE, u64(3) + u64(0) + u32(5) + u32(0) + u64(0) + u32(0) + u32(0) + b"hello"))
    got = rq.parse(buf, len(buf))
    buf[-5:] = b"XXXXX"
    assert got.data == b"hello" and type(got.data) is bytes


# -- replies ---------------------------------------------------------------------------------------


class Recorder:
    def __init__(self):
        self.sent: list[bytes] = []

    def __call__(self, unique, parts):
        self.sent.append(b"".join(parts))


def out(unique: int, error: int, body: bytes = b"") -> bytes:
    return u32(16 + len(body)) + u32(error) + u64(unique) + body


ATTR = Attr(ino=42, mode=stat.S_IFREG | 0o644, nlink=1, uid=1000, gid=1001, size=5000, blocks=16,
            atime_ns=1_700_000_000_123_456_789, mtime_ns=1_700_000_001_000_000_001, ctime_ns=1_700_000_002_000_000_000,
            rdev=0, blksize=4096, flags=0)
ATTR_BYTES = (u64(42) + u64(5000) + u64(16) + u64(1_700_000_000) + u64(1_700_000_001) + u64(1_700_000_002)
              + u32(123_456_789) + u32(1) + u32(0) + u32(0o100644) + u32(1) + u32(1000) + u32(1001) + u32(0)
              + u32(4096) + u32(0))
ENTRY = Entry(42, ATTR, entry_valid=2.5, attr_valid=1.0, generation=3)
ENTRY_BYTES = u64(42) + u64(3) + u64(2) + u64(1) + u32(500_000_000) + u32(0) + ATTR_BYTES


def reply(unique: int = 7) -> tuple[Reply, Recorder]:
    rec = Recorder()
    return Reply(unique, rec), rec


@pytest.mark.parametrize("answer,body", [
    (lambda r: r.entry(ENTRY), ENTRY_BYTES),
    (lambda r: r.attr(ATTR, 0.25), u64(0) + u32(250_000_000) + u32(0) + ATTR_BYTES),
    (lambda r: r.open(9, abi.OpenFlag.KEEP_CACHE | abi.OpenFlag.NOFLUSH), u64(9) + u32(0b100010) + u32(0)),
    (lambda r: r.open(9, abi.OpenFlag.PASSTHROUGH, backing_id=4), u64(9) + u32(1 << 7) + u32(4)),
    (lambda r: r.create(ENTRY, 9, 0), ENTRY_BYTES + u64(9) + u32(0) + u32(0)),
    (lambda r: r.data(b"bytes"), b"bytes"),
    (lambda r: r.data(b""), b""),
    (lambda r: r.ok(), b""),
    (lambda r: r.write(4096), u32(4096) + u32(0)),
    (lambda r: r.statfs(Statfs(100, 50, 40, 1000, 900, 4096)),
     u64(100) + u64(50) + u64(40) + u64(1000) + u64(900) + u32(4096) + u32(255) + u32(4096) + u32(0) + bytes(24)),
    (lambda r: r.xattr(b"value", 0), u32(5) + u32(0)),
    (lambda r: r.xattr(b"value", 64), b"value"),
    (lambda r: r.lock(0, 100, 1, 77), u64(0) + u64(100) + u32(1) + u32(77)),
    (lambda r: r.bmap(12), u64(12)),
    (lambda r: r.lseek(300), u64(300)),
    (lambda r: r.poll(0x41), u32(0x41) + u32(0)),
    (lambda r: r.ioctl(0, b"xy"), u32(0) + u32(0) + u32(0) + u32(0) + b"xy"),
    (lambda r: r.ioctl(-1), u32(-1) + u32(0) + u32(0) + u32(0)),
])
def test_golden_reply(answer, body):
    r, rec = reply()
    answer(r)
    assert rec.sent == [out(7, 0, body)] and r.sent


def test_error_replies():
    r, rec = reply()
    r.error(errno.ENOENT)
    assert rec.sent == [out(7, -errno.ENOENT)]
    r, rec = reply()
    r.xattr(b"value", 3)  # the caller's buffer is too small
    assert rec.sent == [out(7, -errno.ERANGE)]
    r, rec = reply()
    r.error(0)  # no such thing as a successful error: EIO
    assert rec.sent == [out(7, -errno.EIO)]


def test_a_second_answer_raises():
    r, rec = reply()
    r.ok()
    with pytest.raises(AlreadyAnswered):
        r.error(errno.EIO)
    assert len(rec.sent) == 1


def test_negative_times_pack():
    r, rec = reply()
    r.attr(ATTR._replace(mtime_ns=-1), 0)  # one nanosecond before the epoch: -1 s + 999999999 ns
    body = rec.sent[0][16 + 16:]
    assert body[32:40] == u64(-1) and body[52:56] == u32(999_999_999)


def test_dirents_are_padded_and_stop_when_full():
    buf = DirentBuffer(24 + 8 + 24 + 8)
    assert buf.add(b"a", 1, 2, stat.S_IFREG)
    assert buf.add(b"dir123456", 2, 3, stat.S_IFDIR) is False  # 24 + 9 bytes, padded to 40: 32 left
    assert buf.add(b"dir1234", 2, 3, stat.S_IFDIR)
    assert buf.add(b"x", 3, 4, stat.S_IFREG) is False
    assert buf.getvalue() == (u64(2) + u64(1) + u32(1) + u32(8) + b"a" + bytes(7)
                              + u64(3) + u64(2) + u32(7) + u32(4) + b"dir1234" + bytes(1))


def test_direntplus_carries_the_entry():
    buf = DirentBuffer(4096, plus=True)
    assert buf.add(b"file", 1, 42, ATTR.mode, ENTRY)
    assert buf.add(b"..", 2, 1, stat.S_IFDIR, None)
    assert buf.getvalue() == (ENTRY_BYTES + u64(42) + u64(1) + u32(4) + u32(8) + b"file" + bytes(4)
                              + bytes(128) + u64(1) + u64(2) + u32(2) + u32(4) + b".." + bytes(6))


# -- INIT ------------------------------------------------------------------------------------------


def init_request(minor: int, flags: int, max_readahead: int = 131072) -> rq.Init:
    return rq.Init(header(Opcode.INIT, 64), 7, minor, max_readahead, flags)


def test_init_at_the_current_minor():
    offered = (InitFlag.ASYNC_READ | InitFlag.PARALLEL_DIROPS | InitFlag.NO_OPEN_SUPPORT | InitFlag.MAX_PAGES
               | InitFlag.INIT_EXT | InitFlag.WRITEBACK_CACHE | InitFlag.PASSTHROUGH | InitFlag.AUTO_INVAL_DATA)
    conn, body = negotiate(init_request(45, offered), Options(max_write=1 << 20, max_background=64), 256)
    wanted = (InitFlag.ASYNC_READ | InitFlag.PARALLEL_DIROPS | InitFlag.NO_OPEN_SUPPORT | InitFlag.MAX_PAGES
              | InitFlag.INIT_EXT | InitFlag.AUTO_INVAL_DATA)
    assert conn.minor == 45 and conn.flags == wanted and conn.kernel_flags == offered
    assert (conn.max_pages, conn.max_write, conn.max_background, conn.congestion_threshold) == (256, 1 << 20, 64, 48)
    assert body == (u32(7) + u32(45) + u32(131072) + u32(wanted) + u16(64) + u16(48) + u32(1 << 20) + u32(1)
                    + u16(256) + u16(0) + u32(0) + u32(0) + u16(0) + bytes(22))


def test_max_pages_is_capped_by_the_kernels_limit():
    conn, body = negotiate(init_request(45, InitFlag.MAX_PAGES), Options(max_write=8 << 20), 32)
    assert conn.max_pages == 32 and conn.max_write == 32 * 4096
    assert body[28:30] == u16(32) and body[20:24] == u32(32 * 4096)


def test_flags2_is_sent_only_with_init_ext():
    passthrough = InitFlag.PASSTHROUGH
    opts = Options(want=passthrough | InitFlag.INIT_EXT)
    conn, body = negotiate(init_request(45, passthrough | InitFlag.INIT_EXT), opts, 256)
    assert body[12:16] == u32(InitFlag.INIT_EXT) and body[32:36] == u32(1 << 5)
    conn, body = negotiate(init_request(45, passthrough), opts, 256)
    assert conn.flags == 0 and body[32:36] == u32(0)  # a kernel that sent no INIT_EXT did not offer the high bits


def test_passthrough_is_negotiated_with_a_stack_depth_and_never_with_writeback_cache(caplog):
    offered = InitFlag.PASSTHROUGH | InitFlag.INIT_EXT | InitFlag.WRITEBACK_CACHE
    conn, body = negotiate(init_request(45, offered), Options(want=InitFlag.PASSTHROUGH | InitFlag.INIT_EXT), 256)
    assert conn.passthrough and conn.max_stack_depth == 1
    assert body[32:36] == u32(1 << 5) and body[36:40] == u32(1)  # flags2 PASSTHROUGH, max_stack_depth 1
    conn, body = negotiate(init_request(45, offered), Options(want=InitFlag.INIT_EXT), 256)
    assert not conn.passthrough and body[36:40] == u32(0)  # not asked: no depth either
    for opts in (Options(want=InitFlag.PASSTHROUGH | InitFlag.INIT_EXT | InitFlag.WRITEBACK_CACHE),
                 Options(want=InitFlag.PASSTHROUGH | InitFlag.INIT_EXT, max_stack_depth=0),
                 Options(want=InitFlag.PASSTHROUGH | InitFlag.INIT_EXT, max_stack_depth=3)):
        conn, body = negotiate(init_request(45, offered), opts, 256)
        assert not conn.passthrough and body[32:36] == u32(0) and body[36:40] == u32(0)  # the kernel would ignore it
    assert "passthrough not asked" in caplog.text


def test_init_at_an_old_minor():
    offered = InitFlag.ASYNC_READ | InitFlag.BIG_WRITES | InitFlag.AUTO_INVAL_DATA
    conn, body = negotiate(init_request(22, offered, max_readahead=65536), Options(max_readahead=1 << 20), 256)
    assert conn.minor == 22 and conn.max_readahead == 65536 and conn.max_pages == 32
    # a 7.22 kernel reads 24 bytes (FUSE_COMPAT_22_INIT_OUT_SIZE): no time_gran, no max_pages
    assert body == u32(7) + u32(22) + u32(65536) + u32(offered) + u16(64) + u16(48) + u32(32 * 4096)


def test_init_out_sizes():
    assert [abi.init_out_size(m) for m in (4, 5, 22, 23, 45)] == [8, 24, 24, 64, 64]


def test_too_old_a_kernel_is_refused():
    with pytest.raises(SessionError, match="7.11"):
        negotiate(init_request(11, 0), Options(), 256)
    with pytest.raises(SessionError):
        negotiate(rq.Init(header(Opcode.INIT, 16), 6, 99, 0, 0), Options(), 256)


def test_a_newer_major_gets_our_version_only():
    assert encode_init_version_only() == u32(7) + u32(45)
    assert len(encode_init(45, 0, 0, 1, 1, 4096)) == 64


# -- notifications ---------------------------------------------------------------------------------


def notification(code: int, body: bytes) -> bytes:
    return u32(16 + len(body)) + u32(code) + u64(0) + body


def test_notify_encodings():
    assert b"".join(notify.inval_inode(42, 4096, 8192)) == notification(2, u64(42) + u64(4096) + u64(8192))
    assert b"".join(notify.inval_inode(42, -1, 0)) == notification(2, u64(42) + u64(-1) + u64(0))
    assert b"".join(notify.inval_entry(1, b"name")) == notification(3, u64(1) + u32(4) + u32(0) + b"name\0")
    assert b"".join(notify.inval_entry(1, b"n", expire_only=True)) == notification(3, u64(1) + u32(1) + u32(1) + b"n\0")
    assert b"".join(notify.delete(1, 42, b"gone")) == notification(6, u64(1) + u64(42) + u32(4) + u32(0) + b"gone\0")
    assert b"".join(notify.store(42, 8192, b"data")) == notification(4, u64(42) + u64(8192) + u32(4) + u32(0) + b"data")
    assert b"".join(notify.retrieve(5, 42, 0, 4096)) == notification(5, u64(5) + u64(42) + u64(0) + u32(4096) + u32(0))


def test_notify_gates():
    notify.check(abi.NotifyCode.STORE, 45, 0)
    with pytest.raises(notify.NotSupported):
        notify.check(abi.NotifyCode.STORE, 14, 0)
    with pytest.raises(notify.NotSupported):
        notify.check(abi.NotifyCode.DELETE, 17, 0)
    with pytest.raises(notify.NotSupported):
        notify.check(abi.NotifyCode.INVAL_ENTRY, 45, 0, expire_only=True)
    notify.check(abi.NotifyCode.INVAL_ENTRY, 45, InitFlag.HAS_EXPIRE_ONLY, expire_only=True)


def test_ioctl_numbers():
    assert abi.FUSE_DEV_IOC_CLONE == 0x8004E500
    assert abi.FUSE_DEV_IOC_BACKING_OPEN == 0x4010E501
    assert abi.FUSE_DEV_IOC_BACKING_CLOSE == 0x4004E502
