"""Ingest: scan a source, checksum, extract, chunk, enqueue. No provider calls.

Idempotent: an item whose raw bytes and extractor/chunker versions are unchanged
is skipped (a duplicate event creates no work). A changed item has its chunks
replaced and its new chunks enqueued in one transaction per batch, and the
jobs of content no longer wanted are superseded at once. Items gone from the
source are tombstoned after a complete scan.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

import psycopg

from pipeline_assets.jobs import transitions
from pipeline_assets import settings
from pipeline_assets.content.chunking import Chunk, Chunker
from pipeline_assets.content.extract import ExtractError, extract_text, extractor_version
from pipeline_assets.content.identity import sha256_hex
from pipeline_assets.content.sources import SourceError, SourceItem, read_guarded, scan_directory
from pipeline_assets.content.timeouts import wall_clock_limit


@dataclass
class IngestOptions:
    chunker: Chunker
    max_bytes: int
    decode_errors: str = "strict"
    max_attempts: int = settings.DEFAULT_MAX_ATTEMPTS
    run_id: str | None = None       # the Dagster run id, when run from Dagster
    force: bool = False             # re-extract even when nothing changed (a rerun)
    allow_empty: bool = False       # allow a scan that finds nothing to tombstone everything
    stage_timeout: float = settings.DEFAULT_STAGE_TIMEOUT_SECONDS  # per document: extract + chunk

    @property
    def config_hash(self) -> str:
        return sha256_hex(f"{self.max_bytes}|{self.decode_errors}".encode())[:16]


@dataclass
class IngestReport:
    scanned: int = 0
    new: int = 0
    changed: int = 0
    unchanged: int = 0
    quarantined: int = 0
    deleted: int = 0
    chunks: int = 0
    enqueued: int = 0
    superseded: int = 0
    revived: int = 0
    errors: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class _Processed:
    item: SourceItem
    checksum: bytes | None
    text_checksum: bytes | None
    chunks: list[Chunk]
    error_class: str | None = None
    error_message: str | None = None


def register_source(conn: psycopg.Connection, root: Path) -> int:
    row = conn.execute(
        "INSERT INTO app.sources (root) VALUES (%s) ON CONFLICT (root) DO UPDATE SET root = EXCLUDED.root"
        " RETURNING source_id", (str(root),)).fetchone()
    return row[0]


def ingest_directory(conn: psycopg.Connection, root: Path, options: IngestOptions) -> IngestReport:
    """Scan everything under ``root``; tombstone what is no longer there."""
    root = Path(root).expanduser().resolve()
    items = scan_directory(root)  # raises SourceError for a missing root
    scan_started = conn.execute("SELECT now()").fetchone()[0]
    first = next(items, None)
    source_id = register_source(conn, root)
    report = IngestReport()
    conn.execute("CREATE TEMP TABLE IF NOT EXISTS ingest_seen (document_id text PRIMARY KEY)")
    conn.execute("TRUNCATE ingest_seen")
    all_items = _chain(first, items)
    _ingest_items(conn, source_id, all_items, options, report, record_seen=True)
    if report.scanned == 0 and not options.allow_empty:
        current = conn.execute("SELECT count(*) FROM app.documents WHERE source_id = %s AND status <> 'deleted'",
                               (source_id,)).fetchone()[0]
        if current:
            raise SourceError(f"source {root} is empty but {current} documents from it are current; "
                              "refusing to tombstone them all (pass --allow-empty if this is intended)")
    with conn.transaction():
        write_lock(conn)
        # Only what this scan could have seen: a document another process
        # ingested after the listing started is not "gone".
        _tombstone(conn, report, "source_id = %s AND status <> 'deleted' AND updated_at < %s"
                   " AND NOT EXISTS (SELECT 1 FROM ingest_seen s WHERE s.document_id = d.document_id)",
                   (source_id, scan_started))
        conn.execute("UPDATE app.sources SET last_scan_at = now() WHERE source_id = %s", (source_id,))
    return report


def ingest_paths(conn: psycopg.Connection, root: Path, document_ids: Iterable[str],
                 options: IngestOptions) -> IngestReport:
    """Ingest only some documents of a source (a Dagster partition, a rerun).

    An id whose file is gone is tombstoned.
    """
    root = Path(root).expanduser().resolve()
    if not root.is_dir():
        raise SourceError(f"source directory not found: {root}")
    source_id = register_source(conn, root)
    report = IngestReport()
    present, missing = [], []
    for doc_id in document_ids:
        path = root / doc_id
        if path.is_file():
            st = path.stat()
            present.append(SourceItem(doc_id, path, st.st_size, st.st_mtime_ns, path.as_uri()))
        else:
            missing.append(doc_id)
    _ingest_items(conn, source_id, iter(present), options, report, record_seen=False)
    if missing:
        with conn.transaction():
            write_lock(conn)
            _tombstone(conn, report, "source_id = %s AND status <> 'deleted' AND document_id = ANY(%s)",
                       (source_id, missing))
    return report


# Arbitrary fixed key: one content-changing ingest transaction at a time.
INGEST_WRITE_LOCK_KEY = 7_301_946_222


def write_lock(conn: psycopg.Connection) -> None:
    """Serialise transactions that replace chunks. Two concurrent ingests that
    share a chunk checksum could otherwise each miss the other's chunk row and
    supersede (and delete the vector of) content that is still wanted. The
    transactions are short; workers never take this lock."""
    conn.execute("SELECT pg_advisory_xact_lock(%s)", (INGEST_WRITE_LOCK_KEY,))


def _tombstone(conn: psycopg.Connection, report: IngestReport, where: str, params: tuple) -> None:
    """Mark documents deleted, drop their chunks, supersede what nobody wants any more."""
    pks = [r[0] for r in conn.execute(
        f"UPDATE app.documents d SET status = 'deleted', chunk_count = 0, updated_at = now() WHERE {where}"
        " RETURNING doc_pk", params)]
    if not pks:
        return
    report.deleted += len(pks)
    dropped = {r[0] for r in conn.execute(
        "DELETE FROM app.chunks WHERE doc_pk = ANY(%s) RETURNING chunk_checksum", (pks,))}
    if dropped:
        report.superseded += transitions.supersede_unwanted(conn, list(dropped))


def _chain(first: SourceItem | None, rest: Iterator[SourceItem]) -> Iterator[SourceItem]:
    if first is not None:
        yield first
        yield from rest


def _batches(items: Iterator[SourceItem], size: int) -> Iterator[list[SourceItem]]:
    batch: list[SourceItem] = []
    for item in items:
        batch.append(item)
        if len(batch) >= size:
            yield batch
            batch = []
    if batch:
        yield batch


def _ingest_items(conn: psycopg.Connection, source_id: int, items: Iterator[SourceItem],
                  options: IngestOptions, report: IngestReport, *, record_seen: bool) -> None:
    ext_version = extractor_version()
    for batch in _batches(items, settings.INGEST_BATCH_DOCUMENTS):
        report.scanned += len(batch)
        existing = {
            r[0]: r[1:] for r in conn.execute(
                "SELECT document_id, source_checksum, extractor_version, chunker_version, status,"
                " error_class, size_bytes FROM app.documents WHERE source_id = %s AND document_id = ANY(%s)",
                (source_id, [i.document_id for i in batch]))
        }
        todo: list[_Processed] = []
        for item in batch:
            old = existing.get(item.document_id)
            processed = _process(item, options, old, ext_version)
            if processed is None:
                report.unchanged += 1
                continue
            if old is None or old[3] == "deleted":
                report.new += 1
            else:
                report.changed += 1
            if processed.error_class:
                report.quarantined += 1
                report.errors[processed.error_class] = report.errors.get(processed.error_class, 0) + 1
            todo.append(processed)
        with conn.transaction():
            if record_seen:
                with conn.cursor().copy("COPY ingest_seen (document_id) FROM STDIN") as copy:
                    for item in batch:
                        copy.write_row((item.document_id,))
            if todo:
                write_lock(conn)
                _write(conn, source_id, todo, options, ext_version, report)


def _process(item: SourceItem, options: IngestOptions, old: tuple | None, ext_version: str) -> _Processed | None:
    """Read, checksum, extract, chunk one item; None when nothing changed."""
    unchanged_versions = old is not None and old[1] == ext_version and old[2] == options.chunker.version
    try:
        raw = read_guarded(item, options.max_bytes)
    except ExtractError as exc:
        if (not options.force and old is not None and old[3] == "quarantined" and old[4] == exc.error_class
                and old[5] == item.size):
            return None
        return _Processed(item, None, None, [], exc.error_class, exc.message)
    except OSError as exc:
        return _Processed(item, None, None, [], "unreadable", f"{type(exc).__name__}: {exc}"[:300])
    checksum = hashlib.sha256(raw).digest()
    if (not options.force and unchanged_versions and old[0] == checksum and old[3] != "deleted"):
        return None
    limit = options.stage_timeout
    try:
        with wall_clock_limit(limit, ExtractError("timeout", f"extract and chunk took longer than {limit:g} s")):
            text = extract_text(item.document_id, raw, decode_errors=options.decode_errors)
            chunks = options.chunker.chunk(text)
    except ExtractError as exc:
        return _Processed(item, checksum, None, [], exc.error_class, exc.message)
    return _Processed(item, checksum, hashlib.sha256(text.encode("utf-8", "replace")).digest(), chunks)


def _write(conn: psycopg.Connection, source_id: int, todo: list[_Processed], options: IngestOptions,
           ext_version: str, report: IngestReport) -> None:
    rows = conn.execute(
        """INSERT INTO app.documents AS d (source_id, document_id, source_uri, source_checksum, size_bytes, status,
                                           extractor_version, chunker_version, text_checksum, chunk_count,
                                           error_class, error_message)
           SELECT %(source)s, t.document_id, t.uri, t.checksum, t.size,
                  CASE WHEN t.error_class IS NULL THEN 'current' ELSE 'quarantined' END,
                  %(ext)s, %(chunker)s, t.text_checksum, t.chunk_count, t.error_class, t.error_message
           FROM unnest(%(ids)s::text[], %(uris)s::text[], %(checksums)s::bytea[], %(sizes)s::bigint[],
                       %(text_checksums)s::bytea[], %(counts)s::int[], %(classes)s::text[], %(messages)s::text[])
                AS t(document_id, uri, checksum, size, text_checksum, chunk_count, error_class, error_message)
           ON CONFLICT (source_id, document_id) DO UPDATE
           SET source_uri = EXCLUDED.source_uri, source_checksum = EXCLUDED.source_checksum,
               size_bytes = EXCLUDED.size_bytes, status = EXCLUDED.status,
               extractor_version = EXCLUDED.extractor_version, chunker_version = EXCLUDED.chunker_version,
               text_checksum = EXCLUDED.text_checksum, chunk_count = EXCLUDED.chunk_count,
               error_class = EXCLUDED.error_class, error_message = EXCLUDED.error_message, updated_at = now()
           RETURNING d.document_id, d.doc_pk""",
        {"source": source_id, "ext": ext_version, "chunker": options.chunker.version,
         "ids": [p.item.document_id for p in todo], "uris": [p.item.source_uri for p in todo],
         "checksums": [p.checksum for p in todo], "sizes": [p.item.size for p in todo],
         "text_checksums": [p.text_checksum for p in todo], "counts": [len(p.chunks) for p in todo],
         "classes": [p.error_class for p in todo], "messages": [p.error_message for p in todo]},
    ).fetchall()
    pk_of = dict(rows)
    pks = list(pk_of.values())
    old_checksums = {r[0] for r in conn.execute(
        "DELETE FROM app.chunks WHERE doc_pk = ANY(%s) RETURNING chunk_checksum", (pks,))}
    new_checksums: set[bytes] = set()
    with conn.cursor().copy(
            "COPY app.chunks (doc_pk, chunk_index, chunk_checksum, text, token_count, char_start, char_end)"
            " FROM STDIN") as copy:
        for p in todo:
            pk = pk_of[p.item.document_id]
            for c in p.chunks:
                digest = bytes.fromhex(c.checksum)
                new_checksums.add(digest)
                copy.write_row((pk, c.index, digest, c.text, c.token_count, c.char_start, c.char_end))
                report.chunks += 1
    report.enqueued += transitions.enqueue_for_docs(conn, pks, options.max_attempts)
    if new_checksums:
        report.revived += transitions.revive_wanted(conn, list(new_checksums))
    dropped = old_checksums - new_checksums
    if dropped:
        report.superseded += transitions.supersede_unwanted(conn, list(dropped))
    _record_stage_runs(conn, todo, pk_of, options, ext_version)


def _record_stage_runs(conn: psycopg.Connection, todo: list[_Processed], pk_of: dict[str, int],
                       options: IngestOptions, ext_version: str) -> None:
    pks, stages, statuses, classes, messages, versions, checksums = [], [], [], [], [], [], []
    for p in todo:
        pk = pk_of[p.item.document_id]
        extract_failed = p.error_class is not None
        for stage, version in (("extract", ext_version), ("chunk", options.chunker.version)):
            pks.append(pk)
            stages.append(stage)
            versions.append(version)
            checksums.append(p.checksum)
            if stage == "extract" and extract_failed:
                statuses.append("failed")
                classes.append(p.error_class)
                messages.append(p.error_message)
            elif stage == "chunk" and extract_failed:
                statuses.append("skipped")
                classes.append(None)
                messages.append(None)
            else:
                statuses.append("succeeded")
                classes.append(None)
                messages.append(None)
    conn.execute(
        """INSERT INTO app.stage_runs AS s (doc_pk, stage, status, error_class, last_error, code_version,
                                            config_hash, dagster_run_id, source_checksum, finished_at)
           SELECT t.pk, t.stage, t.status, t.cls, t.msg, t.version, %(config)s, %(run)s, t.checksum, now()
           FROM unnest(%(pks)s::bigint[], %(stages)s::text[], %(statuses)s::text[], %(classes)s::text[],
                       %(messages)s::text[], %(versions)s::text[], %(checksums)s::bytea[])
                AS t(pk, stage, status, cls, msg, version, checksum)
           ON CONFLICT (doc_pk, stage) DO UPDATE
           SET status = EXCLUDED.status, error_class = EXCLUDED.error_class, last_error = EXCLUDED.last_error,
               code_version = EXCLUDED.code_version, config_hash = EXCLUDED.config_hash,
               dagster_run_id = EXCLUDED.dagster_run_id, source_checksum = EXCLUDED.source_checksum,
               attempts = s.attempts + 1, started_at = now(), finished_at = now()""",
        {"config": options.config_hash, "run": options.run_id, "pks": pks, "stages": stages,
         "statuses": statuses, "classes": classes, "messages": messages, "versions": versions,
         "checksums": checksums},
    )
