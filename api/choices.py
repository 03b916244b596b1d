"""Turning RowEvents into OpenAI choices: text, logprobs and finish reasons, whole or as deltas.

A `Choice` accumulates one row's events (one choice = one row of one engine job).
Logprobs cover every token usage counts: the sampled tokens and the eos/stop token that
ended the row (`RowEvent.stop_token`, whose text is never part of the content), as
OpenAI's and vLLM's echo responses do; scorers such as lm-eval drop the last entry as
the generated token.
`CompletionShape` and `ChatShape` render it the two ways OpenAI does: `/v1/completions`
(`text`, legacy `logprobs` with tokens / token_logprobs / top_logprobs / text_offset)
and `/v1/chat/completions` (`message` or `delta`, `logprobs.content[]` entries with
`top_logprobs` lists). The batcher already holds back text that could start a stop
string and never splits a UTF-8 character, so a delta is the event's `text` as is.
A chat choice with tools or thinking sections carries an `OutputParser`
(`api/structured.py`): its text becomes `reasoning_content`, `content` and `tool_calls`
(whole, or as deltas), and a reply with calls finishes with "tool_calls".
Usage is counted by the generation core (`api/generation.py`), not here.
`reply_entries` says how large a whole reply will be, so the adapter builds a large one
in the CPU pool (`INLINE_REPLY_ENTRIES`); how large a reply may be at all is a request
limit (`api/limits.py:check_reply_entries`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

from api.structured import OutputParser, parse_output
from ferrox_jax.request import RowEvent


# Whole replies with more token entries than this are rendered off the event loop: a few
# µs of CPU per entry (a dict per logprob alternative, then its JSON). Measured on a busy
# 2-core box, 32 prompts x 800 tokens x 20 logprobs (537,600 entries, a 9.9 MiB reply)
# held /health for 1.8-2.1 s rendered inline and 0.2-0.6 s rendered in the pool; 4 Ki
# entries inline cost the loop ~15 ms.
INLINE_REPLY_ENTRIES = 4 << 10


@dataclasses.dataclass
class Choice:
    """One row's output so far."""

    index: int  # OpenAI choice index: job * n + row index
    echo: str = ""  # completions `echo`: the prompt text, sent before the first delta
    prompt_entries: list[tuple[int, float | None, tuple]] | None = None  # echo logprobs
    text: list[str] = dataclasses.field(default_factory=list)
    entries: list[tuple[int, float, tuple]] = dataclasses.field(default_factory=list)  # (id, lp, top)
    finish_reason: str | None = None
    error: str | None = None
    started: bool = False  # streaming: first chunk (role / echo) sent
    lp_offset: int = 0  # completions text_offset of the next logprob token
    parser: OutputParser | None = None  # chat: reasoning and tool calls to split out of the text

    def add(self, event: RowEvent) -> list[tuple[int, float, tuple]]:
        """Fold in one RowEvent; returns the logprob entries it brought."""
        if event.text:
            self.text.append(event.text)
        results = list(event.logprobs or ())
        if event.logprobs is not None and event.stop_token is not None:
            results.append(event.stop_token)  # counted in usage, so scored too (echo scoring reads it)
        new = [(int(r.token_id), float(r.logprob), tuple(r.top_logprobs)) for r in results]
        self.entries.extend(new)
        if event.finish_reason is not None:
            self.finish_reason = event.finish_reason
            self.error = event.error
        return new


def reply_entries(choices: Sequence[Choice], top_k: int | None) -> int:
    """Token entries a whole reply of `choices` renders: each token (echoed prompt ones
    too) once, plus its `top_k` logprob alternatives; text alone counts its tokens."""
    tokens = sum(len(c.entries) + len(c.prompt_entries or ()) for c in choices)
    return tokens * (1 + (top_k or 0)) + sum(len(c.text) for c in choices)


def prompt_entries(prompt_ids: Sequence[int], prompt_logprobs: Any) -> list[tuple[int, float | None, tuple]]:
    """Echo logprob entries: the first prompt token has none (nothing precedes it).

    `prompt_logprobs` holds, per prompt token after the first, (logprob, top-k pairs).
    """
    out: list[tuple[int, float | None, tuple]] = [(int(prompt_ids[0]), None, ())]
    for token_id, item in zip(prompt_ids[1:], prompt_logprobs or ()):
        logprob, top = item
        out.append((int(token_id), float(logprob), tuple(top)))
    return out


