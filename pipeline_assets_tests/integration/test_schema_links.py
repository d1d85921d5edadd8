"""app.job_keys and app.embedding_jobs are one-to-one in the schema (sql/009):
a key without its job, or a job without its key, is refused at commit."""

from __future__ import annotations

import hashlib
import shutil
import uuid

import psycopg
import pytest

from pipeline_assets.jobqueue import transitions
from pipeline_assets.store import migrations

MODEL = "test/links@4"


def checksum(label: str) -> bytes:
    return hashlib.sha256(label.encode()).digest()


def seed(conn, labels: list[str]) -> dict[str, int]:
    """Current chunks with these texts, enqueued by the real enqueue statement; label -> job_id."""
    conn.execute(
        """INSERT INTO app.models (model_id, provider, name, dimension, max_input_tokens)
                    VALUES (%s, 'test', 'links', 4, 8191) ON CONFLICT DO NOTHING""",
        (MODEL,),
    )
    src = conn.execute(
        "INSERT INTO app.sources (root) VALUES (%s) RETURNING source_id", (f"/links/{uuid.uuid4().hex}",)
    ).fetchone()[0]
    pk = conn.execute(
        """INSERT INTO app.documents (source_id, document_id, source_uri, status, chunk_count)
                         VALUES (%s, 'd', 'file:///d', 'current', %s) RETURNING doc_pk""",
        (src, len(labels)),
    ).fetchone()[0]
    for i, label in enumerate(labels):
        conn.execute(
            """INSERT INTO app.chunks (doc_pk, chunk_index, chunk_checksum, text, token_count,
                                                char_start, char_end) VALUES (%s, %s, %s, %s, 1, 0, 1)""",
            (pk, i, checksum(label), label),
        )
    assert transitions.enqueue_for_docs(conn, [pk], 5) == len(labels)
    return {
        label: conn.execute(
            "SELECT job_id FROM app.job_keys WHERE chunk_checksum = %s AND model_id = %s", (checksum(label), MODEL)
        ).fetchone()[0]
        for label in labels
    }


def counts(conn) -> tuple[int, int]:
    return conn.execute(
        "SELECT (SELECT count(*) FROM app.embedding_jobs), (SELECT count(*) FROM app.job_keys)"
    ).fetchone()


def test_enqueue_writes_both_rows_in_one_statement(clean_db):
    jobs = seed(clean_db, ["a", "b"])
    assert counts(clean_db) == (2, 2)
    assert (
        clean_db.execute(
            "SELECT count(*) FROM app.job_keys k JOIN app.embedding_jobs j USING (job_id)"
            " WHERE (k.chunk_checksum, k.model_id) = (j.chunk_checksum, j.model_id)"
        ).fetchone()[0]
        == 2
    )
    assert sorted(jobs.values()) == [r[0] for r in clean_db.execute("SELECT job_id FROM app.embedding_jobs ORDER BY 1")]


def test_deleting_a_job_without_its_key_is_refused_at_commit(clean_db):
    conn = clean_db
    jobs = seed(conn, ["a", "b"])
    with pytest.raises(psycopg.errors.ForeignKeyViolation), conn.transaction():
        assert conn.execute("DELETE FROM app.embedding_jobs WHERE job_id = %s", (jobs["a"],)).rowcount == 1
        # deferred: the statement itself went through; the commit is what is refused
    assert counts(conn) == (2, 2)
    with pytest.raises(psycopg.errors.ForeignKeyViolation):  # autocommit: its own transaction
        conn.execute("DELETE FROM app.embedding_jobs WHERE job_id = %s", (jobs["a"],))
    assert counts(conn) == (2, 2)


def test_deleting_a_key_without_its_job_is_refused_at_commit(clean_db):
    conn = clean_db
    jobs = seed(conn, ["a"])
    with pytest.raises(psycopg.errors.ForeignKeyViolation), conn.transaction():
        conn.execute("DELETE FROM app.job_keys WHERE job_id = %s", (jobs["a"],))
    assert counts(conn) == (1, 1)


def test_deleting_both_in_one_transaction_is_allowed_and_enqueue_recreates_them(clean_db):
    conn = clean_db
    jobs = seed(conn, ["a", "b"])
    with conn.transaction():
        conn.execute("DELETE FROM app.embedding_jobs WHERE job_id = %s", (jobs["a"],))
        conn.execute("DELETE FROM app.job_keys WHERE job_id = %s", (jobs["a"],))
    assert counts(conn) == (1, 1)
    assert transitions.drop_orphan_keys(conn) == 0  # nothing left for reconcile's clean-up to do
    assert transitions.enqueue_missing(conn, 5) == 1
    assert counts(conn) == (2, 2)


def test_a_job_or_key_inserted_alone_is_refused(clean_db):
    conn = clean_db
    jobs = seed(conn, ["a"])
    with pytest.raises(psycopg.errors.ForeignKeyViolation):
        conn.execute(
            "INSERT INTO app.embedding_jobs (chunk_checksum, model_id) VALUES (%s, %s)", (checksum("lonely"), MODEL)
        )
    with pytest.raises(psycopg.errors.ForeignKeyViolation):
        conn.execute(
            "INSERT INTO app.job_keys (chunk_checksum, model_id, job_id) VALUES (%s, %s, 987654321)",
            (checksum("lonely"), MODEL),
        )
    # A second key for an existing job (another identity) is refused at once.
    with pytest.raises(psycopg.errors.UniqueViolation):
        conn.execute(
            "INSERT INTO app.job_keys (chunk_checksum, model_id, job_id) VALUES (%s, %s, %s)",
            (checksum("other"), MODEL, jobs["a"]),
        )
    assert counts(conn) == (1, 1)


