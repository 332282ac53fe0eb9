"""The HTTP service: a Litestar app over one opened :class:`MemoryEngine`.

Routes live under ``/v1`` (see ``docs/HTTP.md``); the OpenAPI document, generated from the
msgspec types, is served at ``/schema/openapi.json``. Request bodies are decoded strictly
(no type coercion, unknown fields refused) before anything is written.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version
from typing import Annotated, Any, Generic, TypeVar

import msgspec
from litestar import Litestar, Request, Response, Router, delete, get, head, post
from litestar._openapi.schema_generation import SchemaCreator
from litestar.connection import ASGIConnection
from litestar.datastructures import State
from litestar.di import NamedDependency, Provide
from litestar.dto import MsgspecDTO
from litestar.exceptions import HTTPException, ValidationException
from litestar.handlers import BaseRouteHandler
from litestar.middleware import DefineMiddleware
from litestar.openapi import OpenAPIConfig, ResponseSpec
from litestar.openapi.spec import Components, Reference, Schema, SecurityScheme
from litestar.params import JSONBody, PathParameter, QueryParameter
from litestar.typing import FieldDefinition

from prme.projectors.status import partition_statuses, projector_failure, read_log_ends
from prme.schemas.codec import explain_json_error
from prme.schemas.config import Settings
from prme.schemas.errors import (
    TOO_DEEP,
    InsufficientSpace,
    InvalidInput,
    PRMEError,
    ShardUnavailable,
    Unauthenticated,
    patterns_in_words,
)
from prme.schemas.records import HTTP_ERASABLE_OWNER_PATTERN, Message
from prme.schemas.validation_hints import validation_hint

from .auth import ApiKeys, Caller, refuse_repeated_credentials
from .cluster import NotOwner
from .engine import MemoryEngine
from .forwarding import ForwardingMiddleware
from .http_errors import HTTP_KINDS, status_of
from .http_types import (
    ID_PATTERN,
    NOT_OWNER_HEADER,
    PATH_ID_PATTERN,
    PATTERN_WORDS,
    TOKEN_PATTERN,
    USER_ID_PATTERN,
    ArchiveRequest,
    ClearHistoryRequest,
    ClusterView,
    ErrorBody,
    Health,
    HistoryWriteRequest,
    Readiness,
    RenderedBundle,
    RestoreRequest,
    RetrieveReply,
    RetrieveRequest,
    StoreManyRequest,
    StoreRequest,
    SupersedeRequest,
    WaitRequest,
    parse_token,
)
from .observe import CALLER_STATE, RequestObserver, metrics_endpoint, status_endpoint
from .openapi import PROTECTED_ERRORS, StrictBodySchemaPlugin, error_responses
from .request_target import StrictRequestTarget, check_query_parameters
from .types import EventView, StoreResult

T = TypeVar("T", bound=msgspec.Struct)
log = logging.getLogger(__name__)


class StrictBody(MsgspecDTO[T], Generic[T]):
    """Decodes the request body strictly into its Struct (Litestar's default coerces
    ``"10"`` to ``10``); errors name the field, e.g. ``Expected `int`, got `str` - at
    `$.top_k```."""

    @classmethod
    def create_openapi_schema(
        cls, field_definition: FieldDefinition, handler_id: str, schema_creator: SchemaCreator
    ) -> Schema | Reference:
        """The body's schema from the Struct it is decoded into (the DTO's generated
        transfer type would lose the field constraints)."""
        return schema_creator.for_field_definition(FieldDefinition.from_annotation(cls.model_type))

    def decode_bytes(self, value: bytes) -> Any:
        if not value.strip():
            raise InvalidInput(_MISSING_BODY)
        try:
            return msgspec.json.decode(value, type=self.model_type)
        except msgspec.DecodeError as error:
            explained = explain_json_error(error, value)
            if explained is error:
                raise
            raise explained from error


_MISSING_BODY = "a JSON request body is required"
# -- dependencies ---------------------------------------------------------------------


def authenticating_guard(
    engine: MemoryEngine, api_keys: ApiKeys
) -> Callable[[ASGIConnection[Any, Any, Any, Any], BaseRouteHandler], None]:
    """The guard of the protected routes: it names the caller before anything reads the
    body, so a request without a valid key is 401 whatever its body holds."""

    def authenticate(connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
        if not api_keys.open:
            refuse_repeated_credentials(connection.scope["headers"])
        headers = connection.headers
        hop = None if engine.router is None else engine.router.check_forwarded(headers)
        if hop is not None:  # forwarded by a node that authenticated the key: its caller
            caller = Caller(hop)
        else:
            caller = api_keys.authenticate(headers.get("authorization"), headers.get("x-api-key"))
        connection.state[CALLER_STATE] = caller  # the access log hashes the owners acted for

    return authenticate


async def provide_caller(request: Request[Any, Any, Any]) -> Caller:
    caller: Caller = request.state[CALLER_STATE]  # set by the guard
    return caller


EngineDep = NamedDependency[MemoryEngine]
CallerDep = NamedDependency[Caller]
UserId = Annotated[
    str,
    QueryParameter(
        description="the owner acted on (1-256 characters, no control or invisible "
        "characters, no surrounding space)",
        min_length=1,
        max_length=256,
        pattern=USER_ID_PATTERN,
    ),
]
ErasedUserId = Annotated[
    str,
    QueryParameter(
        description="the owner erased (1-256 characters, no control characters, no "
        "surrounding space: one written before ids refused invisible characters too; not "
        "`*`, which stands for every owner in API keys)",
        min_length=1,
        max_length=256,
        pattern=HTTP_ERASABLE_OWNER_PATTERN,
    ),
]
Wait = Annotated[bool, QueryParameter(description="return once the write is applied")]
_ID_RULE = "1-256 characters, no control or invisible characters"
_PATH_ID_RULE = "1-256 characters, no /, control or invisible characters"
SessionId = Annotated[
    str,
    QueryParameter(
        description=f"the chat session ({_ID_RULE})",
        min_length=1,
        max_length=256,
        pattern=ID_PATTERN,
    ),
]
Scope = Annotated[
    str,
    QueryParameter(
        name="scope",
        description=f"the memory scope ({_ID_RULE})",
        min_length=1,
        max_length=256,
        pattern=ID_PATTERN,
    ),
]
EventId = Annotated[
    str,
    PathParameter(
        description=f"the event ({_PATH_ID_RULE})",
        min_length=1,
        max_length=256,
        pattern=PATH_ID_PATTERN,
    ),
]
NodeId = Annotated[
    str,
    PathParameter(
        description=f"the memory node, mem:<event id> ({_PATH_ID_RULE})",
        min_length=1,
        max_length=256,
        pattern=PATH_ID_PATTERN,
    ),
]


def protected_post(path: str, body: type[msgspec.Struct], summary: str, **options: Any) -> Any:
    """``@post`` for a route behind a key whose body is ``body``, decoded strictly, with
    every error it can answer in the OpenAPI document."""
    return post(
        path,
        dto=StrictBody[body],  # type: ignore[valid-type]
        return_dto=None,
        summary=summary,
        responses=PROTECTED_ERRORS,
        **options,
    )


# -- open routes ----------------------------------------------------------------------


@get("/health", summary="Liveness", tags=["service"])
async def health() -> Health:
    return Health(status="ok")


@get(
    "/ready",
    summary="Readiness: projecting, and caught up",
    tags=["service"],
    responses={503: ResponseSpec(Readiness, description="not ready: see detail")},
)
async def ready(engine: EngineDep) -> Response[Readiness]:
    body = await readiness(engine)
    return Response(body, status_code=200 if body.ready else 503)


@head("/health", summary="Liveness, without a body (load balancers' HEAD checks)", tags=["service"])
async def health_head() -> None:
    return None


@head(
    "/ready",
    summary="Readiness as a status only: 200 or 503",
    tags=["service"],
    responses={503: ResponseSpec(None, description="not ready: GET says why")},
)
async def ready_head(engine: EngineDep) -> Response[None]:
    return Response(None, status_code=200 if (await readiness(engine)).ready else 503)


async def readiness(engine: MemoryEngine) -> Readiness:
    """Projecting and caught up (a serve-only node: routing), and if not, why."""
    runner = engine.runner
    shards = dict(runner.shards)
    ends = await read_log_ends(runner)  # bounded: a probe answers whatever the log does
    lag = sum(s.lag_records for s in await partition_statuses(runner, ends=ends))
    ok, detail = True, "projecting"
    if not engine.settings.cluster.project:
        cluster_map = None if engine.router is None else engine.router.cluster_map
        ok = cluster_map is not None
        detail = "routing (serve-only)" if ok else "no cluster map from the group yet"
    elif (failure := projector_failure(runner)) is not None:
        ok, detail = False, failure
    elif isinstance(retrying := runner.retrying, InsufficientSpace):
        ok, detail = False, f"the projector waits: {retrying}"
    elif retrying is not None:
        ok, detail = False, f"the projector waits out a log error and tries again: {retrying!r}"
    elif (refusal := runner.refusal) is not None:
        ok, detail = False, f"the group gave this node no partitions: {refusal}"
    elif not shards:
        ok, detail = False, "no partitions assigned to this process yet"
    elif behind := runner.records_behind():
        ok, detail = False, f"catching up: {behind} records behind"
    else:
        try:
            # Returns at once for an applied offset; raises if the projector has stopped.
            partition = next(iter(shards))
            await runner.wait_applied(partition, -1, 0.0)
        except ShardUnavailable as error:
            ok, detail = False, str(error)
    if ok and (standby_failure := runner.standbys.failure) is not None:
        detail += f"; standby replicas failing (the owners serve): {standby_failure!r}"
    if ends.unavailable is not None and engine.settings.cluster.project:
        # Without the log a member cannot tell whether it still owns its partitions.
        known = "never read" if ends.age_s is None else f"last read {ends.age_s:.0f}s ago"
        ok = False
        detail = f"{ends.unavailable} (log end unknown: {known}); {detail}"
    return Readiness(ready=ok, detail=detail, partitions=sorted(shards), lag=lag)


# -- writes ---------------------------------------------------------------------------


@protected_post("/memories", StoreRequest, summary="Store one memory")
async def store(data: JSONBody[StoreRequest], engine: EngineDep, caller: CallerDep) -> StoreResult:
    caller.authorize(data.user_id)
    return (await engine.store_many([data.draft()], wait=data.wait))[0]


@protected_post(
    "/memories/batch", StoreManyRequest, summary="Store several memories atomically (all or none)"
)
async def store_many(
    data: JSONBody[StoreManyRequest], engine: EngineDep, caller: CallerDep
) -> list[StoreResult]:
    caller.authorize_all({m.user_id for m in data.messages})
    return await engine.store_many([m.draft() for m in data.messages], wait=data.wait)


def _history_write(path: str, summary: str, method: str) -> Any:
    """The route of a history write: the engine's ``method`` (add or replace) on the body."""

    @protected_post(path, HistoryWriteRequest, summary=summary, operation_id=method)
    async def write(
        data: JSONBody[HistoryWriteRequest], engine: EngineDep, caller: CallerDep
    ) -> list[StoreResult]:
        caller.authorize(data.user_id)
        writer = getattr(engine, method)
        return list(
            await writer(
                data.user_id, data.session_id, data.drafts(), scope=data.scope, wait=data.wait
            )
        )

    return write


