"""LoRA serving cost: decode tokens/s with 0, 1 and 4 distinct adapters in the batch.

Two engines over the same checkpoint in one process: one without adapter slots
(`--max-loras 0`, the plain projections) and one with `--max-loras 4 --max-lora-rank 16`
holding four random rank-16 PEFT adapters on every q/k/v/o and MLP projection. Decode
steps of 1 and 32 rows at a fixed context run through the runner (`run_plan`, no HTTP):

    base       engine without slots
    lora-0     engine with slots, every row in slot 0 (no adapter)
    lora-1     every row with the same adapter
    lora-4     rows cycling through the four adapters

Rounds alternate the four configurations so drift hits them alike; the median step time
of each is reported. `lora-0` steps take the no-adapter branch (`models/lora.py`,
`project_lora`: no row has an adapter, so the A/B products are skipped); `lora-1` at one
row is what every step with slots cost before that branch. Accuracy beside the speed: a
slot-0 row's logits against the base engine's on one prompt (max |difference|, greedy
tokens agree?), alone and beside a row with an adapter (the adapter branch). The
product itself (one-hot over slots, `lora_delta`, against a per-token gather,
`lora_delta_gather`) is timed on one layer's seven projections.

    python -m tools.bench.bench_lora --json results/lora.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from ferrox_jax.step_output import run_plan

RANK = 16
NUM_ADAPTERS = 4


def write_adapters(engine, folder: Path, count: int, rank: int, seed: int = 0) -> list[Path]:
    """`count` random PEFT adapters of `rank` on every target the engine's model has."""
    from safetensors.numpy import save_file

    from models.registry import family_for

    cfg = engine.model_config
    ours_to_hf = {ours: hf[:-len(".weight")] for hf, ours in family_for(cfg.architecture).hf_layer_weights.items()
                  if isinstance(ours, str)}
    rng = np.random.RandomState(seed)
    paths = []
    for i in range(count):
        tensors = {}
        for (layer, name), (d_in, d_out) in engine.adapter_targets.items():
            prefix = f"base_model.model.model.layers.{layer}.{ours_to_hf[name]}"
            tensors[f"{prefix}.lora_A.weight"] = (rng.randn(rank, d_in) / np.sqrt(d_in)).astype(np.float32)
            tensors[f"{prefix}.lora_B.weight"] = (rng.randn(d_out, rank) * 0.01).astype(np.float32)
        path = folder / f"adapter{i}"
        path.mkdir(parents=True)
        save_file(tensors, str(path / "adapter_model.safetensors"))
        (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank}))
        paths.append(path)
    return paths


def decode_step_s(engine, rows: int, slots: list[int], context: int, steps: int) -> float:
    """Seconds per decode step of `rows` rows at `context`, row r in slot slots[r % len]."""
    from ferrox_jax.plan import RowPlan, StepPlan
    from ferrox_jax.request import RowSampling

    from tools.bench.bench_engine import row_tables

    runner = engine.runner
    tables = row_tables(runner, rows, context + steps + 2)
    greedy = RowSampling(temperature=0.0)

    def plan_at(pos):
        return StepPlan(decode=tuple(RowPlan(row_id=r, token_ids=(7,), start_pos=pos, block_ids=tables[r],
                                             sample=True, sampling=greedy, adapter_slot=slots[r % len(slots)])
                                     for r in range(rows)))

    run_plan(engine.runner, plan_at(context))
    t0 = time.perf_counter()
    for s in range(steps):
        run_plan(engine.runner, plan_at(context + 1 + s))
    return (time.perf_counter() - t0) / steps


