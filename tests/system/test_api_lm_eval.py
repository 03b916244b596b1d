"""Scoring as lm-evaluation-harness does it: echo + logprobs with a generated stop token,
every wire counting that token alike, and lm-eval itself (`local-completions` against
this server, its `hf` model on the same weights) agreeing choice for choice.

lm-eval's `local-completions` scores a (context, continuation) pair with
`{"prompt": [[ids]], "max_tokens": 1, "logprobs": 1, "echo": true, "temperature": 0}` and
drops the last logprobs entry as the generated token. The case that matters is a
generated eos: usage counts it, so its entry must be there too, or lm-eval drops a scored
continuation token instead. `STOP_CONTEXT` + `STOP_CHOICE` is a prompt after which the
tiny checkpoint's greedy next token is a stop token (checked against the reference, so a
changed checkpoint fails loudly here instead of testing nothing). The module's server
renders every chat as that prompt, so the chat, Anthropic, Responses and llama.cpp routes
all end on that stop token too. Reference: transformers in float32 on the same folder.
"""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

import anthropic
import httpx
import pytest
import torch
import transformers

from api.app import create_app
from api.config import ServerConfig
from tests.support.server_harness import ServerThread, templated_checkpoint, tiny_engine

STOP_CONTEXT = "Question: what is it? Answer:"
STOP_CHOICE = "{"
LOGPROB_ATOL = 1e-4  # ferrox vs transformers, both float32, 2 layers: summation-order differences only
LM_EVAL_ATOL = 1e-3  # lm-eval's own runs compared (the bound)


@pytest.fixture(scope="module")
def folder():
    with tempfile.TemporaryDirectory(prefix="ferrox_lm_eval_") as root:
        yield templated_checkpoint("{{ '" + STOP_CONTEXT + STOP_CHOICE + "' }}", Path(root) / "tiny-lm-eval")


@pytest.fixture(scope="module")
def server(folder):
    with ServerThread(create_app(tiny_engine(folder), ServerConfig())) as url:
        yield url


@pytest.fixture(scope="module")
def reference(folder):
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def reference_logprobs(reference, ids: list[int]) -> torch.Tensor:
    """f32[len(ids), V]: log p(next token | ids[:i + 1]) at every position."""
    with torch.no_grad():
        return torch.log_softmax(reference(torch.tensor([ids])).logits[0].float(), dim=-1)


def tokenize(http, text: str) -> list[int]:
    return http.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]


def stop_prompt(http, reference) -> tuple[list[int], int, torch.Tensor]:
    """(ids of context + choice, the context's length, reference logprobs); asserts the
    greedy continuation is a stop token."""
    ids, ctxlen = tokenize(http, STOP_CONTEXT + STOP_CHOICE), len(tokenize(http, STOP_CONTEXT))
    logprobs = reference_logprobs(reference, ids)
    info = http.get("/tokenizer_info").json()
    assert int(logprobs[-1].argmax()) in info["stop_token_ids"], \
        "the tiny checkpoint changed: pick a STOP_CONTEXT whose greedy continuation is a stop token"
    return ids, ctxlen, logprobs


def test_echo_scoring_keeps_the_entry_of_a_generated_stop_token(http, reference):
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    ids, ctxlen, ref = stop_prompt(http, reference)
    body = {"prompt": [ids], "max_tokens": 1, "logprobs": 1, "echo": True, "temperature": 0}  # lm-eval's, verbatim
    reply = http.post("/v1/completions", json=body).json()
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "stop" and reply["usage"]["completion_tokens"] == 1
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(ids) + 1, "every prompt token and the stop token"
    stop_id = int(ref[-1].argmax())
    assert lp["tokens"][-1] == http.post("/detokenize", json={"tokens": [stop_id]}).json()["prompt"] or \
        lp["tokens"][-1] == http.get("/tokenizer_info").json()["added_tokens_decoder"][str(stop_id)]
    assert math.isclose(lp["token_logprobs"][-1], float(ref[-1, stop_id]), abs_tol=LOGPROB_ATOL)
    for i in range(1, len(ids)):
        assert math.isclose(lp["token_logprobs"][i], float(ref[i - 1, ids[i]]), abs_tol=LOGPROB_ATOL), i
    (loglikelihood, _greedy), = LocalCompletionsAPI.parse_logprobs(reply, ctxlens=[ctxlen])
    expected = sum(float(ref[i - 1, ids[i]]) for i in range(ctxlen, len(ids)))
    assert loglikelihood != 0.0 and math.isclose(loglikelihood, expected, abs_tol=LOGPROB_ATOL), \
        "lm-eval's loglikelihood of the continuation is the reference's"


