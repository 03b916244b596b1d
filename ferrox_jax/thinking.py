"""Thinking budgets: a row's thinking section cut at N tokens by forcing its end marker. No jax here.

Reasoning models write a thinking section (`<think> ... </think>`) before their answer. A
request may cap it (vLLM's `thinking_token_budget`, Anthropic's `thinking.budget_tokens`,
`reasoning.max_tokens` on Responses): `ThinkingBudget` is that cap as plain data on the
`Job`, with the template's markers already tokenized by the API; `ThinkingCounter` is one
row's progress through it, kept on the row (`Row.accept_token`).

How the cap works: the row counts the tokens it writes inside its section. Once it has
written `max_tokens` of them without closing the section, its next tokens are the end
marker's, one per step, each taken *instead of* the token that step sampled: the device
samples as usual and the row records the marker's token in its place (`forced_token`).
Nothing changes on the device (no mask, no bias, no new shape), so a budgeted row batches
with any other row and nothing recompiles; the next step feeds the forced token, so the
model's cache holds exactly the text the client receives, and after the marker the row
writes its answer as usual. With speculation, the drafts verified after a replaced token
were conditioned on the token it replaced, so the scheduler drops them
(`Row.took_forced_token`): a replaced token is the row's last of its step.

A forced token's `RowResult` keeps the step's top logprobs (the model's view of that
position); its own logprob is the model's when it is among them, else -9999.0 (below any
the model gave it, the value vLLM writes for -inf).

States, in order: `before` (the prompt did not open a section: the output may open one
with the start marker's tokens, first thing, or else has none), `inside` (counting),
`forcing` (writing the end marker), `done` (closed by the model or by force, or never
opened). Only the marker's exact token ids are recognised, the way the template writes it.
"""

from __future__ import annotations

import dataclasses

FORCED_UNKNOWN_LOGPROB = -9999.0  # a forced token outside the step's top logprobs (vLLM's -inf)


@dataclasses.dataclass(frozen=True)
class ThinkingBudget:
    """The most tokens a row may write inside its thinking section, and the markers' tokens."""

    max_tokens: int  # tokens inside the section before the end marker is forced (0: at once)
    end_token_ids: tuple[int, ...]  # the end marker (`</think>`) as the tokenizer encodes it
    start_token_ids: tuple[int, ...] = ()  # the start marker (`<think>`); () when the prompt opens it
    starts_inside: bool = False  # the rendered prompt ends inside an open section

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 0:
            raise ValueError(f"ThinkingBudget.max_tokens must be an int >= 0; got {self.max_tokens!r}")
        if not self.end_token_ids:
            raise ValueError("ThinkingBudget.end_token_ids must not be empty")
        if not self.starts_inside and not self.start_token_ids:
            raise ValueError("ThinkingBudget.start_token_ids must not be empty unless starts_inside")


class ThinkingCounter:
    """One row's progress through its `ThinkingBudget` (module docstring). Owner thread only."""

    def __init__(self, budget: ThinkingBudget) -> None:
        self.budget = budget
        self.state = "inside" if budget.starts_inside else "before"
        self.num_thinking_tokens = 0  # tokens written inside the section so far
        self._tail: list[int] = []  # `before`: the output so far; `inside`: its last tokens
        self._num_forced = 0  # `forcing`: marker tokens written

    @property
    def is_forcing(self) -> bool:
        return self.state == "forcing"

    def forced_token(self) -> int | None:
        """The token the row must take next instead of sampling, or None."""
        if self.state == "inside" and self.num_thinking_tokens >= self.budget.max_tokens:
            self.state, self._num_forced = "forcing", 0
        if self.state == "forcing":
            return self.budget.end_token_ids[self._num_forced]
        return None

    def observe(self, token_id: int) -> None:
        """The row recorded `token_id` (sampled or forced) in its output."""
        budget = self.budget
        if self.state == "before":
            self._tail.append(token_id)
            start = budget.start_token_ids
            if tuple(self._tail) == start:
                self.state, self._tail = "inside", []
            elif tuple(self._tail) != start[:len(self._tail)]:
                self.state = "done"  # the output does not open with a section: nothing to count
        elif self.state == "inside":
            end = budget.end_token_ids
            self._tail = (self._tail + [token_id])[-len(end):]
            if tuple(self._tail) == end:
                self.state = "done"  # the model closed its section within the budget
            else:
                self.num_thinking_tokens += 1
        elif self.state == "forcing":
            self._num_forced += 1
            if self._num_forced == len(budget.end_token_ids):
                self.state = "done"
