"""Fixtures of the Dagster modules."""

import pytest

from pipeline_assets_tests.dagster_helpers import IN_PROCESS_BUCKETS


@pytest.fixture
def in_process_buckets(monkeypatch) -> int:
    """The test's database and definitions use IN_PROCESS_BUCKETS buckets (a clean database takes the
    count of its first run)."""
    monkeypatch.setenv("PIPELINE_PARTITION_BUCKETS", str(IN_PROCESS_BUCKETS))
    return IN_PROCESS_BUCKETS
