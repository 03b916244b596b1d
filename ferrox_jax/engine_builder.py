"""Building an engine: everything `Engine.load` does before the facade exists.

`build_parts(config)` returns what the facade holds (`EngineParts`) and never imports the
facade (`Engine.load` wraps the parts), so the dependency runs one way. In order: set up
the process (`jax.distributed` and the persistent compilation cache, once per process),
open the checkpoint (config, tokenizer, lazy tensors; `models/loader.py`), size the KV
cache and the context ceiling (`size_kv`), choose the decode attention for that
block-table width, build the model with it, lay w8a8 projections out for the CPU kernel,
then the runner (device state, buckets) and the batcher with the resolved `SchedulerLimits`.

Sizing: `kv_blocks` if given, else the KV memory budget `kv_memory_gib` divided by the
bytes one block takes in the KV storage dtype (`kv_cache_dtype`: a bfloat16 cache holds
twice the blocks of a float32 one in the same budget), else (neither given) blocks for
`max_seqs` rows of a whole context each, at most `DEFAULT_KV_MEMORY_GIB`
(`memory_bounds.kv_blocks_for`); the context ceiling is `max_context` if given, else the
model's trained context capped by what the cache holds. The start-up log says
which applied. `quantization` ("int8", "w8a8") makes the loader place int8 weights
(`models/quant.py`).

Bounds (`ferrox_jax/memory_bounds.py`): the KV cache, the LoRA slots and the largest step
(its shape: the chunk, the prompt-token budget `max_batched_tokens`, 0 = the backend's
default, and the rows speculation adds, all from `Footprint.step`) are checked against the
memory the devices can give and the index types' ceilings twice: before the weights are
read, and once they are placed, right before the LoRA slots and the KV cache are
allocated. A setting that does not fit raises `MemoryBoundError` naming it and saying what
fits; nothing sized by it has been allocated.

`load_format="dummy"` serves the checkpoint's shapes with random weights made on the
device (`models/loaders/dummy.py`), to size and benchmark a deployment before downloading
weights: a WARNING at start-up, `synthetic_weights` in the model card (`/health`,
`/metrics`). `plan_memory(config)` gives the same weights and KV bytes from abstract
shapes without allocating anything.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import logging
import os
import time
from typing import TYPE_CHECKING, Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from ferrox_jax.batcher import ContinuousBatcher
from ferrox_jax.step_faults import FaultPolicy
from ferrox_jax.config import EngineConfig, SchedulerLimits
from ferrox_jax.draft import DraftModel
from ferrox_jax.mtp import build_mtp, check_mtp, mtp_bytes_per_block
from ferrox_jax.kv_cache import model_bytes_per_block
from ferrox_jax.kv_groups import WindowPlan, sliding_window, window_plan
from ferrox_jax.kv_offload import host_room_for_tier, size_host_tier
from ferrox_jax.memory_bounds import (DEFAULT_KV_MEMORY_GIB, GIB, Footprint, context_for, device_room, engine_devices,
                                      kv_blocks_for, kv_shards, needed_kv_blocks)
from ferrox_jax.lora_registry import build_registry
from ferrox_jax.multihost import StepChannel, check_mesh, step_channel_address
from ferrox_jax.multihost_runner import BroadcastRunner, DraftSender
from ferrox_jax.quant_setup import DTYPES, block_matmul, int8_matmul, resolve_kv_dtype, resolve_quantization
from ferrox_jax.vision import open_vision
from ferrox_jax.executable_store import store_for
from ferrox_jax.shared_compiles import SharedCompiles
from ferrox_jax.runner import ModelRunner, block_table_width
from ferrox_jax.runner_protocol import Runner
from ferrox_jax.sharding import check_divisibility, make_mesh, param_placement
from models.moe_ep import enable_expert_parallel, resolve_expert_parallel
from ferrox_jax.state_pool import settings_pool_bytes, snapshot_slots, state_entries
from models.checkpoint import CheckpointSource
from models.config import ModelConfig
from models.loader import open_checkpoint
from models.loaders.common import abstract_model
from models.lora import LoraSlots, attach_lora
from models.pallas_attention import select_decode_attention
from models.quant import INT8_MODES, quantized_channel_axis, quantized_nbytes
from models.tokenizer import Tokenizer

if TYPE_CHECKING:  # llguidance is imported only when structured output is set up
    from ferrox_jax.grammar import GrammarCompiler


@dataclasses.dataclass(frozen=True)
class KVSizing:
    """How big the KV cache is and why (the start-up log prints `note`)."""

    num_blocks: int  # including the null block 0
    max_context: int
    bytes_per_block: int  # of the full-attention group's arrays when the sliding group has its own pool
    note: str
    window: WindowPlan | None = None  # the sliding group's own pool (ferrox_jax/kv_groups.py); None: one pool
    window_blocks: int = 0  # its slots, the null slot included (0: none)

    @property
    def kv_bytes(self) -> int:
        """The whole cache: every group's arrays."""
        return self.num_blocks * self.bytes_per_block + self.window_blocks * (self.window.slot_bytes if self.window else 0)


