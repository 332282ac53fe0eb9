"""The write API everything else uses: validate, build records, append, return tokens.

Validation happens before anything is appended: a bad record raises
:class:`~prme.schemas.errors.InvalidInput` naming the field, and nothing is written.
"""

from __future__ import annotations

import hashlib
import math
import re
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any, Literal

import msgspec
import uuid_utils

from prme.schemas.codec import encode_record
from prme.schemas.config import LimitsSettings
from prme.schemas.errors import (
    TOO_DEEP,
    InvalidInput,
    ShardUnavailable,
    TransportError,
    patterns_in_words,
)
from prme.schemas.metrics import Metrics, transport_label
from prme.schemas.records import (
    PATTERN_WORDS,
    UNSEEN_CHARACTERS,
    HistoryCleared,
    HistoryReplaced,
    Message,
    MessageDeleted,
    NodeArchived,
    NodeRestored,
    NodeSuperseded,
    OwnerErased,
    Record,
    has_only_text,
    has_visible_text,
    message_text,
)
from prme.schemas.sealing import DataKey

from .erasure_gate import ErasureGate
from .keys import KeyStore
from .sealing import RecordSealer
from .transport import LogItem, LogTransport, Position, dedupe_key

ControlKind = Literal[
    "history_cleared",
    "message_deleted",
    "node_archived",
    "node_restored",
    "node_superseded",
    "owner_erased",
]
_CONTROL_TYPES: dict[str, type[Record]] = {
    "history_cleared": HistoryCleared,
    "message_deleted": MessageDeleted,
    "node_archived": NodeArchived,
    "node_restored": NodeRestored,
    "node_superseded": NodeSuperseded,
    "owner_erased": OwnerErased,
}


class AppendReceipt(msgspec.Struct, frozen=True):
    """What a write returns: the event id and the consistency token."""

    event_id: str
    position: Position


class MessageDraft(msgspec.Struct, frozen=True, kw_only=True):
    """A message before it gets an envelope (the unit of batch and replacement writes)."""

    owner: str
    content: str | list[dict[str, Any]]
    role: str = "user"
    session_id: str = "default"
    scope: str = "default"
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[dict[str, Any]] = []
    message_id: str | None = None
    fields: dict[str, Any] = {}
    metadata: dict[str, Any] = {}
    occurred_at: datetime | None = None
    request_id: str | None = None


UNSEEN_CHARACTER = re.compile(f"[{UNSEEN_CHARACTERS}]")
"""Refused in new ids (owner, session, scope, request): C0 and C1 controls (NUL, the unit
separator, tabs, newlines) name nothing a person would pick, and break logs, headers and key
encodings; invisible characters (U+200B, U+FEFF, ...) make an id that looks like another."""
ID_FIELDS = ("session_id", "scope", "request_id")

ADDITION_MISMATCH = "each message must belong to the history it is added to"
REPLACEMENT_MISMATCH = "replacement messages must share the history's owner/session/scope"


def check_history(
    owner: str, session_id: str, scope: str, drafts: Sequence[MessageDraft], mismatch: str
) -> None:
    """InvalidInput(``mismatch``) unless every draft belongs to (owner, session, scope)."""
    for draft in drafts:
        if (draft.owner, draft.session_id, draft.scope) != (owner, session_id, scope):
            raise InvalidInput(mismatch)


def check_owner(owner: str, field: str = "owner") -> None:
    """InvalidInput if ``owner`` holds a control or invisible character, or is ``*`` (every
    owner, in API keys; the API's ``USER_ID_PATTERN``). The record's own checks, length and
    surrounding whitespace, run when it is built."""
    check_id(owner, field, "an owner id")
    if owner == "*":
        raise InvalidInput(
            f"an owner id may not be `*`: it stands for every owner in API keys - at $.{field}"
        )


def check_id(value: object, field: str, what: str | None = None) -> None:
    """InvalidInput naming ``field`` if ``value`` (an id) holds one of
    :data:`UNSEEN_CHARACTER` (the API's ``ID_PATTERN``, for writes that were not decoded
    from a body)."""
    found = UNSEEN_CHARACTER.search(value) if isinstance(value, str) else None
    if found is not None:
        raise InvalidInput(
            f"{what or field} may not contain a control character or an invisible one "
            f"(U+{ord(found.group()):04X} at index {found.start()}) - at $.{field}"
        )


