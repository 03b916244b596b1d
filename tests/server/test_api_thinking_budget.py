"""Thinking budgets on every wire, against a tiny random Qwen3 whose tokenizer has Qwen3's
`<think>` / `</think>` added tokens and whose chat template opens the section in the
generation prompt as the Qwen3 Thinking models' does. A random model never closes its
section, which is exactly what a budget cuts: with a budget of N the reply's reasoning is
the unbudgeted reply's first N tokens (greedy, so the same tokens), the marker follows, and
the model goes on with an answer. Chat (`thinking_token_budget`, whole and streamed, the
reasoning under `reasoning_content` and `reasoning`), completions, Responses
(`reasoning.max_tokens` and `thinking_token_budget`) and Anthropic's `thinking.budget_tokens`
(1024 at least: its unbudgeted twin runs in the same batch). Real server, one engine."""

from __future__ import annotations

import json
import shutil
import tempfile
import threading
from pathlib import Path

import httpx
import pytest
import transformers

from tests.support import family_checks as fc
from tests.support.server_harness import ServerThread, parse_sse, tiny_engine

# Qwen3 Thinking's template, in the parts that place the markers: earlier turns' thinking is
# dropped from the history, and the generation prompt opens `<think>\n`.
QWEN3_THINKING_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}{%- set content = message.content %}"
    "{%- if '</think>' in content %}{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "{{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n<think>\\n' }}{%- endif %}")
QUESTION = "Tell me about a person."
PROMPT_TEXT = f"<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n<think>\n"
BUDGET = 6
EXTRA = 8  # tokens past the budget: the marker and the start of the answer


def tiny_qwen3(folder: Path) -> Path:
    """A random Qwen3 with the tests' BPE tokenizer plus `<think>` and `</think>` as added
    tokens (one id each, as in Qwen3's tokenizer) and the template above."""
    from tokenizers import AddedToken, Tokenizer

    config = transformers.Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      max_position_embeddings=2048, tie_word_embeddings=False)
    fc.make_checkpoint(folder, config, chat_template=QWEN3_THINKING_TEMPLATE)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.add_tokens([AddedToken("<think>", normalized=False), AddedToken("</think>", normalized=False)])
    tok.save(str(folder / "tokenizer.json"))
    config.vocab_size = tok.get_vocab_size()  # the two new ids need rows in the embedding
    from tests.support.tiny_model import save_random_weights

    save_random_weights(config, folder)
    return folder


@pytest.fixture(scope="module")
def server():
    root = Path(tempfile.mkdtemp(prefix="ferrox_qwen3_"))
    try:
        folder = tiny_qwen3(root / "tiny-qwen3")
        # Two rows (the batched tests run two requests at once), a context for Anthropic's
        # least budget: few step shapes to compile.
        engine = tiny_engine(folder, max_seqs=2, prefill_chunk=32, kv_blocks=140, max_context=1088, max_queue=8)
        from api.app import create_app
        from api.config import ServerConfig

        with ServerThread(create_app(engine, ServerConfig())) as url:
            yield url
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server, timeout=300) as client:
        yield client


def chat(http, **fields) -> dict:
    body = {"messages": [{"role": "user", "content": QUESTION}], "temperature": 0, **fields}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def reasoning_n(http) -> str:
    """The unbudgeted reply's first BUDGET tokens: all thinking (the section is never closed)."""
    message = chat(http, max_tokens=BUDGET)["choices"][0]["message"]
    assert message["reasoning_content"] and message["content"] == "", "an unclosed section is all reasoning"
    return message["reasoning_content"]


def test_chat_stops_thinking_at_the_budget_and_answers(http, reasoning_n):
    free = chat(http, max_tokens=BUDGET + EXTRA)["choices"][0]["message"]
    assert free["reasoning_content"] != reasoning_n and free["content"] == "", \
        "negative control: without a budget the random model thinks to the end"
    reply = chat(http, max_tokens=BUDGET + EXTRA, thinking_token_budget=BUDGET)
    message = reply["choices"][0]["message"]
    assert message["reasoning_content"] == reasoning_n, "the reasoning is exactly the first BUDGET tokens"
    assert message["reasoning"] == message["reasoning_content"], "under both names"
    assert reply["usage"]["completion_tokens"] == BUDGET + EXTRA, "the marker and the answer follow"
    assert "</think>" not in message["content"] and "<think>" not in message["reasoning_content"]


def test_streamed_chat_splits_the_same_and_sends_both_names(http, reasoning_n):
    body = {"messages": [{"role": "user", "content": QUESTION}], "temperature": 0, "stream": True,
            "max_tokens": BUDGET + EXTRA, "thinking_token_budget": BUDGET}
    r = http.post("/v1/chat/completions", json=body)
    deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in r.text.splitlines()
              if line.startswith("data: {") and json.loads(line[6:])["choices"]]
    reasoning = [d for d in deltas if "reasoning_content" in d]
    assert reasoning and all(d["reasoning"] == d["reasoning_content"] for d in reasoning)
    assert "".join(d["reasoning_content"] for d in reasoning) == reasoning_n
    whole = chat(http, max_tokens=BUDGET + EXTRA, thinking_token_budget=BUDGET)["choices"][0]["message"]
    assert "".join(d.get("content") or "" for d in deltas) == whole["content"], "streamed == whole"


