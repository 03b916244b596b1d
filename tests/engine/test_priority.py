"""Priority scheduling with preemption, driven tick by tick against the scripted runner.

The scripted runner samples each token from the row's whole history *read back through its
block table*, so a preempted row that recomputed too little, into the wrong blocks, or
sampled with another key, would produce other tokens than the same job run alone: every
test here compares a preempted job's reply with its unpreempted run.
"""

from __future__ import annotations

import pytest

from ferrox_jax import preemption, priority
from ferrox_jax.config import SchedulerLimits, SpeculativeConfig
from ferrox_jax.priority import MAX_PREEMPTIONS, WaitingQueue, check_priority
from ferrox_jax.request import Job, RowSampling
from ferrox_jax.scheduler import Scheduler
from ferrox_jax.speculative import spec_decode_stats
from tests.support.scripted import ByteTokenizer, ScriptedRunner, letters_token_fn, run_until_idle, tick

SEEDED = RowSampling(temperature=1.0, seed=7)
GREEDY = RowSampling(temperature=0.0)


def make(*, policy="priority", block_size=4, num_blocks=64, max_rows=2, chunk=16, prefix_caching=True,
         speculative=None):
    limits = SchedulerLimits(block_size=block_size, num_blocks=num_blocks, max_rows=max_rows,
                             max_chunk_tokens=chunk, prefix_caching=prefix_caching, scheduling_policy=policy,
                             speculative=speculative)
    runner = ScriptedRunner(block_size=block_size, num_blocks=num_blocks + 1, max_rows=16,
                            max_chunk_tokens=chunk, token_fn=letters_token_fn(),
                            # a speculating row is several tokens long, as a chunk is
                            max_chunks=limits.max_chunks + (max_rows if speculative else 0))
    return Scheduler(limits, ByteTokenizer()), runner


def job(request_id, prompt_len=9, max_tokens=30, priority=0, **kw):
    prompt = tuple(100 + (i * 7 + len(request_id) * 3) % 20 for i in range(prompt_len))
    return Job(request_id=request_id, prompt_token_ids=prompt, max_tokens=max_tokens, priority=priority, **kw)


def alone(spec, **make_kw):
    """The job's reply on an idle scheduler of the same shape: nothing preempts it."""
    scheduler, runner = make(**make_kw)
    scheduler.add_job(spec)
    return run_until_idle(scheduler, runner)


def assert_same_replies(outputs, specs, **make_kw):
    for spec in specs:
        expected = alone(spec, **make_kw)
        for index in range(spec.n):
            got, want = outputs[spec.request_id, index], expected[spec.request_id, index]
            assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason), (
                f"{spec.request_id}/{index}: a preempted job's reply must equal its unpreempted run")
            assert got.num_final_events == 1, f"{spec.request_id}/{index}: exactly one final event"


def busy_then_urgent(scheduler, runner, background, urgent, ticks=6):
    """Starts `background`, lets it decode `ticks` ticks, submits `urgent` and runs one tick;
    returns (outputs, the plan of the tick after the urgent job arrived)."""
    outputs = {}
    for spec in background:
        scheduler.add_job(spec)
    for _ in range(ticks):
        tick(scheduler, runner, outputs)
    assert all(outputs.get((spec.request_id, 0)) for spec in background), "the background jobs decode"
    scheduler.add_job(urgent)
    return outputs, tick(scheduler, runner, outputs)


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("prefix_caching", [True, False], ids=["cached", "uncached"])
def test_urgent_job_preempts_the_least_urgent_at_once_and_every_reply_matches_its_run_alone(sampling, prefix_caching):
    scheduler, runner = make(prefix_caching=prefix_caching)
    background = [job("bg0", 9, 30, priority=5, sampling=sampling), job("bg1", 7, 30, priority=5, sampling=sampling)]
    urgent = job("fg", 6, 5, priority=0, sampling=sampling)
    outputs, plan = busy_then_urgent(scheduler, runner, background, urgent)
    urgent_row = 3  # row ids in submit order: bg0 1, bg1 2, fg 3
    assert any(step.row_id == urgent_row for step in plan.chunks), "the urgent job prefills in the very next tick"
    assert not plan.decode, "less urgent decoding rows yield that step to the urgent prompt's chunk"
    assert scheduler.num_preemptions == 1
    assert scheduler.waiting_request_ids == ("bg1",), "the latest arrival of the least urgent level gave way"
    run_until_idle(scheduler, runner, outputs)
    assert_same_replies(outputs, [*background, urgent], prefix_caching=prefix_caching)
    scheduler.budget.check()
    assert scheduler.budget.num_held_blocks == 0 and scheduler.budget.num_owed_blocks == 0