def check_content(
    content: Any,
    tool_calls: Sequence[Any] = (),
    fields: Mapping[str, Any] | None = None,
    at: str = " - at $.content",
) -> None:
    """InvalidInput if ``content`` shows nothing: empty, or text (blocks) of whitespace,
    control and invisible characters only (a memory with no text is never retrieved), unless
    the message carries ``tool_calls`` (an assistant turn that only calls tools has empty
    content), ``fields`` (a framework's own form of the message: a chat history keeps an
    empty turn as it was said) or a block of another type than text (an image). ``at`` ends
    the message (msgspec adds its own path)."""
    if tool_calls or fields or (content and not has_only_text(content)):
        return
    if not content or not has_visible_text(message_text(content)):
        raise InvalidInput(
            "content must have a visible character (not only whitespace, control or "
            f"invisible characters) unless the message has tool_calls or fields{at}"
        )


NAMES = ("name", "tool_call_id", "message_id")
"""A message's optional names and ids: left out (None) or not empty."""


def check_names(fields: dict[str, Any]) -> None:
    """InvalidInput for a message field of :data:`NAMES` given as ``""``: an empty speaker
    name or id matches nothing and reads as absent in one place and present in another."""
    for name in NAMES:
        if fields.get(name) == "":
            raise InvalidInput(
                f"{name} must not be empty: leave it out (null) when there is none - at $.{name}"
            )


def check_occurred_at(occurred_at: object, at: str = " - at $.occurred_at") -> None:
    """InvalidInput for an ``occurred_at`` without a UTC offset (``2024-05-01T10:00:00``, a
    naive ``datetime``): it names no instant (the log would keep it as written, date cues
    would read it as UTC and the vector payload as this machine's local time). ``at`` ends
    the message, as for :func:`check_content`."""
    if isinstance(occurred_at, datetime) and occurred_at.utcoffset() is None:
        raise InvalidInput(
            f"occurred_at {occurred_at.isoformat()} has no UTC offset: send one, e.g. "
            "2024-05-01T10:00:00Z or 2024-05-01T12:00:00+02:00 (from Python an aware "
            f"datetime, e.g. datetime(2024, 5, 1, 10, tzinfo=UTC)){at}"
        )


NUMBER_RANGE = (-(2**63), 2**64 - 1)
"""What the log's msgpack can store of a number in free-form JSON (metadata, fields, tool
calls, content blocks); floats are held to it too, so one rule (and one JSON Schema bound)
covers every number."""


def check_numbers(value: Any, path: str) -> None:
    """InvalidInput naming the first number under ``value`` that is not finite or lies
    outside :data:`NUMBER_RANGE`."""
    low, high = NUMBER_RANGE
    for number, where in _numbers(value, path):
        _check_finite(number, where)
        if not low <= number <= high:
            raise InvalidInput(
                f"number {number!r} is outside the storable range -2**63 to 2**64-1 - at {where}"
            )


def check_finite_numbers(value: Any, path: str) -> None:
    """InvalidInput naming the first float under ``value`` that is NaN or an infinity: JSON
    has neither, and an encoder would write ``null`` in its place (a client checks its
    request so, instead of sending another one)."""
    for number, where in _numbers(value, path):
        _check_finite(number, where)


def _check_finite(number: float, where: str) -> None:
    if isinstance(number, float) and not math.isfinite(number):
        raise InvalidInput(
            f"number {number!r} is not finite (JSON has no NaN or Infinity) - at {where}"
        )


def _numbers(value: Any, path: str) -> Iterator[tuple[float, str]]:
    """Every number under ``value`` (free-form JSON: dicts, lists, tuples), with where."""
    if value is None or isinstance(value, str) or (type(value) in (dict, list) and not value):
        return  # the usual content, metadata and fields: nothing to walk
    for item, where in _leaves(value, path):
        if isinstance(item, int | float) and not isinstance(item, bool):
            yield item, where


