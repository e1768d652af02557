"""One tier's bucket: object names, checksums, and boto3 run in worker threads.

Pure parts (tested in tests/unit/test_tiering.py): ``parse_url``,
``object_name`` / ``parse_object_name``, ``to_signed`` / ``to_unsigned`` (xxh3
is unsigned 64-bit, the metadata store keeps signed 64-bit integers).

``Bucket`` wraps a blocking boto3 S3 client; every call goes through
``trio.to_thread.run_sync`` with a shared ``CapacityLimiter``, as the
PostgreSQL store runs psycopg. Failures become ``StripefsError(IO)`` whose
message names the tier, the bucket and the object. Credentials come from the
standard AWS environment variables or the shared-credentials file named by
``tier_credentials`` in metad.toml: never from the command line or the
database, never logged (docs/tiering.md).
"""

from __future__ import annotations

import base64
import hashlib
import logging
import re
import threading
from typing import TYPE_CHECKING

import trio
import xxhash

from ..common.errors import ErrorCode, StripefsError

if TYPE_CHECKING:
    from ..common.config import MetaConfig

log = logging.getLogger(__name__)
# boto3's own loggers stay quiet even under --debug: their debug lines carry signed request headers
for _name in ("boto3", "botocore", "s3transfer", "urllib3"):
    logging.getLogger(_name).setLevel(logging.WARNING)

#: objects one DeleteObjects request names (S3's limit)
DELETE_BATCH = 1000

_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_NAME = re.compile(r"^(?P<cluster>[0-9a-f]{32})/(?P<ino>[0-9]+)/(?P<idx>[0-9]+)\.(?P<version>[0-9]+)\.(?P<stamp>[0-9]+)$")


def parse_url(url: str) -> tuple[str, str]:
    """(bucket, prefix) of ``s3://BUCKET[/PREFIX]``; the prefix ends with '/' unless empty."""
    if not url.startswith("s3://"):
        raise ValueError(f"{url!r}: a tier is s3://BUCKET[/PREFIX]")
    bucket, _, prefix = url[5:].partition("/")
    if not _BUCKET.match(bucket):
        raise ValueError(f"{bucket!r} is not a valid bucket name (3-63 of a-z, 0-9, '.' and '-')")
    prefix = prefix.strip("/")
    return bucket, prefix + "/" if prefix else ""


def object_name(prefix: str, cluster_id: str, ino: int, idx: int, version: int, stamp: int) -> str:
    """The object holding version ``version`` of chunk ``idx`` of file ``ino``, uploaded by the migration
    whose intent was recorded at ``stamp`` (ns): a chunk version migrated, recalled and migrated again gets
    a new name, so a deletion of the old object still queued can never hit the new one (docs/tiering.md)."""
    return f"{prefix}{cluster_id}/{ino}/{idx}.{version}.{stamp}"


def parse_object_name(prefix: str, name: str) -> tuple[str, int, int, int, int] | None:
    """(cluster_id, ino, idx, version, stamp) of an object name, None when it is not one of ours."""
    if not name.startswith(prefix):
        return None
    m = _NAME.match(name[len(prefix):])
    if m is None:
        return None
    return m["cluster"], int(m["ino"]), int(m["idx"]), int(m["version"]), int(m["stamp"])