def test_a_budgeted_row_and_an_unbudgeted_one_in_the_same_batch(server, reasoning_n):
    answers: dict[str, dict] = {}

    def ask(name: str, **fields):
        with httpx.Client(base_url=server, timeout=300) as client:
            answers[name] = chat(client, max_tokens=200, **fields)["choices"][0]["message"]

    threads = [threading.Thread(target=ask, args=("budget",), kwargs={"thinking_token_budget": BUDGET}),
               threading.Thread(target=ask, args=("free",))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert answers["budget"]["reasoning_content"] == reasoning_n
    assert answers["free"]["reasoning_content"].startswith(reasoning_n) and answers["free"]["content"] == ""


def test_completions_force_the_marker_into_the_raw_text(http):
    base = {"prompt": PROMPT_TEXT, "temperature": 0}
    first = http.post("/v1/completions", json={**base, "max_tokens": BUDGET}).json()["choices"][0]["text"]
    cut = http.post("/v1/completions", json={**base, "max_tokens": BUDGET + EXTRA,
                                             "thinking_token_budget": BUDGET}).json()["choices"][0]["text"]
    assert cut.startswith(first + "</think>") and "</think>" not in first, cut


@pytest.mark.parametrize("fields", [{"reasoning": {"max_tokens": BUDGET}}, {"thinking_token_budget": BUDGET}])
def test_responses_cut_the_reasoning_item(http, reasoning_n, fields):
    r = http.post("/v1/responses", json={"input": QUESTION, "temperature": 0, "max_output_tokens": BUDGET + EXTRA,
                                         **fields})
    assert r.status_code == 200, r.text
    items = r.json()["output"]
    assert [i["type"] for i in items] == ["reasoning", "message"]
    assert items[0]["content"][0]["text"] == reasoning_n


@pytest.mark.parametrize("fields, param", [
    ({"reasoning": {"max_tokens": -1}}, "reasoning.max_tokens"),
    ({"reasoning": {"max_tokens": "6"}}, "reasoning.max_tokens"),
    ({"reasoning": {"max_tokens": 6}, "thinking_token_budget": 6}, "thinking_token_budget"),
    ({"thinking_token_budget": -1}, "thinking_token_budget")])
def test_bad_caps_are_400s_naming_the_field(http, fields, param):
    r = http.post("/v1/responses", json={"input": QUESTION, "max_output_tokens": 4, **fields})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": QUESTION}],
                                                "thinking_token_budget": -1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "thinking_token_budget", r.text


ANTHROPIC_BUDGET = 1024  # Anthropic's least budget_tokens


def messages_body(max_tokens: int, thinking: dict | None = None, **fields) -> dict:
    body = {"model": "tiny-qwen3", "max_tokens": max_tokens, "temperature": 0,
            "messages": [{"role": "user", "content": QUESTION}], **fields}
    return body if thinking is None else {**body, "thinking": thinking}


@pytest.fixture(scope="module")
def anthropic_pair(server) -> dict[str, list]:
    """An unbudgeted reply of ANTHROPIC_BUDGET tokens and a budgeted one, run at once."""
    answers: dict[str, list] = {}

    def ask(name: str, body: dict):
        r = httpx.post(server + "/v1/messages", json=body, timeout=300)
        assert r.status_code == 200, r.text
        answers[name] = r.json()["content"]

    enabled = {"type": "enabled", "budget_tokens": ANTHROPIC_BUDGET}
    threads = [threading.Thread(target=ask, args=("first", messages_body(ANTHROPIC_BUDGET))),
               threading.Thread(target=ask, args=("cut", messages_body(ANTHROPIC_BUDGET + EXTRA, enabled)))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    return answers


def test_anthropic_budget_tokens_cut_the_thinking_block(anthropic_pair):
    assert [b["type"] for b in anthropic_pair["first"]] == ["thinking", "text"]
    assert anthropic_pair["first"][1]["text"] == "", "negative control: unbudgeted, it never stops thinking"
    assert [b["type"] for b in anthropic_pair["cut"]] == ["thinking", "text"]
    assert anthropic_pair["cut"][0]["thinking"] == anthropic_pair["first"][0]["thinking"], \
        "exactly budget_tokens of thinking"


def test_streamed_anthropic_thinking_matches(server, anthropic_pair):
    body = messages_body(ANTHROPIC_BUDGET + EXTRA, {"type": "enabled", "budget_tokens": ANTHROPIC_BUDGET},
                         stream=True)
    events = parse_sse(httpx.post(server + "/v1/messages", json=body, timeout=300).text)
    thinking = "".join(e["delta"]["thinking"] for e in events
                       if e.get("type") == "content_block_delta" and e["delta"]["type"] == "thinking_delta")
    assert thinking == anthropic_pair["cut"][0]["thinking"], "streamed == whole"
