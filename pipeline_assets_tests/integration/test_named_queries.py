"""Named queries: the loader's file format, that every family loads and every
``FAMILY.name`` used in the code exists, that no SQL is built with f-strings,
and that the job states of the code, the SQL and the schema agree."""

from __future__ import annotations

import hashlib
import io
import re
import tokenize
import warnings
from pathlib import Path

import numpy as np
import pytest
from psycopg import sql

from pipeline_assets.app import dlq
from pipeline_assets.app import search as search_uc
from pipeline_assets.app.status import database_status
from pipeline_assets.jobqueue import ledger, transitions
from pipeline_assets.jobqueue.status import JobStatus
from pipeline_assets.providers import ModelSpec
from pipeline_assets.registry import models, vector_index
from pipeline_assets.store import queries, reports, retrieval, stage_runs
from pipeline_assets_tests import job_helpers

PACKAGE = Path(queries.__file__).resolve().parents[1]
QUERY_DIR = queries.sql_dir() / "queries"
MAX_QUERY_COMMENT_LINES = 3

# The modules whose SQL moved to sql/queries/ (their f-string check is an assertion).
OWNED = [
    "jobqueue/transitions.py",
    "registry/models.py",
    "registry/vector_index.py",
    "jobqueue/ledger.py",
    "jobqueue/status.py",
    "store/reports.py",
    "store/retrieval.py",
    "store/stage_runs.py",
    "jobqueue/provider_state.py",
]
# Every family in sql/queries/ (a new file is checked the day it lands).
FAMILIES = sorted(p.stem for p in QUERY_DIR.glob("*.sql"))


# --------------------------------------------------------------------------- the file format


def test_parse_blocks_with_their_comments():
    text = """-- A file header, before the first block, is not a query.

-- name: one
-- What one does.
SELECT 1

--name: two --
SELECT %(x)s
"""
    parsed = queries.parse(text)
    assert list(parsed) == ["one", "two"]
    assert parsed["one"] == "SELECT 1"  # the documenting comment stays in the file, not in the text sent
    assert parsed["two"] == "SELECT %(x)s"


def test_parse_rejects_duplicate_names():
    with pytest.raises(ValueError, match="'a' defined twice"):
        queries.parse("-- name: a\nSELECT 1\n-- name: a\nSELECT 2\n", source="dup.sql")


def test_parse_rejects_empty_blocks():
    with pytest.raises(ValueError, match="'a' is empty"):
        queries.parse("-- name: a\n\n-- name: b\nSELECT 2\n")
    with pytest.raises(ValueError, match="'b' is empty"):
        queries.parse("-- name: a\nSELECT 1\n-- name: b\n   \n")
    with pytest.raises(ValueError, match="'b' is empty"):
        queries.parse("-- name: a\nSELECT 1\n-- name: b\n-- only a comment\n")


def test_parse_rejects_a_file_without_names():
    with pytest.raises(ValueError, match="no '-- name:' blocks"):
        queries.parse("SELECT 1\n")


def test_missing_query_name_raises(tmp_path):
    (tmp_path / "fam.sql").write_text("-- name: present\nSELECT 1\n")
    fam = queries.NamedQueries("fam", tmp_path)
    assert fam.present == "SELECT 1"
    assert fam.names() == ["present"]
    with pytest.raises(AttributeError, match="no query 'absent'"):
        fam.absent  # noqa: B018


def test_loading_is_lazy(tmp_path):
    fam = queries.NamedQueries("not_there", tmp_path)  # nothing read yet
    with pytest.raises(FileNotFoundError):
        fam.anything  # noqa: B018
    assert queries.load("jobs") is queries.load("jobs")


# --------------------------------------------------------------------------- the shipped files


@pytest.mark.parametrize("path", sorted(QUERY_DIR.glob("*.sql")), ids=lambda p: p.stem)
def test_every_family_file_loads(path):
    names = queries.NamedQueries(path.stem, QUERY_DIR).names()
    assert names
    for name in names:
        assert name == name.lower(), f"{path.name}: {name} is not snake_case"


