"""LoRA adapters on the shared projection path: stacked slots, a per-token slot index.

A LoRA adapter adds a low-rank product to a projection: y = x W + s (x A) B, with A
[in, r], B [r, out] and s = lora_alpha / r (rsLoRA: lora_alpha / sqrt(r)). Many adapters
serve one batch through fixed slots, so every shape is static whatever is loaded:

    LoraWeight (replaces the Param value of each targeted projection, as QuantizedWeight does)
      base          [in, out]       the projection's own weight (float or QuantizedWeight)
      a             [in, S*r]       S = max_loras + 1 slots, r = max_lora_rank; slot s's A
                                    in columns s*r .. s*r + r - 1
      b             [S*r, out]      slot s's B (with the adapter's scale s folded in) in rows
                                    s*r .. s*r + r - 1
      token_slots   i32[N] | None   the slot of each new token of this forward (set while
                                    tracing by `bind_token_slots`; None in the stored state)
      has_adapter   bool[] | None   any token_slots != 0 (set with them): a step without
                                    adapted rows skips the adapter term (`project_lora`)
      out_order     static | None   the checkpoint's output column at each of ours, where the
                                    model reordered them after attaching (below); None: its own

The slots are stacked along the inner axis of two plain matrices rather than as [S, in, r]
and [S, r, out]: XLA CPU ran the stacked 3-D form far slower (likely a layout change of
every A per step): a 30-layer chain of the default model's seven projections at one row took 97.9 ms with it
against 21.9 ms flat (18.8 ms without LoRA; docs/benchmarks.md).

Slot 0 is all zeros and means "no adapter": a row in slot 0 adds exactly 0.0 to every
projection, so its output equals the base model's bit for bit. An adapter of rank r <
max_lora_rank fills the first r columns of A and rows of B; the rest stay zero. Loading
an adapter writes its slot's rows (`write_slot`, one jitted update over same-shape
arrays), so loading, unloading and mixing adapters never changes a compiled shape.

The product (`lora_delta`) computes every slot's x A at once ([N, S*r], one matmul),
zeroes all but each token's own slot's r columns, and multiplies by B: two dense matmuls
whose inner size is S*r. The alternative, gathering A
and B per token ([N, in, r] and [N, r, out]), reads N copies of the adapter weights
instead of S; docs/benchmarks.md has the measurement that chose this one on CPU.

Targets: q_proj, k_proj, v_proj, o_proj and the dense MLP's gate_proj, up_proj,
down_proj, and a Gated DeltaNet layer's projections (`models/deltanet.py`: in_proj_qkv,
in_proj_z, in_proj_b, in_proj_a, out_proj; Qwen3-Next's fused in_proj_qkvz and in_proj_ba),
wherever a family's layer has them as 2-D parameters (MoE experts, routers, the conv1d and
the LM head are never targets). PEFT names map to ours through each family's HF
weight table (`self_attn.q_proj.weight` -> `q_proj`), so every family whose checkpoint
names go through that table reads PEFT adapters the same way (`read_peft_adapter`). A
fused checkpoint module (Phi-3's qkv_proj, gate_up_proj; split into our q/k/v and gate/up
at load) takes a fused adapter split the same way (`split_fused`); GGUF LoRA adapters
(llama.cpp's format) are read by `models/lora_gguf.py` into the same layout.

Nothing reaches a slot unchecked: a malformed adapter_config.json or safetensors file, an
`r` or `lora_alpha` that is not a number, and any weight that is NaN, inf or beyond
`MAX_ADAPTER_WEIGHT` (raw, and again with the scale folded in) are refused at load with a
`LoraError` naming the file and the tensor, so one tenant's broken adapter is a 400 for
whoever loads it, never a fault in the shared step.

A projection whose output columns the model reorders after the slots are attached (a
DeltaNet in_proj_qkv regrouped per device for tensor parallelism,
`models/deltanet_groups.py`) records the order in its LoraWeight (`out_order`: the
checkpoint's column at each of ours); the base and B move with it, and `write_slot` takes
each adapter's B columns in that order, so an adapter trained on the checkpoint's layout
adds the same product in ours.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj", "in_proj_qkvz", "in_proj_ba")
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_PEFT_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(.+)\.lora_([AB])(?:\.[^.]+)?\.weight$")


class LoraError(ValueError):
    """An adapter that cannot be served; `code` names why (the API's error code)."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


@struct.dataclass
class LoraWeight:
    """A projection weight with its adapter slots (layout in the module docstring)."""

    base: jax.Array
    a: jax.Array  # [in, S*r]
    b: jax.Array  # [S*r, out], scale folded in
    token_slots: jax.Array | None = None  # i32[N] while tracing a forward
    has_adapter: jax.Array | None = None  # bool[]: some token of this forward is in a slot > 0
    num_slots: int = struct.field(pytree_node=False, default=1)  # S, the zero slot included
    rank: int = struct.field(pytree_node=False, default=1)  # r, columns per slot
    # The checkpoint's output column at each of ours, where the model reordered them after the
    # slots were attached (module docstring); None: the checkpoint's order
    out_order: tuple[int, ...] | None = struct.field(pytree_node=False, default=None)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.base.shape)


