"""The command line: help that explains, errors that say what to do."""

import socket

import pytest

from conftest import run_cli
from stripefs.local_cluster import _is_mounted


@pytest.mark.parametrize(
    "args,words",
    [
        ([], ["local up"]),
        (["meta"], ["metadata", "--config"]),
        (["storage"], ["storage", "--config"]),
        (["mount"], ["META_ADDR", "MOUNTPOINT", "allow_other"]),
        (["local", "up"], ["--nodes", "--mount"]),
        (["layout", "set"], ["--chunk-size", "--replicas"]),
        (["status"], ["--json"]),
    ],
)
def test_help_explains(args, words):
    out = run_cli(*args, "--help").stdout
    for w in words:
        assert w in out, (args, w)


def test_mount_without_a_daemon_says_so(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here
    res = run_cli("mount", f"tcp://127.0.0.1:{port}", str(tmp_path), "--log", str(tmp_path.parent / "m.log"), check=False)
    assert res.returncode != 0
    assert "no metadata daemon answered" in res.stderr and "Traceback" not in res.stderr
    assert not _is_mounted(tmp_path)
    res = run_cli("mount", "nonsense", str(tmp_path), check=False)
    assert res.returncode == 1 and "tcp://HOST:PORT" in res.stderr


def test_admin_command_without_a_cluster_says_how_to_find_one(tmp_path):
    res = run_cli("status", "--dir", str(tmp_path), check=False, env={"PATH": "/usr/bin:/bin"})
    assert res.returncode == 1 and "--meta" in res.stderr and "Traceback" not in res.stderr
