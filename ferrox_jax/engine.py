"""Engine: the facade the API holds. Loads a checkpoint, sizes the KV cache, owns the batcher.

The API reaches the engine only through this class (`docs/architecture.md`): `submit`,
`cancel`, `stats`, `health`, `tokenizer`, `model_card`, `describe`, `shutdown`. Request
and error types come from `ferrox_jax/request.py`; the batcher, scheduler, block budget
and runner stay behind this facade.

`Engine.load(config)`, in order: open the checkpoint (config, tokenizer, lazy tensors;
`models/loader.py`), size the KV cache and the context ceiling from the config and the
checkpoint (`size_kv`), choose the decode attention for that block-table width, build
the model with it, then the runner (device state, buckets) and the batcher with the
resolved `SchedulerLimits`. Sizing: `kv_blocks` if given, else the KV memory budget
divided by the bytes one block takes in the KV storage dtype (`kv_cache_dtype`: a
bfloat16 cache holds twice the blocks of a float32 one in the same budget); the context ceiling is `max_context` if given, else
the model's trained context capped by what the budget holds. The start-up log says which
applied.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from typing import Callable

import jax
import jax.numpy as jnp

from ferrox_jax.batcher import ContinuousBatcher, EventCallback
from ferrox_jax.config import EngineConfig, SchedulerLimits
from ferrox_jax.kv_cache import bytes_per_block
from ferrox_jax.request import GenerationRequest
from ferrox_jax.runner import ModelRunner, block_table_width
from ferrox_jax.sharding import check_divisibility, make_mesh
from ferrox_jax.stats import BatcherStats
from models.config import ModelConfig
from models.loader import CheckpointSource, open_checkpoint
from models.pallas_attention import select_decode_attention
from models.tokenizer import Tokenizer

log = logging.getLogger(__name__)

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def default_dtype_name() -> str:
    """float32 on CPU (XLA's CPU bf16 elementwise work is ~10x slower), bfloat16 elsewhere."""
    return "float32" if jax.default_backend() == "cpu" else "bfloat16"


@dataclasses.dataclass(frozen=True)
class ModelCard:
    """What `/v1/models` and `/health` say about the served model."""

    id: str  # the name clients send as `model`
    architecture: str  # the checkpoint's (HF) architecture name
    max_context: int  # prompt + generated tokens per request, at most
    dtype: str  # compute dtype
    quantization: str  # weights: "none", "int8" or "w8a8" (models/quant.py)
    kv_cache_dtype: str  # KV cache storage dtype


@dataclasses.dataclass(frozen=True)
class KVSizing:
    """How big the KV cache is and why (the start-up log prints `note`)."""

    num_blocks: int  # including the null block 0
    max_context: int
    bytes_per_block: int
    note: str


def initialize_distributed(coordinator_address: str | None, num_processes: int | None = None,
                           process_id: int | None = None) -> bool:
    """`jax.distributed.initialize` when a coordinator is given; must run before any other
    jax call. "auto" lets JAX discover the cluster (TPU pods, SLURM). Returns whether it ran."""
    if not coordinator_address:
        return False
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
        return jax.devices("cpu")[0]
    except RuntimeError:
        return None


def enable_compile_cache(path: str | None) -> None:
    """JAX's persistent compilation cache: a second start reuses compiled buckets."""
    if not path:
        return
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def size_kv(config: EngineConfig, model_cfg: ModelConfig, kv_dtype) -> KVSizing:
    """Blocks, context ceiling and the reason, from the config and the checkpoint.
    `kv_dtype`: the cache's storage dtype, which sets the bytes per block."""
    per_block = bytes_per_block(model_cfg.num_layers, model_cfg.num_kv_heads, config.block_size,
                                model_cfg.head_dim, kv_dtype)
    kv_blocks = config.kv_blocks
    if kv_blocks:
        why = f"{kv_blocks} KV blocks as configured"
    else:
        kv_blocks = max(2, int(config.kv_memory_gib * 2**30 // per_block))
        why = (f"{kv_blocks} KV blocks from the {config.kv_memory_gib:g} GiB KV memory budget "
               f"({per_block} B/block in {jnp.dtype(kv_dtype).name})")
    trained = model_cfg.max_position_embeddings
    usable_tokens = (kv_blocks - 1) * config.block_size
    max_context = config.max_context
    if max_context:
        why += f"; context ceiling {max_context} as configured"
    else:
        max_context = min(trained, usable_tokens)
        why += f"; context ceiling {max_context} = min(trained context {trained}, KV capacity {usable_tokens})"
    if max_context > trained:
        log.warning("max_context %d exceeds the model's trained context %d", max_context, trained)
    return KVSizing(kv_blocks, max_context, per_block, why)


class Engine:
    """The engine facade (see the module docstring). Thread-safe where the API needs it:
    `submit`, `cancel`, `stats` and `health` may be called from any thread."""

    def __init__(self, source: CheckpointSource, runner: ModelRunner, batcher: ContinuousBatcher,
                 config: EngineConfig, sizing: KVSizing, attention_note: str) -> None:
        self._source = source
        self._runner = runner
        self._batcher = batcher
        self.config = config
        self.tokenizer: Tokenizer = source.tokenizer
        self.model_name = config.served_model_name or source.name
        self.max_context = sizing.max_context
        self.sizing = sizing
        self.attention_note = attention_note
        self.dtype_name = str(jnp.dtype(runner.compute_dtype))
        self.warmup_s: float | None = None
        self.load_s: float = 0.0

    @classmethod
    def load(cls, config: EngineConfig, progress: Callable[[str], None] | None = None) -> "Engine":
        """Open, size, build and wire an engine (not yet warmed up or started).

        Raises:
          ValueError (a configuration this checkpoint or these devices cannot serve, named),
          FileNotFoundError, UnsupportedModelError, CheckpointError (models/loader.py).
        """
        t0 = time.perf_counter()
        initialize_distributed(config.coordinator_address, config.num_processes, config.process_id)
        if jax.process_count() > 1:
            raise ValueError(
                f"{jax.process_count()} JAX processes: multi-host serving needs every process to run "
                "the same steps, and the scheduler does not broadcast its plans yet; run one engine "
                "per host (docs/deploy-tpu.md, 'Multi-host')")
        enable_compile_cache(config.compile_cache_dir)
        dtype = DTYPES[config.dtype or default_dtype_name()]
        kv_dtype = DTYPES[config.kv_cache_dtype] if config.kv_cache_dtype else dtype
        source = open_checkpoint(config.model)
        _, model_axis = config.mesh_shape
        check_divisibility(source.config, model_axis, config.replicate_attention)
        mesh = make_mesh(1, model_axis) if model_axis > 1 else None
        sizing = size_kv(config, source.config, kv_dtype)
        attention, attention_note = select_decode_attention(
            config.attention_impl, head_dim=source.config.head_dim, block_size=config.block_size,
            max_blocks_per_row=block_table_width(sizing.max_context, config.block_size), mesh=mesh,
            kv_sharded=not config.replicate_attention)
        log.info("%s", attention_note)
        host = _host_device() if mesh is not None else None
        with jax.default_device(host) if host is not None else contextlib.nullcontext():
            model = source.build(dtype, decode_attention=attention, progress=progress,
                                 quantization=config.quantization)
        max_rows = config.max_seqs
        prefill_chunk = min(config.prefill_chunk, sizing.max_context)
        runner = ModelRunner(model, num_blocks=sizing.num_blocks, block_size=config.block_size,
                             max_rows=max_rows, max_prefill_tokens=prefill_chunk,
                             max_context=sizing.max_context, kv_dtype=kv_dtype, mesh=mesh,
                             replicate_attention=config.replicate_attention)
        limits = SchedulerLimits(
            block_size=config.block_size, num_blocks=sizing.num_blocks - 1, max_seqs=config.max_seqs,
            max_rows=max_rows, max_chunk_tokens=prefill_chunk, max_context=sizing.max_context,
            max_queue=config.max_queue, kv_bytes_per_block=sizing.bytes_per_block)
        batcher = ContinuousBatcher(runner, source.tokenizer, limits)
        engine = cls(source, runner, batcher, config, sizing, attention_note)
        engine.load_s = time.perf_counter() - t0
        return engine

    # -- lifecycle -----------------------------------------------------------------------

    def warmup(self, progress: Callable[[int, int, tuple], None] | None = None) -> float:
        """Compiles every bucket (progress(done, total, key) after each); returns seconds."""
        self.warmup_s = self._runner.warmup(progress)
        return self.warmup_s

    def start(self) -> None:
        self._batcher.start()

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stops the batcher; open requests end with an error event."""
        self._batcher.shutdown(timeout_s)

    # -- serving (any thread) -----------------------------------------------------------

    def submit(self, request: GenerationRequest, on_event: EventCallback) -> None:
        """Queues a job; `on_event(RowEvent)` is then called from the engine's owner thread.

        Raises:
          AdmissionError: refused, with a complete message; nothing is held for it.
          ValueError: the request id is already open.
        """
        self._batcher.submit(request, on_event)

    def cancel(self, request_id: str) -> bool:
        """Cancels a request; True if it was open. Idempotent."""
        return self._batcher.cancel(request_id)

    def stats(self) -> BatcherStats:
        """The latest published counters (a frozen snapshot)."""
        return self._batcher.stats()

    def health(self) -> str:
        """"ready", "dead" (the owner loop crashed) or "stopped"."""
        return self._batcher.health()

    # -- descriptions -------------------------------------------------------------------

    @property
    def runner(self) -> ModelRunner:
        """The device side, for offline tools that time steps directly (tools/bench_engine.py)
        and fault-injection tests; the API never touches it."""
        return self._runner

    @property
    def model_config(self) -> ModelConfig:
        return self._source.config

    @property
    def model_card(self) -> ModelCard:
        return ModelCard(id=self.model_name, architecture=self._source.config.architecture,
                         max_context=self.max_context, dtype=self.dtype_name,
                         quantization=self.config.quantization,
                         kv_cache_dtype=str(jnp.dtype(self._runner.kv_dtype)))

    def memory(self) -> dict[str, int]:
        """{"weights_bytes", "kv_bytes"}: bytes of the placed weights (quantized values and
        scales included) and of the KV cache, measured from the arrays themselves, summed
        over the whole mesh (a replicated array counts once)."""
        return {"weights_bytes": self._runner.weights_bytes, "kv_bytes": self._runner.kv_cache.nbytes}

    def describe(self) -> dict:
        """The start-up log block: model, devices, weights and KV sizing, buckets."""
        cfg = self._source.config
        runner = self._runner
        buckets = runner.buckets
        return {
            "model": self.model_name,
            "path": self._source.path,
            "architecture": cfg.architecture,
            "params": f"{cfg.num_layers} layers, hidden {cfg.hidden_size}, {cfg.num_heads} heads "
                      f"({cfg.num_kv_heads} kv), vocab {cfg.vocab_size}",
            "dtype": self.dtype_name,
            "quantization": self.config.quantization,
            "weights_bytes": runner.weights_bytes,
            "kv_cache_dtype": str(jnp.dtype(runner.kv_dtype)),
            "devices": [str(d) for d in jax.devices()],
            "mesh": None if runner.mesh is None else dict(runner.mesh.shape),
            "replicate_attention": self.config.replicate_attention,
            "attention": self.attention_note,
            "kv_blocks": self.sizing.num_blocks,
            "block_size": self.config.block_size,
            "kv_bytes": runner.kv_cache.nbytes,
            "max_context": self.max_context,
            "kv_sizing": self.sizing.note,
            "buckets": {"decode_rows": buckets.decode_rows, "prefill_tokens": buckets.prefill_tokens},
            "num_compiled_shapes": len(buckets.keys()),
        }
