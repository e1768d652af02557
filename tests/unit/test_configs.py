"""Config files: every example loads, every kind of mistake names the key and the file."""

import subprocess
import sys
from pathlib import Path

import pytest

from stripefs.common import config as cfg
from stripefs.common.errors import QuietError

REPO = Path(__file__).resolve().parents[2]
FILES = {"meta": "metad.toml", "storage": "storage.toml", "client": "client.toml"}


@pytest.mark.parametrize("role", sorted(cfg.ROLES))
def test_deploy_examples_are_what_config_example_prints(role):
    # deploy/ ships the same text 'stripefs config example ROLE' prints: one template, two ways to get it
    assert (REPO / "deploy" / FILES[role]).read_text() == cfg.example(role)
    res = subprocess.run([sys.executable, "-m", "stripefs", "config", "example", role], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and res.stdout == cfg.example(role)
    assert isinstance(cfg.load(REPO / "deploy" / FILES[role], cfg.ROLES[role]), cfg.ROLES[role])


@pytest.mark.parametrize(
    "role,line,key",
    [
        ("meta", 'listen_addr = "tcp://0.0.0.0:7100"', "listen_addr"),  # unknown key
        ("meta", "node_timeout_s = \"ten\"", "node_timeout_s"),  # wrong type
        ("meta", 'chunk_size = "4Q"', "chunk_size"),  # bad size
        ("storage", "node_id = -", "node_id"),  # not TOML at all: the line is named instead
        ("storage", 'meta = "tcp://x:1"', "meta"),  # a string where a list is expected
        ("client", 'cache_size = "lots"', "cache_size"),
        ("client", "metrics = 9100", "metrics"),
    ],
)
def test_bad_config_names_the_key_and_the_file(tmp_path, role, line, key):
    path = tmp_path / FILES[role]
    base = "node_id = 1\n" if role == "storage" and not line.startswith("node_id") else ""
    path.write_text(base + line + "\n")
    with pytest.raises(QuietError) as err:
        cfg.load(path, cfg.ROLES[role])
    message = str(err.value)
    assert str(path) in message
    assert key in message or "line 1" in message or "line 2" in message, message


def test_missing_required_key_is_named(tmp_path):
    path = tmp_path / "storage.toml"
    path.write_text('listen = "tcp://127.0.0.1:7101"\n')
    with pytest.raises(QuietError, match=r"storage.toml.*node_id"):
        cfg.load(path, cfg.StorageConfig)


@pytest.mark.parametrize("role,command", [("meta", ["meta"]), ("storage", ["storage"])])
def test_daemons_refuse_a_bad_config_plainly(tmp_path, role, command):
    path = tmp_path / FILES[role]
    path.write_text(("node_id = 1\n" if role == "storage" else "") + 'data_dri = "/tmp/x"\n')
    res = subprocess.run([sys.executable, "-m", "stripefs", *command, "--config", str(path)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 1
    assert str(path) in res.stderr and "data_dri" in res.stderr and "Traceback" not in res.stderr

