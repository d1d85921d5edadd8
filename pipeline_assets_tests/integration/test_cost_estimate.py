"""The cost estimate before spending: `models add --dry-run`, `rerun --stage embed --dry-run` and
the Dagster embeddings run's preflight, each against what the ledger then records as billed.

The fake OpenAI server counts usage in cl100k here (``usage="cl100k"``), as OpenAI bills its own
models, and the models are OpenAI's (text-embedding-3-small / -large, 16 dimensions asked for), so
the estimate and the bill are counted the same way: they must agree exactly. A dry run writes no
model, no job and no ledger row.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import dagster as dg
import pytest

from pipeline_assets.app import estimate
from pipeline_assets.content.chunking import count_tokens
from pipeline_assets.defs.partitions import bucket_key
from pipeline_assets.providers import ModelSpec
from pipeline_assets.providers.pricing import OPENAI_PRICES_PER_MILLION, price_per_million
from pipeline_assets.settings import Settings
from pipeline_assets.store import db
from pipeline_assets_tests.conftest import FAKE_DIM
from pipeline_assets_tests.dagster_helpers import execute, fresh_defs, materialization_metadata, range_tags
from pipeline_assets_tests.data_helpers import job_counts, write_corpus
from pipeline_assets_tests.fake_openai import FakeOpenAI
from pipeline_assets_tests.processes import cli

SMALL, LARGE = "text-embedding-3-small", "text-embedding-3-large"
SMALL_ID, LARGE_ID = f"openai/{SMALL}@{FAKE_DIM}", f"openai/{LARGE}@{FAKE_DIM}"
POISON = "POISONWORD"
# The estimate against the bill: within 2% (the requirement); counted alike, they are equal.
TOLERANCE = 0.02


@pytest.fixture
def fake():
    with FakeOpenAI(dim=FAKE_DIM, usage="cl100k") as srv:
        yield srv


@pytest.fixture
def env_small(env, monkeypatch):
    values = {"PIPELINE_EMBEDDING_MODEL": SMALL, "PIPELINE_EMBEDDING_DIMENSIONS": str(FAKE_DIM)}
    for key, value in values.items():
        monkeypatch.setenv(key, value)
    return {**env, **values}


def _corpus(root: Path) -> Path:
    """Small distinct documents, one copied under another name (identical chunk text: one input),
    and one long document whose last chunk alone carries ``POISON``."""
    paths = write_corpus(root, 10)
    (root / "copy.md").write_text(paths[0].read_text())
    long_words = " ".join(f"w{j % 991}x{j}" for j in range(1400))
    (root / "long.md").write_text(f"# long\n\n{long_words} {POISON} end\n")
    return root


def _billed(conn, model_id: str, after_call: int = 0) -> tuple[int, int]:
    """Inputs and tokens the ledger records as billed (or possibly billed) for the model."""
    inputs, tokens = conn.execute(
        "SELECT coalesce(sum(inputs), 0), coalesce(sum(tokens), 0) FROM app.provider_calls "
        "WHERE model_id = %s AND billed <> 'no' AND call_id > %s",
        (model_id, after_call),
    ).fetchone()
    return int(inputs), int(tokens)


def _last_call(conn) -> int:
    return conn.execute("SELECT coalesce(max(call_id), 0) FROM app.provider_calls").fetchone()[0]


def _state(conn) -> tuple:
    """What a dry run must leave alone: models, jobs by status, ledger rows, vectors."""
    return (
        conn.execute("SELECT array_agg(model_id ORDER BY model_id) FROM app.models").fetchone()[0],
        job_counts(conn),
        _last_call(conn),
        conn.execute("SELECT count(*) FROM app.embeddings").fetchone()[0],
    )


def _close(estimated: int, billed: int) -> bool:
    return abs(estimated - billed) <= TOLERANCE * max(billed, 1)


def test_prices_built_in_for_openai_a_setting_otherwise_and_local_models_free():
    def spec(provider: str, name: str) -> ModelSpec:
        return ModelSpec(
            provider=provider, name=name, dimension=16, max_input_tokens=8191, max_batch_inputs=8, max_batch_tokens=8191
        )

    assert price_per_million(spec("openai", SMALL), None) == 0.02
    assert price_per_million(spec("openai", LARGE), 9.0) == 0.13
    assert price_per_million(spec("openai", "text-embedding-ada-002"), None) == 0.10
    assert price_per_million(spec("openai", "bge-m3"), None) is None
    assert price_per_million(spec("openai", "bge-m3"), 0.5) == 0.5
    assert price_per_million(spec("local", "local-hashing"), 3.0) == 0.0
    assert price_per_million(spec("onnx", "local-onnx"), None) == 0.0
    assert set(OPENAI_PRICES_PER_MILLION) == {SMALL, LARGE, "text-embedding-ada-002"}


def test_models_add_dry_run_estimates_what_the_new_model_is_billed(env_small, fake, clean_db, tmp_path):
    conn = clean_db
    root = _corpus(tmp_path / "corpus")
    cli("embed", str(root), env=env_small)
    assert job_counts(conn) == {
        "ready": conn.execute("SELECT count(DISTINCT chunk_checksum) FROM app.chunks").fetchone()[0]
    }
    before = _state(conn)

    dry = json.loads(
        cli("models", "add", LARGE, "--dimensions", str(FAKE_DIM), "--dry-run", "--json", env=env_small).stdout
    )
    assert _state(conn) == before, "a dry run wrote something"
    text = cli("models", "add", LARGE, "--dimensions", str(FAKE_DIM), "--dry-run", env=env_small).stdout
    assert _state(conn) == before
    print(text)
    chunks, distinct, tokens = conn.execute(
        "SELECT count(*), count(DISTINCT chunk_checksum), "
        "(SELECT sum(t) FROM (SELECT min(token_count) AS t FROM app.chunks GROUP BY chunk_checksum) d) "
        "FROM app.chunks"
    ).fetchone()
    assert dry["dry_run"] and dry["model_id"] == LARGE_ID
    assert dry["chunks"] == chunks == distinct + 1  # the copy is one input
    assert dry["send_inputs"] == distinct and dry["embedded"] == 0 and dry["send_tokens"] == tokens
    assert dry["tokens_exact"] and dry["price_per_million"] == 0.13
    assert dry["cost_usd"] == pytest.approx(tokens * 0.13 / 1e6)
    assert text.strip().startswith(f"estimate for {LARGE_ID}: would send {distinct} input(s), {tokens} token(s), $")

    cli("models", "add", LARGE, "--dimensions", str(FAKE_DIM), env=env_small)
    large_env = {**env_small, "PIPELINE_EMBEDDING_MODEL": LARGE}
    cli("work", "--until-idle", env=large_env)
    billed_inputs, billed_tokens = _billed(conn, LARGE_ID)
    print(
        f"models add: estimated {dry['send_inputs']} inputs / {dry['send_tokens']} tokens; "
        f"billed {billed_inputs} / {billed_tokens}"
    )
    assert _close(dry["send_inputs"], billed_inputs) and _close(dry["send_tokens"], billed_tokens)
    assert (dry["send_inputs"], dry["send_tokens"]) == (billed_inputs, billed_tokens)  # counted alike: exact

    # Now every input has its vector: adding it again would send nothing.
    again = json.loads(
        cli("models", "add", LARGE, "--dimensions", str(FAKE_DIM), "--dry-run", "--json", env=env_small).stdout
    )
    assert again["send_inputs"] == 0 and again["send_tokens"] == 0 and again["cost_usd"] == 0
    assert again["embedded"] == distinct


def test_rerun_embed_dry_run_estimates_what_the_requeued_selection_is_billed(env_small, fake, clean_db, tmp_path):
    conn = clean_db
    root = _corpus(tmp_path / "corpus")
    fake.poison_marker = POISON
    cli("embed", str(root), env=env_small)
    assert job_counts(conn)["failed"] == 1
    fake.poison_marker = None
    before = _state(conn)
    poisoned = conn.execute(
        "SELECT c.text, c.token_count FROM app.chunks c WHERE position(%s in c.text) > 0", (POISON,)
    ).fetchall()
    assert len(poisoned) == 1
    long_chunks = conn.execute(
        "SELECT count(*) FROM app.chunks c JOIN app.documents d USING (doc_pk) WHERE d.document_id = 'long.md'"
    ).fetchone()[0]
    assert long_chunks >= 2

    selection = ("rerun", "--stage", "embed", "--document", "long.md", "--document", "doc000*", "--document", "copy.md")
    dry = json.loads(cli(*selection, "--dry-run", "--json", env=env_small).stdout)
    text = cli(*selection, "--dry-run", env=env_small).stdout
    print(text)
    assert _state(conn) == before, "a dry run wrote something"
    est = dry["estimate"]
    assert dry["count"] == 12 and {d["document_id"] for d in dry["documents"]} >= {"long.md", "copy.md"}
    assert est["model_id"] == SMALL_ID and est["failed"] == 1
    assert est["send_inputs"] == 1 and est["send_tokens"] == poisoned[0][1] == count_tokens(poisoned[0][0])
    # Every other chunk of the selection (the long document's first ones, the copy) is reused.
    assert est["embedded"] == est["inputs"] - 1 and est["chunks"] == est["inputs"] + 1
    assert est["price_per_million"] == 0.02
    assert "12 document(s) would be rerun" in text and f"would send 1 input(s), {poisoned[0][1]} token(s)" in text
    assert text.rstrip().endswith("23 already embedded (reused), 1 dead-lettered (requeued)")

    chunk_stage = cli("rerun", "--stage", "chunk", "--document", "long.md", "--dry-run", env=env_small).stdout
    assert chunk_stage.splitlines()[-1].startswith("estimate: none before re-chunking")
    refused = cli(*selection, "--json", env=env_small, check=False)
    assert refused.returncode == 1 and refused.stderr.startswith("error: --json goes with --dry-run")
    assert _state(conn) == before

    last = _last_call(conn)
    cli(*selection, env=env_small)
    cli("work", "--until-idle", env=env_small)
    billed_inputs, billed_tokens = _billed(conn, SMALL_ID, last)
    print(
        f"rerun: estimated {est['send_inputs']} inputs / {est['send_tokens']} tokens; "
        f"billed {billed_inputs} / {billed_tokens}"
    )
    assert _close(est["send_inputs"], billed_inputs) and _close(est["send_tokens"], billed_tokens)
    assert (est["send_inputs"], est["send_tokens"]) == (billed_inputs, billed_tokens)
    assert job_counts(conn) == {
        "ready": conn.execute("SELECT count(DISTINCT chunk_checksum) FROM app.chunks").fetchone()[0]
    }


def test_dagster_preflight_records_the_estimate_before_the_backfill_spends(
    env_small, fake, clean_db, tmp_path, monkeypatch
):
    conn = clean_db
    root = _corpus(tmp_path / "corpus")
    for path in root.iterdir():
        old = time.time() - 3600  # not "just modified": the scan's prefilter trusts size and mtime
        os.utime(path, (old, old))
    monkeypatch.setenv("PIPELINE_SOURCE_DIR", str(root))
    instance = dg.DagsterInstance.ephemeral()
    keys = [bucket_key(i) for i in range(64)]

    result = execute(fresh_defs(), instance, tags=range_tags(keys))
    assert result.success
    observations = [
        e.event_specific_data.asset_observation for e in result.all_events if e.event_type_value == "ASSET_OBSERVATION"
    ]
    (pre,) = [o for o in observations if o.metadata.get("preflight")]
    meta = {k: v.value for k, v in pre.metadata.items()}
    billed_inputs, billed_tokens = _billed(conn, SMALL_ID)
    distinct = conn.execute("SELECT count(DISTINCT chunk_checksum) FROM app.chunks").fetchone()[0]
    print(
        f"dagster preflight: estimated {meta['send_inputs']} inputs / {meta['send_tokens']} tokens; "
        f"billed {billed_inputs} / {billed_tokens}"
    )
    assert meta["model_id"] == SMALL_ID and meta["buckets"] == 64 and meta["send_inputs"] == distinct
    assert meta["cost_usd"] == pytest.approx(meta["send_tokens"] * 0.02 / 1e6)
    assert _close(meta["send_inputs"], billed_inputs) and _close(meta["send_tokens"], billed_tokens)
    assert (meta["send_inputs"], meta["send_tokens"]) == (billed_inputs, billed_tokens)
    # Recorded before the first provider call of the run.
    (record,) = [
        r
        for r in instance.all_logs(result.results[-1].run_id)
        if r.dagster_event is not None and r.dagster_event.event_type_value == "ASSET_OBSERVATION"
    ]
    first_call = conn.execute("SELECT extract(epoch FROM min(called_at)) FROM app.provider_calls").fetchone()[0]
    assert record.timestamp < float(first_call)
    emb = materialization_metadata(result, "embeddings")
    assert emb["estimated_tokens"] == meta["send_tokens"] == emb["tokens"]

    # Materialized again with nothing changed: the preflight says nothing would be sent, and nothing is.
    last = _last_call(conn)
    again = execute(fresh_defs(), instance, tags=range_tags(keys))
    assert again.success and _last_call(conn) == last
    (pre2,) = [
        e.event_specific_data.asset_observation for e in again.all_events if e.event_type_value == "ASSET_OBSERVATION"
    ]
    assert pre2.metadata["send_inputs"].value == 0 and pre2.metadata["embedded"].value == distinct


def test_a_price_from_the_setting_unknown_without_it_and_the_local_model_free(env, clean_db, tmp_path):
    conn = clean_db
    root = _corpus(tmp_path / "corpus")
    cli("ingest", str(root), env=env)  # no provider call
    tokens = conn.execute(
        "SELECT sum(t) FROM (SELECT min(token_count) AS t FROM app.chunks GROUP BY chunk_checksum) d"
    ).fetchone()[0]
    before = _state(conn)
    unknown = cli("models", "add", "bge-m3", "--dry-run", env=env).stdout
    assert f"{tokens} token(s) (cl100k; the model counts its own)" in unknown
    assert "price unknown (set PIPELINE_PRICE_PER_MILLION_TOKENS)" in unknown
    priced = json.loads(
        cli(
            "models", "add", "bge-m3", "--dry-run", "--json", env={**env, "PIPELINE_PRICE_PER_MILLION_TOKENS": "0.5"}
        ).stdout
    )
    assert priced["send_tokens"] == tokens and not priced["tokens_exact"]
    assert priced["cost_usd"] == pytest.approx(tokens * 0.5 / 1e6)
    free = cli("models", "add", "local-hashing", "--dry-run", env=env).stdout
    assert f"{tokens} token(s), free (local model)" in free
    assert _state(conn) == before


def test_the_estimate_reads_sums_not_texts(env_small, clean_db):
    """An empty corpus: one row of zeros, for each selection."""
    spec = ModelSpec(
        provider="openai", name=SMALL, dimension=16, max_input_tokens=8191, max_batch_inputs=8, max_batch_tokens=8191
    )
    with db.make_pool(db.database_url(Settings.from_env().database_config()), min_size=1, max_size=1) as pool:
        for est in (
            estimate.for_corpus(pool, spec, None),
            estimate.for_documents(pool, spec, None, []),
            estimate.for_buckets(pool, spec, None, Path("/nowhere"), [0, 1], 64),
        ):
            assert (est.chunks, est.inputs, est.send_inputs, est.send_tokens, est.cost) == (0, 0, 0, 0, 0.0)