def _leaves(value: Any, path: str) -> Iterator[tuple[Any, str]]:
    """Every value under ``value`` that is not a dict, list or tuple, with where, in order."""
    stack: list[tuple[Any, str]] = [(value, path)]
    while stack:
        item, where = stack.pop()
        if isinstance(item, dict):
            stack.extend((v, f"{where}.{k}") for k, v in reversed(item.items()))
        elif isinstance(item, list | tuple):
            stack.extend((v, f"{where}[{i}]") for i, v in reversed(list(enumerate(item))))
        else:
            yield item, where


def _unencodable_at(fields: dict[str, Any]) -> str:
    """`` - at <path>`` of the first text in ``fields`` that is not UTF-8 (a lone
    surrogate), or ``""``."""
    for item, where in _leaves(fields, "$"):
        if isinstance(item, str):
            try:
                item.encode()
            except UnicodeEncodeError:
                return f" - at {where}"
    return ""


def check_supersede(node_id: str, by_node_id: str) -> None:
    """InvalidInput if a node would supersede itself (it would leave retrieval with nothing
    in its place)."""
    if node_id == by_node_id:
        raise InvalidInput(
            f"a node cannot supersede itself: by_node_id names node {node_id!r} - at $.by_node_id"
        )


MAX_REASON_CHARS = 1024
"""The longest reason an archive may give (it is kept in the record and the graph)."""


def check_reason(reason: object) -> None:
    """InvalidInput for an archive reason longer than ``MAX_REASON_CHARS``."""
    if isinstance(reason, str) and len(reason) > MAX_REASON_CHARS:
        raise InvalidInput(
            f"reason is {len(reason)} characters, more than {MAX_REASON_CHARS} - at $.reason"
        )


FULL_DISK_RETRY_S = 10.0
"""The ``Retry-After`` of an append refused for want of disk space."""


def new_event_id() -> str:
    """A UUIDv7 string: unique and time-ordered."""
    return str(uuid_utils.uuid7())


def replacement_request_id(session_id: str, scope: str, messages: Sequence[Message]) -> str | None:
    """The request id of a replacement whose messages carry request ids (any of them):
    a hash of the history and of each message's fingerprint (its request id and all it
    says), so the same replacement sent again is the same events, marker included, and
    any other replacement is new (never a conflict). ``None`` when no message has one (the
    replacement is new each time it is sent)."""
    if not any(message.request_id for message in messages):
        return None
    material = [request_fingerprint(message) for message in messages]
    digest = hashlib.blake2b(
        msgspec.msgpack.encode([session_id, scope, material]), digest_size=16
    ).hexdigest()
    return f"replace:{digest}"


def deletion_request_id(event_id: str) -> str:
    """The request id of the deletion of message ``event_id``: the same each time, so a
    second delete is the first one's write (the log answers with its position and writes
    nothing; on Kafka best effort, as for any request id) and every read model applies
    it once. A message deleted stays deleted, so there is nothing a second delete could
    change."""
    return f"delete:{event_id}"


_REQUEST_EVENTS = uuid.UUID("5f0c2a57-61f3-4bd4-9d4e-8f3b7e1a2c90")
"""The namespace of the event ids derived from request ids (any fixed UUID)."""


def request_event_id(owner: str, request_id: str) -> str:
    """The event id of ``owner``'s write ``request_id``: a UUIDv5 of its dedupe key, the
    same each time the write is sent. So a retry the log deduplicates answers with the
    first write's ids, and one it does not (sent through another process) is the same
    event again, which every read model applies once."""
    return str(uuid.uuid5(_REQUEST_EVENTS, dedupe_key(owner, request_id)))


