"""Fuzzed request bodies against a real server: never a 5xx, every 4xx in the envelope.

Hypothesis draws, per route, bodies that are valid-ish (each known field either a
plausible value or junk: wrong types, huge and negative numbers, NaN, lone surrogates,
nested lists and objects) and raw garbage (bytes, truncated JSON, JSON that is not an
object). The server must answer each with a status below 500; a 4xx must carry the
OpenAI envelope; a 200 stream must end with `[DONE]` and carry no error event.

The Anthropic, Responses, llama.cpp and embeddings routes get the same property with
their own envelopes (`test_other_protocols_fuzzed_bodies_never_get_a_5xx`).

Generation is kept short by the server's limits, not by the strategies: the fuzzed
`max_tokens` may be anything, `--max-output-tokens 8` caps what is served (asking more is
a 400), `--max-n 4`. Bounded: 150 examples per route, no per-example deadline.
"""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from api.app import create_app
from api.config import ServerConfig
from tests.support.server_harness import ServerThread, parse_sse, tiny_engine

EXAMPLES = 150  # per route: VALID_EXAMPLES plausible bodies, valid-ish ones, GARBAGE_EXAMPLES raw garbage
VALID_EXAMPLES = 40
GARBAGE_EXAMPLES = 30
FUZZ_SETTINGS = settings(max_examples=EXAMPLES, deadline=None, database=None,
                         suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                                HealthCheck.data_too_large])


@pytest.fixture(scope="module")
def http():
    config = ServerConfig(max_output_tokens=8, max_n=4, max_prompt_tokens=512)
    with ServerThread(create_app(tiny_engine(), config)) as url, httpx.Client(base_url=url, timeout=60) as client:
        yield client


# ---------------------------------------------------------------- strategies

# Any Unicode (control characters, astral planes); lone surrogates (which strict JSON
# parsers refuse) only now and then, so most bodies still parse.
texts = st.one_of(st.text(st.characters(exclude_categories=("Cs",)), max_size=40),
                  st.text(st.characters(exclude_categories=("Cs",)), max_size=40),
                  st.sampled_from(["", "Hello", "{{ ''.__class__ }}", "\u00e9\u4e2d\U0001f600", "\ud800", "\x00",
                                   "a" * 300, "<|im_end|>", "<|im_start|>system"]))
huge_ints = st.integers() | st.sampled_from([0, -1, 2**31, 2**63, 10**30, -(10**30)])
numbers = huge_ints | st.floats(allow_nan=True, allow_infinity=True)
junk = st.recursive(st.none() | st.booleans() | numbers | texts,
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(texts, inner, max_size=4),
                    max_leaves=12)


def route_strategies(valid: bool) -> dict:
    """Body strategies per route. `valid`: every field plausible (most bodies reach the
    engine); otherwise each field is mostly plausible, sometimes an edge just outside the
    valid range, sometimes junk of any type."""

    def field(plausible, edges=st.nothing()):
        return plausible if valid else st.one_of(plausible, plausible, plausible, plausible, edges, junk)

    token_ids = st.lists(st.integers(0, 383), min_size=1, max_size=12)
    if not valid:
        token_ids = token_ids | st.lists(st.integers(-5, 500), max_size=12)
    small_int, small_edges = st.integers(1, 12), st.sampled_from([-1, 0, 9, 40, 2**63])
    unit, unit_edges = st.floats(0, 1), st.sampled_from([-0.5, 0.0, 1.0, 2.0, 2.5, 1e308])
    text = st.text(st.characters(exclude_categories=("Cs",)), min_size=1, max_size=40) if valid else texts
    parts = st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": text}), min_size=1, max_size=3)
    message = st.fixed_dictionaries(
        {"role": field(st.sampled_from(["system", "developer", "user", "assistant", "tool"]), st.just("robot"))},
        optional={"content": field(text | parts), "name": field(text),
                  **({} if valid else {"tool_calls": junk}), "tool_call_id": field(text)})
    messages = st.lists(field(message), min_size=1, max_size=4)
    if not valid:
        messages = st.one_of(messages, messages, messages, st.just([]))
    stop = text | st.lists(text, max_size=3)
    sampling = {
        "model": field(st.just("tiny-chat"), st.just("gpt-4")), "temperature": field(unit, unit_edges),
        "top_p": field(st.floats(0.05, 1), unit_edges), "top_k": field(small_int, small_edges),
        "min_p": field(unit, unit_edges), "n": field(st.integers(1, 4), small_edges),
        "stop": field(stop, st.lists(texts, min_size=17, max_size=20)), "stop_token_ids": field(token_ids),
        "seed": field(huge_ints), "presence_penalty": field(st.floats(-2, 2), unit_edges),
        "frequency_penalty": field(st.floats(-2, 2), unit_edges),
        "repetition_penalty": field(st.floats(0.5, 2), unit_edges),
        "logit_bias": field(st.dictionaries(st.integers(0, 383).map(str), st.floats(-100, 100), max_size=3),
                            st.dictionaries(st.integers(-5, 500).map(str) | texts, st.floats(-150, 150),
                                            max_size=3)),
        "ignore_eos": field(st.booleans()), "min_tokens": field(st.integers(0, 4), small_edges),
        "stream": field(st.booleans()),
        "stream_options": field(st.fixed_dictionaries({}, optional={"include_usage": field(st.booleans())})),
        "user": field(text),
    }
    if valid:  # stream_options without stream is a 400; min_tokens over max_tokens too
        del sampling["stream_options"], sampling["min_tokens"]
    completion = {**sampling, "max_tokens": field(small_int, small_edges),
                  "logprobs": field(st.integers(0, 5), small_edges), "echo": field(st.booleans())}
    if not valid:
        completion.update(best_of=field(st.integers(0, 3)), suffix=field(texts))
    chat = {**sampling, "max_tokens": field(small_int, small_edges),
            "max_completion_tokens": field(small_int, small_edges), "logprobs": field(st.booleans()),
            "add_generation_prompt": field(st.booleans())}
    if not valid:
        chat["top_logprobs"] = field(st.integers(0, 5), small_edges)
    prompt = st.one_of(text, token_ids, st.lists(text, min_size=1, max_size=4),
                       st.lists(token_ids, min_size=1, max_size=4))
    return {
        "/v1/completions": bodies({"prompt": field(prompt)}, completion),
        "/v1/chat/completions": bodies({"messages": field(messages)}, chat),
        "/v1/tokenize": bodies({}, {"prompt": field(text), "messages": field(messages), "model": field(text),
                                    "add_special_tokens": field(st.booleans())}),
        "/v1/detokenize": bodies({"tokens": field(token_ids)}, {"model": field(st.just("tiny-chat"))}),
        "/v1/cancel": bodies({"request_id": field(text | st.just("cmpl-0"))}, {}),
    }


