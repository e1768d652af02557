"""Typed error codes that travel on the wire, and their one errno table.

A handler raises ``StripefsError(ErrorCode.X, "what happened")``; the server
turns it into an ``ErrorRsp``; the client's RPC layer raises it again; the FUSE
boundary maps it to an errno with ``ERRNO_BY_CODE`` (unknown codes -> EIO).
Never match on message text: match on the code.
"""

from __future__ import annotations

import enum
import errno


class ErrorCode(enum.IntEnum):
    # generic
    INTERNAL = 1  # a bug on the server: logged there with a traceback
    BAD_REQUEST = 2  # malformed header or body, wrong payload count
    VERSION_MISMATCH = 3  # protocol version differs
    UNKNOWN_MESSAGE = 4
    TIMEOUT = 5  # the peer did not answer in time (raised locally)
    UNAVAILABLE = 6  # no healthy node / peer down
    LIMIT = 7  # a count one session or key may hold is reached (open inodes, sessions: docs/security.md)
    # namespace
    NOT_FOUND = 10
    EXISTS = 11
    NOT_DIR = 12
    IS_DIR = 13
    NOT_EMPTY = 14
    INVALID = 15
    NAME_TOO_LONG = 16
    NO_ATTR = 17  # xattr missing
    PERMISSION = 18
    CROSS_DEVICE = 19
    RANGE = 20  # xattr value too large for the caller's buffer
    # data
    NO_SPACE = 30  # disk full on a storage node
    STALE = 31  # the copy is older than the version asked for
    CORRUPT = 32  # a block failed its checksum: a bad copy, never returned as data
    IO = 33  # local I/O error on a storage node
    BUSY = 34  # the object changed under a long operation (a conversion's copy): try again
    # quotas
    QUOTA_EXCEEDED = 40  # a directory quota's byte or inode limit (daemon/quota.py)

    # authorisation (daemon/access.py, storage_node/access.py)
    READ_ONLY = 50  # the sender's key may not change anything
    ACCESS = 51  # outside the sender key's subtree, or a request its role may not send


ERRNO_BY_CODE: dict[int, int] = {
    ErrorCode.NOT_FOUND: errno.ENOENT,
    ErrorCode.EXISTS: errno.EEXIST,
    ErrorCode.NOT_DIR: errno.ENOTDIR,
    ErrorCode.IS_DIR: errno.EISDIR,
    ErrorCode.NOT_EMPTY: errno.ENOTEMPTY,
    ErrorCode.INVALID: errno.EINVAL,
    ErrorCode.NAME_TOO_LONG: errno.ENAMETOOLONG,
    ErrorCode.NO_ATTR: errno.ENODATA,
    ErrorCode.PERMISSION: errno.EPERM,
    ErrorCode.CROSS_DEVICE: errno.EXDEV,
    ErrorCode.RANGE: errno.ERANGE,
    ErrorCode.NO_SPACE: errno.ENOSPC,
    ErrorCode.TIMEOUT: errno.ETIMEDOUT,
    ErrorCode.UNAVAILABLE: errno.EIO,
    ErrorCode.BUSY: errno.EBUSY,
    ErrorCode.LIMIT: errno.EMFILE,
    ErrorCode.QUOTA_EXCEEDED: errno.EDQUOT,
    ErrorCode.READ_ONLY: errno.EROFS,
    ErrorCode.ACCESS: errno.EACCES,
}


def errno_for(code: int) -> int:
    """The errno a FUSE handler answers for an error code (EIO when unmapped)."""
    return ERRNO_BY_CODE.get(code, errno.EIO)


class StripefsError(Exception):
    """An error with a code that can cross the wire."""

    def __init__(self, code: ErrorCode | int, message: str = ""):
        self.code = ErrorCode(code) if code in ErrorCode._value2member_map_ else code
        self.message = message
        super().__init__(f"{getattr(self.code, 'name', self.code)}: {message}")

    @property
    def errno(self) -> int:
        return errno_for(int(self.code))


def error_from(code: int, message: str) -> StripefsError:
    """The error an ErrorRsp (or a batched reply's item) names; a code unknown here (from a newer
    peer) is IO, so callers can always match on an ErrorCode."""
    return StripefsError(code if code in ErrorCode._value2member_map_ else ErrorCode.IO, message)


class QuietError(Exception):
    """A user error: the CLI prints the message without a traceback and exits.

    Exit codes: 1 usage or config error, 2 cluster unreachable, 3 operation failed.
    """

    def __init__(self, message: str, exitcode: int = 1):
        super().__init__(message)
        self.exitcode = exitcode


def leaves(exc: BaseException) -> list[BaseException]:
    """The exceptions inside ``exc``, exception groups (trio's nurseries wrap what fails in them) flattened;
    ``[exc]`` itself when it is no group. The one place the project looks inside exception groups."""
    if not isinstance(exc, BaseExceptionGroup):
        return [exc]
    found: list[BaseException] = []
    for inner in exc.exceptions:
        found += leaves(inner)
    return found


def sole(exc: BaseException) -> BaseException:
    """``exc`` without the exception groups wrapped around it when they hold only it; else ``exc`` as it is."""
    inner = leaves(exc)
    return inner[0] if len(inner) == 1 else exc
