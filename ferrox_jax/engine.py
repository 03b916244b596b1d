"""Engine: loads a checkpoint, sizes the KV cache, warms up the runner, owns the batcher.

This is what the API holds (`docs/architecture.md`). Sizing, in order: `kv_blocks` if
given, else the KV memory budget (`kv_memory_gib`) divided by the bytes one block takes;
the per-request context ceiling is `max_context` if given, else the model's trained
context capped by what the budget can hold. The start-up log says which applied.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Callable

import jax
import jax.numpy as jnp

from ferrox_jax.batcher import ContinuousBatcher
from ferrox_jax.config import BatcherConfig
from ferrox_jax.kv_cache import bytes_per_block
from ferrox_jax.runner import ModelRunner
from ferrox_jax.sharding import make_mesh, parse_mesh
from models.loader import load_checkpoint
from models.pallas_attention import ATTENTION_IMPLS

log = logging.getLogger(__name__)

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def default_dtype_name() -> str:
    """float32 on CPU (XLA's CPU bf16 elementwise work is ~10x slower), bfloat16 elsewhere."""
    return "float32" if jax.default_backend() == "cpu" else "bfloat16"


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Model and KV-cache settings (the batcher's live in BatcherConfig)."""

    model: str = "default"  # HF folder, .gguf file, or "default" (embedded SmolLM2)
    dtype: str | None = None  # None: default_dtype_name()
    block_size: int = 16
    kv_blocks: int | None = None  # total blocks including the null block
    kv_memory_gib: float = 2.0  # KV budget when kv_blocks is not given
    max_context: int | None = None  # per-request prompt + max_tokens ceiling
    max_rows: int = 32  # largest decode row bucket
    served_model_name: str | None = None
    compile_cache_dir: str | None = None
    # ---- scale-out (ferrox_jax/sharding.py, docs/deploy-tpu.md) ----
    tensor_parallel: int = 1  # devices on the mesh's "model" axis; 1 = no mesh
    mesh: str | None = None  # "data=1,model=4" (overrides tensor_parallel; data must be 1)
    replicate_attention: bool = False  # shard only MLP + vocab (heads need not divide)
    attention_impl: str = "auto"  # decode attention: auto | jax | pallas | pallas-interpret
    coordinator_address: str | None = None  # multi-host: "host:port", or "auto" on TPU pods
    num_processes: int | None = None  # multi-host: processes in the cluster
    process_id: int | None = None  # multi-host: this process's index

    @property
    def mesh_shape(self) -> tuple[int, int]:
        """(data, model) sizes; (1, 1) means a single device and no mesh."""
        return parse_mesh(self.mesh) if self.mesh else (1, self.tensor_parallel)

    def __post_init__(self) -> None:
        if self.tensor_parallel < 1:
            raise ValueError(f"EngineConfig.tensor_parallel must be >= 1; got {self.tensor_parallel}")
        try:
            data, model = self.mesh_shape
        except ValueError as e:
            raise ValueError(f"EngineConfig.mesh: {e}") from None
        if self.mesh and self.tensor_parallel not in (1, model):
            raise ValueError(f"EngineConfig.tensor_parallel {self.tensor_parallel} contradicts "
                             f"EngineConfig.mesh {self.mesh!r} (model={model}); give one of them")
        if data != 1:
            raise ValueError(f"EngineConfig.mesh {self.mesh!r}: data={data} is not supported inside one "
                             f"engine (one scheduler owns one KV block pool); run {data} replicas with "
                             f"model={model} behind a load balancer (docs/deploy-tpu.md)")
        if self.attention_impl not in ATTENTION_IMPLS:
            raise ValueError(f"EngineConfig.attention_impl must be one of {', '.join(ATTENTION_IMPLS)}; "
                             f"got {self.attention_impl!r}")
        if self.coordinator_address not in (None, "auto") and (self.num_processes is None or self.process_id is None):
            raise ValueError("EngineConfig.coordinator_address needs num_processes and process_id "
                             "(or coordinator_address='auto' on a TPU pod)")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"EngineConfig.dtype must be one of {', '.join(DTYPES)}; got {self.dtype!r}")
        for name in ("block_size", "max_rows"):
            if getattr(self, name) < 1:
                raise ValueError(f"EngineConfig.{name} must be >= 1; got {getattr(self, name)}")
        if self.kv_blocks is not None and self.kv_blocks < 2:
            raise ValueError(f"EngineConfig.kv_blocks must be >= 2 (block 0 is reserved); got {self.kv_blocks}")
        if self.kv_memory_gib <= 0:
            raise ValueError(f"EngineConfig.kv_memory_gib must be > 0; got {self.kv_memory_gib}")
        if self.max_context is not None and self.max_context < 2:
            raise ValueError(f"EngineConfig.max_context must be >= 2; got {self.max_context}")


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


class Engine:
    def __init__(self, checkpoint, runner: ModelRunner, batcher: ContinuousBatcher, config: EngineConfig,
                 sizing_note: str):
        self.checkpoint = checkpoint
        self.runner = runner
        self.batcher = batcher
        self.config = config
        self.tokenizer = checkpoint.tokenizer
        self.model_name = config.served_model_name or checkpoint.name
        self.max_context = runner.max_context
        self.block_size = runner.block_size
        self.num_blocks = runner.num_blocks
        self.kv_bytes_per_block = bytes_per_block(
            checkpoint.config.num_layers, checkpoint.config.num_kv_heads, runner.block_size,
            checkpoint.config.head_dim, runner.kv_dtype)
        self.sizing_note = sizing_note
        self.warmup_s: float | None = None
        self.load_s: float = 0.0

    @classmethod
    def load(cls, config: EngineConfig, batcher_config: BatcherConfig | None = None,
             progress: Callable[[str], None] | None = None) -> "Engine":
        t0 = time.perf_counter()
        initialize_distributed(config.coordinator_address, config.num_processes, config.process_id)
        if jax.process_count() > 1:
            raise ValueError(
                f"{jax.process_count()} JAX processes: multi-host serving needs every process to run "
                "the same steps, and the scheduler does not broadcast its plans yet; run one engine "
                "per host (docs/deploy-tpu.md, 'Multi-host')")
        enable_compile_cache(config.compile_cache_dir)
        dtype_name = config.dtype or default_dtype_name()
        dtype = DTYPES[dtype_name]
        data, model_axis = config.mesh_shape
        mesh = make_mesh(data, model_axis) if model_axis > 1 else None
        host = _host_device() if mesh is not None else None
        if host is not None:
            with jax.default_device(host):
                ckpt = load_checkpoint(config.model, dtype, progress=progress)
        else:
            ckpt = load_checkpoint(config.model, dtype, progress=progress)
        batcher_config = batcher_config or BatcherConfig()
        num_blocks, max_context, note = size_kv(config, batcher_config, ckpt.config, dtype)
        max_rows = min(config.max_rows, batcher_config.max_seqs or config.max_rows)
        prefill_chunk = min(batcher_config.prefill_chunk, max_context)
        runner = ModelRunner(ckpt.model, num_blocks=num_blocks, block_size=config.block_size,
                             max_rows=max_rows, max_prefill_tokens=prefill_chunk,
                             max_context=max_context, kv_dtype=dtype, mesh=mesh,
                             replicate_attention=config.replicate_attention,
                             attention_impl=config.attention_impl)
        batcher_config = dataclasses.replace(
            batcher_config, kv_block_size=config.block_size, kv_blocks=num_blocks, max_context=max_context)
        batcher = ContinuousBatcher(runner, ckpt.tokenizer, batcher_config)
        engine = cls(ckpt, runner, batcher, config, note)
        engine.load_s = time.perf_counter() - t0
        return engine

    def warmup(self, progress: Callable[[int, int, tuple], None] | None = None) -> float:
        self.warmup_s = self.runner.warmup(progress)
        return self.warmup_s

    def start(self) -> None:
        self.batcher.start()

    def shutdown(self, timeout_s: float = 5.0) -> None:
        self.batcher.shutdown(timeout_s)

    def describe(self) -> dict:
        cfg = self.checkpoint.config
        b = self.runner.buckets
        return {
            "model": self.model_name,
            "path": self.checkpoint.path,
            "architecture": cfg.architecture,
            "params": f"{cfg.num_layers} layers, hidden {cfg.hidden_size}, {cfg.num_heads} heads "
                      f"({cfg.num_kv_heads} kv), vocab {cfg.vocab_size}",
            "dtype": str(jnp.dtype(self.runner.kv_dtype)),
            "devices": [str(d) for d in jax.devices()],
            "mesh": None if self.runner.mesh is None else dict(self.runner.mesh.shape),
            "replicate_attention": self.config.replicate_attention,
            "attention": self.runner.attention_note,
            "kv_blocks": self.num_blocks,
            "block_size": self.block_size,
            "kv_bytes": self.num_blocks * self.kv_bytes_per_block,
            "max_context": self.max_context,
            "kv_sizing": self.sizing_note,
            "buckets": {"decode_rows": b.decode_rows, "prefill_tokens": b.prefill_tokens},
            "num_compiled_shapes": len(b.keys()),
        }


def size_kv(config: EngineConfig, batcher_config: BatcherConfig, model_cfg, dtype) -> tuple[int, int, str]:
    """Return (num_blocks including the null block, max_context, why)."""
    per_block = bytes_per_block(model_cfg.num_layers, model_cfg.num_kv_heads, config.block_size,
                                model_cfg.head_dim, dtype)
    kv_blocks = config.kv_blocks or batcher_config.kv_blocks
    if kv_blocks:
        why = f"{kv_blocks} KV blocks as configured"
    else:
        kv_blocks = max(2, int(config.kv_memory_gib * 2**30 // per_block))
        why = f"{kv_blocks} KV blocks from the {config.kv_memory_gib:g} GiB KV memory budget ({per_block} B/block)"
    trained = model_cfg.max_position_embeddings
    usable_tokens = (kv_blocks - 1) * config.block_size
    max_context = config.max_context or batcher_config.max_context
    if max_context:
        why += f"; context ceiling {max_context} as configured"
    else:
        max_context = min(trained, usable_tokens)
        why += f"; context ceiling {max_context} = min(trained context {trained}, KV capacity {usable_tokens})"
    if max_context > trained:
        log.warning("max_context %d exceeds the model's trained context %d", max_context, trained)
    return kv_blocks, max_context, why
