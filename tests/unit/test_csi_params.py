"""The CSI plugin's checks of what a Kubernetes user writes: StorageClass parameters, mount flags, volume ids.

A typo must be refused with INVALID_ARGUMENT naming it, never become a default; a volume id
of another shape names no volume (NOT_FOUND), whatever directory it points at.
"""

from __future__ import annotations

import grpc
import pytest

from stripefs.csi import params
from stripefs.csi.namespace import CsiError


def _code(fn, *args) -> grpc.StatusCode:
    with pytest.raises(CsiError) as info:
        fn(*args)
    return info.value.code


def test_parameters_become_settings():
    got = params.check({"replicas": "3", "chunkSize": "1M", "stripeCount": "2", "inodes": "1000", "tierTo": "cold",
                        "tierAfter": "7d", "onDelete": "retain", "mode": "0775", "subdir": "team-a"})
    assert got == {"redundancy": "replicas=3", "chunk_size": 1 << 20, "stripe_count": 2, "inodes": 1000, "tier": "cold",
                   "tier_after_s": 7 * 86400, "retain": True, "mode": 0o775, "subdir": "team-a"}
    assert params.check({"ec": "4+2"})["redundancy"] == "ec=4+2"
    assert params.check({}) == {"redundancy": None, "chunk_size": None, "stripe_count": None, "inodes": None, "tier": None,
                                "tier_after_s": 30 * 86400, "retain": False, "mode": 0o777, "subdir": None}


@pytest.mark.parametrize("bad", [
    {"replica": "3"},                   # a typo
    {"replicas": "3", "ec": "4+2"},     # both
    {"ec": "4+9"},                      # M beyond what is supported
    {"chunkSize": "big"},
    {"inodes": "-1"},
    {"tierAfter": "30d"},               # no tier to move to
    {"onDelete": "keep"},
    {"mode": "rwx"},
    {"subdir": "../team-b"},
    {"subdir": "a/b"},
])
def test_bad_parameters_are_refused(bad):
    assert _code(params.check, bad) == grpc.StatusCode.INVALID_ARGUMENT


def test_mount_flags():
    assert params.mount_options(["noatime", "dataset,op_timeout=30", ""]) == ["noatime", "dataset", "op_timeout=30"]
    for bad in ("key=/etc/shadow", "subdir=/other", "disk_cache_dir=/etc", "config=/tmp/x", "allow_root"):
        assert _code(params.mount_options, [bad]) == grpc.StatusCode.INVALID_ARGUMENT, bad


def test_volume_ids():
    assert params.volume_path("/k8s", "/k8s/pvc-1") == "/k8s/pvc-1"
    assert params.volume_path("/k8s", "/k8s/team-a/pvc-1") == "/k8s/team-a/pvc-1"
    for other in ("/etc", "/k8s", "/k8s/", "/k8sx/pvc-1", "/k8s/../etc", "/k8s/a/b/c", "/k8s/.retained/pvc-1",
                  "/k8s/team-a/.retained/pvc-1-20260101T000000", "k8s/pvc-1", "/k8s//pvc-1"):
        assert _code(params.volume_path, "/k8s", other) == grpc.StatusCode.NOT_FOUND, other
    assert _code(params.volume_path, "/k8s", "") == grpc.StatusCode.INVALID_ARGUMENT
