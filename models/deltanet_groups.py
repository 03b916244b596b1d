"""Tensor parallelism for Gated DeltaNet layers (`models/deltanet.py`): the conv channels
regrouped per device. HF stores them q | k | v, so a split of C in M equal parts would not
give each device whole heads; `group_for_devices` permutes in_proj_qkv's columns and
conv1d's channels to [q_0 k_0 v_0 | q_1 k_1 v_1 | ...] and records the grouping in each
layer's spec (`DeltaNetSpec.shards`), which the forward reads q, k and v by
(`DeltaNetSpec.split_channels`). `ferrox_jax/sharding.py` has the split itself.

An in_proj_qkv with LoRA adapter slots (`models/lora.py:LoraWeight`, attached before the
runner groups the model) moves its base and its B stack's columns the same way and records
the order (`LoraWeight.out_order`), so adapters written into its slots later, in the
checkpoint's layout, are regrouped as they are written (`models/lora.py:write_slot`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.deltanet import DeltaNetSpec
from models.lora import LoraWeight


def channel_order(spec: DeltaNetSpec, shards: int) -> np.ndarray:
    """HF's conv channel (q | k | v) at each position of the layout grouped for `shards`
    devices (`DeltaNetSpec.shards`): device d's q heads, k heads and value heads, d after d."""
    kd, vd = spec.key_dim // shards, spec.value_dim // shards
    return np.concatenate([np.concatenate([np.arange(d * kd, (d + 1) * kd),
                                           spec.key_dim + np.arange(d * kd, (d + 1) * kd),
                                           2 * spec.key_dim + np.arange(d * vd, (d + 1) * vd)])
                           for d in range(shards)])


def group_for_devices(model, shards: int):
    """`model` with its DeltaNet layers' conv channels grouped for `shards` devices (tensor
    parallelism: `ferrox_jax/sharding.py` splits C, and each device must get whole heads).

    Permutes in_proj_qkv's columns (unfused) and conv1d's channels into the grouped order and
    records it in each layer's spec (fused projections are grouped per k head already: the
    forward builds the grouped q | k | v). A model without DeltaNet layers, or already grouped
    so, is returned as it is; otherwise a copy (the caller's model keeps its layout and the
    arrays it does not change are shared)."""
    layers = [layer for layer in getattr(model, "layers", ()) if getattr(layer, "delta_spec", None) is not None]
    if not layers or all(layer.delta_spec.shards == shards for layer in layers):
        return model
    model = nnx.merge(*nnx.split(model))
    for layer in model.layers:
        spec = getattr(layer, "delta_spec", None)
        if spec is None or spec.shards == shards:
            continue
        for what, m in (("k", spec.num_k_heads), ("v", spec.num_v_heads)):
            if m % shards:
                raise ValueError(f"tensor parallelism {shards} does not divide the DeltaNet layers' {what} heads {m} "
                                 f"(linear_num_key_heads {spec.num_k_heads}, linear_num_value_heads "
                                 f"{spec.num_v_heads}); choose a size dividing both")
        # new position i holds old position old_at[HF channel at i]
        old_at = np.argsort(channel_order(spec, spec.shards))[channel_order(spec, shards)]
        names = ("conv_weight",) if spec.fused else ("conv_weight", "in_proj_qkv")
        for name in names:
            var = getattr(layer, name)
            value = var.get_value()
            if not isinstance(value.base if isinstance(value, LoraWeight) else value, jax.Array):
                raise ValueError(f"tensor parallelism: this model's DeltaNet {name} is stored quantized, and its "
                                 "channels cannot be regrouped per device; serve it on one device or from float "
                                 "weights")
            if isinstance(value, LoraWeight):
                var.set_value(regroup_lora(value, old_at))
            else:
                var.set_value(jnp.take(value, jnp.asarray(old_at), axis=0 if name == "conv_weight" else 1))
        layer.delta_spec = dataclasses.replace(spec, shards=shards)
    return model


def regroup_lora(w: LoraWeight, old_at: np.ndarray) -> LoraWeight:
    """An in_proj_qkv with adapter slots, its output columns reordered (new column i holds old
    column old_at[i]): the base and the B stack move, and `out_order` records the checkpoint's
    column at each new one, which `models/lora.py:write_slot` takes adapters' B columns by."""
    prior = np.arange(w.shape[1]) if w.out_order is None else np.asarray(w.out_order)
    index = jnp.asarray(old_at)
    return w.replace(base=jnp.take(w.base, index, axis=1), b=jnp.take(w.b, index, axis=1),
                     out_order=tuple(int(i) for i in prior[old_at]))
