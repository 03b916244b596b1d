"""The engine's job types, and the one state machine of its rows. No jax here.

What the API hands the engine and gets back (the engine facade's side of the seam):
`RowSampling` and `Job` in, `RowEvent`s out (one or more per row per tick, each
carrying `RowResult` logprobs when asked), `AdmissionError` when a submit is refused. The
API imports these and `ferrox_jax/engine.py`'s facade, nothing deeper. "Request" is the
HTTP request's word; a job keeps its request's id (`request_id`) so events find their way
back to it.

Inside the engine the scheduler turns a `Job` (what was submitted: immutable) into a
`JobState` (the engine's state of it: `submitted`, prefill progress, block reservation)
holding n `Row`s (one sequence being generated each; `n > 1` gives n rows). Every row
carries a `RowState`; the rows of a job move together until they decode, then end one by
one:

    WAITING ──admit──> PREFILLING ──last chunk──> DECODING ──> FINISHED_STOP | _LENGTH
       │                   │                         │
       └───────────────────┴─────────────────────────┴──────> FINISHED_CANCELLED | _ERROR

(WAITING -> DECODING directly when there is nothing to prefill: n > 1 with a one-token
prompt, whose only token every row computes itself. PREFILLING -> FINISHED_STOP for a
pooling job, which ends after its last prefill chunk with the pooled hidden state.)
Under the priority policy a running job can be preempted (`ferrox_jax/priority.py`): its
open rows go back to WAITING with their output so far, recomputed when re-admitted (a row
that had decoded re-enters PREFILLING for that, then DECODING). `row_state.transition()` is the only code that changes a state;
it checks `_ALLOWED_TRANSITIONS` and counts entries per state (WAITING's: preempted rows).

A row's output life is on the row: the settings of its next draw (`Row.step_sampling`),
each sampled token with its stop checks (`accept_token`: its thinking budget, stop
tokens, min_tokens, stop strings, its grammar, max_tokens), its end (`finish`) and the events its client gets
(`take_event`). The scheduler (`ferrox_jax/scheduler.py`) decides when rows compute and
owns their blocks; it calls these and counts what they report.
"""

from __future__ import annotations

import collections
import dataclasses
import random
from collections.abc import Callable
from typing import Any

from ferrox_jax.constraint import GrammarSpec
from ferrox_jax.detokenize import SpecialTokensKept, TextStream
from ferrox_jax.images import ImageSpan, check_spans  # noqa: F401 (ImageSpan: what the routes build)
from ferrox_jax.row_state import RowState, transition
from ferrox_jax.thinking import FORCED_UNKNOWN_LOGPROB, ThinkingBudget, ThinkingCounter

# Makes a row's grammar state (a `ferrox_jax.grammar.RowMatcher`) for its constraint: the
# engine passes `GrammarCompiler.new_matcher`. Opaque here, so this module needs no llguidance.
MatcherFactory = Callable[[GrammarSpec], Any]

# ---------------------------------------------------------------- the public types

MAX_LOGPROBS = 20  # top-k logprobs returned per sampled token, at most (OpenAI's limit)
POOLINGS = ("mean", "last")  # Job.pooling
PRIORITY_MIN, PRIORITY_MAX = -(2 ** 31), 2 ** 31 - 1  # Job.priority's range: a 32-bit signed int


def check_draw_ranges(owner: str, settings: Any) -> None:
    """Raises ValueError naming `owner.<field>` for the first of `settings`' temperature,
    top_p, min_p and repetition_penalty out of range. Both sampling types share these
    ranges (the engine's `RowSampling` and the offline API's `SamplingParams`), and each
    names itself, so a message names the class its caller built."""
    if not 0.0 <= settings.temperature:
        raise ValueError(f"{owner}.temperature must be >= 0; got {settings.temperature}")
    if not 0.0 < settings.top_p <= 1.0:
        raise ValueError(f"{owner}.top_p must be in (0, 1]; got {settings.top_p}")
    if not 0.0 <= settings.min_p <= 1.0:
        raise ValueError(f"{owner}.min_p must be in [0, 1]; got {settings.min_p}")
    if settings.repetition_penalty <= 0:
        raise ValueError(f"{owner}.repetition_penalty must be > 0; got {settings.repetition_penalty}")


