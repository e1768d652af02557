"""The plugin's calls to the cluster: volume directories, their quotas and layouts, over the public protocol.

The controller needs no mount: it speaks the metadata daemon's protocol
(common/protocol.py) as the admin commands do (stripefs/cluster.py), with the
plugin's own CURVE key when the cluster is secure. The key is held per ZeroMQ
context (common/security.py ``use_identity(ctx, ...)``), never as the process
default, so that gRPC's worker threads, each running its own short trio loop
here, cannot mix keys.

Every call maps the cluster's error codes to ``CsiError`` with the gRPC status
the CSI spec names (a missing volume: NOT_FOUND; the cluster unreachable:
UNAVAILABLE, which the sidecars retry).
"""

from __future__ import annotations

import logging
import os
import stat
from dataclasses import dataclass

import grpc
import trio
import zmq

from ..common import protocol as p
from ..common.errors import ErrorCode, StripefsError
from ..common.security import Identity, use_identity
from ..common.transport import connect

log = logging.getLogger(__name__)

#: how long one call to the metadata daemon may take before the next daemon is tried
RPC_TIMEOUT_S = 10.0


class CsiError(Exception):
    """A failed CSI call: the gRPC status code the spec names, and a message saying what to do."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


_STATUS_BY_CODE = {
    ErrorCode.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    ErrorCode.NO_ATTR: grpc.StatusCode.NOT_FOUND,
    ErrorCode.EXISTS: grpc.StatusCode.ALREADY_EXISTS,
    ErrorCode.NOT_DIR: grpc.StatusCode.FAILED_PRECONDITION,
    ErrorCode.NOT_EMPTY: grpc.StatusCode.FAILED_PRECONDITION,
    ErrorCode.INVALID: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorCode.NAME_TOO_LONG: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorCode.PERMISSION: grpc.StatusCode.PERMISSION_DENIED,
    ErrorCode.ACCESS: grpc.StatusCode.PERMISSION_DENIED,
    ErrorCode.READ_ONLY: grpc.StatusCode.PERMISSION_DENIED,
    ErrorCode.TIMEOUT: grpc.StatusCode.UNAVAILABLE,
    ErrorCode.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    ErrorCode.BUSY: grpc.StatusCode.UNAVAILABLE,
    ErrorCode.NO_SPACE: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ErrorCode.QUOTA_EXCEEDED: grpc.StatusCode.RESOURCE_EXHAUSTED,
}


def split_path(path: str) -> list[bytes]:
    """The names of an absolute namespace path; '..' and '.' are refused (a volume id names one directory)."""
    if not path.startswith("/"):
        raise CsiError(grpc.StatusCode.INVALID_ARGUMENT, f"{path!r} is not an absolute path in the cluster (like /k8s/pvc-1)")
    parts = [x for x in path.split("/") if x]
    if any(x in (".", "..") for x in parts):
        raise CsiError(grpc.StatusCode.INVALID_ARGUMENT, f"{path!r}: '.' and '..' are not allowed in a volume path")
    return [os.fsencode(x) for x in parts]


@dataclass
class Namespace:
    """The cluster's metadata daemons (``tcp://HOST:PORT[?key=Z85]``) and the key to call them with."""

    addresses: list[str]
    identity: Identity | None = None

    def call(self, *requests: p.Msg) -> list[p.Msg]:
        """Replies to ``requests``, sent in order to the first metadata daemon that answers."""
        return trio.run(self._call, list(requests))

    def run(self, fn, *args):
        """``await fn(call, *args)`` in one trio run, ``call(request)`` being one request on one connection:
        what takes many requests (a tree's removal) opens one connection for them all."""
        return trio.run(self._run, fn, args)

    async def _run(self, fn, args):
        ctx = zmq.Context()
        if self.identity is not None:
            use_identity(ctx, self.identity)
        last = "no metadata address"
        try:
            for address in self.addresses:
                try:
                    async with connect(ctx, address, timeout=RPC_TIMEOUT_S) as client:
                        async def call(request: p.Msg) -> p.Msg:
                            return (await client.call(request))[0]

                        return await fn(call, *args)
                except StripefsError as exc:
                    if exc.code not in (ErrorCode.TIMEOUT, ErrorCode.UNAVAILABLE):
                        raise _to_csi(exc) from None
                    last = f"{address}: {exc.message or exc.code.name}"
            raise CsiError(grpc.StatusCode.UNAVAILABLE, f"no metadata daemon answered ({last}); is the cluster up?")
        finally:
            ctx.destroy(linger=0)

    async def _call(self, requests: list[p.Msg]) -> list[p.Msg]:
        async def each(call):
            return [await call(r) for r in requests]

        return await self._run(each, ())

    # -- what the controller and node services need ------------------------------------------

    def lookup(self, path: str) -> p.Attr | None:
        """The attributes of ``path``, or None when it does not exist."""
        return self.run(_lookup, split_path(path))

    def make_dirs(self, path: str, mode: int) -> tuple[p.Attr, bool]:
        """Create ``path`` and missing parents (``mode``); its attributes, and whether it was made now."""
        return self.run(_make_dirs, split_path(path), mode)

    def remove_tree(self, path: str) -> bool:
        """Remove ``path`` and everything below it; False when it was not there."""
        return self.run(_remove_tree, split_path(path))

    def rename(self, path: str, new_path: str) -> None:
        """Move ``path`` to ``new_path`` (its parent is created when missing)."""
        self.run(_rename, split_path(path), split_path(new_path))

    def quota(self, ino: int) -> p.QuotaInfo | None:
        """The quota set on directory ``ino`` itself, or None."""
        (rsp,) = self.call(p.QuotaGetReq(ino=ino))
        return next((q for q in rsp.quotas if q.ino == ino), None)

    def total_bytes(self) -> int:
        """What the storage nodes can hold (StatfsReq): no volume may be promised more."""
        (rsp,) = self.call(p.StatfsReq())
        return rsp.total_bytes


