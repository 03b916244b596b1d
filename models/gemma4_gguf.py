"""Gemma 4 from a GGUF file: llama.cpp's `gemma4` architecture read into `Gemma4Config`'s fields,
and its tensor names.

llama.cpp's converter (`conversion/gemma.py:Gemma4Model`, read back by `src/models/gemma4.cpp`)
writes what models/gemma4.py needs as these keys (`gemma4.` prefix) and tensors:

    layer kinds         attention.sliding_window_pattern  per-layer booleans (true: sliding)
    window              attention.sliding_window
    head sizes          attention.key_length (full layers), attention.key_length_swa (sliding);
                        value_length(_swa) must equal them
    kv heads            attention.head_count_kv           one number, or one per layer
    shared-KV layers    attention.shared_kv_layers        the last n layers read earlier caches
    MLP widths          feed_forward_length               one number, or one per layer (the
                                                          shared layers twice as wide with
                                                          use_double_wide_mlp)
    per-layer inputs    embedding_length_per_layer_input  P; per_layer_token_embd [V', L*P],
                                                          per_layer_model_proj, per_layer_proj_norm
    RoPE                rope.freq_base (full), rope.freq_base_swa (sliding),
                        rope.dimension_count(_swa) = the head sizes; the full layers' partial
                        ("proportional") RoPE is the tensor rope_freqs.weight [head/2]: 1 for each
                        rotated frequency pair, 1e30 (never turns) for the rest
    soft-capping        final_logit_softcapping
    experts             expert_count, expert_used_count, expert_feed_forward_length; the router
                        ffn_gate_inp (+ .scale), the stacks ffn_gate_up_exps / ffn_down_exps
                        (+ ffn_down_exps.scale: the per-expert scale)
    keys serve as       full layers without attn_v.weight (llama.cpp's "use_alternative_attention")
      values
    layer_scalar        layer_output_scale.weight

Norm weights are stored as they are (Gemma 4 multiplies by w, not 1 + w), rows unpermuted.

What the converter drops and cannot be recovered is refused at load, by name: RoPE scaling on top
of proportional RoPE (`rope.scaling.type`; the converter keeps no proportional factor), partial
RoPE on the sliding layers (`rope.dimension_count_swa` below the head size), a `rope_freqs.weight`
that is not ones then 1e30s, feed-forward widths other than one width (or it and its double on the
shared layers), full layers that disagree on having values.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from models.config import FULL_ATTENTION, SLIDING_ATTENTION, RopeScaling, UnsupportedModelError
from models.gemma2 import GGUF_LAYER_WEIGHTS as GEMMA_GGUF_LAYER_WEIGHTS, gguf_sliding_layers
from models.family import ExpertStack

ARCH = "gemma4"
_NEVER_TURNS = 1e29  # at least this: the converter's 1e30, the factor of a pair proportional RoPE never turns


def _per_layer(value: Any, n: int, key: str) -> tuple[int, ...]:
    values = tuple(int(v) for v in value) if isinstance(value, list) else (int(value),) * n
    if len(values) != n:
        raise UnsupportedModelError(f"GGUF {ARCH}.{key} has {len(values)} values for {n} layers")
    return values


def _rope_partial(meta, head_dim: int) -> tuple[str, float]:
    """(RoPE type, partial factor) of the full layers from `rope_freqs.weight` (module docstring)."""
    factors = meta.tensor("rope_freqs.weight")
    if factors is None:
        return "default", 1.0
    factors = np.asarray(factors, np.float64).reshape(-1)
    rotated = int(np.sum(factors == 1.0))
    if factors.shape != (head_dim // 2,) or not (np.all(factors[:rotated] == 1.0)
                                                  and np.all(factors[rotated:] >= _NEVER_TURNS)):
        raise UnsupportedModelError(f"GGUF {ARCH} rope_freqs.weight is not the converter's proportional RoPE "
                                    f"(ones, then 1e30s, {head_dim // 2} in all); other frequency factors are "
                                    "not supported")
    return "proportional", 2 * rotated / head_dim


def _check_rope(meta, full_dim: int, swa_dim: int) -> None:
    kind = meta.get(f"{ARCH}.rope.scaling.type", "none")
    if kind not in ("none", ""):
        raise UnsupportedModelError(f"GGUF {ARCH}.rope.scaling.type {kind!r} is not supported: Gemma 4 is served "
                                    "with proportional or default RoPE only")
    for key, head in (("rope.dimension_count", full_dim), ("rope.dimension_count_swa", swa_dim)):
        rot = int(meta.get(f"{ARCH}.{key}", head))
        if rot != head:
            raise UnsupportedModelError(f"GGUF {ARCH}.{key} {rot} below the head size {head} is not supported "
                                        "(partial RoPE comes from rope_freqs.weight on the full layers only)")


def _mlp_widths(meta, n: int, first_shared: int) -> tuple[int, bool]:
    """(intermediate size, double-wide MLP on the shared layers) from feed_forward_length."""
    widths = _per_layer(meta.require(f"{ARCH}.feed_forward_length"), n, "feed_forward_length")
    base = widths[0]
    if all(w == base for w in widths):
        return base, False
    if first_shared < n and all(w == (base if i < first_shared else 2 * base) for i, w in enumerate(widths)):
        return base, True
    raise UnsupportedModelError(f"GGUF {ARCH}.feed_forward_length {list(widths)} is not supported: one width, "
                                "or it doubled on the shared-KV layers")


def _keys_are_values(meta, types: tuple[str, ...], first_shared: int) -> bool:
    full = [i for i in range(first_shared) if types[i] == FULL_ATTENTION]
    has_v = {meta.has_tensor(f"blk.{i}.attn_v.weight") for i in full}
    if len(has_v) > 1:
        raise UnsupportedModelError(f"GGUF {ARCH}: some full-attention layers have attn_v.weight and some do not; "
                                    "not supported")
    return has_v == {False}


def config_fields(meta, fields: dict) -> dict[str, Any]:
    """`Gemma4Config` keyword arguments from the metadata and the loader's shared fields (which
    hold the first layer's value of each per-layer array)."""
    n = fields["num_layers"]
    types = gguf_sliding_layers(meta, n, 6)
    full_dim = int(meta.require(f"{ARCH}.attention.key_length"))
    swa_dim = int(meta.get(f"{ARCH}.attention.key_length_swa", full_dim))
    for key, want in (("value_length", full_dim), ("value_length_swa", swa_dim)):
        if int(meta.get(f"{ARCH}.attention.{key}", want)) != want:
            raise UnsupportedModelError(f"GGUF {ARCH}.attention.{key} differs from the key length; not supported")
    _check_rope(meta, full_dim, swa_dim)
    kv_heads = _per_layer(meta.get(f"{ARCH}.attention.head_count_kv", fields["num_heads"]), n,
                          "attention.head_count_kv")
    shared = int(meta.get(f"{ARCH}.attention.shared_kv_layers", 0) or 0)
    intermediate, double_wide = _mlp_widths(meta, n, n - shared)
    rope_type, partial = _rope_partial(meta, full_dim)
    sliding = [i for i in range(n) if types[i] == SLIDING_ATTENTION]
    ple_dim = int(meta.get(f"{ARCH}.embedding_length_per_layer_input", 0) or 0)
    ple_shape = meta.tensor_shape("per_layer_token_embd.weight") if ple_dim else None
    experts = int(meta.get(f"{ARCH}.expert_count", 0) or 0)
    if experts and not meta.has_tensor("blk.0.ffn_gate_inp.weight"):
        experts = 0  # the converter writes the count from the config even with the MoE block off
    head_dims = tuple(swa_dim if t == SLIDING_ATTENTION else full_dim for t in types)
    return dict(
        fields, head_dim=swa_dim, num_kv_heads=kv_heads[sliding[0]] if sliding else kv_heads[0],
        intermediate_size=intermediate, rope_scaling=RopeScaling(), rotary_dim=None,
        sliding_window=int(meta.get(f"{ARCH}.attention.sliding_window", 512)), layer_types=types,
        final_logit_softcap=meta.get(f"{ARCH}.final_logit_softcapping"), layer_head_dims=head_dims,
        layer_kv_heads=kv_heads, k_eq_v=_keys_are_values(meta, types, n - shared),
        rope_local_theta=float(meta.get(f"{ARCH}.rope.freq_base_swa", 10000.0)), rope_global_type=rope_type,
        rope_global_partial=partial, rope_global_factor=1.0, num_kv_shared_layers=shared,
        double_wide_mlp=double_wide, ple_dim=ple_dim,
        ple_vocab=int(ple_shape[0]) if ple_shape else fields["vocab_size"],
        num_experts=experts, top_k=int(meta.get(f"{ARCH}.expert_used_count", 0) or 0) if experts else 0,
        moe_intermediate_size=int(meta.get(f"{ARCH}.expert_feed_forward_length", 0) or 0) if experts else 0)


