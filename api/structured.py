"""Structured output, tool calls and thinking sections, for every wire protocol.

The protocol-neutral half of the feature (the OpenAI adapter is its first user; other
adapters render the same pieces in their own shapes). An adapter parses its request into
an optional constraint (`json_schema_constraint`, `regex_constraint`, ...) and an optional
`ToolRequest` (`tool_request`), then `prepare_chat` renders the prompt and says what the
output needs (`OutputPlan`); `check_grammar` has the engine compile the plan's constraint
(off the event loop) before it becomes the job's `Job.grammar`. Each choice's text then goes through the plan's
`OutputParser`:

    RowEvent.text ──▶ thinking split (api/reasoning.py) ──▶ tool-call parser (api/tool_call_parser.py)
                        │ reasoning text                      │ content text     │ calls
                        ▼                                     ▼                  ▼
    deltas: {"reasoning_content": str}            {"content": str}    {"tool_calls": [{index, id,
                                                                        type, function: {name, arguments}}]}

Deltas are plain dicts in that shape (OpenAI's `choices[].delta` fields); a whole reply is
the same parser fed once (`parse_output`), so both agree exactly. A reply with calls that
ended normally finishes with "tool_calls".

Rules, in the order they apply:
  * constraints: at most one per request; a server-wide default (`--grammar`,
    `--grammar-file`, `--json-schema`) applies when a request gives none, asks for no
    plain `text` and forces no tool call;
  * tools: `tool_choice` "none" renders no tools and parses no calls; "auto" (the default
    when tools are given) renders them and parses calls in the template's format;
    "required" or a named function also forces the call with a grammar, always in the
    plain `json` format (`api/tool_calls.py:tool_call_grammar`), so it parses and its
    arguments validate against the tool's parameters;
  * tools are rendered by the chat template when it uses `tools`, else described in the
    system message (`TOOLS_PROMPT`); history messages carrying `tool_calls` are given to
    such a template with parsed arguments, and written as the `json` call text otherwise;
  * thinking sections are split when the template has `<think>`, unless a grammar
    constrains the output (the constrained text is the answer, not reasoning) or the
    request asks for them in the text (`split_reasoning=False`: Anthropic's
    `thinking: {"type": "disabled"}`);
  * a harmony template (gpt-oss: `api/harmony.py`) is parsed by channel instead, under
    the same conditions: analysis is reasoning, final content, `to=functions.NAME`
    bodies tool calls (when the request has tools).

Adapters whose replies are lists of blocks (Anthropic content blocks, Responses output
items) fold the parser's deltas into ordered blocks with `api/output_blocks.py`.
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import TYPE_CHECKING, Any, Sequence

from quart import g, has_request_context

from api.errors import APIError
from api.harmony import HarmonyStreamParser, is_harmony_template
from api.offload import run_cpu
from api.reasoning import THINK_START, ReasoningStreamParser, prompt_opens_reasoning
from api.tool_call_parser import ToolCall, ToolCallStreamParser, detect_tool_call_format
from api.tool_calls import (ToolDefinitionError, ToolSpec, add_tools_to_messages, template_renders_tools,
                            tool_call_grammar, validate_tools)
from ferrox_jax.constraint import GrammarError, GrammarSpec, grammar_syntax

if TYPE_CHECKING:  # the facade's module imports jax; only its type is needed here
    from ferrox_jax.engine import Engine

# What a request may say about its output besides a constraint: plain text, which also
# opts out of the server-wide default constraint.
PLAIN_TEXT = "text"
# Whitespace between JSON tokens of a forced call: one character, the one-line style calls
# are written in (`{"name": "f", "arguments": {"a": 1}}`); a small model is not left to
# pad a call with runs of blank lines.
TOOL_CALL_MAX_WHITESPACE_CHARS = 1


# ---------------------------------------------------------------- constraints


def json_schema_constraint(schema: Any, *, strict: bool, param: str) -> GrammarSpec:
    """A JSON-schema constraint; 400 naming `param` when the schema is not a JSON object."""
    if not isinstance(schema, dict):
        raise APIError(400, f"{param} must be a JSON schema object; got {type(schema).__name__}", param=param)
    try:
        return GrammarSpec.json_schema(schema, strict=strict)
    except GrammarError as e:
        raise APIError(400, f"{param}: {e}", param=param, code="invalid_grammar") from None


def json_object_constraint() -> GrammarSpec:
    return GrammarSpec.json_object()


def regex_constraint(pattern: Any, *, param: str) -> GrammarSpec:
    if not isinstance(pattern, str):
        raise APIError(400, f"{param} must be a string", param=param)
    return _spec(lambda: GrammarSpec.regex(pattern), param)


def choice_constraint(choices: Any, *, param: str) -> GrammarSpec:
    if not isinstance(choices, list) or not all(isinstance(c, str) for c in choices):
        raise APIError(400, f"{param} must be a list of strings", param=param)
    return _spec(lambda: GrammarSpec.choice(choices), param)


def grammar_constraint(text: Any, *, param: str) -> GrammarSpec:
    """A Lark or GBNF grammar (told apart by their rule syntax: GBNF's `::=`)."""
    if not isinstance(text, str):
        raise APIError(400, f"{param} must be a string", param=param)
    return _spec(lambda: GrammarSpec.grammar(text, syntax=grammar_syntax(text)), param)


def _spec(build, param: str) -> GrammarSpec:
    try:
        return build()
    except GrammarError as e:
        raise APIError(400, f"{param}: {e}", param=param, code="invalid_grammar") from None


async def check_grammar(engine: Engine, spec: GrammarSpec | None, param: str) -> GrammarSpec | None:
    """`spec` once the engine has compiled it (None for None), off the event loop (about a
    millisecond cold; cached by spec), ready for `Job.grammar`. A constraint
    the engine cannot compile or enforce is a 400 naming `param` and the problem (e.g. the
    unsupported keyword)."""
    if spec is None:
        return None
    started = time.monotonic()
    try:
        await run_cpu(engine.check_grammar, spec)
    except GrammarError as e:
        raise APIError(400, f"{param}: {e}", param=param, code="invalid_grammar") from None
    if has_request_context():  # the request's trace shows the compile (api/tracing.py)
        g.ferrox_grammar_compile = (started, time.monotonic())
    return spec


# ---------------------------------------------------------------- tools


@dataclasses.dataclass(frozen=True)
class ToolRequest:
    """A request's validated tools and what it asks of them."""

    tools: tuple[ToolSpec, ...]
    choice: str  # "none" | "auto" | "required" | "function" (one named function, forced)
    function: str | None = None  # the forced function's name, when choice is "function"
    parallel: bool = True  # several calls in one reply

    @property
    def is_active(self) -> bool:
        """Tools are rendered into the prompt and calls parsed from the output."""
        return self.choice != "none" and bool(self.tools)

    @property
    def forces_call(self) -> bool:
        return self.choice in ("required", "function")

    def grammar(self) -> GrammarSpec:
        """The forced-call constraint (`forces_call` only)."""
        choice = "required" if self.choice == "required" else {"type": "function", "function": {"name": self.function}}
        return tool_call_grammar(self.tools, choice, parallel_tool_calls=self.parallel,
                                 max_whitespace_chars=TOOL_CALL_MAX_WHITESPACE_CHARS)

    def template_tools(self) -> list[dict[str, Any]]:
        """The tools as chat templates expect them (OpenAI's function-tool objects)."""
        return [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                   "parameters": t.parameters}} for t in self.tools]


