"""The topology of a scenario module, started once for the module and closed after it.

A module sets ``WITH_DAGSTER = False`` when its scenarios need no Dagster deployment (webserver,
daemon, code server): the hosts, PostgreSQL, PgBouncer and the provider only.
"""

from __future__ import annotations

import json
import sys
import time

import pytest

from pipeline_assets_tests.topology.hosts import Topology
from pipeline_assets_tests.topology.scenarios import FIGURES


@pytest.fixture(scope="module")
def topo(request, tmp_path_factory):
    t = Topology(workers=3)
    module = request.module.__name__.rsplit(".", 1)[-1]
    try:
        started = time.monotonic()
        t.start(dagster=getattr(request.module, "WITH_DAGSTER", True))
        FIGURES.setdefault("start_s", {})[module] = round(time.monotonic() - started, 1)
        yield t
    finally:
        t.close(keep_logs=tmp_path_factory.getbasetemp() / f"topology-logs-{module}")
        out = tmp_path_factory.getbasetemp() / "topology-figures.json"
        out.write_text(json.dumps(FIGURES, indent=2))
        print("\ntopology figures:", json.dumps(FIGURES), file=sys.stderr)
