"""The Kubernetes CSI plugin (``stripefs csi``): volumes are quota'd directories, published as subtree mounts.

    csi.proto, csi_pb2*.py  the CSI spec's messages for the calls served (generated: ``make csi-proto``)
    server.py               the command: gRPC on a Unix socket, which services
    service.py              errors to gRPC status codes, capability checks, the Identity service
    controller.py           CreateVolume, DeleteVolume, ControllerExpandVolume
    node.py                 NodePublishVolume, NodeUnpublishVolume, NodeGetVolumeStats
    namespace.py            the calls to the cluster (public protocol, the plugin's key)
    params.py               StorageClass parameters and mount flags

Deployment: deploy/kubernetes/; design and walk-through: docs/kubernetes.md.
"""
