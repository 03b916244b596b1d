"""Speculative decoding with a draft model (`--speculative draft`): the tokens are the target's
own, greedy and seeded, alone and batched, with stops, n > 1, the prefix cache, a cancel and a
thinking budget's forced marker; the draft's KV lives in the target's block ids, so every block returns to the one budget."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from ferrox_jax.config import EngineConfig, SpeculativeConfig
from ferrox_jax.draft import DraftModel
from ferrox_jax.request import Job, RowSampling, ThinkingBudget
from ferrox_jax.runner import ModelRunner
from tests.support.spec_driver import GREEDY, STEP_ROWS, copy_prompt, drive, greedy_jobs
from tests.engine.test_speculative import _CHI2_999, PEAKED, ROOT, _assert_same, _chi_square, _sampled_jobs
from tests.support.xla_flags import with_devices

DRAFT = SpeculativeConfig(method="draft", draft_model="(attached in the test)", num_speculative_tokens=4, max_rows=4)


def _draft_runner(path, target: ModelRunner) -> ModelRunner:
    from models.loader import load_checkpoint

    ckpt = load_checkpoint(str(path))
    return ModelRunner(ckpt.model, num_blocks=target.num_blocks, block_size=target.block_size,
                       max_rows=target.max_rows, max_chunk_tokens=target.max_chunk_tokens,
                       max_context=target.max_context)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A 2-layer tiny Llama (the target) and a 1-layer one of another seed (the draft), on
    the tests' one tokenizer."""
    from tests.support.tiny_model import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("draft")
    return {"target": make_tiny_checkpoint(root / "target", "llama", seed=0, num_layers=2),
            "small": make_tiny_checkpoint(root / "small", "llama", seed=1, num_layers=1)}


@pytest.fixture(scope="module")
def target(checkpoints):
    """One target runner (compiled once); `_with_draft` picks the draft a test uses."""
    from tests.support.engine_helpers import make_runner

    runner, ckpt = make_runner(checkpoints["target"], max_rows=STEP_ROWS)
    drafts = {"small": _draft_runner(checkpoints["small"], runner),
              "self": _draft_runner(checkpoints["target"], runner)}  # a copy of the target: all greedy drafts kept
    return runner, ckpt, drafts


def _with_draft(target, name):
    """(the target runner, its checkpoint, `drive` with the draft model `name`). Swapping
    drafts between runs is sound because each run starts a fresh scheduler (empty budget
    and prefix cache): every block is written anew."""
    runner, ckpt, drafts = target
    return runner, ckpt, functools.partial(drive, draft=DraftModel(drafts[name]))


def test_config_takes_vllms_draft_model_form():
    cfg = SpeculativeConfig.from_json('{"method": "draft_model", "model": "/m/draft", "num_speculative_tokens": 2}')
    assert (cfg.method, cfg.draft_model, cfg.num_speculative_tokens) == ("draft", "/m/draft", 2)
    with pytest.raises(ValueError, match="--draft-model"):
        SpeculativeConfig(method="draft")
    with pytest.raises(ValueError, match="--draft-model"):
        SpeculativeConfig(method="ngram", draft_model="/m/draft")


@pytest.mark.parametrize("draft", ["self", "small"])
def test_greedy_tokens_identical_alone_and_batched(target, draft):
    runner, ckpt, drive = _with_draft(target, draft)
    jobs = greedy_jobs(ckpt.tokenizer)
    for batch in ([jobs[0]], jobs) if draft == "small" else (jobs,):
        off = drive(runner, ckpt.tokenizer, batch, None)
        on = drive(runner, ckpt.tokenizer, batch, DRAFT)
        _assert_same(off, on, f"draft {draft}, {len(batch)} rows")
        c = on.scheduler.speculator.counters
        assert c.num_draft_tokens > 0, "nothing was drafted"
        if draft == "self":  # the target drafting for itself: every greedy draft is its own token
            assert c.num_accepted_tokens == c.num_draft_tokens, c
            assert on.num_steps < off.num_steps
        assert on.scheduler.budget.num_held_blocks == 0 and on.scheduler.budget.num_owed_blocks == 0
    assert set(runner._compiled) <= set(runner.compile_keys())
    draft_runner = target[2][draft]
    assert set(draft_runner._compiled) <= set(draft_runner.compile_keys()), "proposals add no shape"


def test_a_thinking_budgets_forced_marker_keeps_the_draft_consistent(target):
    """The target drafting for itself has every greedy draft accepted, so each step that
    forces a marker token had drafts verified after the token it replaced (dropped), and the
    draft's K/V at that position is its own guess: were it not rewritten with the marker's,
    the next drafts would be rejected."""
    runner, ckpt, drive = _with_draft(target, "self")
    tok = ckpt.tokenizer
    marker = tuple(tok.encode("</think>", add_special_tokens=False))
    budget = ThinkingBudget(max_tokens=6, end_token_ids=marker, starts_inside=True)
    jobs = [Job(request_id="cut", prompt_token_ids=copy_prompt(tok), max_tokens=30, sampling=GREEDY,
                thinking_budget=budget), *greedy_jobs(tok)[1:]]
    off = drive(runner, tok, jobs, None)
    on = drive(runner, tok, jobs, DRAFT)
    _assert_same(off, on, "a thinking budget with a draft model")
    assert tuple(on.tokens["cut"][0][6:6 + len(marker)]) == marker
    c = on.scheduler.speculator.counters
    assert c.num_draft_tokens > 0 and c.num_accepted_tokens == c.num_draft_tokens, c


