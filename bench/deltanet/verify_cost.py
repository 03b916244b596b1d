"""What a speculative verification step costs a Qwen3.5 model (8 layers, 6 Gated DeltaNet + 2
full attention, hidden 512, random weights, float32) on the runner's verbs (`forward`, then
`sample`): two rows after 128 positions each, timed as

    plain 1     one token a row, a runner without speculation (one state entry a slot)
    plain 4     one token a row, a runner keeping 1 + 3 entries a slot (what speculation costs
                a step in which no row verifies: the `while` of passes runs no trip)
    verify 4    each row its last token + 3 drafts (8 one-token rows, 4 passes of the update)
    rows 8      8 independent one-token rows on the runner without speculation (the same row
                bucket as "verify 4", one pass)

best of 11 runs, the four alternating. Accuracy beside it: the verification's logits against the
same tokens computed one step at a time without speculation.

    cd <repo> && python bench/deltanet/verify_cost.py      (docs/benchmarks.md, "Qwen3.5")
"""
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import transformers

sys.path.insert(0, '.')
from ferrox_jax.host_batch import HostBatch  # noqa: E402
from ferrox_jax.plan import RowPlan, StepPlan  # noqa: E402
from ferrox_jax.runner import ModelRunner  # noqa: E402
from models.loader import load_checkpoint  # noqa: E402
from tests.support import family_checks as fc  # noqa: E402
from tests.support.engine_helpers import shuffled_blocks  # noqa: E402

HISTORY, K, REPS = 128, 3, 11
cfg = transformers.Qwen3_5TextConfig(
    hidden_size=512, intermediate_size=1024, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
    head_dim=64, max_position_embeddings=2048, tie_word_embeddings=False, linear_num_key_heads=4,
    linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64,
    layer_types=["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"])
cfg.architectures = ["Qwen3_5ForCausalLM"]
ckpt = load_checkpoint(str(fc.make_checkpoint(Path(tempfile.mkdtemp()) / "qwen3_5", cfg)))
geometry = dict(num_blocks=200, block_size=16, max_rows=8, max_chunk_tokens=128, max_context=512)
runners = {"plain": ModelRunner(ckpt.model, **geometry), "spec": ModelRunner(ckpt.model, state_entries=1 + K, **geometry)}
rng = np.random.RandomState(0)
prompts = [rng.randint(0, 380, HISTORY + 1 + K).tolist() for _ in range(8)]
tables = [tuple(b) for b in np.asarray(shuffled_blocks(160, 200, 1)).reshape(8, 20).tolist()]


def row(i, tokens, start, drafts=0):
    return RowPlan(row_id=i + 1, token_ids=tuple(tokens), start_pos=start, block_ids=tables[i], sample=True,
                   state_slot=i + 1, num_draft_tokens=drafts)


def step(runner, rows):
    batch = HostBatch.build(StepPlan(decode=tuple(rows)), runner.geometry)
    return runner.sample(runner.forward(batch), None)


for runner in runners.values():  # every row's first HISTORY positions, in prompt chunks
    for i in range(8):
        for s in range(0, HISTORY, 128):
            runner.run_logits([RowPlan(row_id=i + 1, token_ids=tuple(prompts[i][s:s + 128]), start_pos=s,
                                       block_ids=tables[i], sample=False, state_slot=i + 1)])
    runner.warmup()

# Accuracy: the verification step's greedy tokens and their logprobs after each of the 1 + K
# positions against the same tokens one step at a time without speculation, first, on untouched
# states (the timed runs below overwrite them).
verify = step(runners["spec"], [row(i, prompts[i][HISTORY:HISTORY + 1 + K], HISTORY, K) for i in range(2)])
one = [step(runners["plain"], [row(i, [prompts[i][HISTORY + j]], HISTORY + j) for i in range(2)]) for j in range(1 + K)]
one_tokens = np.stack([o.tokens[:, 0] for o in one], axis=1)
one_logprob = np.stack([o.logprob[:, 0] for o in one], axis=1)
err = float(np.abs(verify.logprob[:, :1 + K] - one_logprob).max())
print(f"verification vs one token a step (2 rows): same greedy tokens "
      f"{bool((verify.tokens[:, :1 + K] == one_tokens).all())}, max |dlogprob| {err:.2e}")
# The same, the one-token steps padded with the other 6 rows to the verification's 8-row
# bucket (the CPU matmuls sum in other pieces from 5 rows: ferrox_jax/speculative.py). The two
# rows' states must start again from position HISTORY: restore them by recomputing their history.
for i in range(2):
    runners["plain"].run_logits([RowPlan(row_id=i + 1, token_ids=tuple(prompts[i][:HISTORY]), start_pos=0,
                                         block_ids=tables[i], sample=False, state_slot=i + 1)])
padded = [step(runners["plain"], [row(i, [prompts[i][HISTORY + j]], HISTORY + j) for i in range(2)]
               + [row(i, [prompts[i][HISTORY]], HISTORY) for i in range(2, 8)]) for j in range(1 + K)]
err8 = float(np.abs(verify.logprob[:, :1 + K] - np.stack([o.logprob[:2, 0] for o in padded], axis=1)).max())
print(f"verification vs one token a step in the 8-row bucket: max |dlogprob| {err8:.2e}")

cases = {
    "plain 1": ("plain", [row(i, prompts[i][HISTORY:HISTORY + 1], HISTORY) for i in range(2)]),
    "plain 4": ("spec", [row(i, prompts[i][HISTORY:HISTORY + 1], HISTORY) for i in range(2)]),
    "verify 4": ("spec", [row(i, prompts[i][HISTORY:HISTORY + 1 + K], HISTORY, K) for i in range(2)]),
    "rows 8": ("plain", [row(i, prompts[i][HISTORY:HISTORY + 1], HISTORY) for i in range(8)]),
}
best = {}
for rep in range(REPS):
    names = list(cases) if rep % 2 == 0 else list(reversed(cases))
    for name in names:
        runner, rows = cases[name]
        t0 = time.perf_counter()
        step(runners[runner], rows)
        best[name] = min(best.get(name, 1e9), time.perf_counter() - t0)
print(f"best of {REPS} (ms):", {k: round(v * 1e3, 2) for k, v in best.items()},
      "recompiles:", {k: r.recompiles_after_warmup for k, r in runners.items()})