add_messages = _history_write(
    "/history/messages", "Append messages to a chat history", "add_messages"
)
replace_history = _history_write(
    "/history/replace",
    "Replace a chat history atomically (a clear marker plus the new messages)",
    "replace_history",
)


@protected_post(
    "/history/clear", ClearHistoryRequest, status_code=200, summary="Clear a chat history"
)
async def clear_history(
    data: JSONBody[ClearHistoryRequest], engine: EngineDep, caller: CallerDep
) -> StoreResult:
    caller.authorize(data.user_id)
    return await engine.clear_history(
        data.user_id, data.session_id, scope=data.scope, wait=data.wait
    )


@delete(
    "/history/messages/{event_id:str}",
    status_code=200,
    summary="Remove one message from its chat history",
    responses=PROTECTED_ERRORS,
)
async def delete_message(
    event_id: EventId,
    user_id: UserId,
    engine: EngineDep,
    caller: CallerDep,
    wait: Wait = True,
) -> StoreResult:
    caller.authorize(user_id)
    return await engine.delete_message(user_id, event_id, wait=wait)


@protected_post(
    "/nodes/{node_id:str}/archive",
    ArchiveRequest,
    status_code=200,
    summary="Archive a memory node (it leaves normal retrieval)",
)
async def archive(
    node_id: NodeId, data: JSONBody[ArchiveRequest], engine: EngineDep, caller: CallerDep
) -> StoreResult:
    caller.authorize(data.user_id)
    return await engine.archive(node_id, data.user_id, reason=data.reason, wait=data.wait)


