"""client/dir_hints.py: which files get hints, when a directory is listed, the memory bound."""

import trio

from stripefs.client import dir_hints
from stripefs.client.dir_hints import DirHints, hint_of
from stripefs.common import protocol as p

MiB = 1 << 20


def _info(ino: int, size: int, *, version: int = 5, chunk_size: int = 4 * MiB, redundancy: str = "replicas=2") -> p.OpenRsp:
    attr = p.Attr(ino=ino, mode=0o100644, nlink=1, uid=0, gid=0, rdev=0, size=size, atime_ns=0, mtime_ns=0, ctime_ns=0, generation=0)
    chunks = [p.ChunkRef(index=i, version=version, nodes=[1, 2]) for i in range(max(1, -(-size // chunk_size)))]
    return p.OpenRsp(attr=attr, layout=p.Layout(chunk_size=chunk_size, stripe_count=4, redundancy=redundancy), chunks=chunks, nodes=[])


def test_only_written_replicated_files_of_one_chunk_get_a_hint():
    h = hint_of(_info(7, 110 << 10))
    assert h is not None and (h.ino, h.ref.version, h.length) == (7, 5, 4 * MiB)
    assert hint_of(_info(7, 4 * MiB)) is not None  # exactly one chunk
    assert hint_of(_info(7, 4 * MiB + 1)) is None  # two chunks: a sequential reader's read-ahead handles those
    assert hint_of(_info(7, 0)) is None  # empty: nothing to read
    assert hint_of(_info(7, 100, version=0)) is None  # never written
    assert hint_of(_info(7, 100, redundancy="ec=4+2")) is None  # fragments: the EC path prefetches itself


def test_a_directory_is_listed_after_a_few_walks_and_only_once():
    hints = DirHints()
    calls = [hints.should_list(10) for _ in range(dir_hints.WALK_THRESHOLD)]
    assert calls == [False] * (dir_hints.WALK_THRESHOLD - 1) + [True]
    hints._keep(10, {})  # listed (empty)
    assert not any(hints.should_list(10) for _ in range(10))


class _Meta:
    """Answers ReaddirReq pages from a list of (name, OpenRsp); records the requests."""

    def __init__(self, files):
        self.files, self.requests = files, []

    async def call(self, req):
        self.requests.append(req)
        start = req.after
        page = self.files[start : start + req.limit]
        entries = [p.DirEntry(name=n, attr=i.attr, cookie=start + k + 1) for k, (n, i) in enumerate(page)]
        return p.ReaddirRsp(entries=entries, more=start + req.limit < len(self.files), files=[i for _, i in page if hint_of(i)])


class _Nodes:
    def __init__(self):
        self.learned = 0

    def learn(self, nodes):
        self.learned += 1


def test_listing_pages_through_and_keeps_hints_of_small_files():
    files = [(f"f{i}".encode(), _info(100 + i, 1000 if i % 3 else 9 * MiB)) for i in range(600)]
    meta, hints = _Meta(files), DirHints()
    trio.run(hints.list_dir, meta, _Nodes(), 1)
    assert [r.after for r in meta.requests] == [0, 256, 512]
    assert all(r.open_info and r.small_only for r in meta.requests)
    assert len(hints) == 400  # the 200 large files have none
    assert hints.get(1, b"f1").ino == 101 and hints.get(1, b"f0") is None
    # a lookup's answer is the truth: a rewritten file's hint follows it; a vanished name loses it
    hints.learn(1, b"f1", _info(101, 1000, version=9))
    assert hints.get(1, b"f1").ref.version == 9
    hints.forget(1, b"f1")
    assert hints.get(1, b"f1") is None and len(hints) == 399
    hints.learn(2, b"x", _info(5, 10))  # not a listed directory: nothing kept
    assert hints.get(2, b"x") is None


def test_huge_directories_are_not_listed(monkeypatch):
    monkeypatch.setattr(dir_hints, "MAX_LISTED", 500)
    files = [(f"f{i}".encode(), _info(100 + i, 1000)) for i in range(2000)]
    meta, hints = _Meta(files), DirHints()
    trio.run(hints.list_dir, meta, _Nodes(), 1)
    assert len(meta.requests) == 2 and len(hints) == 0
    assert not hints.should_list(1)  # and not listed again


def test_memory_stays_bounded_least_recently_listed_first():
    hints = DirHints(max_hints=250)
    for d in range(1, 4):
        trio.run(hints.list_dir, _Meta([(f"f{i}".encode(), _info(1000 * d + i, 10)) for i in range(100)]), _Nodes(), d)
    assert len(hints) == 200 and hints.get(1, b"f0") is None and hints.get(3, b"f0") is not None
