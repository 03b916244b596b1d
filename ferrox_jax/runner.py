"""ModelRunner: pads a `HostBatch` to a compiled step shape, dispatches it, fetches the results.

It owns the device state (weights and KV cache) and is touched only by the owner thread,
through the verbs of `ferrox_jax/runner_protocol.py:Runner` and nothing else. Every shape
comes from `Buckets`; `warmup()` compiles all of them ahead of time (AOT:
`lower().compile()`), or loads them untraced from the executable store where an earlier
start left them (`ferrox_jax/executable_store.py`), and a shape first seen afterwards is
compiled on demand and counted in `recompiles_after_warmup` (it should stay 0: tests assert it).

`forward(batch)`, then `sample(pending, bitmask)`, in order:
  1. Pad (`ferrox_jax/padding.py`): rows of one new token go to the decode segment, longer
     rows (prompt chunks) to the chunk segment; a speculating row (its last token and d
     drafts, sampled after each: `num_logits` 1 + d) becomes 1 + d consecutive one-token
     decode rows sharing its block table, at consecutive positions. Every token's K/V is
     written before any row attends, so the row at position p + j reads the drafts before
     it: causal verification through the one-query kernels, with no shape of its own (a
     ragged kernel sees the 1 + d rows as one span: `models/ragged_attention.py`). The
     smallest `StepShape` holding both is picked and the batch's arrays are laid out in it
     (`ForwardBatch`, numpy, handed to the compiled step as they are).
  2. Dispatch: the host tier's saves and restores (`offload_blocks`, `--kv-offload-gib`:
     blocks evicted from the prefix cache go to host memory, host hits come back), block
     copies, then the one forward over every row. Dispatch is
     asynchronous: `forward` returns a `DevicePending` while the device runs.
  3. Meanwhile the owner thread fills the grammar bitmask of constrained rows
     (`ferrox_jax/batcher.py`): the mask for a row depends on the token it sampled last
     step, so this is the earliest it can be computed, and the forward is what it hides behind.
  4. `sample` runs the sampler on the forward's logits; everything comes back in one
     fetch (`ferrox_jax/padding.py:fetch_results`), un-padded to host-batch rows
     (`StepArrays`: per row, what was sampled after each position it samples at).

A draft model (`--speculative draft`) is a runner of its own; the owner loop mirrors every
target batch on it and drives its proposal steps through the same verbs (`ferrox_jax/draft.py`).

State verbs, between ticks: `swap_state` (LoRA slot writes: new arrays of the same shapes,
placed with the same shardings), `release` / `restore` (sleep and wake, `ferrox_jax/sleep.py`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import math
import os
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ferrox_jax import sleep
from ferrox_jax.buckets import Buckets, StepShape
from ferrox_jax.host_batch import ALL_TOKENS_ALLOWED, BatchGeometry, HostBatch, SamplingArrays, StepArrays
from ferrox_jax.host_copies import HostCopies, state_runs
from ferrox_jax.kv_cache import KVCache, copy_blocks, create_model_kv_cache, storage_dtype
from ferrox_jax.kv_groups import window_arrays
from ferrox_jax.kv_offload import HostKVPool, HostStatePool
from ferrox_jax.multihost import place_on_mesh
from ferrox_jax.padding import empty_forward, fetch_results, pad_batch
from ferrox_jax.runner_protocol import DeviceState
from ferrox_jax.executable_store import ExecutableStore
from ferrox_jax.shared_compiles import SharedCompiles
from ferrox_jax.plan import RowPlan
from ferrox_jax.sharding import runner_shardings
from models.moe_ep import uses_expert_parallel
from ferrox_jax.step import ForwardBatch, ForwardResult, jit_steps
from ferrox_jax.vision import VisionEncoder
from models.attention import ATTENTION_CHUNK_BLOCKS
from models.cpu_kernels import runtime_problems
from models.deltanet import create_states
from models.deltanet_groups import group_for_devices
from models.lora import lora_slot_count

log = logging.getLogger(__name__)
COPY_BATCH = 8  # block copies are padded to this many pairs (0 -> 0 is a no-op copy)
COPY_KEY = ("copy",)  # the block-copy executable's key among the compiled shapes


def compile_keys(buckets: Buckets, offload: list[tuple] | None = None) -> list[tuple]:
    """Every executable a runner with `buckets` compiles at warm-up, as plain tuples (they
    go into logs and JSON): ("forward", Bd, Pc, Tc) per step shape, ("sample", rows) per
    sampler, ("copy",), and with a host tier its copies' (`offload`: `HostCopies.keys`)."""
    return ([("forward", *shape.key) for shape in buckets.shapes()]
            + [("sample", rows) for rows in buckets.sampler_rows()] + [COPY_KEY] + list(offload or []))


