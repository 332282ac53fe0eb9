"""The ASGI middleware that sends a request to the node owning its owner's partition.

Reads (retrieve, history, events), the writes that must read first (delete a message,
archive, restore, supersede: they check the event or node), and every one-owner write
(store a memory, add to, replace or clear a history, erase the owner) are answered by the
owner's node; the reply is relayed as it came (same status and body). One owner's writes
go to its node because that node checks a ``request_id`` against its events model (which
Kafka cannot do) and is the one that erases the owner, dropping the data key it seals
with: a node that sealed the owner's writes itself kept sealing with the erased key from
memory, and the owner's node then dropped those acknowledged writes. A one-owner write
whose owner cannot be found within ``WRITE_OWNER_WAIT_S``, or refuses the connection, is
appended here (the log takes it; the answer says whether it was applied); a write the hop
may have delivered (504) or whose owner refused this node's secret (503) is not. A write
whose pooled connection to the owner broke before the answer is sent once more, on a new
connection, when its request ids make that harmless (``Route.request_ids``). A batch of
several owners' memories is appended by the node it reaches.
A request another node forwarded is served here or refused with 503 ``not_owner`` (never
forwarded twice), so a stale map costs a retry, not a loop.
"""

from __future__ import annotations

import asyncio
from typing import Any
from urllib.parse import parse_qs

import msgspec
from litestar.types import (
    ASGIApp,
    HTTPResponseBodyEvent,
    HTTPResponseStartEvent,
    Message,
    Receive,
    Scope,
    Send,
)

from prme.schemas.errors import Forbidden, Unauthenticated

from .auth import ApiKeys, Caller, refuse_repeated_credentials
from .cluster import ClusterRouter, HopBroken, HopRefused, NodeRefused, NotOwner
from .http_types import FORWARDED_BY_HEADER, NOT_OWNER_HEADER, SERVED_BY_HEADER, ErrorBody
from .observe import CALLER_STATE
from .routes import Route, carries_request_ids, is_repeatable, route_of

WRITE_OWNER_WAIT_S = 2.0
"""How long a write waits for its owner to be found (a rebalance) before it is appended
by the node it reached."""


class _Owner(msgspec.Struct):
    user_id: str | None = None


class _Batch(msgspec.Struct):
    messages: list[_Owner] = []


_owner_of_body = msgspec.json.Decoder(_Owner)
_owners_of_batch = msgspec.json.Decoder(_Batch)


