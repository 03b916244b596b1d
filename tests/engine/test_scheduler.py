"""The scheduler driven tick by tick against the scripted runner (no threads, no device)."""

from __future__ import annotations

import collections
import dataclasses

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from ferrox_jax.request import RowSampling
from ferrox_jax.request import Job, derive_row_seed
from ferrox_jax.config import SchedulerLimits
from ferrox_jax.scheduler import Scheduler, blocks_to_reserve, check_admission
from ferrox_jax.step_output import run_plan
from tests.support.scripted import (EOS, ByteTokenizer, ScriptedRunner, letters_token_fn, run_until_idle,
                            script_token_fn, tick)


def make(*, block_size=4, num_blocks=64, max_rows=8, chunk=16, max_context=None, batched_tokens=None,
         token_fn=None, tokenizer=None, clock=None):
    limits = SchedulerLimits(block_size=block_size, num_blocks=num_blocks, max_rows=max_rows,
                             max_chunk_tokens=chunk, max_context=max_context, max_batched_tokens=batched_tokens)
    runner = ScriptedRunner(block_size=block_size, num_blocks=num_blocks + 1, max_rows=max_rows,
                            max_chunk_tokens=chunk, max_chunks=limits.max_chunks, token_fn=token_fn)
    kwargs = {} if clock is None else {"clock": clock}
    return Scheduler(limits, tokenizer or ByteTokenizer(), **kwargs), runner


def req(request_id, prompt_len=5, max_tokens=6, **kw):
    prompt = tuple(100 + (i * 7 + len(request_id)) % 20 for i in range(prompt_len))
    return Job(request_id=request_id, prompt_token_ids=prompt, max_tokens=max_tokens, **kw)


def outputs_alone(spec, **make_kw):
    scheduler, runner = make(**make_kw)
    scheduler.add_job(spec)
    return run_until_idle(scheduler, runner)


def prefill_positions(runner, row_id):
    return [step.start_pos + i for plan in runner.plans for step in plan.chunks
            if step.row_id == row_id for i in range(len(step.token_ids))]


# -- chunking, interleaving, FIFO ------------------------------------------------------

SPECS = [req("p1", 1), req("p3", 3), req("p4", 4), req("p5", 5), req("p17", 17, 9),
         req("p40", 40, 3), req("n3", 9, 7, n=3, sampling=RowSampling(seed=11)),
         req("n2", 8, 5, n=2, sampling=RowSampling(seed=5))]


@pytest.mark.parametrize("chunk", [1, 7, 128])
def test_chunk_size_never_changes_tokens_and_plans_cover_each_uncached_prompt_position_once(chunk):
    reference, _ = make(chunk=128)
    for spec in SPECS:
        reference.add_job(spec)
    expected = run_until_idle(reference, make(chunk=128)[1])
    scheduler, runner = make(chunk=chunk)
    for spec in SPECS:
        scheduler.add_job(spec)
    got = run_until_idle(scheduler, runner)
    assert {k: v.token_ids for k, v in got.items()} == {k: v.token_ids for k, v in expected.items()}, (
        f"chunk size {chunk} changed the sampled tokens")
    first_row_id = 1
    for spec in SPECS:
        num_prefill = len(spec.prompt_token_ids) - (0 if spec.n == 1 else 1)
        num_cached = got[(spec.request_id, 0)].events[0].num_cached_tokens  # a prefix-cache hit
        assert sorted(prefill_positions(runner, first_row_id)) == list(range(num_cached, num_prefill)), (
            f"{spec.request_id}: prefill must cover each prompt position not cached exactly once")
        first_row_id += spec.n
    assert all(len(s.token_ids) <= chunk for p in runner.plans for s in p.chunks), "chunk cap"


