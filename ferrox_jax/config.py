"""The engine's one configuration, and the limits the batcher runs under. No jax here.

`EngineConfig` is everything a user sets about the engine: the checkpoint, the KV cache
and batching sizes (the ferrox-server contract's `FERROX_CB_*` settings), compilation and
scale-out. It is filled once (by `api/cli.py` from flags and `FERROX_*` variables, or by a
test or tool directly) and validated here, each message naming its field. The multi-host
secret stays out of its repr and out of every message.

Ceilings the index types set (int32 block ids and positions) are checked here; whether
the device can hold what the settings ask for is checked when the engine is built, against
its memory (`ferrox_jax/memory_bounds.py`).

`SchedulerLimits` are what the engine derives from it once the checkpoint is open and the
KV cache sized (`ferrox_jax/engine.py`): plain numbers, never None, checked against the
runner by the batcher. Nothing else sizes the engine.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os

from ferrox_jax.grammar_sandbox import DEFAULT_TIMEOUT_S as GRAMMAR_TIMEOUT_S, DEFAULT_WORKERS as GRAMMAR_WORKERS
from ferrox_jax.memory_bounds import INT32_MAX, MAX_USABLE_KV_BLOCKS, TABLE_ROUND_BLOCKS, max_positions
from ferrox_jax.state_snapshots import DEFAULT_INTERVAL_BLOCKS
from ferrox_jax.step_channel_auth import MIN_SECRET_CHARS, coordinator_host, is_loopback_host

DTYPE_NAMES = ("float32", "bfloat16", "float16")
# JAX's persistent compilation cache when a user names none (`ferrox serve`, the offline `LLM`).
DEFAULT_COMPILE_CACHE = os.path.join("~", ".cache", "ferrox_jax", "jax")
# The executable store's default disk bound: ~170 folders of the 1B's 23 step shapes (12 MiB
# each), a few dozen of a bigger model's; what ccache (5 GB) or a browser cache would take.
DEFAULT_STORE_MAX_GIB = 2.0
LOAD_FORMAT_NAMES = ("auto", "dummy")  # models/loader.py LOAD_FORMATS (that module imports jax)
# Weight quantization modes; the same tuple as models/quant.py's QUANTIZATION_MODES (this
# module imports no jax, a test keeps the two equal).
QUANTIZATION_NAMES = ("none", "int8", "w8a8", "w8a8-block32", "gguf", "auto")  # auto: resolved at load (engine_builder)
# Where w8a8 projections run on CPU: "auto" (the AVX2 kernel of models/cpu_kernels.py when it is
# built and the model is on one device) or "xla" (XLA's int8 dot, for comparison).
INT8_KERNEL_NAMES = ("auto", "xla")
# The order jobs are admitted in (ferrox_jax/priority.py): "fcfs", the contract's arrival
# order (the default), or "priority" (Job.priority, lower first, with preemption).
SCHEDULING_POLICIES = ("fcfs", "priority")
EXPERT_PARALLEL_MODES = ("auto", "on", "off")  # models/moe_ep.py resolve_expert_parallel


def parse_mesh(text: str) -> tuple[int, int]:
    """"data=1,model=4" -> (1, 4). Either axis may be omitted (it is then 1)."""
    sizes = {"data": 1, "model": 1}
    seen = set()
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        name, sep, value = part.partition("=")
        name = name.strip()
        if not sep or name not in sizes:
            raise ValueError(f"mesh {text!r}: expected comma-separated data=D,model=M; got {part!r}")
        if name in seen:
            raise ValueError(f"mesh {text!r}: axis {name!r} given twice")
        seen.add(name)
        try:
            sizes[name] = int(value)
        except ValueError:
            raise ValueError(f"mesh {text!r}: size of {name!r} must be an integer; got {value!r}") from None
        if sizes[name] < 1:
            raise ValueError(f"mesh {text!r}: size of {name!r} must be >= 1; got {sizes[name]}")
    return sizes["data"], sizes["model"]


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """What the engine serves and how big it is; see the module docstring."""

    # ---- the checkpoint ----
    model: str = "default"  # HF folder, .gguf file, or "default" (the embedded SmolLM2)
    served_model_name: str | None = None  # the id clients send; None: the file or folder stem
    dtype: str | None = None  # compute dtype; None: float32 on CPU, bfloat16 elsewhere
    load_format: str = "auto"  # "auto": read the weights; "dummy": random weights from the config (sizing)
    dummy_weights_seed: int = 0  # the seed of load_format="dummy" (same seed, same weights)
    mmproj: str | None = None  # llama.cpp's projector GGUF for a Gemma 3 GGUF (images in: ferrox_jax/vision.py)
    quantization: str = "none"  # "int8" (weight-only) or "w8a8" (int8 weights and activations)
    int8_kernel: str = "auto"  # w8a8 on CPU: "auto" (the AVX2 kernel where it applies) or "xla"
    # ---- KV cache and batching (the contract's FERROX_CB_* settings) ----
    block_size: int = 16  # token positions per KV block
    kv_blocks: int | None = None  # usable blocks (kv_blocks_total; the null block is added); None: from kv_memory_gib
    # KV cache budget when kv_blocks is not given; None: what max_seqs rows of a whole context
    # need, at most 2 GiB (ferrox_jax/memory_bounds.py: kv_blocks_for)
    kv_memory_gib: float | None = None
    kv_cache_dtype: str | None = None  # KV storage dtype; None: the compute dtype
    max_context: int | None = None  # prompt + max_tokens ceiling; None: trained context within the budget
    # The contract's names; inside the engine they are SchedulerLimits.max_rows / max_chunk_tokens.
    max_seqs: int = 32  # rows at once (prefilling and decoding); also the largest decode row bucket
    prefill_chunk: int = 128  # prompt tokens of one chunk, at most (capped at max_context)
    prefill_chunk_idle: int = 0  # ... when no row is decoding (larger buckets, compiled at start-up); 0: prefill_chunk
    # Prompt tokens one step computes over all its chunks (decode rows always run besides);
    # 0: the backend's default (ferrox_jax/engine_builder.py: one chunk on CPU).
    max_batched_tokens: int = 0
    max_queue: int = 512  # waiting jobs; one more is refused (503)
    scheduling_policy: str = "fcfs"  # "fcfs" or "priority" (SCHEDULING_POLICIES)
    prefix_caching: bool = True  # full prompt blocks stay cached and are shared by later prompts
    # Recurrent-state models: snapshot slots for prefix hits (ferrox_jax/state_snapshots.py); 0: two per row.
    state_snapshots: int = 0
    # ... and a prompt's snapshot every this many blocks (besides its last full block); 0: none between.
    state_snapshot_interval: int = DEFAULT_INTERVAL_BLOCKS
    # Host memory for prefix blocks the device cache evicts, restored on a hit (ferrox_jax/kv_offload.py); 0: off.
    kv_offload_gib: float = 0.0
    speculative: SpeculativeConfig | None = None  # prompt-lookup speculative decoding; None: off
    # ---- structured output (ferrox_jax/grammar.py, grammar_sandbox.py) ----
    # Each new constraint is compiled in a child process first, so a native crash in the
    # compiler costs that request a 400 instead of the server; False: in-process only.
    grammar_sandbox: bool = True
    grammar_workers: int = GRAMMAR_WORKERS  # the sandbox's child processes (each holds a tokenizer)
    grammar_timeout_s: float = GRAMMAR_TIMEOUT_S  # one compile in a child, at most (400 above)
    # ---- compilation ----
    compile_cache_dir: str | None = None  # JAX persistent compilation cache; None: off
    # the step executables serialized under compile_cache_dir, keyed by what makes them
    # (ferrox_jax/executable_store.py): a restart loads them without tracing; False: JAX's cache only
    executable_store: bool = True
    # ... and the store's disk bound in GiB: once warm, least recently used folders of other
    # programs are removed until it fits (ferrox_jax/store_bound.py); 0: unbounded
    executable_store_max_gib: float = DEFAULT_STORE_MAX_GIB
    # ---- scale-out (ferrox_jax/sharding.py, docs/deploy-tpu.md) ----
    tensor_parallel: int = 1  # devices on the mesh's "model" axis; 1 = no mesh
    mesh: str | None = None  # "data=1,model=4" (overrides tensor_parallel; data must be 1)
    replicate_attention: bool = False  # shard only MLP + vocab (heads need not divide)
    # routed experts on a mesh: "on" split by expert (E / devices whole experts each), "off" each
    # expert by its width, "auto" by the family's expert count (models/moe_ep.py resolves it at load)
    expert_parallel: str = "auto"
    attention_impl: str = "auto"  # the attention kernel (models/pallas_attention.py checks the name)
    coordinator_address: str | None = None  # multi-host: "host:port", or "auto" on TPU pods
    num_processes: int | None = None  # multi-host: processes in the cluster
    process_id: int | None = None  # multi-host: this process's index
    multihost_timeout_s: float = 10.0  # multi-host: a peer silent this long (no step, no heartbeat) is hung
    # multi-host: what every process proves it knows before the step channel carries a step
    # (ferrox_jax/step_channel_auth.py); None: on loopback, one the leader generates. Never
    # in a repr, so never in a log line or an error message that prints the config.
    multihost_secret: str | None = dataclasses.field(default=None, repr=False)
    share_compiles: bool = True  # multi-host: process 0 compiles each step shape, the others load it (shared_compiles.py)
    # LoRA (models/lora.py): adapter slots on the device (0: no LoRA, the projections stay
    # plain), the largest rank a slot holds, and (name, PEFT folder) pairs loaded at start-up.
    max_loras: int = 0
    max_lora_rank: int = 16
    lora_modules: tuple[tuple[str, str], ...] = ()
    # ---- step faults (ferrox_jax/step_faults.py, docs/operations.md) ----
    step_timeout_s: float = 600.0  # a step running longer after warm-up kills the engine; 0: no watchdog
    max_step_faults: int = 3  # faulted steps in a row before the engine gives up

    @property
    def mesh_shape(self) -> tuple[int, int]:
        """(data, model) sizes; (1, 1) means a single device and no mesh."""
        return parse_mesh(self.mesh) if self.mesh else (1, self.tensor_parallel)

    def __post_init__(self) -> None:
        for name in ("block_size", "max_seqs", "prefill_chunk", "max_queue", "tensor_parallel"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"EngineConfig.{name} must be a positive int; got {value!r}")
        self._check_lora()
        if self.max_batched_tokens and self.max_batched_tokens < self.prefill_chunk:
            raise ValueError(f"EngineConfig.max_batched_tokens must be 0 (the backend's default) or >= "
                             f"prefill_chunk ({self.prefill_chunk}); got {self.max_batched_tokens}")
        if self.prefill_chunk_idle and self.prefill_chunk_idle < self.prefill_chunk:
            raise ValueError(f"EngineConfig.prefill_chunk_idle must be 0 (off) or >= prefill_chunk "
                             f"({self.prefill_chunk}); got {self.prefill_chunk_idle}")
        self._check_ceilings()
        if isinstance(self.state_snapshots, bool) or not isinstance(self.state_snapshots, int) or self.state_snapshots < 0:
            raise ValueError(f"EngineConfig.state_snapshots must be an int >= 0 (0: two per row); "
                             f"got {self.state_snapshots!r}")
        interval = self.state_snapshot_interval
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 0:
            raise ValueError(f"EngineConfig.state_snapshot_interval must be an int >= 0, in blocks (0: a prompt's "
                             f"last full block only); got {interval!r}")
        bound = self.executable_store_max_gib
        if isinstance(bound, bool) or not isinstance(bound, (int, float)) or not 0 <= bound < float("inf"):
            raise ValueError(f"EngineConfig.executable_store_max_gib must be a finite number of GiB >= 0 "
                             f"(0: unbounded); got {bound!r}")
        offload = self.kv_offload_gib
        if isinstance(offload, bool) or not isinstance(offload, (int, float)) or not 0 <= offload < float("inf"):
            raise ValueError(f"EngineConfig.kv_offload_gib must be a finite number of GiB >= 0 (0: off); "
                             f"got {offload!r}")
        for name in ("dtype", "kv_cache_dtype"):
            value = getattr(self, name)
            if value is not None and value not in DTYPE_NAMES:
                raise ValueError(f"EngineConfig.{name} must be one of {', '.join(DTYPE_NAMES)}; got {value!r}")
        if self.quantization not in QUANTIZATION_NAMES:
            raise ValueError(f"EngineConfig.quantization must be one of {', '.join(QUANTIZATION_NAMES)}; "
                             f"got {self.quantization!r}")
        if self.int8_kernel not in INT8_KERNEL_NAMES:
            raise ValueError(f"EngineConfig.int8_kernel must be one of {', '.join(INT8_KERNEL_NAMES)}; "
                             f"got {self.int8_kernel!r}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"EngineConfig.scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}; "
                             f"got {self.scheduling_policy!r}")
        if self.expert_parallel not in EXPERT_PARALLEL_MODES:
            raise ValueError(f"EngineConfig.expert_parallel must be one of {', '.join(EXPERT_PARALLEL_MODES)}; "
                             f"got {self.expert_parallel!r}")
        if self.load_format not in LOAD_FORMAT_NAMES:
            raise ValueError(f"EngineConfig.load_format must be one of {', '.join(LOAD_FORMAT_NAMES)}; "
                             f"got {self.load_format!r}")
        seed = self.dummy_weights_seed
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"EngineConfig.dummy_weights_seed must be an int >= 0; got {seed!r}")
        self._check_mesh()
        if not self.step_timeout_s >= 0:
            raise ValueError(f"EngineConfig.step_timeout_s must be >= 0 (0: no watchdog); got {self.step_timeout_s}")
        if isinstance(self.max_step_faults, bool) or not isinstance(self.max_step_faults, int) or self.max_step_faults < 1:
            raise ValueError(f"EngineConfig.max_step_faults must be a positive int; got {self.max_step_faults!r}")
        if self.coordinator_address not in (None, "auto") and (self.num_processes is None or self.process_id is None):
            raise ValueError("EngineConfig.coordinator_address needs num_processes and process_id "
                             "(or coordinator_address='auto' on a TPU pod)")
        if not self.multihost_timeout_s > 0:
            raise ValueError(f"EngineConfig.multihost_timeout_s must be > 0; got {self.multihost_timeout_s!r}")
        self._check_multihost_secret()
        workers = self.grammar_workers
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ValueError(f"EngineConfig.grammar_workers must be a positive int; got {workers!r}")
        if not (self.grammar_timeout_s > 0 and math.isfinite(self.grammar_timeout_s)):
            raise ValueError(f"EngineConfig.grammar_timeout_s must be a finite number of seconds > 0; "
                             f"got {self.grammar_timeout_s!r}")

    def _check_multihost_secret(self) -> None:
        """A group whose coordinator is not on loopback has no private place to share a
        generated secret: it must be given one. The messages never hold the secret."""
        secret = self.multihost_secret
        if secret is not None and len(secret) < MIN_SECRET_CHARS:
            raise ValueError(f"EngineConfig.multihost_secret must be at least {MIN_SECRET_CHARS} characters "
                             f"(e.g. `openssl rand -hex 32`); got {len(secret)}")
        address = self.coordinator_address
        if (not secret and address not in (None, "auto") and (self.num_processes or 0) > 1
                and not is_loopback_host(coordinator_host(address))):
            raise ValueError(f"EngineConfig.multihost_secret is required: the coordinator {coordinator_host(address)} "
                             "is not on loopback, so the step channel would take any process that connects; set "
                             "FERROX_MULTIHOST_SECRET (or --multihost-secret) to the same value on every process")

    def _check_ceilings(self) -> None:
        """What the index types can address (`ferrox_jax/memory_bounds.py`); whether the
        device can hold it is checked when the engine is built, against its memory."""
        if self.block_size > INT32_MAX // TABLE_ROUND_BLOCKS:
            raise ValueError(f"EngineConfig.block_size must be at most {INT32_MAX // TABLE_ROUND_BLOCKS} (a block "
                             f"table's positions are int32); got {self.block_size}")
        blocks = self.kv_blocks
        # kv_blocks counts the blocks requests can use; the engine adds the null block, so the
        # cache holds kv_blocks + 1 and the largest id, kv_blocks, must still be an int32.
        if blocks is not None and (isinstance(blocks, bool) or not isinstance(blocks, int) or blocks < 1):
            raise ValueError(f"EngineConfig.kv_blocks must be an int >= 1 (the usable blocks; the null block is "
                             f"added); got {blocks!r}")
        if blocks is not None and blocks > MAX_USABLE_KV_BLOCKS:
            raise ValueError(f"EngineConfig.kv_blocks must be at most {MAX_USABLE_KV_BLOCKS} (block ids are int32 "
                             f"and the null block is added); got {blocks}")
        gib = self.kv_memory_gib
        if gib is not None and (isinstance(gib, bool) or not isinstance(gib, (int, float))
                                or not (gib > 0 and math.isfinite(gib))):
            raise ValueError(f"EngineConfig.kv_memory_gib must be a finite number > 0 or None (the rows' need); "
                             f"got {gib!r}")
        context = self.max_context
        if context is not None and (isinstance(context, bool) or not isinstance(context, int) or context < 2):
            raise ValueError(f"EngineConfig.max_context must be an int >= 2; got {context!r}")
        if context is not None and context > max_positions(self.block_size):
            raise ValueError(f"EngineConfig.max_context must be at most {max_positions(self.block_size)} with "
                             f"block_size {self.block_size} (positions are int32); got {context}")

    def _check_lora(self) -> None:
        if isinstance(self.max_loras, bool) or not isinstance(self.max_loras, int) or self.max_loras < 0:
            raise ValueError(f"EngineConfig.max_loras must be an int >= 0; got {self.max_loras!r}")
        if isinstance(self.max_lora_rank, bool) or not isinstance(self.max_lora_rank, int) or self.max_lora_rank < 1:
            raise ValueError(f"EngineConfig.max_lora_rank must be a positive int; got {self.max_lora_rank!r}")
        if (self.max_loras + 1) * self.max_lora_rank > INT32_MAX:  # models/lora.py numbers the columns in int32
            raise ValueError(f"EngineConfig.max_loras + 1 times max_lora_rank must be at most {INT32_MAX} (the "
                             f"slots' columns are int32); got ({self.max_loras} + 1) x {self.max_lora_rank}")
        if len(self.lora_modules) > self.max_loras:
            raise ValueError(f"EngineConfig.lora_modules names {len(self.lora_modules)} adapters but max_loras is "
                             f"{self.max_loras}; raise --max-loras")
        names = [name for name, _ in self.lora_modules]
        if len(set(names)) != len(names):
            raise ValueError(f"EngineConfig.lora_modules repeats a name: {names}")

    def _check_mesh(self) -> None:
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


# prompt lookup; a smaller model's autoregressive drafts; the checkpoint's own MTP layer (ferrox_jax/mtp.py)
SPECULATIVE_METHODS = ("ngram", "draft", "mtp")


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """`--speculative ngram|draft|mtp` and its settings (vLLM's `--speculative-config` names in brackets)."""

    method: str = "ngram"  # [method: "ngram", "draft_model" for "draft", "deepseek_mtp" or "qwen3_next_mtp" for "mtp"]
    num_speculative_tokens: int = 3  # k: draft tokens per row and step [num_speculative_tokens]
    ngram_min: int = 2  # shortest suffix looked up [prompt_lookup_min]
    ngram_max: int = 4  # longest suffix looked up, tried first [prompt_lookup_max]
    max_rows: int = 4  # a step with more decoding rows does not speculate (measured: docs/benchmarks.md)
    draft_model: str | None = None  # method "draft": the drafting checkpoint (same tokenizer) [model]
    # Adaptive draft length: a row whose every draft was accepted may verify twice as many
    # tokens (k -> 2k + 1 drafts) the next step, up to this many drafts (within the step's
    # rows); a rejected draft sends it back to num_speculative_tokens. 0: always k.
    max_speculative_tokens: int = 0

    def __post_init__(self) -> None:
        if self.method in ("draft_model", "deepseek_mtp", "qwen3_next_mtp"):  # vLLM's names for the methods
            object.__setattr__(self, "method", "draft" if self.method == "draft_model" else "mtp")
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"SpeculativeConfig.method must be one of {', '.join(SPECULATIVE_METHODS)}; got {self.method!r}")
        for name in ("num_speculative_tokens", "ngram_min", "ngram_max", "max_rows"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"SpeculativeConfig.{name} must be a positive int; got {value!r}")
        m = self.max_speculative_tokens
        if isinstance(m, bool) or not isinstance(m, int) or (m and m < self.num_speculative_tokens):
            raise ValueError("SpeculativeConfig.max_speculative_tokens must be 0 (fixed length) or at least "
                             f"num_speculative_tokens ({self.num_speculative_tokens}); got {m!r}")
        if self.ngram_min > self.ngram_max:
            raise ValueError(f"SpeculativeConfig.ngram_min ({self.ngram_min}) must be <= ngram_max ({self.ngram_max})")
        if (self.method == "draft") != bool(self.draft_model):
            raise ValueError("--speculative draft needs --draft-model PATH (and only it takes one); got "
                             f"method {self.method!r}, draft_model {self.draft_model!r}")

    @property
    def most_drafts(self) -> int:
        """The most drafts a row verifies in one step."""
        return max(self.num_speculative_tokens, self.max_speculative_tokens)

    @property
    def verify_tokens(self) -> int:
        """Tokens a speculating row computes in one step: its last token and k drafts."""
        return 1 + self.num_speculative_tokens

    def step_rows(self, max_rows: int) -> int:
        """One-token rows a step's forward must hold when `max_rows` rows run at once: each
        speculating row's tokens are rows of their own (`ferrox_jax/runner.py`), so a
        step of `self.max_rows` speculating rows holds 1 + k rows each."""
        return max(max_rows, min(max_rows, self.max_rows) * self.verify_tokens)

    @classmethod
    def from_json(cls, text: str, **defaults) -> "SpeculativeConfig":
        """vLLM's form: '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}'
        (ours, ngram_min / ngram_max / max_rows, are accepted too). `defaults` fill the rest."""
        try:
            given = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"speculative config is not JSON: {e}") from None
        if not isinstance(given, dict):
            raise ValueError(f"speculative config must be a JSON object; got {text!r}")
        aliases = {"prompt_lookup_min": "ngram_min", "prompt_lookup_max": "ngram_max", "model": "draft_model"}
        known = {f.name for f in dataclasses.fields(cls)}
        values = dict(defaults)
        for key, value in given.items():
            name = aliases.get(key, key)
            if name not in known:
                raise ValueError(f"speculative config: unknown key {key!r} (known: {', '.join(sorted(known | set(aliases)))})")
            values[name] = value
        return cls(**values)


