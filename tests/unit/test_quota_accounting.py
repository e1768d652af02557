"""Directory quotas (daemon/quota.py) through the namespace, over a real SQLite file.

Every call runs in its own savepoint as the service runs it (test_namespace's
World), so an EDQUOT must leave nothing behind.
"""

import stat

import pytest

from stripefs.common import protocol as P
from stripefs.common.errors import ErrorCode
from test_namespace import ROOT, code_of, w  # noqa: F401 - w: the fixture, over SQLite and PostgreSQL

MiB = 1 << 20
QUOTA = ErrorCode.QUOTA_EXCEEDED


def usage(w, ino):
    q = w.raw.quotas.get(ino)
    return q.used_bytes, q.used_inodes


def write(w, ino, size):
    """What a writer's close does: commit the new size with the chunk holding its last byte
    (a commit that grows a file must carry it: daemon/namespace.py)."""
    last = max(size - 1, 0) // MiB  # the default layout's 1 MiB chunks
    w.ns.alloc_chunks(ino, [last])
    return w.ns.commit(ino, size, 0, [P.ChunkRef(index=last, version=5, nodes=[])])


def test_inode_limit_counts_everything_below_and_unlink_frees(w):
    d = w.ns.mkdir(ROOT, b"d", 0o755, 0, 0).ino
    w.ns.quotas.set(d, None, 3)
    sub = w.ns.mkdir(d, b"sub", 0o755, 0, 0).ino
    w.ns.create(sub, b"f", 0o644, 0, 0)
    w.ns.symlink(d, b"l", b"target", 0, 0)
    assert usage(w, d) == (6, 3)  # the symlink's target length counts as bytes
    for make in (
        lambda: w.ns.create(d, b"x", 0o644, 0, 0),
        lambda: w.ns.mkdir(sub, b"x", 0o755, 0, 0),
        lambda: w.ns.mknod(d, b"x", stat.S_IFIFO | 0o600, 0, 0, 0),
        lambda: w.ns.symlink(sub, b"x", b"t", 0, 0),
    ):
        assert code_of(make) == QUOTA
    assert code_of(w.ns.lookup, d, b"x") == ErrorCode.NOT_FOUND  # nothing left behind
    assert usage(w, d) == (6, 3)
    w.ns.create(ROOT, b"outside", 0o644, 0, 0)  # other trees are not limited
    w.ns.unlink(sub, b"f")
    assert usage(w, d) == (6, 2)
    w.ns.create(d, b"x", 0o644, 0, 0)
    w.ns.unlink(d, b"l")
    w.ns.rmdir(d, b"sub")
    assert usage(w, d) == (0, 1)


def test_byte_limit_commit_is_cut_to_what_fits_and_truncate_is_checked(w):
    d = w.ns.mkdir(ROOT, b"d", 0o755, 0, 0).ino
    w.ns.quotas.set(d, 3 * MiB, None)
    f, _ = w.ns.create(d, b"f", 0o644, 0, 0)
    g, _ = w.ns.create(d, b"g", 0o644, 0, 0)
    assert w.raw.quotas.max_size(g, 0) == 3 * MiB
    assert write(w, f, 2 * MiB).size == 2 * MiB
    assert w.raw.quotas.max_size(g, 0) == MiB
    # g grew past the room (a racing writer): the commit keeps exactly what fits
    w.ns.alloc_chunks(g, [1, 2])
    garbage = w.store.count_garbage()
    chunks = [P.ChunkRef(index=i, version=5, nodes=[]) for i in range(3)]
    assert w.ns.commit(g, 3 * MiB - 10, 0, chunks).size == MiB
    assert usage(w, d) == (3 * MiB, 2)
    assert sorted(w.store.get_chunks(g)) == [0]  # chunks past the limit dropped...
    assert w.store.count_garbage() == garbage + 4  # ...their copies (2 chunks x 2 replicas) become garbage
    assert code_of(w.ns.setattr, f, size=2 * MiB + 1) == QUOTA  # extending truncate
    assert w.ns.getattr(f).size == 2 * MiB
    w.ns.setattr(f, size=MiB)  # shrinking frees
    assert usage(w, d) == (2 * MiB, 2)
    assert write(w, g, MiB + 5).size == MiB + 5
    w.ns.setattr(f, size=0)
    write(w, f, 100)  # overwriting within the size never fails
    assert usage(w, d) == (MiB + 105, 2)
    w.ns.unlink(d, b"g")
    assert usage(w, d) == (100, 1)


