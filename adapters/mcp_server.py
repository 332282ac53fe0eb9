"""``prme mcp``: PRME as a Model Context Protocol server (the official ``mcp`` SDK).

Tools (``remember``, ``recall``, ``history``, ``forget_message``, ``archive_memory``) and
resources (a session's history, a recall's receipt) over one ``AsyncMemoryClient``:
embedded on a data directory, or in front of a running ``prme serve`` (``--url``).

Transports: stdio (the default; the local user who started the process is trusted, and
``--user-id`` pins the owner) or streamable HTTP (``--http``) with the API-key rules of
``prme serve``: every request presents a key, a key bound to one owner acts only for that
owner, and without keys the server only listens on loopback.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import sys
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from importlib.metadata import PackageNotFoundError, version
from typing import Any, Literal
from urllib.parse import parse_qs, quote, unquote, urlsplit

import anyio
import mcp_types as types
import msgspec
import pydantic
import uvicorn
from mcp.server import Server, ServerRequestContext
from mcp.server.auth.middleware.bearer_auth import AuthenticatedUser
from mcp.server.auth.provider import AccessToken
from mcp.server.stdio import stdio_server
from mcp.shared.exceptions import MCPError
from mcp.shared.message import SessionMessage
from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from prme.projectors.embeddings.protocol import EmbeddingProvider
from prme.query.auth import (
    ADMIN,
    ApiKeys,
    Caller,
    check_bind_safety,
    refuse_repeated_credentials,
)
from prme.query.client import AsyncMemoryClient
from prme.query.http_types import check_ids
from prme.query.listening import listen
from prme.schemas.config import Settings
from prme.schemas.errors import (
    ConfigurationError,
    Forbidden,
    InvalidInput,
    NotFound,
    PRMEError,
    Unauthenticated,
    shown,
)

from .mcp_access import OwnerPolicy, Receipts
from .mcp_tools import (
    HISTORY_URI,
    RECEIPT_URI,
    HistoryArgs,
    MemoryTools,
    decode_as,
    error_kind,
)

CALLER_KEY = "prme.caller"
"""Where :class:`ApiKeyGate` leaves the authenticated caller in the ASGI scope."""
RESOURCE_NOT_FOUND = -32002  # the MCP specification's code for an unknown resource
FORBIDDEN = -32003  # a server-defined JSON-RPC error: the caller may not read it
JSON = "application/json"
INSTRUCTIONS = (
    "PRME is long-term memory. Call `recall` before answering when earlier conversations "
    "may matter; call `remember` for facts, preferences and decisions worth keeping. "
    "Memories are per owner; the server or your API key decides the owner."
)


class PrmeMcp:
    """The MCP server object: tools and resources over one client."""

    def __init__(
        self,
        client: AsyncMemoryClient,
        settings: Settings,
        *,
        transport: Literal["stdio", "http"],
    ) -> None:
        self.policy = OwnerPolicy(settings.mcp.user_id)
        receipts = Receipts(settings.mcp.receipts, ttl_s=settings.mcp.receipt_ttl_s)
        self.tools = MemoryTools(client, self.policy, receipts)
        self._transport = transport
        self.server: Server[Any] = Server(
            "prme",
            version=_version(),
            title="PRME memory",
            instructions=INSTRUCTIONS,
            on_list_tools=self._list_tools,
            on_call_tool=self._call_tool,
            on_list_resources=self._list_resources,
            on_list_resource_templates=self._list_resource_templates,
            on_read_resource=self._read_resource,
        )

    def caller(self, ctx: ServerRequestContext[Any, Any]) -> Caller:
        """Over stdio the local user is trusted (``--user-id`` still pins the owner); over
        HTTP the caller is whoever :class:`ApiKeyGate` authenticated for this request."""
        if self._transport == "stdio":
            return Caller(ADMIN)
        request = ctx.request
        caller = request.scope.get(CALLER_KEY) if request is not None else None
        if not isinstance(caller, Caller):
            raise MCPError(FORBIDDEN, "unauthenticated: this request carried no API key")
        return caller

    async def _list_tools(
        self, ctx: ServerRequestContext[Any, Any], params: types.PaginatedRequestParams | None
    ) -> types.ListToolsResult:
        return types.ListToolsResult(tools=self.tools.listing(self.caller(ctx)))

    async def _call_tool(
        self, ctx: ServerRequestContext[Any, Any], params: types.CallToolRequestParams
    ) -> types.CallToolResult:
        return await self.tools.call(params.name, params.arguments, self.caller(ctx))

    async def _list_resources(
        self, ctx: ServerRequestContext[Any, Any], params: types.PaginatedRequestParams | None
    ) -> types.ListResourcesResult:
        receipts = self.tools.receipts.visible(self.caller(ctx), self.policy)
        return types.ListResourcesResult(
            resources=[
                types.Resource(
                    uri=RECEIPT_URI.format(request_id=receipt.request_id),
                    name=f"receipt {receipt.request_id}",
                    # Never the query: a listing is no place for what an owner asked.
                    description="How a recall found its results",
                    mime_type=JSON,
                )
                for receipt in receipts
            ]
        )

    async def _list_resource_templates(
        self, ctx: ServerRequestContext[Any, Any], params: types.PaginatedRequestParams | None
    ) -> types.ListResourceTemplatesResult:
        return types.ListResourceTemplatesResult(
            resource_templates=[
                types.ResourceTemplate(
                    uri_template=HISTORY_URI,
                    name="session history",
                    description=(
                        "The messages of one chat session of an owner, in order, with clears "
                        "and deletions applied (JSON list of messages). scope defaults to "
                        "'default'; percent-encode ids that contain '/'."
                    ),
                    mime_type=JSON,
                ),
                types.ResourceTemplate(
                    uri_template=RECEIPT_URI,
                    name="recall receipt",
                    description=(
                        "The receipt of a recall: its query, channels with timings, each "
                        "result's ranks and scores, token cost. Kept in this server's memory "
                        "for a while (PRME_MCP__RECEIPT_TTL_S); only recent ones remain."
                    ),
                    mime_type=JSON,
                ),
            ]
        )

    async def _read_resource(
        self, ctx: ServerRequestContext[Any, Any], params: types.ReadResourceRequestParams
    ) -> types.ReadResourceResult:
        caller = self.caller(ctx)
        uri = str(params.uri)
        try:
            body = await self._resource_body(uri, caller)
        except NotFound as error:
            raise MCPError(RESOURCE_NOT_FOUND, f"not_found: {error}") from None
        except Forbidden as error:
            raise MCPError(FORBIDDEN, f"forbidden: {error}") from None
        except PRMEError as error:
            raise MCPError(types.INVALID_PARAMS, f"{error_kind(error)}: {error}") from None
        return types.ReadResourceResult(
            contents=[types.TextResourceContents(uri=uri, mime_type=JSON, text=body)]
        )

    async def _resource_body(self, uri: str, caller: Caller) -> str:
        parts = urlsplit(uri)
        segments = [unquote(s) for s in parts.path.split("/")[1:]]
        if parts.scheme != "prme" or not all(segments):
            raise NotFound(f"unknown resource {shown(uri)}")
        if parts.netloc == "receipts" and len(segments) == 1:
            receipt = await self.tools.receipt(segments[0], caller)
            return msgspec.json.encode(receipt).decode()
        if parts.netloc == "history" and len(segments) == 2:
            user_id, session_id = segments
            query = parse_qs(parts.query, keep_blank_values=True)
            unknown = set(query) - {"scope"}
            if unknown:
                raise InvalidInput(
                    f"unknown query parameter {shown(sorted(unknown)[0])} in {shown(uri)}"
                )
            scopes = query.get("scope", ["default"])
            if len(scopes) > 1:
                raise InvalidInput("query parameter 'scope' given more than once")
            fields = {"user_id": user_id, "session_id": session_id, "scope": scopes[0]}
            args = decode_as(HistoryArgs, fields)
            self.policy.check(caller, args.user_id)
            messages = await self.tools.client.history(
                args.user_id, args.session_id, scope=args.scope
            )
            return msgspec.json.encode(messages).decode()
        raise NotFound(f"unknown resource {shown(uri)}")


def history_uri(user_id: str, session_id: str, scope: str = "default") -> str:
    """The resource URI of a session's history."""
    uri = f"prme://history/{quote(user_id, safe='')}/{quote(session_id, safe='')}"
    return uri if scope == "default" else f"{uri}?scope={quote(scope, safe='')}"