def lora_delta(x: jax.Array, w: LoraWeight) -> jax.Array:
    """x [N, in] -> [N, out]: each token's own slot's s (x A) B; exactly 0 for slot 0.

    The one-hot select uses `where`, not a product, so a slot's values never reach
    another slot's tokens (not even as 0 * inf)."""
    column_slot = jnp.arange(w.num_slots * w.rank, dtype=jnp.int32) // w.rank  # [S*r]
    own = w.token_slots[:, None] == column_slot[None, :]  # [N, S*r]
    u = jnp.where(own, x @ w.a.astype(x.dtype), jnp.zeros((), x.dtype))
    return u @ w.b.astype(x.dtype)


def lora_delta_gather(x: jax.Array, w: LoraWeight) -> jax.Array:
    """The per-token gather variant of `lora_delta` (same result; kept for the benchmark)."""
    d_in, d_out = w.a.shape[0], w.b.shape[1]
    a = w.a.reshape(d_in, w.num_slots, w.rank).transpose(1, 0, 2)[w.token_slots].astype(x.dtype)  # [N, in, r]
    b = w.b.reshape(w.num_slots, w.rank, d_out)[w.token_slots].astype(x.dtype)  # [N, r, out]
    return jnp.einsum("nr,nro->no", jnp.einsum("ni,nir->nr", x, a), b)


# ---------------------------------------------------------------- the model side


@dataclasses.dataclass(frozen=True)
class LoraSlots:
    """How many adapters fit at once and how large (from `--max-loras`, `--max-lora-rank`)."""

    max_loras: int
    max_rank: int

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"LoraSlots.max_loras must be >= 1; got {self.max_loras}")
        if self.max_rank < 1:
            raise ValueError(f"LoraSlots.max_rank must be >= 1; got {self.max_rank}")

    @property
    def num_slots(self) -> int:
        """Device slots, the zero slot 0 included."""
        return self.max_loras + 1


def _targets(model) -> list[tuple[int, str, nnx.Variable]]:
    """(layer, name, variable) of every projection LoRA can target."""
    out = []
    for i, layer in enumerate(model.layers):
        for name in LORA_TARGETS:
            var = getattr(layer, name, None)
            if isinstance(var, nnx.Variable) and len(getattr(var.get_value(), "shape", ())) == 2:
                out.append((i, name, var))
    return out


def attach_lora(model, slots: LoraSlots) -> dict[tuple[int, str], tuple[int, int]]:
    """Wrap every target projection of a loaded model in a zero `LoraWeight` (in place).

    Returns {(layer, name): (in, out)}: what adapters may target, with their shapes."""
    shapes = {}
    for i, name, var in _targets(model):
        base = var.get_value()
        d_in, d_out = base.shape
        dtype = model.dtype
        width = slots.num_slots * slots.max_rank
        var.set_value(LoraWeight(base=base, a=jnp.zeros((d_in, width), dtype), b=jnp.zeros((width, d_out), dtype),
                                 num_slots=slots.num_slots, rank=slots.max_rank))
        shapes[(i, name)] = (d_in, d_out)
    return shapes


