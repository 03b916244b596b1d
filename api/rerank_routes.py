"""Reranking and scoring: `POST /v1/rerank` (and `/rerank`), `POST /v1/score`.

Both score (query, document) pairs with the served model, one of two ways
(`--rerank-scheme`):

- `yes-no` (Qwen3-Reranker's scheme): each pair is rendered into the reranker's judging
  prompt (`judge_prompt`: a system line asking for "yes" or "no", the instruction, query
  and document, and an empty thinking section) and scored by the next token's two logits:
  `score = exp(l_yes) / (exp(l_yes) + exp(l_no))`, i.e. sigmoid(l_yes - l_no). The engine
  returns the logprob of the token it samples, so each pair runs as two greedy one-token
  jobs, one with a +100 logit bias on "yes" and one on "no": the sampled token is then the
  biased one and its returned logprob is the model's own (logprobs are taken before the
  bias), so the difference of the two is l_yes - l_no exactly. The two jobs share the
  prompt, and the prefix cache serves the second one's prompt but its last token.
- `embedding`: the query and each document are embedded (mean-pooled final hidden
  states, as `/v1/embeddings`) and the score is their cosine similarity.

`auto` (the default) picks `yes-no` when the served model's id names a reranker
("rerank" in it, as Qwen3-Reranker-0.6B does) and the tokenizer has "yes" and "no"; else
`embedding`. The "yes" and "no" tokens are the vocabulary's own single tokens where they
exist, else the first token each encodes to.

Shapes (Jina's and Cohere's, which vLLM and llama.cpp also accept):
`/v1/rerank {"model", "query", "documents": [str | {"text"}], "top_n"?, "return_documents"?
(default true), "instruction"?}` -> `{"id", "model", "usage": {"prompt_tokens",
"total_tokens"}, "results": [{"index", "relevance_score", "document": {"text"}}]}`, best
first, the first `top_n`. `/v1/score {"model", "text_1": str | [str], "text_2": str | [str]}`
(one text_1 against every text_2, or lists of equal length pairwise) -> `{"id", "object":
"list", "model", "data": [{"index", "object": "score", "score"}], "usage"}` in input order.
Errors use the OpenAI envelope.
"""

from __future__ import annotations

import math
import uuid
from typing import TYPE_CHECKING, Any

import numpy as np
from pydantic import Field, field_validator
from quart import Blueprint, Response, current_app, request

from api import generation
from api.embeddings_routes import normalize
from api.errors import APIError
from api.generation import GenerationRun, RowOutput, job_ids
from api.limits import check_prompt_tokens
from api.prompts import check_model, encode
from api.protocol import StrictBody, parse_body
from api.state import AppState, json_response, state_of
from ferrox_jax.request import Job, RowSampling

if TYPE_CHECKING:
    from ferrox_jax.engine import Engine

blueprint = Blueprint("rerank", __name__)

MAX_DOCUMENTS = 1024
BIAS = 100.0  # large enough that the biased token is always the greedy choice
DEFAULT_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
JUDGE_PREFIX = ("<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the "
                'Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n')
JUDGE_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
SCHEMES = ("auto", "yes-no", "embedding")


def judge_prompt(query: str, document: str, instruction: str = DEFAULT_INSTRUCTION) -> str:
    """Qwen3-Reranker's prompt for one pair."""
    return f"{JUDGE_PREFIX}<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}{JUDGE_SUFFIX}"


def answer_token_ids(tokenizer: Any) -> tuple[int, int]:
    """(yes id, no id): the vocabulary's single tokens, else each word's first token."""
    ids = []
    for word in ("yes", "no"):
        token_id = tokenizer.token_to_id(word)
        ids.append(token_id if token_id is not None else tokenizer.encode(word, add_special_tokens=False)[0])
    return ids[0], ids[1]


def scheme_for(configured: str, engine: Engine) -> str:
    if configured != "auto":
        return configured
    tok = engine.tokenizer
    has_answers = tok.token_to_id("yes") is not None and tok.token_to_id("no") is not None
    return "yes-no" if "rerank" in engine.model_name.lower() and has_answers else "embedding"


def _texts(v: Any, name: str) -> list[str]:
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or not items:
        raise ValueError(f"{name} must be a string or a non-empty list of strings")
    out = []
    for item in items:
        if isinstance(item, dict) and isinstance(item.get("text"), str):
            item = item["text"]
        if not isinstance(item, str):
            raise ValueError(f"{name} must hold strings (or {{\"text\": str}} objects)")
        out.append(item)
    return out


class RerankRequest(StrictBody):
    model: str | None = None
    query: str
    documents: Any
    top_n: int | None = Field(None, ge=1)
    return_documents: bool = True
    instruction: str | None = None

    @field_validator("documents", mode="plain")
    @classmethod
    def _documents(cls, v: Any) -> list[str]:
        if not isinstance(v, list):
            raise ValueError("documents must be a non-empty list of strings")
        return _texts(v, "documents")


class ScoreRequest(StrictBody):
    model: str | None = None
    text_1: Any
    text_2: Any
    instruction: str | None = None

    @field_validator("text_1", "text_2", mode="plain")
    @classmethod
    def _text(cls, v: Any) -> list[str]:
        return _texts(v, "text")


# ---------------------------------------------------------------- scoring


async def _tokens(engine: Engine, state: AppState, text: str, param: str, add_special_tokens: bool) -> list[int]:
    ids = await encode(engine.tokenizer, text, add_special_tokens=add_special_tokens)
    if not ids:
        raise APIError(400, f"{param} must contain at least one token", param=param)
    check_prompt_tokens(len(ids), state.config, param)
    if len(ids) >= engine.max_context:
        raise APIError(400, f"{param} has {len(ids)} tokens; this model's context is {engine.max_context}",
                       param=param, code="context_length_exceeded")
    return ids


