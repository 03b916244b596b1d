"""The measuring phases of `tools/device/device_check.py`, one function each, run in a subprocess.

Each phase gets the run's `Settings` and a `PhaseResult` it fills and saves after every
measurement, so a phase killed at its time box still leaves what it measured. Phases
check `settings.deadline` (monotonic seconds) before each measurement and record
`{"skipped": "time box reached"}` for what they leave out.

    platform   versions, devices, and the two ceilings measured on this device: a large
               elementwise pass (bytes read + written / s) and a bf16 matrix product (FLOP/s)
    attention  one layer's decode attention per candidate (models/gpu_attention.py) at each
               rows x context, against the pure-JAX loop: time, bytes/s, error
    engine     the real engine on a dummy model of the shape (models/known_shapes.py): load,
               warm-up of exactly the measured buckets, prefill and decode (tools/bench/bench_engine.py)
    mixed      decode rows and prompt chunks in one forward, with the engine's attention
               (`auto`: the ragged kernel on a GPU or TPU)
    mixed_segments  the same through the attention auto took before (one call per segment)
    torch      the same shapes through HF transformers on torch (random init from the same
               config; DynamicCache, its default), as the side-by-side peer
    rewarm     the engine loaded again in a fresh process: warm-up from the persistent cache

The parity phase is pytest itself (`tools/device/device_check.py` runs it).
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable


@dataclasses.dataclass(frozen=True)
class Settings:
    """What one run measures (`tools/device/device_check.py` has the full and --small sets)."""

    shape: str  # a models/known_shapes.py SHAPES name
    dtype: str
    rows: tuple[int, ...]  # decode rows measured (and the only decode buckets compiled)
    contexts: tuple[int, ...]  # context lengths the decode rows sit at
    prefill_tokens: tuple[int, ...]  # prefill chunk sizes measured (the only prefill buckets)
    decode_steps: int  # timed decode steps per (rows, context)
    max_context: int  # the engine's context ceiling: sets the block-table width
    block_size: int
    attention_reps: int  # timed calls per attention measurement (median kept)
    copy_bytes: int  # size of the elementwise pass of the platform phase
    matmul_size: int  # n of the n x n x n bf16 product of the platform phase
    cache_dir: str  # JAX persistent compilation cache, independent of --out
    engine_attention: str = "auto"
    mixed_chunks: tuple[int, ...] = (1, 4)  # prompt chunks per step measured by the mixed phase
    deadline: float = math.inf  # time.monotonic() by which the phase must have finished

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "Settings":
        d = json.loads(text)
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})


class PhaseResult(dict):
    """A phase's results, written to `path` (JSON) on every `save()`."""

    def __init__(self, path: str | Path) -> None:
        super().__init__()
        self.path = Path(path)

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self, indent=2, default=str))
        tmp.replace(self.path)


def time_box_reached(settings: Settings) -> bool:
    return time.monotonic() > settings.deadline


