"""/v1/chat/completions end to end (real Hypercorn server, real engine on a tiny Llama with
a ChatML template), with the official `openai` client and httpx."""

from __future__ import annotations

import httpx
import pytest

from api.app import create_app
from api.config import ServerConfig
from tests.support.server_harness import CONTEXT_TOKENS, ServerThread, parse_sse, tiny_engine

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello world!"}]


@pytest.fixture(scope="module")
def server():
    with ServerThread(create_app(tiny_engine(), ServerConfig())) as url:
        yield url


def chat(http, **body):
    r = http.post("/v1/chat/completions", json={"messages": MESSAGES, **body})
    assert r.status_code == 200, r.text
    return r.json()


def prompt_ids(http, messages) -> list[int]:
    """The prompt's token ids as the chat route renders and tokenizes `messages`."""
    return http.post("/v1/tokenize", json={"messages": messages}).json()["tokens"]


def prompt_count(http, messages) -> int:
    return len(prompt_ids(http, messages))


def test_chat_with_the_openai_client(client, http, model):
    out = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=6, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert out.object == "chat.completion"
    assert out.model_extra["request_id"] == out.id and out.id.startswith("chatcmpl-")
    choice = out.choices[0]
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason == "length"
    assert out.usage.prompt_tokens == prompt_count(http, MESSAGES)
    assert out.usage.completion_tokens == 6


def test_the_prompt_is_the_chat_template(http):
    rendered = "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHello world!<|im_end|>\n" \
               "<|im_start|>assistant\n"  # tests/support/tiny_model.py's CHATML_TEMPLATE by hand
    assert prompt_ids(http, MESSAGES) == http.post(
        "/v1/tokenize", json={"prompt": rendered, "add_special_tokens": False}).json()["tokens"]


def test_all_roles_and_text_parts(http):
    messages = [
        {"role": "system", "content": [{"type": "text", "text": "Be"}, {"type": "text", "text": "brief."}]},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": "{}"}}]},
        {"role": "tool", "content": "4", "tool_call_id": "call_1"},
        {"role": "user", "content": "Thanks"},
    ]
    out = chat(http, messages=messages, max_tokens=3, temperature=0)
    assert out["usage"]["prompt_tokens"] == prompt_count(http, messages)
    same = [{**messages[0], "content": "Be\nbrief."}] + messages[1:]
    assert prompt_ids(http, same) == prompt_ids(http, messages), "text parts join with newlines"


def test_default_max_tokens_is_the_room_left(http):
    out = chat(http, temperature=0, ignore_eos=True)
    prompt = out["usage"]["prompt_tokens"]
    assert out["usage"]["completion_tokens"] == CONTEXT_TOKENS - prompt, "the context minus the prompt"
    assert out["choices"][0]["finish_reason"] == "length"


def test_max_completion_tokens_wins_over_max_tokens(http):
    out = chat(http, max_tokens=9, max_completion_tokens=4, temperature=0, ignore_eos=True)
    assert out["usage"]["completion_tokens"] == 4


def test_logprobs_and_top_logprobs(client, model):
    out = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=5, temperature=0,
                                         logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = out.choices[0].logprobs.content
    assert len(content) == 5
    assert "".join(c.token for c in content) == out.choices[0].message.content
    for item in content:
        assert len(item.top_logprobs) == 2
        assert item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
        assert item.logprob == pytest.approx(item.top_logprobs[0].logprob), "greedy picks the best"
        assert item.bytes == list(item.token.encode("utf-8"))
    plain = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2, temperature=0)
    assert plain.choices[0].logprobs is None


def test_seeded_chat_is_reproducible_and_n_gives_n_choices(http):
    body = dict(max_tokens=8, temperature=1.0, seed=99, n=3, ignore_eos=True)
    first = chat(http, **body)
    again = chat(http, **body)
    assert [c["message"]["content"] for c in first["choices"]] == [c["message"]["content"] for c in again["choices"]]
    assert [c["index"] for c in first["choices"]] == [0, 1, 2]
    assert first["usage"]["completion_tokens"] == 3 * 8


def test_streaming_chat_matches_the_whole_answer(http, client, model):
    whole = chat(http, max_tokens=10, temperature=0, ignore_eos=True)
    stream = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=10, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant", "the first chunk carries the role"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole["choices"][0]["message"]["content"]
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert reasons == ["length"]
    assert all(c.usage is None for c in chunks), "no usage chunk unless include_usage"


def test_streaming_chat_usage_chunk(http):
    r = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 4, "temperature": 0,
                                                "ignore_eos": True, "stream": True,
                                                "stream_options": {"include_usage": True}})
    events = parse_sse(r.text)
    assert events[-1] == "[DONE]"
    usage_chunks = [e for e in events[:-1] if "usage" in e]
    assert len(usage_chunks) == 1 and usage_chunks[0] is events[-2]
    assert usage_chunks[0]["choices"] == []
    assert usage_chunks[0]["usage"]["completion_tokens"] == 4
    assert usage_chunks[0]["usage"]["prompt_tokens"] == prompt_count(http, MESSAGES)
