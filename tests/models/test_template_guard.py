"""Chat templates within an output-size and time budget: a hostile template in a checkpoint
is a ChatTemplateError (HTTP 400) naming the limit, never a process grown to gigabytes."""

from __future__ import annotations

import resource
import time

import pytest

from models.chat_template import ChatTemplate, ChatTemplateError

MESSAGES = [{"role": "user", "content": "hi"}]


def render(source: str, **limits) -> str:
    return ChatTemplate(source, **limits).render(MESSAGES, add_generation_prompt=True, special_tokens={})


@pytest.mark.parametrize("source,words", [
    ("{{ 'x' * 1000000000 }}", "repetition of 1,000,000,000"),
    ("{{ ['x'] * 1000000000 }}", "repetition of 1,000,000,000"),
    ("{% set ns = namespace(s='xx') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
     "a string of 33,554,432"),
    ("{% set ns = namespace(s='xx') %}{% for i in range(60) %}{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s }}",
     "a string of 33,554,432"),
    ("{{ 'x'|center(1000000000) }}", "center width"),
    ("{{ 'x'|indent(1000000000, true) }}", "indent width"),
    ("{{ messages|tojson(indent=1000000000) }}", "tojson width"),
    ("{{ 'x'.ljust(1000000000) }}", "padded string"),
    ("{{ '{:>1000000000}'.format(1) }}", "limit"),
    ("{{ '%1000000000s' % 'x' }}", "%-format width"),
    ("{{ 7 ** 100000000 }}", "a power"),
    ("{% for i in range(100) %}{{ 'x' * 1000000 }}{% endfor %}", "an output of 17,000,000"),
])
def test_hostile_templates_hit_the_size_limit(source, words):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(ChatTemplateError, match="limit is 16,777,216") as e:
        render(source)
    assert words in str(e.value)
    grown_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grown_kb < 300_000, f"rendering grew the process by {grown_kb} kB"


def test_a_template_that_never_ends_hits_the_time_limit():
    start = time.monotonic()
    with pytest.raises(ChatTemplateError, match="took longer than 0.3 s"):
        render("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", max_seconds=0.3)
    assert time.monotonic() - start < 3


def test_a_recursive_macro_is_a_template_error():
    with pytest.raises(ChatTemplateError, match="recursed too deep"):
        render("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}")


def test_ordinary_templates_render_as_before():
    source = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] | trim }}{{ '\n' * 2 }}{% endfor %}"
              "{{ ('=' * 3) ~ ' %s ' % 'end' ~ ('ab' | center(6)) }}{{ messages | tojson(indent=2) | length > 0 }}")
    assert render(source) == "<|user|>hi\n\n=== end   ab  True"
    with pytest.raises(ChatTemplateError, match="limit is 10"):
        render("{{ 'x' * 11 }}", max_output_chars=10)
