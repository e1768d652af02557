"""Data through the mount's handlers: a writer scattering small writes over many chunks.

Moved from tests/cluster/test_data.py, which keeps what needs the kernel
(large sequential I/O through its read-ahead, many files written by threads,
several mounts, the CLI).
"""

import os
import random

MiB = 1 << 20


async def test_scattered_writer_over_many_chunks(fs):
    """More partial chunks than a file may hold unsent: the oldest go out early, nothing is lost."""
    rng = random.Random(7)
    chunk = 4 * MiB
    pieces = {}
    fh, ino = await fs.open_path(fs.dir, b"sparse", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        for _ in range(3):
            for i in rng.sample(range(40), 40):
                off = i * chunk + rng.randrange(0, chunk - 5000)
                data = rng.randbytes(rng.randrange(1, 5000))
                assert await fs.write(fh, off, data) == len(data)  # each a write(2) of its own
                pieces[off] = data
    finally:
        await fs.close(fh)
    fh, _ = await fs.open_path(fs.dir, b"sparse", os.O_RDONLY)
    try:
        for off, data in pieces.items():
            got = await fs.read(fh, off, len(data))
            # a later piece may overlap an earlier one: compare only bytes no later write touched
            later = [(o, d) for o, d in pieces.items() if o != off and o < off + len(data) and o + len(d) > off]
            if not later:
                assert got == data
    finally:
        await fs.close(fh)
    assert (await fs.getattr(ino)).st_size == max(o + len(d) for o, d in pieces.items())
