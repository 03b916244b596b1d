"""ModelRunner: pads a `HostBatch` to a compiled step shape, dispatches it, fetches the results.

It owns the device state (weights and KV cache) and is touched only by the owner
thread. Every shape comes from `Buckets`; `warmup()` compiles all of them ahead of time
(AOT: `lower().compile()`), and a shape first seen afterwards is compiled on demand and
counted in `recompiles_after_warmup` (it should stay 0: tests assert it).

`run(batch, fill_masks)`, in order:
  1. Pad: rows of one new token go to the decode segment, longer rows (prompt chunks) to
     the chunk segment; a speculating row (its last token and d drafts, sampled after each:
     `num_logits` 1 + d) becomes 1 + d consecutive one-token decode rows sharing its block
     table, at consecutive positions. Every token's K/V is written before any row attends,
     so the row at position p + j reads the drafts before it: causal verification through
     the one-query kernels, with no shape of its own. The smallest `StepShape` holding both
     is picked and the batch's arrays are laid out in it (`ForwardBatch`, numpy, handed to the
     compiled step as they are).
  2. Dispatch: block copies, then the one forward over every row. Dispatch is
     asynchronous: the forward runs on the device while the host goes on.
  3. Meanwhile, if some row is constrained, `fill_masks(batch, forward_is_done)` fills its
     grammar bitmask rows (llguidance's thread pool, GIL released). The mask for a row
     depends on the token it sampled last step, so this is the earliest it can be
     computed, and the forward is what it hides behind.
  4. The sampler runs on the forward's logits; everything comes back in one
     `jax.device_get`, un-padded to host-batch rows (`StepArrays`).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import math
import os
import time
from typing import TYPE_CHECKING, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ferrox_jax.buckets import Buckets, StepShape
if TYPE_CHECKING:
    from ferrox_jax.draft import DraftModel
from ferrox_jax.host_batch import ALL_TOKENS_ALLOWED, BatchGeometry, HostBatch, SamplingArrays, StepArrays
from ferrox_jax.kv_cache import KVCache, copy_blocks, create_kv_cache
from ferrox_jax.multihost import place_on_mesh
from ferrox_jax.shared_compiles import SharedCompiles
from ferrox_jax.plan import MaskFiller, RowPlan
from ferrox_jax.sharding import runner_shardings
from ferrox_jax.step import ForwardBatch, ForwardResult, jit_steps
from models.attention import ATTENTION_CHUNK_BLOCKS
from models.lora import lora_slot_count

log = logging.getLogger(__name__)
COPY_BATCH = 8  # block copies are padded to this many pairs (0 -> 0 is a no-op copy)
COPY_KEY = ("copy",)  # the block-copy executable's key among the compiled shapes


def block_table_width(max_context: int, block_size: int) -> int:
    """Blocks per row in every step's block table: enough for `max_context` positions,
    rounded up to a multiple of the attention loop's chunk (`models/attention.py`)."""
    num_blocks = math.ceil(max_context / block_size)
    return -(-num_blocks // ATTENTION_CHUNK_BLOCKS) * ATTENTION_CHUNK_BLOCKS


class ModelRunner:
    """Device side of the engine (implements `ferrox_jax.plan.Runner`)."""

    def __init__(self, model, num_blocks: int, block_size: int, max_rows: int, max_chunk_tokens: int,
                 max_context: int, kv_dtype=None, mesh=None, replicate_attention: bool = False,
                 max_chunks: int = 1):
        """Args:
          model: the built model, its decode attention already chosen (`models/loader.py`).
          num_blocks: KV cache blocks, the null block 0 included.
          max_rows: decode rows one step holds (the largest row bucket).
          max_chunk_tokens: tokens of one prompt chunk (the largest token bucket).
          max_context: positions a row may reach (sets the block-table width).
          kv_dtype: the cache dtype (default: the model's).
          mesh: place weights and KV with NamedShardings and jit the steps with explicit
            in/out shardings (`ferrox_jax/sharding.py`); None keeps everything on one device.
          replicate_attention: on a mesh, replicate attention weights and KV.
          max_chunks: prompt chunks one step holds (the token budget over the chunk size).
        """
        cfg = model.cfg
        self.cfg = cfg
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_rows = max_rows
        self.max_chunk_tokens = max_chunk_tokens
        self.max_chunks = max_chunks
        self.max_context = max_context
        self.vocab_size = cfg.vocab_size
        self.compute_dtype = model.dtype
        self.kv_dtype = kv_dtype or model.dtype
        self.geometry = BatchGeometry(block_size, block_table_width(max_context, block_size), cfg.vocab_size)
        self.buckets = Buckets.derive(max_rows, max_chunk_tokens, max_chunks)
        self.mesh = mesh
        self.graphdef, state = nnx.split(model)
        self.shardings = None if mesh is None else runner_shardings(mesh, cfg, state, replicate_attention)
        self.state = state if self.shardings is None else place_on_mesh(state, self.shardings.state)
        # One process: batch inputs go to the compiled steps as numpy (`ferrox_jax/step.py`).
        self._place_inputs = jax.process_count() > 1
        self._steps = jit_steps(self.shardings)
        self.max_loras = lora_slot_count(self.state)  # adapter slots the projections carry (0: no LoRA)
        self.has_lora = self.max_loras > 0
        self.kv_cache: KVCache = create_kv_cache(
            cfg.num_layers, cfg.num_kv_heads, num_blocks, block_size, cfg.head_dim, self.kv_dtype,
            sharding=None if self.shardings is None else self.shardings.kv_array)
        self._compiled: dict[tuple, Callable] = {}
        # Set by the engine builder in a multi-process group (`shared_compiles.SharedCompiles`):
        # process 0 compiles, the others load. None: this process compiles everything.
        self.shared_compiles: SharedCompiles | None = None
        self.is_warm = False
        self._recompiles = 0
        self.draft: DraftModel | None = None  # --speculative draft: mirrors every step (attach_draft)
        self.bitmask_words = -(-self.vocab_size // 32)  # int32 words per bitmask row
        self._all_ones: dict[int, jax.Array] = {}  # rows -> all-ones bitmask, on the device

    @property
    def state(self):
        """The weights as an `nnx.State`; kept flat too (`_state_leaves`), which is what the
        forward takes. Rebinding it (LoRA slots, sleep / wake) refreshes both."""
        return self._state

    @state.setter
    def state(self, state) -> None:
        self._state = state
        if state is None:  # asleep (`ferrox_jax/sleep.py`)
            self._state_leaves = None
            return
        leaves, tree = jax.tree.flatten(state)
        if getattr(self, "_state_tree", tree) != tree:
            raise ValueError(f"a new state must have the old one's structure; got {tree} for {self._state_tree}")
        self._state_leaves, self._state_tree = leaves, tree

    def _to_step(self, tree):
        """Batch inputs as the compiled steps take them (module docstring of step.py)."""
        return jax.device_put(tree) if self._place_inputs else tree

    @property
    def max_blocks_per_row(self) -> int:
        return self.geometry.table_width

    @property
    def recompiles_after_warmup(self) -> int:
        """Shapes compiled after warm-up, the draft model's included (should stay 0)."""
        return self._recompiles + (self.draft.recompiles_after_warmup if self.draft is not None else 0)

    def attach_draft(self, draft_runner: ModelRunner) -> None:
        """`--speculative draft`: `draft_runner` (the draft checkpoint, built with this
        runner's geometry) mirrors every step from now on (`ferrox_jax/draft.py`)."""
        from ferrox_jax.draft import DraftModel

        self.draft = DraftModel(draft_runner, self)

    def propose_drafts(self, requests, pending_copies) -> list[tuple[int, ...]]:
        """The scheduler's `Speculator.proposer` for the draft method."""
        return self.draft.propose(requests, pending_copies)

    # ---- compilation -------------------------------------------------------------
    def compile_keys(self) -> list[tuple]:
        """Every executable warm-up compiles, as plain tuples (they go into logs and JSON):
        ("forward", Bd, Pc, Tc) per step shape, ("sample", rows) per sampler, ("copy",)."""
        return ([("forward", *dataclasses.astuple(shape)) for shape in self.buckets.shapes()]
                + [("sample", rows) for rows in self.buckets.sampler_rows()] + [COPY_KEY])

    def _lower(self, key: tuple) -> jax.stages.Lowered:
        if key == COPY_KEY:
            pairs = jnp.zeros(COPY_BATCH, jnp.int32)
            return copy_blocks.lower(self.kv_cache, pairs, pairs)
        if key[0] == "sample":
            rows = key[1]
            logits = jnp.zeros((rows, self.vocab_size), jnp.float32)
            positions = jnp.zeros(rows, jnp.int32)
            sampling = self._to_step(SamplingArrays.padding(rows, self.vocab_size))
            return self._steps.sample.lower(logits, positions, sampling, self._all_ones_mask(rows))
        batch = self._to_step(self._empty_forward(StepShape(*key[1:])))
        return self._steps.forward.lower(self.graphdef, self._state_tree, self._state_leaves, self.kv_cache, batch)

    def _compile(self, key: tuple) -> Callable:
        """Every executable, at warm-up or after it, comes from here: compiled by this
        process, or in a multi-process group by process 0 and loaded (`shared_compiles`)."""
        lowered = self._lower(key)
        if self.shared_compiles is None:
            return lowered.compile()
        return self.shared_compiles.compile("/".join(map(str, key)), lowered)

    def _executable(self, key: tuple) -> Callable:
        exe = self._compiled.get(key)
        if exe is None:
            if self.is_warm:
                self._recompiles += 1
                log.warning("compiling shape %s after warm-up (recompile #%d)", key, self._recompiles)
            exe = self._compiled[key] = self._compile(key)
        return exe

    def warmup(self, progress: Callable[[int, int, tuple], None] | None = None,
               num_threads: int | None = None) -> float:
        """Compile every shape and the block copy ahead of time; returns seconds taken.
        Nothing is executed. XLA compiles release the GIL, so they run one thread per core.
        """
        t0 = time.perf_counter()
        keys = [k for k in self.compile_keys() if k not in self._compiled]
        num_threads = num_threads or min(len(keys), os.cpu_count() or 1) or 1
        with concurrent.futures.ThreadPoolExecutor(num_threads) as pool:
            for i, (key, exe) in enumerate(zip(keys, pool.map(self._compile, keys))):
                self._compiled[key] = exe
                if progress:
                    progress(i + 1, len(keys), key)
        if self.draft is not None:
            self.draft.warmup()
        self.is_warm = True
        return time.perf_counter() - t0

    # ---- pad ---------------------------------------------------------------------------
    def _empty_forward(self, shape: StepShape) -> ForwardBatch:
        """A ForwardBatch of `shape` with numpy leaves, every token padding."""
        n, r, mb = shape.num_tokens, shape.num_rows, self.geometry.table_width
        segments = [(shape.decode_rows, 1), (shape.chunk_rows, shape.chunk_tokens)]
        segments = [(rows, tokens) for rows, tokens in segments if rows]
        return ForwardBatch(
            tokens=np.zeros(n, np.int32), positions=np.zeros(n, np.int32), valid=np.zeros(n, bool),
            block_tables=tuple(np.zeros((rows, mb), np.int32) for rows, _ in segments),
            last_index=np.zeros(r, np.int32), next_tokens=np.full(n, -1, np.int32),
            row_of_token=np.full(n, r, np.int32), want_prompt_logprobs=np.asarray(False),
            segment_tokens=tuple(tokens for _, tokens in segments),
            adapter_slots=np.zeros(n, np.int32) if self.has_lora else None)

    def _pad(self, batch: HostBatch) -> tuple[StepShape, np.ndarray, ForwardBatch]:
        """The step shape, `order` (i64[R]: the host row in each padded row, -1 for
        padding) and the padded forward inputs."""
        lengths = batch.row_lengths
        is_decode = (lengths == 1) | (batch.num_logits == lengths)  # one token, or every token sampled
        decode = np.flatnonzero(is_decode)
        chunks = np.flatnonzero(~is_decode)
        # A speculating row takes one decode row per token; `part` is the token's offset in its row.
        decode_order = np.repeat(decode, lengths[decode])
        part = np.arange(len(decode_order)) - np.repeat(np.cumsum(lengths[decode]) - lengths[decode], lengths[decode])
        shape = self.buckets.shape_for(len(decode_order), lengths[chunks].tolist())
        order = np.full(shape.num_rows, -1, np.int64)
        order[:len(decode_order)] = decode_order
        order[shape.decode_rows:shape.decode_rows + len(chunks)] = chunks
        offsets = np.zeros(shape.num_rows, np.int64)
        offsets[:len(part)] = part
        out = self._empty_forward(shape)
        starts = _row_token_starts(shape)
        for row in np.flatnonzero(order >= 0):
            host = order[row]
            lo, hi = batch.row_starts[host], batch.row_starts[host + 1]
            if row < shape.decode_rows:  # one token of a decode row, or of a speculating row
                lo, hi = lo + offsets[row], lo + offsets[row] + 1
            start, stop = starts[row], starts[row] + (hi - lo)
            out.tokens[start:stop] = batch.token_ids[lo:hi]
            out.positions[start:stop] = batch.positions[lo:hi]
            out.valid[start:stop] = True
            out.next_tokens[start:stop] = batch.next_token_ids[lo:hi]
            out.row_of_token[start:stop] = row
            out.last_index[row] = stop - 1
            # The chunk segment is the last one; the decode segment, when present, the first.
            segment, local = (0, row) if row < shape.decode_rows else (-1, row - shape.decode_rows)
            out.block_tables[segment][local] = batch.block_tables[host]
        out = out.replace(want_prompt_logprobs=np.asarray(bool(batch.prompt_logprobs.any())))
        return shape, order, self._pad_adapters(out, batch, order, starts, shape.decode_rows)

    def _pad_adapters(self, out: ForwardBatch, batch: HostBatch, order: np.ndarray, starts: np.ndarray,
                      decode_rows: int):
        """Each padded token's LoRA slot (padding: 0), when the model has adapter slots."""
        if not self.has_lora:
            return out
        slots = np.zeros(len(out.tokens), np.int32)
        if batch.adapter_slots is not None:
            for row in np.flatnonzero(order >= 0):
                host = order[row]
                # a decode row holds one token (a speculating row's tokens are several such rows)
                length = 1 if row < decode_rows else batch.row_lengths[host]
                slots[starts[row]:starts[row] + length] = batch.adapter_slots[host]
        return out.replace(adapter_slots=slots)

    def _all_ones_mask(self, rows: int) -> jax.Array:
        """The bitmask of `rows` unconstrained rows, kept on the device (no transfer per step)."""
        mask = self._all_ones.get(rows)
        if mask is None:
            host = np.full((rows, self.bitmask_words), ALL_TOKENS_ALLOWED, np.int32)
            sharding = None if self.shardings is None else self.shardings.replicated
            # place_on_mesh: warm-up builds these from a thread pool, in an order that differs
            # between processes, so on a multi-process mesh the placement must need no collective.
            mask = self._all_ones[rows] = place_on_mesh(host, sharding) if sharding is not None else jax.device_put(host)
        return mask

    # ---- dispatch and fetch -----------------------------------------------------------
    def run(self, batch: HostBatch, fill_masks: MaskFiller | None = None) -> StepArrays:
        """One step (module docstring, steps 1-4)."""
        shape, order, forward_inputs = self._pad(batch)
        if len(batch.block_copies):
            self._run_copies(batch.block_copies)
        forward = self._run_forward(shape, forward_inputs)
        if self.draft is not None:  # the draft writes its K/V wherever the target does
            self.draft.mirror(shape, forward_inputs, batch.block_copies)
        rows = shape.num_rows
        sampling = batch.sampling.gather(order, self.vocab_size)
        if batch.has_constrained_rows:
            if fill_masks is None:
                raise ValueError("a row is constrained but the runner was given no fill_masks")
            fill_masks(batch, forward.logits.is_ready)
            bitmask = np.where((order >= 0)[:, None], batch.bitmask[np.maximum(order, 0)], ALL_TOKENS_ALLOWED)
            sampling, bitmask = self._to_step((sampling, bitmask.astype(np.int32)))
        else:
            sampling, bitmask = self._to_step(sampling), self._all_ones_mask(rows)
        samples = self._executable(("sample", rows))(forward.logits, forward.sample_pos, sampling, bitmask)
        wants_prompt, wants_pooled = bool(batch.prompt_logprobs.any()), bool(batch.pooling.any())
        fetch = [samples.tokens, samples.logprob, samples.top_ids, samples.top_logprobs, samples.finite]
        if wants_prompt:
            fetch += [forward.prompt_logprob, forward.prompt_top_ids, forward.prompt_top_logprobs]
        if wants_pooled:
            fetch += [forward.hidden_sum, forward.last_hidden]
        fetched = [np.asarray(a) for a in jax.device_get(fetch)]
        # Back to host-batch order: host row h starts at padded row padded_row[h] (a
        # speculating row's later tokens follow it).
        padded_row = np.empty(batch.num_rows, np.int64)
        real = np.flatnonzero(order >= 0)
        first = np.ones(len(real), bool)
        first[1:] = order[real][1:] != order[real][:-1]
        padded_row[order[real][first]] = real[first]
        arrays = StepArrays(*(a[padded_row] for a in fetched[:4]), finite=_host_finite(fetched[4], order, batch.num_rows))
        if batch.num_logits.max(initial=0) > 1:
            _add_verify_arrays(arrays, batch, fetched[:4], padded_row)
        rest = fetched[5:]
        if wants_prompt:
            token_index = _host_token_index(batch, shape, padded_row)
            arrays.prompt_logprob, arrays.prompt_top_ids, arrays.prompt_top_logprobs = (a[token_index] for a in rest[:3])
            rest = rest[3:]
        if wants_pooled:
            arrays.hidden_sum, arrays.last_hidden = (a[padded_row] for a in rest)
        return arrays

    def _run_forward(self, shape: StepShape, inputs: ForwardBatch) -> ForwardResult:
        exe = self._executable(("forward", *dataclasses.astuple(shape)))
        self.kv_cache, result = exe(self._state_leaves, self.kv_cache, self._to_step(inputs))
        return result

    def _run_copies(self, copies: np.ndarray) -> None:
        copy = self._executable(COPY_KEY)
        for i in range(0, len(copies), COPY_BATCH):
            part = np.zeros((COPY_BATCH, 2), np.int32)
            chunk = copies[i:i + COPY_BATCH]
            part[:len(chunk)] = chunk
            self.kv_cache = copy(self.kv_cache, jnp.asarray(part[:, 0]), jnp.asarray(part[:, 1]))

    def run_logits(self, rows: list[RowPlan]) -> list[np.ndarray]:
        """Offline (tests, tools/parity/compare_logits.py): write the rows' tokens into the cache
        and return each row's logits f32[len(token_ids), V]. Shapes are not bucketed."""
        t = max(len(r.token_ids) for r in rows)
        mb = self.geometry.table_width
        n = len(rows) * t
        batch = ForwardBatch(tokens=np.zeros(n, np.int32), positions=np.zeros(n, np.int32), valid=np.zeros(n, bool),
                             block_tables=(np.zeros((len(rows), mb), np.int32),),
                             last_index=np.zeros(len(rows), np.int32), next_tokens=np.full(n, -1, np.int32),
                             row_of_token=np.full(n, len(rows), np.int32), want_prompt_logprobs=np.asarray(False),
                             segment_tokens=(t,))
        for i, row in enumerate(rows):
            k = len(row.token_ids)
            batch.tokens[i * t:i * t + k] = row.token_ids
            batch.positions[i * t:i * t + k] = np.arange(row.start_pos, row.start_pos + k)
            batch.valid[i * t:i * t + k] = True
            needed = self.geometry.blocks_needed(row)
            batch.block_tables[0][i, :needed] = row.block_ids[:needed]
        if self.has_lora:
            batch = batch.replace(adapter_slots=np.repeat(np.asarray([r.adapter_slot for r in rows], np.int32), t))
        self.kv_cache, logits = self._steps.logits(self.graphdef, self.state, self.kv_cache, jax.device_put(batch))
        logits = np.asarray(jax.device_get(logits)).reshape(len(rows), t, -1)
        return [logits[i, : len(r.token_ids)] for i, r in enumerate(rows)]


def _add_verify_arrays(arrays: StepArrays, batch: HostBatch, samples: list[np.ndarray],
                       padded_row: np.ndarray) -> None:
    """A speculating step: what was sampled after each token of each row, [R, K] with K the
    most tokens a row verified (a row's tokens sit in consecutive padded rows)."""
    width = int(batch.num_logits.max())
    index = padded_row[:, None] + np.arange(width)[None, :]
    index = np.where(np.arange(width)[None, :] < batch.num_logits[:, None], index, padded_row[:, None])
    arrays.verify_tokens, arrays.verify_logprob, arrays.verify_top_ids, arrays.verify_top_logprobs = (
        a[index] for a in samples)


def _host_finite(finite: np.ndarray, order: np.ndarray, num_rows: int) -> np.ndarray:
    """bool[R] per host row from the padded rows' flags: a speculating row's tokens are
    several padded rows, all of which must be finite; padding rows are ignored."""
    out = np.ones(num_rows, bool)
    real = order >= 0
    np.logical_and.at(out, order[real], finite[real])
    return out


def _row_token_starts(shape: StepShape) -> np.ndarray:
    """i64[R]: flat index of each padded row's first token (decode rows, then chunk rows)."""
    decode = np.arange(shape.decode_rows)
    chunks = shape.decode_rows + np.arange(shape.chunk_rows) * shape.chunk_tokens
    return np.concatenate([decode, chunks]).astype(np.int64)


def _host_token_index(batch: HostBatch, shape: StepShape, padded_row: np.ndarray) -> np.ndarray:
    """i64[N]: for each host-batch token, its index in the padded flat tokens."""
    starts = _row_token_starts(shape)[padded_row]
    lengths = batch.row_lengths
    return np.repeat(starts - batch.row_starts[:-1], lengths) + np.arange(len(batch.token_ids))
