"""DeepSeek-V3's multi-token-prediction (MTP) layer: the draft of `--speculative mtp`.

DeepSeek-V3 checkpoints append `num_nextn_predict_layers` (1) layers after the decoder's,
at index n = num_hidden_layers (`model.layers.61.*` in DeepSeek-V3); transformers ignores
them and the main model skips them (`models/deepseek_v3.py`). For position i, given the
main model's final hidden state h_i (after its final norm, as vLLM and SGLang feed it) and
the token x_{i+1} that follows, the layer predicts x_{i+2}:

    e   = enorm(embed(x_{i+1}))            zero at position 0, as vLLM's DeepSeekMTP does
    x   = eh_proj([e | hnorm(h_i)])        [2D] -> [D]
    x   = decoder_layer(x)                 one full DeepSeek-V3 layer at position i
                                           (latent attention over its own latent cache, MoE)
    out = shared_head.head(shared_head.norm(x))    logits for x_{i+2}

and `x` (before shared_head.norm) is the hidden state a second prediction takes in place of
h (k > 1 drafts reuse the one layer, as vLLM does).

Tensors read (after `model.layers.{n}.`; the names of the released checkpoints):

    enorm.weight                [D]
    hnorm.weight                [D]
    eh_proj.weight              [D, 2D]   -> ours [2D, D]; its input is [embedding | hidden]
    shared_head.norm.weight     [D]       absent: the main model's final norm
    shared_head.head.weight     [V, D]    -> [D, V]; absent: the main model's LM head
    embed_tokens.weight         [V, D]    absent: the main model's embedding (V3 ships a copy)
    input_layernorm, post_attention_layernorm, self_attn.*, mlp.*: the decoder layer's, under
                                the names of `models/deepseek_v3.py:HF_LAYER_WEIGHTS`

A GGUF file's layer (llama.cpp's `deepseek2` at block n: the decoder layer's tensors and
`blk.{n}.nextn.*`) is read by models/loaders/gguf_mtp.py under `GGUF_MTP_WEIGHTS`.

The weights are placed in the compute dtype whatever `--quantization` says (one layer).
Under tensor parallelism (`ferrox_jax/mtp.py`, "Tensor parallelism") the layer splits as the
model's own layers; eh_proj and the head split by output column, their products pinned split
then whole (`gathered`: one all-gather each), so the layer's residual stream stays replicated.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.deepseek_v3 import HF_LAYER_WEIGHTS, DeepseekV3Config, DeepseekV3DecoderLayer
from models.layers import ForwardContext, norm_param, param, project, rms_norm
from models.loaders.shards import shard_tensors
from models.mtp_weights import NoMtpLayerError, fill_mtp, our_mtp_tensors
from models.quant import embed_lookup
from models.rope import rope_cos_sin
from models.yarn import yarn_cos_sin

MTP_WEIGHTS = {  # HF suffix after model.layers.{n}. -> (ours, transposed)
    "enorm.weight": ("enorm", False),
    "hnorm.weight": ("hnorm", False),
    "eh_proj.weight": ("eh_proj", True),
    "shared_head.norm.weight": ("head_norm", False),
    "shared_head.head.weight": ("head", True),
    "embed_tokens.weight": ("embed", False),
}
# llama.cpp's names for them in a GGUF (`blk.{n}.nextn.*`, models/loaders/gguf_mtp.py)
GGUF_MTP_WEIGHTS = {
    "nextn.enorm.weight": ("enorm", False),
    "nextn.hnorm.weight": ("hnorm", False),
    "nextn.eh_proj.weight": ("eh_proj", True),
    "nextn.shared_head_norm.weight": ("head_norm", False),
    "nextn.shared_head_head.weight": ("head", True),
    "nextn.embed_tokens.weight": ("embed", False),
}


def gathered(x: jax.Array, shardings) -> jax.Array:
    """x [R, N], the product of a column-split projection (fc / eh_proj, the head), kept split
    over N where it is computed and then gathered whole on every device: one all-gather of
    [R, N] (`shardings`: (split, replicated); None on one device: x). Without the first
    constraint XLA may gather the weight instead, and without the second it carries the
    layer's residual stream split, paying a reduction and a gather at every norm after."""
    if shardings is None:
        return x
    split, whole = shardings
    return jax.lax.with_sharding_constraint(jax.lax.with_sharding_constraint(x, split), whole)


