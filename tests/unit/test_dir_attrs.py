"""client/dir_attrs.py: which reply a mount may keep for a directory, in every order of replies and events."""

import stat

import msgspec

from stripefs.client.dir_attrs import DirAttrs
from stripefs.common import protocol as p

D = 7


def _attr(mtime: int, ino: int = D, mode: int = stat.S_IFDIR | 0o755) -> p.Attr:
    return p.Attr(ino=ino, mode=mode, nlink=2, uid=0, gid=0, rdev=0, size=0, atime_ns=0, mtime_ns=mtime, ctime_ns=mtime, generation=0)


def _reply(seq: int, *attrs: p.Attr) -> p.ChangedRsp:
    return p.ChangedRsp(dir_attrs=list(attrs), seq=seq)


def _following(at: int = 10) -> DirAttrs:
    cache = DirAttrs()
    cache.resume(at)
    return cache


def test_a_reply_is_kept_until_a_later_event_and_its_own_event_does_not_drop_it():
    cache = _following()
    cache.begin([D])
    cache.end([D], _reply(11, _attr(11)))
    cache.changed([D], 11)  # the change's own event, after its reply
    assert cache.get(D).mtime_ns == 11
    cache.changed([D], 12)  # someone else's
    assert cache.get(D) is None


def test_a_reply_older_than_an_applied_event_is_not_kept():
    cache = _following()
    cache.begin([D])
    cache.changed([D], 11)  # its own event first: fine
    cache.end([D], _reply(11, _attr(11)))
    assert cache.get(D).mtime_ns == 11
    cache.begin([D])
    cache.changed([D], 13)  # another mount's change, applied before this reply of position 12 came
    cache.end([D], _reply(12, _attr(12)))
    assert cache.get(D) is None


def test_nothing_is_kept_while_another_change_of_the_directory_is_in_flight():
    cache = _following()
    cache.begin([D])
    cache.begin([D])
    cache.end([D], _reply(11, _attr(11)))  # the other one may land before or after position 11
    assert cache.get(D) is None
    cache.end([D], _reply(12, _attr(12)))
    assert cache.get(D).mtime_ns == 12
    cache.begin([D])  # a change sent drops the entry at once
    assert cache.get(D) is None
    cache.end([D], None)  # it failed: nothing to keep
    assert cache.get(D) is None


def test_no_position_no_file_no_feed_nothing_kept():
    cache = DirAttrs()
    cache.clear()  # not following the feed yet
    cache.begin([D])
    cache.end([D], _reply(11, _attr(11)))
    assert cache.get(D) is None
    cache.resume(20)  # followed again from 20: older replies may miss changes up to it
    for reply in (_reply(15, _attr(15)), _reply(0, _attr(21)), _reply(21, _attr(21, mode=stat.S_IFREG | 0o644))):
        cache.begin([D])
        cache.end([D], reply)
        assert cache.get(D) is None
    cache.begin([D])
    cache.end([D], _reply(21, _attr(21)))
    assert cache.get(D).mtime_ns == 21
    cache.clear(30)  # a gap: everything goes
    assert cache.get(D) is None


def test_changes_answered_here_update_what_is_kept_and_an_earlier_reply_does_not_undo_a_later_one():
    """Issue 31 (client/async_dirops.py): a create or mkdir the mount answered itself updates the
    kept attributes at once; the daemon's replies come later, and one that is older than other
    changes still unanswered (a batch sent before them) is not kept, or the mkdir made here since
    would vanish from the directory's nlink until the next reply."""
    cache = _following()
    cache.begin([D])
    cache.end([D], _reply(11, _attr(11)))  # a synchronous mkdir's reply: kept
    cache.made_here(D, 20, nlink=1)  # a mkdir answered here, in the batch being sent
    cache.made_here(D, 21, nlink=1)  # another, answered while that batch was on its way
    assert (cache.get(D).nlink, cache.get(D).mtime_ns) == (4, 21)
    cache.answered_here(D, _reply(12, p.Attr(**{**msgspec.structs.asdict(_attr(12)), "nlink": 3})))
    assert cache.get(D).nlink == 4  # the first one's reply would undo the second
    cache.answered_here(D, _reply(13, p.Attr(**{**msgspec.structs.asdict(_attr(13)), "nlink": 4})))
    assert (cache.get(D).nlink, cache.get(D).mtime_ns) == (4, 13)  # the daemon's, once all are answered
    cache.made_here(D, 30)
    cache.answered_here(D, None)  # refused: what was kept is dropped (the kernel asks the daemon)
    assert cache.get(D) is None


def test_a_listing_keeps_its_directories_as_of_its_position_until_a_later_event():
    """A listing's directories (ReaddirRsp, as of its callback's position) are kept as a reply's
    are: also as of the floor itself (the feed followed from there saw nothing before it), not
    below it, not past an event already applied, dropped by a later event."""
    cache = _following(10)
    since = cache.stamp()
    cache.listed([_attr(10), _attr(10, ino=8), _attr(10, ino=9, mode=stat.S_IFREG | 0o644)], 10, since)
    assert cache.get(D).mtime_ns == 10 and cache.get(8).mtime_ns == 10
    assert cache.get(9) is None  # a file: not a directory's GETATTR
    cache.changed([8], 12)  # another mount's change of 8
    cache.listed([_attr(11, ino=8)], 11, cache.stamp())  # a listing from before it, come late
    assert cache.get(8) is None
    cache.changed([D], 11)
    assert cache.get(D) is None
    cache.listed([_attr(9, ino=20)], 9, cache.stamp())  # older than where the feed is followed from
    assert cache.get(20) is None


def test_a_listing_keeps_nothing_of_a_directory_changed_here_since_it_was_asked():
    """This mount's own change events drop nothing, so a listing asked before a change made here
    (sent, or answered here) is not kept for that directory: its position may precede the change."""
    cache = _following(10)
    since = cache.stamp()
    cache.made_here(D, 15)  # an unlink answered here while the listing was on its way ...
    cache.answered_here(D, _reply(11, _attr(11)))  # ... and answered (kept: the reply is as of it)
    cache.begin([8])
    cache.end([8], _reply(12))  # a change of 8 sent and answered, its reply without 8's attributes
    cache.listed([_attr(10), _attr(10, ino=8), _attr(10, ino=9)], 10, since)
    assert cache.get(D).mtime_ns == 11  # the reply's, not the listing's
    assert cache.get(8) is None
    assert cache.get(9).mtime_ns == 10
    cache.listed([_attr(13, ino=8)], 13, cache.stamp())  # asked after the change: kept
    assert cache.get(8).mtime_ns == 13


def test_a_listed_directory_answers_the_getattr_after_a_change_made_here():
    """rm -rf: the walk listed the directory; the first unlink answered here updates what the
    listing left (times, links), so the GETATTR that follows it is answered without the daemon."""
    cache = _following(10)
    cache.listed([_attr(10)], 10, cache.stamp())
    cache.made_here(D, 20, nlink=-1)
    got = cache.get(D)
    assert got.mtime_ns == 20 and got.ctime_ns == 20 and got.nlink == 1
