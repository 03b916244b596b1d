"""Thinking sections: split a reasoning model's output into `reasoning_content` and `content`.

Models whose chat templates have thinking sections (DeepSeek-R1, Qwen3, ...) write
`<think> ... </think>` before the answer; OpenAI-compatible servers return the inside as
`reasoning_content` and only the rest as `content`. Some templates open the section in
the generation prompt (the rendered prompt ends with `<think>`), so the output starts
inside it and only the closing tag appears: pass `starts_in_reasoning=True` then
(`prompt_opens_reasoning(prompt)` tells).

The protocol adapters call `split_reasoning` on a finished text, or feed a
`ReasoningStreamParser` the row's text deltas (`RowEvent.text`) and send each returned
(reasoning delta, content delta) pair as a chunk. Whole-text and streamed results are
the same by construction, whatever the delta boundaries:
  * a section is recognised only at the start of the output (after whitespace);
  * whitespace right inside the tags and right after `</think>` is dropped;
  * without a section, the content is the text verbatim;
  * an unclosed section (the row hit max_tokens) is all reasoning.
The streaming parser never emits a partial tag: a suffix that could still grow into
`<think>` or `</think>` is held back, the way stop strings are.
Tool-call parsing (api/tool_calls.py) then runs on the content part only.

Thinking budgets: a request may cap its thinking section (`thinking_token_budget` on chat,
completions and Responses, as vLLM takes it; `reasoning.max_tokens` on Responses;
Anthropic's `thinking.budget_tokens`). `thinking_budget` turns the cap into the engine's
`ThinkingBudget` with the markers as this tokenizer encodes them; the engine then forces
`</think>` once the section holds that many tokens (`ferrox_jax/thinking.py`), and the
split above sees a closed section. A cap on an output with no section to cut (a template
without thinking sections, a constrained output) changes nothing.
"""

from __future__ import annotations

from typing import Any, Sequence

from ferrox_jax.request import ThinkingBudget

THINK_START = "<think>"
THINK_END = "</think>"


def held_prefix_len(text: str, markers: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some marker:
    the characters a streaming parser must hold back because a marker may be starting."""
    longest = min(max((len(m) for m in markers), default=1) - 1, len(text))
    for num_chars in range(longest, 0, -1):
        suffix = text[-num_chars:]
        if any(m.startswith(suffix) for m in markers):
            return num_chars
    return 0


def prompt_opens_reasoning(prompt: str, start: str = THINK_START) -> bool:
    """True if the rendered prompt ends inside an open thinking section."""
    return prompt.rstrip().endswith(start)


def thinking_budget(tokenizer: Any, max_tokens: int | None, *, has_sections: bool,
                    starts_inside: bool) -> ThinkingBudget | None:
    """The engine's budget for a request's cap of `max_tokens` thinking tokens.

    Args:
      tokenizer: the engine's (`encode(text, add_special_tokens=False)`).
      max_tokens: the cap the request asked for; None: none.
      has_sections: the output is split into reasoning and content (`OutputPlan.reasoning`).
      starts_inside: the prompt opened the section (`OutputPlan.starts_in_reasoning`).
    Returns:
      None without a cap or a section to cut; else the budget, with `</think>`'s tokens (and
      `<think>`'s when the output must open the section itself)."""
    if max_tokens is None or not has_sections:
        return None
    end = tuple(tokenizer.encode(THINK_END, add_special_tokens=False))
    start = () if starts_inside else tuple(tokenizer.encode(THINK_START, add_special_tokens=False))
    return ThinkingBudget(max_tokens, end, start, starts_inside)


def split_reasoning(text: str, *, starts_in_reasoning: bool = False, start: str = THINK_START,
                    end: str = THINK_END) -> tuple[str, str]:
    """Split a whole output into (reasoning_content, content); reasoning is "" if none."""
    parser = ReasoningStreamParser(starts_in_reasoning=starts_in_reasoning, start=start, end=end)
    reasoning, content = parser.feed(text)
    tail_reasoning, tail_content = parser.finish()
    return reasoning + tail_reasoning, content + tail_content


class ReasoningStreamParser:
    """Splits streamed text deltas into (reasoning delta, content delta) pairs."""

    def __init__(self, *, starts_in_reasoning: bool = False, start: str = THINK_START,
                 end: str = THINK_END) -> None:
        if not start or not end:
            raise ValueError(f"thinking tags must be non-empty; got {start!r} and {end!r}")
        self._start, self._end = start, end
        # "start": nothing decided yet; "open": just inside the section (leading whitespace
        # dropped); "reasoning": inside; "after": just past the end tag (leading
        # whitespace dropped); "content": plain text to the end.
        self._state = "open" if starts_in_reasoning else "start"
        self._buf = ""  # text received but not yet emitted

    def feed(self, text: str) -> tuple[str, str]:
        """Add a text delta; returns the (reasoning, content) text now safe to emit."""
        self._buf += text
        return self._process(final=False)

    def finish(self) -> tuple[str, str]:
        """The output ended: release whatever was held back."""
        return self._process(final=True)

    def _process(self, final: bool) -> tuple[str, str]:
        reasoning, content = [], []
        while True:
            state, buf = self._state, self._buf
            if state == "start":
                stripped = buf.lstrip()
                if self._start.startswith(stripped) and not final:
                    return "", ""  # whitespace, or a possible start tag: undecided
                if stripped.startswith(self._start):
                    self._buf, self._state = stripped[len(self._start):], "open"
                else:
                    self._state = "content"
            elif state in ("open", "after"):
                stripped = buf.lstrip()
                if not stripped:
                    self._buf = ""
                    break
                self._buf, self._state = stripped, ("reasoning" if state == "open" else "content")
            elif state == "reasoning":
                cut = buf.find(self._end)
                if cut >= 0:
                    reasoning.append(buf[:cut].rstrip())
                    self._buf, self._state = buf[cut + len(self._end):], "after"
                    continue
                if final:
                    reasoning.append(buf.rstrip())
                    self._buf = ""
                    break
                # Hold a possible end-tag start, and trailing whitespace (dropped if the
                # end tag follows it).
                safe = buf[:len(buf) - held_prefix_len(buf, (self._end,))].rstrip()
                reasoning.append(safe)
                self._buf = buf[len(safe):]
                break
            else:  # content
                content.append(buf)
                self._buf = ""
                break
        return "".join(reasoning), "".join(content)
