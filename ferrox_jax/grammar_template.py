"""One GrammarSpec into llguidance: its grammar text and its never-stepped template matcher.

`compile_template(lltokenizer, spec)` is the translation every compile goes through: JSON
schemas (closed under `strict`, best effort otherwise), regexes, choices and Lark / GBNF
grammars become llguidance grammar text, which is compiled under the parser limits of
`ferrox_jax/grammar_limits.py` into a matcher that is only ever copied, never stepped. An
error comes back as a `GrammarError` naming the problem in the request's words.

Two callers share it, which is why it is a module of its own: the server's
`GrammarCompiler` (`ferrox_jax/grammar.py`, cached by spec) and the sandbox's child process
(`ferrox_jax/grammar_sandbox.py`), which compiles each new spec first so a native crash
costs one request. Neither imports the other for it.
"""

from __future__ import annotations

import json
import re
from typing import Any

import llguidance
from llguidance.gbnf_to_lark import any_to_lark

from ferrox_jax.constraint import GrammarError, GrammarSpec
from ferrox_jax.grammar_limits import PARSER_LIMITS

_UNIMPLEMENTED_KEYS = re.compile(r"Unimplemented keys: \[([^\]]*)\]")


def _close_objects(schema: Any) -> Any:
    """A copy of `schema` where object schemas that do not say `additionalProperties`
    (or `unevaluatedProperties`) get `additionalProperties: false`. `not` subschemas are
    left alone (closing them would widen what they forbid)."""
    if isinstance(schema, list):
        return [_close_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in ("const", "enum", "default", "examples", "not", "x-guidance"):
            out[key] = value  # data, or a subschema whose meaning closing would invert
        elif key in ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas"):
            out[key] = {k: _close_objects(v) for k, v in value.items()} if isinstance(value, dict) else value
        else:
            out[key] = _close_objects(value)
    is_object = "properties" in schema or schema.get("type") == "object"
    if is_object and "additionalProperties" not in schema and "unevaluatedProperties" not in schema:
        out["additionalProperties"] = False
    return out


def _has_multi_branch_all_of(schema: Any) -> bool:
    """True if some `allOf` has two or more branches (possibly through `$defs`)."""
    if isinstance(schema, list):
        return any(_has_multi_branch_all_of(s) for s in schema)
    if not isinstance(schema, dict):
        return False
    all_of = schema.get("allOf")
    if isinstance(all_of, list) and len(all_of) > 1:
        return True
    return any(_has_multi_branch_all_of(v) for k, v in schema.items() if k not in ("const", "enum", "default", "examples"))


def _to_llguidance_grammar(spec: GrammarSpec) -> str:
    """The llguidance grammar text for `spec`; raises GrammarError for an unparsable GBNF."""
    if spec.kind in ("json_schema", "json_object"):
        schema = json.loads(spec.source) if spec.kind == "json_schema" else {"type": "object"}
        # Closing every branch of an allOf would make each forbid the others' properties
        # (an empty intersection), so such schemas keep JSON Schema's open default.
        if spec.kind == "json_schema" and spec.strict and not _has_multi_branch_all_of(schema):
            schema = _close_objects(schema)
        # Non-strict is best effort: unimplemented keywords are ignored and a oneOf whose
        # branches may overlap is approximated by anyOf.
        is_lenient = spec.kind == "json_schema" and not spec.strict
        options: dict[str, Any] = {"lenient": is_lenient, "coerce_one_of": is_lenient}
        if spec.max_whitespace_chars == 0:
            options.update(whitespace_flexible=False, whitespace_pattern=None)
        else:
            options["whitespace_pattern"] = f"[\\x20\\x0A\\x0D\\x09]{{1,{spec.max_whitespace_chars}}}"
        # Overrides beat the schema's own "x-guidance", so a request cannot lift the bound.
        return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=options)
    if spec.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.source)
    if spec.kind == "choice":
        # JSON string literals are valid Lark string literals (llguidance's own recipe);
        # ensure_ascii=False keeps characters outside the BMP out of surrogate escapes.
        return "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.source)
    if spec.syntax == "gbnf":
        try:
            return any_to_lark(spec.source)
        # The converter raises bare Exception for grammar errors (e.g. "Rule 'x' not found").
        except Exception as e:  # noqa: BLE001
            raise GrammarError(f"invalid GBNF grammar: {e}") from e
    return llguidance.LLMatcher.grammar_from_lark(spec.source)


def _error_message(spec: GrammarSpec, engine_error: str) -> str:
    """A GrammarError message naming the problem, from llguidance's error text."""
    engine_error = engine_error.strip()
    unimplemented = _UNIMPLEMENTED_KEYS.search(engine_error)
    if unimplemented:
        keys = ", ".join(k.strip().strip('"') for k in unimplemented.group(1).split(","))
        return (f"JSON schema uses unsupported keyword(s): {keys} "
                "(not enforceable; a non-strict json_schema ignores them)")
    what = {"json_schema": "JSON schema", "json_object": "JSON object constraint", "regex": "regex",
            "choice": "choice", "grammar": f"{spec.syntax} grammar"}[spec.kind]
    return f"invalid {what}: {engine_error}"


def compile_template(lltokenizer: llguidance.LLTokenizer, spec: GrammarSpec) -> tuple[llguidance.LLMatcher, tuple[str, ...]]:
    """The never-stepped matcher for `spec` and its warnings; GrammarError naming the problem.
    Native code: call it only on a spec that passed `check_limits` (and, in the server,
    the sandbox)."""
    try:
        grammar = _to_llguidance_grammar(spec)
    except ValueError as e:
        if isinstance(e, GrammarError):
            raise
        raise GrammarError(_error_message(spec, str(e))) from e
    # The constructor never raises for grammar errors; it leaves the matcher in an
    # error state whose message is the validation error.
    template = llguidance.LLMatcher(lltokenizer, grammar, log_level=0, limits=PARSER_LIMITS)
    if template.is_error():
        raise GrammarError(_error_message(spec, template.get_error()))
    return template, tuple(template.get_grammar_warnings())
