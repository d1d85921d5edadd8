"""What a run would cost, before anything is sent: the estimate of `models add --dry-run`,
`rerun --stage embed --dry-run` and the Dagster embeddings run's preflight.

For a selection of current chunks and one model: the distinct content (a vector is keyed by
chunk checksum and model, so identical text is embedded once), how much of it already has a
vector for the model (reused: never sent again), how much is dead-lettered, and what is left:
the inputs and tokens that would be sent, with their price when the model's is known
(``providers.pricing``). The tokens are the chunks' cl100k counts, of the exact text a worker
sends, summed in the database (sql/queries/estimates.sql); for OpenAI's models they are what
the provider bills and the ledger records (store/estimates.py). Retries after a fault, and a run's worker that
claims other queued work of the model, send more than this.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from psycopg_pool import ConnectionPool

from pipeline_assets.counts import Counts
from pipeline_assets.providers import ModelSpec
from pipeline_assets.providers.pricing import price_per_million, tokens_exact
from pipeline_assets.store import estimates, reports

TOKENS_PER_MILLION = 1_000_000


@dataclass(frozen=True)
class Estimate(Counts):
    """One model's bill for one selection (counts of distinct content unless named chunks)."""

    model_id: str
    chunks: int  # current chunks selected (with repeats of the same text)
    inputs: int  # distinct content among them
    tokens: int  # cl100k tokens of that content
    embedded: int  # content with a vector for the model already: reused
    embedded_tokens: int
    failed: int  # dead-lettered content (sent only when the selection requeues it)
    failed_tokens: int
    send_inputs: int  # what would be sent
    send_tokens: int
    price_per_million: float | None  # USD; None: unknown (PIPELINE_PRICE_PER_MILLION_TOKENS)
    tokens_exact: bool  # the model counts in cl100k (else its own tokenizer: approximate)
    requeues_failed: bool  # dead-lettered content is in send_* (a rerun of the embed stage requeues it)

    @property
    def cost(self) -> float | None:
        """USD for ``send_tokens``, or None when the price is unknown."""
        if self.price_per_million is None:
            return None
        return self.send_tokens * self.price_per_million / TOKENS_PER_MILLION

    def as_dict(self) -> dict:
        return {**super().as_dict(), "cost_usd": self.cost}

    def describe(self) -> str:
        """One line: what would be sent, what is reused, the price."""
        tokens = f"{self.send_tokens} token(s)" + ("" if self.tokens_exact else " (cl100k; the model counts its own)")
        if self.cost is None:
            price = "price unknown (set PIPELINE_PRICE_PER_MILLION_TOKENS)"
        elif self.price_per_million == 0:
            price = "free (local model)"
        else:
            price = f"{usd(self.cost)} at ${self.price_per_million:g}/M tokens"
        return (
            f"estimate for {self.model_id}: would send {self.send_inputs} input(s), {tokens}, {price}; "
            f"{self.chunks} chunk(s), {self.inputs} distinct, {self.embedded} already embedded (reused)"
            + (
                f", {self.failed} dead-lettered ({'requeued' if self.requeues_failed else 'not sent'})"
                if self.failed
                else ""
            )
        )


def usd(amount: float) -> str:
    """Dollars to the cent, or to six decimals below a cent (a small selection costs fractions of one)."""
    return f"${amount:,.2f}" if amount >= 0.01 else f"${amount:.6f}"


def _estimate(
    counts: dict[str, int], spec: ModelSpec, configured_price: float | None, *, requeue_failed: bool
) -> Estimate:
    send_inputs = counts["inputs"] - counts["embedded"] - (0 if requeue_failed else counts["failed"])
    send_tokens = counts["tokens"] - counts["embedded_tokens"] - (0 if requeue_failed else counts["failed_tokens"])
    return Estimate(
        model_id=spec.model_id,
        **counts,
        send_inputs=send_inputs,
        send_tokens=send_tokens,
        price_per_million=price_per_million(spec, configured_price),
        tokens_exact=tokens_exact(spec),
        requeues_failed=requeue_failed,
    )


def for_corpus(pool: ConnectionPool, spec: ModelSpec, configured_price: float | None) -> Estimate:
    """`models add`: every current chunk; dead-lettered content stays dead-lettered."""
    with pool.connection() as conn:
        row = estimates.of_corpus(conn, spec.model_id)
    return _estimate(row, spec, configured_price, requeue_failed=False)


def for_documents(
    pool: ConnectionPool,
    spec: ModelSpec,
    configured_price: float | None,
    pks: Sequence[int],
    *,
    requeue_failed: bool = True,
) -> Estimate:
    """The current chunks of some documents (keys); a rerun of the embed stage requeues their
    dead-lettered content, so it is sent too unless ``requeue_failed`` is False."""
    with pool.connection() as conn:
        row = estimates.of_documents(conn, spec.model_id, pks)
    return _estimate(row, spec, configured_price, requeue_failed=requeue_failed)


def for_buckets(
    pool: ConnectionPool,
    spec: ModelSpec,
    configured_price: float | None,
    root: Path | str,
    bucket_ids: Sequence[int],
    bucket_count: int,
) -> Estimate:
    """An embeddings run over some buckets (of ``bucket_count``) of a source: what it enqueues and
    waits for (dead-lettered content stays dead-lettered)."""
    with pool.connection() as conn:
        row = estimates.of_buckets(conn, spec.model_id, root, bucket_ids, bucket_count)
    return _estimate(row, spec, configured_price, requeue_failed=False)


def for_document_ids(
    pool: ConnectionPool,
    spec: ModelSpec,
    configured_price: float | None,
    root: Path | str,
    document_ids: Sequence[str],
) -> Estimate:
    """``for_buckets`` for some documents of a source (ids): the current ones' chunks, what an
    embeddings run over them enqueues and waits for (dead-lettered content stays dead-lettered)."""
    with pool.connection() as conn:
        summaries = reports.document_summaries(conn, str(root), document_ids)
        pks = [s.doc_pk for s in summaries.values() if s.status == "current"]
        row = estimates.of_documents(conn, spec.model_id, pks)
    return _estimate(row, spec, configured_price, requeue_failed=False)
