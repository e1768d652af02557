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


def test_a_reply_the_kernel_no_longer_waits_for_is_no_error():
    """pyfuse3's ERROR for a reply refused with ENOENT (a RELEASE answered after an unmount) is
    logged at INFO; other reply failures stay errors."""
    import io
    import logging

    from stripefs.common.logs import setup_logging

    out = io.StringIO()
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        setup_logging("mount", stream=out)
        log = logging.getLogger("pyfuse3")
        log.error("fuse_release(): fuse_reply_* failed with %s", "No such file or directory")
        log.error("fuse_read(): fuse_reply_* failed with %s", "Invalid argument")
    finally:
        root.handlers[:], root.level = saved
    first, second = out.getvalue().splitlines()
    assert " INFO pyfuse3: fuse_release(): fuse_reply_* failed with No such file or directory (the kernel no longer" in first
    assert " ERROR pyfuse3: fuse_read(): fuse_reply_* failed with Invalid argument" in second
