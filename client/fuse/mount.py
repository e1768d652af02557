"""Mounting and unmounting a FUSE file system, and the device descriptor a mount yields.

Two ways in, as libfuse, go-fuse and fuser do:

* as root, ``mount(2)`` directly: open /dev/fuse and name its descriptor in the mount data
  (``fd=N,rootmode=...,user_id=...,group_id=...``); EPERM (no CAP_SYS_ADMIN) falls back to
* ``fusermount3`` (setuid root): it is run with ``_FUSE_COMMFD`` naming one end of a socketpair,
  mounts, and sends the /dev/fuse descriptor back over it (SCM_RIGHTS).

Unmounting is lazy (``MNT_DETACH``, ``fusermount3 -u -z``): a busy mount point must not keep a
stopping client alive, and the kernel finishes the unmount when the last user lets go. It is
done by path, so only while that path still holds *this* mount: the client's own unmount asks
the device first (a connection the kernel has ended, POLLERR, means the mount is gone and the
path may hold anything now), and every unmount checks that /proc/self/mountinfo shows, at that
path, the mount id, device number and type this mount got. The device number alone is not
enough: anonymous device numbers are reused at once (a tmpfs mounted right after an unmount got
the same 0:N in a test), and so are mount ids; all three and the path together make a stranger
unlikely, not impossible, for the reaper, which has no device left to ask.

A client killed with SIGKILL cannot unmount. The kernel then aborts the connection but leaves
the mount point in place, answering ENOTCONN ("Transport endpoint is not connected"), until
someone unmounts it. So :func:`mount` starts a reaper (``reaper.py``): a small process in a
session of its own that waits for the client's end of a pipe to close, which happens on every
exit, and then unmounts the mount if it is still this one.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import os
import socket
import stat
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Iterable, NamedTuple

log = logging.getLogger(__name__)

_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_NOATIME = 1, 2, 4, 8, 1024
_MNT_DETACH = 2
#: VFS options that are mount(2) flags, not FUSE data
_FLAG_OPTIONS = {"ro": _MS_RDONLY, "nosuid": _MS_NOSUID, "nodev": _MS_NODEV, "noexec": _MS_NOEXEC,
                 "noatime": _MS_NOATIME}
_IGNORED_OPTIONS = {"rw", "suid", "dev", "exec", "atime"}
#: what the kernel's fuse takes in the mount data, besides fd/rootmode/user_id/group_id
_KERNEL_OPTIONS = {"default_permissions", "allow_other"}
_KERNEL_VALUE_OPTIONS = {"max_read"}

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]


class MountError(Exception):
    """Mounting failed; the message says why and what to check."""


class MountEntry(NamedTuple):
    """One line of /proc/self/mountinfo, the fields this module reads."""

    mount_id: str
    dev: str  # "major:minor"
    path: str
    fstype: str


@dataclass
class Mount:
    """A FUSE mount this process made: where, its device descriptor, and how mountinfo shows it."""

    mountpoint: str
    fd: int
    entry: MountEntry | None  # None: mountinfo did not show it (then it is never unmounted by path)
    via: str  # "mount(2)" or "fusermount3"
    reaper: subprocess.Popen | None = field(default=None, repr=False)
    reaper_pipe: int | None = field(default=None, repr=False)


def mount(mountpoint: str, options: Iterable[str] = (), *, fsname: str = "stripefs", subtype: str = "stripefs",
          reaper: bool = True, via: str | None = None) -> Mount:
    """Mount a FUSE file system at ``mountpoint``; the returned :class:`Mount` holds the descriptor
    to serve it on (the kernel sends INIT first and every other request waits for its answer).
    ``via="fusermount3"`` skips mount(2) even as root (what an unprivileged client does)."""
    mountpoint = os.path.abspath(mountpoint)
    try:
        st = os.stat(mountpoint)
    except OSError as e:
        raise MountError(f"cannot mount at {mountpoint}: {e.strerror}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise MountError(f"cannot mount at {mountpoint}: not a directory")
    opts = list(options)
    fd = None
    if os.geteuid() == 0 and via != "fusermount3":
        try:
            fd, via = _mount_syscall(mountpoint, st.st_mode, opts, fsname, subtype), "mount(2)"
        except PermissionError:
            log.info("mount(2) at %s was refused (no CAP_SYS_ADMIN here): trying fusermount3", mountpoint)
    if fd is None:
        fd, via = _mount_fusermount(mountpoint, opts, fsname, subtype), "fusermount3"
    m = Mount(mountpoint, fd, _newest(mountpoint, f"fuse.{subtype}"), via)
    if reaper and m.entry is not None:
        _start_reaper(m)
    log.debug("mounted %s through %s (%s, fd %d)", mountpoint, via, m.entry, fd)
    return m


def unmount(m: Mount, device=None) -> bool:
    """Lazily unmount ``m`` if it is still mounted (and still this mount); True if it unmounted it.
    ``device`` (device.Device of the mount, still open): if the kernel says the connection is gone,
    the path is left alone. Then lets the reaper go (it finds nothing to do)."""
    done = False
    if device is not None and not device.alive():
        log.debug("the connection of %s is gone: not unmounting by path", m.mountpoint)
    elif m.entry is not None and is_mounted(m.entry):
        done = unmount_path(m.mountpoint)
    if m.reaper_pipe is not None:
        os.close(m.reaper_pipe)
        m.reaper_pipe = None
    if m.reaper is not None:
        try:
            m.reaper.wait(timeout=10)
        except subprocess.TimeoutExpired:
            log.warning("the unmount reaper of %s (pid %d) did not end", m.mountpoint, m.reaper.pid)
        m.reaper = None
    return done


def is_mounted(entry: MountEntry) -> bool:
    """Whether /proc/self/mountinfo still shows this mount (id, device, path and type)."""
    return entry in mounts()


def unmount_path(mountpoint: str) -> bool:
    """Lazily unmount whatever is at ``mountpoint``: callers check first that it is theirs."""
    if os.geteuid() == 0:
        if _libc.umount2(mountpoint.encode(), _MNT_DETACH) == 0:
            return True
        err = ctypes.get_errno()
        if err not in (errno.EPERM,):
            log.warning("umount2(%s) failed: %s", mountpoint, os.strerror(err))
            return False
    res = subprocess.run(["fusermount3", "-u", "-z", "--", mountpoint], capture_output=True, text=True)
    if res.returncode:
        log.warning("fusermount3 -u -z %s failed: %s", mountpoint, res.stderr.strip())
    return res.returncode == 0


def _mount_syscall(mountpoint: str, mode: int, opts: list[str], fsname: str, subtype: str) -> int:
    flags, data = _MS_NOSUID | _MS_NODEV, []
    for o in opts:
        key = o.split("=", 1)[0]
        if o in _FLAG_OPTIONS:
            flags |= _FLAG_OPTIONS[o]
        elif o in _IGNORED_OPTIONS:
            pass
        elif o in _KERNEL_OPTIONS or key in _KERNEL_VALUE_OPTIONS:
            data.append(o)
        else:
            raise MountError(f"unknown FUSE mount option {o!r}")
    fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
    data = [f"fd={fd}", f"rootmode={stat.S_IFMT(mode):o}", f"user_id={os.getuid()}", f"group_id={os.getgid()}", *data]
    if _libc.mount(fsname.encode(), mountpoint.encode(), f"fuse.{subtype}".encode(), flags,
                   ",".join(data).encode()) != 0:
        err = ctypes.get_errno()
        os.close(fd)
        if err == errno.EPERM:
            raise PermissionError(err, os.strerror(err))
        raise MountError(f"mount(2) of {mountpoint} failed: {os.strerror(err)}")
    return fd


def _mount_fusermount(mountpoint: str, opts: list[str], fsname: str, subtype: str) -> int:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        env = dict(os.environ, _FUSE_COMMFD=str(theirs.fileno()))
        args = ["fusermount3", "-o", ",".join([f"fsname={fsname}", f"subtype={subtype}", *opts]), "--", mountpoint]
        try:
            proc = subprocess.Popen(args, env=env, pass_fds=(theirs.fileno(),), stderr=subprocess.PIPE, text=True)
        except FileNotFoundError:
            raise MountError("fusermount3 is not installed (Debian: apt-get install fuse3)") from None
        theirs.close()
        _, fds, _, _ = socket.recv_fds(ours, 1, 1)
        _, err = proc.communicate(timeout=60)
        if not fds:
            raise MountError(f"fusermount3 could not mount {mountpoint}: {err.strip() or f'exit {proc.returncode}'}")
        os.set_inheritable(fds[0], False)
        return fds[0]
    finally:
        ours.close()
        theirs.close()


def _unescape(path: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as octal (\\040, ...)."""
    if "\\" not in path:
        return path
    out, i = [], 0
    while i < len(path):
        if path[i] == "\\" and len(path[i + 1:i + 4]) == 3 and path[i + 1:i + 4].isdigit():
            out.append(chr(int(path[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(path[i])
            i += 1
    return "".join(out)


def mounts() -> list[MountEntry]:
    """Every mount this process sees."""
    rows = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            try:
                sep = fields.index("-", 6)
            except ValueError:
                continue
            rows.append(MountEntry(fields[0], fields[2], _unescape(fields[4]), fields[sep + 1]))
    return rows


def _newest(mountpoint: str, fstype: str) -> MountEntry | None:
    """The newest mount of ``fstype`` at ``mountpoint`` (mountinfo lists mounts in the order they were
    made). Read from mountinfo, not stat(): a stat of the mount point would be a GETATTR, which
    waits until INIT is answered."""
    found = None
    for e in mounts():
        if e.path == mountpoint and e.fstype == fstype:
            found = e
    return found


def _start_reaper(m: Mount) -> None:
    read_end, write_end = os.pipe()  # both close-on-exec (PEP 446); the child gets read_end as stdin
    try:
        m.reaper = subprocess.Popen(
            [sys.executable, "-m", "stripefs.client.fuse.reaper", *m.entry],
            stdin=read_end, start_new_session=True)
    except OSError as e:
        os.close(write_end)
        log.warning("no unmount reaper for %s (%s): a crash would leave the mount point dead", m.mountpoint, e)
    else:
        m.reaper_pipe = write_end
    finally:
        os.close(read_end)
