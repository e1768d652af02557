"""A metadata round trip at the client, beside the floor under it: what one
request to the metadata daemon costs a Python client on this machine before
any namespace work (issue 15: <= 0.35 ms at the client).

N sequential requests, one in flight, timed one by one (perf_counter):

- floor: a bare pyzmq DEALER (blocking) sending one small frame to a bare
  ROUTER echo loop in another process, over TCP on loopback as the cluster
  talks. What ZeroMQ and two Python processes cost; nothing else can beat it.
- client share: the project's client (common/transport.py ``RpcClient``
  under trio) against a blocking pyzmq ROUTER in another process that
  decodes each request and answers a PingRsp (common/protocol.py): the
  client's part of a round trip, with a server as cheap as Python allows.
- daemon: the same client against the cluster's metadata daemon, idle:
  ``PingReq`` (dispatch only), ``GetattrReq`` of the root and ``LookupReq`` of
  a directory (the daemon's burst path, daemon/burst.py).
- blocking client: the mount's client for plain threads
  (client/meta_blocking.py, what the mount's worker threads ask a GETATTR
  miss with: client/thread_meta.py) against the same daemon, which it asks on
  its read lane (daemon/read_lane.py): ``GetattrReq`` and ``LookupReq`` (issue
  30: <= 0.15 ms median, <= 1 ms p99, for the client the mount uses).
- creates straight to the daemon (no mount), 64 CreateReq in flight, and
  BatchReq of 64 creates: creates/s and the daemon's CPU per create (issue 30).

The local-disk ratio of the other benchmarks does not fit a round trip: the
floor is printed beside it instead.

    python bench/transport.py [--n 5000] [--meta tcp://127.0.0.1:PORT]   # without --meta: a throwaway cluster
    python bench/transport.py serve echo|protocol                        # a server child (started by the above)
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import zmq

WARMUP = 200


def _summary(times: list[float]) -> dict:
    return {"n": len(times), "mean_ms": statistics.fmean(times) * 1e3, "median_ms": statistics.median(times) * 1e3,
            "p99_ms": sorted(times)[int(len(times) * 0.99)] * 1e3}


def _server(kind: str, children=None) -> tuple[subprocess.Popen, str]:
    """A server child of this file on a free loopback port: (process, its address)."""
    cmd = [sys.executable, __file__, "serve", kind]
    proc = (children.start if children else subprocess.Popen)(cmd, stdout=subprocess.PIPE, text=True)
    return proc, proc.stdout.readline().strip()


def _stop(proc: subprocess.Popen, children=None) -> None:
    proc.kill()
    proc.wait()
    if children:
        children.done(proc)


def floor(n: int, children=None) -> dict:
    """Bare pyzmq DEALER -> ROUTER echo in another process."""
    proc, address = _server("echo", children)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    try:
        frame = b"\x93\x01\x01\x81\xa1t\xa4ping"  # the size of a msgpack PingReq header
        times = []
        for i in range(WARMUP + n):
            t = time.perf_counter()
            sock.send(frame)
            sock.recv()
            times.append(time.perf_counter() - t)
        return _summary(times[WARMUP:])
    finally:
        sock.close()
        ctx.term()
        _stop(proc, children)


def rpc(address: str, n: int, request) -> dict:
    """The project's RpcClient: n sequential calls of ``request`` to ``address``."""
    import trio
    from stripefs.common.transport import connect

    async def go() -> list[float]:
        ctx = zmq.Context()
        try:
            async with connect(ctx, address, timeout=10.0) as client:
                times = []
                for _ in range(WARMUP + n):
                    t = time.perf_counter()
                    await client.call(request)
                    times.append(time.perf_counter() - t)
                return times[WARMUP:]
        finally:
            ctx.destroy(linger=0)

    return _summary(trio.run(go))