@protected_post(
    "/nodes/{node_id:str}/restore",
    RestoreRequest,
    status_code=200,
    summary="Bring an archived or superseded node back",
)
async def restore(
    node_id: NodeId, data: JSONBody[RestoreRequest], engine: EngineDep, caller: CallerDep
) -> StoreResult:
    caller.authorize(data.user_id)
    return await engine.restore(node_id, data.user_id, wait=data.wait)


@protected_post(
    "/nodes/{node_id:str}/supersede",
    SupersedeRequest,
    status_code=200,
    summary="Replace a node by another (it leaves retrieval)",
)
async def supersede(
    node_id: NodeId, data: JSONBody[SupersedeRequest], engine: EngineDep, caller: CallerDep
) -> StoreResult:
    caller.authorize(data.user_id)
    return await engine.supersede(node_id, data.by_node_id, data.user_id, wait=data.wait)


@delete(
    "/owners",
    status_code=200,
    summary="Erase every trace of an owner (admin or the owner)",
    responses=PROTECTED_ERRORS,
)
async def erase_owner(
    user_id: ErasedUserId, engine: EngineDep, caller: CallerDep, wait: Wait = True
) -> StoreResult:
    caller.authorize(user_id)
    return await engine.erase_owner(user_id, wait=wait)


# -- reads ----------------------------------------------------------------------------
# Litestar reserves the handler argument name ``scope`` (the ASGI scope), hence ``scope_``.


