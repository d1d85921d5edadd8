"""`pipeline-assets rerun` through the command line: per-format extractor versions, every stage,
combinable filters, --dry-run; outcomes read back from the database and the fake provider's bill."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline_assets.app.buckets import stale_stages
from pipeline_assets.app.runtime import Runtime
from pipeline_assets.settings import Settings
from pipeline_assets_tests.conftest import FAKE_MODEL
from pipeline_assets_tests.data_helpers import job_counts, write_corpus
from pipeline_assets_tests.processes import cli
from pipeline_assets_tests.unit.test_extract import make_pdf

MODEL_ID = f"openai/{FAKE_MODEL}"


@pytest.fixture
def corpus(tmp_path) -> Path:
    return tmp_path / "corpus"


def listed(out: str) -> list[str]:
    """The document ids a --dry-run lists (then the count; for embed, then the estimate)."""
    lines = [line for line in out.strip().splitlines() if not line.startswith("estimate")]
    assert lines[-1].endswith("document(s) would be rerun"), out
    assert int(lines[-1].split()[0]) == len(lines) - 1
    return sorted(line.split(" [", 1)[0] for line in lines[:-1])


def extract_rows(conn) -> dict[str, tuple[str, str, int]]:
    return {
        r[0]: tuple(r[1:])
        for r in conn.execute(
            "SELECT d.document_id, s.status, s.code_version, s.attempts FROM app.stage_runs s "
            "JOIN app.documents d USING (doc_pk) WHERE s.stage = 'extract'"
        )
    }


def stale_in(env: dict, conn, root: Path) -> tuple[str, ...]:
    """The stages a bucket run under ``env``'s settings reads stale documents in (its skip scan)."""
    return stale_stages(Runtime.build(Settings.from_env(env)), conn, str(root.resolve()))


def mixed_corpus(root: Path) -> tuple[list[str], list[str]]:
    """3 markdown, 2 HTML and 2 PDF documents: (PDF ids, the others)."""
    write_corpus(root, 3)
    for i in range(2):
        (root / f"page{i}.html").write_text(f"<html><body><h1>Page {i}</h1><p>html words {i} here</p></body></html>")
        (root / f"paper{i}.pdf").write_bytes(make_pdf([f"Paper {i} about retries", f"page two of paper {i}"]))
    pdfs = ["paper0.pdf", "paper1.pdf"]
    others = sorted(["doc0000.md", "doc0001.md", "doc0002.md", "page0.html", "page1.html"])
    return pdfs, others


def test_a_pdf_only_fix_reextracts_only_pdfs_and_bills_nothing(env, fake, clean_db, corpus):
    conn = clean_db
    pdfs, others = mixed_corpus(corpus)
    cli("embed", str(corpus), env=env)
    assert {v[:2] for v in extract_rows(conn).values()} == {("succeeded", "extract-1")}
    assert (
        conn.execute(
            "SELECT count(*) FROM app.chunks c JOIN app.documents d USING (doc_pk) WHERE d.document_id LIKE '%.pdf'"
        ).fetchone()[0]
        >= 2
    )
    jobs_before = conn.execute("SELECT job_id, status, attempts FROM app.embedding_jobs ORDER BY 1").fetchall()
    fake.reset_stats()

    # The PDF extractor's version is bumped; the others keep theirs.
    env2 = {**env, "PIPELINE_EXTRACTOR_VERSION": "pdf=extract-2"}
    assert stale_in(env, conn, corpus) == () and stale_in(env2, conn, corpus) == ("extract",)
    assert listed(cli("rerun", "--stale", "--dry-run", env=env2).stdout) == pdfs
    assert listed(cli("rerun", "--stage", "chunk", "--stale", "--dry-run", env=env2).stdout) == []
    assert cli("rerun", "--stage", "extract", "--stale", env=env2).stdout.strip() == "reran extract for 2 document(s)"

    rows = extract_rows(conn)
    assert {d: rows[d] for d in pdfs} == {d: ("succeeded", "extract-2", 2) for d in pdfs}
    assert {d: rows[d] for d in others} == {d: ("succeeded", "extract-1", 1) for d in others}
    assert dict(conn.execute("SELECT document_id, extractor_version FROM app.documents")) == {
        **{d: "extract-2" for d in pdfs},
        **{d: "extract-1" for d in others},
    }
    # Same texts -> same chunks -> the jobs are untouched and a worker sends nothing.
    assert conn.execute("SELECT job_id, status, attempts FROM app.embedding_jobs ORDER BY 1").fetchall() == jobs_before
    work = json.loads(cli("work", "--until-idle", "--json", env=env2).stdout)
    assert work["provider_calls"] == 0 and work["embedded"] == 0
    assert fake.stats["requests"] == 0 and fake.stats["billed_inputs"] == 0
    assert listed(cli("rerun", "--stale", "--dry-run", env=env2).stdout) == []
    # A bucket run's skip scan agrees: nothing stale under the bump, the PDFs under the old versions,
    # every chunk under another chunk size.
    assert stale_in(env2, conn, corpus) == () and stale_in(env, conn, corpus) == ("extract",)
    assert stale_in({**env2, "PIPELINE_CHUNK_TOKENS": "100"}, conn, corpus) == ("chunk",)
    # An ingest under the bumped version skips every unchanged document, PDFs included.
    assert '"changed": 0' in cli("ingest", str(corpus), "--json", env=env2).stdout


