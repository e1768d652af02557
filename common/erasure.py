"""Reed-Solomon coding of stripes: a pure codec over pyeclib's ISA-L backend.

No network and no trio here: the client's EC data path (client/ec_path.py)
and, later, the daemon's repair code both build fragments with this module.

Stripes and fragments
---------------------
An erasure-coded file (layout ``ec=K+M``) is cut into chunks of
``chunk_size`` bytes as any file; each chunk is one *stripe*, coded into K
data fragments and M parity fragments, fragment ``j`` stored as chunk copy
``ChunkId(ino, index, part=j)`` on the ``j``-th node of the chunk's placement.

pyeclib's ``isa_l_rs_vand`` is a systematic code. A pyeclib fragment is an
80-byte header followed by a payload of ``fps = ceil(chunk_size / K)`` bytes,
and data fragment ``j``'s payload is bytes ``[j*fps, (j+1)*fps)`` of the
stripe (zero-padded at the end). So a byte range of a stripe maps to byte
offsets inside data fragments (``data_ranges``), and a healthy read fetches
only the data fragments that hold the range and decodes nothing.

Only the payload is stored. The header depends only on (K, M, the coded
size), never on the data (checked by the unit tests), so the codec makes it
itself when pyeclib needs it. Stored fragments thus start at offset 0 of the
chunk data: a read of a whole fragment is aligned on the storage node's
64 KiB checksum blocks and is served without a copy, as a replicated chunk is.

Every stripe is coded as if it were ``chunk_size`` bytes long (the rest
zeros), so ``fps`` is a property of the layout and a reader never needs to
know how much of a stripe was written. What is stored is trimmed:

* data fragment ``j`` keeps its payload only up to the stripe's used length
  ``L`` (a short file's later data fragments are a bare header);
* parity byte ``b`` of a Reed-Solomon code depends only on byte ``b`` of each
  data fragment, so past ``min(L, fps)`` every parity byte is zero and is not
  stored either; only that prefix is coded (``encode`` codes sub-stripes of
  the first ``min(L, fps)`` columns).

A stored fragment shorter than ``fps`` is zero-padded when read back (the
storage node's "past the stored length is a hole" rule). A 10-byte file
costs 10 bytes per data and parity fragment, not ``chunk_size * (K+M)/K``.

The GIL
-------
pyeclib holds the GIL while it codes: a call in a worker thread still stops
every other Python thread, the FUSE loop included, for its whole duration
(a 4 MiB 4+2 stripe takes about 8 ms, and a 1 ms timer then wakes up to 45 ms
late when the machine is busy). So ``encode_job``/``decode_job`` cut a stripe
into steps of SLICE_BYTES (1 MiB) of columns: Reed-Solomon works column by
column, so coding the slices separately gives the same bytes. The client
runs each step in a worker thread (trio.to_thread.run_sync), and the loop
gets the GIL back between steps: each stall is bounded by one 1 MiB call.

Slots
-----
See ``fragment_part``: fragment j of version v lives in chunk part
``j + 32 * (v & 1)``, so a new stripe version never overwrites the committed one
(common/layout.py "Slots": replicated chunks are stored the same way).

Backend check
-------------
``check_backend()`` (also ``python -m stripefs.common.erasure``, run by
``make install``) codes a stripe and reads the backend name back from a
fragment header: liberasurecode silently falls back to nothing, so the check
refuses to run with anything but ``isa_l_rs_vand``.
"""

from __future__ import annotations

import functools
import logging
import sys
from dataclasses import dataclass
from typing import Callable, Mapping

from .errors import ErrorCode, StripefsError
from .layout import SLOT_STRIDE, slot_part  # noqa: F401  (SLOT_STRIDE: also here for its users)

log = logging.getLogger(__name__)

EC_TYPE = "isa_l_rs_vand"
HEADER = 80  #: bytes of pyeclib's fragment header with this backend (checked at start)


def _driver(k: int, m: int):
    try:
        from pyeclib.ec_iface import ECDriver
    except ImportError as exc:  # pragma: no cover - install problem
        raise StripefsError(ErrorCode.INTERNAL, f"pyeclib is not installed ({exc}); run 'make install'") from None
    try:
        return ECDriver(k=k, m=m, ec_type=EC_TYPE)
    except Exception as exc:  # pyeclib raises its own ECDriverError family
        raise StripefsError(
            ErrorCode.INTERNAL, f"pyeclib cannot load the {EC_TYPE} backend for {k}+{m}: {exc} (run 'make install')"
        ) from None


