#!/usr/bin/env python3
"""Server CPU per hot request: the mount's own FUSE session (stripefs.client.fuse) against pyfuse3 + trio.

    python bench/fuse_session_cpu.py [--requests 100000]

Each server holds one file and answers from memory; the file's attributes are given a zero timeout
(the root's an hour), so every ``os.stat`` of the file from this process (one synchronous client)
is one GETATTR that reaches the server. The figure is the server process's CPU time (user + system, from
/proc/PID/stat) over the timed stats, divided by the GETATTRs the server counted: the whole cost
of a request to the server, the device read and reply write included. The issue's goal for a
hot request is 10 us or less (issue 29; libfuse's C hello_ll measured 4.9 us on this kind of
machine, pyfuse3 27-31 us).

Servers: ``floor``: a bare loop on the device answering from prepacked bytes (what the
interpreter costs at the least, on this machine today); ``own``: client.fuse's session, the GETATTR answered on its reader thread (fast path);
``own-prepacked``: the same, the attributes kept encoded (``replies.Encoded``); ``own-lane``: the
same bytes answered by the session's GETATTR lane (from the header alone: no request object, no
dispatch; client/fuse/session.py);
``pyfuse3``: pyfuse3's loop under trio with an async ``getattr``, as the stripefs mount today.
Each runs in a process of its own (``--serve KIND MOUNTPOINT``), mounted in a temporary directory.

Then (``--hot-path``, or ``--only-hot-path`` alone) the mount's own hot requests above the device, in
this process: the request bytes parsed and served by the session's ``_handle``, the dispatcher,
client/operations_bridge.py and the real ``Operations`` (a file held under a callback, the feed in
order), the answer written to a device that keeps it; no kernel, no syscall. Per request kind, the
best and worst of 5 runs: GETATTR of the held file (through ``_handle``, and as the session's
GETATTR lane answers it), IOCTL TCGETS (a buffered open's isatty(),
answered by the session itself: ``Options.ioctls``), an OPEN + RELEASE pair (the default
mount's warm file), a READDIRPLUS page of 100 held files (a cold index walk's, also right after
the kernel forgot them: drop_caches), and an empty file's create on the default (no-open) mount in a directory it
holds whole, per file: the four requests the kernel sends (LOOKUP of the new name, CREATE, the
close's FLUSH, the directory's GETATTR), answered on the reader thread (client/async_dirops.py;
the batch is never sent). What the session and the handlers cost, without the kernel's part.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import signal
import stat
import subprocess
import sys
import tempfile
import time

NAME = b"f"
DATA = b"x" * 4096


def _serve_own(mnt: str, prepacked: bool = False, lane: bool = False) -> None:
    from stripefs.client.fuse import abi
    from stripefs.client.fuse.device import Device
    from stripefs.client.fuse.dispatch import Dispatcher
    from stripefs.client.fuse.mount import mount, unmount
    from stripefs.client.fuse.replies import Attr, Encoded, Entry, encode_attr_out
    from stripefs.client.fuse.session import Session

    root = Attr(abi.ROOT_ID, stat.S_IFDIR | 0o755, nlink=2)
    f = Attr(2, stat.S_IFREG | 0o644, size=len(DATA))
    f_packed = Encoded(encode_attr_out(f, 0.0))

    class FS:
        def fast_lookup(self, req):
            if req.header.nodeid == abi.ROOT_ID and req.name == NAME:
                return Entry(2, f, 3600.0, 0.0)
            raise FileNotFoundError(errno.ENOENT, "no")

        def fast_getattr(self, req):
            if req.header.nodeid == abi.ROOT_ID:
                return root, 3600.0
            return f_packed if prepacked else (f, 0.0)

        if lane:
            def lane_getattr(self, nodeid):
                return f_packed if nodeid == 2 else None

    m = mount(mnt, ["default_permissions"], fsname="bench", subtype="bench")
    dev = Device(m.fd)
    session = Session(dev, Dispatcher(FS()), on_close=lambda: unmount(m, dev))
    session.start()
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    print("ready", flush=True)
    while not stop and not session.wait(0.2):
        pass
    session.close()
    print(json.dumps({"getattr": session.counts[abi.Opcode.GETATTR]}), flush=True)


def _serve_floor(mnt: str) -> None:
    """The floor on this machine: a bare loop on the device answering from prepacked bytes (the issue's
    "plain Python loop", 6.6 us where pyfuse3 took 27-31 us): no request objects, no reply objects."""
    import struct

    from stripefs.client.fuse import abi, requests as rq
    from stripefs.client.fuse.mount import mount, unmount
    from stripefs.client.fuse.replies import Attr, encode_attr_out, encode_entry, Entry
    from stripefs.client.fuse.session import Options, negotiate

    m = mount(mnt, ["default_permissions"], fsname="bench", subtype="bench")
    fd, buf = m.fd, bytearray(1 << 21)
    out = abi.FUSE_OUT_HEADER
    n = os.readv(fd, [buf])
    init = rq.parse(buf, n)
    _, body = negotiate(init, Options(), 256)
    os.writev(fd, [out.pack(16 + len(body), 0, init.header.unique), body])
    root = encode_attr_out(Attr(abi.ROOT_ID, stat.S_IFDIR | 0o755, nlink=2), 3600.0)
    f_attr = encode_attr_out(Attr(2, stat.S_IFREG | 0o644, size=len(DATA)), 0.0)
    f_entry = encode_entry(Entry(2, Attr(2, stat.S_IFREG | 0o644, size=len(DATA)), 3600.0, 0.0))
    head = struct.Struct("<IIQQ")
    counts = {"getattr": 0}
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: (stop.append(1), unmount(m)))
    print("ready", flush=True)
    bufs, readv, writev = [buf], os.readv, os.writev
    while True:
        try:
            n = readv(fd, bufs)
        except OSError as e:
            if e.errno in (errno.EINTR, errno.ENOENT, errno.EAGAIN) and not stop:
                continue
            break
        _, opcode, unique, nodeid = head.unpack_from(buf)
        if opcode == 3:  # GETATTR
            counts["getattr"] += 1
            body = root if nodeid == abi.ROOT_ID else f_attr
            writev(fd, [out.pack(16 + len(body), 0, unique), body])
        elif opcode == 1:  # LOOKUP
            writev(fd, [out.pack(16 + len(f_entry), 0, unique), f_entry])
        elif opcode not in (2, 42):  # FORGET, BATCH_FORGET: no reply
            writev(fd, [out.pack(16, -errno.ENOSYS, unique)])
    print(json.dumps(counts), flush=True)


def _serve_pyfuse3(mnt: str) -> None:
    import pyfuse3
    import trio

    counts = {"getattr": 0}

    def attrs(ino: int, mode: int, size: int) -> pyfuse3.EntryAttributes:
        a = pyfuse3.EntryAttributes()
        a.st_ino, a.st_mode, a.st_nlink, a.st_size = ino, mode, 1, size
        a.entry_timeout, a.attr_timeout = 3600.0, 0.0
        return a

    table = {pyfuse3.ROOT_INODE: attrs(pyfuse3.ROOT_INODE, stat.S_IFDIR | 0o755, 0), 2: attrs(2, stat.S_IFREG | 0o644, len(DATA))}
    table[pyfuse3.ROOT_INODE].attr_timeout = 3600.0  # the root's permission checks need no request

    class Ops(pyfuse3.Operations):
        async def lookup(self, parent, name, ctx=None):
            if parent == pyfuse3.ROOT_INODE and name == NAME:
                return table[2]
            raise pyfuse3.FUSEError(errno.ENOENT)

        async def getattr(self, inode, ctx=None):
            counts["getattr"] += 1
            return table[inode]

    pyfuse3.init(Ops(), mnt, set(pyfuse3.default_options) | {"fsname=bench", "subtype=bench"})

    async def run():
        with trio.open_signal_receiver(signal.SIGTERM) as signals:
            async with trio.open_nursery() as nursery:
                async def stop():
                    async for _ in signals:
                        pyfuse3.terminate()
                        return
                nursery.start_soon(stop)
                print("ready", flush=True)
                await pyfuse3.main()
                nursery.cancel_scope.cancel()

    try:
        trio.run(run)
    finally:
        pyfuse3.close(unmount=True)
    print(json.dumps(counts), flush=True)


def _cpu(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of process ``pid``, all its threads."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def measure(kind: str, requests: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="stripefs-bench-") as mnt:
        proc = subprocess.Popen([sys.executable, __file__, "--serve", kind, mnt], stdout=subprocess.PIPE, text=True)
        try:
            if proc.stdout.readline().strip() != "ready":
                raise SystemExit(f"the {kind} server did not start")
            path = os.path.join(mnt, NAME.decode())
            for _ in range(2000):  # warm: the name is looked up once, the interpreter's paths are hot
                os.stat(path)
            cpu0, t0 = _cpu(proc.pid), time.perf_counter()
            for _ in range(requests):
                os.stat(path)
            wall, cpu1 = time.perf_counter() - t0, _cpu(proc.pid)
        finally:
            proc.send_signal(signal.SIGTERM)
            out, _ = proc.communicate(timeout=30)
        served = json.loads(out.strip().splitlines()[-1])["getattr"]
        timed = requests * served / (requests + 2000)  # GETATTRs during the timed stats
        user, system = cpu1[0] - cpu0[0], cpu1[1] - cpu0[1]
        return {"server": kind, "stats": requests, "getattr_served": served,
                "server_cpu_us_per_request": (user + system) / timed * 1e6,
                "user_us": user / timed * 1e6, "system_us": system / timed * 1e6,
                "wall_us_per_stat": wall / requests * 1e6}


def hot_path(requests: int, runs: int = 5) -> dict[str, tuple[float, float]]:
    """us per request (best, worst of ``runs``) of the mount's hot requests above the device."""
    import struct
    from types import SimpleNamespace

    from stripefs.client.fuse import abi, requests as rq
    from stripefs.client.fuse.dispatch import Dispatcher
    from stripefs.client.fuse.session import Options, Session
    from stripefs.client.operations import SERVED_IOCTLS, Operations
    from stripefs.client.operations_bridge import OperationsBridge
    from stripefs.common import protocol as p
    from stripefs.common.gc_tuning import tune_gc

    tune_gc()  # as the mount does once it is up

    class Kept:
        """A device that keeps the last answer (its parts) instead of writing it."""
        fd, last = -1, ()

        def writev(self, parts):
            self.last = parts
            return True

    ops = Operations(SimpleNamespace(writer=0, session_id=1, callbacks=True), SimpleNamespace(nodes=SimpleNamespace(learn=lambda n: None)),
                     attr_timeout=1.0, entry_timeout=1.0, cache_timeout=30.0)
    ops.kcache.healthy = True  # the change feed is followed
    attr = p.Attr(ino=9, mode=stat.S_IFREG | 0o644, nlink=1, uid=0, gid=0, rdev=0, size=len(DATA), atime_ns=1,
                  mtime_ns=2, ctime_ns=3)
    ops._keep_held(9, p.OpenRsp(attr=attr, layout=p.Layout(chunk_size=1 << 22, stripe_count=1, redundancy="replicas=1"),
                                chunks=[], nodes=[]))  # as a LOOKUP under a callback leaves it
    dev = Kept()
    session = Session(dev, Dispatcher(OperationsBridge(ops, None, None)), Options(switch_interval=None, ioctls=SERVED_IOCTLS))
    ctx, handle, parse = session._ctx, session._handle, rq.parse
    head = abi.FUSE_IN_HEADER

    def request(opcode: int, args: bytes) -> bytearray:
        return bytearray(head.pack(head.size + len(args), opcode, 7, 9, 0, 0, 1, 0, 0) + args)

    getattr_ = request(abi.Opcode.GETATTR, bytes(16))
    ioctl = request(abi.Opcode.IOCTL, struct.pack("<QIIQII", 0, 0, 0x5401, 0, 0, 0))
    open_ = request(abi.Opcode.OPEN, struct.pack("<II", os.O_RDONLY, 0))
    release = request(abi.Opcode.RELEASE, bytes(24))

    def one(buf: bytearray) -> float:
        n, t = len(buf), time.perf_counter()
        for _ in range(requests):
            handle(parse(buf, n, ctx))
        return (time.perf_counter() - t) / requests * 1e6

    from stripefs.client.fuse import session as session_mod
    lane, lane_lock = session.handler.lane_getattr, session.handler.lane_lock
    lane_head, out_head = session_mod._HEAD_LANE.unpack_from, session_mod._OUT_HEAD.pack

    def lane_one(buf: bytearray) -> float:
        """A GETATTR as the reader thread's loop takes it when the lane answers (session.py _serve)."""
        n, t = len(buf), time.perf_counter()
        for _ in range(requests):
            length, opcode, unique, nodeid = lane_head(buf)
            if not (opcode == abi.Opcode.GETATTR and length == n and session._on_lane("GETATTR", lane_lock, out_head, unique, lane, nodeid)):
                raise SystemExit("the GETATTR lane did not answer the held file")
        return (time.perf_counter() - t) / requests * 1e6

    def pair() -> float:
        no, nr, t = len(open_), len(release), time.perf_counter()
        for _ in range(requests):
            handle(parse(open_, no, ctx))
            struct.pack_into("<Q", release, head.size, struct.unpack_from("<Q", dev.last[1])[0])  # its fh
            handle(parse(release, nr, ctx))
        return (time.perf_counter() - t) / requests * 1e6

    # namespace changes in a directory the mount holds whole (client/async_dirops.py), as the kernel
    # asks them (bench/dirops_probe.py counts them through a real mount): an empty file's create is
    # LOOKUP (the new name), CREATE and the directory's GETATTR (default_permissions, after
    # fuse_dir_changed; closes send nothing); a mkdir LOOKUP, MKDIR, GETATTR; an unlink UNLINK,
    # GETATTR, FORGET. Numbers delegated, the batch never sent. Served as the reader thread's loop
    # does (session.py ``_serve``): a GETATTR or LOOKUP a lane answers takes no request object. CPU of this
    # thread (``time.thread_time``), not wall time: the figure load moves least.
    ops = Operations(SimpleNamespace(writer=0, session_id=1, callbacks=True), SimpleNamespace(nodes=SimpleNamespace(learn=lambda n: None)),
                     attr_timeout=1.0, entry_timeout=1.0, cache_timeout=30.0, per_open_handles=False)  # the default mount
    ops.kcache.healthy = True
    dev2 = Kept()
    session2 = Session(dev2, Dispatcher(OperationsBridge(ops, None, None)), Options(switch_interval=None))
    handle2 = session2._handle
    lane2, lane2_lock = session2.handler.lane_getattr, session2.handler.lane_lock
    d = 5
    dattr = p.Attr(ino=d, mode=stat.S_IFDIR | 0o755, nlink=2, uid=0, gid=0, rdev=0, size=0, atime_ns=1, mtime_ns=2,
                   ctime_ns=3)
    ops.kcache.send_ack = lambda *a: None  # callbacks possible (a mount's real one acknowledges recalls)
    dirops = ops.dirops
    dirops._session = 1
    created = iter(range(1 << 20, 1 << 62))

    def hold_dir() -> None:
        ops.kcache.granted_dir(d, 1)
        ops._names_complete[d] = set()
        ops.kcache.dir_attrs.keep_new(dattr)
        dirops._ranges = [(1 << 20, 1 << 62)]
        dirops._queue.clear(), dirops._unanswered.clear(), dirops._inos.clear(), dirops._dirs.clear()

    def named(opcode: int, fixed: bytes, name: bytes) -> bytearray:
        args = fixed + name + b"\0"
        return bytearray(head.pack(head.size + len(args), opcode, 7, d, 0, 0, 1, 0, 0) + args)

    dir_getattr = request(abi.Opcode.GETATTR, bytes(16))
    struct.pack_into("<Q", dir_getattr, 8 + 8, d)  # its nodeid
    create_in = abi.FUSE_CREATE_IN.pack(os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o100644, 0o022, 0)
    mkdir_in = abi.FUSE_MKDIR_IN.pack(0o755, 0o022)

    lookup2 = getattr(session2.handler, "lane_lookup", None)  # (a session without it: the ordinary way)

    def serve(buf: bytearray) -> None:
        n = len(buf)
        if n == session_mod._GETATTR_SIZE:
            _, opcode, unique, nodeid = lane_head(buf)
            if opcode == abi.Opcode.GETATTR and session2._on_lane("GETATTR", lane2_lock, out_head, unique, lane2, nodeid):
                return
        elif lookup2 is not None and buf[4] == abi.Opcode.LOOKUP:
            _, opcode, unique, nodeid = lane_head(buf)
            nul = buf.find(0, head.size, n)
            if session2._on_lane("LOOKUP", lane2_lock, out_head, unique, lookup2, nodeid, bytes(buf[head.size:nul])):
                return
        handle2(parse(buf, n, ctx))

    def forget_of(ino: int) -> bytearray:
        return bytearray(head.pack(head.size + 8, abi.Opcode.FORGET, 0, ino, 0, 0, 1, 0, 0) + struct.pack("<Q", 1))

    def changes(kind: str) -> float:
        """us of this thread's CPU per operation of ``kind`` (create, mkdir, unlink of the files created)."""
        hold_dir()
        names = [b"f%07d" % next(created) for _ in range(requests)]
        if kind == "unlink":
            for name in names:
                serve(named(abi.Opcode.LOOKUP, b"", name))
                serve(named(abi.Opcode.CREATE, create_in, name))
            inos = [ops.kcache.lookup_known(d, name) for name in names]
            made = [(named(abi.Opcode.UNLINK, b"", name), dir_getattr, forget_of(ino)) for name, ino in zip(names, inos)]
        else:
            fixed, opcode = (create_in, abi.Opcode.CREATE) if kind == "create" else (mkdir_in, abi.Opcode.MKDIR)
            made = [(named(abi.Opcode.LOOKUP, b"", name), named(opcode, fixed, name), dir_getattr) for name in names]
        t = time.thread_time()
        for bufs in made:
            for buf in bufs:
                serve(buf)
        spent = time.thread_time() - t
        last = dirops._queue[-1] if dirops._queue else None
        if last is None or type(last.request).__name__ != {"create": "CreateReq", "mkdir": "MkdirReq"}.get(kind, "UnlinkReq"):
            raise SystemExit(f"the {kind} was not answered on the reader thread")
        return spent / requests * 1e6

    # a cold index walk's page: READDIRPLUS (128 KiB: the kernel asks max_pages pages) of a directory of 100
    # files the default (no-open) mount holds whole under its callback, its listing kept (client/dir_listings.py),
    # answered again and after the kernel FORGOT every inode (drop_caches 3)
    from stripefs.client.dir_listings import Listing

    rd = 6
    listed = []
    for i in range(100):
        a = p.Attr(ino=50_000 + i, mode=stat.S_IFREG | 0o644, nlink=1, uid=0, gid=0, rdev=0, size=110_000,
                   atime_ns=1, mtime_ns=2, ctime_ns=3)
        listed.append(p.DirEntry(name=b"img_%06d.jpg" % i, attr=a, cookie=i + 1))
        ops._keep_held(a.ino, a)
    ops.kcache.granted_dir(rd, 1)
    ops._names_complete[rd] = {e.name for e in listed}
    ops.listings.keep(rd, Listing(0, listed, True, ops.kcache.stamp(), dir_grant=1), ops.listings.generation)
    rdplus = bytearray(head.pack(head.size + abi.FUSE_READ_IN.size, abi.Opcode.READDIRPLUS, 7, rd, 0, 0, 1, 0, 0)
                       + abi.FUSE_READ_IN.pack(0, 0, 131072, 0, 0, 0, 0))
    forgets = [(e.attr.ino, 1) for e in listed]

    def pages(forget: bool) -> float:
        n, spent = len(rdplus), 0.0
        handle2(parse(rdplus, n, ctx))
        if sum(map(len, dev2.last)) < 100 * 150:
            raise SystemExit("the READDIRPLUS of the held directory was not answered from memory")
        for _ in range(requests // 20):
            if forget:
                ops.forget_now(forgets)
            t = time.perf_counter()
            handle2(parse(rdplus, n, ctx))
            spent += time.perf_counter() - t
        return spent / (requests // 20) * 1e6

    times: dict[str, list[float]] = {"getattr": [], "getattr (lane)": [], "ioctl (TCGETS)": [],
                                     "readdirplus, 100 held files": [], "  the same after FORGET of each": [], "open + release": [],
                                     "empty create (LOOKUP CREATE GETATTR), CPU": [],
                                     "mkdir (LOOKUP MKDIR GETATTR), CPU": [], "unlink (UNLINK GETATTR FORGET), CPU": []}
    for _ in range(runs):
        times["getattr"].append(one(getattr_))
        times["getattr (lane)"].append(lane_one(getattr_))
        times["ioctl (TCGETS)"].append(one(ioctl))
        times["readdirplus, 100 held files"].append(pages(False))
        times["  the same after FORGET of each"].append(pages(True))
        times["open + release"].append(pair())
        times["empty create (LOOKUP CREATE GETATTR), CPU"].append(changes("create"))
        times["mkdir (LOOKUP MKDIR GETATTR), CPU"].append(changes("mkdir"))
        times["unlink (UNLINK GETATTR FORGET), CPU"].append(changes("unlink"))
    return {kind: (min(t), max(t)) for kind, t in times.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=100_000)
    parser.add_argument("--serve", nargs=2, metavar=("KIND", "MOUNTPOINT"), help=argparse.SUPPRESS)
    parser.add_argument("--hot-path", action="store_true", help="also the mount's hot requests above the device")
    parser.add_argument("--only-hot-path", action="store_true", help="only those (no mount)")
    a = parser.parse_args(argv)
    if a.serve:
        {"own": _serve_own, "own-prepacked": lambda mnt: _serve_own(mnt, prepacked=True),
         "own-lane": lambda mnt: _serve_own(mnt, prepacked=True, lane=True),
         "pyfuse3": _serve_pyfuse3, "floor": _serve_floor}[a.serve[0]](a.serve[1])
        return 0
    if not a.only_hot_path:
        rows = [measure(kind, a.requests) for kind in ("floor", "own", "own-prepacked", "own-lane", "pyfuse3")]
        print(f"{'server':14} {'GETATTRs':>10} {'server CPU us/request':>22} {'(user':>7} {'system)':>8} {'wall us/stat':>13}")
        for r in rows:
            print(f"{r['server']:14} {r['getattr_served']:>10} {r['server_cpu_us_per_request']:>22.1f} "
                  f"{r['user_us']:>7.1f} {r['system_us']:>8.1f} {r['wall_us_per_stat']:>13.1f}")
        print("goal (issue 29): <= 10 us of server CPU per hot request")
    if a.hot_path or a.only_hot_path:
        print(f"the mount's hot requests above the device (no kernel), us per request, best-worst of 5 x "
              f"{min(a.requests, 20_000):,}; load {os.getloadavg()[0]:.1f}:")
        for kind, (best, worst) in hot_path(min(a.requests, 20_000)).items():
            print(f"  {kind:32} {best:6.1f} - {worst:6.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
