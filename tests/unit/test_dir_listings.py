"""client/dir_listings.py: which page of a kept listing answers a READDIR offset, and when a
listing may not be kept (a change made here in its directory while it was asked)."""

from __future__ import annotations

import stat

import pytest

from stripefs.client.dir_listings import KeptListings, Listing
from stripefs.client.fuse.replies import DirentBuffer, dirent_record
from stripefs.common import protocol as p


def _entries(cookies, mode=stat.S_IFREG | 0o644):
    return [p.DirEntry(name=f"n{c}".encode(), attr=p.Attr(c + 100, mode, 1, 0, 0, 0, 0, 0, 0, 0), cookie=c)
            for c in cookies]


def test_a_page_starts_after_the_cookie_the_kernel_passes_back():
    listing = Listing(0, _entries([3, 5, 9]), complete=True, stamp=1)
    assert listing.page(0) == 0
    assert listing.page(3) == 1
    assert listing.page(9) == 3  # the end: an empty page, the kernel's EOF
    assert listing.page(4) is None  # not a cookie it gave: the daemon is asked


def test_a_listing_with_more_to_come_does_not_answer_past_its_end():
    listing = Listing(10, _entries([12, 15]), complete=False, stamp=1)
    assert listing.page(10) == 0
    assert listing.page(12) == 1
    assert listing.page(15) is None  # what follows is the daemon's next answer
    assert listing.page(0) is None  # before its start
    assert Listing(0, [], complete=True, stamp=1).page(0) == 0  # an empty directory
    assert Listing(7, [], complete=False, stamp=1).page(7) is None


def test_a_listing_asked_while_its_directory_changed_here_is_not_kept():
    kept = KeptListings()
    generation = kept.generation
    kept.drop(42)  # a create in directory 42 while its listing was asked
    kept.keep(42, Listing(0, _entries([1]), True, 1), generation)
    assert kept.get(42) is None
    kept.keep(7, Listing(0, _entries([1]), True, 1), generation)  # another directory's change is no reason
    assert kept.get(7) is not None
    generation = kept.generation
    kept.keep(42, Listing(0, _entries([1]), True, 1), generation)
    assert kept.get(42) is not None
    kept.drop(42)
    assert kept.get(42) is None


def test_a_directorys_own_attributes_in_its_parents_listing_are_old_after_a_change_made_in_it():
    kept = KeptListings()
    parent = Listing(0, _entries([1], stat.S_IFDIR | 0o755), True, 1)
    kept.keep(5, parent, kept.generation)
    assert not kept.changed_here_since(parent, 101)
    kept.drop(101)  # a file made in the subdirectory: its mtime and nlink changed
    assert kept.changed_here_since(parent, 101)
    assert not kept.changed_here_since(parent, 102)


def test_kept_directories_are_bounded_and_forgotten_changes_count_as_changes():
    kept = KeptListings(dirs=2)
    for ino in (1, 2, 3):
        kept.keep(ino, Listing(0, [], True, 1), kept.generation)
    assert kept.get(1) is None and kept.get(3) is not None and len(kept) == 2
    listing = kept.get(3)
    kept.clear()
    assert kept.changed_here_since(listing, 999)  # what happened before the clear is not known


def test_a_record_is_what_the_buffer_would_encode():
    for plus in (False, True):
        one, two = DirentBuffer(4096, plus), DirentBuffer(4096, plus)
        assert one.add(b"img_000001.jpg", 17, 1234, stat.S_IFREG | 0o644)
        assert two.add_record(dirent_record(b"img_000001.jpg", 17, 1234, stat.S_IFREG | 0o644))
        assert one.getvalue() == two.getvalue()
    full = DirentBuffer(len(dirent_record(b"a", 1, 1, stat.S_IFREG)), False)
    assert full.add_record(dirent_record(b"a", 1, 1, stat.S_IFREG))
    assert not full.add_record(dirent_record(b"b", 2, 2, stat.S_IFREG))  # nothing appended past the size
    assert len(full) == len(dirent_record(b"a", 1, 1, stat.S_IFREG))


