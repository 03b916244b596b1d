"""Speculative decoding by prompt lookup: the tokens are the non-speculative ones, greedy and
sampled, alone and batched, with every stop condition and a thinking budget's forced marker;
drafts were really accepted. The same on the default model is
tests/engine/test_speculative_default_model.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ferrox_jax.config import SpeculativeConfig
from ferrox_jax.request import Job, JobState, RowSampling, ThinkingBudget
from ferrox_jax.speculative import Speculator, count_accepted, propose_ngram
from tests.support.engine_helpers import make_runner
from tests.support.spec_driver import GREEDY, SPEC, STEP_ROWS, copy_prompt, drive, greedy_jobs
from tests.support.xla_flags import with_devices

ROOT = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------- host-side pieces


def test_propose_ngram_takes_the_latest_longest_match():
    #        0  1  2  3  4  5  6  7  8  9
    text = [5, 6, 7, 8, 5, 6, 9, 1, 5, 6]
    # suffix (5, 6) last occurred at 4..5, followed by 9, 1, 5, 6: the latest, not the one at 0
    assert propose_ngram(text, 3, 1, 3) == (9, 1, 5)
    # suffix (1, 5, 6) never occurred before; ngram_min 3 finds nothing
    assert propose_ngram(text, 3, 3, 3) == ()
    assert propose_ngram(text, 0, 1, 3) == ()
    # a match near the end proposes only what follows it
    assert propose_ngram([1, 2, 3, 1, 2], 4, 1, 2) == (3, 1, 2)


def test_count_accepted_stops_at_the_first_mismatch():
    assert count_accepted((4, 5, 6), [4, 5, 7, 9]) == 2
    assert count_accepted((4, 5, 6), [3, 5, 6, 9]) == 0
    assert count_accepted((4, 5, 6), [4, 5, 6, 9]) == 3


def test_bench_reports_the_free_verification_bound_and_the_verifying_step_cost():
    from tools.bench.bench_speculative import Sample, step_costs

    def run(engine, c, steps, ticks, tick_s, verifying=0):
        return Sample(engine, "copy", c, 0, tick_s, 0, 0, 0, [], decode_steps=steps, ticks=ticks, tick_s=tick_s,
                      verifying_steps=verifying)

    # 100 one-token ticks of 10 ms without; with: 60 ticks, 30 of them verifying at 15 ms
    off = [run("off", 1, 96, 100, 1.0)]
    ngram = [run("ngram", 1, 56, 60, 30 * 0.010 + 30 * 0.015, verifying=30)]
    costs = step_costs(off, ngram)
    assert costs["free_verification_bound"] == round(96 / 56, 3)
    assert costs["verify_step_cost"] == 1.5
    # above concurrency 1 a step holds many rows: no per-step cost, the bound still stands
    many = step_costs([run("off", 32, 64, 70, 1.0)], [run("ngram", 32, 60, 66, 1.0, verifying=5)])
    assert many["verify_step_cost"] is None and many["free_verification_bound"] == round(64 / 60, 3)
    # too few verifying ticks to tell their cost from the noise in the mean tick
    few = step_costs(off, [run("ngram", 1, 90, 94, 0.95, verifying=10)])
    assert few["verify_step_cost"] is None and few["free_verification_bound"] == round(96 / 90, 3)


def test_config_reads_vllm_json_and_checks_fields():
    cfg = SpeculativeConfig.from_json('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5, '
                                      '"prompt_lookup_min": 2}')
    assert (cfg.num_speculative_tokens, cfg.ngram_min, cfg.ngram_max, cfg.verify_tokens) == (3, 2, 5, 4)
    with pytest.raises(ValueError, match="unknown key 'draft'"):
        SpeculativeConfig.from_json('{"draft": 1}')
    with pytest.raises(ValueError, match="ngram_min"):
        SpeculativeConfig(ngram_min=5, ngram_max=2)
    with pytest.raises(ValueError, match="method"):
        SpeculativeConfig(method="eagle")


class _Tokenizer:
    stop_token_ids = (0,)

    def decode(self, ids, **_):
        return "".join(chr(65 + i % 26) for i in ids)


def _row(matcher=None, **spec_fields):
    spec = Job(request_id="x", prompt_token_ids=(1, 2, 3),
               **{"sampling": GREEDY, "max_tokens": 10, **spec_fields})
    job = JobState(spec, 1, _Tokenizer(), (lambda grammar: matcher) if matcher is not None else None)
    return job.rows[0]


def test_rows_whose_next_token_depends_on_more_than_the_step_do_not_speculate():
    speculator = Speculator(SpeculativeConfig(num_speculative_tokens=4))
    assert speculator.max_drafts(_row()) == 4
    # structured output: the grammar's mask at a draft position is unknown
    row = _row()
    row.matcher = object()
    assert speculator.max_drafts(row) == 0
    assert speculator.max_drafts(_row(sampling=RowSampling(temperature=0.0, presence_penalty=0.5))) == 0
    assert speculator.max_drafts(_row(sampling=RowSampling(temperature=0.0, repetition_penalty=1.1))) == 0
    assert speculator.max_drafts(_row(min_tokens=3)) == 0
    # logit_bias is the same at every position
    assert speculator.max_drafts(_row(sampling=RowSampling(temperature=0.0, logit_bias=((5, 1.0),)))) == 4
    # 10 max_tokens, 8 generated: 1 more draft at most (2 tokens this step)
    row = _row()
    row.num_generated_tokens = 8
    assert speculator.max_drafts(row) == 1


def _extend(speculator, decode, rows, blocks, max_tokens):
    """The speculator's part of a tick: the rows' draft requests, prompt lookup's answer,
    the drafts added to the rows (what `Scheduler.schedule` / `add_drafts` do around the
    owner loop's proposer)."""
    from ferrox_jax.plan import StepPlan
    from ferrox_jax.speculative import NgramProposer

    decode, requests, room = speculator.plan_drafts(decode, rows, blocks, max_tokens)
    drafts = NgramProposer(speculator.config).propose(StepPlan(decode=decode, draft_requests=requests,
                                                               max_draft_tokens=room))
    return speculator.add_drafts(decode, requests, drafts, rows, blocks)


def test_a_row_whose_drafts_are_rejected_backs_off_doubling():
    from ferrox_jax.plan import RowPlan
    from ferrox_jax.request import RowResult

    class Blocks:
        def prepare_decode(self, row, num_tokens=1):
            pass

    speculator = Speculator(SpeculativeConfig(num_speculative_tokens=2, ngram_min=1))
    row = _row()
    row.token_ids[:] = [1, 2, 1, 2]  # the suffix (1, 2) occurred before: drafts (1, 2)
    plan = RowPlan(row_id=row.row_id, token_ids=(2,), start_pos=3, block_ids=(), sample=True)

    def step(accepted):
        (planned,) = _extend(speculator, (plan,), {row.row_id: row}, Blocks(), max_tokens=8)
        if planned.num_draft_tokens:
            speculator.record(planned, RowResult(row.row_id, 1, following=(RowResult(row.row_id, 2),) * accepted),
                              is_finished=False)
        return planned.num_draft_tokens

    # rejected: skip 1 step, then 2, then 4; an accepted draft resets it
    assert [step(0) for _ in range(10)] == [2, 0, 2, 0, 0, 2, 0, 0, 0, 0]
    assert [step(1) for _ in range(3)] == [2, 2, 2]
    assert speculator.counters.num_drafts == 3 + 3 and speculator.counters.num_accepted_tokens == 3


def test_adaptive_length_doubles_while_every_draft_is_kept_and_resets_on_a_rejection():
    from ferrox_jax.plan import RowPlan
    from ferrox_jax.request import RowResult

    class Blocks:
        def prepare_decode(self, row, num_tokens=1):
            pass

    with pytest.raises(ValueError, match="max_speculative_tokens"):
        SpeculativeConfig(num_speculative_tokens=4, max_speculative_tokens=2)
    config = SpeculativeConfig(num_speculative_tokens=2, ngram_min=1, max_speculative_tokens=7)
    assert config.most_drafts == 7 and SpeculativeConfig.from_json('{"max_speculative_tokens": 7}').most_drafts == 7
    speculator = Speculator(config)
    assert len(speculator.counters.accepted_per_pos) == 0 and speculator.counters.num_speculative_tokens == 7
    row = _row(max_tokens=100)
    row.token_ids[:] = list(range(10, 40)) + [10, 11, 12]  # copying: the lookup finds 27 tokens to follow
    plan = RowPlan(row_id=row.row_id, token_ids=(12,), start_pos=32, block_ids=(), sample=True)

    def step(rejected_at=None, room=32):
        (planned,) = _extend(speculator, (plan,), {row.row_id: row}, Blocks(), max_tokens=room)
        n = planned.num_draft_tokens
        kept = n if rejected_at is None else rejected_at
        speculator.record(planned, RowResult(row.row_id, 1, following=(RowResult(row.row_id, 2),) * kept),
                          is_finished=False)
        return n

    # all kept: 2, 5 (1 + k doubles), 7 (the maximum), 7; one rejected: back to 2, then up again
    assert [step() for _ in range(4)] == [2, 5, 7, 7]
    assert step(rejected_at=3) == 7
    assert [step() for _ in range(3)] == [2, 5, 7]
    assert step(room=4) == 3, "a step's rows cap the drafts (1 + 3 of 4 rows)"
    assert speculator.counters.accepted_per_pos[6] == 3, "per-position counts cover the longest drafts"
    # a finished row is forgotten: a new row with the same id would start at k
    (planned,) = _extend(speculator, (plan,), {row.row_id: row}, Blocks(), max_tokens=32)
    speculator.record(planned, RowResult(row.row_id, 1), is_finished=True)
    assert speculator.max_drafts(row) == 2
    # fixed length (the default, 0): always k
    fixed = Speculator(SpeculativeConfig(num_speculative_tokens=2, ngram_min=1))
    (planned,) = _extend(fixed, (plan,), {row.row_id: row}, Blocks(), max_tokens=32)
    fixed.record(planned, RowResult(row.row_id, 1, following=(RowResult(row.row_id, 2),) * 2), is_finished=False)
    assert fixed.max_drafts(row) == 2


# ---------------------------------------------------------------- the real runner


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    """Three families: Llama, Qwen2 (q/k/v biases), Qwen3 (q/k norms, own head_dim)."""
    import transformers

    from tests.support import family_checks as fc
    from tests.support.tiny_model import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("spec")
    qwen3 = transformers.Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                     max_position_embeddings=512, tie_word_embeddings=False)
    return {"llama": make_tiny_checkpoint(root / "llama", "llama"),
            "qwen2": make_tiny_checkpoint(root / "qwen2", "qwen2"),
            "qwen3": fc.make_checkpoint(root / "qwen3", qwen3)}


