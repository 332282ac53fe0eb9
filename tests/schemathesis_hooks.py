"""Schemathesis hooks for ``tests/test_schemathesis.py`` (loaded by the ``st`` process via
``SCHEMATHESIS_HOOKS``): with an owner-bound key, a generated ``user_id`` that is valid
becomes the key's owner, so the run reaches past ``403``; an invalid one stays as
generated (the server must still refuse it). Every other generated event or node id is
replaced by one of the owner's real ones (``PRME_SCHEMATHESIS_EVENTS``), so the event,
delete and lifecycle routes are exercised past ``404`` too."""

from __future__ import annotations

import os
import re
from typing import Any

import schemathesis

from prme.query.http_types import USER_ID_PATTERN

OWNER = os.environ.get("PRME_SCHEMATHESIS_OWNER")
EVENTS = [e for e in os.environ.get("PRME_SCHEMATHESIS_EVENTS", "").split(",") if e]
TOKEN = os.environ.get("PRME_SCHEMATHESIS_TOKEN", "")
"""``partition:offset`` of one of the owner's writes: the ``after`` of every other read."""
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


def _real_id(generated: Any, prefix: str) -> Any:
    """One of the real ids for every other generated one (chosen by the generated text,
    so a run stays reproducible from its seed)."""
    if not EVENTS or not isinstance(generated, str) or len(generated) % 2:
        return generated
    return prefix + EVENTS[len(generated) // 2 % len(EVENTS)]


@schemathesis.hook
def before_call(context: Any, case: Any, kwargs: dict[str, Any]) -> None:
    if OWNER is not None:
        _as_owner(case.body)
        _as_owner(case.query)
    path = case.path_parameters
    if isinstance(path, dict):
        if "event_id" in path:
            path["event_id"] = _real_id(path["event_id"], "")
        if "node_id" in path:
            path["node_id"] = _real_id(path["node_id"], "mem:")
    if isinstance(case.body, dict) and "by_node_id" in case.body:
        case.body["by_node_id"] = _real_id(case.body["by_node_id"], "mem:")
    if OWNER is not None and TOKEN:
        _real_after(case)


def _real_after(case: Any) -> None:
    """A valid ``after`` (a token of the owner's own writes) for every other one that has
    the right shape; a malformed one stays as generated."""
    partition, offset = (int(part) for part in TOKEN.split(":"))
    query, body = case.query, case.body
    given = query.get("after") if isinstance(query, dict) else None
    if isinstance(given, str) and re.fullmatch(r"[0-9]+:[0-9]+", given) and len(given) % 2 == 0:
        query["after"] = TOKEN
    if isinstance(body, dict) and isinstance(body.get("after"), dict):
        after = body["after"]
        shape = set(after) == {"partition", "offset"} and all(
            isinstance(after[k], int) and not isinstance(after[k], bool) and after[k] >= 0
            for k in after
        )
        if shape and (after["partition"] + after["offset"]) % 2 == 0:
            body["after"] = {"partition": partition, "offset": offset}
