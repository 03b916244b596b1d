"""Thinking budgets on the scheduler, tick by tick against the scripted runner: after N
tokens inside the section the end marker's tokens replace the sampled ones, then the row
goes on; a section the model closes itself, an output that opens none, n rows and an
unbudgeted neighbour in the same batch, and speculation on (the drafts verified after a
replaced token are dropped: the tokens equal the non-speculative run's)."""

from __future__ import annotations

import pytest

from ferrox_jax.config import SchedulerLimits, SpeculativeConfig
from ferrox_jax.request import Job, RowSampling, ThinkingBudget
from ferrox_jax.scheduler import Scheduler
from tests.support.scripted import ByteTokenizer, ScriptedRunner, run_until_idle

TOKENIZER = ByteTokenizer()
START, END = TOKENIZER.ids("<think>")[0], TOKENIZER.ids("</think>")[0]  # one token each, as in Qwen3
CYCLE = [ord(c) for c in "abc"]
AFTER_MARKER = ord("z")  # what the scripted model writes after a marker token


def cycling(seed: int, history: tuple[int, ...]) -> int:
    """a -> b -> c -> a ...: the next token follows from the last one alone, so prompt lookup's
    drafts are right and get accepted; after a marker token (or any other) it writes 'z',
    then 'a'. A token verified after a replaced one would therefore show: it follows the
    replaced token, not the marker."""
    last = history[-1]
    if last in CYCLE:
        return CYCLE[(CYCLE.index(last) + 1) % len(CYCLE)]
    return CYCLE[0] if last == AFTER_MARKER else AFTER_MARKER


def run(jobs, *, speculative=None, token_fn=cycling, max_rows=8):
    limits = SchedulerLimits(block_size=4, num_blocks=128, max_rows=max_rows, max_chunk_tokens=32,
                             speculative=speculative)
    scheduler = Scheduler(limits, TOKENIZER)
    runner = ScriptedRunner(block_size=4, num_blocks=129, max_rows=max_rows, max_chunk_tokens=32,
                            token_fn=token_fn)
    for job in jobs:
        scheduler.add_job(job)
    return run_until_idle(scheduler, runner), runner


def job(request_id, budget, max_tokens=12, prompt=(ord("a"),), **kw):
    return Job(request_id=request_id, prompt_token_ids=tuple(prompt), max_tokens=max_tokens,
               sampling=RowSampling(temperature=0), thinking_budget=budget, **kw)


def inside(n, end=(END,)):
    return ThinkingBudget(max_tokens=n, end_token_ids=tuple(end), starts_inside=True)


def test_the_end_marker_replaces_the_token_after_n_thinking_tokens_then_the_answer_goes_on():
    outputs, _ = run([job("r", inside(4))])
    # prompt "a": b c a b (4 thinking tokens), then the marker instead of 'c', then z a b ...
    assert outputs[("r", 0)].token_ids == [*map(ord, "bcab"), END, *map(ord, "zabcabc")]
    assert outputs[("r", 0)].finish_reason == "length", "max_tokens counts the marker and the answer"
    alone, _ = run([job("r", None)])
    assert alone[("r", 0)].token_ids[:4] == outputs[("r", 0)].token_ids[:4], "the first N tokens are the model's"
    assert END not in alone[("r", 0)].token_ids, "negative control: without a budget nothing is forced"


@pytest.mark.parametrize("n", [0, 1, 5])
def test_a_multi_token_marker_is_forced_one_token_per_step(n):
    marker = [ord(c) for c in "</think>"]  # eight byte tokens
    outputs, _ = run([job("r", inside(n, marker), max_tokens=n + 10)])
    tokens = outputs[("r", 0)].token_ids
    assert tokens[n:n + len(marker)] == marker and tokens[n + len(marker)] == AFTER_MARKER, tokens


