"""Grammar-constrained generation through the real engine (tiny random Llama, CPU).

The tiny random model is the adversary: unconstrained it emits garbage, so every valid
document below is the token mask's doing. Requests are submitted together, so the 100
seeds decode as batches of up to 32 rows.
"""

from __future__ import annotations

import json
import threading
import time

import pytest

from ferrox_jax.constraint import GrammarSpec
from ferrox_jax.request import AdmissionError, Job, RowSampling
from tests.support.schema_check import check
from tests.support.server_harness import tiny_engine

TIMEOUT_S = 300
# Bounded strings, integers and arrays: every document ends within MAX_TOKENS even with
# the whitespace bound's 16 characters between every two JSON tokens (~14 separators).
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
MAX_TOKENS = 300


class Collector:
    """RowEvents per request id; `wait` returns once every row of the asked ids finished."""

    def __init__(self) -> None:
        self.events: dict[str, list] = {}
        self._lock = threading.Lock()
        self._done = threading.Condition(self._lock)

    def __call__(self, event) -> None:
        with self._lock:
            self.events.setdefault(event.request_id, []).append(event)
            self._done.notify_all()

    def wait(self, ids: list[str], n: int = 1) -> None:
        deadline = time.monotonic() + TIMEOUT_S
        with self._lock:
            while not all(sum(e.finish_reason is not None for e in self.events.get(i, ())) == n for i in ids):
                assert self._done.wait(deadline - time.monotonic()), "requests did not finish in time"

    def text(self, request_id: str, index: int = 0) -> str:
        return "".join(e.text for e in self.events[request_id] if e.index == index)

    def finish(self, request_id: str, index: int = 0) -> str:
        return next(e.finish_reason for e in self.events[request_id] if e.index == index and e.finish_reason)

    def tokens(self, request_id: str) -> list[int]:
        return [t for e in self.events[request_id] for t in e.token_ids]

    def logprobs(self, request_id: str) -> list[float]:
        return [r.logprob for e in self.events[request_id] for r in (e.logprobs or ())]


@pytest.fixture(scope="module")
def engine():
    return tiny_engine()


@pytest.fixture(scope="module")
def prompt(engine) -> tuple[int, ...]:
    return tuple(engine.tokenizer.encode("Describe a person as JSON:"))


def submit_all(engine, requests: list[Job], collector: Collector) -> list[str]:
    """Submit every request, waiting out a full queue (more are sent than it holds)."""
    for request in requests:
        while True:
            try:
                engine.submit(request, collector)
                break
            except AdmissionError as e:
                assert e.reason == "queue_full", e.message
                time.sleep(0.01)
    ids = [r.request_id for r in requests]
    collector.wait(ids)
    return ids


def test_sampled_schema_requests_all_parse_and_validate_over_100_seeds(engine, prompt):
    before = engine.stats()
    grammar = GrammarSpec.json_schema(SCHEMA)
    collector = Collector()
    requests = [Job(f"schema-{seed}", prompt, MAX_TOKENS, RowSampling(temperature=1.0, seed=seed),
                    grammar=grammar) for seed in range(100)]
    ids = submit_all(engine, requests, collector)
    for request_id in ids:
        text = collector.text(request_id)
        assert collector.finish(request_id) == "stop", f"{request_id} did not finish its document: {text!r}"
        check(json.loads(text), SCHEMA)
    after = engine.stats()
    assert after.constrained_requests - before.constrained_requests == 100
    assert after.grammar_errors == 0, "every sampled token was allowed by its row's mask"
    assert after.grammar_mask_rows - before.grammar_mask_rows >= sum(len(collector.tokens(i)) for i in ids)
    assert after.grammar_mask_s > before.grammar_mask_s
    assert after.recompiles_after_warmup == 0, "constrained rows compiled nothing new"


def test_the_same_seeds_unconstrained_are_not_json(engine, prompt):
    """Negative control: without the mask the tiny model does not write JSON by chance."""
    collector = Collector()
    requests = [Job(f"free-{seed}", prompt, 40, RowSampling(temperature=1.0, seed=seed))
                for seed in range(10)]
    for request_id in submit_all(engine, requests, collector):
        with pytest.raises(ValueError):
            json.loads(collector.text(request_id))


