"""The tokenizer routes (vLLM's): `/tokenize`, `/detokenize` and `/tokenizer_info`.

They let a client work in token ids without a tokenizer of its own: lm-eval's
`local-completions` probes `GET /tokenizer_info` and, when it answers, tokenizes through
`POST /tokenize` and `/detokenize` (its "remote" tokenizer), so no tokenizer folder is
needed on the client's side.

- `POST /v1/tokenize`, `/tokenize`: `{"prompt", "add_special_tokens"?}` or `{"messages",
  "tools"?}` (rendered exactly as the chat route renders them) -> `{"tokens", "count",
  "max_model_len"}`.
- `POST /v1/detokenize`, `/detokenize`: `{"tokens"}` -> `{"prompt", "text"}` (the same
  text; `prompt` is vLLM's name, which lm-eval reads).
- `GET /tokenizer_info`: what vLLM answers there, the tokenizer's configuration as
  `tokenizer_config.json` has it: `tokenizer_class`, the special tokens (`bos_token`,
  `eos_token`, `pad_token`, `unk_token`: strings or null), `add_bos_token` /
  `add_eos_token` (what `add_special_tokens` does), `model_max_length` (the served
  context), `added_tokens_decoder` (id -> token text), `chat_template`; and ferrox's
  additions with the ids: `bos_token_id`, `eos_token_id`, `pad_token_id`, `stop_token_ids`
  (every token that ends generation), `vocab_size`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from quart import Blueprint, Response, current_app, request

from api.errors import APIError
from api.limits import check_token_ids
from api.prompts import check_model, encode
from api.protocol import DetokenizeRequest, TokenizeRequest, parse_body
from api.state import json_response, state_of
from api.structured import prepare_chat, tool_request
from api.template_kwargs import template_kwargs

if TYPE_CHECKING:
    from ferrox_jax.engine import Engine

blueprint = Blueprint("tokenizer", __name__)


async def _parsed(model: type) -> tuple[Any, Engine]:
    """The request's body as `model`, and the engine (the body's `model` checked against it)."""
    body = parse_body(await request.get_data(), model)
    engine = state_of(current_app).require_engine()
    check_model(body.model, engine)
    return body, engine


@blueprint.post("/v1/tokenize")
@blueprint.post("/tokenize")
async def tokenize() -> Response:
    body, engine = await _parsed(TokenizeRequest)
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "give exactly one of prompt or messages", param="prompt")
    if body.messages is not None:  # rendered as the chat route renders them, tools included
        chat = prepare_chat(engine.tokenizer, [m.template_dict() for m in body.messages],
                            template_kwargs=template_kwargs(body.chat_template_kwargs, body.reasoning_effort,
                                                            engine.tokenizer.chat_template),
                            tools=tool_request(body.tools, None, None))
        tokens = await encode(engine.tokenizer, chat.text, add_special_tokens=False)
    else:
        tokens = await encode(engine.tokenizer, body.prompt, add_special_tokens=bool(body.add_special_tokens))
    return json_response({"tokens": tokens, "count": len(tokens), "max_model_len": engine.max_context})


@blueprint.post("/v1/detokenize")
@blueprint.post("/detokenize")
async def detokenize() -> Response:
    body, engine = await _parsed(DetokenizeRequest)
    check_token_ids(body.tokens, engine.tokenizer.vocab_size, "tokens")
    text = engine.tokenizer.decode(body.tokens)
    return json_response({"prompt": text, "text": text})


@blueprint.get("/tokenizer_info")
async def tokenizer_info() -> Response:
    return json_response(tokenizer_config(state_of(current_app).require_engine()))


def tokenizer_config(engine: Engine) -> dict[str, Any]:
    """The served tokenizer as vLLM's `/tokenizer_info` describes one (module docstring)."""
    tok = engine.tokenizer

    def text(token_id: int | None) -> str | None:
        return None if token_id is None else tok.id_to_token(token_id)

    probe = tok.encode("a", add_special_tokens=False)
    with_specials = tok.encode("a", add_special_tokens=True)
    added = tok.backend.get_added_tokens_decoder()
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": text(tok.bos_token_id), "eos_token": text(tok.eos_token_id),
        "pad_token": text(tok.pad_token_id), "unk_token": text(tok.unk_token_id),
        "add_bos_token": with_specials[:1] != probe[:1] and tok.bos_token_id in with_specials[:1],
        "add_eos_token": with_specials[-1:] != probe[-1:] and tok.eos_token_id in with_specials[-1:],
        "model_max_length": engine.max_context,
        "added_tokens_decoder": {str(i): added[i].content for i in sorted(added)},
        "chat_template": tok.chat_template,
        "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id,
        "stop_token_ids": sorted(tok.stop_token_ids), "vocab_size": tok.vocab_size,
    }