# --------------------------------------------------------------------------- the migration repairs old data


@pytest.fixture
def scratch_url(server_url):
    name = "t_links_mig_" + uuid.uuid4().hex[:8]
    with psycopg.connect(server_url, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    yield psycopg.conninfo.make_conninfo(server_url, dbname=name)
    with psycopg.connect(server_url, autocommit=True) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def test_migration_009_repairs_what_the_old_schema_allowed(scratch_url, tmp_path):
    """Migrated up to 008, the data the old schema allowed (an orphan key, a job without
    a key, a duplicate job, embed stage rows keyed without the model) is repaired by 009."""
    old = tmp_path / "old"
    old.mkdir()
    for path in migrations.migration_files():
        if path.name < "009":
            shutil.copy(path, old / path.name)
    with psycopg.connect(scratch_url, autocommit=True) as conn:
        migrations.migrate(conn, old)
        conn.execute(
            """INSERT INTO app.models (model_id, provider, name, dimension, max_input_tokens)
                        VALUES (%s, 'test', 'links', 4, 8191)""",
            (MODEL,),
        )
        src = conn.execute("INSERT INTO app.sources (root) VALUES ('/m') RETURNING source_id").fetchone()[0]
        pk = conn.execute(
            """INSERT INTO app.documents (source_id, document_id, source_uri, status)
                             VALUES (%s, 'd', 'file:///d', 'current') RETURNING doc_pk""",
            (src,),
        ).fetchone()[0]
        for cs in (checksum("keyed"), checksum("keyless"), checksum("dup")):
            conn.execute("INSERT INTO app.embedding_jobs (chunk_checksum, model_id) VALUES (%s, %s)", (cs, MODEL))
        # keyed: a proper key; keyless: none; dup: a second job for the content of 'keyed'.
        conn.execute(
            """INSERT INTO app.job_keys (chunk_checksum, model_id, job_id)
                        SELECT chunk_checksum, model_id, job_id FROM app.embedding_jobs WHERE chunk_checksum = %s""",
            (checksum("keyed"),),
        )
        conn.execute(
            "UPDATE app.embedding_jobs SET chunk_checksum = %s WHERE chunk_checksum = %s",
            (checksum("keyed"), checksum("dup")),
        )
        conn.execute(
            "INSERT INTO app.job_keys (chunk_checksum, model_id, job_id) VALUES (%s, %s, 424242)",
            (checksum("orphan"), MODEL),
        )
        conn.execute(
            """INSERT INTO app.stage_runs (doc_pk, stage, status, code_version)
                        VALUES (%s, 'extract', 'succeeded', 'extract-1'), (%s, 'embed', 'failed', %s)""",
            (pk, pk, MODEL),
        )

        assert migrations.migrate(conn) == [p.name for p in migrations.migration_files() if p.name >= "009"]
        jobs = conn.execute("""SELECT encode(k.chunk_checksum, 'hex'), j.job_id = k.job_id
                               FROM app.embedding_jobs j JOIN app.job_keys k USING (job_id) ORDER BY 1""").fetchall()
        assert sorted(jobs) == sorted([(checksum("keyed").hex(), True), (checksum("keyless").hex(), True)])
        assert counts(conn) == (2, 2)
        assert conn.execute("SELECT stage, model_id FROM app.stage_runs ORDER BY stage").fetchall() == [
            ("embed", MODEL),
            ("extract", ""),
        ]
        # The new key: a second embed row for another model is a row of its own.
        conn.execute(
            """INSERT INTO app.stage_runs (doc_pk, stage, model_id, status, code_version)
                        VALUES (%s, 'embed', 'other/model@4', 'pending', 'other/model@4')""",
            (pk,),
        )
        with pytest.raises(psycopg.errors.CheckViolation):
            conn.execute(
                """INSERT INTO app.stage_runs (doc_pk, stage, model_id, status)
                            VALUES (%s, 'chunk', 'other/model@4', 'succeeded')""",
                (pk,),
            )
        with pytest.raises(psycopg.errors.CheckViolation):
            conn.execute("INSERT INTO app.stage_runs (doc_pk, stage, status) VALUES (%s, 'embed', 'pending')", (pk,))


def test_no_code_deletes_a_model_row():
    """A vector's model is guaranteed through its job (app.embeddings.model_id has no foreign key of
    its own): that holds only while nothing deletes from app.models. Retire and
    purge keep the row; this pins it for every statement the package can run."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    pattern = re.compile(r"DELETE\s+FROM\s+(ONLY\s+)?app\.models\b|TRUNCATE\b[^;]*\bapp\.models\b", re.I)
    sources = [*root.joinpath("sql").rglob("*.sql"), *root.joinpath("pipeline_assets").rglob("*.py")]
    offenders = [str(p.relative_to(root)) for p in sources if pattern.search(p.read_text(errors="replace"))]
    assert offenders == []
