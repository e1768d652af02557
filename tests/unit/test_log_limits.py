"""common/log_limits.py: a flood of one kind of line logged once per interval, the rest counted."""

from __future__ import annotations

import logging

from stripefs.common import log_limits
from stripefs.common.log_limits import LogEvery


def test_one_line_per_key_and_interval_and_the_count_of_the_rest_with_the_next(monkeypatch, caplog):
    now = [100.0]
    monkeypatch.setattr(log_limits.time, "monotonic", lambda: now[0])
    log = logging.getLogger("test.log_limits")
    limited = LogEvery(log, every_s=10.0)
    with caplog.at_level(logging.WARNING, logger=log.name):
        assert limited.log(logging.WARNING, "a", "stripe %d degraded", 1)
        for i in range(2, 6):  # within the interval: held back, counted
            now[0] += 1.0
            assert not limited.log(logging.WARNING, "a", "stripe %d degraded", i)
        assert limited.log(logging.WARNING, "b", "another kind %s", "x")  # keys are apart
        now[0] = 110.5
        assert limited.log(logging.WARNING, "a", "stripe %d degraded", 9)
        now[0] = 121.0
        assert limited.log(logging.WARNING, "a", "stripe %d degraded", 10)  # nothing held back: no count
    assert [r.getMessage() for r in caplog.records] == [
        "stripe 1 degraded",
        "another kind x",
        "stripe 9 degraded (and 4 more like it in the last 10 s)",
        "stripe 10 degraded",
    ]


def test_a_level_the_logger_drops_is_neither_logged_nor_counted(caplog):
    log = logging.getLogger("test.log_limits.quiet")
    limited = LogEvery(log, every_s=10.0)
    with caplog.at_level(logging.ERROR, logger=log.name):
        assert not limited.log(logging.INFO, "k", "not shown")
    assert not limited._last and not caplog.records


def test_the_keys_remembered_are_bounded(monkeypatch):
    monkeypatch.setattr(log_limits, "MAX_KEYS", 3)
    limited = LogEvery(logging.getLogger("test.log_limits.bounded"), every_s=10.0)
    for key in range(10):
        limited.log(logging.WARNING, key, "k %d", key)
    assert len(limited._last) <= 3