log = logging.getLogger(__name__)


def default_dtype_name() -> str:
    """float32 on CPU (XLA's CPU bf16 elementwise work is ~10x slower), bfloat16 elsewhere."""
    return "float32" if jax.default_backend() == "cpu" else "bfloat16"


def initialize_distributed(coordinator_address: str | None, num_processes: int | None = None,
                           process_id: int | None = None) -> bool:
    """`jax.distributed.initialize` when a coordinator is given; must run before any other
    jax call. "auto" lets JAX discover the cluster (TPU pods, SLURM). Returns whether it ran."""
    if not coordinator_address:
        return False
    # CPU clusters (tests, laptops) need a cross-process collectives backend; the setting
    # only concerns XLA's CPU client, so it is harmless on TPU and GPU.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # The preemption service (for training's sync points) installs a SIGTERM notifier that
    # swallows the signal: a server must stop on SIGTERM (seen: a 2-process group still ran
    # 27 minutes after one).
    jax.config.update("jax_enable_preemption_service", False)
    if coordinator_address == "auto":
        jax.distributed.initialize()
    else:
        jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                                   process_id=process_id)
    log.info("jax.distributed: process %d of %d, %d global devices (%d local)", jax.process_index(),
             jax.process_count(), jax.device_count(), jax.local_device_count())
    return True


def _host_device():
    """Where to load weights before sharding them: host memory, so a model larger than one
    chip never lands whole on device 0 (None if the CPU backend is disabled)."""
    try:
        return jax.local_devices(backend="cpu")[0]  # this process's: jax.devices() lists every process's
    except RuntimeError:
        return None


_PROCESS: dict[str, Any] = {}  # set up once a process: "distributed", "compile_cache", "shared_compiles"


def setup_process(config: EngineConfig) -> None:
    """The per-process JAX setup, done by the first engine a process loads: later loads
    (a model swap) find it done. `jax.distributed` must come before any other jax call."""
    if "distributed" not in _PROCESS:
        _PROCESS["distributed"] = initialize_distributed(config.coordinator_address, config.num_processes,
                                                         config.process_id)
        # Started at once: process 0's heartbeat is what a follower waiting for a shape
        # watches, and a follower may reach its first shape before the leader has loaded.
        if jax.process_count() > 1 and config.share_compiles:
            _PROCESS["shared_compiles"] = SharedCompiles.for_this_process(config.multihost_timeout_s)
    path = config.compile_cache_dir
    if "compile_cache" not in _PROCESS:
        _PROCESS["compile_cache"] = path
        enable_compile_cache(path)
    elif path != _PROCESS["compile_cache"]:
        log.warning("compile cache %r asked for, but this process already uses %r (set once per process)",
                    path, _PROCESS["compile_cache"])