def median_seconds(fn: Callable[[], Any], reps: int, warmup: int = 2) -> float:
    """Median wall time of `fn()` (which must block until its device work is done)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


# ---------------------------------------------------------------- platform


def platform(settings: Settings, result: PhaseResult) -> None:
    import jax
    import jax.numpy as jnp

    device = jax.devices()[0]
    stats = device.memory_stats() or {}
    result.update(
        backend=jax.default_backend(), devices=[str(d) for d in jax.devices()], device_kind=device.device_kind,
        memory_bytes_limit=stats.get("bytes_limit"), python=sys.version.split()[0],
        versions={d: _version(d) for d in ("jax", "jaxlib", "jax-cuda13-plugin", "flax", "numpy", "torch",
                                           "transformers", "tokenizers", "triton")})
    if shutil.which("nvidia-smi"):
        query = "name,driver_version,memory.total,clocks.sm,clocks.max.sm,clocks.mem"
        out = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        result["nvidia_smi"] = (out.stdout or out.stderr).strip()
    result.save()
    # The two ceilings, measured: an elementwise pass over `copy_bytes` of bf16 (bytes read
    # plus written), and an n^3 bf16 product on random data (zeros run faster: METHOD.md).
    x = jax.random.normal(jax.random.key(0), (settings.copy_bytes // 2,), jnp.bfloat16)
    bump = jax.jit(lambda a: a + jnp.bfloat16(1))
    seconds = median_seconds(lambda: bump(x).block_until_ready(), reps=10)
    result["measured_copy_tbytes_per_s"] = 2 * x.nbytes / seconds / 1e12
    n = settings.matmul_size
    a, b = (jax.random.normal(jax.random.key(i), (n, n), jnp.bfloat16) for i in (1, 2))
    matmul = jax.jit(lambda p, q: p @ q)
    seconds = median_seconds(lambda: matmul(a, b).block_until_ready(), reps=10)
    result["measured_bf16_tflops"] = 2 * n**3 / seconds / 1e12
    result.save()


# ---------------------------------------------------------------- attention candidates


def attention_candidates(backend: str) -> tuple[str, ...]:
    """The candidates timed on this backend ("jax" is the reference). Off a GPU only the
    XLA path runs: the interpreted Pallas kernels time a simulation (their correctness is
    tests/models/test_gpu_attention.py's and tests/models/test_ragged_attention.py's)."""
    from models.gpu_attention import GPU_BACKENDS

    if backend in GPU_BACKENDS:
        return ("jax", "ragged-gpu", "pallas-gpu", "gather-xla", "gather-cudnn")
    if backend == "tpu":
        return ("jax", "ragged-tpu", "pallas", "gather-xla")
    return ("jax", "gather-xla")


def previous_attention(backend: str) -> str:
    """What `auto` ran before the ragged kernels: the TPU decode kernel (with the loop for
    chunks), the pure-JAX loop elsewhere; the mixed_segments phase measures it."""
    return "pallas" if backend == "tpu" else "jax"


def _ragged_as_decode(kernel):
    """A ragged kernel behind the one-query contract the attention phase times: each row a
    span of one query (`models/ragged_attention.py`)."""
    import jax.numpy as jnp

    from models.layers import Segment
    from models.ragged_attention import ragged_spans

    def attend(q, k_cache, v_cache, tables, positions, scale):
        rows = q.shape[0]
        spans = ragged_spans((Segment(0, rows, 1, positions, jnp.ones(positions.shape, bool), tables),))
        return kernel(q[:, 0], k_cache, v_cache, spans, scale=scale)[:, None]

    return attend


def _build_candidates(backend: str, head_dim: int, block_size: int, width: int, dtype) -> tuple[dict, dict]:
    """({name: attention callable}, {name: why or why not}) for this backend's candidates."""
    from models.attention import paged_attention
    from models.pallas_attention import select_decode_attention

    impls: dict[str, Any] = {"jax": paged_attention}
    notes = {"jax": "models.attention.paged_attention (the reference)"}
    for impl in attention_candidates(backend)[1:]:
        try:
            impls[impl], notes[impl] = select_decode_attention(impl, head_dim=head_dim, block_size=block_size,
                                                               max_blocks_per_row=width, backend=backend,
                                                               kv_dtype=dtype)
            if impl.startswith("ragged"):
                impls[impl] = _ragged_as_decode(impls[impl])
        except ValueError as e:
            impls.pop(impl, None)
            notes[impl] = f"unavailable: {e}"
    return impls, notes


