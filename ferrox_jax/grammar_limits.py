"""Size and shape limits a constraint must meet before the native grammar compiler sees it.

llguidance compiles recursively: a JSON schema whose `$defs` form a long chain of `$ref`s
(3,000 links, about 200 KB), or a Lark grammar of 3,000 rules each naming the next,
overflows the compiling thread's native stack and the process dies with SIGSEGV. Nested
counted repetitions (`(a{1000}){1000}`) and very long choice lists expand into automata
that take seconds and hundreds of MB to build, and fail with a parser-state dump instead
of a reason. `check_limits(spec)` measures a `GrammarSpec` in plain Python (llguidance
only gives its limits; iteratively, so it cannot overflow itself) and raises `GrammarError` naming
the limit and the measured value; the API answers it with a 400. The limits sit far above
what real schemas and grammars use (depth 10-40, a few hundred rules) and far below where
the compiler breaks (a chain of 2,000 links compiles, 3,000 crashes).

A second kind of limit is hit only while generating, not while compiling: llguidance's
Earley parser holds at most `max_items_in_row` items (its `LLParserLimits`, 2,000 in the
installed version, read from the package below) at one token position, and a row over it
fails at the first token with a parser-state dump. Each alternative that may come next
is an item: a choice list takes one per choice (2,000 choices fail, 1,999 run); a JSON
object whose optional properties may come in any subset takes about 4 per optional
property that may come first (499 optional properties fail, 498 run; 500 in a closed
object); the branches of an
`anyOf` add up; a Lark rule takes one per alternative, plus those of the rules its
alternatives start with. `check_limits` estimates that width from the constraint
(`ferrox_jax/grammar_width.py`, on the high side of what llguidance was measured to
build) and refuses one over the limit with a message about what the request holds
(choices, properties, alternatives), so a constraint that compiles also runs.

Compilation itself then runs in a child process (`ferrox_jax/grammar_sandbox.py`), so a
crash the limits do not foresee costs one request, not the server.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Iterator

import llguidance  # its parser limits only: nothing here compiles

from ferrox_jax.constraint import GrammarError, GrammarSpec
from ferrox_jax.grammar_width import (ITEMS_PER_LEADING_OPTIONAL, SchemaWidths, object_row, open_items,
                                      optional_runs, rule_widths)

# The limits every matcher runs under (`ferrox_jax/grammar.py` passes them): llguidance's
# defaults, except that an error met while generating says what failed without a dump of
# the parser's state and the grammar (`verbose_errors`).
PARSER_LIMITS = llguidance.LLParserLimits(verbose_errors=False)
# Parser items a choice list puts in one row besides its choices (measured: n choices
# make a row of n + 1 once the first token is consumed).
CHOICE_ROW_ITEMS = 1


@dataclass(frozen=True)
class GrammarLimits:
    """The bounds `check_limits` enforces (the defaults are the server's)."""

    max_source_bytes: int = 1 << 20  # schema JSON / regex / grammar text, UTF-8
    max_depth: int = 256  # schema nesting plus $ref hops; grammar rule-reference chain
    max_definitions: int = 2_000  # $defs + definitions entries; grammar rules
    max_repeat_product: int = 10_000  # product of nested counted repetitions in one regex
    max_choice_bytes: int = 256 << 10  # all guided_choice entries together, UTF-8
    max_length_bound: int = 100_000  # minLength/maxLength/minItems/... numbers in a schema
    # llguidance's parser items at one token position (`LLParserLimits.max_items_in_row`):
    # what a constraint's widest point (choices, optional properties, alternatives) may take.
    max_items_in_row: int = PARSER_LIMITS.max_items_in_row

    @property
    def max_choices(self) -> int:
        """guided_choice entries: one parser item each, besides the rule's own."""
        return self.max_items_in_row - CHOICE_ROW_ITEMS


DEFAULT_LIMITS = GrammarLimits()

_DEFINITION_MAPS = ("$defs", "definitions")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "dependentSchemas")
_DATA_KEYS = ("const", "enum", "default", "examples", "description", "title", "$comment")
_LENGTH_KEYS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties",
                "minContains", "maxContains")


