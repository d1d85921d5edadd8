"""The source sensor's run after an edit costs what the edit holds, not what its buckets hold: its
sync and its embeddings go by the edited documents (found from the tick's observations), the
buckets' coverage is read once for its cells, and only other outstanding chunks of the buckets make
it wait for them whole."""

from __future__ import annotations

import psycopg

from pipeline_assets.defs.ingest import sync_and_embed
from pipeline_assets.defs.partitions import bucket_key
from pipeline_assets.store import queries
from pipeline_assets_tests.dagster import test_dagster_sync_and_embed as sync_and_embed_tests
from pipeline_assets_tests.dagster.test_dagster_sync_and_embed import (
    DOCS,
    MODEL_ID,
    _bucket,
    _edited_far_apart,
    _run_tags,
)
from pipeline_assets_tests.dagster_helpers import fresh_defs, served

corpus = sync_and_embed_tests.corpus  # the fixture: the same corpus of DOCS documents


def _with_neighbours(corpus, per_bucket: int = 3) -> list[str]:
    """Files beside the two documents ``_edited_far_apart`` edits, in their buckets: what the run
    after the edit must leave alone (written before the first tick, so the first run embeds them)."""
    docs = sorted((f"doc{i:04d}.md" for i in range(DOCS)), key=_bucket)
    wanted = {_bucket(docs[0]): per_bucket, _bucket(docs[-1]): per_bucket}
    out = []
    for i in range(100_000):
        name = f"near{i}.md"
        if wanted.get(_bucket(name), 0) > 0:
            wanted[_bucket(name)] -= 1
            (corpus / name).write_text(f"# {name}\n\nunchanged beside an edited document\n")
            out.append(name)
        if not any(wanted.values()):
            return out
    raise AssertionError("no names found for the buckets")


def _statements(monkeypatch) -> list[tuple[str | None, dict]]:
    """Every statement this process sends through psycopg: its name in sql/queries (None: a template
    or another's), with its parameters."""
    named = {}
    for path in (queries.sql_dir() / "queries").glob("*.sql"):
        family = queries.load(path.stem)
        named.update({getattr(family, n): f"{path.stem}.{n}" for n in family.names()})
    sent: list[tuple[str | None, dict]] = []
    real = psycopg.Cursor.execute

    def spying(self, query, params=None, **kwargs):
        text = query if isinstance(query, str) else None
        sent.append((named.get(text) if text else None, dict(params) if isinstance(params, dict) else {}))
        return real(self, query, params, **kwargs)

    monkeypatch.setattr(psycopg.Cursor, "execute", spying)
    return sent


def _pks(conn, ids: list[str]) -> set[int]:
    return {r[0] for r in conn.execute("SELECT doc_pk FROM app.documents WHERE document_id = ANY(%s)", (ids,))}


def test_the_run_after_an_edit_reads_the_edited_documents_not_their_buckets(corpus, conn, fake, instance, monkeypatch):
    """The sync and the embeddings of the run after an edit go by the edited documents: no statement
    lists the buckets' documents or their stale ones (no version changed), every document key it
    sends is an edited one, and the buckets' coverage and states are read once each; its cells still count the whole
    bucket, the unchanged neighbours' vectors included."""
    neighbours = _with_neighbours(corpus)
    defs = fresh_defs()
    tick, edited, _, _ = _edited_far_apart(defs, instance, corpus)
    (request,) = tick.run_requests
    billed = fake.stats["billed_inputs"]
    sent = _statements(monkeypatch)
    result = defs.resolve_job_def(request.job_name).execute_in_process(
        instance=instance, partition_key=request.partition_key, tags=_run_tags(request), raise_on_error=False
    )
    monkeypatch.undo()
    assert result.success
    assert fake.stats["billed_inputs"] == billed + 2
    for doc in edited:
        assert "to be served by one run" in served(conn, doc, MODEL_ID)[0]
    ran = [name for name, _ in sent]
    assert "buckets.bucket_current_pks" not in ran and "stage_runs.rerun_targets" not in ran, ran
    assert ran.count("buckets.bucket_coverage") == 1, ran
    assert ran.count("buckets.bucket_states") == 1, ran  # the sync's, passed on to the embedding step
    # A key parameter is a list, or an Int8Array (one binary bigint[]) holding one.
    keys = [set(getattr(params["docs"], "values", params["docs"])) for _, params in sent if "docs" in params]
    assert keys and all(k <= _pks(conn, edited) for k in keys), (keys, _pks(conn, edited))
    # The cells: the whole bucket's chunks, all ready (the neighbours' from the first run).
    cells = {
        m.partition.split("|")[0]: {k: m.metadata[k].value for k in ("chunks", "ready", "waiting")}
        for m in result.asset_materializations_for_node(sync_and_embed.EMBED_OP)
    }
    for doc in edited:
        members = [d for d in [*neighbours, *(f"doc{i:04d}.md" for i in range(DOCS))] if _bucket(d) == _bucket(doc)]
        chunks = sum(served(conn, d, MODEL_ID)[1] for d in members)
        assert cells[bucket_key(_bucket(doc))] == {"chunks": chunks, "ready": chunks, "waiting": 0}


def test_other_outstanding_chunks_of_the_buckets_are_waited_for_too(corpus, conn, fake, instance):
    """A neighbour's vector missing (an earlier run's failure, another run's work): the run after the
    edit does not report its bucket embedded without it: it waits for the bucket whole, and embeds it."""
    neighbours = _with_neighbours(corpus, per_bucket=1)
    defs = fresh_defs()
    tick, _, _, _ = _edited_far_apart(defs, instance, corpus)
    (request,) = tick.run_requests
    lost = neighbours[0]
    conn.execute(
        "DELETE FROM app.embeddings e USING app.chunks c, app.documents d WHERE e.chunk_checksum = c.chunk_checksum "
        "AND c.doc_pk = d.doc_pk AND d.document_id = %s",
        (lost,),
    )
    conn.execute(
        "UPDATE app.embedding_jobs j SET status = 'pending' FROM app.chunks c, app.documents d "
        "WHERE j.chunk_checksum = c.chunk_checksum AND c.doc_pk = d.doc_pk AND d.document_id = %s",
        (lost,),
    )
    billed = fake.stats["billed_inputs"]
    result = defs.resolve_job_def(request.job_name).execute_in_process(
        instance=instance, partition_key=request.partition_key, tags=_run_tags(request), raise_on_error=False
    )
    assert result.success
    _, chunks, vectors = served(conn, lost, MODEL_ID)
    assert chunks == vectors > 0 and fake.stats["billed_inputs"] == billed + 2 + chunks
    cell = next(
        m
        for m in result.asset_materializations_for_node(sync_and_embed.EMBED_OP)
        if m.partition.startswith(bucket_key(_bucket(lost)))
    )
    assert cell.metadata["waiting"].value == 0 and cell.metadata["ready"].value == cell.metadata["chunks"].value