def test_long_prompt_interleaves_with_decoding_rows_without_changing_them():
    kw = dict(block_size=16, num_blocks=200, chunk=256, token_fn=letters_token_fn())
    decoders = [req(f"d{i}", 6 + i, 40) for i in range(4)]
    alone = {spec.request_id: outputs_alone(spec, **kw)[(spec.request_id, 0)].token_ids
             for spec in decoders}
    scheduler, runner = make(**kw)
    outputs = {}
    for spec in decoders:
        scheduler.add_job(spec)
    for _ in range(6):  # 4 prefill ticks, then every row has decoded at least once
        tick(scheduler, runner, outputs)
    assert all(outputs[(s.request_id, 0)].token_ids for s in decoders), "all 4 rows decode"
    long_prompt = req("long", 2000, 4)
    scheduler.add_job(long_prompt)
    decode_steps_before = scheduler.decode_steps
    long_row_id = 5
    chunk_ticks = []
    while scheduler.has_work:
        plan = tick(scheduler, runner, outputs)
        if any(step.row_id == long_row_id for step in plan.chunks):
            chunk_ticks.append(len(plan.decode))
    # ceil(2000 / 256) = 8 chunks, one per tick, each tick also decoding the 4 rows.
    assert chunk_ticks == [4] * 8, f"each of the 8 chunks shares its tick with 4 decode rows: {chunk_ticks}"
    assert scheduler.decode_steps - decode_steps_before >= 8, "decode steps counted between chunks"
    for spec in decoders:
        assert outputs[(spec.request_id, 0)].token_ids == alone[spec.request_id], (
            f"{spec.request_id}: a long prompt arriving must not change a decoding row's tokens")


def _chunk_schedule(batched_tokens):
    """(decode rows, [(request, chunk length), ...]) per tick for three prompts arriving while
    two rows decode (chunk 8: prompts of 20, 12 and 3 tokens)."""
    scheduler, runner = make(chunk=8, batched_tokens=batched_tokens, token_fn=letters_token_fn())
    outputs = {}
    for spec in (req("d0", 3, 30), req("d1", 4, 30)):
        scheduler.add_job(spec)
    for _ in range(2):
        tick(scheduler, runner, outputs)
    for spec in (req("a", 20, 2), req("b", 12, 2), req("c", 3, 2)):
        scheduler.add_job(spec)
    names = {3: "a", 4: "b", 5: "c"}  # row ids in submit order
    ticks = []
    while any(scheduler.waiting_request_ids) or scheduler._prefilling:
        plan = tick(scheduler, runner, outputs)
        ticks.append((len(plan.decode), [(names[s.row_id], len(s.token_ids)) for s in plan.chunks]))
    run_until_idle(scheduler, runner, outputs)
    return ticks, {k: v.token_ids for k, v in outputs.items()}


def test_a_budget_of_one_chunk_is_the_contracts_one_chunk_per_tick():
    ticks, _ = _chunk_schedule(batched_tokens=None)
    # Round robin, one chunk per tick: a 8, b 8, c 3 (done), a 8, b 4 (done), a 4 (done).
    assert [chunks for _, chunks in ticks] == [[("a", 8)], [("b", 8)], [("c", 3)], [("a", 8)], [("b", 4)], [("a", 4)]]
    assert all(decode == 2 for decode, _ in ticks[:3]), "the decoding rows run in every tick"


def test_a_larger_budget_fills_a_step_with_chunks_round_robin_and_keeps_every_output():
    one, tokens_one = _chunk_schedule(batched_tokens=None)
    ticks, tokens = _chunk_schedule(batched_tokens=16)
    # 16 prompt tokens per step, one chunk per job: a 8 + b 8, then c 3 + a 8 (c finishes,
    # 11 tokens), then b 4 + a 4.
    assert [chunks for _, chunks in ticks] == [[("a", 8), ("b", 8)], [("c", 3), ("a", 8)], [("b", 4), ("a", 4)]]
    assert len(ticks) < len(one), "fewer ticks until every prompt has its first token"
    assert tokens == tokens_one, "the schedule changed no row's tokens"


def test_a_prompt_alone_takes_idle_chunks_and_decoding_rows_keep_the_small_ones():
    runner = ScriptedRunner(block_size=4, num_blocks=65, max_chunk_tokens=16, token_fn=letters_token_fn())
    limits = SchedulerLimits(block_size=4, num_blocks=64, max_rows=8, max_chunk_tokens=4,
                             max_idle_chunk_tokens=16)
    scheduler = Scheduler(limits, ByteTokenizer())
    outputs = {}
    scheduler.add_job(req("alone", 40, 20))
    sizes = [len(tick(scheduler, runner, outputs).chunks[0].token_ids) for _ in range(3)]
    assert sizes == [16, 16, 8], "no row decodes: 40 prompt tokens in chunks of up to 16"
    scheduler.add_job(req("late", 10, 3))
    late = [len(plan.chunks[0].token_ids) for plan in (tick(scheduler, runner, outputs) for _ in range(3))]
    assert late == [4, 4, 2], "a row decodes: chunks of 4, so its tokens keep coming"
    run_until_idle(scheduler, runner, outputs)
    assert outputs[("alone", 0)].token_ids == outputs_alone(req("alone", 40, 20))[("alone", 0)].token_ids


