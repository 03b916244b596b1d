"""The OpenAI embeddings adapter: `POST /v1/embeddings`.

OpenAI's wire format only. Each input (a string, a list of strings, token ids or lists of
token ids) becomes one prefill-only engine job (`Job.pooling`): the
scheduler runs its prompt through the same prefill chunks and buckets as any prompt,
reserving only the prompt's blocks, and ends it after the last chunk with the pooled
hidden state (the decoder's final-norm output; `RowEvent.embedding`). Pooling is `mean`
over the prompt's tokens by default, or `last` (the last token's state) with the ferrox
field `"pooling": "last"`. Vectors are L2-normalised here, and sent as float lists or,
with `encoding_format: "base64"`, as base64 of little-endian float32 (what the `openai`
client asks for and decodes). `usage.prompt_tokens` counts every input's tokens.
Errors use the OpenAI envelope.
"""

from __future__ import annotations

import base64
import uuid
from typing import Any, Literal

import numpy as np
from pydantic import field_validator
from quart import Blueprint, Response, current_app, request

from api import generation
from api.errors import APIError
from api.generation import GenerationRun, RowOutput, job_ids
from api.limits import check_fits_queue, check_prompt_tokens, check_token_ids
from api.offload import parse_body_off_loop
from api.prompts import check_model, encode
from api.protocol import StrictBody
from api.state import json_response, state_of
from ferrox_jax.request import Job

blueprint = Blueprint("embeddings", __name__)

ROUTE = "/v1/embeddings"
MAX_INPUTS = 2048  # OpenAI's limit on inputs per request


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class EmbeddingRequest(StrictBody):
    model: str | None = None
    input: Any
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    pooling: Literal["mean", "last"] = "mean"  # ferrox
    user: str | None = None

    @field_validator("input", mode="plain")
    @classmethod
    def _input_shape(cls, v: Any) -> Any:
        if isinstance(v, str):
            return [v]
        if isinstance(v, list) and v:
            if all(isinstance(p, str) for p in v) or all(isinstance(p, list) and p and all(map(_is_int, p)) for p in v):
                return list(v)
            if all(map(_is_int, v)):
                return [list(v)]
        raise ValueError("input must be a string, a non-empty list of strings, token ids, or a list of token-id lists")


@blueprint.post(ROUTE)
async def create_embeddings() -> Response:
    state = state_of(current_app)
    body: EmbeddingRequest = await parse_body_off_loop(await request.get_data(), EmbeddingRequest)
    engine = state.require_engine()
    check_model(body.model, engine)
    hidden_size = engine.model_config.hidden_size
    if body.dimensions is not None and body.dimensions != hidden_size:
        raise APIError(400, f"dimensions must be the model's hidden size {hidden_size} (no truncation); "
                            f"got {body.dimensions}", param="dimensions")
    if len(body.input) > MAX_INPUTS:
        raise APIError(400, f"at most {MAX_INPUTS} inputs per request; got {len(body.input)}", param="input")
    check_fits_queue(len(body.input), engine, "input")
    prompts = []
    for i, item in enumerate(body.input):
        ids = await encode(engine.tokenizer, item) if isinstance(item, str) else item
        if not ids:
            raise APIError(400, f"input[{i}] must contain at least one token", param="input")
        check_token_ids(ids, engine.tokenizer.vocab_size, "input")
        check_prompt_tokens(len(ids), state.config, "input")
        if len(ids) > engine.max_context:
            raise APIError(400, f"input[{i}] has {len(ids)} tokens; this model's context is {engine.max_context}",
                           param="input", code="context_length_exceeded")
        prompts.append(ids)
    api_id = f"embd-{uuid.uuid4().hex}"
    jobs = [Job(request_id=job_id, prompt_token_ids=tuple(ids), max_tokens=0, pooling=body.pooling)
            for job_id, ids in zip(job_ids(api_id, len(prompts)), prompts)]
    run = GenerationRun(state, ROUTE, api_id, jobs, stream=False, engine=engine, model=body.model)
    vectors: list[np.ndarray | None] = [None] * len(jobs)

    def fold(output: RowOutput) -> None:
        if output.event.embedding is not None:
            vectors[output.job] = normalize(output.event.embedding)

    generation.start(run)
    await generation.collect(run, fold)
    if any(v is None for v in vectors):  # cancelled through /v1/cancel before its prefill ended
        raise APIError(409, "the request was cancelled before every input was embedded",
                       code="cancelled")
    data = [{"object": "embedding", "index": i, "embedding": encode_vector(v, body.encoding_format)}
            for i, v in enumerate(vectors)]
    usage = {"prompt_tokens": run.num_prompt_tokens, "total_tokens": run.num_prompt_tokens}
    return json_response({"object": "list", "data": data, "model": engine.model_name, "usage": usage},
                         headers={"X-Request-Id": api_id})


def normalize(vector: Any) -> np.ndarray:
    """f32[D] scaled to unit L2 norm (a zero vector stays zero)."""
    v = np.asarray(vector, np.float32)
    norm = float(np.linalg.norm(v))
    return v / norm if norm > 0 else v


def encode_vector(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()
