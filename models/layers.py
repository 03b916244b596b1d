"""Building blocks every family's decoder layer is composed of.

- `project(x, w)`: THE projection matmul. Every q/k/v/o, MLP, router, expert and LM-head
  product goes through it: a float weight is a plain product, a `QuantizedWeight` (int8
  values with per-channel scales, `--quantization`) the int8 matmul of `models/quant.py`,
  a `LoraWeight` its base's product plus each token's adapter (`models/lora.py`).
  Layers read weights with `.get_value()`, which returns either kind.
- `project_many(x, ws, biases)`: several projections of the same x (q/k/v, gate/up): one
  kernel call where every weight is GGUF blocks on the same CPU block kernel
  (`models/gguf_blocks.py`, `block_matmul_many`), else `project` each; the same values.
- Norms: `rms_norm` (Llama: normalise in f32, cast back, then times w) and
  `rms_norm_plus_one` (Gemma: times (1 + w) in f32, then cast).
- MLPs: `gated_mlp(x, gate, up, down, act)` with `silu` (SwiGLU) or `gelu_tanh` (GeGLU);
  the mixture of experts lives in `models/moe.py`.
- Attention: `SelfAttention`, a mix-in that gives a decoder layer the flat parameters
  q_proj/k_proj/v_proj/o_proj (+ q/k/v biases, + an o_proj bias, + per-head q_norm/k_norm,
  + per-head sink logits) and the whole block: project, norm heads, rotate, write the new
  K/V into the paged cache, attend (optionally through a sliding window, with soft-capped
  logits, with attention sinks), project out. With a
  ragged kernel (`models/ragged_attention.py`, `auto` on TPUs and CUDA GPUs) a layer
  attends every row of the forward in one call over the forward's spans; otherwise each
  segment on its own (a one-query kernel for decode rows where it applies, else pure JAX).
  That attending half is `attend(spec, q, k_cache, v_cache, fwd)`, also called by layers
  that build their q/k/v otherwise or read another layer's cache (Gemma 4);
  `AttentionSpec.kernels=False` keeps a layer whose head size is not the kernel's in pure JAX.

Layouts are `x @ W` (`[in, out]`, HF's `[out, in]` transposed); parameter names are flat
per layer (`layers.{i}.q_proj`) so loaders, sharding rules and tests name them one way.
Axis names: N new tokens of one forward (flat: every row's, segment after segment), B rows
and T tokens per row of one segment, D hidden, H query heads, K kv heads, hd head_dim,
F intermediate. Everything but attention works on the flat [N, ...] tokens; attention
looks at each segment's rows as [B, T] (`Segment`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
from flax import nnx

from models.attention import kv_slots, paged_attention, write_kv
from models.ragged_attention import RaggedAttention, RaggedSpans, ragged_spans
from models.gguf_blocks import BlockQuantizedWeight, block_matmul, block_matmul_many, fusable
from models.lora import LoraWeight, project_lora
from models.quant import QuantizedWeight, quantized_matmul
from models.rope import apply_rope


def param(rngs: nnx.Rngs, shape: tuple[int, ...], dtype, scale: float = 0.02) -> nnx.Param:
    """A random parameter (real weights replace it at load; tests build from it)."""
    return nnx.Param((jax.random.normal(rngs.params(), shape, jnp.float32) * scale).astype(dtype))


def norm_param(size: int, dtype, value: float = 1.0) -> nnx.Param:
    return nnx.Param(jnp.full((size,), value, dtype))


def project(x: jax.Array, w: jax.Array | QuantizedWeight | BlockQuantizedWeight | LoraWeight,
            bias: jax.Array | None = None) -> jax.Array:
    """x [..., in] @ w [in, out] (+ bias [out]) -> [..., out]. The one projection matmul.

    A `LoraWeight` (models/lora.py) adds each token's adapter product to its base's; a
    `BlockQuantizedWeight` is a GGUF file's own blocks (models/gguf_blocks.py)."""
    if isinstance(w, LoraWeight) and w.token_slots is None:  # a forward without adapter slots
        return project(x, w.base, bias)
    if isinstance(w, LoraWeight):
        y = project_lora(x, w, project)
        return y if bias is None else y + bias
    if isinstance(w, BlockQuantizedWeight):
        y = block_matmul(x, w)
    else:
        y = quantized_matmul(x, w) if isinstance(w, QuantizedWeight) else x @ w
    return y if bias is None else y + bias