def test_head_job_that_does_not_fit_holds_the_line():
    # 10 blocks of 4: "big" reserves ceil((4+28)/4) = 8; "next" needs 6 > 2 left; "small" needs 1.
    scheduler, runner = make(num_blocks=10, token_fn=letters_token_fn())
    scheduler.add_job(req("big", 4, 28))
    tick(scheduler, runner, {})
    scheduler.add_job(req("next", 4, 20))
    scheduler.add_job(req("small", 1, 2))
    tick(scheduler, runner, {})
    assert scheduler.waiting_request_ids == ("next", "small"), (
        "a job that would fit must not skip ahead of a head that does not")
    outputs = run_until_idle(scheduler, runner)
    assert outputs[("small", 0)].finish_reason == "length", "the line moves once the head fits"


def test_first_event_reports_the_wait_for_admission_then_none():
    now = [100.0]
    scheduler, runner = make(max_rows=1, token_fn=letters_token_fn(), clock=lambda: now[0])
    scheduler.add_job(req("first", 2, 3))
    scheduler.add_job(req("second", 2, 3))  # waits: one row at a time
    events = []
    while scheduler.has_work:
        now[0] += 0.5  # each tick takes half a second on the fake clock
        plan = scheduler.schedule()
        if not plan.is_empty:
            scheduler.update(plan, run_plan(runner, plan))
        events += scheduler.take_events()
    first = {e.request_id: e for e in reversed(events)}  # earliest event per request
    assert first["first"].queue_s == 0.5, "admitted at the first tick, 0.5 s after it was queued"
    # "first" runs 3 ticks (prefill + 2 decodes; its 3rd token ends it), "second" waits for them.
    assert first["second"].queue_s > first["first"].queue_s, "a job behind a full row cap waited longer"
    later = [e for e in events if e.request_id == "second"][1:]
    assert later and all(e.queue_s is None for e in later), "only the first event carries the wait"


def test_max_seqs_counts_prefilling_prompts_and_all_n_rows():
    scheduler, runner = make(max_rows=4)
    scheduler.add_job(req("three", 30, 5, n=3))
    scheduler.add_job(req("two", 30, 5, n=2))
    tick(scheduler, runner, {})
    assert scheduler.num_running_rows == 3 and scheduler.waiting_request_ids == ("two",), (
        "3 rows of a prefilling job + 2 more would exceed max_seqs=4")


# -- n > 1: shared prompt blocks ---------------------------------------------------------

@pytest.mark.parametrize("prompt_len", [1, 4, 5, 9])  # (P - 1) % 4: 0 (one token), 3, 0, 0 and partial
def test_n_rows_share_prompt_blocks_and_sample_like_single_rows_with_derived_seeds(prompt_len):
    spec = req("multi", prompt_len, 6, n=3, sampling=RowSampling(seed=7))
    scheduler, runner = make()
    scheduler.add_job(spec)
    outputs = {}
    tick(scheduler, runner, outputs)
    total = blocks_to_reserve(prompt_len, 6, 3, 4)
    assert scheduler.budget.num_reserved_blocks == total, "the job reserves blocks_to_reserve()"
    run_until_idle(scheduler, runner, outputs)
    for index in range(3):
        single = req("multi", prompt_len, 6, sampling=RowSampling(seed=derive_row_seed(7, index)))
        assert outputs[("multi", index)].token_ids == outputs_alone(single)[("multi", 0)].token_ids, (
            f"row {index} must sample as a lone request with its derived seed")
    copies = [copy for plan in runner.plans for copy in plan.block_copies]
    has_partial_block = (prompt_len - 1) % 4 != 0
    assert len(copies) == (2 if has_partial_block else 0), "rows 1..n-1 copy a partly filled block"
    assert len({tuple(outputs[("multi", i)].token_ids) for i in range(3)}) == 3, "seeds differ per row"


