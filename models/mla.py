"""Multi-head latent attention (DeepSeek-V2/V3, Kimi K2) over a latent paged cache.

The projections, as transformers' `DeepseekV3Attention`:

    q       = q_b_proj(rms_norm(q_a_proj(x)))    or q_proj(x) when q_lora_rank is None
              per head [q_nope (dn) | q_rope (dr)]
    kv_a    = kv_a_proj(x) = [latent (r) | k_rope (dr)]    one shared RoPE key per token
    c       = rms_norm(latent)                   the compressed KV, r = kv_lora_rank
    k_nope, v = per head [W_UK c (dn) | W_UV c (dv)]       from kv_b_proj [r, H*(dn+dv)]
    score   = (q_nope . k_nope + q_rope . k_rope) * scale  scale: (dn+dr)^-0.5, times
                                                           YaRN's mscale^2 (models/yarn.py)

The cache holds per token only what the keys and values are made of: one "head" of width
r + dr, the normed latent followed by the rotated shared key (`[1, N, bs, r+dr]` per layer
in the layout of `ferrox_jax/kv_cache.py`; the V array is zero-width). At DeepSeek-V3's
shape (r 512, dr 64, 128 heads of k 192 / v 128) that is 576 values a token and layer
against 40960 for the expanded heads: 71x less.

Decode and short prompt chunks attend absorbed (`latent_attention`): W_UK moves onto the query,

    q_lat   = q_nope W_UK^T           [N, H, r]   (einsum over dn, per head)
    score   = [q_lat | q_rope] . [c | k_rope]      = q_nope . (W_UK c) + q_rope . k_rope
    o_lat   = sum_s p_s c_s           [N, H, r]
    out     = o_proj(o_lat W_UV)      [N, H*dv] -> [N, D]

so the attention reads the latent cache directly: `models/attention.py:paged_attention`
with one KV head and the same array as keys and values (its value sum yields [c | k_rope]
weighted; the k_rope part is dropped). A query pays H*r multiply-adds per key instead of
H*(dn+dr) (x2.7 at DeepSeek-V3's shape) but never expands the latent; the cache write is
the same either way. Prompt chunks of `EXPAND_PREFILL_FROM` tokens a row or more attend
expanded instead (`expanded_attention`, as vLLM's and SGLang's MLA prefill): each block
chunk of context is expanded once into every head's k_nope and v, then ordinary
multi-head attention; it is cheaper for long chunks over short contexts (the measured
costs beside the constant). The choice is static per segment shape (`mla_attention`):
no extra compile. Every rotation is HF's: with `rope_interleave` (DeepSeek's default)
the rotary dims come in pairs (x0, x1), (x2, x3)...; they are de-interleaved (evens then
odds) before the rotate-half `apply_rope`, which is exactly HF's interleaved rotation
with the output in the de-interleaved order, for q and k alike (the score is unchanged).

Parameters it adds to a decoder layer (HF names after `model.layers.{i}.self_attn.`):

    q_a_proj  [D, qr]           q_a_proj.weight        (q_lora_rank qr; absent when None)
    q_a_norm  [qr]              q_a_layernorm.weight
    q_b_proj  [qr, H*(dn+dr)]   q_b_proj.weight
    q_proj    [D, H*(dn+dr)]    q_proj.weight          (only when q_lora_rank is None)
    kv_a_proj [D, r+dr]         kv_a_proj_with_mqa.weight
    kv_a_norm [r]               kv_a_layernorm.weight
    kv_b_proj [r, H*(dn+dv)]    kv_b_proj.weight
    o_proj    [H*dv, D]         o_proj.weight

Tensor parallelism splits the heads, as vLLM and SGLang do: q_b_proj (or q_proj) and
kv_b_proj are column-split by heads (their columns are head-major), o_proj row-split, so
each device absorbs and attends with its H/M heads; the latent cache is one head, so it
is replicated, as are the small down-projections q_a_proj / kv_a_proj. The compiled tp=4
decode step of the test model all-gathers only the vocab-split logits (and all-reduces
after o_proj and the MLPs): no attention weight or activation moves.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from models.attention import ATTENTION_CHUNK_BLOCKS, load_kv, paged_attention, store_kv
from models.layers import ForwardContext, norm_param, param, project, rms_norm
from models.rope import apply_rope


# Prompt chunks of at least this many tokens a row attend expanded. One layer's attention
# at DeepSeek-V3's head shape (16 heads), best of 7 alternating on a loaded 2-core CPU:
# 128 tokens from position 0 9.9 ms expanded / 16.7 absorbed, after 384 or 896 cached
# 37.9 / 40.9 and 75.3 / 74.0; 64 tokens 8.1 / 8.4 from 0 but 31.0 / 20.4 after 384;
# 32 tokens absorbed always (7.2 / 4.6 from 0). docs/models.md has the table.
EXPAND_PREFILL_FROM = 128


@dataclasses.dataclass(frozen=True)
class MlaSpec:
    """Static description of one layer's latent attention (part of the graphdef)."""

    num_heads: int
    q_lora_rank: int  # 0: a plain q_proj
    kv_lora_rank: int
    nope_dim: int  # dn
    rope_dim: int  # dr
    v_dim: int  # dv
    scale: float
    interleave: bool  # rope dims in interleaved pairs (DeepSeek's rope_interleave)
    norm_eps: float
    # Prompt-chunk segments of at least this many tokens a row attend expanded
    # (`expanded_attention`); shorter ones and decode absorbed. 0: always absorbed.
    expand_from: int = 0

    @property
    def cache_width(self) -> int:
        return self.kv_lora_rank + self.rope_dim


