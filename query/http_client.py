"""``HttpMemoryBackend``: the engine's async methods over the HTTP service (``prme serve``).

``AsyncMemoryClient(url=..., api_key=...)`` uses it in place of a ``MemoryEngine``: same
methods, same signatures, same result types, and HTTP errors become the same exceptions.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Self, TypeVar
from urllib.parse import quote

import httpx
import msgspec

from prme.producers.partitioner import Partitioner
from prme.producers.producer import (
    ADDITION_MISMATCH,
    REPLACEMENT_MISMATCH,
    MessageDraft,
    check_finite_numbers,
)
from prme.producers.transport import Position
from prme.schemas.errors import InvalidInput, PRMEError, TransportError
from prme.schemas.records import Message

from .backend import MemoryBackend
from .http_errors import error_of
from .http_types import (
    FORWARDED_BY_HEADER,
    NOT_OWNER_HEADER,
    ArchiveRequest,
    ClearHistoryRequest,
    ClusterView,
    ErrorBody,
    HistoryWriteRequest,
    MemoryIn,
    RestoreRequest,
    RetrieveRequest,
    StoreManyRequest,
    StoreRequest,
    SupersedeRequest,
    check_ids,
    format_token,
    node_urls,
)
from .pooled_http import ResendingPool
from .routes import safe_to_resend
from .types import EventView, RetrieveResponse, StoreResult, with_record

T = TypeVar("T")


class HttpMemoryBackend(MemoryBackend):
    """An ``httpx.AsyncClient`` speaking to ``/v1`` of a PRME service or cluster.

    ``url``: one node, or several nodes of a cluster. The client reads the cluster map
    (``GET /v1/cluster``) from the first node that answers and sends each call straight to
    the node that owns its owner's partition (one hop); it reads the map again when a node
    answers that it forwarded the call or does not own the partition, or cannot be reached.
    ``timeout_s`` bounds every request (connect, read, write, pool); server-side writes
    wait for the projector by default, so a store followed by a read sees the write.
    ``transport`` lets a caller pass another httpx transport (an ASGI app, a proxy).
    """

    def __init__(
        self,
        url: str | Sequence[str],
        api_key: str | None = None,
        *,
        timeout_s: float = 30.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._routes = ClusterRoutes(node_urls(url))
        self._http = ResendingPool(
            headers=headers,
            timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, 10.0)),
            transport=transport,
        )
        self._encoder = msgspec.json.Encoder()

    async def close(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # -- writing -----------------------------------------------------------------------

    async def store_request(self, request: StoreRequest) -> StoreResult:
        return await self._call("POST", "memories", StoreResult, json=request)

    async def store_many(
        self, drafts: Sequence[MessageDraft], *, wait: bool = True
    ) -> list[StoreResult]:
        body = StoreManyRequest(messages=[MemoryIn.of_draft(d) for d in drafts], wait=wait)
        return await self._call("POST", "memories/batch", list[StoreResult], json=body)

    async def add_messages(
        self,
        user_id: str,
        session_id: str,
        drafts: Sequence[MessageDraft],
        *,
        scope: str = "default",
        wait: bool = True,
    ) -> list[StoreResult]:
        body = HistoryWriteRequest.of(
            user_id, session_id, drafts, scope=scope, wait=wait, mismatch=ADDITION_MISMATCH
        )
        return await self._call("POST", "history/messages", list[StoreResult], json=body)

    async def clear_history(
        self, user_id: str, session_id: str, *, scope: str = "default", wait: bool = True
    ) -> StoreResult:
        body = ClearHistoryRequest(user_id=user_id, session_id=session_id, scope=scope, wait=wait)
        return await self._call("POST", "history/clear", StoreResult, json=body)

    async def replace_history(
        self,
        user_id: str,
        session_id: str,
        drafts: Sequence[MessageDraft],
        *,
        scope: str = "default",
        wait: bool = True,
    ) -> list[StoreResult]:
        body = HistoryWriteRequest.of(
            user_id, session_id, drafts, scope=scope, wait=wait, mismatch=REPLACEMENT_MISMATCH
        )
        return await self._call("POST", "history/replace", list[StoreResult], json=body)

    async def delete_message(
        self, user_id: str, event_id: str, *, wait: bool = True
    ) -> StoreResult:
        check_ids(event_id=event_id)
        params = {"user_id": user_id, "wait": _flag(wait)}
        path = f"history/messages/{_segment(event_id)}"
        return await self._call("DELETE", path, StoreResult, params=params)

    async def archive(
        self, node_id: str, user_id: str, *, reason: str | None = None, wait: bool = True
    ) -> StoreResult:
        check_ids(node_id=node_id)
        body = ArchiveRequest(user_id=user_id, reason=reason, wait=wait)
        return await self._call(
            "POST", f"nodes/{_segment(node_id)}/archive", StoreResult, json=body
        )

    async def restore(self, node_id: str, user_id: str, *, wait: bool = True) -> StoreResult:
        check_ids(node_id=node_id)
        body = RestoreRequest(user_id=user_id, wait=wait)
        return await self._call(
            "POST", f"nodes/{_segment(node_id)}/restore", StoreResult, json=body
        )

    async def supersede(
        self, node_id: str, by_node_id: str, user_id: str, *, wait: bool = True
    ) -> StoreResult:
        check_ids(node_id=node_id)
        body = SupersedeRequest(user_id=user_id, by_node_id=by_node_id, wait=wait)
        path = f"nodes/{_segment(node_id)}/supersede"
        return await self._call("POST", path, StoreResult, json=body)

    async def erase_owner(self, user_id: str, *, wait: bool = True) -> StoreResult:
        params = {"user_id": user_id, "wait": _flag(wait)}
        return await self._call("DELETE", "owners", StoreResult, params=params)

    # -- reading -----------------------------------------------------------------------

    async def retrieve_request(self, request: RetrieveRequest) -> RetrieveResponse:
        return await self._call("POST", "retrieve", RetrieveResponse, json=request)

    async def history(
        self,
        user_id: str,
        session_id: str = "default",
        *,
        scope: str = "default",
        limit: int | None = None,
        after: Position | None = None,
    ) -> list[Message]:
        params: dict[str, str | int] = {"user_id": user_id, "session_id": session_id}
        params["scope"] = scope
        if limit is not None:
            params["limit"] = limit
        if after is not None:
            params["after"] = format_token(after)
        return await self._call("GET", "history", list[Message], params=params)

    async def get_event(self, event_id: str, user_id: str) -> EventView:
        check_ids(event_id=event_id)
        path = f"events/{_segment(event_id)}"
        return with_record(await self._call("GET", path, EventView, params={"user_id": user_id}))

    async def get_event_nodes(self, event_id: str, user_id: str) -> list[str]:
        check_ids(event_id=event_id)
        path = f"events/{_segment(event_id)}/nodes"
        return await self._call("GET", path, list[str], params={"user_id": user_id})

    # -- plumbing ----------------------------------------------------------------------

    async def _call(
        self,
        method: str,
        path: str,
        result: type[T],
        *,
        json: msgspec.Struct | None = None,
        params: dict[str, Any] | None = None,
        owner: str | None = None,
    ) -> T:
        try:
            content = None if json is None else self._encoder.encode(json)
            plain = None if json is None else msgspec.to_builtins(json)
        except (TypeError, ValueError, OverflowError) as error:
            raise InvalidInput(f"the request is not JSON-serializable: {error}") from error
        check_finite_numbers(plain, "$")  # the encoder wrote NaN and infinities as null
        headers = None if content is None else {"Content-Type": "application/json"}
        if owner is None:
            owner = _owner_in(json, params)
        response = await self._send(method, path, content, params, headers, owner)
        if response.is_error:
            raise error_from_response(response)
        try:
            return msgspec.json.decode(response.content, type=result)
        except msgspec.DecodeError as error:
            raise TransportError(f"{method} {path}: unexpected response ({error})") from error

    async def _send(
        self,
        method: str,
        path: str,
        content: bytes | None,
        params: dict[str, Any] | None,
        headers: dict[str, str] | None,
        owner: str | None,
    ) -> httpx.Response:
        """Send to the owner's node; on a stale map (forwarded, not the owner, node gone)
        read the map again and, once, resend to the node it names. A read, or a write with
        its request ids, whose pooled connection broke before any answer is sent once more
        on a new connection (``pooled_http``)."""
        for attempt in (0, 1):
            if self._routes.stale:
                await self._routes.refresh(self._http)
            node = self._routes.node_for(owner)
            try:
                response = await self._http.request(
                    method,
                    f"{node}/v1/{path}",
                    content=content,
                    params=params,
                    headers=headers,
                    resendable=safe_to_resend(method, f"/v1/{path}", content),
                )
            except httpx.InvalidURL as error:  # nothing was sent: an id too long for a URL
                raise InvalidInput(
                    f"{method} {path}: no URL can carry this request: {error}"
                ) from error
            except (httpx.ConnectError, httpx.ConnectTimeout) as error:  # nothing was sent
                self._routes.lost(node)
                if attempt or not self._routes.clustered:
                    raise TransportError(f"{method} {path}: {error}") from error
                continue
            except httpx.TimeoutException as error:
                raise TransportError(
                    f"{method} {path}: the service did not answer in time"
                ) from error
            except httpx.HTTPError as error:  # sent: resending could write it twice
                self._routes.lost(node)
                raise TransportError(f"{method} {path}: {error}") from error
            if FORWARDED_BY_HEADER in response.headers or NOT_OWNER_HEADER in response.headers:
                self._routes.stale = True  # answered, one hop more than needed: re-read
                if NOT_OWNER_HEADER in response.headers and not attempt:
                    continue
            return response
        raise AssertionError("unreachable")


class ClusterRoutes:
    """The client's copy of the cluster map: owner -> the URL of the node that owns it."""

    def __init__(self, seeds: list[str]) -> None:
        self.seeds = seeds
        self.stale = True
        self._owners: dict[int, str] = {}
        self._partitioner: Partitioner | None = None
        self._down: set[str] = set()

    @property
    def clustered(self) -> bool:
        return len(self.seeds) > 1 or bool(self._owners)

    def node_for(self, owner: str | None) -> str:
        """The owner's node; a seed (which forwards) when that node was unreachable."""
        if owner is not None and self._partitioner is not None:
            node = self._owners.get(self._partitioner(owner.encode()))
            if node and node not in self._down:
                return node
        alive = [s for s in self.seeds if s not in self._down] or self.seeds
        return alive[0]

    def lost(self, node: str) -> None:
        self._down.add(node)
        self.stale = True

    async def refresh(self, http: ResendingPool) -> None:
        """Read ``GET /v1/cluster`` from the first node that answers (seeds first, then
        the members the last map named); keep the old map if none does."""
        candidates = list(dict.fromkeys([*self.seeds, *self._owners.values()]))
        candidates.sort(key=lambda url: url in self._down)
        for url in candidates:
            try:
                response = await http.get(f"{url}/v1/cluster")
                view = msgspec.json.decode(response.content, type=ClusterView)
            except (httpx.HTTPError, msgspec.DecodeError):
                continue
            self.stale = False
            self._down.discard(url)
            owners = {p: m.url for m in view.members for p in m.partitions if m.url}
            if owners:
                if owners != self._owners:  # a new map: its nodes get a fresh chance
                    self._down.clear()
                self._owners = owners
                self._partitioner = Partitioner(view.partitions)
            return
        self.stale = False  # nothing answered: the next failure marks it stale again