@pytest.mark.parametrize("path", sorted(QUERY_DIR.glob("*.sql")), ids=lambda p: p.stem)
def test_each_query_says_what_it_does_in_one_to_three_comment_lines(path):
    long = {}
    for block in path.read_text().split("-- name:")[1:]:
        name, *lines = block.splitlines()
        comments = 0
        for line in lines:
            if not line.startswith("--"):
                break
            comments += 1
        if not 1 <= comments <= MAX_QUERY_COMMENT_LINES:
            long[name.strip()] = comments
    assert not long, f"{path.name}: queries with no comment or over {MAX_QUERY_COMMENT_LINES} lines of it: {long}"


def test_the_families_of_this_module_exist():
    assert {"jobs", "models", "ledger", "reports", "retrieval", "stage_runs", "documents", "migrations"} <= set(
        FAMILIES
    )


def _package_sources() -> dict[str, str]:
    return {str(p.relative_to(PACKAGE)): p.read_text(encoding="utf-8") for p in sorted(PACKAGE.rglob("*.py"))}


_LOAD = re.compile(r"^(\w+)\s*=\s*queries\.load\(\s*[\"'](\w+)[\"']\s*\)", re.M)


def _references() -> list[tuple[str, str, str, str]]:
    """(module, variable, family, query name) for each ``VAR.name`` of a ``VAR = queries.load(...)``."""
    refs = []
    for module, text in _package_sources().items():
        for var, family in _LOAD.findall(text):
            for name in re.findall(rf"\b{var}\.(\w+)", text):
                if name not in ("names", "family"):
                    refs.append((module, var, family, name))
    return refs


def test_every_referenced_query_exists():
    refs = _references()
    used = {(family, name) for _, _, family, name in refs}
    assert {family for family, _ in used} >= set(FAMILIES)
    missing = [r for r in refs if r[3] not in queries.load(r[2]).names()]
    assert not missing, missing


def test_every_query_is_used():
    used = {(family, name) for _, _, family, name in _references()}
    unused = [(f, n) for f in FAMILIES for n in queries.load(f).names() if (f, n) not in used]
    assert not unused, unused


def test_loaded_modules_hold_their_families():
    assert transitions.JOBS.family == "jobs"
    assert models.MODELS.family == "models"
    assert ledger.LEDGER.family == "ledger"
    assert reports.REPORTS.family == "reports"
    assert retrieval.RETRIEVAL.family == "retrieval"
    assert stage_runs.STAGE_RUNS.family == "stage_runs"


def test_the_old_jobs_queries_module_is_gone():
    assert not (PACKAGE / "jobs" / "queries.py").exists()


# --------------------------------------------------------------------------- no SQL in f-strings

_SQL_WORD = re.compile(r"\b(SELECT|INSERT|UPDATE|DELETE|CREATE)\b")


def _fstring_sql(text: str) -> list[tuple[int, str]]:
    """(line, token) of every f-string holding an SQL keyword."""
    hits = []
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.STRING:
            prefix = re.match(r"[A-Za-z]*", tok.string).group(0).lower()
            if "f" in prefix and _SQL_WORD.search(tok.string):
                hits.append((tok.start[0], tok.string[:60]))
    return hits


def test_the_detector_finds_fstring_sql():
    assert _fstring_sql('x = f"SELECT {a} FROM t"\n')
    assert _fstring_sql('x = (f"CREATE INDEX {name}"\n     " ON t")\n')
    assert not _fstring_sql('x = "SELECT %(a)s FROM t"\ny = f"select the {thing}"\n')


@pytest.mark.parametrize("module", OWNED)
def test_owned_modules_build_no_sql_with_fstrings(module):
    assert _fstring_sql((PACKAGE / module).read_text(encoding="utf-8")) == []


def test_report_other_modules_with_fstring_sql():
    """Not an assertion for modules owned elsewhere: a warning listing them."""
    offenders = {
        module: hits
        for module, text in _package_sources().items()
        if module not in OWNED and (hits := _fstring_sql(text))
    }
    if offenders:
        warnings.warn(
            "SQL built with f-strings in: "
            + "; ".join(f"{m} lines {[line for line, _ in hits]}" for m, hits in sorted(offenders.items())),
            stacklevel=1,
        )


# --------------------------------------------------------------------------- psycopg.sql templates


def _fields(template: str) -> set[str]:
    return set(re.findall(r"\{(\w+)\}", template))


