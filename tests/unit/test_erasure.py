"""The stripe codec (common/erasure.py): round trips with any M fragments lost, trimming, range math."""

import itertools
import os
import random

import pytest

from stripefs.common.erasure import HEADER, StripeCodec, check_backend, codec, xor
from stripefs.common.errors import StripefsError

KiB = 1024


def test_backend_is_isa_l():
    assert "isa_l_rs_vand" in check_backend()


def test_headers_do_not_depend_on_the_data():
    c = StripeCodec(4, 2, 64 * KiB)
    full = c._driver.encode(os.urandom(64 * KiB))
    assert [bytes(f[:HEADER]) for f in full] == list(c.headers)


@pytest.mark.parametrize("k,m,chunk", [(4, 2, 64 * KiB), (3, 2, 64 * KiB), (6, 3, 68 * KiB), (2, 1, 64 * KiB), (1, 1, 64 * KiB)])
def test_any_m_fragments_lost_decode(k, m, chunk):
    rng = random.Random(k * 100 + m)
    c = StripeCodec(k, m, chunk)
    for used in sorted({u for u in (0, 1, 7, c.fps - 1, c.fps, c.fps + 1, chunk - 3, chunk) if u <= chunk}):
        stripe = rng.randbytes(used)
        frags = c.encode(stripe)
        want = stripe + bytes(chunk - used)
        for lost in itertools.combinations(range(k + m), m):
            have = {j: frags[j] for j in range(k + m) if j not in lost}
            assert c.decode(have) == want, (used, lost)


def test_systematic_payloads_are_contiguous_slices():
    c = StripeCodec(4, 2, 64 * KiB)
    stripe = os.urandom(64 * KiB)
    frags = c.encode(stripe)
    for j in range(4):
        assert frags[j] == stripe[j * c.fps : (j + 1) * c.fps]


def test_trimmed_fragments_match_full_coding():
    """What is stored is a prefix of what pyeclib makes for the zero-padded full stripe."""
    c = StripeCodec(5, 3, 64 * KiB)
    for used in (10, 5000, c.fps + 17, 64 * KiB):
        stripe = os.urandom(used)
        full = c._driver.encode(stripe + bytes(64 * KiB - used))
        frags = c.encode(stripe)
        for j in range(8):
            assert len(frags[j]) == c.stored_payload(j, used)
            padded = frags[j] + bytes(c.fps - len(frags[j]))
            assert padded == full[j][HEADER:], (used, j)


def test_small_stripe_costs_its_size_per_fragment():
    c = StripeCodec(4, 2, 4 << 20)
    frags = c.encode(b"x" * 10)
    assert [len(f) for f in frags] == [10, 0, 0, 0, 10, 10]


def test_too_few_fragments_is_a_clear_error():
    c = StripeCodec(4, 2, 64 * KiB)
    frags = c.encode(os.urandom(1000))
    with pytest.raises(StripefsError, match="at least 4"):
        c.decode({0: frags[0], 4: frags[4], 5: frags[5]})


def test_data_ranges_cover_the_range_in_order():
    c = StripeCodec(3, 2, 64 * KiB)  # fps = 21846, not a divisor of the chunk size
    for offset, length in [(0, 1), (0, 64 * KiB), (21845, 2), (21846, 21846), (60000, 10000), (100, 0)]:
        pieces = c.data_ranges(offset, length)
        end = min(offset + length, 64 * KiB)
        assert sum(p.length for p in pieces) == max(0, end - offset)
        pos = offset
        for p in pieces:
            assert p.stripe_offset == pos == p.part * c.fps + p.offset
            assert 0 <= p.offset and p.offset + p.length <= c.fps and p.part < 3
            pos += p.length


def test_codec_is_shared_per_layout():
    assert codec(4, 2, 64 * KiB) is codec(4, 2, 64 * KiB)


def test_bad_parameters_are_refused():
    with pytest.raises(StripefsError):
        StripeCodec(17, 2, 64 * KiB)
    with pytest.raises(StripefsError):
        StripeCodec(4, 5, 64 * KiB)


def test_fragment_slots_alternate_with_version_parity():
    from stripefs.common.erasure import SLOT_STRIDE, fragment_part

    assert {fragment_part(j, 10) for j in range(20)}.isdisjoint({fragment_part(j, 11) for j in range(20)})
    assert fragment_part(3, 10) == fragment_part(3, 12) == 3 and fragment_part(3, 11) == 3 + SLOT_STRIDE


