"""Constraint limits checked before the native compiler, and the compile sandbox: a
constraint that crashes llguidance (a 3,000-link `$ref` chain overflows its stack) is a
GrammarError for that request, never a SIGSEGV of the server process."""

from __future__ import annotations

import pytest

from ferrox_jax.constraint import GrammarError, GrammarSpec
from ferrox_jax.grammar_limits import GrammarLimits, check_limits, check_regex
from tests.engine.test_grammar import PROFILE_SCHEMA


def ref_chain(n: int) -> dict:
    """A schema whose $defs are a chain of n `$ref`s ending in a string (n=3,000: ~100 KB)."""
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def lark_chain(n: int) -> str:
    return "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(n)) + f'r{n}: "x"\n'


@pytest.mark.parametrize("spec,words", [
    (GrammarSpec.json_schema(ref_chain(3000)), "3001 $defs/definitions; the limit is 2000"),
    (GrammarSpec.json_schema(ref_chain(1000)), "deeper than the limit of 256 levels"),
    (GrammarSpec.grammar(lark_chain(3000)), "3002 rules; the limit is 2000"),
    (GrammarSpec.grammar(lark_chain(500)), "deeper than the limit of 256 levels"),
    (GrammarSpec.regex("^(a{1000}){1000}$"), "1,000,000 times"),
    (GrammarSpec.regex("((a{100}){100}){100}"), "1,000,000 times"),
    (GrammarSpec.json_schema({"type": "string", "pattern": "^(a{1000}){1000}$"}), "JSON schema pattern repeats"),
    (GrammarSpec.json_schema({"type": "object", "patternProperties": {"(x{200}){200}": {}}}), "patternProperties"),
    (GrammarSpec.json_schema({"type": "array", "maxItems": 10**9}), "maxItems 1000000000"),
    (GrammarSpec.choice([f"option {i}" for i in range(50_000)]), "50,000 choices; at most 1,999"),
    (GrammarSpec.grammar('start: x\nx: (("a"{100}){100}){100}\n'), "grammar rule repeats"),
    (GrammarSpec.grammar("start: /(a{1000}){1000}/\n"), "grammar regex repeats"),
])
def test_pathological_constraints_are_refused_naming_the_limit(spec, words):
    with pytest.raises(GrammarError, match="limit") as e:
        check_limits(spec)
    assert words in str(e.value)


def test_deep_nesting_counts_like_ref_hops():
    schema: dict = {"type": "string"}
    for _ in range(300):
        schema = {"type": "object", "properties": {"a": schema}}
    with pytest.raises(GrammarError, match="deeper than the limit of 256"):
        check_limits(GrammarSpec.json_schema(schema))


