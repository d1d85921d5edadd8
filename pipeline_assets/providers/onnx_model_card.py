"""What a local ONNX model's directory says about the model (``ModelCard``), read once and
checked: the sentence-transformers layout (``model.onnx`` or ``onnx/model.onnx``,
``tokenizer.json``, the pooling, normalisation and window files). Nothing is fetched: a missing
or unusable file is a one-line ``ConfigError``. ``version`` digests all that changes a vector
(the weights, the tokenizer, the window, pooling and normalisation).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from .base import ConfigError

TOKENIZER_FILE = "tokenizer.json"
MODEL_FILES = ("model.onnx", "onnx/model.onnx")
# The window when the model card names none: BERT's position embeddings.
DEFAULT_MAX_SEQ_LENGTH = 512
# Hex digits of the content digest kept in the model id.
VERSION_DIGITS = 12


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
    max_seq = int(st_config.get("max_seq_length") or config.get("max_position_embeddings") or DEFAULT_MAX_SEQ_LENGTH)
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
    return ModelCard(
        directory=d,
        model_file=model_file,
        name=d.resolve().name,
        max_seq_length=max_seq,
        pooling=pooling,
        normalize=normalize,
        dimension=int(dimension) if dimension else None,
        version=version,
    )
