"""Grammar constraints compiled into per-row token matchers that write packed
allowed-token bitmasks on the host. What a request asks for is a `GrammarSpec`
(`ferrox_jax/constraint.py`, plain data); this module compiles it, caches the result and
steps the matchers. The translation of one spec into llguidance is
`ferrox_jax/grammar_template.py` (shared with the sandbox's child process), under the parser
limits `ferrox_jax/grammar_limits.py` reads, which every matcher here runs under.

This is the host half of structured output (JSON schema, any JSON object, regex, choice,
Lark/GBNF grammars). The device half is `ferrox_jax.token_mask.apply_token_bitmask`, which
turns the bitmask rows into -inf logits inside the jitted sampler. Nothing here imports
jax; the engine is llguidance (why, and the measurements: docs/structured-output.md).

    GrammarSpec          frozen, validated request data (constraint.py; the cache key)
      │ GrammarCompiler.compile(spec)       API worker thread, before the request is queued
      ▼                                     (Engine.check_grammar): GrammarError -> HTTP 400
    CompiledGrammar      immutable, shared by every row (and request) with the same spec
      │ compiled.new_matcher()              owner thread, when a row starts generating
      ▼
    RowMatcher           one per generating row, mutable, owner thread only:
                         fill_mask(bitmask[row]) -> sample -> accept(token) -> is_finished

Bitmask layout (the one llguidance and xgrammar use): `int32[ceil(V / 32)]` per row, where
V is the model's logits width; bit i of word j (`(word >> i) & 1`, two's complement) says
whether token 32*j + i may be sampled. Ids the tokenizer does not have (V may exceed the
tokenizer's vocabulary) and the padding bits past V are always 0 in a constrained row. A
row without a constraint carries `all_ones_mask(V)`; the bitmask's shape never changes, so
constraining a row never recompiles the step.

Stop tokens: the tokenizer's `stop_token_ids` (eos and the template's end-of-turn tokens)
are the grammar's end-of-sequence. They are allowed exactly when the text so far is a
complete match; once nothing but a stop token can follow, `is_finished` turns true and the
row must stop (finish reason "stop") without sampling the stop token.

Threads: llguidance's tokenizer and a never-stepped matcher are only read, so `compile`
and `new_matcher` may run on any thread (`compile` releases the GIL while llguidance
builds the grammar). A `RowMatcher` wraps a Rust object whose methods take `&mut self`:
two threads calling it at once get a pyo3 borrow error (RuntimeError), not corruption,
but the contract is that only the owner thread touches it, as with every other per-row
object; `fill_bitmask` computes rows on llguidance's thread pool with the GIL released.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Sequence

import llguidance
import numpy as np

from ferrox_jax.constraint import GrammarSpec
from ferrox_jax.grammar_limits import check_limits
from ferrox_jax.grammar_sandbox import DEFAULT_TIMEOUT_S, DEFAULT_WORKERS, SandboxUnavailable, shared_sandbox
from ferrox_jax.grammar_template import compile_template
from ferrox_jax.host_batch import ALL_TOKENS_ALLOWED, bitmask_words

DEFAULT_CACHE_SIZE = 256  # compiled grammars kept; a template matcher is a few hundred kB

log = logging.getLogger(__name__)

def all_ones_mask(vocab_size: int) -> np.ndarray:
    """The bitmask row of an unconstrained row: every token allowed. Returns int32[W]."""
    return np.full(bitmask_words(vocab_size), ALL_TOKENS_ALLOWED, dtype=np.int32)


class RowMatcher:
    """The grammar state of one generating row; owner thread only.

    Per tick: `fill_mask(row)` before the step, `accept(token)` with the sampled token
    after it, then `is_finished` says whether the row must stop.
    """

    def __init__(self, matcher: llguidance.LLMatcher, num_words: int):
        self._matcher = matcher
        self.num_words = num_words

    def fill_mask(self, out_row: np.ndarray) -> None:
        """Write the allowed-token bitmask for the next token into `out_row`.

        Args:
          out_row: int32[W], C-contiguous, W = ceil(V / 32) (e.g. one row of the tick's
            bitmask); overwritten whole. When the grammar is complete only stop tokens
            are set; a matcher in an error state also allows only stop tokens.
        """
        if out_row.dtype != np.int32 or out_row.shape != (self.num_words,):
            raise ValueError(f"out_row must be int32[{self.num_words}]; got {out_row.dtype}{list(out_row.shape)}")
        if not out_row.flags["C_CONTIGUOUS"]:
            raise ValueError("out_row must be C-contiguous")
        self._matcher.unsafe_compute_mask_ptr(out_row.ctypes.data, out_row.nbytes)

    def accept(self, token_id: int) -> bool:
        """Advance past the sampled `token_id`; False if the grammar forbids it.

        False can only happen when the mask was not applied to the row (a bug upstream);
        the matcher then stays in an error state (`error` says why) and is finished.
        A stop token is accepted when the text so far is a complete match.
        """
        return self._matcher.consume_token(int(token_id))

    @property
    def is_finished(self) -> bool:
        """True when nothing but a stop token may follow (or a stop token was accepted,
        or the matcher is in an error state): the row must stop now."""
        return self._matcher.is_stopped()

    @property
    def is_accepting(self) -> bool:
        """True when the text so far is a complete match (a stop token is allowed next)."""
        return self._matcher.is_accepting()

    @property
    def error(self) -> str | None:
        """Why the matcher failed (a forbidden token was accepted), or None."""
        if not self._matcher.is_error():
            return None
        return self._matcher.get_error() or "unknown matcher error"


@dataclass(frozen=True, eq=False)
class CompiledGrammar:
    """A validated, compiled constraint; immutable and shared. Any thread may call
    `new_matcher`: the template is only ever deep-copied, never stepped."""

    spec: GrammarSpec
    warnings: tuple[str, ...]  # keywords a non-strict schema ignores, unknown formats, ...
    _template: llguidance.LLMatcher
    _num_words: int

    def new_matcher(self) -> RowMatcher:
        """A fresh matcher at the start of the constraint, for one row (a ~µs copy)."""
        return RowMatcher(self._template.deep_copy(), self._num_words)


class GrammarCompiler:
    """Compiles GrammarSpecs for one tokenizer and logits width, with an LRU cache.

    One per server, built at start-up (building the llguidance tokenizer takes ~0.4 s
    for a 49k vocabulary). `compile` is thread-safe (API handlers call it before
    queueing a request); `fill_bitmask` is for the owner thread.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, *, cache_size: int = DEFAULT_CACHE_SIZE,
                 mask_threads: int | None = None, sandbox: bool = True, sandbox_workers: int = DEFAULT_WORKERS,
                 sandbox_timeout_s: float = DEFAULT_TIMEOUT_S):
        """
        Args:
          tokenizer: a `models.tokenizer.Tokenizer` (its `.backend` HF tokenizer and its
            `stop_token_ids` are used).
          vocab_size: the model's logits width V (may exceed the tokenizer's vocabulary;
            the extra ids are never allowed in a constrained row).
          cache_size: compiled grammars kept (least recently used dropped first).
          mask_threads: threads `fill_bitmask` computes rows on (llguidance's default:
            80% of the CPUs, at least 1).
          sandbox: compile each new spec in a child process first (grammar_sandbox.py),
            so a native crash is that request's GrammarError (`EngineConfig.grammar_sandbox`).
          sandbox_workers, sandbox_timeout_s: its child processes, and the seconds one
            compile may take in one (`EngineConfig.grammar_workers`, `grammar_timeout_s`).
        """
        if vocab_size < tokenizer.vocab_size:
            raise ValueError(f"vocab_size ({vocab_size}) must cover the tokenizer's vocabulary "
                             f"({tokenizer.vocab_size} ids)")
        if not tokenizer.stop_token_ids:
            raise ValueError("the tokenizer has no stop tokens; a grammar could never end the row")
        self.vocab_size = vocab_size
        self.num_words = bitmask_words(vocab_size)
        self.stop_token_ids = tuple(sorted(tokenizer.stop_token_ids))
        tokenizer_json = tokenizer.backend.to_str()
        self._lltokenizer = llguidance.LLTokenizer(
            tokenizer_json, n_vocab=vocab_size, eos_token=list(self.stop_token_ids))
        self._executor = llguidance.LLExecutor(num_threads=mask_threads)
        self._sandbox = shared_sandbox(tokenizer_json, vocab_size, self.stop_token_ids, workers=sandbox_workers,
                                       timeout_s=sandbox_timeout_s) if sandbox else None
        self._cache: OrderedDict[GrammarSpec, CompiledGrammar] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()  # guards the cache and the counters only
        self.num_cache_hits = 0
        self.num_cache_misses = 0

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """Validate and compile `spec` (cached). Any thread.

        Raises:
          GrammarError: naming the problem (invalid schema / regex / grammar, unsupported
            JSON-schema keyword under strict).
        """
        with self._lock:
            cached = self._cache.get(spec)
            if cached is not None:
                self._cache.move_to_end(spec)
                self.num_cache_hits += 1
                return cached
            self.num_cache_misses += 1
        # Compiled outside the lock: two threads compiling the same new spec both do the
        # work (the second result wins the slot), instead of every compile queueing.
        compiled = self._compile_uncached(spec)
        with self._lock:
            self._cache[spec] = compiled
            self._cache.move_to_end(spec)
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def new_matcher(self, spec: GrammarSpec) -> RowMatcher:
        """A fresh matcher for one row constrained by `spec` (compiled, or from the cache)."""
        return self.compile(spec).new_matcher()

    def _compile_uncached(self, spec: GrammarSpec) -> CompiledGrammar:
        check_limits(spec)
        if self._sandbox is not None:
            try:
                self._sandbox.check(spec)
            except SandboxUnavailable as e:
                log.warning("%s; compiling in-process", e)
        template, warnings = compile_template(self._lltokenizer, spec)
        return CompiledGrammar(spec, warnings, template, self.num_words)

    def fill_bitmask(self, bitmask: np.ndarray, matchers: Sequence[RowMatcher | None]) -> None:
        """Fill one tick's bitmask: constrained rows from their matchers (in parallel, GIL
        released), every other row all ones. Owner thread.

        Args:
          bitmask: int32[B, W], C-contiguous, W = ceil(V / 32); overwritten whole.
          matchers: length <= B; matchers[r] is row r's RowMatcher or None. Rows past
            len(matchers) (bucket padding) are set to all ones.
        """
        if bitmask.dtype != np.int32 or bitmask.ndim != 2 or bitmask.shape[1] != self.num_words:
            raise ValueError(f"bitmask must be int32[B, {self.num_words}]; got {bitmask.dtype}{list(bitmask.shape)}")
        if not bitmask.flags["C_CONTIGUOUS"]:
            raise ValueError("bitmask must be C-contiguous")
        if len(matchers) > bitmask.shape[0]:
            raise ValueError(f"{len(matchers)} matchers for a bitmask of {bitmask.shape[0]} rows")
        rows = [(m._matcher, r) for r, m in enumerate(matchers) if m is not None]
        constrained = {r for _, r in rows}
        for r in range(bitmask.shape[0]):
            if r not in constrained:
                bitmask[r] = ALL_TOKENS_ALLOWED
        if rows:
            self._executor.unsafe_compute_mask_ptr(rows, bitmask.ctypes.data, self.num_words * 4, bitmask.shape[0])

    def cache_info(self) -> tuple[int, int, int]:
        """(hits, misses, entries) of the compile cache."""
        with self._lock:
            return self.num_cache_hits, self.num_cache_misses, len(self._cache)
