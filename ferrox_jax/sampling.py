"""On-device sampling, per row: greedy, temperature, top-k, top-p, min-p, penalties, seeds.

Every setting is a `[rows]` array (never a static argument, which would compile once per
value). A row's draw depends only on (seed, position): its Gumbel noise comes from
`fold_in(key(seed), position)`, so the same row samples the same tokens alone or inside
any batch.

Penalties and logit_bias arrive sparse: per row up to `MAX_PENALTY_TOKENS` (token id,
additive value, repetition flag) entries built on the host from the row's history
(`ferrox_jax/host_batch.py:SamplingArrays`).
Order, as in vLLM: repetition penalty (divide positive logits, multiply negative ones,
over prompt and generated tokens), then presence/frequency penalties (generated tokens)
and logit_bias, then temperature and the top-k/top-p/min-p filters. Returned logprobs
are the raw model's (before grammar masks, penalties and temperature).

Structured output arrives as one more per-row input, a packed allowed-token bitmask
(`ferrox_jax/token_mask.py`; all ones for an unconstrained row): disallowed tokens get
-inf after the raw logprobs are taken and after the penalties and logit_bias (so no
penalty can bring a disallowed token back), before temperature, the filters and the draw,
which see only allowed tokens.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ferrox_jax.host_batch import SamplingArrays
from ferrox_jax.request import MAX_LOGPROBS
from ferrox_jax.token_mask import apply_token_bitmask
from models.cpu_kernels import sample_rows

_BISECT_STEPS = 24

# The host batch's sampling arrays travel to the device as a pytree of [rows] arrays.
jax.tree_util.register_dataclass(SamplingArrays, data_fields=[f.name for f in dataclasses.fields(SamplingArrays)],
                                 meta_fields=[])


def apply_penalties(logits: jax.Array, s: SamplingArrays) -> jax.Array:
    """logits f32[B, V] -> penalised f32[B, V]."""
    b = logits.shape[0]
    rows = jnp.arange(b)[:, None]
    add = jnp.zeros_like(logits).at[rows, s.penalty_ids].add(s.penalty_add, mode="drop")
    rep = jnp.zeros(logits.shape, bool).at[rows, s.penalty_ids].set(s.penalty_rep, mode="drop")
    # A penalty that rounds to 0 in float32 (the API takes any value > 0, e.g. 5e-324) would
    # give inf / NaN logits: the smallest normal float32 and the clip keep every logit finite
    # and ordered as the float64 penalty would.
    rp = jnp.maximum(s.repetition_penalty[:, None], jnp.finfo(jnp.float32).tiny)
    big = jnp.finfo(jnp.float32).max
    logits = jnp.where(rep, jnp.clip(jnp.where(logits > 0, logits / rp, logits * rp), -big, big), logits)
    return logits + add


def _filter_threshold(probs: jax.Array, s: SamplingArrays) -> jax.Array:
    """f32[B]: the probability a token needs to survive top-k, top-p and min-p.

    No sort: two bisections over the probability threshold run side by side, each step
    one masked reduction over the vocabulary (a full-vocabulary argsort cost ~0.9 s for
    32 rows on a 2-core CPU; this costs a few ms). After `_BISECT_STEPS` halvings the
    threshold is within p_max / 2**_BISECT_STEPS of the exact one.
      top-p: the largest t whose kept mass sum(p >= t) still reaches top_p;
      top-k: the smallest t keeping at most k tokens;
      min-p: t = min_p * p_max.
    The most likely token always survives (every threshold is <= p_max).
    """
    p_max = probs.max(axis=-1)
    zeros = jnp.zeros_like(p_max)

    def body(_, carry):
        lo_p, hi_p, lo_k, hi_k = carry
        mid_p, mid_k = (lo_p + hi_p) / 2, (lo_k + hi_k) / 2
        mass = jnp.where(probs >= mid_p[:, None], probs, 0.0).sum(axis=-1)
        count = (probs >= mid_k[:, None]).sum(axis=-1)
        reaches = mass >= s.top_p
        few_enough = count <= s.top_k
        return (jnp.where(reaches, mid_p, lo_p), jnp.where(reaches, hi_p, mid_p),
                jnp.where(few_enough, lo_k, mid_k), jnp.where(few_enough, mid_k, hi_k))

    lo_p, _, _, hi_k = jax.lax.fori_loop(0, _BISECT_STEPS, body, (zeros, p_max, zeros, p_max))
    t_p = jnp.where(s.top_p < 1.0, lo_p, 0.0)
    t_k = jnp.where(s.top_k > 0, hi_k, 0.0)
    return jnp.maximum(jnp.maximum(t_p, t_k), s.min_p * p_max)


def fast_argmax(x: jax.Array) -> jax.Array:
    """i32[B]: first index of each row's maximum. XLA CPU's variadic argmax reduction ran
    ~60x slower than a max plus a min over indices (11 ms vs 0.2 ms for [32, 49152])."""
    iota = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    is_max = x == x.max(axis=-1, keepdims=True)
    return jnp.min(jnp.where(is_max, iota, x.shape[-1]), axis=-1)


def _cumsum(x: jax.Array, block: int = 256) -> jax.Array:
    """Inclusive cumsum over the last axis in two levels (within blocks, then block totals):
    a flat cumsum over 49152 entries was ~3x slower on XLA CPU."""
    b, v = x.shape
    padded = -(-v // block) * block
    x = jnp.pad(x, ((0, 0), (0, padded - v))).reshape(b, padded // block, block)
    inner = jnp.cumsum(x, axis=-1)
    offsets = jnp.cumsum(inner[:, :, -1], axis=-1) - inner[:, :, -1]
    return (inner + offsets[:, :, None]).reshape(b, padded)[:, :v]


def _uniform(seed: jax.Array, position: jax.Array) -> jax.Array:
    """A row's draw in [0, 1): it depends only on (seed, position)."""
    return jax.random.uniform(jax.random.fold_in(jax.random.key(seed), position), (), jnp.float32)


