"""Engine: the facade the API holds. Serves a loaded checkpoint through the batcher.

The API reaches the engine only through this module (`docs/architecture.md`, "Rules";
`tests/tools/test_layering.py` enforces it): the `Engine` class (`submit`, `cancel`, `stats`,
`health`, `tokenizer`, `check_grammar`, `model_card`, `describe`, `memory_stats`,
`checkpoint_path` and `resolve_checkpoint` for paths not loaded yet, `sleep` / `wake` and
the checks before a state change (`check_rebuild`, `check_sleep`), the adapters (`adapters`,
`load_adapter`, `unload_adapter`), the multi-host follower's `follow_leader`,
`shutdown`) and the names in `__all__`: what the API builds an engine from (`EngineConfig`),
reads from it (`BatcherStats`, `ModelCard`) and catches from it (`MemoryBoundError`,
`SleepRefused`, `LoraError`, `ChatTemplateError`). Only jobs and their events (`ferrox_jax/request.py`) and
output constraints (`ferrox_jax/constraint.py`: `GrammarSpec`, `GrammarError`) are imported
from their own modules, which import no jax, so the settings table and the routes can
name them at import time. The batcher, scheduler, block budget, runner, step faults,
memory bounds and multi-host channel stay behind this facade. Every change to device
state (an adapter's slot, sleep and wake) is a message to the batcher's owner thread, run
between ticks: no API thread touches the runner.

`Engine.load(config)` builds one: `ferrox_jax/engine_builder.py:build_parts` does the process
setup, sizing, the model, the runner and the batcher and hands back the parts, which this
facade then holds (the builder never imports the facade); `warmup` compiles every step
shape, `start` starts the owner thread.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable

import jax
import jax.numpy as jnp

from ferrox_jax import memory_bounds, multihost
from ferrox_jax.batcher import ContinuousBatcher, EventCallback
from ferrox_jax.config import DEFAULT_COMPILE_CACHE, EngineConfig, SpeculativeConfig
from ferrox_jax.constraint import GrammarError, GrammarSpec
from ferrox_jax.engine_builder import KVSizing, build_parts
from ferrox_jax.host_heap import trim_host_heap
from ferrox_jax.images import ImageError, ImageLimits
from ferrox_jax.lora_registry import LoadedAdapter, LoraRegistry, check_adapter_name
from ferrox_jax.memory_bounds import MemoryBoundError, host_total_bytes
from ferrox_jax.request import AdmissionError, Job, with_seed
from ferrox_jax.priority import check_priority
from ferrox_jax.runner import ModelRunner
from ferrox_jax.runner_protocol import Runner
from ferrox_jax.sleep import SleepRefused
from ferrox_jax.stats import BatcherStats
from models.chat_template import ChatTemplateError
from models.checkpoint import CheckpointSource
from models.config import ModelConfig
from models.cpu_isa import cap_xla
from models.loader import resolve_path
from models.lora import LoraError
from models.tokenizer import Tokenizer

if TYPE_CHECKING:  # llguidance is imported only when structured output is set up
    import concurrent.futures

    from ferrox_jax.grammar import GrammarCompiler

# What the API may take from this module (tests/tools/test_layering.py checks every import of it).
__all__ = (
    "Engine", "ModelCard",
    "EngineConfig", "SpeculativeConfig", "DEFAULT_COMPILE_CACHE",  # what an engine is built from
    "BatcherStats",  # what `Engine.stats` returns
    "MemoryBoundError", "SleepRefused", "LoraError", "ChatTemplateError",  # what the facade's calls raise
    "check_adapter_name",  # an adapter name's rule, before a path is looked at
    "check_priority",  # a request's priority under the scheduling policy, before it is submitted
    "host_total_bytes",  # the host's memory, which also caps the server's own byte caps
    "ImageError", "ImageLimits",  # `Engine.prepare_images`' refusal and limits
    "cap_xla",  # FERROX_CPU_ISA's cap on XLA's own code, before the backend starts (models/cpu_isa.py)
)


@dataclasses.dataclass(frozen=True)
class ModelCard:
    """What the engine says of the model it serves; the API renders it as `/v1/models`'
    entry (its wire shape is `api/protocol.py:ModelObject`), in `/health`, `/admin/stats`
    and `/metrics`."""

    id: str  # the name clients send as `model`
    architecture: str  # the checkpoint's (HF) architecture name
    max_context: int  # prompt + generated tokens per request, at most
    dtype: str  # compute dtype
    quantization: str = "none"  # weights: "none", "int8" or "w8a8" (models/quant.py)
    kv_cache_dtype: str = "float32"  # KV cache storage dtype
    synthetic_weights: bool = False  # random weights (--load-format dummy): outputs are meaningless
    weights_bytes: int = 0  # model arrays' bytes, each array once (quantized values and scales; a float tied LM-head copy included)
    kv_bytes: int = 0  # the KV cache's bytes (all blocks, the null block included)
    matmul: str = ""  # which kernel multiplies quantized weights, and on which ISA ("" for float)


class Engine:
    """The engine facade (see the module docstring). Thread-safe where the API needs it:
    `submit`, `cancel`, `stats` and `health` may be called from any thread."""

    def __init__(self, source: CheckpointSource, device: ModelRunner, batcher: ContinuousBatcher,
                 config: EngineConfig, sizing: KVSizing, attention_note: str,
                 grammar: GrammarCompiler | None = None, grammar_note: str = "", matmul_note: str = "",
                 runner: Runner | None = None, draft_runner: ModelRunner | None = None,
                 lora: LoraRegistry | None = None) -> None:
        """`device`: the model's runner (what the descriptions read); `runner`: the one the
        batcher drives (on a multi-host leader, `device` wrapped to send every step to the
        other processes; default `device`); `draft_runner`: `--speculative draft`'s; `lora`:
        the adapter registry (`--max-loras` > 0)."""
        self._source = source
        self._device = device
        self._runner = runner if runner is not None else device
        self.draft_runner = draft_runner  # a multi-host follower replays the draft's steps on it
        self._lora = lora  # the adapter registry (None without --max-loras): reached through the methods below
        self._batcher = batcher
        self.config = config
        self.tokenizer: Tokenizer = source.tokenizer
        self.model_name = config.served_model_name or source.name
        self.max_context = sizing.max_context
        self.sizing = sizing
        self.attention_note = attention_note
        self.matmul_note = matmul_note  # which int8 matmul w8a8 runs on ("" when not quantized)
        self.dtype_name = str(jnp.dtype(device.compute_dtype))
        self.warmup_s: float | None = None
        self.load_s: float = 0.0
        self._grammar = grammar
        self.grammar_note = grammar_note  # why structured output is unavailable, when it is
        # Measured from the placed arrays, not from the config: logical bytes, a replicated
        # array counted once (on a mesh a device holds its shards of the split ones).
        # Each array once: a GGUF's tied LM head is its embedding's blocks, one array under two names.
        self.weights_bytes = sum({id(leaf): leaf.nbytes for leaf in jax.tree.leaves(device.state)}.values())

    @classmethod
    def load(cls, config: EngineConfig, progress: Callable[[str], None] | None = None,
             wrap_runner: Callable[[Runner], Runner] | None = None) -> "Engine":
        """Open, size, build and wire an engine (not yet warmed up or started): the parts
        come from `ferrox_jax/engine_builder.py:build_parts`, which knows nothing of this class.
        `wrap_runner`: the builder's one runner-wrapping hook (tests' fault injection,
        `tests/support/faults.py`): the batcher drives `wrap_runner(runner)`.

        Raises:
          ValueError (a configuration this checkpoint or these devices cannot serve, named),
          FileNotFoundError, UnsupportedModelError, CheckpointError (models/loader.py).
        """
        parts = build_parts(config, progress, wrap_runner)
        engine = cls(parts.source, parts.device, parts.batcher, parts.config, parts.sizing, parts.attention_note,
                     parts.grammar, parts.grammar_note, parts.matmul_note, runner=parts.runner,
                     draft_runner=parts.draft_runner, lora=parts.lora)
        engine.load_s = parts.load_s
        return engine

    # -- lifecycle -----------------------------------------------------------------------

    def warmup(self, progress: Callable[[int, int, tuple], None] | None = None) -> float:
        """Compiles every bucket (progress(done, total, key) after each); returns seconds."""
        self.warmup_s = self._batcher.warmup(progress)
        trim_host_heap()  # the compiles' freed memory, back to the system before serving
        return self.warmup_s

    def start(self) -> None:
        self._batcher.start()

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stops the batcher; open requests end with an error event."""
        self._batcher.shutdown(timeout_s)

    # -- serving (any thread) -----------------------------------------------------------

    def submit(self, job: Job, on_event: EventCallback) -> Job:
        """Queues a job; `on_event(RowEvent)` is then called from the engine's owner thread.

        A constrained request's grammar should have passed `check_grammar` first (on a
        worker thread): here it is only looked up in the compile cache. The job's seed is
        settled here and nowhere else (`with_seed`): the one it names, or a fresh one.

        Returns:
          The job as queued, with the seed it samples with.

        Raises:
          AdmissionError: refused, with a complete message; nothing is held for it.
          GrammarError: the request's output constraint cannot be compiled.
          ValueError: the request id is already open, or its priority is out of range or
            not 0 under the fcfs policy (`check_priority`; the API answers 400 first).
        """
        refusal = check_priority(job.priority, self.config.scheduling_policy, "Job.priority")
        if refusal is not None:
            raise ValueError(refusal)
        if job.grammar is not None:
            self.check_grammar(job.grammar)
        if job.images and not self.takes_images:
            raise AdmissionError("images_unsupported", f"the model {self.model_name!r} takes no images; "
                                 "send text only, or serve a vision-language model")
        job = dataclasses.replace(job, sampling=with_seed(job.sampling))
        self._batcher.submit(job, on_event)
        return job

    def cancel(self, request_id: str) -> bool:
        """Cancels a request; True if it was open. Idempotent."""
        return self._batcher.cancel(request_id)

    def stats(self) -> BatcherStats:
        """The latest published counters (a frozen snapshot)."""
        return self._batcher.stats()

    def check_grammar(self, spec: GrammarSpec) -> None:
        """Validate and compile an output constraint for `Job.grammar` into
        the engine's compile cache (keyed by spec; about a millisecond cold, with the GIL
        released), so that `submit` finds it there. Call it off the event loop.

        Raises:
          GrammarError: naming the problem (an invalid schema, regex or grammar, a
            JSON-schema keyword strict mode cannot enforce), or why this model's
            tokenizer has no structured output.
        """
        if self._grammar is None:
            raise GrammarError(f"structured output is unavailable for this model: {self.grammar_note}")
        self._grammar.compile(spec)

    def sleep(self, level: int = 1) -> "concurrent.futures.Future":
        """Frees the KV cache (level 2: also moves the weights to host memory) once idle;
        the caller stops submitting first (`ferrox_jax/sleep.py`). A message to the owner
        thread, which runs it between ticks (`ContinuousBatcher.sleep`)."""
        return self._batcher.sleep(level)

    def wake(self) -> "concurrent.futures.Future":
        """Reallocates what `sleep` freed, in the same shapes (no recompiles)."""
        return self._batcher.wake()

    def check_sleep(self, level: int) -> None:
        """Before `sleep(level)`, on any thread: level 2 copies the weights to host memory.

        Raises:
          SleepRefused: a multi-host group (`ferrox_jax/sleep.py`).
          MemoryBoundError (field "level"): the host has less memory available than that."""
        if jax.process_count() > 1:
            raise SleepRefused(f"a multi-host group ({jax.process_count()} processes) does not sleep: every process "
                               "would have to free and rebuild its part of the cache in step; stop the group and "
                               "start it again instead")
        if level == 2:
            memory_bounds.check_host_room(self.weights_bytes, "moving the weights to host memory")

    def check_rebuild(self, overrides: dict) -> None:
        """Before a cache rebuild with `overrides` (kv_blocks or kv_memory_gib): refuses what
        the new engine could not hold beside this one once this one's cache is freed.

        Raises:
          MemoryBoundError naming the given field."""
        memory_bounds.check_rebuild(self, overrides)

    @property
    def sleep_level(self) -> int:
        """0 awake, else the level it sleeps at."""
        return self._batcher.sleep_level

    # -- LoRA adapters (the admin routes) ------------------------------------------------

    @property
    def max_loras(self) -> int:
        """Adapter slots (`--max-loras`; 0: this engine serves no adapters)."""
        return self._lora.max_loras if self._lora is not None else 0

    @property
    def adapter_targets(self) -> dict[tuple[int, str], tuple[int, int]]:
        """{(layer, projection): (in, out)} an adapter may target ({} without slots)."""
        return self._lora.targets if self._lora is not None else {}

    def adapters(self) -> list[LoadedAdapter]:
        """The loaded adapters, in load order (copies; any thread)."""
        return self._lora.adapters() if self._lora is not None else []

    def resolve_adapter(self, name: str) -> str:
        """The key (name + weights digest) of the loaded adapter `name`, for a request's jobs
        to name it by (`Job.adapter_name` / `adapter_key`); counts the request
        in the adapter's `num_requests`. Any thread.

        Raises:
          AdmissionError: "adapter_not_found" (not loaded, or no LoRA slots) or
            "adapter_quarantined" (its message says how to clear it).
        """
        if self._lora is None:
            raise AdmissionError("adapter_not_found", f"no LoRA adapter named {name!r} is loaded (this server "
                                                      "has no LoRA slots)")
        try:
            return self._lora.resolve(name)
        except LoraError as e:
            raise AdmissionError(e.code, str(e)) from None

    def load_adapter(self, name: str, path: str) -> LoadedAdapter:
        """Reads and checks the adapter's files on the calling thread (call it off the event
        loop), then writes its slot on the owner thread between two ticks.

        Raises:
          LoraError: the name, the files or the slots refuse it (`ferrox_jax/lora_registry.py`).
        """
        registry = self._require_lora()
        read = registry.read(name, path)
        return self._batcher.run_between_ticks(lambda: registry.place(read)).result()

    def unload_adapter(self, name: str) -> None:
        """The name stops resolving (on the owner thread, between two ticks); the slot frees
        once no request holds it. Raises LoraError("adapter_not_found")."""
        registry = self._require_lora()
        self._batcher.run_between_ticks(lambda: registry.unload(name)).result()

    def _require_lora(self) -> LoraRegistry:
        if self._lora is None:
            raise LoraError("lora_disabled", "this server has no LoRA slots (start it with --max-loras N)")
        return self._lora

    def health(self) -> str:
        """"ready", "dead" (the owner loop crashed or the engine gave up on faults) or "stopped"."""
        return self._batcher.health()

    def fatal(self) -> tuple[str, str] | None:
        """(kind, reason) once the engine gave up (`ferrox_jax/step_faults.py`), else None."""
        return self._batcher.fatal()

    def add_fatal_listener(self, listener: Callable[[str, str], None]) -> None:
        """`listener(kind, reason)`, once, when the engine gives up (any thread)."""
        self._batcher.add_fatal_listener(listener)

    # -- multi-host (`ferrox_jax/multihost.py`) ------------------------------------------

    def follow_leader(self, on_connected: Callable[[], None] | None = None) -> int:
        """A follower process's life after warm-up: join process 0's step channel (the
        config's coordinator, secret and timeout) and run every step it sends. Returns 0 when
        the leader stops the group; a lost or silent leader exits the process."""
        cfg = self.config
        return multihost.follow(self._runner, multihost.step_channel_address(cfg.coordinator_address),
                                cfg.process_id, on_connected=on_connected, timeout_s=cfg.multihost_timeout_s,
                                secret=cfg.multihost_secret, draft=self.draft_runner)

    @staticmethod
    def stop_followers() -> None:
        """Stops this process's followers (a leader's clean exit; nothing on one process)."""
        multihost.close_all()

    # -- descriptions -------------------------------------------------------------------

    @property
    def runner(self) -> Runner:
        """The runner the batcher drives, for offline tools that time steps through its verbs
        (tools/bench/bench_engine.py) while the batcher is not started, and for a multi-host
        follower, which replays the leader's steps on it; the API never touches it."""
        return self._runner

    @property
    def model_config(self) -> ModelConfig:
        return self._source.config

    @property
    def takes_images(self) -> bool:
        """The model has a vision encoder: a job may carry images (`Job.images`)."""
        return getattr(self._source.config, "vision", None) is not None

    def prepare_images(self, blobs: list[bytes], limits: ImageLimits) -> list[Any]:
        """The pictures of image files, as this model's encoder takes them (Gemma 3: (pixels,
        digest); Idefics3 / SmolVLM: tiles; Qwen2.5-VL: patches and their grid;
        `ferrox_jax/image_layout.py`), in any thread (CPU
        work: the API runs it in its pool). Raises ImageError naming the image and the limit."""
        return self._image_layout().preprocess(blobs, limits)

    def expand_images(self, text: str, pictures: list[Any]) -> str:
        """A rendered prompt with its image markers, one per `prepare_images` picture, laid out
        as the model's processor lays them. Raises ValueError."""
        return self._image_layout().expand(text, self.tokenizer, pictures) if pictures else text

    def image_spans(self, ids: list[int], pictures: list[Any]) -> tuple:
        """`Job.images` for a tokenized prompt and its `prepare_images` pictures. Raises ValueError."""
        return self._image_layout().spans(ids, pictures) if pictures else ()

    @property
    def image_layout(self):
        """The model's image layout (`ferrox_jax/image_layout.py`), None for a text model."""
        return self._device.vision.layout if self._device.vision is not None else None

    def _image_layout(self):
        if self._device.vision is None:
            raise ImageError(f"the model {self.model_name!r} takes no images; send text only")
        return self._device.vision.layout

    @property
    def checkpoint_path(self) -> str:
        """The file or folder the weights came from (the default model's resolved file)."""
        return self._source.path

    @staticmethod
    def resolve_checkpoint(path: str) -> str:
        """Where `path` ("default", a folder, a .gguf) points. Raises FileNotFoundError."""
        return str(resolve_path(path))

    def memory_stats(self) -> dict:
        """Device memory as the first local device reports it (bytes_in_use, peak_bytes_in_use,
        bytes_limit where known); empty where the backend reports nothing (XLA's CPU)."""
        stats = jax.local_devices()[0].memory_stats() or {}
        keys = ("bytes_in_use", "peak_bytes_in_use", "bytes_limit")
        return {key: int(stats[key]) for key in keys if key in stats}

    @property
    def model_card(self) -> ModelCard:
        return ModelCard(id=self.model_name, architecture=self._source.config.architecture,
                         max_context=self.max_context, dtype=self.dtype_name,
                         quantization=self.config.quantization,
                         kv_cache_dtype=str(jnp.dtype(self._device.kv_dtype)),
                         synthetic_weights=self._source.is_synthetic, weights_bytes=self.weights_bytes,
                         kv_bytes=self.sizing.kv_bytes, matmul=self.matmul_note)

    def describe(self) -> dict:
        """The start-up log block: model, devices, weights and KV sizing, buckets."""
        cfg = self._source.config
        runner = self._device
        buckets = runner.buckets
        return {
            "model": self.model_name,
            "path": self._source.path,
            "synthetic_weights": self._source.is_synthetic,
            "architecture": cfg.architecture,
            "params": f"{cfg.num_layers} layers, hidden {cfg.hidden_size}, {cfg.num_heads} heads "
                      f"({cfg.num_kv_heads} kv), vocab {cfg.vocab_size}",
            "dtype": self.dtype_name,
            "quantization": self.config.quantization,
            "kv_cache_dtype": str(jnp.dtype(runner.kv_dtype)),
            "devices": [str(d) for d in jax.devices()],
            "mesh": None if runner.mesh is None else dict(runner.mesh.shape),
            "replicate_attention": self.config.replicate_attention,
            "attention": self.attention_note,
            "int8_matmul": self.matmul_note or None,
            "kv_blocks": self.sizing.num_blocks,
            "block_size": self.config.block_size,
            "weights_bytes": self.weights_bytes,
            "kv_bytes": self.sizing.kv_bytes,
            "memory": f"weights {self.weights_bytes / 2**30:.2f} GiB + KV {self.sizing.kv_bytes / 2**30:.2f} GiB",
            "max_context": self.max_context,
            "kv_sizing": self.sizing.note,
            "prefix_caching": self.config.prefix_caching,
            "buckets": {"decode_rows": buckets.decode_rows, "mixed_rows": buckets.mixed_rows,
                        "chunk_tokens": buckets.chunk_tokens, "chunk_rows": buckets.chunk_rows},
            "max_batched_tokens": self._batcher.limits.batched_tokens,
            "num_compiled_shapes": len(runner.compile_keys()),
        }
