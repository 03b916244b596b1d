"""Open a checkpoint, then build its model: HF safetensors folder, GGUF file, or the default.

Loading is two steps, so the engine can size the KV cache and choose the attention
implementation from the checkpoint's config before any weight is read:

    source = open_checkpoint(path)          # config, tokenizer, lazy tensors; no weights read
    model = source.build(dtype, decode_attention=..., progress=...)

`load_checkpoint(path, dtype)` does both (tests, tools). The model config and tokenizer
always come from the checkpoint itself; nothing is downloaded.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable, Mapping

import jax.numpy as jnp
import numpy as np

from models.config import ModelConfig
from models.llama import LlamaModel
from models.loaders.common import build_model
from models.tokenizer import Tokenizer

DEFAULT_MODEL = "default"


@dataclasses.dataclass(frozen=True)
class CheckpointSource:
    """An opened checkpoint: everything but the weights, which `tensors` produces on demand."""

    config: ModelConfig
    tokenizer: Tokenizer
    name: str  # served model id: the file or folder stem
    path: str
    tensors: Mapping[str, Callable[[], np.ndarray]]  # our name -> lazily read array, our layout
    # our name -> lazily read (int8 values, f32 scales), where the format stores integer blocks
    int8_tensors: Mapping[str, Callable[[], tuple[np.ndarray, np.ndarray]]] = dataclasses.field(
        default_factory=dict)

    def build(self, dtype=jnp.float32, *, decode_attention: Any = None,
              progress: Callable[[str], None] | None = None, quantization: str = "none") -> LlamaModel:
        """Read, check and place the weights (`models/loaders/common.py`).

        Args:
          dtype: compute dtype of the parameters.
          quantization: "none", "int8" or "w8a8" (`models/quant.py`).
          decode_attention: the attention for one-query steps, fixed in the model's graph
            (None: pure-JAX paged attention; see `models/pallas_attention.py`).
          progress: called with each tensor's name once placed.
        """
        return build_model(self.config, self.tensors, dtype, progress, decode_attention=decode_attention,
                           quantization=quantization, int8_tensors=self.int8_tensors)


@dataclasses.dataclass
class Checkpoint:
    """A built checkpoint (what `load_checkpoint` returns)."""

    config: ModelConfig
    model: LlamaModel
    tokenizer: Tokenizer
    name: str
    path: str


def resolve_path(path: str) -> Path:
    if path == DEFAULT_MODEL:
        from models.loaders.gguf import default_model_path

        return Path(default_model_path())
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"model path does not exist: {p}")
    return p


def open_checkpoint(path: str) -> CheckpointSource:
    """Config, tokenizer and lazy tensors of a checkpoint; no weight is read yet.

    Raises:
      FileNotFoundError, ValueError (not a checkpoint), UnsupportedModelError (an
      architecture, option or tensor type we cannot run).
    """
    p = resolve_path(path)
    if p.is_dir():
        from models.loaders import safetensors as st

        cfg = st.read_config(p)
        return CheckpointSource(cfg, Tokenizer.from_hf_dir(p), p.name, str(p), st.read_tensors(p, cfg))
    if p.suffix == ".gguf":
        from models.loaders.gguf import open_gguf_checkpoint

        cfg, tensors, tokenizer, int8_tensors = open_gguf_checkpoint(p)
        return CheckpointSource(cfg, tokenizer, p.stem, str(p), tensors, int8_tensors)
    raise ValueError(f"unrecognised model path {p}: expected an HF folder with config.json or a .gguf file")


def load_checkpoint(path: str, dtype=jnp.float32, progress: Callable[[str], None] | None = None, *,
                    decode_attention: Any = None, quantization: str = "none") -> Checkpoint:
    """`open_checkpoint(path).build(...)`, returned with its config and tokenizer."""
    source = open_checkpoint(path)
    model = source.build(dtype, decode_attention=decode_attention, progress=progress, quantization=quantization)
    return Checkpoint(source.config, model, source.tokenizer, source.name, source.path)
