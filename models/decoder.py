"""The decoder skeleton every family shares: embed -> layers -> final norm -> LM head.

A family subclasses `CausalLM`, names its decoder layer (`make_layer`) and overrides only
what differs (Gemma scales the embeddings and norms with 1 + w; Gemma 2 soft-caps the
logits; Gemma 3 has a second RoPE for its sliding layers). Layers are unrolled: a Python
loop over `nnx.List` (see the style notes on scan vs unrolled for why).

The model is pure math: it never owns the KV cache. Each call takes the per-layer K/V
block arrays (layout: `ferrox_jax/kv_cache.py`) and block tables, writes the new tokens'
K/V into their blocks, attends through the block tables and returns the updated arrays.
The engine splits the model once (`nnx.split`) and jits the step functions over
(graphdef static, state traced); `cfg` and `decode_attention` are static.

Global parameters (per-layer ones are in each family's module docstring):

    embed                    [V, D]
    final_norm               [D]
    lm_head                  [D, V]        (absent when tie_word_embeddings; the model then
                                            keeps `tied_lm_head`, a transposed copy of embed)

Under `--quantization int8|w8a8` the loader places a `QuantizedWeight` (`models/quant.py`)
for the embedding, an untied LM head and every projection; the model reads them with
`.get_value()` and multiplies through `project` / `embed_lookup`, which take either kind.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from models.config import ModelConfig
from models.layers import ForwardContext, TwoHalves, norm_param, param, project, rms_norm
from models.quant import embed_lookup, tied_head
from models.rope import rope_cos_sin


class CausalLM(nnx.Module):
    """A decoder-only LM over a paged KV cache. Construct under `nnx.eval_shape` to get
    abstract params."""

    final_norm_init = 1.0  # what a norm weight is initialised to (Gemma stores w - 1: 0.0)
    # The step also returns every token's final hidden state (`ferrox_jax/step.py`): set on
    # the instance, before the runner splits it, when `--speculative mtp`'s layer reads them.
    keeps_step_hidden = False

    def __init__(self, cfg: ModelConfig, dtype=jnp.float32, *, rngs: nnx.Rngs, decode_attention=None):
        """`decode_attention`: None for pure-JAX paged attention everywhere, else a hashable
        callable used for one-query-per-row steps (`models/pallas_attention.py`). It is
        static (part of the graphdef), so it is chosen here, when the model is built."""
        self.cfg = cfg
        self.dtype = dtype
        self.embed = param(rngs, (cfg.vocab_size, cfg.hidden_size), dtype)
        self.layers = nnx.List([self.make_layer(i, rngs) for i in range(cfg.num_layers)])
        self.final_norm = norm_param(cfg.hidden_size, dtype, self.final_norm_init)
        if cfg.tie_word_embeddings:
            # A [D, V] copy of the tied embedding, refreshed by the loader: reading [V, D]
            # transposed inside the step made XLA CPU re-transpose it every decode step.
            self.tied_lm_head = nnx.Variable(tied_head(self.embed.get_value()))
        else:
            self.lm_head = param(rngs, (cfg.hidden_size, cfg.vocab_size), dtype)
        self.decode_attention = decode_attention

    # -- what a family overrides -------------------------------------------------------

    def make_layer(self, index: int, rngs: nnx.Rngs) -> nnx.Module:
        """The family's decoder layer for layer `index`: `layer(x [N, D], fwd, k_cache,
        v_cache) -> (x, k_cache, v_cache)` (`fwd`: the forward's `ForwardContext`)."""
        raise NotImplementedError

    def embed_tokens(self, tokens: jax.Array) -> jax.Array:
        return embed_lookup(self.embed.get_value(), tokens, self.dtype)

    def norm(self, x: jax.Array, weight: jax.Array) -> jax.Array:
        return rms_norm(x, weight, self.cfg.rms_norm_eps)

    def rope(self, positions: jax.Array, valid: jax.Array) -> dict[str, tuple[jax.Array, jax.Array]]:
        """cos/sin per kind of RoPE the layers use (constants of the config)."""
        cfg = self.cfg
        return {"global": rope_cos_sin(positions, valid, cfg.rope_dim, cfg.rope_theta, cfg.rope_scaling)}

    def logits(self, hidden: jax.Array) -> jax.Array:
        """hidden [..., D] -> f32[..., V]."""
        w = self.tied_lm_head.get_value() if self.cfg.tie_word_embeddings else self.lm_head.get_value()
        return project(hidden, w).astype(jnp.float32)

    # -- the shared forward --------------------------------------------------------------

    @property
    def finishes_kept_rows(self) -> bool:
        """Whether `__call__` takes `keep`: the family runs this skeleton's forward (not one of
        its own), its last layer comes in two halves (`models/layers.py:TwoHalves`), and no step
        reads every token's final hidden state."""
        return (type(self).__call__ is CausalLM.__call__ and isinstance(self.layers[-1], TwoHalves)
                and not self.keeps_step_hidden)

    def __call__(self, tokens, positions, valid, k_caches, v_caches, block_tables, segment_tokens,
                 images=None, window_tables=None, keep=None):
        """Run the decoder over one forward's new tokens, writing their K/V into the paged cache.

        The tokens are flat: segment after segment, each segment's rows row-major
        (`models/layers.py:Segment`); a segment is `block_tables[s].shape[0]` rows of
        `segment_tokens[s]` tokens.

        Args:
          tokens: i32[N] new token ids (padding anywhere `valid` is False).
          positions: i32[N] absolute position of each token.
          valid: bool[N] which tokens are real; padded ones write into block 0.
          k_caches, v_caches: tuples of L arrays [K, num_blocks, block_size, hd].
          block_tables: one i32[B_s, MB] per segment, block ids per row (0 = null block).
          segment_tokens: tokens per row of each segment (static ints).
          images: None, or (embeds f32[N, D], mask bool[N], limits i32[N]) for a model taking
            images: where `mask` is set the token's embedding is `embeds` (an image's soft
            token from the vision encoder, not scaled as text embeddings are), and each token
            sees keys up to `limits` (an image's tokens see the whole image); a model with
            M-RoPE (Qwen2.5-VL) gets a fourth, its tokens' 3-D rotary positions i32[N, 3], which
            its `rope` takes in place of `positions`.
          window_tables: None, or one i32[B_s, MB] per segment: the sliding-window layers'
            slots (`ferrox_jax/kv_groups.py`), whose cache arrays then hold that pool.
          keep: None, or (index i32[R], every bool[]) on a model whose `finishes_kept_rows`:
            the last layer's attention half runs over every token (their K/V are written) and
            its MLP half over the R tokens `index` names only (a step reads the hidden state at
            each row's last new token; a prompt chunk's other tokens only fill the cache:
            127 of a 128-token chunk's last-layer MLPs, as llama.cpp's `inp_out_ids` skips);
            over every token too where `every` is set (prompt logprobs, pooling).
        Returns:
          (hidden f32/dtype[N, D] after the final norm, k_caches, v_caches); with `keep`,
          (hidden [N, D], zeros unless `every`; hidden [R, D] at `index`; k_caches, v_caches).
        """
        if len(k_caches) != self.cfg.num_layers or len(v_caches) != self.cfg.num_layers:
            raise ValueError(f"expected {self.cfg.num_layers} K and V cache arrays; got {len(k_caches)} "
                             f"and {len(v_caches)}")
        block_size = k_caches[0].shape[2]
        embeds, mask, limits, *rope_positions = images if images is not None else (None, None, None)
        fwd = ForwardContext.build(positions, valid, block_tables, segment_tokens, block_size, self.rope,
                                   self.decode_attention, limits, rope_positions[0] if rope_positions else None,
                                   window_tables)
        x = self.embed_tokens(tokens)
        if embeds is not None:
            x = jnp.where(mask[:, None], embeds.astype(x.dtype), x)
        new_k, new_v = [], []
        last = self.cfg.num_layers - 1 if keep is not None else None
        for i, (layer, k_cache, v_cache) in enumerate(zip(self.layers, k_caches, v_caches)):
            if i == last:
                x, k_cache, v_cache = layer.attend(x, fwd, k_cache, v_cache)
            else:
                x, k_cache, v_cache = layer(x, fwd, k_cache, v_cache)
            new_k.append(k_cache)
            new_v.append(v_cache)
        if keep is None:
            return self.norm(x, self.final_norm[...]), tuple(new_k), tuple(new_v)
        index, every = keep
        layer = self.layers[last]
        kept = self.norm(layer.finish(x[index]), self.final_norm[...])
        # Only the [N, D] result crosses the cond: its untaken branch costs nothing.
        whole = jax.lax.cond(every, lambda: self.norm(layer.finish(x), self.final_norm[...]), lambda: jnp.zeros_like(x))
        return whole, kept, tuple(new_k), tuple(new_v)