@dataclasses.dataclass(frozen=True)
class RowSampling:
    """How one row draws its tokens: the engine's per-row settings, which travel to the
    device as [rows] arrays, never static. (The offline API's vLLM-shaped `SamplingParams`,
    `ferrox_jax/offline.py`, is what to generate for one prompt; it converts to this.)

    temperature 0 means greedy. top_k 0 means off (as does a top_k of the vocabulary size or
    more, however large); top_p 1 and min_p 0 are off.
    `seed` makes the draw a function of (seed, position) only, so a row samples the same
    tokens alone or in any batch; None asks the engine for a fresh one (`with_seed`, applied
    once when the job is submitted). `logprobs` is None (not asked), or k in [0, 20]: the
    chosen token's logprob plus the top k (raw model logprobs, before temperature).
    Penalties follow vLLM: presence/frequency over generated tokens, repetition over
    prompt and generated tokens; `logit_bias` adds to the raw logits by token id.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = 0
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        check_draw_ranges("RowSampling", self)
        if self.top_k < 0:
            raise ValueError(f"RowSampling.top_k must be >= 0; got {self.top_k}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"RowSampling.logprobs must be in [0, {MAX_LOGPROBS}]; got {self.logprobs}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0 or self.logit_bias)


@dataclasses.dataclass(frozen=True)
class RowResult:
    """What one sampling row produced this step."""

    row_id: int
    token_id: int
    logprob: float = 0.0  # raw logprob of token_id
    top_logprobs: tuple[tuple[int, float], ...] = ()  # (token id, logprob), best first
    # For prompt_logprobs rows: per computed token (after the first prompt token),
    # (logprob of that token, its top-k). Empty otherwise.
    prompt_logprobs: tuple[tuple[float, tuple[tuple[int, float], ...]], ...] = ()
    # For pooling rows (embeddings): f32[D] sum of the chunk's final hidden states over its
    # tokens, and f32[D] the state at its last token. None otherwise.
    hidden_sum: Any = None
    last_hidden: Any = None
    # A speculating row: the tokens verification accepted after this one, in order, each
    # with its own logprobs (`ferrox_jax/speculative.py`). Empty otherwise.
    following: tuple["RowResult", ...] = ()


@dataclasses.dataclass(frozen=True)
class Job:
    """What the API submits: one prompt and what to generate from it, already tokenized and
    validated against the model by the API layer. Immutable; the engine tracks it in a `JobState`."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    sampling: RowSampling = RowSampling()
    n: int = 1  # choices; each is its own row, with its own derived seed
    stop: tuple[str, ...] = ()  # stop strings; the text is cut where one starts
    stop_token_ids: tuple[int, ...] = ()  # extra single-token stops (not in the output)
    ignore_eos: bool = False  # keep generating through the tokenizer's stop tokens
    min_tokens: int = 0  # no eos/stop-token stop before this many output tokens
    prompt_logprobs: bool = False  # return logprobs of the prompt tokens (echo + logprobs)
    # What the output must match (checked by `Engine.check_grammar`), enforced by a token
    # mask in the sampler; the tokenizer's stop tokens are its end. None: unconstrained.
    grammar: GrammarSpec | None = None
    # Caps the thinking section (`ferrox_jax/thinking.py`): its end marker is forced after
    # `max_tokens` tokens inside it. None: the section is as long as the model makes it.
    thinking_budget: ThinkingBudget | None = None
    # False: special tokens stay in the text (tool-call markers such as [TOOL_CALLS]).
    skip_special_tokens: bool = True
    # A prefill-only job (embeddings): "mean" or "last" pools the prompt's final hidden
    # states; the job samples nothing, holds only the prompt's blocks, and its one event
    # carries `RowEvent.embedding`. Needs max_tokens 0 and n 1.
    pooling: str | None = None
    # False: the prompt is computed whole, nothing taken from the prefix cache (llama.cpp's
    # `cache_prompt: false`); its blocks are still cached for later prompts.
    reads_prefix_cache: bool = True
    # The LoRA adapter the job runs with, by name (None: the base model), and its key (name
    # + a digest of its weights, `Engine.resolve_adapter`): the version of the weights the
    # job asked for, and the prefix cache's salt, so an adapter reloaded with other weights
    # never meets its old blocks. The scheduler holds the adapter's slot from the job's
    # admission to its last row's end (`ferrox_jax/admission.py`).
    adapter_name: str | None = None
    adapter_key: str | None = None
    priority: int = 0  # lower is more urgent (the priority policy, ferrox_jax/priority.py); fcfs: 0 only
    # The prompt's images (`ferrox_jax/images.py`): where each one's soft tokens sit, its
    # digest and pixels; the engine encodes them and names their blocks by the digests.
    images: tuple = ()

    @property
    def computes_every_position(self) -> bool:
        """The job needs every prompt position computed, so it takes nothing from the prefix
        cache: prompt logprobs score each token, mean pooling sums every hidden state, and
        a job may ask not to read the cache."""
        return self.prompt_logprobs or self.pooling == "mean" or not self.reads_prefix_cache

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError(f"Job {self.request_id!r}: prompt_token_ids is empty")
        if self.pooling is not None:
            if self.pooling not in POOLINGS or self.max_tokens != 0 or self.n != 1:
                raise ValueError(f"Job.pooling must be one of {POOLINGS}, with max_tokens 0 and "
                                 f"n 1; got {self.pooling!r}, {self.max_tokens}, {self.n}")
        elif self.max_tokens < 1:
            raise ValueError(f"Job.max_tokens must be >= 1; got {self.max_tokens}")
        if self.n < 1:
            raise ValueError(f"Job.n must be >= 1; got {self.n}")
        if self.min_tokens < 0:
            raise ValueError(f"Job.min_tokens must be >= 0; got {self.min_tokens}")
        if any(not s for s in self.stop):
            raise ValueError("Job.stop must not contain an empty string")
        if isinstance(self.priority, bool) or not isinstance(self.priority, int) or not (
                PRIORITY_MIN <= self.priority <= PRIORITY_MAX):
            raise ValueError(f"Job.priority must be an int in [{PRIORITY_MIN}, {PRIORITY_MAX}]; got {self.priority!r}")
        if self.images:
            check_spans(self.images, len(self.prompt_token_ids))


