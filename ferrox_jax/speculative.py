"""Speculative decoding by prompt lookup (n-gram drafts). No jax here.

A decoding row usually computes one token per step. With speculation it computes its last
token plus k *draft* tokens guessed from its own text, and the step samples after each of
those 1 + k positions at once:

    row text   ... the cat sat on the mat . the cat      last token "cat"
    drafts     the n-gram "the cat" occurred before, followed by "sat on the": k = 3 drafts
    computes   cat sat on the          positions p .. p+3, one forward
    samples    t0  t1  t2  t3          after each of them, with the row's own settings
    accepts    t0 == "sat"? t1 == "on"? ... the longest run of drafts equal to what was
               sampled at their position, then the next sample: 1 to k + 1 tokens a step

In the tick (`ferrox_jax/batcher.py`): `schedule()` names the decoding rows that may verify
drafts (`Speculator.plan_drafts`, `StepPlan.draft_requests`), a proposer answers them (here
`NgramProposer`, on the host; or the draft model, `ferrox_jax/draft.py`; or DeepSeek's MTP
layer, `ferrox_jax/mtp.py`, which plans like the draft model), and
`Scheduler.add_drafts` appends the drafts to their rows before the host batch is built.
The step's output is read on one path for every row (`ferrox_jax/step_output.py`): what
was sampled after each of a row's tokens, the drafts kept while they match.

In the forward, the row's 1 + k tokens are 1 + k one-token decode rows sharing its block
table (`ferrox_jax/runner.py`): every token's K/V is written before any row attends, so the
row at position p + j reads the drafts before it. Verification needs no compiled shape of
its own (only more rows of the decode buckets) and runs through the same one-query
attention kernels as plain decoding, so its logits are the non-speculative ones, up to the
rounding of a bigger row bucket: from 5 rows the block kernel sums in other pieces, and on
AVX-512 VNNI rounds activations to int16 blocks (~1e-5 of a logit; models/cpu_kernels.py),
and the CPU attention kernel reads the keys once for the row's 1 + k tokens, summing them
tile by tile (models/kernels/decode_attention_shared.inc, ~1e-6 of an output), so a greedy
token could differ only where two logits tie to that precision (the tests and
tools/bench/bench_speculative.py compare outputs token for token).

Exactness. Each sampled token is what the row would have sampled without speculation: the
target model's logits at that position given the same prefix, and the row's noise keyed by
(seed, position) (`ferrox_jax/sampling.py`). A draft is kept only where it equals that
sample, and the first sample that differs is kept in its place, so the tokens are the
non-speculative ones, greedy or sampled, seed for seed. For a sampled row this is the
standard speculative rejection rule with a one-hot proposal q = [draft]: the draft is
accepted with probability p(draft), and on rejection the token is drawn from p with the
draft removed and renormalised (the shared noise couples the two draws; the marginal law is
the same). The distribution is unchanged and a seeded reply stays reproducible and
independent of the batch, of the drafts, and of whether speculation ran at all.

Rows that never speculate, because their next token's distribution depends on the tokens
before it in a way one step's settings cannot express: structured-output rows (the
grammar's mask at draft positions is unknown until the draft is accepted), rows with
presence / frequency / repetition penalties (the counts change inside the run), and rows
still short of `min_tokens` (their stop tokens are banned by count). `logit_bias` is the
same at every position, so it speculates. A step with more decoding rows than `max_rows`
does not speculate at all (a large batch is compute-bound, where verifying k tokens costs
k times more), and a step's rows and drafts together stay within its largest row bucket.

KV of rejected drafts: their positions were written this step, but `num_computed_tokens`
advances only over the accepted ones, so those positions lie beyond the row's length; the
next step writes them again before any query can attend to them (attention reads positions
up to the query's own, and a step writes its tokens' K/V before attending). Drafts are
capped at `max_tokens - generated - 1`, so a row never writes past the last position its
admission-time block reservation covers: no lookahead blocks are needed.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np

from ferrox_jax.config import SpeculativeConfig
from ferrox_jax.plan import DraftRequest, RowPlan, StepPlan
from ferrox_jax.request import Row, RowResult

if TYPE_CHECKING:
    from ferrox_jax.block_tables import BlockTables

MAX_BACKOFF_STEPS = 16  # longest a row waits between drafts while none is accepted


def propose_ngram(token_ids, max_drafts: int, ngram_min: int, ngram_max: int) -> tuple[int, ...]:
    """Prompt lookup: the tokens that followed the latest earlier occurrence of the text's
    longest suffix of `ngram_max` down to `ngram_min` tokens; () when none occurs.

    Args:
      token_ids: the row's prompt and output so far (its last token is the one it computes next).
      max_drafts: at most this many drafts.
    """
    if max_drafts < 1:
        return ()
    tokens = np.asarray(token_ids, np.int64)
    length = len(tokens)
    for n in range(min(ngram_max, length - 1), ngram_min - 1, -1):
        # Windows starting at i < length - n (an earlier occurrence, at least one token after it).
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
        hits = np.flatnonzero((windows == tokens[length - n:]).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return tuple(tokens[start:start + max_drafts].tolist())
    return ()


def count_accepted(drafts: tuple[int, ...], sampled) -> int:
    """Drafts kept: the longest prefix of `drafts` equal to the tokens sampled before each
    (`sampled[j]` is what was sampled after the row's j-th computed token)."""
    accepted = 0
    for draft, token in zip(drafts, sampled):
        if int(token) != draft:
            break
        accepted += 1
    return accepted


@dataclasses.dataclass
class SpecDecodeCounters:
    """vLLM's spec-decode counters: published in BatcherStats, rendered in /metrics."""

    num_speculative_tokens: int = 0  # k (the length of the per-position counts)
    num_drafts: int = 0  # row-steps that verified at least one draft
    num_draft_tokens: int = 0  # draft tokens verified
    num_accepted_tokens: int = 0  # of those, accepted
    accepted_per_pos: list[int] = dataclasses.field(default_factory=list)  # accepted at draft position j

    def record(self, num_drafts: int, num_accepted: int) -> None:
        if not num_drafts:
            return
        if len(self.accepted_per_pos) < self.num_speculative_tokens:
            self.accepted_per_pos += [0] * (self.num_speculative_tokens - len(self.accepted_per_pos))
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        for j in range(num_accepted):
            self.accepted_per_pos[j] += 1


class NgramProposer:
    """Prompt lookup's proposer (`propose_ngram`), on the host: each request's drafts from
    its own text, within the step's `max_draft_tokens` in request order."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config

    def propose(self, plan: StepPlan) -> list[tuple[int, ...]]:
        room = plan.max_draft_tokens
        proposed = []
        for request in plan.draft_requests:
            drafts = propose_ngram(request.token_ids, min(room, request.num_drafts), self.config.ngram_min,
                                   self.config.ngram_max)
            room -= len(drafts)
            proposed.append(drafts)
        return proposed


class Speculator:
    """The scheduler's side: names the decoding rows that may verify drafts, adds the
    proposer's drafts to them, and counts what was accepted (module docstring: which rows
    and steps speculate)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.counters = SpecDecodeCounters(config.most_drafts)
        # Back-off per row: a verification that kept no draft makes the row skip drafting
        # for its next `wait` steps, doubling up to MAX_BACKOFF_STEPS while none is kept
        # (a draft costs a row of the step; text with nothing to copy should not pay it).
        self._backoff: dict[int, list[int]] = {}  # row id -> [steps left to skip, next wait]
        # Adaptive length (config.max_speculative_tokens): rows whose drafts were all kept
        # draft more (1 + k doubling, up to the maximum) while the text keeps repeating; absent: k.
        self._length: dict[int, int] = {}  # row id -> drafts it may verify next

    def max_drafts(self, row: Row) -> int:
        """Drafts the row may verify this step: 0 for a row that never speculates, else k
        capped so that it samples no more than its remaining max_tokens."""
        submitted = row.job.submitted
        p = row.sampling
        if (row.matcher is not None or p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0
                or row.num_output_tokens < submitted.min_tokens):
            return 0
        length = self._length.get(row.row_id, self.config.num_speculative_tokens)
        return max(0, min(length, submitted.max_tokens - row.num_generated_tokens - 1))

    def plan_drafts(self, decode: tuple[RowPlan, ...], rows: dict[int, Row], blocks: BlockTables,
                    max_tokens: int) -> tuple[tuple[RowPlan, ...], tuple[DraftRequest, ...], int]:
        """(the decoding rows, their draft requests, the draft tokens the step may take in
        all); no request when the batch is over `max_rows`. The rows' tokens stay within
        `max_tokens` (each is a one-token row of the step's forward, so they must fit its
        largest row bucket). For the draft model a requesting row's table grows here to
        cover its drafts (the model writes their K/V while proposing), within the room;
        n-gram drafts are found from the row's text, and its table grows in `add_drafts`
        for those it gets."""
        if len(decode) > self.config.max_rows:
            return decode, (), 0
        if len(self._backoff) + len(self._length) > 4 * len(rows) + 64:  # rows that ended by a cancel: forget them
            self._backoff = {row_id: b for row_id, b in self._backoff.items() if row_id in rows}
            self._length = {row_id: n for row_id, n in self._length.items() if row_id in rows}
        room = max_tokens - len(decode)
        out = list(decode)
        requests: list[DraftRequest] = []
        for i, plan in enumerate(decode):
            row = rows[plan.row_id]
            backoff = self._backoff.get(plan.row_id)
            if backoff is not None and backoff[0] > 0:
                backoff[0] -= 1
                continue
            if self.config.method == "ngram":
                if num := self.max_drafts(row):
                    requests.append(DraftRequest(plan, num, tuple(row.token_ids)))
            elif num := min(room, self.max_drafts(row)):
                blocks.prepare_decode(row, num_tokens=1 + num)
                out[i] = dataclasses.replace(plan, block_ids=tuple(row.block_ids))
                requests.append(DraftRequest(out[i], num))
                room -= num
        max_draft_tokens = room if self.config.method == "ngram" else sum(r.num_drafts for r in requests)
        return tuple(out), tuple(requests), max_draft_tokens

    def add_drafts(self, decode: tuple[RowPlan, ...], requests: tuple[DraftRequest, ...],
                   drafts: list[tuple[int, ...]], rows: dict[int, Row], blocks: BlockTables) -> tuple[RowPlan, ...]:
        """The decoding rows with each request's proposed `drafts` appended (and their
        tables grown to cover them)."""
        proposed = {request.row.row_id: tuple(found) for request, found in zip(requests, drafts)}
        return tuple(self._with_drafts(plan, rows[plan.row_id], blocks, proposed[plan.row_id])
                     if proposed.get(plan.row_id) else plan for plan in decode)

    @staticmethod
    def _with_drafts(plan: RowPlan, row: Row, blocks: BlockTables, drafts: tuple[int, ...]) -> RowPlan:
        if not drafts:
            return plan
        blocks.prepare_decode(row, num_tokens=1 + len(drafts))
        return dataclasses.replace(plan, token_ids=plan.token_ids + drafts, block_ids=tuple(row.block_ids),
                                   num_draft_tokens=len(drafts))

    def record(self, plan: RowPlan, result: RowResult, is_finished: bool) -> None:
        """Counts a verification and updates the row's back-off and draft length (both
        forgotten once it ends)."""
        accepted = len(result.following)
        self.counters.record(plan.num_draft_tokens, accepted)
        if is_finished:
            self._backoff.pop(plan.row_id, None)
            self._length.pop(plan.row_id, None)
            return
        if self.config.max_speculative_tokens and plan.num_draft_tokens:
            if accepted == plan.num_draft_tokens:
                length = self._length.get(plan.row_id, self.config.num_speculative_tokens)
                # 1 + k tokens fill a row bucket (1, 2, 4, 8, 16...): 3 -> 7 -> 15 doubles it
                self._length[plan.row_id] = min(2 * length + 1, self.config.max_speculative_tokens)
            else:
                self._length.pop(plan.row_id, None)
        if accepted:
            self._backoff.pop(plan.row_id, None)
        else:
            wait = self._backoff.get(plan.row_id, [0, 1])[1]
            self._backoff[plan.row_id] = [wait, min(2 * wait, MAX_BACKOFF_STEPS)]


def spec_decode_stats(speculator: Speculator | None) -> dict[str, object]:
    """The counters as BatcherStats fields (empty when speculation is off)."""
    if speculator is None:
        return {}
    c = speculator.counters
    return dict(spec_decode_num_drafts=c.num_drafts, spec_decode_num_draft_tokens=c.num_draft_tokens,
                spec_decode_num_accepted_tokens=c.num_accepted_tokens,
                spec_decode_num_accepted_tokens_per_pos=tuple(c.accepted_per_pos))
