"""Engine faults, isolated and loud (issue 26): a row whose logits go non-finite fails alone
while its step's other rows keep their exact outputs; a step that raises is counted; a step
that hangs past the watchdog, or repeated failing steps, end every in-flight request with
an error, turn /health 503 with the reason, and make `ferrox serve` exit non-zero; and a
model swap between a handler's engine pick and its submit neither answers a spurious 503
nor mixes vocabularies.

In-process faults cue the runner wrapper of an engine; an engine a test kills has
limits of its own, so no other test shares it. Faults come from the tests' runner wrapper
(`tests/support/faults.py`), installed through the engine builder's runner-wrapping hook: the
tiny engines carry it inert, and the `ferrox serve` tests run `tests/support/fault_serve.py` (the
CLI with the hook set) with `FERROX_FAULT_INJECT` naming the fault.
"""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import numpy as np
import pytest

from api.app import create_app
from api.config import ServerConfig
from api.state import state_of
from tests.support.server_harness import ServerThread, tiny_engine, wait_for
from tests.system.test_reliability import (FailingRuns, LONG, data_events, first_event, idle, post_in_thread,
                                           serve_process)

NAN_MAX_TOKENS = 77  # marks the request whose rows get NaN logits
# The engines these tests kill: two rows, 16-token chunks (few shapes to compile), each
# with limits of its own so that no other test shares it.
SMALL = dict(max_seqs=2, prefill_chunk=16)
FEW_SHAPES = ("--max-seqs", "2", "--prefill-chunk", "16")  # the same shapes for `ferrox serve`


def metric(http, name: str, kind: str) -> float:
    for line in http.get("/metrics").text.splitlines():
        if line.startswith(f'{name}{{kind="{kind}"}}'):
            return float(line.split()[-1])
    raise AssertionError(f"{name}{{kind={kind!r}}} not on /metrics")


class NanRows:
    """Sets the logits of every row of the marked request to NaN on the device, between the
    forward and the sampler (the engine's fault-injection runner, `tests/support/faults.py`; the
    pending step's `order` tells which padded rows are the request's)."""

    def __init__(self, monkeypatch, engine) -> None:
        self.scheduler = engine._batcher._scheduler
        self.mixed_steps = 0  # steps holding a marked row and another request's row
        monkeypatch.setattr(engine.runner, "nan_rows", self._rows)

    def _rows(self, pending):
        batch, order = pending.batch, pending.order
        marked = [h >= 0 and self.scheduler._rows[int(batch.row_ids[h])].job.submitted.max_tokens == NAN_MAX_TOKENS
                  for h in order]
        targets = np.flatnonzero(marked)
        if len(targets) and int((order >= 0).sum()) > len(targets):
            self.mixed_steps += 1
        return targets


@pytest.fixture(scope="module")
def shared():
    engine = tiny_engine()
    with ServerThread(create_app(engine, ServerConfig())) as url, httpx.Client(base_url=url, timeout=30) as http:
        yield engine, url, http


def test_nonfinite_logits_fail_only_their_row_and_the_others_keep_their_exact_outputs(shared, monkeypatch):
    engine, url, http = shared
    body = {"prompt": "Continuous batching", "max_tokens": 300, "temperature": 0, "ignore_eos": True}
    alone = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
    wait_for(lambda: idle(http))
    before = metric(http, "ferrox_step_faults_total", "nonfinite")
    nan = NanRows(monkeypatch, engine)
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as running:
        lines = running.iter_lines()
        texts = [first_event(lines)["choices"][0]["text"]]
        bad = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": NAN_MAX_TOKENS})
        events = data_events(lines)
    assert bad.status_code == 500, bad.text
    error = bad.json()["error"]
    assert error["code"] == "engine_error" and "non-finite logits" in error["message"]
    assert nan.mixed_steps >= 1, "the NaN row shared a step with the running stream"
    assert events[-1] == "[DONE]"
    texts += [c["text"] for e in events[:-1] for c in e["choices"]]
    assert "".join(texts) == alone, "the step's other row kept its exact greedy output"
    assert metric(http, "ferrox_step_faults_total", "nonfinite") == before + 1
    health = http.get("/health")
    assert health.status_code == 200 and health.json()["last_step_fault"].startswith("nonfinite: ")
    assert http.get("/admin/stats").json()["step_faults_nonfinite"] == before + 1
    wait_for(lambda: idle(http))  # the failed row's blocks came back