def test_json_object_output_parses(engine, prompt):
    """Any JSON object: strings are unbounded, so the random model may fill max_tokens inside
    one; every object it closes parses."""
    grammar = GrammarSpec.json_object()
    collector = Collector()
    requests = [Job(f"object-{seed}", prompt, 400, RowSampling(temperature=0.7, seed=seed),
                    grammar=grammar) for seed in range(8)]
    closed = []
    for request_id in submit_all(engine, requests, collector):
        assert collector.finish(request_id) in ("stop", "length")
        if collector.finish(request_id) == "stop":
            closed.append(json.loads(collector.text(request_id)))
    assert closed and all(isinstance(doc, dict) for doc in closed), closed
    assert any(doc for doc in closed), "some closed object has keys"


def test_choice_stops_on_its_last_character_without_sampling_a_stop_token(engine, prompt):
    choices = ["apple", "banana split", "cherry"]
    grammar = GrammarSpec.choice(choices)
    collector = Collector()
    requests = [Job(f"choice-{seed}", prompt, 50, RowSampling(temperature=1.0, seed=seed),
                    grammar=grammar) for seed in range(6)]
    for request_id in submit_all(engine, requests, collector):
        assert collector.text(request_id) in choices
        assert collector.finish(request_id) == "stop"
        last = collector.events[request_id][-1]
        assert last.num_generated_tokens == len(collector.tokens(request_id)), "no step spent on a stop token"


def test_ignore_eos_and_min_tokens_never_leave_a_row_without_an_allowed_token(engine, prompt):
    """Both ban the stop tokens with a -inf bias; the grammar's end must still end the row."""
    grammar = GrammarSpec.regex(r"[0-9]{1,6}")
    collector = Collector()
    requests = [Job(f"bans-{i}", prompt, 30, RowSampling(temperature=1.0, seed=i), grammar=grammar,
                    ignore_eos=i % 2 == 0, min_tokens=30 if i % 3 == 0 else 0) for i in range(6)]
    for request_id in submit_all(engine, requests, collector):
        text = collector.text(request_id)
        assert collector.finish(request_id) == "stop" and text.isdigit() and 1 <= len(text) <= 6, text
    assert engine.stats().grammar_errors == 0


def test_constrained_neighbour_leaves_unconstrained_rows_bit_identical(engine, prompt):
    """Unconstrained rows alone, then batched with constrained rows: the same tokens."""
    grammar = GrammarSpec.json_schema(SCHEMA)
    settings = [RowSampling(temperature=0.0, logprobs=3), RowSampling(temperature=1.0, seed=7, logprobs=3),
                RowSampling(temperature=0.8, top_p=0.9, seed=8, logprobs=3)]

    def free(i: int, tag: str) -> Job:
        return Job(f"{tag}-{i}", prompt + (i + 5,), 40, settings[i], ignore_eos=True)

    alone = Collector()
    for i in range(3):
        submit_all(engine, [free(i, "alone")], alone)
    mixed = Collector()
    constrained = [Job(f"masked-{i}", prompt, MAX_TOKENS, RowSampling(temperature=1.0, seed=i),
                       grammar=grammar) for i in range(3)]
    submit_all(engine, [x for i in range(3) for x in (constrained[i], free(i, "mixed"))], mixed)
    for i in range(3):
        assert mixed.tokens(f"mixed-{i}") == alone.tokens(f"alone-{i}"), f"row {i}: tokens changed"
        # Alone, a row decodes in the 1-row bucket, mixed in the 8-row one: the model's
        # matmuls then sum in another order (~1e-6 apart in f32, with or without masks).
        # At one shape a mask changes nothing, bit for bit: tests/engine/test_runner.py.
        assert mixed.logprobs(f"mixed-{i}") == pytest.approx(alone.logprobs(f"alone-{i}"), abs=1e-5)
        check(json.loads(mixed.text(f"masked-{i}")), SCHEMA)
    assert engine.stats().recompiles_after_warmup == 0
