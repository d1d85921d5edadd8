"""Everything a command needs, built from the environment in one place.

The CLI and the Dagster resources both start here, so they share defaults:
the embedded database and the local model when nothing is configured.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline_assets import settings
from pipeline_assets.content.chunking import chunker_from_env
from pipeline_assets.content.extract import decode_policy_from_env
from pipeline_assets.app.ingest import IngestOptions
from pipeline_assets.providers import Provider, provider_from_env
from pipeline_assets.content.sources import max_input_bytes_from_env


@dataclass
class Runtime:
    provider: Provider
    options: IngestOptions

    @property
    def model_id(self) -> str:
        return self.provider.spec.model_id


def runtime_from_env(model: str | None = None, *, run_id: str | None = None) -> Runtime:
    provider = provider_from_env(model)
    options = IngestOptions(
        chunker=chunker_from_env(hard_limit=provider.spec.max_input_tokens),
        max_bytes=max_input_bytes_from_env(),
        decode_errors=decode_policy_from_env(),
        max_attempts=settings.max_attempts(),
        stage_timeout=settings.env_float("PIPELINE_STAGE_TIMEOUT", settings.DEFAULT_STAGE_TIMEOUT_SECONDS),
        run_id=run_id,
    )
    return Runtime(provider=provider, options=options)