def tool_request(tools: Sequence[Any] | None, tool_choice: Any, parallel_tool_calls: bool | None,
                 engine: Engine | None = None) -> ToolRequest | None:
    """Validate a request's tools and tool choice; None when it has neither.

    Args:
      tools: OpenAI function tools (`[{"type": "function", "function": {...}}]`).
      tool_choice: "none", "auto", "required", {"type": "function", "function": {"name"}},
        or None (then "auto" with tools, "none" without).
      parallel_tool_calls: None means True.
      engine: when given and a call is forced, each tool's parameters are compiled, so a
        schema the engine cannot enforce is named by its tool.
    Raises:
      APIError 400 naming `tools` or `tool_choice`.
    """
    tools = list(tools or [])
    if not tools and tool_choice in (None, "none"):
        return None
    choice, function = _tool_choice(tool_choice, bool(tools))
    forced = choice in ("required", "function")
    check = engine.check_grammar if forced and engine is not None else None
    try:
        specs = validate_tools(tools, check)
    except ToolDefinitionError as e:
        raise APIError(400, str(e), param="tools", code="invalid_tools") from None
    if function is not None and function not in {t.name for t in specs}:
        raise APIError(400, f"tool_choice names function {function!r}, which is not in tools", param="tool_choice")
    return ToolRequest(specs, choice, function, True if parallel_tool_calls is None else parallel_tool_calls)