def test_preempted_row_recomputes_from_the_prefix_cache_and_samples_nothing_while_it_does():
    scheduler, runner = make(chunk=64)
    outputs, _ = busy_then_urgent(scheduler, runner, [job("bg0", 9, 30, priority=1), job("bg1", 9, 30, priority=1)],
                                  job("fg", 5, 3), ticks=10)
    run_until_idle(scheduler, runner, outputs)
    history_steps = [step for plan in runner.plans for step in plan.chunks if step.row_id == 2 and step.start_pos > 0]
    assert history_steps, "bg1 recomputed its tokens after the preemption"
    assert all(not step.sample for step in history_steps), "recomputing samples nothing"
    # bg1 had 9 prompt + 9 output tokens (10 ticks: 1 prefill, 9 decodes); its 4 full blocks
    # (16 positions) were named before the preemption, so the recompute starts at 16.
    assert history_steps[0].start_pos == 16, "the recompute starts after the cached blocks"


def test_preemption_for_lack_of_kv_blocks():
    # Two jobs of 8 + 24 tokens hold 8 blocks each of 20; the urgent one needs 5 (10 + 10
    # tokens): only 4 are free, rows are not short (max_rows 4).
    scheduler, runner = make(num_blocks=20, max_rows=4)
    background = [job("bg0", 8, 24, priority=3), job("bg1", 8, 24, priority=3)]
    urgent = job("fg", 10, 10, priority=-3)
    outputs, plan = busy_then_urgent(scheduler, runner, background, urgent)
    assert any(step.row_id == 3 for step in plan.chunks) and scheduler.num_preemptions == 1
    run_until_idle(scheduler, runner, outputs)
    assert_same_replies(outputs, [*background, urgent], num_blocks=20, max_rows=4)
    scheduler.budget.check()


def test_jobs_of_one_level_never_preempt_each_other_and_fcfs_never_preempts():
    for policy, urgent_priority in (("priority", 5), ("fcfs", 0)):
        scheduler, runner = make(policy=policy)
        background = [job("bg0", priority=5 if policy == "priority" else 0),
                      job("bg1", priority=5 if policy == "priority" else 0)]
        outputs, plan = busy_then_urgent(scheduler, runner, background, job("fg", 6, 5, priority=urgent_priority))
        assert scheduler.num_preemptions == 0 and scheduler.waiting_request_ids == ("fg",), (
            f"{policy}: the job waits for a row")
        assert not plan.chunks


def test_waiting_queue_admits_by_priority_then_arrival():
    scheduler, runner = make(max_rows=1)
    scheduler.add_job(job("running", 5, 4, priority=-1))  # the most urgent: nothing preempts it
    tick(scheduler, runner, {})
    for name, level in (("a", 3), ("b", 1), ("c", 2), ("d", 1)):
        scheduler.add_job(job(name, 5, 2, priority=level))
    assert scheduler.waiting_request_ids == ("b", "d", "c", "a")
    first_chunk = {}
    names = {2: "a", 3: "b", 4: "c", 5: "d"}
    for i, plan in enumerate(runner.plans + [tick(scheduler, runner, {}) for _ in range(40)]):
        for step in plan.chunks:
            first_chunk.setdefault(names.get(step.row_id), i)
    order = sorted(names.values(), key=first_chunk.__getitem__)
    assert order == ["b", "d", "c", "a"], "admitted by (priority, arrival)"
    assert scheduler.num_preemptions == 0


def test_fcfs_queue_keeps_arrival_order_whatever_the_priority():
    scheduler, _ = make(policy="fcfs")
    for name, level in (("a", 3), ("b", 1)):
        scheduler.add_job(job(name, priority=level))
    assert scheduler.waiting_request_ids == ("a", "b")
    by_urgency = WaitingQueue("priority")
    for spec in scheduler._waiting:
        by_urgency.append(spec)
    assert [j.submitted.request_id for j in by_urgency] == ["b", "a"], "negative control: the other order"


def test_priority_policy_with_equal_priorities_plans_exactly_as_fcfs():
    specs = [job(f"j{i}", 3 + i * 5, 6 + i, n=1 + i % 2, sampling=SEEDED) for i in range(6)]
    plans = {}
    for policy in ("fcfs", "priority"):
        scheduler, runner = make(policy=policy, max_rows=3, num_blocks=30)
        for spec in specs:
            scheduler.add_job(spec)
        run_until_idle(scheduler, runner)
        plans[policy] = runner.plans
        assert scheduler.num_preemptions == 0
    assert plans["fcfs"] == plans["priority"], "one level is first come first served, step for step"