def attention(settings: Settings, result: PhaseResult) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from ferrox_jax.runner import block_table_width
    from models.known_shapes import SHAPES
    from models.registry import config_from_hf

    cfg = config_from_hf(SHAPES[settings.shape])
    dtype = jnp.dtype(settings.dtype)
    backend = jax.default_backend()
    bs, kv, heads, hd = settings.block_size, cfg.num_kv_heads, cfg.num_heads, cfg.head_dim
    width = block_table_width(settings.max_context, bs)
    per_row = -(-(max(settings.contexts) + 1) // bs)
    num_blocks = max(settings.rows) * per_row + 1
    k_cache, v_cache = (jax.random.normal(jax.random.key(i), (kv, num_blocks, bs, hd), jnp.float32).astype(dtype)
                        for i in (0, 1))
    scale = 1.0 / math.sqrt(hd)
    result.update(backend=backend, kv_heads=kv, heads=heads, head_dim=hd, block_size=bs, table_width_blocks=width,
                  dtype=dtype.name, num_layers=cfg.num_layers, measurements=[])
    impls, result["candidates"] = _build_candidates(backend, hd, bs, width, dtype)
    result.save()
    rng = np.random.RandomState(0)
    ids = rng.permutation(np.arange(1, num_blocks))  # shuffled, so the block table matters
    tolerance = 2e-2 if dtype.itemsize == 2 else 1e-4  # relative L2: bf16 rounds at 2^-8 a few times
    for rows in settings.rows:
        tables = np.zeros((rows, width), np.int32)
        for r in range(rows):
            tables[r, :per_row] = ids[r * per_row:(r + 1) * per_row]
        tables = jnp.asarray(tables)
        q = jax.random.normal(jax.random.key(rows), (rows, 1, heads, hd), jnp.float32).astype(dtype)
        compiled = {name: jax.jit(lambda *a, f=f: f(*a, scale)) for name, f in impls.items()}
        for context in settings.contexts:
            positions = jnp.full((rows, 1), context - 1, jnp.int32)
            args = (q, k_cache, v_cache, tables, positions)
            ref = np.asarray(compiled["jax"](*args), np.float32)
            kv_bytes = rows * context * 2 * kv * hd * dtype.itemsize
            for name, fn in compiled.items():
                entry: dict[str, Any] = {"candidate": name, "rows": rows, "context": context}
                if time_box_reached(settings):
                    entry["skipped"] = "time box reached"
                else:
                    try:
                        out = np.asarray(fn(*args), np.float32)
                        rel = float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
                        seconds = median_seconds(lambda: fn(*args).block_until_ready(), settings.attention_reps)
                        entry.update(us=seconds * 1e6, kv_tbytes_per_s=kv_bytes / seconds / 1e12,
                                     rel_err=rel, max_abs_err=float(np.abs(out - ref).max()),
                                     correct=bool(np.isfinite(out).all() and rel < tolerance))
                    except Exception as e:  # a candidate this GPU or version refuses: record it, go on
                        entry["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                result["measurements"].append(entry)
                result.save()


# ---------------------------------------------------------------- engine


def count_cache_files(cache_dir: str) -> int:
    return sum(len(files) for _, _, files in os.walk(cache_dir)) if os.path.isdir(cache_dir) else 0


def _load_and_warm(settings: Settings, result: PhaseResult, buckets=None):
    """Load the engine on a dummy model of the shape and compile exactly the measured buckets
    (`buckets`, or the decode rows and prefill sizes of `settings` apart)."""
    import jax

    from ferrox_jax.buckets import Buckets
    from ferrox_jax.config import EngineConfig
    from ferrox_jax.engine import Engine
    from models.known_shapes import write_config_folder

    folder = write_config_folder(settings.shape, Path(tempfile.mkdtemp(prefix="ferrox_shape_")) / settings.shape)
    per_row = -(-(max(max(settings.contexts) + settings.decode_steps + 1, max(settings.prefill_tokens)))
                // settings.block_size)
    config = EngineConfig(model=str(folder), load_format="dummy", dtype=settings.dtype,
                          block_size=settings.block_size, kv_blocks=max(settings.rows) * per_row + 2,
                          max_context=settings.max_context, max_seqs=max(settings.rows),
                          prefill_chunk=max(settings.prefill_tokens), compile_cache_dir=settings.cache_dir,
                          attention_impl=settings.engine_attention,
                          # the rewarm phase measures JAX's own persistent cache; the executable
                          # store (CPU only) would load the shapes past it where this check runs on CPU
                          executable_store=False)
    t0 = time.perf_counter()
    eng = Engine.load(config)
    result.update(backend=jax.default_backend(), load_s=time.perf_counter() - t0, describe=eng.describe(),
                  weights_bytes=eng.weights_bytes, kv_bytes=eng.model_card.kv_bytes)
    result.save()
    # Only the measured shapes are compiled: the serving default would also compile every
    # power of two in between (9 row and 8 token buckets) and their mixes, minutes of compile for nothing.
    eng.runner.buckets = buckets or Buckets(decode_rows=tuple(settings.rows), mixed_rows=(),
                                            chunk_tokens=tuple(settings.prefill_tokens), chunk_rows=(1,))
    compiled_at: list = []
    before = count_cache_files(settings.cache_dir)
    # Counted from this process's own cache writes (JAX's monitoring event), not from the
    # folder's file count: another process sharing the folder (a parallel test worker)
    # may write into it meanwhile.
    events = {"/jax/compilation_cache/cache_misses": 0, "/jax/compilation_cache/cache_hits": 0}

    def on_event(event: str, **_kwargs) -> None:
        if event in events:
            events[event] += 1

    jax.monitoring.register_event_listener(on_event)
    t0 = time.perf_counter()
    try:
        eng.warmup(lambda done, total, key: compiled_at.append([list(key), round(time.perf_counter() - t0, 2)]))
    finally:
        jax.monitoring.unregister_event_listener(on_event)
    result.update(warmup_s=eng.warmup_s, compiled_shapes=compiled_at, compile_cache_files_before=before,
                  compile_cache_files_after=count_cache_files(settings.cache_dir),
                  compile_cache_writes=events["/jax/compilation_cache/cache_misses"],
                  compile_cache_hits=events["/jax/compilation_cache/cache_hits"])
    result.save()
    return eng


def engine(settings: Settings, result: PhaseResult) -> None:
    from tools.bench.bench_engine import bench_decode, bench_prefill, fill_kv_random

    eng = _load_and_warm(settings, result)
    fill_kv_random(eng.runner)  # decode positions nothing prefilled: random, not zeros
    result["prefill"] = bench_prefill(eng, list(settings.prefill_tokens), deadline=settings.deadline)
    result.save()
    result["decode"] = {}
    for rows in settings.rows:
        result["decode"].update(bench_decode(eng, [rows], list(settings.contexts), settings.decode_steps,
                                             deadline=settings.deadline))
        result.save()
    result["recompiles_after_warmup"] = eng.runner.recompiles_after_warmup
    result.save()


def mixed(settings: Settings, result: PhaseResult) -> None:
    """The unified step's prefill rate: decode rows and prompt chunks in one forward against
    the same work as separate forwards, for 1 and `max(mixed_chunks)` chunks of the smallest
    measured prefill size (what `--max-batched-tokens` trades: prefill rate against every
    decoding row's inter-token gap)."""
    from ferrox_jax.buckets import Buckets
    from tools.bench.bench_engine import bench_mixed, fill_kv_random

    rows, chunk = settings.rows[min(2, len(settings.rows) - 1)], min(settings.prefill_tokens)
    chunks = (1, max(settings.mixed_chunks))
    measured = dataclasses.replace(settings, rows=(rows,), prefill_tokens=(chunk,))
    eng = _load_and_warm(measured, result, Buckets(decode_rows=(rows,), mixed_rows=(rows,), chunk_tokens=(chunk,),
                                                  chunk_rows=tuple(sorted(set(chunks)))))
    fill_kv_random(eng.runner)
    result["mixed"] = bench_mixed(eng, rows, min(settings.contexts), chunk, list(chunks), settings.decode_steps)
    result["recompiles_after_warmup"] = eng.runner.recompiles_after_warmup
    result.save()


def mixed_segments(settings: Settings, result: PhaseResult) -> None:
    """The mixed phase again through the attention `auto` took before the ragged kernels
    (`previous_attention`: one attention call per segment), so the two sit side by side."""
    import jax

    impl = previous_attention(jax.default_backend())
    mixed(dataclasses.replace(settings, engine_attention=impl), result)
    result["attention_impl"] = impl
    result.save()


def rewarm(settings: Settings, result: PhaseResult) -> None:
    """A fresh process loads the same engine again: its warm-up reads the persistent compile
    cache the engine phase filled (the serving restart case)."""
    _load_and_warm(settings, result)


# ---------------------------------------------------------------- HF transformers on torch


def _hf_model(settings: Settings):
    import torch
    import transformers

    from models.known_shapes import SHAPES

    hf_config = transformers.LlamaConfig(**{k: v for k, v in SHAPES[settings.shape].items() if k != "architectures"})
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if settings.dtype == "bfloat16" else torch.float32
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    return model.eval(), hf_config, device, dtype


def _random_cache(hf_config, rows: int, context: int, device: str, dtype):
    """A DynamicCache already holding `context` random positions for `rows` rows."""
    import torch
    from transformers import DynamicCache

    try:
        cache = DynamicCache(config=hf_config)
    except TypeError:  # transformers before the config argument
        cache = DynamicCache()
    head_dim = hf_config.head_dim
    shape = (rows, hf_config.num_key_value_heads, context, head_dim)
    for layer in range(hf_config.num_hidden_layers):
        cache.update(torch.randn(shape, device=device, dtype=dtype), torch.randn(shape, device=device, dtype=dtype),
                     layer)
    return cache


def hf_torch(settings: Settings, result: PhaseResult) -> None:
    import torch

    torch.set_grad_enabled(False)
    t0 = time.perf_counter()
    model, hf_config, device, dtype = _hf_model(settings)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    result.update(device=device, torch=torch.__version__, transformers=_version("transformers"),
                  attn_implementation=getattr(model.config, "_attn_implementation", None),
                  cache="DynamicCache (transformers' default)", init_s=time.perf_counter() - t0,
                  prefill={}, decode={})
    result.save()
    vocab = hf_config.vocab_size

    def forward(ids, cache=None):
        return model(input_ids=ids, past_key_values=cache, use_cache=cache is not None, logits_to_keep=1)

    for tokens in settings.prefill_tokens:
        key = f"prefill_{tokens}"
        if time_box_reached(settings):
            result["prefill"][key] = {"skipped": "time box reached"}
            continue
        ids = torch.randint(10, vocab - 10, (1, tokens), device=device)
        seconds = median_seconds(lambda: (forward(ids), sync()), reps=3, warmup=1)
        result["prefill"][key] = {"tokens": tokens, "tokens_per_s": tokens / seconds, "step_ms": seconds * 1e3}
        result.save()
    for rows in settings.rows:
        for context in settings.contexts:
            key = f"decode_{rows}_rows_{context}_context"
            if time_box_reached(settings):
                result["decode"][key] = {"skipped": "time box reached"}
                continue
            cache = _random_cache(hf_config, rows, context, device, dtype)
            ids = torch.randint(10, vocab - 10, (rows, 1), device=device)
            sync()
            step_s = median_seconds(lambda: (forward(ids, cache), sync()), reps=settings.decode_steps, warmup=1)
            result["decode"][key] = {"rows": rows, "context": context, "tokens_per_s": rows / step_s,
                                     "step_ms": step_s * 1e3}
            del cache
            if device == "cuda":
                torch.cuda.empty_cache()
            result.save()


PHASE_FUNCTIONS: dict[str, Callable[[Settings, PhaseResult], None]] = {
    "platform": platform, "attention": attention, "engine": engine, "mixed": mixed,
    "mixed_segments": mixed_segments, "torch": hf_torch, "rewarm": rewarm,
}
