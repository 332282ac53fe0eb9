"""Schemathesis hooks for ``tests/test_schemathesis.py`` (loaded by the ``st`` process via
``SCHEMATHESIS_HOOKS``): with an owner-bound key, a generated ``user_id`` that is valid
becomes the key's owner, so the run reaches past ``403``; an invalid one stays as
generated (the server must still refuse it)."""

from __future__ import annotations

import os
import re
from typing import Any

import schemathesis

from prme.query.http_types import USER_ID_PATTERN

OWNER = os.environ.get("PRME_SCHEMATHESIS_OWNER")
_VALID = re.compile(USER_ID_PATTERN)


def _is_valid_owner(value: Any) -> bool:
    return isinstance(value, str) and 1 <= len(value) <= 256 and bool(_VALID.search(value))


def _as_owner(container: Any) -> None:
    if isinstance(container, dict):
        if OWNER is not None and _is_valid_owner(container.get("user_id")):
            container["user_id"] = OWNER
        for value in container.values():
            if isinstance(value, list):
                for item in value:
                    _as_owner(item)


@schemathesis.hook
def before_call(context: Any, case: Any, kwargs: dict[str, Any]) -> None:
    if OWNER is not None:
        _as_owner(case.body)
        _as_owner(case.query)
