"""ContinuousBatcher: the owner thread, refusals, cancellation, failures, stats, config."""

from __future__ import annotations

import threading
import time

import pytest

from ferrox_jax.batcher import ContinuousBatcher
from ferrox_jax.config import SchedulerLimits
from ferrox_jax.request import AdmissionError, Job, RowSampling
from ferrox_jax.scheduler import Scheduler
from tests.support.scripted import (ByteTokenizer, ScriptedRunner, collect, letters_token_fn, run_until_idle,
                            script_token_fn)

WAIT_S = 10.0


class Sink:
    """Collects RowEvents per request from the owner thread; waits for final events."""

    def __init__(self):
        self.lock = threading.Lock()
        self.outputs = {}
        self.done = {}

    def callback(self, spec):
        self.done[spec.request_id] = threading.Event()
        finished = set()

        def on_event(event):
            with self.lock:
                collect(self.outputs, [event])
            if event.finish_reason is not None:
                finished.add(event.index)
                if len(finished) == spec.n:
                    self.done[spec.request_id].set()

        return on_event

    def submit(self, batcher, spec):
        batcher.submit(spec, self.callback(spec))

    def wait(self, *request_ids):
        for request_id in request_ids:
            assert self.done[request_id].wait(WAIT_S), f"{request_id} never finished"

    def out(self, request_id, index=0):
        with self.lock:
            return self.outputs[(request_id, index)]


def req(request_id, prompt_len=5, max_tokens=6, **kw):
    prompt = tuple(100 + (i * 3 + len(request_id)) % 20 for i in range(prompt_len))
    return Job(request_id=request_id, prompt_token_ids=prompt, max_tokens=max_tokens, **kw)


def limits_for(runner, **overrides):
    """The runner's whole cache and buckets, as the engine resolves them; overrides win."""
    limits = dict(block_size=runner.block_size, num_blocks=runner.num_blocks - 1, max_rows=runner.max_rows,
                  max_chunk_tokens=min(128, runner.max_chunk_tokens))
    return SchedulerLimits(**{**limits, **overrides})


def make(limits=None, tokenizer=None, delay_s=0.001, **runner_kw):
    """A started batcher over a scripted runner; `limits`: SchedulerLimits overrides."""
    runner_kw.setdefault("token_fn", letters_token_fn())
    runner = ScriptedRunner(**runner_kw)
    runner.delay_s = delay_s  # 200-token jobs stay open ~0.2 s: time to cancel them
    batcher = ContinuousBatcher(runner, tokenizer or ByteTokenizer(), limits_for(runner, **(limits or {})))
    batcher.start()
    return batcher, runner


@pytest.fixture
def cleanup():
    batchers = []
    yield batchers.append
    for batcher in batchers:
        batcher.shutdown(WAIT_S)


def wait_for(predicate, what):
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


# -- generation ------------------------------------------------------------------------

def test_concurrent_jobs_stream_the_same_tokens_as_the_scheduler_alone(cleanup):
    specs = [req(f"j{i}", 3 + 2 * i, 4 + i, n=1 + i % 2, sampling=RowSampling(seed=i))
             for i in range(6)]
    batcher, runner = make(dict(max_chunk_tokens=4))
    cleanup(batcher)
    sink = Sink()
    for spec in specs:
        sink.submit(batcher, spec)
    sink.wait(*(spec.request_id for spec in specs))
    for spec in specs:
        scheduler = Scheduler(batcher.limits, ByteTokenizer())
        scheduler.add_job(spec)
        alone = run_until_idle(scheduler, ScriptedRunner(token_fn=letters_token_fn()))
        for index in range(spec.n):
            assert sink.out(spec.request_id, index).token_ids == alone[(spec.request_id, index)].token_ids, (
                f"{spec.request_id}/{index}: batched tokens must equal the job run alone")
    stats = batcher.stats()
    assert stats.kv_blocks_free == stats.kv_blocks_total == runner.num_blocks - 1, "all blocks returned"
    assert stats.tokens_generated == sum(len(o.token_ids) for o in sink.outputs.values())
    # Prompts here are prefixes of one another: tokens served from the prefix cache are not computed.
    assert stats.prefill_tokens + stats.prefix_cache_hits == sum(len(s.prompt_token_ids) - (s.n > 1) for s in specs)
    assert stats.prefix_cache_queries == sum(len(s.prompt_token_ids) for s in specs)


