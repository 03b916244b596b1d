"""GrammarSpec validation, GrammarCompiler and RowMatcher on the real default tokenizer
(SmolLM2, 49152 ids): masks, walks, stop tokens, whitespace bound, errors, cache."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from ferrox_jax.constraint import GrammarError, GrammarSpec, grammar_syntax
from ferrox_jax.grammar import ALL_TOKENS_ALLOWED, CompiledGrammar, GrammarCompiler, RowMatcher, all_ones_mask, bitmask_words

# Every string bounded, no free numbers, arrays bounded: a random walk always ends.
PROFILE_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "maxItems": 3, "items": {"enum": ["a", "b", "c"]}},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8}, "zip": {"type": "integer", "minimum": 0, "maximum": 99999}},
            "required": ["city"],
        },
        "active": {"type": "boolean"},
    },
    "required": ["name", "role", "tags", "address"],
}
MAX_WALK_TOKENS = 400


def check_profile(doc) -> None:
    """Hand validation against PROFILE_SCHEMA (jsonschema is not installed), strict mode
    (no properties beyond the schema's)."""
    assert isinstance(doc, dict), doc
    assert set(doc) <= set(PROFILE_SCHEMA["properties"]), doc
    assert set(PROFILE_SCHEMA["required"]) <= set(doc), doc
    assert isinstance(doc["name"], str) and 1 <= len(doc["name"]) <= 12, doc
    if "age" in doc:
        assert type(doc["age"]) is int and 0 <= doc["age"] <= 150, doc
    assert doc["role"] in ("admin", "user", "guest"), doc
    assert isinstance(doc["tags"], list) and len(doc["tags"]) <= 3 and set(doc["tags"]) <= {"a", "b", "c"}, doc
    address = doc["address"]
    assert isinstance(address, dict) and set(address) <= {"city", "zip"} and "city" in address, doc
    assert isinstance(address["city"], str) and len(address["city"]) <= 8, doc
    if "zip" in address:
        assert type(address["zip"]) is int and 0 <= address["zip"] <= 99999, doc
    if "active" in doc:
        assert isinstance(doc["active"], bool), doc


@pytest.fixture(scope="module")
def tokenizer():
    from models.loaders.gguf import default_model_path, open_gguf
    from models.tokenizer import Tokenizer

    return Tokenizer.from_gguf(open_gguf(default_model_path()))


@pytest.fixture(scope="module")
def compiler(tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, 49152)  # SmolLM2's logits width


@pytest.fixture(scope="module")
def profile(compiler) -> CompiledGrammar:
    return compiler.compile(GrammarSpec.json_schema(PROFILE_SCHEMA))


def allowed_ids(matcher: RowMatcher, vocab_size: int) -> np.ndarray:
    row = np.zeros(bitmask_words(vocab_size), np.int32)
    matcher.fill_mask(row)
    bits = np.unpackbits(row.view(np.uint8), bitorder="little")  # bit i of word j = id 32j+i
    return np.flatnonzero(bits[:vocab_size])


def random_walk(matcher: RowMatcher, tokenizer, seed: int, stop_ids) -> list[int]:
    """Sample uniformly among allowed tokens until the matcher finishes; returns the
    generated ids without the stop token."""
    rng = np.random.default_rng(seed)
    out: list[int] = []
    for _ in range(MAX_WALK_TOKENS):
        token = int(rng.choice(allowed_ids(matcher, 49152)))
        assert matcher.accept(token), matcher.error
        if token in stop_ids:
            break
        out.append(token)
        if matcher.is_finished:
            break
    assert matcher.is_finished, f"walk {seed} did not finish in {MAX_WALK_TOKENS} tokens: {tokenizer.decode(out)!r}"
    return out


def test_json_schema_mask_allows_open_brace_first_and_no_letters(profile, tokenizer):
    allowed = allowed_ids(profile.new_matcher(), 49152)
    texts = [tokenizer.decode([int(i)], skip_special_tokens=False) for i in allowed]
    assert texts and all(t.startswith("{") for t in texts), texts
    assert tokenizer.encode("{", add_special_tokens=False)[0] in allowed
    for word in ("hello", "The", " {"):
        assert tokenizer.encode(word, add_special_tokens=False)[0] not in allowed, word


def test_walking_a_valid_document_is_allowed_token_by_token_and_ends_finished(profile, tokenizer):
    doc = {"name": "Ada", "age": 36, "role": "admin", "tags": ["a", "c"], "address": {"city": "London"}}
    matcher = profile.new_matcher()
    for token in tokenizer.encode(json.dumps(doc, indent=2), add_special_tokens=False):
        assert token in allowed_ids(matcher, 49152), tokenizer.decode([token])
        assert not matcher.is_finished
        assert matcher.accept(token)
    assert matcher.is_finished and matcher.is_accepting, "a closed top-level object admits nothing more"
    assert set(allowed_ids(matcher, 49152)) == tokenizer.stop_token_ids, "a complete match allows only stop tokens"


def test_random_allowed_walks_always_produce_schema_valid_json(profile, tokenizer):
    for seed in range(100):
        text = tokenizer.decode(random_walk(profile.new_matcher(), tokenizer, seed, tokenizer.stop_token_ids))
        check_profile(json.loads(text))


def test_complete_but_extendable_match_allows_stop_tokens_and_finishes_on_one(compiler, tokenizer):
    matcher = compiler.compile(GrammarSpec.regex(r"[0-9]{1,4}")).new_matcher()
    assert matcher.accept(tokenizer.encode("12", add_special_tokens=False)[0])
    allowed = set(allowed_ids(matcher, 49152))
    assert tokenizer.stop_token_ids <= allowed, "stop tokens end a complete match"
    assert tokenizer.encode("3", add_special_tokens=False)[0] in allowed, "the match may still grow"
    assert not matcher.is_finished
    assert matcher.accept(tokenizer.eos_token_id)
    assert matcher.is_finished


def test_regex_walks_produce_exactly_matching_text(compiler, tokenizer):
    pattern = r"(red|green|blue)-[0-9]{2,3}( [a-z]{1,5}){0,2}"
    compiled = compiler.compile(GrammarSpec.regex(pattern))
    for seed in range(30):
        text = tokenizer.decode(random_walk(compiled.new_matcher(), tokenizer, seed, tokenizer.stop_token_ids))
        assert re.fullmatch(pattern, text), text


def test_choice_walks_produce_exactly_one_choice(compiler, tokenizer):
    choices = ("positive", "negative", "neutral", 'say "hi"\n', "😀 emoji")
    compiled = compiler.compile(GrammarSpec.choice(choices))
    seen = set()
    for seed in range(40):
        text = tokenizer.decode(random_walk(compiled.new_matcher(), tokenizer, seed, tokenizer.stop_token_ids))
        assert text in choices, text
        seen.add(text)
    assert len(seen) >= 3, f"random walks should reach several choices; got {seen}"


def test_lark_and_gbnf_grammars_constrain_output(compiler, tokenizer):
    lark = compiler.compile(GrammarSpec.grammar('start: "yes" | "no" | "maybe " NUM\nNUM: /[0-9]/'))
    gbnf = compiler.compile(GrammarSpec.grammar('root ::= "yes" | "no" | "maybe " [0-9]', syntax="gbnf"))
    for compiled in (lark, gbnf):
        for seed in range(10):
            text = tokenizer.decode(random_walk(compiled.new_matcher(), tokenizer, seed, tokenizer.stop_token_ids))
            assert re.fullmatch(r"yes|no|maybe [0-9]", text), text


def test_whitespace_between_json_tokens_is_bounded(compiler, tokenizer):
    # No free strings in this schema, so every whitespace character is between JSON tokens.
    schema = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 9}, "b": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}},
              "required": ["n", "b"]}
    whitespace_ids = [i for i in range(tokenizer.vocab_size) if (s := tokenizer.decode([i])) and not s.strip()]
    longest_run = {}
    for bound in (0, 3, 8):
        matcher = compiler.compile(GrammarSpec.json_schema(schema, max_whitespace_chars=bound)).new_matcher()
        rng, out = np.random.default_rng(bound), []
        while not matcher.is_finished and len(out) < MAX_WALK_TOKENS:
            allowed = allowed_ids(matcher, 49152)
            spaces = np.intersect1d(allowed, whitespace_ids)
            # Always take the longest whitespace token on offer: a model spinning on spaces.
            token = int(max(spaces, key=lambda i: len(tokenizer.decode([int(i)])))) if len(spaces) else int(rng.choice(allowed))
            assert matcher.accept(token)
            out.append(token)
        text = tokenizer.decode([t for t in out if t not in tokenizer.stop_token_ids])
        json.loads(text)
        longest_run[bound] = max((len(m) for m in re.findall(r"\s+", text)), default=0)
    assert longest_run[0] == 0, "max_whitespace_chars=0 is compact JSON"
    assert longest_run[3] == 3, f"runs capped at 3 (and the walk reaches the cap); got {longest_run[3]}"
    assert longest_run[8] == 8, f"runs capped at 8; got {longest_run[8]}"