def enable_compile_cache(path: str | None) -> None:
    """JAX's persistent compilation cache: a second start reuses compiled buckets."""
    if not path:
        return
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def size_kv(config: EngineConfig, model_cfg: ModelConfig, kv_dtype, draft_cfg: ModelConfig | None = None,
            extra_per_block: int = 0) -> KVSizing:
    """Blocks, context ceiling and the reason, from the config and the checkpoint.
    `kv_dtype`: the cache's storage dtype, which sets the bytes per block. `draft_cfg`: a
    draft model's, whose cache has a block for every block id too (`ferrox_jax/draft.py`);
    `extra_per_block`: the MTP layer's bytes per block (`ferrox_jax/mtp.py`), likewise."""
    per_block = extra_per_block + sum(model_bytes_per_block(c, config.block_size, kv_dtype)
                                      for c in (model_cfg, draft_cfg) if c is not None)
    kv_blocks = kv_blocks_for(config, per_block, model_cfg.max_position_embeddings)
    # An MTP layer's cache (block-id indexed, inside the target's step) keeps one pool. A draft's
    # (its own runner's) holds a block per block id: its bytes go with the full group's.
    window = (window_plan(model_cfg, config, config.block_size, jnp.dtype(kv_dtype).itemsize)
              if not extra_per_block else None)
    if window is not None and draft_cfg is not None:
        window = dataclasses.replace(window, full_bytes=window.full_bytes
                                     + model_bytes_per_block(draft_cfg, config.block_size, kv_dtype))
    if window is not None:  # the sliding layers' pool is sized apart (kv_groups.py)
        window_blocks = window.slots(config.max_seqs) + 1
        grouped = kv_blocks_for(config, window.full_bytes, model_cfg.max_position_embeddings,
                                window_blocks * window.slot_bytes)
        # A pool no smaller than the full group's (or, every layer sliding, than one pool's
        # blocks) would save nothing. Every layer sliding, the block ids hold no bytes: each
        # row gets a whole context of them (`kv_blocks_for`) and the pool is the cache.
        if window_blocks < (grouped if window.full_bytes else kv_blocks):
            note = (size_kv_note(config, kv_dtype, grouped, window.full_bytes, model_cfg) if window.full_bytes
                    else f"{grouped} logical KV blocks (every layer slides: block ids hold no bytes)")
            return _grouped_sizing(config, model_cfg, window, grouped, window_blocks, note)
    why = size_kv_note(config, kv_dtype, kv_blocks, per_block, model_cfg)
    trained = model_cfg.max_position_embeddings
    usable_tokens = (kv_blocks - 1) * config.block_size
    max_context = context_for(config, trained, kv_blocks)
    if config.max_context:
        why += f"; context ceiling {max_context} as configured"
    else:
        why += f"; context ceiling {max_context} = min(trained context {trained}, KV capacity {usable_tokens})"
    if max_context > trained:
        log.warning("max_context %d exceeds the model's trained context %d", max_context, trained)
    return KVSizing(kv_blocks, max_context, per_block, why)


def size_kv_note(config: EngineConfig, kv_dtype, kv_blocks: int, per_block: int, model_cfg: ModelConfig) -> str:
    """Why the cache has `kv_blocks` blocks (the start of `KVSizing.note`)."""
    if config.kv_blocks:
        return f"{kv_blocks} KV blocks ({config.kv_blocks} as configured + the null block)"
    if config.kv_memory_gib is None:
        need = needed_kv_blocks(config, model_cfg.max_position_embeddings)
        capped = f", capped at the default {DEFAULT_KV_MEMORY_GIB:g} GiB" if kv_blocks < need else ""
        return (f"{kv_blocks} KV blocks ({kv_blocks * per_block / GIB:.2f} GiB, {per_block} B/block in "
                f"{jnp.dtype(kv_dtype).name}) for {config.max_seqs} rows of a whole context{capped} "
                "(--kv-memory-gib or --kv-blocks sets it)")
    return (f"{kv_blocks} KV blocks from the {config.kv_memory_gib:g} GiB KV memory budget "
            f"({per_block} B/block in {jnp.dtype(kv_dtype).name})")


def _grouped_sizing(config: EngineConfig, model_cfg: ModelConfig, window: WindowPlan, kv_blocks: int,
                    window_blocks: int, why: str) -> KVSizing:
    """The sizing of a cache whose sliding layers keep their own pool of `window_blocks`."""
    max_context = context_for(config, model_cfg.max_position_embeddings, kv_blocks)
    why += (f"{' for the full-attention layers,' if window.full_bytes else ''} + {window_blocks} slots of {window.slot_bytes} B for the "
            f"{window.window}-token sliding layers ({window.cap} a row); context ceiling {max_context}")
    return KVSizing(kv_blocks, max_context, window.full_bytes, why, window, window_blocks)


def prefix_cache_salt(source: CheckpointSource, dtype, block_size: int) -> str:
    """What the K/V of a block depend on besides its tokens: the weights and how they run.
    It goes into every prefix-cache block name (`ferrox_jax/prefix_cache.py`)."""
    cfg = source.config
    return f"{source.path}|{cfg.architecture}|{jnp.dtype(dtype).name}|{block_size}"


