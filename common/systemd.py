"""sd_notify(3) without libsystemd: one datagram to $NOTIFY_SOCKET.

Services send ``READY=1`` once their sockets are bound (Type=notify units) and
``STOPPING=1`` when they begin a clean shutdown. Outside systemd this is a no-op.
"""

from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger(__name__)


def notify(state: str) -> bool:
    """Send ``state`` (e.g. "READY=1") to the service manager; False when not under one."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):  # abstract namespace
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(address)
            sock.sendall(state.encode())
    except OSError as exc:
        log.warning("sd_notify(%s) to %s failed: %s", state, address, exc)
        return False
    return True