@dataclasses.dataclass(frozen=True)
class RowEvent:
    """New output of one row (one choice) in one tick, delivered from the owner thread.

    Each row gets exactly one event with a finish_reason, and it is that row's last event.
    An eos/stop token ends the row without appearing in `token_ids`, `text` or `logprobs`
    (it is counted in `num_generated_tokens`, which counts every sampled token); the last
    event carries it as `stop_token`, so a client can score every counted token.
    """

    request_id: str
    index: int  # choice index, 0..n-1
    token_ids: tuple[int, ...]  # tokens new this tick
    text: str  # new text: whole UTF-8 characters, never a stop string or a possible start of one
    logprobs: tuple[RowResult, ...] | None  # one per token in token_ids, when asked
    finish_reason: str | None  # None | "stop" | "length" | "cancelled" | "error"
    error: str | None = None  # why, when finish_reason is "error"
    # With `error`, what kind of failure, when the API answers it otherwise than an engine
    # error: "adapter_quarantined", "adapter_not_found" (`ferrox_jax/admission.py`).
    error_code: str | None = None
    prompt_logprobs: tuple[Any, ...] | None = None  # first event only, when asked
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0  # sampled so far, the stop token included
    queue_s: float | None = None  # first event only: seconds the job waited for admission
    # Last event of a row that a stop string ended ("stop"): which one. None when an
    # eos or stop token ended it, so adapters can tell the two apart.
    stop_string: str | None = None
    embedding: Any = None  # a pooling job's last event: f32[hidden] numpy, not normalised
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache, not computed (per job)
    # Last event of a row an eos/stop token ended: that token (its logprobs filled when
    # the request asked for logprobs). None otherwise.
    stop_token: RowResult | None = None


