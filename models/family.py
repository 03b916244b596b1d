"""What a model family is to the rest of the engine: its model class, how its config is
read and how its checkpoint tensors are named. Each family module ends with one
`FAMILY = Family(...)`; `models/registry.py` indexes them by architecture name.

A family with global tensors beyond the embedding, final norm and LM head names them in
`hf_global_weights` (Gemma 4's per-layer input tables).

Weight tables map a checkpoint tensor name (HF: the suffix after `model.layers.{i}.`;
GGUF: the suffix after `blk.{i}.`) to ours (`layers.{i}.<name>`):
- a string: one parameter;
- a tuple of names: a fused tensor split by rows into these parameters, each taking as
  many rows as its expected output width (Phi-3's qkv_proj into q/k/v, gate_up_proj
  into gate/up);
- a key containing `{e}`: one tensor per expert, stacked into one `[E, ...]` parameter;
- an `ExpertStack`: one tensor holding every expert already stacked (gpt-oss's HF
  experts, llama.cpp's `*_exps`), possibly two parameters interleaved along its last axis.
Projection weights are transposed from `[out, in]` to our `[in, out]` on the way.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

from models.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class ExpertStack:
    """A checkpoint tensor `[E, ...]` holding every expert of one (or more) of our stacks.

    `transpose`: it is `[E, out, in]` (llama.cpp), each expert transposed to our `[in, out]`;
    else it is already ours (`[E, in, out]`, or a bias `[E, n]`). With several `names` its
    last axis interleaves them: column j belongs to names[j % len(names)] (gpt-oss's
    gate_up_proj: even columns gate, odd columns up); with `halves`, it concatenates them
    instead, each an equal run of columns in order (Llama 4's gate_up_proj: gate then up)."""

    names: tuple[str, ...]
    transpose: bool = False
    halves: bool = False


WeightTable = Mapping[str, "str | tuple[str, ...] | ExpertStack"]


@dataclasses.dataclass(frozen=True)
class Family:
    name: str  # short name, as in docs/models.md
    model: type  # the CausalLM subclass
    architectures: tuple[str, ...]  # HF config.json architectures[0] values
    config_from_hf: Callable[[dict], ModelConfig]
    hf_layer_weights: WeightTable
    # HF global tensors beyond embed / final norm / LM head: HF name -> (ours, transposed)
    hf_global_weights: Mapping[str, tuple[str, bool]] = dataclasses.field(default_factory=dict)
    gguf_architectures: Mapping[str, str] = dataclasses.field(default_factory=dict)  # GGUF arch -> HF name
    # (metadata, common fields) -> config; metadata: models.gguf_metadata.GGUFMetadata
    config_from_gguf: Callable[[Any, dict], ModelConfig] | None = None
    gguf_layer_weights: WeightTable = dataclasses.field(default_factory=dict)
    gguf_non_parameters: tuple[str, ...] = ()  # GGUF tensors read as config, not weights
    # GGUF global tensors beyond token_embd / output_norm / output: GGUF name -> (ours, transposed)
    gguf_global_weights: Mapping[str, tuple[str, bool]] = dataclasses.field(default_factory=dict)
    # Its config_from_gguf reads per-layer arrays (kv heads, feed-forward widths) and rope_freqs.weight
    # itself: the loader's shared fields then hold the first layer's value instead of refusing them.
    gguf_layer_arrays: bool = False
    gguf_norm_offset: float = 0.0  # GGUF stores norm weights as ours + this (llama.cpp's Gemma: 1)
    gguf_qk_permuted: tuple[str, ...] = ()  # GGUF archs whose q/k rows llama.cpp interleaved (llama)
    # Its GGUF architectures are the files with experts (`{arch}.expert_count` > 0): llama.cpp
    # writes Mixtral as `llama`, told apart from a dense Llama only by that key.
    gguf_experts: bool = False
    # (tensors, config): rewrites the GGUF tensors in place after the name tables, for tensors
    # split or laid out differently from ours (deepseek2's attn_k_b / attn_v_b -> kv_b_proj,
    # Qwen3.5's DeltaNet heads) or layers we do not run; None: nothing to rewrite
    gguf_merge: Callable[[dict, ModelConfig], None] | None = None
    # (pairs, config) -> {(layer, ours): {"A", "B"}}: a GGUF LoRA adapter's tensors whose layout the
    # converter changed as it changed the base weights' (Qwen3.5's DeltaNet tensors), taken out of
    # `pairs` ({(layer, GGUF suffix): {"A", "B"}}) and put back in the checkpoint's layout
    # (`models/lora_gguf.py`); the rest map through gguf_layer_weights. None: nothing to rewrite
    gguf_adapter_merge: Callable[[dict, ModelConfig], dict] | None = None
    # HF layers past num_hidden_layers are skipped, not refused (DeepSeek-V3's multi-token-prediction layer)
    hf_skips_extra_layers: bool = False
    # HF tensor name prefixes the main model's loader skips: a side block another reader loads
    # (Qwen3.5's and Qwen3-Next's multi-token-prediction block, `mtp.*`: models/qwen3_5_mtp.py)
    hf_skipped_prefixes: tuple[str, ...] = ()
