"""Memory bounds: what an engine's settings make it allocate, checked before anything is.

Every setting that becomes an array shape or a byte count is bounded twice:
- By the index types that address it (hard ceilings; the static ones are checked in
  `EngineConfig.__post_init__`, the ones that need the checkpoint here): block ids,
  positions and a step's token indices are int32 (block tables, `kv_slots`, the host
  batch), so a cache holds at most `MAX_KV_BLOCKS` blocks, a block table at most
  `max_positions(block_size)` positions, a step at most `INT32_MAX` tokens, and the LoRA
  slots at most `INT32_MAX` columns (`models/lora.py` numbers them in int32).
- By the memory the device can give (`Room`): on a CPU the host's available memory
  (/proc/meminfo MemAvailable, within the process's cgroup limit), on a GPU or TPU the
  device's free memory as jax reports it (`memory_stats()`: bytes_limit - bytes_in_use).
  What the settings ask for (`Demand`, per device) is the KV cache (the engine's own sizing),
  the LoRA slots, an upper estimate of the largest step's live arrays (logits and the sampler's
  copies, activations, block tables), and the weights where they are not placed yet.

A setting that does not fit is refused with `MemoryBoundError` (a ValueError) naming the field,
what it needs, what there is and the largest value that fits ("kv_blocks 1073741824 needs
8,192.0 GiB: KV cache ...; host memory has 21.9 GiB free; ask for at most kv_blocks 2867000");
`ferrox serve` names the flag and variable instead (`api/settings.py`), and
`POST /v1/cache/rebuild` answers it as a 400.

Where the checks run: `engine_builder.build_parts` checks once before it reads the
weights (nothing is placed yet: a value that could never fit is refused at once) and once
the weights are placed, right before the LoRA slots and the KV cache are allocated (the free
memory then counts the weights); `check_rebuild` before a cache rebuild puts the old engine to
sleep (counting the old cache it frees and the new engine's copy of the weights);
`check_host_room` before a level-2 sleep moves the weights to host memory. Where the backend
reports no memory, only the ceilings apply.

`Footprint.step` is also where the largest step's shape comes from (the token budget per backend,
the rows speculation adds), so the engine's limits and the bytes checked here cannot drift apart.
No jax at import (`ferrox_jax/config.py` uses the ceilings); the device query imports it.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

from ferrox_jax.state_pool import settings_pool_bytes

GIB = 1 << 30
MIB = 1 << 20
INT32_MAX = 2**31 - 1
MAX_KV_BLOCKS = INT32_MAX + 1  # block ids are int32: ids 0 .. INT32_MAX
MAX_USABLE_KV_BLOCKS = MAX_KV_BLOCKS - 1  # the most `kv_blocks` can ask for: block 0 is the null block
# models/attention.py ATTENTION_CHUNK_BLOCKS: block tables are a multiple of this wide (that
# module imports jax; tests/engine/test_memory_bounds.py keeps the two equal).
TABLE_ROUND_BLOCKS = 8
# Prompt chunks per step when EngineConfig.max_batched_tokens is 0, by backend, measured on
# CPU (docs/benchmarks.md, "One step for every row"): there one chunk already keeps the
# cores busy, so more chunks per step only lengthen every decoding row's inter-token gap.
DEFAULT_BATCHED_CHUNKS = {"cpu": 1}
DEFAULT_ACCELERATOR_BATCHED_CHUNKS = 4  # not measured on a device yet (tools/device/device_check.py measures it)
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}
UNLIMITED = 1 << 60  # a cgroup limit at or above this is "no limit" (the kernel writes ~2**63)
# A budget in blocks is computed in floats; above this (far past every ceiling) it is clamped.
_BLOCKS_CLAMP = 1 << 62
# The KV budget when neither kv_blocks nor kv_memory_gib is given is what the rows need
# (`needed_kv_blocks`), at most this: a model with a 128k trained context and 32 rows would
# otherwise ask for hundreds of GiB. An explicit budget is used as given.
DEFAULT_KV_MEMORY_GIB = 2.0


class MemoryBoundError(ValueError):
    """A setting the device cannot hold or its index types cannot address. The message
    starts with `field` (the EngineConfig field; `ferrox serve` puts the flag there);
    `code` says which: "insufficient_memory" or "invalid_value" (past an index type)."""

    def __init__(self, field: str, message: str, code: str = "insufficient_memory") -> None:
        super().__init__(message)
        self.field = field
        self.code = code


def max_positions(block_size: int) -> int:
    """The largest context whose block table keeps every position an int32: the table is
    rounded up to TABLE_ROUND_BLOCKS blocks, and its last position must still fit."""
    return INT32_MAX // block_size // TABLE_ROUND_BLOCKS * TABLE_ROUND_BLOCKS * block_size


def table_width(max_context: int, block_size: int) -> int:
    """Blocks per row of every block table (`runner.block_table_width`, without jax)."""
    return -(-(-(-max_context // block_size)) // TABLE_ROUND_BLOCKS) * TABLE_ROUND_BLOCKS


def kv_blocks_for(settings: Any, bytes_per_block: int, trained_context: int, fixed_bytes: int = 0) -> int:
    """The cache's blocks, the null block included: `kv_blocks` + 1 (`kv_blocks` counts the blocks
    requests can use, the contract's `kv_blocks_total`; the null block is ours to add), else the
    budget `kv_memory_gib` over the bytes of one block (at least 2), else (no budget given) what
    the rows need (`needed_kv_blocks`) within `DEFAULT_KV_MEMORY_GIB`; `Footprint.check` bounds
    it by the device. `fixed_bytes`: what the budget holds besides the blocks (the sliding layers'
    pool, `ferrox_jax/kv_groups.py`), taken off it first. Blocks of 0 bytes (every layer slides:
    the pool is the whole cache, block ids are logical): what the rows need."""
    if settings.kv_blocks:
        return int(settings.kv_blocks) + 1
    if settings.kv_memory_gib is None or not bytes_per_block:
        ceiling = (DEFAULT_KV_MEMORY_GIB * GIB - fixed_bytes) // bytes_per_block if bytes_per_block else _BLOCKS_CLAMP
        return max(2, min(needed_kv_blocks(settings, trained_context), int(ceiling)))
    blocks = (settings.kv_memory_gib * GIB - fixed_bytes) // bytes_per_block
    return max(2, int(min(blocks, _BLOCKS_CLAMP)))


def needed_kv_blocks(settings: Any, trained_context: int) -> int:
    """Blocks for `max_seqs` rows each holding a whole context (`max_context`, else the
    trained context), the null block included: with them no admitted row ever waits for a
    block, and nothing more is held (llama-server's `-c` is the same total: its slots
    share `-c` tokens)."""
    context = min(settings.max_context or trained_context, _BLOCKS_CLAMP)
    return settings.max_seqs * -(-context // settings.block_size) + 1


def context_for(settings: Any, trained_context: int, num_blocks: int) -> int:
    """The context ceiling: `max_context` if given, else the trained context the cache holds."""
    return settings.max_context or min(trained_context, (num_blocks - 1) * settings.block_size)


def lora_bytes(model: Any, max_loras: int, max_rank: int, itemsize: int) -> int:
    """The LoRA slots' A and B matrices (`models/lora.py`: [in, S*r] and [S*r, out] per
    targeted projection, S = max_loras + 1): in + out of every projection the model's config
    counts (`ModelConfig.lora_widths`), an upper bound where a family's MLP is not a target (MoE)."""
    return model.lora_widths() * (max_loras + 1) * max_rank * itemsize if max_loras else 0


