# gpt-oss's MXFP4 experts: dequantized to float32 at load against kept as blocks on the CPU
# MXFP4 kernel (models/kernels/block_matmul_mxfp4.cc), on a gpt-oss-shaped small model
# (2 layers, D 1024, 16 experts of width 1024, top-4, 16 heads of 64, 4 KV heads, the
# tests' 384-token vocabulary; experts MXFP4 as released checkpoints store them, HF layout).
# Usage (from the repository root):
#   python bench/quant/mxfp4/measure.py make DIR        write the checkpoint (float + MXFP4 folders)
#   python bench/quant/mxfp4/measure.py mem DIR MODE    one fresh process: build in MODE (none |
#                                                       gguf), expert bytes, VmRSS / VmHWM (JSON)
#   python bench/quant/mxfp4/measure.py step DIR ROUNDS both models in one process, warmed up;
#                                                       ROUNDS alternated rounds of 16 one-row
#                                                       greedy decode steps (JSON)
import json
import sys
import time
from pathlib import Path

import numpy as np

D, F, E, LAYERS = 1024, 1024, 16, 2
PROMPT = [5, 80, 17, 230, 41, 9, 300, 77, 12, 140, 64, 3, 99, 7, 250, 31]
STEPS = 16


def make(root: Path) -> None:
    import transformers
    from safetensors.numpy import load_file, save_file

    from tests.models.test_family_gpt_oss import _mxfp4_encode
    from tests.support import family_checks as fc

    cfg = transformers.GptOssConfig(hidden_size=D, intermediate_size=F, num_hidden_layers=LAYERS,
                                    num_attention_heads=16, num_key_value_heads=4, head_dim=64,
                                    max_position_embeddings=4096, num_local_experts=E, num_experts_per_tok=4,
                                    sliding_window=128, tie_word_embeddings=False)
    path = fc.make_checkpoint(root / "float", cfg)
    out = root / "mxfp4"
    out.mkdir(exist_ok=True)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (out / name).write_bytes((path / name).read_bytes())
    tensors = {}
    for name, arr in load_file(str(path / "model.safetensors")).items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            rows = np.ascontiguousarray(arr.swapaxes(-1, -2))  # per output row, as released
            packed = [_mxfp4_encode(rows[e]) for e in range(rows.shape[0])]  # one expert at a time
            tensors[name + "_blocks"] = np.stack([p[0] for p in packed])
            tensors[name + "_scales"] = np.stack([p[1] for p in packed])
        else:
            tensors[name] = arr
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (out / "config.json").write_text(json.dumps(config))


def status(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1]) / 1024  # MiB
    raise KeyError(field)


def build(root: Path, mode: str):
    from models import cpu_kernels
    from models.loader import open_checkpoint

    model = open_checkpoint(str(root / "mxfp4")).build(quantization=mode)
    if mode == "gguf":
        cpu_kernels.pack_blocks_for_kernel(model)
    return model


def expert_bytes(model) -> int:
    from models.gguf_blocks import BlockQuantizedWeight

    total = 0
    for layer in model.layers:
        for name in ("experts_gate", "experts_up", "experts_down"):
            w = getattr(layer, name).get_value()
            total += w.nbytes if isinstance(w, BlockQuantizedWeight) else np.asarray(w).nbytes
    return total


def mem(root: Path, mode: str) -> None:
    import jax

    base = status("VmRSS")
    model = build(root, mode)
    jax.block_until_ready(jax.tree.leaves(model))
    print(json.dumps({"mode": mode, "expert_MiB": expert_bytes(model) / 2**20, "rss_before_MiB": base,
                      "rss_after_load_MiB": status("VmRSS"), "peak_MiB": status("VmHWM")}))


def step(root: Path, rounds: int) -> None:
    from ferrox_jax.plan import RowPlan, StepPlan
    from ferrox_jax.request import RowSampling
    from ferrox_jax.runner import ModelRunner
    from ferrox_jax.step_output import run_plan

    greedy = RowSampling(temperature=0.0)
    blocks = tuple(range(1, 9))
    runners = {}
    for mode in ("none", "gguf"):
        runners[mode] = ModelRunner(build(root, mode), num_blocks=16, block_size=8, max_rows=1,
                                    max_chunk_tokens=16, max_context=64)
        runners[mode].warmup()

    def one_round(runner):
        res = run_plan(runner, StepPlan(chunks=(RowPlan(row_id=1, token_ids=tuple(PROMPT), start_pos=0,
                                                        block_ids=blocks, sample=True, sampling=greedy),)))
        tokens, times = [res.results[1].token_id], []
        for i in range(STEPS):
            plan = StepPlan(decode=(RowPlan(row_id=1, token_ids=(tokens[-1],), start_pos=len(PROMPT) + i,
                                            block_ids=blocks, sample=True, sampling=greedy),))
            t0 = time.perf_counter()
            tokens.append(run_plan(runner, plan).results[1].token_id)
            times.append(time.perf_counter() - t0)
        return tokens, float(np.median(times)) * 1e3

    per_round = {"none": [], "gguf": []}
    tokens = {}
    for _ in range(rounds):
        for mode in ("none", "gguf"):  # alternated
            tokens[mode], ms = one_round(runners[mode])
            per_round[mode].append(ms)
    row = RowPlan(row_id=0, token_ids=tuple(PROMPT), start_pos=0, block_ids=blocks, sample=False)
    logits = {mode: runners[mode].run_logits([row])[0] for mode in runners}
    print(json.dumps({"median_ms_per_round": per_round,
                      "best_round_ms": {m: min(v) for m, v in per_round.items()},
                      "max_abs_logit_diff": float(np.abs(logits["gguf"] - logits["none"]).max()),
                      "max_abs_logit": float(np.abs(logits["none"]).max()),
                      "same_greedy_tokens": tokens["none"] == tokens["gguf"],
                      "recompiles_after_warmup": {m: r.recompiles_after_warmup for m, r in runners.items()}}))


if __name__ == "__main__":
    cmd, root = sys.argv[1], Path(sys.argv[2])
    if cmd == "make":
        make(root)
    elif cmd == "mem":
        mem(root, sys.argv[3])
    else:
        step(root, int(sys.argv[3]))
