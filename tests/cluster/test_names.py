"""Names are bytes: any name POSIX allows works through the mount; the impossible ones get the right errno.

Through the real mount: non-UTF-8 names, control characters, 255-byte names
(create, write, read, readdir, rename, link, unlink, mkdir, rmdir, xattr
names, symlink targets), names over 255 bytes and symlink targets over 4095
(ENAMETOOLONG). With raw requests to the daemon (the kernel never sends them):
NUL and '/' in names (INVALID), and paths over PATH_MAX in LookupPathsReq.
The admin CLI prints such names and takes them as arguments without crashing.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys

import pytest
import trio
import zmq

from stripefs.common import protocol as P
from stripefs.common.errors import ErrorCode, StripefsError
from stripefs.common.transport import connect

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


def _b(path) -> bytes:
    return os.fsencode(path)


def test_any_byte_name_works_end_to_end(mnt):
    d = _b(mnt)
    for i, name in enumerate(NAMES):
        path = d + b"/" + name
        data = b"%d:" % i + name
        with open(path, "wb") as f:
            f.write(data)
        assert os.stat(path).st_size == len(data)
        with open(path, "rb") as f:
            assert f.read() == data
    assert sorted(os.listdir(d)) == sorted(NAMES)
    assert sorted(e.name for e in os.scandir(d)) == sorted(NAMES)

    # rename between non-UTF-8 names, hard link, unlink
    for i, name in enumerate(NAMES):
        new = b"\xfe-renamed-%d-" % i + name[:200]
        os.rename(d + b"/" + name, d + b"/" + new)
        assert not os.path.lexists(d + b"/" + name)
        os.link(d + b"/" + new, d + b"/" + new + b"\xff")
        with open(d + b"/" + new + b"\xff", "rb") as f:
            assert f.read() == b"%d:" % i + name
        os.unlink(d + b"/" + new)
        os.unlink(d + b"/" + new + b"\xff")
    assert os.listdir(d) == []

    # directories and symlinks (a non-UTF-8 target, and the longest target)
    sub = d + b"/\xff-dir"
    os.mkdir(sub)
    os.symlink(b"../\xfe\xfd-target", sub + b"/\xfa-link")
    assert os.readlink(sub + b"/\xfa-link") == b"../\xfe\xfd-target"
    longest = b"\xe9" * (os.pathconf(d, "PC_PATH_MAX") - 1)
    os.symlink(longest, sub + b"/long-link")
    assert os.readlink(sub + b"/long-link") == longest
    assert sorted(os.listdir(sub)) == sorted([b"\xfa-link", b"long-link"])

    # xattr names and values are bytes too (after the namespace prefix)
    os.setxattr(sub, b"user.\xff\xfe", b"\x00\xff")
    assert os.getxattr(sub, b"user.\xff\xfe") == b"\x00\xff"
    assert b"user.\xff\xfe" in [_b(n) for n in os.listxattr(sub)]

    for name in os.listdir(sub):
        os.unlink(sub + b"/" + name)
    os.rmdir(sub)


def test_names_and_targets_too_long_get_enametoolong(mnt):
    d = _b(mnt)
    too_long = b"\xff" * 256
    for op in (
        lambda: open(d + b"/" + too_long, "wb"),
        lambda: os.mkdir(d + b"/" + too_long),
        lambda: os.symlink(b"t", d + b"/" + too_long),
        lambda: os.stat(d + b"/" + too_long),
    ):
        with pytest.raises(OSError) as exc:
            op()
        assert exc.value.errno == errno.ENAMETOOLONG
    open(d + b"/f", "wb").close()
    with pytest.raises(OSError) as exc:
        os.rename(d + b"/f", d + b"/" + too_long)
    assert exc.value.errno == errno.ENAMETOOLONG
    with pytest.raises(OSError) as exc:
        os.link(d + b"/f", d + b"/" + too_long)
    assert exc.value.errno == errno.ENAMETOOLONG
    with pytest.raises(OSError) as exc:
        os.symlink(b"x" * 4096, d + b"/link")
    assert exc.value.errno == errno.ENAMETOOLONG
    assert os.listdir(d) == [b"f"]


def _ask(cluster, requests):
    async def run():
        ctx = zmq.Context()
        try:
            async with connect(ctx, cluster.meta_address, timeout=10) as client:
                out = []
                for req in requests:
                    try:
                        out.append((await client.call(req))[0])
                    except StripefsError as exc:
                        out.append(exc.code)
                return out
        finally:
            ctx.term()

    return trio.run(run)


def test_raw_requests_with_impossible_names_get_the_right_code(cluster, mnt):
    """NUL and '/' cannot come through the kernel; a raw request gets INVALID, a name over 255
    bytes NAME_TOO_LONG, a symlink target over 4095 NAME_TOO_LONG, and nothing is created."""
    parent = os.stat(mnt).st_ino
    (mnt / "src").write_bytes(b"")
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
    codes = _ask(cluster, requests)
    assert codes == [ErrorCode.INVALID] * 4 + [ErrorCode.NAME_TOO_LONG, ErrorCode.NAME_TOO_LONG, ErrorCode.INVALID,
                                               ErrorCode.INVALID, ErrorCode.NAME_TOO_LONG, ErrorCode.INVALID]
    assert os.listdir(mnt) == ["src"]

    # LookupPathsReq: a path over PATH_MAX is not resolvable (None), the others still are
    (mnt / "ok").write_bytes(b"1")
    deep = b"/".join([b"d" * 200] * 21)  # 4220 bytes
    (rsp,) = _ask(cluster, [P.LookupPathsReq(root=parent, paths=[b"ok", deep, b"ok/" + b"y" * 256, b"\xff"])])
    assert [f is not None for f in rsp.files] == [True, False, False, False]


def test_admin_cli_takes_and_prints_non_utf8_names(cluster, mnt):
    d = _b(mnt) + b"/\xff\xfe-layout"
    os.mkdir(d)
    res = subprocess.run([sys.executable, "-m", "stripefs", "layout", "get", d], capture_output=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith(d + b": chunk_size=")  # the same bytes back, as ls prints them
    res = subprocess.run([sys.executable, "-m", "stripefs", "layout", "get", "--meta", cluster.meta_address,
                          b"/" + os.path.relpath(d, _b(cluster.mnt))], capture_output=True, timeout=120)
    assert res.returncode == 0, res.stderr
    too_long = b"/" + b"/".join([b"e" * 200] * 21)
    res = subprocess.run([sys.executable, "-m", "stripefs", "layout", "get", "--meta", cluster.meta_address, too_long],
                         capture_output=True, timeout=120)
    assert res.returncode == 1 and b"File name too long" in res.stderr and b"Traceback" not in res.stderr
    res = subprocess.run([sys.executable, "-m", "stripefs", "status", d], capture_output=True, timeout=120)
    assert res.returncode == 0, res.stderr