def bodies(required: dict, optional: dict):
    """JSON objects, as bytes: all fields drawn at once, or one or two at a time as real
    clients send them."""
    everything = st.fixed_dictionaries(required, optional=optional)
    keys = sorted(optional)
    few = (st.lists(st.sampled_from(keys), max_size=2, unique=True) if keys else st.just([])).flatmap(
        lambda chosen: st.fixed_dictionaries({**required, **{k: optional[k] for k in chosen}}))
    return st.one_of(everything, few).map(lambda d: json.dumps(d).encode())


def garbage(objects):
    """Raw bodies that are not a JSON object: bytes, truncated JSON, other JSON values."""
    return (st.binary(max_size=64) | junk.map(lambda v: json.dumps(v).encode())
            | objects.map(lambda b: b[: max(1, len(b) // 2)]))


ROUTES = route_strategies(valid=False)
VALID_ROUTES = route_strategies(valid=True)


# ---------------------------------------------------------------- the property


def check(r: httpx.Response, raw: bytes) -> None:
    assert r.status_code < 500, f"{r.status_code} for body {raw[:300]!r}: {r.text[:500]}"
    if r.status_code >= 400:
        error = r.json()["error"]
        assert {"message", "type", "param", "code"} <= set(error), r.text
        assert isinstance(error["message"], str) and error["message"]
        return
    if r.headers["content-type"].startswith("text/event-stream"):
        events = parse_sse(r.text)
        assert events and events[-1] == "[DONE]", f"stream without [DONE] for body {raw[:300]!r}"
        assert not any(isinstance(e, dict) and "error" in e for e in events), f"error event: {r.text[-500:]}"


def fuzz(http, path: str, strategy, max_examples: int) -> None:
    @settings(FUZZ_SETTINGS, max_examples=max_examples)
    @given(raw=strategy)
    def run(raw: bytes) -> None:
        check(http.post(path, content=raw, headers={"Content-Type": "application/json"}), raw)

    run()


@pytest.mark.parametrize("path", list(ROUTES))
def test_fuzzed_bodies_never_get_a_5xx(http, path):
    fuzz(http, path, VALID_ROUTES[path], VALID_EXAMPLES)
    fuzz(http, path, ROUTES[path], EXAMPLES - VALID_EXAMPLES - GARBAGE_EXAMPLES)
    fuzz(http, path, garbage(ROUTES[path]), GARBAGE_EXAMPLES)
    assert http.get("/health").status_code == 200
    stats = http.get("/admin/stats").json()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"] or stats["generating_now"] > 0


@pytest.mark.parametrize("body", [{"prompt": "0", "top_k": 2**63, "max_tokens": 2},
                                  {"prompt": "0", "top_k": 2**31, "seed": 2**70, "max_tokens": 2}])
def test_huge_integers_the_fuzzer_found_are_served(http, body):
    r = http.post("/v1/completions", json=body)
    check(r, json.dumps(body).encode())
    assert r.status_code == 200, r.text


# ---------------------------------------------------------------- the other wire protocols

OTHER_EXAMPLES = 60  # per route


def _other_routes(valid: bool) -> dict:
    """Bodies for the Anthropic, Responses, llama.cpp and embeddings adapters: every field
    plausible (`valid`), or each plausible four times in six, else junk or a huge integer."""

    def field(plausible):
        return plausible if valid else st.one_of(plausible, plausible, plausible, plausible, junk, huge_ints)

    text = st.text(st.characters(exclude_categories=("Cs",)), min_size=1, max_size=30)
    ids = st.lists(st.integers(-5, 500), min_size=1, max_size=8)
    small = st.integers(1, 12)
    unit = st.floats(0, 1)
    a_block = st.fixed_dictionaries({"type": st.sampled_from(["text", "image", "tool_use", "tool_result"]),
                                     "text": text}, optional={"id": text, "name": text, "input": junk})
    a_message = st.fixed_dictionaries({"role": field(st.sampled_from(["user", "assistant"])),
                                       "content": field(text | st.lists(a_block, min_size=1, max_size=2))})
    a_tool = st.fixed_dictionaries({"name": field(text), "input_schema": field(st.just({"type": "object"}))},
                                   optional={"type": st.sampled_from(["custom", "web_search_20250305"])})
    anthropic = {"model": field(st.just("tiny-chat")), "max_tokens": field(small),
                 "messages": field(st.lists(a_message, min_size=1, max_size=3))}
    anthropic_optional = {"system": field(text), "temperature": field(unit), "top_k": field(small),
                          "top_p": field(unit), "stop_sequences": field(st.lists(text, max_size=2)),
                          "stream": field(st.booleans()), "tools": field(st.lists(a_tool, max_size=2)),
                          "tool_choice": field(st.fixed_dictionaries({"type": st.sampled_from(["auto", "any", "none",
                                                                                             "tool"])})),
                          "thinking": field(st.fixed_dictionaries({"type": st.sampled_from(["enabled", "disabled"]),
                                                                   "budget_tokens": st.integers(0, 5000)}))}
    r_item = st.fixed_dictionaries({"role": field(st.sampled_from(["user", "assistant", "system", "developer"])),
                                    "content": field(text)}, optional={"type": st.sampled_from(
                                        ["message", "function_call", "function_call_output", "reasoning"])})
    responses = {"input": field(text | st.lists(r_item, min_size=1, max_size=3))}
    responses_optional = {"model": field(st.just("tiny-chat")), "instructions": field(text),
                          "max_output_tokens": field(small), "temperature": field(unit), "top_p": field(unit),
                          "stream": field(st.booleans()), "text": field(st.fixed_dictionaries(
                              {"format": st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object",
                                                                                         "json_schema"])})})),
                          "tools": field(st.lists(st.fixed_dictionaries({"type": st.just("function"),
                                                                         "name": text}), max_size=2))}
    llamacpp = {"prompt": field(text | ids)}
    llamacpp_optional = {"n_predict": field(st.integers(-1, 8)), "temperature": field(unit), "top_k": field(small),
                         "top_p": field(unit), "min_p": field(unit), "repeat_penalty": field(st.floats(0.5, 2)),
                         "seed": field(huge_ints), "stop": field(st.lists(text, max_size=2)),
                         "stream": field(st.booleans()), "cache_prompt": field(st.booleans())}
    embeddings = {"input": field(text | st.lists(text, min_size=1, max_size=3) | ids
                                 | st.lists(ids, min_size=1, max_size=3))}
    embeddings_optional = {"model": field(st.just("tiny-chat")), "encoding_format": field(
        st.sampled_from(["float", "base64"])), "pooling": field(st.sampled_from(["mean", "last"]))}
    return {"/v1/messages": bodies(anthropic, anthropic_optional),
            "/v1/responses": bodies(responses, responses_optional),
            "/completion": bodies(llamacpp, llamacpp_optional),
            "/v1/embeddings": bodies(embeddings, embeddings_optional)}