def to_signed(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


def to_unsigned(x: int) -> int:
    return x + (1 << 64) if x < 0 else x


def checksum(data: bytes | memoryview) -> int:
    return xxhash.xxh3_64_intdigest(data)


class Bucket:
    """The bucket of one tier. ``await put(...)``, ``get``, ``head``, ``delete``, ``list``."""

    def __init__(self, name: str, bucket: str, prefix: str, endpoint: str, region: str, config: MetaConfig,
                 limiter: trio.CapacityLimiter):
        self.name = name
        self.bucket = bucket
        self.prefix = prefix
        self.endpoint = endpoint
        self.region = region
        self.limiter = limiter
        self._config = config
        self._client = None
        self._client_lock = threading.Lock()  # worker threads ask for the client at once: one is made

    def __str__(self) -> str:
        return f"tier {self.name} (s3://{self.bucket}/{self.prefix}{' at ' + self.endpoint if self.endpoint else ''})"

    def client(self):
        with self._client_lock:
            return self._make_client()

    def _make_client(self):
        if self._client is None:
            import boto3
            from botocore.config import Config

            cfg = self._config
            session = boto3.session.Session(profile_name=cfg.tier_profile or None) if not cfg.tier_credentials else None
            if cfg.tier_credentials:
                import botocore.session

                core = botocore.session.Session(profile=cfg.tier_profile or None)
                core.set_config_variable("credentials_file", cfg.tier_credentials)
                session = boto3.session.Session(botocore_session=core)
            self._client = session.client(
                "s3",
                endpoint_url=self.endpoint or None,
                region_name=self.region or "us-east-1",
                config=Config(
                    connect_timeout=cfg.tier_timeout_s,
                    read_timeout=cfg.tier_timeout_s,
                    retries={"max_attempts": 2, "mode": "standard"},
                    max_pool_connections=max(4, cfg.tier_parallelism * 2),
                    s3={"addressing_style": "path"},
                ),
            )
        return self._client

    async def _run(self, what: str, fn, *args, **kwargs):
        def call():
            return fn(self.client(), *args, **kwargs)

        try:
            return await trio.to_thread.run_sync(call, limiter=self.limiter)
        except StripefsError:
            raise
        except Exception as exc:  # botocore: connection, timeout, HTTP errors; all mean "the bucket failed"
            raise StripefsError(ErrorCode.IO, f"{self}: {what} failed: {_reason(exc)}") from None

    async def check(self) -> None:
        """The bucket answers with these credentials (HeadBucket)."""
        await self._run("reaching the bucket", lambda c: c.head_bucket(Bucket=self.bucket))

    async def put(self, name: str, data: bytes | memoryview, xxh3: int) -> None:
        """Store ``data`` as ``name`` with its checksum; the bucket checks Content-MD5 on arrival."""
        meta = {"xxh3": f"{xxh3:016x}", "length": str(len(data))}

        def upload(c):
            body = bytes(data)
            md5 = base64.b64encode(hashlib.md5(body).digest()).decode()  # in the worker thread, as the upload
            c.put_object(Bucket=self.bucket, Key=name, Body=body, ContentMD5=md5, Metadata=meta)

        await self._run(f"upload of {name}", upload)

    async def verify(self, name: str, length: int, xxh3: int) -> None:
        """The object exists with that length and checksum (HeadObject); IO otherwise."""
        head = await self._run(f"check of {name}", lambda c: c.head_object(Bucket=self.bucket, Key=name))
        meta = head.get("Metadata", {})
        if head.get("ContentLength") != length or meta.get("xxh3") != f"{xxh3:016x}":
            raise StripefsError(
                ErrorCode.CORRUPT,
                f"{self}: {name} holds {head.get('ContentLength')} bytes with xxh3 {meta.get('xxh3')}, "
                f"expected {length} bytes with {xxh3:016x}",
            )

    async def get(self, name: str, length: int, xxh3: int) -> bytes:
        """The object's bytes, checked against the length and checksum the metadata store recorded."""

        def fetch(c):
            return c.get_object(Bucket=self.bucket, Key=name)["Body"].read()

        data = await self._run(f"download of {name}", fetch)
        got = await trio.to_thread.run_sync(checksum, data, limiter=self.limiter)
        if len(data) != length or got != xxh3:
            raise StripefsError(
                ErrorCode.CORRUPT,
                f"{self}: {name} read back {len(data)} bytes with xxh3 {got:016x}, expected {length} with {xxh3:016x}",
            )
        return data

    async def delete(self, names: list[str]) -> list[str]:
        """Delete objects (missing ones are fine); the names whose deletion failed."""
        failed: list[str] = []
        for i in range(0, len(names), DELETE_BATCH):
            part = names[i : i + DELETE_BATCH]
            rsp = await self._run(
                f"deletion of {len(part)} object(s)",
                lambda c: c.delete_objects(Bucket=self.bucket, Delete={"Objects": [{"Key": n} for n in part], "Quiet": True}),
            )
            failed += [e["Key"] for e in rsp.get("Errors", [])]
        return failed

    async def list(self, under: str) -> dict[str, int]:
        """name -> size of every object whose name starts with ``under``."""

        def run(c):
            out = {}
            for page in c.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=under):
                for obj in page.get("Contents", []):
                    out[obj["Key"]] = obj["Size"]
            return out

        return await self._run(f"listing of {under}", run)


def _reason(exc: Exception) -> str:
    """A short reason for a boto3 failure, without anything secret (no request headers)."""
    response = getattr(exc, "response", None)
    if isinstance(response, dict) and "Error" in response:
        err = response["Error"]
        return f"{err.get('Code', '?')}: {err.get('Message', '')}".strip()
    return f"{type(exc).__name__}: {exc}"