def bind_token_slots(model, token_slots: jax.Array) -> None:
    """Give every LoraWeight of a merged model (inside a traced forward) this forward's
    per-token slots i32[N], and whether any of them is not the zero slot (computed once
    here, so each projection's no-adapter branch is one scalar test: `project_lora`).
    A model without adapters is left as it is."""
    has_adapter = jnp.any(token_slots != 0)
    for _, _, var in _targets(model):
        w = var.get_value()
        if isinstance(w, LoraWeight):
            var.set_value(w.replace(token_slots=token_slots, has_adapter=has_adapter))


def project_lora(x: jax.Array, w: LoraWeight, base_product) -> jax.Array:
    """x [..., in] -> x W + each token's adapter product [..., out] (`base_product(x, W)`
    is `models/layers.project` on the base weight).

    The adapter term runs under a `lax.cond` on `has_adapter`: a step whose rows are all
    in slot 0 skips it, so it reads none of the A/B stacks (at one row, f32 stacks of 5
    slots of rank 16 are ~20 % of the default model's dense bytes per step). Both
    branches live in the one compiled step, so this adds no shape to warm up and no
    recompile; a step with any adapted row takes the adapter branch for every row, and a
    slot-0 row there still adds exactly 0.0 (`lora_delta`), so a base row's output is the
    same either way."""
    y = base_product(x, w.base)
    if w.has_adapter is None:  # slots bound without the flag (tools timing the product alone)
        return y + lora_delta(x.reshape(-1, x.shape[-1]), w).reshape(y.shape)
    return jax.lax.cond(w.has_adapter,
                        lambda x, y: y + lora_delta(x.reshape(-1, x.shape[-1]), w).reshape(y.shape),
                        lambda x, y: y, x, y)


def lora_paths(state) -> list[tuple[int, str]]:
    """(layer, name) of every LoraWeight in an nnx.State (`nnx.split` of a model), in order."""
    return [(int(path[1]), str(path[2])) for path, w in _lora_leaves(state)]


def _lora_leaves(state):
    flat = jax.tree_util.tree_flatten_with_path(state, is_leaf=lambda x: isinstance(x, LoraWeight))[0]
    out = []
    for path, leaf in flat:
        if isinstance(leaf, LoraWeight):
            keys = [getattr(k, "key", getattr(k, "idx", None)) for k in path]
            out.append((keys, leaf))
    return out


@jax.jit
def _write(stacks, slot, values):
    """stacks: ((a [in, S*r], b [S*r, out]), ...); values: ((A [in, r], B [r, out]), ...)."""
    out = []
    for (a, b), (va, vb) in zip(stacks, values):
        start = slot * va.shape[1]
        out.append((jax.lax.dynamic_update_slice(a, va.astype(a.dtype), (0, start)),
                    jax.lax.dynamic_update_slice(b, vb.astype(b.dtype), (start, 0))))
    return tuple(out)


