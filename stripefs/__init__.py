"""stripefs: a striped, replicated FUSE filesystem for feeding GPU training jobs.

The roles live in their own folders and install under this namespace:
``stripefs.common`` (wire protocol, layout math, config, errors),
``stripefs.daemon`` (metadata), ``stripefs.storage_node`` and
``stripefs.client`` (the FUSE mount). Only ``stripefs.cli`` and
``stripefs.local_cluster`` know all three.
"""

__version__ = "0.1.0"