def test_stop_string_over_several_tokens_never_reaches_the_stream_and_utf8_stays_whole(cleanup):
    tok = ByteTokenizer()
    spec = req("s", 3, 30, stop=("STOP",))
    # é and € arrive as single bytes (2 and 3 tokens), the stop string over four tokens.
    script = list("é€".encode("utf-8")) + tok.ids("x S", "T", "O", "P", "never")
    batcher, _ = make(tokenizer=tok, token_fn=script_token_fn({spec.prompt_token_ids: script}))
    cleanup(batcher)
    sink = Sink()
    sink.submit(batcher, spec)
    sink.wait("s")
    out = sink.out("s")
    assert out.text == "é€x " and out.finish_reason == "stop", f"cut before the stop: {out.text!r}"
    assert all("\ufffd" not in e.text and "STOP" not in e.text for e in out.events), (
        "no event carries half a character or the stop string")


def test_a_steps_events_reach_the_job_once_the_next_forward_is_dispatched(cleanup):
    """While a job has more steps, a step's event is held until the next step's forward is
    dispatched (the HTTP side's work for it then runs beside the device); the last one is not."""
    batcher, runner = make(delay_s=0.0)
    cleanup(batcher)
    arrivals, done = [], threading.Event()  # (tokens so far, forwards dispatched when it arrived)

    def on_event(event):
        arrivals.append((event.num_generated_tokens, len(runner.batches)))
        if event.finish_reason is not None:
            done.set()

    batcher.submit(req("held", 5, 5), on_event)
    assert done.wait(WAIT_S)
    assert arrivals == [(1, 2), (2, 3), (3, 4), (4, 5), (5, 5)], (
        "token k arrives after forward k + 1; the last as soon as it is sampled")


def test_held_events_go_before_a_failed_steps_error_and_before_shutdowns(cleanup):
    """A step that fails before its dispatch delivers the held tokens first, then its error; a
    shutdown delivers every token sampled before the jobs' error events."""
    batcher, runner = make(delay_s=0.0)
    cleanup(batcher)
    runner.fail_when = lambda _batch: len(runner.batches) == 3
    sink = Sink()
    sink.submit(batcher, req("fails", 5, 8))
    sink.wait("fails")
    out = sink.out("fails")
    assert [len(e.token_ids) for e in out.events] == [1, 1, 0] and out.finish_reason == "error", (
        "both sampled tokens, then the failed step's error")
    stopped, runner2 = make(delay_s=0.002)
    sink.submit(stopped, req("stopped", 3, 200))
    wait_for(lambda: len(runner2.batches) > 5, "a few steps")
    stopped.shutdown(WAIT_S)
    sink.wait("stopped")
    out = sink.out("stopped")
    assert out.finish_reason == "error" and len(out.token_ids) == len(runner2.batches), (
        "every forward's token reached the job before its error event")


# -- refusals --------------------------------------------------------------------------

def test_refusals_are_counted_in_their_own_fields_and_hold_nothing(cleanup):
    # 8 usable blocks of 4 = 32 positions
    batcher, runner = make(dict(max_context=64, max_queue=1, max_rows=1), block_size=4, num_blocks=9)
    cleanup(batcher)
    runner.gate = threading.Event()
    sink = Sink()
    sink.submit(batcher, req("running", 2, 2))
    assert runner.entered.wait(WAIT_S)
    sink.submit(batcher, req("queued", 2, 2))  # fills the queue (cap 1) while the loop is held
    cases = [("context_length", req("ctx", 60, 10)),  # 70 > 64 tokens (and too large, and queue full)
             ("too_large", req("big", 30, 10)),  # ceil(40 / 4) = 10 > 8 blocks (and queue full)
             ("queue_full", req("full", 2, 2))]
    for reason, spec in cases:
        with pytest.raises(AdmissionError) as refused:
            batcher.submit(spec, sink.callback(spec))
        assert refused.value.reason == reason, f"{spec.request_id}: checks run in the contract's order"
    stats = batcher.stats()
    assert (stats.kv_rejected_context_length, stats.kv_rejected_too_large, stats.queue_rejected) == (1, 1, 1)
    runner.gate.set()
    sink.wait("running", "queued")
    sink.submit(batcher, req("after", 2, 2))  # the refused jobs took no queue slot
    sink.wait("after")
    wait_for(lambda: batcher.stats().kv_blocks_free == 8, "all blocks back")
    assert set(sink.outputs) == {("running", 0), ("queued", 0), ("after", 0)}, "refused jobs never ran"


