"""One logging setup per process.

Under systemd (JOURNAL_STREAM set) lines carry a ``<N>`` syslog priority prefix
so journald records levels, and every event is one line (tracebacks included);
otherwise a timestamped plain format. Messages name what they are about:
``node 3``, ``chunk 12:0:1`` (ino:index:part), ``inode 12``, ``session N``,
``request N``, so ``journalctl -u 'stripefs-*' | grep 'chunk 12:'`` follows one
chunk across processes. SIGUSR1
dumps every thread's stack (faulthandler) to find where a process hangs.
"""

from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import signal
import sys

_PRIORITY = {logging.DEBUG: 7, logging.INFO: 6, logging.WARNING: 4, logging.ERROR: 3, logging.CRITICAL: 2}


class SystemdFormatter(logging.Formatter):
    """``<N>logger: message``, one line per event: journald makes an entry of every line
    it reads, so a traceback's newlines are written as `` | `` to keep it one entry."""

    def format(self, record: logging.LogRecord) -> str:
        prio = _PRIORITY.get(record.levelno, 6)
        return f"<{prio}>" + super().format(record).replace("\n", " | ")


def setup_logging(role: str, *, debug: bool | list[str] = False, stream=None) -> None:
    """Configure the root logger for a process of ``role``.

    ``debug`` True turns on DEBUG everywhere; a list of module names turns it on
    only for those (``--debug stripefs.client.operations``).
    """
    handler = logging.StreamHandler(stream or sys.stderr)
    if os.environ.get("JOURNAL_STREAM"):
        handler.setFormatter(SystemdFormatter("%(name)s: %(message)s"))
    else:
        handler.setFormatter(
            logging.Formatter(f"%(asctime)s.%(msecs)03d {role}[%(process)d] %(levelname)s %(name)s: %(message)s", "%H:%M:%S")
        )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
    if debug is True:
        root.setLevel(logging.DEBUG)
    elif debug:
        for name in debug:
            logging.getLogger(name).setLevel(logging.DEBUG)
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, all_threads=True)


def add_debug_argument(parser: argparse.ArgumentParser, example_module: str) -> None:
    """``--debug`` (everywhere) or ``--debug MOD[,MOD...]`` (only those modules): the same on every process."""
    parser.add_argument(
        "--debug",
        nargs="?",
        const="all",
        metavar="MODULES",
        help=f"log at DEBUG level: everywhere, or only in the given comma-separated modules (e.g. {example_module})",
    )


def debug_setting(value: str | None) -> bool | list[str]:
    """What ``--debug`` asked for, in the form ``setup_logging`` takes."""
    if value is None:
        return False
    if value == "all":
        return True
    return [m.strip() for m in value.split(",") if m.strip()]