@pytest.fixture(scope="module")
def runners(families):
    return {name: make_runner(path, max_rows=STEP_ROWS) for name, path in families.items()}


def test_a_speculating_row_is_consecutive_decode_rows(runners):
    from ferrox_jax.buckets import StepShape
    from ferrox_jax.host_batch import HostBatch
    from ferrox_jax.plan import RowPlan, StepPlan

    runner, _ = runners["llama"]
    rows = (RowPlan(row_id=1, token_ids=(5, 6, 7, 8, 9), start_pos=10, block_ids=(3, 4), sample=True,
                    num_draft_tokens=4),
            RowPlan(row_id=2, token_ids=(5,), start_pos=3, block_ids=(7,), sample=True))
    shape, order, forward = runner._pad(HostBatch.build(StepPlan(decode=rows), runner.geometry))
    assert shape == StepShape(8, 0, 0), "5 + 1 one-token rows: the 8-row decode bucket, no shape of its own"
    assert SPEC.step_rows(8) == 20 and SPEC.step_rows(32) == 32, "4 speculating rows of 1 + 4 tokens"
    assert order[:6].tolist() == [0, 0, 0, 0, 0, 1]
    assert forward.tokens[:6].tolist() == [5, 6, 7, 8, 9, 5]
    assert forward.positions[:6].tolist() == [10, 11, 12, 13, 14, 3]
    assert (forward.block_tables[0][:5, :2] == [3, 4]).all(), "every position reads the row's own table"