def test_racing_submitters_never_overshoot_the_queue_cap(cleanup):
    cap = 5
    batcher, runner = make(dict(max_queue=cap, max_rows=1))
    cleanup(batcher)
    runner.gate = threading.Event()
    sink = Sink()
    sink.submit(batcher, req("blocker", 2, 2))
    assert runner.entered.wait(WAIT_S), "the blocker is admitted and its step is held"
    barrier = threading.Barrier(32)
    accepted, refused = [], []

    def submit(i):
        spec = req(f"race{i}", 2, 2)
        on_event = sink.callback(spec)
        barrier.wait()
        try:
            batcher.submit(spec, on_event)
            accepted.append(spec.request_id)
        except AdmissionError as e:
            refused.append(e.reason)

    threads = [threading.Thread(target=submit, args=(i,)) for i in range(32)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(WAIT_S)
    assert len(accepted) == cap and refused == ["queue_full"] * (32 - cap), (
        f"32 racing submitters against a cap of {cap} admit exactly {cap}")
    assert batcher.stats().queue_rejected == 32 - cap
    runner.gate.set()
    sink.wait("blocker", *accepted)


# -- cancellation ----------------------------------------------------------------------

def test_cancel_ends_a_decoding_request_keeping_its_tokens(cleanup):
    batcher, runner = make()
    cleanup(batcher)
    sink = Sink()
    sink.submit(batcher, req("long", 3, 200))
    wait_for(lambda: ("long", 0) in sink.outputs and len(sink.out("long").token_ids) >= 3, "a few tokens")
    assert batcher.cancel("long") is True, "cancel of an open request reports it"
    sink.wait("long")
    out = sink.out("long")
    assert out.finish_reason == "cancelled" and len(out.token_ids) >= 3, "keeps what it produced"
    wait_for(lambda: batcher.stats().kv_blocks_free == batcher.stats().kv_blocks_total, "blocks back")
    assert batcher.stats().aborted == 1
    assert batcher.cancel("long") is False, "cancel after finish is harmless and reports nothing open"
    time.sleep(0.05)
    assert batcher.stats().aborted == 1, "cancel after finish is not counted"


def test_cancel_before_submit_is_not_lost(cleanup):
    batcher, runner = make()
    cleanup(batcher)
    sink = Sink()
    assert batcher.cancel("early") is False, "nothing open yet"
    sink.submit(batcher, req("early"))
    sink.wait("early")
    assert sink.out("early").finish_reason == "cancelled" and sink.out("early").token_ids == []
    assert batcher.stats().aborted == 1


def test_failing_callback_cancels_its_request_and_the_loop_goes_on(cleanup):
    batcher, _ = make()
    cleanup(batcher)

    def broken(event):
        raise ConnectionError("client went away")

    batcher.submit(req("broken", 3, 200), broken)
    wait_for(lambda: batcher.stats().aborted == 1, "the broken request to be cancelled")
    sink = Sink()
    sink.submit(batcher, req("fine", 3, 3))
    sink.wait("fine")
    assert sink.out("fine").finish_reason == "length" and batcher.health() == "ready"


# -- failures ----------------------------------------------------------------------------

def test_runner_exception_fails_that_steps_jobs_and_the_loop_stays_alive(cleanup):
    batcher, runner = make()
    cleanup(batcher)
    doomed = req("doomed", 3, 5)
    runner.fail_when = lambda batch: tuple(batch.token_ids.tolist()) == doomed.prompt_token_ids
    sink = Sink()
    sink.submit(batcher, doomed)
    sink.wait("doomed")
    out = sink.out("doomed")
    assert out.finish_reason == "error" and "scripted runner failure" in out.events[-1].error
    sink.submit(batcher, req("next", 4, 3))
    sink.wait("next")
    assert sink.out("next").finish_reason == "length" and batcher.health() == "ready"
    assert batcher.stats().kv_blocks_free == batcher.stats().kv_blocks_total, "failed job freed its blocks"


class ExplodingTokenizer(ByteTokenizer):
    def decode(self, ids, skip_special_tokens=True):
        if ord("!") in ids:
            raise RuntimeError("tokenizer bug")
        return super().decode(ids, skip_special_tokens)


def test_loop_crash_errors_every_open_stream_and_refuses_new_work(cleanup):
    tok = ExplodingTokenizer()
    calm = Job(request_id="calm", prompt_token_ids=(120, 121), max_tokens=200)
    boom = Job(request_id="boom", prompt_token_ids=(122, 123), max_tokens=5)
    token_fn = script_token_fn({calm.prompt_token_ids: [ord("a")] * 200,
                                boom.prompt_token_ids: [ord("b"), ord("!")]})
    batcher, _ = make(tokenizer=tok, token_fn=token_fn)
    cleanup(batcher)
    sink = Sink()
    sink.submit(batcher, calm)
    sink.submit(batcher, boom)
    sink.wait("calm", "boom")
    assert sink.out("calm").finish_reason == "error" and sink.out("boom").finish_reason == "error", (
        "every open stream gets an error event when the loop dies")
    assert batcher.health() == "dead"
    with pytest.raises(AdmissionError) as refused:
        batcher.submit(req("late"), lambda event: None)
    assert refused.value.reason == "unavailable"


def test_shutdown_ends_open_requests_with_an_error_and_refuses_new_work():
    batcher, _ = make()
    sink = Sink()
    sink.submit(batcher, req("open", 3, 200))
    wait_for(lambda: ("open", 0) in sink.outputs, "the first token")
    batcher.shutdown(WAIT_S)
    sink.wait("open")
    assert sink.out("open").finish_reason == "error" and batcher.health() == "stopped"
    with pytest.raises(AdmissionError) as refused:
        batcher.submit(req("late"), lambda event: None)
    assert refused.value.reason == "unavailable"


def test_idle_loop_blocks_instead_of_spinning(cleanup):
    batcher, runner = make()
    cleanup(batcher)
    sink = Sink()
    sink.submit(batcher, req("one", 3, 3))
    sink.wait("one")
    ticks = batcher.stats().ticks
    num_plans = len(runner.batches)
    time.sleep(0.1)
    assert batcher.stats().ticks == ticks and len(runner.batches) == num_plans, "no ticks while idle"
    sink.submit(batcher, req("two", 3, 3))
    sink.wait("two")
    assert batcher.stats().ticks > ticks, "a submit wakes the loop"


def test_stats_snapshot_is_frozen_and_reports_the_peak_from_rows(cleanup):
    batcher, _ = make(block_size=4)
    cleanup(batcher)
    sink = Sink()
    sink.submit(batcher, req("p", 6, 5))  # 6 + 5 - 1 = 10 positions written -> 3 blocks of 4
    sink.wait("p")
    stats = batcher.stats()
    assert stats.kv_blocks_peak == 3, f"peak {stats.kv_blocks_peak}: 10 written positions fill 3 blocks"
    with pytest.raises(AttributeError):
        stats.kv_blocks_peak = 0


# -- configuration -----------------------------------------------------------------------

def test_limits_are_validated_by_name():
    with pytest.raises(ValueError, match="SchedulerLimits.max_queue"):
        limits_for(ScriptedRunner(), max_queue=0)


def test_batcher_refuses_limits_that_disagree_with_the_runner():
    with pytest.raises(ValueError, match="block_size"):
        ContinuousBatcher(ScriptedRunner(block_size=4), ByteTokenizer(),
                          limits_for(ScriptedRunner(block_size=4), block_size=16))
    with pytest.raises(ValueError, match="num_blocks"):
        ContinuousBatcher(ScriptedRunner(num_blocks=9), ByteTokenizer(),
                          limits_for(ScriptedRunner(num_blocks=9), num_blocks=9))
    with pytest.raises(ValueError, match="max_rows"):
        ContinuousBatcher(ScriptedRunner(max_rows=8), ByteTokenizer(), limits_for(ScriptedRunner(), max_rows=16))
