"""A local cluster's processes and mount, found without trusting its state directory.

``stripefs local up`` starts every process with absolute paths under the state
directory on its command line (``--config STATE/storage-1/storage.toml``,
``--pidfile STATE/mount.pid``, PostgreSQL's ``-D STATE/postgres/...``). So the
processes of the cluster in STATE are found by their exact command lines even
when STATE/pids.json, or the whole of STATE, is gone: never by a name match
(other clusters on the machine run the same programs). Only what ``up`` starts
matches: a mount of the cluster made by hand (another ``--pidfile``) does not.

A mount is ``live`` (in /proc/mounts and served by the cluster's client),
``dead`` (in /proc/mounts, its client gone: every access fails with "Transport
endpoint is not connected"), ``foreign`` (something else is mounted there) or
``none``.
"""

from __future__ import annotations

import errno
import logging
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Proc:
    pid: int
    name: str  # meta, meta-2, storage-3, mount, postgres
    argv: tuple[str, ...]

    @property
    def mountpoint(self) -> Path | None:
        """The mountpoint a mount process serves (``stripefs mount ADDR MOUNTPOINT ...``)."""
        if self.name != "mount":
            return None
        args = self.argv[self.argv.index("mount") + 1:]
        positional = [a for i, a in enumerate(args) if not a.startswith("-") and (i == 0 or not args[i - 1].startswith("-"))]
        return Path(positional[1]) if len(positional) > 1 else None


def _argv(pid: int) -> tuple[str, ...]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return tuple(os.fsdecode(a) for a in f.read().split(b"\0") if a)
    except OSError:
        return ()


def _name_of(argv: tuple[str, ...], state: Path) -> str | None:
    """Which process of the cluster in ``state`` this command line is, or None."""
    under = str(state) + "/"
    if "-m" in argv and argv[argv.index("-m") + 1: argv.index("-m") + 2] == ("stripefs",):
        args = argv[argv.index("-m") + 2:]
        if not args:
            return None
        role = args[0]
        value = lambda flag: args[args.index(flag) + 1] if flag in args[:-1] else ""  # noqa: E731
        if role in ("meta", "storage"):
            config = Path(value("--config"))
            if str(config).startswith(under) and config.parent.parent == state:
                return config.parent.name  # meta, meta-2, storage-3
        if role == "mount" and value("--pidfile") == str(state / "mount.pid"):
            return "mount"
        if role == "local" and args[1:2] == ("s3-server",) and value("--dir") == str(state):
            return "s3"  # the local S3 server of --tier s3 (stripefs/local_s3.py)
        return None
    if argv and os.path.basename(argv[0]) == "postgres" and "-D" in argv[:-1] and argv[argv.index("-D") + 1].startswith(under):
        return "postgres"
    return None


def processes_of(state: str | Path) -> list[Proc]:
    """Every running process ``stripefs local up`` started for the cluster in ``state`` (absolute)."""
    state = Path(state).absolute()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        argv = _argv(int(entry))
        name = _name_of(argv, state) if argv else None
        if name is not None and _running(int(entry)):
            found.append(Proc(int(entry), name, argv))
    return found


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return False


def is_mounted(path: Path) -> bool:
    target = str(path.absolute())
    try:
        with open("/proc/mounts") as f:
            return any(line.split()[1] == target for line in f)
    except OSError:
        return False


def mount_state(path: Path, client_pid: int | None) -> str:
    """``none``, ``live``, ``dead`` or ``foreign`` (see the module docstring). ``client_pid``: the
    cluster's mount process, if one runs. Only a mount without its client is touched (a stat: a
    dead FUSE endpoint answers ENOTCONN at once); a live one is never waited on."""
    if not is_mounted(path):
        return "none"
    if client_pid is not None and _running(client_pid):
        return "live"
    try:
        os.stat(path)
    except OSError as exc:
        if exc.errno == errno.ENOTCONN:
            return "dead"
    return "foreign"


def unmount(path: Path) -> str:
    """Unmount ``path`` (lazily when busy); "" when done, else why not."""
    res = subprocess.run(["fusermount3", "-u", str(path)], capture_output=True, text=True)
    if res.returncode and is_mounted(path):
        res = subprocess.run(["fusermount3", "-u", "-z", str(path)], capture_output=True, text=True)
    if is_mounted(path):
        return (res.stderr or res.stdout).strip() or "still mounted"
    return ""
