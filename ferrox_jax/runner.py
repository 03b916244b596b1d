"""ModelRunner: turns a StepPlan into padded device batches and runs the step functions.

It owns the device state (weights and KV cache) and is touched only by the owner
thread. Every shape comes from `Buckets`; `warmup()` compiles all of them ahead of time
(AOT: `lower().compile()`), and a shape first seen afterwards is compiled on demand and
counted in `recompiles_after_warmup` (it should stay 0: tests assert it).

`run(plan)`, in order:
  1. block copies, then every model call is dispatched: each prefill chunk (one row,
     T = token bucket), then one decode step over the decode rows (B = row bucket).
     Dispatch is asynchronous: the calls run on the device while the host goes on.
  2. Meanwhile, per call that samples: the host builds the rows' sampling inputs and
     fills the grammar bitmask of its constrained rows (`fill_bitmask`, llguidance's
     thread pool with the GIL released; unconstrained rows carry all ones), then
     dispatches the sampler on the call's logits. The mask for a row depends on the
     token it sampled last step, so this is the earliest it can be computed, and the
     model call is what it hides behind.
  3. All results come back to the host in a single `jax.device_get`.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import math
import os
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ferrox_jax.buckets import Buckets, pick
from ferrox_jax.kv_cache import KVCache, copy_blocks, create_kv_cache
from ferrox_jax.plan import RowStep, StepOutput, StepPlan
from ferrox_jax.request import RowResult
from ferrox_jax.sampling import host_sampling_batch
from ferrox_jax.sharding import runner_shardings
from ferrox_jax.step import ForwardResult, SampleResult, StepBatch, jit_steps
from models.attention import ATTENTION_CHUNK_BLOCKS

log = logging.getLogger(__name__)
COPY_BATCH = 8  # block copies are padded to this many pairs (0 -> 0 is a no-op copy)
COPY_KEY = ("copy",)  # the block-copy executable's key among the compiled shapes
ALL_TOKENS_ALLOWED = -1  # a bitmask word with every bit set (`ferrox_jax/grammar.py`)

# fill_bitmask(bitmask i32[B, W], matchers): writes every row, constrained rows from their
# matcher and the rest all ones (`ferrox_jax.grammar.GrammarCompiler.fill_bitmask`).
BitmaskFiller = Callable[[np.ndarray, Sequence], None]


def block_table_width(max_context: int, block_size: int) -> int:
    """Blocks per row in every step's block table: enough for `max_context` positions,
    rounded up to a multiple of the attention loop's chunk (`models/attention.py`)."""
    num_blocks = math.ceil(max_context / block_size)
    return -(-num_blocks // ATTENTION_CHUNK_BLOCKS) * ATTENTION_CHUNK_BLOCKS


class ModelRunner:
    """Device side of the engine (implements `ferrox_jax.plan.Runner`)."""

    def __init__(self, model, num_blocks: int, block_size: int, max_rows: int,
                 max_prefill_tokens: int, max_context: int, kv_dtype=None, mesh=None,
                 replicate_attention: bool = False, fill_bitmask: BitmaskFiller | None = None):
        """Args:
          model: the built model, its decode attention already chosen (`models/loader.py`).
          num_blocks: KV cache blocks, the null block 0 included.
          max_rows, max_prefill_tokens: the largest row and token buckets.
          max_context: positions a row may reach (sets the block-table width).
          kv_dtype: the cache dtype (default: the model's).
          mesh: place weights and KV with NamedShardings and jit the steps with explicit
            in/out shardings (`ferrox_jax/sharding.py`); None keeps everything on one device.
          replicate_attention: on a mesh, replicate attention weights and KV.
          fill_bitmask: computes grammar masks for rows whose RowStep carries a matcher
            (the engine's `GrammarCompiler.fill_bitmask`); None: no row may carry one.
        """
        cfg = model.cfg
        self.cfg = cfg
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_rows = max_rows
        self.max_prefill_tokens = max_prefill_tokens
        self.max_context = max_context
        self.vocab_size = cfg.vocab_size
        self.compute_dtype = model.dtype
        self.kv_dtype = kv_dtype or model.dtype
        self.max_blocks_per_row = block_table_width(max_context, block_size)
        self.buckets = Buckets.derive(max_rows, max_prefill_tokens)
        self.mesh = mesh
        self.graphdef, self.state = nnx.split(model)
        self.shardings = None if mesh is None else runner_shardings(mesh, cfg, self.state, replicate_attention)
        if self.shardings is not None:
            self.state = jax.device_put(self.state, self.shardings.state)
        self._steps = jit_steps(self.shardings)
        self.kv_cache: KVCache = create_kv_cache(
            cfg.num_layers, cfg.num_kv_heads, num_blocks, block_size, cfg.head_dim, self.kv_dtype,
            sharding=None if self.shardings is None else self.shardings.kv_array)
        self._compiled: dict[tuple, Callable] = {}
        self.is_warm = False
        self.recompiles_after_warmup = 0
        self.fill_bitmask = fill_bitmask
        self.bitmask_words = -(-self.vocab_size // 32)  # int32 words per bitmask row
        self._all_ones: dict[int, jax.Array] = {}  # rows -> all-ones bitmask, on the device

    # ---- compilation -------------------------------------------------------------
    def _compile(self, key: tuple) -> Callable:
        """AOT-compile one (kind, rows, tokens) bucket, or ("copy",) for block copies."""
        if key[0] == "copy":
            pairs = jnp.zeros(COPY_BATCH, jnp.int32)
            return copy_blocks.lower(self.kv_cache, pairs, pairs).compile()
        kind, b, t = key
        if kind == "sample":
            logits = jnp.zeros((b, self.vocab_size), jnp.float32)
            positions = jnp.zeros(b, jnp.int32)
            sampling = jax.device_put(host_sampling_batch([None] * b, [()] * b, [0] * b, b, self.vocab_size))
            return self._steps.sample.lower(logits, positions, sampling, self._all_ones_mask(b)).compile()
        step = self._steps.prefill if kind == "prefill" else self._steps.decode
        return step.lower(self.graphdef, self.state, self.kv_cache, self._dummy_batch(b, t)).compile()

    def _executable(self, key: tuple) -> Callable:
        exe = self._compiled.get(key)
        if exe is None:
            if self.is_warm:
                self.recompiles_after_warmup += 1
                log.warning("compiling shape %s after warm-up (recompile #%d)", key, self.recompiles_after_warmup)
            exe = self._compiled[key] = self._compile(key)
        return exe

    def warmup(self, progress: Callable[[int, int, tuple], None] | None = None,
               num_threads: int | None = None) -> float:
        """Compile every bucket and the block copy ahead of time; returns seconds taken.
        Nothing is executed. XLA compiles release the GIL, so they run one thread per core.
        """
        t0 = time.perf_counter()
        keys = [k for k in self.buckets.keys() + [COPY_KEY] if k not in self._compiled]
        num_threads = num_threads or min(len(keys), os.cpu_count() or 1) or 1
        with concurrent.futures.ThreadPoolExecutor(num_threads) as pool:
            for i, (key, exe) in enumerate(zip(keys, pool.map(self._compile, keys))):
                self._compiled[key] = exe
                if progress:
                    progress(i + 1, len(keys), key)
        self.is_warm = True
        return time.perf_counter() - t0

    def _dummy_batch(self, b: int, t: int) -> StepBatch:
        return jax.device_put(self._host_batch([None] * b, b, t))

    # ---- host batch building -------------------------------------------------------
    def _host_batch(self, rows: list[RowStep | None], b: int, t: int) -> StepBatch:
        """The step's inputs as a StepBatch of numpy arrays (None rows are padding);
        `jax.device_put` moves it to the device in one call."""
        mb = self.max_blocks_per_row
        tokens = np.zeros((b, t), np.int32)
        positions = np.zeros((b, t), np.int32)
        valid = np.zeros((b, t), bool)
        tables = np.zeros((b, mb), np.int32)
        last = np.zeros(b, np.int32)
        next_tokens = np.full((b, t), -1, np.int32)
        want_prompt = False
        for i, row in enumerate(rows):
            if row is None:
                continue
            n = len(row.token_ids)
            tokens[i, :n] = row.token_ids
            positions[i, :n] = np.arange(row.start_pos, row.start_pos + n)
            valid[i, :n] = True
            needed = math.ceil((row.start_pos + n) / self.block_size)
            if needed > len(row.block_ids):
                raise ValueError(f"row {row.row_id}: block table has {len(row.block_ids)} blocks "
                                 f"but positions up to {row.start_pos + n - 1} need {needed}")
            if needed > mb:
                raise ValueError(f"row {row.row_id}: position {row.start_pos + n - 1} is beyond the "
                                 f"context ceiling of {self.max_context} tokens")
            tables[i, :needed] = row.block_ids[:needed]
            last[i] = n - 1
            if row.prompt_logprobs:
                want_prompt = True
                next_tokens[i, : n - 1] = row.token_ids[1:]
                next_tokens[i, n - 1] = row.next_token_id
        return StepBatch(tokens=tokens, positions=positions, valid=valid, block_tables=tables,
                         last_index=last, next_tokens=next_tokens, want_prompt_logprobs=np.asarray(want_prompt))

    def _host_sampling(self, rows: list[RowStep], b: int):
        """The rows' SamplingBatch (numpy leaves), padded to `b` rows."""
        rows = list(rows) + [None] * (b - len(rows))
        return host_sampling_batch(
            [r.sampling if r is not None else None for r in rows],
            [r.history_token_ids if r is not None else () for r in rows],
            [r.num_prompt_tokens if r is not None else 0 for r in rows], b, self.vocab_size)

    def _all_ones_mask(self, b: int) -> jax.Array:
        """The bitmask of `b` unconstrained rows, kept on the device (no transfer per step)."""
        mask = self._all_ones.get(b)
        if mask is None:
            host = np.full((b, self.bitmask_words), ALL_TOKENS_ALLOWED, np.int32)
            sharding = None if self.shardings is None else self.shardings.replicated
            mask = self._all_ones[b] = jax.device_put(host, sharding)
        return mask

    # ---- running -------------------------------------------------------------------
    def _run_prefill(self, row: RowStep):
        n = len(row.token_ids)
        if n > self.max_prefill_tokens:
            raise ValueError(f"prefill chunk of {n} tokens exceeds the largest bucket {self.max_prefill_tokens}")
        t = pick(self.buckets.prefill_tokens, n)
        batch = jax.device_put(self._host_batch([row], 1, t))
        exe = self._executable(("prefill", 1, t))
        self.kv_cache, result = exe(self.state, self.kv_cache, batch)
        return result

    def _run_decode(self, rows: list[RowStep]):
        for r in rows:
            if len(r.token_ids) != 1:
                raise ValueError(f"decode row {r.row_id} has {len(r.token_ids)} tokens; expected 1")
        b = pick(self.buckets.decode_rows, len(rows))
        batch = jax.device_put(self._host_batch(list(rows) + [None] * (b - len(rows)), b, 1))
        exe = self._executable(("decode", b, 1))
        self.kv_cache, result = exe(self.state, self.kv_cache, batch)
        return result

    def _run_copies(self, copies) -> None:
        copy = self._executable(COPY_KEY)
        for i in range(0, len(copies), COPY_BATCH):
            part = list(copies[i:i + COPY_BATCH])
            part += [(0, 0)] * (COPY_BATCH - len(part))
            src = jnp.asarray([s for s, _ in part], jnp.int32)
            dst = jnp.asarray([d for _, d in part], jnp.int32)
            self.kv_cache = copy(self.kv_cache, src, dst)

    def run(self, plan: StepPlan) -> StepOutput:
        """Runs one tick's device work (module docstring, steps 1-3)."""
        t0 = time.perf_counter()
        if plan.block_copies:
            self._run_copies(plan.block_copies)
        calls: list[tuple[list[RowStep], ForwardResult]] = []
        for row in plan.prefill:
            calls.append(([row], self._run_prefill(row)))
        decode_rows = list(plan.decode)
        for i in range(0, len(decode_rows), self.max_rows):
            group = decode_rows[i:i + self.max_rows]
            calls.append((group, self._run_decode(group)))
        masks = _MaskTimes()
        sampled = [self._run_sample(rows, forward, masks) for rows, forward in calls]
        fetched = jax.device_get([(forward, samples) for (_, forward), samples in zip(calls, sampled)])
        results: dict[int, RowResult] = {}
        for (rows, _), (forward, samples) in zip(calls, fetched):
            for i, row in enumerate(rows):
                if row.sample or row.prompt_logprobs or row.pooling:
                    results[row.row_id] = self._row_result(row, forward, samples, i)
        return StepOutput(results=results, device_s=time.perf_counter() - t0, mask_s=masks.seconds,
                          num_mask_rows=masks.num_rows, num_mask_fills=masks.num_fills,
                          num_mask_fills_hidden=masks.num_hidden)

    def _run_sample(self, rows: list[RowStep], forward: ForwardResult, masks: _MaskTimes) -> SampleResult | None:
        """Dispatches the sampler for one model call's rows (None when none samples), after
        filling the constrained rows' grammar masks while that call runs."""
        if not any(row.sample for row in rows):
            return None
        b = forward.logits.shape[0]
        sampling = self._host_sampling(rows, b)
        matchers = [row.matcher if row.sample else None for row in rows]
        if any(m is not None for m in matchers):
            if self.fill_bitmask is None:
                raise ValueError("a row carries a grammar matcher but the runner has no fill_bitmask")
            bitmask = np.empty((b, self.bitmask_words), np.int32)
            start_s = time.perf_counter()
            self.fill_bitmask(bitmask, matchers)
            masks.add(time.perf_counter() - start_s, sum(m is not None for m in matchers),
                      is_hidden=not forward.logits.is_ready())
            sampling, bitmask = jax.device_put((sampling, bitmask))
        else:
            sampling, bitmask = jax.device_put(sampling), self._all_ones_mask(b)
        exe = self._executable(("sample", b, 1))
        return exe(forward.logits, forward.sample_pos, sampling, bitmask)

    def run_logits(self, rows: list[RowStep]) -> list[np.ndarray]:
        """Offline (tests, tools/compare_logits.py): write the rows' tokens into the cache
        and return each row's logits f32[len(token_ids), V]. Shapes are not bucketed."""
        t = max(len(r.token_ids) for r in rows)
        batch = jax.device_put(self._host_batch(list(rows), len(rows), t))
        self.kv_cache, logits = self._steps.logits(self.graphdef, self.state, self.kv_cache, batch)
        logits = np.asarray(jax.device_get(logits))
        return [logits[i, : len(r.token_ids)] for i, r in enumerate(rows)]

    def _row_result(self, row: RowStep, forward, samples, i: int) -> RowResult:
        k = row.sampling.logprobs or 0
        prompt = ()
        if row.prompt_logprobs:
            n = len(row.token_ids) if row.next_token_id >= 0 else len(row.token_ids) - 1
            prompt = tuple(
                (float(forward.prompt_logprob[i, j]),
                 tuple(zip(forward.prompt_top_ids[i, j, :k].tolist(), forward.prompt_top_logprobs[i, j, :k].tolist())))
                for j in range(n)
            )
        pooled = (forward.hidden_sum[i], forward.last_hidden[i]) if row.pooling else (None, None)
        if not row.sample:  # a prompt-logprobs chunk that is not the prompt's last, or pooling
            return RowResult(row_id=row.row_id, token_id=-1, prompt_logprobs=prompt, hidden_sum=pooled[0],
                             last_hidden=pooled[1])
        top = tuple(zip(samples.top_ids[i, :k].tolist(), samples.top_logprobs[i, :k].tolist()))
        return RowResult(row_id=row.row_id, token_id=int(samples.tokens[i]), logprob=float(samples.logprob[i]),
                         top_logprobs=top, prompt_logprobs=prompt)


@dataclasses.dataclass
class _MaskTimes:
    """Grammar mask cost within one run (reported in StepOutput)."""

    seconds: float = 0.0
    num_rows: int = 0
    num_fills: int = 0
    num_hidden: int = 0

    def add(self, seconds: float, num_rows: int, is_hidden: bool) -> None:
        self.seconds += seconds
        self.num_rows += num_rows
        self.num_fills += 1
        self.num_hidden += is_hidden
