"""The soak's request mix: one valid or malformed call per wire protocol, and how to judge it.

tools/soak/soak.py draws every request from here (seeded), so a run is reproducible. The mix
covers each protocol the server speaks: OpenAI `/v1/completions`, `/v1/chat/completions`
and `/v1/responses`, Anthropic `/v1/messages`, llama.cpp `/completion` and
`/v1/embeddings`. Prompts start with one of a few shared prefixes half the time (so the
prefix cache is hit under load), and some requests carry structured output
(`json_schema`), tools, or a LoRA adapter's name as `model`. A malformed call breaks a
valid body of the same protocol and must come back 4xx in that protocol's own error
envelope (OpenAI `{"error": {message, type, param, code}}`, Anthropic
`{"type": "error", "error": {type, message}}`, llama.cpp `{"error": {code, message, type}}`).
"""

from __future__ import annotations

import dataclasses
import json
import random
from typing import Any

WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly judge "
         "boxing matches near old stone bridges under bright winter stars").split()

PROTOCOLS = ("completions", "chat", "responses", "messages", "llamacpp", "embeddings")
ENVELOPE = {"completions": "openai", "chat": "openai", "responses": "openai", "embeddings": "openai",
            "messages": "anthropic", "llamacpp": "llamacpp"}
PATH = {"completions": "/v1/completions", "chat": "/v1/chat/completions", "responses": "/v1/responses",
        "messages": "/v1/messages", "llamacpp": "/completion", "embeddings": "/v1/embeddings"}
ADAPTER_PROTOCOLS = ("completions", "chat", "llamacpp")  # where `model` may name a LoRA adapter

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "count": {"type": "integer"}},
          "required": ["name", "count"], "additionalProperties": False}
TOOL_PARAMS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
               "required": ["city"], "additionalProperties": False}


@dataclasses.dataclass(frozen=True)
class Call:
    """One request: where, what, and which envelope its errors must use."""

    protocol: str
    path: str
    body: dict
    stream: bool

    @property
    def envelope(self) -> str:
        return ENVELOPE[self.protocol]


def shared_prefixes(seed: int, count: int = 4, words: int = 48) -> list[str]:
    """`count` fixed prompt prefixes (about `words` words each) that requests share."""
    rng = random.Random(f"prefix-{seed}")
    return [" ".join(rng.choice(WORDS) for _ in range(words)) for _ in range(count)]


def prompt(rng: random.Random, max_words: int, prefixes: list[str]) -> str:
    tail = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, max_words)))
    if prefixes and rng.random() < 0.5:
        return f"{rng.choice(prefixes)} {tail}"
    return tail


def valid_call(rng: random.Random, model: str, max_tokens: tuple[int, int], max_words: int,
               prefixes: list[str], adapters: tuple[str, ...] = (), protocols: tuple[str, ...] = PROTOCOLS) -> Call:
    """A random request the server must serve in full."""
    protocol = rng.choice(protocols)
    text = prompt(rng, max_words, prefixes)
    tokens = rng.randint(*max_tokens)
    stream = protocol != "embeddings" and rng.random() < 0.5
    if adapters and protocol in ADAPTER_PROTOCOLS and rng.random() < 0.25:
        model = rng.choice(adapters)
    body = _BUILDERS[protocol](rng, model, text, tokens, stream)
    return Call(protocol, PATH[protocol], body, stream)


def _completions(rng: random.Random, model: str, text: str, tokens: int, stream: bool) -> dict:
    body: dict[str, Any] = {"model": model, "prompt": text, "max_tokens": tokens, "stream": stream,
                            **_sampling(rng)}
    if rng.random() < 0.1:
        body["n"] = 2
    if rng.random() < 0.1:
        body["logprobs"] = 2
    if rng.random() < 0.1:
        body["stop"] = [rng.choice(WORDS)]
    if stream and rng.random() < 0.5:
        body["stream_options"] = {"include_usage": True}
    return body


def _chat(rng: random.Random, model: str, text: str, tokens: int, stream: bool) -> dict:
    body: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": text}],
                            "max_tokens": tokens, "stream": stream, **_sampling(rng)}
    u = rng.random()
    if u < 0.15:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}}
    elif u < 0.3:
        body["tools"] = [{"type": "function", "function": {"name": "weather", "description": "the weather",
                                                           "parameters": TOOL_PARAMS}}]
        body["tool_choice"] = rng.choice(["auto", "required"])
    elif u < 0.4:
        body.update(logprobs=True, top_logprobs=2)
    return body


def _responses(rng: random.Random, model: str, text: str, tokens: int, stream: bool) -> dict:
    body: dict[str, Any] = {"model": model, "input": text, "max_output_tokens": tokens, "stream": stream,
                            "temperature": rng.choice([0.0, 0.7, 1.0])}
    u = rng.random()
    if u < 0.15:
        body["text"] = {"format": {"type": "json_schema", "name": "thing", "schema": SCHEMA}}
    elif u < 0.3:
        body["tools"] = [{"type": "function", "name": "weather", "description": "the weather",
                          "parameters": TOOL_PARAMS}]
        body["tool_choice"] = rng.choice(["auto", "required"])
    return body


