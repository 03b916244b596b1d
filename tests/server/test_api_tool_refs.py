"""Forced tool calls whose parameters use `$ref` (pydantic's nested, listed, optional and
recursive models; draft-7 `definitions`; pointers into the document itself) on the three
wires that force calls: chat completions (`tool_choice` "required" / named), Anthropic
Messages (`any` / `tool`) and Responses ("required" / named), through the official
clients. Every call is validated against its tool's own schema (jsonschema) and, for the
pydantic tools, by the model itself. The tiny random model writes garbage unless masked,
so each valid call is the forced-call grammar's doing. Calls are single (a random model
keeps extending a parallel list); the list wrapper's `$defs` are checked in
tests/server/test_tool_calls.py. One server for the module."""

from __future__ import annotations

import anthropic
import pytest

from api.app import create_app
from api.config import ServerConfig
from tests.support.nested_tools import SCHEMAS, TOOLS, anthropic_tools, check_call, responses_tools
from tests.support.server_harness import ServerThread, tiny_engine

MESSAGES = [{"role": "user", "content": "Save a person, plant a tree, send mail."}]
NAMES = tuple(SCHEMAS)


@pytest.fixture(scope="module")
def server():
    with ServerThread(create_app(tiny_engine(), ServerConfig())) as url:
        yield url


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server, api_key="unused", max_retries=0)


@pytest.mark.parametrize("name", [None, *NAMES])
def test_chat_forced_calls_with_refs_validate(client, model, name):
    tool_choice = "required" if name is None else {"type": "function", "function": {"name": name}}
    for seed in range(2):
        reply = client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice,
                                               temperature=1.0, seed=seed, max_tokens=1500, parallel_tool_calls=False)
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls", "the call ended within max_tokens"
        (call,) = choice.message.tool_calls
        check_call(call.function.name, call.function.arguments)
        assert name is None or call.function.name == name


def test_chat_streamed_forced_call_with_refs_validates(client, model):
    stream = client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, stream=True, seed=3,
                                            tool_choice={"type": "function", "function": {"name": "save_person"}},
                                            temperature=1.0, max_tokens=1500, parallel_tool_calls=False)
    arguments = "".join(tc.function.arguments or "" for chunk in stream for tc in chunk.choices[0].delta.tool_calls or ())
    check_call("save_person", arguments)


@pytest.mark.parametrize("name", [None, *NAMES])
def test_anthropic_forced_tool_use_with_refs_validates(claude, model, name):
    tool_choice = {"type": "any"} if name is None else {"type": "tool", "name": name}
    tool_choice["disable_parallel_tool_use"] = True
    msg = claude.messages.create(model=model, max_tokens=1500, messages=MESSAGES, tools=anthropic_tools(),
                                 tool_choice=tool_choice, extra_body={"temperature": 1.0})
    assert msg.stop_reason == "tool_use"
    (block,) = msg.content
    assert block.type == "tool_use"
    check_call(block.name, block.input)
    assert name is None or block.name == name


@pytest.mark.parametrize("name", [None, *NAMES])
def test_responses_forced_function_calls_with_refs_validate(client, model, name):
    tool_choice = "required" if name is None else {"type": "function", "name": name}
    r = client.responses.create(model=model, input=MESSAGES[0]["content"], tools=responses_tools(),
                                tool_choice=tool_choice, temperature=1.0, max_output_tokens=1500,
                                parallel_tool_calls=False)
    assert r.status == "completed"
    (item,) = r.output
    assert item.type == "function_call"
    check_call(item.name, item.arguments)
    assert name is None or item.name == name