def test_templates_have_exactly_their_fields():
    assert _fields(models.MODELS.create_hnsw_index) == {"name", "kind", "dim", "opclass", "model"}
    assert _fields(models.MODELS.drop_index) == {"name"}
    assert _fields(retrieval.RETRIEVAL.nearest) == {"kind", "dim"}
    assert _fields(transitions.JOBS.enqueue) == {"scope"}
    assert _fields(transitions.JOBS.claim) == {"scope", "limit"}
    assert _fields(stage_runs.STAGE_RUNS.embed_state) == {"models", "scope"}
    assert _fields(stage_runs.STAGE_RUNS.refresh_embed) == _fields(stage_runs.STAGE_RUNS.embed_counts) == {"state"}
    assert _fields(stage_runs.STAGE_RUNS.refresh_embed_drained) == {"refresh"}
    assert _fields(queries.load("estimates").summary) == {"wanted"}
    # A table source's templates: identifiers composed with sql.Identifier, types from the catalog.
    table_fields = {
        "table_source": {"table", "id", "text", "updated", "id_type", "updated_type"},
        "change_log": {"table", "id", "text", "id_name"},
    }
    for family, allowed in table_fields.items():
        for name in queries.load(family).names():
            assert _fields(getattr(queries.load(family), name)) <= allowed, (family, name)
    for family in FAMILIES:
        fam = queries.load(family)
        for name in fam.names():
            if family in table_fields:
                continue
            if (family, name) not in {
                ("models", "create_hnsw_index"),
                ("models", "drop_index"),
                ("retrieval", "nearest"),
                ("jobs", "enqueue"),
                ("jobs", "claim"),
                ("migrations", "create_database"),
                ("stage_runs", "embed_state"),
                ("stage_runs", "refresh_embed"),
                ("stage_runs", "refresh_embed_drained"),
                ("stage_runs", "embed_counts"),
                ("estimates", "summary"),
            } and family != "roles":
                assert "{" not in getattr(fam, name), (family, name)


def test_index_template_quotes_what_it_interpolates():
    text = (
        sql.SQL(models.MODELS.create_hnsw_index)
        .format(
            name=sql.Identifier("embeddings_hnsw_x"),
            kind=sql.Identifier("halfvec"),
            opclass=sql.Identifier("halfvec_cosine_ops"),
            dim=sql.Literal(3072),
            model=sql.Literal("o'brien/m@16"),
        )
        .as_string(None)
    )
    assert 'CREATE INDEX CONCURRENTLY IF NOT EXISTS "embeddings_hnsw_x" ON app.embeddings' in text
    assert '"halfvec"(3072)) "halfvec_cosine_ops"' in text
    assert "model_id = 'o''brien/m@16'" in text


# --------------------------------------------------------------------------- JobStatus


def test_job_status_values():
    assert [s.value for s in JobStatus] == ["pending", "processing", "ready", "retry", "superseded", "failed"]
    assert JobStatus.RETRY == "retry" and {"retry": 1}[JobStatus.RETRY] == 1
    assert {JobStatus.FAILED: 2}["failed"] == 2


def _job_status_check(conn) -> str:
    [(definition,)] = conn.execute("""
        SELECT pg_get_constraintdef(c.oid)
        FROM pg_constraint c
        JOIN pg_class t ON t.oid = c.conrelid
        JOIN pg_namespace n ON n.oid = t.relnamespace
        JOIN pg_attribute a ON a.attrelid = t.oid AND a.attnum = ANY(c.conkey)
        WHERE n.nspname = 'app' AND t.relname = 'embedding_jobs' AND c.contype = 'c' AND a.attname = 'status'
    """).fetchall()
    return definition


def test_check_constraint_allows_exactly_the_job_statuses(conn):
    definition = _job_status_check(conn)
    assert set(re.findall(r"'([^']*)'", definition)) == {s.value for s in JobStatus}, definition
    [(default,)] = conn.execute("""
        SELECT column_default FROM information_schema.columns
        WHERE table_schema = 'app' AND table_name = 'embedding_jobs' AND column_name = 'status'
    """).fetchall()
    assert re.findall(r"'([^']*)'", default) == [JobStatus.PENDING]