def blocking(address: str, n: int, request) -> dict:
    """The mount's blocking client for plain threads (client/meta_blocking.py): n sequential
    calls of ``request`` to ``address``."""
    from stripefs.client.meta_blocking import BlockingMetaClient
    from stripefs.client.meta_rpc import MetaClient

    ctx = zmq.Context()
    client = BlockingMetaClient(ctx, MetaClient(ctx, [address], timeout=10.0), timeout=10.0)
    try:
        times = []
        for _ in range(WARMUP + n):
            t = time.perf_counter()
            client.call(request)
            times.append(time.perf_counter() - t)
        return _summary(times[WARMUP:])
    finally:
        client.close()
        ctx.destroy(linger=0)


def _mkdir(address: str) -> bytes:
    """A directory in the root for the lookups to find: its name."""
    from stripefs.common import protocol as p

    name = b"bench-lookup-%d" % time.time_ns()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    try:
        sock.send(p.encode(1, p.MkdirReq(parent=1, name=name, mode=0o40755, uid=0, gid=0)))
        _, body = p.decode_reply(sock.recv_multipart()[0])
        if isinstance(body, p.ErrorRsp):
            raise RuntimeError(f"the daemon refused a mkdir: {body.message}")
        return name
    finally:
        sock.close()
        ctx.term()


def client_share(n: int, children=None) -> dict:
    """RpcClient -> a blocking ROUTER in another process answering PingRsp."""
    from stripefs.common import protocol as p

    proc, address = _server("protocol", children)
    try:
        return rpc(address, n, p.PingReq())
    finally:
        _stop(proc, children)


def creates(address: str, n: int, batch: int, in_flight: int, daemon_cpu=None) -> dict:
    """Creates sent straight to the daemon (no mount; a blocking pyzmq client, as cheap as
    Python allows): ``n`` files in a new directory, ``batch`` per BatchReq (1: a CreateReq
    each), ``in_flight`` messages outstanding. Creates/s, and the daemon's CPU per create
    when ``daemon_cpu()`` gives its CPU seconds (issue 30: <= 0.08 ms in batches of 64)."""
    from stripefs.common import protocol as p

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)

    def call(request_id: int, request) -> None:
        sock.send(p.encode(request_id, request))

    def answer():
        _, body = p.decode_reply(sock.recv_multipart()[0])
        errors = [body] if isinstance(body, p.ErrorRsp) else [r for r in getattr(body, "results", ()) if isinstance(r, p.ErrorRsp)]
        if errors:
            raise RuntimeError(f"the daemon refused a create: {errors[0].message}")
        return body

    try:
        call(0, p.MkdirReq(parent=1, name=b"bench-creates-%d-%d" % (batch, time.time_ns()), mode=0o40755, uid=0, gid=0))
        parent = answer().attr.ino
        reqs = [p.CreateReq(parent=parent, name=b"f%d" % i, mode=0o100644, uid=0, gid=0, session_id=0) for i in range(n)]
        messages = reqs if batch == 1 else [p.BatchReq(items=reqs[i:i + batch]) for i in range(0, n, batch)]
        cpu0 = daemon_cpu() if daemon_cpu else None
        started = time.perf_counter()
        sent = received = 0
        while received < len(messages):
            while sent < len(messages) and sent - received < in_flight:
                call(sent + 1, messages[sent])
                sent += 1
            answer()
            received += 1
        elapsed = time.perf_counter() - started
        cpu = daemon_cpu() - cpu0 if daemon_cpu else None
    finally:
        sock.close()
        ctx.term()
    return {"creates": n, "batch": batch, "in_flight": in_flight, "per_s": n / elapsed,
            "daemon_cpu_ms": None if cpu is None else 1e3 * cpu / n}