async def _run(state: AppState, engine: Engine, route: str, api_id: str, jobs: list[Job],
               model: str | None = None) -> tuple[list[RowOutput], int]:
    """Every job's last output (in job order) and the prompt tokens computed or cached;
    `model` may name a LoRA adapter, which then scores (api/lora_routes.py)."""
    run = GenerationRun(state, route, api_id, jobs, stream=False, engine=engine, model=model)
    last: list[RowOutput | None] = [None] * len(jobs)

    def fold(output: RowOutput) -> None:
        if output.event.finish_reason is not None:
            last[output.job] = output

    generation.start(run)
    await generation.collect(run, fold)
    if any(o is None or o.event.finish_reason == "cancelled" for o in last):
        raise APIError(409, "the request was cancelled before every pair was scored", code="cancelled")
    return last, run.num_prompt_tokens


async def yes_no_scores(state: AppState, engine: Engine, route: str, api_id: str, pairs: list[tuple[str, str]],
                        instruction: str, model: str | None = None) -> tuple[list[float], int]:
    """sigmoid(l_yes - l_no) of each pair's judging prompt (see the module docstring)."""
    yes_id, no_id = answer_token_ids(engine.tokenizer)
    prompts = [await _tokens(engine, state, judge_prompt(q, d, instruction), "documents", False) for q, d in pairs]
    jobs = []
    names = job_ids(api_id, 2 * len(prompts))
    for i, ids in enumerate(prompts):
        for k, token_id in enumerate((yes_id, no_id)):
            sampling = RowSampling(temperature=0.0, seed=None, logprobs=0,
                                   logit_bias=((token_id, BIAS),))
            jobs.append(Job(request_id=names[2 * i + k], prompt_token_ids=tuple(ids), max_tokens=1,
                            sampling=sampling, ignore_eos=True))
    outputs, _ = await _run(state, engine, route, api_id, jobs, model)
    logprobs = []
    for job, output in zip(jobs, outputs):
        event = output.event
        want = job.sampling.logit_bias[0][0]
        if tuple(event.token_ids) != (want,) or not event.logprobs:
            raise APIError(500, "the biased answer token was not the one sampled", type="server_error",
                           code="engine_error")
        logprobs.append(float(event.logprobs[0].logprob))
    scores = [1.0 / (1.0 + math.exp(logprobs[2 * i + 1] - logprobs[2 * i])) for i in range(len(prompts))]
    return scores, sum(len(ids) for ids in prompts)


async def embedding_scores(state: AppState, engine: Engine, route: str, api_id: str,
                           pairs: list[tuple[str, str]], model: str | None = None) -> tuple[list[float], int]:
    """Cosine similarity of each pair's mean-pooled embeddings (each distinct text embedded once)."""
    texts = list(dict.fromkeys(t for pair in pairs for t in pair))
    prompts = [await _tokens(engine, state, text, "documents", True) for text in texts]
    jobs = [Job(request_id=name, prompt_token_ids=tuple(ids), max_tokens=0, pooling="mean")
            for name, ids in zip(job_ids(api_id, len(prompts)), prompts)]
    outputs, num_tokens = await _run(state, engine, route, api_id, jobs, model)
    vectors = {text: normalize(o.event.embedding) for text, o in zip(texts, outputs)}
    return [float(np.dot(vectors[q], vectors[d])) for q, d in pairs], num_tokens


async def _scores(route: str, pairs: list[tuple[str, str]], instruction: str | None,
                  model: str | None) -> tuple[list[float], int, str, str]:
    state = state_of(current_app)
    engine = state.require_engine()
    check_model(model, engine)
    if len(pairs) > MAX_DOCUMENTS:
        raise APIError(400, f"at most {MAX_DOCUMENTS} documents per request; got {len(pairs)}", param="documents")
    api_id = f"rerank-{uuid.uuid4().hex}"
    if scheme_for(state.config.rerank_scheme, engine) == "yes-no":
        scores, tokens = await yes_no_scores(state, engine, route, api_id, pairs, instruction or DEFAULT_INSTRUCTION,
                                             model)
    else:
        scores, tokens = await embedding_scores(state, engine, route, api_id, pairs, model)
    return scores, tokens, api_id, model or engine.model_name


@blueprint.post("/v1/rerank")
@blueprint.post("/rerank")
async def rerank() -> Response:
    body: RerankRequest = parse_body(await request.get_data(), RerankRequest)
    pairs = [(body.query, doc) for doc in body.documents]
    scores, tokens, api_id, model = await _scores(request.path, pairs, body.instruction, body.model)
    order = sorted(range(len(scores)), key=lambda i: -scores[i])[:body.top_n or len(scores)]
    results = [{"index": i, "relevance_score": scores[i],
                **({"document": {"text": body.documents[i]}} if body.return_documents else {})} for i in order]
    return json_response({"id": api_id, "model": model, "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
                          "results": results})


@blueprint.post("/v1/score")
async def score() -> Response:
    body: ScoreRequest = parse_body(await request.get_data(), ScoreRequest)
    first, second = body.text_1, body.text_2
    if len(first) == 1:
        first = first * len(second)
    if len(first) != len(second):
        raise APIError(400, f"text_1 must be one text or as many as text_2 ({len(second)}); got {len(first)}",
                       param="text_1", code="invalid_value")
    scores, tokens, api_id, model = await _scores(request.path, list(zip(first, second)), body.instruction,
                                                  body.model)
    data = [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)]
    return json_response({"id": api_id, "object": "list", "model": model, "data": data,
                          "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})
