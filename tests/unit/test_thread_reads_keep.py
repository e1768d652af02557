"""Which cold loads the chunk cache keeps (client/thread_reads.py ``kernel_holds_all``).

A chunk whose every stored byte went to the kernel's page cache with a READ's answer is left to
the kernel; a partial READ, or one of a file opened O_DIRECT (its reads bypass the page cache),
keeps it for the next READ. The cluster test beside tests/cluster/test_thread_reads.py checks the
mount does so; this one checks the rule's edges.
"""

from stripefs.client.thread_reads import Waiter, kernel_holds_all

DATA = bytes(110_000)


def _w(offset: int, length: int, cached: bool = True) -> Waiter:
    return Waiter(reply=None, slow=None, offset=offset, length=length, started=0.0, cached=cached)


def test_a_read_of_the_whole_chunk_leaves_it_to_the_kernel():
    assert kernel_holds_all([_w(0, 110_000)], DATA)
    assert kernel_holds_all([_w(0, 131_072)], DATA)  # past the stored end: zeros, the kernel has it all
    assert kernel_holds_all([_w(4096, 4096), _w(0, 110_000)], DATA)  # one of the waiters read it all


def test_a_partial_read_keeps_it():
    assert not kernel_holds_all([_w(0, 65_536)], DATA)
    assert not kernel_holds_all([_w(4096, 110_000)], DATA)
    assert not kernel_holds_all([_w(0, 65_536), _w(65_536, 44_464)], DATA)  # together, but not one READ
    assert not kernel_holds_all([], DATA)  # a LOOKUP's fetch: no READ yet


def test_an_o_direct_read_keeps_it():
    assert not kernel_holds_all([_w(0, 110_000, cached=False)], DATA)