class AdmissionError(Exception):
    """A refused submit, with what its error message needs.

    `reason`: "context_length" (prompt + max_tokens over the context ceiling: a request
    to fix), "too_large" (more KV blocks than the whole budget, or n above the row cap),
    "queue_full" (momentary pressure: retry), "unavailable" (the engine is not running),
    "adapter_not_found" / "adapter_quarantined" (the named LoRA adapter is not loaded, or
    refused until reloaded), "unsupported" (an option this model cannot serve: n > 1 on a model
    with recurrent state; counted in no stats field). `message` is complete and user-facing (token, block and byte
    counts, the adapter's name).
    """

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


# ---------------------------------------------------------------- inside the engine

_BANNED_LOGIT = float("-inf")  # logit bias masking a row's stop tokens before its min_tokens

# Multiplier mixing a choice index into the request seed (2^32 / golden ratio): choices of
# one request, and neighbouring seeds, get well-separated streams.
_SEED_MIX = 0x9E3779B1
_SEED_MASK = 0x7FFFFFFF  # keep derived seeds in int32 range for the device arrays


def derive_row_seed(seed: int, index: int) -> int:
    """Seed of choice `index`. Choice 0 keeps the request's seed, so n=1 and the first of
    n choices sample alike; others mix the index in (seed + index would make choice 1 of
    seed s repeat choice 0 of seed s + 1)."""
    if index == 0:
        return seed
    return (seed + index * _SEED_MIX) & _SEED_MASK


def with_seed(sampling: RowSampling) -> RowSampling:
    """The seed rule, applied once where a job is submitted (`Engine.submit`): the seed the
    client named, kept in int32 range where the choices' derived seeds live (so s and
    s + 2^31 sample alike, as the offline API's do), or a fresh random one when it named
    none, so unseeded jobs sample independently and their n choices differ."""
    seed = random.getrandbits(31) if sampling.seed is None else sampling.seed & _SEED_MASK
    return dataclasses.replace(sampling, seed=seed)


