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


def test_random_reads_of_a_small_file_stop_reading_ahead():
    """Every read of a file under NEAR_BYTES is near the last one: near alone made each random read
    of a small file read ahead (the data-path model tester: most fragments fetched ahead went unread)."""
    import random

    rng = random.Random(7)
    s = ReadStream()
    KiB = 1 << 10
    ahead = []
    for _ in range(200):
        off = rng.randrange(0, 900 * KiB)
        ahead.append(s.advance(off, off + rng.randint(1, 40 * KiB), 64 * KiB, 8))
    assert sum(1 for w in ahead[2:] if w) <= 4  # a chance hit on a recent read's end may open it briefly


def test_interleaved_sequential_readers_of_one_handle_still_read_ahead():
    """Several threads (or, on the no-open mount, processes) each reading their own part of one
    file in order: each read continues one of the recent reads."""
    s = ReadStream()
    fronts = [0, 40 * MiB, 80 * MiB, 120 * MiB]
    ahead = []
    for _ in range(16):
        for i, front in enumerate(fronts):
            ahead.append(s.advance(front, front + MiB, CS, 8))
            fronts[i] = front + MiB
    assert all(w > 0 for w in ahead[4:])
