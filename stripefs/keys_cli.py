"""``stripefs keygen NAME``: a CURVE keypair; ``$STRIPEFS_KEY``: the key admin commands use."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from .common.errors import QuietError
from .common.keyring import load_identity, write_keypair
from .common.security import identity_of, use_identity

_DESCRIPTION = """\
Write a CURVE keypair for one process or mount: NAME.key holds the public
key (hand it out; list it in the keyring of the metadata daemon and storage
nodes), NAME.key_secret holds both halves and is created mode 0600 (keep it
on that machine only: whoever reads it acts with the key's rights). Both are
in ZeroMQ's certificate format with Z85 keys.

Then: curve_key = "NAME.key_secret" in the process's config (or -o
key=NAME.key_secret for a mount, or $STRIPEFS_KEY for admin commands), and
one [[key]] entry with the public key, a role and its rights in keyring.toml
(docs/security.md).
"""


def add_parsers(sub) -> None:
    keygen = sub.add_parser(
        "keygen", help="create a CURVE keypair (NAME.key, NAME.key_secret)", description=_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Example: stripefs keygen /etc/stripefs/keys/meta && grep public-key /etc/stripefs/keys/meta.key",
    )
    keygen.add_argument("name", metavar="NAME", help="path prefix of the two files, e.g. /etc/stripefs/keys/node1 (a missing directory is created, mode 0700)")
    keygen.add_argument("--force", action="store_true", help="replace an existing keypair")
    keygen.set_defaults(func=cmd_keygen)
    cap = sub.add_parser(
        "cap-secret", help="create or rotate the capability secret of daemons and storage nodes",
        description=_CAP_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Example: stripefs cap-secret /etc/stripefs/keys/cap_secret",
    )
    cap.add_argument("path", metavar="PATH", help="the secret file (created mode 0600; a missing directory is created, mode 0700)")
    how = cap.add_mutually_exclusive_group()
    how.add_argument("--rotate", action="store_true", help="put a new secret first, keep the previous one (still accepted)")
    how.add_argument("--retire", action="store_true", help="keep only the first secret (once cap_ttl_s has passed since --rotate)")
    how.add_argument("--force", action="store_true", help="replace the file with one new secret (capabilities in use stop working)")
    cap.set_defaults(func=cmd_cap_secret)


_CAP_DESCRIPTION = """\
Write the secret with which metadata daemons sign capabilities and storage
nodes check them: a key restricted to a subtree (keyring subdir) must show one
for every chunk it reads or writes (docs/security.md, "Capabilities"). Copy
the same file to every daemon and storage node (mode 0600, readable only by
the service's user) and set cap_secret = "PATH" in metad.toml and storage.toml.

Rotation: --rotate puts a new secret first and keeps the previous one; install
the file on every storage node first (they accept both), then on the daemons
(they sign with the first). After cap_ttl_s (metad.toml) no capability signed
with the old secret is alive: --retire drops it, everywhere.
"""


def _writing(path: str, what):
    """Run ``what()``, which writes key material at ``path``: its directory is created (mode 0700) when
    missing, as the README's ``stripefs keygen /etc/stripefs/keys/NAME`` expects; an OSError is one line."""
    parent = Path(path).absolute().parent
    try:
        parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        return what()
    except OSError as exc:
        where = exc.filename or parent
        raise QuietError(f"cannot write {where}: {exc.strerror} (choose a directory you may write to, or run as its owner)") from None


def cmd_cap_secret(args) -> int:
    from .common.capability import write_secret

    lines = _writing(args.path, lambda: write_secret(args.path, rotate=args.rotate, retire=args.retire, force=args.force))
    what = "rotated" if args.rotate else "retired the old secret(s) of" if args.retire else "wrote"
    print(f"{what} {args.path} (mode 0600): {len(lines)} secret(s); daemons sign with the first, nodes accept any")
    return 0


def cmd_keygen(args) -> int:
    public_path, secret_path = _writing(args.name, lambda: write_keypair(args.name, force=args.force))
    public = load_identity(secret_path).public_text
    print(f"public key {public}\n  written to {public_path}\nsecret key written to {secret_path} (mode 0600)")
    return 0


def use_env_key() -> None:
    """Admin commands and mounts without a key of their own use $STRIPEFS_KEY (a NAME.key_secret file)."""
    path = os.environ.get("STRIPEFS_KEY")
    if path and identity_of(None) is None:
        use_identity(None, load_identity(path))