def check_limits(spec: GrammarSpec, limits: GrammarLimits = DEFAULT_LIMITS) -> None:
    """Raise GrammarError naming the first limit `spec` exceeds; return None when it fits."""
    if spec.kind == "choice":
        _check_choices(spec.source, limits)
        return
    size = len(spec.source.encode("utf-8"))
    if size > limits.max_source_bytes:
        raise GrammarError(f"{_what(spec)} is {size} bytes; the limit is {limits.max_source_bytes}")
    if spec.kind == "json_schema":
        _check_schema(json.loads(spec.source), limits, spec.strict)
    elif spec.kind == "regex":
        check_regex(spec.source, limits, "regex")
    elif spec.kind == "grammar":
        _check_grammar_rules(spec.source, limits, spec.syntax)


def _what(spec: GrammarSpec) -> str:
    return {"json_schema": "JSON schema", "json_object": "JSON object constraint", "regex": "regex",
            "choice": "choice", "grammar": f"{spec.syntax} grammar"}[spec.kind]


def _check_choices(choices: tuple[str, ...], limits: GrammarLimits) -> None:
    if len(choices) > limits.max_choices:
        raise GrammarError(f"{len(choices):,} choices; at most {limits.max_choices:,} can be enforced (the grammar "
                           f"engine's limit is {limits.max_items_in_row:,} alternatives at one point, one per choice "
                           "and one of its own): send fewer, or the same list as a regex alternation (guided_regex)")
    size = sum(len(c.encode("utf-8")) for c in choices)
    if size > limits.max_choice_bytes:
        raise GrammarError(f"choice entries total {size} bytes; the limit is {limits.max_choice_bytes}")


# ---------------------------------------------------------------- JSON schema


def _subschemas(schema: Any, path: str) -> Iterator[tuple[Any, str]]:
    """The direct subschemas of a schema node (dict or list) with their JSON pointers, data
    keywords and the definition maps (`$defs`, `definitions`: reached through `$ref`) skipped."""
    if isinstance(schema, list):
        yield from ((child, f"{path}/{i}") for i, child in enumerate(schema))
        return
    if not isinstance(schema, dict):
        return
    for key, value in schema.items():
        if key in _DATA_KEYS or key in _DEFINITION_MAPS:
            continue
        if key in _SUBSCHEMA_MAPS and isinstance(value, dict):
            yield from ((child, f"{path}/{key}/{name}") for name, child in value.items())
        elif isinstance(value, (dict, list)):
            yield value, f"{path}/{key}"


def _resolve(root: dict, ref: str) -> Any:
    """The schema a local `$ref` ("#/$defs/name", "#/definitions/a/b", "#") points at, or None."""
    if not ref.startswith("#"):
        return None
    node: Any = root
    for part in filter(None, ref[1:].split("/")):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _check_schema(root: Any, limits: GrammarLimits, strict: bool = True) -> None:
    """Definition count, numeric bounds, patterns, the width of each point (optional
    properties, branches: `ferrox_jax/grammar_width.py`), and the depth a recursive
    compiler reaches: nesting plus `$ref` hops into schemas not entered yet (a depth-first
    walk that, like the compiler, does not re-enter a schema already being or been compiled)."""
    if isinstance(root, dict):
        count = sum(len(root[k]) for k in ("$defs", "definitions") if isinstance(root.get(k), dict))
        if count > limits.max_definitions:
            raise GrammarError(f"JSON schema has {count} $defs/definitions; the limit is {limits.max_definitions}")
    widths = SchemaWidths(lambda ref: _resolve(root, ref), strict)
    entered: set[int] = set()
    stack: list[tuple[Any, int, str]] = [(root, 1, "")]
    while stack:
        node, depth, path = stack.pop()
        if id(node) in entered:
            continue
        entered.add(id(node))
        if depth > limits.max_depth:
            raise GrammarError(f"JSON schema nests (counting $ref hops) deeper than the limit of "
                               f"{limits.max_depth} levels")
        if not isinstance(node, (dict, list)):
            continue
        if isinstance(node, dict):
            _check_schema_keywords(node, limits)
            _check_schema_width(node, path, widths, limits, strict)
            # Definitions go to the bottom of the stack: reached through a $ref first (as
            # the compiler reaches them), at their real depth; unreferenced ones still checked.
            for key in _DEFINITION_MAPS:
                if isinstance(node.get(key), dict):
                    stack.extend((child, depth + 1, f"{path}/{key}/{name}") for name, child in node[key].items())
        stack.extend((child, depth + 1, child_path) for child, child_path in _subschemas(node, path))
        ref = node.get("$ref") if isinstance(node, dict) else None
        target = _resolve(root, ref) if isinstance(ref, str) else None
        if target is not None:
            stack.append((target, depth + 1, ref[1:]))


