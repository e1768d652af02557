"""Names are bytes: the admin CLI prints non-UTF-8 names of a mount and takes them as arguments without crashing.

What names the mount's handlers and the daemon take, and the errno of the
impossible ones, is tested without a kernel (tests/inprocess/test_names_ops.py).
"""

from __future__ import annotations

import os
import subprocess
import sys


def _b(path) -> bytes:
    return os.fsencode(path)


def test_admin_cli_takes_and_prints_non_utf8_names(cluster, mnt):
    d = _b(mnt) + b"/\xff\xfe-layout"
    os.mkdir(d)
    res = subprocess.run([sys.executable, "-m", "stripefs", "layout", "get", d], capture_output=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith(d + b": chunk_size=")  # the same bytes back, as ls prints them
    res = subprocess.run([sys.executable, "-m", "stripefs", "layout", "get", "--meta", cluster.meta_address,
                          b"/" + os.path.relpath(d, _b(cluster.mnt))], capture_output=True, timeout=120)
    assert res.returncode == 0, res.stderr
    too_long = b"/" + b"/".join([b"e" * 200] * 21)
    res = subprocess.run([sys.executable, "-m", "stripefs", "layout", "get", "--meta", cluster.meta_address, too_long],
                         capture_output=True, timeout=120)
    assert res.returncode == 1 and b"File name too long" in res.stderr and b"Traceback" not in res.stderr
    res = subprocess.run([sys.executable, "-m", "stripefs", "status", d], capture_output=True, timeout=120)
    assert res.returncode == 0, res.stderr
