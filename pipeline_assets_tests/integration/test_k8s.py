"""deploy/k8s/: the worker fleet's manifests and the Dagster Helm chart's values, checked offline.

* Every manifest is validated with kubernetes-validate (its schemas ship in the wheel, no
  network) against KUBERNETES_VERSION, strictly (an unknown field is an error). KEDA's kinds
  (keda.sh/v1alpha1: ScaledObject, TriggerAuthentication) are CRDs it has no schema for:
  they are checked here against the fields of KEDA's CRDs and its PostgreSQL scaler
  (KEDA_SCALED_OBJECT_SPEC, KEDA_POSTGRESQL_METADATA), and the objects they name must exist.
* The KEDA trigger's query is, verbatim, the named query `status` reports its backlog with,
  and it runs against a migrated database and counts what `status` counts.
* The worker's shutdown fits its pod's grace period, which fits in the lease.
* dagster-values.yaml uses only keys of the chart's values schema (CHART_SCHEMA_KEYS below).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import click
import kubernetes_validate
import pytest
import yaml

from pipeline_assets.jobqueue.worker import SHUTDOWN_GRACE_SECONDS
from pipeline_assets.jobqueue.worker_config import DEFAULT_LEASE_SECONDS, IDLE_POLL_SECONDS
from pipeline_assets.settings import Settings
from pipeline_assets.store.db import CONNECT_TIMEOUT_SECONDS
from pipeline_assets.store.reports import REPORTS
from pipeline_assets_tests.data_helpers import write_corpus
from pipeline_assets_tests.processes import REPO, cli

K8S = REPO / "deploy" / "k8s"
# The Kubernetes version the manifests are validated against (and documented for).
KUBERNETES_VERSION = "1.33.0"
VALUES = K8S / "dagster-values.yaml"
MANIFESTS = sorted(p for p in K8S.glob("*.yaml") if p != VALUES)

# KEDA 2.x (keda.sh/v1alpha1): the spec fields of its ScaledObject and TriggerAuthentication
# CRDs and the metadata of its `postgresql` scaler, as its documentation lists them.
KEDA_SCALED_OBJECT_SPEC = {
    "scaleTargetRef",
    "pollingInterval",
    "cooldownPeriod",
    "initialCooldownPeriod",
    "idleReplicaCount",
    "minReplicaCount",
    "maxReplicaCount",
    "fallback",
    "advanced",
    "triggers",
}
KEDA_TRIGGER = {"type", "metadata", "authenticationRef", "metricType", "name", "useCachedMetrics"}
KEDA_POSTGRESQL_METADATA = {
    "connectionFromEnv",
    "host",
    "port",
    "userName",
    "passwordFromEnv",
    "dbName",
    "sslmode",
    "query",
    "targetQueryValue",
    "activationTargetQueryValue",
    "metricName",
}
KEDA_TRIGGER_AUTH_SPEC = {
    "secretTargetRef",
    "env",
    "hashiCorpVault",
    "azureKeyVault",
    "podIdentity",
    "configMapTargetRef",
    "awsSecretManager",
    "gcpSecretManager",
}


def _docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _objects() -> dict[tuple[str, str], dict]:
    return {(d["kind"], d["metadata"]["name"]): d for p in MANIFESTS for d in _docs(p)}


def _settings_env() -> set[str]:
    return {f.metadata["env"] for f in dataclasses.fields(Settings) if "env" in f.metadata}


def test_every_manifest_is_valid_for_the_stated_kubernetes_version():
    assert MANIFESTS, "no manifests in deploy/k8s"
    checked, crds = 0, 0
    for path in MANIFESTS:
        for doc in _docs(path):
            if doc["apiVersion"].startswith("keda.sh/"):
                crds += 1
                continue  # no schema in kubernetes-validate: test_keda_objects checks them
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)  # raises ValidationError
            checked += 1
    assert checked >= 4 and crds == 2


def test_the_validator_refuses_an_unknown_field():
    """The strict validation is not a formality: a misspelt field of the Deployment fails it."""
    deployment = _objects()[("Deployment", "pipeline-worker")]
    broken = json.loads(json.dumps(deployment))
    broken["spec"]["template"]["spec"]["terminationGracePeriod"] = 30
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)


def test_keda_objects():
    objects = _objects()
    scaled = objects[("ScaledObject", "pipeline-worker")]
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    spec = scaled["spec"]
    assert set(spec) <= KEDA_SCALED_OBJECT_SPEC, set(spec) - KEDA_SCALED_OBJECT_SPEC
    target = spec["scaleTargetRef"]
    assert (target.get("kind", "Deployment"), target["name"]) in objects
    assert 1 <= spec["minReplicaCount"] <= spec["maxReplicaCount"]
    [trigger] = spec["triggers"]
    assert set(trigger) <= KEDA_TRIGGER and trigger["type"] == "postgresql"
    meta = trigger["metadata"]
    assert set(meta) <= KEDA_POSTGRESQL_METADATA, set(meta) - KEDA_POSTGRESQL_METADATA
    assert all(isinstance(v, str) for v in meta.values()), "KEDA's trigger metadata are strings"
    float(meta["targetQueryValue"]), float(meta["activationTargetQueryValue"])
    auth = objects[("TriggerAuthentication", trigger["authenticationRef"]["name"])]
    assert set(auth["spec"]) <= KEDA_TRIGGER_AUTH_SPEC
    assert [ref["parameter"] for ref in auth["spec"]["secretTargetRef"]] == ["password"]
    # The read-only role, never a password in the manifest.
    assert meta["userName"] == "pipeline_reader" and "password" not in meta


def test_the_trigger_query_is_the_status_backlog_query():
    [trigger] = _objects()[("ScaledObject", "pipeline-worker")]["spec"]["triggers"]
    assert trigger["metadata"]["query"] == REPORTS.backlog, (
        "deploy/k8s/worker-scaledobject.yaml's query must be sql/queries/reports.sql's `backlog`, verbatim"
    )


def test_the_trigger_query_counts_the_backlog_status_reports(env, clean_db, tmp_path):
    """On a migrated database with jobs in every state: the manifest's query, as KEDA sends it,
    returns pending + retry, and `status` reports the same number."""
    conn = clean_db
    write_corpus(tmp_path / "src", 12)
    cli("ingest", str(tmp_path / "src"), env=env)
    ids = [r[0] for r in conn.execute("SELECT job_id FROM app.embedding_jobs ORDER BY job_id")]
    assert len(ids) >= 10
    # Two retrying, one in flight, two ready-looking, one dead letter, one superseded; the rest pending.
    conn.execute("UPDATE app.embedding_jobs SET status = 'retry' WHERE job_id = ANY(%s)", (ids[0:2],))
    conn.execute(
        "UPDATE app.embedding_jobs SET status = 'processing', lease_owner = 'x/y/1', "
        "lease_expires_at = now() + interval '1 hour' WHERE job_id = %s",
        (ids[2],),
    )
    conn.execute("UPDATE app.embedding_jobs SET status = 'failed' WHERE job_id = %s", (ids[3],))
    conn.execute("UPDATE app.embedding_jobs SET status = 'superseded' WHERE job_id = %s", (ids[4],))
    by_status = dict(conn.execute("SELECT status, count(*) FROM app.embedding_jobs GROUP BY 1").fetchall())
    expected = by_status["pending"] + by_status["retry"]
    assert by_status["retry"] == 2 and expected == len(ids) - 3

    [trigger] = _objects()[("ScaledObject", "pipeline-worker")]["spec"]["triggers"]
    rows = conn.execute(trigger["metadata"]["query"]).fetchall()
    assert rows == [(expected,)]  # one row, one integer: what KEDA's scaler reads
    assert json.loads(cli("status", "--json", env=env).stdout)["backlog"] == expected
    assert f"backlog: {expected} " in cli("status", env=env).stdout


def test_the_worker_stops_within_its_grace_period_and_the_grace_within_the_lease():
    objects = _objects()
    deployment = objects[("Deployment", "pipeline-worker")]
    pod = deployment["spec"]["template"]["spec"]
    grace = pod["terminationGracePeriodSeconds"]
    # What `work` does on SIGTERM (jobqueue/worker.py): a stop is seen within a poll, the calls in
    # flight get SHUTDOWN_GRACE_SECONDS, then the give-back and the leave are two round trips,
    # each bounded by the connect timeout when the database is away.
    stop_takes_at_most = IDLE_POLL_SECONDS + SHUTDOWN_GRACE_SECONDS + 2 * CONNECT_TIMEOUT_SECONDS
    assert stop_takes_at_most < grace < DEFAULT_LEASE_SECONDS, (stop_takes_at_most, grace)
    [container] = pod["containers"]
    assert "--lease-seconds" not in container["command"]  # the default lease the bound assumes
    # SIGTERM reaches `work` itself (no shell in between), and the PDB covers these pods.
    assert container["command"][:2] == ["pipeline-assets", "work"]
    pdb = objects[("PodDisruptionBudget", "pipeline-worker")]
    assert (
        pdb["spec"]["selector"]["matchLabels"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    )
    assert pdb["spec"].get("maxUnavailable") == 1


def test_commands_settings_and_secrets_of_the_manifests():
    from pipeline_assets.cli import main

    objects = _objects()
    config = objects[("ConfigMap", "pipeline-config")]["data"]
    unknown = set(config) - _settings_env()
    assert not unknown, f"pipeline-config sets variables that are no setting: {unknown}"
    Settings.from_env(config)  # a bad value is a SettingsError naming the variable
    dockerfile = (REPO / "deploy" / "Dockerfile").read_text()
    compose = yaml.safe_load((REPO / "deploy" / "compose.yaml").read_text())
    for (kind, name), obj in objects.items():
        if kind not in ("Deployment", "Job"):
            continue
        pod = obj["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsUser"] == 10001 and "USER pipeline" in dockerfile
        for container in pod["containers"]:
            assert container["image"] == compose["services"]["worker"]["image"], name
            command = container["command"]
            assert command[0] == "pipeline-assets"
            ctx = click.Context(main)
            sub = main.get_command(ctx, command[1])
            assert sub is not None, command
            sub.make_context(command[1], list(command[2:]), parent=ctx)  # raises on an unknown option
            refs = {ref["configMapRef"]["name"] for ref in container["envFrom"] if "configMapRef" in ref}
            assert refs == {"pipeline-config"}
            env = {e["name"]: e["value"] for e in container.get("env", [])}
            assert set(env) <= _settings_env()
            url = env["PIPELINE_DATABASE_URL"]
            assert url.startswith("postgresql://") and "@" in url and ":" not in url.split("//")[1].split("@")[0]
    # The roles: the owner migrates, the workers are the worker role through PgBouncer.
    migrate = objects[("Job", "pipeline-migrate")]["spec"]["template"]["spec"]["containers"][0]
    assert migrate["command"] == ["pipeline-assets", "migrate"]
    assert {e["name"]: e["value"] for e in migrate["env"]}["PIPELINE_DATABASE_URL"].startswith(
        "postgresql://pipeline_owner@"
    )
    worker = objects[("Deployment", "pipeline-worker")]["spec"]["template"]["spec"]["containers"][0]
    assert {e["name"]: e["value"] for e in worker["env"]}["PIPELINE_DATABASE_URL"].startswith(
        "postgresql://pipeline_worker@pgbouncer:6432/"
    )
    assert config["PIPELINE_DATABASE_URL"].startswith("postgresql://pipeline_worker@")
    for path in [*MANIFESTS, VALUES]:
        text = path.read_text()
        assert "sk-" not in text and "PGPASSWORD:" not in text and "kind: Secret" not in text, path


# --------------------------------------------------------------------------- the Helm chart's values

# The property names of the objects of Dagster's chart values schema this file sets
# (helm/dagster/values.schema.json of dagster-io/dagster, read at commit bdb8547f, the 1.x
# schema with dagsterWebserver, codeServerArgs and postgresqlScheme). A dict is an object whose
# keys must be among its keys; None is a value of any shape (a Kubernetes type, a free object);
# a one-item list is a list of that item.
_IMAGE = {"repository": None, "tag": None, "pullPolicy": None}
_K8S_COMMON = {
    k: None
    for k in (
        "env",
        "envConfigMaps",
        "envSecrets",
        "deploymentLabels",
        "labels",
        "nodeSelector",
        "affinity",
        "tolerations",
        "podSecurityContext",
        "securityContext",
        "resources",
        "readinessProbe",
        "livenessProbe",
        "startupProbe",
        "annotations",
        "schedulerName",
        "volumeMounts",
        "volumes",
        "initContainerResources",
    )
}
_TICKS = {"purgeAfterDays": None}
CHART_SCHEMA_KEYS = {
    "global": {
        "postgresqlSecretName": None,
        "dagsterHome": None,
        "serviceAccountName": None,
        "celeryConfigSecretName": None,
    },
    "postgresql": {
        "image": _IMAGE,
        "enabled": None,
        "postgresqlHost": None,
        "postgresqlUsername": None,
        "postgresqlPassword": None,
        "postgresqlDatabase": None,
        "postgresqlParams": None,
        "postgresqlScheme": None,
        "service": {"port": None},
    },
    "generatePostgresqlPasswordSecret": None,
    "generateCeleryConfigSecret": None,
    "dagsterWebserver": {
        **_K8S_COMMON,
        "replicaCount": None,
        "image": _IMAGE,
        "nameOverride": None,
        "pathPrefix": None,
        "service": None,
        "workspace": None,
        "enableReadOnly": None,
        "dbStatementTimeout": None,
        "dbPoolRecycle": None,
        "logLevel": None,
    },
    "dagsterDaemon": {
        **_K8S_COMMON,
        "enabled": None,
        "image": _IMAGE,
        "heartbeatTolerance": None,
        "runMonitoring": None,
        "runRetries": None,
        "runCoordinator": {
            "enabled": None,
            "type": None,
            "config": {
                "queuedRunCoordinator": {
                    "maxConcurrentRuns": None,
                    "tagConcurrencyLimits": None,
                    "dequeueIntervalSeconds": None,
                    "dequeueNumWorkers": None,
                    "dequeueUseThreads": None,
                    "blockOpConcurrencyLimitedRuns": None,
                },
                "customRunCoordinator": None,
            },
        },
        "sensors": {"useThreads": None, "numWorkers": None, "numSubmitWorkers": None},
        "schedules": {"useThreads": None, "numWorkers": None, "numSubmitWorkers": None},
    },
    "dagster-user-deployments": {
        "enabled": None,
        "enableSubchart": None,
        "imagePullSecrets": None,
        "deployments": [
            {
                **_K8S_COMMON,
                "name": None,
                "image": _IMAGE,
                "dagsterApiGrpcArgs": None,
                "codeServerArgs": None,
                "includeConfigInLaunchedRuns": {"enabled": None},
                "deploymentNamespace": None,
                "port": None,
                "initContainers": None,
                "sidecarContainers": None,
            }
        ],
    },
    "runLauncher": {
        "type": None,
        "config": {
            "k8sRunLauncher": {
                "image": None,
                "imagePullPolicy": None,
                "jobNamespace": None,
                "loadInclusterConfig": None,
                "kubeconfigFile": None,
                "envConfigMaps": None,
                "envSecrets": None,
                "envVars": None,
                "volumeMounts": None,
                "volumes": None,
                "labels": None,
                "failPodOnRunFailure": None,
                "resources": None,
                "schedulerName": None,
                "securityContext": None,
                "runK8sConfig": None,
            },
            "celeryK8sRunLauncher": None,
            "customRunLauncher": None,
        },
    },
    "additionalInstanceConfig": None,
    "retention": {"enabled": None, "sensor": _TICKS, "schedule": _TICKS, "autoMaterialize": _TICKS},
    "telemetry": {"enabled": None},
    **{
        k: None
        for k in (
            "rabbitmq",
            "redis",
            "flower",
            "ingress",
            "imagePullSecrets",
            "computeLogManager",
            "scheduler",
            "pythonLogs",
            "busybox",
            "migrate",
            "serviceAccount",
        )
    },
}


def _unknown_keys(value, schema, path="") -> list[str]:
    if schema is None:
        return []
    if isinstance(schema, list):
        return [p for i, item in enumerate(value) for p in _unknown_keys(item, schema[0], f"{path}[{i}]")]
    problems = []
    for key, sub in value.items():
        if key not in schema:
            problems.append(f"{path}.{key}")
        else:
            problems += _unknown_keys(sub, schema[key], f"{path}.{key}")
    return problems


def test_the_checker_finds_an_unknown_key():
    assert _unknown_keys({"postgresql": {"postgresqlHots": "x"}}, CHART_SCHEMA_KEYS) == [".postgresql.postgresqlHots"]
    assert _unknown_keys({"dagster-user-deployments": {"deployments": [{"codeServerArg": []}]}}, CHART_SCHEMA_KEYS) == [
        ".dagster-user-deployments.deployments[0].codeServerArg"
    ]


def test_the_dagster_values_use_the_charts_keys_and_this_deployment():
    values = yaml.safe_load(VALUES.read_text())
    assert not _unknown_keys(values, CHART_SCHEMA_KEYS), _unknown_keys(values, CHART_SCHEMA_KEYS)
    # PostgreSQL from outside the chart, its password from an existing Secret, psycopg2.
    pg = values["postgresql"]
    assert pg["enabled"] is False and pg["postgresqlHost"] and "postgresqlPassword" not in pg
    assert values["generatePostgresqlPasswordSecret"] is False and values["global"]["postgresqlSecretName"]
    assert pg["postgresqlScheme"] == "postgresql+psycopg2"
    # The code location is this image serving what compose's code-location serves.
    compose = yaml.safe_load((REPO / "deploy" / "compose.yaml").read_text())
    code = compose["services"]["code-location"]["command"]
    [deployment] = values["dagster-user-deployments"]["deployments"]
    assert values["dagster-user-deployments"]["enabled"] is True
    assert deployment["codeServerArgs"] == code[code.index("-m") :]
    assert deployment["port"] == int(code[code.index("-p") + 1])
    image = compose["services"]["code-location"]["image"]
    for part in (deployment, values["dagsterWebserver"], values["dagsterDaemon"]):
        assert f"{part['image']['repository']}:{part['image']['tag']}" == image
    # Its environment: the pipeline's config map and secret, and the Dagster variables compose sets.
    assert [c["name"] for c in deployment["envConfigMaps"]] == ["pipeline-config"]
    assert ("ConfigMap", "pipeline-config") in _objects()
    assert [s["name"] for s in deployment["envSecrets"]] == ["pipeline-worker"]
    assert deployment["includeConfigInLaunchedRuns"]["enabled"] is True
    dagster_env = compose["services"]["code-location"]["environment"]
    for key in (
        "DAGSTER_EVENT_BATCH_SIZE",
        "DAGSTER_EMIT_PARTITION_SUBSET_IN_PLANNED_EVENTS",
        "PIPELINE_EMBED_WORKERS",
    ):
        assert deployment["env"][key] == str(dagster_env[key]), key
    assert set(k for k in deployment["env"] if k.startswith("PIPELINE_")) <= _settings_env()
    assert values["global"]["dagsterHome"] == dagster_env["DAGSTER_HOME"]
    assert values["runLauncher"]["type"] == "K8sRunLauncher"
    mount = {m["mountPath"] for m in values["runLauncher"]["config"]["k8sRunLauncher"]["volumeMounts"]}
    assert dagster_env["PIPELINE_SOURCE_DIR"] in mount
    # The kubernetes-typed parts (volumes, mounts) are valid Kubernetes objects.
    for vol in deployment["volumes"]:
        kubernetes_validate.validate(
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": "x"},
                "spec": {
                    "containers": [{"name": "c", "image": "i", "volumeMounts": deployment["volumeMounts"]}],
                    "volumes": [vol],
                },
            },
            KUBERNETES_VERSION,
            strict=True,
        )