def test_invalid_schema_raises_grammar_error_naming_the_problem(compiler):
    with pytest.raises(GrammarError, match="invalid JSON schema.*minLength"):
        compiler.compile(GrammarSpec.json_schema({"type": "string", "minLength": -1}))
    with pytest.raises(GrammarError, match="invalid JSON schema.*objectx"):
        compiler.compile(GrammarSpec.json_schema({"type": "objectx"}))
    with pytest.raises(GrammarError, match="must be a JSON object"):
        GrammarSpec.json_schema([{"type": "string"}])


def test_unsupported_keyword_raises_naming_it_when_strict_and_is_a_warning_otherwise(compiler):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
              "dependentRequired": {"a": ["b"]}}
    with pytest.raises(GrammarError, match="unsupported keyword.*dependentRequired"):
        compiler.compile(GrammarSpec.json_schema(schema))
    lenient = compiler.compile(GrammarSpec.json_schema(schema, strict=False))
    assert any("dependentRequired" in w for w in lenient.warnings), lenient.warnings
    overlapping = {"oneOf": [{"type": "number"}, {"type": "integer"}]}  # 1 matches both branches
    with pytest.raises(GrammarError, match="oneOf"):
        compiler.compile(GrammarSpec.json_schema(overlapping))
    compiler.compile(GrammarSpec.json_schema(overlapping, strict=False))  # approximated by anyOf