OTHER_ROUTES = _other_routes(valid=False)
OTHER_VALID_ROUTES = _other_routes(valid=True)


def check_other(path: str, r: httpx.Response, raw: bytes) -> None:
    """No 5xx; a 4xx in the route's own envelope; a stream without an error event."""
    assert r.status_code < 500, f"{path}: {r.status_code} for body {raw[:300]!r}: {r.text[:500]}"
    if r.status_code >= 400:
        body = r.json()
        if path == "/v1/messages":
            assert body["type"] == "error" and {"type", "message"} <= set(body["error"]), r.text
        elif path == "/completion":
            assert {"code", "message", "type"} <= set(body["error"]), r.text
        else:
            assert {"message", "type", "param", "code"} <= set(body["error"]), r.text
        return
    if r.headers["content-type"].startswith("text/event-stream"):
        assert "event: error" not in r.text and '"type": "error"' not in r.text, f"{path}: error event: {r.text[-500:]}"


@pytest.mark.parametrize("path", list(OTHER_ROUTES))
def test_other_protocols_fuzzed_bodies_never_get_a_5xx(http, path):
    @settings(FUZZ_SETTINGS, max_examples=OTHER_EXAMPLES)
    @given(raw=OTHER_VALID_ROUTES[path] | OTHER_ROUTES[path] | garbage(OTHER_ROUTES[path]))
    def run(raw: bytes) -> None:
        check_other(path, http.post(path, content=raw, headers={"Content-Type": "application/json"}), raw)

    run()
    assert http.get("/health").status_code == 200
    stats = http.get("/admin/stats").json()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"] or stats["generating_now"] > 0
