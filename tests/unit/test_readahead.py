"""ReadStream: sequential readers get a growing window, random readers none."""

from stripefs.client.readahead import ReadStream

MiB = 1 << 20
CS = 4 * MiB


def test_sequential_reader_window_doubles_per_new_chunk_up_to_the_maximum():
    s = ReadStream()
    windows = [s.advance(off, off + MiB, CS, 8) for off in range(0, 64 * MiB, MiB)]
    assert windows[0] == 1  # a read from the start is sequential
    assert windows[:4] == [1, 1, 1, 1]  # no growth inside one chunk
    assert windows[4] == 2 and windows[8] == 4 and windows[12] == 8
    assert max(windows) == 8 and windows[-1] == 8


def test_out_of_order_requests_near_the_stream_still_count():
    s = ReadStream()
    for off in (0, 2 * MiB, MiB, 4 * MiB, 3 * MiB, 6 * MiB, 5 * MiB):  # the kernel's parallel read-ahead
        assert s.advance(off, off + MiB, CS, 8) > 0


def test_random_reader_never_reads_ahead_and_a_new_sequence_starts_small():
    s = ReadStream()
    for off in (0, MiB, 2 * MiB, 3 * MiB, 4 * MiB):
        s.advance(off, off + MiB, CS, 8)
    assert s.window == 2
    assert s.advance(900 * MiB, 900 * MiB + 4096, CS, 8) == 0
    assert s.advance(300 * MiB, 300 * MiB + 4096, CS, 8) == 0
    assert s.advance(300 * MiB + 4096, 300 * MiB + 8192, CS, 8) == 1  # sequential again: starts over at one chunk
