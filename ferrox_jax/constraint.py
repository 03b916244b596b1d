"""Output constraints as plain data: what a request asks its output to match.

`GrammarSpec` is what the API builds from a request (JSON schema, any JSON object, regex,
choice, Lark/GBNF grammar), validated at construction, hashable (the compile cache's key)
and cheap to copy: it travels in `Job.grammar`. Compiling it into token
matchers is `ferrox_jax/grammar.py`'s job (llguidance), on the engine's side of the seam;
nothing here imports llguidance, numpy or jax, so the API and the scheduler's plain data
never pull the compiler in.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

GRAMMAR_KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")
GRAMMAR_SYNTAXES = ("lark", "gbnf")
# Longest run of JSON whitespace between two JSON tokens: room for pretty-printed output
# ("\n" plus 2-space indents 7 levels deep) while a small model that keeps choosing spaces
# is forced back to structure after 16 of them. 0 means compact JSON (no whitespace).
DEFAULT_MAX_WHITESPACE_CHARS = 16
# A Lark grammar has a `start:` rule or a `%llguidance` directive; GBNF has neither.
_LARK_RULES = re.compile(r"(?m)^\s*(%llguidance\b|start\s*:)")


class GrammarError(ValueError):
    """A constraint that cannot be compiled; the message names the problem (HTTP 400)."""


def grammar_syntax(text: str) -> str:
    """"lark" or "gbnf" for a grammar's text, told apart by its rules (GBNF's `::=`), as
    llguidance's converter does (`llguidance.gbnf_to_lark.is_lark_syntax`, the same pattern); for the `grammar` kind's `syntax` when a client does not say."""
    return "lark" if _LARK_RULES.search(text) else "gbnf"


@dataclass(frozen=True)
class GrammarSpec:
    """One output constraint, validated at construction; hashable, so it is the cache key.

    Build it with the classmethods (`json_schema`, `json_object`, `regex`, `choice`,
    `grammar`), which serialise the source canonically. A JSON schema is serialised
    compactly but with its key order kept: llguidance emits object properties in the
    order of `properties`, so two schemas that differ only in key order are different
    constraints.
    """

    kind: str  # one of GRAMMAR_KINDS
    # json_schema: the schema as compact JSON text; json_object: ""; regex: the pattern
    # (Rust regex syntax, matched in full); choice: the strings; grammar: the grammar text.
    source: str | tuple[str, ...]
    syntax: str = "lark"  # grammar kind only: "lark" (llguidance's Lark) or "gbnf" (llama.cpp)
    # json_schema only. True: a keyword the engine cannot enforce (or a oneOf it cannot
    # prove exclusive) is a GrammarError, and an object schema without
    # `additionalProperties` gets `false` (the model may not invent keys; not applied when
    # an allOf has several branches). False: such keywords are ignored
    # (CompiledGrammar.warnings names them), oneOf is treated as anyOf, and the schema's
    # own additionalProperties default (any extra key) applies.
    strict: bool = True
    # json kinds only: longest run of whitespace between JSON tokens (0: compact JSON).
    # Whitespace inside strings is content, bounded only by maxLength / max_tokens.
    max_whitespace_chars: int = DEFAULT_MAX_WHITESPACE_CHARS

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise GrammarError(f"kind must be one of {GRAMMAR_KINDS}; got {self.kind!r}")
        if self.syntax not in GRAMMAR_SYNTAXES:
            raise GrammarError(f"syntax must be one of {GRAMMAR_SYNTAXES}; got {self.syntax!r}")
        if isinstance(self.max_whitespace_chars, bool) or not isinstance(self.max_whitespace_chars, int) \
                or self.max_whitespace_chars < 0:
            raise GrammarError(f"max_whitespace_chars must be an int >= 0; got {self.max_whitespace_chars!r}")
        if self.kind == "choice":
            if not isinstance(self.source, tuple) or not self.source:
                raise GrammarError("choice needs a non-empty tuple of strings")
            for choice in self.source:
                if not isinstance(choice, str) or not choice:
                    raise GrammarError(f"every choice must be a non-empty string; got {choice!r}")
            return
        if not isinstance(self.source, str):
            raise GrammarError(f"{self.kind} source must be a string; got {type(self.source).__name__}")
        if self.kind == "json_object" and self.source:
            raise GrammarError("json_object takes no source (it means any JSON object)")
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.source)
            except json.JSONDecodeError as e:
                raise GrammarError(f"invalid JSON schema: not JSON ({e})") from e
            if not isinstance(schema, dict):
                raise GrammarError(f"invalid JSON schema: must be a JSON object; got {type(schema).__name__}")
        if self.kind in ("regex", "grammar") and not self.source.strip():
            raise GrammarError(f"{self.kind} must not be empty")

    @classmethod
    def json_schema(cls, schema: Mapping[str, Any], *, strict: bool = True,
                    max_whitespace_chars: int = DEFAULT_MAX_WHITESPACE_CHARS) -> "GrammarSpec":
        """Output is one JSON value valid against `schema` (a dict, as parsed from JSON)."""
        if not isinstance(schema, Mapping):
            raise GrammarError(f"invalid JSON schema: must be a JSON object; got {type(schema).__name__}")
        try:
            source = json.dumps(schema, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise GrammarError(f"invalid JSON schema: not serialisable as JSON ({e})") from e
        return cls("json_schema", source, strict=strict, max_whitespace_chars=max_whitespace_chars)

    @classmethod
    def json_object(cls, *, max_whitespace_chars: int = DEFAULT_MAX_WHITESPACE_CHARS) -> "GrammarSpec":
        """Output is any JSON object (OpenAI's `response_format: {"type": "json_object"}`)."""
        return cls("json_object", "", max_whitespace_chars=max_whitespace_chars)

    @classmethod
    def regex(cls, pattern: str) -> "GrammarSpec":
        """Output matches `pattern` in full (Rust `regex` syntax: no lookaround, no backrefs)."""
        return cls("regex", pattern)

    @classmethod
    def choice(cls, choices: Sequence[str]) -> "GrammarSpec":
        """Output is exactly one of `choices`."""
        if isinstance(choices, str):
            raise GrammarError("choice needs a list of strings, not one string")
        return cls("choice", tuple(choices))

    @classmethod
    def grammar(cls, text: str, syntax: str = "lark") -> "GrammarSpec":
        """Output matches the grammar's start rule (`start` in Lark, `root` in GBNF)."""
        return cls("grammar", text, syntax=syntax)
