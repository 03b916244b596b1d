"""Incremental detokenization and stop-string matching for one row. No jax here.

The scheduler feeds each row's generated tokens, one at a time, through a `TextStream`:

    token ids --IncrementalDetokenizer--> complete text --StopStringMatcher--> safe text

`IncrementalDetokenizer` uses only `tokenizer.decode(list[int])`, the way vLLM does: it
decodes a short window `tokens[prefix_offset:]` and emits what it adds beyond
`tokens[prefix_offset:read_offset]`. Decoding a window (instead of each token alone) keeps
tokenizers that glue a leading space or merge bytes across tokens right. Text whose
decode ends in U+FFFD is held back: the token stream stopped inside a multi-byte UTF-8
character, and the next token usually completes it.

`StopStringMatcher` holds back any suffix that could still start a stop string, and when a
stop string appears cuts the text where it begins (the stop string is never emitted) and
remembers which one it was (`matched`: Anthropic's `stop_sequence`, llama.cpp's
`stopping_word`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

# Prompt tokens decoded in front of the first generated token, so the first piece gets the
# spacing it would have in context (vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET).
NUM_CONTEXT_TOKENS = 5
# A UTF-8 character spans at most 4 bytes, i.e. at most 4 byte-fallback tokens. A decode
# still ending in U+FFFD after this many held tokens is a genuinely invalid sequence, so it
# is emitted as is rather than held forever.
MAX_HELD_TOKENS = 4
REPLACEMENT_CHAR = "\ufffd"


class Decoder(Protocol):
    def decode(self, ids: Sequence[int]) -> str: ...


class IncrementalDetokenizer:
    """Turns a token stream into text deltas that never end inside a UTF-8 character."""

    def __init__(self, tokenizer: Decoder, prompt_token_ids: Sequence[int]) -> None:
        self._tokenizer = tokenizer
        context = list(prompt_token_ids[-NUM_CONTEXT_TOKENS:])
        self._tokens = context  # only the window still needed, not the whole sequence
        self._prefix_offset = 0  # start of the decode window
        self._read_offset = len(context)  # tokens before this are already emitted as text

    def add_token(self, token_id: int) -> str:
        """Appends one token; returns the newly completed text (possibly empty)."""
        self._tokens.append(token_id)
        return self._advance(is_final=False)

    def flush(self) -> str:
        """Returns whatever is still held back; call once, when the row ends."""
        return self._advance(is_final=True)

    def _advance(self, *, is_final: bool) -> str:
        decode = self._tokenizer.decode
        prefix_text = decode(self._tokens[self._prefix_offset:self._read_offset])
        new_text = decode(self._tokens[self._prefix_offset:])
        num_held = len(self._tokens) - self._read_offset
        is_incomplete = new_text.endswith(REPLACEMENT_CHAR) and num_held < MAX_HELD_TOKENS
        if len(new_text) <= len(prefix_text) or (is_incomplete and not is_final):
            return ""
        delta = new_text[len(prefix_text):]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._tokens)
        # Drop tokens before the window so decode cost stays constant per token.
        del self._tokens[:self._prefix_offset]
        self._read_offset -= self._prefix_offset
        self._prefix_offset = 0
        return delta


class StopStringMatcher:
    """Accumulates text and releases only the part no stop string can still claim."""

    def __init__(self, stop: Sequence[str]) -> None:
        assert all(stop), "stop strings must be non-empty"
        self._stop = tuple(stop)
        self._max_stop_chars = max((len(s) for s in self._stop), default=0)
        self._text = ""
        self._num_emitted_chars = 0
        self.is_stopped = False
        self.matched: str | None = None  # the stop string that ended the text

    @property
    def text(self) -> str:
        """All text decided so far, cut before a matched stop string."""
        return self._text

    def add_text(self, text: str) -> str:
        """Adds text; returns the newly releasable part. Sets `is_stopped` on a match."""
        assert not self.is_stopped, "text added after a stop string matched"
        self._text += text
        if not self._stop:
            return self._release(len(self._text))
        # Emitted text never ends with a possible stop-string start, so a match can only
        # begin at or after the first unemitted character.
        matches = [(i, n, s) for n, s in enumerate(self._stop)
                   if (i := self._text.find(s, self._num_emitted_chars)) >= 0]
        if matches:
            # The earliest start wins; at one start, the first listed (the request's order).
            cut, _, self.matched = min(matches)
            self._text = self._text[:cut]
            self.is_stopped = True
            return self._release(cut)
        return self._release(len(self._text) - self._num_chars_to_hold())

    def flush(self) -> str:
        """Releases held text: the row ended without this text completing a stop string."""
        return self._release(len(self._text))

    def _num_chars_to_hold(self) -> int:
        """Length of the longest unemitted suffix that is a proper prefix of a stop string."""
        longest = min(self._max_stop_chars - 1, len(self._text) - self._num_emitted_chars)
        for num_chars in range(longest, 0, -1):
            suffix = self._text[-num_chars:]
            if any(s.startswith(suffix) for s in self._stop):
                return num_chars
        return 0

    def _release(self, end: int) -> str:
        released = self._text[self._num_emitted_chars:end]
        self._num_emitted_chars = max(self._num_emitted_chars, end)
        return released


class TextStream:
    """A row's text: detokenizer then stop-string matcher. `is_stopped` after a match."""

    def __init__(self, tokenizer: Decoder, prompt_token_ids: Sequence[int],
                 stop: Sequence[str] = ()) -> None:
        self._detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids)
        self._matcher = StopStringMatcher(stop)

    @property
    def is_stopped(self) -> bool:
        return self._matcher.is_stopped

    @property
    def text(self) -> str:
        return self._matcher.text

    @property
    def matched_stop(self) -> str | None:
        """The stop string that ended the row, or None."""
        return self._matcher.matched

    def add_token(self, token_id: int) -> str:
        """Returns the text this token makes safe to send (possibly empty)."""
        return self._matcher.add_text(self._detokenizer.add_token(token_id))

    def finish(self) -> str:
        """Returns the held-back remainder when the row ends (empty after a stop string)."""
        if self._matcher.is_stopped:
            return ""
        released = self._matcher.add_text(self._detokenizer.flush())
        if self._matcher.is_stopped:
            return released
        return released + self._matcher.flush()


class SpecialTokensKept:
    """A decoder that keeps special tokens in the text (for output parsed afterwards, such
    as tool calls whose markers are special tokens)."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer

    def decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=False)