def slot0_accuracy(base, lora, prompt: list[int]) -> dict:
    """A slot-0 row of the LoRA engine against the engine without slots: alone (the step
    takes the no-adapter branch) and beside a row with adapter 1 (the adapter branch)."""
    from ferrox_jax.plan import RowPlan

    per_row = -(-len(prompt) // base.runner.block_size)
    row = RowPlan(row_id=0, token_ids=tuple(prompt), start_pos=0, block_ids=tuple(range(1, 1 + per_row)),
                  sample=False)
    adapted = RowPlan(row_id=1, token_ids=tuple(prompt), start_pos=0, sample=False, adapter_slot=1,
                      block_ids=tuple(range(1 + per_row, 1 + 2 * per_row)))
    # Against the base engine at the same batch shape: XLA CPU may sum a matmul of 2 rows in
    # another order than one of 1, so a 1-row reference would measure that, not the slots.
    want = base.runner.run_logits([row])[0]
    want_pair = base.runner.run_logits([row, dataclasses.replace(adapted, adapter_slot=0)])[0]
    alone = lora.runner.run_logits([row])[0]
    mixed, moved = lora.runner.run_logits([row, adapted])
    out = {}
    for name, ref, got in (("alone", want, alone), ("beside_adapted_row", want_pair, mixed)):
        out[name] = {"max_abs_logit_diff": float(np.abs(ref - got).max()),
                     "same_greedy_tokens": bool((ref.argmax(-1) == got.argmax(-1)).all())}
    out["adapter_1_moves_logits_by"] = float(np.abs(moved - want).max())  # the adapted row is not the base
    return out


def product_ms(engine, tokens_list: list[int], repeats: int = 20) -> dict:
    """One layer's seven LoRA products (4 adapter slots + the zero one, rank 16), one-hot vs gather."""
    from models.lora import LoraWeight, lora_delta, lora_delta_gather

    shapes = [shape for (layer, _), shape in engine.adapter_targets.items() if layer == 0]
    slots = NUM_ADAPTERS + 1
    key = jax.random.key(0)
    weights = [LoraWeight(base=jnp.zeros((1, 1)), a=jax.random.normal(key, (i, slots * RANK)),
                          b=jax.random.normal(key, (slots * RANK, o)), num_slots=slots, rank=RANK) for i, o in shapes]
    out = {}
    for n in tokens_list:
        token_slots = jnp.asarray(np.arange(n) % slots, jnp.int32)
        xs = [jax.random.normal(key, (n, i)) for i, _ in shapes]
        for name, fn in (("one_hot", lora_delta), ("gather", lora_delta_gather)):
            step = jax.jit(lambda xs, ws, fn=fn: [fn(x, w.replace(token_slots=token_slots)) for x, w in zip(xs, ws)])
            jax.block_until_ready(step(xs, weights))
            t0 = time.perf_counter()
            for _ in range(repeats):
                jax.block_until_ready(step(xs, weights))
            out[f"{name}_{n}_tokens_ms"] = (time.perf_counter() - t0) / repeats * 1e3
    return out


def main(argv: list[str] | None = None) -> int:
    from ferrox_jax.config import EngineConfig
    from ferrox_jax.engine import Engine

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 32])
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", dest="json_path", default=None)
    args = p.parse_args(argv)

    per_row = -(-(args.context + args.steps + 2) // 16)
    common = dict(model=args.model, max_seqs=max(args.rows), max_context=1024, kv_blocks=max(args.rows) * per_row,
                  block_size=16, prefix_caching=False)
    base = Engine.load(EngineConfig(**common))
    lora = Engine.load(EngineConfig(**common, max_loras=NUM_ADAPTERS, max_lora_rank=RANK))
    with tempfile.TemporaryDirectory() as tmp:
        for i, path in enumerate(write_adapters(lora, Path(tmp), NUM_ADAPTERS, RANK)):
            lora.load_adapter(f"adapter{i}", str(path))
    configs = {"base": (base, [0]), "lora-0": (lora, [0]), "lora-1": (lora, [1]), "lora-4": (lora, [1, 2, 3, 4])}
    times: dict[str, list[float]] = {f"{c}_{r}": [] for c in configs for r in args.rows}
    for _ in range(args.rounds):
        for name, (engine, slots) in configs.items():
            for rows in args.rows:
                times[f"{name}_{rows}"].append(decode_step_s(engine, rows, slots, args.context, args.steps))
    result = {"model": base.model_name, "context": args.context, "steps": args.steps, "rounds": args.rounds,
              "rank": RANK, "backend": jax.default_backend(), "decode": {}}
    for key, samples in times.items():
        step_s = statistics.median(samples)
        rows = int(key.rsplit("_", 1)[1])
        result["decode"][key] = {"tokens_per_s": rows / step_s, "step_ms": step_s * 1e3,
                                 "step_ms_rounds": [s * 1e3 for s in samples]}
    prompt = base.tokenizer.encode("The capital of France is Paris. Once upon a time, in a small village by the sea,")
    result["slot0_vs_base"] = slot0_accuracy(base, lora, prompt)
    result["product"] = product_ms(lora, [1, 32, 256])
    text = json.dumps(result, indent=2)
    print(text)
    if args.json_path:
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
