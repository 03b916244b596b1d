"""The memory plan of a model of well-known shape: size before downloading.

The shapes are models/known_shapes.py's (`SHAPES`: the `config.json` of a few public
checkpoints; `write_config_folder` writes one as a config-only HF folder that
`--load-format dummy` serves with random weights). This CLI prints what an engine of that
shape would hold, from abstract shapes (`ferrox_jax.engine_builder.plan_memory`): nothing
is allocated, so a 70B shape sizes on a laptop.

    python -m tools.device.model_shapes llama-3.1-8b --dtype bfloat16 --kv-memory-gib 8 --tensor-parallel 4
    python -m tools.device.model_shapes llama-3.1-8b --write /tmp/llama8b   # then: ferrox serve --model /tmp/llama8b --load-format dummy
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from models.known_shapes import SHAPES, write_config_folder


def _dotted(path) -> str:
    """A state leaf's key path -> "layers.3.q_proj" (the names of the sharding table)."""
    parts = []
    for k in path:
        if hasattr(k, "key"):
            parts.append(str(k.key))
        elif hasattr(k, "idx"):
            parts.append(str(k.idx))
    return ".".join(parts)


def per_device_bytes(config, tensor_parallel: int) -> dict:
    """Weights and KV bytes one device holds at `tensor_parallel` (the sharding table's rules)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from ferrox_jax.engine_builder import default_dtype_name, plan_memory
    from ferrox_jax.quant_setup import DTYPES
    from ferrox_jax.sharding import MODEL_AXIS, kv_partition_spec, param_partition_spec
    from models.loader import open_checkpoint
    from models.loaders.common import abstract_model
    from models.quant import quantized_channel_axis, reduce_axis

    plan = plan_memory(config)
    dtype = DTYPES[config.dtype or default_dtype_name()]
    cfg = open_checkpoint(config.model, load_format=config.load_format).config
    state = nnx.state(abstract_model(cfg, dtype))
    weights = 0
    for path, leaf in jax.tree_util.tree_leaves_with_path(state):
        name, shape = _dotted(path), tuple(leaf.shape)
        spec = tuple(param_partition_spec(name, shape, cfg, config.replicate_attention))
        split = tensor_parallel if MODEL_AXIS in spec else 1
        axis = quantized_channel_axis(name, shape) if config.quantization != "none" else None
        if axis is None:
            weights += leaf.size * jnp.dtype(leaf.dtype).itemsize // split
            continue
        # int8 values split like the float weight; f32 scales like its spec without the
        # reduced axis (ferrox_jax/sharding.py: quantized_partition_specs).
        drop = reduce_axis(len(shape), axis)
        scales = [n for i, n in enumerate(shape) if i != drop]
        scale_spec = [a for i, a in enumerate(spec + (None,) * len(shape)) if i != drop]
        scale_split = tensor_parallel if MODEL_AXIS in scale_spec else 1
        weights += leaf.size // split + 4 * int(np.prod(scales)) // scale_split
    # a latent cache (models/mla.py) is one head: replicated whatever the attention's split
    replicate_kv = config.replicate_attention or cfg.kv_cache_dims()[0] % tensor_parallel != 0
    kv_split = 1 if MODEL_AXIS not in tuple(kv_partition_spec(replicate_kv)) else tensor_parallel
    return {"weights_bytes": plan.weights_bytes, "kv_bytes": plan.kv_bytes,
            "weights_bytes_per_device": weights, "kv_bytes_per_device": plan.kv_bytes // kv_split,
            "kv_blocks": plan.sizing.num_blocks, "max_context": plan.sizing.max_context,
            "kv_bytes_per_token": cfg.kv_bytes_per_token(jnp.dtype(dtype).itemsize), "dtype": plan.dtype}


def main(argv: list[str] | None = None) -> int:
    import tempfile

    from ferrox_jax.config import EngineConfig

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("shape", choices=sorted(SHAPES))
    p.add_argument("--write", metavar="DIR", help="write the config-only folder there and stop")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--quantization", default="none", choices=["none", "int8", "w8a8"])
    p.add_argument("--kv-memory-gib", type=float, default=2.0)
    p.add_argument("--kv-blocks", type=int, default=None)
    p.add_argument("--max-context", type=int, default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--tensor-parallel", type=int, default=1)
    p.add_argument("--replicate-attention", action="store_true")
    args = p.parse_args(argv)
    if args.write:
        print(write_config_folder(args.shape, args.write))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_config_folder(args.shape, Path(tmp) / args.shape)
        config = EngineConfig(model=str(folder), load_format="dummy", dtype=args.dtype, quantization=args.quantization,
                              kv_memory_gib=args.kv_memory_gib, kv_blocks=args.kv_blocks,
                              max_context=args.max_context, block_size=args.block_size,
                              replicate_attention=args.replicate_attention)
        print(json.dumps({"shape": args.shape, "tensor_parallel": args.tensor_parallel,
                          **per_device_bytes(config, args.tensor_parallel)}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