@dataclasses.dataclass(frozen=True)
class StepSize:
    """The largest step an engine of these settings compiles (`ferrox_jax/buckets.py`)."""

    rows: int  # one-token rows (a speculating row counts 1 + k)
    chunk_tokens: int  # tokens of one prompt chunk
    idle_chunk_tokens: int  # ... when no row decodes (the largest chunk bucket)
    batched_tokens: int  # prompt tokens one step computes, over all its chunks
    table_width: int  # blocks per row of the block table
    block_size: int

    @property
    def max_chunks(self) -> int:
        return -(-self.batched_tokens // self.chunk_tokens)

    @property
    def num_rows(self) -> int:
        return self.rows + self.max_chunks

    @property
    def num_tokens(self) -> int:
        return self.rows + self.max_chunks * self.idle_chunk_tokens


def step_bytes(model: Any, step: StepSize, lora_columns: int) -> int:
    """An upper estimate of the largest step's live arrays, all counted as float32: the
    logits with the sampler's sorted copy and its indices ([rows, vocab] each), each
    token's activations (the residual and its norms, q / k / v, the attention scores of
    one pass over TABLE_ROUND_BLOCKS blocks, the MLP's gate / up / product, the LoRA
    slots' x A), and the int32 block tables on the host and the device. XLA reuses
    buffers, so the real peak is lower; what the estimate is for is refusing row and
    token settings whose step could never fit, before anything compiles."""
    per_token = (4 * model.hidden_size + (model.num_heads + 2 * model.num_kv_heads) * model.head_dim
                 + 3 * model.intermediate_size + lora_columns
                 + model.num_heads * TABLE_ROUND_BLOCKS * step.block_size)
    return 4 * (3 * step.num_rows * model.vocab_size + step.num_tokens * per_token
                + 2 * step.num_rows * step.table_width)


def batched_tokens(settings: Any, chunk: int, backend: str) -> int:
    """A step's prompt-token budget: the configured one (at least a chunk), else the
    backend's default number of chunks."""
    if settings.max_batched_tokens:
        return max(settings.max_batched_tokens, chunk)
    return chunk * DEFAULT_BATCHED_CHUNKS.get(backend, DEFAULT_ACCELERATOR_BATCHED_CHUNKS)


@dataclasses.dataclass(frozen=True)
class Demand:
    """What one device holds for an engine, in bytes."""

    kv_bytes: int  # this device's part of the KV cache
    lora_bytes: int
    step_bytes: int
    num_blocks: int  # the whole cache's blocks
    max_context: int
    step: StepSize

    state_bytes: int = 0  # this device's part of the recurrent state pool (split as the KV heads)

    @property
    def total(self) -> int:
        return self.kv_bytes + self.lora_bytes + self.step_bytes + self.state_bytes


@dataclasses.dataclass(frozen=True)
class Room:
    """What the devices an engine uses can still allocate."""

    free_bytes: int | None  # None: the backend reports nothing (only the ceilings apply)
    where: str  # "host memory", "device cuda:0"
    shared_by: int = 1  # devices drawing on free_bytes (a CPU's devices share the host's memory)

    @property
    def per_device(self) -> int | None:
        return None if self.free_bytes is None else self.free_bytes // self.shared_by


class _Settings:
    """An EngineConfig with some fields replaced, unvalidated: a rebuild's body and the
    search for the largest value that fits read it where a config would be invalid."""

    def __init__(self, config: Any, overrides: dict[str, Any]) -> None:
        self._config, self._overrides = config, overrides

    def __getattr__(self, name: str) -> Any:
        return self._overrides[name] if name in self._overrides else getattr(self._config, name)


@dataclasses.dataclass(frozen=True)
class Footprint:
    """The fixed facts that turn an engine's settings into bytes: the checkpoint's shapes,
    the bytes one KV block takes, the backend and how the cache is split over devices."""

    model: Any  # models.config.ModelConfig of the served (target) model
    bytes_per_block: int  # K + V of one block over every layer (a draft model's included)
    compute_itemsize: int  # bytes of one weight or activation element in the compute dtype
    backend: str  # jax.default_backend(): it picks the step's default token budget
    kv_shards: int = 1  # devices the cache's KV heads are split over
    window: Any = None  # the sliding layers' own pool (ferrox_jax/kv_groups.py:WindowPlan); None: one pool

    @classmethod
    def of_engine(cls, engine: Any) -> "Footprint":
        """The footprint of a loaded engine's checkpoint (for a rebuild of its cache)."""
        import jax

        return cls(engine.model_config, engine.sizing.bytes_per_block, ITEMSIZE.get(engine.dtype_name, 4),
                   jax.default_backend(), kv_shards(engine.config, engine.model_config), engine.sizing.window)

    def step(self, settings: Any, max_context: int) -> StepSize:
        """The largest step's shape: chunks capped at the context, the idle chunk at least
        the chunk, the token budget (the backend's default when 0), and one decode row per
        token a speculating row verifies."""
        chunk = min(settings.prefill_chunk, max_context)
        idle = min(max(settings.prefill_chunk_idle, chunk), max_context)
        batched = batched_tokens(settings, chunk, self.backend)
        spec = settings.speculative
        rows = spec.step_rows(settings.max_seqs) if spec is not None else settings.max_seqs
        return StepSize(rows, chunk, idle, batched, table_width(max_context, settings.block_size),
                        settings.block_size)

    def window_bytes(self, settings: Any) -> int:
        """The sliding layers' own pool under `settings` (0 without one)."""
        return (self.window.slots(settings.max_seqs) + 1) * self.window.slot_bytes if self.window else 0

    def demand(self, settings: Any) -> Demand:
        window_bytes = self.window_bytes(settings)
        num_blocks = kv_blocks_for(settings, self.bytes_per_block, self.model.max_position_embeddings, window_bytes)
        max_context = context_for(settings, self.model.max_position_embeddings, num_blocks)
        step = self.step(settings, max_context)
        lora_columns = (settings.max_loras + 1) * settings.max_lora_rank if settings.max_loras else 0
        return Demand(kv_bytes=-(-(num_blocks * self.bytes_per_block + window_bytes) // self.kv_shards),
                      lora_bytes=lora_bytes(self.model, settings.max_loras, settings.max_lora_rank,
                                            self.compute_itemsize),
                      step_bytes=step_bytes(self.model, step, lora_columns), num_blocks=num_blocks,
                      max_context=max_context, step=step,
                      state_bytes=-(-settings_pool_bytes(self.model.recurrent_specs(), step.rows, settings)
                                    // self.kv_shards))

    def check(self, config: Any, room: Room, *, overrides: dict[str, Any] | None = None, weights_bytes: int = 0,
              freed_bytes: int = 0, blame: str | None = None, note: str = "") -> Demand:
        """Refuse `config` (with `overrides`) if this device cannot hold it or its index
        types cannot address it.

        Args:
          weights_bytes: weights still to be placed on each device besides what `room` counts.
          freed_bytes: bytes freed on each device before the allocation (an old cache).
          blame: the field to name (a rebuild's); None: the setting behind the largest part.
          note: said after the free memory ("once the current cache is freed").
        Raises:
          MemoryBoundError naming the field, what it needs, what there is, what fits.
        """
        settings = _Settings(config, overrides or {})
        demand = self.demand(settings)
        have = None if room.per_device is None else room.per_device + freed_bytes
        if have is not None and demand.total + weights_bytes > have:
            field = blame or self._blame(settings, demand)
            parts = [("KV cache", demand.kv_bytes, f" ({self.bytes_per_block} bytes per block)"),
                     ("LoRA slots", demand.lora_bytes, ""), ("largest step", demand.step_bytes, ""),
                     ("recurrent state pool", demand.state_bytes, ""),
                     ("the weights", weights_bytes, "")]
            said = ", ".join(f"{name} {_size(n)}{why}" for name, n, why in parts if n)
            shared = f" for {room.shared_by} devices" if room.shared_by > 1 else ""
            raise MemoryBoundError(field, f"{field} {_value(getattr(settings, field))} needs "
                                          f"{_size(demand.total + weights_bytes)}{shared and ' per device'}: "
                                          f"{said}; {room.where} has {_size(have * room.shared_by)} "
                                          f"free{shared}{note}; "
                                          + self._advice(settings, field, have - weights_bytes))
        self._check_ceilings(settings, demand)
        return demand

    # -- what to say -----------------------------------------------------------------------

    def _blame(self, settings: Any, demand: Demand) -> str:
        """The setting behind the largest part of the demand."""
        largest = max((demand.kv_bytes, "kv"), (demand.lora_bytes, "lora"), (demand.step_bytes, "step"))[1]
        if largest == "kv":  # blocks of no bytes (every layer slides): the pool, which max_seqs sizes
            return "max_seqs" if not self.bytes_per_block else "kv_blocks" if settings.kv_blocks else "kv_memory_gib"
        if largest == "lora":
            return "max_loras"
        step = demand.step
        prompt_tokens = step.max_chunks * step.idle_chunk_tokens
        if settings.max_context and 2 * step.table_width > self.model.vocab_size + prompt_tokens:
            return "max_context"  # the block tables outweigh the logits and the prompt chunks
        if prompt_tokens <= step.rows:
            return "max_seqs"
        if step.max_chunks > 1:
            return "max_batched_tokens"
        return "prefill_chunk_idle" if settings.prefill_chunk_idle > settings.prefill_chunk else "prefill_chunk"

    def _advice(self, settings: Any, field: str, room_bytes: int) -> str:
        """"ask for at most ..." the largest value of `field` that fits in `room_bytes`."""
        if field == "kv_memory_gib":
            others = self.demand(_Settings(settings, {"kv_blocks": 1}))
            budget = (room_bytes - others.lora_bytes - others.step_bytes) * self.kv_shards
            budget = min(budget, MAX_KV_BLOCKS * self.bytes_per_block)
            if budget < 2 * self.bytes_per_block:
                return f"even 2 blocks do not fit beside the rest ({_size(others.lora_bytes + others.step_bytes)})"
            return f"ask for at most kv_memory_gib {math.floor(budget / GIB * 100) / 100:g}"
        low = {"kv_blocks": 1, "max_loras": max(1, len(settings.lora_modules)), "max_context": 2,
               "max_batched_tokens": settings.prefill_chunk, "prefill_chunk_idle": settings.prefill_chunk}.get(field, 1)
        high = int(getattr(settings, field))
        if field == "kv_blocks":
            high = min(high, MAX_USABLE_KV_BLOCKS)

        def fits(value: int) -> bool:
            return self.demand(_Settings(settings, {field: value})).total <= room_bytes

        if high < low or not fits(low):
            rest = self.demand(_Settings(settings, {field: low})).total
            return f"even {field} {low} needs {_size(rest)}: lower the other settings"
        while low < high:  # the demand grows with every one of these settings
            mid = (low + high + 1) // 2
            low, high = (mid, high) if fits(mid) else (low, mid - 1)
        return f"ask for at most {field} {low}"

    def _check_ceilings(self, settings: Any, demand: Demand) -> None:
        """The index types' limits, for what only the checkpoint and backend decide."""
        if demand.num_blocks > MAX_KV_BLOCKS:
            field = "kv_blocks" if settings.kv_blocks else "kv_memory_gib"
            most = (f"kv_blocks {MAX_USABLE_KV_BLOCKS}" if settings.kv_blocks
                    else f"kv_memory_gib {math.floor(MAX_KV_BLOCKS * self.bytes_per_block / GIB * 100) / 100:g}")
            raise MemoryBoundError(field, f"{field} {_value(getattr(settings, field))} makes {demand.num_blocks} "
                                          f"blocks, more than the {MAX_KV_BLOCKS} int32 block ids address; "
                                          f"ask for at most {most}", "invalid_value")
        if demand.max_context > max_positions(settings.block_size):
            raise MemoryBoundError("max_context", f"max_context {demand.max_context} is more positions than int32 "
                                                  f"holds with block_size {settings.block_size}; ask for at most "
                                                  f"max_context {max_positions(settings.block_size)}",
                                   "invalid_value")
        if demand.step.num_tokens > INT32_MAX:
            raise MemoryBoundError("max_seqs", f"max_seqs {settings.max_seqs} with the prompt-token budget makes "
                                               f"a step of {demand.step.num_tokens} tokens, more than int32 "
                                               "indexes; lower max_seqs or max_batched_tokens", "invalid_value")


def kv_shards(config: Any, model: Any = None) -> int:
    """Devices the KV heads are split over (1 on one device or with replicated attention, or
    when `model`'s cache heads do not split: a latent cache is one head, replicated)."""
    model_axis = config.mesh_shape[1]
    if model is not None and model.kv_cache_dims()[0] % model_axis:
        return 1
    return model_axis if model_axis > 1 and not config.replicate_attention else 1


def engine_devices(config: Any) -> list:
    """This process's devices an engine of `config` places its arrays on (`sharding.make_mesh`
    takes the first ones)."""
    import jax

    devices = jax.devices()[:config.mesh_shape[1]]
    return [d for d in devices if d.process_index == jax.process_index()] or jax.local_devices()[:1]


def device_room(devices: list) -> Room:
    """What `devices` can still allocate: the host's available memory for CPU devices
    (they share it), else the device with the least free memory."""
    if devices[0].platform == "cpu":
        return Room(host_available_bytes(), "host memory", len(devices))
    least: tuple[int, Any] | None = None
    for device in devices:
        stats = device.memory_stats() or {}
        if "bytes_limit" not in stats:
            return Room(None, f"device {device}")
        free = int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
        if least is None or free < least[0]:
            least = (free, device)
    assert least is not None
    return Room(least[0], f"device {least[1]}")


def host_available_bytes() -> int | None:
    """Memory the host can still give this process: /proc/meminfo's MemAvailable, within
    the process's cgroup limit (a container's), or None where neither is readable."""
    found = [n for n in (_meminfo("MemAvailable"), _cgroup_bytes(available=True)) if n is not None]
    if not found and hasattr(os, "sysconf"):
        try:
            found.append(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
        except (OSError, ValueError):
            pass
    return min(found) if found else None


def host_total_bytes() -> int | None:
    """The host's memory (/proc/meminfo's MemTotal) within the process's cgroup limit, or
    None where neither is readable: what a byte cap on retained data can never exceed."""
    found = [n for n in (_meminfo("MemTotal"), _cgroup_bytes(available=False)) if n is not None]
    return min(found) if found else None


def _meminfo(key: str) -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_bytes(available: bool) -> int | None:
    """The cgroup's limit, or (`available`) the limit less the usage, reclaimable page
    cache not counted as used (cgroup v2, then v1); None without a limit."""
    for limit_path, usage_path, stat_path, inactive in (
            ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current", "/sys/fs/cgroup/memory.stat",
             "inactive_file"),
            ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes",
             "/sys/fs/cgroup/memory/memory.stat", "total_inactive_file")):
        try:
            with open(limit_path, encoding="ascii") as f:
                text = f.read().strip()
            if text == "max" or int(text) >= UNLIMITED:
                return None
            if not available:
                return int(text)
            with open(usage_path, encoding="ascii") as f:
                usage = int(f.read())
        except (OSError, ValueError):
            continue
        reclaimable = 0
        try:
            with open(stat_path, encoding="ascii") as f:
                for line in f:
                    name, _, value = line.partition(" ")
                    if name == inactive:
                        reclaimable = int(value)
        except (OSError, ValueError):
            pass
        return max(0, int(text) - usage + reclaimable)
    return None


def check_rebuild(engine: Any, overrides: dict[str, Any]) -> Demand:
    """Before a cache rebuild of `engine` with `overrides` (kv_blocks or kv_memory_gib):
    refuse what the new engine could not hold beside the old one once the old cache is
    freed (the rebuild reads the weights again while the old engine sleeps at level 1).

    Raises:
      MemoryBoundError naming the given field."""
    footprint = Footprint.of_engine(engine)
    field = next(name for name, value in overrides.items() if value is not None)
    return footprint.check(engine.config, device_room(engine_devices(engine.config)), overrides=overrides,
                           # a second copy of the weights, split as the mesh splits them
                           weights_bytes=engine.weights_bytes // engine.config.mesh_shape[1],
                           freed_bytes=engine.model_card.kv_bytes // footprint.kv_shards, blame=field,
                           note=" once the current cache is freed")


def check_host_room(weights_bytes: int, what: str) -> None:
    """Before `what` copies `weights_bytes` of weights into host memory (a level-2 sleep).

    Raises:
      MemoryBoundError (field "level") when the host has less available."""
    have = host_available_bytes()
    if have is not None and weights_bytes > have:
        raise MemoryBoundError("level", f"level 2 ({what}) needs {_size(weights_bytes)} of host memory for the "
                                        f"weights; the host has {_size(have)} available; sleep at level 1 "
                                        "(frees the KV cache only) or free host memory first")


def _size(num_bytes: int) -> str:
    return f"{num_bytes / GIB:,.1f} GiB" if num_bytes >= GIB // 10 else f"{num_bytes / MIB:,.1f} MiB"


def _value(value: Any) -> str:
    if value is None:  # kv_memory_gib by default (`kv_blocks_for`)
        return f"(default: the rows' need, at most {DEFAULT_KV_MEMORY_GIB:g})"
    return f"{value:g}" if isinstance(value, float) else str(value)
