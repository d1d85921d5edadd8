"""Search modes: hybrid (full-text and vector rankings fused by
reciprocal rank fusion, the default), vector, text; current chunks only; a
model whose vectors are incomplete; no vector index; and the offline embedder
v2 (stop words, sublinear weights, bigrams, signed hashing, its own model id).
"""

from __future__ import annotations

import json
import os
import shutil
import uuid

import numpy as np
import psycopg
import pytest

from pipeline_assets.app import search as search_uc
from pipeline_assets.app.runtime import Runtime
from pipeline_assets.providers import provider_for
from pipeline_assets.providers.local import LocalHashingProvider, terms
from pipeline_assets.registry import vector_index
from pipeline_assets.settings import Settings
from pipeline_assets.store import db, queries, retrieval
from pipeline_assets_tests.processes import cli

MODEL_ID = "local/hashing-words-v2@512"

DOCS = {
    "kettle.md": "# Descaling a kettle\n\nLimescale builds up in a kettle in hard water areas. Boil vinegar "
    "and water, let it stand for an hour, rinse twice.\n",
    "orchard.md": "# Pruning apple trees\n\nPrune apple trees in late winter while they are dormant. Remove "
    "crossing branches and keep the centre open to light and air.\n",
    "tides.md": "# Reading a tide table\n\nHigh and low water times shift by about fifty minutes a day; "
    "spring tides follow the full and the new moon.\n",
}


