"""``python -m stripefs.client.fuse.reaper MOUNT_ID MAJOR:MINOR MOUNTPOINT FSTYPE``: unmount after the client dies.

Started by :func:`stripefs.client.fuse.mount.mount` in a session of its own (a signal to the
client's process group does not reach it), with stdin the read end of a pipe whose write end
only the client holds. Every way the client can end closes that end, SIGKILL included; the
read here then sees end-of-file, and the mount is lazily unmounted if /proc/self/mountinfo
still shows that mount (id, device, path, type) there (a clean stop has unmounted it already; after a remount
the path is someone else's).
"""

from __future__ import annotations

import sys

from .mount import MountEntry, is_mounted, unmount_path


def main(argv: list[str]) -> int:
    entry = MountEntry(*argv)
    mountpoint = entry.path
    while sys.stdin.buffer.read(65536):
        pass
    if is_mounted(entry):
        print(f"stripefs: the client of {mountpoint} ended without unmounting it: unmounting", file=sys.stderr)
        return 0 if unmount_path(mountpoint) else 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
