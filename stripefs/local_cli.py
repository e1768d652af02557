"""``stripefs local up|down|add-node|status``: a whole cluster on this machine (stripefs/local_cluster.py).

    stripefs local up [--dir STATE] [--mount MNT] [--nodes N] ...   start (or restart) it and mount it
    stripefs local add-node [--dir STATE]                           one more storage node
    stripefs local down [--dir STATE]                               unmount and stop what 'up' started
    stripefs local status [--dir STATE] [--json]                    its processes and their states
"""

from __future__ import annotations

import json

from .cluster import DEFAULT_STATE


def cmd_local(args) -> int:
    from .local_cluster import LocalCluster

    cluster = LocalCluster(args.dir)
    if args.action == "up":
        return cluster.up(args.mount, args.nodes, args.options, settings=args.settings, secure=args.secure, subdir=args.subdir,
                          meta_store=args.meta_store, metas=args.metas, tier=args.tier, dataset_mount=args.dataset_mount)
    if args.action == "s3-server":
        from pathlib import Path

        from .local_s3 import serve

        return serve(Path(args.dir).absolute(), args.port)
    if args.action == "down":
        return cluster.down()
    if args.action == "add-node":
        return cluster.add_node()
    status = cluster.status()
    if args.json:
        print(json.dumps(status, indent=1))
    else:
        from .status import render_local

        print(render_local(status))
    return 0


def add_parser(sub) -> None:
    local = sub.add_parser("local", help="run a whole cluster on this machine", description="Start, stop and inspect a one-machine cluster.")
    lsub = local.add_subparsers(dest="action", metavar="ACTION", required=True)
    up = lsub.add_parser("up", help="start (or restart) the cluster and mount it",
                         description="Start a metadata daemon, N storage nodes and the mount. Running it again on a "
                         "stopped STATE brings the same data back; it starts what is not running (not the nodes an "
                         "operator removed) and mounts again over a dead mount (its client killed). A new cluster's ports are free ones "
                         "between 10000 and the ephemeral range, or in $STRIPEFS_LOCAL_PORTS (LOW-HIGH: several clusters "
                         "created at once on one machine, each given its own range, never pick the same port).")
    up.add_argument("--dir", default=DEFAULT_STATE, help="state directory: configs, data, logs, pids (default: %(default)s)")
    up.add_argument("--mount", default="./mnt", help="mountpoint (default: %(default)s)")
    up.add_argument("--dataset-mount", default="", metavar="DIR",
                    help="also mount the cluster at DIR in dataset mode (-o dataset: read-only, warm opens answered by "
                    "the kernel); remembered, so later ups mount it again, and 'local down' unmounts it")
    up.add_argument("--nodes", type=int, default=None, help="storage nodes of a new cluster (default: 4)")
    up.add_argument("-o", dest="options", action="append", default=[], help="FUSE mount option, e.g. -o allow_other (repeatable)")
    up.add_argument("--set", dest="settings", action="append", default=[], metavar="ROLE.KEY=VALUE",
                    help="config value for a new cluster, e.g. --set meta.node_timeout_s=3 --set storage.scrub_bandwidth=64M "
                    "(TOML value; roles meta, storage, client; repeatable; used when STATE is created)")
    up.add_argument("--secure", action="store_true",
                    help="CURVE on every socket: keys for the daemon, each node, the mount and an admin in STATE/keys, "
                         "listed in STATE/keys/keyring.toml (new clusters only; docs/security.md)")
    up.add_argument("--subdir", default="", metavar="/DIR",
                    help="mount only this directory of the cluster (created if missing); with --secure the mount's key "
                         "is restricted to it at the daemon")
    up.add_argument("--meta-store", choices=("sqlite", "postgresql"), default="sqlite",
                    help="where metadata lives: an SQLite file (one daemon), or a throwaway PostgreSQL server started "
                    "in STATE (needs Debian's postgresql package; several daemons) (default: %(default)s; used when STATE is created)")
    up.add_argument("--metas", type=int, default=1, metavar="N",
                    help="metadata daemons, each on its own port, all given to the storage nodes and the mount "
                    "(N > 1 needs --meta-store postgresql) (default: %(default)s; used when STATE is created)")
    up.add_argument("--tier", choices=("s3",), default="",
                    help="also a cold tier (docs/tiering.md): a local S3 server (moto, pip install 'stripefs[s3]') on "
                    "loopback, holding its objects in memory (lost when it stops: for trying, never for data), "
                    "added as tier 'cold' (used when STATE is created: an existing cluster refuses it; add a tier "
                    "to it with 'stripefs tier add')")
    s3 = lsub.add_parser("s3-server", help="(internal) the local S3 server 'up --tier s3' starts")
    s3.add_argument("--dir", default=DEFAULT_STATE, help="state directory")
    s3.add_argument("--port", type=int, required=True, help="loopback port")
    add = lsub.add_parser("add-node", help="start one more storage node", description="Create, start and register one more storage node in a running local cluster (then data rebalances onto it).")
    add.add_argument("--dir", default=DEFAULT_STATE, help="state directory (default: %(default)s)")
    down = lsub.add_parser("down", help="unmount and stop everything 'up' started",
                           description="Unmount and stop the processes 'up' started: those in STATE/pids.json and every "
                           "process whose command line names STATE (so a cluster whose state directory was deleted "
                           "while it ran is stopped too; never a name match). Data stays in the state directory. "
                           "Exit 0 when nothing of it runs any more (also when nothing ran), 3 when something could "
                           "not be stopped or unmounted.")
    down.add_argument("--dir", default=DEFAULT_STATE, help="state directory (default: %(default)s)")
    st = lsub.add_parser("status", help="which local processes are running",
                         description="List the cluster's processes: role, node id, pid, address, state (up, down; "
                         "a storage node 'removed' by an operator; the mount 'dead' when its client is gone but the "
                         "mount point is still there: 'local up' mounts again) and bytes stored.")
    st.add_argument("--dir", default=DEFAULT_STATE, help="state directory (default: %(default)s)")
    st.add_argument("--json", action="store_true", help='machine-readable: {"processes": [{role, node_id, pid, address, state, bytes_stored, metrics}, ...], "under_replicated": N}')
    local.set_defaults(func=cmd_local)
