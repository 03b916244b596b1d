"""The multi-token-prediction (MTP) block of Qwen3.5, Qwen3.5-MoE and Qwen3-Next: the draft of
`--speculative mtp` for them (`ferrox_jax/mtp.py` runs it).

Their checkpoints ship it beside the model under `mtp.*` (config `mtp_num_hidden_layers: 1`;
Qwen3-Next's config does not say, its tensors do); transformers ignores those tensors and the
main model's loader skips them (`Family.hf_skipped_prefixes`: `models/qwen3_5.py:MTP_PREFIXES`).
For position i, given the main model's final hidden state h_i (after its final norm, as vLLM
feeds it) and the token x_{i+1} that follows, the block predicts x_{i+2}, as vLLM's
`Qwen3NextMultiTokenPredictor` / `Qwen3_5MultiTokenPredictor` define it:

    e   = pre_fc_norm_embedding(embed(x_{i+1}))      RMSNorm times (1 + w); the main model's
                                                     embedding (no zeroing at position 0)
    x   = fc([e | pre_fc_norm_hidden(h_i)])          [2D] -> [D]: the embedding first
    x   = decoder_layer(x)                           one layer of the model's full-attention
                                                     kind at position i: gated attention, q/k
                                                     norms, partial RoPE, over a K/V cache of
                                                     its own; the MoE MLP for the MoE models
    out = norm(x)                                    RMSNorm times (1 + w)
    logits = lm_head(out)                            the main model's LM head (tied: its embedding)

and `out` is the hidden state a second prediction takes in place of h (k > 1 drafts reuse the
one layer, as vLLM does).

Tensors read (after `mtp.`; `model.mtp.` is read the same):

    fc.weight                     [D, 2D]  -> ours [2D, D]; its input is [embedding | hidden]
    pre_fc_norm_embedding.weight  [D]      -> enorm
    pre_fc_norm_hidden.weight     [D]      -> hnorm
    norm.weight                   [D]      -> head_norm
    layers.0.*                    the decoder layer's, under the family's layer names
                                  (`models/qwen3_5.py`, `models/qwen3_next.py`); a second layer
                                  (mtp_num_hidden_layers > 1) is refused, naming its tensor

A GGUF file's block (llama.cpp's converter writes it as `blk.{n}.nextn.*` beside the layer's
own tensors at block n) is read by models/loaders/gguf_mtp.py under `GGUF_MTP_WEIGHTS`.

The weights are placed in the compute dtype whatever `--quantization` says (one layer).
Under tensor parallelism (`ferrox_jax/mtp.py`, "Tensor parallelism") the layer splits as the
model's full-attention layers; fc and the head split by output column, their products pinned
split then whole (`models/deepseek_mtp.py:gathered`).
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

from models.deepseek_mtp import gathered
from models.layers import ForwardContext, norm_param, param, project, rms_norm_plus_one
from models.loaders.shards import shard_tensors
from models.mtp_weights import NoMtpLayerError, fill_mtp, our_mtp_tensors
from models.qwen3_5 import MTP_PREFIXES, Qwen3_5Config, Qwen3_5DecoderLayer
from models.qwen3_next import Qwen3NextConfig, Qwen3NextDecoderLayer
from models.quant import embed_lookup
from models.registry import family_for
from models.rope import rope_cos_sin

ARCHITECTURES = ("Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM", "Qwen3NextForCausalLM")
MTP_WEIGHTS = {  # HF suffix after mtp. -> (ours, transposed)
    "fc.weight": ("fc", True),
    "pre_fc_norm_embedding.weight": ("enorm", False),
    "pre_fc_norm_hidden.weight": ("hnorm", False),
    "norm.weight": ("head_norm", False),
}
# llama.cpp's names for them in a GGUF (`blk.{n}.nextn.*`, models/loaders/gguf_mtp.py), stored 1 + w for the norms
GGUF_MTP_WEIGHTS = {
    "nextn.eh_proj.weight": ("fc", True),
    "nextn.enorm.weight": ("enorm", False),
    "nextn.hnorm.weight": ("hnorm", False),
    "nextn.shared_head_norm.weight": ("head_norm", False),
}
_LAYER_RE = re.compile(r"^layers\.(\d+)\.(.+)$")


def layer_config(cfg: Qwen3_5Config) -> Qwen3_5Config:
    """The config the block's decoder layer is built from: one full-attention layer, whose MLP
    is the main model's layer 0's kind (vLLM numbers the MTP layer 0 too)."""
    one = dict(num_layers=1, linear_layers=(False,), layer_types=())
    if isinstance(cfg, Qwen3NextConfig):
        one["dense_layers"] = (0,) if 0 in cfg.dense_layers else ()
    return dataclasses.replace(cfg, **one)


def mtp_layout(cfg: Qwen3_5Config) -> tuple[tuple[int, int, int], ...]:
    """The block's cache: one K/V pair of the model's full-attention shape."""
    return (cfg.kv_cache_dims(),)


class Qwen3_5Mtp(nnx.Module):
    """The MTP block (module docstring): `draft_step` runs one-token rows over its K/V cache."""

    def __init__(self, cfg: Qwen3_5Config, dtype, rngs: nnx.Rngs):
        d, v = cfg.hidden_size, cfg.vocab_size
        self.cfg = cfg
        self.dtype = dtype
        self.embed = param(rngs, (v, d), dtype)
        self.enorm = norm_param(d, dtype, 0.0)
        self.hnorm = norm_param(d, dtype, 0.0)
        self.fc = param(rngs, (2 * d, d), dtype)
        layer = Qwen3NextDecoderLayer if isinstance(cfg, Qwen3NextConfig) else Qwen3_5DecoderLayer
        self.layer = layer(layer_config(cfg), 0, dtype, rngs)
        self.head_norm = norm_param(d, dtype, 0.0)
        self.head = param(rngs, (d, v), dtype)
        self.gather_shardings = None  # on a mesh: (split, replicated), set by ferrox_jax/mtp.py (`gathered`)

    def rope(self, positions, valid):
        cfg = self.cfg  # text-only M-RoPE is plain RoPE (models/qwen3_5.py)
        return {"global": rope_cos_sin(positions, valid, cfg.rope_dim, cfg.rope_theta, cfg.rope_scaling)}

    def draft_step(self, tokens, positions, valid, hidden, k_cache, v_cache, block_tables):
        """R one-token rows: tokens / positions / valid [R], the main model's hidden [R, D],
        the block's K and V arrays, block_tables i32[R, MB] -> (out [R, D], k_cache, v_cache).
        Every row's K/V is written before any row attends (`models/attention.py:write_kv`),
        so rows of one sequence at consecutive positions see each other causally."""
        fwd = ForwardContext.build(positions, valid, (block_tables,), (1,), k_cache.shape[2], self.rope, None)
        eps = self.cfg.rms_norm_eps
        e = embed_lookup(self.embed.get_value(), tokens, self.dtype)
        x = jnp.concatenate([rms_norm_plus_one(e, self.enorm[...], eps),
                             rms_norm_plus_one(hidden.astype(e.dtype), self.hnorm[...], eps)], axis=-1)
        x = gathered(project(x, self.fc.get_value()), self.gather_shardings)
        x, k_cache, v_cache = self.layer(x, fwd, k_cache, v_cache)
        return rms_norm_plus_one(x, self.head_norm[...], eps), k_cache, v_cache

    def logits(self, out: jax.Array) -> jax.Array:
        """out [R, D] (already normed) -> f32[R, V] through the shared LM head."""
        return gathered(project(out, self.head.get_value()), self.gather_shardings).astype(jnp.float32)


def mtp_tensors(folder: Path, cfg: Qwen3_5Config) -> dict[str, Callable[[], np.ndarray]]:
    """{our name (relative to `Qwen3_5Mtp`): lazy array in our layout} of the checkpoint's MTP
    block (`folder`: a checkpoint folder, or a GGUF file's `nextn` block); raises
    NoMtpLayerError when it has none, or one we cannot run."""
    if folder.suffix == ".gguf":
        from models.loaders.gguf_mtp import gguf_mtp_tensors  # the gguf package only for a GGUF file

        return gguf_mtp_tensors(folder, cfg, layer_config(cfg), GGUF_MTP_WEIGHTS, norm_offset=1.0, max_blocks=1)
    loads = shard_tensors(folder, lambda name: name.split("mtp.", 1)[1] if name.startswith(MTP_PREFIXES) else None)
    if "fc.weight" not in loads:
        raise NoMtpLayerError(
            f"{folder.name} has no multi-token-prediction layer (no mtp.fc.weight; mtp_num_hidden_layers is 0 "
            "or its weights were not saved): --speculative mtp needs one; use --speculative ngram or "
            "--speculative draft")

    def layer_suffix(suffix: str) -> str | None:
        m = _LAYER_RE.match(suffix)
        if m and m.group(1) != "0":
            raise NoMtpLayerError(f"MTP tensor mtp.{suffix}: a checkpoint with more than one MTP layer "
                                  "(mtp_num_hidden_layers > 1) is not supported; use --speculative ngram")
        return m.group(2) if m else None

    return our_mtp_tensors(loads, MTP_WEIGHTS, layer_suffix, family_for(cfg.architecture).hf_layer_weights,
                           getattr(cfg, "num_experts", None), lambda suffix: f"MTP tensor mtp.{suffix} is not one we know")


def load_mtp(folder: str | Path, cfg: Qwen3_5Config, target, dtype) -> Qwen3_5Mtp:
    """The MTP block of the checkpoint in `folder`, in `dtype`; the embedding and the LM head
    are `target`'s (the main model, a `CausalLM`): the same arrays, not copies."""
    tensors = mtp_tensors(Path(folder), cfg)
    model = nnx.eval_shape(lambda: Qwen3_5Mtp(cfg, dtype, nnx.Rngs(0)))
    shared = {"embed": target.embed, "head": target.tied_lm_head if cfg.tie_word_embeddings else target.lm_head}
    return fill_mtp(model, tensors, shared, dtype)
