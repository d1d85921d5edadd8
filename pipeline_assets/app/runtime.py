"""What a use case needs besides a pool: the provider and the ingest options,
built from one ``Settings``.

The command line and the Dagster resources both build it here, so they agree
on the model, the chunker, the extractor version and every limit.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pipeline_assets.app.ingest_config import IngestConfig
from pipeline_assets.content.chunking import DEFAULT_CHUNK_OVERLAP, DEFAULT_CHUNK_TOKENS, Chunker
from pipeline_assets.content.extract import EXTRACTOR_VERSION, EXTRACTOR_VERSIONS, FORMATS, ExtractorVersions
from pipeline_assets.content.identity import sha256_hex
from pipeline_assets.providers import ConfigError, ModelLimit, ModelSpec, Provider, check_chunk_size, provider_for
from pipeline_assets.settings import Settings


def extractor_versions(settings: Settings) -> ExtractorVersions:
    """Each format's extractor version: EXTRACTOR_VERSIONS, overridden by PIPELINE_EXTRACTOR_VERSION
    (a dry run of a parser fix): ``V`` for every format, or ``pdf=V[,html=W]`` for those formats
    only. ValueError for an unknown format."""
    spec = (settings.extractor_version or "").strip()
    if not spec:
        return ExtractorVersions.of_formats(EXTRACTOR_VERSIONS)
    if "=" not in spec:
        return ExtractorVersions.of_formats({f: spec for f in FORMATS})
    overrides = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        fmt, _, version = part.partition("=")
        if not version.strip():
            raise ValueError(f"PIPELINE_EXTRACTOR_VERSION: {part!r} is not FORMAT=VERSION")
        overrides[fmt.strip()] = version.strip()
    return ExtractorVersions.of_formats({**EXTRACTOR_VERSIONS, **overrides})


def extractor_version(settings: Settings) -> str:
    """The code version of Dagster's ``documents`` asset: EXTRACTOR_VERSION (the code every format
    shares), or a plain PIPELINE_EXTRACTOR_VERSION (every format). A per-format bump leaves it
    alone: Dagster's code version is one per asset, it cannot make only some partitions stale."""
    spec = (settings.extractor_version or "").strip()
    return spec if spec and "=" not in spec else EXTRACTOR_VERSION


def chunking(settings: Settings, spec: ModelSpec | None = None) -> tuple[int, int]:
    """The chunk size and overlap (cl100k tokens). Set, PIPELINE_CHUNK_TOKENS is kept as it is (never
    shrunk: a size past a window is refused by ``check_chunk_size``) and an unset overlap is
    DEFAULT_CHUNK_OVERLAP. Unset, the size follows the configured model's window (``spec``, else the
    model ``settings`` configure): DEFAULT_CHUNK_TOKENS, or the largest chunk the window takes when
    that is smaller, and an unset overlap is the same eighth of it. A model that cannot be built
    here gets the defaults: the command that needs it says why."""
    tokens, overlap = settings.chunk_tokens, settings.chunk_overlap
    if tokens is not None:
        return tokens, DEFAULT_CHUNK_OVERLAP if overlap is None else overlap
    if spec is None:
        try:
            provider = provider_for(settings.provider_config())
        except (ConfigError, ValueError):
            provider = None
        if provider is not None:
            spec = provider.spec
            provider.close()
    tokens = DEFAULT_CHUNK_TOKENS if spec is None else min(DEFAULT_CHUNK_TOKENS, spec.max_chunk_tokens)
    return tokens, tokens * DEFAULT_CHUNK_OVERLAP // DEFAULT_CHUNK_TOKENS if overlap is None else overlap


def fitted(settings: Settings, spec: ModelSpec | None = None) -> Settings:
    """``settings`` with the chunk size and overlap filled in (``chunking``): what a runtime keeps, so
    that a model other than the configured one (``models add``) chunks as the configured one does."""
    if settings.chunk_tokens is not None and settings.chunk_overlap is not None:
        return settings
    tokens, overlap = chunking(settings, spec)
    return dataclasses.replace(settings, chunk_tokens=tokens, chunk_overlap=overlap)


def chunker_for(settings: Settings, hard_limit: int | None = None) -> Chunker:
    """The chunker of ``chunking(settings)``: PIPELINE_CHUNK_TOKENS / PIPELINE_CHUNK_OVERLAP or their
    defaults fitted to the configured model (ValueError if invalid)."""
    tokens, overlap = chunking(settings)
    return Chunker(max_tokens=tokens, overlap=overlap, hard_limit=hard_limit)


# The code version of the embeddings stage: what makes a vector besides its chunk and its model.
# The model is not part of it: every vector is keyed by (chunk checksum, model id), and Dagster's
# embeddings are partitioned by model, so a model change is a new column, not new code.
EMBEDDINGS_CODE_VERSION = "vectors-1"


def code_versions(settings: Settings) -> dict[str, str]:
    """The code version of each stage: extractor, chunker, embedding. Never raises for a missing key."""
    return {
        "documents": extractor_version(settings),
        "chunks": chunker_for(settings).version,
        "embeddings": EMBEDDINGS_CODE_VERSION,
    }


@dataclass
class IngestOptions:
    """How one ingest turns files into chunks and jobs: its bounds (``config``) and this run's choices."""

    chunker: Chunker
    config: IngestConfig = dataclasses.field(default_factory=IngestConfig)
    dagster_run_id: str | None = None  # the Dagster run it runs in, when run from Dagster
    force: bool = False  # re-extract even when nothing changed (a rerun)
    allow_empty: bool = False  # allow a scan that finds nothing to tombstone everything
    # Each format's extractor version (``extractor_version.of(document_id)``).
    extractor_version: ExtractorVersions = dataclasses.field(
        default_factory=lambda: ExtractorVersions.of_formats(EXTRACTOR_VERSIONS)
    )
    # Leave the chunks' text-search vectors to the caller (``store.text_search``; `embed`'s worker
    # computes them at its drain); otherwise the ingest computes them at its end.
    text_search_later: bool = False

    @property
    def config_hash(self) -> str:
        return sha256_hex(f"{self.config.max_bytes}|{self.config.decode_errors}".encode())[:16]


@dataclass
class Runtime:
    settings: Settings
    provider: Provider
    options: IngestOptions

    @property
    def model_id(self) -> str:
        return self.provider.spec.model_id

    @classmethod
    def build(
        cls,
        settings: Settings,
        model: str | None = None,
        *,
        dagster_run_id: str | None = None,
        force: bool = False,
        allow_empty: bool = False,
    ) -> Runtime:
        provider = provider_for(settings.provider_config(), model)
        settings = fitted(settings, None if model else provider.spec)
        # The chunk size must fit the model's window (in its tokens): one line, before any call.
        check_chunk_size(chunking(settings)[0], [ModelLimit.of(provider.spec)])
        options = IngestOptions(
            chunker=chunker_for(settings, hard_limit=provider.spec.max_chunk_tokens),
            config=settings.ingest_config(),
            extractor_version=extractor_versions(settings),
            dagster_run_id=dagster_run_id,
            force=force,
            allow_empty=allow_empty,
        )
        return cls(settings=settings, provider=provider, options=options)
