"""A query parameter given twice is refused.

Every endpoint reads one value per query parameter, and readers disagree on which of two
(the forwarding middleware routes by the first ``user_id``, the app would act on the
last): ``?user_id=a&user_id=b`` is answered 400 before either reads it.
"""

from __future__ import annotations

from collections import Counter
from urllib.parse import parse_qsl

import msgspec
from litestar.types import ASGIApp, Receive, Scope, Send

from .http_types import ErrorBody


class SingleQueryValues:
    """ASGI middleware: 400 ``invalid_input`` for a query parameter given more than once."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        query = scope.get("query_string", b"") if scope["type"] == "http" else b""
        repeated = repeated_parameters(query) if query else []
        if not repeated:
            await self.app(scope, receive, send)
            return
        names = ", ".join(repr(name) for name in repeated)
        content = msgspec.json.encode(
            ErrorBody("invalid_input", f"query parameter {names} given more than once")
        )
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


def repeated_parameters(query: bytes) -> list[str]:
    counts = Counter(
        name for name, _ in parse_qsl(query.decode(errors="replace"), keep_blank_values=True)
    )
    return sorted(name for name, count in counts.items() if count > 1)