GGUF_LAYER_WEIGHTS = {
    **GEMMA_GGUF_LAYER_WEIGHTS,
    "attn_q_norm.weight": "q_norm",
    "attn_k_norm.weight": "k_norm",
    "inp_gate.weight": "ple_gate",
    "proj.weight": "ple_proj",
    "post_norm.weight": "ple_norm",
    "ffn_gate_inp.weight": "router",
    "ffn_gate_inp.scale": "router_scale",
    "ffn_down_exps.scale": "expert_scale",
    "ffn_gate_up_exps.weight": ExpertStack(("experts_gate_up",), transpose=True),
    "ffn_down_exps.weight": ExpertStack(("experts_down",), transpose=True),
    "post_ffw_norm_1.weight": "post_mlp_norm_1",
    "pre_ffw_norm_2.weight": "pre_moe_norm",
    "post_ffw_norm_2.weight": "post_moe_norm",
    "layer_output_scale.weight": "layer_scalar",
}
GGUF_GLOBAL_WEIGHTS = {  # GGUF name -> (ours, transposed), as HF_GLOBAL_WEIGHTS
    "per_layer_token_embd.weight": ("ple_embed", False),
    "per_layer_model_proj.weight": ("ple_model_proj", True),
    "per_layer_proj_norm.weight": ("ple_proj_norm", False),
}