def test_a_raising_step_is_counted_on_metrics_health_and_stats(monkeypatch):
    engine = tiny_engine(max_seqs=1, max_queue=8)  # test_reliability's one-row engine
    with ServerThread(create_app(engine, ServerConfig())) as url, httpx.Client(base_url=url, timeout=30) as http:
        before = metric(http, "ferrox_step_faults_total", "exception")
        fail = FailingRuns(monkeypatch, engine.runner)
        fail.left = 1
        r = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 4})
        assert r.status_code == 500 and "injected" in r.json()["error"]["message"]
        assert metric(http, "ferrox_step_faults_total", "exception") == before + 1
        health = http.get("/health").json()
        assert health["state"] == "ready" and health["step_faults"]["exception"] == before + 1
        assert "injected step failure" in health["last_step_fault"]
        assert http.get("/admin/stats").json()["last_step_fault"] == health["last_step_fault"]
        assert http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 4}).status_code == 200
        wait_for(lambda: idle(http))


class HangingRuns:
    """Cues the engine's fault-injection runner (`tests/support/faults.py`) so that, once `hang` is
    set, the next step blocks until `release`."""

    def __init__(self, monkeypatch, runner) -> None:
        self.hang = threading.Event()
        self.release = threading.Event()
        monkeypatch.setattr(runner, "before_forward", self)

    def __call__(self, batch):
        if self.hang.is_set():
            self.release.wait(60)


def test_a_step_past_the_watchdog_ends_every_request_and_the_engine_loudly(monkeypatch):
    engine = tiny_engine(**SMALL, max_queue=7, step_timeout_s=2.0)  # killed here
    app = create_app(engine, ServerConfig())
    hang = HangingRuns(monkeypatch, engine.runner)
    try:
        with ServerThread(app) as url, httpx.Client(base_url=url, timeout=20) as http:
            with http.stream("POST", "/v1/chat/completions", json={
                    "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1000, "temperature": 0,
                    "ignore_eos": True, "stream": True}) as chat:
                lines = chat.iter_lines()
                first_event(lines)
                thread, whole = post_in_thread(url, {**LONG, "max_tokens": 1000})
                wait_for(lambda: http.get("/admin/stats").json()["generating_now"] == 2)
                hang.hang.set()
                events = data_events(lines)  # the watchdog ends it within ~2 s; httpx's 20 s bound a hang
            thread.join(20)
            assert events[-1]["error"]["code"] == "engine_error"
            assert "past the step timeout of 2 s" in events[-1]["error"]["message"]
            assert whole[0].status_code == 500 and "step timeout" in whole[0].json()["error"]["message"]
            health = http.get("/health")
            assert health.status_code == 503 and health.json()["state"] == "unavailable"
            assert "step timeout" in health.json()["reason"] and health.json()["step_faults"]["timeout"] == 1
            assert metric(http, "ferrox_step_faults_total", "timeout") == 1
            r = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
            assert r.status_code == 503 and r.json()["error"]["code"] == "unavailable"
            assert "step timeout" in r.json()["error"]["message"]
            state = state_of(app)
            assert state.engine_failed.is_set() and state.fatal[0] == "timeout"  # what `ferrox serve` exits on
    finally:
        hang.release.set()  # the stuck owner thread comes back and touches nothing


def test_repeated_failing_steps_exit_the_server_non_zero_with_errors_in_every_envelope(tmp_path):
    # Steps fail after 400 good ones: both streams are decoding by then; with
    # --max-step-faults 1 the first failed step is unrecoverable.
    env = {"FERROX_FAULT_INJECT": "raise:after=400"}
    with serve_process(tmp_path, *FEW_SHAPES, "--max-step-faults", "1", env=env) as (proc, url, log):
        with httpx.Client(base_url=url, timeout=30) as http, \
                http.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as completion, \
                http.stream("POST", "/v1/chat/completions", json={
                    "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1500, "temperature": 0,
                    "ignore_eos": True, "stream": True}) as chat:
            completion_lines, chat_lines = completion.iter_lines(), chat.iter_lines()
            first_event(completion_lines)
            first_event(chat_lines)
            events, chat_events = data_events(completion_lines), data_events(chat_lines)
        for stream in (events, chat_events):
            assert stream[-1]["error"]["code"] == "engine_error", stream[-2:]
            assert "unrecoverable" in stream[-1]["error"]["message"]
        assert proc.wait(30) == 3
    assert "exiting 3" in log.read_text()


