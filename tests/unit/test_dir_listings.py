"""client/dir_listings.py: which page of a kept listing answers a READDIR offset, and when a
listing may not be kept (a change made here in its directory while it was asked)."""

from __future__ import annotations

import stat

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