def test_a_section_the_model_opens_itself_is_counted_from_after_its_start_marker():
    script = {(1,): [START, *map(ord, "bcabcabcab")]}  # the model writes <think> first

    def token_fn(seed, history):
        out = history[1:]
        return script[(1,)][len(out)] if len(out) < len(script[(1,)]) else AFTER_MARKER

    budget = ThinkingBudget(max_tokens=3, end_token_ids=(END,), start_token_ids=(START,))
    outputs, _ = run([job("r", budget, prompt=(1,))], token_fn=token_fn)
    assert outputs[("r", 0)].token_ids[:5] == [START, *map(ord, "bca"), END], "3 tokens after <think>, then </think>"
    no_section = {(1,): list(map(ord, "bcabcabcabcab"))}
    plain, _ = run([job("r", budget, prompt=(1,))], token_fn=lambda s, h: no_section[(1,)][len(h) - 1])
    assert END not in plain[("r", 0)].token_ids, "an output that opens no section is not cut"


def test_a_section_the_model_closes_within_the_budget_is_left_alone():
    script = list(map(ord, "bc")) + [END] + list(map(ord, "abcabcabc"))
    outputs, _ = run([job("r", inside(5))], token_fn=lambda s, h: script[len(h) - 1])
    assert outputs[("r", 0)].token_ids == script[:12], "closed after 2 tokens: nothing forced afterwards"


def test_rows_of_one_batch_keep_their_own_budgets():
    jobs = [job("two", inside(2)), job("none", None), job("n", inside(3), n=2)]
    outputs, runner = run(jobs)
    assert any(len(plan.decode) >= 3 for plan in runner.plans), "the rows decoded in the same steps"
    assert outputs[("two", 0)].token_ids[2] == END and END not in outputs[("none", 0)].token_ids
    assert outputs[("n", 0)].token_ids[3] == END and outputs[("n", 1)].token_ids[3] == END


def test_speculation_drops_the_drafts_verified_after_a_replaced_token():
    spec = SpeculativeConfig(num_speculative_tokens=3, ngram_min=1, ngram_max=3)
    prompt = list(map(ord, "abcabcabca"))  # a repeating prompt: drafts from the first step on
    plain, _ = run([job("r", inside(7), max_tokens=20, prompt=prompt)])
    fast, runner = run([job("r", inside(7), max_tokens=20, prompt=prompt)], speculative=spec)
    assert fast[("r", 0)].token_ids == plain[("r", 0)].token_ids, "speculation changes no token"
    assert plain[("r", 0)].token_ids[7] == END
    assert sum(step.num_draft_tokens for plan in runner.plans for step in plan.decode) > 0, "drafts were verified"
    # The step that forced the marker verified drafts after it (the cycle's next tokens): they
    # were dropped, or 'a' would follow the marker instead of 'z'.
    assert plain[("r", 0)].token_ids[8] == AFTER_MARKER


def test_forced_tokens_report_the_models_logprob_when_it_is_among_the_top():
    forced_job = Job(request_id="r", prompt_token_ids=(ord("a"),), max_tokens=4,
                     sampling=RowSampling(temperature=0, logprobs=2), thinking_budget=inside(2))
    outputs, _ = run([forced_job])
    results = [r for e in outputs[("r", 0)].events for r in e.logprobs]
    assert [r.token_id for r in results[:3]] == [ord("b"), ord("c"), END]
    # The scripted runner's top ids are the sampled id + 0..19 ('a' + 0..19 here): END is not
    # among them, so its logprob is the stand-in; the top list is the step's, unchanged.
    assert results[2].logprob == -9999.0 and results[2].top_logprobs[0][0] == ord("a")


def test_a_budget_is_validated():
    with pytest.raises(ValueError, match="max_tokens must be an int >= 0"):
        ThinkingBudget(max_tokens=-1, end_token_ids=(END,), starts_inside=True)
    with pytest.raises(ValueError, match="end_token_ids must not be empty"):
        ThinkingBudget(max_tokens=1, end_token_ids=(), starts_inside=True)
    with pytest.raises(ValueError, match="start_token_ids must not be empty"):
        ThinkingBudget(max_tokens=1, end_token_ids=(END,))