def _assert_same(off, on, what):
    assert on.tokens == off.tokens, f"{what}: speculation changed the tokens"
    assert on.finish == off.finish, f"{what}: speculation changed the finish reasons"


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_greedy_tokens_identical_alone_and_batched(runners, family):
    runner, ckpt = runners[family]
    jobs = greedy_jobs(ckpt.tokenizer)
    for batch in ([jobs[0]], jobs):
        off = drive(runner, ckpt.tokenizer, batch, None)
        on = drive(runner, ckpt.tokenizer, batch, SPEC)
        _assert_same(off, on, f"{family}, {len(batch)} rows")
        counters = on.scheduler.speculator.counters
        assert counters.num_accepted_tokens > 0, f"{family}: no draft was ever accepted (nothing was tested)"
        assert on.num_steps < off.num_steps, "accepted drafts must save steps"
        assert on.scheduler.budget.num_held_blocks == 0
    # verification adds no shape: every one used is among those warm-up compiles
    assert set(runner._compiled) <= set(runner.compile_keys())


def test_stops_max_tokens_logprobs_n_and_prefix_cache_stay_exact(runners):
    runner, ckpt = runners["llama"]
    tok = ckpt.tokenizer
    prompt = copy_prompt(tok)
    reference = drive(runner, tok, greedy_jobs(tok, 40)[:1], None).tokens["r0"][0]
    stop_id = reference[9]
    stop_text = tok.decode(reference[12:14])
    logprobs = RowSampling(temperature=0.0, logprobs=2)
    jobs = [Job(request_id="stop_id", prompt_token_ids=prompt, max_tokens=40, sampling=GREEDY,
                stop_token_ids=(stop_id,)),
            Job(request_id="stop_str", prompt_token_ids=prompt, max_tokens=40, sampling=GREEDY,
                stop=(stop_text,)),
            Job(request_id="len", prompt_token_ids=prompt, max_tokens=7, sampling=logprobs),
            Job(request_id="n2", prompt_token_ids=prompt, max_tokens=20, sampling=GREEDY, n=2)]
    # the same prompt four times; with 4 rows at once n=2 waits, then starts from the prefix cache
    off = drive(runner, tok, jobs, None, max_rows=4)
    on = drive(runner, tok, jobs, SPEC, max_rows=4)
    _assert_same(off, on, "stops")
    assert on.finish["len"] == ["length"] and len(on.tokens["len"][0]) == 7
    assert on.scheduler.blocks.num_hit_tokens > 0, "the prefix cache was not exercised"
    np.testing.assert_allclose(on.logprobs["len"][0], off.logprobs["len"][0], atol=1e-4,
                               err_msg="verify logprobs (tolerance: another attention path, float32)")
    assert on.scheduler.speculator.counters.num_accepted_tokens > 0