def test_n_rows_hold_fewer_blocks_than_n_separate_requests():
    # prompt 12 (11 prefilled = 2 full blocks + 3 positions), max_tokens 3 -> 4 blocks per row.
    scheduler, runner = make(token_fn=letters_token_fn())
    scheduler.add_job(req("multi", 12, 3, n=3, sampling=RowSampling(seed=1)))
    run_until_idle(scheduler, runner)
    # 2 shared + 3 rows x 2 private (partial copy + one for the new tokens) = 8, not 3 x 4 = 12.
    assert scheduler.kv_blocks_peak == 8, f"peak {scheduler.kv_blocks_peak}: shared blocks count once"


# -- stops ---------------------------------------------------------------------------------

def scripted(tokens_by_prompt, **kw):
    return make(token_fn=script_token_fn(tokens_by_prompt), **kw)


def test_eos_ends_the_row_without_appearing_in_its_output():
    spec = req("e", 3, 10)
    scheduler, runner = scripted({spec.prompt_token_ids: [ord("h"), ord("i"), EOS]})
    scheduler.add_job(spec)
    out = run_until_idle(scheduler, runner)[("e", 0)]
    assert (out.token_ids, out.text, out.finish_reason) == ([104, 105], "hi", "stop")
    assert out.events[-1].num_generated_tokens == 3, "the eos token is counted as generated"


def test_ignore_eos_and_stop_token_ids():
    spec = req("e", 3, 4, ignore_eos=True, stop_token_ids=(ord("x"),))
    scheduler, runner = scripted({spec.prompt_token_ids: [ord("a"), EOS, ord("b"), ord("x")]})
    scheduler.add_job(spec)
    out = run_until_idle(scheduler, runner)[("e", 0)]
    assert out.token_ids == [ord("a"), EOS, ord("b")] and out.finish_reason == "stop", (
        "ignore_eos keeps going through eos; a stop token id ends the row, not in the output")


def test_min_tokens_bans_and_ignores_eos_until_reached():
    spec = req("m", 3, 6, min_tokens=2)
    scheduler, runner = scripted({spec.prompt_token_ids: [EOS, ord("a"), EOS]})
    scheduler.add_job(spec)
    out = run_until_idle(scheduler, runner)[("m", 0)]
    assert out.token_ids == [EOS, ord("a")] and out.finish_reason == "stop", (
        "an eos before min_tokens output tokens does not stop the row")
    first_step = runner.plans[0].chunks[0]
    assert (EOS, float("-inf")) in first_step.sampling.logit_bias, "eos banned before min_tokens"
    last_step = runner.plans[-1].decode[0]
    assert last_step.sampling.logit_bias == (), "no ban once min_tokens is reached"


def test_max_tokens_finishes_with_length():
    scheduler, runner = make(token_fn=letters_token_fn())
    scheduler.add_job(req("l", 3, 5))
    out = run_until_idle(scheduler, runner)[("l", 0)]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"


def test_stop_string_across_tokens_ends_row_and_frees_blocks_in_the_same_tick():
    tok = ByteTokenizer()
    spec = req("s", 3, 20, stop=("END",))
    script = tok.ids("ok E", "N", "D", "more", "more")
    scheduler, runner = scripted({spec.prompt_token_ids: script}, tokenizer=tok)
    scheduler.add_job(spec)
    outputs = {}
    for _ in range(3):  # prefill samples "ok E", then two decode steps: "N", "D"
        tick(scheduler, runner, outputs)
    out = outputs[("s", 0)]
    assert out.finish_reason == "stop" and out.text == "ok ", f"text cut before the stop: {out.text!r}"
    assert scheduler.budget.num_held_blocks == 0 and scheduler.budget.num_reserved_blocks == 0, (
        "a row stopped by a stop string frees its blocks in that tick")


