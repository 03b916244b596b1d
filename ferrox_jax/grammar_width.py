"""How wide a constraint is at its widest point: the parser items llguidance holds there.

llguidance's Earley parser keeps, for each token position, a row of items: one for each
alternative that may continue the text from there. A row over `max_items_in_row`
(`LLParserLimits`) fails the request at that token, with a parser-state dump, however
well the constraint compiled. `ferrox_jax/grammar_limits.py` refuses such constraints
up front with the estimates here, made in plain Python from the constraint's source.
Every estimate is on the high side of the rows llguidance 1.9 was measured to build (the
numbers below; a literal, an `enum`, a `const` or an uppercase Lark terminal is one
lexeme, matched by the lexer, and takes no items of its own):

    guided_choice of n strings                      n + 1
    JSON object, n optional properties, closed      4n - 1    (open: 4n + 7)
    the same, then a required one                   3n + 1
    JSON object, required properties only           1
    after a required property, n optional next      n         (open: n + 5)
    anyOf / oneOf / allOf                           the sum of its branches
    Lark rule of n alternatives                     n + 1, plus the alternatives of the
                                                    rules its alternatives start with
"""

from __future__ import annotations

import re
from typing import Any, Callable, Iterator

# A JSON object's row of keys. Optional properties before the first required one may
# each come first, alone or after one another: about 4 items each (3 when a required one
# follows). After a required property, each optional one that may come next takes 1.
# Up to 8 more where keys other than the named ones are allowed (an open object, or
# patternProperties, plus 1 per pattern). Measured: 100 optional properties make 399 items
# closed and 407 open; 498 open make 1,999, 500 closed 1,999; a required property then
# 1,990 optional ones 1,990 closed, 1,995 open.
ITEMS_PER_LEADING_OPTIONAL = 4
OPEN_OBJECT_ITEMS = 8
_ALTERNATIVES = ("anyOf", "oneOf", "allOf")


def optional_runs(node: dict) -> tuple[int, int]:
    """(optional properties before the first required one, the longest run of optional
    ones after a required one), in `properties` order."""
    props = node.get("properties")
    required = node.get("required")
    required = set(required) if isinstance(required, list) else set()
    leading, run, later, seen_required = 0, 0, 0, False
    for name in props if isinstance(props, dict) else ():
        if name in required:
            seen_required, run = True, 0
        elif seen_required:
            run += 1
            later = max(later, run)
        else:
            leading += 1
    return leading, later


def _is_object(node: dict) -> bool:
    kind = node.get("type")
    return ("properties" in node or "patternProperties" in node or kind == "object"
            or (isinstance(kind, list) and "object" in kind))


def open_items(node: dict, strict: bool) -> int:
    """The items of an object's keys other than its named properties: 0 when closed."""
    patterns = node.get("patternProperties")
    num_patterns = len(patterns) if isinstance(patterns, dict) else 0
    additional = node.get("additionalProperties")
    # strict closes an object that says nothing (ferrox_jax/grammar.py); best effort leaves it open.
    is_open = additional is not False and not (strict and additional is None)
    return OPEN_OBJECT_ITEMS + num_patterns if is_open or num_patterns else 0


def object_row(node: dict, strict: bool) -> int:
    """Items in the row of an object's keys (the table in the module docstring); 0 for a
    node that is not an object."""
    if not _is_object(node):
        return 0
    leading, later = optional_runs(node)
    return max(ITEMS_PER_LEADING_OPTIONAL * leading, later, 1) + open_items(node, strict)


