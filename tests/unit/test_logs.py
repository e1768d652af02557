"""Logging: journald-friendly, one line per event."""


def test_journald_lines_are_one_per_event(monkeypatch):
    import io
    import logging

    from stripefs.common.logs import setup_logging

    monkeypatch.setenv("JOURNAL_STREAM", "8:1234")
    out = io.StringIO()
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        setup_logging("meta", stream=out)
        log = logging.getLogger("stripefs.test")
        log.warning("node %d: disk slow", 3)
        try:
            raise ValueError("boom")
        except ValueError:
            log.exception("chunk %s: write failed", "12:0:1")
    finally:
        root.handlers[:], root.level = saved
    lines = out.getvalue().splitlines()
    assert lines[0] == "<4>stripefs.test: node 3: disk slow"
    assert len(lines) == 2 and lines[1].startswith("<3>stripefs.test: chunk 12:0:1: write failed | Traceback")
    assert "ValueError: boom" in lines[1]
