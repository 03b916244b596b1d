"""The jitted step functions: `prefill_step` and `decode_step`, jitted here and nowhere else.

Both are the same pure function of (graphdef, state, kv_cache, batch): run the model
over each row's new tokens (writing their K/V into the paged cache, layout in
`kv_cache.py`), take the logits at each row's last new token and sample on device.
`prefill_step` sees one row with T = a token bucket and can also return prompt
logprobs, and always returns the chunk's final hidden states pooled (summed, and the
last one) for embeddings jobs; `decode_step` sees B = a row bucket with T = 1. The graphdef is static, the
state traced, and only the KV cache is donated: the caller rebinds it in the same
statement (`self.kv_cache, out = step(graphdef, state, self.kv_cache, batch)`).

`jit_steps(shardings)` jits the three bodies once per runner: plain `jax.jit` on one
device, or with explicit in/out shardings on a mesh (`ferrox_jax/sharding.py`).

`StepBatch` is built on the host with numpy leaves (`ferrox_jax/runner.py`) and moved
to the device in one `jax.device_put` per step; the same class holds either.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx, struct

from ferrox_jax.kv_cache import KVCache
from ferrox_jax.request import MAX_LOGPROBS
from ferrox_jax.sampling import SamplingBatch, sample
from ferrox_jax.sharding import RunnerShardings, kv_cache_shardings


@struct.dataclass
class StepBatch:
    """Inputs of one step (numpy leaves on the host, jax arrays on the device).
    B rows, T tokens per row, MB blocks per row."""

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
    hidden_sum: jax.Array  # f32[B, D] (prefill: final hidden states summed over valid tokens) or f32[B, 0]
    last_hidden: jax.Array  # f32[B, D] (prefill: the state at last_index) or f32[B, 0]


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
        # Pooling outputs for embeddings jobs, in the same executable: one reduction over
        # [T, D], so every prefill bucket serves them without a compile of its own.
        pooled = (jnp.sum(jnp.where(batch.valid[..., None], hidden.astype(jnp.float32), 0.0), axis=1),
                  last_hidden.astype(jnp.float32))
    else:
        prompt = (jnp.zeros((b, 0), jnp.float32), jnp.zeros((b, 0, MAX_LOGPROBS), jnp.int32),
                  jnp.zeros((b, 0, MAX_LOGPROBS), jnp.float32))
        pooled = (jnp.zeros((b, 0), jnp.float32), jnp.zeros((b, 0), jnp.float32))
    result = StepResult(tokens, logprob, top_ids, top_lp, *prompt, *pooled)
    return KVCache(k=k, v=v), result


def _logits(graphdef, state, kv_cache: KVCache, batch: StepBatch):
    """Offline variant for parity checks: the logits f32[B, T, V] at every new position."""
    model = nnx.merge(graphdef, state)
    hidden, k, v = model(batch.tokens, batch.positions, batch.valid, kv_cache.k, kv_cache.v,
                         batch.block_tables)
    return KVCache(k=k, v=v), model.logits(hidden)


@dataclasses.dataclass(frozen=True)
class StepFunctions:
    """One runner's jitted steps; each is `fn(graphdef, state, kv_cache, batch) -> (kv_cache, out)`."""

    prefill: Callable
    decode: Callable
    logits: Callable  # offline parity: f32[B, T, V] at every new position


_BODIES = (functools.partial(_step, is_prefill=True), functools.partial(_step, is_prefill=False), _logits)


def jit_steps(shardings: RunnerShardings | None = None) -> StepFunctions:
    """jax.jit the step bodies for one runner, donating the KV cache (argument 2).

    With shardings: state, KV and batch get explicit in_shardings, the KV comes back with
    its own sharding (so the next step takes it without a reshard or recompile) and the
    outputs come back replicated. Without: a plain jit on the default device, shared by
    every unsharded runner (so equal graphdefs and shapes reuse one trace).
    """
    if shardings is None:
        return _unsharded_steps()
    kv = kv_cache_shardings(shardings)
    rep = shardings.replicated
    return StepFunctions(*(jax.jit(fn, static_argnums=(0,), donate_argnums=(2,),
                                   in_shardings=(shardings.state, kv, rep), out_shardings=(kv, rep))
                           for fn in _BODIES))


@functools.cache
def _unsharded_steps() -> StepFunctions:
    return StepFunctions(*(jax.jit(fn, static_argnums=(0,), donate_argnums=(2,)) for fn in _BODIES))