def test_nested_quotas_all_apply(w):
    a = w.ns.mkdir(ROOT, b"a", 0o755, 0, 0).ino
    b = w.ns.mkdir(a, b"b", 0o755, 0, 0).ino
    w.ns.quotas.set(a, 100, 10)
    w.ns.quotas.set(b, 50, 2)
    f, _ = w.ns.create(b, b"f", 0o644, 0, 0)
    assert write(w, f, 80).size == 50  # b's limit is the tighter
    g, _ = w.ns.create(a, b"g", 0o644, 0, 0)
    assert write(w, g, 80).size == 50  # a has 50 left
    assert usage(w, a) == (100, 3) and usage(w, b) == (50, 1)
    w.ns.create(b, b"h", 0o644, 0, 0)
    assert code_of(w.ns.create, b, b"i", 0o644, 0, 0) == QUOTA  # b's inode limit
    assert [q.ino for q in w.raw.quotas.applying(f, False)] == [b, a]
    assert [q.ino for q in w.raw.quotas.applying(b, True)] == [b, a]
    w.ns.quotas.set(b, 0, 0)  # removed
    assert w.raw.quotas.get(b) is None and [q.ino for q in w.raw.quotas.all()] == [a]
    w.ns.create(b, b"i", 0o644, 0, 0)
    assert usage(w, a) == (100, 5)


def test_set_counts_an_existing_tree_once_and_recount_repairs(w):
    d = w.ns.mkdir(ROOT, b"d", 0o755, 0, 0).ino
    sub = w.ns.mkdir(d, b"sub", 0o755, 0, 0).ino
    f, _ = w.ns.create(sub, b"f", 0o644, 0, 0)
    write(w, f, 1000)
    w.ns.link(f, d, b"f2")  # a hard link counts once
    w.ns.symlink(d, b"l", b"abc", 0, 0)
    q = w.ns.quotas.set(d, 10_000, 0)
    assert (q.used_bytes, q.used_inodes) == (1003, 3)
    w.store.set_quota_usage(d, 5, 5)  # drift (a bug, a hand-edited database)
    fixed = w.ns.quotas.recount()
    assert [(before.used_bytes, after.used_bytes, after.used_inodes) for before, after in fixed] == [(5, 1003, 3)]
    assert usage(w, d) == (1003, 3) and w.ns.quotas.recount() == []


