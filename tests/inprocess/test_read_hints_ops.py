"""Read hints (client/dir_hints.py): a walked directory's small files are read beside their lookups,
and a hint that went out of date never hands out old data (close-to-open holds).

Moved from tests/cluster/test_read_hints.py: the files are written by a second
client (so the reading one has nothing of them cached) and read through the
reading client's handlers as the kernel asks for them: LOOKUP, OPEN, READ,
FLUSH, RELEASE by one process.
"""

import os

from prometheus_client import REGISTRY

from fsapi import Kernel, open_fs
from util import eventually_async


def _readahead(outcome: str) -> float:
    """This process's clients' read-ahead counter (client/metrics.py)."""
    return REGISTRY.get_sample_value("stripefs_readahead_chunks_total", {"outcome": outcome}) or 0.0


async def test_hinted_reads_are_used_and_never_serve_an_old_version(fs, monkeypatch):
    async with open_fs(fs.rig, Kernel(monkeypatch), "hint-writer") as writer:
        theirs = await writer.mkdir(fs.dir, b"walk")  # inode numbers are the cluster's: the same for both clients
        files = {b"f%02d" % i: os.urandom(40_000 + i) for i in range(30)}
        for name, data in files.items():
            await writer.write_file(theirs, name, data)
        ours = (await fs.lookup(fs.dir, b"walk")).nodeid
        before = {o: _readahead(o) for o in ("fetched", "used")}

        # a reader walking the directory: after a few files the mount lists it for hints
        names = sorted(files)
        for name in names[:8]:
            assert await fs.read_file(ours, name) == files[name]
        # the listing runs in the background: wait until the mount has it
        await eventually_async(lambda: fs.ops.hints.get(ours, names[-1]) is not None, within=30, what="the directory listed for hints")

        # meanwhile the files change elsewhere: rewritten in place (same inode, new version),
        # replaced by a rename (new inode), removed
        files[b"f10"] = os.urandom(40_010)
        await writer.write_file(theirs, b"f10", files[b"f10"])
        files[b"f11"] = os.urandom(40_011)
        await writer.write_file(theirs, b"f11.tmp", files[b"f11"])
        await writer.rename(theirs, b"f11.tmp", theirs, b"f11")
        await writer.unlink(theirs, b"f12")
        del files[b"f12"]

        for name in names[8:]:
            if name in files:
                assert await fs.read_file(ours, name) == files[name], name
            else:
                assert not await fs.exists(ours, name)

    fetched = _readahead("fetched") - before["fetched"]
    used = _readahead("used") - before["used"]
    # the 19 unchanged files after the listing were read through their hints (f10's hint was out of date)
    assert fetched >= 15 and used >= 15, (fetched, used)