class Producer:
    """Builds and validates records, then appends them through a :class:`LogTransport`."""

    def __init__(
        self,
        transport: LogTransport,
        limits: LimitsSettings | None = None,
        metrics: Metrics | None = None,
        keys: KeyStore | None = None,
        refusal: Callable[[], str | None] | None = None,
        room: Callable[[], str | None] | None = None,
    ) -> None:
        """With ``keys``, records are sealed with their owner's data key on append.
        ``refusal`` says why nothing may be appended now (``ShardUnavailable``), or None;
        ``room`` the same for the disk, which does not stop an erasure (``free_space``)."""
        self._transport = transport
        self._refusal = refusal
        self._room = room
        self._sealer = None if keys is None else RecordSealer(keys)
        self._gate = ErasureGate()
        self._limits = limits or LimitsSettings()
        self._metrics = metrics if metrics is not None else Metrics(enabled=False)
        self._label = label = transport_label(transport)
        self._metrics.sample(
            "counter",
            "prme_log_dedupe_hits",
            "Appends answered with the first position of their request_id (nothing written)",
            ("transport",),
            lambda: [((label,), getattr(transport, "dedupe_hits", 0))],
        )

    @property
    def transport(self) -> LogTransport:
        return self._transport

    @property
    def limits(self) -> LimitsSettings:
        return self._limits

    def build_message(self, draft: MessageDraft) -> Message:
        """The validated ``message`` record for ``draft`` (raises InvalidInput)."""
        return self.build_message_item(msgspec.structs.asdict(draft))[0]

    def build_message_item(self, fields: dict[str, Any]) -> tuple[Message, LogItem]:
        """``build_message`` of a draft's ``fields`` (a dict of ``MessageDraft`` fields,
        taken over; absent ones keep their defaults) and the record's log item, encoded
        once: the bulk path, with no draft built and no second encoding."""
        try:
            return self._message_item(fields)
        except RecursionError as error:
            raise InvalidInput(f"the message has {TOO_DEEP}") from error

    def _message_item(self, fields: dict[str, Any]) -> tuple[Message, LogItem]:
        check_owner(fields["owner"])
        for name in ID_FIELDS:
            check_id(fields.get(name), name)
        check_content(fields["content"], fields.get("tool_calls", ()), fields.get("fields"))
        check_occurred_at(fields.get("occurred_at"))
        check_names(fields)
        for name in ("metadata", "fields"):
            self._check_json(name, fields.get(name, {}))
        for name in ("content", "tool_calls", "metadata", "fields"):
            check_numbers(fields.get(name), f"$.{name}")
        request_id = fields.get("request_id")
        event_id = (
            request_event_id(fields["owner"], request_id)
            if isinstance(request_id, str) and request_id
            else new_event_id()
        )
        fields.update(kind="message", event_id=event_id, recorded_at=_now())
        message, encoded = _convert(fields, Message)
        self._check_content_size(message)
        return message, log_item(message, encoded)

    def build_control(self, kind: ControlKind, owner: str, **fields: Any) -> Record:
        """The validated control or lifecycle record ``kind`` (raises InvalidInput)."""
        record_type = _CONTROL_TYPES.get(kind)
        if record_type is None:
            raise InvalidInput(f"unknown control kind {kind!r} (known: {sorted(_CONTROL_TYPES)})")
        if kind != "owner_erased":  # an owner written before the check may still be erased
            check_owner(owner)
            for name in ("session_id", "scope", "node_id", "by_node_id"):
                check_id(fields.get(name), name)
        if kind == "node_superseded":
            check_supersede(fields.get("node_id", ""), fields.get("by_node_id", ""))
        if kind == "node_archived":
            check_reason(fields.get("reason"))
        request_id = fields.get("request_id")
        event_id = (
            request_event_id(owner, request_id)
            if isinstance(request_id, str) and request_id
            else new_event_id()
        )
        fields.update(kind=kind, owner=owner, event_id=event_id, recorded_at=_now())
        return _convert(fields, record_type)[0]

    def build_replacement(
        self, owner: str, session_id: str, scope: str, drafts: Sequence[MessageDraft]
    ) -> list[Record]:
        """A ``history_replaced`` marker followed by the new messages (append atomically).

        When a message carries a request id, the replacement is one idempotent write: the
        marker's request id derives from the whole replacement (``replacement_request_id``)
        and each message's becomes ``<that>:<index>``. A retry is then the same events, and
        a later replacement repeating a message's request id writes that message anew
        (its own request id would name the earlier event, which the new clear hides)."""
        check_owner(owner)
        check_history(owner, session_id, scope, drafts, REPLACEMENT_MISMATCH)
        messages = [self.build_message(draft) for draft in drafts]
        request_id = replacement_request_id(session_id, scope, messages)
        if request_id is not None:
            messages = [
                self.build_message(msgspec.structs.replace(draft, request_id=f"{request_id}:{i}"))
                for i, draft in enumerate(drafts)
            ]
        marker, _ = _convert(
            {
                "kind": "history_replaced",
                "owner": owner,
                "session_id": session_id,
                "scope": scope,
                "event_id": (
                    new_event_id() if request_id is None else request_event_id(owner, request_id)
                ),
                "recorded_at": _now(),
                "request_id": request_id,
                "message_count": len(drafts),
            },
            HistoryReplaced,
        )
        return [marker, *messages]

    async def sealing_keys(self, owners: Iterable[str]) -> dict[str, DataKey] | None:
        """The keys this producer would seal ``owners``' records with now (created where
        an owner has none); ``None`` when it does not seal."""
        if self._sealer is None:
            return None
        return await self._sealer.keys.writing_keys(owners)

    async def append_message(self, draft: MessageDraft) -> AppendReceipt:
        return (await self.append_records([self.build_message(draft)]))[0]

    async def append_control(self, kind: ControlKind, owner: str, **fields: Any) -> AppendReceipt:
        return (await self.append_records([self.build_control(kind, owner, **fields)]))[0]

    async def append_records(
        self, records: Sequence[Record], *, atomic: bool = True
    ) -> list[AppendReceipt]:
        """Append already-validated records, atomically (all or none) unless told not to;
        at most ``limits.max_batch_records`` messages (one write request's bound; the clear
        marker a replacement adds is not the caller's, and is not counted)."""
        messages = sum(isinstance(record, Message) for record in records)
        if messages > self._limits.max_batch_records:
            raise InvalidInput(
                f"a write of {messages} messages exceeds limits.max_batch_records="
                f"{self._limits.max_batch_records} - at `$.messages`"
            )
        items = [log_item(record) for record in records]
        positions = await self.append_items(
            items, [record.event_id for record in records], atomic=atomic
        )
        return [AppendReceipt(r.event_id, p) for r, p in zip(records, positions, strict=True)]

    def held_sealing_keys(self, owners: Iterable[str]) -> dict[str, DataKey] | None:
        """The keys of ``owners`` this producer holds now (no store read, none created);
        ``None`` when it does not seal."""
        if self._sealer is None:
            return None
        return self._sealer.keys.held_writing_keys(owners)

    async def seal_items(self, items: Sequence[LogItem]) -> list[LogItem]:
        """``items`` as this producer appends them: sealed with their owners' keys (when
        it seals records)."""
        if self._sealer is None:
            return list(items)
        return await self._sealer.seal(items)

    async def append_items(
        self,
        items: Sequence[LogItem],
        event_ids: Sequence[str],
        *,
        atomic: bool = True,
        sealed: bool = False,
    ) -> list[Position]:
        """Append records already turned into log items (``log_item``; ``event_ids`` are
        theirs), with the same metrics and trace span as ``append_records`` but no bound on
        their count (the bulk ingest bounds its own batches). ``sealed``: every item went
        through :meth:`seal_items` (or was sealed with a key :meth:`sealing_keys` gave)
        already, so they are not looked at again."""
        self._check_room()  # (before sealing: a new owner's key is written then)
        async with self._gate.writing(item.key for item in items):
            if not sealed:
                items = await self.seal_items(items)
            return await self._append(items, event_ids, atomic=atomic)

    async def append_erasure(
        self, owner: str, erase_keys: Callable[[], Awaitable[None]]
    ) -> AppendReceipt:
        """Append ``owner_erased`` for ``owner``, then ``erase_keys()``, with no write of
        the owner by this producer between the two (:mod:`erasure_gate`)."""
        record = self.build_control("owner_erased", owner)
        async with self._gate.erasing(owner.encode("utf-8", "surrogatepass")):
            (position,) = await self._append([log_item(record)], [record.event_id], atomic=True)
            await erase_keys()
        return AppendReceipt(record.event_id, position)

    def _check_room(self) -> None:
        """``ShardUnavailable`` when the disk is too full for a write (an erasure, which
        does not come this way, is not refused: it is small, and a duty)."""
        if self._room is not None and (full := self._room()) is not None:
            refused = ShardUnavailable(f"nothing is appended: {full}")
            refused.retry_after_s = FULL_DISK_RETRY_S  # (space is not freed in a second)
            raise refused

    async def _append(
        self, items: Sequence[LogItem], event_ids: Sequence[str], *, atomic: bool
    ) -> list[Position]:
        if self._refusal is not None and (refusal := self._refusal()) is not None:
            raise ShardUnavailable(f"this node appends nothing: {refusal}")
        started = time.perf_counter()
        attributes = {"prme.transport": self._label, "prme.event_ids": list(event_ids)}
        with self._metrics.tracing.span("prme.append", attributes) as span:
            try:
                positions = await self._transport.append_many(items, atomic=atomic)
            except TransportError:
                self._metrics.transport_errors.labels(self._label, "append").inc()
                raise
            if span is not None:
                span.set_attribute("prme.partitions", sorted({p.partition for p in positions}))
        self._metrics.append_duration.labels(self._label).observe(time.perf_counter() - started)
        self._metrics.log_appends.labels(self._label).inc(len(items))
        return positions

    def _check_content_size(self, message: Message) -> None:
        content = message.content
        size = (
            len(content.encode()) if isinstance(content, str) else len(msgspec.json.encode(content))
        )
        if size > self._limits.max_content_bytes:
            raise InvalidInput(
                f"content is {size} bytes, over the limit of {self._limits.max_content_bytes} "
                "(limits.max_content_bytes) - at $.content"
            )

    def _check_json(self, name: str, value: Any) -> None:
        if type(value) is dict and not value and self._limits.max_metadata_bytes >= 2:
            return  # the usual metadata and fields: "{}"
        try:
            encoded = msgspec.json.encode(value)
        except (TypeError, ValueError, OverflowError) as error:
            raise InvalidInput(
                f"{name} is not JSON-serializable ({error}) - at $.{name}"
            ) from error
        if len(encoded) > self._limits.max_metadata_bytes:
            raise InvalidInput(
                f"{name} is {len(encoded)} bytes, over the limit of "
                f"{self._limits.max_metadata_bytes} (limits.max_metadata_bytes) - at $.{name}"
            )


