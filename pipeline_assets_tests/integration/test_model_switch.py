"""A model switch without downtime: several active models, one served.

Search always answers during a switch: from the old model until the new one
covers every current chunk and is served, then from the new one. `models serve`
refuses an incomplete model (--force switches anyway, saying what is missing);
the served model cannot be retired; a retired model's vectors and index are
deleted by reconcile after the grace period, not before.
"""

from __future__ import annotations

import json
import threading
import time

import pytest

from pipeline_assets.app import model_admin, model_runtime
from pipeline_assets.app import search as search_uc
from pipeline_assets.app.embed import embed_directory, work
from pipeline_assets.app.runtime import Runtime
from pipeline_assets.jobqueue.worker import BudgetExhausted
from pipeline_assets.providers import ConfigError, ModelSpec
from pipeline_assets.registry import models, vector_index
from pipeline_assets.settings import Settings
from pipeline_assets.store import db
from pipeline_assets_tests.conftest import FAKE_MODEL
from pipeline_assets_tests.data_helpers import write_corpus
from pipeline_assets_tests.processes import cli

OLD = f"openai/{FAKE_MODEL}"
NEW_NAME, NEW_DIMS = "fake-embed-2", 8
NEW = f"openai/{NEW_NAME}@{NEW_DIMS}"  # another dimension: a query embedded by the wrong model cannot even run


def vectors_of(conn, model_id: str) -> int:
    return conn.execute("SELECT count(*) FROM app.embeddings WHERE model_id = %s", (model_id,)).fetchone()[0]


def index_exists(conn, model_id: str) -> bool:
    return (
        conn.execute(
            "SELECT count(*) FROM pg_indexes WHERE schemaname = 'app' AND indexname = %s",
            (vector_index.index_name(model_id),),
        ).fetchone()[0]
        == 1
    )