def block_table_width(max_context: int, block_size: int) -> int:
    """Blocks per row in every step's block table: enough for `max_context` positions,
    rounded up to a multiple of the attention loop's chunk (`models/attention.py`)."""
    num_blocks = math.ceil(max_context / block_size)
    return -(-num_blocks // ATTENTION_CHUNK_BLOCKS) * ATTENTION_CHUNK_BLOCKS


@dataclasses.dataclass
class DevicePending:
    """A dispatched forward (`ModelRunner.forward`), for `ModelRunner.sample`."""

    batch: HostBatch
    shape: StepShape  # the compiled shape it was padded to
    order: np.ndarray  # i64[R']: the host row in each padded row, -1 for padding
    inputs: ForwardBatch  # what was dispatched (numpy, `ferrox_jax/padding.py`)
    result: ForwardResult  # on the device (logits f32[R', V] and what the host may fetch)

    def is_done(self) -> bool:
        return self.result.logits.is_ready()


class ModelRunner:
    """Device side of the engine (implements `ferrox_jax.runner_protocol.Runner`)."""

    def __init__(self, model, num_blocks: int, block_size: int, max_rows: int, max_chunk_tokens: int,
                 max_context: int, kv_dtype=None, mesh=None, replicate_attention: bool = False,
                 max_chunks: int = 1, shared_compiles: SharedCompiles | None = None,
                 vision: VisionEncoder | None = None, kv_offload_blocks: int = 0, window_blocks: int = 0,
                 executable_store: ExecutableStore | None = None, state_snapshots: int = 0,
                 state_entries: int = 1, kv_offload_snapshots: int = 0):
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
          shared_compiles: in a multi-process group, where process 0's compiles are shared
            (`ferrox_jax/shared_compiles.py`): it compiles, the others load. None: this
            process compiles everything.
          vision: a model taking images: its encoder (`ferrox_jax/vision.py`); every step
            then carries the image columns of `ferrox_jax/step.py`.
          kv_offload_blocks: host-tier slots (`--kv-offload-gib`, `ferrox_jax/kv_offload.py`);
            0: no tier, nothing of it compiled or allocated.
          kv_offload_snapshots: its recurrent-state snapshot slots (a model with recurrent layers).
          window_blocks: the sliding-window layers' own pool, its null slot included
            (`ferrox_jax/kv_groups.py`); 0: they hold `num_blocks` as every layer does.
          executable_store: where executables serialized by an earlier start are loaded
            from, without tracing, and new ones stored (`ferrox_jax/executable_store.py`);
            None: every executable is traced, lowered and compiled (JAX's cache may hold it).
          state_snapshots: a model with recurrent layers: the state pool's snapshot slots
            after its running ones (`ferrox_jax/state_snapshots.py`); 0 without prefix caching.
          state_entries: a recurrent model's states kept per slot (`state_pool.state_entries`:
            1 + the most drafts a row verifies with speculation, else 1).
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
        self.vision = vision
        # Which cache arrays hold the sliding pool (one flag per array; () without one).
        self.windowed = window_arrays(cfg) if window_blocks else ()
        self.geometry = BatchGeometry(block_size, block_table_width(max_context, block_size), cfg.vocab_size,
                                      getattr(cfg, "image_width", cfg.hidden_size) if vision is not None else 0,
                                      mrope=vision is not None and getattr(cfg, "mrope_section", None) is not None,
                                      windowed=bool(self.windowed))
        self.buckets = Buckets.derive(max_rows, max_chunk_tokens, max_chunks)
        self.mesh = mesh
        if mesh is not None and not replicate_attention:  # DeltaNet conv channels per device: whole heads each
            model = group_for_devices(model, mesh.shape["model"])
        self.graphdef, state = nnx.split(model)
        self._state_tree = None  # the weights' tree structure, fixed by the first `_set_state`
        # Expert layers pointed at the mesh (models/moe_ep.py) take their stacks split by expert.
        self.shardings = None if mesh is None else runner_shardings(mesh, cfg, state, replicate_attention,
                                                                    uses_expert_parallel(model), state_entries)
        self._set_state(state if self.shardings is None else place_on_mesh(state, self.shardings.state))
        # One process: batch inputs go to the compiled steps as numpy (`ferrox_jax/step.py`).
        self._place_inputs = jax.process_count() > 1
        # On a CPU, the sampler's passes over the vocabulary are one kernel call (step.py).
        self._steps = jit_steps(self.shardings, cpu_sampler=self.shardings is None and not runtime_problems(
            jax.default_backend()))
        self.max_loras = lora_slot_count(self.state)  # adapter slots the projections carry (0: no LoRA)
        self.has_lora = self.max_loras > 0
        self.kv_cache: KVCache = create_model_kv_cache(
            cfg, num_blocks, block_size, self.kv_dtype, sharding=None if self.shardings is None else self.shardings.kv_array,
            windowed=self.windowed, window_blocks=window_blocks)
        if cfg.recurrent_specs():  # the null slot 0, one state slot per row a step holds, then the snapshots
            self.kv_cache = self.kv_cache.replace(states=create_states(
                cfg.recurrent_specs(), max_rows + 1 + state_snapshots,
                None if self.shardings is None else self.shardings.states, entries=state_entries))
        self.kv_offload_blocks, self.kv_offload_snapshots = kv_offload_blocks, kv_offload_snapshots
        layout = set(cfg.kv_layout())
        heads, k_dim, v_dim = next(iter(layout))
        if kv_offload_blocks and (len(layout) > 1 or k_dim != v_dim):
            raise ValueError("--kv-offload-gib: this model's cache arrays differ in shape (a latent-attention "
                             "cache, or layers of several head sizes) and are not offloaded yet; serve it "
                             "without the host tier")
        states = self.kv_cache.states
        self._host = HostCopies(HostKVPool(kv_offload_blocks, len(self.kv_cache.k), heads, block_size, k_dim,
                                           storage_dtype(self.kv_dtype)),
                                HostStatePool(kv_offload_snapshots, [a.shape[1:] for a in states.conv],
                                              [a.shape[1:] for a in states.recurrent], state_entries)
                                if kv_offload_snapshots and states is not None else None) if kv_offload_blocks else None
        self._compiled: dict[tuple, Callable] = {}
        self._shared_compiles = shared_compiles
        self._store = executable_store
        self.is_warm = False
        self._recompiles = 0
        self._asleep: sleep.Asleep | None = None  # what `release` freed, until `restore`
        self.bitmask_words = -(-self.vocab_size // 32)  # int32 words per bitmask row
        self._all_ones: dict[int, jax.Array] = {}  # rows -> all-ones bitmask, on the device

    @property
    def state(self):
        """The weights as an `nnx.State` (read-only: `swap_state`, `release` and `restore`
        change them); kept flat too (`_state_leaves`), which is what the forward takes."""
        return self._state

    def _set_state(self, state) -> None:
        self._state = state
        if state is None:  # asleep at level 2
            self._state_leaves = None
            return
        leaves, tree = jax.tree.flatten(state)
        if self._state_tree is not None and self._state_tree != tree:
            raise ValueError(f"a new state must have the old one's structure; got {tree} for {self._state_tree}")
        self._state_leaves, self._state_tree = leaves, tree

    # ---- state verbs (the owner thread, between ticks) ------------------------------------
    def swap_state(self, update: Callable[[DeviceState], DeviceState]) -> None:
        """The weights and KV cache become `update(DeviceState(weights, kv_cache))`; new
        weights are placed with this runner's shardings and a new cache must match the old
        one's shapes and shardings, so the compiled steps take them as they took the old
        ones (no recompile)."""
        new = update(DeviceState(self._state, self.kv_cache))
        if new.kv_cache is not self.kv_cache:
            old_specs = [(a.shape, a.dtype, a.sharding) for a in jax.tree.leaves(self.kv_cache)]
            new_specs = [(a.shape, a.dtype, a.sharding) for a in jax.tree.leaves(new.kv_cache)]
            if old_specs != new_specs:
                raise ValueError("a new KV cache must have the old one's shapes, dtypes and shardings")
            self.kv_cache = new.kv_cache
        if new.weights is not self._state:
            weights = new.weights
            if self.shardings is not None:
                weights = jax.device_put(weights, self.shardings.state)
            self._set_state(weights)

    @property
    def sleep_level(self) -> int:
        return 0 if self._asleep is None else self._asleep.level

    def release(self, level: int) -> int:
        """Frees the KV cache (level 2: also moves the weights to host memory); returns the
        level it sleeps at (`ferrox_jax/sleep.py`)."""
        if self._asleep is not None:
            return self._asleep.level
        self._asleep = sleep.put_to_sleep(self.kv_cache, self._state, level)
        self.kv_cache = None
        if level == 2:
            self._set_state(None)
        return level

    def restore(self) -> None:
        """Reallocates what `release` freed, in the same shapes and shardings."""
        if self._asleep is None:
            return
        self.kv_cache, state = sleep.wake(self._asleep)
        if state is not None:
            self._set_state(state)
        self._asleep = None

    def _to_step(self, tree):
        """Batch inputs as the compiled steps take them (module docstring of step.py)."""
        return jax.device_put(tree) if self._place_inputs else tree

    @property
    def max_blocks_per_row(self) -> int:
        return self.geometry.table_width

    @property
    def recompiles_after_warmup(self) -> int:
        """Shapes compiled after warm-up (should stay 0)."""
        return self._recompiles

    # ---- compilation -------------------------------------------------------------
    def compile_keys(self) -> list[tuple]:
        """Every executable warm-up compiles (`compile_keys`)."""
        return compile_keys(self.buckets, offload=self._host.keys if self._host is not None else None) + (
            self.vision.compile_keys() if self.vision is not None else [])

    def _lower(self, key: tuple) -> jax.stages.Lowered:
        if key == COPY_KEY:
            pairs = jnp.zeros(COPY_BATCH, jnp.int32)
            return copy_blocks.lower(self.kv_cache, pairs, pairs, pairs, pairs, pairs, pairs, windowed=self.windowed)
        if key[0] == "vision":
            return self.vision.lower(key)
        if key[0].startswith("offload"):
            return self._host.lower(key, self.kv_cache)
        if key[0] == "sample":
            rows = key[1]
            logits = jnp.zeros((rows, self.vocab_size), jnp.float32)
            positions = jnp.zeros(rows, jnp.int32)
            sampling = self._to_step(SamplingArrays.padding(rows, self.vocab_size))
            return self._steps.sample.lower(logits, positions, sampling, self._all_ones_mask(rows))
        batch = self._to_step(empty_forward(StepShape(*key[1:]), self.geometry.table_width, self.has_lora,
                                            self.geometry.image_width, self.geometry.mrope, self.geometry.windowed))
        return self._steps.forward.lower(self.graphdef, self._state_tree, self._state_leaves, self.kv_cache, batch)

    def _compile(self, key: tuple) -> Callable:
        """Every executable compiled, at warm-up or after it, comes from here: compiled by
        this process (and stored, with an executable store), or in a multi-process group by
        process 0 and loaded (`shared_compiles`). Loads from the store are `warmup`'s."""
        lowered = self._lower(key)
        if self._shared_compiles is not None:
            return self._shared_compiles.compile("/".join(map(str, key)), lowered)
        if self._store is not None:
            return self._store.compile(key, lowered)
        return lowered.compile()

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
        With an executable store, what it holds is loaded first (no trace, no lowering), and
        the rest compiled with JAX's cache suspended, so that each can be stored whole.
        """
        t0 = time.perf_counter()
        keys = [k for k in self.compile_keys() if k not in self._compiled]
        done = 0
        if self._store is not None:
            for key in keys:
                exe = self._store.load(key)
                if exe is not None:
                    self._compiled[key] = exe
                    done += 1
                    if progress:
                        progress(done, len(keys), key)
            self._store.end_prefetch()
        misses = [k for k in keys if k not in self._compiled]
        if self._store is not None:
            log.info("executable store: %d of %d executables loaded in %.1f s, %d to compile", len(keys) - len(misses),
                     len(keys), time.perf_counter() - t0, len(misses))
        fresh = self._store.fresh_compiles() if self._store is not None and misses else contextlib.nullcontext()
        num_threads = num_threads or min(len(misses), os.cpu_count() or 1) or 1
        with fresh, concurrent.futures.ThreadPoolExecutor(num_threads) as pool:
            for key, exe in zip(misses, pool.map(self._compile, misses)):
                self._compiled[key] = exe
                done += 1
                if progress:
                    progress(done, len(keys), key)
        if self._store is not None:  # its folder is settled: the store's disk bound, other folders LRU first
            self._store.apply_bound()
        self.is_warm = True
        return time.perf_counter() - t0

    # ---- pad ---------------------------------------------------------------------------
    def _pad(self, batch: HostBatch) -> tuple[StepShape, np.ndarray, ForwardBatch]:
        """`ferrox_jax/padding.py:pad_batch` for this runner's shapes."""
        return pad_batch(batch, self.buckets, self.geometry.table_width, self.has_lora, self.geometry.image_width,
                         self.geometry.mrope, self.geometry.windowed)

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
    def forward(self, batch: HostBatch) -> DevicePending:
        """Steps 1-2 of the module docstring: pad, block copies, dispatch; returns at once."""
        shape, order, forward_inputs = self._pad(batch)
        if batch.has_offload:  # the host tier's saves, then its restores, before the copies
            self.offload_blocks(batch.kv_saves, batch.kv_restores)
        if any(a is not None and len(a) for a in (batch.block_copies, batch.window_copies, batch.state_copies)):
            self._copy_blocks(batch.block_copies, batch.window_copies, batch.state_copies)
        result = self._run_forward(shape, forward_inputs)
        return DevicePending(batch, shape, order, forward_inputs, result)

    def sample(self, pending: DevicePending, bitmask: np.ndarray | None) -> StepArrays:
        """Step 4: the sampler over the forward's logits (`bitmask` i32[R, W] per host row
        for the constrained rows' masks, None when no row is constrained), one fetch."""
        batch, shape, order, forward = pending.batch, pending.shape, pending.order, pending.result
        rows = shape.num_rows
        sampling = batch.sampling.gather(order, self.vocab_size)
        if bitmask is not None:
            padded = np.where((order >= 0)[:, None], bitmask[np.maximum(order, 0)], ALL_TOKENS_ALLOWED)
            sampling, padded = self._to_step((sampling, padded.astype(np.int32)))
        elif batch.has_constrained_rows:
            raise ValueError("a row of the batch is constrained but the sampler was given no bitmask")
        else:
            sampling, padded = self._to_step(sampling), self._all_ones_mask(rows)
        samples = self._executable(("sample", rows))(forward.logits, forward.sample_pos, sampling, padded)
        return fetch_results(batch, shape, order, forward, samples.packed)

    def _run_forward(self, shape: StepShape, inputs: ForwardBatch) -> ForwardResult:
        exe = self._executable(("forward", *shape.key))
        self.kv_cache, result = exe(self._state_leaves, self.kv_cache, self._to_step(inputs))
        return result

    def encode_images(self, pixels: np.ndarray) -> np.ndarray:
        """The vision encoder over B images, f32[B, C, S, S] -> f32[B, T, D], in bucketed calls
        (Qwen2.5-VL: a list of `QwenPicture`s -> a list of f32[T_i, D]; `ferrox_jax/vision.py`)."""
        if self.vision is None:
            raise ValueError("this model takes no images")
        return self.vision.encode(pixels, lambda bucket: self._executable(("vision", bucket)))

    def copy_blocks(self, copies: np.ndarray) -> None:
        """(src, dst) block copies, `COPY_BATCH` pairs per call (padded with 0 -> 0 no-ops)."""
        self._copy_blocks(copies, None, None)

    def _copy_blocks(self, copies: np.ndarray, window_copies: np.ndarray | None,
                     state_copies: np.ndarray | None) -> None:
        """`copy_blocks`, and beside them the sliding pool's (src, dst) slot copies (a step's
        copy-on-write, `HostBatch.window_copies`) and the recurrent state slots' (in order:
        `HostBatch.state_copies`), `COPY_BATCH` pairs of each per call. State copies to or
        from the host tier's snapshots run in their place in that order (`host_copies.py`)."""
        runs = state_runs(state_copies if state_copies is not None else np.zeros((0, 2), np.int32))
        if any(kind != "device" for kind, _ in runs):
            self._copy_device(copies, window_copies, None)
            for kind, pairs in runs:
                if kind == "device":
                    self._copy_device(None, None, pairs)
                elif self._host is None:
                    raise ValueError("this runner has no host KV tier (--kv-offload-gib 0)")
                else:
                    self.kv_cache = self._host.move_states(self.kv_cache, self._executable, kind, pairs)
            return
        self._copy_device(copies, window_copies, state_copies)

    def _copy_device(self, copies: np.ndarray | None, window_copies: np.ndarray | None,
                     state_copies: np.ndarray | None) -> None:
        copy = self._executable(COPY_KEY)
        columns = [np.zeros((0, 2), np.int32) if c is None else np.asarray(c, np.int32).reshape(-1, 2)
                   for c in (copies, window_copies, state_copies)]
        for i in range(0, max(map(len, columns)), COPY_BATCH):
            part = np.zeros((COPY_BATCH, 6), np.int32)
            for j, column in enumerate(columns):
                chunk = column[i:i + COPY_BATCH]
                part[:len(chunk), 2 * j:2 * j + 2] = chunk
            # `windowed` is static: the executable was lowered with it (`_lower`)
            self.kv_cache = copy(self.kv_cache, *(jnp.asarray(part[:, j]) for j in range(6)))

    def offload_blocks(self, saves: np.ndarray, restores: np.ndarray) -> None:
        """The host tier's copies (`ferrox_jax/kv_offload.py`), `OFFLOAD_BATCH` blocks per
        call: every save (i32[S, 2], (device block, host slot)) is fetched to host memory
        before any restore (i32[L, 2], (host slot, device block)) is written, since a
        restore may land in a block a save reads."""
        if self._host is None:
            raise ValueError("this runner has no host KV tier (--kv-offload-gib 0)")
        self.kv_cache = self._host.move_blocks(self.kv_cache, self._executable, np.asarray(saves, np.int32).reshape(-1, 2),
                                               np.asarray(restores, np.int32).reshape(-1, 2))

    def run_logits(self, rows: list[RowPlan], window_slots: dict[int, int] | None = None) -> list[np.ndarray]:
        """Offline (tests, tools/parity/compare_logits.py): write the rows' tokens into the cache
        and return each row's logits f32[len(token_ids), V]. Shapes are not bucketed.
        `window_slots`: block -> slot of the sliding layers' own pool, when the cache has one
        (a block without one reads the null slot)."""
        t = max(len(r.token_ids) for r in rows)
        mb = self.geometry.table_width
        n = len(rows) * t
        batch = ForwardBatch(tokens=np.zeros(n, np.int32), positions=np.zeros(n, np.int32), valid=np.zeros(n, bool),
                             block_tables=(np.zeros((len(rows), mb), np.int32),),
                             last_index=np.zeros(len(rows), np.int32), next_tokens=np.full(n, -1, np.int32),
                             row_of_token=np.full(n, len(rows), np.int32), want_prompt_logprobs=np.asarray(False),
                             segment_tokens=(t,), state_slots=np.asarray([r.state_slot for r in rows], np.int32))
        for i, row in enumerate(rows):
            k = len(row.token_ids)
            batch.tokens[i * t:i * t + k] = row.token_ids
            batch.positions[i * t:i * t + k] = np.arange(row.start_pos, row.start_pos + k)
            batch.valid[i * t:i * t + k] = True
            needed = self.geometry.blocks_needed(row)
            batch.block_tables[0][i, :needed] = row.block_ids[:needed]
        if self.windowed:
            slots = window_slots or {}
            batch = batch.replace(window_tables=(np.asarray(
                [[slots.get(int(b), 0) for b in table] for table in batch.block_tables[0]], np.int32),))
        if self.has_lora:
            batch = batch.replace(adapter_slots=np.repeat(np.asarray([r.adapter_slot for r in rows], np.int32), t))
        self.kv_cache, logits = self._steps.logits(self.graphdef, self.state, self.kv_cache, jax.device_put(batch))
        logits = np.asarray(jax.device_get(logits)).reshape(len(rows), t, -1)
        return [logits[i, : len(r.token_ids)] for i, r in enumerate(rows)]