def write_slot(state, slot: int, adapter: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]] | None,
               max_rank: int):
    """The state with slot `slot` of every LoraWeight set to the adapter's A and s*B
    (zeros where the adapter does not target a projection, or everywhere when None).
    Returns a new state (arrays are immutable); shapes are unchanged."""
    leaves = _lora_leaves(state)
    values = []
    for keys, w in leaves:
        d_in, d_out = w.a.shape[0], w.b.shape[1]
        a, b = np.zeros((d_in, max_rank), np.float32), np.zeros((max_rank, d_out), np.float32)
        if adapter is not None and (int(keys[1]), str(keys[2])) in adapter:
            pa, pb = adapter[(int(keys[1]), str(keys[2]))]
            if w.out_order is not None:  # the adapter's B is in the checkpoint's column order
                pb = pb[:, list(w.out_order)]
            a[:, :pa.shape[1]] = pa
            b[:pb.shape[0], :] = pb
        values.append((a, b))
    stacks = _write(tuple((w.a, w.b) for _, w in leaves), jnp.int32(slot), tuple(values))
    new = iter(stacks)

    def replace(leaf):
        if isinstance(leaf, LoraWeight):
            a, b = next(new)
            return leaf.replace(a=a, b=b)
        return leaf

    return jax.tree_util.tree_map(replace, state, is_leaf=lambda x: isinstance(x, LoraWeight))


# ---------------------------------------------------------------- PEFT files


@dataclasses.dataclass(frozen=True)
class PeftAdapter:
    """A PEFT LoRA adapter read into our layout: {(layer, name): (A f32[in, r], s*B f32[r, out])}."""

    rank: int
    scale: float
    weights: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]]
    base_model: str | None = None


# The largest |value| an adapter's A or scaled B may hold (checked at load, `_check_tensor`).
# Trained LoRA weights are small: PEFT starts A kaiming-uniform (|a| <= 1 / sqrt(in), under
# 0.1 for any real hidden size) and B at zero, training moves them by well under 1, and the
# scale lora_alpha / r (or / sqrt(r)) is at most a few tens, so a trained adapter's scaled
# entries stay under ~10^2; 10^4 leaves two orders of magnitude above that. It is far below
# an overflow: one projection's adapter term is at most sum_i |x_i| * r * bound^2, for a
# hidden size of 16k, |x_i| <= 10^3 and r = 256 about 1.6e7 * 256 * 1e8 = 4e17, against
# 3.4e38 for float32 and bfloat16. The bound refuses garbage (1e30, uninitialised memory)
# before it reaches a slot; what passes it can still blow up through products of products
# (the MLP's gate times up, layer after layer, or float16's 65504), which the run-time
# quarantine of a non-finite row's adapter catches (`ferrox_jax/batcher.py`).
MAX_ADAPTER_WEIGHT = 1e4


def _check_tensor(what: str, tensor: np.ndarray) -> None:
    """Refuses (invalid_adapter) a tensor holding NaN, inf or |value| > MAX_ADAPTER_WEIGHT."""
    if tensor.size == 0:
        return
    if not np.isfinite(tensor).all():
        raise LoraError("invalid_adapter", f"{what} holds NaN or inf values; an adapter's weights must be finite")
    peak = float(np.abs(tensor).max())
    if peak > MAX_ADAPTER_WEIGHT:
        raise LoraError("invalid_adapter", f"{what} holds |value| {peak:.3g}, above the {MAX_ADAPTER_WEIGHT:g} "
                                           "any trained LoRA adapter stays far below")


def lora_scale(config: dict) -> tuple[int, float]:
    """(r, s) of an adapter_config: s = lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora.

    Raises LoraError("invalid_adapter") for an `r` that is not a positive integer or a
    `lora_alpha` that is not a finite number."""
    r = config.get("r", 8)
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise LoraError("invalid_adapter", f"adapter_config r={r!r}: the rank must be a positive integer")
    alpha = config.get("lora_alpha", r)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise LoraError("invalid_adapter", f"adapter_config lora_alpha={alpha!r}: must be a finite number")
    return r, alpha / (math.sqrt(r) if config.get("use_rslora") else r)


def _check_config(config: dict, max_rank: int) -> None:
    if config.get("peft_type", "LORA") != "LORA":
        raise LoraError("invalid_adapter", f"peft_type {config.get('peft_type')!r} is not LORA")
    for key in ("use_dora", "modules_to_save", "rank_pattern", "alpha_pattern"):
        if config.get(key):
            raise LoraError("invalid_adapter", f"adapter_config {key}={config[key]!r} is not supported")
    if config.get("bias", "none") != "none":
        raise LoraError("invalid_adapter", f"adapter_config bias={config['bias']!r} is not supported (only 'none')")
    if config.get("fan_in_fan_out"):
        raise LoraError("invalid_adapter", "adapter_config fan_in_fan_out=true is not supported")
    r, _ = lora_scale(config)
    if r > max_rank:
        raise LoraError("rank_too_large", f"adapter rank {r} is larger than --max-lora-rank {max_rank}")


