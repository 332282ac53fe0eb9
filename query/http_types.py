"""The API types: request bodies (strict, unknown fields refused) and the replies that are
not already engine types. ``HttpMemoryBackend`` encodes the same Structs the service
decodes, and the engine takes ``RetrieveRequest`` as is: each parameter and its default is
declared here once."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from datetime import datetime
from typing import Annotated, Any, TypeVar
from urllib.parse import urlsplit

import msgspec

from prme.producers.producer import (
    MAX_REASON_CHARS,
    MessageDraft,
    check_content,
    check_history,
    check_occurred_at,
)
from prme.producers.transport import Position
from prme.schemas.cluster import ClusterMember, TopicRefused
from prme.schemas.errors import ConfigurationError, InvalidInput, patterns_in_words
from prme.schemas.records import (
    ERASABLE_OWNER_PATTERN,
    HTTP_ERASABLE_OWNER_PATTERN,
    ID_PATTERN,
    PATH_ID_PATTERN,
    USER_ID_PATTERN,
    VISIBLE_TEXT_PATTERN,
    Role,
    UserIdField,
)

from .fusion import FusionName
from .types import Bundle, MemoryResult, Receipt

TOKEN_PATTERN = r"^[0-9]+:[0-9]+$"
"""A consistency token as a query parameter, ``partition:offset``."""
PATTERN_WORDS = {
    USER_ID_PATTERN: "Expected an owner id without control characters, invisible characters "
    "(U+200B zero-width space, U+200D zero-width joiner as in joined emoji, U+FEFF, ...) or "
    "whitespace at either end, and not `*` (every owner, in API keys)",
    ERASABLE_OWNER_PATTERN: "Expected an owner id without control characters or whitespace at "
    "either end",
    HTTP_ERASABLE_OWNER_PATTERN: "Expected an owner id without control characters or "
    "whitespace at either end, and not `*` (every owner, in API keys: erase owners one at a "
    "time)",
    ID_PATTERN: "Expected an id without control characters or invisible characters (U+200B "
    "zero-width space, U+200D zero-width joiner as in joined emoji, U+FEFF, ...)",
    PATH_ID_PATTERN: "Expected an event or node id: no `/`, control characters or invisible "
    "characters",
    VISIBLE_TEXT_PATTERN: "Expected text that shows something: not only whitespace, control "
    "characters or invisible ones (U+200B zero-width space, U+200D zero-width joiner, U+FEFF, "
    "...)",
    TOKEN_PATTERN: "Expected a consistency token `partition:offset`",
}
"""What the request types' patterns mean, for error messages."""

IdField = Annotated[
    str,
    msgspec.Meta(
        min_length=1,
        max_length=256,
        pattern=ID_PATTERN,
        description="1-256 characters, no control or invisible characters",
    ),
]
PathIdField = Annotated[
    str,
    msgspec.Meta(
        min_length=1,
        max_length=256,
        pattern=PATH_ID_PATTERN,
        description="an event or node id: 1-256 characters, no /, control or invisible ones",
    ),
]
NameField = Annotated[str, msgspec.Meta(min_length=1)]
"""A message's ``name``, ``tool_call_id`` or ``message_id``: null or not empty (the
producer's ``check_names`` holds in-process writes to the same rule)."""
QueryText = Annotated[str, msgspec.Meta(min_length=1, pattern=VISIBLE_TEXT_PATTERN)]
Positive = Annotated[int, msgspec.Meta(ge=1)]
FiniteFloat = Annotated[float, msgspec.Meta(ge=-sys.float_info.max, le=sys.float_info.max)]
"""A float that is not NaN or an infinity (in-process a caller can pass either)."""
MAX_TOP_K = 1000
"""The most results one retrieve returns (each channel gathers at least this many
candidates, so the bound keeps one request from allocating without limit)."""
TopK = Annotated[int, msgspec.Meta(ge=1, le=MAX_TOP_K)]


