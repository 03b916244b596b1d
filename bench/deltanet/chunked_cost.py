"""The chunked DeltaNet prefill against the token-by-token scan, on a CPU.

1. Layer level (`layer`): one row of T tokens, 8 value heads of dk = dv = 64 (the bench model's
   DeltaNet), `deltanet.gated_delta_rule` against `deltanet_chunked.chunked_gated_delta_rule`,
   each jitted, best of R runs alternating the two; max |diff| of outputs and end states beside.
2. Model level (`model`): the Qwen3.5 of bench/deltanet/scan_cost.py (hidden 512, 8 layers: 6
   Gated DeltaNet with 4 k / 8 v heads of 64, 2 gated full attention), random weights, float32,
   two runners: one with the scan for every segment, one with the engine's length rule
   (`deltanet_chunked.CHUNKED_FROM_TOKENS`). A P-token prompt prefilled in one step and in
   128-token chunks (the engine's default `prefill_chunk`), `ModelRunner.run_logits` (which
   also computes every token's logits), best of R alternating; the logits' max |diff| between
   the two and against HF transformers float32 beside it.

    cd <repo> && python bench/deltanet/chunked_cost.py [layer|model|both] [reps]
"""
import dataclasses
import functools
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, '.')
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from models import deltanet, deltanet_chunked  # noqa: E402

WHAT = sys.argv[1] if len(sys.argv) > 1 else "both"
REPS = int(sys.argv[2]) if len(sys.argv) > 2 else 5
BLOCKS = [int(c) for c in sys.argv[3].split(",")] if len(sys.argv) > 3 else [deltanet_chunked.CHUNK_TOKENS]


def load() -> str:
    return "load average " + " ".join(open("/proc/loadavg").read().split()[:3])


def best_alternating(fns: dict, reps: int) -> dict:
    best = {}
    for rep in range(reps):
        for name in (list(fns) if rep % 2 == 0 else list(fns)[::-1]):
            t0 = time.perf_counter()
            fns[name]()
            best[name] = min(best.get(name, 1e9), time.perf_counter() - t0)
    return best


def layer(reps: int) -> None:
    h, dk, dv = 8, 64, 64
    scan = jax.jit(deltanet.gated_delta_rule)
    forms = {"scan": scan} | {f"c={c}": jax.jit(functools.partial(deltanet_chunked.chunked_gated_delta_rule, chunk=c))
                              for c in BLOCKS}
    print(f"layer: 1 row, {h} heads, dk = dv = {dk}; best of {reps} alternating; {load()}")
    for t in (4, 8, 16, 32, 64, 128, 512, 2048):
        rng = np.random.RandomState(t)
        q = deltanet.l2norm(jnp.asarray(rng.randn(1, t, h, dk), jnp.float32)) * dk ** -0.5
        k = deltanet.l2norm(jnp.asarray(rng.randn(1, t, h, dk), jnp.float32))
        v = jnp.asarray(rng.randn(1, t, h, dv), jnp.float32)
        g = -jax.nn.softplus(jnp.asarray(rng.randn(1, t, h), jnp.float32))
        beta = jax.nn.sigmoid(jnp.asarray(rng.randn(1, t, h), jnp.float32))
        s0 = jnp.asarray(rng.randn(1, h, dk, dv) * 0.5, jnp.float32)
        valid = jnp.ones((1, t), bool)
        args = (q, k, v, g, beta, s0, valid)
        o1, s1 = scan(*args)
        err = {}
        for name, form in forms.items():
            o2, s2 = form(*args)
            err[name] = max(float(jnp.abs(o1 - o2).max()), float(jnp.abs(s1 - s2).max()))
        best = best_alternating({name: (lambda f=f: jax.block_until_ready(f(*args))) for name, f in forms.items()},
                                reps)
        print(f"T={t:5d}: " + "  ".join(f"{name} {best[name] * 1e3:7.2f} ms" + (
            "" if name == "scan" else f" ({best['scan'] / best[name]:4.2f}x, |diff| {err[name]:.0e})")
            for name in forms))
    print(load())


