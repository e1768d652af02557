"""The node pool's batched writes hand libzmq the caller's buffers (client/data_rpc.py ``shared_frames``)."""

import zmq

from stripefs.client.data_rpc import shared_frames
from stripefs.common import protocol as p
from stripefs.common.transport import COPY_THRESHOLD


def test_a_batch_s_small_payloads_are_sent_without_a_copy():
    # 4 KiB: below common/transport.py's COPY_THRESHOLD and pyzmq's own, so anything but an explicit
    # zero-copy frame is copied into libzmq
    buf = bytearray(b"x" * 4096)
    assert len(buf) < min(COPY_THRESHOLD, zmq.COPY_THRESHOLD)
    request = p.WriteChunkReq(chunk=p.ChunkId(1, 0, 0), version=1, base_version=0, offset=0, xxh3=0, replace=True)
    (frame,) = shared_frames([(request, memoryview(buf))])
    assert isinstance(frame, zmq.Frame)
    buf[:4] = b"seen"  # a frame sharing the caller's memory sees it: a copy would not
    assert bytes(frame.buffer[:4]) == b"seen" and len(frame.buffer) == len(buf)
