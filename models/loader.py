"""Open a checkpoint, then build its model: HF safetensors folder, GGUF file, or the default.

Loading is two steps, so the engine can size the KV cache and choose the attention
implementation from the checkpoint's config before any weight is read:

    source = open_checkpoint(path)          # config, tokenizer, lazy tensors; no weights read
    model = source.build(dtype, decode_attention=..., progress=...)

`load_checkpoint(path, dtype)` does both (tests, tools). The model config and tokenizer
always come from the checkpoint itself; nothing is downloaded.

`open_checkpoint(path, load_format="dummy")` reads only the config (and tokenizer) and
builds random weights on the device instead (`models/loaders/dummy.py`). What an opened
checkpoint is, `CheckpointSource`, lives in `models/checkpoint.py`, which every loader
(this one and the dummy one) builds.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable

import jax.numpy as jnp

from models.checkpoint import CheckpointSource
from models.config import ModelConfig
from models.decoder import CausalLM
from models.tokenizer import Tokenizer

DEFAULT_MODEL = "default"
LOAD_FORMATS = ("auto", "dummy")  # auto: read the checkpoint's weights; dummy: synthetic


@dataclasses.dataclass
class Checkpoint:
    """A built checkpoint (what `load_checkpoint` returns)."""

    config: ModelConfig
    model: CausalLM
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


def open_checkpoint(path: str, load_format: str = "auto", seed: int = 0) -> CheckpointSource:
    """Config, tokenizer and lazy tensors of a checkpoint; no weight is read yet.

    `load_format="dummy"`: only the config and tokenizer are read; `build` makes random
    weights from `seed` on the device (`models/loaders/dummy.py`).

    Raises:
      FileNotFoundError, ValueError (not a checkpoint), UnsupportedModelError (an
      architecture, option or tensor type we cannot run).
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {', '.join(LOAD_FORMATS)}; got {load_format!r}")
    p = resolve_path(path)
    if load_format == "dummy":
        from models.loaders.dummy import open_dummy

        return open_dummy(p, seed)
    if p.is_dir():
        from models.loaders import safetensors as st

        cfg = st.read_config(p)
        return CheckpointSource(cfg, Tokenizer.from_hf_dir(p), p.name, str(p), st.read_tensors(p, cfg),
                                block_tensors=st.read_block_tensors(p, cfg))
    if p.suffix == ".gguf":
        from models.loaders.gguf import forget_vocabulary, open_gguf, open_gguf_checkpoint, release_pages
        from models.loaders.gguf_blocks import gguf_block_tensors

        reader = open_gguf(p)  # parsed once: the default model's metadata takes seconds to read
        cfg, tensors, tokenizer, int8_tensors = open_gguf_checkpoint(reader)
        blocks = gguf_block_tensors(reader, cfg)
        forget_vocabulary(reader)  # the tokenizer is built; the tensors are all the reader still serves
        return CheckpointSource(cfg, tokenizer, p.stem, str(p), tensors, int8_tensors=int8_tensors,
                                block_tensors=blocks, release=lambda: release_pages(reader))
    raise ValueError(f"unrecognised model path {p}: expected an HF folder with config.json or a .gguf file")


def load_checkpoint(path: str, dtype=jnp.float32, progress: Callable[[str], None] | None = None, *,
                    decode_attention: Any = None, quantization: str = "none") -> Checkpoint:
    """`open_checkpoint(path).build(...)`, returned with its config and tokenizer."""
    source = open_checkpoint(path)
    model = source.build(dtype, decode_attention=decode_attention, progress=progress, quantization=quantization)
    return Checkpoint(source.config, model, source.tokenizer, source.name, source.path)