def _grammar_compiler(tokenizer: Tokenizer, vocab_size: int,
                      config: EngineConfig) -> tuple[GrammarCompiler | None, str]:
    """The grammar compiler for this tokenizer and logits width (building llguidance's view
    of the vocabulary takes ~0.4 s for 49k tokens), with the config's sandbox, or None and
    the reason it cannot be built: a model without structured output still serves everything else."""
    try:
        # Imported here: llguidance is only needed for structured output (the accelerator
        # image of tools/device/device_check.py does not carry it).
        from ferrox_jax.grammar import GrammarCompiler

        return GrammarCompiler(tokenizer, vocab_size, sandbox=config.grammar_sandbox,
                               sandbox_workers=config.grammar_workers,
                               sandbox_timeout_s=config.grammar_timeout_s), ""
    except (ImportError, ValueError, RuntimeError) as e:  # not installed, no stop token, a vocabulary it cannot read
        log.warning("structured output disabled: %s", e)
        return None, str(e)


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """What an engine of this config would hold on its devices (`plan_memory`)."""

    weights_bytes: int  # every model array: the parameters and the tied LM-head copy
    kv_bytes: int  # num_blocks * bytes_per_block
    sizing: KVSizing
    dtype: str


def plan_memory(config: EngineConfig) -> MemoryPlan:
    """Weights and KV bytes of `config`'s engine, from abstract shapes (`nnx.eval_shape`):
    nothing is allocated and no weight is read, so an 8B or 70B shape sizes on a laptop.
    Equal to what a loaded engine's `describe()` reports (tests/models/test_dummy_weights.py)."""
    dtype = DTYPES[config.dtype or default_dtype_name()]
    source = open_checkpoint(config.model, load_format=config.load_format, seed=config.dummy_weights_seed)
    quantization = resolve_quantization(config, source, None)[0] if config.mesh_shape[1] == 1 else config.quantization
    kv_dtype = resolve_kv_dtype(config.kv_cache_dtype, quantization, dtype)
    model = abstract_model(source.config, dtype)
    weights = 0
    for path, leaf in nnx.to_flat_state(nnx.state(model)):
        shape = tuple(leaf.shape)
        axis = quantized_channel_axis(".".join(map(str, path)), shape) if config.quantization in INT8_MODES else None
        weights += quantized_nbytes(shape, axis) if axis is not None else leaf.size * jnp.dtype(leaf.dtype).itemsize
    sizing = size_kv(config, source.config, kv_dtype)
    return MemoryPlan(weights, sizing.kv_bytes, sizing, jnp.dtype(dtype).name)


def _leader_runners(runner: ModelRunner, draft_runner: ModelRunner | None,
                    config: EngineConfig) -> tuple[Runner, DraftModel | None, StepChannel | None]:
    """The runner the batcher drives, the draft model (`--speculative draft`, else None)
    and the step channel (None but on a leader). On process 0 of a multi-process cluster
    both send their steps to the other processes first (`ferrox_jax/multihost_runner.py`);
    elsewhere they are the runners themselves (a follower replays the leader's steps from
    `multihost.follow`, never from a batcher)."""
    if jax.process_count() == 1 or jax.process_index() != 0:
        return runner, DraftModel(draft_runner) if draft_runner is not None else None, None
    if not config.coordinator_address or config.coordinator_address == "auto":
        raise ValueError("multi-host serving needs --coordinator-address HOST:PORT (the step channel "
                         "listens on the leader at PORT + 1)")
    channel = StepChannel(step_channel_address(config.coordinator_address), jax.process_count() - 1,
                          config.multihost_timeout_s, secret=config.multihost_secret)
    atexit.register(channel.close)  # a clean exit stops the followers too
    # --speculative draft: the proposal steps go to the followers too (the mirror needs no frame)
    draft = DraftModel(draft_runner, DraftSender(draft_runner, channel)) if draft_runner is not None else None
    return BroadcastRunner(runner, channel), draft, channel


