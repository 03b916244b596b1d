"""A request must not take the server down or stall it: pathological constraints are 400s
naming the limit (on every wire that takes one), and CPU-heavy request steps run off the
event loop."""

from __future__ import annotations


import anthropic
import openai
import pytest

from api.app import create_app
from api.config import ServerConfig
from tests.support.server_harness import ServerThread, tiny_engine
from tests.engine.test_grammar_limits import lark_chain, ref_chain


@pytest.fixture(scope="module")
def server():
    with ServerThread(create_app(tiny_engine(), ServerConfig())) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)


def model_of(client) -> str:
    return client.models.list().data[0].id


@pytest.mark.parametrize("extra,words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": ref_chain(3000)}}},
     "3001 $defs/definitions; the limit is 2000"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": ref_chain(1500)}}},
     "deeper than the limit of 256 levels"),
    ({"guided_grammar": lark_chain(3000)}, "3002 rules; the limit is 2000"),
    ({"guided_regex": "((a{100}){100}){100}"}, "1,000,000 times"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "string", "pattern": "^(a{1000}){1000}$"}}}}, "JSON schema pattern"),
    ({"guided_choice": [f"option {i}" for i in range(50_000)]}, "50,000 choices; at most 1,999 can be enforced"),
])
def test_pathological_constraints_are_400_naming_the_limit(client, extra, words):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model_of(client), messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=2, extra_body=extra)
    error = e.value.body
    assert error["code"] == "invalid_grammar" and words in error["message"], error
    assert len(error["message"]) < 400  # a reason, not a parser-state dump


def test_a_forced_tool_with_a_ref_chain_is_400_on_the_anthropic_wire(server, client):
    messages = anthropic.Anthropic(base_url=server, api_key="unused", max_retries=0).messages
    with pytest.raises(anthropic.BadRequestError, match="limit is 2000"):
        messages.create(model=model_of(client), max_tokens=4, messages=[{"role": "user", "content": "hi"}],
                        tools=[{"name": "f", "input_schema": {"type": "object", **ref_chain(3000)}}],
                        tool_choice={"type": "any"})
    # The server is still here, and a sane schema on the same route still works.
    out = messages.create(model=model_of(client), max_tokens=4, messages=[{"role": "user", "content": "hi"}],
                          tools=[{"name": "f", "input_schema": {"type": "object", "properties": {
                              "a": {"type": "integer"}}, "required": ["a"]}}], tool_choice={"type": "any"})
    assert out.type == "message" and out.usage.output_tokens >= 1
