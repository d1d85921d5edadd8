"""Fixtures of the Dagster modules."""

import pytest

from pipeline_assets_tests.conftest import TEST_BUCKETS
from pipeline_assets_tests.dagster_instances import postgres_instance


@pytest.fixture
def in_process_buckets(monkeypatch) -> int:
    """The test's database and definitions use TEST_BUCKETS buckets (a clean database takes the
    count of its first run)."""
    monkeypatch.setenv("PIPELINE_PARTITION_BUCKETS", str(TEST_BUCKETS))
    return TEST_BUCKETS


@pytest.fixture
def instance(server_url):
    """A real instance on PostgreSQL, as `pipeline-assets dev` runs one: sensors need one they can hand to
    other processes (and SQLite writes each of a range run's events in its own transaction)."""
    with postgres_instance(server_url) as inst:
        yield inst
