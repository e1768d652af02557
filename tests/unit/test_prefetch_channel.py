"""The prefetch request's channels (stripefs/prefetch_control.py, common/protocol.py)."""

from stripefs.common import protocol as p
from stripefs.prefetch_control import split_blobs


def test_the_ioctl_numbers_are_linux_iow_of_their_buffer():
    for command, number in ((p.PREFETCH_IOC, 1), (p.PREFETCH_SHM_IOC, 2)):
        assert command >> 30 == 1  # _IOC_WRITE: the kernel copies the buffer in, nothing out
        assert (command >> 16) & 0x3FFF == p.PREFETCH_IOC_SIZE  # _IOC_SIZE: 14 bits, the whole buffer
        assert (command >> 8) & 0xFF == ord("S") and command & 0xFF == number


def testsplit_blobs_keep_the_order_and_never_pass_the_limit():
    paths = [b"d%d/sample-%05d.jpg" % (i % 7, i) for i in range(5_000)]
    blobs = list(split_blobs(paths, p.PREFETCH_IOC_MAX_PATHS))
    assert len(blobs) > 1 and all(len(b) <= p.PREFETCH_IOC_MAX_PATHS for b in blobs)
    assert b"\n".join(blobs).split(b"\n") == paths
    assert list(split_blobs([], 100)) == []
