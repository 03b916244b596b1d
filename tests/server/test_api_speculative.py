"""`--speculative ngram` served: the flags, and vLLM's spec-decode counters in /metrics and
/admin/stats. Real server over a tiny Llama, driven by the OpenAI client."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from api import cli
from api.app import create_app
from api.config import ServerConfig
from ferrox_jax.config import SpeculativeConfig
from tests.support.server_harness import ServerThread, tiny_engine

SPEC = SpeculativeConfig(num_speculative_tokens=3, ngram_min=1, ngram_max=3, max_rows=2)
PROMPT = "a b c d e f g a b c d e f g a b c d e f g a b c"


@pytest.fixture(scope="module")
def server():
    engine = tiny_engine(block_size=16, kv_blocks=128, max_seqs=4, prefill_chunk=32, speculative=SPEC)
    with ServerThread(create_app(engine, ServerConfig())) as url:
        yield url


def _parse(argv):
    return cli.speculative_config(cli.build_parser({}).parse_args(["serve", *argv]))


def test_flags_and_vllm_json_give_the_same_config():
    assert _parse([]) is None, "off by default"
    flags = _parse(["--speculative", "ngram", "--num-speculative-tokens", "3", "--ngram-max", "5",
                    "--speculative-max-rows", "8"])
    json_form = _parse(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3, '
                        '"prompt_lookup_max": 5, "max_rows": 8}'])
    assert flags == json_form == SpeculativeConfig(num_speculative_tokens=3, ngram_min=2, ngram_max=5, max_rows=8)


def test_counters_in_metrics_and_admin_stats(client, model, http):
    text = client.completions.create(model=model, prompt=PROMPT, max_tokens=40, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    assert text
    stats = http.get("/admin/stats").json()
    assert stats["spec_decode_num_drafts"] > 0
    assert 0 < stats["spec_decode_num_accepted_tokens"] <= stats["spec_decode_num_draft_tokens"]
    assert sum(stats["spec_decode_num_accepted_tokens_per_pos"]) == stats["spec_decode_num_accepted_tokens"]
    assert stats["recompiles_after_warmup"] == 0, "verify shapes are compiled at warm-up"
    values = {(s.name, tuple(sorted(s.labels.items()))): s.value
              for family in text_string_to_metric_families(http.get("/metrics").text) for s in family.samples}
    assert values[("vllm:spec_decode_num_drafts_total", ())] <= stats["spec_decode_num_drafts"]
    assert values[("vllm:spec_decode_num_accepted_tokens_total", ())] > 0
    per_pos = [values[("vllm:spec_decode_num_accepted_tokens_per_pos_total", (("position", str(j)),))]
               for j in range(SPEC.num_speculative_tokens)]
    assert per_pos == sorted(per_pos, reverse=True), "a later draft is accepted only after the earlier ones"


def test_draft_flags_and_vllm_json_give_the_same_config():
    flags = _parse(["--speculative", "draft", "--draft-model", "/m/small", "--num-speculative-tokens", "2"])
    json_form = _parse(["--speculative-config", '{"method": "draft_model", "model": "/m/small", '
                        '"num_speculative_tokens": 2}'])
    assert flags == json_form == SpeculativeConfig(method="draft", draft_model="/m/small", num_speculative_tokens=2)


def test_draft_model_served_end_to_end(client, model):
    """`--speculative draft` built by the engine builder (the tiny checkpoint drafting for
    itself, so every greedy draft is kept): the reply is the ngram server's (both are the
    non-speculative one), the counters move, and proposals compiled nothing after warm-up."""
    from openai import OpenAI

    from tests.support.server_harness import api_checkpoint

    spec = SpeculativeConfig(method="draft", draft_model=str(api_checkpoint()), num_speculative_tokens=3, max_rows=2)
    engine = tiny_engine(block_size=16, kv_blocks=128, max_seqs=2, prefill_chunk=32, speculative=spec)
    expected = client.completions.create(model=model, prompt=PROMPT, max_tokens=24, temperature=0).choices[0].text
    with ServerThread(create_app(engine, ServerConfig())) as url:
        drafted = OpenAI(base_url=f"{url}/v1", api_key="x")
        reply = drafted.completions.create(model=drafted.models.list().data[0].id, prompt=PROMPT, max_tokens=24,
                                           temperature=0)
    assert reply.choices[0].text == expected
    stats = engine.stats()
    assert 0 < stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens
    assert stats.recompiles_after_warmup == 0, "the draft's proposal shapes are compiled at warm-up"