@pytest.mark.parametrize("spec", [
    GrammarSpec.json_schema(PROFILE_SCHEMA),
    GrammarSpec.json_schema(ref_chain(200)),
    # Recursive: a tree whose children are trees (the walk enters each schema once).
    GrammarSpec.json_schema({"$defs": {"node": {"type": "object", "properties": {
        "value": {"type": "integer"}, "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}},
        "$ref": "#/$defs/node"}),
    GrammarSpec.json_schema({"type": "string", "pattern": r"^\d{4}-\d{2}-\d{2}$", "maxLength": 10}),
    GrammarSpec.regex(r"(\d{3}-){2}\d{4}|[A-Z]{2,8}\{x\}"),
    GrammarSpec.regex("(a{100}){100}"),
    GrammarSpec.choice([f"option {i}" for i in range(1999)]),
    GrammarSpec.grammar(lark_chain(200)),
    GrammarSpec.grammar('root ::= "a" item{1,8}\nitem ::= [0-9] | "{" root "}"\n', syntax="gbnf"),
    GrammarSpec.json_object(),
])
def test_real_constraints_fit(spec):
    check_limits(spec)


def test_regex_product_counts_nesting_not_sequence():
    check_regex("a{9999}b{9999}c{9999}")  # in sequence: the largest, not the product
    check_regex(r"[{]{5000}\{2}")  # braces in a class or escaped are not repetitions
    with pytest.raises(GrammarError, match="20,000"):
        check_regex("(a{100}|b){200}")
    with pytest.raises(GrammarError):
        check_regex("(a{10,}){2000}", GrammarLimits(max_repeat_product=1000))


# ---------------------------------------------------------------- parser items at one point


def optional_object(n: int, required: tuple[str, ...] = ()) -> dict:
    return {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(n)},
            **({"required": list(required)} if required else {})}


def alternatives(prefix: str, n: int) -> str:
    return " | ".join(f'"{prefix}{i}"' for i in range(n))


# (the widest constraint of a shape that runs, the same one step wider, what the refusal
# says, text to walk the accepted one through: its widest rows come after these tokens).
# The steps are llguidance's own limit, LLParserLimits().max_items_in_row (2,000 here).
WIDEST = {
    "choices": (GrammarSpec.choice([f"option {i}" for i in range(1999)]),
                GrammarSpec.choice([f"option {i}" for i in range(2001)]), "2,001 choices; at most 1,999",
                ["option 7", "option 1998"]),
    "optional properties (best effort: an open object)": (
        GrammarSpec.json_schema(optional_object(498), strict=False),
        GrammarSpec.json_schema(optional_object(499), strict=False),
        "499 optional properties before its first required one (any of them may come first); at most 498",
        ['{"p3": 1, "p200": 2}', '{"p497": 1}']),
    "optional properties (strict: a closed object)": (
        GrammarSpec.json_schema(optional_object(500)), GrammarSpec.json_schema(optional_object(501)),
        "501 optional properties before its first required one (any of them may come first); at most 500",
        ['{"p3": 1, "p200": 2}']),
    "optional properties after a required one": (
        GrammarSpec.json_schema(optional_object(1993, ("p0",))),
        GrammarSpec.json_schema(optional_object(2002, ("p0",))),
        "2,001 optional properties in a row after a required one; at most 2,000", ['{"p0": 1, "p9": 2}']),
    "anyOf branches": (
        GrammarSpec.json_schema({"anyOf": [optional_object(247), optional_object(247)]}, strict=False),
        GrammarSpec.json_schema({"anyOf": [optional_object(249), optional_object(249)]}, strict=False),
        "anyOf at the top level offers about 2,008 alternatives", ['{"p1": 1}']),
    "Lark alternatives": (GrammarSpec.grammar("start: " + alternatives("v", 1999)),
                          GrammarSpec.grammar("start: " + alternatives("v", 2000)),
                          "grammar rule start offers over 2,000 alternatives", ["v1998"]),
    "Lark rules started together": (
        GrammarSpec.grammar("start: a | b\na: " + alternatives("v", 998) + "\nb: " + alternatives("w", 998)),
        GrammarSpec.grammar("start: a | b\na: " + alternatives("v", 999) + "\nb: " + alternatives("w", 999)),
        "grammar rule start offers over 2,000", ["w7"]),
    "GBNF alternatives": (GrammarSpec.grammar("root ::= " + alternatives("v", 1999), syntax="gbnf"),
                          GrammarSpec.grammar("root ::= " + alternatives("v", 2000), syntax="gbnf"),
                          "grammar rule root offers over 2,000", ["v5"]),
}


def test_the_limit_is_llguidances_own():
    import llguidance

    assert GrammarLimits().max_items_in_row == llguidance.LLParserLimits().max_items_in_row
    assert GrammarLimits().max_choices == llguidance.LLParserLimits().max_items_in_row - 1


@pytest.mark.parametrize("shape", WIDEST)
def test_one_step_past_the_widest_constraint_that_runs_is_refused(shape):
    _, wider, words, _ = WIDEST[shape]
    with pytest.raises(GrammarError) as e:
        check_limits(wider)
    assert words in str(e.value), f"the refusal names what the request holds: {e.value}"


@pytest.mark.parametrize("shape", WIDEST)
def test_the_widest_accepted_constraint_runs_through_its_widest_rows(tokenizer, shape):
    """What the limits accept, llguidance runs: walked token by token through the rows
    where it is widest, no matcher error (the parser-state dump a row over the limit gives)."""
    import numpy as np

    from ferrox_jax.grammar import GrammarCompiler

    widest, _, _, texts = WIDEST[shape]
    check_limits(widest)
    compiler = GrammarCompiler(tokenizer, 49152, sandbox=False)
    mask = np.zeros(compiler.num_words, np.int32)
    for text in texts:
        matcher = compiler.new_matcher(widest)
        for token in tokenizer.encode(text, add_special_tokens=False):
            matcher.fill_mask(mask)
            assert matcher.accept(token) and matcher.error is None, f"{shape} {text!r}: {matcher.error}"
        matcher.fill_mask(mask)
        assert matcher.error is None, f"{shape} {text!r}: {matcher.error}"


def test_a_native_crash_in_the_compiler_is_a_grammar_error(tokenizer, monkeypatch):
    """With the limits out of the way, a 3,000-link chain really does crash llguidance: in
    the sandbox child, which the server survives; the next compile still works."""
    import ferrox_jax.grammar as grammar

    monkeypatch.setattr(grammar, "check_limits", lambda spec: None)
    compiler = grammar.GrammarCompiler(tokenizer, 49152, sandbox=True)
    with pytest.raises(GrammarError, match="grammar compiler failed on this constraint .signal SIGSEGV"):
        compiler.compile(GrammarSpec.json_schema(ref_chain(3000)))
    with pytest.raises(GrammarError, match="SIGSEGV"):
        compiler.compile(GrammarSpec.grammar(lark_chain(3000)))
    assert compiler._sandbox.num_crashes >= 2
    compiled = compiler.compile(GrammarSpec.json_schema(PROFILE_SCHEMA))
    assert compiled.new_matcher().is_accepting is False
    with pytest.raises(GrammarError, match="invalid regex"):  # the child's own errors come through
        compiler.compile(GrammarSpec.regex("(unclosed"))


def test_a_compile_past_the_timeout_is_a_grammar_error(tokenizer, monkeypatch):
    import ferrox_jax.grammar as grammar
    from ferrox_jax.grammar_sandbox import GrammarSandbox

    monkeypatch.setattr(grammar, "check_limits", lambda spec: None)
    compiler = grammar.GrammarCompiler(tokenizer, 49152, sandbox=False)
    compiler._sandbox = GrammarSandbox(tokenizer.backend.to_str(), 49152, compiler.stop_token_ids,
                                       workers=1, timeout_s=0.05)
    try:
        with pytest.raises(GrammarError, match="took longer than 0.05 s"):
            compiler.compile(GrammarSpec.choice([f"choice number {i}" for i in range(50_000)]))
    finally:
        compiler._sandbox.close()


@pytest.fixture(scope="module")
def tokenizer():
    from models.loaders.gguf import default_model_path, open_gguf
    from models.tokenizer import Tokenizer

    return Tokenizer.from_gguf(open_gguf(default_model_path()))