def _owner_in(json: msgspec.Struct | None, params: dict[str, Any] | None) -> str | None:
    """The owner a request acts for: its ``user_id`` (a batch: its first message's)."""
    if params and isinstance(params.get("user_id"), str):
        return str(params["user_id"])
    user_id = getattr(json, "user_id", None)
    if isinstance(user_id, str):
        return user_id
    messages = getattr(json, "messages", None)
    if messages:
        return getattr(messages[0], "user_id", None)
    return None


def error_from_response(response: httpx.Response) -> PRMEError:
    """The exception an error response of a PRME node stands for."""
    try:
        body = msgspec.json.decode(response.content, type=ErrorBody)
        kind, detail = body.error, body.detail
    except msgspec.DecodeError:
        kind, detail = "", response.text[:500] or response.reason_phrase
        if "html" in response.headers.get("content-type", ""):  # a proxy's or another site's
            detail = (
                f"{response.status_code} {response.reason_phrase}, an HTML page: not a PRME "
                f"node's answer (is {response.request.url.join('/')} a PRME node?)"
            )
    return error_of(kind, response.status_code, detail)


def _segment(value: str) -> str:
    """``value`` as one URL path segment."""
    return quote(value, safe="")


def _flag(value: bool) -> str:
    return "true" if value else "false"