@protected_post(
    "/retrieve",
    RetrieveRequest,
    status_code=200,
    summary="Retrieve memories: results, a token-budgeted bundle and a receipt",
)
async def retrieve(
    data: JSONBody[RetrieveRequest], engine: EngineDep, caller: CallerDep
) -> RetrieveReply:
    caller.authorize(data.user_id)
    response = await engine.retrieve_request(data)
    if engine.router is not None:
        receipt = msgspec.structs.replace(response.receipt, served_by=engine.router.url)
        response = msgspec.structs.replace(response, receipt=receipt)
    bundle = RenderedBundle(
        **msgspec.structs.asdict(response.bundle), text=response.bundle.render()
    )
    return RetrieveReply(results=response.results, bundle=bundle, receipt=response.receipt)


@get(
    "/history",
    summary="Read a chat history (clear, replace and delete applied)",
    responses=PROTECTED_ERRORS,
)
async def history(
    user_id: UserId,
    engine: EngineDep,
    caller: CallerDep,
    session_id: SessionId = "default",
    scope_: Scope = "default",
    limit: Annotated[
        int | None, QueryParameter(description="the newest N messages (at least 1)", ge=1)
    ] = None,
    after: Annotated[
        str | None,
        QueryParameter(
            description="consistency token 'partition:offset' of one of the owner's writes",
            pattern=TOKEN_PATTERN,
        ),
    ] = None,
) -> list[Message]:
    caller.authorize(user_id)
    token = parse_token(after) if after is not None else None
    return await engine.history(user_id, session_id, scope=scope_, limit=limit, after=token)


@get(
    "/events/{event_id:str}", summary="The original record of an event", responses=PROTECTED_ERRORS
)
async def get_event(
    event_id: EventId, user_id: UserId, engine: EngineDep, caller: CallerDep
) -> EventView:
    caller.authorize(user_id)
    return await engine.get_event(event_id, user_id)


@get(
    "/events/{event_id:str}/nodes",
    summary="The ids of the nodes derived from an event",
    responses=PROTECTED_ERRORS,
)
async def get_event_nodes(
    event_id: EventId, user_id: UserId, engine: EngineDep, caller: CallerDep
) -> list[str]:
    caller.authorize(user_id)
    return await engine.get_event_nodes(event_id, user_id)


# -- cluster --------------------------------------------------------------------------