def open_draft(config: EngineConfig, target: CheckpointSource, mesh: Any) -> CheckpointSource | None:
    """`--speculative draft`: the draft checkpoint, checked against the target (the same
    vocabulary, token for token, and logits width); None when speculation is not by draft."""
    spec = config.speculative
    if spec is None or spec.method != "draft":
        return None
    draft = open_checkpoint(spec.draft_model, load_format=config.load_format, seed=config.dummy_weights_seed)
    if draft.config.recurrent_specs():  # its proposal steps would move its states past the row's tokens
        raise ValueError(f"--draft-model {spec.draft_model}: a draft with recurrent (linear-attention) layers is "
                         "not supported; use a draft of attention layers only, or --speculative ngram")
    if mesh is not None:
        try:
            check_divisibility(draft.config, config.mesh_shape[1], config.replicate_attention)
        except ValueError as e:
            raise ValueError(f"--draft-model {spec.draft_model}: {e}") from None
    ours, theirs = draft.tokenizer.backend.get_vocab(), target.tokenizer.backend.get_vocab()
    if ours != theirs or draft.config.vocab_size != target.config.vocab_size:
        differ = sorted(set(ours.items()) ^ set(theirs.items()))[:3]
        raise ValueError(f"--draft-model {spec.draft_model}: its tokenizer differs from the target's "
                         f"({len(ours)} vs {len(theirs)} tokens, logits {draft.config.vocab_size} vs "
                         f"{target.config.vocab_size}; first differences {differ}); a draft must share the vocabulary")
    return draft


def _build_model(source: CheckpointSource, dtype, attention, quantization: str, mesh: Any,
                 replicate_attention: bool, progress: Callable[[str], None] | None = None,
                 expert_parallel: bool = False) -> Any:
    """The model of `source`. Read weights go through host memory and are sharded by the
    runner; synthetic ones are made on the devices, each parameter directly with its sharding.
    `expert_parallel`: its expert layers run their stacks split by expert (models/moe_ep.py)."""
    placement = None if mesh is None else param_placement(mesh, source.config, replicate_attention, expert_parallel)
    host = _host_device() if mesh is not None and not source.is_synthetic else None
    with jax.default_device(host) if host is not None else contextlib.nullcontext():
        model = source.build(dtype, decode_attention=attention, progress=progress, placement=placement,
                             quantization=quantization)
    if expert_parallel:
        enable_expert_parallel(model, mesh)
    return model


def _no_kernel_for_latent(cfg, attention, note: str):
    """(None, why) for a latent cache (models/mla.py: no V array), whose layers attend in pure
    JAX: the decode and ragged kernels read K/V heads. Else (attention, note) unchanged."""
    if cfg.kv_cache_dims()[2] == 0:
        return None, "attention: pure JAX over the latent cache (latent attention)"
    return attention, note


def _draft_runner(draft: CheckpointSource, config: EngineConfig, dtype, kv_dtype, sizing: KVSizing,
                  target: ModelRunner, mesh: Any) -> ModelRunner:
    """The draft's runner, with the target runner's blocks, buckets, context and mesh (its
    weights and KV cache sharded as the target's are)."""
    quantization, _ = resolve_quantization(config, draft, mesh)
    attention, _ = select_decode_attention(
        config.attention_impl, head_dim=draft.config.head_dim, block_size=config.block_size,
        max_blocks_per_row=target.geometry.table_width, mesh=mesh, kv_sharded=not config.replicate_attention,
        kv_dtype=kv_dtype)
    attention, _ = _no_kernel_for_latent(draft.config, attention, "")
    model = _build_model(draft, dtype, attention, quantization, mesh, config.replicate_attention)
    note = int8_matmul(model, dataclasses.replace(config, quantization=quantization), mesh) or block_matmul(
        model, dataclasses.replace(config, quantization=quantization), mesh)
    log.info("draft model %s: %s", draft.name, note or quantization)
    return ModelRunner(model, num_blocks=sizing.num_blocks, block_size=config.block_size, max_rows=target.max_rows,
                       max_chunk_tokens=target.max_chunk_tokens, max_context=sizing.max_context, kv_dtype=kv_dtype,
                       max_chunks=target.max_chunks, mesh=mesh, replicate_attention=config.replicate_attention)


