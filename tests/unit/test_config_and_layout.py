"""Pure parts: sizes, layouts, extents, configs, the chunk cache."""

from pathlib import Path

import pytest
import trio

from stripefs.client.chunk_cache import ChunkCache
from stripefs.common import config as cfg
from stripefs.common.errors import ErrorCode, QuietError, StripefsError
from stripefs.common.layout import DEFAULT_LAYOUT, chunk_count, chunk_extents, parse_redundancy, parse_size, validate_layout
from stripefs.common.protocol import Layout

REPO = Path(__file__).resolve().parents[2]


def test_parse_size_binary_units():
    assert parse_size("4M") == 4 << 20
    assert parse_size("64K") == 65536
    assert parse_size("1G") == 1 << 30
    assert parse_size("1.5K") == 1536
    assert parse_size("2MiB") == 2 << 20
    assert parse_size(123) == 123
    for bad in ("", "abc", "4X", "-1M", "1.3"):
        with pytest.raises(ValueError):
            parse_size(bad)


def test_redundancy_and_layout_validation():
    assert parse_redundancy("replicas=3").copies == 3
    ec = parse_redundancy("ec=4+2")
    assert ec.is_ec and ec.copies == 6 and str(ec) == "ec=4+2"
    for bad in ("replicas=0", "replicas=9", "ec=17+1", "ec=4+5", "mirror"):
        with pytest.raises(StripefsError) as e:
            parse_redundancy(bad)
        assert e.value.code == ErrorCode.INVALID
    validate_layout(DEFAULT_LAYOUT)
    with pytest.raises(StripefsError, match="chunk_size"):
        validate_layout(Layout(chunk_size=3000, stripe_count=1, redundancy="replicas=1"))
    with pytest.raises(StripefsError, match="stripe_count"):
        validate_layout(Layout(chunk_size=1 << 20, stripe_count=0, redundancy="replicas=1"))


def test_chunk_extents_cover_the_range_exactly():
    cs = 1000
    for offset, length in [(0, 0), (0, 1000), (999, 2), (1500, 3000), (0, 1), (2000, 1000)]:
        exts = list(chunk_extents(offset, length, cs))
        assert sum(e.length for e in exts) == length
        pos = offset
        for e in exts:
            assert e.file_offset == pos and e.index == pos // cs and e.offset == pos % cs
            assert 0 < e.length <= cs - e.offset
            pos += e.length
    assert chunk_count(0, cs) == 0 and chunk_count(1, cs) == 1 and chunk_count(1000, cs) == 1 and chunk_count(1001, cs) == 2


@pytest.mark.parametrize("name,kind", [("metad.toml", cfg.MetaConfig), ("storage.toml", cfg.StorageConfig), ("client.toml", cfg.ClientConfig)])
def test_example_configs_load(name, kind):
    loaded = cfg.load(REPO / "deploy" / name, kind)
    assert isinstance(loaded, kind)
    role = {"metad.toml": "meta", "storage.toml": "storage", "client.toml": "client"}[name]
    assert cfg.loads(cfg.example(role), kind) == loaded


def test_config_errors_name_the_key_and_file(tmp_path):
    p = tmp_path / "storage.toml"
    p.write_text('node_id = 1\nblok_size = "64K"\n')
    with pytest.raises(QuietError, match=r"storage.toml.*blok_size"):
        cfg.load(p, cfg.StorageConfig)
    p.write_text('node_id = 1\ncapacity = "lots"\n')
    with pytest.raises(QuietError, match=r"capacity"):
        cfg.load(p, cfg.StorageConfig)
    with pytest.raises(QuietError, match="cannot read"):
        cfg.load(tmp_path / "missing.toml", cfg.MetaConfig)
    sc = cfg.StorageConfig(node_id=3, capacity=cfg.Size(1 << 30))
    assert cfg.loads(cfg.dumps(sc), cfg.StorageConfig) == sc


async def test_chunk_cache_budget_and_single_flight():
    cache = ChunkCache(budget_bytes=250)
    loads = 0

    async def load():
        nonlocal loads
        loads += 1
        await trio.sleep(0.01)
        return b"x" * 100

    async with trio.open_nursery() as n:
        for _ in range(10):
            n.start_soon(cache.fetch, (1, 0, 1), load)
    assert loads == 1  # ten concurrent readers, one load
    await cache.fetch((1, 1, 1), load)
    await cache.fetch((1, 2, 1), load)  # 300 bytes > budget: the oldest goes
    assert cache.used <= 250 and cache.get((1, 0, 1)) is None and cache.get((1, 2, 1)) is not None
    cache.drop_inode(1)
    assert cache.used == 0

    async def failing():
        raise StripefsError(ErrorCode.IO, "boom")

    with pytest.raises(StripefsError):
        await cache.fetch((2, 0, 1), failing)
    assert (2, 0, 1) not in cache