class Row:
    """One sequence being generated, and its output life (module docstring). Mutable;
    touched only by the owner thread."""

    def __init__(self, row_id: int, job: JobState, index: int, tokenizer: Any,
                 new_matcher: MatcherFactory | None = None) -> None:
        submitted = job.submitted
        self.row_id = row_id  # never reused
        self.job = job
        self.index = index
        self.state = RowState.WAITING
        self.sampling = dataclasses.replace(
            submitted.sampling, seed=derive_row_seed(submitted.sampling.seed, index))
        self.token_ids: list[int] = list(submitted.prompt_token_ids)  # prompt + output so far
        self.num_computed_tokens = 0  # positions whose K/V is in the cache
        self.num_generated_tokens = 0  # sampled tokens, a final stop token included
        self.block_ids: list[int] = []  # block table, in position order
        self.block_names: list[bytes] = []  # prefix-cache names of its full blocks, as far as known
        self.num_named_blocks = 0  # leading blocks already entered in the prefix cache
        decoder = tokenizer if submitted.skip_special_tokens else SpecialTokensKept(tokenizer)
        self.text = TextStream(decoder, submitted.prompt_token_ids, submitted.stop)
        # Grammar state, advanced only by `accept_token`; the owner thread's mask filling reads it.
        self.matcher = None
        if submitted.grammar is not None:
            if new_matcher is None:
                raise ValueError(f"request {submitted.request_id!r} has an output constraint but the engine "
                                 "has no grammar compiler")
            self.matcher = new_matcher(submitted.grammar)
        self.thinking = ThinkingCounter(submitted.thinking_budget) if submitted.thinking_budget else None
        self.took_forced_token = False  # its last token replaced the sampled one (the budget's marker)
        self.error: str | None = None
        self.error_code: str | None = None  # RowEvent.error_code
        self.has_sent_event = False
        # Output gathered during the current tick; becomes one RowEvent.
        self.new_token_ids: list[int] = []
        self.new_text = ""
        self.new_logprobs: list[RowResult] = []
        self.stop_token: RowResult | None = None  # the eos/stop token that ended the row

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.job.submitted.prompt_token_ids)

    # -- the row's output life: its next draw, each sampled token, its end, its events ----
    # The scheduler decides when a row computes and owns its blocks; what a sampled token
    # does to the row (stop checks, grammar, text, logprobs) and what the client hears of
    # it are the row's own. `eos_token_ids` is the tokenizer's stop tokens, `counts` the
    # scheduler's entries per state (`transition`).

    def step_sampling(self, eos_token_ids: frozenset[int]) -> RowSampling:
        """The row's settings for its next draw, with its stop tokens banned while output <
        min_tokens.

        A constrained row's grammar ends on the tokenizer's stop tokens; with `ignore_eos`
        they are banned for as long as it samples, so it goes on while the grammar can.
        Banning them never leaves such a row without an allowed token: a row whose grammar
        allows only a stop token has already finished (`accept_token`)."""
        submitted = self.job.submitted
        banned: set[int] = set()
        if self.num_output_tokens < submitted.min_tokens:
            banned = set(submitted.stop_token_ids) | (set() if submitted.ignore_eos else eos_token_ids)
        if self.matcher is not None and submitted.ignore_eos:
            banned |= eos_token_ids
        if not banned:
            return self.sampling
        bias = dict(self.sampling.logit_bias)
        bias.update((token_id, _BANNED_LOGIT) for token_id in sorted(banned))
        return dataclasses.replace(self.sampling, logit_bias=tuple(bias.items()))

    def penalty_history(self, eos_token_ids: frozenset[int]) -> tuple[int, ...]:
        """The tokens the next draw's penalties and logit bias look at (prompt and output);
        () when it has none, so an unpenalized row sends no history."""
        return tuple(self.token_ids) if self.step_sampling(eos_token_ids).has_penalties else ()

    def accept_token(self, result: RowResult, eos_token_ids: frozenset[int],
                     counts: collections.Counter[RowState]) -> RowState | None:
        """Records a sampled token and ends the row if it is a stop; returns the finished
        state the row entered, or None while it goes on.

        A constrained row first advances its grammar. A token the grammar rejects means its
        mask was not applied (an engine bug): the row ends with an error. A stop token the
        grammar accepted is its end; and once the grammar allows nothing but a stop token
        the row ends at once, "stop", without spending a step on sampling it. A row whose
        thinking budget is spent takes its end marker's next token instead of the sampled one."""
        submitted = self.job.submitted
        forced = self.thinking.forced_token() if self.thinking is not None else None
        self.took_forced_token = forced is not None
        if forced is not None:
            result = RowResult(result.row_id, forced, dict(result.top_logprobs).get(forced, FORCED_UNKNOWN_LOGPROB),
                               result.top_logprobs)
        token_id = result.token_id
        self.num_generated_tokens += 1
        matcher = self.matcher
        if matcher is not None and not matcher.accept(token_id):
            return self.finish(RowState.FINISHED_ERROR, counts,
                               f"the output grammar rejected sampled token {token_id} ({matcher.error}); "
                               "its token mask was not applied")
        is_eos = token_id in eos_token_ids
        is_grammar_end = matcher is not None and is_eos
        is_stop_token = token_id in submitted.stop_token_ids or (not submitted.ignore_eos and is_eos)
        if is_grammar_end or (is_stop_token and self.num_output_tokens >= submitted.min_tokens):
            self.stop_token = result
            return self.finish(RowState.FINISHED_STOP, counts)
        self.token_ids.append(token_id)
        if self.thinking is not None:
            self.thinking.observe(token_id)
        self.new_token_ids.append(token_id)
        if submitted.sampling.logprobs is not None:
            self.new_logprobs.append(result)
        self.new_text += self.text.add_token(token_id)
        if self.text.is_stopped or (matcher is not None and matcher.is_finished):
            return self.finish(RowState.FINISHED_STOP, counts)
        if self.num_generated_tokens >= submitted.max_tokens:
            return self.finish(RowState.FINISHED_LENGTH, counts)
        return None

    def finish(self, state: RowState, counts: collections.Counter[RowState], error: str | None = None,
               code: str | None = None) -> RowState:
        """Ends the row in `state` (with `error` and its kind `code` when it failed) and
        releases the text the stop-string check held back; returns `state`. Its blocks are
        the scheduler's to free."""
        transition(self, state, counts)
        self.error, self.error_code = error, code
        self.new_text += self.text.finish()
        return state

    def take_event(self) -> RowEvent:
        """The row's output gathered this tick as one event (the job's prompt logprobs and
        queue time on its first; the finish on its last), and a fresh start for the next."""
        submitted = self.job.submitted
        is_first = not self.has_sent_event
        event = RowEvent(
            request_id=submitted.request_id, index=self.index, token_ids=tuple(self.new_token_ids), text=self.new_text,
            logprobs=tuple(self.new_logprobs) if submitted.sampling.logprobs is not None else None,
            finish_reason=self.state.finish_reason, error=self.error, error_code=self.error_code,
            prompt_logprobs=tuple(self.job.prompt_logprobs) if submitted.prompt_logprobs and is_first else None,
            num_prompt_tokens=len(submitted.prompt_token_ids), num_generated_tokens=self.num_generated_tokens,
            queue_s=self.job.queue_s if is_first else None,
            stop_string=self.text.matched_stop if self.state is RowState.FINISHED_STOP else None,
            embedding=self.job.pooled, num_cached_tokens=self.job.num_cached_tokens,
            stop_token=self.stop_token)
        self.has_sent_event = True
        self.new_token_ids, self.new_text, self.new_logprobs = [], "", []
        return event