class ApiKeyGate:
    """ASGI middleware: authenticate every HTTP request by its API key (``Authorization:
    Bearer <key>`` or ``X-API-Key``) before the MCP transport sees it; 401 otherwise. With
    no keys configured every caller is admin (allowed on loopback only).

    The key is also the request's ``user`` for the SDK's session manager, which ties a
    streamable-HTTP session to the principal that opened it and answers a request of
    another one (DELETE included) as for an unknown session: 404 "Session not found"."""

    def __init__(self, app: ASGIApp, keys: ApiKeys) -> None:
        self.app = app
        self.keys = keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            headers = Headers(scope=scope)
            try:
                if not self.keys.open:
                    refuse_repeated_credentials(scope["headers"])
                caller = self.keys.authenticate(
                    headers.get("authorization"), headers.get("x-api-key")
                )
            except Unauthenticated as error:
                response = JSONResponse(
                    {"error": "unauthenticated", "detail": str(error)},
                    status_code=401,
                    headers={"WWW-Authenticate": 'Bearer realm="prme"'},
                )
                await response(scope, receive, send)
                return
            scope[CALLER_KEY] = caller
            scope["user"] = session_principal(caller)
        await self.app(scope, receive, send)


def session_principal(caller: Caller) -> AuthenticatedUser:
    """The principal a streamable-HTTP session belongs to: the API key, by its digest (all
    callers of an open server are one)."""
    key = caller.key_id or "open"
    return AuthenticatedUser(AccessToken(token=key, client_id=key, scopes=[]))


