"""The offline API (`from ferrox_jax import LLM, SamplingParams`) against the server.

The server is the shared tiny engine behind a real Hypercorn server, driven by the
official `openai` client; the `LLM` loads its own engine from the same checkpoint with the
same limits (the same compiled shapes, so its warm-up reads the compile cache). Equal
outputs therefore show the same tokenization, the same mapping of sampling settings and
the same seeded draws, not one engine read twice. Logprob values are compared to 1e-4:
the two engines run the same float32 programs, but a row's logits can come from a
different batch bucket in each (batch composition differs), which moves the last bits.
"""

from __future__ import annotations

import json

import pytest

from api.app import create_app
from api.config import ServerConfig
from ferrox_jax import LLM, SamplingParams, StructuredOutputsParams
from tests.support.server_harness import DEFAULT_LIMITS, ServerThread, api_checkpoint, tiny_engine

PROMPTS = ["Hello there", "The capital of", "a b c d e f"]
LOGPROB_ATOL = 1e-4  # see the module docstring
QUEUE = 8  # the offline engine's waiting queue: small, so a long prompt list must wait for room


@pytest.fixture(scope="module")
def server():
    with ServerThread(create_app(tiny_engine(), ServerConfig())) as url:
        yield url


@pytest.fixture(scope="module")
def llm():
    with LLM(str(api_checkpoint()), dtype="float32", **{**DEFAULT_LIMITS, "max_queue": QUEUE}) as offline:
        yield offline


def test_package_exports_the_offline_api_lazily():
    import ferrox_jax
    from ferrox_jax.llm import LLM as defined

    assert ferrox_jax.LLM is defined
    assert "SamplingParams" in dir(ferrox_jax)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        ferrox_jax.nope  # noqa: B018


@pytest.mark.parametrize("settings", [dict(temperature=0), dict(temperature=0.9, top_p=0.95, seed=1234)],
                         ids=["greedy", "seeded"])
def test_generate_equals_the_servers_completions(llm, client, model, settings):
    params = SamplingParams(max_tokens=24, logprobs=2, ignore_eos=True, **settings)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outputs):
        reply = client.completions.create(model=model, prompt=prompt, max_tokens=24, logprobs=2,
                                          extra_body={"ignore_eos": True}, **settings)
        choice, ours = reply.choices[0], out.outputs[0]
        assert out.prompt == prompt
        assert ours.text == choice.text, f"{prompt!r}: offline and server disagree"
        assert ours.finish_reason == choice.finish_reason == "length"
        assert len(ours.token_ids) == reply.usage.completion_tokens == 24
        assert len(out.prompt_token_ids) == reply.usage.prompt_tokens
        server_lps = choice.logprobs.token_logprobs
        ours_lps = [entry[t].logprob for t, entry in zip(ours.token_ids, ours.logprobs)]
        assert ours_lps == pytest.approx(server_lps, abs=LOGPROB_ATOL)
        assert ours.cumulative_logprob == pytest.approx(sum(server_lps), abs=24 * LOGPROB_ATOL)
        top = ours.logprobs[0]
        assert len(top) in (2, 3), "the top 2 plus the chosen token when it is not among them"
        assert {e.rank for e in top.values()} >= {1, 2}


def test_n_choices_with_a_seed_equal_the_servers(llm, client, model):
    params = SamplingParams(n=3, temperature=1.0, seed=99, max_tokens=12, ignore_eos=True)
    out = llm.generate("Once upon a time", params, use_tqdm=False)[0]
    reply = client.completions.create(model=model, prompt="Once upon a time", n=3, temperature=1.0, seed=99,
                                      max_tokens=12, extra_body={"ignore_eos": True})
    assert [c.text for c in out.outputs] == [c.text for c in sorted(reply.choices, key=lambda c: c.index)]
    assert len({c.text for c in out.outputs}) > 1, "each choice draws with its own derived seed"


@pytest.mark.parametrize("settings", [dict(temperature=0), dict(temperature=0.8, seed=5)], ids=["greedy", "seeded"])
def test_chat_equals_the_servers_chat_completions(llm, client, model, settings):
    conversations = [[{"role": "user", "content": "Hi!"}],
                     [{"role": "system", "content": "Be brief."},
                      {"role": "user", "content": [{"type": "text", "text": "Name a colour."}]}]]
    outputs = llm.chat(conversations, SamplingParams(max_tokens=20, **settings), use_tqdm=False)
    for messages, out in zip(conversations, outputs):
        reply = client.chat.completions.create(model=model, messages=messages, max_tokens=20, **settings)
        assert out.outputs[0].text == reply.choices[0].message.content
        assert out.outputs[0].finish_reason == reply.choices[0].finish_reason
        assert len(out.prompt_token_ids) == reply.usage.prompt_tokens


