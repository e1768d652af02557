"""A local cluster's processes and mount, found without trusting its state directory.

``stripefs local up`` starts every process with absolute paths under the state
directory on its command line (``--config STATE/storage-1/storage.toml``,
``--pidfile STATE/mount.pid``, PostgreSQL's ``-D STATE/postgres/...``). So the
processes of the cluster in STATE are found by their exact command lines even
when STATE/pids.json, or the whole of STATE, is gone: never by a name match
(other clusters on the machine run the same programs). Only what ``up`` starts
matches: a mount of the cluster made by hand (another ``--pidfile``) does not.

Only processes of the cluster's owner count (the owner of STATE, else the
user asking): a command line is text any local user can write, so a process of
another user naming STATE is never signalled, and its "mountpoint" never
unmounted (docs/security.md).

A mount is ``live`` (in /proc/mounts and served by the cluster's client),
``dead`` (in /proc/mounts, its client gone: every access fails with "Transport
endpoint is not connected"), ``foreign`` (something else is mounted there) or
``none``. A dead mount is known by its device: ``up`` records the FUSE
connection it mounted (``major:minor`` in /proc/self/mountinfo, the
connection's number in /sys/fs/fuse/connections) beside the client's pid, so
it is recognised even while the kernel still answers a stat of it from its
attribute cache.
"""

from __future__ import annotations

import errno
import logging
import os
import re
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
        if self.name not in ("mount", "dataset-mount"):
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
        if role == "mount" and value("--pidfile") in (str(state / "mount.pid"), str(state / "dataset-mount.pid")):
            return Path(value("--pidfile")).stem  # mount, dataset-mount (up --dataset-mount)
        if role == "local" and args[1:2] == ("s3-server",) and value("--dir") == str(state):
            return "s3"  # the local S3 server of --tier s3 (stripefs/local_s3.py)
        return None
    if argv and os.path.basename(argv[0]) == "postgres" and "-D" in argv[:-1] and argv[argv.index("-D") + 1].startswith(under):
        return "postgres"
    return None


def owner_of(state: str | Path) -> int:
    """The uid whose processes may belong to the cluster in ``state``: the owner of STATE, else (STATE
    is gone) the user asking."""
    try:
        return os.stat(state).st_uid
    except OSError:
        return os.geteuid()


def uids_of(pid: int) -> tuple[int, ...]:
    """Real, effective, saved and file-system uid of ``pid`` (() when it is gone). Read from
    /proc/PID/status: the owner of /proc/PID is root for any process that made itself non-dumpable."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("Uid:"):
                    return tuple(int(v) for v in line.split()[1:])
    except (OSError, ValueError):
        pass
    return ()


def owned_by(pid: int, uid: int) -> bool:
    """Whether every uid of ``pid`` is ``uid``: a process another user could have started is not ours."""
    uids = uids_of(pid)
    return bool(uids) and all(u == uid for u in uids)


def processes_of(state: str | Path) -> list[Proc]:
    """Every running process ``stripefs local up`` started for the cluster in ``state`` (absolute):
    its command line names STATE and it runs as the cluster's owner (``owner_of``)."""
    state = Path(state).absolute()
    uid = owner_of(state)
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        argv = _argv(int(entry))
        name = _name_of(argv, state) if argv else None
        if name is not None and _running(int(entry)) and owned_by(int(entry), uid):
            found.append(Proc(int(entry), name, argv))
    return found


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return False


@dataclass(frozen=True)
class MountEntry:
    device: str  # major:minor; for FUSE, minor is the connection's number in /sys/fs/fuse/connections
    fstype: str  # fuse.stripefs for ours


def _unescape(field: str) -> str:
    """/proc/self/mountinfo writes space, tab, newline and backslash as octal escapes."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def mounted_at(path: Path) -> MountEntry | None:
    """What is mounted at ``path`` (the topmost mount when several are stacked there), or None."""
    target = str(path.absolute())
    top = None
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                fields, _, rest = line.partition(" - ")
                fields = fields.split()
                if len(fields) >= 5 and _unescape(fields[4]) == target and rest:
                    top = MountEntry(device=fields[2], fstype=rest.split()[0])
    except OSError:
        return None
    return top


def is_mounted(path: Path) -> bool:
    return mounted_at(path) is not None


def is_ours(entry: MountEntry | None) -> bool:
    """Whether a mount could be a stripefs client's: only those are ever unmounted by ``local``."""
    return entry is not None and entry.fstype == "fuse.stripefs"


def mount_state(path: Path, client_pid: int | None, device: str | None = None) -> str:
    """``none``, ``live``, ``dead`` or ``foreign`` (see the module docstring). ``client_pid``: the
    cluster's mount process, if one runs; ``device``: the connection ``up`` recorded when it mounted.
    A mount whose client is gone is dead when it is that connection, however the kernel answers a
    stat (from its attribute cache, a dead connection's stat succeeds). Without a record only a
    mount without its client is touched (a stat: a dead FUSE endpoint answers ENOTCONN at once); a
    live one is never waited on."""
    entry = mounted_at(path)
    if entry is None:
        return "none"
    if not is_ours(entry):
        return "foreign"
    if client_pid is not None and _running(client_pid):
        return "live"
    if device is not None and entry.device == device:
        return "dead"
    try:
        os.stat(path)
    except OSError as exc:
        if exc.errno == errno.ENOTCONN:
            return "dead"
    return "foreign"


def unmount(path: Path) -> str:
    """Unmount ``path`` (lazily when busy); "" when done, else why not. Only a stripefs mount:
    ``fusermount3 -u`` run as root unmounts anything, a tmpfs another user pointed us at too."""
    entry = mounted_at(path)
    if entry is None:
        return ""
    if not is_ours(entry):
        return f"a {entry.fstype} mount, not a stripefs one: left alone"
    res = subprocess.run(["fusermount3", "-u", str(path)], capture_output=True, text=True)
    if res.returncode and is_mounted(path):
        res = subprocess.run(["fusermount3", "-u", "-z", str(path)], capture_output=True, text=True)
    if is_mounted(path):
        return (res.stderr or res.stdout).strip() or "still mounted"
    return ""
