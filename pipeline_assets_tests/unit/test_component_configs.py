"""Each component's own config: its defaults are the named constants beside it, a value out of
range is one line naming the field (the variable, when read from the environment), and every
variable a component uses reaches that component's config through ``Settings``. No database: the
worker runs on the in-memory queue with the offline model.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline_assets.app import ingest_config as ic
from pipeline_assets.app.ingest_config import IngestConfig
from pipeline_assets.app.runtime import Runtime
from pipeline_assets.app.source_config import SourceConfig
from pipeline_assets.component_config import InvalidConfig
from pipeline_assets.defs import dagster_config as dc
from pipeline_assets.defs.dagster_config import DagsterConfig
from pipeline_assets.jobqueue import executor_config as ec
from pipeline_assets.jobqueue import worker_config as wc
from pipeline_assets.jobqueue.executor_config import ExecutorConfig
from pipeline_assets.jobqueue.memory_job_store import MemoryJobStore
from pipeline_assets.jobqueue.memory_queue import MemoryQueue
from pipeline_assets.jobqueue.worker import BudgetExhausted, Worker
from pipeline_assets.jobqueue.worker_config import WorkerConfig
from pipeline_assets.providers import provider_config as pc
from pipeline_assets.providers import provider_for
from pipeline_assets.providers.local import LocalHashingProvider
from pipeline_assets.providers.provider_config import ProviderConfig
from pipeline_assets.registry.registry_config import DEFAULT_INDEX_BUILD_MEMORY
from pipeline_assets.settings import Settings, SettingsError
from pipeline_assets.store import database_config as dbc
from pipeline_assets.store.database_config import DatabaseConfig


def test_defaults_are_the_named_constants():
    assert ExecutorConfig() == ExecutorConfig(
        call_timeout=ec.DEFAULT_CALL_TIMEOUT_SECONDS,
        backoff_base=ec.DEFAULT_BACKOFF_BASE_SECONDS,
        backoff_cap=ec.DEFAULT_BACKOFF_CAP_SECONDS,
        retry_after_cap=ec.DEFAULT_RETRY_AFTER_CAP_SECONDS,
        max_throttles=ec.DEFAULT_MAX_THROTTLES,
        crashpoint=None,
    )
    assert WorkerConfig() == WorkerConfig(
        concurrency=wc.DEFAULT_CONCURRENCY,
        lease_seconds=wc.DEFAULT_LEASE_SECONDS,
        poll_seconds=wc.IDLE_POLL_SECONDS,
        rescue_interval=wc.RESCUE_INTERVAL_SECONDS,
        index_quiet_seconds=wc.INDEX_QUIET_SECONDS,
        worker_dead_after=wc.DEFAULT_WORKER_DEAD_AFTER_SECONDS,
        index_build_memory=DEFAULT_INDEX_BUILD_MEMORY,
        run_token_budget=wc.NO_TOKEN_BUDGET,
        daily_token_budget=wc.NO_TOKEN_BUDGET,
        executor=ExecutorConfig(),
    )
    assert IngestConfig() == IngestConfig(
        max_bytes=ic.DEFAULT_MAX_INPUT_BYTES,
        decode_errors=ic.DEFAULT_DECODE_ERRORS,
        stage_timeout=ic.DEFAULT_STAGE_TIMEOUT_SECONDS,
        extract_memory=ic.DEFAULT_EXTRACT_MEMORY,
        extract_processes=ic.DEFAULT_EXTRACT_PROCESSES,
        max_text_chars=ic.DEFAULT_MAX_TEXT_CHARS,
        max_chunks=ic.DEFAULT_MAX_CHUNKS_PER_DOCUMENT,
        batch_bytes=ic.DEFAULT_INGEST_BATCH_BYTES,
        batch_documents=ic.INGEST_BATCH_DOCUMENTS,
        max_attempts=ic.DEFAULT_MAX_ATTEMPTS,
    )
    assert DagsterConfig() == DagsterConfig(
        partition_buckets=dc.DEFAULT_PARTITION_BUCKETS,
        source_sensor_interval=dc.DEFAULT_SOURCE_SENSOR_INTERVAL_SECONDS,
        source_retry_base=dc.DEFAULT_SOURCE_RETRY_BASE_SECONDS,
        reconcile_cron=dc.DEFAULT_RECONCILE_CRON,
        health_cron=dc.DEFAULT_HEALTH_CRON,
        dlq_growth_per_hour=dc.DEFAULT_DLQ_GROWTH_PER_HOUR,
        embed_workers=dc.DEFAULT_EMBED_WORKERS,
        embed_run_deadline=dc.DEFAULT_EMBED_RUN_DEADLINE_SECONDS,
    )
    assert SourceConfig() == SourceConfig(
        retry_base=ec.DEFAULT_BACKOFF_BASE_SECONDS,
        retry_cap=ec.DEFAULT_BACKOFF_CAP_SECONDS,
        database=DatabaseConfig(),
        max_bytes=ic.DEFAULT_MAX_INPUT_BYTES,
    )
    assert DatabaseConfig() == DatabaseConfig(url=None, home=dbc.DEFAULT_HOME, pool_mode=dbc.DEFAULT_POOL_MODE)
    assert ProviderConfig() == ProviderConfig(
        model=None,
        api_key=None,
        base_url=None,
        dimensions=None,
        call_timeout=ec.DEFAULT_CALL_TIMEOUT_SECONDS,
        batch_inputs=pc.DEFAULT_BATCH_INPUTS,
        batch_tokens=pc.DEFAULT_BATCH_TOKENS,
        max_input_tokens=None,
        local_model_dir=None,
        local_batch_inputs=pc.DEFAULT_LOCAL_BATCH_INPUTS,
    )


def test_an_empty_environment_builds_the_default_configs():
    s = Settings.from_env({})
    assert s.executor_config() == ExecutorConfig()
    assert s.worker_config() == WorkerConfig()
    assert s.ingest_config() == IngestConfig()
    assert s.dagster_config() == DagsterConfig()
    home = dbc.DEFAULT_HOME.expanduser().resolve()
    assert s.database_config() == DatabaseConfig(home=home)
    assert s.source_config() == SourceConfig(database=DatabaseConfig(home=home))
    assert s.provider_config() == ProviderConfig()


@pytest.mark.parametrize(
    ("build", "field", "value"),
    [
        (ExecutorConfig, "call_timeout", 0),
        (ExecutorConfig, "max_throttles", 0),
        (WorkerConfig, "concurrency", 0),
        (WorkerConfig, "lease_seconds", -1.0),
        (WorkerConfig, "index_build_memory", 1024),
        (IngestConfig, "decode_errors", "ignore"),
        (IngestConfig, "batch_documents", 0),
        (IngestConfig, "extract_processes", -1),
        (SourceConfig, "retry_cap", -0.5),
        (DatabaseConfig, "pool_mode", "statement"),
        (DagsterConfig, "partition_buckets", dc.MAX_PARTITION_BUCKETS + 1),
        (DagsterConfig, "embed_workers", "elsewhere"),
        (DagsterConfig, "source_retry_base", 0.0),
        (ProviderConfig, "batch_inputs", 0),
        (ProviderConfig, "dimensions", 0),
        (ProviderConfig, "max_input_tokens", -1),
        (ProviderConfig, "local_batch_inputs", 0),
    ],
)
def test_a_value_out_of_range_is_one_line_naming_the_field(build, field, value):
    with pytest.raises(InvalidConfig) as raised:
        build(**{field: value})
    message = str(raised.value)
    assert "\n" not in message and message.startswith(f"{field} ") and repr(value) in message


@pytest.mark.parametrize(
    ("env", "value"),
    [
        ("PIPELINE_CALL_TIMEOUT", "0"),
        ("PIPELINE_BACKOFF_CAP", "-1"),
        ("PIPELINE_WORKER_DEAD_AFTER", "0"),
        ("PIPELINE_INDEX_BUILD_MEMORY", "1000"),
        ("PIPELINE_MAX_CHUNKS_PER_DOCUMENT", "0"),
        ("PIPELINE_INGEST_BATCH_BYTES", "0"),
        ("PIPELINE_MAX_INPUT_BYTES", "0"),
        ("PIPELINE_PARTITION_BUCKETS", "0"),
        ("PIPELINE_DATABASE_POOL_MODE", "statement"),
        ("PIPELINE_EMBED_RUN_DEADLINE", "0"),
        ("PIPELINE_BATCH_INPUTS", "0"),
        ("PIPELINE_BATCH_TOKENS", "0"),
        ("PIPELINE_EMBEDDING_DIMENSIONS", "0"),
        ("PIPELINE_MODEL_MAX_INPUT_TOKENS", "0"),
        ("PIPELINE_LOCAL_BATCH_INPUTS", "0"),
    ],
)
def test_from_the_environment_the_error_names_the_variable(env, value):
    with pytest.raises(SettingsError) as raised:
        Settings.from_env({env: value})
    message = str(raised.value)
    assert "\n" not in message and message.startswith(f"{env} ") and ", got " in message


# (variable, value, the config built from Settings, what the component reads, the value it reads)
REACHES = [
    ("PIPELINE_CALL_TIMEOUT", "7.5", "worker_config", lambda c: c.executor.call_timeout, 7.5),
    ("PIPELINE_BACKOFF_BASE", "0.25", "worker_config", lambda c: c.executor.backoff_base, 0.25),
    ("PIPELINE_BACKOFF_CAP", "9", "worker_config", lambda c: c.executor.backoff_cap, 9.0),
    ("PIPELINE_RETRY_AFTER_CAP", "30", "worker_config", lambda c: c.executor.retry_after_cap, 30.0),
    ("PIPELINE_MAX_THROTTLES", "3", "worker_config", lambda c: c.executor.max_throttles, 3),
    ("PIPELINE_CRASHPOINT", "after_claim", "worker_config", lambda c: c.executor.crashpoint, "after_claim"),
    ("PIPELINE_WORKER_DEAD_AFTER", "2", "worker_config", lambda c: c.worker_dead_after, 2.0),
    ("PIPELINE_INDEX_BUILD_MEMORY", str(64 << 20), "worker_config", lambda c: c.index_build_memory, 64 << 20),
    ("PIPELINE_DATABASE_POOL_MODE", "transaction", "worker_config", lambda c: c.prepare, False),
    ("PIPELINE_RUN_TOKEN_BUDGET", "100", "worker_config", lambda c: c.run_token_budget, 100),
    ("PIPELINE_DAILY_TOKEN_BUDGET", "200", "worker_config", lambda c: c.daily_token_budget, 200),
    ("PIPELINE_MAX_INPUT_BYTES", "1234", "ingest_config", lambda c: c.max_bytes, 1234),
    ("PIPELINE_DECODE_ERRORS", "REPLACE", "ingest_config", lambda c: c.decode_errors, "replace"),
    ("PIPELINE_STAGE_TIMEOUT", "3", "ingest_config", lambda c: c.stage_timeout, 3.0),
    ("PIPELINE_EXTRACT_MEMORY", "0", "ingest_config", lambda c: c.extract_memory, 0),
    ("PIPELINE_EXTRACT_PROCESSES", "3", "ingest_config", lambda c: c.extract_processes, 3),
    ("PIPELINE_MAX_TEXT_CHARS", "50", "ingest_config", lambda c: c.max_text_chars, 50),
    ("PIPELINE_MAX_CHUNKS_PER_DOCUMENT", "4", "ingest_config", lambda c: c.max_chunks, 4),
    ("PIPELINE_INGEST_BATCH_BYTES", "1000", "ingest_config", lambda c: c.batch_bytes, 1000),
    ("PIPELINE_MAX_ATTEMPTS", "2", "ingest_config", lambda c: c.max_attempts, 2),
    ("AWS_ENDPOINT_URL", "http://minio:9000", "source_config", lambda c: c.s3_endpoint, "http://minio:9000"),
    ("PIPELINE_BACKOFF_BASE", "0.25", "source_config", lambda c: c.retry_base, 0.25),
    (
        "PIPELINE_SOURCE_DATABASE_URL",
        "postgresql://src/db",
        "source_config",
        lambda c: c.table_database_url,
        "postgresql://src/db",
    ),
    ("PIPELINE_DATABASE_URL", "postgresql://app/db", "source_config", lambda c: c.database.url, "postgresql://app/db"),
    ("PIPELINE_DATABASE_URL", "postgresql://app/db", "database_config", lambda c: c.url, "postgresql://app/db"),
    ("PIPELINE_HOME", "/tmp/somewhere", "database_config", lambda c: c.home, Path("/tmp/somewhere").resolve()),
    ("PIPELINE_DATABASE_POOL_MODE", "Transaction", "database_config", lambda c: c.prepare, False),
    ("PIPELINE_MAX_INPUT_BYTES", "1234", "source_config", lambda c: c.max_bytes, 1234),
    ("PIPELINE_PARTITION_BUCKETS", "8", "dagster_config", lambda c: c.partition_buckets, 8),
    ("PIPELINE_SOURCE_SENSOR_INTERVAL", "5", "dagster_config", lambda c: c.source_sensor_interval, 5),
    ("PIPELINE_SOURCE_RETRY_BASE", "2.5", "dagster_config", lambda c: c.source_retry_base, 2.5),
    ("PIPELINE_RECONCILE_CRON", "5 * * * *", "dagster_config", lambda c: c.reconcile_cron, "5 * * * *"),
    ("PIPELINE_HEALTH_CRON", "0 0 * * *", "dagster_config", lambda c: c.health_cron, "0 0 * * *"),
    ("PIPELINE_DLQ_GROWTH_PER_HOUR", "3", "dagster_config", lambda c: c.dlq_growth_per_hour, 3),
    ("PIPELINE_EMBED_WORKERS", "external", "dagster_config", lambda c: c.in_process, False),
    ("PIPELINE_EMBED_RUN_DEADLINE", "12.5", "dagster_config", lambda c: c.embed_run_deadline, 12.5),
    ("PIPELINE_EMBEDDING_MODEL", "local-onnx", "provider_config", lambda c: c.model_name, "local-onnx"),
    ("OPENAI_API_KEY", "sk-test", "provider_config", lambda c: c.model_name, pc.DEFAULT_OPENAI_MODEL),
    ("OPENAI_BASE_URL", "http://llm:8080/v1", "provider_config", lambda c: c.base_url, "http://llm:8080/v1"),
    ("PIPELINE_EMBEDDING_DIMENSIONS", "256", "provider_config", lambda c: c.dimensions, 256),
    ("PIPELINE_CALL_TIMEOUT", "7.5", "provider_config", lambda c: c.call_timeout, 7.5),
    ("PIPELINE_BATCH_INPUTS", "5000", "provider_config", lambda c: c.request_inputs, pc.MAX_BATCH_INPUTS),
    ("PIPELINE_BATCH_TOKENS", "500", "provider_config", lambda c: c.batch_tokens, 500),
    ("PIPELINE_MODEL_MAX_INPUT_TOKENS", "512", "provider_config", lambda c: c.max_input_tokens, 512),
    ("PIPELINE_LOCAL_MODEL_DIR", "/models/m", "provider_config", lambda c: c.local_model_dir, Path("/models/m")),
    ("PIPELINE_LOCAL_BATCH_INPUTS", "8", "provider_config", lambda c: c.local_batch_inputs, 8),
]


@pytest.mark.parametrize(
    ("env", "value", "builder", "read", "expected"), REACHES, ids=[f"{r[0]}->{r[2]}" for r in REACHES]
)
def test_a_changed_variable_reaches_its_components_config(env, value, builder, read, expected):
    config = getattr(Settings.from_env({env: value}), builder)()
    assert read(config) == expected
    assert read(getattr(Settings.from_env({}), builder)()) != expected  # it is the variable that changed it


def test_a_command_sets_the_fields_no_variable_sets():
    config = Settings.from_env({"PIPELINE_CALL_TIMEOUT": "5"}).worker_config(
        concurrency=2, until_idle=True, lease_seconds=None
    )
    assert (config.concurrency, config.until_idle, config.lease_seconds) == (2, True, wc.DEFAULT_LEASE_SECONDS)
    assert config.executor.call_timeout == 5.0


def test_database_urls_stay_out_of_the_configs_repr():
    config = Settings.from_env(
        {
            "PIPELINE_SOURCE_DATABASE_URL": "postgresql://u:hunter2@src/db",
            "PIPELINE_DATABASE_URL": "postgresql://u:hunter3@app/db",
        }
    ).source_config()
    assert "hunter2" not in repr(config) and "hunter3" not in repr(config)


def test_the_runtime_carries_the_ingest_config_the_environment_set():
    settings = Settings.from_env({"PIPELINE_MAX_CHUNKS_PER_DOCUMENT": "4", "PIPELINE_STAGE_TIMEOUT": "3"})
    rt = Runtime.build(settings)
    try:
        assert rt.options.config == settings.ingest_config() and rt.options.config.max_chunks == 4
    finally:
        rt.provider.close()


def test_a_run_token_budget_from_the_environment_stops_the_worker():
    """The budget reaches the worker through its config alone: it stops claiming once its tokens reach
    it, and the jobs it did not claim stay pending."""
    provider = LocalHashingProvider()
    queue = MemoryQueue()
    texts = [f"budget chunk {i}" for i in range(12)]
    checksums = [hashlib.sha256(t.encode()).digest() for t in texts]
    queue.add_content(1, [(c, t, len(t.split())) for c, t in zip(checksums, texts, strict=True)])
    queue.add_model(provider.spec.model_id)
    jobs = queue.enqueue(checksums, max_attempts=5)
    config = Settings.from_env({"PIPELINE_RUN_TOKEN_BUDGET": "1"}).worker_config(
        concurrency=1, until_idle=True, poll_seconds=0.02, build_index=False, batch_inputs=4
    )
    worker = Worker("", provider, config, store=MemoryJobStore(queue, model_id=provider.spec.model_id))
    with pytest.raises(BudgetExhausted, match="run token budget of 1"):
        worker.run()
    statuses = [queue.jobs[j].status for j in jobs]
    assert statuses.count("ready") == 4 and statuses.count("pending") == 8, statuses


def test_the_key_stays_out_of_the_provider_configs_repr():
    config = Settings.from_env({"OPENAI_API_KEY": "sk-hunter2-secret"}).provider_config()
    assert config.api_key == "sk-hunter2-secret" and "hunter2" not in repr(config)


def test_the_provider_is_built_from_its_config_alone():
    config = ProviderConfig(
        api_key="sk-test",
        base_url="http://127.0.0.1:9/v1",
        dimensions=64,
        batch_inputs=5000,
        batch_tokens=900,
        max_input_tokens=512,
        model="bge-small",
    )
    provider = provider_for(config)
    try:
        spec = provider.spec
        assert (spec.name, spec.dimension, spec.max_batch_inputs, spec.max_batch_tokens, spec.max_input_tokens) == (
            "bge-small",
            64,
            pc.MAX_BATCH_INPUTS,
            900,
            512,
        )
    finally:
        provider.close()
    assert provider_for(ProviderConfig()).spec.name == pc.LOCAL_MODEL_NAME


def test_the_providers_package_and_the_settings_load_no_model_library():
    """A command that builds no local model (``settings``, ``status``, ``dlq``) does not pay for numpy,
    onnxruntime or the openai SDK: importing the package and building the config loads none of them."""
    code = (
        "import sys\n"
        "from pipeline_assets.settings import Settings\n"
        "import pipeline_assets.providers\n"
        "Settings.from_env({}).provider_config()\n"
        "print(' '.join(m for m in ('numpy', 'onnxruntime', 'openai') if m in sys.modules))"
    )
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert loaded == []