class TokenText:
    """Token id -> its string (special tokens kept), cached: logprobs name every token."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self.text = functools.lru_cache(maxsize=65536)(self._text)

    def _text(self, token_id: int) -> str:
        return self._tokenizer.decode([token_id], skip_special_tokens=False)


class CompletionShape:
    """`/v1/completions`: object `text_completion`, choices carry `text`."""

    object = "text_completion"
    chunk_object = "text_completion"

    def __init__(self, tokens: TokenText, top_k: int | None) -> None:
        self.tokens = tokens
        self.top_k = top_k  # the request's `logprobs`; None = no logprobs

    def _logprobs(self, choice: Choice, entries: Sequence[tuple[int, float | None, tuple]]) -> dict | None:
        if self.top_k is None:
            return None
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token_id, logprob, top in entries:
            s = self.tokens.text(token_id)
            out["tokens"].append(s)
            out["token_logprobs"].append(logprob)
            if logprob is None:
                out["top_logprobs"].append(None)
            else:
                # OpenAI: the sampled token is always included, so up to top_k + 1 entries
                tops: dict[str, float] = {}
                for t, lp in top[: self.top_k]:  # best first; tokens that print alike keep the best
                    tops.setdefault(self.tokens.text(t), lp)
                tops.setdefault(s, logprob)
                out["top_logprobs"].append(tops)
            out["text_offset"].append(choice.lp_offset)
            choice.lp_offset += len(s)
        return out

    def final(self, choice: Choice) -> dict:
        entries = (choice.prompt_entries or []) + choice.entries
        return {"index": choice.index, "text": choice.echo + "".join(choice.text),
                "logprobs": self._logprobs(choice, entries), "finish_reason": choice.finish_reason}

    def deltas(self, choice: Choice, text: str, entries: list, finish_reason: str | None) -> list[dict]:
        out = []
        if not choice.started:
            choice.started = True
            if choice.echo:
                out.append({"index": choice.index, "text": choice.echo,
                            "logprobs": self._logprobs(choice, choice.prompt_entries or []),
                            "finish_reason": None})
        if text or entries or finish_reason:
            out.append({"index": choice.index, "text": text, "logprobs": self._logprobs(choice, entries),
                        "finish_reason": finish_reason})
        return out


class ChatShape:
    """`/v1/chat/completions`: `message` when whole, `delta` when streamed."""

    object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def __init__(self, tokens: TokenText, top_k: int | None) -> None:
        self.tokens = tokens
        self.top_k = top_k  # top_logprobs when logprobs is true; None = no logprobs

    def _entry(self, token_id: int, logprob: float) -> dict:
        s = self.tokens.text(token_id)
        return {"token": s, "logprob": logprob, "bytes": list(s.encode("utf-8"))}

    def _logprobs(self, entries: Sequence[tuple[int, float, tuple]]) -> dict | None:
        if self.top_k is None:
            return None
        content = []
        for token_id, logprob, top in entries:
            item = self._entry(token_id, logprob)
            item["top_logprobs"] = [self._entry(t, lp) for t, lp in top[: self.top_k]]
            content.append(item)
        return {"content": content}

    def final(self, choice: Choice) -> dict:
        message: dict[str, Any] = {"role": "assistant", "content": "".join(choice.text)}
        finish_reason = choice.finish_reason
        if choice.parser is not None:
            parsed = parse_output(choice.parser, message["content"])
            # OpenAI sends null content for a reply that is only calls.
            message["content"] = parsed.content if parsed.content or not parsed.calls else None
            if parsed.reasoning is not None:  # under both names, for clients of either vintage
                message["reasoning_content"] = message["reasoning"] = parsed.reasoning or None
            if parsed.calls:
                message["tool_calls"] = [call.to_openai() for call in parsed.calls]
            finish_reason = choice.parser.finish_reason(finish_reason)
        return {"index": choice.index, "message": message, "logprobs": self._logprobs(choice.entries),
                "finish_reason": finish_reason}

    def deltas(self, choice: Choice, text: str, entries: list, finish_reason: str | None) -> list[dict]:
        out = []
        if not choice.started:
            choice.started = True
            out.append({"index": choice.index, "delta": {"role": "assistant", "content": ""},
                        "logprobs": None, "finish_reason": None})
        parser = choice.parser
        if parser is None:
            pieces = [{"content": text}] if text else []
        else:  # reasoning, content and tool-call deltas; the parser holds back undecided text
            pieces = parser.feed(text) + (parser.finish() if finish_reason else [])
            finish_reason = parser.finish_reason(finish_reason)
        if entries and not pieces:
            pieces = [{"content": ""}]  # the logprobs of tokens whose text is held back
        for i, piece in enumerate(pieces):
            if "reasoning_content" in piece:  # under both names, as the whole reply
                piece = {**piece, "reasoning": piece["reasoning_content"]}
            out.append({"index": choice.index, "delta": piece,
                        "logprobs": self._logprobs(entries if i == 0 else []), "finish_reason": None})
        if finish_reason:
            out.append({"index": choice.index, "delta": {}, "logprobs": None, "finish_reason": finish_reason})
        return out