@pytest.fixture
def offline(database_url, clean_db, tmp_path) -> dict:
    """The quick start's configuration (no key: the offline model) on this module's database."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIPELINE_", "OPENAI_"))}
    env.update(PIPELINE_DATABASE_URL=database_url, PIPELINE_HOME=str(tmp_path / "home"))
    return env


def write(root, docs: dict[str, str]) -> None:
    root.mkdir(parents=True, exist_ok=True)
    for name, text in docs.items():
        (root / name).write_text(text)


def search(env: dict, query: str, *args: str) -> list[dict]:
    return json.loads(cli("search", query, "--json", *args, env=env).stdout)


def test_modes_rank_by_their_own_score_and_report_every_score(offline, tmp_path):
    corpus = tmp_path / "c"
    write(corpus, DOCS)
    cli("embed", str(corpus), env=offline)
    for mode in ("hybrid", "vector", "text"):
        hits = search(offline, "when should I prune my apple trees?", "-k", "3", "--mode", mode)
        assert hits[0]["document_id"] == "orchard.md", mode
        assert {"document_id", "chunk_index", "text", "distance", "text_rank", "score"} <= set(hits[0]), mode
        assert [h["score"] for h in hits] == sorted((h["score"] for h in hits), reverse=True), mode
    vector = search(offline, "when should I prune my apple trees?", "--mode", "vector")
    assert len(vector) == 3 and [h["distance"] for h in vector] == sorted(h["distance"] for h in vector)
    assert all(h["text_rank"] is None for h in vector)
    text = search(offline, "when should I prune my apple trees?", "--mode", "text")
    assert [h["document_id"] for h in text] == ["orchard.md"]  # the only chunk with a query word
    assert text[0]["distance"] is None and text[0]["text_rank"] > 0
    hybrid = search(offline, "when should I prune my apple trees?")  # the default mode
    assert hybrid[0]["distance"] == pytest.approx(vector[0]["distance"], abs=1e-6)
    assert hybrid[0]["text_rank"] == pytest.approx(text[0]["text_rank"])
    # Fused: in both lists at rank 1; the others only in the vector list.
    assert hybrid[0]["score"] == pytest.approx(2 / (search_uc.RRF_K + 1))
    assert {h["document_id"] for h in hybrid} == set(DOCS)
    # A query of stop words only, or of operator characters, is no error and matches no text.
    assert search(offline, "how can it be that the", "--mode", "text") == []
    assert search(offline, "'\":&|!<-> (", "--mode", "text") == []


def test_hybrid_finds_chunks_without_vectors_and_only_current_chunks(offline, tmp_path):
    """A model whose vectors are incomplete (new documents not embedded yet) still answers:
    their chunks are found by text, with no distance; edited and deleted text is never returned."""
    corpus = tmp_path / "c"
    write(corpus, {"kettle.md": DOCS["kettle.md"]})
    cli("embed", str(corpus), env=offline)
    write(corpus, {"tides.md": DOCS["tides.md"]})
    cli("ingest", str(corpus), env=offline)  # no provider calls: tides.md has no vector
    hits = {h["document_id"]: h for h in search(offline, "spring tide times", "-k", "2")}
    assert hits["tides.md"]["distance"] is None and hits["tides.md"]["text_rank"] > 0  # found by its text
    assert hits["kettle.md"]["distance"] is not None and hits["kettle.md"]["text_rank"] is None
    assert [h["document_id"] for h in search(offline, "spring tide times", "--mode", "vector")] == ["kettle.md"]

    # Edit kettle.md, delete tides.md: their old text is gone from every mode at once.
    (corpus / "kettle.md").write_text("# Cleaning a coffee grinder\n\nGrind a handful of rice, then brush it out.\n")
    (corpus / "tides.md").unlink()
    cli("ingest", str(corpus), env=offline)
    for mode in ("hybrid", "text", "vector"):
        hits = search(offline, "limescale vinegar kettle tide moon", "--mode", mode)
        assert all("limescale" not in h["text"].lower() and "tide" not in h["text"].lower() for h in hits), mode
    assert search(offline, "limescale vinegar kettle tide moon", "--mode", "text") == []


def test_hybrid_search_without_a_vector_index_is_an_exact_scan(offline, tmp_path, clean_db):
    corpus = tmp_path / "c"
    write(corpus, DOCS)
    cli("embed", str(corpus), env=offline)
    dim = 512
    clean_db.execute("SELECT '[1]'::vector")  # pgvector loaded in this session: its GUC ranges apply
    q = LocalHashingProvider().embed(["kettle"]).vectors[0]
    assert len(search_uc.hybrid_search(clean_db, MODEL_ID, "kettle", q, 300)) == 3  # ef_search capped at 1000
    if vector_index.state(clean_db, MODEL_ID, dim) != vector_index.MISSING:
        clean_db.execute(f'DROP INDEX app."{vector_index.index_name(MODEL_ID)}"')
    assert vector_index.state(clean_db, MODEL_ID, dim) == vector_index.MISSING
    provider = LocalHashingProvider()
    query = "hard water in the kettle"
    q = provider.embed([query]).vectors[0]
    hits = search_uc.hybrid_search(clean_db, MODEL_ID, query, q, 3)
    assert hits[0]["document_id"] == "kettle.md"
    for hit in hits:  # the exact cosine distance of each hit's own vector
        v = provider.embed([hit["text"]]).vectors[0]
        assert hit["distance"] == pytest.approx(1 - float(q @ v), abs=1e-5)


def test_text_mode_calls_no_provider(database_url, clean_db, tmp_path):
    class Refusing:
        spec = LocalHashingProvider().spec

        def embed(self, texts):
            raise AssertionError("text search embedded the query")

    settings = Settings.from_env({"PIPELINE_DATABASE_URL": database_url})
    rt = Runtime.build(settings)
    rt.provider = Refusing()
    with db.make_pool(database_url) as pool:
        assert search_uc.search(rt, pool, "anything at all", 3, "text") == []
        with pytest.raises(ValueError, match="unknown search mode"):
            search_uc.search(rt, pool, "anything", 3, "fuzzy")


def test_text_search_reads_the_gin_index(offline, tmp_path, clean_db):
    """Document frequencies and candidate chunks come from the GIN index on chunks.text_search
    (the planner would pick a sequential scan on a table this small, so it is discouraged)."""
    corpus = tmp_path / "c"
    write(corpus, DOCS)
    cli("ingest", str(corpus), env=offline)
    with clean_db.transaction():
        clean_db.execute("SET LOCAL enable_seqscan = off")
        plan = "\n".join(
            r[0]
            for r in clean_db.execute(
                "EXPLAIN " + retrieval.RETRIEVAL.text_ranked,
                {"words": "apple trees", "limit": 3, "k1": 1.2, "b": 0.75, "common_ratio": 0.1, "common_floor": 1},
            )
        )
    assert "chunks_text_search" in plan and "Seq Scan on chunks" not in plan, plan


def test_migration_010_indexes_chunks_written_before_it(server_url, tmp_path):
    """An existing database (migrated up to 009, with chunks) gets every chunk's tsvector on upgrade."""
    before = tmp_path / "sql"
    before.mkdir()
    for path in sorted(queries.sql_dir().glob("[0-9][0-9][0-9]_*.sql")):
        if path.name < "010":
            shutil.copy(path, before / path.name)
    name = "t_search_upgrade_" + uuid.uuid4().hex[:8]
    with psycopg.connect(server_url, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    try:
        with db.connect(psycopg.conninfo.make_conninfo(server_url, dbname=name)) as conn:
            db.migrate(conn, before)
            source = conn.execute("INSERT INTO app.sources (root) VALUES ('/old') RETURNING source_id").fetchone()[0]
            doc = conn.execute(
                "INSERT INTO app.documents (source_id, document_id, source_uri, status)"
                " VALUES (%s, 'old.md', 'file:///old.md', 'current') RETURNING doc_pk",
                (source,),
            ).fetchone()[0]
            conn.execute(
                "INSERT INTO app.chunks (doc_pk, chunk_index, chunk_checksum, text, token_count,"
                " char_start, char_end) VALUES (%s, 0, '\\x01', 'Pruning apple trees in winter', 5, 0, 29)",
                (doc,),
            )
            assert "010_chunk_text_search.sql" in db.migrate(conn)
            hits = search_uc.text_search(conn, "when do I prune an apple tree?", 3)
            assert [(h["document_id"], h["chunk_index"]) for h in hits] == [("old.md", 0)]
    finally:
        with psycopg.connect(server_url, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


# -- the offline embedder ---------------------------------------------------------------------------


def test_offline_embedder_v2_has_its_own_model_id():
    # never mixed with v1's vectors
    assert provider_for(Settings.from_env({}).provider_config()).spec.model_id == MODEL_ID


def test_offline_embedder_drops_stop_words_and_joins_inflections():
    assert terms("How do I retry without the herd?") == ["retri", "without", "herd"]
    assert terms("retries retrying retried") == ["retri"] * 3
    p = LocalHashingProvider()
    a, b, c, stop = p.embed(
        ["retrying failed requests", "retries of a failed request", "baking bread with a starter", "the of and to"]
    ).vectors
    assert float(a @ b) > 0.6 > 0.1 > abs(float(a @ c))
    assert np.isclose(np.linalg.norm(stop), 1.0)  # stop words only: a fixed unit vector, no NaN
    assert (a < 0).any() and (a > 0).any()  # signed hashing


def test_offline_embedder_is_deterministic_and_sublinear():
    p = LocalHashingProvider()
    once, again = p.embed(["jitter spreads retries"]).vectors[0], p.embed(["jitter spreads retries"]).vectors[0]
    assert np.array_equal(once, again)
    # Twenty repetitions of a word weigh 1 + ln 20 (about 4), not 20, against one other word.
    flood = p.embed(["jitter " * 20 + "bread"]).vectors[0]
    bread = p.embed(["bread"]).vectors[0]
    assert float(flood @ bread) > 0.1
