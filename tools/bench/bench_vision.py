"""The vision encoder's cost on this machine: Gemma 3's SigLIP encoder + projector at a real shape
(SigLIP-So400m: 27 layers, hidden 1152, MLP 4304, 16 heads, 896 x 896 pixels in 14 x 14 patches,
4,096 patches pooled to 256 soft tokens) with random weights, one image a call, through the same
jitted function the engine runs (`models/siglip.py:gemma3_image_tokens`).

    python -m tools.bench.bench_vision [--layers 4] [--repeats 5]

Every layer has the same shape and cost, so `--layers N` (fewer than 27) times N layers and
scales to 27 by the measured per-layer time (the patch embedding and projector, measured at 0
layers, are added once). Prints the best and median seconds per image and the FLOP rate.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from models.siglip import VisionConfig, expected_shapes, gemma3_image_tokens

SO400M = dict(hidden=1152, heads=16, intermediate=4304, image_size=896, patch_size=14, tokens_per_image=256,
              text_hidden=2560)
FULL_LAYERS = 27


def _params(cfg: VisionConfig, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {name: jnp.asarray(rng.normal(0, 0.02, shape).astype(np.float32))
            for name, shape in expected_shapes(cfg).items()}


def time_encoder(layers: int, repeats: int) -> list[float]:
    cfg = VisionConfig(layers=layers, **SO400M)
    params = _params(cfg)
    pixels = jnp.asarray(np.random.default_rng(1).uniform(-1, 1, (1, 3, 896, 896)).astype(np.float32))
    gemma3_image_tokens(params, pixels, cfg).block_until_ready()  # compile
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        gemma3_image_tokens(params, pixels, cfg).block_until_ready()
        times.append(time.perf_counter() - t0)
    return times


def layer_flops(cfg: VisionConfig) -> float:
    p, d, f = cfg.num_patches, cfg.hidden, cfg.intermediate
    return 2 * (4 * p * d * d + 2 * p * d * f + 2 * p * p * d)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    base = time_encoder(0, args.repeats)
    part = time_encoder(args.layers, args.repeats)
    per_layer = (min(part) - min(base)) / args.layers
    full = min(base) + FULL_LAYERS * per_layer
    flops = FULL_LAYERS * layer_flops(VisionConfig(layers=FULL_LAYERS, **SO400M))
    print(f"backend {jax.default_backend()}, {jax.device_count()} device(s)")
    print(f"embedding + projector: best {min(base):.3f} s, median {statistics.median(base):.3f} s")
    print(f"{args.layers} layers: best {min(part):.3f} s, median {statistics.median(part):.3f} s "
          f"-> {per_layer:.3f} s a layer")
    print(f"SigLIP-So400m + Gemma 3 projector, one 896 x 896 image: ~{full:.1f} s "
          f"({flops / 1e12:.2f} TFLOP, {flops / full / 1e9:.0f} GFLOP/s)")


if __name__ == "__main__":
    main()