def project_many(x: jax.Array, weights, biases=None) -> list[jax.Array]:
    """[project(x, w, b) for w, b in zip(weights, biases)], as one kernel call when the
    weights are block weights the CPU kernel fuses (`models/gguf_blocks.py`: fusable). A
    LoRA weight of a forward without adapter slots counts as its base."""
    biases = biases or [None] * len(weights)
    plain = [w.base if isinstance(w, LoraWeight) and w.token_slots is None else w for w in weights]
    if not fusable(plain):
        return [project(x, w, b) for w, b in zip(weights, biases)]
    return [y if b is None else y + b for y, b in zip(block_matmul_many(x, plain), biases)]


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm computed in f32, cast back before the weight (as transformers' Llama)."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * xf.astype(x.dtype)


def rms_norm_plus_one(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """Gemma's RMSNorm: the weight is stored as an offset from 1, applied in f32 before the cast."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)


def silu(x: jax.Array) -> jax.Array:
    return jax.nn.silu(x)


def gelu_tanh(x: jax.Array) -> jax.Array:
    """GELU with the tanh approximation (transformers' gelu_pytorch_tanh)."""
    return jax.nn.gelu(x, approximate=True)


def gated_mlp(x: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array,
              act: Callable[[jax.Array], jax.Array]) -> jax.Array:
    """down(act(gate(x)) * up(x)): SwiGLU with silu, GeGLU with gelu_tanh. x [..., D] -> [..., D]."""
    g, u = project_many(x, [gate, up])
    return project(act(g) * u, down)


def softcap(x: jax.Array, cap: float | None) -> jax.Array:
    """cap * tanh(x / cap), or x when cap is None."""
    return x if cap is None else cap * jnp.tanh(x / cap)


@dataclasses.dataclass(frozen=True)
class Segment:
    """Rows of one shape in a forward: `rows` rows of `tokens` new tokens each, stored
    row-major in the flat tokens from index `start` (static ints), with their
    positions i32[B, T], valid bool[B, T] and block tables i32[B, MB]."""

    start: int
    rows: int
    tokens: int
    positions: jax.Array
    valid: jax.Array
    block_tables: jax.Array
    limits: jax.Array | None = None  # i32[B, T] furthest key each query sees (images); None: its position

    @property
    def stop(self) -> int:
        return self.start + self.rows * self.tokens


@dataclasses.dataclass(frozen=True)
class ForwardContext:
    """What every layer of one forward shares (a bundle while tracing, not a pytree).

    Fields:
      segments: the forward's rows, by shape (decode rows of one token, prompt chunks).
      kv_blocks, kv_offsets: i32[N] where each new token's K/V goes (`kv_slots`).
      rope: kind -> (cos, sin) f32[N, rotary_dim]; each layer names the kind it uses.
      decode_attention: the model's attention kernel or None (pure JAX). A one-query
        kernel serves segments of one token per row; a ragged one
        (`models/ragged_attention.py`) every segment of every layer, in one call.
      spans: the forward's rows as ragged spans, when the kernel is a ragged one.
      window: the same forward seen by the sliding-window layers when their K/V live in a
        pool of their own (`ferrox_jax/kv_groups.py`): its tables, slots and spans index
        that pool; None: every layer reads the tables above.
    """

    segments: tuple[Segment, ...]
    kv_blocks: jax.Array
    kv_offsets: jax.Array
    rope: Mapping[str, tuple[jax.Array, jax.Array]]
    decode_attention: Any = None
    spans: RaggedSpans | None = None
    window: "ForwardContext | None" = None

    def for_layer(self, spec: "AttentionSpec") -> "ForwardContext":
        """The context a layer of `spec` writes and reads its K/V through."""
        return self.window if spec.window is not None and self.window is not None else self

    @classmethod
    def build(cls, positions, valid, block_tables, segment_tokens, block_size: int, rope, decode_attention,
              limits=None, rope_positions=None, window_tables=None):
        """From the flat positions i32[N] / valid bool[N], one block table i32[B_s, MB] per
        segment and each segment's tokens per row (static); `rope(positions, valid)` gives
        a segment's cos/sin tables ([B, T, r] per kind), flattened here to [N, r].
        `limits` i32[N]: the furthest key each token sees (a model taking images; None: its
        own position). The ragged kernels do not take limits: such a forward attends in
        pure JAX segment by segment (the one-query kernels still serve decode rows, whose
        limit is their position). `rope_positions` i32[N, 3]: M-RoPE positions, handed to
        `rope` ([B, T, 3] per segment) instead of the positions (None: the positions).
        `window_tables`: one i32[B_s, MB] per segment, the sliding-window pool's slot of each
        block (0 behind the window), or None."""
        if limits is not None and isinstance(decode_attention, RaggedAttention):
            decode_attention = None
        segments, start = [], 0
        for tables, tokens in zip(block_tables, segment_tokens):
            rows = tables.shape[0]
            stop = start + rows * tokens
            seg_limits = None if limits is None or tokens == 1 else limits[start:stop].reshape(rows, tokens)
            segments.append(Segment(start, rows, tokens, positions[start:stop].reshape(rows, tokens),
                                    valid[start:stop].reshape(rows, tokens), tables, seg_limits))
            start = stop
        if start != positions.shape[0]:
            raise ValueError(f"segments hold {start} tokens but the forward has {positions.shape[0]}")
        slots = [kv_slots(s.positions, s.valid, s.block_tables, block_size) for s in segments]
        def flat_tables():
            if rope_positions is None:
                tables = [rope(s.positions, s.valid) for s in segments]
            else:  # the segments' 3-D positions, cut as the flat tokens are
                tables = [rope(rope_positions[s.start:s.start + s.rows * s.tokens].reshape(s.rows, s.tokens, 3),
                               s.valid) for s in segments]
            return {kind: tuple(jnp.concatenate([t[kind][i].reshape(s.rows * s.tokens, -1)
                                                 for s, t in zip(segments, tables)]) for i in (0, 1))
                    for kind in tables[0]}

        flat_rope = computed_once(flat_tables, valid)
        # The spans are built once per forward: every layer's ragged call shares them.
        spans = ragged_spans(segments) if isinstance(decode_attention, RaggedAttention) else None
        window = None
        if window_tables is not None:
            window = cls.build(positions, valid, window_tables, segment_tokens, block_size, rope, decode_attention,
                               limits)
        return cls(tuple(segments), jnp.concatenate([b.reshape(-1) for b, _ in slots]),
                   jnp.concatenate([o.reshape(-1) for _, o in slots]), flat_rope, decode_attention, spans, window)


def computed_once(compute, valid):
    """compute() (the forward's RoPE cos/sin tables), evaluated once per forward: inside a
    conditional whose two branches are that same computation, so the value never depends
    on the predicate. XLA fuses nothing across a branch boundary; left bare, XLA CPU fuses
    the cos/sin into every layer's q and k rotation and evaluates them once per head and
    layer (at 8 decode rows of the 1B: 32 heads x 64 dims x 16 layers of transcendentals,
    ~0.4 ms a layer), and an optimization barrier does not stop it (XLA CPU drops barriers
    before fusing). Only where XLA compiles for the CPU: on an accelerator a conditional can cost
    a round trip to the host, and its recomputed transcendentals were not measured."""
    if jax.default_backend() != "cpu":
        return compute()
    return jax.lax.cond(jnp.any(valid), compute, compute)


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """Static description of one layer's attention (part of the graphdef)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float  # multiplies q.k: head_dim^-0.5, or Gemma's query_pre_attn_scalar^-0.5
    window: int | None = None  # sliding window in keys, or None for full causal attention
    softcap: float | None = None  # attention logit soft-cap, or None
    rope: str = "global"  # which ForwardContext.rope entry rotates q and k
    bias: bool = False  # q/k/v projections carry a bias
    qk_norm: str | None = None  # per-head norm of q and k before RoPE: None, "rms" or "rms_plus_one"
    norm_eps: float = 1e-6
    o_bias: bool = False  # o_proj carries a bias (gpt-oss)
    sinks: bool = False  # one learned logit per query head joins the softmax's denominator (gpt-oss)
    # False: never the model's attention kernel, always pure JAX (a layer whose head size is
    # not the one the kernel was built for: Gemma 4's full layers)
    kernels: bool = True

    @classmethod
    def from_config(cls, cfg, layer: int, **overrides) -> "AttentionSpec":
        fields = dict(num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                      scale=1.0 / math.sqrt(cfg.head_dim), window=cfg.window(layer), bias=cfg.attention_bias,
                      norm_eps=cfg.rms_norm_eps)
        fields.update(overrides)
        return cls(**fields)


_QK_NORMS = {"rms": rms_norm, "rms_plus_one": rms_norm_plus_one}


class SelfAttention:
    """Mix-in for a decoder layer (an `nnx.Module`): attention parameters and the block.

    Parameters it adds (our layouts):
        q_proj [D, H*hd]  k_proj [D, K*hd]  v_proj [D, K*hd]  o_proj [H*hd, D]
        q_bias [H*hd]  k_bias / v_bias [K*hd]      when spec.bias
        q_norm [hd]  k_norm [hd]                   when spec.qk_norm
        o_bias [D]                                 when spec.o_bias
        sinks [H]                                  when spec.sinks
    """

    def init_attention(self, spec: AttentionSpec, hidden: int, dtype, rngs: nnx.Rngs) -> None:
        self.attn_spec = spec
        q_dim, kv_dim = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        self.q_proj = param(rngs, (hidden, q_dim), dtype)
        self.k_proj = param(rngs, (hidden, kv_dim), dtype)
        self.v_proj = param(rngs, (hidden, kv_dim), dtype)
        self.o_proj = param(rngs, (q_dim, hidden), dtype)
        if spec.bias:
            self.q_bias = param(rngs, (q_dim,), dtype)
            self.k_bias = param(rngs, (kv_dim,), dtype)
            self.v_bias = param(rngs, (kv_dim,), dtype)
        if spec.o_bias:
            self.o_bias = param(rngs, (hidden,), dtype)
        if spec.sinks:
            self.sinks = param(rngs, (spec.num_heads,), dtype)
        if spec.qk_norm is not None:
            self.q_norm = norm_param(spec.head_dim, dtype, 1.0 if spec.qk_norm == "rms" else 0.0)
            self.k_norm = norm_param(spec.head_dim, dtype, 1.0 if spec.qk_norm == "rms" else 0.0)

    def _bias(self, name: str) -> jax.Array | None:
        return getattr(self, name)[...] if self.attn_spec.bias else None

    def _out(self, out: jax.Array, dtype) -> jax.Array:
        """The heads' outputs [N, H*hd] through o_proj (and its bias)."""
        return project(out.astype(dtype), self.o_proj.get_value(), self.o_bias[...] if self.attn_spec.o_bias else None)

    def attention(self, h: jax.Array, fwd: ForwardContext, k_cache: jax.Array, v_cache: jax.Array):
        """h [N, D] (already normed) -> (o_proj output [N, D], k_cache, v_cache).

        Every new token's K/V is written first, then each segment's rows attend through
        their block tables (a row reads only its own blocks, so segments never see each
        other's tokens)."""
        spec = self.attn_spec
        n = h.shape[0]
        q, k, v = project_many(h, [self.q_proj.get_value(), self.k_proj.get_value(), self.v_proj.get_value()],
                               [self._bias("q_bias"), self._bias("k_bias"), self._bias("v_bias")])
        q = q.reshape(n, spec.num_heads, spec.head_dim)
        k, v = k.reshape(n, spec.num_kv_heads, spec.head_dim), v.reshape(n, spec.num_kv_heads, spec.head_dim)
        if spec.qk_norm is not None:
            norm = _QK_NORMS[spec.qk_norm]
            q = norm(q, self.q_norm[...], spec.norm_eps)
            k = norm(k, self.k_norm[...], spec.norm_eps)
        cos, sin = fwd.rope[spec.rope]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        fwd = fwd.for_layer(spec)
        k_cache, v_cache = write_kv(k_cache, v_cache, k, v, fwd.kv_blocks, fwd.kv_offsets)
        sinks = self.sinks[...] if spec.sinks else None
        return self._out(attend(spec, q, k_cache, v_cache, fwd, sinks), h.dtype), k_cache, v_cache


class TwoHalves(SelfAttention):
    """Mix-in for a decoder layer that runs in two halves: `attend`, x + attention(norm(x)) over
    every token (it writes their K/V), then `finish`, the layer's MLP or experts, row by row. The
    last layer can then finish only the rows a step reads (`models/decoder.py:CausalLM.__call__`,
    `keep`). The layer defines `finish`, `input_norm` and `eps`; one whose attention half
    differs (Gemma 2's post-attention norm) overrides `attend`."""

    def __call__(self, x, fwd, k_cache, v_cache):
        """x: [N, D] -> ([N, D], k_cache, v_cache)."""
        x, k_cache, v_cache = self.attend(x, fwd, k_cache, v_cache)
        return self.finish(x), k_cache, v_cache

    def attend(self, x, fwd, k_cache, v_cache):
        """The attention half, over every token: x [N, D] -> ([N, D], k_cache, v_cache)."""
        attn, k_cache, v_cache = self.attention(rms_norm(x, self.input_norm[...], self.eps), fwd, k_cache, v_cache)
        return x + attn, k_cache, v_cache

    def finish(self, x):
        """The MLP half, row by row: x [M, D] -> [M, D]."""
        raise NotImplementedError


def attend(spec: AttentionSpec, q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, fwd: ForwardContext,
           sinks: jax.Array | None = None) -> jax.Array:
    """The new tokens' queries q [N, H, hd] (rotated) attend through their rows' block
    tables over a cache the new K/V are already in -> [N, H*hd] (before o_proj).

    A layer may read a cache another layer wrote (Gemma 4's shared-KV layers)."""
    n = q.shape[0]
    if fwd.spans is not None and spec.kernels:  # one ragged call for every row of every segment
        out = fwd.decode_attention(q, k_cache, v_cache, fwd.spans, scale=spec.scale, window=spec.window,
                                   softcap=spec.softcap, sinks=sinks)
        return out.reshape(n, -1)
    outs = []
    for seg in fwd.segments:
        q_seg = q[seg.start:seg.stop].reshape(seg.rows, seg.tokens, spec.num_heads, spec.head_dim)
        # The one-query kernels know neither windows, soft-capping nor sinks: those
        # layers always take the pure-JAX path (models/pallas_attention.py). A kernel
        # with a `chunks` method (the CPU one) serves segments of several tokens a row too.
        plain = spec.window is None and spec.softcap is None and not spec.sinks and spec.kernels
        kernel = fwd.decode_attention if plain else None
        if kernel is not None and seg.tokens == 1:
            out = kernel(q_seg, k_cache, v_cache, seg.block_tables, seg.positions, spec.scale)
        elif kernel is not None and hasattr(kernel, "chunks") and seg.limits is None:
            out = kernel.chunks(q_seg, k_cache, v_cache, seg.block_tables, seg.positions, seg.valid, spec.scale)
        else:
            out = paged_attention(q_seg, k_cache, v_cache, seg.block_tables, seg.positions, spec.scale,
                                  valid=seg.valid, window=spec.window, softcap=spec.softcap, sinks=sinks,
                                  limits=seg.limits)
        outs.append(out.reshape(seg.rows * seg.tokens, -1))
    return outs[0] if len(outs) == 1 else jnp.concatenate(outs)