def test_a_hung_step_exits_the_server_with_4(tmp_path):
    env = {"FERROX_FAULT_INJECT": "hang:after=100"}
    with serve_process(tmp_path, *FEW_SHAPES, "--step-timeout-s", "2", env=env) as (proc, url, log):
        with httpx.Client(base_url=url, timeout=30) as http, \
                http.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as stream:
            lines = stream.iter_lines()
            first_event(lines)
            events = data_events(lines)
        assert "past the step timeout" in events[-1]["error"]["message"]
        assert proc.wait(30) == 4
    assert "TEST-ONLY fault injection" in log.read_text()


# ---------------------------------------------------------------- the batcher alone (scripted runner)


def scripted_batcher(policy, **limits):
    from ferrox_jax.batcher import ContinuousBatcher
    from tests.support.scripted import ByteTokenizer, ScriptedRunner, letters_token_fn
    from tests.engine.test_batcher import limits_for

    runner = ScriptedRunner(token_fn=letters_token_fn())
    runner.delay_s = 0.001
    batcher = ContinuousBatcher(runner, ByteTokenizer(), limits_for(runner, **limits), faults=policy)
    fatal = []
    batcher.add_fatal_listener(lambda kind, reason: fatal.append((kind, reason)))
    batcher.start()
    return batcher, runner, fatal


def test_consecutive_failed_steps_end_every_request_even_a_waiting_one_and_call_the_listener_once():
    from ferrox_jax.step_faults import FaultPolicy
    from tests.engine.test_batcher import Sink, req

    batcher, runner, fatal = scripted_batcher(FaultPolicy(max_consecutive_faults=2), max_rows=1)
    try:
        runner.gate = threading.Event()  # hold the first step until all three are queued
        runner.fail_when = lambda batch: True
        sink = Sink()
        for name in ("a", "b", "c"):
            sink.submit(batcher, req(name, 3, 50))
        runner.gate.set()
        sink.wait("a", "b", "c")
        assert "scripted runner failure" in sink.out("a").events[-1].error  # the first failed step: its job
        for name in ("b", "c"):  # the second is unrecoverable: its job and the waiting one
            assert "unrecoverable: 2 consecutive faulted steps" in sink.out(name).events[-1].error
        assert batcher.health() == "dead" and [kind for kind, _ in fatal] == ["exception"]
        assert batcher.fatal() == fatal[0]
        stats = batcher.stats()
        assert stats.step_faults_exception == 2 and "scripted runner failure" in stats.last_step_fault
        late = []
        batcher.add_fatal_listener(lambda *fault: late.append(fault))
        assert late == fatal, "a listener added after the end is told at once"
    finally:
        batcher.shutdown(5)


def test_the_watchdog_ends_a_hung_step_and_the_owner_touches_nothing_when_it_returns():
    from ferrox_jax.step_faults import FaultPolicy
    from tests.engine.test_batcher import Sink, req

    batcher, runner, fatal = scripted_batcher(FaultPolicy(step_timeout_s=0.3))
    events = []
    try:
        sink = Sink()
        spec = req("hung", 3, 200)
        callback = sink.callback(spec)
        batcher.submit(spec, lambda event: (events.append(event), callback(event)))
        wait_for(lambda: events)
        runner.gate = threading.Event()  # the next step blocks
        sink.wait("hung")
        assert "past the step timeout of 0.3 s" in events[-1].error and events[-1].finish_reason == "error"
        assert batcher.health() == "dead" and fatal and fatal[0][0] == "timeout"
        assert batcher.stats().step_faults_timeout == 1
        finals = len([e for e in events if e.finish_reason])
        runner.gate.set()  # the stuck step comes back: nothing more may be delivered
        batcher._thread.join(5)
        assert not batcher._thread.is_alive()
        assert len([e for e in events if e.finish_reason]) == finals == 1
    finally:
        batcher.shutdown(5)