def test_logprobs_and_prompt_logprobs_are_reported_per_token():
    spec = req("lp", 9, 3, sampling=RowSampling(logprobs=2), prompt_logprobs=True)
    scheduler, runner = make(chunk=4, token_fn=letters_token_fn())
    scheduler.add_job(spec)
    out = run_until_idle(scheduler, runner)[("lp", 0)]
    logprobs = [lp for event in out.events for lp in (event.logprobs or ())]
    assert [lp.token_id for lp in logprobs] == out.token_ids, "one logprob entry per output token"
    assert all(len(lp.top_logprobs) == 2 for lp in logprobs)
    # The scripted runner reports -p for the prompt token at position p, for p = 1..8.
    assert [p[0] for p in out.events[0].prompt_logprobs] == [-float(p) for p in range(1, 9)]


# -- cancellation and failure -----------------------------------------------------------

@pytest.mark.parametrize("state", ["waiting", "prefilling", "decoding"])
def test_cancel_frees_blocks_within_one_tick_and_counts_one_abort(state):
    scheduler, runner = make(max_rows=1, chunk=4, token_fn=letters_token_fn())
    outputs = {}
    scheduler.add_job(req("other", 3, 30))
    scheduler.add_job(req("victim", 20, 30))
    if state != "waiting":
        scheduler.cancel("other")
        tick(scheduler, runner, outputs)  # "other" cancelled from waiting; "victim" admitted
    ticks = {"waiting": 1, "prefilling": 1, "decoding": 7}[state]  # 20 tokens / 4 = 5 chunks
    for _ in range(ticks):
        tick(scheduler, runner, outputs)
    assert scheduler.waiting_request_ids == (("victim",) if state == "waiting" else ())
    num_tokens_before = len(outputs.get(("victim", 0), None).token_ids) if state == "decoding" else 0
    assert (num_tokens_before > 0) == (state == "decoding")
    aborted_before = scheduler.aborted
    scheduler.cancel("victim")
    tick(scheduler, runner, outputs)
    out = outputs[("victim", 0)]
    assert out.finish_reason == "cancelled" and len(out.token_ids) == num_tokens_before, (
        "a cancelled row ends at the next tick keeping the tokens it produced")
    assert scheduler.aborted == aborted_before + 1, "aborted goes up by exactly one"
    if state != "waiting":
        assert scheduler.budget.num_held_blocks == 0 and scheduler.budget.num_reserved_blocks == 0, (
            f"cancelling a {state} job frees its blocks within one tick")
    scheduler.cancel("victim")
    run_until_idle(scheduler, runner, outputs)
    assert scheduler.aborted == aborted_before + 1, "a second cancel is harmless and not counted"


def test_cancel_arriving_before_its_job_is_not_lost():
    scheduler, runner = make()
    scheduler.cancel("early")
    tick(scheduler, runner, {})
    scheduler.add_job(req("early"))
    outputs = run_until_idle(scheduler, runner)
    assert outputs[("early", 0)].finish_reason == "cancelled" and outputs[("early", 0)].token_ids == []
    assert scheduler.aborted == 1 and not runner.plans, "the early-cancelled job never runs"


def test_pending_cancel_expires_so_unknown_ids_do_not_pile_up():
    now = [0.0]
    scheduler, runner = make(clock=lambda: now[0])
    scheduler.cancel("late")
    tick(scheduler, runner, {})
    now[0] += 61.0  # past PENDING_CANCEL_TTL_S
    scheduler.add_job(req("late", 3, 2))
    assert run_until_idle(scheduler, runner)[("late", 0)].finish_reason == "length", (
        "a cancel older than the TTL no longer applies")


def test_runner_failure_fails_the_steps_jobs_frees_blocks_and_later_jobs_run():
    scheduler, runner = make(token_fn=letters_token_fn())
    runner.fail_when = lambda plan: len(runner.plans) == 2
    outputs = {}
    scheduler.add_job(req("a", 3, 5))
    scheduler.add_job(req("b", 3, 5))
    tick(scheduler, runner, outputs)  # prefill a
    tick(scheduler, runner, outputs)  # prefill b + decode a: fails
    assert outputs[("a", 0)].finish_reason == "error" and outputs[("b", 0)].finish_reason == "error"
    assert outputs[("a", 0)].events[-1].error == "scripted runner failure"
    assert scheduler.budget.num_held_blocks == 0 and scheduler.budget.num_reserved_blocks == 0
    scheduler.add_job(req("c", 3, 5))
    assert run_until_idle(scheduler, runner, outputs)[("c", 0)].finish_reason == "length"