class ForwardingMiddleware:
    """Serves a routed request here when this node owns the partition (once it has caught
    up), forwards it otherwise, and stamps every response with the node that served it."""

    def __init__(self, app: ASGIApp, router: ClusterRouter, api_keys: ApiKeys) -> None:
        self.app = app
        self.router = router
        self.api_keys = api_keys
        self.timeout_s = router.settings.query.consistency_timeout_s
        """How long a request waits for its partition's owner (during a rebalance)."""
        self.max_body_bytes = router.settings.limits.max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        stamped = self._stamp(send)
        route = route_of(str(scope.get("method", "")), str(scope.get("path", "")))
        if route is None:
            await self.app(scope, receive, stamped)
            return
        body, complete = await _read_body(receive, self.max_body_bytes)
        replay = _replayer(body, complete, receive)
        owner = _owner(scope, body, route) if complete else None
        if owner is None:  # the app answers the malformed (or too large) request
            await self.app(scope, replay, stamped)
            return
        headers = _headers(scope)
        partition = self.router.partition_of(owner)
        try:
            if not self.api_keys.open:
                refuse_repeated_credentials(scope.get("headers", []))
            hop = self.router.check_forwarded(headers)
        except Forbidden:  # Unauthenticated too
            await self.app(scope, replay, stamped)  # the app answers 401 or 403 the same way
            return
        if hop is not None:
            await self._serve_hop(partition, route, scope, replay, stamped)
            return
        caller = self._caller(headers, owner)
        if caller is None:  # 401 or 403, answered by the app
            await self.app(scope, replay, stamped)
            return
        # The access log names the owner of a forwarded request too (the app, if it serves
        # the request here after all, sets its own caller).
        caller.acted_for.append(owner)
        scope.setdefault("state", {})[CALLER_STATE] = caller
        target = str(scope.get("raw_path", b"").decode() or scope["path"])
        if scope.get("query_string"):
            target += "?" + scope["query_string"].decode()
        # A write waits briefly for an owner (a crash, a rebalance): it used to be appended
        # at once, and is appended here when none is found.
        timeout_s = (
            min(self.timeout_s, WRITE_OWNER_WAIT_S) if route.appended_here else self.timeout_s
        )
        clock = asyncio.get_running_loop()
        deadline = clock.time() + timeout_s
        resendable = carries_request_ids(route, body)
        while True:
            try:
                response = await self.router.forward(
                    partition,
                    str(scope.get("method", "")),
                    target,
                    caller=caller.owner,
                    body=body,
                    headers=headers,
                    timeout_s=max(0.0, deadline - clock.time()),
                    resendable=resendable,
                )
            except NotOwner as error:
                refused = (NodeRefused, HopBroken, HopRefused)
                if route.appended_here and not isinstance(error, refused):
                    await self.app(scope, replay, stamped)  # no owner reached: the log takes it
                    return
                await _refuse(stamped, error, not_owner=False)
                return
            if response is not None:
                break
            if not is_repeatable(str(scope.get("method", "")), target):
                await self.app(scope, replay, stamped)  # it may have written: never twice
                return
            if await self._served_here(partition, scope, replay, stamped, deadline=deadline):
                return
            replay = _replayer(body, complete, receive)  # the partition moved: route again
        relayed: list[tuple[bytes, bytes]] = [
            (name.encode(), value.encode())
            for name, value in response.headers.items()
            if name in ("content-type", "retry-after", "www-authenticate", SERVED_BY_HEADER)
        ]
        relayed.append((FORWARDED_BY_HEADER.encode(), self.router.url.encode()))
        relayed.append((b"content-length", str(len(response.content)).encode()))
        start: HTTPResponseStartEvent = {
            "type": "http.response.start",
            "status": response.status_code,
            "headers": relayed,
        }
        await send(start)
        await send(_body(response.content))

    def _caller(self, headers: dict[str, str], owner: str) -> Caller | None:
        """The caller, when its key may act for ``owner`` (else the app answers it)."""
        try:
            caller = self.api_keys.authenticate(
                headers.get("authorization"), headers.get("x-api-key")
            )
        except Unauthenticated:
            return None
        return caller if caller.is_admin or caller.owner == owner else None

    async def _serve_hop(
        self, partition: int, route: Route, scope: Scope, receive: Receive, send: Send
    ) -> None:
        # A write needs the owner, not a caught-up partition: it is appended at once (its
        # read-your-writes wait is the app's), as it was before writes were forwarded.
        if self.router.owns(partition) and (
            route.appended_here or await self.router.runner.wait_serving(partition, self.timeout_s)
        ):
            if not is_repeatable(str(scope.get("method", "")), str(scope.get("path", ""))):
                await self.app(scope, receive, send)
                return
            if await self._served_here(partition, scope, receive, send, deadline=None):
                return
        error = NotOwner(f"{self.router.url} does not own partition {partition}")
        await _refuse(send, error, not_owner=True)

    async def _served_here(
        self, partition: int, scope: Scope, receive: Receive, send: Send, *, deadline: float | None
    ) -> bool:
        """Let the app answer a read of ``partition``; False, with nothing sent, when the
        app answered 503 because a rebalance took the partition from this node while the
        request was on its way in, and ``deadline`` (None: a hop, refused as not the
        owner) leaves time to route it again. A rebalance revokes every partition and
        gives most back; the ones that moved left such a read with no shard (a scale-out's
        handovers measured 3 of 3,200 reads)."""
        held: list[Message] = []

        async def hold_unavailable(message: Message) -> None:
            if held or (message["type"] == "http.response.start" and message["status"] == 503):
                held.append(message)
                return
            await send(message)

        await self.app(scope, receive, hold_unavailable)
        retry = deadline is None or asyncio.get_running_loop().time() < deadline - 0.1
        if held and retry and not self.router.owns(partition):
            return False
        for message in held:
            await send(message)
        return True

    def _stamp(self, send: Send) -> Send:
        url = self.router.url.encode()

        async def stamped(message: Message) -> None:
            if message["type"] == "http.response.start" and url:
                headers = list(message.get("headers", []))
                headers.append((SERVED_BY_HEADER.encode(), url))
                message = {**message, "headers": headers}
            await send(message)

        return stamped


def _owner(scope: Scope, body: bytes, route: Route) -> str | None:
    """The owner a request names (None: the app answers the request)."""
    if route.owner_in == "query":
        values = parse_qs(scope.get("query_string", b"").decode(errors="replace")).get("user_id")
        return values[0] if values and values[0] else None
    try:
        if route.owner_in == "batch":  # one owner's batch goes to its node; others stay here
            owners = {message.user_id for message in _owners_of_batch.decode(body).messages}
            return owners.pop() if len(owners) == 1 else None
        return _owner_of_body.decode(body).user_id or None
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):
        return None  # the app answers it (400), counted and logged as such


def _headers(scope: Scope) -> dict[str, str]:
    return {
        name.decode("latin-1").lower(): value.decode("latin-1")
        for name, value in scope.get("headers", [])
    }


async def _read_body(receive: Receive, limit: int) -> tuple[bytes, bool]:
    """The body, and whether it is all there: reading stops past ``limit`` bytes (the app
    then reads the rest and answers 413), before anyone is authenticated."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return b"".join(chunks), False
        chunk = message.get("body", b"")
        chunks.append(chunk)
        size += len(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks), True
        if size > limit:
            return b"".join(chunks), False


def _replayer(body: bytes, complete: bool, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Any:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": not complete}
        return await receive()

    return replay


async def _refuse(send: Send, error: NotOwner, *, not_owner: bool) -> None:
    # A write the hop may have delivered: its outcome is unknown, as an append the log did
    # not confirm (a 503 told clients to send it again).
    unknown = isinstance(error, HopBroken)
    status, kind = (504, "append_unconfirmed") if unknown else (503, "shard_unavailable")
    content = msgspec.json.encode(ErrorBody(kind, str(error)))
    headers: list[tuple[bytes, bytes]] = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(content)).encode()),
    ]
    if not unknown:  # a retry of a write of unknown outcome is safe only with a request_id
        headers.append((b"retry-after", str(max(1, round(error.retry_after_s))).encode()))
    if not_owner:
        headers.append((NOT_OWNER_HEADER.encode(), b"1"))
    start: HTTPResponseStartEvent = {
        "type": "http.response.start",
        "status": status,
        "headers": headers,
    }
    await send(start)
    await send(_body(content))


def _body(content: bytes) -> HTTPResponseBodyEvent:
    return {"type": "http.response.body", "body": content, "more_body": False}