def absorbed_weights(kv_b: jax.Array, spec: MlaSpec) -> tuple[jax.Array, jax.Array]:
    """kv_b_proj [r, H*(dn+dv)] -> (W_UK [r, H, dn], W_UV [r, H, dv]): each head's output
    columns are its k_nope then its v (HF's view(..., H, dn+dv))."""
    per_head = kv_b.reshape(spec.kv_lora_rank, spec.num_heads, spec.nope_dim + spec.v_dim)
    return per_head[..., :spec.nope_dim], per_head[..., spec.nope_dim:]


def deinterleave(x: jax.Array) -> jax.Array:
    """[..., dr] pairs (x0, x1), (x2, x3)... -> [x0, x2, ... | x1, x3, ...]."""
    return jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)


def write_latent(k_cache: jax.Array, entry: jax.Array, blocks: jax.Array, offsets: jax.Array) -> jax.Array:
    """Scatter [n, r+dr] latent entries into a [1, N, bs, r+dr] cache."""
    return k_cache.at[0, blocks, offsets].set(store_kv(entry, k_cache))


def latent_attention(q_nope, q_rope, k_cache, segments, spec: MlaSpec, w_uk, w_uv) -> jax.Array:
    """Absorbed attention of new queries over the latent cache (module docstring).

    Args:
      q_nope: [N, H, dn]; q_rope: [N, H, dr] rotated (and de-interleaved).
      k_cache: [1, num_blocks, bs, r+dr], already holding the new tokens.
      segments: the forward's `Segment`s (`models/layers.py`).
      w_uk, w_uv: [r, H, dn], [r, H, dv] (`absorbed_weights`).
    Returns:
      f32[N, H*dv] (before o_proj).
    """
    n, h = q_nope.shape[:2]
    q_lat = jnp.einsum("nhd,rhd->nhr", q_nope, w_uk.astype(q_nope.dtype), preferred_element_type=jnp.float32)
    q = jnp.concatenate([q_lat.astype(q_rope.dtype), q_rope], axis=-1)  # [N, H, r+dr]
    outs = []
    for seg in segments:
        q_seg = q[seg.start:seg.stop].reshape(seg.rows, seg.tokens, h, spec.cache_width)
        out = paged_attention(q_seg, k_cache, k_cache, seg.block_tables, seg.positions, spec.scale, valid=seg.valid)
        outs.append(out.reshape(seg.rows * seg.tokens, h, spec.cache_width)[..., :spec.kv_lora_rank])
    o_lat = outs[0] if len(outs) == 1 else jnp.concatenate(outs)
    out = jnp.einsum("nhr,rhv->nhv", o_lat, w_uv.astype(jnp.float32), preferred_element_type=jnp.float32)
    return out.reshape(n, h * spec.v_dim)


