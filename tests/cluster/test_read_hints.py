"""Read hints (client/dir_hints.py): a walked directory's small files are read beside their lookups,
and a hint that went out of date never hands out old data (close-to-open holds)."""

import os

from test_ops import _processes, scrape, total
from util import eventually


def _read(path):
    with open(path, "rb") as f:
        return f.read()


def _mount_metrics(cluster) -> str:
    return next(p["metrics"] for p in _processes(cluster) if p["role"] == "mount")


def test_hinted_reads_are_used_and_never_serve_an_old_version(cluster, mnt):
    # written through a second mount, so the reading mount has nothing of them cached
    writer = cluster.mount_again("hint-writer")
    try:
        theirs = writer / mnt.name / "walk"
        theirs.mkdir()
        files = {f"f{i:02d}": os.urandom(40_000 + i) for i in range(30)}
        for name, data in files.items():
            (theirs / name).write_bytes(data)
        ours = mnt / "walk"
        url = _mount_metrics(cluster)
        before = scrape(url)

        # a reader walking the directory: after a few files the mount lists it for hints
        names = sorted(files)
        for name in names[:8]:
            assert _read(ours / name) == files[name]
        # the listing runs in the background: wait until the mount has asked for it
        eventually(lambda: total(scrape(url), "stripefs_rpc_seconds_count", type="ReaddirReq")
                   > total(before, "stripefs_rpc_seconds_count", type="ReaddirReq"), within=30, what="the directory listed for hints")

        # meanwhile the files change elsewhere: rewritten in place (same inode, new version),
        # replaced by a rename (new inode), removed
        files["f10"] = os.urandom(40_010)
        (theirs / "f10").write_bytes(files["f10"])
        files["f11"] = os.urandom(40_011)
        (theirs / "f11.tmp").write_bytes(files["f11"])
        os.rename(theirs / "f11.tmp", theirs / "f11")
        os.unlink(theirs / "f12")
        del files["f12"]

        for name in names[8:]:
            if name in files:
                assert _read(ours / name) == files[name], name
            else:
                assert not (ours / name).exists()
        after = scrape(url)
    finally:
        cluster.unmount(writer)
        cluster.extra_mounts.remove(writer)

    fetched = total(after, "stripefs_readahead_chunks_total", outcome="fetched") - total(before, "stripefs_readahead_chunks_total", outcome="fetched")
    used = total(after, "stripefs_readahead_chunks_total", outcome="used") - total(before, "stripefs_readahead_chunks_total", outcome="used")
    # the 19 unchanged files after the listing were read through their hints (f10's hint was out of date)
    assert fetched >= 15 and used >= 15, (fetched, used)