def _draw(logits: jax.Array, positions: jax.Array, s: SamplingArrays) -> jax.Array:
    """Temperature, filters and a seeded inverse-CDF draw: i32[B].

    One uniform number per row, `uniform(fold_in(key(seed), position))`, picks the token
    where the kept probabilities' running sum first reaches it: the draw depends only on
    (seed, position) and the row's own logits.
    """
    temperature = jnp.where(s.temperature > 0, s.temperature, 1.0)[:, None]
    probs = jax.nn.softmax(logits / temperature, axis=-1)
    needs_filter = jnp.any((s.top_k > 0) | (s.top_p < 1.0) | (s.min_p > 0.0))
    # Only the [B] thresholds cross the cond, so the untaken branch costs nothing.
    threshold = jax.lax.cond(needs_filter, lambda: _filter_threshold(probs, s),
                             lambda: jnp.zeros(probs.shape[0], jnp.float32))
    kept = jnp.where(probs >= threshold[:, None], probs, 0.0)
    cdf = _cumsum(kept)

    # (1 - u) is in (0, 1], so the target is never 0 and never lands on a dropped token.
    target = (1.0 - jax.vmap(_uniform)(s.seed, positions)) * cdf[:, -1]
    reached = (cdf >= target[:, None]) & (kept > 0)
    iota = jax.lax.broadcasted_iota(jnp.int32, cdf.shape, 1)
    return jnp.min(jnp.where(reached, iota, cdf.shape[-1] - 1), axis=-1)