def test_a_thinking_budgets_forced_marker_stays_exact(runners):
    runner, ckpt = runners["llama"]
    tok = ckpt.tokenizer
    prompt = copy_prompt(tok)
    marker = tuple(tok.encode("</think>", add_special_tokens=False))  # several tokens here, forced one per step
    # 15: the row is then in a loop whose drafts are accepted, so the step that forces the
    # marker's first token has verified drafts after it (dropping them is what keeps it exact)
    budget = ThinkingBudget(max_tokens=15, end_token_ids=marker, starts_inside=True)
    jobs = [Job(request_id="cut", prompt_token_ids=prompt, max_tokens=30, sampling=GREEDY, thinking_budget=budget),
            Job(request_id="free", prompt_token_ids=prompt[1:], max_tokens=30, sampling=GREEDY)]
    off = drive(runner, tok, jobs, None)
    on = drive(runner, tok, jobs, SPEC)
    _assert_same(off, on, "a thinking budget")
    cut = on.tokens["cut"][0]
    assert tuple(cut[15:15 + len(marker)]) == marker, "the marker after 15 tokens, whole"
    assert marker not in {tuple(off.tokens["free"][0][i:i + len(marker)]) for i in range(30)}, "only where forced"
    assert on.scheduler.speculator.counters.num_accepted_tokens > 0, "drafts were accepted around the marker"