def creates_at_once(addresses: list[str], n: int, batch: int, in_flight: int, daemon_cpu=None) -> dict:
    """``creates`` to every daemon of ``addresses`` at once (a thread each, ``n`` files each, in
    a directory of its own): aggregate creates/s (all files over the wall time until the last
    thread ends) and the daemons' CPU per create (``daemon_cpu()``: their CPU seconds together)."""
    from meta_ops import at_once

    cpu0 = daemon_cpu() if daemon_cpu else None
    total, elapsed = at_once(addresses, lambda address: creates(address, n, batch, in_flight)["creates"])
    cpu = daemon_cpu() - cpu0 if daemon_cpu else None
    return {"creates": total, "daemons": len(addresses), "batch": batch, "in_flight": in_flight, "per_s": total / elapsed,
            "daemon_cpu_ms": None if cpu is None else 1e3 * cpu / total}


def measure(meta_address: str, n: int, children=None, daemon_cpu=None) -> dict:
    """Every figure of this module; meta_address: an idle metadata daemon; ``daemon_cpu()``:
    its CPU seconds (for the creates' CPU figures)."""
    from stripefs.common import protocol as p

    out = {"floor": floor(n, children), "client_share": client_share(n, children),
           "ping": rpc(meta_address, n, p.PingReq()), "getattr": rpc(meta_address, n, p.GetattrReq(ino=1))}
    lookup = p.LookupReq(parent=1, name=_mkdir(meta_address))
    out["lookup"] = rpc(meta_address, n, lookup)
    out["blocking_getattr"] = blocking(meta_address, n, p.GetattrReq(ino=1))
    out["blocking_lookup"] = blocking(meta_address, n, lookup)
    files = max(2000, n)
    out["creates_single"] = creates(meta_address, files, 1, 64, daemon_cpu)
    if hasattr(p, "BatchReq"):
        out["creates_batch64"] = creates(meta_address, files * 4, 64, 4, daemon_cpu)
    return out


def _serve(kind: str) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    print(f"tcp://127.0.0.1:{port}", flush=True)
    if kind == "echo":
        while True:
            sock.send_multipart(sock.recv_multipart())
    from stripefs.common import protocol as p

    reply = p.PingRsp(role="meta")
    while True:
        identity, header, *_ = sock.recv_multipart()
        request_id, _body = p.decode_request(header)
        sock.send_multipart([identity, p.encode(request_id, reply)])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=5000, help="round trips per figure (default 5000)")
    ap.add_argument("--meta", help="an idle metadata daemon (default: a throwaway local cluster)")
    ap.add_argument("--workdir", default="/var/tmp", help="for the throwaway cluster (default /var/tmp)")
    a = ap.parse_args(argv)
    cluster = work = None
    try:
        address = a.meta
        if not address:
            from common import Cluster

            work = Path(tempfile.mkdtemp(prefix="stripefs-bench-transport-", dir=a.workdir))
            cluster = Cluster(work / "state", work / "mnt", nodes=1)
            cluster.up()
            address = f"tcp://127.0.0.1:{json.loads((work / 'state' / 'cluster.json').read_text())['meta_port']}"
        res = measure(address, a.n)
    finally:
        if cluster is not None:
            cluster.teardown()
            shutil.rmtree(work, ignore_errors=True)
    for key, label in (("floor", "bare pyzmq DEALER/ROUTER (the floor)"), ("client_share", "RpcClient -> minimal server"),
                       ("ping", "RpcClient -> metadata daemon, PingReq"),
                       ("getattr", "RpcClient -> metadata daemon, GetattrReq /"),
                       ("lookup", "RpcClient -> metadata daemon, LookupReq"),
                       ("blocking_getattr", "blocking client -> daemon, GetattrReq /"),
                       ("blocking_lookup", "blocking client -> daemon, LookupReq")):
        if key not in res:
            continue
        r = res[key]
        print(f"{label:44s} {r['mean_ms']:.3f} ms mean  {r['median_ms']:.3f} median  {r['p99_ms']:.3f} p99")
    for key in ("creates_single", "creates_batch64"):
        if key in res:
            r = res[key]
            print(f"creates to the daemon, {r['batch']} per message, {r['in_flight']} in flight: {r['per_s']:,.0f}/s")
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["serve"]:
        _serve(sys.argv[2])
    else:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the finally below tears the cluster down
        sys.exit(main())