def _read_config(folder: Path) -> dict:
    """adapter_config.json as a JSON object, or LoraError("invalid_adapter") naming the file
    and what is wrong with it (unreadable, not UTF-8, not JSON, not an object)."""
    where = f"{folder.name}/{ADAPTER_CONFIG}"
    try:
        config = json.loads((folder / ADAPTER_CONFIG).read_bytes().decode("utf-8"))
    except OSError as e:
        raise LoraError("invalid_adapter", f"{where} cannot be read ({e.strerror or e})") from None
    except UnicodeDecodeError as e:
        raise LoraError("invalid_adapter", f"{where} is not UTF-8 text (byte {e.start}); save it as UTF-8 JSON") \
            from None
    except json.JSONDecodeError as e:
        raise LoraError("invalid_adapter", f"{where} is not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") \
            from None
    if not isinstance(config, dict):
        raise LoraError("invalid_adapter", f"{where} must hold a JSON object; got a {type(config).__name__}")
    return config


def _read_tensors(folder: Path) -> dict[str, np.ndarray]:
    """adapter_model.safetensors' tensors, or LoraError("invalid_adapter") naming the file
    and what the reader found wrong (a garbage or oversized header, offsets past the end,
    a data type numpy lacks)."""
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    try:
        return load_file(str(folder / ADAPTER_WEIGHTS))
    except (SafetensorError, OSError, TypeError, ValueError) as e:
        raise LoraError("invalid_adapter", f"{folder.name}/{ADAPTER_WEIGHTS} is not a readable safetensors file "
                                           f"({e})") from None


def read_peft_adapter(folder: str | Path, hf_layer_weights: dict[str, str],
                      targets: dict[tuple[int, str], tuple[int, int]], max_rank: int) -> PeftAdapter:
    """Read adapter_config.json + adapter_model.safetensors from `folder`.

    Args:
      hf_layer_weights: the family's table (HF name after `model.layers.{i}.` -> ours).
      targets: {(layer, name): (in, out)} the served model can adapt (`attach_lora`).
      max_rank: `--max-lora-rank`.
    Raises:
      LoraError: code "invalid_adapter" (missing, unreadable or malformed files, an `r` or
        `lora_alpha` that is not a number, unsupported options, a tensor holding NaN, inf or
        values beyond MAX_ADAPTER_WEIGHT), "rank_too_large" or "missing_target_module" (a
        module the model lacks or whose shape differs); each message names the file.
        A fused module (Phi-3's qkv_proj) is split into its parts (`split_fused`).
    """
    folder = Path(folder)
    if not (folder / ADAPTER_CONFIG).is_file() or not (folder / ADAPTER_WEIGHTS).is_file():
        raise LoraError("invalid_adapter", f"{folder.name}: needs {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}")
    config = _read_config(folder)
    try:
        _check_config(config, max_rank)
        rank, scale = lora_scale(config)
    except LoraError as e:
        raise LoraError(e.code, f"{folder.name}/{ADAPTER_CONFIG}: {e}") from None
    pairs: dict[tuple[int, str | tuple[str, ...]], dict[str, np.ndarray]] = {}
    for key, tensor in _read_tensors(folder).items():
        m = _PEFT_KEY.match(key)
        ours = hf_layer_weights.get(f"{m.group(2)}.weight") if m else None
        parts = ours if isinstance(ours, tuple) else (ours,)
        if ours is None or any((int(m.group(1)), name) not in targets for name in parts):
            raise LoraError("missing_target_module", f"adapter tensor {key!r} targets a module the model lacks "
                                                     f"(targets: {', '.join(LORA_TARGETS)})")
        _check_tensor(f"{folder.name}/{ADAPTER_WEIGHTS}: tensor {key!r}", tensor)  # before a cast could overflow
        pairs.setdefault((int(m.group(1)), ours), {})[m.group(3)] = tensor.astype(np.float32)
    weights = split_fused(pairs, targets, rank, scale)
    if not weights:
        raise LoraError("invalid_adapter", f"{folder.name}: {ADAPTER_WEIGHTS} holds no LoRA tensors")
    base_model = config.get("base_model_name_or_path")
    return PeftAdapter(rank=rank, scale=scale, weights=weights,
                       base_model=base_model if isinstance(base_model, str) else None)


