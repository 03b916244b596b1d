"""Every compiled step of an engine, lowered for TPUs and CUDA GPUs on a CPU-only machine.

For each model shape (`models/known_shapes.py`), platform and tensor-parallel size, this
builds what an engine on that device would compile at warm-up, from abstract shapes
(`nnx.eval_shape` weights, `ShapeDtypeStruct` KV cache: nothing is allocated, so a 70B
shape runs on a laptop), and `jax.export`s each executable for the platform:

    the forward of every step shape   (`ferrox_jax/buckets.py`: decode, chunk and mixed)
    the sampler of every row count
    the block copy

with `attention_impl` chosen as `auto` chooses on that backend (`models/pallas_attention.py`:
the ragged kernels of `models/ragged_tpu.py` / `models/ragged_gpu.py`) and, for a TP size
above 1, the engine's shardings (`ferrox_jax/sharding.py`) on an abstract mesh of that
many devices (KV heads split, or the attention replicated when the heads do not divide
the mesh, as a deployment would pass --replicate-attention). What it checks and reports:

    executables   how many the warm-up set holds, and that every one lowered
    kernel        per layer kind (full attention, sliding window W, soft-capped), the
                  attention the layer runs, and that every forward holds exactly one
                  kernel call per layer (counted in the lowered module)
    bytes/device  weights and KV one device holds under the exported shardings, equal to
                  what `tools/model_shapes.per_device_bytes` expects
    TPU metadata  the scalar-prefetch (SMEM) bytes of the TPU kernel's largest call

A lowering failure (a shape the Mosaic or Triton tiling refuses, a sharding that does not
divide, a kernel `auto` did not pick) makes the exit status 1 and is named with its shape,
platform, TP size and executable. What this does not check: Mosaic's and Triton's own
compile on the device (layouts, VMEM / SMEM limits, PTX), nor any timing.

    python -m tools.device.export_steps --out docs/export-report.md     # the four shapes, tpu + cuda, TP 1 / 4 / 8
    python -m tools.device.export_steps --shapes tiny --tp 1,2 --max-seqs 2 --prefill-chunk 16 --max-context 128
    python -m tools.device.export_steps --from-json docs/export-report.json --out docs/export-report.md   # re-render
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

DEFAULT_SHAPES = ("llama-3.1-8b", "llama-3.1-70b", "qwen3-30b-a3b", "gemma-3-27b")
PLATFORMS = {"tpu": "tpu", "cuda": "cuda"}  # export platform -> the backend name `auto` sees
KERNEL_NAME = "ferrox_ragged_paged_attention"  # the pallas_call name of both ragged kernels
KERNEL_LABELS = {"TpuRaggedAttention": "ragged, Pallas TPU", "GpuRaggedAttention": "ragged, Pallas GPU (Triton)"}


@dataclasses.dataclass(frozen=True)
class Settings:
    """The engine every target is built as (`ferrox serve`'s defaults where they exist)."""

    dtype: str = "bfloat16"
    block_size: int = 16
    max_seqs: int = 32
    prefill_chunk: int = 128
    max_context: int = 8192
    kv_memory_gib: float = 16.0  # the KV budget of the whole mesh
    attention_impl: str = "auto"


@dataclasses.dataclass
class TargetResult:
    """One (shape, platform, TP size): what lowered and what one device holds."""

    shape: str
    platform: str
    tp: int
    replicate_attention: bool = False
    attention: str = ""  # the selection's note
    kernel_by_layer_kind: dict = dataclasses.field(default_factory=dict)
    executables: int = 0
    exported: int = 0
    failures: list = dataclasses.field(default_factory=list)  # "what: why" lines
    weights_bytes_per_device: int = 0
    kv_bytes_per_device: int = 0
    expected: dict = dataclasses.field(default_factory=dict)  # tools/model_shapes.per_device_bytes
    smem_bytes: int = 0
    seconds: float = 0.0

    @property
    def name(self) -> str:
        return f"{self.shape} on {self.platform} at TP {self.tp}"


def _engine_config(folder: Path, tp: int, replicate: bool, settings: Settings):
    from ferrox_jax.config import EngineConfig

    return EngineConfig(model=str(folder), load_format="dummy", dtype=settings.dtype, block_size=settings.block_size,
                        max_seqs=settings.max_seqs, prefill_chunk=settings.prefill_chunk,
                        max_context=settings.max_context, kv_memory_gib=settings.kv_memory_gib,
                        tensor_parallel=tp, replicate_attention=replicate, attention_impl=settings.attention_impl)


def layer_kinds(cfg) -> dict[str, int]:
    """{"full attention": n, "sliding window 1024": m, ...} with the soft-cap named."""
    from models.layers import AttentionSpec

    kinds: dict[str, int] = {}
    cap = getattr(cfg, "attn_logit_softcap", None)
    for layer in range(cfg.num_layers):
        window = AttentionSpec.from_config(cfg, layer).window
        kind = "full attention" if window is None else f"sliding window {window}"
        kind += f", soft-cap {cap:g}" if cap else ""
        kinds[kind] = kinds.get(kind, 0) + 1
    return kinds


def export_target(shape: str, platform: str, tp: int, settings: Settings) -> TargetResult:
    """Lower every executable of one target (module docstring); failures are recorded, not raised."""
    from models.known_shapes import write_config_folder

    result = TargetResult(shape, platform, tp)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_config_folder(shape, Path(tmp) / shape)
        try:
            _export(folder, result, settings)
        except ValueError as e:  # a configuration the engine refuses (a sharding that does not divide)
            result.failures.append(f"setup: {e}")
    result.seconds = round(time.perf_counter() - t0, 1)
    return result


def _export(folder: Path, result: TargetResult, settings: Settings) -> None:
    import jax
    from flax import nnx
    from jax.sharding import AbstractMesh

    from ferrox_jax.buckets import Buckets
    from ferrox_jax.engine_builder import size_kv
    from ferrox_jax.quant_setup import DTYPES, resolve_kv_dtype
    from ferrox_jax.memory_bounds import batched_tokens
    from ferrox_jax.runner import block_table_width, compile_keys
    from ferrox_jax.kv_groups import window_arrays
    from ferrox_jax.sharding import MESH_AXES, check_divisibility, runner_shardings
    from ferrox_jax.step import jit_steps
    from models.loader import open_checkpoint
    from models.loaders.common import abstract_model
    from models.pallas_attention import select_decode_attention
    from models.ragged_attention import RaggedAttention
    from tools.device.model_shapes import per_device_bytes

    cfg = open_checkpoint(str(folder), load_format="dummy").config
    tp = result.tp
    result.replicate_attention = tp > 1 and bool(cfg.num_heads % tp or cfg.num_kv_heads % tp)
    check_divisibility(cfg, tp, result.replicate_attention)
    config = _engine_config(folder, tp, result.replicate_attention, settings)
    dtype = DTYPES[settings.dtype]
    kv_dtype = resolve_kv_dtype(None, "none", dtype)
    sizing = size_kv(config, cfg, kv_dtype)
    width = block_table_width(sizing.max_context, settings.block_size)
    mesh = AbstractMesh((1, tp), MESH_AXES) if tp > 1 else None
    backend = PLATFORMS[result.platform]
    kernel, result.attention = select_decode_attention(
        settings.attention_impl, head_dim=cfg.head_dim, block_size=settings.block_size, max_blocks_per_row=width,
        backend=backend, mesh=mesh, kv_sharded=not result.replicate_attention, kv_dtype=kv_dtype)
    is_ragged = isinstance(kernel, RaggedAttention)
    if not is_ragged and settings.attention_impl == "auto":
        result.failures.append(f"setup: auto did not pick the ragged kernel on {backend}: {result.attention}")
    attention = KERNEL_LABELS.get(type(kernel).__name__, type(kernel).__name__) if kernel is not None else "pure JAX"
    result.kernel_by_layer_kind = {f"{kind} ({n} layers)": attention for kind, n in layer_kinds(cfg).items()}
    graphdef, state = nnx.split(abstract_model(cfg, dtype, decode_attention=kernel))
    leaves, tree = jax.tree.flatten(state)
    shardings = runner_shardings(mesh, cfg, state, result.replicate_attention) if mesh is not None else None
    # the sliding-window layers' arrays hold their own pool where the engine gives them one (ferrox_jax/kv_groups.py)
    windowed = window_arrays(cfg) if sizing.window_blocks else ()
    kv = _abstract_kv(cfg, sizing.num_blocks, settings.block_size, kv_dtype, shardings, windowed, sizing.window_blocks)
    chunk = min(settings.prefill_chunk, sizing.max_context)
    buckets = Buckets.derive(settings.max_seqs, chunk, -(-batched_tokens(config, chunk, backend) // chunk))
    keys = compile_keys(buckets)
    result.executables = len(keys)
    steps = jit_steps(shardings)
    for key in keys:
        try:
            text = _export_one(key, steps, graphdef, tree, leaves, kv, cfg, width, shardings, result.platform, windowed)
        except Exception as e:  # noqa: BLE001 - any lowering error is the report's subject, named below
            result.failures.append(f"{'/'.join(map(str, key))}: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
            continue
        if key[0] == "forward":
            calls = sum(1 for line in text.splitlines() if "custom_call" in line and f'"{KERNEL_NAME}"' in line)
            want = cfg.num_layers if is_ragged else 0
            if calls != want:
                result.failures.append(f"{'/'.join(map(str, key))}: {calls} ragged kernel calls, want {want}")
                continue
            if result.platform == "tpu" and is_ragged:
                result.smem_bytes = max(result.smem_bytes, _tpu_smem_bytes(key, width, settings))
        result.exported += 1
    result.weights_bytes_per_device = _bytes_per_device(leaves, None if shardings is None else
                                                        jax.tree.leaves(shardings.state))
    result.kv_bytes_per_device = _bytes_per_device(kv.k + kv.v, None)
    expected = per_device_bytes(config, tp)
    result.expected = {k: expected[k] for k in ("weights_bytes_per_device", "kv_bytes_per_device")}
    for what in result.expected:
        if getattr(result, what) != result.expected[what]:
            result.failures.append(f"{what}: the exported shardings hold {getattr(result, what)}, the sizing expects "
                                   f"{result.expected[what]}")


def _abstract_kv(cfg, num_blocks: int, block_size: int, kv_dtype, shardings, windowed=(), window_blocks: int = 0):
    """The cache's arrays as shapes, in the model's geometry (`ModelConfig.kv_layout`; a latent
    cache: one head, no V); the arrays `windowed` flags hold `window_blocks` blocks."""
    import jax

    from ferrox_jax.kv_cache import KVCache, kv_cache_shape

    sharding = None if shardings is None else shardings.kv_array

    def arrays(which: int) -> tuple:
        blocks = [window_blocks if windowed and windowed[i] else num_blocks for i in range(len(cfg.kv_layout()))]
        return tuple(jax.ShapeDtypeStruct(kv_cache_shape(heads, n, block_size, dims[which]), kv_dtype,
                                          sharding=sharding)
                     for n, (heads, *dims) in zip(blocks, cfg.kv_layout()))

    return KVCache(k=arrays(0), v=arrays(1))


def _export_one(key, steps, graphdef, tree, leaves, kv, cfg, width: int, shardings, platform: str,
                windowed: tuple[bool, ...] = ()) -> str:
    """Export one executable for `platform` (`windowed`: the arrays holding the sliding pool,
    whose window tables the forward then takes); returns the lowered module's text."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import export

    from ferrox_jax.buckets import StepShape
    from ferrox_jax.host_batch import SamplingArrays, bitmask_words
    from ferrox_jax.kv_cache import copy_blocks
    from ferrox_jax.runner import COPY_BATCH
    from ferrox_jax.padding import empty_forward

    # The Triton kernel is a custom call without export's compatibility guarantee: what is
    # checked here is that it lowers, not that a serialized module outlives a jaxlib.
    triton = export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
    lower = dict(platforms=(platform,), disabled_checks=[triton])
    if key[0] == "forward":
        batch = empty_forward(StepShape(*key[1:]), width, False, windowed=bool(windowed))
        exported = export.export(steps.forward, **lower)(graphdef, tree, leaves, kv, batch)
    elif key[0] == "sample":
        rows = key[1]
        exported = export.export(steps.sample, **lower)(
            jax.ShapeDtypeStruct((rows, cfg.vocab_size), jnp.float32), np.zeros(rows, np.int32),
            SamplingArrays.padding(rows, cfg.vocab_size), np.zeros((rows, bitmask_words(cfg.vocab_size)), np.int32))
    else:
        pairs = np.zeros(COPY_BATCH, np.int32)
        exported = export.export(copy_blocks, **lower)(kv, pairs, pairs, pairs, pairs, windowed=windowed)
    return exported.mlir_module()


def _tpu_smem_bytes(key, width: int, settings: Settings) -> int:
    """Scalar-prefetch bytes of the TPU kernel for one forward shape (`models/ragged_tpu.py`):
    per q tile its span range, per span three ints and its block table (padded to whole
    K/V steps)."""
    from ferrox_jax.buckets import StepShape
    from models.ragged_tpu import TPU_KEYS_PER_TILE, TPU_Q_TILE_TOKENS

    shape = StepShape(*key[1:])
    tile_blocks = max(1, TPU_KEYS_PER_TILE // settings.block_size)
    padded = -(-width // tile_blocks) * tile_blocks
    q_tiles = -(-shape.num_tokens // TPU_Q_TILE_TOKENS)
    return 4 * (2 * q_tiles + shape.num_rows * (3 + padded))


def _bytes_per_device(arrays, shardings) -> int:
    """Bytes of one device's shards (an array's own sharding, or the matching one given)."""
    import numpy as np

    total = 0
    for i, a in enumerate(arrays):
        sharding = shardings[i] if shardings is not None else getattr(a, "sharding", None)
        shape = sharding.shard_shape(a.shape) if sharding is not None else a.shape
        total += int(np.prod(shape)) * np.dtype(a.dtype).itemsize
    return total


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def render_markdown(results: list[TargetResult], settings: Settings) -> str:
    import jax

    lines = ["# Every compiled step, lowered for TPU and GPU", "",
             "Produced on a CPU-only machine by `python -m tools.device.export_steps --out docs/export-report.md` "
             f"(jax {jax.__version__}); the tool's docstring says what is checked and what is not (Mosaic's and "
             "Triton's compile on the device, and any timing). Bytes are per device under the exported shardings, "
             "each equal to what `tools/device/model_shapes.py` sizes.", "",
             f"Engine: {settings.dtype}, block size {settings.block_size}, {settings.max_seqs} rows, chunks of "
             f"{settings.prefill_chunk} tokens, context {settings.max_context}, KV budget "
             f"{settings.kv_memory_gib:g} GiB over the mesh, attention_impl={settings.attention_impl}.", "",
             "| shape | platform | TP | executables lowered | kernel per layer kind | weights / device | "
             "KV / device | TPU kernel SMEM | s |", "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        kinds = "<br>".join(f"{kind}: {k}" for kind, k in r.kernel_by_layer_kind.items())
        if r.replicate_attention:
            kinds += "<br>(attention replicated: the heads do not divide the mesh)"
        smem = f"{r.smem_bytes / 1024:.1f} KiB" if r.smem_bytes else "-"
        lines.append(f"| {r.shape} | {r.platform} | {r.tp} | {r.exported} / {r.executables} | {kinds} | "
                     f"{_size(r.weights_bytes_per_device)} | {_size(r.kv_bytes_per_device)} | {smem} | "
                     f"{r.seconds:.0f} |")
    failures = [f"- {r.name}: {f}" for r in results for f in r.failures]
    lines += ["", "Failures:" if failures else "Every executable lowered; bytes per device equal the sizing's."]
    return "\n".join(lines + failures) + "\n"


def _save(out: str, results: list[TargetResult], settings: Settings) -> None:
    Path(out).write_text(render_markdown(results, settings))
    Path(out).with_suffix(".json").write_text(json.dumps(
        {"settings": dataclasses.asdict(settings), "targets": [dataclasses.asdict(r) for r in results]},
        indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    import gc

    import jax

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=",".join(DEFAULT_SHAPES), help="models/known_shapes.py SHAPES names")
    p.add_argument("--platforms", default="tpu,cuda")
    p.add_argument("--tp", default="1,4,8", help="tensor-parallel sizes")
    defaults = Settings()
    for field in dataclasses.fields(Settings):
        p.add_argument("--" + field.name.replace("_", "-"), type=type(getattr(defaults, field.name)),
                       default=getattr(defaults, field.name))
    p.add_argument("--out", help="write the markdown report here (and the JSON beside it), after every target")
    p.add_argument("--resume", action="store_true",
                   help="keep the targets --out's JSON already holds without failures (same settings)")
    p.add_argument("--from-json", help="render a report from an earlier run's JSON instead of exporting")
    args = p.parse_args(argv)
    logging.getLogger("models").setLevel(logging.ERROR)  # the config-only folders' tokenizer fallback notes
    settings = Settings(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Settings)})
    results: list[TargetResult] = []
    saved_json = args.from_json or (Path(args.out).with_suffix(".json") if args.resume and args.out else None)
    if saved_json and Path(saved_json).is_file():
        saved = json.loads(Path(saved_json).read_text())
        if args.from_json:
            settings = Settings(**saved["settings"])
        elif Settings(**saved["settings"]) != settings:
            p.error(f"--resume: {saved_json} was made with other settings: {saved['settings']}")
        results = [TargetResult(**r) for r in saved["targets"] if args.from_json or not r["failures"]]
    done = {(r.shape, r.platform, r.tp) for r in results}
    targets = [] if args.from_json else [(shape, platform, int(tp)) for shape in args.shapes.split(",")
                                         for platform in args.platforms.split(",") for tp in args.tp.split(",")]
    for target in targets:
        if target in done:
            continue
        result = export_target(*target, settings)
        print(f"[export_steps] {result.name}: {result.exported}/{result.executables} lowered in "
              f"{result.seconds} s" + "".join(f"\n  FAILED {f}" for f in result.failures), flush=True)
        results.append(result)
        if args.out:  # a run cut short keeps what it did (--resume goes on from there)
            _save(args.out, results, settings)
        # Each target traces a model of tens of layers dozens of times; the traces cached
        # for reuse would otherwise pile up (19 GB by the 22nd of the 24 real targets).
        jax.clear_caches()
        gc.collect()
    if args.out:
        _save(args.out, results, settings)
    print(render_markdown(results, settings))
    return 1 if any(r.failures for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