def _messages(rng: random.Random, model: str, text: str, tokens: int, stream: bool) -> dict:
    body: dict[str, Any] = {"model": model, "max_tokens": tokens, "stream": stream,
                            "messages": [{"role": "user", "content": text}],
                            "temperature": rng.choice([0.0, 0.7, 1.0])}
    if rng.random() < 0.2:
        body["tools"] = [{"name": "weather", "description": "the weather", "input_schema": TOOL_PARAMS}]
        body["tool_choice"] = rng.choice([{"type": "auto"}, {"type": "any"}])
    return body


def _llamacpp(rng: random.Random, model: str, text: str, tokens: int, stream: bool) -> dict:
    return {"model": model, "prompt": text, "n_predict": tokens, "stream": stream,
            "temperature": rng.choice([0.0, 0.7, 1.0]), "seed": rng.randrange(1 << 20)}


def _embeddings(rng: random.Random, model: str, text: str, tokens: int, stream: bool) -> dict:
    return {"model": model, "input": text if rng.random() < 0.5 else [text, text[::-1] or "x"]}


def _sampling(rng: random.Random) -> dict:
    return {"temperature": rng.choice([0.0, 0.7, 1.0]), "seed": rng.randrange(1 << 20)}


_BUILDERS = {"completions": _completions, "chat": _chat, "responses": _responses, "messages": _messages,
             "llamacpp": _llamacpp, "embeddings": _embeddings}

_NUMBER_FIELD = {"completions": "max_tokens", "chat": "max_tokens", "responses": "max_output_tokens",
                 "messages": "max_tokens", "llamacpp": "n_predict", "embeddings": "dimensions"}
_REQUIRED = {"completions": "prompt", "chat": "messages", "responses": "input", "messages": "messages",
             "llamacpp": "prompt", "embeddings": "input"}


def malformed_call(rng: random.Random, model: str, protocols: tuple[str, ...] = PROTOCOLS) -> tuple[Call, bytes]:
    """A request the server must refuse with a 4xx in the protocol's envelope: (call, raw body)."""
    protocol = rng.choice(protocols)
    ok = _BUILDERS[protocol](random.Random(0), model, "hi", 2, False)
    number = _NUMBER_FIELD[protocol]
    broken = rng.choice([
        lambda: b'{"model": "m", "max_tokens": ',
        lambda: b"\xff\xfe not utf-8",
        lambda: b"",
        lambda: b"[1, 2, 3]",
        lambda: json.dumps({**ok, number: "many"}).encode(),
        lambda: json.dumps({**ok, number: -3}).encode(),
        lambda: json.dumps({**ok, "temperature": 7}).encode(),
        lambda: json.dumps({**ok, "model": "no-such-model"}).encode(),
        lambda: json.dumps({**ok, "stop": ["x"] * 100}).encode(),
        lambda: json.dumps({k: v for k, v in ok.items() if k != _REQUIRED[protocol]}).encode(),
    ])
    raw = broken()
    # Fields a protocol lacks are ignored, not refused: break one it has instead.
    if raw == json.dumps({**ok, "temperature": 7}).encode() and protocol == "embeddings":
        raw = json.dumps({**ok, "encoding_format": "hex"}).encode()
    if raw == json.dumps({**ok, "stop": ["x"] * 100}).encode() and protocol in _NO_STOP:
        raw = json.dumps({**ok, **_NO_STOP[protocol]}).encode()
    return Call(protocol, PATH[protocol], ok, False), raw


_NO_STOP = {"embeddings": {"input": []}, "messages": {"stop_sequences": ["x"] * 100},
            "responses": {"top_p": 0}}


def in_envelope(envelope: str, body: Any) -> bool:
    """Whether an error body has the fields of `envelope` ("openai", "anthropic" or "llamacpp")."""
    if not isinstance(body, dict):
        return False
    error = body.get("error")
    if not isinstance(error, dict):
        return False
    if envelope == "anthropic":
        return body.get("type") == "error" and {"type", "message"} <= set(error)
    if envelope == "llamacpp":
        return {"code", "message", "type"} <= set(error) and isinstance(error["code"], int)
    return {"message", "type", "param", "code"} <= set(error)


def stream_verdict(protocol: str, events: list[tuple[str | None, str]]) -> str:
    """"200" for a stream that ended as its protocol ends one, else why not; `events` are
    (event name or None, data) pairs in arrival order."""
    for name, data in events:
        if name == "error" or (name is None and data != "[DONE]" and '"error"' in data
                               and isinstance(_json(data), dict) and "error" in _json(data)):
            return "5xx-stream-error"
    names = {name for name, _ in events}
    datas = [data for _, data in events]
    if protocol in ("completions", "chat"):
        done = "[DONE]" in datas
    elif protocol == "responses":
        done = "response.completed" in names or "response.incomplete" in names
        if "response.failed" in names:
            return "5xx-stream-error"
    elif protocol == "messages":
        done = "message_stop" in names
    else:  # llama.cpp: the last event carries "stop": true
        done = bool(datas) and isinstance(_json(datas[-1]), dict) and _json(datas[-1]).get("stop") is True
    return "200" if done else "200-no-done"


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None