def expanded_attention(q_nope, q_rope, k_cache, seg, spec: MlaSpec, w_uk, w_uv,
                       chunk_blocks: int = ATTENTION_CHUNK_BLOCKS) -> jax.Array:
    """Expanded attention of one segment's queries over its rows' latent context.

    Walks each row's block table `chunk_blocks` blocks at a time with an online softmax (as
    `paged_attention`; the trip count is traced, so only the blocks up to the furthest query
    are read), and per chunk expands the context's latent into every head's k_nope = W_UK c
    and v = W_UV c: rows x keys x r x H x (dn + dv) multiply-adds, shared by the chunk's T
    queries. The scores are then ordinary multi-head ones, q_nope . k_nope + q_rope . k_rope
    (the rope key shared by the heads): H x T x S x (dn + dr + dv) against the absorbed
    H x T x S x 2(r + dr) (its sum runs over the whole cache entry).

    Args: as `latent_attention`, q_nope / q_rope the segment's own [rows*T, H, dn|dr].
    Returns:
      f32[rows*T, H, dv] (before o_proj).
    """
    b, t, h, r = seg.rows, seg.tokens, spec.num_heads, spec.kv_lora_rank
    qn = q_nope.reshape(b, t, h, spec.nope_dim)
    qr = q_rope.reshape(b, t, h, spec.rope_dim)
    chunk_keys = chunk_blocks * k_cache.shape[2]
    if seg.block_tables.shape[1] % chunk_blocks:
        raise ValueError(f"block table width {seg.block_tables.shape[1]} must be a multiple of {chunk_blocks}")
    w_uk, w_uv = w_uk.astype(q_nope.dtype), w_uv.astype(q_nope.dtype)

    def body(i, carry):
        m, l, acc = carry  # [B, H, T], [B, H, T], [B, H, T, dv]
        blocks = jax.lax.dynamic_slice_in_dim(seg.block_tables, i * chunk_blocks, chunk_blocks, axis=1)
        entry = load_kv(k_cache[0, blocks], q_nope.dtype).reshape(b, chunk_keys, spec.cache_width)
        c, k_rope = entry[..., :r], entry[..., r:]
        k_nope = jnp.einsum("bsr,rhd->bshd", c, w_uk, preferred_element_type=jnp.float32).astype(q_nope.dtype)
        v = jnp.einsum("bsr,rhd->bshd", c, w_uv, preferred_element_type=jnp.float32).astype(q_nope.dtype)
        s = (jnp.einsum("bthd,bshd->bhts", qn, k_nope, preferred_element_type=jnp.float32)
             + jnp.einsum("bthd,bsd->bhts", qr, k_rope, preferred_element_type=jnp.float32)) * spec.scale
        key_pos = i * chunk_keys + jnp.arange(chunk_keys, dtype=jnp.int32)
        s = jnp.where(key_pos[None, None, None, :] <= seg.positions[:, None, :, None], s, -1e30)
        m_new = jnp.maximum(m, s.max(axis=-1))
        p = jnp.exp(s - m_new[..., None])
        correction = jnp.exp(m - m_new)
        pv = jnp.einsum("bhts,bshd->bhtd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
        return m_new, l * correction + p.sum(axis=-1), acc * correction[..., None] + pv

    init = (jnp.full((b, h, t), -1e30, jnp.float32), jnp.zeros((b, h, t), jnp.float32),
            jnp.zeros((b, h, t, spec.v_dim), jnp.float32))
    _, l, acc = jax.lax.fori_loop(0, jnp.max(seg.positions) // chunk_keys + 1, body, init)
    out = acc / jnp.maximum(l, 1e-30)[..., None]
    return out.transpose(0, 2, 1, 3).reshape(b * t, h, spec.v_dim)


def expands(spec: MlaSpec, tokens: int) -> bool:
    """Whether a segment of `tokens` tokens a row attends expanded (decode never does)."""
    return spec.expand_from > 1 and tokens >= spec.expand_from


def mla_attention(q_nope, q_rope, k_cache, segments, spec: MlaSpec, w_uk, w_uv) -> jax.Array:
    """f32[N, H*dv]: each segment absorbed (`latent_attention`) or, a prompt chunk of at
    least `spec.expand_from` tokens a row, expanded; the choice is static per segment shape."""
    expand = [expands(spec, seg.tokens) for seg in segments]
    if not any(expand):
        return latent_attention(q_nope, q_rope, k_cache, segments, spec, w_uk, w_uv)
    outs = []
    for seg, expanded in zip(segments, expand):
        qn, qr = q_nope[seg.start:seg.stop], q_rope[seg.start:seg.stop]
        if expanded:
            out = expanded_attention(qn, qr, k_cache, seg, spec, w_uk, w_uv).reshape(-1, spec.num_heads * spec.v_dim)
        else:
            out = latent_attention(qn, qr, k_cache, (dataclasses.replace(seg, start=0),), spec, w_uk, w_uv)
        outs.append(out)
    return outs[0] if len(outs) == 1 else jnp.concatenate(outs)


class LatentAttention:
    """Mix-in for a decoder layer (an `nnx.Module`): MLA's parameters (table above) and block."""

    def init_attention(self, spec: MlaSpec, hidden: int, dtype, rngs: nnx.Rngs) -> None:
        self.mla_spec = spec
        q_out = spec.num_heads * (spec.nope_dim + spec.rope_dim)
        if spec.q_lora_rank:
            self.q_a_proj = param(rngs, (hidden, spec.q_lora_rank), dtype)
            self.q_a_norm = norm_param(spec.q_lora_rank, dtype)
            self.q_b_proj = param(rngs, (spec.q_lora_rank, q_out), dtype)
        else:
            self.q_proj = param(rngs, (hidden, q_out), dtype)
        self.kv_a_proj = param(rngs, (hidden, spec.cache_width), dtype)
        self.kv_a_norm = norm_param(spec.kv_lora_rank, dtype)
        self.kv_b_proj = param(rngs, (spec.kv_lora_rank, spec.num_heads * (spec.nope_dim + spec.v_dim)), dtype)
        self.o_proj = param(rngs, (spec.num_heads * spec.v_dim, hidden), dtype)

    def attention(self, h: jax.Array, fwd: ForwardContext, k_cache: jax.Array, v_cache: jax.Array):
        """h [N, D] (already normed) -> (o_proj output [N, D], k_cache, v_cache untouched).
        The model's decode kernel, if any, is not used: it reads full heads."""
        spec = self.mla_spec
        n = h.shape[0]
        if spec.q_lora_rank:
            q = project(rms_norm(project(h, self.q_a_proj.get_value()), self.q_a_norm[...], spec.norm_eps),
                        self.q_b_proj.get_value())
        else:
            q = project(h, self.q_proj.get_value())
        q = q.reshape(n, spec.num_heads, spec.nope_dim + spec.rope_dim)
        q_nope, q_rope = q[..., :spec.nope_dim], q[..., spec.nope_dim:]
        kv_a = project(h, self.kv_a_proj.get_value())
        latent = rms_norm(kv_a[:, :spec.kv_lora_rank], self.kv_a_norm[...], spec.norm_eps)
        k_rope = kv_a[:, None, spec.kv_lora_rank:]  # [N, 1, dr]
        if spec.interleave:
            q_rope, k_rope = deinterleave(q_rope), deinterleave(k_rope)
        cos, sin = fwd.rope["global"]
        q_rope, k_rope = apply_rope(q_rope, cos, sin), apply_rope(k_rope, cos, sin)
        entry = jnp.concatenate([latent, k_rope[:, 0].astype(latent.dtype)], axis=-1)
        k_cache = write_latent(k_cache, entry, fwd.kv_blocks, fwd.kv_offsets)
        w_uk, w_uv = absorbed_weights(self.kv_b_proj[...], spec)
        out = mla_attention(q_nope, q_rope, k_cache, fwd.segments, spec, w_uk, w_uv)
        return project(out.astype(h.dtype), self.o_proj.get_value()), k_cache, v_cache