def sample(logits: jax.Array, positions: jax.Array, s: SamplingArrays, bitmask: jax.Array | None = None):
    """Sample one token per row.

    Args:
      logits: f32[B, V] raw model logits.
      positions: i32[B] position the sampled token will occupy (keys the row's noise).
      s: the rows' SamplingArrays.
      bitmask: i32[B, ceil(V/32)] allowed tokens per row (`ferrox_jax/token_mask.py`),
        all ones (-1 words) for an unconstrained row; None: no row is constrained.
    Returns:
      tokens i32[B], logprob f32[B] (raw, of the chosen token),
      top_ids i32[B, 20], top_logprobs f32[B, 20] (raw, best first).
    """
    return sample_checked(logits, positions, s, bitmask)[:4]


def sample_checked(logits: jax.Array, positions: jax.Array, s: SamplingArrays, bitmask: jax.Array | None = None,
                   *, cpu_kernel: bool = False):
    """`sample`'s four arrays and finite bool[B] (every raw logit of the row finite: a NaN
    is caught without copying the logits to the host, `ferrox_jax/step_faults.py`).

    cpu_kernel: the passes over the vocabulary (the raw logits' max, log-sum-exp and
    finiteness, the greedy argmax, the filtered draw) in one CPU kernel call
    (`models/kernels/sample_rows.cc`) instead of XLA's reductions; the caller checked that
    the kernels run here (`models/cpu_kernels.py:runtime_problems`). Same greedy tokens;
    the same draw up to float rounding, with exact top-k / top-p thresholds in place of
    the bisection's.
    """
    b = logits.shape[0]
    raw_logits = logits
    has_penalties = jnp.any(s.penalty_ids < logits.shape[-1]) | jnp.any(s.repetition_penalty != 1.0)
    logits = jax.lax.cond(has_penalties, lambda: apply_penalties(logits, s), lambda: logits)
    if bitmask is not None:
        # After the raw logprobs, so returned logprobs stay the model's, and after the
        # penalties, so a disallowed token is -inf whatever they did (a penalty times a
        # masked -inf was NaN, which argmax picked). A batch with no constrained row (every
        # word -1) skips unpacking the bits; a masked row's unconstrained neighbours pass
        # through `where` bit for bit either way.
        logits = jax.lax.cond(jnp.any(bitmask != -1), lambda: apply_token_bitmask(logits, bitmask),
                              lambda: logits)
    if cpu_kernel:
        tokens, row_max, log_sum, finite = sample_rows(raw_logits, logits, s.temperature, s.top_k, s.top_p, s.min_p,
                                                       jax.vmap(_uniform)(s.seed, positions))
        row_max, log_sum = row_max[:, None], log_sum[:, None]
    else:
        finite = jnp.isfinite(raw_logits).all(axis=-1)
        # The raw logprobs are log_softmax's (x - max) - log(sum(exp(x - max))), but only the
        # chosen token's is always needed: two reductions over [B, V] instead of a whole
        # [B, V] array written and read back (32 rows: ~2 ms of a ~7 ms sampler on a 2-core CPU).
        row_max = jax.lax.stop_gradient(raw_logits.max(axis=-1, keepdims=True))
        log_sum = jnp.log(jnp.exp(raw_logits - row_max).sum(axis=-1, keepdims=True))
        greedy = fast_argmax(logits)
        # An all-greedy batch skips the noise and the filters entirely.
        drawn = jax.lax.cond(jnp.any(s.temperature > 0), lambda: _draw(logits, positions, s), lambda: greedy)
        tokens = jnp.where(s.temperature > 0, drawn, greedy)
    # The top-20 search over the vocabulary runs only when some row asked for logprobs.
    top_lp, top_ids = jax.lax.cond(
        jnp.any(s.want_logprobs), lambda: tuple(jax.lax.top_k((raw_logits - row_max) - log_sum, MAX_LOGPROBS)),
        lambda: (jnp.zeros((b, MAX_LOGPROBS), jnp.float32), jnp.zeros((b, MAX_LOGPROBS), jnp.int32)))
    chosen_lp = ((jnp.take_along_axis(raw_logits, tokens[:, None], axis=-1) - row_max) - log_sum)[:, 0]
    return tokens, chosen_lp, top_ids.astype(jnp.int32), top_lp, finite
