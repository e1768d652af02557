"""deploy/kubernetes/ and the CSI plugin's generated code: what needs no cluster and no mount.

* Every manifest is a valid Kubernetes object: checked against the Kubernetes API's
  OpenAPI schemas (kubernetes-validate, strict: an unknown or misspelt field fails),
  for the oldest and the newest Kubernetes the manifests are meant for.
* They agree with the plugin: the driver's name, the stripefs containers' arguments
  (parsed by ``stripefs csi``'s own parser), the example StorageClass's parameters
  (checked by the plugin's own check), and a socket path the sidecars share.
* The checked-in stripefs/csi/csi_pb2*.py are what ``make csi-proto`` makes of csi.proto,
  and csi.proto keeps the spec's field numbers for what kubelet and the sidecars send.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from stripefs.cli import build_parser
from stripefs.common import config as cfg
from stripefs.csi import csi_pb2 as pb
from stripefs.csi import params
from stripefs.csi.service import DRIVER_NAME

REPO = Path(__file__).resolve().parents[2]
MANIFESTS = REPO / "deploy" / "kubernetes"
#: the Kubernetes versions the manifests are written for (CSIDriver fsGroupPolicy and sidecars of this age)
VERSIONS = ["1.31.0", "1.37.0"]


def _docs() -> list[tuple[str, dict]]:
    out = []
    for path in sorted(MANIFESTS.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                out.append((path.name, doc))
    return out


def test_manifests_cover_what_a_deployment_needs():
    kinds = {doc["kind"] for _, doc in _docs()}
    assert {"CSIDriver", "DaemonSet", "Deployment", "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "StorageClass",
            "PersistentVolumeClaim", "Pod", "Secret", "ConfigMap"} <= kinds


@pytest.mark.parametrize("version", VERSIONS)
def test_manifests_are_valid_kubernetes_objects(version):
    for name, doc in _docs():
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{name}: {doc['kind']} {doc['metadata'].get('name')}: {exc.message} at {'.'.join(map(str, exc.path))}")


def test_a_broken_manifest_is_caught():
    """The check itself: a misspelt field and a wrong type fail."""
    (_, driver), = [(n, d) for n, d in _docs() if d["kind"] == "CSIDriver"]
    for broken in ({**driver, "spec": {**driver["spec"], "attachRequird": False}},
                   {**driver, "spec": {**driver["spec"], "attachRequired": "no"}}):
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(broken, VERSIONS[-1], strict=True)


def _stripefs_containers():
    for name, doc in _docs():
        if doc["kind"] in ("Deployment", "DaemonSet"):
            for c in doc["spec"]["template"]["spec"]["containers"]:
                if c["image"].startswith("stripefs/"):
                    yield name, doc, c


def test_manifests_agree_with_the_plugin():
    docs = _docs()
    assert [d["metadata"]["name"] for _, d in docs if d["kind"] == "CSIDriver"] == [DRIVER_NAME]
    for name, doc, c in _stripefs_containers():
        args = build_parser().parse_args(c["args"])  # the arguments 'stripefs csi' takes
        assert args.func.__name__ == "cmd_csi", name
        services = set(args.services.split(","))
        assert services == ({"controller"} if doc["kind"] == "Deployment" else {"node"}), name
        env = {e["name"] for e in c["env"]}
        assert {"STRIPEFS_META", "STRIPEFS_KEY"} <= env, f"{name}: the cluster's address and the key file's path"
        # the key reaches the plugin as a file from a Secret, never as text in an argument or a variable
        assert all("value" not in e or e["value"].startswith("/") for e in c["env"] if e["name"] == "STRIPEFS_KEY")
        volumes = {v["name"]: v for v in doc["spec"]["template"]["spec"]["volumes"]}
        assert volumes["key"]["secret"]["defaultMode"] == 0o400
        sidecars = [s for s in doc["spec"]["template"]["spec"]["containers"] if s is not c]
        assert all("--csi-address=/csi/csi.sock" in s["args"] for s in sidecars), name
        if doc["kind"] == "DaemonSet":
            pods = next(m for m in c["volumeMounts"] if m["name"] == "pods")
            assert pods["mountPropagation"] == "Bidirectional"  # the plugin's mounts must reach kubelet
            assert args.target_root == pods["mountPath"]
            probe = c["livenessProbe"]["exec"]["command"]
            assert probe[0] == "stripefs" and build_parser().parse_args(probe[1:]).probe
    (sc,) = [d for _, d in docs if d["kind"] == "StorageClass"]
    assert sc["provisioner"] == DRIVER_NAME
    # the provisioner strips csi.storage.k8s.io/ keys; the rest reach CreateVolume and must pass
    params.check({k: v for k, v in sc["parameters"].items() if not k.startswith("csi.storage.k8s.io/")})
    params.mount_options(sc.get("mountOptions", []))


def test_client_config_in_the_config_map_loads(tmp_path):
    """The client.toml every node mount reads (--client-config) is one the mount accepts (unknown keys fail)."""
    (cm,) = [d for _, d in _docs() if d["kind"] == "ConfigMap"]
    path = tmp_path / "client.toml"
    path.write_text(cm["data"]["client.toml"])
    client = cfg.load(str(path), cfg.ClientConfig)
    assert client.cache_size < cfg.ClientConfig().cache_size  # one client per published volume: less than the default


def test_generated_code_matches_the_proto(tmp_path):
    """What 'make csi-proto' would write is what is checked in (a changed csi.proto was regenerated)."""
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-I", str(REPO), f"--python_out={tmp_path}",
                    f"--grpc_python_out={tmp_path}", str(REPO / "stripefs" / "csi" / "csi.proto")], check=True)
    for name in ("csi_pb2.py", "csi_pb2_grpc.py"):
        assert (tmp_path / "stripefs" / "csi" / name).read_text() == (REPO / "stripefs" / "csi" / name).read_text(), \
            f"stripefs/csi/{name} is stale: run 'make csi-proto'"


def test_proto_keeps_the_spec_numbers():
    """A few fields kubelet and the sidecars fill, by the numbers csi.proto of the spec gives them."""
    def number(message, field):
        return message.DESCRIPTOR.fields_by_name[field].number

    assert pb.DESCRIPTOR.package == "csi.v1"
    assert number(pb.CreateVolumeRequest, "parameters") == 4 and number(pb.CreateVolumeRequest, "secrets") == 5
    assert number(pb.NodePublishVolumeRequest, "target_path") == 4 and number(pb.NodePublishVolumeRequest, "readonly") == 6
    assert number(pb.NodePublishVolumeRequest, "secrets") == 7 and number(pb.NodePublishVolumeRequest, "volume_context") == 8
    assert number(pb.ControllerExpandVolumeRequest, "capacity_range") == 2
    assert number(pb.NodeGetVolumeStatsRequest, "volume_path") == 2
    assert pb.VolumeCapability.AccessMode.MULTI_NODE_MULTI_WRITER == 5
    assert pb.ControllerServiceCapability.RPC.EXPAND_VOLUME == 9
    secret = pb.DESCRIPTOR.extensions_by_name["csi_secret"]
    assert pb.NodePublishVolumeRequest.DESCRIPTOR.fields_by_name["secrets"].GetOptions().Extensions[secret]