def test_filters_combine_and_dry_run_changes_nothing(env, fake, clean_db, corpus):
    conn = clean_db
    for sub in ("a", "b"):
        write_corpus(corpus / sub, 2 if sub == "b" else 3)
        (corpus / sub / "blob.bin").write_bytes(b"\x00\x01binary\x00" * 10)
    cli("ingest", str(corpus), env=env)
    before = extract_rows(conn)

    def dry(*args: str, env=env) -> list[str]:
        return listed(cli("rerun", *args, "--dry-run", env=env).stdout)

    assert dry("--status", "failed") == ["a/blob.bin", "b/blob.bin"]
    assert dry("--status", "failed", "--document", "a/*") == ["a/blob.bin"]
    assert dry("--error-class", "unsupported_binary", "--document", "b/*") == ["b/blob.bin"]
    assert dry("--error-class", "too_large") == []
    assert dry("--stage", "chunk", "--status", "skipped", "--document", "*/blob.*") == ["a/blob.bin", "b/blob.bin"]
    assert dry("--status", "succeeded", "--document", "a/doc000?.md", "--document", "b/doc0001.md") == [
        "a/doc0000.md",
        "a/doc0001.md",
        "a/doc0002.md",
        "b/doc0001.md",
    ]
    assert dry("--document", "a/doc_000%.md") == []  # LIKE's own wildcards are literal
    assert extract_rows(conn) == before  # a dry run changed nothing

    # Re-extract a/doc* under extract-2 only; --before-version then finds the rest.
    env2 = {**env, "PIPELINE_EXTRACTOR_VERSION": "extract-2"}
    assert cli("rerun", "--document", "a/doc*", env=env2).stdout.strip() == "reran extract for 3 document(s)"
    rest = ["a/blob.bin", "b/blob.bin", "b/doc0000.md", "b/doc0001.md"]
    assert dry("--before-version", "extract-2", env=env2) == rest
    assert dry("--stale", env=env2) == rest
    assert dry("--before-version", "extract-2", "--status", "succeeded", "--document", "b/*", env=env2) == [
        "b/doc0000.md",
        "b/doc0001.md",
    ]
    assert dry("--before-version", "extract-1", env=env2) == []
    assert dry("--before-version", "other-3", env=env2) == []  # another name: not "before" it

    # Misuse is one line and exit status 1.
    for args, needle in (
        (("--before-version", "latest"), "must end with a number"),
        (("--stage", "embed", "--stale"), "embed stage's version is its model"),
    ):
        proc = cli("rerun", *args, env=env, check=False)
        assert proc.returncode == 1 and proc.stderr.startswith("error: ") and needle in proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1


def test_embed_rerun_requeues_failed_and_never_rebills_ready(env, fake, clean_db, corpus):
    conn = clean_db
    write_corpus(corpus, 4)
    (corpus / "poisoned.md").write_text("# bad\n\nthis chunk carries the POISON word\n")
    fake.poison_marker = "POISON"
    cli("embed", str(corpus), env=env)
    ready = conn.execute("SELECT count(*) FROM app.embedding_jobs WHERE status = 'ready'").fetchone()[0]
    assert job_counts(conn) == {"ready": ready, "failed": 1}

    def dry(*args: str) -> list[str]:
        return listed(cli("rerun", "--stage", "embed", *args, "--dry-run", env=env).stdout)

    out = cli("rerun", "--stage", "embed", "--status", "failed", "--dry-run", env=env).stdout
    assert f"poisoned.md [embed failed bad_input {MODEL_ID}]" in out
    assert dry("--error-class", "bad_input") == ["poisoned.md"]
    assert dry("--status", "succeeded", "--document", "doc*") == [f"doc{i:04d}.md" for i in range(4)]

    # The provider is fixed; rerun the embed stage of EVERY document.
    fake.poison_marker = None
    fake.reset_stats()
    out = cli("rerun", "--stage", "embed", "--document", "*", env=env).stdout.strip()
    assert out.startswith("reran embed for 5 document(s): requeued=1 enqueued=0")
    assert job_counts(conn) == {"ready": ready, "pending": 1}
    cli("work", "--until-idle", env=env)
    assert job_counts(conn) == {"ready": ready + 1}
    # Only the failed chunk was sent: ready vectors are not billed again.
    assert fake.stats["billed_inputs"] == 1
    poison_text = conn.execute("SELECT text FROM app.chunks WHERE text LIKE '%POISON%'").fetchone()[0]
    assert fake.billed_count(poison_text) == 1
    assert dry("--status", "failed") == [] and len(dry("--status", "succeeded")) == 5