def own_logits_step(runner) -> None:
    """Give the runner a jitted logits step of its own. Unsharded runners share one jit
    (`ferrox_jax/step.py:jit_steps`), so equal graphdefs and shapes reuse one trace: the second
    runner would run the first one's kernel. A fresh function is a fresh trace cache."""
    from ferrox_jax import step

    def logits(graphdef, state, kv_cache, batch):
        return step._logits(graphdef, state, kv_cache, batch)

    runner._steps = dataclasses.replace(runner._steps, logits=jax.jit(logits, static_argnums=(0,),
                                                                       donate_argnames=("kv_cache",)))


def model(reps: int) -> None:
    import torch
    import transformers

    from ferrox_jax.plan import RowPlan
    from tests.support import family_checks as fc
    from tests.support.engine_helpers import make_runner, shuffled_blocks

    cfg = transformers.Qwen3_5TextConfig(
        hidden_size=512, intermediate_size=1024, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
        head_dim=64, max_position_embeddings=4096, tie_word_embeddings=False, linear_num_key_heads=4,
        linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 2)
    cfg.architectures = ["Qwen3_5ForCausalLM"]
    path = fc.make_checkpoint(Path(tempfile.mkdtemp()) / "qwen3_5", cfg)
    blocks = shuffled_blocks(128, 140, 1)
    prompt = np.random.RandomState(0).randint(0, 380, 2048).tolist()

    def prefill(runner, n, chunk):
        return np.concatenate([runner.run_logits([RowPlan(
            row_id=1, token_ids=tuple(prompt[s:min(n, s + chunk)]), start_pos=s, block_ids=tuple(blocks),
            sample=False, state_slot=1)])[0] for s in range(0, n, chunk)])

    runners, rule = {}, deltanet_chunked.CHUNKED_FROM_TOKENS
    cases = [(512, 512), (2048, 2048), (2048, 128)]
    for name, threshold in (("scan", 1 << 30), ("chunked", rule)):
        deltanet_chunked.CHUNKED_FROM_TOKENS = threshold  # read when each shape is traced: warm them now
        runner = make_runner(path, num_blocks=140, block_size=16, max_context=2048, max_chunk_tokens=128)[0]
        own_logits_step(runner)
        runners[name] = (runner, {case: prefill(runner, *case) for case in cases})
    deltanet_chunked.CHUNKED_FROM_TOKENS = rule
    hf = fc.hf_model(path)
    with torch.no_grad():
        ref = {n: hf(torch.tensor([prompt[:n]])).logits[0].numpy() for n in (512, 2048)}
    print(f"model: Qwen3.5 hidden 512, 8 layers (6 DeltaNet), one row; best of {reps} alternating; {load()}")
    for case in cases:
        n, chunk = case
        best = best_alternating({name: (lambda r=r: prefill(r, *case)) for name, (r, _) in runners.items()}, reps)
        scan_out, chunk_out = runners["scan"][1][case], runners["chunked"][1][case]
        print(f"{n} tokens in steps of {chunk}: scan {best['scan'] * 1e3:8.1f} ms  chunked "
              f"{best['chunked'] * 1e3:8.1f} ms  speed-up {best['scan'] / best['chunked']:5.2f}x  max |dlogit| "
              f"scan vs chunked {np.abs(scan_out - chunk_out).max():.1e}, vs HF f32: scan "
              f"{np.abs(scan_out - ref[n]).max():.1e} chunked {np.abs(chunk_out - ref[n]).max():.1e} "
              f"(logits up to {np.abs(ref[n]).max():.1f})")
    print(load())


if __name__ == "__main__":
    if WHAT in ("layer", "both"):
        layer(REPS)
    if WHAT in ("model", "both"):
        model(max(2, REPS // 2 + 1))