def test_rename_across_quota_trees(w):
    q = w.ns.mkdir(ROOT, b"q", 0o755, 0, 0).ino
    other = w.ns.mkdir(ROOT, b"other", 0o755, 0, 0).ino
    w.ns.quotas.set(q, 1000, 5)
    f, _ = w.ns.create(ROOT, b"f", 0o644, 0, 0)
    write(w, f, 600)
    w.ns.rename(ROOT, b"f", q, b"f")  # into the tree: usage moves in
    assert usage(w, q) == (600, 1)
    big, _ = w.ns.create(ROOT, b"big", 0o644, 0, 0)
    write(w, big, 500)
    assert code_of(w.ns.rename, ROOT, b"big", q, b"big") == QUOTA
    assert w.ns.lookup(ROOT, b"big").ino == big and usage(w, q) == (600, 1)
    w.ns.rename(q, b"f", other, b"f")  # out of it: usage moves out
    assert usage(w, q) == (0, 0)
    w.ns.rename(ROOT, b"big", q, b"big")
    # replacing a file inside the tree frees the replaced one first
    small, _ = w.ns.create(ROOT, b"small", 0o644, 0, 0)
    write(w, small, 400)
    w.ns.rename(ROOT, b"small", q, b"big")
    assert usage(w, q) == (400, 1)
    # directories, multiply-linked files and exchanges across trees: EXDEV
    w.ns.mkdir(ROOT, b"dir", 0o755, 0, 0)
    assert code_of(w.ns.rename, ROOT, b"dir", q, b"dir") == ErrorCode.CROSS_DEVICE
    w.ns.link(f, other, b"f-again")
    assert code_of(w.ns.rename, other, b"f", q, b"f") == ErrorCode.CROSS_DEVICE
    assert code_of(w.ns.link, f, q, b"f3") == ErrorCode.CROSS_DEVICE
    assert code_of(w.ns.rename, other, b"f", q, b"big", 2) == ErrorCode.CROSS_DEVICE  # RENAME_EXCHANGE
    # within one tree, and between directories under the same roots, anything goes
    inner = w.ns.mkdir(q, b"inner", 0o755, 0, 0).ino
    w.ns.rename(q, b"big", inner, b"big")
    w.ns.rename(ROOT, b"dir", other, b"dir")
    assert usage(w, q) == (400, 2)
    # a quota root itself moves with its quota when its parent's roots do not change
    w.ns.rename(ROOT, b"q", other, b"q")
    assert w.raw.quotas.roots_of_dir(inner) == (q,) and usage(w, q) == (400, 2)


def test_usage_survives_reopen_and_rmdir_drops_the_quota(w):
    d = w.ns.mkdir(ROOT, b"d", 0o755, 0, 0).ino
    w.ns.quotas.set(d, 1000, 2)
    f, _ = w.ns.create(d, b"f", 0o644, 0, 0)
    write(w, f, 700)
    w.reopen()
    assert usage(w, d) == (700, 1)
    assert write(w, f, 1001).size == 1000  # cut to the limit after the restart too
    w.ns.unlink(d, b"f")
    w.ns.rmdir(ROOT, b"d")
    assert w.raw.quotas.all() == [] and not w.raw.quotas.active


def test_no_quota_no_quota_sql(w):
    """Without quotas the hooks return before any SQL: the hot path pays one ``if``."""
    if w.kind == "postgresql":
        pytest.skip("SQLite's trace hook; on PostgreSQL each transaction reads the quota roots once (daemon/quota.py)")
    statements = []
    w.store.conn.set_trace_callback(statements.append)
    d = w.ns.mkdir(ROOT, b"d", 0o755, 0, 0).ino
    f, _ = w.ns.create(d, b"f", 0o644, 0, 0)
    write(w, f, 100)
    w.ns.setattr(f, size=10)
    w.ns.rename(d, b"f", ROOT, b"f")
    w.ns.unlink(ROOT, b"f")
    w.ns.rmdir(ROOT, b"d")
    w.store.conn.set_trace_callback(None)
    assert statements and not [s for s in statements if "quota" in s.lower() or "parent_of" in s]


def test_bad_limits(w):
    d = w.ns.mkdir(ROOT, b"d", 0o755, 0, 0).ino
    assert code_of(w.ns.quotas.set, d, -1, None) == ErrorCode.INVALID


def test_a_failed_rename_keeps_a_quota_root_it_would_have_replaced(w):
    q = w.ns.mkdir(ROOT, b"q", 0o755, 0, 0).ino
    inner = w.ns.mkdir(q, b"inner", 0o755, 0, 0).ino  # an empty quota root that a rename could replace
    w.ns.quotas.set(inner, 0, 1)
    w.ns.quotas.set(q, 0, 10)
    w.ns.mkdir(ROOT, b"dir", 0o755, 0, 0)
    assert code_of(w.ns.rename, ROOT, b"dir", q, b"inner") == ErrorCode.CROSS_DEVICE
    w.ns.create(inner, b"f", 0o644, 0, 0)
    assert code_of(w.ns.create, inner, b"g", 0o644, 0, 0) == QUOTA  # still enforced
