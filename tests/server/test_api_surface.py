"""The rest of the ferrox-server surface, end to end over one real server and the official
clients: a `system` role inside Anthropic `messages`, `chat_template_kwargs`,
`reasoning_effort`, `session_id` (and its per-key privacy). One server for the module,
over a copy of the tiny Llama whose chat template prints the variables it is given, so
every rendered prompt is known text whose token count the test computes with /v1/tokenize."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from api.app import create_app
from api.config import ServerConfig
from tests.support.server_harness import ServerThread, parse_sse, templated_checkpoint, tiny_engine, wait_for

# Prints each turn, then the variables under test right after the generation prompt.
TEMPLATE = ("{%- for m in messages -%}<|{{ m.role }}|>{{ m.content }}\n{% endfor -%}"
            "{%- if add_generation_prompt -%}<|assistant|>"
            "{%- if enable_thinking is defined and not enable_thinking %}[no-think]{% endif -%}"
            "{%- if reasoning_effort is defined %}[effort={{ reasoning_effort }}]{% endif -%}"
            "{{ greeting | default('') }}{%- endif -%}")
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def server():
    root = Path(tempfile.mkdtemp(prefix="ferrox_surface_"))
    folder = templated_checkpoint(TEMPLATE, root / "tiny-surface")
    try:
        with ServerThread(create_app(tiny_engine(folder), ServerConfig())) as url:
            yield url
    finally:
        shutil.rmtree(root, ignore_errors=True)


def count(http, text: str) -> int:
    """Tokens of an already rendered prompt (the chat route adds no special tokens)."""
    return http.post("/v1/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["count"]


def chat_tokens(client, model, messages, **extra) -> int:
    reply = client.chat.completions.create(model=model, messages=messages, max_tokens=1,
                                           extra_body={**GREEDY, **extra})
    return reply.usage.prompt_tokens


USER = [{"role": "user", "content": "Hello"}]


# ---------------------------------------------------------------- template variables


@pytest.mark.parametrize("extra, rendered", [
    ({"chat_template_kwargs": {"greeting": "Hi there"}}, "Hi there"),
    ({"reasoning_effort": "none"}, "[no-think][effort=none]"),
    ({"reasoning_effort": "high"}, "[effort=high]"),  # high: the switch on, so no [no-think]
    # a key the request gives wins over the effort's mapping
    ({"reasoning_effort": "low", "chat_template_kwargs": {"enable_thinking": False}}, "[no-think][effort=low]"),
])
def test_template_variables_reach_the_template(client, http, model, extra, rendered):
    want = count(http, "<|user|>Hello\n<|assistant|>" + rendered)
    assert want != count(http, "<|user|>Hello\n<|assistant|>"), "the variables must change the prompt"
    assert chat_tokens(client, model, USER, **extra) == want
    assert http.post("/v1/tokenize", json={"messages": USER, **extra}).json()["count"] == want


@pytest.mark.parametrize("extra, param", [
    ({"chat_template_kwargs": "enable_thinking"}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs.messages"),
    ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs.add_generation_prompt"),
    ({"reasoning_effort": "extreme"}, "reasoning_effort"),
    ({"session_id": ""}, "session_id"),
    ({"session_id": 7}, "session_id"),
])
def test_bad_template_variables_and_sessions_are_400s_naming_the_field(client, model, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=USER, max_tokens=1, extra_body=extra)
    assert e.value.body["param"] == param and e.value.body["type"] == "invalid_request_error"


# ---------------------------------------------------------------- sessions


def rendered(turns) -> str:
    return "".join(f"<|{t['role']}|>{t['content']}\n" for t in turns) + "<|assistant|>"


def test_a_session_prepends_its_earlier_turns(client, http, model):
    first = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "one"}],
                                           max_tokens=3, extra_body={**GREEDY, "session_id": "s-whole"})
    answer = first.choices[0].message.content
    history = [{"role": "user", "content": "one"}, {"role": "assistant", "content": answer},
               {"role": "user", "content": "two"}]
    got = chat_tokens(client, model, [{"role": "user", "content": "two"}], session_id="s-whole")
    assert got == count(http, rendered(history)), "the second turn must follow the first exchange"


def test_a_streamed_reply_joins_its_session(client, http, model):
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "one"}],
                                            max_tokens=3, stream=True, extra_body={**GREEDY, "session_id": "s-sse"})
    answer = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    history = [{"role": "user", "content": "one"}, {"role": "assistant", "content": answer},
               {"role": "user", "content": "two"}]
    got = chat_tokens(client, model, [{"role": "user", "content": "two"}], session_id="s-sse")
    assert got == count(http, rendered(history))


def test_only_the_same_key_reads_a_session(server, client, http, model):
    client.chat.completions.create(model=model, messages=[{"role": "user", "content": "secret"}], max_tokens=2,
                                   extra_body={**GREEDY, "session_id": "s-private"})
    other = openai.OpenAI(base_url=server + "/v1", api_key="another-key", max_retries=0)
    alone = [{"role": "user", "content": "two"}]
    assert chat_tokens(other, model, alone, session_id="s-private") == count(http, rendered(alone)), \
        "another key must not see the session's turns"


# ---------------------------------------------------------------- Anthropic: system inside messages


def test_anthropic_system_messages_fold_into_the_system_prompt(server, http, model):
    claude = anthropic.Anthropic(base_url=server, api_key="unused", max_retries=0)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "system", "content": [{"type": "text", "text": "No lists."}]}]
    want = count(http, rendered([{"role": "system", "content": "Top\n\nBe brief.\n\nNo lists."},
                                 {"role": "user", "content": "Hi"}]))
    assert claude.messages.count_tokens(model=model, system="Top", messages=messages).input_tokens == want
    msg = claude.messages.create(model=model, system="Top", messages=messages, max_tokens=1, extra_body=GREEDY)
    assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens == want


@pytest.mark.parametrize("messages, param", [
    ([{"role": "system", "content": "only a system prompt"}], "messages"),
    ([{"role": "system", "content": [{"type": "image"}]}, {"role": "user", "content": "Hi"}],
     "messages[0].content[0]"),
])
def test_anthropic_bad_system_messages_are_400s_in_anthropics_envelope(server, model, messages, param):
    body = httpx.post(server + "/v1/messages", json={"model": model, "max_tokens": 1, "messages": messages})
    assert body.status_code == 400
    assert body.json()["type"] == "error" and body.json()["error"]["type"] == "invalid_request_error"
    assert param in body.json()["error"]["message"]


def test_session_store_is_bounded_in_number_and_age():
    from api.sessions import SessionStore

    store = SessionStore(max_sessions=2, ttl_s=10.0)
    turn = [{"role": "user", "content": "x"}]
    store.append("k", "a", turn, now=0.0)
    store.append("k", "b", turn, now=1.0)
    store.append("k", "c", turn, now=2.0)  # 3 sessions > 2: "a", the least recently used, goes
    assert store.history("k", "a", now=2.0) == [] and store.history("k", "b", now=2.0) == turn
    assert store.history("other-key", "b", now=2.0) == [], "a session is filed under its key"
    assert store.history("k", "b", now=11.0) == [], "unused for 10 s: forgotten"
    assert store.history("k", "c", now=11.0) == turn and len(store) == 1


# ---------------------------------------------------------------- llama.cpp /completion


def completion(http, **body):
    return http.post("/completion", json={"n_predict": 4, "temperature": 0, **body}).json()


def test_return_tokens_gives_the_generated_ids(http):
    plain = completion(http, prompt="Hello")
    assert plain["tokens"] == [], "llama.cpp leaves tokens empty unless asked"
    asked = completion(http, prompt="Hello", return_tokens=True)
    assert len(asked["tokens"]) == asked["tokens_predicted"] == 4, "greedy here never ends by itself"
    assert http.post("/v1/detokenize", json={"tokens": asked["tokens"]}).json()["text"] == asked["content"]
    with http.stream("POST", "/completion", json={"prompt": "Hello", "n_predict": 4, "temperature": 0,
                                                  "stream": True, "return_tokens": True}) as r:
        events = parse_sse(r.read().decode())
    assert [t for e in events for t in e["tokens"]] == asked["tokens"]


def test_cache_prompt_decides_whether_the_prefix_cache_serves(http):
    prompt = "The prefix cache keeps whole blocks of sixteen positions. " * 3  # > 2 blocks, unique here
    length = http.post("/v1/tokenize", json={"prompt": prompt}).json()["count"]
    cached = (length - 1) // 16 * 16  # whole blocks before the last prompt token
    assert cached >= 32
    assert completion(http, prompt=prompt, cache_prompt=False)["tokens_cached"] == 0, "a first sight"
    assert completion(http, prompt=prompt)["tokens_cached"] == cached, "cache_prompt false still fills the cache"
    assert completion(http, prompt=prompt, cache_prompt=False)["tokens_cached"] == 0, "false: nothing read"


def test_llamacpp_bad_fields_are_400s_in_its_envelope(http):
    r = http.post("/completion", json={"prompt": "Hello", "return_tokens": "yes"})
    assert r.status_code == 400
    assert r.json()["error"]["code"] == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert "return_tokens" in r.json()["error"]["message"]


# ---------------------------------------------------------------- Responses lookups, slots, caches


def test_an_in_flight_response_is_found_shown_in_slots_and_cancelled(client, http, model):
    stream = client.responses.create(model=model, input="Hello", max_output_tokens=1500, stream=True,
                                     temperature=0)
    events = iter(stream)
    response_id = next(events).response.id
    assert client.responses.retrieve(response_id).status == "in_progress"
    slots = http.get("/slots").json()
    assert len(slots) == 32 and [s["id"] for s in slots] == list(range(32)), "one per row (max_seqs 32)"
    busy = [s for s in slots if s["is_processing"]]
    assert [s["id_task"] for s in busy] == [response_id] and busy[0]["route"] == "/v1/responses"
    assert busy[0]["n_prompt_tokens"] > 0 and busy[0]["n_ctx"] == 2048
    assert client.responses.cancel(response_id).status == "cancelled"
    last = list(events)[-1]
    assert last.type == "response.incomplete" and last.response.status == "cancelled"
    wait_for(lambda: not any(s["is_processing"] for s in http.get("/slots").json()))
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.retrieve(response_id)
    assert e.value.body["code"] == "response_not_found" and e.value.body["param"] == "response_id"
    with pytest.raises(openai.NotFoundError):
        client.responses.cancel(response_id)


def test_cache_status_and_stats_match_the_engine(http):
    status = http.get("/v1/cache/status").json()
    stats = http.get("/admin/stats").json()
    assert (status["block_size"], status["blocks_total"]) == (16, stats["kv_blocks_total"])
    assert status["blocks_used"] == status["blocks_total"] - status["blocks_free"]
    # the null block is part of the cache's bytes, never handed out
    assert status["bytes_total"] == status["bytes_per_block"] * (status["blocks_total"] + 1)
    prefix = status["prefix_cache"]
    assert prefix["enabled"] and prefix["hit_tokens"] == stats["prefix_cache_hits"]
    assert prefix["queried_tokens"] == stats["prefix_cache_queries"]
    both = http.get("/cache/stats").json()
    assert both["prefix_cache"]["hit_tokens"] == prefix["hit_tokens"] and "response_cache" in both


def test_responses_reasoning_effort_reaches_the_template(client, http, model):
    reply = client.responses.create(model=model, input="Hello", max_output_tokens=1, temperature=0,
                                    reasoning={"effort": "none"})
    assert reply.usage.input_tokens == count(http, "<|user|>Hello\n<|assistant|>[no-think][effort=none]")
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=model, input="Hello", max_output_tokens=1, reasoning={"effort": "max"})
    assert e.value.body["param"] == "reasoning.effort"