def test_cancel_mid_run_frees_every_block(runners):
    runner, ckpt = runners["llama"]
    jobs = greedy_jobs(ckpt.tokenizer, 40)

    def cancel_at_step_6(scheduler, step):
        if step == 6:
            scheduler.cancel("r1")

    run = drive(runner, ckpt.tokenizer, jobs, SPEC, on_step=cancel_at_step_6)
    assert run.finish["r1"] == ["cancelled"]
    assert run.scheduler.budget.num_held_blocks == 0 and run.scheduler.budget.num_owed_blocks == 0


# Two tokens the sampled tests' prompt alternates, and the logit bias that makes them likely:
# a tiny random model's own distribution is too flat for any draft to be accepted.
A, B = 40, 41
PEAKED = ((A, 8.0), (B, 8.0))


def _sampled_jobs(seed0, count, max_tokens, n=1):
    return [Job(request_id=f"j{i}", prompt_token_ids=(A, B) * 12, max_tokens=max_tokens, n=n,
                sampling=RowSampling(temperature=1.0, seed=seed0 + i, logit_bias=PEAKED))
            for i in range(count)]


def test_seeded_sampling_is_unchanged_seed_for_seed(runners):
    """The shared (seed, position) noise makes verification the coupled form of the
    one-hot rejection rule: each seed gives the non-speculative tokens exactly."""
    runner, ckpt = runners["llama"]
    jobs = _sampled_jobs(0, 4, 12)
    off = drive(runner, ckpt.tokenizer, jobs, None)
    on = drive(runner, ckpt.tokenizer, jobs, SPEC)
    _assert_same(off, on, "sampled")
    assert on.scheduler.speculator.counters.num_accepted_tokens > 0


def test_sampled_distribution_is_unchanged_chi_square(runners):
    """Two-sample chi-square over disjoint seeds (so the coupling above plays no part):
    the 2nd-4th generated tokens (the 1st comes from the prefill, which never speculates),
    160 rows each way, bins = the outcomes seen >= 8 times overall plus "other"; the 0.1 %
    critical value for the bins' degrees of freedom."""
    runner, ckpt = runners["llama"]

    def outcomes(seed0, speculative):
        run = drive(runner, ckpt.tokenizer, _sampled_jobs(seed0, 40, 4, n=4), speculative)
        return [tuple(t[1:4]) for rows in run.tokens.values() for t in rows], run

    off, _ = outcomes(0, None)
    on, run = outcomes(100_000, SPEC)
    counters = run.scheduler.speculator.counters
    assert counters.num_accepted_tokens > 20, f"too few accepted drafts to test anything: {counters}"
    stat, dof = _chi_square(off, on, min_count=8)
    assert dof >= 4, "too few distinct outcomes to test anything"
    assert stat < _CHI2_999[dof], f"chi-square {stat:.1f} with {dof} dof: the distribution moved"


# 99.9th percentile of chi-square by degrees of freedom (scipy.stats.chi2.ppf(0.999, dof)).
_CHI2_999 = {2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32, 8: 26.12, 9: 27.88, 10: 29.59,
             11: 31.26, 12: 32.91, 13: 34.53, 14: 36.12, 15: 37.70, 16: 39.25, 17: 40.79, 18: 42.31, 19: 43.82,
             20: 45.31}


def _chi_square(a, b, min_count):
    from collections import Counter

    both = Counter(a) + Counter(b)
    bins = [x for x, c in both.most_common() if c >= min_count][:20]
    table = np.array([[Counter(s)[x] for x in bins] + [sum(1 for y in s if y not in bins)] for s in (a, b)], float)
    table = table[:, table.sum(axis=0) > 0]
    expected = table.sum(axis=1, keepdims=True) * table.sum(axis=0, keepdims=True) / table.sum()
    return float(((table - expected) ** 2 / expected).sum()), table.shape[1] - 1


def test_greedy_identical_under_tensor_parallel_on_two_devices(families):
    env = {**os.environ, "XLA_FLAGS": with_devices(2), "JAX_PLATFORMS": "cpu"}
    driver = ROOT / "tests" / "support" / "spec_driver.py"
    proc = subprocess.run([sys.executable, str(driver), "tp", str(families["llama"])],
                          capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["devices"] == 2
    assert got["on"] == got["off"], "speculation changed the tokens under tensor parallelism"
    assert got["accepted"] > 0 and got["steps_on"] < got["steps_off"]