@pytest.mark.parametrize("k,m", [(4, 2), (3, 2), (5, 1)])
def test_sliced_coding_gives_the_same_bytes(k, m):
    """Coding column slices separately (short GIL holds) equals coding the stripe at once."""
    rng = random.Random(k)
    c = StripeCodec(k, m, 64 * KiB)
    whole = StripeCodec(k, m, 64 * KiB)
    whole.slice = 1 << 30
    c.slice = 4096 + 64  # several steps, the last one short
    for used in (100, c.fps - 5, c.fps + 3, 64 * KiB):
        stripe = rng.randbytes(used)
        job = c.encode_job(stripe)
        assert len(job.steps) == -(-min(used, c.fps) // c.slice)
        frags = job.run()
        assert frags == whole.encode(stripe)
        for lost in itertools.combinations(range(k + m), m):
            have = {j: frags[j] for j in range(k + m) if j not in lost}
            assert c.decode(have) == stripe + bytes(64 * KiB - used), (used, lost)


def test_small_coding_jobs_run_inline_large_ones_in_steps():
    """A job coding a 64 KiB stripe (the data-path model's) is ``small``: the mount codes it on its loop
    rather than hand it to a worker thread and back (client/ec_path.py ``_run``); a 4 MiB stripe's is
    not, and a parity delta is sized by the columns it codes."""
    small, large = StripeCodec(4, 2, 64 * KiB), StripeCodec(4, 2, 4096 * KiB)
    assert small.encode_job(os.urandom(64 * KiB)).small
    assert small.decode_job({j: f for j, f in enumerate(small.encode(os.urandom(64 * KiB))) if j != 1}).small
    assert not large.encode_job(os.urandom(4096 * KiB)).small
    assert large.encode_job(os.urandom(40 * KiB)).small  # trimmed: only the columns that can be nonzero
    assert large.parity_delta_job({0: (bytes(4096), os.urandom(4096))}, 0, 4096).small
    assert not large.parity_delta_job({0: (bytes(large.fps), os.urandom(large.fps))}, 0, large.fps).small


@pytest.mark.parametrize("k,m", [(4, 2), (2, 1), (6, 3), (10, 4)])
def test_parity_delta_updates_equal_a_full_re_encode(k, m):
    """new parity = old parity + coefficient x (new data - old data): every stripe after a run of
    random partial updates (one or several data fragments, any columns, past the trimmed end, across
    a slice boundary) has exactly the parity a full re-encode of the new stripe gives."""
    c = StripeCodec(k, m, k * (32 << 10))  # fragments of 32 KiB
    c.slice = 4096  # several coding steps per delta
    rng = random.Random(k * 10 + m)
    used = 1000  # a short stripe: its stored parity is trimmed to 1000 bytes
    stripe = bytearray(rng.randbytes(used)) + bytearray(c.chunk_size - used)
    parity = [bytes(p).ljust(c.fps, b"\0") for p in c.encode(stripe, used)[k:]]
    for _ in range(40):
        a = rng.randrange(c.fps)
        b = min(c.fps, a + rng.choice([1, 17, 4096, 9000]))
        changes = {}
        for j in rng.sample(range(k), rng.randint(1, k)):
            new = rng.randbytes(b - a)
            changes[j] = (bytes(stripe[j * c.fps + a : j * c.fps + b]), new)
            stripe[j * c.fps + a : j * c.fps + b] = new
        deltas = c.parity_delta_job(changes, a, b).run()
        parity = [p[:a] + xor(p[a:b], d) + p[b:] for p, d in zip(parity, deltas)]
        assert parity == [bytes(p).ljust(c.fps, b"\0") for p in c.encode(stripe)[k:]]


def test_parity_delta_refuses_bad_columns():
    c = codec(4, 2, 64 << 10)
    with pytest.raises(StripefsError):
        c.parity_delta_job({0: (b"ab", b"cd")}, 0, 3)
    with pytest.raises(StripefsError):
        c.parity_delta_job({4: (b"a", b"b")}, 0, 1)  # a parity fragment is not data
    with pytest.raises(StripefsError):
        c.parity_delta_job({}, 10, c.fps + 1)