def _held_dir(files: int = 100, dataset: bool = False):
    """An Operations holding directory 5 whole (default mount: under its callback; dataset: the
    feed's) and each of its ``files`` files, its listing kept; and the READDIRPLUS of its first page."""
    from types import SimpleNamespace

    from stripefs.client.dir_listings import Listing
    from stripefs.client.fuse import requests as rq
    from stripefs.client.fuse.abi import Opcode
    from stripefs.client.operations import Operations
    from stripefs.client.operations_bridge import OperationsBridge
    from stripefs.common import protocol as p

    from test_fuse_wire import request, u32, u64

    ops = Operations(SimpleNamespace(writer=0, session_id=1, callbacks=True),
                     SimpleNamespace(nodes=SimpleNamespace(learn=lambda n: None)), attr_timeout=1.0,
                     entry_timeout=1.0, cache_timeout=30.0, dataset=dataset)
    ops.kcache.healthy = True
    entries = []
    for i in range(files):
        a = p.Attr(ino=1000 + i, mode=stat.S_IFREG | 0o644, nlink=1, uid=0, gid=0, rdev=0, size=100 + i,
                   atime_ns=1, mtime_ns=2, ctime_ns=3)
        entries.append(p.DirEntry(name=b"f%04d" % i, attr=a, cookie=i + 1))
        if dataset:
            ops._dataset_info[a.ino] = p.OpenRsp(attr=a, layout=p.Layout(chunk_size=1 << 22, stripe_count=1,
                                                                         redundancy="replicas=1"), chunks=[], nodes=[])
        else:
            ops._keep_held(a.ino, a)
    ops.kcache.granted_dir(5, 1)
    ops._names_complete[5] = {e.name for e in entries}
    ops.listings.keep(5, Listing(0, entries, True, ops.kcache.stamp(), dir_grant=1), ops.listings.generation)
    data = request(Opcode.READDIRPLUS, u64(0) + u64(0) + u32(32768) + u32(0) + u64(0) + u32(0) + u32(0), nodeid=5)
    return ops, OperationsBridge(ops, None, None), rq.parse(data, len(data)), entries


def _page(bridge, req) -> bytes:
    from stripefs.client.fuse.replies import DirentBuffer

    buf = DirentBuffer(req.size, True)
    assert bridge.fast_readdir(req, buf) is None
    return buf.getvalue()


@pytest.mark.parametrize("dataset", [False, True])
def test_a_readdirplus_page_of_held_files_is_answered_again_whole_and_never_with_old_attributes(dataset):
    """A READDIRPLUS page of files the mount holds is made once and answered again as it is (no
    answer made per entry), the names remembered again after the kernel forgot them; a file whose
    attributes changed since (what a lookup or the feed leaves), or that is open here, makes the
    page anew: its new size is answered, never the old bytes; with the feed broken every entry is
    a zero entry."""
    from unittest import mock

    from stripefs.client.fuse.dispatch import MISS

    from stripefs.common import protocol as p

    ops, bridge, req, entries = _held_dir(dataset=dataset)
    first = _page(bridge, req)
    assert len(first) > 100 * 150 and (5, b"f0007") in ops.kcache._names
    if not dataset:  # (a dataset mount's FORGET drops what it held of the file: the page is made anew)
        ops.forget_now([(e.attr.ino, 1) for e in entries])  # drop_caches: the kernel forgets every inode
        assert (5, b"f0007") not in ops.kcache._names
    with mock.patch.object(ops, "_held_long", side_effect=AssertionError("an answer made per entry")):
        assert _page(bridge, req) == first
    assert ops.kcache._names[(5, b"f0007")] == 1007  # the kernel holds the names (again)
    new = p.Attr(ino=1007, mode=stat.S_IFREG | 0o644, nlink=1, uid=0, gid=0, rdev=0, size=77_777, atime_ns=1,
                 mtime_ns=9_000_000_000, ctime_ns=9_000_000_000)
    if dataset:
        ops._dataset_info[1007] = p.OpenRsp(attr=new, layout=ops._dataset_info[1006].layout, chunks=[], nodes=[])
    else:
        ops._keep_held(1007, new)
    changed = _page(bridge, req)
    assert changed != first and (77_777).to_bytes(8, "little") in changed
    assert _page(bridge, req) == changed
    from stripefs.client.open_files import OpenFile

    held = entries[8].attr
    of = ops.files[1008] = OpenFile(1008, held, p.Layout(chunk_size=1 << 22, stripe_count=1, redundancy="replicas=1"), {})
    of.size = held.size + 5  # written here, not committed: the page may not say what the mount held
    with mock.patch.object(ops, "_held_long", wraps=ops._held_long) as made:
        written = _page(bridge, req)
    assert made.call_count == 100 and written != changed
    del ops.files[1008]
    ops.kcache.healthy = False  # the feed broke: the daemon is asked, whose answer is filled in as zero entries
    from stripefs.client.fuse.replies import DirentBuffer

    assert bridge.fast_readdir(req, DirentBuffer(req.size, True)) is MISS
    buf = DirentBuffer(req.size, True)
    ops._fill(5, ops.listings.get(5), 0, buf)
    broken = buf.getvalue()
    assert len(broken) == len(changed) and (77_777).to_bytes(8, "little") not in broken