def _tool_choice(tool_choice: Any, has_tools: bool) -> tuple[str, str | None]:
    if tool_choice is None:
        return ("auto" if has_tools else "none"), None
    if tool_choice in ("none", "auto", "required"):
        if tool_choice != "none" and not has_tools:
            raise APIError(400, f"tool_choice {tool_choice!r} needs tools", param="tool_choice")
        return tool_choice, None
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function" or not isinstance(name, str):
        raise APIError(400, 'tool_choice must be "none", "auto", "required" or '
                            '{"type": "function", "function": {"name": ...}}', param="tool_choice")
    if not has_tools:
        raise APIError(400, "tool_choice names a function but the request has no tools", param="tool_choice")
    return "function", name


# ---------------------------------------------------------------- chat prompt and output plan


@dataclasses.dataclass(frozen=True)
class OutputPlan:
    """What a request's output needs: its constraint, and how to parse its text."""

    grammar: GrammarSpec | None = None  # checked by `check_grammar` before it is submitted
    grammar_param: str = "response_format"  # the field a compile error names
    tool_format: str | None = None  # parse calls in this format (api/tool_calls.py); None: no calls
    parallel_tool_calls: bool = True
    reasoning: bool = False  # split <think> sections into reasoning_content
    starts_in_reasoning: bool = False  # the prompt opened the section
    harmony: bool = False  # parse harmony channels (api/harmony.py) instead of tags and call formats

    @property
    def skip_special_tokens(self) -> bool:
        """Parsed output keeps special tokens: call markers ([TOOL_CALLS], <|python_tag|>),
        thinking tags and harmony's channel markers may be special tokens."""
        return self.tool_format is None and not self.reasoning and not self.harmony

    def new_parser(self) -> OutputParser | None:
        """A parser for one choice, or None when the text is plain content."""
        if self.tool_format is None and not self.reasoning and not self.harmony:
            return None
        return OutputParser(self)


@dataclasses.dataclass(frozen=True)
class ChatPrompt:
    text: str  # the rendered prompt
    plan: OutputPlan


