"""``stripefs keygen NAME``: a CURVE keypair; ``$STRIPEFS_KEY``: the key admin commands use."""

from __future__ import annotations

import argparse
import os

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
    keygen.add_argument("name", metavar="NAME", help="path prefix of the two files, e.g. /etc/stripefs/keys/node1")
    keygen.add_argument("--force", action="store_true", help="replace an existing keypair")
    keygen.set_defaults(func=cmd_keygen)


def cmd_keygen(args) -> int:
    public_path, secret_path = write_keypair(args.name, force=args.force)
    public = load_identity(secret_path).public_text
    print(f"public key {public}\n  written to {public_path}\nsecret key written to {secret_path} (mode 0600)")
    return 0


def use_env_key() -> None:
    """Admin commands and mounts without a key of their own use $STRIPEFS_KEY (a NAME.key_secret file)."""
    path = os.environ.get("STRIPEFS_KEY")
    if path and identity_of(None) is None:
        use_identity(None, load_identity(path))