def test_refusals_in_contract_order():
    limits = SchedulerLimits(block_size=4, num_blocks=8, max_rows=4,
                             max_chunk_tokens=8, max_context=40)
    # 30 + 20 = 50 > 40 tokens, and ceil(50 / 4) = 13 > 8 blocks: context length is checked first.
    assert check_admission(req("x", 30, 20), limits)[0] == "context_length"
    assert check_admission(req("x", 30, 10), limits)[0] == "too_large"  # ceil(40/4) = 10 > 8
    assert check_admission(req("x", 2, 2, n=5), limits)[0] == "too_large"  # n=5 > max_rows=4
    assert check_admission(req("x", 30, 2), limits) is None  # ceil(32/4) = 8 blocks fit


# -- the stateful property test ---------------------------------------------------------

LIMITS = SchedulerLimits(block_size=4, num_blocks=16, max_rows=4, max_chunk_tokens=5, max_batched_tokens=10,
                         max_context=40)
QUEUE_CAP = 5
# Prompts are prefixes of one of three token sequences, so they share cached blocks at
# every boundary: whole prompts, k blocks, k blocks + a few tokens, prefixes of each other.
FAMILIES = [tuple(100 + (i * 7 + family) % 20 for i in range(30)) for family in range(3)]


class SchedulerMachine(RuleBasedStateMachine):
    """Random submit / cancel / tick / runner-failure sequences against a model of FIFO,
    over prompts that share prefixes (the prefix cache on)."""

    limits = LIMITS

    def __init__(self):
        super().__init__()
        self.runner = ScriptedRunner(block_size=4, num_blocks=17, max_rows=4, max_chunk_tokens=5, max_chunks=2,
                                     token_fn=letters_token_fn(eos_period=7))
        self.scheduler = Scheduler(self.limits, ByteTokenizer())
        self.checked = set()  # jobs whose tokens were compared with a run alone
        self.fail_next = False
        self.runner.fail_when = self._take_failure
        self.outputs = {}
        self.specs = {}
        self.refused = {}
        self.model_waiting = collections.deque()  # what FIFO admission must leave waiting
        self.model_cancels = []  # cancels not yet applied by a schedule()
        self.model_pending = set()  # cancels that arrived before their job
        self.num_ids = 0
        self.num_ticks = 0

    def _take_failure(self, plan):
        failed, self.fail_next = self.fail_next, False
        return failed

    @rule(prompt_len=st.integers(1, 30), max_tokens=st.integers(1, 16), n=st.integers(1, 3),
          min_tokens=st.integers(0, 2), stop=st.sampled_from([(), ("ab",), ("q", "zz")]),
          seed=st.integers(0, 3), family=st.integers(0, 2), prompt_logprobs=st.booleans())
    def submit(self, prompt_len, max_tokens, n, min_tokens, stop, seed, family, prompt_logprobs):
        request_id = f"r{self.num_ids}"
        self.num_ids += 1
        spec = Job(request_id, FAMILIES[family][:prompt_len], max_tokens, n=n,
                   min_tokens=min(min_tokens, max_tokens), stop=stop,
                   sampling=RowSampling(seed=seed), prompt_logprobs=prompt_logprobs)
        refusal = check_admission(spec, self.limits)
        if refusal is None and self.scheduler.num_waiting >= QUEUE_CAP:
            refusal = ("queue_full", "")
        if refusal is not None:
            self.refused[request_id] = refusal[0]
            return
        self.specs[request_id] = spec
        self.scheduler.add_job(spec)
        if request_id in self.model_pending:
            self.model_pending.discard(request_id)
        else:
            self.model_waiting.append(request_id)

    @rule(data=st.data())
    def cancel(self, data):
        choices = [*self.specs, f"r{self.num_ids}", "never-submitted"]
        request_id = data.draw(st.sampled_from(choices))
        self.scheduler.cancel(request_id)
        self.model_cancels.append(request_id)

    @rule()
    def fail_next_step(self):
        self.fail_next = True

    @rule(num_ticks=st.integers(1, 6))
    def run_ticks(self, num_ticks):
        for _ in range(num_ticks):
            self._tick()

    def _tick(self):
        for request_id in self.model_cancels:
            if request_id in self.model_waiting:
                self.model_waiting.remove(request_id)
            elif request_id not in self.specs:
                self.model_pending.add(request_id)
        self.model_cancels.clear()
        admitted_before = self.scheduler.num_admitted
        tick(self.scheduler, self.runner, self.outputs)
        for _ in range(self.scheduler.num_admitted - admitted_before):
            self.model_waiting.popleft()
        assert self.scheduler.waiting_request_ids == tuple(self.model_waiting), (
            "admission must take jobs strictly from the head of the queue")
        self.num_ticks += 1

    @invariant()
    def blocks_stay_within_budget(self):
        budget = self.scheduler.budget
        budget.check()  # free + held + idle cached == total, pairwise disjoint, promises covered
        assert budget.ref_counts() == dict(self.scheduler.block_references()), (
            "the pool's reference counts must be the references the tables hold")
        assert budget.num_reserved_blocks <= LIMITS.num_blocks, "reservations beyond the budget"
        assert self.scheduler.kv_blocks_peak <= LIMITS.num_blocks, "peak beyond the budget"

    @rule()
    def drain_and_check_every_job_ended_once(self):
        for _ in range(2000):
            if not self.scheduler.has_work:
                break
            self._tick()
        assert not self.scheduler.has_work, "the scheduler did not go idle"
        budget = self.scheduler.budget
        assert budget.num_free_blocks == LIMITS.num_blocks and budget.num_held_blocks == 0, (
            "an idle scheduler must hold no blocks and reserve none (leak)")
        assert budget.num_idle_cached_blocks == self.scheduler.blocks.num_cached_blocks, (
            "idle: every cached block is evictable")
        self._check_tokens_as_alone()
        for request_id, spec in self.specs.items():
            for index in range(spec.n):
                out = self.outputs.get((request_id, index))
                assert out is not None and out.num_final_events == 1, (
                    f"{request_id}/{index} must end exactly once")
        assert not any(rid in self.refused for rid, _ in self.outputs), "a refused job produced events"
        reasons = collections.defaultdict(set)
        for (request_id, _), out in self.outputs.items():
            reasons[out.finish_reason].add(request_id)
        assert self.scheduler.aborted == len(reasons["cancelled"]), "aborted counts cancelled jobs"
        assert self.scheduler.num_failed_jobs == len(reasons["error"]), "failed jobs counted once"
        num_rows = sum(spec.n for spec in self.specs.values())
        num_ended = sum(self.scheduler.state_counts[state] for state in self.scheduler.state_counts
                        if state.is_finished)
        assert num_ended == num_rows, f"{num_ended} row endings for {num_rows} rows"

    def _check_tokens_as_alone(self):
        """Jobs that ran to their end sampled what they sample alone without a cache: a hit on
        a wrong or overwritten block would change what the scripted runner reads back."""
        for request_id, spec in self.specs.items():
            ends = {self.outputs[(request_id, i)].finish_reason for i in range(spec.n)}
            if request_id in self.checked or not ends <= {"stop", "length"}:
                continue
            self.checked.add(request_id)
            alone = Scheduler(dataclasses.replace(LIMITS, prefix_caching=False), ByteTokenizer())
            alone.add_job(spec)
            expected = run_until_idle(alone, ScriptedRunner(block_size=4, num_blocks=17,
                                                            token_fn=letters_token_fn(eos_period=7)))
            for index in range(spec.n):
                assert self.outputs[(request_id, index)].token_ids == expected[(request_id, index)].token_ids, (
                    f"{request_id}/{index}: tokens differ from the job run alone")

    def teardown(self):
        self.drain_and_check_every_job_ended_once()  # every example ends drained and checked


class UncachedSchedulerMachine(SchedulerMachine):
    """The same machine with the prefix cache off (n > 1 sharing still on)."""

    limits = dataclasses.replace(LIMITS, prefix_caching=False)


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
TestUncachedSchedulerMachine = UncachedSchedulerMachine.TestCase
TestUncachedSchedulerMachine.settings = settings(max_examples=50, stateful_step_count=40, deadline=None)