class DeepseekMtp(nnx.Module):
    """The MTP layer (module docstring): `__call__` runs one-token rows over its latent cache."""

    def __init__(self, cfg: DeepseekV3Config, dtype, rngs: nnx.Rngs):
        d, v = cfg.hidden_size, cfg.vocab_size
        self.cfg = cfg
        self.dtype = dtype
        self.embed = param(rngs, (v, d), dtype)
        self.enorm = norm_param(d, dtype)
        self.hnorm = norm_param(d, dtype)
        self.eh_proj = param(rngs, (2 * d, d), dtype)
        self.layer = DeepseekV3DecoderLayer(cfg, cfg.num_layers, dtype, rngs)
        self.head_norm = norm_param(d, dtype)
        self.head = param(rngs, (d, v), dtype)
        self.gather_shardings = None  # on a mesh: (split, replicated), set by ferrox_jax/mtp.py (`gathered`)

    def rope(self, positions, valid):
        cfg = self.cfg
        if cfg.yarn is not None:
            return {"global": yarn_cos_sin(positions, cfg.qk_rope_head_dim, cfg.rope_theta, cfg.yarn)}
        return {"global": rope_cos_sin(positions, valid, cfg.rope_dim, cfg.rope_theta, cfg.rope_scaling)}

    def __call__(self, tokens, positions, valid, hidden, k_cache, block_tables):
        """R one-token rows: tokens / positions / valid [R], the main model's hidden [R, D],
        k_cache [1, blocks, bs, r+dr], block_tables i32[R, MB] -> (x [R, D], k_cache).
        Every row's latent is written before any row attends (`models/mla.py`), so rows
        of one sequence at consecutive positions see each other causally."""
        fwd = ForwardContext.build(positions, valid, (block_tables,), (1,), k_cache.shape[2], self.rope, None)
        e = embed_lookup(self.embed.get_value(), tokens, self.dtype)
        e = jnp.where((positions == 0)[:, None], jnp.zeros_like(e), e)
        eps = self.cfg.rms_norm_eps
        x = jnp.concatenate([rms_norm(e, self.enorm[...], eps), rms_norm(hidden.astype(e.dtype), self.hnorm[...], eps)],
                            axis=-1)
        x = gathered(project(x, self.eh_proj.get_value()), self.gather_shardings)
        x, k_cache, _ = self.layer(x, fwd, k_cache, jnp.zeros(k_cache.shape[:3] + (0,), k_cache.dtype))
        return x, k_cache

    def draft_step(self, tokens, positions, valid, hidden, k_cache, v_cache, block_tables):
        """The MTP draft's call (`ferrox_jax/mtp.py`, shared with models/qwen3_5_mtp.py):
        `__call__`, the latent cache's empty V array passed through."""
        x, k_cache = self(tokens, positions, valid, hidden, k_cache, block_tables)
        return x, k_cache, v_cache

    def logits(self, x: jax.Array) -> jax.Array:
        """x [R, D] -> f32[R, V] (shared_head)."""
        logits = project(rms_norm(x, self.head_norm[...], self.cfg.rms_norm_eps), self.head.get_value())
        return gathered(logits, self.gather_shardings).astype(jnp.float32)


def mtp_tensors(folder: Path, cfg: DeepseekV3Config) -> dict[str, Callable[[], np.ndarray]]:
    """{our name (relative to `DeepseekMtp`): lazy array in our layout} of the checkpoint's
    first MTP layer (`folder`: a checkpoint folder, or a GGUF file's `nextn` block); raises
    NoMtpLayerError when it has none."""
    n = cfg.num_layers
    if folder.suffix == ".gguf":  # the block's decoder layer is an MoE one, as layer n is
        from models.loaders.gguf_mtp import gguf_mtp_tensors  # the gguf package only for a GGUF file

        return gguf_mtp_tensors(folder, cfg, dataclasses.replace(cfg, num_layers=1, dense_layers=()),
                                GGUF_MTP_WEIGHTS)
    layer_re = re.compile(rf"^model\.layers\.{n}\.(.+)$")
    loads = shard_tensors(folder, lambda name: m.group(1) if (m := layer_re.match(name)) else None)
    if "eh_proj.weight" not in loads:
        raise NoMtpLayerError(
            f"{folder.name} has no multi-token-prediction layer (no model.layers.{n}.eh_proj.weight; "
            "num_nextn_predict_layers is 0 or its weights were not saved): --speculative mtp needs "
            "one; use --speculative ngram or --speculative draft")
    return our_mtp_tensors(loads, MTP_WEIGHTS, lambda suffix: suffix, HF_LAYER_WEIGHTS,
                           getattr(cfg, "num_experts", None),
                           lambda suffix: f"MTP layer tensor model.layers.{n}.{suffix} is not one we know")


def load_mtp(folder: str | Path, cfg: DeepseekV3Config, target, dtype) -> DeepseekMtp:
    """The MTP layer of the checkpoint in `folder`, in `dtype`; what it does not ship (the
    shared head, the embedding) from `target` (the main model, a `CausalLM`)."""
    tensors = mtp_tensors(Path(folder), cfg)
    model = nnx.eval_shape(lambda: DeepseekMtp(cfg, dtype, nnx.Rngs(0)))
    fallback = {"embed": target.embed, "head_norm": target.final_norm,
                "head": target.tied_lm_head if cfg.tie_word_embeddings else target.lm_head}
    return fill_mtp(model, tensors, fallback, dtype)