@dataclasses.dataclass(frozen=True)
class SchedulerLimits:
    """The limits the batcher and scheduler run under, resolved against the runner."""

    block_size: int  # token positions per block
    num_blocks: int  # usable blocks, ids 1..num_blocks (the null block 0 not counted)
    max_rows: int  # rows in flight (the contract's max_seqs): decoding rows plus the n rows of each prefilling job
    max_chunk_tokens: int  # prompt tokens per chunk
    max_idle_chunk_tokens: int | None = None  # per chunk when no row decodes; None: max_chunk_tokens
    max_batched_tokens: int | None = None  # prompt tokens per step, over all its chunks; None: max_chunk_tokens
    max_context: int | None = None  # prompt + max_tokens ceiling; None: the budget decides
    max_queue: int = 512  # waiting jobs; one more is refused
    kv_bytes_per_block: int = 0  # K+V bytes of one block, for refusal messages; 0: unknown
    prefix_caching: bool = True  # keep and share full prompt blocks across requests
    prefix_cache_salt: str = ""  # what else the K/V depend on (model, dtype), in every block name
    kv_offload_blocks: int = 0  # host-tier slots under the prefix cache (ferrox_jax/kv_offload.py); 0: off
    kv_offload_snapshots: int = 0  # its recurrent-state snapshot slots (ferrox_jax/kv_offload.py, "Snapshots")
    kv_offload_snapshot_bytes: int = 0  # the bytes of one (for the start-up log and /admin/stats)
    speculative: SpeculativeConfig | None = None  # prompt-lookup drafts (ferrox_jax/speculative.py); None: off
    scheduling_policy: str = "fcfs"  # admission order, and preemption under "priority" (ferrox_jax/priority.py)
    kv_window: int | None = None  # the sliding KV group's window in tokens (ferrox_jax/kv_groups.py); None: no such group
    kv_window_slots: int = 0  # its own pool's slots (the sliding arrays' size); 0: they hold every block, as before
    # recurrent state slots, the null slot included (ferrox_jax/state_pool.py); 0: the model keeps none
    state_slots: int = 0
    state_pool_bytes: int = 0  # the pool's device bytes (for /admin/stats)
    state_snapshots: int | None = None  # its snapshot slots after the running ones; None: two per row
    state_snapshot_interval: int = DEFAULT_INTERVAL_BLOCKS  # a prompt's snapshots every this many blocks; 0: off

    def __post_init__(self) -> None:
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"SchedulerLimits.scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}; "
                             f"got {self.scheduling_policy!r}")
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or field.name in (
                    "kv_bytes_per_block", "kv_offload_blocks", "kv_offload_snapshots", "kv_offload_snapshot_bytes",
                    "kv_window_slots", "state_slots", "state_pool_bytes",
                    "state_snapshots", "state_snapshot_interval"):
                continue
            if value <= 0:
                raise ValueError(f"SchedulerLimits.{field.name} must be > 0; got {value}")
        if self.idle_chunk_tokens < self.max_chunk_tokens:
            raise ValueError(f"SchedulerLimits.max_idle_chunk_tokens ({self.max_idle_chunk_tokens}) must be "
                             f">= max_chunk_tokens ({self.max_chunk_tokens})")
        if self.batched_tokens < self.max_chunk_tokens:
            raise ValueError(f"SchedulerLimits.max_batched_tokens ({self.max_batched_tokens}) must be "
                             f">= max_chunk_tokens ({self.max_chunk_tokens})")

    @property
    def idle_chunk_tokens(self) -> int:
        """Prompt tokens a chunk may take when no row is decoding (nobody's tokens wait on it)."""
        return self.max_idle_chunk_tokens or self.max_chunk_tokens

    @property
    def batched_tokens(self) -> int:
        """Prompt tokens one step computes, over all its chunks."""
        return self.max_batched_tokens or self.max_chunk_tokens

    @property
    def max_chunks(self) -> int:
        """Chunks one step holds: the budget over the chunk size, rounded up (1: the
        contract's one chunk per tick)."""
        return -(-self.batched_tokens // self.max_chunk_tokens)