def prepare_chat(tokenizer: Any, messages: list[dict[str, Any]], *, tools: ToolRequest | None = None,
                 constraint: GrammarSpec | str | None = None, constraint_param: str = "response_format",
                 default_constraint: GrammarSpec | None = None, add_generation_prompt: bool = True,
                 messages_param: str = "messages", split_reasoning: bool = True,
                 template_kwargs: dict[str, Any] | None = None) -> ChatPrompt:
    """Render a chat request's prompt and plan its output (the module docstring's rules).

    Args:
      tokenizer: the engine's tokenizer (`apply_chat_template`, `chat_template`).
      messages: role/content dicts; assistant messages may carry OpenAI `tool_calls`,
        tool messages `tool_call_id`.
      tools: from `tool_request`.
      constraint: the request's own constraint, PLAIN_TEXT, or None.
      constraint_param: the field a compile error of the request's constraint names.
      default_constraint: the server-wide constraint.
      messages_param: the field a template error names (the adapter's name for the messages).
      split_reasoning: False keeps thinking sections in the content (for adapters that do
        not render reasoning of their own).
      template_kwargs: further template variables (`api/template_kwargs.py`).
    Raises:
      APIError 400: a constraint next to a forced call; a template that fails (names
        `messages_param`).
    """
    from ferrox_jax.engine import ChatTemplateError  # the engine's tokenizer raises it

    template = tokenizer.chat_template
    renders_tools = template_renders_tools(template)
    active = tools is not None and tools.is_active
    grammar, param = _plan_grammar(tools, constraint, constraint_param, default_constraint)
    template_messages = _history_for_template(messages, renders_tools)
    template_tools = None
    if active and renders_tools:
        template_tools = tools.template_tools()
    elif active:
        template_messages = add_tools_to_messages(template_messages, tools.tools, parallel=tools.parallel)
    try:
        text = tokenizer.apply_chat_template(template_messages, add_generation_prompt=add_generation_prompt,
                                             tools=template_tools, template_kwargs=template_kwargs)
    except ChatTemplateError as e:
        raise APIError(400, f"{messages_param}: {e}", param=messages_param, code="chat_template_error") from None
    tool_format = None
    if active:
        tool_format = "json" if tools.forces_call else detect_tool_call_format(template)
    harmony = split_reasoning and is_harmony_template(template) and grammar is None
    reasoning = harmony or (split_reasoning and THINK_START in (template or "") and grammar is None)
    plan = OutputPlan(grammar=grammar, grammar_param=param, tool_format=tool_format,
                      parallel_tool_calls=tools.parallel if tools is not None else True, reasoning=reasoning,
                      starts_in_reasoning=reasoning and not harmony and prompt_opens_reasoning(text), harmony=harmony)
    return ChatPrompt(text, plan)


def completion_plan(constraint: GrammarSpec | str | None, constraint_param: str,
                    default_constraint: GrammarSpec | None) -> OutputPlan:
    """The output plan of a plain completion (no tools, no thinking sections)."""
    grammar, param = _plan_grammar(None, constraint, constraint_param, default_constraint)
    return OutputPlan(grammar=grammar, grammar_param=param)


def _plan_grammar(tools: ToolRequest | None, constraint: GrammarSpec | str | None, param: str,
                  default_constraint: GrammarSpec | None) -> tuple[GrammarSpec | None, str]:
    if tools is not None and tools.forces_call:
        if isinstance(constraint, GrammarSpec):
            raise APIError(400, f"tool_choice {tools.choice!r} forces a tool call, whose format is fixed; "
                                f"it cannot be combined with {param}", param="tool_choice")
        try:
            return tools.grammar(), "tools"
        except ToolDefinitionError as e:
            raise APIError(400, str(e), param="tool_choice") from None
    if isinstance(constraint, GrammarSpec):
        return constraint, param
    if constraint == PLAIN_TEXT:
        return None, param
    return default_constraint, "server default constraint"


def _history_for_template(messages: list[dict[str, Any]], renders_tools: bool) -> list[dict[str, Any]]:
    """Assistant `tool_calls` in the history, as the template can take them: with arguments
    parsed into objects for a template that renders tools (as transformers' templates
    expect), else appended to the content as the `json` call text the tools prompt teaches."""
    out = []
    for message in messages:
        calls = message.get("tool_calls")
        if message.get("role") != "assistant" or not calls:
            out.append(message)
            continue
        parsed = [_history_call(call) for call in calls]
        if renders_tools:
            out.append({**message, "tool_calls": [
                {**call, "function": {"name": name, "arguments": arguments}}
                for call, (name, arguments) in zip(calls, parsed)]})
            continue
        objects = [{"name": name, "arguments": arguments} for name, arguments in parsed]
        text = json.dumps(objects[0] if len(objects) == 1 else objects, ensure_ascii=False)
        content = message.get("content") or ""
        rest = {k: v for k, v in message.items() if k != "tool_calls"}
        out.append({**rest, "content": f"{content}\n{text}" if content else text})
    return out


