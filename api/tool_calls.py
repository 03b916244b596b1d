"""Tool definitions: validate a request's tools, describe them to models whose templates
cannot, and force a call with a grammar.

Where it sits: the protocol adapters pass a request's `tools` through `validate_tools`,
render the prompt (with `add_tools_to_messages` when `template_renders_tools` is false),
and, for `tool_choice: "required"` or a named function, constrain the row with
`tool_call_grammar(...)` (a `ferrox_jax.constraint.GrammarSpec`); the output is then
parsed in the `json` format by `api/tool_call_parser.py`.
"""

from __future__ import annotations

import json
import re
import urllib.parse
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from ferrox_jax.constraint import DEFAULT_MAX_WHITESPACE_CHARS, GrammarError, GrammarSpec

_FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names

# The system-prompt fallback for templates that do not render `tools`. {tools} is one
# JSON object per line: {"name", "description", "parameters"}.
TOOLS_PROMPT = (
    "You can call the following functions. Each is given as a JSON object with its name, "
    "description and parameters (a JSON schema):\n{tools}\n\n"
    "To call a function, reply with only a JSON object and nothing before or after it: "
    '{{"name": <function name>, "arguments": <object of arguments>}}.{parallel} '
    "If no function call is needed, reply normally."
)
TOOLS_PROMPT_PARALLEL = " To call several functions at once, reply with a JSON list of such objects."


class ToolDefinitionError(ValueError):
    """A request's tool definition is unusable; the message names the tool (HTTP 400)."""


@dataclass(frozen=True)
class ToolSpec:
    """A validated `tools[]` entry."""

    name: str
    description: str
    parameters: dict[str, Any]  # a JSON schema for the arguments object


def template_renders_tools(chat_template: str | None) -> bool:
    """Whether the template uses the `tools` variable (else add TOOLS_PROMPT ourselves)."""
    return bool(chat_template) and re.search(r"\btools\b", chat_template) is not None


def validate_tools(tools: Sequence[Any], check_grammar: Callable[[GrammarSpec], None] | None = None
                   ) -> tuple[ToolSpec, ...]:
    """Check a request's `tools` and return them as ToolSpecs.

    Args:
      tools: the request's list of {"type": "function", "function": {"name",
        "description"?, "parameters"?}}.
      check_grammar: the engine's `check_grammar`; when given, each parameters schema is
        also compiled, so a schema the engine rejects is caught here.
    Raises:
      ToolDefinitionError naming the tool (by name, else by index) and the problem.
    """
    specs: list[ToolSpec] = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        label = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
            raise ToolDefinitionError(f"{label}: must be {{\"type\": \"function\", \"function\": {{...}}}}")
        name = function.get("name")
        if not isinstance(name, str) or not _FUNCTION_NAME.match(name):
            raise ToolDefinitionError(f"{label}: function name must be 1-64 letters, digits, _ or -; got {name!r}")
        label = f"tool {name!r}"
        if name in {s.name for s in specs}:
            raise ToolDefinitionError(f"{label} is defined twice")
        description = function.get("description", "")
        if not isinstance(description, str):
            raise ToolDefinitionError(f"{label}: description must be a string")
        parameters = function.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, dict):
            raise ToolDefinitionError(f"{label}: parameters must be a JSON schema object; got {type(parameters).__name__}")
        if check_grammar is not None:
            try:
                check_grammar(GrammarSpec.json_schema(parameters))
            except GrammarError as e:
                raise ToolDefinitionError(f"{label}: parameters are not a usable JSON schema: {e}") from e
        specs.append(ToolSpec(name, description, parameters))
    return tuple(specs)


def render_tools_prompt(tools: Sequence[ToolSpec], *, parallel: bool = True) -> str:
    """TOOLS_PROMPT filled in for `tools`."""
    lines = [json.dumps({"name": t.name, "description": t.description, "parameters": t.parameters},
                        ensure_ascii=False) for t in tools]
    return TOOLS_PROMPT.format(tools="\n".join(lines), parallel=TOOLS_PROMPT_PARALLEL if parallel else "")


def add_tools_to_messages(messages: list[dict[str, Any]], tools: Sequence[ToolSpec], *,
                          parallel: bool = True) -> list[dict[str, Any]]:
    """A copy of `messages` whose system message ends with the tools prompt (one is
    prepended when there is none)."""
    prompt = render_tools_prompt(tools, parallel=parallel)
    if messages and messages[0].get("role") == "system" and isinstance(messages[0].get("content"), str):
        return [{**messages[0], "content": messages[0]["content"] + "\n\n" + prompt}, *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]