def _starvation_run(monkeypatch, guard):
    """One long low-priority job on one row; a short urgent job arrives every 4 ticks."""
    monkeypatch.setattr(priority, "MAX_PREEMPTIONS", guard)
    scheduler, runner = make(max_rows=1)
    background = job("bg", 5, 40, priority=9, sampling=SEEDED)
    scheduler.add_job(background)
    outputs, urgent = {}, []
    for i in range(6):
        for _ in range(4):
            tick(scheduler, runner, outputs)
        urgent.append(job(f"fg{i}", 4, 2, priority=0))
        scheduler.add_job(urgent[-1])
    run_until_idle(scheduler, runner, outputs)
    return scheduler, outputs, [background, *urgent]


def test_starvation_guard_stops_preempting_a_job_after_max_preemptions(monkeypatch):
    scheduler, outputs, specs = _starvation_run(monkeypatch, MAX_PREEMPTIONS)
    assert scheduler.num_preemptions == MAX_PREEMPTIONS, "the background job gave way MAX_PREEMPTIONS times, no more"
    assert_same_replies(outputs, specs, max_rows=1)
    # Negative control: without the guard the same arrivals preempt it every time.
    unguarded, _, _ = _starvation_run(monkeypatch, 100)
    assert unguarded.num_preemptions == 6 > MAX_PREEMPTIONS


def test_n_rows_stop_strings_and_speculation_survive_a_preemption():
    spec_cfg = SpeculativeConfig(num_speculative_tokens=2, ngram_min=1, ngram_max=2)
    n_job = job("bg0", 6, 24, priority=4, n=3, sampling=SEEDED)
    text = alone(job("bg1", 9, 30, priority=4), speculative=spec_cfg)["bg1", 0].text
    stop_job = job("bg1", 9, 30, priority=4, stop=(text[20:22],))  # a stop string met after the preemption
    urgent = job("fg", 6, 4, priority=0)
    scheduler, runner = make(max_rows=4, speculative=spec_cfg)
    outputs, _ = busy_then_urgent(scheduler, runner, [n_job, stop_job], urgent)
    assert len(outputs["bg1", 0].text) < 20, "preempted before its stop string"
    assert scheduler.num_preemptions == 1 and scheduler.waiting_request_ids == ("bg1",)
    run_until_idle(scheduler, runner, outputs)
    assert outputs["bg1", 0].finish_reason == "stop" and outputs["bg1", 0].text == text[:20]
    assert_same_replies(outputs, [n_job, stop_job, urgent], max_rows=4, speculative=spec_cfg)
    assert spec_decode_stats(scheduler.speculator)["spec_decode_num_drafts"] > 0, "rows speculated"


def test_a_preempted_n_job_recomputes_each_rows_own_output():
    n_job = job("bg", 6, 24, priority=4, n=3, sampling=SEEDED)
    scheduler, runner = make(max_rows=3)
    outputs, _ = busy_then_urgent(scheduler, runner, [n_job], job("fg", 6, 4, priority=0))
    assert scheduler.num_preemptions == 1
    run_until_idle(scheduler, runner, outputs)
    assert_same_replies(outputs, [n_job], max_rows=3)
    scheduler.budget.check()


def test_cancelling_a_preempted_job_frees_everything():
    scheduler, runner = make()
    outputs, _ = busy_then_urgent(scheduler, runner, [job("bg0", priority=2), job("bg1", priority=2)], job("fg", 6, 5))
    scheduler.cancel("bg1")
    run_until_idle(scheduler, runner, outputs)
    assert outputs["bg1", 0].finish_reason == "cancelled" and scheduler.aborted == 1
    scheduler.budget.check()
    assert scheduler.budget.num_held_blocks == 0 and scheduler.budget.num_owed_blocks == 0


def test_negative_control_a_resume_that_skips_the_recompute_is_caught(monkeypatch):
    """A wrong implementation (the row decodes at once, as if its tokens were still in its
    blocks) reads what another job wrote there: its reply differs from its run alone (or
    the scripted runner's read-back fails outright)."""
    def resume_without_recompute(self, job):
        for row in self._open_rows(job):
            row.num_computed_tokens = len(row.token_ids) - 1
            preemption.transition(row, preemption.RowState.DECODING, self.state_counts)
            self._decoding[row.row_id] = row

    monkeypatch.setattr(preemption.Preemption, "_resume", resume_without_recompute)
    scheduler, runner = make(prefix_caching=False)
    background = [job("bg0", priority=2), job("bg1", priority=2)]
    # The urgent prompt (40 tokens, 10 blocks) takes and overwrites the blocks bg1 freed.
    outputs, _ = busy_then_urgent(scheduler, runner, background, job("fg", 40, 2))
    try:
        run_until_idle(scheduler, runner, outputs)
    except AssertionError as e:  # the read-back found a position nobody wrote for it
        assert "reads" in str(e) or "does not cover" in str(e)
        return
    with pytest.raises(AssertionError, match="must equal its unpreempted run"):
        assert_same_replies(outputs, background)


