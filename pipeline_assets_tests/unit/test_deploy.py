"""deploy/: the production shape, checked without Docker.

`docker compose config` is not available here, so the compose file is parsed
with PyYAML (anchors and merge keys resolved as Compose does) and checked for
what would break a deployment: the services and their images or builds, the
settings they set (each PIPELINE_* variable a real setting, with a valid value),
Dagster's instance environment on every Dagster process, no secret written
inline, and the files the image and the workspace refer to.
"""

from __future__ import annotations

import dataclasses
import re
import sys
import tomllib
from pathlib import Path

import psycopg
import pytest
import yaml

from pipeline_assets.cli import dagster_instance
from pipeline_assets.settings import Settings

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
DAGSTER_SERVICES = ("code-location", "webserver", "daemon")
APP_SERVICES = ("migrate", "worker", *DAGSTER_SERVICES)
SECRET_NAME = re.compile(r"(?i)(KEY|PASSWORD|SECRET|TOKEN)")
URL_WITH_PASSWORD = re.compile(r"://[^/@\s:]+:[^/@\s]+@")


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((DEPLOY / "compose.yaml").read_text())


def _env(service: dict) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):  # the KEY=VALUE list form
        env = dict(item.split("=", 1) for item in env)
    return {k: ("" if v is None else str(v)) for k, v in env.items()}


def _dockerfile() -> str:
    return (DEPLOY / "Dockerfile").read_text()


