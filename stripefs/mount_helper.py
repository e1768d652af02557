"""``mount.fuse.stripefs``: what mount(8) runs for ``mount -t fuse.stripefs`` (fstab, .mount units).

mount(8) calls ``/sbin/mount.fuse.stripefs SOURCE MOUNTPOINT [-sfnvr] [-N NS] -o OPTIONS``
(util-linux's helper convention). This turns that into ``stripefs mount
SOURCE MOUNTPOINT -o ...``, which returns once the mount answers and leaves the
client running in the background, as mount(8) expects of a helper:

* SOURCE is the metadata address list (``tcp://meta1:7100,tcp://meta2:7100``).
* fstab-only words (``_netdev``, ``nofail``, ``noauto``, ``user``, ``x-systemd.*``,
  ``comment=``...) are dropped: they are for mount(8) and systemd, not FUSE.
* ``config=PATH`` (client.toml), ``metrics=HOST:PORT`` pass to ``stripefs mount``;
  ``log=PATH`` chooses the client's log file (default
  ``/var/log/stripefs/mount-<mountpoint>.log`` as root, else the mount's own default).
* ``-r`` means read-only, ``-f`` (fake) only prints what would run, ``-v`` prints it too.

``stripefs install-mount-helper`` writes the helper into /sbin as a two-line
shell script that runs this module with the Python that stripefs is installed
in, so it works whatever PATH mount(8) runs with.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

HELPER_NAME = "mount.fuse.stripefs"

#: options for mount(8), fstab or systemd; never for FUSE
_MOUNT_ONLY = {"_netdev", "nofail", "auto", "noauto", "user", "nouser", "users", "owner", "group", "defaults", "rw", "sw"}
_MOUNT_ONLY_PREFIXES = ("x-", "comment=")


def translate(argv: list[str]) -> tuple[list[str], bool, bool]:
    """(``stripefs mount`` arguments, fake, verbose) for a helper command line (without the program name)."""
    parser = argparse.ArgumentParser(prog=HELPER_NAME, description=__doc__.split("\n\n")[0])
    parser.add_argument("source", help="metadata address(es): tcp://HOST:PORT[,...]")
    parser.add_argument("mountpoint")
    parser.add_argument("-o", dest="options", action="append", default=[])
    parser.add_argument("-s", action="store_true", help="sloppy (ignored)")
    parser.add_argument("-f", dest="fake", action="store_true", help="print the command, do not mount")
    parser.add_argument("-n", action="store_true", help="no mtab (ignored)")
    parser.add_argument("-v", dest="verbose", action="store_true")
    parser.add_argument("-r", dest="read_only", action="store_true")
    parser.add_argument("-N", dest="namespace")
    parser.add_argument("-t", dest="type")
    args = parser.parse_args(argv)
    options: list[str] = []
    log = None
    for group in args.options:
        for opt in filter(None, group.split(",")):
            if opt in _MOUNT_ONLY or opt.startswith(_MOUNT_ONLY_PREFIXES):
                continue
            if opt.startswith("log="):
                log = opt[4:]
                continue
            options.append(opt)
    if args.read_only and "ro" not in options:
        options.append("ro")
    out = [args.source, args.mountpoint]
    if options:
        out += ["-o", ",".join(options)]
    if log is None and os.geteuid() == 0:
        name = str(Path(args.mountpoint).absolute()).strip("/").replace("/", "_") or "root"
        log = f"/var/log/stripefs/mount-{name}.log"
        try:
            Path(log).parent.mkdir(parents=True, exist_ok=True)
        except OSError:
            log = None  # the mount's own default
    if log:
        out += ["--log", log]
    return out, args.fake, args.verbose


def main(argv: list[str] | None = None) -> int:
    mount_args, fake, verbose = translate(sys.argv[1:] if argv is None else argv)
    command = [sys.executable, "-m", "stripefs", "mount", *mount_args]
    if fake or verbose:
        print(" ".join(command))
    if fake:
        return 0
    os.execv(sys.executable, command)
    return 127  # not reached


def install(directory: str | Path = "/sbin", *, force: bool = False) -> Path:
    """Write the helper script into ``directory``; its path. Refuses to replace a foreign file unless ``force``."""
    target = Path(directory) / HELPER_NAME
    script = f'#!/bin/sh\n# installed by "stripefs install-mount-helper": mount -t fuse.stripefs runs this\nexec {sys.executable} -m stripefs.mount_helper "$@"\n'
    if target.exists() and not force and "stripefs install-mount-helper" not in target.read_text(errors="replace"):
        raise FileExistsError(f"{target} exists and was not written by stripefs; --force replaces it")
    tmp = target.with_name(f".{HELPER_NAME}.tmp")
    tmp.write_text(script)
    tmp.chmod(0o755)
    tmp.replace(target)
    return target


def cmd_install_mount_helper(args) -> int:
    """``stripefs install-mount-helper``."""
    from .common.errors import QuietError

    try:
        target = install(args.dir, force=args.force)
    except (OSError, FileExistsError) as exc:
        raise QuietError(f"cannot install the mount helper: {exc} (run as root, or choose --dir)") from None
    print(f"installed {target}: 'mount -t fuse.stripefs META_ADDR MOUNTPOINT' and fstab entries now work")
    return 0


def add_parser(sub) -> None:
    helper = sub.add_parser(
        "install-mount-helper",
        help="let mount(8), fstab and .mount units mount stripefs (writes /sbin/mount.fuse.stripefs)",
        description="Write /sbin/mount.fuse.stripefs, which mount(8) runs for 'mount -t fuse.stripefs META_ADDR MOUNTPOINT -o OPTS' "
        "(and so for fstab lines and systemd .mount units). It runs 'stripefs mount' with this installation's Python. "
        "See deploy/fstab.example and deploy/mnt-data.mount.",
    )
    helper.add_argument("--dir", default="/sbin", help="where mount(8) looks for helpers (default: %(default)s)")
    helper.add_argument("--force", action="store_true", help="replace a mount.fuse.stripefs that stripefs did not write")
    helper.set_defaults(func=cmd_install_mount_helper)


if __name__ == "__main__":
    sys.exit(main())
