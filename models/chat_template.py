"""Chat templates: the checkpoint's jinja2 template, rendered in a sandbox as transformers does.

`ChatTemplate(source)` compiles once and renders `messages` with the variables HF
templates expect. The environment is transformers' (`trim_blocks`, `lstrip_blocks`,
`loopcontrols`, a non-escaping `tojson`, `raise_exception`, `strftime_now`, `namespace`),
made immutable and sandboxed: templates come with checkpoints and are not trusted, so
they see plain JSON data only and cannot reach Python internals, and each render has an
output-size and time budget (`models/template_guard.py`: `{{ 'x' * 1000000000 }}` is
refused before it allocates). Every failure (does not compile, `raise_exception`, a
sandbox violation, a limit, an error while rendering) is a `ChatTemplateError`, which the
API answers with a 400 naming the reason.
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from typing import Any, Mapping

import jinja2
import jinja2.ext

from models.template_guard import MAX_OUTPUT_CHARS, MAX_RENDER_SECONDS, GuardedEnvironment, guard_filter, render_guarded

# Used when a checkpoint has no chat template: "role: content" paragraphs, then an open
# "assistant:" turn when a generation prompt is asked for. Plain text on purpose, so it
# works for any vocabulary (base models have no chat tokens).
FALLBACK_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}\n\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)

class ChatTemplateError(ValueError):
    """The chat template failed to compile or render (including sandbox violations)."""


class ChatTemplate:
    """One compiled chat template (the checkpoint's, or FALLBACK_CHAT_TEMPLATE when None)."""

    def __init__(self, source: str | None, *, max_output_chars: int = MAX_OUTPUT_CHARS,
                 max_seconds: float = MAX_RENDER_SECONDS) -> None:
        self.source = source
        self.max_output_chars = max_output_chars  # any string the template builds, and its output
        self.max_seconds = max_seconds  # one render's wall time
        try:
            self._template = _chat_environment().from_string(source if source is not None else FALLBACK_CHAT_TEMPLATE)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template does not compile: {e}") from e

    def render(self, messages: list[dict], *, add_generation_prompt: bool, special_tokens: Mapping[str, str],
               tools: list[dict] | None = None, extra: Mapping[str, Any] | None = None) -> str:
        """The prompt text for `messages` (keys whose value is None dropped, as transformers
        does), `add_generation_prompt`, `tools` (None: the template's no-tools branch),
        `documents=None` and the special token strings (`bos_token`, `eos_token`, ...).
        `extra` are further template variables (a request's `chat_template_kwargs`, e.g.
        `enable_thinking`); they never replace the names above.

        Raises:
          ChatTemplateError: the template raised, broke the sandbox or failed while rendering.
        """
        if not all(isinstance(m, Mapping) for m in messages):
            raise ChatTemplateError("chat messages must be dicts with 'role' and 'content'")
        clean = [_plain_data({k: v for k, v in m.items() if v is not None}) for m in messages]
        try:
            variables = {**_plain_data(dict(extra or {})), **special_tokens, "messages": clean,
                         "add_generation_prompt": add_generation_prompt, "tools": _plain_data(tools),
                         "documents": None}
            return render_guarded(self._template, self.max_output_chars, self.max_seconds, **variables)
        except jinja2.exceptions.SecurityError as e:
            raise ChatTemplateError(f"chat template failed: it tried an operation the template sandbox forbids "
                                    f"({e})") from e
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template failed: {e}") from e
        except RecursionError:
            raise ChatTemplateError("chat template failed: it recursed too deep") from None
        except MemoryError:
            raise ChatTemplateError("chat template failed: out of memory while rendering") from None
        except (TypeError, ValueError, KeyError, IndexError, AttributeError, ZeroDivisionError, OverflowError) as e:
            raise ChatTemplateError(f"chat template failed while rendering: {e}") from e


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # As transformers: jinja's own tojson HTML-escapes, which would corrupt tool schemas.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _TemplateNamespace(jinja2.utils.Namespace):
    """`namespace()` that refuses underscore attributes, closing a route to CPython internals."""

    def __init__(*args, **kwargs):  # same signature trick as jinja's Namespace
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set underscore attribute {name!r}")


def _chat_environment() -> GuardedEnvironment:
    """The environment transformers renders chat templates in (minus its generation tracker),
    with an output-size and time budget per render (models/template_guard.py)."""
    env = GuardedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = guard_filter(_tojson)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _TemplateNamespace
    return env


def _plain_data(value: Any) -> Any:
    """Rebuild messages out of plain JSON types so the template sees no object's methods."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, Mapping):
        return {str(k): _plain_data(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain_data(v) for v in value]
    # Subclasses (str enums, numpy scalars' kin) carry extra methods: strip to the base type.
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    return f"<{type(value).__name__}>"


def hf_chat_template(path: str, config: dict) -> str | None:
    """The chat template of an HF folder: `chat_template.jinja` wins over the tokenizer
    config's `chat_template` (as in transformers); a list of named templates uses "default"."""
    jinja_file = os.path.join(path, "chat_template.jinja")
    if os.path.isfile(jinja_file):
        with open(jinja_file, encoding="utf-8") as f:
            return f.read()
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None