def test_services_and_images(compose):
    services = compose["services"]
    assert {"postgres", *APP_SERVICES} <= set(services)
    assert services["postgres"]["image"].startswith("pgvector/pgvector:")
    for name in APP_SERVICES:
        svc = services[name]
        assert svc.get("image") or svc.get("build"), name
        build = svc["build"]
        context = (DEPLOY / build["context"]).resolve()
        assert context == REPO, (name, context)
        assert (context / build["dockerfile"]).is_file(), name
    # The workers are replicas of `pipeline-assets work`, stopped by SIGTERM with time to hand back.
    worker = services["worker"]
    assert worker["command"][:2] == ["pipeline-assets", "work"]
    assert "--until-idle" not in worker["command"]
    assert worker["deploy"]["replicas"] >= 2
    assert worker.get("stop_signal", "SIGTERM") == "SIGTERM"
    # Migrations run once before the app; the app waits for them.
    assert services["migrate"]["command"] == ["pipeline-assets", "migrate"]
    for name in ("worker", "code-location"):
        assert services[name]["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
    assert services["migrate"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    # Dagster's three processes, from the project's image.
    assert services["code-location"]["command"][:3] == ["dagster", "code-server", "start"]
    assert "pipeline_assets.defs.definitions" in services["code-location"]["command"]
    assert services["webserver"]["command"][0] == "dagster-webserver"
    assert services["daemon"]["command"][:2] == ["dagster-daemon", "run"]


def test_every_command_exists_with_its_options(compose):
    """The commands the services run are this project's (its CLI, parsed by click)
    and Dagster's entry points, all installed with the project."""
    import click

    from pipeline_assets.cli import main

    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    for name, svc in compose["services"].items():
        command = svc.get("command")
        if name == "postgres" or not command:
            continue
        if command[0] == "pipeline-assets":
            assert "pipeline-assets" in scripts
            ctx = click.Context(main)
            sub = main.get_command(ctx, command[1])
            assert sub is not None, (name, command)
            sub.make_context(command[1], list(command[2:]), parent=ctx)  # raises on an unknown option
        else:
            assert (Path(sys.executable).parent / command[0]).exists(), (name, command[0])


def test_every_pipeline_variable_is_a_real_setting_with_a_valid_value(compose):
    known = {f.metadata["env"] for f in dataclasses.fields(Settings) if "env" in f.metadata}
    seen = set()
    for name, svc in compose["services"].items():
        env = _env(svc)
        pipeline = {k: v for k, v in env.items() if k.startswith("PIPELINE_")}
        unknown = set(pipeline) - known
        assert not unknown, f"{name} sets variables that are no setting: {unknown}"
        if pipeline:
            Settings.from_env(pipeline)  # a bad value is a SettingsError naming the variable
        seen |= set(pipeline)
    assert "PIPELINE_DATABASE_URL" in seen
    for name in APP_SERVICES:
        url = _env(compose["services"][name])["PIPELINE_DATABASE_URL"]
        host = "@pgbouncer:" if name == "worker" else "@postgres:"  # the workers through the pooler
        assert url.startswith("postgresql://") and host in url, (name, url)


def test_the_dagster_processes_share_one_instance(compose):
    services = compose["services"]
    envs = [_env(services[name]) for name in DAGSTER_SERVICES]
    for key in (
        "DAGSTER_HOME",
        "DAGSTER_PG_URL",
        "DAGSTER_EVENT_BATCH_SIZE",
        "DAGSTER_EMIT_PARTITION_SUBSET_IN_PLANNED_EVENTS",
        "PIPELINE_DATABASE_URL",
    ):
        values = {env.get(key) for env in envs}
        assert len(values) == 1 and None not in values, (key, values)
    env = envs[0]
    assert env["DAGSTER_PG_URL"].startswith("postgresql+psycopg2://")  # dagster-postgres with SQLAlchemy 2.1
    # The instance file is deploy/dagster.yaml, copied to DAGSTER_HOME in the image, and reads that URL.
    assert re.search(rf"COPY deploy/dagster.yaml {re.escape(env['DAGSTER_HOME'])}/dagster.yaml", _dockerfile())
    instance = yaml.safe_load((DEPLOY / "dagster.yaml").read_text())
    # The same storage as the instances `pipeline-assets dev` and `dagster-env` write (pooled connections).
    assert instance["storage"] == yaml.safe_load(dagster_instance.STORAGE_YAML)["storage"]
    assert instance["storage"]["custom"]["config"]["postgres_url"] == {"env": "DAGSTER_PG_URL"}
    # The webserver and daemon load the code location over gRPC from its service;
    # the workspace file passes Dagster's own schema (pinned Dagster, internal module).
    from dagster._core.workspace.config_schema import ensure_workspace_config

    workspace = yaml.safe_load((DEPLOY / "workspace.yaml").read_text())
    ensure_workspace_config(workspace, str(DEPLOY / "workspace.yaml"))
    [grpc] = [entry["grpc_server"] for entry in workspace["load_from"]]
    assert grpc["host"] in services
    command = services[grpc["host"]]["command"]
    assert command[command.index("-p") + 1] == str(grpc["port"])
    for name in ("webserver", "daemon"):
        path = services[name]["command"][services[name]["command"].index("-w") + 1]
        assert re.search(rf"COPY deploy/workspace.yaml {re.escape(path)}\b", _dockerfile()), name


def test_no_secret_is_written_inline(compose):
    text = (DEPLOY / "compose.yaml").read_text()
    assert not URL_WITH_PASSWORD.search(text)
    assert "sk-" not in text
    for name, svc in compose["services"].items():
        inline = [k for k in _env(svc) if SECRET_NAME.search(k)]
        assert not inline, f"{name} sets secrets inline: {inline}"
        assert not URL_WITH_PASSWORD.search(" ".join(map(str, svc.get("command") or [])))
    # They come from an env file that is not committed; its template lists them.
    for name in ("postgres", "pgbouncer", *APP_SERVICES):
        assert compose["services"][name]["env_file"] == ["secrets.env"], name
    assert "secrets.env" in (DEPLOY / ".gitignore").read_text().split()
    example = (DEPLOY / "secrets.env.example").read_text()
    for key in ("OPENAI_API_KEY", "PGPASSWORD", "POSTGRES_PASSWORD", "DB_PASSWORD"):
        assert re.search(rf"^{key}=", example, re.M), key
    # Nothing secret is baked into the image either.
    assert not re.search(r"(?im)^\s*(ENV|ARG)\b.*(KEY|PASSWORD|SECRET|TOKEN)", _dockerfile())


def test_the_image_installs_this_project_and_matching_run_launchers():
    dockerfile = _dockerfile()
    assert re.search(r"^FROM python:3\.11", dockerfile, re.M)
    pins = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    library = next(p.split("==")[1] for p in pins if p.startswith("dagster-postgres=="))
    for launcher in ("dagster-docker", "dagster-k8s"):  # Dagster's libraries move in lockstep
        assert f"{launcher}=={library}" in dockerfile
    for path in re.findall(r"^COPY (?!--)(\S+(?: \S+)*) \S+$", dockerfile, re.M):
        for item in path.split():
            assert (REPO / item).exists(), f"Dockerfile copies a missing {item}"
    # The bundled database creates Dagster's database on first start.
    initdb = (DEPLOY / "initdb").glob("*.sql")
    assert any("CREATE DATABASE dagster" in p.read_text() for p in initdb)


def test_the_run_launcher_example_passes_the_runs_the_same_environment(compose):
    """deploy/dagster.yaml's commented DockerRunLauncher example: valid YAML once
    uncommented, and it hands each run container every variable the code location has."""
    lines = (DEPLOY / "dagster.yaml").read_text().splitlines()
    start = lines.index("# run_launcher:")
    block = [lines[start][2:]]
    for line in lines[start + 1 :]:
        if not line.startswith("#  "):
            break
        block.append(line[2:])
    launcher = yaml.safe_load("\n".join(block))["run_launcher"]
    assert (launcher["module"], launcher["class"]) == ("dagster_docker", "DockerRunLauncher")
    assert launcher["config"]["network"] == f"{compose['name']}_default"
    wanted = {
        k
        for k in _env(compose["services"]["code-location"])
        if k.startswith("PIPELINE_")
        or k in ("DAGSTER_PG_URL", "DAGSTER_EVENT_BATCH_SIZE", "DAGSTER_EMIT_PARTITION_SUBSET_IN_PLANNED_EVENTS")
    }
    wanted |= {"OPENAI_API_KEY", "PGPASSWORD"}
    assert wanted <= set(launcher["config"]["env_vars"]), wanted - set(launcher["config"]["env_vars"])


# --------------------------------------------------------------------------- the tested topology


def _port_table() -> dict[str, int]:
    """docs/operations.md's ports table: `| part | process | port | ... |` -> {part: port}."""
    text = (REPO / "docs" / "operations.md").read_text()
    section = text.split("### Ports", 1)[1].split("\n#", 1)[0]
    rows = [
        [c.strip(" `") for c in line.strip().strip("|").split("|")]
        for line in section.splitlines()
        if line.startswith("|")
    ]
    return {r[0]: int(r[2]) for r in rows[2:] if r[2].isdigit()}


def test_compose_is_the_tested_topology(compose):
    """The topology the harness (pipeline_assets_tests/topology) starts and docs/operations.md
    describes: PostgreSQL; PgBouncer in transaction pooling for the workers only; the webserver,
    the daemon and the code server (gRPC, named in workspace.yaml as a grpc_server) as separate
    processes reachable from other hosts; workers as replicas; the same ports everywhere."""
    services = compose["services"]
    ports = _port_table()
    bouncer = _env(services["pgbouncer"])
    assert bouncer["POOL_MODE"] == "transaction" and bouncer["DB_HOST"] == "postgres"
    assert int(bouncer["LISTEN_PORT"]) == ports["pgbouncer"]
    worker_url = psycopg.conninfo.conninfo_to_dict(_env(services["worker"])["PIPELINE_DATABASE_URL"])
    assert (worker_url["host"], int(worker_url["port"])) == ("pgbouncer", ports["pgbouncer"])
    for name in ("migrate", *DAGSTER_SERVICES):  # session features (advisory locks): never the pooler
        url = psycopg.conninfo.conninfo_to_dict(_env(services[name])["PIPELINE_DATABASE_URL"])
        assert (url["host"], int(url["port"])) == ("postgres", ports["postgres"]), name
    dagster_url = _env(services["daemon"])["DAGSTER_PG_URL"]
    assert f"@postgres:{ports['postgres']}/" in dagster_url
    # Each Dagster process on its own, bound to every interface (reachable from other hosts).
    code = services["code-location"]["command"]
    web = services["webserver"]["command"]
    assert code[:3] == ["dagster", "code-server", "start"] and code[code.index("-h") + 1] == "0.0.0.0"
    assert int(code[code.index("-p") + 1]) == ports["code server"]
    assert web[web.index("-h") + 1] == "0.0.0.0" and int(web[web.index("-p") + 1]) == ports["webserver"]
    worker = services["worker"]["command"]
    assert worker[worker.index("--metrics-host") + 1] == "0.0.0.0"
    assert int(worker[worker.index("--metrics-port") + 1]) == ports["worker metrics"]
    workspace = yaml.safe_load((DEPLOY / "workspace.yaml").read_text())
    [entry] = workspace["load_from"]
    assert set(entry) == {"grpc_server"} and entry["grpc_server"]["port"] == ports["code server"]
    # Embeddings runs wait for the worker fleet instead of embedding in the code server.
    for name in DAGSTER_SERVICES:
        assert _env(services[name])["PIPELINE_EMBED_WORKERS"] == "external", name
