"""The offline API's vocabulary: `SamplingParams` in, `RequestOutput`s out, as vLLM names them.

`from ferrox_jax import LLM, SamplingParams` is for code written against vLLM's offline
API (`vllm.LLM`, `vllm.SamplingParams`): evaluation pipelines, batch scoring, dataset
generation. `LLM` (`ferrox_jax/llm.py`) runs the engine in-process; this module holds the
plain data it takes and returns, and imports no jax.

This is the only `SamplingParams`. The engine's `ferrox_jax.request.RowSampling` is *how
one row draws a token* (temperature, top-p/k, min-p, seed, penalties, logit bias,
logprobs): the per-row arrays of a step. vLLM's `SamplingParams` is *what to generate for
one prompt*: that, plus how many choices (`n`), how long (`max_tokens`, `min_tokens`),
when to stop (`stop`, `stop_token_ids`, `ignore_eos`), which logprobs to return for the
prompt (`prompt_logprobs`) and what the output must match (`structured_outputs`). In
ferrox those job-level settings live on `Job`, beside the row's `RowSampling`.
So the public class is vLLM's concept under vLLM's name, with vLLM's field names, defaults
and meanings (`max_tokens` 16, `seed` None = a fresh random seed, `top_k` 0 or -1 = off,
`logprobs` / `prompt_logprobs` = how many top alternatives). It converts to the engine's
types in one place: `SamplingParams.row_sampling` makes the `RowSampling` and `to_job` the
`Job` around it. The fields the two share keep one name and one meaning (vLLM's); the
engine's class is never exported from the package.

Outputs: `RequestOutput` (one per prompt, in prompt order) holds `CompletionOutput`s (one
per choice). Logprobs are vLLM's shape: per token a dict token id -> `Logprob(logprob,
rank, decoded_token)` holding the chosen token and the top alternatives; `prompt_logprobs`
starts with None (nothing precedes the first prompt token). Logprobs are the model's raw
log-softmax, before temperature and penalties (vLLM's default "raw_logprobs"). `rank` is
1-based among the returned alternatives; None for a chosen token outside them.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from ferrox_jax.constraint import GrammarSpec, grammar_syntax
from ferrox_jax.request import MAX_LOGPROBS, Job, RowSampling, check_draw_ranges



@dataclasses.dataclass(frozen=True)
class StructuredOutputsParams:
    """What the output must match (vLLM's `StructuredOutputsParams`): give exactly one.

    `json`: a JSON schema (a dict, or its JSON text); `json_object`: any JSON object;
    `regex`: a regular expression; `choice`: one of these strings; `grammar`: a Lark or
    GBNF grammar. Enforced by a token mask in the sampler, as on the server's
    `response_format` / `guided_*` (docs/structured-output.md).
    """

    json: Any = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar", "json_object")
                 if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"StructuredOutputsParams needs exactly one of json, regex, choice, grammar, "
                             f"json_object; got {given or 'none'}")

    def grammar_spec(self) -> GrammarSpec:
        """The engine's `GrammarSpec` for this constraint (raises `GrammarError` naming the problem)."""
        if self.json is not None:
            schema = json.loads(self.json) if isinstance(self.json, str) else self.json
            return GrammarSpec.json_schema(schema)
        if self.json_object:
            return GrammarSpec.json_object()
        if self.regex is not None:
            return GrammarSpec.regex(self.regex)
        if self.choice is not None:
            return GrammarSpec.choice(list(self.choice))
        return GrammarSpec.grammar(self.grammar, syntax=grammar_syntax(self.grammar))


@dataclasses.dataclass
class SamplingParams:
    """What to generate for one prompt, in vLLM's names (see the module docstring).

    temperature 0 is greedy. `seed` None draws a fresh random seed per prompt (as the
    server does for a request without one); with a seed, the draw is a function of
    (seed, position) only, so a prompt samples the same tokens alone, in any batch, or
    through the server. `max_tokens` None generates until a stop or the context ceiling;
    a prompt leaving less room than `max_tokens` is served with `max_tokens` clamped to
    the room left (the server's rule). `logprobs` k: the chosen token's logprob plus the
    top k per output token; `prompt_logprobs` k: the same per prompt token (k in [0, 20]).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    guided_decoding: StructuredOutputsParams | None = None  # vLLM's earlier name for structured_outputs
    # vLLM settings accepted at their defaults only, so code that spells them out still runs.
    best_of: int | None = None
    detokenize: bool = True
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"SamplingParams.n must be >= 1; got {self.n}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"SamplingParams.max_tokens must be >= 1 or None; got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"SamplingParams.min_tokens must be >= 0; got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"SamplingParams.min_tokens ({self.min_tokens}) must not exceed max_tokens "
                             f"({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise ValueError(f"SamplingParams.{name} must be in [0, {MAX_LOGPROBS}] or None; got {value}")
        if self.top_k < -1:
            raise ValueError(f"SamplingParams.top_k must be >= 0 (or -1 for off); got {self.top_k}")
        if self.structured_outputs is not None and self.guided_decoding is not None:
            raise ValueError("SamplingParams: give structured_outputs or guided_decoding, not both")
        if any(not s for s in self.stop_list):
            raise ValueError("SamplingParams.stop must not contain an empty string")
        unsupported = {"best_of": self.best_of not in (None, self.n), "detokenize": not self.detokenize,
                       "include_stop_str_in_output": self.include_stop_str_in_output}
        for name, is_set in unsupported.items():
            if is_set:
                raise ValueError(f"SamplingParams.{name}={getattr(self, name)!r} is not supported")
        check_draw_ranges("SamplingParams", self)  # the ranges the engine's RowSampling checks too
        self.row_sampling()  # and every valid SamplingParams converts

    @property
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def constraint(self) -> StructuredOutputsParams | None:
        return self.structured_outputs if self.structured_outputs is not None else self.guided_decoding

    def row_sampling(self) -> RowSampling:
        """The engine's per-row settings. The seed is passed as given: None has the engine draw
        one when the job is submitted (`ferrox_jax/request.py:with_seed`, the one seed rule).
        Logprobs: the larger of the two counts asked, since the engine's `logprobs` sets the
        top-k of output and prompt tokens alike; each output is cut back to its own count."""
        asked = [k for k in (self.logprobs, self.prompt_logprobs) if k is not None]
        return RowSampling(
            temperature=self.temperature, top_p=self.top_p, top_k=max(0, self.top_k), min_p=self.min_p,
            seed=self.seed, logprobs=max(asked) if asked else None, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty,
            logit_bias=tuple(sorted((int(t), float(b)) for t, b in (self.logit_bias or {}).items())))


def to_job(params: SamplingParams, request_id: str, prompt_ids: list[int], max_context: int,
           grammar: Any = None, images: tuple = ()) -> Job:
    """One engine job for a prompt (its `n` choices are its rows).

    Raises:
      ValueError: the prompt alone fills the context (nothing left to generate).
    """
    if len(prompt_ids) >= max_context:
        raise ValueError(f"the prompt has {len(prompt_ids)} tokens; this model's context ceiling is "
                         f"{max_context} (no room left to generate)")
    room = max_context - len(prompt_ids)
    max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
    return Job(
        request_id=request_id, prompt_token_ids=tuple(prompt_ids), max_tokens=max_tokens,
        sampling=params.row_sampling(), n=params.n, stop=tuple(params.stop_list),
        stop_token_ids=tuple(params.stop_token_ids or ()), ignore_eos=params.ignore_eos,
        min_tokens=min(params.min_tokens, max_tokens), prompt_logprobs=params.prompt_logprobs is not None,
        grammar=grammar, skip_special_tokens=params.skip_special_tokens, images=images)


# ---------------------------------------------------------------- outputs


@dataclasses.dataclass(frozen=True)
class Logprob:
    """One token's log-probability (vLLM's `Logprob`)."""

    logprob: float
    rank: int | None = None  # 1 = the most likely; None when outside the returned alternatives
    decoded_token: str | None = None


@dataclasses.dataclass
class CompletionOutput:
    """One choice (vLLM's `CompletionOutput`)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None  # sum of the chosen tokens' logprobs, when logprobs were asked
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None  # "stop" | "length"
    stop_reason: str | None = None  # the stop string that ended it; None for an eos or stop token

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestOutput:
    """Everything produced for one prompt (vLLM's `RequestOutput`)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[dict[int, Logprob] | None] | None
    outputs: list[CompletionOutput]
    finished: bool = True
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache


def logprob_dict(token_id: int, logprob: float, top: Any, k: int, decode: Any) -> dict[int, Logprob]:
    """vLLM's per-position dict: the top `k` alternatives (ranked) and the chosen token."""
    out = {int(t): Logprob(float(lp), i + 1, decode(int(t))) for i, (t, lp) in enumerate(list(top)[:k])}
    if token_id not in out:
        out[token_id] = Logprob(float(logprob), None, decode(token_id))
    return out
