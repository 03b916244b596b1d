"""Chat sessions (`session_id`, api/sessions.py) hold only what the template can use, within
byte bounds that count what the turns really take: a field no template renders (a
megabyte `name`, an unknown key inside a tool call) is refused or dropped when the
request arrives, the store's counted bytes match what tracemalloc sees it allocate, and
many large exchanges leave it no larger than its caps. One server for the module, over
the shared tiny engine."""

from __future__ import annotations

import gc
import tracemalloc

import pytest

from api.app import create_app
from api.config import ServerConfig
from api.errors import APIError
from api.sessions import SessionStore, credential_namespace
from api.state import state_of
from tests.support.server_harness import ServerThread, tiny_engine

KIB = 1024
BIG = "x" * (1 << 20)  # 1 MiB: far over any sane name, well under the 4 MiB body limit


@pytest.fixture(scope="module")
def app():
    return create_app(tiny_engine(), ServerConfig())


@pytest.fixture(scope="module")
def server(app):
    with ServerThread(app) as url:
        yield url


def chat(http, model, messages, session_id):
    return http.post("/v1/chat/completions", json={"model": model, "messages": messages, "max_tokens": 2,
                                                   "temperature": 0, "session_id": session_id})


def test_an_overlong_name_in_a_session_is_a_400_before_generating(http, model, app):
    before = http.get("/admin/stats").json()["tokens_generated"]
    r = chat(http, model, [{"role": "user", "content": "hi", "name": BIG}], "s-name")
    assert r.status_code == 400, "a megabyte name the template may never render must not join a session"
    error = r.json()["error"]
    assert error["param"] == "messages[0].name" and "256 characters" in error["message"], error
    assert http.get("/admin/stats").json()["tokens_generated"] == before, "refused before generating"
    assert state_of(app).sessions.history(credential_namespace({}), "s-name") == []
    assert chat(http, model, [{"role": "user", "content": "hi", "name": "ada"}], "s-name").status_code == 200


def test_unknown_fields_of_a_tool_call_are_not_kept(http, model, app):
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}, "padding": BIG}
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "42"}, {"role": "user", "content": "ok"}]
    r = chat(http, model, messages, "s-call")
    assert r.status_code == 200, r.text
    store = state_of(app).sessions
    kept = store.history(credential_namespace({}), "s-call")
    assert [t["role"] for t in kept] == ["user", "assistant", "tool", "user", "assistant"]
    assert kept[1]["tool_calls"] == [{"id": "call_1", "type": "function",
                                      "function": {"name": "f", "arguments": "{}"}}], \
        "a kept call holds what the template reads, nothing else"
    assert store.num_bytes < 64 * KIB, f"the session counts {store.num_bytes} bytes: the padding was kept"


def test_a_request_over_the_session_cap_is_a_400_naming_messages():
    store = SessionStore(max_sessions=8, ttl_s=60.0, max_session_bytes=64 * KIB, max_total_bytes=256 * KIB)
    with pytest.raises(APIError) as e:
        store.kept_turns([{"role": "user", "content": "y" * (100 * KIB)}])
    assert (e.value.status, e.value.param, e.value.code) == (400, "messages", "session_too_large")
    assert "65,536" in e.value.message, "the message names the cap"


def test_a_session_drops_its_oldest_exchanges_to_fit_its_cap():
    store = SessionStore(max_sessions=8, ttl_s=60.0, max_session_bytes=64 * KIB, max_total_bytes=256 * KIB)
    for i in range(10):  # 10 exchanges of ~20 KiB: about 3 fit in 64 KiB
        store.append("k", "s", [{"role": "user", "content": f"{i}" + "q" * (20 * KIB)},
                                {"role": "assistant", "content": f"a{i}"}], now=float(i))
    turns = store.history("k", "s", now=10.0)
    assert turns[-1]["content"] == "a9" and turns[0]["role"] == "user", "whole exchanges, the newest kept"
    assert 2 <= len(turns) // 2 <= 3 and turns[0]["content"].startswith(str(10 - len(turns) // 2))
    assert store.num_bytes <= 64 * KIB


def _exchange(i: int, size: int) -> list[dict]:
    # Fresh strings each time (so tracemalloc sees the store be their only holder); one
    # in three holds a character outside Latin-1, which makes CPython store every
    # character of it in 2 bytes.
    text = ("é" if i % 3 == 1 else "€" if i % 3 == 2 else "e") + str(i) * (size // len(str(i)))
    call = {"id": f"call_{i}", "type": "function", "function": {"name": "lookup", "arguments": {"q": str(i)}}}
    return [{"role": "user", "content": text, "name": f"user-{i}"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"call_{i}", "content": text[: size // 4]}]


def _traced(fill) -> tuple[int, object]:
    """Bytes still allocated after `fill()` returns (what the object it returns holds)."""
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        held = fill()
        gc.collect()
        return tracemalloc.get_traced_memory()[0] - base, held
    finally:
        tracemalloc.stop()


def test_counted_bytes_match_what_the_turns_really_take():
    def fill():
        store = SessionStore(max_sessions=1024, ttl_s=3600.0, max_session_bytes=1 << 20, max_total_bytes=1 << 26)
        for i in range(200):
            store.append("k" * 64, f"session-{i % 50}", _exchange(i, 2 * KIB), now=0.0)
        return store

    real, store = _traced(fill)
    # Within 1.5x either way: the count leaves out CPython's allocator rounding and
    # counts a fixed estimate per session for its record and key.
    assert real / 1.5 <= store.num_bytes <= real * 1.5, \
        f"the store counts {store.num_bytes} bytes; tracemalloc saw {real}"


def test_many_large_exchanges_leave_the_store_within_its_total_cap():
    total_cap = 512 * KIB

    def fill():
        store = SessionStore(max_sessions=1024, ttl_s=3600.0, max_session_bytes=128 * KIB,
                             max_total_bytes=total_cap)
        for i in range(200):  # 200 x ~40 KiB = ~8 MiB offered
            store.append("k" * 64, f"session-{i}", _exchange(i, 32 * KIB), now=float(i))
        return store

    real, store = _traced(fill)
    assert store.num_bytes <= total_cap and real <= 1.5 * total_cap, \
        f"{real} bytes held by sessions under a {total_cap}-byte cap (counted {store.num_bytes})"
    assert len(store) < 200 and store.history("k" * 64, "session-199", now=200.0), \
        "the least recently used sessions went, the newest stayed"
