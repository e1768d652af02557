"""Names are bytes: any name POSIX allows works through the mount's handlers; the impossible ones get the right errno.

Moved from tests/cluster/test_names.py (which keeps the admin CLI's handling of
such names, through a mount): non-UTF-8 names, control characters, 255-byte
names (create, write, read, readdir, rename, link, unlink, mkdir, rmdir, xattr
names, symlink targets), names over 255 bytes and symlink targets over 4095
(ENAMETOOLONG). With raw requests to the daemon (the kernel never sends them):
NUL and '/' in names (INVALID), and paths over PATH_MAX in LookupPathsReq.
"""

from __future__ import annotations

import errno
import stat

import zmq

from stripefs.common import protocol as P
from stripefs.common.errors import ErrorCode, StripefsError
from stripefs.common.transport import connect

from fsapi import raises_errno

NAMES = [
    b"\xff\xfe\xfd",  # not UTF-8 at all
    b"caf\xe9",  # Latin-1
    b"\xc3\x28",  # an invalid UTF-8 sequence
    b"\xed\xa0\x80",  # an encoded surrogate (invalid UTF-8)
    b"tab\there\nnewline",  # control characters
    b"\x01\x1f\x7f",
    b" -leading space and dash",
    b"\x80" * 255,  # the longest name, all non-UTF-8
    "日本語".encode(),  # valid UTF-8, for contrast
]

#: PATH_MAX: the longest symlink target is one byte less
PATH_MAX = 4096


async def test_any_byte_name_works_end_to_end(fs):
    d = fs.dir
    for i, name in enumerate(NAMES):
        data = b"%d:" % i + name
        ino = await fs.write_file(d, name, data)
        assert (await fs.getattr(ino)).size == len(data)
        assert await fs.read_file(d, name) == data
    assert sorted(await fs.listdir(d)) == sorted(NAMES)

    # rename between non-UTF-8 names, hard link, unlink
    for i, name in enumerate(NAMES):
        new = b"\xfe-renamed-%d-" % i + name[:200]
        await fs.rename(d, name, d, new)
        assert not await fs.exists(d, name)
        await fs.link((await fs.lookup(d, new)).nodeid, d, new + b"\xff")
        assert await fs.read_file(d, new + b"\xff") == b"%d:" % i + name
        await fs.unlink(d, new)
        await fs.unlink(d, new + b"\xff")
    assert await fs.listdir(d) == []

    # directories and symlinks (a non-UTF-8 target, and the longest target)
    sub = await fs.mkdir(d, b"\xff-dir")
    link = await fs.symlink(sub, b"\xfa-link", b"../\xfe\xfd-target")
    assert await fs.readlink(link) == b"../\xfe\xfd-target"
    longest = b"\xe9" * (PATH_MAX - 1)
    long_link = await fs.symlink(sub, b"long-link", longest)
    assert await fs.readlink(long_link) == longest
    assert sorted(await fs.listdir(sub)) == sorted([b"\xfa-link", b"long-link"])

    # xattr names and values are bytes too (after the namespace prefix)
    await fs.setxattr(sub, b"user.\xff\xfe", b"\x00\xff")
    assert await fs.getxattr(sub, b"user.\xff\xfe") == b"\x00\xff"
    assert b"user.\xff\xfe" in await fs.listxattr(sub)

    for name in await fs.listdir(sub):
        await fs.unlink(sub, name)
    await fs.rmdir(d, b"\xff-dir")


async def test_names_and_targets_too_long_get_enametoolong(fs):
    d = fs.dir
    too_long = b"\xff" * 256
    for op in (
        lambda: fs.create(d, too_long),
        lambda: fs.mkdir(d, too_long),
        lambda: fs.symlink(d, too_long, b"t"),
        lambda: fs.lookup(d, too_long),
    ):
        async with raises_errno(errno.ENAMETOOLONG):
            await op()
    f = await fs.write_file(d, b"f", b"")
    async with raises_errno(errno.ENAMETOOLONG):
        await fs.rename(d, b"f", d, too_long)
    async with raises_errno(errno.ENAMETOOLONG):
        await fs.link(f, d, too_long)
    async with raises_errno(errno.ENAMETOOLONG):
        await fs.symlink(d, b"link", b"x" * PATH_MAX)
    assert await fs.listdir(d) == [b"f"]


async def _ask(address: str, requests: list) -> list:
    ctx = zmq.Context()
    try:
        async with connect(ctx, address, timeout=10) as client:
            out = []
            for req in requests:
                try:
                    out.append((await client.call(req))[0])
                except StripefsError as exc:
                    out.append(exc.code)
            return out
    finally:
        ctx.destroy(linger=0)


async def test_raw_requests_with_impossible_names_get_the_right_code(fs):
    """NUL and '/' cannot come through the kernel; a raw request gets INVALID, a name over 255
    bytes NAME_TOO_LONG, a symlink target over 4095 NAME_TOO_LONG, and nothing is created."""
    parent = fs.dir
    await fs.write_file(parent, b"src", b"")
    requests = [
        P.MkdirReq(parent=parent, name=b"a\0b", mode=0o755, uid=0, gid=0),
        P.MkdirReq(parent=parent, name=b"a/b", mode=0o755, uid=0, gid=0),
        P.MkdirReq(parent=parent, name=b"", mode=0o755, uid=0, gid=0),
        P.MkdirReq(parent=parent, name=b"..", mode=0o755, uid=0, gid=0),
        P.MknodReq(parent=parent, name=b"x" * 256, mode=0o100644, rdev=0, uid=0, gid=0),
        P.SymlinkReq(parent=parent, name=b"l", target=b"x" * 4096, uid=0, gid=0),
        P.SymlinkReq(parent=parent, name=b"l", target=b"a\0b", uid=0, gid=0),
        P.RenameReq(parent_old=parent, name_old=b"src", parent_new=parent, name_new=b"a/b"),
        P.LookupReq(parent=parent, name=b"x" * 256),
        P.SetxattrReq(ino=parent, name=b"user.a\0b", value=b""),
    ]
    codes = await _ask(fs.rig.meta_address, requests)
    assert codes == [ErrorCode.INVALID] * 4 + [ErrorCode.NAME_TOO_LONG, ErrorCode.NAME_TOO_LONG, ErrorCode.INVALID,
                                               ErrorCode.INVALID, ErrorCode.NAME_TOO_LONG, ErrorCode.INVALID]
    assert await fs.listdir(parent) == [b"src"]

    # LookupPathsReq: a path over PATH_MAX is not resolvable (None), the others still are
    await fs.write_file(parent, b"ok", b"1")
    deep = b"/".join([b"d" * 200] * 21)  # 4220 bytes
    (rsp,) = await _ask(fs.rig.meta_address, [P.LookupPathsReq(root=parent, paths=[b"ok", deep, b"ok/" + b"y" * 256, b"\xff"])])
    assert [f is not None for f in rsp.files] == [True, False, False, False]


async def test_large_directory_listing(fs):
    """The mount's READDIR across the daemon's pages (SQLite here; the daemon's paging on PostgreSQL is
    tests/unit/test_namespace.py's test_readdir_pages_by_cookie[postgresql])."""
    many = await fs.mkdir(fs.dir, b"many")
    names = {b"f%05d" % i for i in range(2100)}  # the listing spans three of the daemon's pages (1000 names)
    for n in names:
        await fs.mknod(many, n, stat.S_IFREG | 0o644)  # an empty file, made by one MKNOD
    listed = await fs.listdir(many)
    assert len(listed) == len(names) and set(listed) == names  # each name once, across replies and pages
