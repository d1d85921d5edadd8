"""The architecture, checked: layers import only downwards, nothing below the
Dagster layer knows Dagster or click, modules stay small, the layout in
docs/architecture.md matches the tree, and the command line and the Dagster assets run the same
use cases (one corpus through each lands the same database state)."""

from __future__ import annotations

import ast
import re
import uuid
from pathlib import Path

import psycopg
import pytest

from pipeline_assets_tests.conftest import _with_dbname
from pipeline_assets_tests.dagster_helpers import execute, fresh_defs
from pipeline_assets_tests.dagster_instances import postgres_instance
from pipeline_assets_tests.data_helpers import write_corpus
from pipeline_assets_tests.processes import cli

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "pipeline_assets"
MAX_MODULE_LINES = 300
MAX_DOCSTRING_LINES = 12

# What each layer may import from the package (besides itself). The floor (the components'
# ``*_config.py`` modules with ``component_config``, ``counts`` and ``messages``) imports only
# itself, and every layer may import it; the settings package reads the environment into the configs.
FLOOR = ("config", "counts", "messages")
ALLOWED = {
    "config": set(),
    "counts": set(),
    "messages": set(),
    "settings": set(),
    "settings_reference": {"settings"},
    "content": {"settings"},
    "providers": {"settings", "content"},
    "store": {"settings"},
    "registry": {"settings", "providers", "store"},
    "jobqueue": {"settings", "providers", "store", "content", "registry"},
    "app": {"settings", "providers", "store", "content", "registry", "jobqueue"},
    "defs": {"settings", "providers", "store", "content", "registry", "jobqueue", "app"},
    "cli": {"settings", "settings_reference", "providers", "store", "content", "registry", "jobqueue", "app", "defs"},
}


def _layer(path: Path) -> str:
    rel = path.relative_to(PACKAGE)
    if rel.stem.endswith("_config"):
        return "config"
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _target(name: str) -> str:
    """The layer an imported name (``pipeline_assets.jobqueue.worker_config.WorkerConfig``) is in."""
    parts = name.split(".")[1:]
    return "config" if any(p.endswith("_config") for p in parts) else parts[0]


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def test_layers_import_only_downwards():
    problems = []
    for path in _modules():
        layer = _layer(path)
        if layer == "__init__":
            continue
        for name in _imports(path):
            top = name.split(".")[0]
            if top in ("dagster", "dagster_webserver", "dagster_postgres") and layer != "defs":
                problems.append(f"{path.relative_to(REPO)} imports {name} (only defs/ may know Dagster)")
            if top == "click" and layer != "cli":
                problems.append(f"{path.relative_to(REPO)} imports {name} (only cli/ may know click)")
            if top == "pipeline_assets" and "." in name:
                target = _target(name)
                if target in ALLOWED and target not in (layer, *FLOOR) and target not in ALLOWED[layer]:
                    problems.append(f"{path.relative_to(REPO)} ({layer}) imports {name}")
    assert not problems, "\n".join(problems)


# What executes SQL: a statement, a cursor, a COPY, or the named-query loader.
_RUNS_SQL = re.compile(r"\bqueries\.(?:load|scalar|one_row)\(|\.execute\(|\.cursor\(|\.copy\(")


def test_app_runs_no_sql_itself():
    """app/ holds use cases: the SQL they need runs in store/ (or the queue's and the registry's
    modules), next to its family in sql/queries/."""
    running = sorted(
        str(p.relative_to(REPO)) for p in (PACKAGE / "app").glob("*.py") if _RUNS_SQL.search(p.read_text())
    )
    assert not running, f"app/ modules that execute SQL themselves: {running}"


def _test_helpers() -> list[Path]:
    """The suite's own modules but its test modules: fixtures, fakes, harnesses."""
    tests = REPO / "pipeline_assets_tests"
    return sorted(p for p in tests.rglob("*.py") if "__pycache__" not in p.parts and not p.name.startswith("test_"))


