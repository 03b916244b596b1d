"""The runner's declared surface: the verbs the owner thread drives the device side with. No jax here.

A runner holds device state (weights and KV cache) and is reached only through these verbs,
in the tick's order (`ferrox_jax/batcher.py`):

    pending = runner.forward(batch)            pad, the batch's block copies, dispatch the
                                               forward; the device runs, the host goes on
    arrays  = runner.sample(pending, bitmask)  sample with the grammar bitmask filled
                                               meanwhile (None: no row constrained), one fetch

and between ticks, on the same owner thread: `warmup` / `compile_keys` (every executable,
ahead of time), `copy_blocks` and `offload_blocks` (what `forward` runs first: the host
KV tier's saves and restores, then the block copies), `encode_images` (a model taking
images: the vision encoder over a step's new images, before its batch is built), and the state verbs
`swap_state` (LoRA slot writes; a benchmark's cache fill), `release` / `restore` (sleep and wake: the KV cache, and at
level 2 the weights, given back to the device and taken again in the same shapes).

`ferrox_jax/runner.py:ModelRunner` is the device's runner, `ferrox_jax/multihost_runner.py`'s
`BroadcastRunner` and `DraftSender` wrap one for a multi-process group (`RunnerWrapper`
below answers what a wrapper does not change), and
`tests/support/scripted.py:ScriptedRunner` is the test double; all of them implement this
protocol and nothing else public (`tests/engine/test_runner_protocol.py` compares their methods
against this list), so nobody needs to write a runner's attributes, call its underscored
methods, or ask whether it has something. A draft model (`--speculative draft`) is one more
runner: the owner loop mirrors each target batch on it and proposes through its verbs
(`ferrox_jax/draft.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

if TYPE_CHECKING:
    import numpy as np

    from ferrox_jax.config import SchedulerLimits
    from ferrox_jax.host_batch import BatchGeometry, HostBatch, StepArrays


class DeviceState(NamedTuple):
    """What `Runner.swap_state` hands its update and takes back."""

    weights: Any  # the model's parameters (an `nnx.State`; LoRA slots live in them)
    kv_cache: Any  # the paged KV cache (`ferrox_jax/kv_cache.py`)


class PendingStep(Protocol):
    """A dispatched forward that has not been sampled yet (what `Runner.forward` returns)."""

    batch: HostBatch  # what was dispatched

    def is_done(self) -> bool:
        """Whether the device has finished the forward (host work done meanwhile was hidden by it)."""
        ...


class Runner(Protocol):
    """What the owner thread needs from the device side (module docstring)."""

    geometry: BatchGeometry  # block size, block-table width and logits width every batch is built for
    block_size: int  # token positions per KV block
    num_blocks: int  # total blocks in the cache, including the null block 0
    max_rows: int  # decode rows one step holds, at most (the largest row bucket)
    max_chunk_tokens: int  # tokens of one prompt chunk, at most (the largest token bucket)
    max_chunks: int  # prompt chunks one step holds, at most
    max_loras: int  # LoRA adapter slots the weights carry (0: none)
    is_warm: bool  # every shape compiled (`warmup` ran): a step's time is the device's, not a compile's
    kv_offload_blocks: int  # host KV tier slots (`--kv-offload-gib`, `ferrox_jax/kv_offload.py`; 0: none)
    kv_offload_snapshots: int  # its recurrent-state snapshot slots (0: none)

    @property
    def recompiles_after_warmup(self) -> int:
        """Shapes compiled after warm-up (should stay 0)."""
        ...

    @property
    def sleep_level(self) -> int:
        """0 awake; 1 the KV cache released; 2 the weights too (`release`)."""
        ...

    def forward(self, batch: HostBatch) -> PendingStep:
        """Pads `batch` to a compiled shape, runs its block copies and dispatches the one
        forward over every row; returns at once while the device runs."""
        ...

    def sample(self, pending: PendingStep, bitmask: np.ndarray | None) -> StepArrays:
        """Samples the forward's logits (masked by `bitmask` i32[R, W], one row per host
        row; None: every token allowed) and fetches everything in one transfer."""
        ...

    def copy_blocks(self, copies: np.ndarray) -> None:
        """Copies KV blocks (i32[C, 2], (src, dst) pairs), in order."""
        ...

    def encode_images(self, pixels: np.ndarray) -> np.ndarray:
        """The soft-token embeddings of B images: f32[B, C, S, S] -> f32[B, T, D]. Raises
        ValueError on a runner whose model takes no images (`geometry.image_width` 0)."""
        ...

    def offload_blocks(self, saves: np.ndarray, restores: np.ndarray) -> None:
        """The host KV tier's copies: every save (i32[S, 2], (device block, host slot)) into
        host memory, then every restore (i32[L, 2], (host slot, device block)) back."""
        ...

    def warmup(self, progress: Callable[[int, int, tuple], None] | None = None,
               num_threads: int | None = None) -> float:
        """Compiles every executable of `compile_keys` ahead of time; returns seconds taken."""
        ...

    def compile_keys(self) -> list[tuple]:
        """Every executable warm-up compiles, as plain tuples (they go into logs and JSON)."""
        ...

    def swap_state(self, update: Callable[[DeviceState], DeviceState]) -> None:
        """Replaces the device state with `update(state)` (the same structure and shapes, so
        nothing recompiles; what the update leaves as it was stays untouched); the next
        forward runs wholly on the new one."""
        ...

    def release(self, level: int) -> int:
        """Gives the KV cache (level 1) and the weights (level 2: kept in host memory) back
        to the device; returns the level it sleeps at (a sleeping runner keeps its own)."""
        ...

    def restore(self) -> None:
        """Takes back what `release` gave, in the same shapes and shardings; awake: nothing."""
        ...


class RunnerWrapper:
    """A runner around another (`self.runner`) that answers every query and verb with the
    wrapped runner's; a wrapper overrides what it adds (the multi-host leader's sends in
    `forward` / `sample`, a test's injected faults). The sizes are read once: a runner's
    shape never changes."""

    def __init__(self, runner: Runner) -> None:
        self.runner = runner
        self.geometry = runner.geometry
        self.block_size = runner.block_size
        self.num_blocks = runner.num_blocks
        self.max_rows = runner.max_rows
        self.max_chunk_tokens = runner.max_chunk_tokens
        self.max_chunks = runner.max_chunks
        self.max_loras = runner.max_loras
        self.kv_offload_blocks = runner.kv_offload_blocks
        self.kv_offload_snapshots = runner.kv_offload_snapshots

    @property
    def is_warm(self) -> bool:
        return self.runner.is_warm

    @property
    def recompiles_after_warmup(self) -> int:
        return self.runner.recompiles_after_warmup

    @property
    def sleep_level(self) -> int:
        return self.runner.sleep_level

    def forward(self, batch: HostBatch) -> Any:
        return self.runner.forward(batch)

    def sample(self, pending: Any, bitmask: np.ndarray | None) -> StepArrays:
        return self.runner.sample(pending, bitmask)

    def copy_blocks(self, copies: np.ndarray) -> None:
        self.runner.copy_blocks(copies)

    def encode_images(self, pixels: np.ndarray) -> np.ndarray:
        return self.runner.encode_images(pixels)

    def offload_blocks(self, saves: np.ndarray, restores: np.ndarray) -> None:
        self.runner.offload_blocks(saves, restores)

    def warmup(self, progress: Callable | None = None, num_threads: int | None = None) -> float:
        return self.runner.warmup(progress, num_threads)

    def compile_keys(self) -> list[tuple]:
        return self.runner.compile_keys()

    def swap_state(self, update: Callable[[DeviceState], DeviceState]) -> None:
        self.runner.swap_state(update)

    def release(self, level: int) -> int:
        return self.runner.release(level)

    def restore(self) -> None:
        self.runner.restore()


def check_limits(limits: SchedulerLimits, runner: Runner, has_draft: bool = False) -> None:
    """Raises ValueError when the limits ask for more than the runner's cache and buckets
    hold, or `--speculative draft` without a draft model (`has_draft`)."""
    if limits.block_size != runner.block_size:
        raise ValueError(f"SchedulerLimits.block_size ({limits.block_size}) must match the runner's "
                         f"KV cache block size ({runner.block_size})")
    if limits.num_blocks > runner.num_blocks - 1:
        raise ValueError(f"SchedulerLimits.num_blocks ({limits.num_blocks}) exceeds the runner's KV "
                         f"cache ({runner.num_blocks - 1} usable blocks)")
    if limits.max_rows > runner.max_rows:
        raise ValueError(f"SchedulerLimits.max_rows ({limits.max_rows}) exceeds the runner's largest "
                         f"row bucket ({runner.max_rows})")
    if limits.speculative is not None and limits.speculative.step_rows(limits.max_rows) > runner.max_rows:
        raise ValueError(f"speculation needs {limits.speculative.step_rows(limits.max_rows)} rows per step "
                         f"(each speculating row's tokens are rows); the runner's largest row bucket is "
                         f"{runner.max_rows}")
    if limits.speculative is not None and limits.speculative.method == "draft" and not has_draft:
        raise ValueError("--speculative draft: the batcher was given no draft model")
    if limits.kv_offload_blocks > runner.kv_offload_blocks:
        raise ValueError(f"SchedulerLimits.kv_offload_blocks ({limits.kv_offload_blocks}) exceeds the runner's "
                         f"host KV tier ({runner.kv_offload_blocks} slots)")
    if limits.kv_offload_snapshots > runner.kv_offload_snapshots:
        raise ValueError(f"SchedulerLimits.kv_offload_snapshots ({limits.kv_offload_snapshots}) exceeds the "
                         f"runner's host KV tier ({runner.kv_offload_snapshots} snapshot slots)")
    if limits.max_chunks > runner.max_chunks:
        raise ValueError(f"SchedulerLimits' {limits.max_chunks} chunks per step exceed the runner's "
                         f"{runner.max_chunks}")
    if limits.idle_chunk_tokens > runner.max_chunk_tokens:
        raise ValueError(f"SchedulerLimits' prefill chunk ({limits.idle_chunk_tokens} tokens) exceeds the "
                         f"runner's largest token bucket ({runner.max_chunk_tokens})")
