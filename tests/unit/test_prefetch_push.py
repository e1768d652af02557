"""The prefetcher's push into the page cache (client/prefetch.py ``_Pusher``; docs/design.md "The
prefetched cold epoch", sixth pass): a batch's files are pushed the moment its reply lands, by a
plain thread that needs no turn of the trio thread; the push's rules stay (a file changed since its
prefetch began is never pushed; a file pushed whole leaves the chunk cache, one not pushed stays;
what the mount learns from a push, ``stored`` and ``on_fetched``, arrives after the push).

A real metadata daemon process and real storage nodes over ZeroMQ (test_data_path.Rig); the
kernel is ``fuse_backend.notify_store``, recorded. The trio thread is held still by an instrument
that blocks right after the step of the fetching task in which the batch's reply landed: before
any other task (the old store loop, a trio worker thread's return) can run.
"""

from __future__ import annotations

import threading

import trio

from stripefs.client import fuse_backend
from stripefs.client.kernel_cache import KernelCache
from stripefs.client.prefetch import Prefetcher
from stripefs.common import protocol as P
from test_data_path import rig  # noqa: F401 (the fixture)
from test_meta_service import ROOT

BODY = b"pushed-bytes " * 700


class Kernel:
    """notify_store recorded: (inode, the pushing thread's name, the bytes)."""

    def __init__(self, monkeypatch, *, gone: frozenset[int] = frozenset()):
        self.stores: list[tuple[int, str, bytes]] = []
        self.pushed = threading.Event()

        def notify_store(ino: int, offset: int, data) -> None:
            assert offset == 0
            if ino in gone:
                raise OSError(2, "the kernel forgot it")  # ENOENT: not pushed
            self.stores.append((ino, threading.current_thread().name, bytes(data)))
            self.pushed.set()

        monkeypatch.setattr(fuse_backend, "notify_store", notify_store)


async def _files(rig, kcache: KernelCache, names: list[bytes]) -> dict[bytes, P.OpenRsp]:
    """Committed one-chunk files in the root, their names known to the (recorded) kernel."""
    out = {}
    for name in names:
        of = await rig.create(name)
        await rig.data.write(of, 0, BODY)
        await rig.data.flush(of)
        kcache.remember(ROOT, name, of.ino)
        out[name] = await rig.meta.call(P.OpenReq(ino=of.ino, session_id=rig.meta.session_id))
        rig.data.cache.drop_inode(of.ino)  # (what the write left cached: the prefetcher fetches it)
    return out


async def _settled(prefetcher: Prefetcher) -> None:
    with trio.fail_after(30):
        while prefetcher._busy or prefetcher._queue:
            await trio.sleep(0.01)


class HoldAfterLanding(trio.abc.Instrument):
    """Blocks the trio thread after the step in which the batch's reply landed (``landed``), until
    ``pushed`` is set (at most ``patience`` s); ``in_time``: whether it was."""

    def __init__(self, pushed: threading.Event, patience: float = 10.0):
        self.landed = False
        self.pushed, self.patience = pushed, patience
        self.in_time: bool | None = None

    def after_task_step(self, task) -> None:
        if self.landed and self.in_time is None:
            self.in_time = self.pushed.wait(self.patience)


async def test_a_batch_is_pushed_with_no_turn_of_the_trio_thread(rig, monkeypatch, nursery):
    """Fails on the store loop and trio worker-thread hop (main): there the push waits for the
    trio thread to run the store loop, which the instrument does not let happen."""
    kernel = Kernel(monkeypatch)
    kcache = KernelCache()
    infos = await _files(rig, kcache, [b"a", b"b", b"c"])
    prefetcher = Prefetcher(rig.meta, rig.data, kcache)
    hold = HoldAfterLanding(kernel.pushed)
    real_fetch = rig.data.fetch

    async def fetch(wants, *, node=None):
        results = await real_fetch(wants, node=node)
        hold.landed = node is not None  # the batch's reply: its task's step goes on from here
        return results

    monkeypatch.setattr(rig.data, "fetch", fetch)
    trio.lowlevel.add_instrument(hold)
    try:
        nursery.start_soon(prefetcher.run)
        prefetcher.submit(ROOT, b"a\nb\nc")
        await _settled(prefetcher)
    finally:
        trio.lowlevel.remove_instrument(hold)
    assert hold.in_time, "nothing was pushed while the trio thread was held after the batch landed"
    assert sorted(ino for ino, _, _ in kernel.stores) == sorted(i.attr.ino for i in infos.values())
    assert all(data == BODY for _, _, data in kernel.stores)
    assert {thread for _, thread, _ in kernel.stores} == {"prefetch-push"}
    assert prefetcher.stored == 3 and prefetcher.fetched == 3


async def test_the_push_keeps_its_rules(rig, monkeypatch, nursery):
    """A file changed after the prefetch began is not pushed and its chunk stays cached for its READ;
    a file the kernel forgot (ENOENT) stays cached too; a file pushed whole leaves the chunk cache;
    ``on_fetched`` says which were pushed, and ``stored`` counts them, once ``pending`` is 0."""
    kcache = KernelCache()
    infos = await _files(rig, kcache, [b"kept", b"changed", b"forgotten"])
    kernel = Kernel(monkeypatch, gone=frozenset({infos[b"forgotten"].attr.ino}))
    prefetcher = Prefetcher(rig.meta, rig.data, kcache)
    told: dict[int, bool] = {}
    prefetcher.on_fetched = lambda rsp, stored: told.__setitem__(rsp.attr.ino, stored)
    real_fetch = rig.data.fetch

    async def fetch(wants, *, node=None):
        kcache.changed_here(infos[b"changed"].attr.ino)  # a change noted after the prefetch's stamp
        return await real_fetch(wants, node=node)

    monkeypatch.setattr(rig.data, "fetch", fetch)
    nursery.start_soon(prefetcher.run)
    prefetcher.submit(ROOT, b"kept\nchanged\nforgotten")
    await _settled(prefetcher)
    ino = {name: info.attr.ino for name, info in infos.items()}
    assert [s[0] for s in kernel.stores] == [ino[b"kept"]]
    assert told == {ino[b"kept"]: True, ino[b"changed"]: False, ino[b"forgotten"]: False}
    assert prefetcher.stored == 1 and prefetcher.fetched == 3

    def cached(name: bytes) -> bool:
        return rig.data.cache.peek((ino[name], 0, infos[name].chunks[0].version)) is not None

    assert not cached(b"kept") and cached(b"changed") and cached(b"forgotten")


async def test_the_pushing_thread_ends_with_the_prefetcher(rig, monkeypatch):
    Kernel(monkeypatch)
    kcache = KernelCache()
    await _files(rig, kcache, [b"x"])
    prefetcher = Prefetcher(rig.meta, rig.data, kcache)
    async with trio.open_nursery() as own:
        own.start_soon(prefetcher.run)
        prefetcher.submit(ROOT, b"x")
        await _settled(prefetcher)
        pushers = [t for t in threading.enumerate() if t.name == "prefetch-push"]
        assert len(pushers) == 1 and prefetcher.stored == 1
        own.cancel_scope.cancel()
    with trio.fail_after(10):
        while pushers[0].is_alive():
            await trio.sleep(0.01)