def _check_schema_width(node: dict, path: str, widths: SchemaWidths, limits: GrammarLimits,
                        strict: bool) -> None:
    """GrammarError when the row where `node`'s value starts would hold more parser items
    than llguidance follows, in words about the schema: the object's optional properties,
    or the branches that add up."""
    if widths.of(node) <= limits.max_items_in_row:
        return
    where = f"at {path}" if path else "at the top level"
    engine = f"the grammar engine's limit is {limits.max_items_in_row:,} alternatives at one point"
    if object_row(node, strict) > limits.max_items_in_row:
        leading, later = optional_runs(node)
        room = limits.max_items_in_row - open_items(node, strict)
        if ITEMS_PER_LEADING_OPTIONAL * leading >= later:
            raise GrammarError(
                f"JSON schema object {where} has {leading:,} optional properties before its first required one "
                f"(any of them may come first); at most {room // ITEMS_PER_LEADING_OPTIONAL:,} can be enforced "
                f"({engine}, about {ITEMS_PER_LEADING_OPTIONAL} per such property): mark some of them required, "
                "or group them into nested objects")
        raise GrammarError(
            f"JSON schema object {where} has {later:,} optional properties in a row after a required one; at "
            f"most {room:,} can be enforced ({engine}): mark some of them required, or group them into "
            "nested objects")
    keywords = [k for k in ("anyOf", "oneOf", "allOf", "$ref") if k in node]
    raise GrammarError(
        f"JSON schema {'/'.join(keywords) or 'node'} {where} offers about {widths.of(node):,} alternatives at one "
        f"point (its branches add up, an object branch about {ITEMS_PER_LEADING_OPTIONAL} per optional property); "
        f"{engine}: use fewer branches, or fewer optional properties in them")


def _check_schema_keywords(node: dict, limits: GrammarLimits) -> None:
    for key in _LENGTH_KEYS:
        value = node.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > limits.max_length_bound:
            raise GrammarError(f"JSON schema {key} {value} is over the limit {limits.max_length_bound}")
    pattern = node.get("pattern")
    if isinstance(pattern, str):
        check_regex(pattern, limits, "JSON schema pattern")
    props = node.get("patternProperties")
    if isinstance(props, dict):
        for key in props:
            check_regex(key, limits, "JSON schema patternProperties key")


# ---------------------------------------------------------------- regex


_COUNTED = re.compile(r"\{(\d*)(?:(,)(\d*))?\}")


def check_regex(pattern: str, limits: GrammarLimits = DEFAULT_LIMITS, what: str = "regex") -> None:
    """GrammarError when nested counted repetitions multiply past the limit: `(a{1000}){1000}`
    asks the compiler for a million states. Each group's largest bound multiplies the bounds
    of the repetitions around it (an unbounded `{n,}` counts as n, `*` / `+` as 1)."""
    product = _repeat_product(pattern)
    if product > limits.max_repeat_product:
        raise GrammarError(f"{what} repeats {product:,} times through nested counted repetitions "
                           f"({{n}} inside {{m}}); the limit is {limits.max_repeat_product:,}")


def _repeat_product(pattern: str) -> int:
    """The largest product of counted-repetition bounds along any nesting path."""
    # Each open group: the largest product found inside it so far.
    groups: list[int] = [1]
    last_atom = 1  # the product of the atom just closed (a group or a single atom)
    worst = 1
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "\\":
            i, last_atom = i + 2, 1
            continue
        if c == "[":
            i, last_atom = _skip_class(pattern, i), 1
            continue
        if c == "(":
            groups.append(1)
            i += 1
            continue
        if c == ")" and len(groups) > 1:
            last_atom = groups.pop()
            groups[-1] = max(groups[-1], last_atom)
            i += 1
            continue
        if c == "{":
            match = _COUNTED.match(pattern, i)
            if match and (match.group(1) or match.group(3)):
                low, high = match.group(1), match.group(3)
                bound = int(high) if match.group(2) and high else int(low or 0)
                if match.group(2) and not high:
                    bound = int(low or 0)
                last_atom = last_atom * max(bound, 1)
                groups[-1] = max(groups[-1], last_atom)
                worst = max(worst, last_atom)
                i = match.end()
                continue
        last_atom = 1
        i += 1
    return max([worst, *groups])


