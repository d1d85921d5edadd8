"""B20: what a Dagster storage call costs the PostgreSQL server, with dagster-postgres' own storage
(`storage: postgres`, a new connection per call) and with the one `pipeline-assets dev` writes
(`PooledPostgresStorage`, connections held): server sessions opened and, on the embedded server,
the server's CPU (its backends', exited ones included), per call.

    python benchmarks/b20_dagster_connections.py [--calls 300] [--rounds 3]

Each round runs both storages, alternating, on fresh databases; medians over the rounds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path

import dagster as dg
import psutil
import psycopg
import yaml
from _common import emit, fresh_database

from pipeline_assets.cli import dagster_instance
from pipeline_assets.settings import Settings

SESSIONS = "SELECT sessions FROM pg_stat_database WHERE datname = current_database()"


def _server_cpu() -> float | None:
    """CPU-seconds of the embedded server (postmaster and exited backends); None for another server."""
    if os.environ.get("PIPELINE_DATABASE_URL"):
        return None
    pid_file = Settings.from_env().home_path.resolve() / "pgdata" / "postmaster.pid"
    if not pid_file.is_file():
        return None
    t = psutil.Process(int(pid_file.read_text().split()[0])).cpu_times()
    return t.user + t.system + t.children_user + t.children_system


def _yaml(pooled: bool) -> str:
    text = yaml.safe_load(dagster_instance.instance_yaml())
    if not pooled:
        text["storage"] = {"postgres": {"postgres_url": {"env": dagster_instance.DAGSTER_URL_ENV}}}
    return yaml.safe_dump(text)


def measure(pooled: bool, calls: int) -> dict:
    with fresh_database("b20", migrate=False) as url, tempfile.TemporaryDirectory() as home:
        (Path(home) / "dagster.yaml").write_text(_yaml(pooled))
        os.environ[dagster_instance.DAGSTER_URL_ENV] = dagster_instance.sqlalchemy_url(url)
        instance = dg.DagsterInstance.from_config(home)
        try:
            with psycopg.connect(url) as conn:
                before = conn.execute(SESSIONS).fetchone()[0]
            cpu = _server_cpu()
            for i in range(calls // 3):  # a write and two reads, as a sensor tick does
                instance.add_dynamic_partitions("model", [f"m{i}"])
                instance.get_dynamic_partitions("model")
                instance.get_runs(limit=1)
            spent = None if cpu is None else _server_cpu() - cpu
            with psycopg.connect(url) as conn:
                opened = conn.execute(SESSIONS).fetchone()[0] - before - 1  # not this one
        finally:
            instance.dispose()
    return {"sessions_per_call": opened / calls, "server_ms_per_call": None if spent is None else 1000 * spent / calls}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    runs: dict[str, list[dict]] = {"postgres": [], "pooled": []}
    for _ in range(args.rounds):
        for name in runs:
            runs[name].append(measure(name == "pooled", args.calls))
    result = {"benchmark": "b20_dagster_connections", "calls": args.calls, "rounds": args.rounds}
    for name, found in runs.items():
        result[name] = {
            key: None if found[0][key] is None else round(statistics.median(r[key] for r in found), 3)
            for key in found[0]
        }
    result["load"] = os.getloadavg()
    emit(result)


if __name__ == "__main__":
    main()