def _to_csi(exc: StripefsError) -> CsiError:
    code = _STATUS_BY_CODE.get(exc.code, grpc.StatusCode.INTERNAL)
    return CsiError(code, f"the cluster answered {getattr(exc.code, 'name', exc.code)}: {exc.message}")


async def _lookup(call, names: list[bytes]) -> p.Attr | None:
    ino = 1
    attr = None
    for name in names:
        try:
            attr = (await call(p.LookupReq(parent=ino, name=name))).attr
        except StripefsError as exc:
            if exc.code == ErrorCode.NOT_FOUND:
                return None
            raise
        ino = attr.ino
    if attr is None:
        attr = (await call(p.GetattrReq(ino=1))).attr
    return attr


async def _make_dirs(call, names: list[bytes], mode: int) -> tuple[p.Attr, bool]:
    ino, attr, made = 1, None, False
    for i, name in enumerate(names):
        last = i == len(names) - 1
        try:
            attr = (await call(p.MkdirReq(parent=ino, name=name, mode=mode if last else 0o755, uid=0, gid=0))).attr
            made = last
        except StripefsError as exc:
            if exc.code != ErrorCode.EXISTS:
                raise
            attr = (await call(p.LookupReq(parent=ino, name=name))).attr
            made = False
        if not stat.S_ISDIR(attr.mode):
            raise CsiError(grpc.StatusCode.FAILED_PRECONDITION, f"{os.fsdecode(name)} in the volume path is not a directory")
        ino = attr.ino
    return attr, made


async def _remove_tree(call, names: list[bytes]) -> bool:
    parent = (await _lookup(call, names[:-1])) if names[:-1] else None
    parent_ino = parent.ino if parent else 1
    if names[:-1] and parent is None:
        return False
    try:
        attr = (await call(p.LookupReq(parent=parent_ino, name=names[-1]))).attr
    except StripefsError as exc:
        if exc.code == ErrorCode.NOT_FOUND:
            return False
        raise
    if stat.S_ISDIR(attr.mode):
        await _empty_dir(call, attr.ino)
        await call(p.RmdirReq(parent=parent_ino, name=names[-1]))
    else:
        await call(p.UnlinkReq(parent=parent_ino, name=names[-1]))
    return True


async def _empty_dir(call, ino: int) -> None:
    """Remove everything in directory ``ino``, depth first. Listing again from the start after each
    batch: removed names shift no cookie of the names still to come, but a fresh listing is simplest."""
    while True:
        rsp = await call(p.ReaddirReq(ino=ino, limit=1000))
        entries = [e for e in rsp.entries if e.name not in (b".", b"..")]
        if not entries:
            return
        for e in entries:
            if stat.S_ISDIR(e.attr.mode):
                await _empty_dir(call, e.attr.ino)
                await call(p.RmdirReq(parent=ino, name=e.name))
            else:
                await call(p.UnlinkReq(parent=ino, name=e.name))


async def _rename(call, names: list[bytes], new_names: list[bytes]) -> None:
    parent = await _lookup(call, names[:-1])
    new_parent, _ = await _make_dirs(call, new_names[:-1], 0o700)
    await call(p.RenameReq(parent_old=parent.ino if parent else 1, name_old=names[-1], parent_new=new_parent.ino, name_new=new_names[-1]))