@pytest.mark.parametrize("dataset", [False, True])
def test_a_listing_asked_of_the_daemon_leaves_its_first_readdirplus_page_made(dataset):
    """The READDIRPLUS that asks the daemon (``Operations.readdir``: the first listing of a
    directory) is answered from the listing it kept, as the reader thread answers it, and its page
    is kept with it; a listing asked ahead (a dataset mount's subdirectories) has its first page made
    too (``_page_ahead``), the names not remembered until the kernel is given the page. The cold walk
    after drop_caches then answers each page as it is: no answer made per entry (before, the first
    such walk made every page anew on the reader thread)."""
    from unittest import mock

    import trio

    from stripefs.client.fuse.replies import DirentBuffer

    ops, bridge, req, entries = _held_dir(dataset=dataset)
    listing = ops.listings.get(5)
    first = _page(bridge, req)  # what the reader thread answers from the listing (a page made per entry)
    if not dataset:  # (a dataset mount's FORGET drops what it held: the mocked listing does not give it back)
        ops.forget_now([(e.attr.ino, 1) for e in entries])  # (and the kernel forgot every name)
    ops.kcache._names.clear()
    ops.listings.clear()  # (memory pressure: the listing is gone too, so the READDIRPLUS asks the daemon)

    async def listed(fh, after):  # the daemon's answer, kept as _list keeps it
        ops.listings.keep(fh, Listing(0, list(entries), True, ops.kcache.stamp(), dir_grant=1), ops.listings.generation)
        return p.ReaddirRsp(entries=list(entries), more=False), ops.kcache.stamp(), False, True

    async def settled(fh):
        pass

    with mock.patch.object(ops, "_list", listed), mock.patch.object(ops, "_settle", settled):
        buf = DirentBuffer(req.size, True)
        trio.run(ops.readdir, 5, 0, buf)
    assert buf.getvalue() == first and ops.kcache._names[(5, b"f0007")] == 1007
    assert ops.listings.get(5) is not listing and ops.listings.get(5).pages  # made and kept with the new listing
    ops.forget_now([(e.attr.ino, 1) for e in entries])
    if not dataset:  # (a dataset mount's FORGET drops what it held of the file: its pages are made anew)
        with mock.patch.object(ops, "_held_long", side_effect=AssertionError("an answer made per entry")):
            assert _page(bridge, req) == first

    # a listing asked ahead: its page made before the kernel asks, no name remembered for it
    ops2, bridge2, req2, entries2 = _held_dir(dataset=dataset)
    ops2._plus_size = req2.size  # (seen at the first READDIRPLUS of the connection)
    ops2._page_ahead(5)
    assert ops2.listings.get(5).pages and (5, b"f0007") not in ops2.kcache._names
    with mock.patch.object(ops2, "_held_long", side_effect=AssertionError("an answer made per entry")):
        assert _page(bridge2, req2) == first
    assert ops2.kcache._names[(5, b"f0007")] == 1007


def test_a_held_entry_packed_at_once_is_the_entry_encoded_the_long_way():
    """``encode_held_entry`` (READDIRPLUS pages, LOOKUPs answered from memory) gives the bytes
    ``encode_entry`` gives for the entry ``Operations._entry(held=True)`` makes: sizes, times before
    1970 and past 2038, nanoseconds, generations, directories."""
    from stripefs.client.fuse.replies import encode_entry, encode_held_entry
    from stripefs.client.operations import BLKSIZE

    ops, _, _, _ = _held_dir(files=1)
    cases = [p.Attr(7, stat.S_IFREG | 0o644, 1, 1000, 100, 0, 0, 1, 2, 3),
             p.Attr(2**40, stat.S_IFREG | 0o600, 3, 0, 0, 0, 123_456_789_012, -1_500_000_001, 2**62, 17, generation=9),
             p.Attr(12, stat.S_IFDIR | 0o755, 5, 1, 1, 0, 4096, 1_700_000_000_123_456_789, 0, 999_999_999)]
    for attr in cases:
        for valid in (30.0, 300.0, 0.25):
            ops.cache_timeout = valid
            assert encode_held_entry(attr, attr.size, valid, BLKSIZE) == encode_entry(ops._entry(attr, held=True))
            ops._entry_bytes.clear()
            assert ops._encoded(attr, ops._entry_bytes, encode_entry) == encode_entry(ops._entry(attr, held=True))


@pytest.mark.parametrize("dataset", [False, True])
def test_a_listing_with_a_file_changed_while_asked_is_answered_with_every_entry(dataset):
    """The READDIRPLUS that asks the daemon answers from the listing it kept only where that gives
    every entry with its attributes: a file the feed reported changed while the listing was asked
    (or not held) gets the daemon path's entry (its inode, for no time), not a zero entry, after
    which the kernel would LOOKUP the name at its open."""
    from unittest import mock

    import trio

    from stripefs.client.fuse.replies import DirentBuffer

    ops, bridge, req, entries = _held_dir(files=3, dataset=dataset)
    ops.listings.clear()
    changed = entries[1].attr.ino

    async def listed(fh, after):
        stamp = ops.kcache.stamp()
        ops.listings.keep(fh, Listing(0, list(entries), True, stamp, dir_grant=1), ops.listings.generation)
        (ops._dataset_info if dataset else ops._held_info).pop(changed)  # (as _list keeps nothing of it)
        return p.ReaddirRsp(entries=list(entries), more=False), stamp, False, True

    async def settled(fh):
        pass

    with mock.patch.object(ops, "_list", listed), mock.patch.object(ops, "_settle", settled):
        buf = DirentBuffer(req.size, True)
        trio.run(ops.readdir, 5, 0, buf)
    data = buf.getvalue()
    assert data.count(changed.to_bytes(8, "little")) >= 2  # its entry's nodeid (and ino), not nodeid 0
    from stripefs.client.fuse.replies import ZERO_ENTRY

    assert ZERO_ENTRY not in data
