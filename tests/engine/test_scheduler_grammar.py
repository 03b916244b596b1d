"""The scheduler's side of constrained rows, against the scripted runner (which ignores
masks, so a script can also play a token the grammar forbids): matchers in the plan,
stop-token bans, and how a grammar ends a row."""

from __future__ import annotations

import pytest

from ferrox_jax.config import SchedulerLimits
from ferrox_jax.constraint import GrammarSpec
from ferrox_jax.plan import RowPlan
from ferrox_jax.grammar import GrammarCompiler
from ferrox_jax.request import Job, RowSampling
from ferrox_jax.scheduler import Scheduler
from models.tokenizer import Tokenizer
from tests.support.scripted import ScriptedRunner, run_until_idle, script_token_fn

PROMPT = (5, 6, 7)


@pytest.fixture(scope="module")
def tokenizer(tiny_llama) -> Tokenizer:
    return Tokenizer.from_hf_dir(tiny_llama)


@pytest.fixture(scope="module")
def compiler(tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, tokenizer.vocab_size)


def run(tokenizer, script: list[int], compiler=None, **request):
    """One request whose sampled tokens are `script`; returns (its output, scheduler, runner)."""
    runner = ScriptedRunner(block_size=4, num_blocks=33, token_fn=script_token_fn({PROMPT: script}))
    limits = SchedulerLimits(block_size=4, num_blocks=32, max_rows=4, max_chunk_tokens=16)
    scheduler = Scheduler(limits, tokenizer, new_matcher=compiler.new_matcher if compiler else None)
    scheduler.add_job(Job("r", PROMPT, request.pop("max_tokens", 20), **request))
    outputs = run_until_idle(scheduler, runner)
    return outputs["r", 0], scheduler, runner


def test_a_complete_grammar_ends_the_row_without_a_step_for_the_stop_token(tokenizer, compiler):
    word = tokenizer.encode("yes")
    out, scheduler, runner = run(tokenizer, word + [999], compiler=compiler, grammar=GrammarSpec.choice(["yes", "no"]))
    assert out.text == "yes" and out.finish_reason == "stop"
    assert out.events[-1].num_generated_tokens == len(word), "no token sampled after the choice was complete"
    assert sum(len([s for s in p.chunks + p.decode if s.sample]) for p in runner.plans) == len(word)
    assert scheduler.num_constrained_requests == 1 and scheduler.num_grammar_errors == 0
    assert scheduler.budget.num_held_blocks == 0


def test_a_token_the_grammar_rejects_ends_the_row_with_an_error(tokenizer, compiler):
    script = tokenizer.encode("1") + tokenizer.encode("x")
    out, scheduler, _ = run(tokenizer, script, compiler=compiler, grammar=GrammarSpec.regex(r"[0-9]{1,4}"))
    assert out.finish_reason == "error" and out.text == "1"
    assert "rejected sampled token" in out.events[-1].error and "mask was not applied" in out.events[-1].error
    assert scheduler.num_grammar_errors == 1
    assert scheduler.budget.num_held_blocks == 0, "the failed row's blocks are freed"


def test_a_stop_token_the_grammar_accepts_is_its_end_even_with_ignore_eos(tokenizer, compiler):
    eos = min(tokenizer.stop_token_ids)
    script = tokenizer.encode("12") + [eos]
    out, _, _ = run(tokenizer, script, compiler=compiler, grammar=GrammarSpec.regex(r"[0-9]{1,4}"), ignore_eos=True)
    assert out.text == "12" and out.finish_reason == "stop"
    assert eos not in out.token_ids


def test_unconstrained_ignore_eos_still_writes_the_stop_token(tokenizer):
    """The control: without a grammar, ignore_eos keeps generating through eos."""
    eos = min(tokenizer.stop_token_ids)
    out, _, _ = run(tokenizer, tokenizer.encode("12") + [eos, eos], ignore_eos=True, max_tokens=4)
    assert out.finish_reason == "length" and out.token_ids[-2:] == [eos, eos]


def test_constrained_rows_carry_their_matcher_and_ignore_eos_bans_stop_tokens(tokenizer, compiler):
    grammar = GrammarSpec.regex(r"[0-9]{1,4}")
    out, _, runner = run(tokenizer, tokenizer.encode("1234"), compiler=compiler, grammar=grammar, ignore_eos=True,
                         sampling=RowSampling(logit_bias=((9, 1.5),)))
    assert out.text == "1234" and out.finish_reason == "stop", "four digits: nothing but a stop token can follow"
    sampled = [s for p in runner.plans for s in p.chunks + p.decode if s.sample]
    assert sampled and all(s.is_constrained for s in sampled), "every sampling step of the row is constrained"
    assert all(isinstance(s, RowPlan) and not hasattr(s, "matcher") for s in sampled), "the matcher stays off the plan"
    for step in sampled:
        bias = dict(step.sampling.logit_bias)
        assert all(bias[t] == float("-inf") for t in tokenizer.stop_token_ids), "stop tokens banned"
        assert bias[9] == 1.5, "the request's own logit_bias kept"
    unconstrained, _, runner = run(tokenizer, tokenizer.encode("1234"), max_tokens=2)
    assert all(not s.is_constrained and not s.sampling.logit_bias for p in runner.plans for s in p.chunks + p.decode)
