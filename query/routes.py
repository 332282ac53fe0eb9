"""The requests that act for one owner: where each names its owner, and whether sending it
twice is harmless. One table for the node that forwards a request to the owner's node
(``forwarding.py``), the hop that carries it (``cluster.py``) and the client that sends it
straight there (``http_client.py``)."""

from __future__ import annotations

import re
from typing import Any, Literal, NamedTuple

import msgspec


class Route(NamedTuple):
    method: str
    path: re.Pattern[str]
    owner_in: Literal["body", "query", "batch"]
    """Where the request names its owner: ``user_id`` in the body or the query, or the one
    ``user_id`` of every message of a batch."""
    appended_here: bool
    """A write the entry node appends itself when no owner can be reached (nothing was
    sent)."""
    request_ids: Literal["body", "every", "any", "none"] = "none"
    """Where a write carries the request ids that make it harmless to send twice (the
    owner answers a repeat with the first write): the body's, every message's, any
    message's (a history replacement is one idempotent write when one has one), none."""


ROUTES: tuple[Route, ...] = (
    Route("POST", re.compile(r"/v1/retrieve"), "body", False),
    Route("GET", re.compile(r"/v1/history"), "query", False),
    Route("GET", re.compile(r"/v1/events/[^/]+(/nodes)?"), "query", False),
    Route("DELETE", re.compile(r"/v1/history/messages/[^/]+"), "query", False),
    Route("POST", re.compile(r"/v1/nodes/[^/]+/(archive|restore|supersede)"), "body", False),
    Route("POST", re.compile(r"/v1/memories"), "body", True, "body"),
    Route("POST", re.compile(r"/v1/history/messages"), "body", True, "every"),
    Route("POST", re.compile(r"/v1/history/replace"), "body", True, "any"),
    Route("POST", re.compile(r"/v1/history/clear"), "body", True),
    Route("POST", re.compile(r"/v1/memories/batch"), "batch", True, "every"),
    Route("DELETE", re.compile(r"/v1/owners"), "query", True),
)
"""The requests the owner's node answers."""


class _Keyed(msgspec.Struct):
    request_id: Any = None
    messages: list[_Keyed] = []


_keyed = msgspec.json.Decoder(_Keyed)


def route_of(method: str, path: str) -> Route | None:
    """The route of a request to ``path`` (no query string); None: not an owner's."""
    for route in ROUTES:
        if method == route.method and route.path.fullmatch(path):
            return route
    return None


def is_repeatable(method: str, target: str) -> bool:
    """Whether sending the request twice is harmless (reads, and waits)."""
    path = target.partition("?")[0]
    return method == "GET" or path in ("/v1/retrieve", "/v1/cluster/wait")


def carries_request_ids(route: Route, body: bytes) -> bool:
    """Whether the write carries the request ids that make it harmless to send twice."""
    if route.request_ids == "none":
        return False
    try:
        write = _keyed.decode(body)
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):
        return False
    if route.request_ids == "body":
        return write.request_id is not None
    ids = [message.request_id is not None for message in write.messages]
    return any(ids) if route.request_ids == "any" else bool(ids) and all(ids)


def safe_to_resend(method: str, target: str, body: bytes | None) -> bool:
    """Whether the request may be sent again when it is unknown if the first one arrived:
    a read or a wait, or a write with its request ids."""
    if is_repeatable(method, target):
        return True
    route = route_of(method, target.partition("?")[0])
    return route is not None and body is not None and carries_request_ids(route, body)
