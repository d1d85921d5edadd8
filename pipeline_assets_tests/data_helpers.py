"""What tests write and check in the database: corpora, the oracles of the per-bucket reads (a
bucket's documents, its state from their summaries), the jobs by status, and vectors checked
against the fake server's."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from pipeline_assets.app.buckets import bucket_of
from pipeline_assets.providers import ModelSpec
from pipeline_assets.registry import models
from pipeline_assets.store import bucket_rows, reports
from pipeline_assets_tests.conftest import FAKE_MODEL


def write_corpus(root: Path, n: int, *, prefix: str = "doc", words: int = 60) -> list[Path]:
    """n small distinct markdown documents."""
    root.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(n):
        p = root / f"{prefix}{i:04d}.md"
        body = " ".join(f"w{(i * 7 + j) % 997}" for j in range(words))
        p.write_text(f"# {prefix} {i}\n\n{body}\n")
        paths.append(p)
    return paths


def one_chunk_documents(conn, root: str, n: int) -> str:
    """``n`` current documents of a new source ``root``, one chunk each, inserted in SQL, and the model
    ``test/m@8`` registered (its id returned): a large store without extracting anything."""
    (source,) = conn.execute("INSERT INTO app.sources (root) VALUES (%s) RETURNING source_id", (root,)).fetchone()
    conn.execute(
        "INSERT INTO app.documents (source_id, document_id, source_uri, status, chunk_count) "
        "SELECT %s, 'd' || g, 'u' || g, 'current', 1 FROM generate_series(1, %s) g",
        (source, n),
    )
    conn.execute(
        "INSERT INTO app.chunks (doc_pk, chunk_index, chunk_checksum, text, token_count, char_start, char_end) "
        "SELECT doc_pk, 0, sha256(document_id::bytea), document_id, 1, 0, 1 FROM app.documents"
    )
    spec = ModelSpec("test", "m", 8, 8191, 64, 10_000)
    models.ensure_model(conn, spec)
    return spec.model_id


BUCKET_DOCUMENTS = """\
SELECT d.document_id FROM app.documents d JOIN app.sources s ON s.source_id = d.source_id
    WHERE s.root = %(root)s AND d.status <> 'deleted'
      AND (d.bucket = ANY(%(buckets)s::int[])
           OR d.bucket IS NULL AND app.document_bucket(d.document_id, %(n)s) = ANY(%(buckets)s::int[]))
    ORDER BY d.document_id COLLATE "C"
"""


def bucket_documents(conn, root: str, bucket_ids, bucket_count: int) -> list[str]:
    """The source's documents (current or quarantined) in some buckets, by their stored bucket or,
    without one, by the hash: the oracle of the per-bucket reads."""
    return [
        r[0]
        for r in conn.execute(BUCKET_DOCUMENTS, {"root": root, "n": bucket_count, "buckets": sorted(set(bucket_ids))})
    ]


def job_counts(conn) -> dict[str, int]:
    return dict(conn.execute("SELECT status, count(*) FROM app.embedding_jobs GROUP BY status").fetchall())


def assert_vectors_match(conn, fake, model_id: str = f"openai/{FAKE_MODEL}") -> int:
    """Every current chunk has a vector, and it is exactly the fake's vector for the chunk text."""
    import numpy as np

    rows = conn.execute(
        """
        SELECT c.text, e.embedding FROM app.chunks c
        JOIN app.documents d ON d.doc_pk = c.doc_pk AND d.status = 'current'
        LEFT JOIN app.embeddings e ON e.chunk_checksum = c.chunk_checksum AND e.model_id = %s""",
        (model_id,),
    ).fetchall()
    assert rows, "no current chunks"
    for text, vec in rows:
        assert vec is not None, f"no vector for current chunk {text[:40]!r}"
        assert np.allclose(vec.to_numpy(), fake.vector_for(text), atol=1e-6), text[:40]
    return len(rows)


def bucket_states(
    summaries: dict[str, reports.DocumentSummary], buckets: Sequence[int], n: int
) -> dict[int, bucket_rows.BucketState]:
    """Each bucket's state computed in Python from its documents' summaries (every bucket asked
    for, empty or not): the oracle ``bucket_rows.states_of`` (one grouped query) must agree with."""
    members: dict[int, list[reports.DocumentSummary]] = {b: [] for b in buckets}
    for doc in sorted(summaries):
        s = summaries[doc]
        if s.status != "deleted":
            members.setdefault(bucket_of(doc, n), []).append(s)
    states = {}
    for bucket, docs in members.items():
        quarantined = [s.document_id for s in docs if s.status == "quarantined"]
        states[bucket] = bucket_rows.BucketState(
            documents=len(docs),
            current=sum(s.status == "current" for s in docs),
            quarantined=len(quarantined),
            chunks=sum(s.chunks for s in docs),
            tokens=sum(s.tokens for s in docs),
            text_digest=bucket_rows.digest(
                f"{s.document_id}={s.text_checksum or f'{s.status}:{s.error_class}'}" for s in docs
            ),
            chunks_digest=bucket_rows.digest(f"{s.document_id}={s.chunks_digest}" for s in docs),
            quarantined_ids=quarantined[: bucket_rows.SAMPLE_IDS],
        )
    return states
