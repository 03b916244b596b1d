"""/v1/completions and /v1/models end to end: a real Hypercorn server, the real engine on
a tiny random Llama, driven by the official `openai` client and httpx.

Expected numbers come from the server itself (token counts from /v1/tokenize, greedy
outputs from a first request) or from arithmetic shown next to the assertion.
"""

from __future__ import annotations

import httpx
import pytest

from api.app import create_app
from api.config import ServerConfig
from tests.support.server_harness import CONTEXT_TOKENS, ServerThread, api_checkpoint, tiny_engine


@pytest.fixture(scope="module")
def server():
    engine = tiny_engine()
    with ServerThread(create_app(engine, ServerConfig())) as url:
        yield url


def complete(http, **body):
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def count_tokens(http, text: str) -> int:
    return http.post("/v1/tokenize", json={"prompt": text}).json()["count"]


def test_models_lists_the_served_model(client, http):
    models = client.models.list().data
    assert len(models) == 1
    card = http.get("/v1/models").json()["data"][0]
    assert card["object"] == "model" and card["owned_by"] == "ferrox"
    assert card["id"] == api_checkpoint().name, "the id is the checkpoint folder's stem"
    assert card["max_model_len"] == CONTEXT_TOKENS, "the tiny model's trained context (max_position_embeddings)"
    assert isinstance(card["created"], int)
    assert http.get(f"/v1/models/{card['id']}").json()["id"] == card["id"]


