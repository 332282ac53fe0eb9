"""JSON Schemas for the MCP tools, derived from the msgspec types of the HTTP API.

MCP clients want one self-contained object schema per tool (``"type": "object"`` at the
root); msgspec writes ``{"$ref": "#/$defs/X", "$defs": {...}}``. :func:`object_schema`
resolves the references, drops the fields a tool does not take, and adds descriptions,
so the tools and the HTTP service validate against the same declarations.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from typing import Any

import msgspec

_DEFS = "#/$defs/"


def object_schema(
    type_: type[msgspec.Struct],
    *,
    drop: Iterable[str] = (),
    optional: Iterable[str] = (),
    descriptions: Mapping[str, str] | None = None,
    description: str | None = None,
) -> dict[str, Any]:
    """The JSON Schema of ``type_`` with ``$ref``s inlined.

    ``drop`` removes properties (a tool that always waits has no ``wait``); ``optional``
    takes names out of ``required``; ``descriptions`` annotates properties by name.
    """
    document = msgspec.json.schema(type_)
    root = _inline(document, document.get("$defs", {}), ())
    if root.get("type") != "object" or "properties" not in root:
        raise TypeError(f"{type_.__name__} is not an object type")
    dropped, loose = set(drop), set(optional)
    properties = {
        name: dict(spec) for name, spec in root["properties"].items() if name not in dropped
    }
    for name, text in (descriptions or {}).items():
        if name in properties:
            properties[name]["description"] = text
    schema: dict[str, Any] = {"type": "object", "properties": properties}
    required = [
        name for name in root.get("required", []) if name in properties and name not in loose
    ]
    if required:
        schema["required"] = required
    schema["additionalProperties"] = False
    text = description if description is not None else root.get("description")
    if text:
        schema["description"] = text
    return schema


def _inline(node: Any, defs: Mapping[str, Any], seen: tuple[str, ...]) -> Any:
    if isinstance(node, list):
        return [_inline(item, defs, seen) for item in node]
    if not isinstance(node, dict):
        return node
    ref = node.get("$ref")
    if isinstance(ref, str) and ref.startswith(_DEFS):
        name = ref[len(_DEFS) :]
        if name in seen:
            raise TypeError(f"recursive type {name} cannot be inlined")
        target = _inline(copy.deepcopy(defs[name]), defs, (*seen, name))
        target.pop("title", None)
        siblings = {k: _inline(v, defs, seen) for k, v in node.items() if k != "$ref"}
        return {**target, **siblings}
    return {
        key: _inline(value, defs, seen)
        for key, value in node.items()
        if key not in ("$defs", "title")
    }
