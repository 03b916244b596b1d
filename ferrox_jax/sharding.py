"""Tensor parallelism on a `jax.sharding.Mesh`: which axis of which array lives where.

One engine serves from one mesh with two named axes, `("data", "model")`. Weights, the
KV cache and activations are split over `model` (Megatron-style: column-parallel
q/k/v and gate/up, row-parallel o_proj and down_proj, vocab-parallel embedding and LM
head), and XLA's SPMD partitioner inserts the collectives: one all-reduce after
o_proj and one after down_proj per layer, plus the vocab reductions. Batch inputs and
step results are replicated (every device sees the whole ForwardBatch; the host reads
the results once).

    param                       shape        spec                 (replicate_attention)
    embed                       [V, D]       P("model", None)     same
    q_proj / k_proj / v_proj    [D, H*hd]    P(None, "model")     P()
    q_bias / k_bias / v_bias    [H*hd]       P("model")           P()
    o_proj                      [H*hd, D]    P("model", None)     P()
    gate_proj / up_proj         [D, F]       P(None, "model")     same
    down_proj                   [F, D]       P("model", None)     same
    lm_head                     [D, V]       P(None, "model")     same
    experts_gate / experts_up   [E, D, F]    P(None, None, "model")  same
    experts_down                [E, F, D]    P(None, "model", None)  same
    experts_gate_bias / _up_bias  [E, F]     P(None, "model")     same
    sinks                       [H]          P("model")           P()
    DeltaNet (models/deltanet.py), Hk key heads, Hv value heads, C = 2*Hk*dk + Hv*dv conv channels:
    in_proj_qkv                 [D, C]       P(None, "model")     P()   (channels grouped per device first)
    in_proj_z / _b / _a         [D, Hv*..]   P(None, "model")     P()
    in_proj_qkvz / in_proj_ba   [D, Hk*..]   P(None, "model")     P()   (per key-head group already)
    conv_weight                 [C, 1, Kc]   P("model", None, None)  P()
    A_log / dt_bias             [Hv]         P("model")           P()
    out_proj                    [Hv*dv, D]   P("model", None)     P()
    state pool, per layer       conv [S*E, Kc-1, C]  P(None, None, "model");  recurrent [S*E, Hv, dk, dv]
                                P(None, "model", None, None)      P()   (E entries a slot with speculation)
    state pool positions        [S] (speculation only)  P()       P()
    shared_gate / shared_up     [D, S]       P(None, "model")     same  (Qwen3-Next's shared expert)
    shared_down                 [S, D]       P("model", None)     same
    norms, q_norm / k_norm, router, router_bias, o_bias, experts_down_bias, gate_norm, shared_expert_gate
                                [D], [hd], [D, E], [E], [D], [E, D], [dv], [D, 1]  P()  same
    KV cache, per layer         [K, N, bs, hd]  P("model", ...)   P()
    q_b_proj / kv_b_proj (MLA)  [r, H*(..)]  P(None, "model")     P()
    q_a_proj / kv_a_proj (MLA)  [D, r]       P()                  P()
    latent KV cache (MLA)       [1, N, bs, r+dr] P()              P()
    MTP layer (ferrox_jax/mtp.py), top-level names of its block only: its decoder layer's as above
    fc / eh_proj                [2D, D]      P(None, "model")     same  (output columns: exact, one all-gather)
    head (its LM head)          [D, V]       P(None, "model")     same  (the target's lm_head, placed as it is)

A quantized weight (`models/quant.py`: int8 values + one f32 scale per channel) shards
like the float weight it replaces: its values take the spec above, its scales that spec
without the reduced (input) axis (the output axis of a projection, the vocab axis of the
embedding, expert and output axes of an expert stack). So column-split weights split their
scales too, row-split ones (o_proj, down_proj, experts_down) replicate them, and a w8a8
row-parallel product all-reduces exact int32 partial sums before the rescale.

Splitting q/k/v columns over `model` splits whole heads (columns are head-major), so
each device owns H/M query heads and K/M KV heads and attends locally; this needs
M | H and M | K. Fused checkpoint tensors (Phi-3's qkv_proj, gate_up_proj) are split
at load, so they shard like any other projection. Experts are split Megatron-style over
their intermediate axis (every device holds a slice of every expert), so each tile of an
expert's tokens is computed locally and its down projection all-reduced (one per tile in
use: `models/moe.py`); their gate/up biases split with those columns, the down bias
(added after the sum) is replicated. With `expert_parallel` (`--expert-parallel`) every
expert stack and expert bias is split by expert instead, P("model", None, ...): each
device holds E/M whole experts and the block runs under shard_map with one all-reduce
of [N, D] per layer (`models/moe_ep.py`); M must divide E, not the experts' width. Attention sinks (one logit per query head) split by
head with q. RoPE tables are constants of the step, not parameters.
A Gated DeltaNet layer splits by key-head group: each device holds Hk/M key heads and the
Hv/M value heads they serve, their conv channels and their slots' states, so the conv, the
delta rule and the gated norm run locally and out_proj's all-reduce is the layer's one
collective. HF's conv channels are q | k | v (a split of C in M parts would cut across
them), so on a mesh the runner regroups them per device first (`models/deltanet_groups.py:
group_for_devices`); this needs M | Hk and M | Hv.
With speculation each slot keeps E = 1 + k entries, rows of the same pool arrays (entry j of
slot s is row s + j * S), so every entry splits as its state does, and the pool's per-slot
positions (i32[S]: which position entry 0 follows) are replicated: every device computes
the same update from the replicated batch. The verification step's reads (the entry a row
continues from, its run's conv window, the state after the row before it) index the slot
and token axes, never a split one, so they stay local and the layer's out_proj all-reduce
remains its one collective (tests/system/test_family_sharding.py compares the compiled
verification step's collectives with those of a plain step).
Latent attention (`models/mla.py`) splits its heads the same way: q_b_proj's and
kv_b_proj's columns are head-major, so each device holds its heads' up-projections and
attends with them over the whole latent cache, which is one head and so replicated (as
are the small down-projections to the latent).

LoRA adapter slots (`models/lora.py`: A [in, S*r], B [S*r, out] beside each adapted
projection, y = x W + (x A) B) shard like the weight they modify, so the adapter's
product splits the way the base product does and needs no collective of its own:

    base spec (projection)      A [in, S*r]          B [S*r, out]
    P(None, "model")  column    P()  replicated      P(None, "model")  each device its outputs
    P("model", None)  row       P("model", None)     P()  replicated
    P()                          P()                  P()

A row-parallel projection's input arrives split over `model` (each device holds its heads'
or intermediate columns), so x A is a partial sum on each device like x W; XLA reduces
the partial products with the base's (one all-reduce of [N, out], or of the small
[N, S*r] before B: the partitioner picks), and nothing else moves.
`replicate_attention=True` relaxes the head constraint: attention weights and the KV
cache are replicated and only the MLP and vocab are split. The default SmolLM2-135M
needs it (9 heads, 3 KV heads: no M > 1 in {2, 4, 8} divides both); its MLP is ~2/3 of
the weights, so it still spreads most of the bytes read per decode step.

`data` must be 1: the scheduler owns one KV block pool and one set of block tables, so a
second batch shard would need its own pool; we run replicas instead
(docs/deploy-tpu.md says why).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from models.config import ModelConfig
from models.deltanet import RecurrentStates
from models.moe_ep import check_expert_parallel
from models.quant import QuantizedWeight

DATA_AXIS = "data"
MODEL_AXIS = "model"
MESH_AXES = (DATA_AXIS, MODEL_AXIS)

# [in, out]: split out. q_b_proj / kv_b_proj: latent attention's per-head up-projections (models/mla.py)
_COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "lm_head", "tied_lm_head", "q_b_proj", "kv_b_proj",
           "shared_gate", "shared_up")  # shared_*: Qwen3-Next's shared expert, split as a dense MLP
_ROW = ("o_proj", "down_proj", "embed", "shared_down")  # split the first axis
_EXPERT_COLUMN = ("experts_gate", "experts_up")  # [E, D, F]: split F
_EXPERT_ROW = ("experts_down",)  # [E, F, D]: split F
_EXPERT_BIAS = ("experts_gate_bias", "experts_up_bias")  # [E, F]: split F with gate/up's columns
# Everything indexed by expert first: split by expert under expert parallelism (models/moe_ep.py).
_EXPERT_STACKS = _EXPERT_COLUMN + _EXPERT_ROW + _EXPERT_BIAS + ("experts_down_bias",)
_BIAS = ("q_bias", "k_bias", "v_bias", "sinks")  # [H*hd] or [H]: split by head with q (sinks are per head)
# Gated DeltaNet (models/deltanet.py): input projections [D, *] split by head (in_proj_qkv's columns
# grouped per device first: `group_for_devices`), conv1d [C, 1, Kc] by channel in the same order,
# the per-value-head decay parameters [Hv] with their heads, out_proj [Hv*dv, D] by row.
_DELTANET_COLUMN = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "in_proj_qkvz", "in_proj_ba")
_DELTANET = _DELTANET_COLUMN + ("conv_weight", "A_log", "dt_bias", "out_proj")
_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj", "q_b_proj", "kv_b_proj") + _BIAS + _DELTANET
# The MTP block's own projections (models/qwen3_5_mtp.py, models/deepseek_mtp.py), matched by their
# whole name (top level of the block's state): fc / eh_proj [2D, D] and its LM head [D, V] by column.
_MTP_COLUMN = ("fc", "eh_proj", "head")


def make_mesh(data: int, model: int, devices=None) -> Mesh:
    """A ("data", "model") mesh over the first data*model devices (all processes' devices).

    Raises ValueError when data > 1 (see the module docstring) or devices are too few.
    """
    if data != 1:
        raise ValueError(
            f"mesh data={data}: data parallelism inside one engine is not supported (the scheduler "
            f"owns one KV block pool); run {data} replicas, each with model={model}, behind a load "
            f"balancer (docs/deploy-tpu.md)")
    devices = list(jax.devices() if devices is None else devices)
    if model > len(devices):
        raise ValueError(f"mesh model={model} needs {model} devices; only {len(devices)} available "
                         f"({devices[0].platform})")
    return Mesh(np.asarray(devices[: data * model]).reshape(data, model), MESH_AXES)


def check_divisibility(cfg: ModelConfig, model_axis: int, replicate_attention: bool,
                       expert_parallel: bool = False) -> None:
    """Raise ValueError naming the numbers when a split axis does not divide by model_axis
    (`expert_parallel`: the experts' count instead of their width, `models/moe_ep.py`)."""
    if expert_parallel:
        check_expert_parallel(cfg, model_axis)
    if model_axis == 1:
        return
    if not replicate_attention:
        for what, n in (("num_heads", cfg.num_heads), ("num_kv_heads", cfg.num_kv_heads)):
            if n % model_axis:
                raise ValueError(
                    f"tensor parallelism {model_axis} does not divide the model's {what} {n} "
                    f"(num_heads {cfg.num_heads}, num_kv_heads {cfg.num_kv_heads}); choose a size "
                    f"dividing both, or pass --replicate-attention to shard only the MLP and vocab")
        # Layers with their own kv heads (Gemma 4's full layers): their cache arrays split too. A
        # latent cache (no V: one latent head, models/mla.py) is replicated instead.
        odd = sorted({heads for heads, _, v_dim in cfg.kv_layout() if heads % model_axis and v_dim})
        if odd:
            raise ValueError(f"tensor parallelism {model_axis} does not divide the kv heads {odd} of some of the "
                             "model's layers; choose a size dividing them, or pass --replicate-attention")
        # Gated DeltaNet layers (models/deltanet.py) split by key head, each with its value heads.
        for spec in set(cfg.recurrent_specs()):
            if spec.num_k_heads % model_axis or spec.num_v_heads % model_axis:
                raise ValueError(
                    f"tensor parallelism {model_axis} does not divide the linear-attention (DeltaNet) layers' heads "
                    f"(linear_num_key_heads {spec.num_k_heads}, linear_num_value_heads {spec.num_v_heads}); choose "
                    f"a size dividing both, or pass --replicate-attention to shard only the MLP and vocab")
    split = [(what, n) for what, n in cfg.sharded_sizes().items()
             if not (expert_parallel and what == "moe_intermediate_size")]  # whole experts per device
    if replicate_attention:
        split.append(("hidden_size", cfg.hidden_size))  # down_proj's output columns
    for what, n in split:
        if n % model_axis:
            raise ValueError(f"tensor parallelism {model_axis} does not divide the model's {what} {n}")


def param_partition_spec(name: str, shape: tuple[int, ...], cfg: ModelConfig,
                         replicate_attention: bool = False, expert_parallel: bool = False) -> P:
    """PartitionSpec of one parameter, by its name in the family modules' tables.

    `name` is the dotted state path ("layers.3.q_proj", "embed"); `cfg` is unused by the
    rules today but is part of the signature so a future rule (e.g. by head count) has it.
    `expert_parallel`: expert stacks and their biases split by expert (`models/moe_ep.py`).
    """
    del cfg
    leaf = name.split(".")[-1]
    if expert_parallel and leaf in _EXPERT_STACKS and len(shape) >= 2:
        return P(MODEL_AXIS, *(None,) * (len(shape) - 1))
    if replicate_attention and leaf in _ATTENTION:
        return P()
    if replicate_attention and leaf == "down_proj":
        # Column-split too, so every output is one whole dot over the intermediate axis
        # (the same summation as one device) and the MLP needs only exact all-gathers.
        # Row-split (one all-reduce of partial sums) moved SmolLM2's prefill logits by
        # 1.6e-4 against one device; this layout by <= 5.3e-5 at tp 2/4/8.
        return P(None, MODEL_AXIS)
    if (leaf in _COLUMN + _DELTANET_COLUMN or name in _MTP_COLUMN) and len(shape) == 2:
        return P(None, MODEL_AXIS)
    if leaf in _ROW + ("out_proj",) and len(shape) == 2:
        return P(MODEL_AXIS, None)
    if leaf in _BIAS + ("A_log", "dt_bias") and len(shape) == 1:
        return P(MODEL_AXIS)
    if leaf == "conv_weight" and len(shape) == 3:
        return P(MODEL_AXIS, None, None)
    if leaf in _EXPERT_COLUMN and len(shape) == 3:
        return P(None, None, MODEL_AXIS)
    if leaf in _EXPERT_ROW and len(shape) == 3:
        return P(None, MODEL_AXIS, None)
    if leaf in _EXPERT_BIAS and len(shape) == 2:
        return P(None, MODEL_AXIS)
    return P()  # norms (q_norm, k_norm too), the router, anything unknown: replicated


def param_placement(mesh: Mesh, cfg: ModelConfig, replicate_attention: bool = False, expert_parallel: bool = False):
    """`placement(name, shape) -> NamedSharding` by the table above, for weights made directly
    on the mesh (`--load-format dummy`: each device generates only its own shards)."""
    check_divisibility(cfg, mesh.shape[MODEL_AXIS], replicate_attention, expert_parallel)

    def placement(name: str, shape: tuple[int, ...]) -> NamedSharding:
        return NamedSharding(mesh, param_partition_spec(name, shape, cfg, replicate_attention, expert_parallel))

    return placement


def quantized_partition_specs(name: str, weight: QuantizedWeight, cfg: ModelConfig,
                               replicate_attention: bool = False, expert_parallel: bool = False) -> QuantizedWeight:
    """A QuantizedWeight of PartitionSpecs: the values as the float weight, the scales as the
    values' channel axis (see the module docstring)."""
    values = param_partition_spec(name, weight.shape, cfg, replicate_attention, expert_parallel)
    axes = tuple(values) + (None,) * (len(weight.shape) - len(values))
    return weight.replace(values=values, scales=P(*(a for i, a in enumerate(axes) if i != weight.reduce_axis)))


def kv_partition_spec(replicate_attention: bool = False) -> P:
    """Per-layer KV array [K, N, bs, hd] (layout: kv_cache.py): KV heads over `model`."""
    return P() if replicate_attention else P(MODEL_AXIS, None, None, None)


def state_pool_partition_specs(replicate_attention: bool = False) -> tuple[P, P]:
    """(conv f32[S*E, Kc - 1, C], recurrent f32[S*E, Hv, dk, dv]) of the recurrent state pool
    (models/deltanet.py): channels and value heads over `model`, as the layer's weights split
    them; the E entries of a slot (speculation) are rows of the same arrays, split alike. The
    pool's positions (with speculation) are replicated (`runner_shardings`)."""
    if replicate_attention:
        return P(), P()
    return P(None, None, MODEL_AXIS), P(None, MODEL_AXIS, None, None)


def _state_name(path) -> str:
    """nnx.State key path -> dotted parameter name (drops the trailing `.value`)."""
    parts = []
    for k in path:
        if isinstance(k, jax.tree_util.DictKey):
            parts.append(str(k.key))
        elif isinstance(k, jax.tree_util.SequenceKey):
            parts.append(str(k.idx))
    return ".".join(parts)


def _lora_stack(path) -> str | None:
    """"a" or "b" for the A or B stack of a LoraWeight (its fields `a` / `b`), else None."""
    last = path[-1] if path else None
    if isinstance(last, jax.tree_util.GetAttrKey) and last.name in ("a", "b"):
        return last.name
    return None


def lora_partition_spec(stack: str, base_spec: P) -> P:
    """PartitionSpec of a LoRA A (`stack` "a") or B ("b") stack whose base weight has
    `base_spec` (the table in the module docstring): B splits the outputs of a
    column-split base, A the inputs of a row-split one; the other side is replicated."""
    column, row = P(None, MODEL_AXIS), P(MODEL_AXIS, None)
    if base_spec == column:
        return column if stack == "b" else P()
    if base_spec == row:
        return row if stack == "a" else P()
    return P()


@dataclasses.dataclass(frozen=True)
class RunnerShardings:
    """Everything a ModelRunner needs to place arrays and compile its steps on a mesh."""

    mesh: Mesh
    state: object  # pytree of NamedSharding matching the runner's nnx.State
    kv_array: NamedSharding  # one per-layer K or V array
    replicated: NamedSharding  # batches and results
    replicate_attention: bool
    num_layers: int  # KV arrays per cache side
    states: object = None  # the recurrent state pool's RecurrentStates of shardings (None: the model has none)


def runner_shardings(mesh: Mesh, cfg: ModelConfig, state, replicate_attention: bool = False,
                     expert_parallel: bool = False, state_entries: int = 1) -> RunnerShardings:
    """Shardings for an nnx.State (from `nnx.split(model)`) and the KV cache on `mesh`
    (`expert_parallel`: the expert stacks split by expert, `models/moe_ep.py`; `state_entries`:
    a recurrent model's entries a state slot keeps, more than 1 with speculation, whose pool
    then carries per-slot positions, replicated)."""
    check_divisibility(cfg, mesh.shape[MODEL_AXIS], replicate_attention, expert_parallel)

    def spec(path, leaf):
        name = _state_name(path)
        stack = _lora_stack(path)
        if stack is not None:  # LoRA slots (models/lora.py): A and B are 2-D like their base
            base = param_partition_spec(name, leaf.shape, cfg, replicate_attention, expert_parallel)
            return NamedSharding(mesh, lora_partition_spec(stack, base))
        if isinstance(leaf, QuantizedWeight):
            specs = quantized_partition_specs(name, leaf, cfg, replicate_attention, expert_parallel)
            return jax.tree_util.tree_map(lambda p: NamedSharding(mesh, p), specs,
                                          is_leaf=lambda x: isinstance(x, P))
        return NamedSharding(mesh, param_partition_spec(name, leaf.shape, cfg, replicate_attention, expert_parallel))

    is_weight = lambda x: isinstance(x, QuantizedWeight)  # noqa: E731
    # A latent cache (models/mla.py) is one head: every device holds all of it.
    replicate_kv = replicate_attention or cfg.kv_cache_dims()[0] % mesh.shape[MODEL_AXIS] != 0
    states = None
    if cfg.recurrent_specs():
        conv, rec = (NamedSharding(mesh, p) for p in state_pool_partition_specs(replicate_attention))
        layers = len(cfg.recurrent_specs())
        states = RecurrentStates(conv=(conv,) * layers, recurrent=(rec,) * layers,
                                 positions=NamedSharding(mesh, P()) if state_entries > 1 else None)
    return RunnerShardings(
        mesh=mesh,
        state=jax.tree_util.tree_map_with_path(spec, state, is_leaf=is_weight),
        kv_array=NamedSharding(mesh, kv_partition_spec(replicate_kv)),
        replicated=NamedSharding(mesh, P()),
        replicate_attention=replicate_attention,
        num_layers=len(cfg.kv_layout()),
        states=states,
    )


def kv_cache_shardings(shardings: RunnerShardings):
    """A KVCache-shaped pytree of shardings (for in/out_shardings)."""
    from ferrox_jax.kv_cache import KVCache

    per_layer = (shardings.kv_array,) * shardings.num_layers
    return KVCache(k=per_layer, v=per_layer, states=shardings.states)


def describe_sharding(array: jax.Array) -> dict:
    """{"spec", "shard_shape", "num_shards"} of an array, for logs and tests."""
    shapes = {tuple(s.data.shape) for s in array.addressable_shards}
    return {"spec": str(getattr(array.sharding, "spec", array.sharding)),
            "shard_shapes": sorted(shapes), "num_shards": len(array.addressable_shards)}
