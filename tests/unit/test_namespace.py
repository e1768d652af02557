"""The metadata namespace in-process, over a real SQLite file in a tmp dir and over PostgreSQL.

Each namespace call runs in its own savepoint (SQLite) or its own transaction
(PostgreSQL), as the service runs it, so a failing call must leave nothing
behind (checked by ``test_failed_operation_leaves_nothing``). Every test runs
on both stores (the ``w`` fixture is parametrized).
"""

import stat

import pytest

from stripefs.common import protocol as P
from stripefs.common.errors import ErrorCode, StripefsError
from stripefs.daemon.db import DB_NAME, SCHEMA_VERSION, open_database, schema_version
from stripefs.daemon.health import NodeRegistry, Sessions
from stripefs.daemon.file_data import EPOCH_BLOCK
from stripefs.daemon.namespace import Namespace
from stripefs.daemon.pg_store import open_pg_store
from stripefs.daemon.store import SqliteStore

ROOT = 1
LAYOUT = P.Layout(chunk_size=1 << 20, stripe_count=2, redundancy="replicas=2")


class _Savepointed:
    """Calls every namespace method inside its own savepoint, like the service."""

    def __init__(self, ns: Namespace):
        self._ns = ns

    def __getattr__(self, name):
        attr = getattr(self._ns, name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            if not self._ns.store.group_commit:  # PostgreSQL: one transaction, as PgStore.run in the service
                return self._ns.store.run(attr, *args, **kwargs)
            with self._ns.store.savepoint():
                return attr(*args, **kwargs)

        return call


class World:
    def __init__(self, path, dsn: str = ""):
        self.path = path
        self.dsn = dsn
        self.kind = "postgresql" if dsn else "sqlite"
        self.open()

    def open(self):
        if self.dsn:
            self.store = open_pg_store(self.dsn, LAYOUT, pool_size=2)
        else:
            self.store = SqliteStore(open_database(self.path / DB_NAME, LAYOUT))
        self.nodes = NodeRegistry(self.store, node_timeout_s=10)
        self.sessions = Sessions(lease_s=15)
        self.raw = Namespace(self.store, self.nodes, is_open=self.sessions.is_open)
        self.ns = _Savepointed(self.raw)

    def add_nodes(self, n=3):
        for i in range(1, n + 1):
            self.nodes.register(
                P.RegisterNodeReq(
                    node_id=i, address=f"tcp://127.0.0.1:{7100 + i}", host=f"h{i}",
                    capacity_bytes=1 << 40, free_bytes=1 << 39, used_bytes=0, chunks=0,
                )
            )

    def reopen(self):
        self.store.close()
        self.open()

    def atomically(self, fn):
        """``fn()`` as one savepoint or transaction."""
        if not self.store.group_commit:
            return self.store.run(fn)
        with self.store.savepoint():
            return fn()


@pytest.fixture(params=["sqlite", "postgresql"])
def w(tmp_path, request):
    world = World(tmp_path, request.getfixturevalue("pg_dsn") if request.param == "postgresql" else "")
    world.add_nodes()
    yield world
    world.store.close()


def code_of(fn, *args, **kwargs):
    with pytest.raises(StripefsError) as info:
        fn(*args, **kwargs)
    return info.value.code


def test_root_schema_and_reopen(w):
    root = w.ns.getattr(ROOT)
    assert stat.S_ISDIR(root.mode) and root.mode & 0o7777 == 0o755 and root.nlink == 2
    assert schema_version(w.store) == SCHEMA_VERSION >= 1
    assert w.ns.get_layout(ROOT) == LAYOUT
    d = w.ns.mkdir(ROOT, b"d", 0o700, 5, 6)
    w.ns.setxattr(d.ino, b"user.k", b"v")
    w.reopen()
    assert w.ns.lookup(ROOT, b"d").ino == d.ino and w.ns.lookup(ROOT, b"d").uid == 5
    assert w.ns.getxattr(d.ino, b"user.k") == b"v"
    assert schema_version(w.store) == SCHEMA_VERSION


def test_names_are_checked(w):
    for bad in (b"", b".", b"..", b"a/b", b"a\0b"):
        assert code_of(w.ns.mkdir, ROOT, bad, 0o755, 0, 0) == ErrorCode.INVALID
    assert code_of(w.ns.mkdir, ROOT, b"x" * 256, 0o755, 0, 0) == ErrorCode.NAME_TOO_LONG
    w.ns.mkdir(ROOT, b"x" * 255, 0o755, 0, 0)


def test_create_mknod_mkdir_and_errors(w):
    ino, created = w.ns.create(ROOT, b"f", 0o644, 1, 2)
    assert created
    attr = w.ns.getattr(ino)
    assert stat.S_ISREG(attr.mode) and attr.nlink == 1 and (attr.uid, attr.gid) == (1, 2)
    _, _, chunks, nodes = w.ns.open_info(ino)
    assert [c.index for c in chunks] == [0] and len(chunks[0].nodes) == 2 and len(nodes) == 2
    assert code_of(w.ns.create, ROOT, b"f", 0o644, 1, 2) == ErrorCode.EXISTS
    assert w.ns.create(ROOT, b"f", 0o644, 1, 2, exclusive=False) == (ino, False)
    assert code_of(w.ns.mkdir, ino, b"x", 0o755, 0, 0) == ErrorCode.NOT_DIR
    assert code_of(w.ns.mkdir, 999, b"x", 0o755, 0, 0) == ErrorCode.NOT_FOUND
    assert code_of(w.ns.lookup, ROOT, b"nope") == ErrorCode.NOT_FOUND
    fifo = w.ns.mknod(ROOT, b"fifo", stat.S_IFIFO | 0o600, 0, 0, 0)
    assert stat.S_ISFIFO(fifo.mode)
    dev = w.ns.mknod(ROOT, b"dev", stat.S_IFCHR | 0o600, 0x0501, 0, 0)
    assert stat.S_ISCHR(dev.mode) and dev.rdev == 0x0501
    sock = w.ns.mknod(ROOT, b"sock", stat.S_IFSOCK | 0o600, 0, 0, 0)
    assert stat.S_ISSOCK(sock.mode)
    assert code_of(w.ns.mknod, ROOT, b"dir", stat.S_IFDIR | 0o755, 0, 0, 0) == ErrorCode.INVALID
    d = w.ns.mkdir(ROOT, b"d", 0o755, 0, 0)
    assert code_of(w.ns.create, ROOT, b"d", 0o644, 0, 0, exclusive=False) == ErrorCode.IS_DIR
    assert w.ns.getattr(ROOT).nlink == 3 and d.nlink == 2


def test_an_existing_name_is_exists_and_leaves_no_inode_behind(w):
    """Creating a name that exists inserts the inode before the entry's UNIQUE constraint
    answers (no lookup first, daemon/namespace.py _add_entry): the savepoint takes it back.
    Under a full quota the existing name is still EXISTS (the lookup comes first there)."""
    d = w.ns.mkdir(ROOT, b"d", 0o755, 0, 0).ino
    w.ns.create(d, b"f", 0o644, 0, 0)
    w.ns.mkdir(d, b"sub", 0o755, 0, 0)
    before = w.store.counts()["inodes"]
    for make in (lambda n: w.ns.create(d, n, 0o644, 0, 0), lambda n: w.ns.mkdir(d, n, 0o755, 0, 0),
                 lambda n: w.ns.mknod(d, n, stat.S_IFIFO | 0o600, 0, 0, 0), lambda n: w.ns.symlink(d, n, b"t", 0, 0)):
        for name in (b"f", b"sub"):
            assert code_of(make, name) == ErrorCode.EXISTS
    assert w.store.counts()["inodes"] == before and w.ns.getattr(d).nlink == 3
    w.atomically(lambda: w.raw.quotas.set(d, None, 1))  # d holds 2 already: full
    assert code_of(w.ns.create, d, b"f", 0o644, 0, 0) == ErrorCode.EXISTS
    assert code_of(w.ns.create, d, b"g", 0o644, 0, 0) == ErrorCode.QUOTA_EXCEEDED


def test_create_without_storage_nodes_still_creates(tmp_path):
    world = World(tmp_path)
    ino, _ = world.ns.create(ROOT, b"f", 0o644, 0, 0)
    assert world.ns.open_info(ino)[2] == []
    assert code_of(world.ns.alloc_chunks, ino, [0]) == ErrorCode.UNAVAILABLE
    world.store.close()


def test_parent_times_change_on_entry_changes(w):
    before = w.ns.getattr(ROOT)
    w.ns.mkdir(ROOT, b"d", 0o755, 0, 0)
    after = w.ns.getattr(ROOT)
    assert after.mtime_ns > before.mtime_ns and after.ctime_ns > before.ctime_ns


def test_unlink_rmdir(w):
    d = w.ns.mkdir(ROOT, b"d", 0o755, 0, 0)
    ino, _ = w.ns.create(d.ino, b"f", 0o644, 0, 0)
    assert code_of(w.ns.unlink, ROOT, b"d") == ErrorCode.IS_DIR
    assert code_of(w.ns.rmdir, ROOT, b"d") == ErrorCode.NOT_EMPTY
    assert code_of(w.ns.rmdir, d.ino, b"f") == ErrorCode.NOT_DIR
    w.ns.unlink(d.ino, b"f")
    assert code_of(w.ns.getattr, ino) == ErrorCode.NOT_FOUND
    assert w.store.count_garbage() == 2  # chunk 0's two copies
    w.ns.rmdir(ROOT, b"d")
    assert w.ns.getattr(ROOT).nlink == 2
    assert code_of(w.ns.rmdir, ROOT, b"d") == ErrorCode.NOT_FOUND


def test_hard_links_symlinks(w):
    ino, _ = w.ns.create(ROOT, b"f", 0o644, 0, 0)
    d = w.ns.mkdir(ROOT, b"d", 0o755, 0, 0)
    assert w.ns.link(ino, d.ino, b"g").nlink == 2
    assert code_of(w.ns.link, ino, d.ino, b"g") == ErrorCode.EXISTS
    assert code_of(w.ns.link, d.ino, ROOT, b"dd") == ErrorCode.PERMISSION
    w.ns.unlink(ROOT, b"f")
    assert w.ns.lookup(d.ino, b"g").nlink == 1
    s = w.ns.symlink(ROOT, b"s", b"d/g", 0, 0)
    assert stat.S_ISLNK(s.mode) and s.size == 3
    assert w.ns.readlink(s.ino) == b"d/g"
    assert code_of(w.ns.readlink, ino) == ErrorCode.INVALID


def test_rename(w):
    a = w.ns.mkdir(ROOT, b"a", 0o755, 0, 0)
    b = w.ns.mkdir(ROOT, b"b", 0o755, 0, 0)
    sub = w.ns.mkdir(a.ino, b"sub", 0o755, 0, 0)
    f, _ = w.ns.create(ROOT, b"f", 0o644, 0, 0)
    g, _ = w.ns.create(ROOT, b"g", 0o644, 0, 0)
    # into its own subtree
    assert code_of(w.ns.rename, ROOT, b"a", sub.ino, b"x") == ErrorCode.INVALID
    assert code_of(w.ns.rename, ROOT, b"a", a.ino, b"x") == ErrorCode.INVALID
    # type mismatches and non-empty targets
    assert code_of(w.ns.rename, ROOT, b"f", ROOT, b"b") == ErrorCode.IS_DIR
    assert code_of(w.ns.rename, ROOT, b"b", ROOT, b"f") == ErrorCode.NOT_DIR
    assert code_of(w.ns.rename, ROOT, b"b", ROOT, b"a") == ErrorCode.NOT_EMPTY
    assert code_of(w.ns.rename, ROOT, b"missing", ROOT, b"x") == ErrorCode.NOT_FOUND
    assert code_of(w.ns.rename, ROOT, b"f", ROOT, b"g", 1) == ErrorCode.EXISTS
    assert code_of(w.ns.rename, ROOT, b"f", ROOT, b"zz", 2) == ErrorCode.NOT_FOUND
    assert code_of(w.ns.rename, ROOT, b"f", ROOT, b"g", 3) == ErrorCode.INVALID
    # file over file: the target inode is reclaimed
    w.ns.rename(ROOT, b"f", ROOT, b"g")
    assert w.ns.lookup(ROOT, b"g").ino == f
    assert code_of(w.ns.getattr, g) == ErrorCode.NOT_FOUND
    # directory over empty directory, across parents: nlinks follow
    w.ns.rename(a.ino, b"sub", ROOT, b"b")
    assert w.ns.lookup(ROOT, b"b").ino == sub.ino
    assert code_of(w.ns.getattr, b.ino) == ErrorCode.NOT_FOUND
    assert w.ns.getattr(a.ino).nlink == 2 and w.ns.getattr(ROOT).nlink == 4
    # exchange a file and a directory in different parents
    w.ns.rename(ROOT, b"g", a.ino, b"x")  # plain move
    w.ns.rename(a.ino, b"x", ROOT, b"b", 2)
    assert w.ns.lookup(a.ino, b"x").ino == sub.ino and w.ns.lookup(ROOT, b"b").ino == f
    assert w.ns.getattr(a.ino).nlink == 3 and w.ns.getattr(ROOT).nlink == 3
    # renaming onto another name of the same inode does nothing
    w.ns.link(f, ROOT, b"f2")
    w.ns.rename(ROOT, b"b", ROOT, b"f2")
    assert w.ns.lookup(ROOT, b"b").ino == f and w.ns.getattr(f).nlink == 2
    w.ns.rename(ROOT, b"b", ROOT, b"b")


def test_rename_keeps_cookie(w):
    w.ns.create(ROOT, b"f", 0o644, 0, 0)
    cookie = w.ns.readdir(ROOT)[0][0].cookie
    w.ns.rename(ROOT, b"f", ROOT, b"g")
    assert w.ns.readdir(ROOT)[0][0].cookie == cookie
    w.nodes.sweep(now=1e12)  # every node silent: down
    assert code_of(w.ns.alloc_chunks, w.ns.lookup(ROOT, b"g").ino, [5]) == ErrorCode.UNAVAILABLE


def test_failed_operation_leaves_nothing(w, monkeypatch):
    def boom(*a, **k):
        raise StripefsError(ErrorCode.INTERNAL, "injected")

    monkeypatch.setattr(w.raw, "place_new", boom)  # a new file's first placement (create_open)
    assert code_of(w.ns.create, ROOT, b"f", 0o644, 0, 0) == ErrorCode.INTERNAL
    assert code_of(w.ns.lookup, ROOT, b"f") == ErrorCode.NOT_FOUND
    assert w.store.counts()["inodes"] == 1


def test_nested_savepoints_undo_their_own_statements(tmp_path):
    """Every savepoint has one name (daemon/store.py: cached statements): an inner one failing
    undoes only its own statements, an outer one failing undoes the inner ones released in it."""
    w = World(tmp_path)
    store = w.store
    with store.savepoint():
        w.raw.mkdir(ROOT, b"kept", 0o755, 0, 0)
        with pytest.raises(StripefsError):
            with store.savepoint():
                w.raw.mkdir(ROOT, b"undone", 0o755, 0, 0)
                raise StripefsError(ErrorCode.INTERNAL, "injected")
        with store.savepoint():
            w.raw.mkdir(ROOT, b"inner", 0o755, 0, 0)
    assert sorted(e.name for e in w.raw.readdir(ROOT)[0]) == [b"inner", b"kept"]
    with pytest.raises(StripefsError):
        with store.savepoint():
            with store.savepoint():
                w.raw.mkdir(ROOT, b"released-then-undone", 0o755, 0, 0)
            raise StripefsError(ErrorCode.INTERNAL, "injected")
    assert sorted(e.name for e in w.raw.readdir(ROOT)[0]) == [b"inner", b"kept"]
    assert w.raw.getattr(ROOT).nlink == 4
    store.close()


def test_change_numbers_stay_contiguous_and_durable_with_the_counter_kept_in_memory(tmp_path):
    """SQLite numbers changes from a counter kept in memory and written at COMMIT (daemon/store.py):
    a rolled-back savepoint gives its numbers back, the row holds the last number after a
    commit, after an outermost savepoint's RELEASE (which commits), and after a reopen."""
    w = World(tmp_path)
    with w.store.savepoint():  # outside a transaction: its RELEASE commits
        first = w.store.log_change(1, b"first")
    assert w.store.conn.execute("SELECT value FROM counters WHERE name='change_seq'").fetchone()[0] == first
    w.store.begin()
    with w.store.savepoint():
        a = w.store.log_change(2, b"a")
    with pytest.raises(RuntimeError):
        with w.store.savepoint():
            w.store.log_change(3, b"undone")
            raise RuntimeError("injected")
    with w.store.savepoint():
        b = w.store.log_change(4, b"b")
    assert (a, b) == (first + 1, first + 2) and w.store.last_change_seq() == b
    w.store.commit()
    w.reopen()
    assert w.store.last_change_seq() == b
    assert [seq for seq, _ in w.store.changes_after(0, 100)][-3:] == [first, a, b]
    w.store.close()


def test_readdir_pages_by_cookie(w):
    d = w.ns.mkdir(ROOT, b"big", 0o755, 0, 0)
    n = 2000  # three pages of 777
    w.atomically(lambda: [w.raw.mknod(d.ino, b"n%05d" % i, stat.S_IFREG | 0o644, 0, 0, 0) for i in range(n)])
    seen, after, pages = [], 0, 0
    while True:
        entries, more = w.ns.readdir(d.ino, after, 777)
        seen += [e.name for e in entries]
        pages += 1
        if not more:
            break
        after = entries[-1].cookie
    assert pages == -(-n // 777)
    assert seen == [b"n%05d" % i for i in range(n)]
    assert entries[-1].attr.mode == stat.S_IFREG | 0o644
    assert code_of(w.ns.readdir, w.ns.lookup(d.ino, b"n00000").ino) == ErrorCode.NOT_DIR


def test_a_commit_grows_a_file_only_with_the_chunk_of_its_new_last_byte(w):
    """The writer of the new last byte stored its chunk: a commit without it (the data was
    lost on the way) must not leave a length that reads as zeros."""
    ino, _ = w.ns.create(ROOT, b"grown", 0o644, 0, 0)
    w.ns.alloc_chunks(ino, [0, 1])
    assert code_of(w.ns.commit, ino, 3, 0, []) == ErrorCode.INVALID
    assert code_of(w.ns.commit, ino, (1 << 20) + 1, 0, [P.ChunkRef(index=0, version=7, nodes=[])]) == ErrorCode.INVALID
    assert code_of(w.ns.commit, ino, 5, 0, [P.ChunkRef(index=0, version=0, nodes=[])]) == ErrorCode.INVALID
    assert w.ns.getattr(ino).size == 0
    assert w.ns.commit(ino, (1 << 20) + 1, 0, [P.ChunkRef(index=1, version=7, nodes=[])]).size == (1 << 20) + 1
    assert w.ns.commit(ino, 10, 0, []).size == (1 << 20) + 1  # not growing: nothing to carry


def test_a_commit_reads_the_inode_row_once_and_answers_what_a_getattr_reads_after(w):
    """The commit's answer is the row it read with its own update applied (no second and third
    read of the row: issue 31's `cp -r`, ~11 statements a commit); it is what the database holds."""
    ino, _ = w.ns.create(ROOT, b"once", 0o644, 3, 4)
    w.ns.alloc_chunks(ino, [0, 1])
    reads = []
    get_inode = w.store.get_inode
    w.store.get_inode = lambda i: (reads.append(i), get_inode(i))[1]
    try:
        attr = w.ns.commit(ino, (1 << 20) + 5, 777, [P.ChunkRef(index=i, version=7, nodes=[]) for i in range(2)])
        again = w.ns.commit(ino, 10, 0, [P.ChunkRef(index=0, version=8, nodes=[])])  # smaller: the size stays
    finally:
        w.store.get_inode = get_inode
    assert reads == [ino, ino]
    assert attr.size == (1 << 20) + 5 and attr.mtime_ns == 777 and attr.uid == 3
    assert again == w.ns.getattr(ino) and again.size == (1 << 20) + 5 and again.mtime_ns >= again.ctime_ns - 10**9


def test_setattr_and_truncate(w):
    ino, _ = w.ns.create(ROOT, b"f", 0o644, 0, 0)
    w.ns.alloc_chunks(ino, [0, 1, 2, 3])
    attr = w.ns.commit(ino, 4 << 20, 123, [P.ChunkRef(index=i, version=7, nodes=[]) for i in range(4)])
    assert attr.size == 4 << 20 and attr.mtime_ns == 123
    assert w.ns.commit(ino, 10, 124, []).size == 4 << 20  # size is a lower bound
    a = w.ns.setattr(ino, mode=0o600, uid=9)
    assert a.mode == stat.S_IFREG | 0o600 and a.uid == 9 and a.ctime_ns > attr.ctime_ns
    a = w.ns.setattr(ino, mode=stat.S_IFDIR | 0o700)
    assert stat.S_ISREG(a.mode)  # the type never changes
    garbage = w.store.count_garbage()
    a = w.ns.setattr(ino, size=(1 << 20) + 5, chunks=[P.ChunkRef(index=1, version=9, nodes=[])])
    assert a.size == (1 << 20) + 5
    chunks = w.ns.open_info(ino)[2]
    assert [(c.index, c.version) for c in chunks] == [(0, 7), (1, 9)]
    assert w.store.count_garbage() == garbage + 4  # chunks 2 and 3, two copies each
    assert code_of(w.ns.setattr, ROOT, size=0) == ErrorCode.IS_DIR
    assert code_of(w.ns.setattr, ino, size=-1) == ErrorCode.INVALID
    # placing a chunk again on a node cancels that node's pending deletion of it
    w.ns.setattr(ino, size=0)
    assert w.ns.open_info(ino)[2] == []
    w.ns.alloc_chunks(ino, [0])
    nodes = w.ns.open_info(ino)[2][0].nodes
    rows = w.store.execute("SELECT node_id FROM garbage WHERE ino=? AND idx=0", (ino,)).fetchall()
    assert not {r[0] for r in rows} & set(nodes)


def test_orphans(w):
    ino, _ = w.ns.create(ROOT, b"f", 0o644, 0, 0)
    sid = w.sessions.hello("h", 1, "/mnt")
    w.sessions.open(sid, ino)
    w.ns.unlink(ROOT, b"f")
    assert w.ns.getattr(ino).nlink == 0  # kept: still open
    assert code_of(w.ns.link, ino, ROOT, b"back") == ErrorCode.NOT_FOUND
    for released in w.sessions.close(sid, ino):
        w.ns.reclaim_if_orphan(released)
    assert code_of(w.ns.getattr, ino) == ErrorCode.NOT_FOUND
    # an orphan that survives a restart is reclaimed by the sweep
    ino2, _ = w.ns.create(ROOT, b"g", 0o644, 0, 0)
    w.sessions.open(sid, ino2)
    w.ns.unlink(ROOT, b"g")
    w.reopen()
    assert w.ns.getattr(ino2).nlink == 0
    sid2 = w.sessions.hello("h", 1, "/mnt")
    w.sessions.heartbeat(sid2, [ino2])
    assert w.ns.reclaim_orphans() == 0
    assert w.sessions.expire(now=1e12) == [ino2]
    assert w.ns.reclaim_orphans() == 1
    assert code_of(w.ns.getattr, ino2) == ErrorCode.NOT_FOUND


def test_inode_numbers_never_reused(w):
    a = w.ns.mkdir(ROOT, b"a", 0o755, 0, 0)
    w.ns.rmdir(ROOT, b"a")
    w.reopen()
    assert w.ns.mkdir(ROOT, b"b", 0o755, 0, 0).ino > a.ino


def test_xattrs(w):
    ino, _ = w.ns.create(ROOT, b"f", 0o644, 0, 0)
    assert code_of(w.ns.getxattr, ino, b"user.a") == ErrorCode.NO_ATTR
    assert code_of(w.ns.setxattr, ino, b"user.a", b"1", 2) == ErrorCode.NO_ATTR
    w.ns.setxattr(ino, b"user.a", b"1", 1)
    assert code_of(w.ns.setxattr, ino, b"user.a", b"2", 1) == ErrorCode.EXISTS
    w.ns.setxattr(ino, b"user.a", b"2", 2)
    w.ns.setxattr(ino, b"user.b", b"")
    assert w.ns.getxattr(ino, b"user.a") == b"2"
    assert w.ns.listxattr(ino) == [b"user.a", b"user.b"]
    assert code_of(w.ns.setxattr, ino, b"user.big", b"x" * (64 * 1024 + 1)) == ErrorCode.INVALID
    w.ns.removexattr(ino, b"user.a")
    assert code_of(w.ns.removexattr, ino, b"user.a") == ErrorCode.NO_ATTR
    assert w.ns.listxattr(ino) == [b"user.b"]


def test_layouts(w):
    d = w.ns.mkdir(ROOT, b"d", 0o755, 0, 0)
    assert w.ns.get_layout(d.ino) == LAYOUT
    assert w.ns.set_layout(d.ino, stripe_count=8).stripe_count == 8
    assert code_of(w.ns.set_layout, d.ino, redundancy="ec=4+2") == ErrorCode.INVALID  # 3 nodes for 6 fragments
    w.add_nodes(6)
    new = w.ns.set_layout(d.ino, redundancy="ec=4+2")
    assert new == P.Layout(chunk_size=LAYOUT.chunk_size, stripe_count=8, redundancy="ec=4+2")
    assert code_of(w.ns.set_layout, d.ino, chunk_size=1000) == ErrorCode.INVALID
    assert code_of(w.ns.set_layout, d.ino, redundancy="raid5") == ErrorCode.INVALID
    ino, _ = w.ns.create(d.ino, b"f", 0o644, 0, 0)
    assert w.ns.get_layout(ino) == new
    assert len(set(w.ns.open_info(ino)[2][0].nodes)) == 6  # one fragment per node
    assert code_of(w.ns.set_layout, ino, stripe_count=2) == ErrorCode.NOT_DIR
    assert w.ns.get_layout(w.ns.mkdir(d.ino, b"sub", 0o755, 0, 0).ino) == new


def test_epochs_increase_across_reopen(w):
    first = [w.ns.alloc_epoch()[0] for _ in range(5)]
    assert first == sorted(set(first))
    w.reopen()
    second, raised = w.ns.alloc_epoch()
    if w.kind == "postgresql":  # a database sequence: nothing to raise, still increasing across reopen
        assert not raised and second > first[-1] and w.ns.last_epoch() == second
        return
    assert raised and second > first[-1]
    later = [w.ns.alloc_epoch() for _ in range(EPOCH_BLOCK)]
    assert [e for e, _ in later] == list(range(second + 1, second + 1 + EPOCH_BLOCK))
    assert sum(r for _, r in later) == 1  # one write per block


def test_epoch_pairs_are_never_handed_out_again(w):
    """A pair (AllocEpochReq.pair): the epoch and the next number are the asker's; nobody gets the
    second one later, before or after a restart (the stored high-water mark covers it)."""
    if w.kind == "postgresql":  # a sequence other daemons share: no pairs, the writer asks again
        assert not w.ns.epoch_pairs
        return
    assert w.ns.epoch_pairs
    first, _ = w.ns.alloc_epoch(pair=True)
    assert w.ns.alloc_epoch()[0] == first + 2 and w.ns.last_epoch() == first + 2
    while w.ns.last_epoch() + 2 < int(w.store.get_meta("epoch_hwm", 1)):  # up to the block's last number
        w.ns.alloc_epoch()
    last, raised = w.ns.alloc_epoch(pair=True)  # its second number is past the stored mark: raised
    assert raised and last + 1 < int(w.store.get_meta("epoch_hwm", 1))
    w.reopen()
    assert w.ns.alloc_epoch()[0] > last + 1


def test_replace_replica_and_statfs(w):
    ino, _ = w.ns.create(ROOT, b"f", 0o644, 0, 0)
    chunk = w.ns.open_info(ino)[2][0]
    failed = chunk.nodes[1]
    ref, addrs = w.ns.replace_replica(ino, 0, failed)
    assert failed not in ref.nodes and len(set(ref.nodes)) == 2 and ref.nodes[0] == chunk.nodes[0]
    assert {a.node_id for a in addrs} == set(ref.nodes)
    assert w.store.execute("SELECT node_id FROM garbage WHERE ino=?", (ino,)).fetchall()[0][0] == failed
    assert w.ns.replace_replica(ino, 0, failed)[0] == ref  # a retry is harmless
    assert code_of(w.ns.replace_replica, ino, 5, failed) == ErrorCode.NOT_FOUND
    total, free, used, files = w.ns.statfs()
    assert total == 3 << 40 and free == 3 << 39 and used == 0 and files == 2


def test_statfs_counts_a_shared_file_system_once_and_used_as_what_is_stored(w):
    """Nodes 1 and 2 on one disk, node 3 on its own: df must not count the shared disk twice, and
    "used" is the chunk bytes the nodes hold, not the disks' used space (issue 17, item 5)."""
    for i, fs, used in ((1, "m:2049:77", 5 << 30), (2, "m:2049:77", 7 << 30), (3, "m:2050:78", 1 << 30)):
        w.nodes.heartbeat(P.NodeHeartbeatReq(node_id=i, capacity_bytes=1 << 40, free_bytes=1 << 39, used_bytes=used,
                                             chunks=1, filesystem=fs))
    total, free, used, _ = w.ns.statfs()
    assert total == 2 << 40 and free == 2 << 39 and used == 13 << 30


def test_listing_open_info_is_each_files_open_info(w):
    """``readdir_open_info`` builds a page's entries from row positions and shares a page's layouts
    and node lists among its files (issue 30): what it says of each file is what ``readdir`` and
    ``open_info`` say, for files of two layouts, of one chunk, several (their nodes' union), none,
    with a lost copy (node 0), in a snapshot (chunks read under the live file's ids), page by page
    and with a filter."""
    d = w.ns.mkdir(ROOT, b"d", 0o755, 0, 0).ino
    inos = [w.ns.create(d, b"a%d" % i, 0o644, 0, 0)[0] for i in range(4)]
    w.ns.set_layout(d, chunk_size=1 << 16, stripe_count=3, redundancy="replicas=1")
    inos += [w.ns.create(d, b"b%d" % i, 0o644, 0, 0)[0] for i in range(3)]
    w.ns.mkdir(d, b"sub", 0o755, 0, 0)
    bare = w.ns.mknod(d, b"bare", stat.S_IFREG | 0o644, 0, 0, 0).ino  # no chunk
    w.ns.symlink(d, b"link", b"a0", 0, 0)
    version = w.ns.alloc_epoch()[0]
    refs, _ = w.ns.alloc_chunks(inos[1], [0, 1, 2, 3, 4])  # several chunks, several placements
    w.ns.commit(inos[1], 5 << 20, 1, [P.ChunkRef(index=r.index, version=version, nodes=r.nodes) for r in refs])
    w.atomically(lambda: w.store.put_chunk(inos[2], 0, version, [0, 2], fresh=False))  # a lost copy
    snap = w.ns.snapshots.create(d, b"s")[1]

    def check(ino, limit, wanted=lambda attr, layout: True):
        after, names, files = 0, [], []
        while True:
            entries, more, infos = w.ns.readdir_open_info(ino, after, limit, wanted)
            listed, more_too = w.ns.readdir(ino, after, limit)
            assert (entries, more) == (listed, more_too)
            names += [e.name for e in entries]
            files += infos
            if not more:
                return names, files
            after = entries[-1].cookie

    for ino in (d, snap):
        for limit in (1, 3, 1000):
            names, files = check(ino, limit)
            regular = [w.ns.lookup(ino, n) for n in names if stat.S_ISREG(w.ns.lookup(ino, n).mode)]
            assert [f[0] for f in files] == regular and len(regular) == 8
            for attr, layout, chunks, nodes in files:
                assert (attr, layout, chunks, nodes) == tuple(w.ns.open_info(attr.ino))
        by_ino = {f[0].ino: f for f in check(ino, 1000)[1]}
        assert len({f[1] for f in by_ino.values()}) == 2  # two layouts
        assert {c.data_ino for c in by_ino[w.ns.lookup(ino, b"a1").ino][2]} == ({0} if ino == d else {inos[1]})
    files = check(d, 1000)[1]
    by_ino = {f[0].ino: f for f in files}
    # the union of its chunks' nodes (placement is seeded at random per file: 2 or 3 of the 3 nodes)
    placed = {n for r in refs for n in r.nodes}
    assert len(by_ino[inos[1]][2]) == 5 and {a.node_id for a in by_ino[inos[1]][3]} == placed and len(placed) >= 2
    assert by_ino[inos[2]][2][0].nodes == [0, 2] and [a.node_id for a in by_ino[inos[2]][3]] == [2]
    assert by_ino[bare][2:] == ([], [])
    small = check(d, 2, lambda attr, layout: layout.chunk_size == 1 << 16)[1]
    assert sorted(f[0].ino for f in small) == sorted(inos[4:] + [bare])  # bare: made after set_layout