def test_every_wire_counts_the_final_stop_token_alike(http, client, server, model, reference):
    _ids, _ctxlen, ref = stop_prompt(http, reference)
    stop_logprob = float(ref[-1].max())
    messages = [{"role": "user", "content": "anything: the template renders one fixed prompt"}]
    chat = client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0,
                                          logprobs=True, top_logprobs=1)
    (entry,) = chat.choices[0].logprobs.content
    assert chat.choices[0].finish_reason == "stop" and chat.choices[0].message.content == ""
    assert chat.usage.completion_tokens == 1 and math.isclose(entry.logprob, stop_logprob, abs_tol=LOGPROB_ATOL)
    streamed = [e for chunk in client.chat.completions.create(model=model, messages=messages, max_tokens=8,
                                                              temperature=0, logprobs=True, stream=True)
                if chunk.choices and chunk.choices[0].logprobs for e in chunk.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [entry.token], "the stream carries the same entries"
    msg = anthropic.Anthropic(base_url=server, api_key="unused", max_retries=0).messages.create(
        model=model, max_tokens=8, messages=messages, extra_body={"temperature": 0})
    assert msg.stop_reason == "end_turn" and msg.usage.output_tokens == 1
    response = client.responses.create(model=model, input=messages[0]["content"], temperature=0, max_output_tokens=8)
    assert response.status == "completed" and response.usage.output_tokens == 1
    llama = http.post("/completion", json={"prompt": STOP_CONTEXT + STOP_CHOICE, "temperature": 0, "n_predict": 8}).json()
    assert llama["stop_type"] == "eos" and llama["tokens_predicted"] == 1


QUESTIONS = [  # (context, choices, index of the gold choice); one continuation ends on a stop token
    (STOP_CONTEXT, [STOP_CHOICE, " cat", " dog"], 1),
    ("The quick brown fox jumps over the", [" lazy dog.", " moon.", " fence."], 0),
    ("Hello world! How are you", [" today?", " yesterday?", " there?"], 0),
    ("Paged attention stores keys and values in", [" fixed-size blocks.", " one big array.", " files."], 0),
    ("Numbers: 0 1 2 3", [" 4 5", " 9 9", " a b"], 0),
    ("def main():\n    print(", ["'hello')", "42)", "main)"], 0),
]


def write_task(root: Path) -> str:
    """A local multiple-choice task (lm-eval's YAML over a JSON-lines file); its name."""
    data = root / "questions.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in QUESTIONS))
    (root / "ferrox_tiny_mc.yaml").write_text(
        "task: ferrox_tiny_mc\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        "doc_to_text: '{{question}}'\n"
        "doc_to_choice: '{{choices}}'\n"
        "doc_to_target: '{{answer}}'\n"
        "target_delimiter: ''\n"  # the choices carry their own leading space
        "metric_list:\n  - metric: acc\n")
    return "ferrox_tiny_mc"


def test_lm_eval_local_completions_matches_lm_evals_hf_model(server, folder, model, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import lm_eval
    from lm_eval.tasks import TaskManager

    task = write_task(tmp_path)
    runs = {}
    for name, model_type, args in (
            ("ferrox", "local-completions", f"base_url={server}/v1/completions,model={model},num_concurrent=1,"
                                            "max_retries=1,tokenized_requests=True"),
            ("hf", "hf", f"pretrained={folder},dtype=float32,device=cpu")):
        runs[name] = lm_eval.simple_evaluate(model=model_type, model_args=args, tasks=[task], batch_size=1,
                                             task_manager=TaskManager(include_path=str(tmp_path)), log_samples=True)
    ours, theirs = runs["ferrox"], runs["hf"]
    assert ours["config"]["model_args"].startswith("base_url"), "the server was scored"
    assert ours["results"][task]["acc,none"] == theirs["results"][task]["acc,none"], "identical accuracy"
    pairs = zip(sorted(ours["samples"][task], key=lambda s: s["doc_id"]),
                sorted(theirs["samples"][task], key=lambda s: s["doc_id"]))
    for a, b in pairs:
        for (ll_a, _), (ll_b, _) in zip(a["filtered_resps"], b["filtered_resps"]):
            assert math.isclose(float(ll_a), float(ll_b), abs_tol=LM_EVAL_ATOL), (a["doc"], ll_a, ll_b)
    assert len(ours["samples"][task]) == len(QUESTIONS)