class SchemaWidths:
    """Items a schema node puts in the row where its value starts: its own object row,
    plus the rows of its branches and of what its `$ref` points at (memoized per node;
    walked with an explicit stack, so a 3,000-link `$ref` chain cannot overflow it)."""

    def __init__(self, resolve: Callable[[str], Any], strict: bool) -> None:
        self._resolve, self._strict = resolve, strict
        self._memo: dict[int, int] = {}

    def _parts(self, node: dict) -> list[Any]:
        """The schemas whose rows start where `node`'s does: its branches and its `$ref`."""
        parts = [b for keyword in _ALTERNATIVES if isinstance(node.get(keyword), list) for b in node[keyword]]
        ref = node.get("$ref")
        if isinstance(ref, str):
            parts.append(self._resolve(ref))
        return parts

    def of(self, node: Any) -> int:
        if not isinstance(node, dict):
            return 1
        on_path: set[int] = set()  # nodes whose parts are being summed (a depth-first path)
        stack: list[tuple[dict, bool]] = [(node, False)]
        while stack:
            current, parts_done = stack.pop()
            key = id(current)
            if key in self._memo:
                continue
            if not parts_done:
                on_path.add(key)
                stack.append((current, True))
                stack.extend((p, False) for p in self._parts(current)
                             if isinstance(p, dict) and id(p) not in on_path and id(p) not in self._memo)
                continue
            # A part still on the path is a recursive $ref: its items are counted where the loop began.
            width = object_row(current, self._strict) + sum(
                self._memo.get(id(p), 0) if isinstance(p, dict) else 1 for p in self._parts(current))
            self._memo[key] = max(width, 1)
            on_path.discard(key)
        return self._memo[id(node)]


# ---------------------------------------------------------------- Lark / GBNF rules


# Names, lexemes (already `\x00`), alternatives and groups (Lark's optional `[...]` too).
_TOKENS = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*|\x00|[()|\[\]]")


def rule_widths(bodies: dict[str, str], literals: re.Pattern, syntax: str,
                limit: int) -> Iterator[tuple[str, int]]:
    """(rule or group, items at its widest point) for each rule and parenthesised group,
    stopping a sum once it passes `limit` (so a wide grammar costs at most `limit` steps
    per rule).

    Args:
      bodies: rule name -> the text of its alternatives.
      literals: what the rules' literals, regexes, GBNF classes and comments look like
        (a lexeme: one symbol, no items of its own; a comment, `#` or `//`: nothing).
      syntax: "lark" (uppercase names are terminals, lexemes too) or "gbnf".
    """
    own: dict[str, int] = {}
    leads: dict[str, set[str]] = {}
    groups: list[tuple[str, int, set[str]]] = []
    for name, body in bodies.items():
        text = literals.sub(lambda m: " " if m.group(0).startswith(("#", "//")) else " \x00 ", body)
        alternatives, lead_names, inner = _alternatives(text)
        own[name], leads[name] = alternatives, lead_names
        groups.extend((f"{name} (a group)", n, g) for n, g in inner)

    def is_rule(symbol: str) -> bool:
        return symbol in own and (syntax == "gbnf" or not symbol[0].isupper())

    def width(alternatives: int, first: set[str]) -> int:
        total, seen, stack = alternatives + 1, set(), [s for s in first if is_rule(s)]
        while stack and total <= limit:
            rule = stack.pop()
            if rule in seen:
                continue
            seen.add(rule)
            total += own[rule]
            stack.extend(s for s in leads[rule] if is_rule(s) and s not in seen)
        return total

    for name in own:
        if is_rule(name):
            yield name, width(own[name], leads[name])
    for name, alternatives, first in groups:
        yield name, width(alternatives, first)


def _alternatives(text: str) -> tuple[int, set[str], list[tuple[int, set[str]]]]:
    """(alternatives, names they start with, and the same for each group inside) of one
    rule body whose lexemes are already `\\x00`. A group that starts an alternative adds
    its alternatives and first names to the enclosing ones (they are predicted together)."""
    # Each open group: [alternatives, first names, at the start of an alternative].
    stack: list[list[Any]] = [[1, set(), True]]
    inner: list[tuple[int, set[str]]] = []
    for token in _TOKENS.findall(text):
        top = stack[-1]
        if token == "|":
            top[0], top[2] = top[0] + 1, True
        elif token in "([":
            stack.append([1, set(), True])
        elif token in ")]" and len(stack) > 1:
            alternatives, first, _ = stack.pop()
            inner.append((alternatives, first))
            parent = stack[-1]
            if parent[2]:
                parent[0] += alternatives
                parent[1] |= first
            parent[2] = False
        else:  # a name or a lexeme
            if top[2] and token != "\x00":
                top[1].add(token)
            top[2] = False
    alternatives, first, _ = stack[0]
    return alternatives, first, inner
