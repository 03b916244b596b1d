"""The jitted step functions: `prefill_step` and `decode_step`.

Both are the same pure function of (graphdef, state, kv_cache, batch): run the model
over each row's new tokens (writing their K/V into the paged cache, layout in
`kv_cache.py`), take the logits at each row's last new token and sample on device.
`prefill_step` sees one row with T = a token bucket and can also return prompt
logprobs; `decode_step` sees B = a row bucket with T = 1. The graphdef is static, the
state traced, and only the KV cache is donated: the caller rebinds it in the same
statement (`self.kv_cache, out = step(graphdef, state, self.kv_cache, batch)`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx, struct

from ferrox_jax.kv_cache import KVCache
from ferrox_jax.plan import MAX_LOGPROBS
from ferrox_jax.sampling import SamplingBatch, sample


@struct.dataclass
class StepBatch:
    """Inputs of one step. B rows, T tokens per row, MB blocks per row."""

    tokens: jax.Array  # i32[B, T]
    positions: jax.Array  # i32[B, T]
    valid: jax.Array  # bool[B, T]
    block_tables: jax.Array  # i32[B, MB]
    last_index: jax.Array  # i32[B]: index in T of the row's last new token
    sampling: SamplingBatch
    next_tokens: jax.Array  # i32[B, T]: token following each position, -1 if unknown
    want_prompt_logprobs: jax.Array  # bool[]: compute prompt logprobs (prefill only)


@struct.dataclass
class StepResult:
    """Device outputs, fetched to the host in one transfer."""

    tokens: jax.Array  # i32[B]
    logprob: jax.Array  # f32[B]
    top_ids: jax.Array  # i32[B, 20]
    top_logprobs: jax.Array  # f32[B, 20]
    prompt_logprob: jax.Array  # f32[B, T] (prefill) or f32[B, 0]
    prompt_top_ids: jax.Array  # i32[B, T, 20] or [B, 0, 20]
    prompt_top_logprobs: jax.Array  # f32[B, T, 20] or [B, 0, 20]


def _prompt_logprobs(model, hidden, next_tokens):
    logprobs = jax.nn.log_softmax(model.logits(hidden), axis=-1)  # [B, T, V]
    chosen = jnp.take_along_axis(logprobs, jnp.maximum(next_tokens, 0)[..., None], axis=-1)[..., 0]
    top_lp, top_ids = jax.lax.top_k(logprobs, MAX_LOGPROBS)
    return chosen, top_ids.astype(jnp.int32), top_lp


def _step(graphdef, state, kv_cache: KVCache, batch: StepBatch, *, is_prefill: bool):
    model = nnx.merge(graphdef, state)
    hidden, k, v = model(batch.tokens, batch.positions, batch.valid, kv_cache.k, kv_cache.v,
                         batch.block_tables)
    b, t, _ = hidden.shape
    last_hidden = jnp.take_along_axis(hidden, batch.last_index[:, None, None], axis=1)[:, 0]
    logits = model.logits(last_hidden)  # f32[B, V]
    sample_pos = jnp.take_along_axis(batch.positions, batch.last_index[:, None], axis=1)[:, 0] + 1
    tokens, logprob, top_ids, top_lp = sample(logits, sample_pos, batch.sampling)
    if is_prefill:
        zeros = (jnp.zeros((b, t), jnp.float32), jnp.zeros((b, t, MAX_LOGPROBS), jnp.int32),
                 jnp.zeros((b, t, MAX_LOGPROBS), jnp.float32))
        prompt = jax.lax.cond(batch.want_prompt_logprobs,
                              lambda: _prompt_logprobs(model, hidden, batch.next_tokens), lambda: zeros)
    else:
        prompt = (jnp.zeros((b, 0), jnp.float32), jnp.zeros((b, 0, MAX_LOGPROBS), jnp.int32),
                  jnp.zeros((b, 0, MAX_LOGPROBS), jnp.float32))
    result = StepResult(tokens, logprob, top_ids, top_lp, *prompt)
    return KVCache(k=k, v=v), result


prefill_step = jax.jit(functools.partial(_step, is_prefill=True), static_argnums=(0,),
                       donate_argnames=("kv_cache",))
decode_step = jax.jit(functools.partial(_step, is_prefill=False), static_argnums=(0,),
                      donate_argnames=("kv_cache",))


def _logits(graphdef, state, kv_cache: KVCache, batch: StepBatch):
    """Offline variant for parity checks: the logits f32[B, T, V] at every new position."""
    model = nnx.merge(graphdef, state)
    hidden, k, v = model(batch.tokens, batch.positions, batch.valid, kv_cache.k, kv_cache.v,
                         batch.block_tables)
    return KVCache(k=k, v=v), model.logits(hidden)


logits_step = jax.jit(_logits, static_argnums=(0,), donate_argnames=("kv_cache",))

# The unjitted bodies, for a runner on a mesh that jits them with its own explicit
# in/out shardings (ferrox_jax/sharding.py: jit_steps).
STEP_BODIES = {"prefill": functools.partial(_step, is_prefill=True),
               "decode": functools.partial(_step, is_prefill=False),
               "logits": _logits}
