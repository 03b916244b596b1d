"""What the multi-token-prediction blocks' loaders share (`models/deepseek_mtp.py`,
`models/qwen3_5_mtp.py`): the checkpoint's MTP tensors mapped to our names, and the block's
variables filled from them, with what the block shares with the main model (the embedding,
the LM head) taken from it, in the form the main model keeps it (float, int8 or GGUF blocks).
A GGUF file's block (llama.cpp's `nextn` layers) is mapped to the same names by
models/loaders/gguf_mtp.py.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.loaders.common import map_layer_tensors, stack_experts


class NoMtpLayerError(ValueError):
    """The checkpoint has no multi-token-prediction layer to draft with (or one we cannot run)."""


def our_mtp_tensors(loads: dict[str, Callable], mtp_weights: dict, layer_suffix: Callable, table,
                    num_experts, unknown: Callable[[str], str]) -> dict[str, Callable[[], np.ndarray]]:
    """{our name: lazy array in our layout} from `loads` ({the checkpoint's suffix: lazy
    array}): a suffix in `mtp_weights` is (our name, transposed); any other is the decoder
    layer's, `layer_suffix(suffix)` its name inside the layer (None: not a layer tensor),
    mapped through the family's `table` (experts stacked); NoMtpLayerError(unknown(suffix))
    for a suffix that is neither."""
    out: dict[str, Callable] = {}
    experts: dict = {}
    for suffix, load in loads.items():
        if suffix in mtp_weights:
            ours, transpose = mtp_weights[suffix]
            out[ours] = (lambda load=load: load().T) if transpose else load
            continue
        inner = layer_suffix(suffix)
        mapped = map_layer_tensors(0, inner, load, table, {}, experts) if inner is not None else None
        if mapped is None:
            raise NoMtpLayerError(unknown(suffix))
        out.update({"layer." + k.split(".", 2)[2]: v for k, v in mapped.items()})
    out.update({"layer." + k.split(".", 2)[2]: v for k, v in stack_experts(experts, num_experts).items()})
    return out


def fill_mtp(model: nnx.Module, tensors: dict[str, Callable], shared: dict, dtype) -> nnx.Module:
    """Sets every variable of `model` (built by `nnx.eval_shape`) from `tensors` (lazy arrays,
    cast to `dtype`), else from `shared` (the main model's variables: the same arrays, not
    copies, quantized ones too: `--quantization int8|w8a8|gguf` keeps the embedding and the
    LM head as `QuantizedWeight` / `BlockQuantizedWeight`, which the layer reads as the model
    does); a variable in neither, or a float one of another shape, is a NoMtpLayerError."""
    for path, var in nnx.iter_graph(model):
        if not isinstance(var, nnx.Variable):
            continue
        name = ".".join(str(p) for p in path)
        if name in tensors:
            arr = jnp.asarray(np.asarray(tensors[name]()), dtype)
        elif name in shared:
            arr = shared[name].get_value()
            if not isinstance(arr, jax.Array):  # the main model's int8 / GGUF-block form: the layer reads it
                var.set_value(arr)  # as the model does (embed_lookup, project), in whatever layout it keeps
                continue
        else:
            raise NoMtpLayerError(f"the MTP layer has no tensor for {name}")
        if arr.shape != var.get_value().shape:
            raise NoMtpLayerError(f"MTP tensor {name}: shape {arr.shape}, expected {var.get_value().shape}")
        var.set_value(arr)
    return model