class Body(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Base of every request body (unknown fields refused)."""


BodyT = TypeVar("BodyT", bound=Body)

_ID_TYPES: dict[str, Any] = {
    "user_id": UserIdField,
    "session_id": IdField,
    "scope": IdField,
    "event_id": PathIdField,
    "node_id": PathIdField,
    "by_node_id": PathIdField,
}


def check_ids(**ids: object) -> None:
    """Owner, session, scope, event and node ids checked as the service checks them (an
    argument passed in-process is not decoded): InvalidInput naming the argument, e.g. for
    ``user_id=""``, ``" alice "`` or ``None``."""
    for name, value in ids.items():
        try:
            msgspec.convert(value, _ID_TYPES[name])
        except msgspec.ValidationError as error:
            reason = patterns_in_words(str(error), PATTERN_WORDS)
            raise InvalidInput(f"invalid {name}: {reason} - at `{name}`") from None


ErasableOwnerId = Annotated[
    str, msgspec.Meta(min_length=1, max_length=256, pattern=ERASABLE_OWNER_PATTERN)
]


def check_erasable(user_id: object) -> None:
    """An owner id as erasure takes it (``ERASABLE_OWNER_PATTERN``)."""
    try:
        msgspec.convert(user_id, ErasableOwnerId)
    except msgspec.ValidationError as error:
        reason = patterns_in_words(str(error), PATTERN_WORDS)
        raise InvalidInput(f"invalid user_id: {reason} - at `user_id`") from None


def checked(request: BodyT) -> BodyT:
    """``request`` checked as the service checks a decoded body (a Struct built in-process
    is not): InvalidInput naming the field, e.g. for a ``top_k`` of ``"5"``."""
    try:
        return msgspec.convert(msgspec.structs.asdict(request), type(request))
    except msgspec.ValidationError as error:
        reason = patterns_in_words(str(error), PATTERN_WORDS)
        raise InvalidInput(f"invalid request: {reason}") from error


class HistoryMessageIn(Body, frozen=True, kw_only=True):
    """A message of a chat history (owner, session and scope come from the request)."""

    content: str | list[dict[str, Any]]
    """Text or content blocks that show something (``check_content``) unless ``tool_calls``
    or ``fields`` is given."""
    role: Role = "user"
    name: NameField | None = None
    tool_call_id: NameField | None = None
    tool_calls: list[dict[str, Any]] = []
    message_id: NameField | None = None
    fields: dict[str, Any] = {}
    metadata: dict[str, Any] = {}
    occurred_at: datetime | None = None
    request_id: IdField | None = None

    def __post_init__(self) -> None:
        # Decoding a body names the message's path; the producer applies the same rules.
        check_content(self.content, self.tool_calls, self.fields, at="")
        check_occurred_at(self.occurred_at, at="")

    @classmethod
    def of(cls, draft: MessageDraft) -> HistoryMessageIn:
        return cls(**{name: getattr(draft, name) for name in _MESSAGE_FIELDS})


class MemoryIn(HistoryMessageIn, frozen=True, kw_only=True):
    """One memory to store: a message with its owner, session and scope."""

    user_id: UserIdField
    session_id: IdField = "default"
    scope: IdField = "default"

    @classmethod
    def of_draft(cls, draft: MessageDraft) -> MemoryIn:
        fields = {name: getattr(draft, name) for name in _DRAFT_FIELDS if name != "owner"}
        return cls(user_id=draft.owner, **fields)

    def draft(self) -> MessageDraft:
        fields = {name: getattr(self, name) for name in _DRAFT_FIELDS if name != "owner"}
        return MessageDraft(owner=self.user_id, **fields)


_DRAFT_FIELDS = tuple(f.name for f in msgspec.structs.fields(MessageDraft))
_MESSAGE_FIELDS = tuple(f.name for f in msgspec.structs.fields(HistoryMessageIn))


class StoreRequest(MemoryIn, frozen=True, kw_only=True):
    wait: bool = True
    """Return once the memory is retrievable (read-your-writes)."""


class StoreManyRequest(Body, frozen=True, kw_only=True):
    messages: list[MemoryIn]
    wait: bool = True


class HistoryWriteRequest(Body, frozen=True, kw_only=True):
    """Add messages to, or replace, the chat history of (user_id, session_id, scope)."""

    user_id: UserIdField
    session_id: IdField
    messages: list[HistoryMessageIn]
    scope: IdField = "default"
    wait: bool = True

    @classmethod
    def of(
        cls,
        user_id: str,
        session_id: str,
        drafts: Sequence[MessageDraft],
        *,
        scope: str,
        wait: bool,
        mismatch: str,
    ) -> HistoryWriteRequest:
        """The request for ``drafts`` (InvalidInput(``mismatch``) if one is of another
        history)."""
        check_history(user_id, session_id, scope, drafts, mismatch)
        messages = [HistoryMessageIn.of(d) for d in drafts]
        return cls(
            user_id=user_id, session_id=session_id, messages=messages, scope=scope, wait=wait
        )

    def drafts(self) -> list[MessageDraft]:
        return [
            MessageDraft(
                owner=self.user_id,
                session_id=self.session_id,
                scope=self.scope,
                **msgspec.structs.asdict(message),
            )
            for message in self.messages
        ]


class ClearHistoryRequest(Body, frozen=True, kw_only=True):
    user_id: UserIdField
    session_id: IdField
    scope: IdField = "default"
    wait: bool = True


class RetrieveRequest(Body, frozen=True, kw_only=True):
    query: QueryText
    user_id: UserIdField
    scope: IdField | None = None
    top_k: TopK = 10
    token_budget: Positive = 4096
    min_score: FiniteFloat | None = None
    after: Position | None = None
    """A consistency token from a write: wait until it is applied before reading."""
    include_archived: bool = False
    fusion: FusionName | None = None


class ArchiveRequest(Body, frozen=True, kw_only=True):
    user_id: UserIdField
    reason: Annotated[str, msgspec.Meta(max_length=MAX_REASON_CHARS)] | None = None
    wait: bool = True


class RestoreRequest(Body, frozen=True, kw_only=True):
    user_id: UserIdField
    wait: bool = True


class SupersedeRequest(Body, frozen=True, kw_only=True):
    user_id: UserIdField
    by_node_id: PathIdField
    wait: bool = True


class RenderedBundle(Bundle, frozen=True, kw_only=True):
    """The bundle plus ``text``, its ``render()`` output, ready for a prompt."""

    text: str


class RetrieveReply(msgspec.Struct, frozen=True, kw_only=True):
    """``RetrieveResponse`` on the wire (decodes as one: ``bundle.text`` is extra)."""

    results: list[MemoryResult]
    bundle: RenderedBundle
    receipt: Receipt


class ErrorBody(msgspec.Struct, frozen=True):
    """Every error response: a stable ``error`` kind and a message for people."""

    error: str
    detail: str


SECRET_HEADER = "x-prme-cluster-secret"
"""On a forwarded request: the cluster's shared secret."""
CALLER_HEADER = "x-prme-forwarded-caller"
"""On a forwarded request: the owner (or ``*``) whose key the entry node authenticated."""
OPEN_ENTRY_HEADER = "x-prme-forwarded-open"
"""On a forwarded request: the entry node has no API keys (every caller is ``*`` there)."""


def node_urls(url: str | Sequence[str]) -> list[str]:
    """The node URLs a client or command was given, without a trailing ``/``;
    ConfigurationError for one that is not ``http(s)://host[:port]`` (``127.0.0.1:8765``
    was taken and failed at the first request with httpx's words)."""
    urls = [url] if isinstance(url, str) else list(url)
    if not urls:
        raise ConfigurationError("url: give at least one node URL")
    for each in urls:
        try:
            parts = urlsplit(each) if isinstance(each, str) else None
            valid = (
                parts is not None
                and parts.scheme in ("http", "https")
                and bool(parts.hostname)
                and (parts.port is None or parts.port > 0)  # a bad port raises ValueError
            )
        except ValueError:
            valid = False
        if not valid:
            raise ConfigurationError(
                f"url {each!r} is not a node URL: give http://host:port (or https://...)"
            )
    return [each.rstrip("/") for each in urls]


SERVED_BY_HEADER = "x-prme-served-by"
"""On every response of a served node: the node that answered."""
FORWARDED_BY_HEADER = "x-prme-forwarded-by"
"""On a response: the entry node forwarded the request (one hop more than needed)."""
NOT_OWNER_HEADER = "x-prme-not-owner"
"""On a 503: this node does not own the partition (any more); ask the map again."""
STARTING_HEADER = "x-prme-starting"
"""On a 503: this node is starting and serves nothing yet (no request reached its app)."""


class WaitRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """``POST /v1/cluster/wait`` (node to node): return once ``partition`` has applied
    ``offset`` on the node that owns it (read-your-writes for a write another node
    appended)."""

    partition: int
    offset: int
    timeout_s: float


class ClusterView(msgspec.Struct, frozen=True, kw_only=True):
    """``GET /v1/cluster``: the map this node routes with, and what it serves itself."""

    node: str | None
    """This node's advertised URL (None: not a served node)."""
    partitions: int
    generation: int | None
    """The map's generation (None before the group handed one out)."""
    members: list[ClusterMember]
    """Every node: its URL, the partitions it owns and those it keeps as standbys (a
    ``prme project`` worker has an empty URL: it projects, it serves nothing)."""
    refused: list[str] = []
    """Nodes the group gave nothing because their cluster secret is not the others'."""
    duplicates: list[str] = []
    """URLs of nodes the group gave nothing because another member advertises them too."""
    topic: str = ""
    """The topic the group reads, whose partitions the map covers."""
    other_topic: list[TopicRefused] = []
    """Nodes the group gave nothing because they read another topic."""
    owned: list[int]
    """Partitions this node owns now."""
    serving: list[int]
    """Of those, the ones caught up and answering (the rest are being restored)."""
    standbys: dict[int, int] = {}
    """Standby copies kept here: partition -> the offset applied so far."""


class Health(msgspec.Struct, frozen=True):
    status: str


class Readiness(msgspec.Struct, frozen=True, kw_only=True):
    ready: bool
    detail: str
    partitions: list[int]
    """The partitions this process projects (and can answer for)."""
    lag: int
    """Records on the log not yet applied to those partitions' read models."""


def format_token(token: Position) -> str:
    """A consistency token as a query parameter: ``partition:offset``."""
    return f"{token.partition}:{token.offset}"


def parse_token(text: str) -> Position:
    """The inverse of :func:`format_token` (InvalidInput naming the parameter)."""
    partition, sep, offset = text.partition(":")
    try:
        if not sep:
            raise ValueError
        return Position(int(partition), int(offset))
    except ValueError:
        raise InvalidInput(
            f"after must be a consistency token 'partition:offset', got {text!r} - at query "
            "parameter `after`"
        ) from None


NODE_KEEP_ALIVE_S = 5
"""How long a node keeps an idle connection open (uvicorn's ``timeout_keep_alive``)."""