# Literals in jobs.sql that are not job states (anything else must be a JobStatus).
NOT_STATUS_LITERALS = {
    "lease_expired",
    "lease expired before completion (worker died or stalled)",  # error class / message
    "worker_dead",
    "its worker process stopped beating (died) before completion",  # error class / message
    "-infinity",  # timestamps
    "app.embedding_jobs",
    "job_id",  # pg_get_serial_sequence
    "synchronous_commit",
    "off",  # set_config (claim)
    "/",  # a lease owner's worker prefix (rescue_expired)
}


def _sql_literals(text: str) -> set[str]:
    code = re.sub(r"--[^\n]*", "", text)
    return {m.replace("''", "'") for m in re.findall(r"'((?:[^']|'')*)'", code)}


def test_status_literals_in_jobs_sql_are_job_statuses():
    text = (QUERY_DIR / "jobs.sql").read_text(encoding="utf-8")
    literals = _sql_literals(text)
    statuses = {s.value for s in JobStatus}
    assert not NOT_STATUS_LITERALS & statuses
    assert literals - NOT_STATUS_LITERALS <= statuses, literals - NOT_STATUS_LITERALS - statuses
    assert literals & statuses == statuses  # the state machine's SQL names every state
    # And in a status position specifically (status = / IN / THEN / ELSE ...):
    in_position = set(re.findall(r"(?:status\s*(?:=|<>)\s*|THEN\s+|ELSE\s+)'(\w+)'", text))
    for group in re.findall(r"status\s+IN\s*\(([^)]*)\)", text):
        in_position |= set(re.findall(r"'(\w+)'", group))
    assert in_position and in_position <= statuses, in_position - statuses


# --------------------------------------------------------------------------- the moved SQL, end to end

SPEC = ModelSpec(
    provider="test", name="o'named", dimension=4, max_input_tokens=100, max_batch_inputs=10, max_batch_tokens=1000
)
MODEL = SPEC.model_id


def _seed_document(conn, document_id: str, texts: list[str]) -> tuple[int, list[bytes]]:
    source_id = conn.execute(
        "INSERT INTO app.sources (root) VALUES ('/named-queries') ON CONFLICT (root) DO UPDATE SET root = EXCLUDED.root"
        " RETURNING source_id"
    ).fetchone()[0]
    doc_pk = conn.execute(
        "INSERT INTO app.documents (source_id, document_id, source_uri, status, source_checksum)"
        " VALUES (%s, %s, %s, 'current', %s) RETURNING doc_pk",
        (source_id, document_id, f"file:///{document_id}", b"\x01\xab"),
    ).fetchone()[0]
    sums = [hashlib.sha256(t.encode()).digest() for t in texts]
    for i, (s, t) in enumerate(zip(sums, texts)):
        conn.execute(
            "INSERT INTO app.chunks (doc_pk, chunk_index, chunk_checksum, text, token_count, char_start,"
            " char_end) VALUES (%s, %s, %s, %s, 3, 0, 10)",
            (doc_pk, i, s, t),
        )
    return doc_pk, sums


