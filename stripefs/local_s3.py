"""An S3 endpoint on loopback for ``stripefs local up --tier s3``: moto's standalone server.

It speaks the real S3 protocol over HTTP, so the daemon's boto3 code is the
one a production bucket gets (docs/tiering.md). Its objects live in this
process's memory: stopping it loses them. For trying tiering and for the
tests, never for data.

    python -m stripefs local s3-server --dir STATE --port PORT

(started by ``LocalCluster.up``; its command line names STATE, so ``local
down`` finds it as it finds the cluster's other processes). The credentials
are moto's dummy ones, written to STATE/s3/credentials (0600) and named by
``tier_credentials`` in the daemon's config: never on a command line.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
import urllib.request
from pathlib import Path

from .common.errors import QuietError

log = logging.getLogger(__name__)

BUCKET = "stripefs-cold"
TIER = "cold"
#: moto accepts any keys; these are the ones its documentation uses
_CREDENTIALS = "[default]\naws_access_key_id = testing\naws_secret_access_key = testing\n"


def check_available() -> None:
    try:
        import moto.server  # noqa: F401
    except ImportError:
        raise QuietError("--tier s3 runs moto's S3 server, which is not installed: pip install 'stripefs[s3]' "
                         "(or moto[server])") from None


def write_credentials(state: Path) -> Path:
    d = state / "s3"
    d.mkdir(mode=0o700, exist_ok=True)
    path = d / "credentials"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(_CREDENTIALS)
    return path


def endpoint(port: int) -> str:
    return f"http://127.0.0.1:{port}"


def wait_ready(port: int, timeout: float) -> None:
    """Until the server answers and holds the bucket (it creates it at start)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"{endpoint(port)}/{BUCKET}?max-keys=1", timeout=1) as rsp:
                if rsp.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise QuietError(f"the local S3 server on port {port} did not come up (see its log)", 3)
        time.sleep(0.1)


def serve(state: Path, port: int) -> int:
    """Run moto's server on 127.0.0.1:``port`` with the bucket made, until SIGTERM."""
    check_available()
    from moto.server import ThreadedMotoServer

    os.environ.setdefault("AWS_SHARED_CREDENTIALS_FILE", str(state / "s3" / "credentials"))
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    import boto3

    boto3.client("s3", endpoint_url=endpoint(port), region_name="us-east-1").create_bucket(Bucket=BUCKET)
    print(f"local S3 server at {endpoint(port)}, bucket {BUCKET}", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    stop.wait()
    server.stop()
    return 0
