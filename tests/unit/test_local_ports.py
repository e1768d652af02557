"""The ports a local cluster picks (stripefs.local_cluster): a port the caller fixed is never picked again."""

import socket

import pytest

from stripefs.common.errors import QuietError
from stripefs.local_cluster import PORTS_ENV, free_port, reserve_port


def test_a_fixed_port_is_never_handed_out_for_another_process_of_the_cluster(monkeypatch):
    with socket.socket() as s:  # a port free now: the range is that one port
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv(PORTS_ENV, f"{port}-{port}")
    assert reserve_port(port) == port  # --set meta.listen=tcp://0.0.0.0:PORT: the daemon binds it later
    with pytest.raises(QuietError, match="no free port"):
        free_port()  # the only port of the range is the daemon's: not the mount's metrics port too
