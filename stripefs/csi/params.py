"""StorageClass parameters and mount flags: what a user writes in Kubernetes, checked before anything is made.

StorageClass ``parameters`` (all optional; strings, as Kubernetes hands them):

    replicas: "3"            copies of each chunk           (stripefs layout set --replicas)
    ec: "4+2"                Reed-Solomon instead           (stripefs layout set --ec)
    chunkSize: "1M"          chunk size                     (stripefs layout set --chunk-size)
    stripeCount: "4"         storage nodes a file stripes over
    inodes: "100000"         the quota's inode limit        (stripefs quota set --inodes)
    tierTo: "cold"           cold-tier policy: idle files move to this tier ...
    tierAfter: "30d"         ... after this long unread     (stripefs tier policy set)
    onDelete: "delete"       DeleteVolume removes the tree; "retain" moves it to ROOT/.retained/
    mode: "0777"             the volume directory's permission bits
    subdir: "team-a"         volumes go to ROOT/team-a/NAME: a team's tree, which a key's keyring
                             subdir can bound (docs/kubernetes.md, "Keys")

A volume id is the volume's directory, ``ROOT/NAME`` or ``ROOT/SUBDIR/NAME``
(``volume_path``): the plugin keeps no state, and an id that is not of that
shape is no volume of this plugin (NOT_FOUND), whatever directory it names.

Mount flags (StorageClass ``mountOptions``, a PersistentVolume's, or an inline
volume's ``mountOptions`` attribute) are checked against ``MOUNT_FLAGS``: only
the mount's own options that are safe to hand to a pod's owner pass.
"""

from __future__ import annotations

import re

import grpc

from ..common.errors import StripefsError
from ..common.layout import parse_redundancy, parse_size
from ..tier_cli import parse_duration
from .namespace import CsiError

PARAMETERS = {"replicas", "ec", "chunkSize", "stripeCount", "inodes", "tierTo", "tierAfter", "onDelete", "mode", "subdir"}
#: a volume's name (Kubernetes: pvc-UUID) or a StorageClass's subdir: one path component of plain characters
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,200}")
#: where retained volumes go, beside the volumes of their subdir (never a volume's name: NAME starts alphanumeric)
RETAINED = ".retained"

#: -o options of 'stripefs mount' a volume may ask for. Others, like key= or subdir=, the plugin sets itself;
#: none names a path of the node (disk_cache_dir would let a pod's author have root write where it says)
MOUNT_FLAGS = {"dataset", "ro", "op_timeout", "root_squash", "noatime", "nodev", "nosuid", "noexec"}


def _bad(message: str) -> CsiError:
    return CsiError(grpc.StatusCode.INVALID_ARGUMENT, message)


def redundancy(params: dict[str, str]) -> str | None:
    if "replicas" in params and "ec" in params:
        raise _bad("give replicas or ec in the StorageClass parameters, not both")
    text = f"replicas={params['replicas']}" if "replicas" in params else f"ec={params['ec']}" if "ec" in params else None
    if text:
        try:
            parse_redundancy(text)
        except StripefsError as exc:
            raise _bad(f"StorageClass parameter {text}: {exc.message}") from None
    return text


def check(params: dict[str, str]) -> dict:
    """The parameters as values: chunk_size, stripe_count, redundancy, inodes, tier, tier_after_s, retain, mode.
    An unknown parameter or a bad value: INVALID_ARGUMENT naming it (a typo must not become a default)."""
    unknown = sorted(set(params) - PARAMETERS)
    if unknown:
        raise _bad(f"unknown StorageClass parameter(s) {', '.join(unknown)}; known: {', '.join(sorted(PARAMETERS))}")
    out: dict = {"redundancy": redundancy(params)}
    try:
        out["chunk_size"] = parse_size(params["chunkSize"]) if "chunkSize" in params else None
    except ValueError as exc:
        raise _bad(f"chunkSize: {exc}") from None
    for key, name in (("stripeCount", "stripe_count"), ("inodes", "inodes")):
        try:
            out[name] = int(params[key]) if key in params else None
        except ValueError:
            raise _bad(f"{key} {params[key]!r}: give a whole number") from None
        if out[name] is not None and out[name] < 1:
            raise _bad(f"{key} must be at least 1")
    out["tier"] = params.get("tierTo") or None
    try:
        out["tier_after_s"] = parse_duration(params["tierAfter"]) if "tierAfter" in params else 30 * 86400
    except ValueError as exc:
        raise _bad(f"tierAfter: {exc}") from None
    if "tierAfter" in params and not out["tier"]:
        raise _bad("tierAfter needs tierTo (the tier idle files move to)")
    out["subdir"] = params.get("subdir") or None
    if out["subdir"] is not None and not NAME.fullmatch(out["subdir"]):
        raise _bad(f"subdir {out['subdir']!r}: one directory name of letters, digits, '.', '_' and '-' (it goes below the plugin's root)")
    on_delete = params.get("onDelete", "delete")
    if on_delete not in ("delete", "retain"):
        raise _bad(f"onDelete {on_delete!r}: give delete or retain")
    out["retain"] = on_delete == "retain"
    try:
        out["mode"] = int(params.get("mode", "0777"), 8)
    except ValueError:
        raise _bad(f"mode {params['mode']!r}: give octal permission bits like 0775") from None
    if not 0 <= out["mode"] <= 0o7777:
        raise _bad(f"mode {params['mode']!r}: give permission bits (at most 7777)")
    return out


def mount_options(flags: list[str]) -> list[str]:
    """``flags`` (each may hold several, comma-separated) as -o options, each checked against MOUNT_FLAGS."""
    out = []
    for group in flags:
        for opt in filter(None, (x.strip() for x in group.split(","))):
            if opt.partition("=")[0] not in MOUNT_FLAGS:
                raise _bad(f"mount option {opt!r} is not allowed for a volume; allowed: {', '.join(sorted(MOUNT_FLAGS))}")
            out.append(opt)
    return out


def volume_path(root: str, volume_id: str) -> str:
    """The directory of ``volume_id`` (ROOT/NAME or ROOT/SUBDIR/NAME); NOT_FOUND for an id of another shape."""
    if not volume_id:
        raise _bad("volume_id is missing")
    rest = volume_id[len(root) + 1:].split("/") if volume_id.startswith(root + "/") else []
    if not 1 <= len(rest) <= 2 or not all(NAME.fullmatch(x) for x in rest):
        raise CsiError(grpc.StatusCode.NOT_FOUND, f"volume {volume_id!r} is not a volume of this plugin (its volumes are {root}/[SUBDIR/]NAME)")
    return volume_id