def tool_call_grammar(tools: Sequence[ToolSpec], tool_choice: Any, *, parallel_tool_calls: bool = True,
                      max_calls: int | None = None,
                      max_whitespace_chars: int = DEFAULT_MAX_WHITESPACE_CHARS) -> GrammarSpec:
    """A constraint forcing the output to be calls in the `json` format.

    Each call is {"name": N, "arguments": A} with N one tool's name (only the named one
    for a named tool_choice) and A valid against that tool's parameters (an anyOf over
    tools, so a name and its arguments always belong together). With parallel calls the
    output is a list of 1..max_calls calls, else a single call. Parse with format "json".

    Args:
      tools: validated tools (`validate_tools`).
      tool_choice: "required", or {"type": "function", "function": {"name": N}}.
    Raises:
      ToolDefinitionError for an unknown tool_choice or named function.
    """
    if tool_choice == "required":
        chosen = list(tools)
    elif isinstance(tool_choice, dict) and isinstance(tool_choice.get("function"), dict):
        name = tool_choice["function"].get("name")
        chosen = [t for t in tools if t.name == name]
        if not chosen:
            raise ToolDefinitionError(f"tool_choice names function {name!r}, which is not in tools")
    else:
        raise ToolDefinitionError(f"tool_choice must be \"required\" or a named function to force a call; got {tool_choice!r}")
    if not chosen:
        raise ToolDefinitionError("tool_choice \"required\" needs at least one tool")
    definitions: dict[str, Any] = {}
    calls = [{"type": "object",
              "properties": {"name": {"const": t.name}, "arguments": nest_parameters(t.name, t.parameters, definitions)},
              "required": ["name", "arguments"], "additionalProperties": False} for t in chosen]
    call = calls[0] if len(calls) == 1 else {"anyOf": calls}
    if parallel_tool_calls:
        call = {"type": "array", "items": call, "minItems": 1}
        if max_calls is not None:
            call["maxItems"] = max_calls
    if definitions:
        call["$defs"] = definitions
    return GrammarSpec.json_schema(call, max_whitespace_chars=max_whitespace_chars)


# ---------------------------------------------------------------- parameters inside the call schema
#
# A tool's parameters are a JSON schema document of their own: its `$ref`s are pointers
# from its root ("#/$defs/Address", what pydantic writes for every nested model; "#" for a
# schema that recurses into itself). In the forced-call schema those parameters sit at
# `.../properties/arguments`, so the same pointers would resolve against the wrapper.
# `nest_parameters` moves each tool's definitions into the wrapper's `$defs` under names
# of its own ("<tool>.<definition>"; tool names have no dot, so no two tools clash) and
# rewrites the pointers to match; a pointer into the parameters themselves ("#",
# "#/properties/...") points at a copy of the whole parameters kept as `$defs/<tool>`.

_DEFINITION_KEYWORDS = ("$defs", "definitions")  # where a document keeps its definitions (2019+, draft 7)
_NAMED_SUBSCHEMAS = ("properties", "patternProperties", "dependentSchemas", *_DEFINITION_KEYWORDS)
_DATA_KEYWORDS = ("const", "enum", "default", "examples")  # values, not schemas: never rewritten
_RESOURCE_KEYWORDS = ("$schema", "$id")  # a document root's; nested, they would start a new resource


def nest_parameters(tool: str, parameters: dict[str, Any], definitions: dict[str, Any]) -> dict[str, Any]:
    """Tool `tool`'s parameters as a subschema of a wrapper whose `$defs` is `definitions`.

    Adds the parameters' definitions (from `$defs` and `definitions`) to `definitions`, and
    returns the parameters without them, every root-relative `$ref` rewritten to where its
    target now is. Refs to other documents are left as they are (the compiler refuses
    them, as it would in the parameters alone).
    """
    names: dict[tuple[str, str], str] = {}  # (keyword, definition) -> its key in `definitions`
    for keyword in _DEFINITION_KEYWORDS:
        for name in parameters.get(keyword) or {}:
            key = f"{tool}.{name}"
            while key in definitions or key in names.values():  # "$defs" and "definitions" may share a name
                key += "_"
            names[keyword, name] = key
    refers_to_root = False

    def moved(ref: str) -> str:
        nonlocal refers_to_root
        if ref != "#" and not ref.startswith("#/"):
            return ref
        tokens = [_unescape(t) for t in ref[2:].split("/")] if ref != "#" else []
        if len(tokens) >= 2 and (tokens[0], tokens[1]) in names:
            return _pointer(["$defs", names[tokens[0], tokens[1]], *tokens[2:]])
        refers_to_root = True
        return _pointer(["$defs", tool, *tokens])

    def rewrite(node: Any) -> Any:
        if isinstance(node, list):
            return [rewrite(v) for v in node]
        if not isinstance(node, dict):
            return node
        out = {}
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str):
                out[key] = moved(value)
            elif key in _DATA_KEYWORDS:
                out[key] = value
            elif key in _NAMED_SUBSCHEMAS and isinstance(value, dict):
                out[key] = {name: rewrite(schema) for name, schema in value.items()}
            else:
                out[key] = rewrite(value)
        return out

    for (keyword, name), key in names.items():
        definitions[key] = rewrite(parameters[keyword][name])
    body = rewrite({k: v for k, v in parameters.items() if k not in _DEFINITION_KEYWORDS + _RESOURCE_KEYWORDS})
    if not refers_to_root:
        return body
    definitions[tool] = body  # refs into the parameters document itself resolve in this copy
    return {"$ref": _pointer(["$defs", tool])}


def _unescape(token: str) -> str:
    """A JSON-pointer token of a URI fragment as the key it names (RFC 6901: %-decoding, ~1, ~0)."""
    return urllib.parse.unquote(token).replace("~1", "/").replace("~0", "~")


def _pointer(tokens: Sequence[str]) -> str:
    """The URI fragment pointing at `tokens` from the root."""
    return "#/" + "/".join(urllib.parse.quote(t.replace("~", "~0").replace("/", "~1"), safe="$~") for t in tokens)