def _skip_class(pattern: str, i: int) -> int:
    """The index after the character class opening at `pattern[i]` ("[...]")."""
    j = i + 1
    if j < len(pattern) and pattern[j] == "^":
        j += 1
    if j < len(pattern) and pattern[j] == "]":
        j += 1
    while j < len(pattern) and pattern[j] != "]":
        j += 2 if pattern[j] == "\\" else 1
    return j + 1


# ---------------------------------------------------------------- Lark / GBNF rules


_RULE_HEAD = re.compile(r"^\s*[?!]?([A-Za-z_][A-Za-z0-9_.-]*?)(?:\.-?\d+)?\s*(::=|:)(?!:)", re.M)
_LITERALS = re.compile(r'"(?:[^"\\\n]|\\.)*"|/(?:[^/\\\n]|\\.)+/[imslux]*|\[(?:[^\]\\\n]|\\.)*\]|#[^\n]*')
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*")
# Lark's lexemes and comments: `[...]` is an optional group there, not a character class.
_LARK_LITERALS = re.compile(r'"(?:[^"\\\n]|\\.)*"i?|/(?:[^/\\\n]|\\.)+/[imslux]*|//[^\n]*|#[^\n]*')


def _check_grammar_rules(text: str, limits: GrammarLimits, syntax: str = "lark") -> None:
    """Rule count, the longest chain of rules each referencing the next, the regexes and
    `{n,m}` repetitions in the rules (the same product bound as a regex), and the
    alternatives a rule offers at one point (`ferrox_jax/grammar_width.py`)."""
    heads = list(_RULE_HEAD.finditer(text))
    if len(heads) > limits.max_definitions:
        raise GrammarError(f"grammar has {len(heads)} rules; the limit is {limits.max_definitions}")
    bodies: dict[str, str] = {}
    for k, head in enumerate(heads):
        end = heads[k + 1].start() if k + 1 < len(heads) else len(text)
        bodies[head.group(1)] = bodies.get(head.group(1), "") + " " + text[head.end():end]
    for body in bodies.values():
        for literal in re.finditer(r"/(?:[^/\\\n]|\\.)+/", body):
            check_regex(literal.group(0)[1:-1], limits, "grammar regex")
        stripped = _LITERALS.sub(" ", body)
        check_regex(stripped, limits, "grammar rule")
    refs = {name: {m.group(0) for m in _NAME.finditer(_LITERALS.sub(" ", body))} & bodies.keys()
            for name, body in bodies.items()}
    start = "start" if "start" in refs else ("root" if "root" in refs else next(iter(refs), None))
    if start is not None and _chain_depth(refs, start) > limits.max_depth:
        raise GrammarError(f"grammar rules reference each other (a rule naming the next) deeper than the "
                           f"limit of {limits.max_depth} levels")
    literals = _LITERALS if syntax == "gbnf" else _LARK_LITERALS
    for name, width in rule_widths(bodies, literals, syntax, limits.max_items_in_row):
        if width > limits.max_items_in_row:
            terminal = " or, in Lark, a list of literals as a terminal (an uppercase rule: one lexeme)" \
                if syntax == "lark" else ""
            raise GrammarError(
                f"grammar rule {name} offers over {limits.max_items_in_row:,} alternatives at one point (its own "
                "and those of the rules they start with), past the grammar engine's limit of "
                f"{limits.max_items_in_row:,}: use fewer alternatives{terminal}")


def _chain_depth(refs: dict[str, set[str]], start: str) -> int:
    """The deepest a depth-first walk from `start` goes, entering each rule once."""
    entered = {start}
    stack: list[tuple[str, Iterator[str]]] = [(start, iter(sorted(refs[start])))]
    deepest = 1
    while stack:
        _, children = stack[-1]
        child = next(children, None)
        if child is None:
            stack.pop()
            continue
        if child not in entered:
            entered.add(child)
            stack.append((child, iter(sorted(refs[child]))))
            deepest = max(deepest, len(stack))
    return deepest