def test_stops_n_prefix_cache_and_cancel_keep_the_draft_consistent(target):
    """Prefix-cache hits, n = 2's shared prompt block and its copy-on-write carry the draft's
    K/V too: with the target drafting for itself, any stale draft K/V would show as a
    rejected draft. A cancel mid-run returns every block."""
    runner, ckpt, drive = _with_draft(target, "self")
    tok = ckpt.tokenizer
    prompt = copy_prompt(tok)
    reference = drive(runner, tok, greedy_jobs(tok, 40)[:1], None).tokens["r0"][0]
    jobs = [Job(request_id="stop_id", prompt_token_ids=prompt, max_tokens=40, sampling=GREEDY,
                stop_token_ids=(reference[9],)),
            Job(request_id="stop_str", prompt_token_ids=prompt, max_tokens=40, sampling=GREEDY,
                stop=(tok.decode(reference[12:14]),)),
            Job(request_id="len", prompt_token_ids=prompt, max_tokens=7,
                sampling=RowSampling(temperature=0.0, logprobs=2)),
            Job(request_id="n2", prompt_token_ids=prompt, max_tokens=20, sampling=GREEDY, n=2)]
    off = drive(runner, tok, jobs, None, max_rows=4)
    on = drive(runner, tok, jobs, DRAFT, max_rows=4)
    _assert_same(off, on, "stops")
    assert on.scheduler.blocks.num_hit_tokens > 0, "the prefix cache was not exercised"
    c = on.scheduler.speculator.counters
    assert c.num_draft_tokens > 0 and c.num_accepted_tokens == c.num_draft_tokens, c
    np.testing.assert_allclose(on.logprobs["len"][0], off.logprobs["len"][0], atol=1e-4)

    def cancel_at_step_4(scheduler, step):
        if step == 4:
            scheduler.cancel("r1")

    run = drive(runner, tok, greedy_jobs(tok, 40), DRAFT, on_step=cancel_at_step_4)
    assert run.finish["r1"] == ["cancelled"]
    assert run.scheduler.budget.num_held_blocks == 0 and run.scheduler.budget.num_owed_blocks == 0


def test_seeded_sampling_unchanged_seed_for_seed_and_in_distribution(target):
    """Seeded rows: the draft draws with the row's (seed, position) noise, so each seed gives
    the non-speculative tokens exactly; and over disjoint seeds the chi-square test of
    tests/engine/test_speculative.py (2nd-4th tokens, 96 rows each way) finds no shift."""
    runner, ckpt, drive = _with_draft(target, "small")
    jobs = _sampled_jobs(0, 4, 12)
    off = drive(runner, ckpt.tokenizer, jobs, None)
    on = drive(runner, ckpt.tokenizer, jobs, DRAFT)
    _assert_same(off, on, "sampled")
    assert on.scheduler.speculator.counters.num_accepted_tokens > 0

    def outcomes(seed0, speculative):
        run = drive(runner, ckpt.tokenizer, _sampled_jobs(seed0, 24, 4, n=4), speculative)
        return [tuple(t[1:4]) for rows in run.tokens.values() for t in rows], run

    base, _ = outcomes(0, None)
    drafted, run = outcomes(100_000, DRAFT)
    assert run.scheduler.speculator.counters.num_accepted_tokens > 20, run.scheduler.speculator.counters
    stat, dof = _chi_square(base, drafted, min_count=6)
    assert dof >= 4, "too few distinct outcomes to test anything"
    assert stat < _CHI2_999[dof], f"chi-square {stat:.1f} with {dof} dof: the distribution moved"
    assert PEAKED  # the jobs' logit bias makes drafts likely to be accepted at all


def test_greedy_identical_with_a_draft_under_tensor_parallel_on_two_devices(checkpoints):
    """Engines built for tensor parallelism 2 (2 simulated devices) with `--speculative
    draft`: the draft's weights and KV cache are sharded as the target's, the tokens are the
    non-speculative ones, and the target drafting for itself keeps every greedy draft (a
    draft K/V cache out of step with the target's under sharding would show as rejections)."""
    env = {**os.environ, "XLA_FLAGS": with_devices(2), "JAX_PLATFORMS": "cpu"}
    small, same = str(checkpoints["small"]), str(checkpoints["target"])
    driver = ROOT / "tests" / "support" / "spec_driver.py"
    proc = subprocess.run([sys.executable, str(driver), "tp-draft", same, small, same],
                          capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, run in got.items():
        assert run["on"] == run["off"], f"draft {name} changed the tokens under tensor parallelism"
        assert run["drafted"] > 0, f"draft {name} proposed nothing"
        assert 2 in run["weight_devices"] and run["kv_devices"] == [2], f"draft {name} is not sharded: {run}"
        assert run["recompiles"] == 0, f"draft {name} compiled after warm-up: {run}"
    assert got[same]["accepted"] == got[same]["drafted"], "the target drafting for itself lost drafts under sharding"


def test_a_draft_with_another_vocabulary_is_refused(checkpoints, tmp_path):
    import transformers

    from ferrox_jax.engine_builder import open_draft
    from models.loader import open_checkpoint
    from tests.support import family_checks as fc
    from tests.support.tiny_model import make_tokenizer_files

    other = fc.make_checkpoint(tmp_path / "other", transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2))
    make_tokenizer_files(other, vocab_size=300)  # another tokenizer over the same files
    config = EngineConfig(model=str(checkpoints["target"]),
                          speculative=dataclasses.replace(DRAFT, draft_model=str(other)))
    with pytest.raises(ValueError, match="tokenizer differs from the target's"):
        open_draft(config, open_checkpoint(str(checkpoints["target"])), None)
    same = EngineConfig(model=str(checkpoints["target"]),
                        speculative=dataclasses.replace(DRAFT, draft_model=str(checkpoints["small"])))
    assert open_draft(same, open_checkpoint(str(checkpoints["target"])), None) is not None