@dataclasses.dataclass(frozen=True)
class EngineParts:
    """What `build_parts` wires and the facade (`ferrox_jax/engine.py:Engine.load`) holds."""

    source: CheckpointSource
    device: ModelRunner  # the model's runner (what the descriptions read)
    runner: Any  # the one the batcher drives: `device`, or the multi-host leader's BroadcastRunner around it
    batcher: ContinuousBatcher
    config: EngineConfig  # as served: `quantization` resolved
    sizing: KVSizing
    attention_note: str  # which decode attention runs, and why
    grammar: GrammarCompiler | None  # None: no structured output, `grammar_note` says why
    grammar_note: str
    matmul_note: str  # which int8 matmul w8a8 runs on ("" when not quantized)
    lora: Any  # the LoraRegistry when --max-loras > 0, else None
    load_s: float  # seconds from the start of the build to the parts
    draft_runner: ModelRunner | None = None  # `--speculative draft`'s; a multi-host follower replays its steps


def build_parts(config: EngineConfig, progress: Callable[[str], None] | None = None,
                wrap_runner: Callable[[Runner], Runner] | None = None) -> EngineParts:
    """Open, size, build and wire an engine's parts (not yet warmed up or started). `wrap_runner`,
    when given, wraps the runner the batcher drives (the one hook for tests' fault injection).

    Raises:
      ValueError (a configuration this checkpoint or these devices cannot serve, named),
      FileNotFoundError, UnsupportedModelError, CheckpointError (models/loader.py).
    """
    t0 = time.perf_counter()
    setup_process(config)
    dtype = DTYPES[config.dtype or default_dtype_name()]
    source = open_checkpoint(config.model, load_format=config.load_format, seed=config.dummy_weights_seed)
    if source.is_synthetic:
        log.warning("synthetic weights (--load-format dummy, seed %d): %s is served with random weights; "
                    "its outputs are meaningless (for sizing and benchmarks only)",
                    config.dummy_weights_seed, source.name)
    vision, config, source = open_vision(source, config)  # a model taking images: its encoder
    _, model_axis = config.mesh_shape
    if jax.process_count() > 1:
        check_mesh(model_axis, jax.device_count())
        if config.max_loras:  # adapters are loaded into slots on process 0 by its routes alone
            raise ValueError("multi-host: LoRA adapters (--max-loras) are not supported across processes yet")
    expert_parallel, expert_note = resolve_expert_parallel(config.expert_parallel, source.config, model_axis)
    if expert_note:
        log.info("%s", expert_note)
    check_divisibility(source.config, model_axis, config.replicate_attention, expert_parallel)
    mesh = make_mesh(1, model_axis) if model_axis > 1 else None
    draft_source = open_draft(config, source, mesh)
    quantization, quantization_note = resolve_quantization(config, source, mesh)
    if quantization_note:
        log.info("%s", quantization_note)
    kv_dtype = resolve_kv_dtype(config.kv_cache_dtype, quantization, dtype)
    mtp = check_mtp(config, source, model_axis)  # --speculative mtp: refused here unless it can run
    sizing = size_kv(config, source.config, kv_dtype, draft_source.config if draft_source else None,
                     mtp_bytes_per_block(source.config, config.block_size, kv_dtype) if mtp else 0)
    footprint = Footprint(source.config, sizing.bytes_per_block, jnp.dtype(dtype).itemsize, jax.default_backend(),
                          kv_shards(config, source.config), sizing.window)
    devices = engine_devices(config)
    footprint.check(config, device_room(devices))  # before the weights: what could never fit is refused at once
    config = dataclasses.replace(config, quantization=quantization, expert_parallel="on" if expert_parallel else "off")
    store = store_for(config, source.path, single_device=mesh is None)  # its entries load from here on
    attention, attention_note = select_decode_attention(
        config.attention_impl, head_dim=source.config.head_dim, block_size=config.block_size,
        max_blocks_per_row=block_table_width(sizing.max_context, config.block_size), mesh=mesh,
        kv_sharded=not config.replicate_attention, kv_dtype=kv_dtype)
    attention, attention_note = _no_kernel_for_latent(source.config, attention, attention_note)
    log.info("%s", attention_note)
    model = _build_model(source, dtype, attention, config.quantization, mesh, config.replicate_attention, progress,
                         expert_parallel)
    matmul_note = int8_matmul(model, config, mesh) or block_matmul(model, config, mesh)
    # The weights are placed: the free memory now counts them. Nothing the settings size is allocated yet.
    step = footprint.check(config, device_room(devices), note=" after the weights").step
    lora_slots = LoraSlots(config.max_loras, config.max_lora_rank) if config.max_loras else None
    lora_targets = attach_lora(model, lora_slots) if lora_slots is not None else None
    tier = size_host_tier(config, sizing.bytes_per_block, sizing.num_blocks - 1, source.config.recurrent_specs(),
                          step.rows, num_processes=jax.process_count(), draft=draft_source is not None,
                          host_room=host_room_for_tier(sizing.num_blocks * sizing.bytes_per_block
                                                       * (jax.default_backend() == "cpu")))
    if tier.blocks:
        log.info("%s", tier.note)
    limits = SchedulerLimits(
        block_size=config.block_size, num_blocks=sizing.num_blocks - 1, max_rows=config.max_seqs,
        max_chunk_tokens=step.chunk_tokens, max_idle_chunk_tokens=step.idle_chunk_tokens,
        max_batched_tokens=step.batched_tokens, max_context=sizing.max_context, max_queue=config.max_queue,
        kv_bytes_per_block=sizing.bytes_per_block,
        prefix_caching=config.prefix_caching, prefix_cache_salt=prefix_cache_salt(source, dtype, config.block_size)
        + (f"|draft={draft_source.path}" if draft_source is not None else ""),
        speculative=config.speculative, scheduling_policy=config.scheduling_policy, kv_offload_blocks=tier.blocks,
        kv_offload_snapshots=tier.snapshots, kv_offload_snapshot_bytes=tier.snapshot_bytes,
        kv_window=sliding_window(source.config), kv_window_slots=max(sizing.window_blocks - 1, 0),
        state_slots=step.rows + 1 if source.config.recurrent_specs() else 0,  # the runner's pool: a slot per row
        state_pool_bytes=settings_pool_bytes(source.config.recurrent_specs(), step.rows, config),
        state_snapshots=snapshot_slots(step.rows, config.prefix_caching, config.state_snapshots),
        state_snapshot_interval=config.state_snapshot_interval)
    snapshots = limits.state_snapshots if source.config.recurrent_specs() else 0  # after the running slots
    grammar, grammar_note = _grammar_compiler(source.tokenizer, source.config.vocab_size, config)
    # Speculating rows take a decode row per token: room for them in the row buckets (step.rows).
    if mtp:  # the MTP layer reads every token's hidden state from the step (a static of the graph)
        model.keeps_step_hidden = True
    runner = ModelRunner(model, num_blocks=sizing.num_blocks, block_size=config.block_size, max_rows=step.rows,
                         max_chunk_tokens=step.idle_chunk_tokens, max_context=sizing.max_context, kv_dtype=kv_dtype,
                         mesh=mesh, replicate_attention=config.replicate_attention, max_chunks=limits.max_chunks,
                         shared_compiles=_PROCESS.get("shared_compiles"), vision=vision, kv_offload_blocks=tier.blocks,
                         kv_offload_snapshots=tier.snapshots,
                         window_blocks=sizing.window_blocks, state_snapshots=snapshots,
                         state_entries=state_entries(config.speculative),
                         executable_store=store)
    draft_runner = (_draft_runner(draft_source, config, dtype, kv_dtype, sizing, runner, mesh)
                    if draft_source is not None else None)
    device, (runner, draft, channel) = runner, _leader_runners(runner, draft_runner, config)
    draft = build_mtp(source, model, dtype, device) if mtp else draft
    if wrap_runner is not None:
        runner = wrap_runner(runner)
    # Before the batcher, which quarantines an adapter whose row goes non-finite through it.
    lora = (build_registry(device, source.config, lora_slots, lora_targets, config.lora_modules)
            if lora_slots is not None else None)
    batcher = ContinuousBatcher(runner, source.tokenizer, limits,
                                new_matcher=grammar.new_matcher if grammar is not None else None,
                                fill_bitmask=grammar.fill_bitmask if grammar is not None else None,
                                faults=FaultPolicy(config.step_timeout_s, config.max_step_faults), adapters=lora,
                                draft=draft)
    if channel is not None:  # a lost peer is a fault of the engine's, on the watchdog's path
        channel.on_failure(batcher.lose_peer)
    return EngineParts(source, device, runner, batcher, config, sizing, attention_note, grammar, grammar_note,
                       matmul_note, lora, time.perf_counter() - t0, draft_runner)
