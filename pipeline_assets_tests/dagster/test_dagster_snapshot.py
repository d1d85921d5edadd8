"""The loaded Dagster definitions match a checked-in snapshot (snapshots/dagster_definitions.json).

Asset keys, partitions, jobs, sensors, schedules, checks and op config fields are what run
history, the UI and launched run config name: a change to any of them fails here. Built from
the defaults (an empty environment), no database. After an intended change, regenerate with
``PIPELINE_UPDATE_SNAPSHOT=1 pytest pipeline_assets_tests/dagster/test_dagster_snapshot.py``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import dagster as dg

from pipeline_assets.defs.definitions import build_definitions
from pipeline_assets.settings import Settings

SNAPSHOT = Path(__file__).parent / "snapshots" / "dagster_definitions.json"
UPDATE_ENV = "PIPELINE_UPDATE_SNAPSHOT"


def _partitions(pd: dg.PartitionsDefinition | None) -> Any:
    if pd is None:
        return None
    if isinstance(pd, dg.StaticPartitionsDefinition):
        keys = pd.get_partition_keys()
        return {"static": len(keys), "first": keys[0], "last": keys[-1]}
    if isinstance(pd, dg.DynamicPartitionsDefinition):
        return {"dynamic": pd.name}
    if isinstance(pd, dg.MultiPartitionsDefinition):
        return {"multi": {d.name: _partitions(d.partitions_def) for d in pd.partitions_defs}}
    return {"other": type(pd).__name__}


def _config_fields(node_def: Any) -> list[str]:
    field = node_def.config_field if hasattr(node_def, "config_field") else None
    fields = getattr(field.config_type, "fields", None) if field is not None else None
    return sorted(fields or {})


def snapshot(defs: dg.Definitions) -> dict[str, Any]:
    """What the definitions expose by name, in a stable JSON-able form."""
    repo = defs.get_repository_def()
    graph = repo.asset_graph
    assets: dict[str, Any] = {}
    for key in sorted(graph.get_all_asset_keys(), key=lambda k: k.to_user_string()):
        node = graph.get(key)
        assets_def = repo.assets_defs_by_key.get(key)
        op = assets_def.node_def if assets_def is not None and assets_def.is_executable else None
        assets[key.to_user_string()] = {
            "materializable": node.is_materializable,
            "group": node.group_name,
            "code_version": node.code_version,
            "kinds": sorted(node.kinds),
            "partitions": _partitions(node.partitions_def),
            "parents": sorted(p.to_user_string() for p in node.parent_keys),
            "backfill_policy": str(node.backfill_policy) if node.backfill_policy else None,
            "op": op.name if op is not None else None,
            "op_pool": getattr(op, "pool", None) if op is not None else None,
            "op_config": _config_fields(op) if op is not None else [],
            "can_subset": assets_def.can_subset if assets_def is not None else None,
        }
    checks = {}
    for check in sorted(graph.asset_check_keys, key=lambda c: (c.asset_key.to_user_string(), c.name)):
        spec = graph.get_check_spec(check)
        checks_def = repo.asset_checks_defs_by_key.get(check)
        checks[f"{check.asset_key.to_user_string()}:{check.name}"] = {
            "blocking": spec.blocking,
            "deps": sorted(d.asset_key.to_user_string() for d in spec.additional_deps),
            "partitions": _partitions(checks_def.partitions_def) if checks_def is not None else None,
        }
    jobs = {}
    for job in sorted(repo.get_all_jobs(), key=lambda j: j.name):
        if job.name.startswith("__"):
            continue
        layer = job.asset_layer
        check_keys = layer.asset_graph.asset_check_keys
        jobs[job.name] = {
            "assets": sorted(k.to_user_string() for k in layer.executable_asset_keys),
            "checks": sorted(f"{c.asset_key.to_user_string()}:{c.name}" for c in check_keys),
            "ops": sorted(job.graph.node_names()) if not layer.executable_asset_keys and not check_keys else [],
            "op_config": {n.name: fields for n in job.graph.nodes if (fields := _config_fields(n.definition))},
            "executor": job.executor_def.name,
        }
    sensors = {
        s.name: {
            "type": type(s).__name__,
            "minimum_interval_seconds": s.minimum_interval_seconds,
            "default_status": s.default_status.value,
            "jobs": sorted(t.job_name for t in s.targets),
        }
        for s in sorted(repo.sensor_defs, key=lambda s: s.name)
    }
    schedules = {
        s.name: {
            "cron": s.cron_schedule,
            "job": s.job_name,
            "default_status": s.default_status.value,
            "timezone": s.execution_timezone,
        }
        for s in sorted(repo.schedule_defs, key=lambda s: s.name)
    }
    return {
        "assets": assets,
        "asset_checks": checks,
        "jobs": jobs,
        "sensors": sensors,
        "schedules": schedules,
        "resources": sorted(repo.get_top_level_resources()),
    }


def test_loaded_definitions_match_the_snapshot():
    got = snapshot(build_definitions(Settings.from_env({})))
    text = json.dumps(got, indent=2, sort_keys=True) + "\n"
    if os.environ.get(UPDATE_ENV):
        SNAPSHOT.write_text(text)
    assert SNAPSHOT.exists(), f"no snapshot: run with {UPDATE_ENV}=1 once"
    assert json.loads(SNAPSHOT.read_text()) == got, (
        f"the loaded definitions differ from {SNAPSHOT.name}; if intended, regenerate with {UPDATE_ENV}=1"
    )