@contextlib.asynccontextmanager
async def open_client(
    settings: Settings, embedding_provider: EmbeddingProvider | None = None
) -> AsyncIterator[AsyncMemoryClient]:
    """The client the tools use: ``settings.mcp.url`` if set, else the embedded pack.
    InvalidInput before anything opens when the pinned owner (``mcp.user_id``) is no owner
    id: every tool call would be refused for it."""
    if settings.mcp.user_id is not None:
        try:
            check_ids(user_id=settings.mcp.user_id)
        except InvalidInput as error:
            raise InvalidInput(f"mcp.user_id (--user-id): {error}") from None
    if settings.mcp.url:
        if embedding_provider is not None:
            raise ConfigurationError("embedding_provider applies to the embedded engine only")
        client = AsyncMemoryClient(url=settings.mcp.url, api_key=settings.mcp.api_key)
    else:
        client = AsyncMemoryClient(
            settings.data_dir, settings=settings, embedding_provider=embedding_provider
        )
    async with client:
        yield client


async def serve_stdio(
    settings: Settings, *, embedding_provider: EmbeddingProvider | None = None
) -> None:
    """Serve MCP over this process's stdin/stdout until stdin closes.

    The pack opens first, so a pack held by another process fails here, before the
    handshake, with PRME's own error."""
    async with contextlib.AsyncExitStack() as stack:
        with _stdout_on_stderr():
            client = await stack.enter_async_context(open_client(settings, embedding_provider))
        read, write = await stack.enter_async_context(stdio_server())
        app = PrmeMcp(client, settings, transport="stdio")
        with anyio.CancelScope() as scope, _on_signals(scope.cancel):
            answering = AnsweringUnreadLines(read, write)
            await app.server.run(answering, write, app.server.create_initialization_options())


class AnsweringUnreadLines:
    """The stdio read stream, answering each line the SDK could not read as a JSON-RPC
    message with a JSON-RPC error for the line's id (``null`` when the id cannot be read
    either): the SDK drops such a line, and a client waited for its answer forever (a
    tool call nested ~200 levels deep: the SDK's parser stops at 128; over HTTP it answers
    -32700)."""

    def __init__(self, inner: Any, write: Any) -> None:
        self._inner = inner
        self._write = write

    async def receive(self) -> Any:
        while True:
            item = await self._inner.receive()
            if not isinstance(item, Exception):
                return item
            await self._write.send(SessionMessage(unread_line_error(item)))

    async def aclose(self) -> None:
        await self._inner.aclose()

    def __aiter__(self) -> AnsweringUnreadLines:
        return self

    async def __anext__(self) -> Any:
        try:
            return await self.receive()
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            raise StopAsyncIteration from None

    def __getattr__(self, name: str) -> Any:  # last_context, ...
        return getattr(self._inner, name)