def log_item(record: Record, encoded: bytes | None = None) -> LogItem:
    """What the log stores for ``record``: its owner as the key, its encoding
    (``encoded``, when the caller has it), and the dedupe key and fingerprint of its
    ``request_id``."""
    value = encoded or encode_record(record)
    if not record.request_id:
        return LogItem(record.owner.encode(), value)
    key = dedupe_key(record.owner, record.request_id)
    return LogItem(record.owner.encode(), value, key, request_fingerprint(record))


_FINGERPRINTED = msgspec.msgpack.Encoder(order="deterministic")
_STAMPED = ("event_id", "recorded_at")
"""What the producer stamps on a record: not part of what a retry must repeat."""


def request_fingerprint(record: Record) -> bytes:
    """A digest of what ``record``'s write says (its kind and every field but the ones the
    producer stamps; object keys in any order; times as the instants the log stores, so
    ``10:00+02:00`` is ``08:00Z``): a retry under the same ``request_id`` repeats it,
    another write does not (``RequestIdConflict``)."""
    fields = msgspec.structs.asdict(record)
    for name in _STAMPED:
        del fields[name]
    fields["kind"] = type(record).__struct_config__.tag
    return hashlib.blake2b(_FINGERPRINTED.encode(fields), digest_size=16).digest()


def _convert(fields: dict[str, Any], record_type: type[Record]) -> tuple[Any, bytes]:
    """The record of ``fields`` and its log encoding (which proves every value storable)."""
    fields.pop("kind", None)
    try:
        record = msgspec.convert(fields, record_type)
        encoded = encode_record(record)
    except msgspec.ValidationError as error:
        raise InvalidInput(patterns_in_words(str(error), PATTERN_WORDS)) from error
    except (TypeError, ValueError, OverflowError) as error:
        at = _unencodable_at(fields) if isinstance(error, UnicodeEncodeError) else ""
        raise InvalidInput(f"value cannot be stored: {error}{at}") from error
    return record, encoded


def _now() -> datetime:
    return datetime.now(UTC)