@get("/cluster", summary="The cluster map: which node owns each partition", tags=["cluster"])
async def cluster(engine: EngineDep) -> ClusterView:
    router = engine.router
    cluster_map = None if router is None else router.cluster_map
    here = engine.runner
    return ClusterView(
        node=router.url if router is not None else None,
        partitions=engine.settings.log.partitions,
        generation=None if cluster_map is None else cluster_map.generation,
        members=[] if cluster_map is None else list(cluster_map.members),
        refused=[] if cluster_map is None else list(cluster_map.refused),
        duplicates=[] if cluster_map is None else sorted(cluster_map.duplicates.values()),
        topic="" if cluster_map is None else cluster_map.topic,
        other_topic=[] if cluster_map is None else list(cluster_map.other_topic),
        owned=sorted(here.shards),
        serving=sorted(p for p in here.shards if here.serving(p)),
        standbys=here.standbys.positions(),
    )


@post(
    "/cluster/wait",
    dto=StrictBody[WaitRequest],
    return_dto=None,
    status_code=200,
    summary="Node to node: return once this node has applied a partition's offset",
    description="Authenticated by the cluster secret (X-PRME-Cluster-Secret), not an API key.",
    tags=["cluster"],
    responses=error_responses(400, 401, 403, 413, 503, 504),
)
async def cluster_wait(
    request: Request[Any, Any, Any], data: JSONBody[WaitRequest], engine: EngineDep
) -> Health:
    if engine.router is None or engine.router.check_forwarded(request.headers) is None:
        raise Unauthenticated("POST /v1/cluster/wait is for the nodes of a cluster")
    if data.partition not in engine.runner.shards:
        raise NotOwner(f"{engine.router.url} does not own partition {data.partition}")
    timeout = min(data.timeout_s, engine.settings.query.consistency_timeout_s * 3)
    await engine.runner.wait_applied(data.partition, data.offset, max(0.0, timeout))
    return Health(status="applied")


# -- errors ---------------------------------------------------------------------------


def _error(
    status: int, kind: str, detail: str, headers: dict[str, str] | None = None, **extra: Any
) -> Response[Any]:
    headers = dict(headers or {})
    if status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    body: Any = ErrorBody(kind, detail)
    if extra:
        body = {**msgspec.structs.asdict(body), **extra}
    return Response(body, status_code=status, headers=headers or None)


def on_prme_error(_: Request[Any, Any, Any], error: Exception) -> Response[Any]:
    known = status_of(error) if isinstance(error, PRMEError) else None
    if known is not None:
        status, kind = known
        if status >= 500:
            log.warning("request failed: %s", error)
        headers: dict[str, str] = {}
        written = getattr(error, "written", None)
        if status == 503 and not written:
            # A write on the log is not to be sent again (without request ids it would be
            # written twice): its answer says what was written, and invites no resend.
            retry_after_s = error.retry_after_s if isinstance(error, ShardUnavailable) else 1.0
            headers["Retry-After"] = str(max(1, round(retry_after_s)))
        if isinstance(error, NotOwner):
            headers[NOT_OWNER_HEADER] = "1"
        if written:  # appended before it failed: say what is on the log
            return _error(status, kind, str(error), headers, written=written)
        return _error(status, kind, str(error), headers)
    log.exception("unexpected PRME error", exc_info=error)
    return _error(500, "internal", str(error))


def on_decode_error(request: Request[Any, Any, Any], error: Exception) -> Response[ErrorBody]:
    if isinstance(error, msgspec.ValidationError):
        reason = patterns_in_words(str(error), PATTERN_WORDS)
        body = request.route_handler.parsed_data_field
        struct = None if body is None else body.annotation
        if isinstance(struct, type) and issubclass(struct, msgspec.Struct):
            reason += validation_hint(struct, str(error))
        return _error(400, "invalid_input", f"invalid request body: {reason}")
    return _error(400, "invalid_input", f"malformed JSON request body: {error}")


