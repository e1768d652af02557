"""``stripefs csi``: the CSI plugin process, serving gRPC on a Unix socket to kubelet and the sidecars.

One command for both halves: the controller Deployment runs it with
``--services controller`` beside the external-provisioner and external-resizer
sidecars, the node DaemonSet with ``--services node`` beside the
node-driver-registrar (deploy/kubernetes/). Identity is always served.

The plugin's own CURVE key (a secure cluster) comes from a file that
Kubernetes mounts from a Secret: its path is given by ``--key`` or
``$STRIPEFS_KEY``, never the key itself; per-volume keys come in the requests'
``secrets`` (docs/kubernetes.md).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import threading
from concurrent import futures

from ..common.errors import QuietError
from ..common.keyring import load_identity
from ..common.logs import add_debug_argument, debug_setting, setup_logging

log = logging.getLogger(__name__)


def add_parser(sub) -> None:
    csi = sub.add_parser(
        "csi", help="run the Kubernetes CSI plugin (controller and/or node)",
        description="The stripefs CSI plugin: Kubernetes volumes on a stripefs cluster. A volume is a directory under "
        "--root with a quota of its capacity and the StorageClass's layout; a pod sees it through a subtree mount of its "
        "own. Serves the CSI Identity, Controller and Node services (spec v1.x) over gRPC on --endpoint. "
        "Manifests: deploy/kubernetes/; walk-through: docs/kubernetes.md.",
        epilog="Example: stripefs csi --endpoint unix:///csi/csi.sock --meta tcp://meta:7100 --services node --node-id $NODE_NAME",
    )
    csi.add_argument("--endpoint", default=os.environ.get("CSI_ENDPOINT", "unix:///csi/csi.sock"),
                     help="where to serve: unix:///PATH (default: $CSI_ENDPOINT, else unix:///csi/csi.sock)")
    csi.add_argument("--meta", default=os.environ.get("STRIPEFS_META"),
                     help="the cluster's metadata daemon address(es), tcp://HOST:PORT[?key=Z85][,...] (default: $STRIPEFS_META)")
    csi.add_argument("--root", default=os.environ.get("STRIPEFS_CSI_ROOT", "/k8s"),
                     help="the directory of the cluster that holds the volumes (default: $STRIPEFS_CSI_ROOT, else /k8s; created when missing)")
    csi.add_argument("--services", default="controller,node", help="controller, node or both, comma-separated (default both)")
    csi.add_argument("--node-id", default=os.environ.get("NODE_NAME") or socket.gethostname(),
                     help="this node's name for Kubernetes (default: $NODE_NAME, else the host name)")
    csi.add_argument("--target-root", default="/var/lib/kubelet/pods",
                     help="publish only below this directory, where kubelet asks for volumes (default /var/lib/kubelet/pods)")
    csi.add_argument("--state-dir", default="/var/lib/stripefs-csi",
                     help="a host directory that outlives the plugin's container: what is mounted where, the mounts' logs")
    csi.add_argument("--key", default=os.environ.get("STRIPEFS_KEY"),
                     help="the plugin's CURVE key file (NAME.key_secret, mounted from a Secret; default $STRIPEFS_KEY)")
    csi.add_argument("--client-config", help="a client.toml for every mount the node plugin makes (cache_size, shm_size... "
                     "'stripefs config example client'); each published volume has a client of its own, with this memory")
    csi.add_argument("--workers", type=int, default=8, help="calls served at once (default 8)")
    csi.add_argument("--probe", action="store_true",
                     help="ask the plugin serving on --endpoint whether it is ready (CSI Probe), exit 0 if so: a liveness probe")
    add_debug_argument(csi, "stripefs.csi.node")
    csi.set_defaults(func=cmd_csi)


def cmd_csi(args) -> int:
    import grpc

    from . import csi_pb2_grpc as pb_grpc
    from .controller import Controller
    from .namespace import Namespace
    from .node import Node
    from .service import Identity

    if args.probe:
        return _probe(args.endpoint)
    services = {s.strip() for s in args.services.split(",") if s.strip()}
    if not services or services - {"controller", "node"}:
        raise QuietError(f"--services {args.services!r}: give controller, node or controller,node")
    if not args.meta:
        raise QuietError("give the cluster's metadata address: --meta tcp://HOST:PORT (or $STRIPEFS_META)")
    if not args.endpoint.startswith("unix://"):
        raise QuietError(f"--endpoint {args.endpoint}: give unix:///PATH (kubelet and the sidecars talk over a Unix socket)")
    identity = load_identity(args.key) if args.key else None
    setup_logging("csi", debug=debug_setting(args.debug))
    ns = Namespace([a.strip() for a in args.meta.split(",") if a.strip()], identity)

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=args.workers, thread_name_prefix="csi"))
    pb_grpc.add_IdentityServicer_to_server(Identity(controller="controller" in services), server)
    if "controller" in services:
        pb_grpc.add_ControllerServicer_to_server(Controller(ns, args.root), server)
    if "node" in services:
        try:
            node = Node(ns, node_id=args.node_id, volume_root=args.root, target_root=args.target_root,
                        state_dir=args.state_dir, key_file=args.key, client_config=args.client_config)
        except OSError as exc:
            raise QuietError(f"--state-dir {args.state_dir}: {exc.strerror}") from None
        pb_grpc.add_NodeServicer_to_server(node, server)
    path = args.endpoint[len("unix://"):]
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    if os.path.exists(path):
        os.unlink(path)  # a socket left by the previous run of the plugin
    if not server.add_insecure_port(args.endpoint):
        raise QuietError(f"cannot listen on {args.endpoint}")
    server.start()
    log.info("CSI plugin serving %s on %s (cluster %s, root %s)", ",".join(sorted(services)), args.endpoint,
             ",".join(ns.addresses), args.root)
    stopped = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopped.set())
    stopped.wait()
    log.info("stopping: calls in progress get 5 s to finish; published volumes stay mounted")
    server.stop(grace=5).wait()
    return 0


def _probe(endpoint: str) -> int:
    import grpc

    from . import csi_pb2 as pb
    from . import csi_pb2_grpc as pb_grpc

    with grpc.insecure_channel(endpoint) as channel:
        try:
            ready = pb_grpc.IdentityStub(channel).Probe(pb.ProbeRequest(), timeout=5).ready.value
        except grpc.RpcError as exc:
            raise QuietError(f"the CSI plugin on {endpoint} does not answer: {exc.code().name} {exc.details()}", 2) from None
    if not ready:
        raise QuietError(f"the CSI plugin on {endpoint} is not ready", 3)
    print(f"the CSI plugin on {endpoint} is ready")
    return 0
