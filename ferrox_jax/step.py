"""The jitted step functions: `prefill_step`, `decode_step` and `sample_step`, jitted here
and nowhere else.

A step is two device calls, so that the host can compute grammar masks while the model
runs (`ferrox_jax/runner.py` dispatches the first, fills the masks, then the second):

  * `prefill_step` / `decode_step` (graphdef, state, kv_cache, batch) -> (kv_cache,
    ForwardResult): run the model over each row's new tokens (writing their K/V into the
    paged cache, layout in `kv_cache.py`) and return the logits at each row's last new
    token. `prefill_step` sees one row with T = a token bucket, can also return prompt
    logprobs, and always returns the chunk's final hidden states pooled (summed over the
    valid tokens, and the last one) for embeddings jobs; `decode_step` sees B = a row
    bucket with T = 1. The graphdef is static, the
    state traced, and only the KV cache is donated: the caller rebinds it in the same
    statement (`self.kv_cache, out = step(graphdef, state, self.kv_cache, batch)`).
  * `sample_step` (logits, positions, sampling, bitmask) -> SampleResult: apply the rows'
    grammar bitmask (all ones for unconstrained rows) and sample (`sampling.py`). Its
    shapes depend only on the row count, so one compiled sampler serves every prefill
    bucket and the decode bucket of the same B.

`jit_steps(shardings)` jits the bodies once per runner: plain `jax.jit` on one device, or
with explicit in/out shardings on a mesh (`ferrox_jax/sharding.py`).

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
    next_tokens: jax.Array  # i32[B, T]: token following each position, -1 if unknown
    want_prompt_logprobs: jax.Array  # bool[]: compute prompt logprobs (prefill only)


@struct.dataclass
class ForwardResult:
    """What the model call leaves on the device for the sampler and the host."""

    logits: jax.Array  # f32[B, V] at each row's last new token
    sample_pos: jax.Array  # i32[B]: the position the sampled token will occupy
    prompt_logprob: jax.Array  # f32[B, T] (prefill) or f32[B, 0]
    prompt_top_ids: jax.Array  # i32[B, T, 20] or [B, 0, 20]
    prompt_top_logprobs: jax.Array  # f32[B, T, 20] or [B, 0, 20]
    hidden_sum: jax.Array  # f32[B, D] (prefill: final hidden states summed over valid tokens) or f32[B, 0]
    last_hidden: jax.Array  # f32[B, D] (prefill: the state at last_index) or f32[B, 0]


@struct.dataclass
class SampleResult:
    """Sampler outputs, fetched to the host with the step's other results in one transfer."""

    tokens: jax.Array  # i32[B]
    logprob: jax.Array  # f32[B]: raw logprob of the sampled token
    top_ids: jax.Array  # i32[B, 20]
    top_logprobs: jax.Array  # f32[B, 20]


def _prompt_logprobs(model, hidden, next_tokens):
    logprobs = jax.nn.log_softmax(model.logits(hidden), axis=-1)  # [B, T, V]
    chosen = jnp.take_along_axis(logprobs, jnp.maximum(next_tokens, 0)[..., None], axis=-1)[..., 0]
    top_lp, top_ids = jax.lax.top_k(logprobs, MAX_LOGPROBS)
    return chosen, top_ids.astype(jnp.int32), top_lp


def _forward(graphdef, state, kv_cache: KVCache, batch: StepBatch, *, is_prefill: bool):
    model = nnx.merge(graphdef, state)
    hidden, k, v = model(batch.tokens, batch.positions, batch.valid, kv_cache.k, kv_cache.v,
                         batch.block_tables)
    b, t, _ = hidden.shape
    last_hidden = jnp.take_along_axis(hidden, batch.last_index[:, None, None], axis=1)[:, 0]
    logits = model.logits(last_hidden)  # f32[B, V]
    sample_pos = jnp.take_along_axis(batch.positions, batch.last_index[:, None], axis=1)[:, 0] + 1
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
    return KVCache(k=k, v=v), ForwardResult(logits, sample_pos, *prompt, *pooled)


def _sample(logits, positions, sampling: SamplingBatch, bitmask) -> SampleResult:
    """logits f32[B, V], positions i32[B], bitmask i32[B, ceil(V/32)] -> SampleResult."""
    return SampleResult(*sample(logits, positions, sampling, bitmask))


def _logits(graphdef, state, kv_cache: KVCache, batch: StepBatch):
    """Offline variant for parity checks: the logits f32[B, T, V] at every new position."""
    model = nnx.merge(graphdef, state)
    hidden, k, v = model(batch.tokens, batch.positions, batch.valid, kv_cache.k, kv_cache.v,
                         batch.block_tables)
    return KVCache(k=k, v=v), model.logits(hidden)


@dataclasses.dataclass(frozen=True)
class StepFunctions:
    """One runner's jitted steps."""

    prefill: Callable  # (graphdef, state, kv_cache, batch) -> (kv_cache, ForwardResult)
    decode: Callable  # the same, T = 1
    sample: Callable  # (logits, positions, sampling, bitmask) -> SampleResult
    logits: Callable  # offline parity: (graphdef, state, kv_cache, batch) -> (kv_cache, f32[B, T, V])


_MODEL_BODIES = (functools.partial(_forward, is_prefill=True), functools.partial(_forward, is_prefill=False))


def jit_steps(shardings: RunnerShardings | None = None) -> StepFunctions:
    """jax.jit the step bodies for one runner, donating the KV cache (argument 2) of the
    model calls; the sampler donates nothing.

    With shardings: state, KV and batch get explicit in_shardings, the KV comes back with
    its own sharding (so the next step takes it without a reshard or recompile) and the
    outputs come back replicated; the sampler takes and returns replicated arrays.
    Without: a plain jit on the default device, shared by every unsharded runner (so
    equal graphdefs and shapes reuse one trace).
    """
    if shardings is None:
        return _unsharded_steps()
    kv = kv_cache_shardings(shardings)
    rep = shardings.replicated
    prefill, decode, logits = (jax.jit(fn, static_argnums=(0,), donate_argnums=(2,),
                                       in_shardings=(shardings.state, kv, rep), out_shardings=(kv, rep))
                               for fn in _MODEL_BODIES + (_logits,))
    sample_step = jax.jit(_sample, in_shardings=(rep, rep, rep, rep), out_shardings=rep)
    return StepFunctions(prefill=prefill, decode=decode, sample=sample_step, logits=logits)


@functools.cache
def _unsharded_steps() -> StepFunctions:
    prefill, decode, logits = (jax.jit(fn, static_argnums=(0,), donate_argnums=(2,))
                               for fn in _MODEL_BODIES + (_logits,))
    return StepFunctions(prefill=prefill, decode=decode, sample=jax.jit(_sample), logits=logits)