def unread_line_error(error: Exception) -> types.JSONRPCError:
    """The JSON-RPC error answering a line the SDK failed to read with ``error``: -32700
    (parse error) for JSON it could not parse, -32600 for JSON that is no JSON-RPC message."""
    errors = error.errors() if isinstance(error, pydantic.ValidationError) else []
    first: dict[str, Any] = dict(errors[0]) if errors else {}
    line = first.get("input")
    request_id = None
    if isinstance(line, str):
        with contextlib.suppress(ValueError, RecursionError):
            parsed = json.loads(line)
            found = parsed.get("id") if isinstance(parsed, dict) else None
            if isinstance(found, (str, int)) and not isinstance(found, bool):
                request_id = found
    unparsable = first.get("type") == "json_invalid" or not errors
    code, kind = (-32700, "Parse error") if unparsable else (-32600, "Invalid Request")
    detail = str(first.get("msg") or error)[:300]
    return types.JSONRPCError(
        jsonrpc="2.0", id=request_id, error=types.ErrorData(code=code, message=f"{kind}: {detail}")
    )


@contextlib.contextmanager
def _stdout_on_stderr() -> Iterator[None]:
    """fd 1 is the MCP wire: until stdio_server() takes it over, writes to it (from Python
    or a native library) go to stderr."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


async def serve_http(
    settings: Settings,
    *,
    embedding_provider: EmbeddingProvider | None = None,
    log_level: str = "warning",
    on_ready: Callable[[str], None] | None = None,
) -> None:
    """Serve MCP over streamable HTTP on ``settings.mcp.host:port`` at ``settings.mcp.path``
    until SIGINT/SIGTERM. ``on_ready`` gets the endpoint URL once the socket is bound.

    Raises ConfigurationError before opening anything when it would listen beyond loopback
    without API keys."""
    mcp = settings.mcp
    check_bind_safety(msgspec.structs.replace(settings.service, host=mcp.host))
    family = socket.AF_INET6 if ":" in mcp.host else socket.AF_INET
    sock = listen(mcp.host.strip("[]"), mcp.port)
    try:
        async with open_client(settings, embedding_provider) as client:
            app = PrmeMcp(client, settings, transport="http")
            starlette = app.server.streamable_http_app(streamable_http_path=mcp.path, host=mcp.host)
            config = uvicorn.Config(
                ApiKeyGate(starlette, ApiKeys(settings.service.api_keys)),
                log_level=log_level,
                lifespan="on",
                server_header=False,
            )
            server = _Server(config)
            port = sock.getsockname()[1]
            host = f"[{mcp.host.strip('[]')}]" if family == socket.AF_INET6 else mcp.host
            if on_ready is not None:
                on_ready(f"http://{host}:{port}{mcp.path}")
            with _on_signals(lambda: setattr(server, "should_exit", True)):
                await server.serve(sockets=[sock])
    finally:
        sock.close()


class _Server(uvicorn.Server):
    """uvicorn, minus its own signal handling: after a graceful stop it raises the signal
    again, which would end the process before the engine closes. ``_on_signals`` asks it
    to stop instead, and the caller closes the engine."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


@contextlib.contextmanager
def _on_signals(stop: Callable[[], object]) -> Iterator[None]:
    """Call ``stop`` on SIGINT or SIGTERM while inside (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    loop = asyncio.get_running_loop()
    signals = (signal.SIGINT, signal.SIGTERM)
    for signum in signals:
        loop.add_signal_handler(signum, stop)
    try:
        yield
    finally:
        for signum in signals:
            loop.remove_signal_handler(signum)


def announce(url: str) -> None:
    print(f"prme mcp: streamable HTTP on {url}", file=sys.stderr, flush=True)


def _version() -> str:
    try:
        return version("prme")
    except PackageNotFoundError:
        return "0"
