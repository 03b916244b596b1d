"""The chunked Gated DeltaNet prefill (models/deltanet_chunked.py) against the token-by-token
scan (models/deltanet.py:gated_delta_rule), then inside the engine on a tiny Qwen3.5.

Layer level: random inputs shaped as the layer makes them (l2-normed q / k, q scaled, decays
g <= 0 from mild to strong per head, beta in (0, 1)), nonzero start states, rows of different
lengths in one segment (a full row, shorter rows padded with random, nonzero inputs, an
all-padding row as the null slot's), lengths that are not a multiple of the block. Outputs on
valid tokens and end states agree to 1e-5 (float32 both sides, summation order only). The
negative controls show the check catches the decay applied inside a block without its
cumulative sum, and padding tokens not masked.

Engine level: prompt chunks long enough for the chunked form, each continuing from the state
its slot holds, against HF transformers (1e-4, as the family tests); and a warmed-up runner
whose chunk buckets trace the chunked form serving a mixed workload with 0 recompiles.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ferrox_jax.plan import RowPlan, StepPlan
from ferrox_jax.request import RowSampling
from ferrox_jax.runner import ModelRunner
from ferrox_jax.step_output import run_plan
from models import deltanet, deltanet_chunked
from models.loader import load_checkpoint
from tests.support import family_checks as fc
from tests.support.engine_helpers import make_runner, shuffled_blocks

H, DK, DV = 4, 16, 8  # dk != dv: a transposed product would not even run


def layer_inputs(seed: int, lengths: list[int], t: int):
    """(q, k, v, g, beta, state0, valid) for len(lengths) rows of t tokens, as the layer feeds the rule."""
    rng = np.random.RandomState(seed)
    b = len(lengths)

    def f32(*shape, scale=1.0):
        return jnp.asarray(rng.randn(*shape) * scale, jnp.float32)

    q = deltanet.l2norm(f32(b, t, H, DK)) * DK ** -0.5
    k = deltanet.l2norm(f32(b, t, H, DK))
    # -exp(A_log) * softplus(a + dt_bias) with A = 0.05, 0.3, 1, 3 per head: a head nearly keeping
    # its state over a block, one forgetting it within a few tokens (exp of the cumsum underflows).
    g = -jnp.asarray([0.05, 0.3, 1.0, 3.0], jnp.float32) * jax.nn.softplus(f32(b, t, H))
    beta = jax.nn.sigmoid(f32(b, t, H))
    valid = jnp.arange(t)[None, :] < jnp.asarray(lengths)[:, None]
    return q, k, f32(b, t, H, DV), g, beta, f32(b, H, DK, DV, scale=0.5), valid


def scan_vs_chunked(seed, lengths, t, chunk):
    """(max |o diff| over valid tokens, max |end state diff|, the chunked end state, state0)."""
    args = layer_inputs(seed, lengths, t)
    state0, valid = args[-2:]
    # fresh functions, so each call traces anew (and a test's patched helper is the one traced)
    o_scan, s_scan = jax.jit(lambda *a: deltanet.gated_delta_rule(*a))(*args)
    o_chunk, s_chunk = jax.jit(lambda *a: deltanet_chunked.chunked_gated_delta_rule(*a, chunk=chunk))(*args)
    assert o_chunk.shape == o_scan.shape and s_chunk.shape == s_scan.shape
    o_err = float(jnp.max(jnp.where(valid[..., None, None], jnp.abs(o_chunk - o_scan), 0.0)))
    return o_err, float(jnp.max(jnp.abs(s_chunk - s_scan))), s_chunk, state0


# (lengths per row, tokens per row, block): 2 blocks of 64 with the second partial; 3 blocks of
# 16 with rows ending mid-block, at a block's end and after one token; one block shorter than 64.
CASES = [([100, 37, 64, 0], 100, 64), ([40, 17, 16, 1], 40, 16), ([48, 29], 48, 64)]


@pytest.mark.parametrize("lengths,t,chunk", CASES)
def test_chunked_rule_equals_the_scan_on_ragged_rows(lengths, t, chunk):
    o_err, s_err, state, state0 = scan_vs_chunked(0, lengths, t, chunk)
    # 1e-5: float32 on both sides, outputs and states of order 1; only the summation order differs.
    assert o_err <= 1e-5 and s_err <= 1e-5, f"chunked != scan: outputs {o_err:.3g}, end states {s_err:.3g}"
    for i, n in enumerate(lengths):
        if n == 0:  # decay exp(0) = 1 and a zero correction: the padding row's state, bit for bit
            assert np.array_equal(state[i], state0[i]), "a row of padding changed its state"


def test_negative_control_decay_without_its_cumulative_sum_is_caught(monkeypatch):
    # each token's own decay in place of the product since the block's start
    monkeypatch.setattr(deltanet_chunked, "cumulative_decay", lambda g: g)
    o_err, s_err, _, _ = scan_vs_chunked(0, *CASES[0])
    assert o_err > 1e-2 and s_err > 1e-2, f"a decay not accumulated went unnoticed ({o_err:.3g}, {s_err:.3g})"


def test_negative_control_padding_not_masked_is_caught(monkeypatch):
    monkeypatch.setattr(deltanet_chunked, "mask_padding", lambda q, k, v, g, beta, valid: (q, k, v, g, beta))
    _, s_err, _, _ = scan_vs_chunked(0, *CASES[0])
    assert s_err > 1e-2, f"padding tokens advancing the state went unnoticed ({s_err:.3g})"


# ---- in the engine -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = fc.make_tiny_qwen3_5(tmp_path_factory.mktemp("dchunk") / "tiny-qwen3_5")
    return path, fc.hf_model(path)


@pytest.fixture
def traced(monkeypatch):
    """Tokens per row of every segment traced through the chunked form (counted at trace time).
    Unsharded runners share one jit (`ferrox_jax/step.py:jit_steps`): its traces are cleared
    first, so that shapes another test traced are traced again here, and after."""
    seen, real = [], deltanet_chunked.chunked_gated_delta_rule

    def counting(q, *args, **kwargs):
        seen.append(q.shape[1])
        return real(q, *args, **kwargs)

    jax.clear_caches()
    monkeypatch.setattr(deltanet_chunked, "chunked_gated_delta_rule", counting)
    yield seen
    jax.clear_caches()


def _row(tokens, start, blocks, slot, sample=False):
    return RowPlan(row_id=slot, token_ids=tuple(tokens), start_pos=start, block_ids=tuple(blocks), sample=sample,
                   state_slot=slot, sampling=RowSampling(temperature=0.0))


def test_prompt_chunks_continue_from_their_slot_and_match_transformers(tiny, traced):
    path, hf = tiny
    runner, ckpt = make_runner(path, num_blocks=96, block_size=8, max_chunk_tokens=64, max_context=256)
    prompt = np.random.RandomState(3).randint(0, ckpt.config.vocab_size, 100).tolist()
    ref = fc.hf_logits(hf, prompt)
    blocks = shuffled_blocks(13, 96, seed=4)  # 100 positions in blocks of 8
    # 64 + 36 tokens: the second chunk starts from the states the first left in slot 1
    chunks = [runner.run_logits([_row(prompt[s:s + 64], s, blocks, slot=1)])[0] for s in (0, 64)]
    chunked_err = float(np.abs(np.concatenate(chunks) - ref).max())
    one_shot = runner.run_logits([_row(prompt, 0, shuffled_blocks(13, 96, seed=5), slot=2)])[0]
    one_shot_err = float(np.abs(one_shot - ref).max())
    print(f"vs HF: chunks of 64 + 36 {chunked_err:.2e}, one 100-token step {one_shot_err:.2e}")
    # 1e-4 as the family tests: float32 on both sides (HF runs its own chunked form, in blocks of 64)
    assert chunked_err < fc.ATOL and one_shot_err < fc.ATOL, (chunked_err, one_shot_err)
    assert {64, 36, 100} <= set(traced), f"the prompt chunks took the chunked form (traced: {traced})"


def test_chunk_buckets_take_the_chunked_form_with_zero_recompiles(tiny, traced):
    path, _ = tiny
    runner = ModelRunner(load_checkpoint(str(path)).model, num_blocks=64, block_size=8, max_rows=2,
                         max_chunk_tokens=64, max_context=256)
    runner.warmup()
    buckets = set(runner.buckets.chunk_tokens)
    # the chunk buckets (16, 32, 64) at or past the length rule's threshold, alone or beside decode rows
    assert set(traced) == {t for t in buckets if deltanet_chunked.uses_chunked(t)} != set(), traced
    rng = np.random.RandomState(6)
    ids = shuffled_blocks(40, 64, seed=7)
    prompts = {1: rng.randint(0, 300, 100).tolist(), 2: rng.randint(0, 300, 23).tolist()}
    blocks = {1: ids[:20], 2: ids[20:]}
    run_plan(runner, StepPlan(chunks=(_row(prompts[1][:64], 0, blocks[1], 1),)))  # 64-token bucket
    out = run_plan(runner, StepPlan(chunks=(_row(prompts[2], 0, blocks[2], 2, sample=True),)))  # 32
    tokens = {2: out.results[2].token_id}
    # row 2 decodes while row 1's last 36 tokens prefill (a mixed step, 64-token bucket)
    out = run_plan(runner, StepPlan(decode=(_row([tokens[2]], 23, blocks[2], 2, sample=True),),
                                    chunks=(_row(prompts[1][64:], 64, blocks[1], 1, sample=True),)))
    tokens = {i: out.results[i].token_id for i in (1, 2)}
    done = {1: 100, 2: 24}
    for _ in range(3):
        out = run_plan(runner, StepPlan(decode=tuple(_row([tokens[i]], done[i], blocks[i], i, sample=True)
                                                     for i in (1, 2))))
        tokens = {i: out.results[i].token_id for i in (1, 2)}
        done = {i: done[i] + 1 for i in (1, 2)}
    assert runner.recompiles_after_warmup == 0