class JobState:
    """The engine's state of one `Job`: its rows, its shared prefill and its block reservation."""

    def __init__(self, submitted: Job, first_row_id: int, tokenizer: Any,
                 new_matcher: MatcherFactory | None = None) -> None:
        self.submitted = submitted  # what the API asked for, unchanged
        self.rows = [Row(first_row_id + i, self, i, tokenizer, new_matcher) for i in range(submitted.n)]
        # n == 1: the prefill is the row's own and samples its first token. n > 1: every
        # prompt token but the last is prefilled once for all rows; each row then computes
        # the last prompt token itself and samples with its own seed.
        self.num_prefill_tokens = len(submitted.prompt_token_ids) - (0 if submitted.n == 1 else 1)
        self.num_computed_tokens = 0  # prefill progress (starts after a prefix-cache hit)
        self.num_cached_tokens = 0  # prompt tokens taken from the prefix cache at admission
        self.prefill_block_ids: list[int] = []  # the prefill's block table: cache hits, then its own
        self.block_names: list[bytes] = []  # prefix-cache names of the prompt's full blocks
        self.num_named_blocks = 0  # leading prefill blocks in the prefix cache (hits included)
        self.num_owed_blocks = 0  # blocks admission promised this job that it has not allocated
        self.num_open_rows = submitted.n
        self.prompt_logprobs: list[Any] = []
        self.queued_at_s = 0.0  # scheduler clock when the job joined the waiting queue
        self.queue_s: float | None = None  # waiting time, set at admission
        self.hidden_sum: Any = None  # pooling jobs: f32[D] summed over the chunks so far
        self.pooled: Any = None  # pooling jobs: the vector their last event carries
        self.adapter_slot = 0  # its LoRA adapter's slot, held from admission to its last row's end (0: none)
        # Preemption (ferrox_jax/priority.py): arrival number (its place within its priority), times
        # preempted, whether its rows had decoded (each then recomputes its own tokens), rows recomputing.
        self.arrival = 0
        self.num_preemptions = 0
        self.has_forked = False
        self.resume_rows: list[Row] = []

    @property
    def is_prefilled(self) -> bool:
        return self.num_computed_tokens == self.num_prefill_tokens

    @property
    def num_prefilling_rows(self) -> int:
        """Rows it holds in the prefilling queue: n, or those recomputing after a preemption."""
        return len(self.resume_rows) if self.resume_rows else self.submitted.n