# ---------------------------------------------------------------- the model-swap race


def test_a_swap_between_the_engine_pick_and_submit_keeps_the_request_on_its_engine(monkeypatch):
    import api.openai_routes

    old = tiny_engine(**SMALL, max_queue=5)  # owned by the app below: shut down here
    new = tiny_engine()
    app = create_app(old, ServerConfig())
    state = state_of(app)
    state.owned_engines.append(old)
    encode = api.openai_routes.encode
    swapped = []

    async def swap_then_encode(tokenizer, text, **kwargs):
        if not swapped:  # the handler picked `old`; the swap lands before its submit
            swapped.append(True)
            state.set_engine(new)
            state.tokens.text = lambda _token_id: "<the new model's vocabulary>"
            retire = state._background[-1]
            await asyncio.wait({retire}, timeout=0.5)  # on main, the old engine is shut down here
        return await encode(tokenizer, text, **kwargs)

    monkeypatch.setattr(api.openai_routes, "encode", swap_then_encode)
    with ServerThread(app) as url, httpx.Client(base_url=url, timeout=30) as http:
        r = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3, "logprobs": 2,
                                               "temperature": 0})
        assert r.status_code == 200, r.text
        logprobs = r.json()["choices"][0]["logprobs"]
        assert "<the new model's vocabulary>" not in logprobs["tokens"]
        assert "".join(logprobs["tokens"]) == r.json()["choices"][0]["text"]
        wait_for(lambda: old.health() == "stopped")  # retired once its request ended
        assert state.engine is new and not state.engine_pins


def test_a_lost_peer_during_a_step_ends_every_request_from_the_channels_thread_and_the_owner_stays_out():
    """A multi-host peer lost while the owner waits in a step (its collective would wait
    forever): the fault takes the watchdog's path, the requests end at once with an error
    naming the process, and the step that comes back delivers nothing more."""
    from ferrox_jax.step_faults import FaultPolicy
    from tests.engine.test_batcher import Sink, req

    batcher, runner, fatal = scripted_batcher(FaultPolicy(step_timeout_s=0))  # no timeout: only the peer
    events = []
    try:
        sink = Sink()
        spec = req("stuck", 3, 200)
        callback = sink.callback(spec)
        batcher.submit(spec, lambda event: (events.append(event), callback(event)))
        wait_for(lambda: events)
        runner.gate = threading.Event()  # the next step waits, as in a collective with a dead peer
        wait_for(runner.at_gate.is_set)
        batcher.lose_peer("follower process 1 closed its step channel (it exited or crashed)")
        sink.wait("stuck")
        assert events[-1].finish_reason == "error" and "follower process 1" in events[-1].error
        assert batcher.health() == "dead" and [kind for kind, _ in fatal] == ["peer"]
        assert batcher.stats().step_faults_peer == 1
        finals = len([e for e in events if e.finish_reason])
        runner.gate.set()  # the step comes back: the owner touches nothing
        batcher._thread.join(5)
        assert not batcher._thread.is_alive()
        assert len([e for e in events if e.finish_reason]) == finals == 1
    finally:
        batcher.shutdown(5)


def test_a_lost_peer_between_steps_is_ended_by_the_owner():
    from ferrox_jax.request import AdmissionError
    from ferrox_jax.step_faults import FaultPolicy
    from tests.engine.test_batcher import Sink, req

    batcher, runner, fatal = scripted_batcher(FaultPolicy())
    try:
        batcher.lose_peer("follower process 2 sent no heartbeat for 10 s (hung)")  # idle: no step runs
        wait_for(lambda: batcher.health() == "dead")
        assert fatal and fatal[0][0] == "peer" and "follower process 2" in fatal[0][1]
        with pytest.raises(AdmissionError, match="dead"):
            Sink().submit(batcher, req("late", 3, 5))
    finally:
        batcher.shutdown(5)