def _history_call(call: Any) -> tuple[str, Any]:
    """(name, arguments object) of one history tool call; 400 if it is not a function call."""
    function = call.get("function") if isinstance(call, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise APIError(400, "messages: an assistant tool_calls entry must be "
                            '{"id", "type": "function", "function": {"name", "arguments"}}', param="messages")
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            pass  # kept as the text it is
    return name, arguments


# ---------------------------------------------------------------- output


class OutputParser:
    """One choice's text as reasoning, content and tool-call deltas, whole or streamed."""

    def __init__(self, plan: OutputPlan) -> None:
        self.plan = plan
        self._harmony = HarmonyStreamParser(tools=plan.tool_format is not None) if plan.harmony else None
        self._reasoning = (ReasoningStreamParser(starts_in_reasoning=plan.starts_in_reasoning)
                           if plan.reasoning and not plan.harmony else None)
        self._tools = (ToolCallStreamParser(plan.tool_format)
                       if plan.tool_format is not None and not plan.harmony else None)
        self._is_finished = False

    def feed(self, text: str) -> list[dict[str, Any]]:
        """A text delta in; the deltas now safe to send out."""
        if self._harmony is not None:
            return [d for d in self._harmony.feed(text) if self._keeps(d)]
        return self._split(*(self._reasoning.feed(text) if self._reasoning else ("", text)), final=False)

    def finish(self) -> list[dict[str, Any]]:
        """The row ended: what was held back (idempotent)."""
        if self._is_finished:
            return []
        self._is_finished = True
        if self._harmony is not None:
            return [d for d in self._harmony.finish() if self._keeps(d)]
        return self._split(*(self._reasoning.finish() if self._reasoning else ("", "")), final=True)

    def _split(self, reasoning: str, content: str, final: bool) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = [{"reasoning_content": reasoning}] if reasoning else []
        if self._tools is None:
            if content:
                out.append({"content": content})
            return out
        deltas = self._tools.feed(content) if content else []
        if final:
            deltas += self._tools.finish()
        return out + [d for d in deltas if self._keeps(d)]

    def _keeps(self, delta: dict[str, Any]) -> bool:
        """Without parallel calls only the first call is sent."""
        return self.plan.parallel_tool_calls or "tool_calls" not in delta or delta["tool_calls"][0]["index"] == 0

    @property
    def calls(self) -> list[ToolCall]:
        source = self._harmony if self._harmony is not None else self._tools
        calls = source.calls if source is not None else []
        return calls if self.plan.parallel_tool_calls else calls[:1]

    def finish_reason(self, reason: str | None) -> str | None:
        """The engine's finish reason, or "tool_calls" for a reply with calls that ended normally."""
        return "tool_calls" if reason == "stop" and self.calls else reason


@dataclasses.dataclass(frozen=True)
class ParsedOutput:
    """A whole choice's text, parsed."""

    reasoning: str | None  # None when the template has no thinking sections
    content: str
    calls: tuple[ToolCall, ...]


def parse_output(parser: OutputParser, text: str) -> ParsedOutput:
    """Feed a whole text to a fresh parser (so it agrees with the streamed deltas)."""
    deltas = parser.feed(text) + parser.finish()
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    content = "".join(d.get("content", "") for d in deltas)
    return ParsedOutput(reasoning if parser.plan.reasoning else None, content, tuple(parser.calls))
