"""An opened checkpoint: everything but its weights, which it reads or makes on demand.

`CheckpointSource` is what every loader returns (`models/loader.py:open_checkpoint` for
HF folders and GGUF files, `models/loaders/dummy.py:open_dummy` for random weights of a
checkpoint's shapes) and what the engine builds its model from (`build`). It sits in a
module of its own because both loaders make one: the loader that dispatches to the dummy
one and the dummy one itself both depend on it, not on each other.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

import jax.numpy as jnp
import numpy as np

from models.config import ModelConfig
from models.decoder import CausalLM
from models.loaders.common import build_model
from models.tokenizer import Tokenizer


@dataclasses.dataclass(frozen=True)
class CheckpointSource:
    """An opened checkpoint: everything but the weights, which `tensors` produces on demand."""

    config: ModelConfig
    tokenizer: Tokenizer
    name: str  # served model id: the file or folder stem
    path: str
    tensors: Mapping[str, Callable[[], np.ndarray]]  # our name -> lazily read array, our layout
    builder: Callable[..., CausalLM] | None = None  # makes the weights instead of reading tensors
    is_synthetic: bool = False  # random weights (--load-format dummy): outputs are meaningless
    # our name -> lazily read (int8 values, f32 scales), where the format stores integer blocks
    int8_tensors: Mapping[str, Callable[[], tuple[np.ndarray, np.ndarray]]] = dataclasses.field(
        default_factory=dict)
    # our name -> lazily read GGUF block rows (u8[out, row bytes], format), for quantization "gguf"
    block_tensors: Mapping[str, Callable[[], tuple[np.ndarray, str]]] = dataclasses.field(default_factory=dict)
    # Called once a build has placed the weights: gives back the host pages the build read
    # (a GGUF's memory-mapped file, `models/loaders/gguf.py:release_pages`); None: nothing to give.
    release: Callable[[], None] | None = None

    def build(self, dtype=jnp.float32, *, decode_attention: Any = None,
              progress: Callable[[str], None] | None = None, placement: Any = None,
              quantization: str = "none") -> CausalLM:
        """Read, check and place the weights (`models/loaders/common.py`), or make them.

        Args:
          dtype: compute dtype of the parameters.
          quantization: "none", "int8", "w8a8" (`models/quant.py`) or "gguf"
            (`models/gguf_blocks.py`).
          decode_attention: the attention for one-query steps, fixed in the model's graph
            (None: pure-JAX paged attention; see `models/pallas_attention.py`).
          progress: called with each tensor's name once placed.
          placement: `placement(name, shape)` -> sharding, for weights made on the device;
            read weights ignore it (the runner places them).
        """
        if self.builder is not None:
            return self.builder(dtype, decode_attention=decode_attention, progress=progress, placement=placement,
                                quantization=quantization)
        model = build_model(self.config, self.tensors, dtype, progress, decode_attention=decode_attention,
                            quantization=quantization, int8_tensors=self.int8_tensors,
                            block_tensors=self.block_tensors)
        if self.release is not None:
            self.release()
        return model