def test_check_priority_range_and_policy():
    assert check_priority(0, "fcfs") is None and check_priority(-5, "priority") is None
    assert "needs priority scheduling" in check_priority(1, "fcfs")
    assert "must be in" in check_priority(2 ** 31, "priority")
    assert "must be an integer" in check_priority(True, "priority")
    with pytest.raises(ValueError, match="Job.priority"):
        job("x", priority=-(2 ** 31) - 1)


def test_a_constrained_row_keeps_its_grammar_state_across_a_preemption(tiny_llama):
    from ferrox_jax.constraint import GrammarSpec
    from ferrox_jax.grammar import GrammarCompiler
    from models.tokenizer import Tokenizer
    from tests.support.scripted import script_token_fn

    tokenizer = Tokenizer.from_hf_dir(tiny_llama)
    prompts = {"bg0": (5, 6, 7), "bg1": (8, 9, 10), "fg": (11, 12)}
    digits = tokenizer.encode("12345678901234567890")
    scripts = {prompts["bg0"]: digits, prompts["bg1"]: digits, prompts["fg"]: tokenizer.encode("42")}
    grammar = GrammarSpec.regex(r"[0-9]{1,40}")

    def run(with_urgent):
        limits = SchedulerLimits(block_size=4, num_blocks=64, max_rows=2, max_chunk_tokens=16,
                                 scheduling_policy="priority")
        runner = ScriptedRunner(block_size=4, num_blocks=65, max_rows=4, token_fn=script_token_fn(scripts))
        scheduler = Scheduler(limits, tokenizer, new_matcher=GrammarCompiler(tokenizer, tokenizer.vocab_size).new_matcher)
        outputs = {}
        for name in ("bg0", "bg1"):
            scheduler.add_job(Job(name, prompts[name], len(digits), priority=1, grammar=grammar))
        for _ in range(5):
            tick(scheduler, runner, outputs)
        if with_urgent:
            scheduler.add_job(Job("fg", prompts["fg"], 2))
        run_until_idle(scheduler, runner, outputs)
        return scheduler, outputs

    scheduler, outputs = run(True)
    _, unpreempted = run(False)
    assert scheduler.num_preemptions == 1 and scheduler.num_grammar_errors == 0
    for name in ("bg0", "bg1"):
        assert outputs[name, 0].text == unpreempted[name, 0].text == "12345678901234567890"


def test_offline_llm_takes_one_priority_per_prompt_checked_before_anything_is_submitted():
    from ferrox_jax.llm import _priorities

    assert _priorities(None, 3, "fcfs") == [0, 0, 0]
    assert _priorities([2, -1], 2, "priority") == [2, -1]
    with pytest.raises(ValueError, match="one per prompt"):
        _priorities([1], 2, "priority")
    with pytest.raises(ValueError, match=r"priority\[1\] 3 needs priority scheduling"):
        _priorities([0, 3], 2, "fcfs")


class _Slots:
    """AdapterSlots at the edge: one adapter "a" in slot 1; counts acquires and releases."""

    def __init__(self):
        self.acquired, self.released = 0, 0

    def refusal(self, name, key):
        return None

    def acquire(self, name):
        self.acquired += 1
        return type("Adapter", (), {"slot": 1})

    def release(self, slot):
        self.released += 1


def test_a_preempted_lora_job_keeps_its_adapter_slot_and_recomputes_with_it():
    limits = SchedulerLimits(block_size=4, num_blocks=64, max_rows=2, max_chunk_tokens=16, scheduling_policy="priority")
    runner = ScriptedRunner(block_size=4, num_blocks=65, max_rows=16, max_chunk_tokens=16, token_fn=letters_token_fn())
    slots = _Slots()
    scheduler = Scheduler(limits, ByteTokenizer(), adapters=slots)
    background = [job("bg0", priority=2, adapter_name="a"), job("bg1", priority=2, adapter_name="a")]
    outputs, _ = busy_then_urgent(scheduler, runner, background, job("fg", 6, 2))
    assert scheduler.num_preemptions == 1 and slots.acquired == 2, "the preempted job holds its slot while it waits"
    run_until_idle(scheduler, runner, outputs)
    history = [step for plan in runner.plans for step in plan.chunks if step.row_id == 2 and step.start_pos > 0]
    assert history and all(step.adapter_slot == 1 for step in history), "the recompute runs with the adapter"
    assert slots.acquired == slots.released == 2, "one acquire and one release per job, preemption or not"