def test_no_module_is_too_long():
    long = {
        str(p.relative_to(REPO)): n
        for p in [*_modules(), *_test_helpers()]
        if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"


def _python_files() -> list[Path]:
    """Every module of the package, the test suite and the benchmarks."""
    found = [*_modules()]
    for top in ("pipeline_assets_tests", "benchmarks"):
        found += sorted(p for p in (REPO / top).rglob("*.py") if "__pycache__" not in p.parts)
    return found


def test_module_docstrings_state_contracts_briefly():
    """A module's docstring says what it guarantees in a few lines; the rest lives in docs/ (a
    benchmark's flags and JSON keys in benchmarks/README.md)."""
    long = {}
    for path in _python_files():
        doc = ast.get_docstring(ast.parse(path.read_text()), clean=False)
        if doc and (n := len(doc.strip().splitlines())) > MAX_DOCSTRING_LINES:
            long[str(path.relative_to(REPO))] = n
    assert not long, f"module docstrings over {MAX_DOCSTRING_LINES} lines: {long}"


def test_no_merge_conflict_is_left():
    marker = re.compile(r"^(<{7} |={7}$|>{7} )", re.MULTILINE)
    files = [
        p
        for top in ("pipeline_assets", "pipeline_assets_tests", "sql", "docs", "benchmarks")
        for p in (REPO / top).rglob("*")
        if p.suffix in (".py", ".sql", ".md", ".yaml", ".toml")
    ]
    left = [str(p.relative_to(REPO)) for p in files if marker.search(p.read_text(errors="replace"))]
    assert not left, f"merge conflict markers in {left}"


def test_documented_layout_matches_the_tree():
    """docs/architecture.md, "Layout", names every module and only folders that exist."""
    page = (REPO / "docs" / "architecture.md").read_text()
    block = page.split("## Layout", 1)[1].split("```", 2)[1]
    for path in _modules():
        rel = path.relative_to(PACKAGE)
        if rel.name == "__init__.py":
            continue
        folder = f"{rel.parts[0]}/" if len(rel.parts) > 1 else None
        assert (folder or rel.name) in block, f"the layout does not mention {rel}"
        if folder:
            assert re.search(rf"\b{re.escape(rel.stem)}\b", block), f"the layout does not mention {rel}"
    for folder in re.findall(r"^\s+(\w+)/\s", block, flags=re.M):
        assert (PACKAGE / folder).is_dir() or (REPO / folder).is_dir(), f"the layout names a missing folder {folder}/"


# -- one code path: the CLI and the Dagster assets land the same state ---------------------

STATE = {
    "documents": """SELECT document_id, status, encode(source_checksum, 'hex'), encode(text_checksum, 'hex'),
                           extractor_version, chunker_version, chunk_count, error_class
                    FROM app.documents ORDER BY 1""",
    "chunks": """SELECT d.document_id, c.chunk_index, encode(c.chunk_checksum, 'hex'), c.token_count,
                        c.char_start, c.char_end
                 FROM app.chunks c JOIN app.documents d USING (doc_pk) ORDER BY 1, 2""",
    "jobs": """SELECT encode(k.chunk_checksum, 'hex'), k.model_id, j.status, j.attempts, j.error_class
               FROM app.job_keys k JOIN app.embedding_jobs j USING (job_id) ORDER BY 1, 2""",
    "embeddings": "SELECT encode(chunk_checksum, 'hex'), model_id, embedding::text FROM app.embeddings ORDER BY 1, 2",
    "stages": """SELECT d.document_id, s.stage, s.status, s.error_class, s.code_version
                 FROM app.stage_runs s JOIN app.documents d USING (doc_pk) ORDER BY 1, 2""",
    "models": "SELECT model_id, dimension, active FROM app.models ORDER BY 1",
}


def _state(url: str) -> dict[str, list[tuple]]:
    with psycopg.connect(url) as conn:
        return {name: conn.execute(query).fetchall() for name, query in STATE.items()}


@pytest.fixture
def second_db(server_url):
    name = "t_layers_b_" + uuid.uuid4().hex[:8]
    with psycopg.connect(server_url, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    yield _with_dbname(server_url, name)
    with psycopg.connect(server_url, autocommit=True) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def test_cli_and_dagster_land_the_same_database_state(
    env, clean_db, database_url, second_db, fake, tmp_path, monkeypatch, server_url
):
    corpus = tmp_path / "corpus"
    write_corpus(corpus, 5)
    (corpus / "copy.md").write_text((corpus / "doc0001.md").read_text())  # shared content: one job
    (corpus / "blob.bin").write_bytes(b"\x00\x01binary")  # quarantined
    (corpus / "page.html").write_text("<html><body><h1>Title</h1><p>Some text.</p></body></html>")

    cli("embed", str(corpus), env={**env, "PIPELINE_DATABASE_URL": database_url})

    monkeypatch.setenv("PIPELINE_DATABASE_URL", second_db)
    monkeypatch.setenv("PIPELINE_SOURCE_DIR", str(corpus))
    with postgres_instance(server_url) as instance:  # a backfill of every bucket
        result = execute(
            fresh_defs(),
            instance,
            tags={"dagster/asset_partition_range_start": "b000", "dagster/asset_partition_range_end": "b063"},
        )
        assert result.success

    via_cli, via_dagster = _state(database_url), _state(second_db)
    assert via_cli["documents"] and via_cli["embeddings"], "the corpus produced nothing"
    assert {r[1] for r in via_cli["documents"]} == {"current", "quarantined"}
    assert {r[2] for r in via_cli["jobs"]} == {"ready"}
    for table in STATE:
        assert via_cli[table] == via_dagster[table], f"{table} differs between the CLI and Dagster"