def test_invalid_regex_and_grammars_raise_grammar_error(compiler):
    with pytest.raises(GrammarError, match="(?s)invalid regex.*unclosed group"):
        compiler.compile(GrammarSpec.regex("a(b"))
    with pytest.raises(GrammarError, match="(?s)invalid lark grammar.*unknown name"):
        compiler.compile(GrammarSpec.grammar("start: foo"))
    with pytest.raises(GrammarError, match="invalid GBNF grammar.*foo"):
        compiler.compile(GrammarSpec.grammar("root ::= foo", syntax="gbnf"))


def test_spec_validation_rejects_malformed_specs():
    with pytest.raises(GrammarError, match="kind"):
        GrammarSpec("xml", "")
    with pytest.raises(GrammarError, match="non-empty"):
        GrammarSpec.choice([])
    with pytest.raises(GrammarError, match="non-empty string"):
        GrammarSpec.choice(["a", ""])
    with pytest.raises(GrammarError, match="max_whitespace_chars"):
        GrammarSpec.json_object(max_whitespace_chars=-1)
    with pytest.raises(GrammarError, match="syntax"):
        GrammarSpec.grammar('root ::= "a"', syntax="ebnf")
    with pytest.raises(GrammarError, match="not JSON"):
        GrammarSpec("json_schema", "{nope")


def test_strict_schema_forbids_extra_properties_and_lenient_allows_them(compiler, tokenizer):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    text = '{"a": 1, "zz": 2}'

    def accepts(spec: GrammarSpec) -> bool:
        matcher = compiler.compile(spec).new_matcher()
        return all(matcher.accept(t) for t in tokenizer.encode(text, add_special_tokens=False))

    assert not accepts(GrammarSpec.json_schema(schema)), "strict closes objects"
    assert accepts(GrammarSpec.json_schema(schema, strict=False)), "non-strict keeps JSON Schema's open default"