#: stripe bytes coded per pyeclib call: the longest the GIL is held at once (about 2 ms here)
SLICE_BYTES = 1 << 20


#: a job coding at most this many bytes of stripe is run where it is asked (``Job.small``): ~20-80 us
#: of coding, about what handing it to a worker thread and back costs the process (issue 35)
INLINE_BYTES = 256 << 10


class Job:
    """A coding job cut into steps; run each step (a worker thread may), then take ``result()``.
    ``nbytes``: the bytes of stripe (data columns) it codes; ``small``: worth no worker thread."""

    def __init__(self, steps: list[Callable[[], None]], result: Callable[[], object], nbytes: int = 0):
        self.steps = steps
        self.result = result
        self.small = nbytes <= INLINE_BYTES

    def run(self):
        for step in self.steps:
            step()
        return self.result()


@dataclass(frozen=True)
class FragmentRange:
    """The part of a stripe byte range that lies in one data fragment."""

    part: int  # data fragment number, 0..K-1
    offset: int  # offset inside the fragment's payload (add HEADER for the stored file)
    length: int
    stripe_offset: int  # where this piece starts in the stripe


class StripeCodec:
    """Encode and decode stripes of one (K, M, chunk_size). Thread-safe: no mutable state."""

    def __init__(self, k: int, m: int, chunk_size: int):
        if not (1 <= k <= 16 and 1 <= m <= 4):
            raise StripefsError(ErrorCode.INVALID, f"ec=K+M needs K in 1..16 and M in 1..4, not {k}+{m}")
        self.k, self.m, self.chunk_size = k, m, chunk_size
        self.n = k + m
        self.fps = -(-chunk_size // k)  #: payload bytes of every fragment
        self._driver = _driver(k, m)
        zero = self._driver.encode(bytes(chunk_size))
        if len(zero) != self.n or any(len(f) != HEADER + self.fps for f in zero):
            raise StripefsError(
                ErrorCode.INTERNAL,
                f"{EC_TYPE} made fragments of {sorted({len(f) for f in zero})} bytes, expected {HEADER}+{self.fps}",
            )
        backend = self._driver.get_metadata(zero[0], formatted=True).get("backend_id")
        if backend != EC_TYPE:
            raise StripefsError(ErrorCode.INTERNAL, f"pyeclib coded with backend {backend!r}, not {EC_TYPE}")
        self.headers: tuple[bytes, ...] = tuple(bytes(f[:HEADER]) for f in zero)
        #: columns per coding step: about SLICE_BYTES of stripe per pyeclib call
        self.slice = max(4096, -(-SLICE_BYTES // k) // 64 * 64)
        self._sub_headers: dict[int, tuple[bytes, ...]] = {}

    @property
    def fragment_size(self) -> int:
        """Full (untrimmed) size of a stored fragment: its payload, no header."""
        return self.fps

    # -- layout math -----------------------------------------------------------

    def data_ranges(self, offset: int, length: int) -> list[FragmentRange]:
        """Split stripe bytes [offset, offset+length) into pieces of data fragments, in order."""
        end = min(offset + length, self.chunk_size)
        out = []
        pos = offset
        while pos < end:
            part, inner = divmod(pos, self.fps)
            n = min(self.fps - inner, end - pos)
            out.append(FragmentRange(part, inner, n, pos))
            pos += n
        return out

    def stored_payload(self, part: int, used: int) -> int:
        """Payload bytes fragment ``part`` stores for a stripe whose first ``used`` bytes may be nonzero."""
        if part >= self.k:
            return min(used, self.fps)
        return max(0, min(self.fps, used - part * self.fps))

    # -- coding ----------------------------------------------------------------

    def encode(self, stripe: bytes | bytearray | memoryview, used: int | None = None) -> list[bytes]:
        """The K+M stored fragments (trimmed payloads, no header) of a stripe, in one go."""
        return self.encode_job(stripe, used).run()

    def decode(self, payloads: Mapping[int, bytes | memoryview]) -> bytes:
        """The stripe from the payloads of at least K fragments, in one go (see ``decode_job``)."""
        return self.decode_job(payloads).run()

    def encode_job(self, stripe: bytes | bytearray | memoryview, used: int | None = None) -> Job:
        """Code a stripe in steps; ``result()`` is the K+M stored fragments (trimmed payloads, no header).

        ``stripe`` holds the stripe's first bytes (at most chunk_size); past it,
        and past ``used`` (default: len(stripe)), the stripe is zeros. Each step
        codes the columns ``[a, a+slice)`` of every data fragment (about
        SLICE_BYTES of stripe): parity column b depends only on column b of the
        data fragments, so the slices' parities, put end to end, are the parity.
        """
        view = memoryview(stripe)
        if len(view) > self.chunk_size:
            raise StripefsError(ErrorCode.INVALID, f"stripe of {len(view)} bytes is longer than the chunk size {self.chunk_size}")
        used = len(view) if used is None else min(used, len(view))
        view = view[:used]
        k, m, fps = self.k, self.m, self.fps
        n = min(used, fps)  # columns that can be nonzero
        data = [view[j * fps : min((j + 1) * fps, used)] for j in range(k)]
        parity: list[list[bytes]] = [[] for _ in range(m)]

        def step(a: int, b: int) -> None:
            w = b - a
            sub = b"".join(bytes(d[a:b]).ljust(w, b"\0") for d in data)
            coded = self._driver.encode(sub)
            for i in range(m):
                parity[i].append(bytes(memoryview(coded[k + i])[HEADER : HEADER + w]))

        def result() -> list[bytes]:
            return [bytes(d) for d in data] + [b"".join(parity[i]) for i in range(m)]

        steps = [functools.partial(step, a, min(a + self.slice, n)) for a in range(0, n, self.slice)]
        return Job(steps, result, n * k)

    def parity_delta_job(self, changes: Mapping[int, tuple[bytes | memoryview, bytes | memoryview]], a: int, b: int) -> Job:
        """The change of every parity fragment's columns ``[a, b)`` when data fragments change there.

        ``changes``: data fragment j -> (its old bytes, its new bytes) in those columns (``b - a``
        bytes each; fragments not named do not change). Reed-Solomon is linear over GF(2^8):
        parity i = sum over j of coef(i, j) * data j, column by column, so
        new parity = old parity + coef * (new data - old data), and "+" and "-" are XOR. The
        coefficient products are what coding the *difference* gives: a stripe holding
        new XOR old in the changed fragments and zeros elsewhere, coded by the same backend (so
        no generator matrix is assumed here). ``result()``: M deltas of ``b - a`` bytes, to XOR
        into the old parity (``xor``). Steps of ``slice`` columns, as ``encode_job``.
        """
        k, m = self.k, self.m
        if not 0 <= a <= b <= self.fps:
            raise StripefsError(ErrorCode.INVALID, f"columns {a}..{b} outside a fragment of {self.fps} bytes")
        for j, (old, new) in changes.items():
            if not 0 <= j < k or len(old) != b - a or len(new) != b - a:
                raise StripefsError(ErrorCode.INVALID, f"data fragment {j}: {len(old)}/{len(new)} bytes for columns {a}..{b}")
        diff = {j: xor(old, new) for j, (old, new) in changes.items()}
        parity: list[list[bytes]] = [[] for _ in range(m)]

        def step(x: int, y: int) -> None:
            w = y - x
            sub = b"".join(diff[j][x - a : y - a] if j in diff else bytes(w) for j in range(k))
            coded = self._driver.encode(sub)
            for i in range(m):
                parity[i].append(bytes(memoryview(coded[k + i])[HEADER : HEADER + w]))

        def result() -> list[bytes]:
            return [b"".join(parity[i]) for i in range(m)]

        steps = [functools.partial(step, x, min(x + self.slice, b)) for x in range(a, b, self.slice)]
        return Job(steps, result, (b - a) * self.k)

    def decode_job(self, payloads: Mapping[int, bytes | memoryview]) -> Job:
        """Rebuild a stripe (``chunk_size`` bytes) in steps from the payloads of at least K fragments.

        A payload is a stored fragment, maybe trimmed: it is zero-padded to
        ``fps``; pyeclib's headers are made here. With every data
        fragment present the payloads are concatenated, no decoding. Otherwise
        each step decodes a slice of columns with pyeclib (headers for the
        slice's size made once); columns past the longest payload are zero in
        every fragment given (a parity fragment is among them and is as long as
        any data fragment) and need no decoding. Payloads must be of one stripe
        version (the caller checks).
        """
        k, fps = self.k, self.fps
        for j, payload in payloads.items():
            if len(payload) > fps or not 0 <= j < self.n:
                raise StripefsError(ErrorCode.CORRUPT, f"fragment {j}: payload of {len(payload)} bytes, at most {fps} expected")
        if all(j in payloads for j in range(k)):
            return Job([], lambda: b"".join(self._padded(payloads[j]) for j in range(k))[: self.chunk_size])
        if len(payloads) < k:
            raise StripefsError(ErrorCode.IO, f"{len(payloads)} fragment(s) of a {k}+{self.m} stripe: at least {k} are needed")
        chosen = sorted(payloads)
        n = max(len(payloads[j]) for j in chosen)
        data: list[list[bytes]] = [[] for _ in range(k)]

        def step(a: int, b: int) -> None:
            w = b - a
            headers = self._headers_for(w)
            full = [headers[j] + bytes(payloads[j][a:b]).ljust(w, b"\0") for j in chosen]
            try:
                out = self._driver.decode(full)
            except Exception as exc:
                raise StripefsError(ErrorCode.IO, f"decoding a {k}+{self.m} stripe from parts {chosen} failed: {exc}") from None
            if len(out) != k * w:
                raise StripefsError(ErrorCode.IO, f"decoded {len(out)} bytes, expected {k * w}")
            for j in range(k):
                data[j].append(out[j * w : (j + 1) * w])

        def result() -> bytes:
            return b"".join(b"".join(data[j]).ljust(fps, b"\0") for j in range(k))[: self.chunk_size]

        steps = [functools.partial(step, a, min(a + self.slice, n)) for a in range(0, n, self.slice)]
        return Job(steps, result, n * self.k)

    def _headers_for(self, width: int) -> tuple[bytes, ...]:
        """Fragment headers of a stripe of K*width bytes (they depend on the size only)."""
        headers = self._sub_headers.get(width)
        if headers is None:
            if len(self._sub_headers) > 64:
                self._sub_headers.clear()
            coded = self._driver.encode(bytes(self.k * width))
            headers = self._sub_headers[width] = tuple(bytes(f[:HEADER]) for f in coded)
        return headers

    def _padded(self, payload: bytes | memoryview) -> bytes:
        if len(payload) > self.fps:
            raise StripefsError(ErrorCode.CORRUPT, f"fragment payload of {len(payload)} bytes is longer than {self.fps}")
        return bytes(payload) + bytes(self.fps - len(payload))


def xor(x: bytes | memoryview, y: bytes | memoryview) -> bytes:
    """``x`` XOR ``y``, byte by byte (equal lengths): addition and subtraction in GF(2^8)."""
    n = len(x)
    return (int.from_bytes(x, "little") ^ int.from_bytes(y, "little")).to_bytes(n, "little")


def fragment_part(j: int, version: int) -> int:
    """The chunk ``part`` that holds fragment ``j`` of stripe version ``version``.

    Two slots per stripe, chosen by the version's parity: a writer codes a new
    version into the slot the committed version does not use (it picks an
    epoch of the other parity), so the committed fragments stay intact until
    the new version is committed. A write that dies half-way, or fails with
    too few fragments, leaves the committed stripe whole and readable: never a
    torn stripe. The daemon deletes the old slot once the new version is
    committed (garbage bounded by the old version). Replicated chunks use the same
    slots (common/layout.py "Slots").
    """
    return slot_part(j, version)


@functools.lru_cache(maxsize=64)
def codec(k: int, m: int, chunk_size: int) -> StripeCodec:
    """The shared codec of one layout (building one codes a zero stripe once)."""
    return StripeCodec(k, m, chunk_size)


def check_backend() -> str:
    """Code and decode a small stripe with 4+2; a line saying which backend ran. Raises if not ISA-L."""
    import os

    c = StripeCodec(4, 2, 64 * 1024)
    data = os.urandom(c.chunk_size)
    frags = c.encode(data)
    if c.decode({j: frags[j] for j in (1, 3, 4, 5)}) != data:
        raise StripefsError(ErrorCode.INTERNAL, f"{EC_TYPE}: a 4+2 stripe did not decode to its data")
    from importlib.metadata import version

    return f"pyeclib {version('pyeclib')}: {EC_TYPE} loads and codes (4+2 round trip ok)"


if __name__ == "__main__":
    try:
        print(check_backend())
    except StripefsError as exc:
        print(f"erasure coding backend check failed: {exc.message}", file=sys.stderr)
        sys.exit(1)
