"""On-device sampling, per row: greedy, temperature, top-k, top-p, min-p, penalties, seeds.

Every setting is a `[rows]` array (never a static argument, which would compile once per
value). A row's draw depends only on (seed, position): its Gumbel noise comes from
`fold_in(key(seed), position)`, so the same row samples the same tokens alone or inside
any batch.

Penalties and logit_bias arrive sparse: per row up to `MAX_PENALTY_TOKENS` (token id,
additive value, repetition flag) entries built on the host from the row's history.
Order, as in vLLM: repetition penalty (divide positive logits, multiply negative ones,
over prompt and generated tokens), then presence/frequency penalties (generated tokens)
and logit_bias, then temperature and the top-k/top-p/min-p filters. Returned logprobs
are the raw model's (before penalties and temperature).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from ferrox_jax.plan import MAX_LOGPROBS, SamplingParams

# Distinct tokens per row that penalties and logit_bias can touch (llama.cpp's default
# window is 64 tokens; OpenAI caps logit_bias at 300 entries).
MAX_PENALTY_TOKENS = 512


@struct.dataclass
class SamplingBatch:
    """Per-row sampling inputs. B rows; P = MAX_PENALTY_TOKENS."""

    temperature: jax.Array  # f32[B]; 0 = greedy
    top_k: jax.Array  # i32[B]; 0 = off
    top_p: jax.Array  # f32[B]; 1 = off
    min_p: jax.Array  # f32[B]; 0 = off
    seed: jax.Array  # u32[B]
    penalty_ids: jax.Array  # i32[B, P]; V (out of range) = unused slot
    penalty_add: jax.Array  # f32[B, P]; logit_bias - presence - frequency * count
    penalty_rep: jax.Array  # bool[B, P]; token seen in prompt or output (repetition)
    repetition_penalty: jax.Array  # f32[B]; 1 = off


def host_sampling_batch(params: list[SamplingParams | None], histories: list[tuple[int, ...]],
                        num_prompt: list[int], rows: int, vocab_size: int) -> dict[str, np.ndarray]:
    """Build the numpy fields of a SamplingBatch for `rows` padded rows."""
    out = {
        "temperature": np.zeros(rows, np.float32),
        "top_k": np.zeros(rows, np.int32),
        "top_p": np.ones(rows, np.float32),
        "min_p": np.zeros(rows, np.float32),
        "seed": np.zeros(rows, np.uint32),
        "penalty_ids": np.full((rows, MAX_PENALTY_TOKENS), vocab_size, np.int32),
        "penalty_add": np.zeros((rows, MAX_PENALTY_TOKENS), np.float32),
        "penalty_rep": np.zeros((rows, MAX_PENALTY_TOKENS), bool),
        "repetition_penalty": np.ones(rows, np.float32),
    }
    for i, p in enumerate(params):
        if p is None:
            continue
        out["temperature"][i] = p.temperature
        out["top_k"][i] = p.top_k
        out["top_p"][i] = p.top_p
        out["min_p"][i] = p.min_p
        out["seed"][i] = p.seed & 0xFFFFFFFF
        out["repetition_penalty"][i] = p.repetition_penalty
        if p.has_penalties:
            _fill_penalties(out, i, p, histories[i], num_prompt[i], vocab_size)
    return out


def _fill_penalties(out, i: int, p: SamplingParams, history: tuple[int, ...], num_prompt: int,
                    vocab_size: int) -> None:
    add: dict[int, float] = {}
    rep: set[int] = set()
    generated = history[num_prompt:]
    if p.presence_penalty or p.frequency_penalty:
        ids, counts = np.unique(np.asarray(generated, np.int64), return_counts=True)
        for t, c in zip(ids.tolist(), counts.tolist()):
            add[t] = add.get(t, 0.0) - p.presence_penalty - p.frequency_penalty * c
    if p.repetition_penalty != 1.0:
        rep = set(history)
    for t, b in p.logit_bias:
        add[t] = add.get(t, 0.0) + b
    # Most recent tokens first, so a very long history keeps the newest within the cap.
    order = list(dict.fromkeys([t for t, _ in p.logit_bias] + list(reversed(history))))
    order = [t for t in order if t in add or t in rep][:MAX_PENALTY_TOKENS]
    for j, t in enumerate(order):
        if 0 <= t < vocab_size:
            out["penalty_ids"][i, j] = t
            out["penalty_add"][i, j] = add.get(t, 0.0)
            out["penalty_rep"][i, j] = t in rep


def apply_penalties(logits: jax.Array, s: SamplingBatch) -> jax.Array:
    """logits f32[B, V] -> penalised f32[B, V]."""
    b = logits.shape[0]
    rows = jnp.arange(b)[:, None]
    add = jnp.zeros_like(logits).at[rows, s.penalty_ids].add(s.penalty_add, mode="drop")
    rep = jnp.zeros(logits.shape, bool).at[rows, s.penalty_ids].set(s.penalty_rep, mode="drop")
    rp = s.repetition_penalty[:, None]
    logits = jnp.where(rep, jnp.where(logits > 0, logits / rp, logits * rp), logits)
    return logits + add


def _filter_mask(scaled: jax.Array, s: SamplingBatch) -> jax.Array:
    """bool[B, V]: tokens that survive top-k, top-p and min-p (computed in sorted order)."""
    vocab = scaled.shape[-1]
    order = jnp.argsort(-scaled, axis=-1)
    sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
    sorted_probs = jax.nn.softmax(sorted_logits, axis=-1)
    rank = jnp.arange(vocab)[None, :]
    k = jnp.where(s.top_k > 0, s.top_k, vocab)[:, None]
    keep = rank < k
    # top-p: keep the smallest prefix whose mass reaches top_p (the first token always).
    mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
    keep &= mass_before < s.top_p[:, None]
    keep &= sorted_probs >= s.min_p[:, None] * sorted_probs[:, :1]
    keep = keep.at[:, 0].set(True)
    return jnp.zeros_like(keep).at[jnp.arange(keep.shape[0])[:, None], order].set(keep)


def sample(logits: jax.Array, positions: jax.Array, s: SamplingBatch):
    """Sample one token per row.

    Args:
      logits: f32[B, V] raw model logits.
      positions: i32[B] position the sampled token will occupy (keys the row's noise).
      s: the rows' SamplingBatch.
    Returns:
      tokens i32[B], logprob f32[B] (raw, of the chosen token),
      top_ids i32[B, 20], top_logprobs f32[B, 20] (raw, best first).
    """
    raw_logprobs = jax.nn.log_softmax(logits, axis=-1)
    top_lp, top_ids = jax.lax.top_k(raw_logprobs, MAX_LOGPROBS)
    logits = apply_penalties(logits, s)
    greedy = jnp.argmax(logits, axis=-1)
    temperature = jnp.where(s.temperature > 0, s.temperature, 1.0)[:, None]
    scaled = logits / temperature
    needs_filter = jnp.any((s.top_k > 0) | (s.top_p < 1.0) | (s.min_p > 0.0))
    # One branch runs: the full-vocabulary sort only when some row filters.
    mask = jax.lax.cond(needs_filter, lambda x: _filter_mask(x, s), lambda x: jnp.ones(x.shape, bool), scaled)
    scaled = jnp.where(mask, scaled, -jnp.inf)

    def noise(seed, pos):
        key = jax.random.fold_in(jax.random.key(seed), pos)
        return jax.random.gumbel(key, (logits.shape[-1],), jnp.float32)

    gumbel = jax.vmap(noise)(s.seed, positions)
    drawn = jnp.argmax(scaled + gumbel, axis=-1)
    tokens = jnp.where(s.temperature > 0, drawn, greedy).astype(jnp.int32)
    chosen_lp = jnp.take_along_axis(raw_logprobs, tokens[:, None], axis=-1)[:, 0]
    return tokens, chosen_lp, top_ids.astype(jnp.int32), top_lp
