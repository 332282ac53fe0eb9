"""What msgspec's validation errors leave out, read from the type that was validated: a
choice's allowed values, and the field a misspelt key is close to."""

from __future__ import annotations

import difflib
import re
from typing import Any, Final

import msgspec
import msgspec.inspect

CLOSE_KEY: Final = 0.65
"""How alike (``difflib`` ratio) an unknown key and a field's name are to suggest it."""

_AT = r" - at (?P<key>`key` in )?`\$(?P<path>(?:\.\w+)+)`"
"""Where msgspec says an error is: `` - at `$.scoring.fusion``` (or `` `key` in`` it)."""
_ERROR_AT = re.compile(_AT)
_ENUM_ERROR = re.compile(rf"Invalid enum value .*{_AT}$")
_UNKNOWN_FIELD = re.compile(
    r"Object contains unknown field `(?P<name>[^`]*)`(?: - at `\$(?P<path>(?:\.\w+)*)`)?$"
)


def validation_hint(cls: type[msgspec.Struct], error: str, *, variables: bool = False) -> str:
    """What msgspec's ``error`` about a value of ``cls`` leaves out: the choices of a field
    given a value outside them (``Invalid enum value 'x' - at `$.scoring.fusion```: `` (one
    of: rrf, weighted, zscore)``), or the field a misspelt key is close to (``Object contains
    unknown field `fuson` - at `$.scoring```: `` (did you mean fusion?)``, or with
    ``variables`` `` (did you mean PRME_SCORING__FUSION?)``); else ``""``."""
    if (match := _ENUM_ERROR.match(error)) is not None:
        node = _type_at(cls, match["path"])
        if match["key"]:
            node = getattr(node, "key_type", None)
        if isinstance(node, msgspec.inspect.UnionType):  # an optional choice
            node = next((t for t in node.types if isinstance(t, msgspec.inspect.LiteralType)), None)
        if isinstance(node, msgspec.inspect.LiteralType):
            return f" (one of: {', '.join(str(value) for value in node.values)})"
    elif (match := _UNKNOWN_FIELD.match(error)) is not None:
        path = match["path"] or ""
        names = [f.name for f in getattr(_type_at(cls, path), "fields", ())]
        close = difflib.get_close_matches(match["name"].lower(), names, n=1, cutoff=CLOSE_KEY)
        if close:
            key = "__".join([*path.split(".")[1:], close[0]])
            return f" (did you mean {'PRME_' + key.upper() if variables else close[0]}?)"
    return ""


def error_path(error: str) -> list[str]:
    """The field names of the path msgspec's ``error`` is at (``["scoring", "fusion"]``),
    or ``[]`` when it names none."""
    match = _ERROR_AT.search(error)
    return [] if match is None else match["path"].split(".")[1:]


def _type_at(cls: type[msgspec.Struct], path: str) -> Any:
    """The type (``msgspec.inspect``) of the field at ``path`` (``.scoring.fusion``), or
    ``None``."""
    node: Any = msgspec.inspect.type_info(cls)
    for name in path.split(".")[1:]:
        fields = {f.name: f.type for f in getattr(node, "fields", ())}
        if name not in fields:
            return None
        node = fields[name]
    return node
