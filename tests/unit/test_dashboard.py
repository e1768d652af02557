"""deploy/grafana-stripefs.json: valid, and every series it queries is one stripefs exports."""

import json
import re
from pathlib import Path

from prometheus_client import REGISTRY

import stripefs.client.metrics  # noqa: F401  (registers the mount's metrics)
import stripefs.common.metrics  # noqa: F401
import stripefs.daemon.metrics  # noqa: F401
import stripefs.storage_node.metrics  # noqa: F401

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana-stripefs.json"


def _exported() -> set[str]:
    names = set()
    for family in REGISTRY.collect():
        if family.name.startswith("stripefs_"):
            names.add(family.name)
            if family.type == "histogram":
                names |= {family.name + s for s in ("_bucket", "_count", "_sum")}
            if family.type == "counter":
                names.add(family.name + "_total")
    return names


def test_dashboard_queries_only_exported_series():
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 15
    used = {m for e in exprs for m in re.findall(r"\bstripefs_[a-z_]+", e)}
    missing = used - _exported()
    assert not missing, f"the dashboard queries series nothing exports: {sorted(missing)}"
    # the question the dashboard exists for is on it
    assert any('source="network"' in e for e in exprs)
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