def test_string_prompt_usage_and_request_id(client, http, model):
    out = client.completions.create(model=model, prompt="Hello world", max_tokens=6, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.object == "text_completion"
    assert out.model_extra["request_id"] == out.id
    assert out.choices[0].finish_reason == "length"
    prompt_tokens = count_tokens(http, "Hello world")
    assert out.usage.prompt_tokens == prompt_tokens
    assert out.usage.completion_tokens == 6, "ignore_eos: exactly max_tokens tokens"
    assert out.usage.total_tokens == prompt_tokens + 6


def test_default_max_tokens_is_16(http, model):
    out = complete(http, model=model, prompt="The quick brown fox", temperature=0, ignore_eos=True)
    assert out["usage"]["completion_tokens"] == 16


def test_prompt_forms_give_the_same_greedy_text(http, model):
    text = "Paged attention stores keys"
    ids = http.post("/v1/tokenize", json={"prompt": text}).json()["tokens"]
    as_text = complete(http, prompt=text, max_tokens=8, temperature=0, ignore_eos=True)
    as_ids = complete(http, prompt=ids, max_tokens=8, temperature=0, ignore_eos=True)
    assert as_ids["choices"][0]["text"] == as_text["choices"][0]["text"]
    many = complete(http, prompt=[ids, ids[:3]], max_tokens=8, temperature=0, ignore_eos=True)
    assert many["choices"][0]["text"] == as_text["choices"][0]["text"]
    assert many["usage"]["prompt_tokens"] == len(ids) + 3


def test_list_of_prompts_with_n(http, model):
    prompts = ["Hello world!", "The quick brown fox"]
    out = complete(http, model=model, prompt=prompts, n=2, max_tokens=4, temperature=0.8, seed=3,
                   ignore_eos=True)
    # choice index = prompt index * n + row index: 2 prompts x 2 rows
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    assert all(c["finish_reason"] == "length" for c in out["choices"])
    assert out["usage"]["prompt_tokens"] == sum(count_tokens(http, p) for p in prompts), \
        "each prompt counts once, whatever n"
    assert out["usage"]["completion_tokens"] == 4 * 4


def test_seed_makes_sampling_reproducible(http):
    body = dict(prompt="Numbers: 0 1 2", max_tokens=12, temperature=1.0, seed=1234, ignore_eos=True)
    first = complete(http, **body)["choices"][0]["text"]
    assert complete(http, **body)["choices"][0]["text"] == first
    others = {complete(http, **{**body, "seed": s})["choices"][0]["text"] for s in (1, 2, 3)}
    assert len(others | {first}) > 1, "different seeds sample different text"


def test_the_engine_seeds_an_unseeded_request_and_masks_a_named_one(http):
    body = dict(prompt="Numbers: 0 1 2", max_tokens=12, temperature=1.0, ignore_eos=True)
    texts = [c["text"] for c in complete(http, **body, n=4)["choices"]]
    assert len(set(texts)) > 1, "the n choices of an unseeded request sample apart"
    # A seed is kept in int32 range: 2^40 + 7 and 7 share their low 31 bits.
    assert complete(http, **body, seed=2**40 + 7)["choices"][0]["text"] == \
        complete(http, **body, seed=7)["choices"][0]["text"], "a seed samples as its int32 part"


def test_filters_that_leave_one_token_equal_greedy(http):
    body = dict(prompt="Continuous batching admits", max_tokens=8, ignore_eos=True)
    greedy = complete(http, **body, temperature=0)["choices"][0]["text"]
    assert complete(http, **body, temperature=1.0, top_k=1, seed=5)["choices"][0]["text"] == greedy
    assert complete(http, **body, temperature=1.0, top_p=1e-6, seed=5)["choices"][0]["text"] == greedy
    assert complete(http, **body, temperature=1.0, min_p=1.0, seed=5)["choices"][0]["text"] == greedy


def test_penalties_act_on_repeated_tokens_and_user_is_accepted(http):
    body = dict(prompt="Hello", max_tokens=24, temperature=0, ignore_eos=True, logprobs=0)

    def distinct(**extra) -> int:
        tokens = complete(http, **body, **extra)["choices"][0]["logprobs"]["tokens"]
        assert len(tokens) == 24
        return len(set(tokens))

    plain = distinct()
    assert plain < 24, "the tiny model repeats itself under greedy decoding (what the penalties act on)"
    for penalty in ({"presence_penalty": 2.0}, {"frequency_penalty": 2.0}, {"repetition_penalty": 3.0}):
        assert distinct(**penalty) > plain, f"{penalty} makes a repeated token less likely"
    assert distinct(frequency_penalty=-2.0) <= plain, "a negative penalty makes repeats more likely"
    out = complete(http, prompt="Hello", max_tokens=5, temperature=0.7, seed=1, presence_penalty=1.5,
                   frequency_penalty=-0.5, repetition_penalty=1.3, user="tester-1", top_k=-1)
    assert out["usage"]["completion_tokens"] >= 1


def test_stop_string_cuts_the_text(http):
    body = dict(prompt="Hello world", max_tokens=24, temperature=0, ignore_eos=True)
    full = complete(http, **body)["choices"][0]["text"]
    stop = full[4:7]
    assert len(stop) == 3, f"need a longer greedy text to pick a stop string from: {full!r}"
    out = complete(http, **body, stop=[stop, "\u2603never"])["choices"][0]
    assert out["finish_reason"] == "stop"
    assert out["text"] == full[: full.index(stop)], "text ends where the stop string starts"


def test_logit_bias_forces_a_token_and_stop_token_ids_stop_on_it(http):
    forced = http.post("/v1/tokenize", json={"prompt": " fox", "add_special_tokens": False}).json()["tokens"][0]
    piece = http.post("/v1/detokenize", json={"tokens": [forced]}).json()["text"]
    bias = {str(forced): 100}
    out = complete(http, prompt="Hello", max_tokens=4, temperature=0.9, seed=2, logit_bias=bias,
                   ignore_eos=True)["choices"][0]
    assert out["text"] == piece * 4
    out = complete(http, prompt="Hello", max_tokens=4, temperature=0, logit_bias=bias,
                   stop_token_ids=[forced])
    assert out["choices"][0]["finish_reason"] == "stop"
    assert out["choices"][0]["text"] == "", "a stop token is not part of the output"
    assert out["usage"]["completion_tokens"] == 1, "but it is billed"
    # min_tokens bans the stop token for the first 3 outputs; with +100 on it the forced
    # token is still banned, so 3 other tokens come first and then the stop ends the row.
    out = complete(http, prompt="Hello", max_tokens=8, temperature=0, logit_bias=bias,
                   stop_token_ids=[forced], min_tokens=3)
    assert out["choices"][0]["finish_reason"] == "stop"
    assert out["usage"]["completion_tokens"] == 3 + 1


def test_eos_stops_unless_ignore_eos(http):
    import json

    eos = json.loads((api_checkpoint() / "config.json").read_text())["eos_token_id"]
    bias = {str(eos): 100}
    out = complete(http, prompt="Hello", max_tokens=5, temperature=0, logit_bias=bias)
    assert out["choices"][0]["finish_reason"] == "stop" and out["usage"]["completion_tokens"] == 1
    out = complete(http, prompt="Hello", max_tokens=5, temperature=0, logit_bias=bias, ignore_eos=True)
    assert out["choices"][0]["finish_reason"] == "length" and out["usage"]["completion_tokens"] == 5


def test_logprobs_shapes(client, model):
    out = client.completions.create(model=model, prompt="Hello world", max_tokens=5, temperature=0,
                                    logprobs=3, extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert "".join(lp.tokens) == out.choices[0].text
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0.0
        # top 3 plus the sampled token when it is not among them; fewer when two tokens
        # print alike (random byte-level tokens often decode to the same U+FFFD)
        assert 1 <= len(top) <= 4
        assert token in top
        assert max(top.values()) == pytest.approx(logprob), "greedy picks the most likely token"


def test_echo_prepends_the_prompt(http):
    out = complete(http, prompt="Hello world", max_tokens=3, temperature=0, echo=True, ignore_eos=True)
    plain = complete(http, prompt="Hello world", max_tokens=3, temperature=0, ignore_eos=True)
    assert out["choices"][0]["text"] == "Hello world" + plain["choices"][0]["text"]


def test_echo_with_zero_max_tokens_scores_the_prompt(http):
    """lm-eval's loglikelihood request: echo + logprobs + max_tokens 0."""
    prompt = "The quick brown fox jumps"
    n = count_tokens(http, prompt)
    out = complete(http, prompt=prompt, max_tokens=0, echo=True, logprobs=1)
    choice = out["choices"][0]
    assert choice["text"] == prompt
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == n and "".join(lp["tokens"]) == prompt
    assert lp["token_logprobs"][0] is None, "nothing precedes the first prompt token"
    assert all(x <= 0.0 for x in lp["token_logprobs"][1:])
    assert lp["top_logprobs"][0] is None and all(1 <= len(t) <= 2 for t in lp["top_logprobs"][1:])
    assert out["usage"] == {"prompt_tokens": n, "completion_tokens": 0, "total_tokens": n,
                            "prompt_tokens_details": {"cached_tokens": 0}}, "prompt logprobs compute every token"
    no_logprobs = complete(http, prompt=prompt, max_tokens=0, echo=True)
    assert no_logprobs["choices"][0]["text"] == prompt
    assert no_logprobs["usage"]["completion_tokens"] == 0


def test_max_tokens_is_clamped_to_the_room_left(http):
    ids = http.post("/v1/tokenize", json={"prompt": "Hello world! " * 1000}).json()["tokens"]
    ids = ids[: CONTEXT_TOKENS - 12]
    out = complete(http, prompt=ids, max_tokens=100, temperature=0, ignore_eos=True)
    assert out["choices"][0]["finish_reason"] == "length"
    assert out["usage"]["completion_tokens"] == 12, "context - (context - 12) prompt tokens = 12 left"