def split_fused(pairs: dict, targets: dict[tuple[int, str], tuple[int, int]], rank: int, scale: float):
    """{(layer, ours): {"A": [r, in], "B": [out, r]}} in PEFT's layout -> our
    {(layer, name): (A [in, r], s * B [r, out])}.

    `ours` is one of our names, or a tuple of them for a fused checkpoint module (Phi-3's
    qkv_proj -> q/k/v, gate_up_proj -> gate/up), which we split at load into separate
    projections: x W_fused = [x W_q | x W_k | x W_v] by output rows, so the fused adapter's
    s x A B_fused splits the same way, one shared A and each part's rows of B (in the
    targets' order, each as wide as the target's output)."""
    weights = {}
    for (layer, ours), ab in sorted(pairs.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))):
        if isinstance(ours, str):
            weights[(layer, ours)] = _to_our_layout((layer, ours), ab, targets[(layer, ours)], rank, scale)
            continue
        widths = [targets[(layer, name)][1] for name in ours]
        b = ab.get("B")
        if b is not None and b.shape[0] != sum(widths):
            raise LoraError("missing_target_module",
                            f"layer {layer} {'+'.join(ours)}: fused lora_B has {b.shape[0]} rows, the model's "
                            f"{'+'.join(ours)} outputs are {'+'.join(map(str, widths))}")
        starts = np.cumsum([0] + widths)
        for name, lo, hi in zip(ours, starts[:-1], starts[1:]):
            part = {k: (v if k == "A" else v[lo:hi]) for k, v in ab.items()}
            weights[(layer, name)] = _to_our_layout((layer, name), part, targets[(layer, name)], rank, scale)
    return weights


def _to_our_layout(where, ab: dict[str, np.ndarray], shape: tuple[int, int], rank: int, scale: float):
    """PEFT lora_A [r, in], lora_B [out, r] -> (A [in, r], s * B [r, out])."""
    if set(ab) != {"A", "B"}:
        raise LoraError("invalid_adapter", f"layer {where[0]} {where[1]}: needs both lora_A and lora_B")
    with np.errstate(over="ignore", invalid="ignore"):  # a huge scale overflows to inf: refused below
        a, b = ab["A"].T, ab["B"].T * np.float32(scale)
    if a.shape != (shape[0], rank) or b.shape != (rank, shape[1]):
        raise LoraError("missing_target_module",
                        f"layer {where[0]} {where[1]}: adapter shapes A {a.shape}, B {b.shape} do not fit the "
                        f"model's [{shape[0]}, {shape[1]}] at rank {rank}")
    # The scale folded into B can push a sane B past the bound (a huge lora_alpha), and a
    # GGUF adapter's tensors are first seen here: what goes into the slot is checked.
    _check_tensor(f"layer {where[0]} {where[1]} lora_A", a)
    _check_tensor(f"layer {where[0]} {where[1]} lora_B scaled by {scale:g}", b)
    return a, b


def lora_slot_count(state) -> int:
    """Adapter slots (the zero slot not counted) of the LoraWeights in an nnx.State; 0 when
    `attach_lora` did not run on its model."""
    leaves = _lora_leaves(state)
    return leaves[0][1].num_slots - 1 if leaves else 0
