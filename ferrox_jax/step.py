"""The jitted step functions: `forward_step` and `sample_step`, jitted here and nowhere else.

A step is two device calls, so that the host can compute grammar masks while the model
runs (`ferrox_jax/runner.py` dispatches the first, fills the masks, then the second):

  * `forward_step(graphdef, state_tree, state_leaves, kv_cache, batch) -> (kv_cache,
    ForwardResult)`: run the
    model over every row's new tokens at once (decode rows and prompt chunks, one flat
    token axis; `ferrox_jax/buckets.py` gives the shapes), writing their K/V into the paged
    cache (layout in `kv_cache.py`), and return the logits at each row's last new token.
    It also returns prompt logprobs for every token when some row asks (echo scoring;
    skipped otherwise), and each row's final hidden states pooled (summed over its valid
    tokens, and its last one) for embeddings jobs; for a model that feeds the MTP draft
    (`keeps_step_hidden`, a static attribute of its graph) every token's hidden state too.
    The graphdef and the state's treedef are static, the state's leaves traced, and only
    the KV cache is donated
    (`donate_argnames`): the caller rebinds it in the same statement
    (`self.kv_cache, out = step(graphdef, tree, leaves, self.kv_cache, batch)`).
  * `sample_step(logits, positions, sampling, bitmask) -> SampleResult`: apply the rows'
    grammar bitmask (all ones for unconstrained rows) and sample (`sampling.py`), packed
    in one i32 array for one fetch. Its shapes depend only on the row count.

`jit_steps(shardings)` jits the bodies once per runner: plain `jax.jit` on one device, or
with explicit in/out shardings on a mesh (`ferrox_jax/sharding.py`).

`ForwardBatch` is the padded forward input, built on the host with numpy leaves from a
`HostBatch` (`ferrox_jax/runner.py`) and handed to the compiled step as it is (the
executable's own transfer is cheaper than a Python `jax.device_put`), except in a
multi-process group, where it is placed first.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from ferrox_jax.buckets import StepShape
from ferrox_jax.host_batch import SamplingArrays
from ferrox_jax.kv_cache import KVCache
from ferrox_jax.request import MAX_LOGPROBS
from ferrox_jax.sampling import sample_checked
from ferrox_jax.sharding import RunnerShardings, kv_cache_shardings
from models.lora import bind_token_slots


@struct.dataclass
class ForwardBatch:
    """Inputs of one forward, padded to a `StepShape` (numpy leaves on the host, jax
    arrays on the device). N tokens, flat, segment after segment; R = sum of B_s rows."""

    tokens: jax.Array  # i32[N]
    positions: jax.Array  # i32[N]
    valid: jax.Array  # bool[N]
    block_tables: tuple[jax.Array, ...]  # one i32[B_s, MB] per segment
    last_index: jax.Array  # i32[R]: flat index of each row's last new token
    next_tokens: jax.Array  # i32[N]: token following each position, -1 if unknown
    row_of_token: jax.Array  # i32[N]: the row each token belongs to (R for padding)
    want_prompt_logprobs: jax.Array  # bool[]: compute prompt logprobs
    segment_tokens: tuple[int, ...] = struct.field(pytree_node=False, default=())  # tokens per row, per segment
    adapter_slots: jax.Array | None = None  # i32[N]: each token's LoRA slot (0 = none); None: no LoRA
    # i32[R]: each padded row's recurrent state slot (0: the null slot; read only by a model with
    # recurrent layers, `ferrox_jax/state_pool.py`); None: a batch built without one (tools)
    state_slots: jax.Array | None = None
    # A model taking images (None otherwise, so a text model's pytree is unchanged):
    image_embeds: jax.Array | None = None  # f32[N, D]: an image's soft token where image_mask is set
    image_mask: jax.Array | None = None  # bool[N]
    attend_until: jax.Array | None = None  # i32[N]: furthest key position each token sees
    rope_positions: jax.Array | None = None  # i32[N, 3]: M-RoPE positions (a model with them; None otherwise)
    # one i32[B_s, MB] per segment: the sliding-window layers' slots (ferrox_jax/kv_groups.py); None: no such pool
    window_tables: tuple[jax.Array, ...] | None = None
    # bool[]: some row reads every token's final hidden state (prompt logprobs, pooling); while
    # it is False a model whose `finishes_kept_rows` runs its last layer's MLP over each row's
    # last new token only. None (a batch built by hand): every token's, always.
    want_every_hidden: jax.Array | None = None

    @classmethod
    def padding(cls, shape: StepShape, table_width: int, has_lora: bool = False,
                image_width: int = 0, mrope: bool = False) -> "ForwardBatch":
        """A batch of `shape` with numpy leaves, every token padding (what warm-up compiles
        against, and what `tools/device/export_steps.py` lowers). `image_width`: the hidden
        size of a model taking images (0: none)."""
        n, r = shape.num_tokens, shape.num_rows
        segments = [(rows, tokens) for rows, tokens in ((shape.decode_rows, 1), (shape.chunk_rows, shape.chunk_tokens))
                    if rows]
        return cls(tokens=np.zeros(n, np.int32), positions=np.zeros(n, np.int32), valid=np.zeros(n, bool),
                   block_tables=tuple(np.zeros((rows, table_width), np.int32) for rows, _ in segments),
                   last_index=np.zeros(r, np.int32), next_tokens=np.full(n, -1, np.int32),
                   row_of_token=np.full(n, r, np.int32), want_prompt_logprobs=np.asarray(False),
                   segment_tokens=tuple(tokens for _, tokens in segments),
                   adapter_slots=np.zeros(n, np.int32) if has_lora else None,
                   state_slots=np.zeros(r, np.int32), want_every_hidden=np.asarray(False),
                   **image_padding(n, image_width, mrope))


def image_padding(num_tokens: int, image_width: int, mrope: bool = False) -> dict:
    """The image fields of a batch of `num_tokens` padding tokens (none when `image_width` is 0;
    `mrope`: the M-RoPE position column too)."""
    if not image_width:
        return {}
    out = dict(image_embeds=np.zeros((num_tokens, image_width), np.float32),
               image_mask=np.zeros(num_tokens, bool), attend_until=np.zeros(num_tokens, np.int32))
    return {**out, "rope_positions": np.zeros((num_tokens, 3), np.int32)} if mrope else out


@struct.dataclass
class ForwardResult:
    """What the forward leaves on the device for the sampler and the host."""

    logits: jax.Array  # f32[R, V] at each row's last new token
    sample_pos: jax.Array  # i32[R]: the position the sampled token will occupy
    prompt_logprob: jax.Array  # f32[N] logprob of next_tokens[n] after token n (zeros unless asked)
    prompt_top_ids: jax.Array  # i32[N, 20]
    prompt_top_logprobs: jax.Array  # f32[N, 20]
    hidden_sum: jax.Array  # f32[R, D]: final hidden states summed over each row's valid tokens
    last_hidden: jax.Array  # f32[R, D]: the state at each row's last new token
    # f32[N, D] every token's final hidden state, left on the device for `--speculative mtp`'s
    # layer (`ferrox_jax/mtp.py`) when the model's `keeps_step_hidden` is set; else [0, D]
    hidden: jax.Array


@struct.dataclass
class SampleResult:
    """Sampler outputs packed in one array (`pack_sampled`), fetched as one buffer."""

    packed: jax.Array  # i32[R, SAMPLED_COLUMNS]: the columns are pack_sampled's


def _prompt_logprobs(model, hidden, next_tokens):
    logprobs = jax.nn.log_softmax(model.logits(hidden), axis=-1)  # [N, V]
    chosen = jnp.take_along_axis(logprobs, jnp.maximum(next_tokens, 0)[..., None], axis=-1)[..., 0]
    top_lp, top_ids = jax.lax.top_k(logprobs, MAX_LOGPROBS)
    return chosen, top_ids.astype(jnp.int32), top_lp


def _run_model(graphdef, state, kv_cache: KVCache, batch: ForwardBatch, kept_rows: bool = False):
    """(model, hidden, kv_cache); `kept_rows` (the forward step): hidden may come as (every
    token's [N, D], each row's last new token's [R, D]), see `ForwardBatch.want_every_hidden`."""
    model = nnx.merge(graphdef, state)
    if batch.adapter_slots is not None:
        bind_token_slots(model, batch.adapter_slots)
    images = None if batch.image_embeds is None else (batch.image_embeds, batch.image_mask, batch.attend_until)
    if images is not None and batch.rope_positions is not None:
        images = (*images, batch.rope_positions)
    # A family without window tables keeps its signature (only the shared decoder takes them).
    windows = {} if batch.window_tables is None else {"window_tables": batch.window_tables}
    args = (batch.tokens, batch.positions, batch.valid, kv_cache.k, kv_cache.v, batch.block_tables,
            batch.segment_tokens, images)
    if kv_cache.states is None:
        # The last layer's MLP over each row's last new token only, where nothing reads the
        # others' hidden states (a LoRA batch keeps every token: its slots are bound per token).
        if kept_rows and batch.want_every_hidden is not None and batch.adapter_slots is None and model.finishes_kept_rows:
            hidden, last_hidden, k, v = model(*args, **windows, keep=(batch.last_index, batch.want_every_hidden))
            return model, (hidden, last_hidden), KVCache(k=k, v=v)
        hidden, k, v = model(*args, **windows)
        return model, hidden, KVCache(k=k, v=v)
    # a model with recurrent layers: its state slots go in and come back beside the K/V
    hidden, k, v, states = model(*args, states=kv_cache.states, state_slots=batch.state_slots, **windows)
    return model, hidden, KVCache(k=k, v=v, states=states)


def _forward(graphdef, state_tree, state_leaves, kv_cache: KVCache, batch: ForwardBatch):
    """The state comes as its flat leaves and their (static) treedef: a call then hands
    XLA a list of arrays, where an `nnx.State` was flattened in Python every step (with
    numpy batch leaves instead of a `device_put`: 1.6 -> 0.3 ms of host time a call for the
    default model's 273 leaves, one thread, AMD EPYC)."""
    state = jax.tree.unflatten(state_tree, state_leaves)
    model, hidden, kv_cache = _run_model(graphdef, state, kv_cache, batch, kept_rows=True)
    hidden, last_hidden = hidden if isinstance(hidden, tuple) else (hidden, hidden[batch.last_index])  # [N, D], [R, D]
    n, _ = hidden.shape
    rows = batch.last_index.shape[0]
    logits = model.logits(last_hidden)  # f32[R, V]
    sample_pos = batch.positions[batch.last_index] + 1
    zeros = (jnp.zeros((n,), jnp.float32), jnp.zeros((n, MAX_LOGPROBS), jnp.int32),
             jnp.zeros((n, MAX_LOGPROBS), jnp.float32))
    prompt = jax.lax.cond(batch.want_prompt_logprobs,
                          lambda: _prompt_logprobs(model, hidden, batch.next_tokens), lambda: zeros)
    # Pooling outputs for embeddings jobs, in the same executable: one segment sum over
    # [N, D], so every shape serves them without a compile of its own.
    valid_hidden = jnp.where(batch.valid[:, None], hidden.astype(jnp.float32), 0.0)
    hidden_sum = jax.ops.segment_sum(valid_hidden, batch.row_of_token, num_segments=rows + 1)[:rows]
    every = (hidden if model.keeps_step_hidden else hidden[:0]).astype(jnp.float32)
    return kv_cache, ForwardResult(logits, sample_pos, *prompt, hidden_sum, last_hidden.astype(jnp.float32), every)


SAMPLED_COLUMNS = 3 + 2 * MAX_LOGPROBS


def pack_sampled(tokens, logprob, top_ids, top_logprobs, finite) -> SampleResult:
    """The sampler's arrays (i32[R], f32[R], i32[R, K], f32[R, K], bool[R]) as one
    i32[R, SAMPLED_COLUMNS], so that the host fetches one buffer: five arrays fetched one
    by one cost the owner thread ~0.16 ms more CPU a step (jax's per-array fetch path).
    Floats keep their bits (a bitcast), so what the host reads back
    (`ferrox_jax/padding.py:split_sampled`) is exactly what was sampled. Columns, K = MAX_LOGPROBS:

        0           the sampled token                     i32
        1           its raw logprob                       f32 bits
        2..K+1      the top-K token ids, best first       i32
        K+2..2K+1   their raw logprobs                    f32 bits
        2K+2        every raw logit of the row finite     0 / 1 (NaN/inf: a step fault)
    """
    as_int = functools.partial(jax.lax.bitcast_convert_type, new_dtype=jnp.int32)
    return SampleResult(jnp.concatenate([tokens[:, None].astype(jnp.int32), as_int(logprob)[:, None],
                                         top_ids.astype(jnp.int32), as_int(top_logprobs),
                                         finite[:, None].astype(jnp.int32)], axis=1))


def _sample(logits, positions, sampling: SamplingArrays, bitmask, cpu_kernel: bool = False) -> SampleResult:
    """logits f32[R, V], positions i32[R], bitmask i32[R, ceil(V/32)] -> SampleResult
    (`ferrox_jax/sampling.py:sample_checked`; cpu_kernel: its CPU kernel path)."""
    return pack_sampled(*sample_checked(logits, positions, sampling, bitmask, cpu_kernel=cpu_kernel))


def _logits(graphdef, state, kv_cache: KVCache, batch: ForwardBatch):
    """Offline variant for parity checks: the logits f32[N, V] at every new token."""
    model, hidden, kv_cache = _run_model(graphdef, state, kv_cache, batch)
    return kv_cache, model.logits(hidden)


@dataclasses.dataclass(frozen=True)
class JittedSteps:
    """One runner's jitted step functions."""

    forward: Callable  # (graphdef, state treedef, state leaves, kv_cache, batch) -> (kv_cache, ForwardResult)
    sample: Callable  # (logits, positions, sampling, bitmask) -> SampleResult
    logits: Callable  # offline parity: (graphdef, state, kv_cache, batch) -> (kv_cache, f32[N, V])


def jit_steps(shardings: RunnerShardings | None = None, cpu_sampler: bool = False) -> JittedSteps:
    """jax.jit the step bodies for one runner, donating the KV cache of the model calls
    (by name); the sampler donates nothing.

    With shardings: state, KV and batch get explicit in_shardings, the KV comes back with
    its own sharding (so the next step takes it without a reshard or recompile) and the
    outputs come back replicated; the sampler takes and returns replicated arrays.
    Without: a plain jit on the default device, shared by every unsharded runner (so
    equal graphdefs and shapes reuse one trace); `cpu_sampler` (the caller checked that
    the CPU kernels run here) samples on `sample_checked`'s kernel path. A sharded sampler
    stays on XLA's (the kernel has no partitioning rule).
    """
    if shardings is None:
        return _unsharded_steps(cpu_sampler)
    kv = kv_cache_shardings(shardings)
    rep = shardings.replicated
    forward = jax.jit(_forward, static_argnums=(0, 1), donate_argnames=("kv_cache",),
                      in_shardings=(jax.tree.leaves(shardings.state), kv, rep), out_shardings=(kv, rep))
    logits = jax.jit(_logits, static_argnums=(0,), donate_argnames=("kv_cache",),
                     in_shardings=(shardings.state, kv, rep), out_shardings=(kv, rep))
    sample_step = jax.jit(_sample, in_shardings=(rep, rep, rep, rep), out_shardings=rep)
    return JittedSteps(forward=forward, sample=sample_step, logits=logits)


@functools.cache
def _unsharded_steps(cpu_sampler: bool) -> JittedSteps:
    forward = jax.jit(_forward, static_argnums=(0, 1), donate_argnames=("kv_cache",))
    logits = jax.jit(_logits, static_argnums=(0,), donate_argnames=("kv_cache",))
    return JittedSteps(forward=forward, sample=jax.jit(functools.partial(_sample, cpu_kernel=cpu_sampler)),
                       logits=logits)
