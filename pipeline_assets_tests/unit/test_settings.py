"""One typed Settings: every variable parsed in one place, errors that name the
variable, the table in docs/configuration.md generated from the same fields, and no
environment read anywhere else in the package."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pipeline_assets.app.runtime import chunker_for, extractor_version
from pipeline_assets.content.extract import EXTRACTOR_VERSION
from pipeline_assets.settings import Settings, SettingsError
from pipeline_assets.settings_reference import reference_table

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "pipeline_assets"


def test_defaults_without_environment():
    s = Settings.from_env({})
    assert s.database_url is None and s.openai_api_key is None
    assert s.max_input_bytes == 20 * 1024 * 1024
    assert s.decode_errors == "strict"
    assert s.provider_config().model_name == "local-hashing"
    assert Settings.from_env({"OPENAI_API_KEY": "k"}).provider_config().model_name == "text-embedding-3-small"


def test_decode_policy(monkeypatch):
    monkeypatch.delenv("PIPELINE_DECODE_ERRORS", raising=False)
    assert Settings.from_env().decode_errors == "strict"
    monkeypatch.setenv("PIPELINE_DECODE_ERRORS", "replace")
    assert Settings.from_env().decode_errors == "replace"
    monkeypatch.setenv("PIPELINE_DECODE_ERRORS", "bogus")
    with pytest.raises(ValueError):
        Settings.from_env()


def test_extractor_version(monkeypatch):
    monkeypatch.delenv("PIPELINE_EXTRACTOR_VERSION", raising=False)
    assert extractor_version(Settings.from_env()) == EXTRACTOR_VERSION == "extract-1"
    monkeypatch.setenv("PIPELINE_EXTRACTOR_VERSION", "extract-2-test")
    assert extractor_version(Settings.from_env()) == "extract-2-test"


def test_max_input_bytes(monkeypatch):
    monkeypatch.delenv("PIPELINE_MAX_INPUT_BYTES", raising=False)
    assert Settings.from_env().max_input_bytes == 20 * 1024 * 1024
    monkeypatch.setenv("PIPELINE_MAX_INPUT_BYTES", "1234")
    assert Settings.from_env().max_input_bytes == 1234
    monkeypatch.setenv("PIPELINE_MAX_INPUT_BYTES", "lots")
    with pytest.raises(ValueError, match="PIPELINE_MAX_INPUT_BYTES"):
        Settings.from_env()
    monkeypatch.setenv("PIPELINE_MAX_INPUT_BYTES", "0")
    with pytest.raises(SettingsError, match="PIPELINE_MAX_INPUT_BYTES"):
        Settings.from_env()


def test_chunker(monkeypatch):
    monkeypatch.delenv("PIPELINE_CHUNK_TOKENS", raising=False)
    monkeypatch.delenv("PIPELINE_CHUNK_OVERLAP", raising=False)
    assert chunker_for(Settings.from_env()).version == "tok-window-1/cl100k/512/64"
    monkeypatch.setenv("PIPELINE_CHUNK_TOKENS", "200")
    monkeypatch.setenv("PIPELINE_CHUNK_OVERLAP", "20")
    assert chunker_for(Settings.from_env()).version == "tok-window-1/cl100k/200/20"
    with pytest.raises(ValueError):
        chunker_for(Settings.from_env(), hard_limit=100)
    monkeypatch.setenv("PIPELINE_CHUNK_TOKENS", "big")
    with pytest.raises(ValueError, match="PIPELINE_CHUNK_TOKENS"):
        Settings.from_env()


def test_secrets_are_never_shown():
    s = Settings.from_env(
        {"OPENAI_API_KEY": "sk-secret-value-123", "PIPELINE_DATABASE_URL": "postgresql://u:hunter2@db:5432/x"}
    )
    shown = repr(s) + str(s.describe())
    assert "sk-secret-value-123" not in shown and "hunter2" not in shown
    assert s.describe()["OPENAI_API_KEY"] == "set"
    assert "db:5432" in s.describe()["PIPELINE_DATABASE_URL"]


def test_overrides_and_replace_keep_unset_values():
    s = Settings.from_env({"PIPELINE_EMBEDDING_MODEL": "a"}, embedding_model=None)
    assert s.embedding_model == "a"
    assert s.replace(embedding_model=None).embedding_model == "a"
    assert s.replace(embedding_model="b").embedding_model == "b"


def test_docs_list_every_setting_from_the_one_place():
    page = (REPO / "docs" / "configuration.md").read_text()
    assert reference_table() in page, (
        "docs/configuration.md's settings table is stale: paste `pipeline-assets settings --reference`"
    )


def test_no_environment_read_outside_settings():
    """Settings are read once, at the edge; only settings/reading.py reads os.environ (and the dev
    server, which builds the environment of the Dagster processes it starts)."""
    allowed = {PACKAGE / "settings" / "reading.py", PACKAGE / "cli" / "devserver.py"}
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        if path in allowed:
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"os\.environ|os\.getenv", line):
                offenders.append(f"{path.relative_to(REPO)}:{n}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


def test_a_password_containing_at_is_fully_redacted():
    from pipeline_assets.settings import redact_text

    url = "postgresql://app:s3@cr3t@db.internal:5432/x"
    # What the CLI prints when libpq, stopping at the first "@", echoes the rest as the host.
    message = f"cannot connect to database {url}: failed to resolve host 'cr3t@db.internal': [Errno -2]"
    shown = redact_text(message)
    assert "s3" not in shown and "cr3t" not in shown, shown
    assert "db.internal:5432" in shown
    assert redact_text("postgresql://app:a@b@c@h/db") == "postgresql://app:***@h/db"
    assert "p@ss" not in redact_text("host=h password=p@ss user=u")
    assert "cr3t" not in str(Settings.from_env({"PIPELINE_DATABASE_URL": url}).describe())


def test_ingest_guard_settings(monkeypatch):
    s = Settings.from_env({})
    assert s.ingest_batch_bytes == 64 * 1024 * 1024 and s.extract_memory == 2 * 1024**3
    assert s.max_text_chars == 20_000_000 and s.max_chunks_per_document == 20_000
    s = Settings.from_env(
        {
            "PIPELINE_INGEST_BATCH_BYTES": "1000",
            "PIPELINE_MAX_TEXT_CHARS": "50",
            "PIPELINE_MAX_CHUNKS_PER_DOCUMENT": "3",
            "PIPELINE_EXTRACT_MEMORY": "0",
        }
    )
    assert (s.ingest_batch_bytes, s.max_text_chars, s.max_chunks_per_document, s.extract_memory) == (1000, 50, 3, 0)
    for env, value in (
        ("PIPELINE_INGEST_BATCH_BYTES", "0"),
        ("PIPELINE_MAX_TEXT_CHARS", "0"),
        ("PIPELINE_MAX_CHUNKS_PER_DOCUMENT", "-1"),
        ("PIPELINE_EXTRACT_MEMORY", "-1"),
    ):
        with pytest.raises(SettingsError, match=env):
            Settings.from_env({env: value})
    from pipeline_assets.app.runtime import Runtime

    config = Runtime.build(s).options.config
    assert (config.batch_bytes, config.max_text_chars, config.max_chunks, config.extract_memory) == (1000, 50, 3, 0)