def test_json_object_accepts_any_object_but_not_other_values(compiler, tokenizer):
    compiled = compiler.compile(GrammarSpec.json_object())
    matcher = compiled.new_matcher()
    for token in tokenizer.encode('{"x": [1, {"y": null}], "z": "w"}', add_special_tokens=False):
        assert matcher.accept(token)
    assert matcher.is_finished
    assert tokenizer.encode("[", add_special_tokens=False)[0] not in allowed_ids(compiled.new_matcher(), 49152)


def test_forbidden_token_puts_the_matcher_in_a_finished_error_state(profile, tokenizer):
    matcher = profile.new_matcher()
    assert not matcher.accept(tokenizer.encode("hello", add_special_tokens=False)[0])
    assert matcher.is_finished and matcher.error and "hello" in matcher.error
    assert set(allowed_ids(matcher, 49152)) <= tokenizer.stop_token_ids, "an errored row can only stop"


def test_ids_past_the_tokenizer_vocabulary_are_never_allowed(tokenizer):
    vocab_size = tokenizer.vocab_size + 40  # wider logits, and not a multiple of 32
    compiler = GrammarCompiler(tokenizer, vocab_size)
    matcher = compiler.compile(GrammarSpec.json_object()).new_matcher()
    row = np.zeros(bitmask_words(vocab_size), np.int32)
    matcher.fill_mask(row)
    bits = np.unpackbits(row.view(np.uint8), bitorder="little")
    assert bits.size == 32 * bitmask_words(vocab_size)
    assert not bits[tokenizer.vocab_size:].any(), "extra ids and padding bits must be 0"
    assert bits[: tokenizer.vocab_size].any()
    with pytest.raises(ValueError, match="vocab_size"):
        GrammarCompiler(tokenizer, tokenizer.vocab_size - 1)


def test_fill_bitmask_fills_constrained_rows_and_sets_others_to_all_ones(compiler, profile, tokenizer):
    a, b = profile.new_matcher(), compiler.compile(GrammarSpec.choice(["yes", "no"])).new_matcher()
    bitmask = np.zeros((4, compiler.num_words), np.int32)
    compiler.fill_bitmask(bitmask, [a, None, b])
    expected_a, expected_b = np.zeros(compiler.num_words, np.int32), np.zeros(compiler.num_words, np.int32)
    a.fill_mask(expected_a)
    b.fill_mask(expected_b)
    np.testing.assert_array_equal(bitmask[0], expected_a)
    np.testing.assert_array_equal(bitmask[2], expected_b)
    np.testing.assert_array_equal(bitmask[1], all_ones_mask(49152))
    assert (bitmask[3] == ALL_TOKENS_ALLOWED).all(), "padding rows are unconstrained"
    with pytest.raises(ValueError, match="int32"):
        a.fill_mask(np.zeros(compiler.num_words, np.int64))


def test_compile_cache_returns_the_same_grammar_for_an_equal_spec(compiler):
    hits, misses, _ = compiler.cache_info()
    first = compiler.compile(GrammarSpec.json_schema({"type": "object", "properties": {"q": {"type": "string"}}}))
    second = compiler.compile(GrammarSpec.json_schema({"type": "object", "properties": {"q": {"type": "string"}}}))
    assert second is first
    assert compiler.cache_info()[:2] == (hits + 1, misses + 1)
    reordered = compiler.compile(GrammarSpec.json_schema({"properties": {"q": {"type": "string"}}, "type": "object"}))
    assert reordered is not first, "key order is part of the schema (it orders properties)"


def test_matchers_from_one_compiled_grammar_are_independent(profile, tokenizer):
    first, second = profile.new_matcher(), profile.new_matcher()
    assert first.accept(tokenizer.encode("{", add_special_tokens=False)[0])
    assert tokenizer.encode("{", add_special_tokens=False)[0] in allowed_ids(second, 49152)


@pytest.mark.parametrize("text", ['start: "a"', '  start : x\nx: "b"', '%llguidance {}\nstart: "c"', 'root ::= "a"',
                                  'x ::= "start:"', 'rule: "a"'])
def test_grammar_syntax_tells_lark_from_gbnf_as_llguidance_does(text):
    from llguidance.gbnf_to_lark import is_lark_syntax

    assert grammar_syntax(text) == ("lark" if is_lark_syntax(text) else "gbnf")