def test_prompt_logprobs_equal_the_servers_echo_scores(llm, client, model):
    prompt = "the cat sat on the mat"
    out = llm.generate(prompt, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=3), use_tqdm=False)[0]
    reply = client.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0, logprobs=3, echo=True)
    n = len(out.prompt_token_ids)
    server = reply.choices[0].logprobs.token_logprobs[:n]  # the prompt's entries; the generated token follows
    assert out.prompt_logprobs[0] is None and server[0] is None, "nothing precedes the first prompt token"
    ours = [entry[t].logprob for t, entry in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:])]
    assert ours == pytest.approx(server[1:], abs=LOGPROB_ATOL)
    assert all(len(entry) in (3, 4) for entry in out.prompt_logprobs[1:])
    assert out.outputs[0].logprobs is None, "logprobs were asked for the prompt only"


def test_structured_output_matches_the_schema(llm, client, model):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    params = SamplingParams(temperature=0, max_tokens=48, structured_outputs=StructuredOutputsParams(json=schema))
    out = llm.chat([{"role": "user", "content": "Answer in JSON."}], params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop", "the grammar ends the output when the object closes"
    assert set(json.loads(out.text)) == {"ok"}
    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Answer in JSON."}], max_tokens=48, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": True}})
    assert out.text == reply.choices[0].message.content


def test_a_long_prompt_list_waits_for_queue_room_and_keeps_its_order(llm, capsys):
    prompts = [f"item {i}:" for i in range(3 * QUEUE + 5)]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert [o.prompt for o in outputs] == prompts
    assert all(len(o.outputs[0].token_ids) == 4 for o in outputs)
    alone = llm.generate(prompts[17], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert alone[0].outputs[0].token_ids == outputs[17].outputs[0].token_ids, "batched or alone, greedy is greedy"
    err = capsys.readouterr().err
    assert "Processed prompts" in err and f"{len(prompts)}/{len(prompts)}" in err and "output:" in err


def test_token_prompts_and_stop_strings(llm):
    tok = llm.get_tokenizer()
    ids = tok.encode("Hello there")
    by_ids = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)
    by_text = llm.generate("Hello there", SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)
    assert by_ids[0].outputs[0].text == by_text[0].outputs[0].text and by_ids[0].prompt is None
    full = by_text[0].outputs[0].text
    cut = full[3:5]  # a stop string from inside the greedy text ends it where it starts
    stopped = llm.generate("Hello there", SamplingParams(temperature=0, max_tokens=10, stop=[cut]), use_tqdm=False)
    assert stopped[0].outputs[0].text == full[:full.index(cut)]
    assert stopped[0].outputs[0].finish_reason == "stop" and stopped[0].outputs[0].stop_reason == cut


def test_a_refused_prompt_cancels_those_already_submitted(llm):
    stats = llm.engine.stats()
    too_many_blocks = SamplingParams(n=16, max_tokens=2000, ignore_eos=True)  # 16 rows x 125 blocks > the budget
    fine = SamplingParams(max_tokens=1500, ignore_eos=True)
    with pytest.raises(ValueError, match="prompt 2"):
        llm.generate(["a", "b", "c"], [fine, fine, too_many_blocks], use_tqdm=False)
    from tests.support.server_harness import wait_for

    wait_for(lambda: llm.engine.stats().kv_blocks_free == stats.kv_blocks_total and
             llm.engine.stats().running_rows == 0)


def test_bad_settings_are_named():
    with pytest.raises(ValueError, match="SamplingParams.temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="include_stop_str_in_output"):
        SamplingParams(include_stop_str_in_output=True)
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(json={"type": "object"}, regex="a+")
    with pytest.raises(TypeError, match="unknown engine setting 'gpu_memory_utilisation'"):
        LLM(str(api_checkpoint()), gpu_memory_utilisation=0.9)


def test_the_offline_defaults_are_the_servers():
    """`LLM(model)` runs what `ferrox serve --model` runs: on the default GGUF, `auto`
    quantization (its own blocks), not EngineConfig's `none` (float32 weights, about twice
    the one-row step)."""
    from api.settings import env_defaults
    from ferrox_jax.llm import engine_config

    assert engine_config("default").quantization == env_defaults({})["quantization"] == "auto"
    assert engine_config("default", quantization="none").quantization == "none"