def test_read_paths_run_against_a_real_database(clean_db):
    conn = clean_db
    assert models.ensure_model(conn, SPEC)
    assert models.resolve_model_id(conn, "o'named") == MODEL
    doc_pk, sums = _seed_document(conn, "doc-a", ["alpha", "beta", "gamma"])
    assert transitions.enqueue_for_docs(conn, [doc_pk], 3) == 3

    claimed = transitions.claim(conn, model_id=MODEL, owner="w", limit=10, lease_seconds=30)
    assert all(isinstance(c, transitions.ClaimedJob) for c in claimed)
    assert sorted(c.text for c in claimed) == ["alpha", "beta", "gamma"]
    assert {c.token_count for c in claimed} == {3} and not any(c.probe for c in claimed)
    by_text = {c.text: c for c in claimed}
    vectors = {"alpha": [1, 0, 0, 0], "beta": [0, 1, 0, 0]}
    ready, _ = job_helpers.complete(
        conn,
        owner="w",
        job_ids=[by_text[t].job_id for t in vectors],
        vectors=[np.array(v, dtype=np.float32) for v in vectors.values()],
    )
    assert len(ready) == 2
    assert job_helpers.fail_terminal(
        conn, owner="w", job_ids=[by_text["gamma"].job_id], error_class="bad", message="m"
    ) == [by_text["gamma"].job_id]
    assert transitions.outstanding(conn, MODEL) == (False, False)

    # The index of a model id with a quote in it (the literal is quoted by psycopg.sql).
    vector_index.build(conn, MODEL, 4)
    vector_index.build(conn, MODEL, 4)  # idempotent
    [(indexdef,)] = conn.execute(
        "SELECT indexdef FROM pg_indexes WHERE schemaname = 'app' AND indexname = %s", (models._index_name(MODEL),)
    ).fetchall()
    assert "vector(4)" in indexdef and "'test/o''named@4'" in indexdef

    hits = search_uc.nearest(conn, MODEL, np.array([1, 0.1, 0, 0], dtype=np.float32), k=2)
    assert [h["text"] for h in hits] == ["alpha", "beta"]
    assert list(hits[0]) == ["document_id", "source_uri", "chunk_index", "text", "distance"]
    assert isinstance(hits[0]["distance"], float) and hits[0]["distance"] < hits[1]["distance"]
    exported = list(retrieval.export_rows(conn, MODEL))
    assert [(r["chunk_index"], r["model"]) for r in exported] == [(0, "o'named"), (1, "o'named")]
    assert list(exported[0]) == ["document_id", "source_uri", "chunk_index", "text", "model", "embedding"]
    assert exported[0]["embedding"] == [1.0, 0.0, 0.0, 0.0]

    st = database_status(conn)
    assert st.jobs == {"ready": 2, "failed": 1} and st.dead_letter == 1 and st.superseded == 0
    assert st.coverage[MODEL] == {"ready": 2, "wanted": 3, "ratio": 2 / 3}
    assert st.documents == {"current": 1} and st.quarantined_documents == 0
    [dead] = dlq.dead_letters(conn)
    assert dead["kind"] == "job" and dead["documents"] == ["doc-a"] and dead["error_class"] == "bad"

    summary = reports.document_summaries(conn, "/named-queries", ["doc-a", "nope"])
    assert list(summary) == ["doc-a"]
    s = summary["doc-a"]
    assert (s.doc_pk, s.status, s.source_checksum, s.text_checksum, s.chunks, s.tokens) == (
        doc_pk,
        "current",
        "01ab",
        None,
        3,
        9,
    )
    assert s.chunks_digest == hashlib.sha256(b"".join(sums)).hexdigest()
    per_doc, total = reports.embedding_coverage(conn, "/named-queries", ["doc-a"], MODEL)
    assert per_doc == {"doc-a": reports.Coverage(wanted=3, ready=2, failed=1, waiting=0)}
    assert total == reports.Coverage(3, 2, 1, 0)
    assert reports.stale_vectors(conn) == {"not_ready": 0, "noncurrent_documents": 0, "sample": []}
    assert reports.dead_letter_growth(conn) == (1, 1)

    assert stage_runs.refresh_embed(conn, MODEL) == 1
    [target] = stage_runs.rerun_targets(conn, stage="embed", failed_only=True)
    assert target == stage_runs.RerunTarget(
        root="/named-queries",
        document_id="doc-a",
        stage="embed",
        status="failed",
        error_class="bad",
        code_version=MODEL,
    )

    ledger.record_call(
        conn,
        model_id=MODEL,
        worker_id="w",
        jobs=claimed[:2],
        tokens=7,
        outcome="ok",
        status=200,
        latency=0.01,
        billed=True,
    )
    assert ledger.tokens_today(conn, MODEL) == 7
    assert database_status(conn).spend[MODEL] == {
        "calls": 1,
        "tokens": 7,
        "inputs_ok": 2,
        "failed_calls": 0,
        "duplicate_inputs": 0,
        "extra_sends": 0,
    }

    assert models.list_models(conn) == [
        {
            "model_id": MODEL,
            "name": "o'named",
            "provider": "test",
            "dimension": 4,
            "active": True,
            "ready": 2,
            "outstanding": 0,
            "index": "ready",
        }
    ]
    assert transitions.requeue_failed(conn, all_failed=True) == {JobStatus.PENDING: 1, JobStatus.SUPERSEDED: 0}
    assert models.active_model_ids(conn) == [MODEL]
    assert models.retire(conn, MODEL) == 1
    assert models.active_model_ids(conn) == []
    assert models.model_dimension(conn, MODEL) == 4
