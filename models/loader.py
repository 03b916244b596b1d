"""Load a checkpoint: HF safetensors folder, GGUF file, or the embedded default model.

`load_checkpoint(path, dtype)` returns config, model and tokenizer. The model config
and tokenizer always come from the checkpoint itself; nothing is downloaded.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable

import jax.numpy as jnp

from models.config import ModelConfig
from models.llama import LlamaModel
from models.loaders.common import build_model
from models.tokenizer import Tokenizer

DEFAULT_MODEL = "default"


@dataclasses.dataclass
class Checkpoint:
    config: ModelConfig
    model: LlamaModel
    tokenizer: Tokenizer
    name: str  # served model id: the file or folder stem
    path: str


def resolve_path(path: str) -> Path:
    if path == DEFAULT_MODEL:
        from models.loaders.gguf import default_model_path

        return Path(default_model_path())
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"model path does not exist: {p}")
    return p


def load_checkpoint(path: str, dtype=jnp.float32, progress: Callable[[str], None] | None = None) -> Checkpoint:
    p = resolve_path(path)
    if p.is_dir():
        from models.loaders import safetensors as st

        cfg = st.read_config(p)
        model = build_model(cfg, st.read_tensors(p, cfg), dtype, progress)
        tokenizer = Tokenizer.from_hf_dir(p)
        name = p.name
    elif p.suffix == ".gguf":
        from models.loaders.gguf import load_gguf

        cfg, model, tokenizer = load_gguf(p, dtype, progress=progress)
        name = p.stem
    else:
        raise ValueError(f"unrecognised model path {p}: expected an HF folder with config.json or a .gguf file")
    return Checkpoint(cfg, model, tokenizer, name, str(p))