def test_search_answers_from_the_old_model_until_the_new_one_is_complete(env, fake, clean_db, tmp_path, monkeypatch):
    monkeypatch.setenv("PIPELINE_BATCH_INPUTS", "2")  # many small requests: the budget stops mid-way
    corpus = tmp_path / "corpus"
    write_corpus(corpus, 24, words=600)
    settings = Settings.from_env()
    with db.make_pool(db.database_url(settings.database_config()), max_size=6) as pool:
        embed_directory(Runtime.build(settings), pool, corpus)
        assert model_admin.served_model_id(pool) == OLD  # the first model is served at once
        query = clean_db.execute("SELECT text FROM app.chunks ORDER BY chunk_checksum LIMIT 1").fetchone()[0]

        added = model_admin.add(settings, pool, NEW_NAME, dimensions=NEW_DIMS)
        wanted = added["coverage"]["wanted"]
        assert added["model_id"] == NEW and added["new"] and added["enqueued"] == wanted >= 40
        assert not added["served"] and added["coverage"]["ready"] == 0

        answers: list[tuple[float, float, str, int, float]] = []  # (start, end, model, hits, best distance)
        errors: list[BaseException] = []
        stop = threading.Event()

        def searcher():
            while not stop.is_set():
                try:
                    started = time.monotonic()
                    rt = model_runtime.served_runtime(settings, pool)
                    hits = search_uc.search(rt, pool, query, 3, mode="vector")
                    answers.append(
                        (
                            started,
                            time.monotonic(),
                            rt.model_id,
                            len(hits),
                            min((h["distance"] for h in hits), default=9.0),
                        )
                    )
                except BaseException as exc:
                    errors.append(exc)
                    return

        def wait_for(condition, what: str, timeout: float = 120) -> None:
            deadline = time.monotonic() + timeout
            while not condition():
                assert time.monotonic() < deadline and not errors, f"timed out waiting for {what}: {errors}"
                time.sleep(0.05)

        thread = threading.Thread(target=searcher, daemon=True)
        thread.start()
        new_settings = settings.replace(embedding_model=NEW_NAME, embedding_dimensions=NEW_DIMS)
        # Half built, forced (not hoped for by timing): a run token budget of half the corpus stops
        # the worker with the new model partly embedded.
        tokens = clean_db.execute(
            "SELECT sum(token_count) FROM (SELECT DISTINCT ON (chunk_checksum) token_count FROM app.chunks) t"
        ).fetchone()[0]
        with pytest.raises(BudgetExhausted):
            work(
                Runtime.build(new_settings.replace(run_token_budget=tokens // 2)), pool, until_idle=True, concurrency=1
            )
        half = models.coverage(clean_db, NEW)
        assert 0 < half.ready < half.wanted
        with pytest.raises(model_admin.NotCovered) as refused:  # `models serve` refuses a half-built model
            model_admin.serve(pool, NEW_NAME)
        partial = refused.value.coverage
        assert 0 < partial.ready < partial.wanted
        assert "search stays on the served model" in str(refused.value)
        wait_for(lambda: len(answers) > 10, "searches while the new model is half built")
        serve_started = time.monotonic()
        work(Runtime.build(new_settings), pool, until_idle=True, concurrency=1)  # the rest
        served = model_admin.serve(pool, NEW_NAME)
        serve_done = time.monotonic()
        assert served["changed"] and served["previous"] == OLD and served["missing"] == 0
        assert models.coverage(clean_db, NEW).complete
        wait_for(lambda: sum(1 for a in answers if a[0] > serve_done) >= 5, "searches after the switch")
        stop.set()
        thread.join(timeout=30)

    assert not errors, errors
    assert len(answers) >= 16  # 11 or more while half built, 5 or more after the switch (waited for)
    assert all(n == 3 for _, _, _, n, _ in answers), "a search answered with fewer than k hits"
    # The query is a chunk's own text: the best hit is that chunk (distance ~0) under whichever
    # model answered, so the query was embedded by the model whose vectors were read.
    assert all(best < 1e-4 for *_, best in answers)
    models_in_order = [m for _, _, m, _, _ in answers]
    assert set(models_in_order) == {OLD, NEW}
    first_new = models_in_order.index(NEW)
    assert models_in_order[first_new:] == [NEW] * (len(answers) - first_new), "search went back to the old model"
    assert all(m == OLD for start, end, m, _, _ in answers if end < serve_started)
    assert all(m == NEW for start, end, m, _, _ in answers if start > serve_done)
    during_build = [a for a in answers if a[1] < serve_started]
    assert len(during_build) > 10 and all(a[2] == OLD for a in during_build)
    print(f"switch: {len(answers)} searches, {len(during_build)} while {NEW} was built, all answered with 3 hits")


def test_serve_force_retire_and_purge_after_the_grace_period(env, fake, clean_db, tmp_path):
    corpus = tmp_path / "corpus"
    write_corpus(corpus, 6)
    cli("embed", str(corpus), env=env)
    new_env = {**env, "PIPELINE_EMBEDDING_MODEL": NEW_NAME, "PIPELINE_EMBEDDING_DIMENSIONS": str(NEW_DIMS)}
    out = cli("models", "add", NEW_NAME, "--dimensions", str(NEW_DIMS), env=env).stdout
    assert out.startswith(f"added {NEW}: ") and "coverage 0/" in out
    wanted = vectors_of(clean_db, OLD)

    refused = cli("models", "serve", NEW, env=env, check=False)
    assert refused.returncode == 1 and refused.stderr.startswith(f"error: model {NEW} does not cover the corpus yet")
    assert f"{wanted} of {wanted} current chunk(s) have no vector (waiting={wanted} failed=0" in refused.stderr
    assert model_admin_served(env) == OLD
    assert f"coverage {OLD}: {wanted}/{wanted} (100.0%) served" in cli("status", env=env).stdout

    # --force switches early and says what is missing; then back to the complete model.
    forced = cli("models", "serve", NEW, "--force", env=env).stdout.splitlines()
    assert forced[0] == f"serving {NEW} (was {OLD})"
    assert forced[1].startswith(f"warning: forced: {wanted} of {wanted} current chunk(s) have no vector")
    assert model_admin_served(env) == NEW
    assert cli("models", "serve", FAKE_MODEL, env=env).stdout.strip() == f"serving {OLD} (was {NEW})"

    cli("work", "--until-idle", env=new_env)
    assert cli("models", "serve", NEW, env=env).stdout.strip() == f"serving {NEW} (was {OLD})"
    status = json.loads(cli("status", "--json", env=env).stdout)
    assert status["served_model"] == NEW
    assert status["coverage"][NEW]["ready"] == status["coverage"][OLD]["ready"] == wanted
    hits = json.loads(cli("search", "w1", "-k", "2", "--json", "--mode", "vector", env=env).stdout)
    assert len(hits) == 2
    exported = [json.loads(line) for line in cli("export", env=env).stdout.splitlines()]
    assert len(exported) >= wanted and all(len(r["embedding"]) == NEW_DIMS for r in exported)

    # Retire the old model: its vectors and index stay for the grace period...
    assert index_exists(clean_db, OLD)
    out = cli("models", "retire", FAKE_MODEL, env=env).stdout
    assert out.startswith(f"retired {OLD}: 0 unstarted job(s) superseded") and "PIPELINE_MODEL_RETIRE_GRACE" in out
    # (reconcile runs with the new model configured: the old one is retired, and refused as a configuration)
    assert json.loads(cli("reconcile", "--json", env=new_env).stdout)["purged_models"] == 0
    assert vectors_of(clean_db, OLD) == wanted and index_exists(clean_db, OLD)
    line = [ln for ln in cli("status", env=env).stdout.splitlines() if ln.startswith(f"retired {OLD}")]
    assert line and "vectors deleted after" in line[0]
    # ...and reconcile deletes them once it is over; the served model is never touched.
    report = json.loads(cli("reconcile", "--json", env={**new_env, "PIPELINE_MODEL_RETIRE_GRACE": "0"}).stdout)
    assert report["purged_models"] == 1 and report["purged_vectors"] == wanted
    assert vectors_of(clean_db, OLD) == 0 and not index_exists(clean_db, OLD)
    assert vectors_of(clean_db, NEW) == wanted
    assert (
        clean_db.execute(
            "SELECT count(*) FROM app.embedding_jobs WHERE model_id = %s AND status <> 'superseded'", (OLD,)
        ).fetchone()[0]
        == 0
    )
    assert cli("models", "purge", env={**env, "PIPELINE_MODEL_RETIRE_GRACE": "0"}).stdout.strip() == "nothing to purge"
    old_row = next(r for r in json.loads(cli("models", "list", "--json", env=env).stdout) if r["model_id"] == OLD)
    assert old_row["purged_at"] and not old_row["active"] and not old_row["served"]
    listing = dict(line.split(" ", 1) for line in cli("models", "list", env=env).stdout.splitlines())
    assert "active=False served=False purged_at=" in listing[OLD]
    assert f"active=True served=True coverage={wanted}/{wanted} " in listing[NEW]

    # A rollback after the purge: activate re-embeds what it lost (the superseded jobs are revived).
    billed = fake.stats["billed_inputs"]
    cli("models", "activate", FAKE_MODEL, env=env)
    cli("work", "--until-idle", env=env)
    assert vectors_of(clean_db, OLD) == wanted and fake.stats["billed_inputs"] == billed + wanted


def test_the_served_model_cannot_be_retired_nor_purged(env, clean_db, tmp_path):
    corpus = tmp_path / "corpus"
    write_corpus(corpus, 2)
    cli("embed", str(corpus), env=env)
    refused = cli("models", "retire", FAKE_MODEL, env=env, check=False)
    assert refused.returncode == 1
    assert refused.stderr.strip() == f"error: model {OLD} is served; `pipeline-assets models serve OTHER` first"
    # Even retired below the use case (registry.models.retire has no guard), a served model is never purged.
    models.retire(clean_db, OLD)
    assert models.purge_due(clean_db, 0) == []
    assert vectors_of(clean_db, OLD) > 0


def model_admin_served(env: dict) -> str:
    return json.loads(cli("status", "--json", env=env).stdout)["served_model"]


def test_a_served_model_this_installation_cannot_build_is_one_line(env, clean_db):
    """An offline embedder replaced by a new version: its vectors are served, its code is gone."""
    gone = ModelSpec(
        provider="local",
        name="local-hashing",
        id_name="hashing-gone-v0",
        dimension=4,
        max_input_tokens=100,
        max_batch_inputs=10,
        max_batch_tokens=1000,
    )
    assert models.ensure_model(clean_db, gone)  # the first model: served at once
    settings = Settings.from_env()
    url = db.database_url(settings.database_config())
    with db.make_pool(url, max_size=2) as pool, pytest.raises(ConfigError) as refused:
        model_runtime.served_runtime(settings, pool)
    assert str(refused.value) == (
        "this installation cannot embed a query with the served model "
        f"local/hashing-gone-v0@4; `pipeline-assets models serve {OLD}` once it covers "
        "the corpus (`models list`), or `search --model NAME`"
    )
