"""Tools whose parameters use `$ref`, as frameworks built on pydantic send them, and the
check that a call's arguments are valid against the tool's own schema.

The models are real pydantic models (a nested model, a list of them, an optional one, a
recursive one); their strings and lists are bounded so a random model (or a random walk
through the grammar) finishes a call within a few hundred tokens. `LEGACY` is a
hand-written draft-7 schema: its `definitions` reuse the name `Address` with another
shape (a clash with Person's), and it points into itself (`#/properties/to`); `CHAIN`
recurses through `#`, the whole document.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

import jsonschema
from pydantic import BaseModel, Field

Short = Annotated[str, Field(min_length=1, max_length=6)]


class Address(BaseModel):
    street: Short
    city: Short


class Person(BaseModel):
    name: Short
    home: Address  # nested
    visits: list[Address] = Field(default_factory=list, max_length=2)  # a list of nested
    work: Address | None = None  # optional nested


class Node(BaseModel):
    value: int = Field(ge=0, le=9)
    children: list["Node"] = Field(default_factory=list, max_length=2)  # recursive


LEGACY = {
    "type": "object",
    "definitions": {"Address": {"type": "object", "properties": {"zip": {"type": "integer", "minimum": 0,
                                                                         "maximum": 99}},
                                "required": ["zip"]}},
    "properties": {"to": {"$ref": "#/definitions/Address"}, "copy": {"$ref": "#/properties/to"}},
    "required": ["to"],
}
CHAIN = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}, "next": {"$ref": "#"}},
         "required": ["n"]}

SCHEMAS: dict[str, dict[str, Any]] = {
    "save_person": Person.model_json_schema(),
    "plant_tree": Node.model_json_schema(),
    "mail": LEGACY,
    "chain": CHAIN,
}
MODELS = {"save_person": Person, "plant_tree": Node}
# OpenAI chat's function tools; api_tools() gives the other wires' shapes.
TOOLS = [{"type": "function", "function": {"name": name, "description": f"{name} tool", "parameters": schema}}
         for name, schema in SCHEMAS.items()]


def anthropic_tools() -> list[dict]:
    return [{"name": name, "description": f"{name} tool", "input_schema": schema} for name, schema in SCHEMAS.items()]


def responses_tools() -> list[dict]:
    return [{"type": "function", "name": name, "description": f"{name} tool", "parameters": schema}
            for name, schema in SCHEMAS.items()]


def check_call(name: str, arguments: str | dict) -> Any:
    """Validate one call's arguments against its tool's schema (jsonschema), and for the
    pydantic tools with the model itself (strict: no coercion); returns the arguments."""
    assert name in SCHEMAS, f"a call to an unknown tool {name!r}"
    args = json.loads(arguments) if isinstance(arguments, str) else arguments
    jsonschema.validate(args, SCHEMAS[name])
    if name in MODELS:
        MODELS[name].model_validate_json(json.dumps(args), strict=True)
    return args