def on_http_error(request: Request[Any, Any, Any], error: Exception) -> Response[ErrorBody]:
    assert isinstance(error, HTTPException)
    status = error.status_code
    detail = str(error.detail)
    if isinstance(error, ValidationException) and isinstance(error.extra, list):
        reasons = [
            _MISSING_BODY
            if item.get("key") == "data" and _source(item) == "body parameter"
            else f"{patterns_in_words(str(item.get('message')), PATTERN_WORDS)} - at "
            f"{_source(item)} `{item.get('key')}`"
            for item in error.extra
            if isinstance(item, dict)
        ]
        detail = "; ".join(reasons) or detail
    elif status == 413:
        limit = request.app.state.max_body_bytes
        detail = f"request body is over the limit of {limit} bytes (limits.max_body_bytes)"
    if status >= 500:
        log.error("request failed: %s", error)
    kind = HTTP_KINDS.get(status, "internal" if status >= 500 else "error")
    return _error(status, kind, detail, dict(error.headers or {}))  # 405 keeps its Allow


def _source(item: dict[str, Any]) -> str:
    source = item.get("source", "parameter")
    return f"{getattr(source, 'value', source)} parameter"


def on_recursion(request: Request[Any, Any, Any], error: Exception) -> Response[ErrorBody]:
    """A body nested deeper than the decoder goes (msgspec says so in its message) is the
    client's error; any other RecursionError is ours."""
    if "deserializing" in str(error):
        return _error(400, "invalid_input", f"malformed JSON request body: {TOO_DEEP}")
    return on_unexpected(request, error)


def on_unexpected(_: Request[Any, Any, Any], error: Exception) -> Response[ErrorBody]:
    log.exception("unexpected error", exc_info=error)
    return _error(500, "internal", f"internal error: {type(error).__name__}")


# -- the app --------------------------------------------------------------------------

PROTECTED = [
    store,
    store_many,
    add_messages,
    replace_history,
    clear_history,
    delete_message,
    archive,
    restore,
    supersede,
    erase_owner,
    retrieve,
    history,
    get_event,
    get_event_nodes,
]


def create_app(engine: EngineDep, settings: Settings | None = None) -> Litestar:
    """The Litestar app serving ``engine`` (which the caller opened and will close).

    API keys and the body-size limit come from ``settings`` (default: the engine's).
    """
    settings = settings or engine.settings
    api_keys = ApiKeys(settings.service.api_keys)
    security: list[dict[str, list[str]]] = [{"bearer": []}, {"apiKey": []}]
    protected = Router(
        "/v1",
        route_handlers=PROTECTED,
        dependencies={"caller": Provide(provide_caller)},
        guards=[authenticating_guard(engine, api_keys), check_query_parameters],
        security=security,
    )
    open_routes = Router(
        "/v1", route_handlers=[health, health_head, ready, ready_head, cluster, cluster_wait]
    )
    middleware = [
        DefineMiddleware(RequestObserver, metrics=engine.metrics),
        DefineMiddleware(StrictRequestTarget),
    ]
    if engine.router is not None:
        middleware.append(
            DefineMiddleware(ForwardingMiddleware, router=engine.router, api_keys=api_keys)
        )
    return Litestar(
        route_handlers=[protected, open_routes, metrics_endpoint, status_endpoint],
        middleware=middleware,
        logging_config=None,  # logging is the process's to configure (prme.logs), not the app's
        dependencies={
            "engine": Provide(lambda: engine, use_cache=True, sync_to_thread=False),
            "api_keys": Provide(lambda: api_keys, use_cache=True, sync_to_thread=False),
        },
        exception_handlers={
            PRMEError: on_prme_error,
            msgspec.DecodeError: on_decode_error,
            RecursionError: on_recursion,
            HTTPException: on_http_error,
            Exception: on_unexpected,
        },
        plugins=[StrictBodySchemaPlugin()],
        request_max_body_size=settings.limits.max_body_bytes,
        state=State({"max_body_bytes": settings.limits.max_body_bytes}),
        openapi_config=OpenAPIConfig(
            title="PRME",
            version=_version(),
            description="Long-term memory for LLM agents (see docs/HTTP.md).",
            components=Components(
                security_schemes={
                    "bearer": SecurityScheme(type="http", scheme="bearer"),
                    "apiKey": SecurityScheme(
                        type="apiKey", name="X-API-Key", security_scheme_in="header"
                    ),
                },
            ),
        ),
    )


def _version() -> str:
    try:
        return version("prme-memory")
    except PackageNotFoundError:
        return "0"
