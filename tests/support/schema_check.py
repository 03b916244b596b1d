"""A small JSON-schema validator for tests (jsonschema is not a dependency).

Covers the keywords the structured-output tests use: type, properties, required,
additionalProperties (boolean), enum, const, minimum, maximum, minLength, maxLength,
items, minItems, maxItems, anyOf. Unknown keywords fail loudly, so a test cannot think it
checked something it did not.
"""

from __future__ import annotations

from typing import Any

_TYPES = {
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: type(v) is int,
    "number": lambda v: type(v) in (int, float),
    "boolean": lambda v: type(v) is bool,
    "null": lambda v: v is None,
}
_KNOWN = {"type", "properties", "required", "additionalProperties", "enum", "const", "minimum", "maximum",
          "minLength", "maxLength", "items", "minItems", "maxItems", "anyOf", "description", "title"}


def check(doc: Any, schema: dict, path: str = "$") -> None:
    """Raises AssertionError naming the path and the keyword `doc` violates."""
    unknown = set(schema) - _KNOWN
    assert not unknown, f"schema_check does not implement {sorted(unknown)}"
    if "anyOf" in schema:
        errors = []
        for branch in schema["anyOf"]:
            try:
                check(doc, branch, path)
                break
            except AssertionError as e:
                errors.append(str(e))
        else:
            raise AssertionError(f"{path}: no anyOf branch matches: {errors}")
    if "type" in schema:
        types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        assert any(_TYPES[t](doc) for t in types), f"{path}: {doc!r} is not {types}"
    if "enum" in schema:
        assert doc in schema["enum"], f"{path}: {doc!r} not in enum {schema['enum']}"
    if "const" in schema:
        assert doc == schema["const"], f"{path}: {doc!r} != const {schema['const']!r}"
    if isinstance(doc, (int, float)) and not isinstance(doc, bool):
        assert doc >= schema.get("minimum", doc), f"{path}: {doc} < minimum"
        assert doc <= schema.get("maximum", doc), f"{path}: {doc} > maximum"
    if isinstance(doc, str):
        assert len(doc) >= schema.get("minLength", 0), f"{path}: {doc!r} shorter than minLength"
        assert len(doc) <= schema.get("maxLength", len(doc)), f"{path}: {doc!r} longer than maxLength"
    if isinstance(doc, list):
        assert len(doc) >= schema.get("minItems", 0), f"{path}: fewer than minItems"
        assert len(doc) <= schema.get("maxItems", len(doc)), f"{path}: more than maxItems"
        for i, item in enumerate(doc):
            if "items" in schema:
                check(item, schema["items"], f"{path}[{i}]")
    if isinstance(doc, dict):
        properties = schema.get("properties", {})
        for key in schema.get("required", ()):
            assert key in doc, f"{path}: required {key!r} missing"
        if schema.get("additionalProperties") is False:
            extra = set(doc) - set(properties)
            assert not extra, f"{path}: properties {sorted(extra)} not allowed"
        for key, value in doc.items():
            if key in properties:
                check(value, properties[key], f"{path}.{key}")
