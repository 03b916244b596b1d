"""Output-size and time limits for chat templates, which come with checkpoints and are not trusted.

jinja's sandbox keeps a template away from Python internals but not from the machine:
`{{ 'x' * 1000000000 }}` builds a gigabyte string, a loop of `ns.s = ns.s ~ ns.s` doubles
one forty times, a recursive macro never ends. `GuardedEnvironment` is the sandbox plus a
budget for each render (`render_guarded`): every string the template builds by `*`, `+`,
`%`, `~`, a filter or a method call is measured, and a repetition is measured before it
runs (`len(s) * n`), so nothing over `max_chars` is ever allocated except by a step that
at most doubles the largest string allowed; the rendered output is counted as it streams;
and a deadline is checked at every operator, attribute or item lookup, call and output
chunk. Past either limit the render raises `TemplateLimitError`, a `SecurityError` (so a
jinja `TemplateError`), which the chat template turns into a 400 naming the limit.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Callable

from jinja2.compiler import CodeGenerator, Frame
from jinja2 import nodes
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment

MAX_OUTPUT_CHARS = 16 << 20  # 16 Mi characters: a 4 MiB body's prompt with room for the template's text
MAX_RENDER_SECONDS = 10.0  # a 60,000-message conversation renders in about a second


class TemplateLimitError(SecurityError):
    """The template built a string over the size limit or ran past its time limit."""


@dataclass
class _Budget:
    max_chars: int
    deadline: float  # time.monotonic(); inf outside a render (compile-time constant folding)
    max_seconds: float

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise TemplateLimitError(f"chat template rendering took longer than {self.max_seconds:g} s")

    def size(self, n: int, what: str = "a string") -> None:
        if n > self.max_chars:
            raise TemplateLimitError(f"chat template built {what} of {n:,} characters or items; "
                                     f"the limit is {self.max_chars:,}")

    def check(self, value: Any) -> Any:
        if isinstance(value, (str, list, tuple)):
            self.size(len(value))
        return value


_NO_RENDER = _Budget(MAX_OUTPUT_CHARS, float("inf"), float("inf"))
_budget: contextvars.ContextVar[_Budget] = contextvars.ContextVar("template_budget", default=_NO_RENDER)
_PERCENT_WIDTH = re.compile(r"%[-#0 +]*(\d+)|%[-#0 +]*\d*\.(\d+)")
_NUMBER = re.compile(r"\d+")
_SIZED = (str, list, tuple)


@contextlib.contextmanager
def budget(max_chars: int, max_seconds: float) -> Iterator[_Budget]:
    """The limits of one render, for this thread / task."""
    b = _Budget(max_chars, time.monotonic() + max_seconds, max_seconds)
    token = _budget.set(b)
    try:
        yield b
    finally:
        _budget.reset(token)


class _GuardedCodeGenerator(CodeGenerator):
    """Measures the result of every `~` concatenation."""

    def visit_Concat(self, node: nodes.Concat, frame: Frame) -> None:
        self.write("environment.guard_value(")
        super().visit_Concat(node, frame)
        self.write(")")


class GuardedEnvironment(ImmutableSandboxedEnvironment):
    """The immutable sandbox with a size and time budget (see the module docstring)."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})
    code_generator_class = _GuardedCodeGenerator

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.filters = {name: guard_filter(f) for name, f in self.filters.items()}

    def guard_value(self, value: Any) -> Any:
        b = _budget.get()
        b.tick()
        return b.check(value)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        b = _budget.get()
        b.tick()
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, _SIZED) and isinstance(n, int):
                    b.size(len(seq) * max(n, 0), "a repetition")
        elif operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1:
            b.size(right * abs(left).bit_length() // 8, "a power (bytes)")
        elif operator == "%" and isinstance(left, str):
            for width, precision in _PERCENT_WIDTH.findall(left):
                b.size(int(width or precision or 0), "a %-format width")
        return b.check(super().call_binop(context, operator, left, right))

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        b = _budget.get()
        b.tick()
        target = getattr(__obj, "__wrapped__", __obj)  # the sandbox wraps str.format
        owner = getattr(target, "__self__", None)
        if isinstance(owner, _SIZED):  # str.ljust(10**9), str.zfill, ...
            for value in (*args, *kwargs.values()):
                if isinstance(value, int):
                    b.size(value, "a padded string")
            if isinstance(owner, str) and getattr(target, "__name__", "") in ("format", "format_map"):
                for width in _NUMBER.findall(owner):  # "{:>1000000000}"
                    b.size(int(width), "a format width")
        return b.check(super().call(__context, __obj, *args, **kwargs))

    def getattr(self, obj: Any, attribute: str) -> Any:
        _budget.get().tick()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        _budget.get().tick()
        return super().getitem(obj, argument)


_WIDTH_FILTERS = frozenset({"do_center", "do_indent", "do_wordwrap", "do_truncate", "do_format",
                            "do_replace", "_tojson"})


def guard_filter(f: Callable) -> Callable:
    """`f` with its result measured, and for the filters that take a width (center,
    indent, wordwrap, format, tojson's indent, ...) its int arguments measured first."""
    sizes_args = getattr(f, "__name__", "") in _WIDTH_FILTERS

    @functools.wraps(f)  # keeps jinja's pass_context / pass_eval_context marker
    def guarded(*args: Any, **kwargs: Any) -> Any:
        b = _budget.get()
        b.tick()
        if sizes_args:
            for value in (*args[1:], *kwargs.values()):
                if isinstance(value, int) and not isinstance(value, bool):
                    b.size(value, f"a {f.__name__.removeprefix('do_').strip('_')} width")
        return b.check(f(*args, **kwargs))

    return guarded


def render_guarded(template: Any, max_chars: int, max_seconds: float, **variables: Any) -> str:
    """`template.render(**variables)` within the limits; TemplateLimitError past them."""
    with budget(max_chars, max_seconds) as b:
        parts, total = [], 0
        for chunk in template.generate(**variables):
            total += len(chunk)
            b.size(total, "an output")
            b.tick()
            parts.append(chunk)
        return "".join(parts)
