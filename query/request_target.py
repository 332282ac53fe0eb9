"""The request target (path and query string) as strictly as a body: a target over
16 KiB, a path or query string that is not UTF-8 once percent-decoded, a query parameter
given twice, one the route does not take, or a whole number written otherwise is refused.

Every endpoint reads one value per query parameter, and readers disagree on which of two
(the forwarding middleware routes by the first ``user_id``, the app would act on the
last): ``?user_id=a&user_id=b`` is answered 400 before either reads it. A body refuses an
unknown field; a query refuses an unknown parameter (``?limt=5`` read as no limit at all),
and ``limit=1e3`` or ``limit=10.0``, which the lax conversion of query strings read as
1000 and 10.
"""

from __future__ import annotations

import re
import typing
from collections import Counter
from typing import Any
from urllib.parse import parse_qsl, unquote_to_bytes

import msgspec
from litestar.connection import ASGIConnection
from litestar.handlers import BaseRouteHandler
from litestar.params import QueryParameter
from litestar.types import ASGIApp, Receive, Scope, Send

from prme.schemas.errors import InvalidInput, shown

from .http_types import ErrorBody

WHOLE_NUMBER = re.compile(r"-?(0|[1-9][0-9]*)")
"""What the conversion of a query string reads as a whole number (no sign ``+``, no leading
zero): anything else gets this module's message, not the converter's."""


MAX_TARGET_BYTES = 16_384
"""The longest path and query string taken: a route's ids are at most 256 characters
(~3 KiB percent-encoded each), and a longer target could not be forwarded (httpx refuses
a URL over 64 KiB: a non-owner node answered 500 where the owner answered 400)."""


class StrictRequestTarget:
    """ASGI middleware: 400 ``invalid_input`` for a path and query string over
    :data:`MAX_TARGET_BYTES`, a query string that is not UTF-8 once percent-decoded, or one
    that gives a parameter more than once; before any node routes the request."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        problem = target_problem(scope) if scope["type"] == "http" else None
        if problem is None:
            await self.app(scope, receive, send)
            return
        content = msgspec.json.encode(ErrorBody("invalid_input", problem))
        await send(
            {
                "type": "http.response.start",
                "status": 400,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(content)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": content, "more_body": False})


def target_problem(scope: Scope) -> str | None:
    """Why the request target of ``scope`` is refused, or ``None``."""
    query = scope.get("query_string", b"")
    path = scope.get("raw_path") or str(scope.get("path", "")).encode()
    size = len(path) + len(query)
    if size > MAX_TARGET_BYTES:
        return (
            f"the request's path and query string are {size} bytes, over the limit of "
            f"{MAX_TARGET_BYTES} (an id is at most 256 characters)"
        )
    try:
        unquote_to_bytes(path).decode()
    except UnicodeDecodeError:  # /v1/events/%FF was looked up as U+FFFD
        return "the request's path is not UTF-8 once percent-decoded"
    return query_string_problem(query) if query else None


def query_string_problem(query: bytes) -> str | None:
    """Why ``query`` is refused, or ``None``. Bytes that are not UTF-8 would be read as
    U+FFFD (every such id the same owner, ``?user_id=%FF`` and ``?user_id=%FE`` alike)."""
    try:
        pairs = parse_qsl(query.decode(), keep_blank_values=True, errors="strict")
    except UnicodeDecodeError:
        return "the query string is not UTF-8 once percent-decoded"
    counts = Counter(name for name, _ in pairs)
    repeated = sorted(name for name, count in counts.items() if count > 1)
    if repeated:
        names = ", ".join(shown(name) for name in repeated)
        return f"query parameter {names} given more than once"
    return None


def check_query_parameters(
    connection: ASGIConnection[Any, Any, Any, Any], handler: BaseRouteHandler
) -> None:
    """The guard of the API routes, after the one that authenticates: InvalidInput for a
    query parameter ``handler`` does not declare, or a whole-number one that is not
    written as digits."""
    declared = query_parameters(handler)
    for name, value in parse_qsl(
        connection.scope.get("query_string", b"").decode(errors="replace"), keep_blank_values=True
    ):
        if name not in declared:
            takes = ", ".join(sorted(declared)) or "none (the request's fields go in its body)"
            raise InvalidInput(f"unknown query parameter {shown(name)}: this route takes {takes}")
        if declared[name] and not WHOLE_NUMBER.fullmatch(value):
            raise InvalidInput(
                f"Expected a whole number written in digits (such as 10), got {shown(value)} "
                f"- at query parameter `{name}`"
            )


def query_parameters(handler: BaseRouteHandler) -> dict[str, bool]:
    """The query parameters ``handler`` declares, by the name a request gives them, each
    with whether it is a whole number."""
    declared: dict[str, bool] = {}
    for argument, field in handler.parsed_fn_signature.parameters.items():
        kwarg = field.kwarg_definition
        if isinstance(kwarg, QueryParameter):
            types = typing.get_args(field.annotation) or (field.annotation,)
            declared[kwarg.query or kwarg.name or argument] = int in types
    return declared