def test_the_query_finds_each_documents_format_as_extract_text_does(clean_db):
    """rerun_targets derives a document's format in SQL from its id's suffix; it must agree with
    ``content.extract.format_of`` (PurePosixPath.suffix, lower case) on awkward ids."""
    from pipeline_assets.content.extract import ExtractorVersions
    from pipeline_assets.store import stage_runs

    conn = clean_db
    versions = ExtractorVersions.of_formats({"text": "T-1", "html": "H-1", "pdf": "P-1"})
    ids = [
        "a.PDF",
        "b.tar.pdf",
        "dir.pdf/readme",
        "dir.pdf/x.Html",
        "x.",
        "y",
        "n/.pdf",
        "c..htm",
        "d.Md",
        "e.pdf.txt",
        "f.unknown",
        "g/h.pdf",
    ]
    source = conn.execute("INSERT INTO app.sources (root) VALUES ('/fmt') RETURNING source_id").fetchone()[0]
    for doc in ids:
        pk = conn.execute(
            "INSERT INTO app.documents (source_id, document_id, source_uri, status) "
            "VALUES (%s, %s, %s, 'current') RETURNING doc_pk",
            (source, doc, doc),
        ).fetchone()[0]
        conn.execute(
            "INSERT INTO app.stage_runs (doc_pk, stage, status, code_version) VALUES (%s, 'extract', 'succeeded', %s)",
            (pk, versions.of(doc)),
        )
    assert {versions.of(d) for d in ids} == {"T-1", "H-1", "P-1"}

    def stale(v: ExtractorVersions) -> list[str]:
        return sorted(
            t.document_id
            for t in stage_runs.rerun_targets(
                conn, stage="extract", not_version=v.default, versions_by_extension=v.by_extension()
            )
        )

    assert stale(versions) == []  # each row has its own format's version
    bumped = ExtractorVersions.of_formats({"text": "T-1", "html": "H-1", "pdf": "P-2"})
    assert stale(bumped) == sorted(d for d in ids if versions.of(d) == "P-1")
    assert stale(bumped) == ["a.PDF", "b.tar.pdf", "g/h.pdf"]


def test_the_walk_through_on_the_bundled_corpus_selects_its_one_pdf(env, fake, clean_db):
    """docs/dagster.md, "Walk-through: a parser fix", step 3 and 6 on examples/corpus (ingest only: no provider)."""
    conn = clean_db
    bundled = Path(__file__).resolve().parents[2] / "examples" / "corpus"
    cli("ingest", str(bundled), env=env)
    env2 = {**env, "PIPELINE_EXTRACTOR_VERSION": "pdf=extract-2"}
    assert listed(cli("rerun", "--stale", "--dry-run", env=env2).stdout) == ["ops/capacity-planning.pdf"]
    assert listed(cli("rerun", "--stale", "--document", "ops/*", "--dry-run", env=env2).stdout) == [
        "ops/capacity-planning.pdf"
    ]
    assert cli("rerun", "--stale", env=env2).stdout.strip() == "reran extract for 1 document(s)"
    assert extract_rows(conn)["ops/capacity-planning.pdf"] == ("succeeded", "extract-2", 2)
    assert {v[1:] for k, v in extract_rows(conn).items() if not k.endswith(".pdf")} == {("extract-1", 1)}
    assert fake.stats["requests"] == 0


def test_rerun_stale_pages_through_every_target(env, fake, clean_db, corpus, monkeypatch):
    """`rerun --stale` redoes every stale document however many there are: with the query answering
    at most 2 rows (pages of 2), all 7 documents of two sources are listed and re-extracted."""
    from pipeline_assets.app import rerun as rerun_uc
    from pipeline_assets.store import stage_runs

    conn = clean_db
    write_corpus(corpus, 5)
    write_corpus(corpus.parent / "second", 2, prefix="other")
    cli("ingest", str(corpus), env=env)
    cli("ingest", str(corpus.parent / "second"), env=env)
    monkeypatch.setattr(rerun_uc, "TARGET_PAGE", 2, raising=False)
    reads: list[int] = []
    real = stage_runs.rerun_targets

    def two_at_most(conn, **filters):  # a page of the query is never more than 2 rows
        rows = real(conn, **{**filters, "limit": min(filters.get("limit", 2), 2)})
        reads.append(len(rows))
        return rows

    monkeypatch.setattr(stage_runs, "rerun_targets", two_at_most)
    bumped = {**env, "PIPELINE_EXTRACTOR_VERSION": "extract-2"}
    everything = sorted([f"doc{i:04d}.md" for i in range(5)] + ["other0000.md", "other0001.md"])
    assert listed(cli("rerun", "--stale", "--dry-run", env=bumped).stdout) == everything
    assert cli("rerun", "--stale", env=bumped).stdout.strip() == "reran extract for 7 document(s)"
    assert {d: v[1:] for d, v in extract_rows(conn).items()} == {d: ("extract-2", 2) for d in everything}
    assert max(reads) == 2 and len(reads) > 4
    assert listed(cli("rerun", "--stale", "--dry-run", env=bumped).stdout) == []