def test_a_job_preempted_again_while_it_recomputes_still_replies_as_alone():
    scheduler, runner = make(chunk=4, prefix_caching=False)  # the recompute takes several ticks
    background = [job("bg0", 9, 30, priority=5, sampling=SEEDED), job("bg1", 9, 30, priority=5, sampling=SEEDED)]
    outputs, _ = busy_then_urgent(scheduler, runner, background, job("fg0", 4, 1), ticks=12)
    bg1 = scheduler._jobs["bg1"]
    for _ in range(40):  # until bg1 is back and recomputing its tokens
        tick(scheduler, runner, outputs)
        if bg1.resume_rows:
            break
    assert bg1.resume_rows, "bg1 was re-admitted and recomputes"
    scheduler.add_job(job("fg1", 4, 1))
    tick(scheduler, runner, outputs)
    assert bg1.num_preemptions == 2 and scheduler.num_preemptions == 2, "preempted again mid-recompute"
    assert scheduler.num_running_rows <= 2
    run_until_idle(scheduler, runner, outputs)
    assert_same_replies(outputs, background, chunk=4, prefix_caching=False)
    scheduler.budget.check()


@pytest.mark.parametrize("seed", range(8))
def test_random_arrivals_priorities_and_cancels_keep_the_ledger_and_every_reply(seed):
    """Jobs of random priority, length, n and sampling arrive over time on a tight budget
    (3 rows, 40 blocks), some cancelled; after every tick the pool's invariants hold, and
    every job that finished replies as it does alone. Prefix cache on for even seeds,
    prompt-lookup speculation for seeds 4-7."""
    import random

    rng = random.Random(seed)
    caching = seed % 2 == 0
    spec_cfg = SpeculativeConfig(num_speculative_tokens=2, ngram_min=1, ngram_max=2) if seed >= 4 else None
    scheduler, runner = make(max_rows=3, num_blocks=40, chunk=8, prefix_caching=caching, speculative=spec_cfg)
    specs, outputs, cancelled = [], {}, set()
    for t in range(400):
        if t < 120 and rng.random() < 0.3:
            spec = job(f"j{len(specs)}", rng.randint(1, 20), rng.randint(1, 25), priority=rng.randint(0, 3),
                       n=rng.choice([1, 1, 2]), sampling=rng.choice([GREEDY, SEEDED]))
            specs.append(spec)
            scheduler.add_job(spec)
        if specs and rng.random() < 0.02:
            victim = rng.choice(specs).request_id
            cancelled.add(victim)
            scheduler.cancel(victim)
        tick(scheduler, runner, outputs)
        scheduler.budget.check()
        assert scheduler.num_running_rows <= 3
    run_until_idle(scheduler, runner, outputs)
    assert scheduler.num_preemptions > 0, "the workload preempted"
    assert scheduler.budget.num_held_blocks == 0 and scheduler.budget.num_owed_blocks == 0
    done = [s for s in specs if s.request_id not in cancelled]
    assert_same_replies(outputs, done, max_rows=3, num_blocks=40, chunk=8, prefix_caching=caching, speculative=spec_cfg)


def test_nothing_is_preempted_when_preempting_every_less_urgent_job_would_not_make_room(monkeypatch):
    # 20 blocks: bg0 (priority 5) and bg1 (priority 0) hold 8 each (8 + 24 tokens), 4 free.
    # fg (priority 1) needs 15 (30 + 30 tokens): bg0's 8 and the 4 free are not enough, and
    # bg1 is more urgent than fg, so fg waits and bg0 keeps its work.
    def run():
        scheduler, runner = make(num_blocks=20, max_rows=4)
        outputs, _ = busy_then_urgent(scheduler, runner, [job("bg0", 8, 24, priority=5), job("bg1", 8, 24, priority=0)],
                                      job("fg", 30, 30, priority=1))
        return scheduler, runner, outputs

    scheduler, runner, outputs = run()
    assert scheduler.num_preemptions == 0 and scheduler.waiting_request_ids == ("fg",)
    run_until_idle(scheduler, runner, outputs)
    assert outputs["fg", 0].finish_reason == "length", "fg runs once the others end"
    # Negative control: without the estimate, bg0 is preempted for nothing.
    monkeypatch.setattr(preemption.Preemption, "_num_blocks_wanted", lambda self, job: 0)
    scheduler, _, _ = run()
    assert scheduler.num_preemptions == 1
