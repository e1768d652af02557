"""Sender CPU for a WriteChunksReq's payload frames, copied into libzmq or zero-copy
(client/data_rpc.py ``shared_frames``).

One DEALER sends messages of a header and ``--frames`` frames of ``--kib`` KiB to a
ROUTER in another process over tcp, one message at a time (each answered), with
the socket's ``copy_threshold`` at common/transport.py's COPY_THRESHOLD (1 MiB:
such frames copied) and then at 0 (zero-copy); printed per frame: the sending
thread's CPU and the whole process's (libzmq's I/O thread and pyzmq's
garbage-collector thread included).

    python bench/batch_frames.py [--frames 64] [--kib 110] [--rounds 60]
"""

from __future__ import annotations

import argparse
import os
import socket
import time

import zmq


def run(mode: str, frames: int, size: int, rounds: int) -> tuple[float, float]:
    with socket.socket() as s:  # a free port, before any zmq context (a context does not survive fork)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    pid = os.fork()
    if pid == 0:  # the receiver, in its own process
        c = zmq.Context()
        r = c.socket(zmq.ROUTER)
        r.bind(f"tcp://127.0.0.1:{port}")
        while True:
            m = r.recv_multipart(copy=False)
            if len(m) == 2:
                os._exit(0)
            r.send_multipart([m[0], b"ok"])
    ctx = zmq.Context()
    d = ctx.socket(zmq.DEALER)
    d.connect(f"tcp://127.0.0.1:{port}")
    d.copy_threshold = (1 << 20) if mode == "copied" else 0
    bufs = [bytearray(os.urandom(size)) for _ in range(frames)]
    t0, thread = os.times(), 0.0
    for _ in range(rounds):
        a = time.thread_time()
        d.send_multipart([b"hdr", *map(memoryview, bufs)], copy=False)
        thread += time.thread_time() - a
        d.recv_multipart()
    t1 = os.times()
    d.send_multipart([b"x"])
    os.waitpid(pid, 0)
    d.close(linger=0)
    ctx.term()
    n = frames * rounds
    return 1e6 * thread / n, 1e6 * ((t1.user + t1.system) - (t0.user + t0.system)) / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--frames", type=int, default=64)
    ap.add_argument("--kib", type=int, default=110)
    ap.add_argument("--rounds", type=int, default=60)
    a = ap.parse_args()
    print(f"load {os.getloadavg()[0]:.1f}; {a.frames} frames of {a.kib} KiB a message")
    for mode in ("copied", "zero-copy", "copied", "zero-copy"):
        thread, process = run(mode, a.frames, a.kib << 10, a.rounds)
        print(f"{mode:10s} sending thread {thread:6.1f} us/frame, process {process:6.1f} us/frame")


if __name__ == "__main__":
    main()
