"""The records on the log: a frozen msgspec envelope and one tagged struct per kind.

Every record carries the envelope fields; ``kind`` is the msgspec tag. Control kinds
(``history_cleared``, ``message_deleted``, ``history_replaced``), lifecycle kinds and
``owner_erased`` carry no retrievable content.
"""

from __future__ import annotations

import re
from datetime import datetime
from typing import Annotated, Any, Literal

import msgspec

SCHEMA_VERSION = 1
"""The newest record schema version this code writes and reads."""

OWNER_PATTERN = r"^\S(.*\S)?$"
OwnerId = Annotated[str, msgspec.Meta(min_length=1, max_length=256, pattern=OWNER_PATTERN)]
PATTERN_WORDS = {OWNER_PATTERN: "Expected an owner id without whitespace at either end"}
"""What the records' patterns mean, for error messages (``errors.patterns_in_words``)."""
Identifier = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
_ASTRAL_UNSEEN = (
    (0x110BD, 0x110BD),
    (0x110CD, 0x110CD),
    (0x13430, 0x1343F),
    (0x1BCA0, 0x1BCA3),
    (0x1D173, 0x1D17A),
    (0xE0000, 0xE0FFF),
)
"""The unseen characters past U+FFFF, written into the pattern as themselves: a ``\\U``
escape is Python's alone, and JSON Schema validators (ECMA-262 with the ``u`` flag) read a
character where they refuse that escape."""
UNSEEN_CHARACTERS = (
    r"\x00-\x1f\x7f-\x9f\u00ad\u034f\u0600-\u0605\u061c\u06dd\u070f\u0890\u0891\u08e2"
    r"\u115f\u1160\u17b4\u17b5\u180b-\u180f\u200b-\u200f\u2028-\u202e\u2060-\u206f"
    r"\u2800\u3164\ufe00-\ufe0f\ufeff\uffa0\ufff0-\ufffb"
    + "".join(
        chr(low) if low == high else f"{chr(low)}-{chr(high)}" for low, high in _ASTRAL_UNSEEN
    )
)
"""What no id the API takes may hold (the body of a regex character class): the C0 and C1
control characters; Unicode's default-ignorable code points, which show as nothing (soft
hyphen, combining grapheme joiner, Hangul fillers, Mongolian and other variation selectors,
zero-width space, non-joiner and joiner, direction marks, embeddings, overrides and
isolates, word joiner and invisible operators, byte order mark, tags, musical formatting);
the other format characters (Arabic number signs, interlinear annotation, Egyptian
hieroglyph format controls); the line and paragraph separators; and the braille blank.
With any of them two ids that look the same are different owners, sessions or scopes."""
USER_ID_PATTERN = (
    rf"^(?!\*$)[^\s{UNSEEN_CHARACTERS}](?:[^{UNSEEN_CHARACTERS}]*[^\s{UNSEEN_CHARACTERS}])?"
    r"(?!\n)$"
)
"""An owner id as the API takes it: no control or invisible characters (the producer
refuses them), no whitespace at either end (the record's own rule), and not ``*``, which
stands for every owner in ``service.api_keys`` (an owner ``*`` was erased alone by
``DELETE /v1/owners?user_id=*``). ``(?!\n)$`` is the end of the text in Python's regex too
(a bare ``$`` there also matches before a final newline, which let ``"alice\n"``
through)."""
CONTROL_CHARACTERS = r"\x00-\x1f\x7f-\x9f"
ERASABLE_OWNER_PATTERN = (
    rf"^[^\s{CONTROL_CHARACTERS}](?:[^{CONTROL_CHARACTERS}]*[^\s{CONTROL_CHARACTERS}])?(?!\n)$"
)
"""An owner id as erasure takes it: no control characters (refused since before ids refused
invisible ones), no whitespace at either end; so an owner an earlier version stored with
an invisible character, or named ``*``, can still be erased (``MemoryEngine.erase_owner``,
``prme audit``; over HTTP ``*`` is refused: ``HTTP_ERASABLE_OWNER_PATTERN``)."""
HTTP_ERASABLE_OWNER_PATTERN = "^(?!\\*$)" + ERASABLE_OWNER_PATTERN[1:]
"""``DELETE /v1/owners``'s owner: not ``*``, which an admin key's holder reads as every
owner (an erasure of ``*`` erased an owner of that name alone)."""
ID_PATTERN = rf"^[^{UNSEEN_CHARACTERS}]+(?!\n)$"
"""A session, scope, event, node or request id as the API takes it: no control or
invisible characters."""
PATH_ID_PATTERN = rf"^[^/{UNSEEN_CHARACTERS}]+(?!\n)$"
"""An event or node id: an id without ``/`` (one URL path segment; the ids PRME makes have
none, and over HTTP a ``/`` in one reached no route: "Not Found" instead of the answer
in-process)."""
UserIdField = Annotated[
    str,
    msgspec.Meta(
        min_length=1,
        max_length=256,
        pattern=USER_ID_PATTERN,
        description="the owner: 1-256 characters, no control characters, no surrounding space",
    ),
]
"""The owner id of every API request, and of the owners API keys are bound to."""
Role = Literal["user", "assistant", "system", "tool", "function", "developer"]
ROLES: frozenset[str] = frozenset(Role.__args__)  # type: ignore[attr-defined]
ContentBlock = dict[str, Any]


class Record(msgspec.Struct, frozen=True, kw_only=True, tag_field="kind"):
    """The envelope every record shares."""

    v: int = SCHEMA_VERSION
    event_id: Identifier
    owner: OwnerId
    session_id: Identifier = "default"
    scope: Identifier = "default"
    recorded_at: datetime
    occurred_at: datetime | None = None
    request_id: Identifier | None = None


class Message(Record, frozen=True, kw_only=True, tag="message"):
    """A chat message or stored memory. Carries enough to round-trip a framework message.

    ``fields`` holds the framework's additional fields (message class, additional_kwargs,
    response_metadata, tool status and artifact, ...); ``metadata`` is the caller's own.
    """

    role: Role
    content: str | list[ContentBlock]
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[dict[str, Any]] = []
    message_id: str | None = None
    fields: dict[str, Any] = {}
    metadata: dict[str, Any] = {}


class HistoryCleared(Record, frozen=True, kw_only=True, tag="history_cleared"):
    """Everything before this marker in (owner, session, scope) leaves the chat history."""


class MessageDeleted(Record, frozen=True, kw_only=True, tag="message_deleted"):
    """One message leaves the chat history; the original stays on the log."""

    target_event_id: Identifier


class HistoryReplaced(Record, frozen=True, kw_only=True, tag="history_replaced"):
    """A clear marker followed, in the same atomic append, by ``message_count`` messages."""

    message_count: Annotated[int, msgspec.Meta(ge=0)]


class NodeArchived(Record, frozen=True, kw_only=True, tag="node_archived"):
    """The node leaves normal retrieval."""

    node_id: Identifier
    reason: str | None = None


class NodeRestored(Record, frozen=True, kw_only=True, tag="node_restored"):
    """An archived or superseded node comes back into normal retrieval."""

    node_id: Identifier


class NodeSuperseded(Record, frozen=True, kw_only=True, tag="node_superseded"):
    """``node_id`` is replaced by ``by_node_id`` (a ``supersedes`` edge); it leaves retrieval."""

    node_id: Identifier
    by_node_id: Identifier


class OwnerErased(Record, frozen=True, kw_only=True, tag="owner_erased"):
    """Every trace of the owner leaves every read model; the log keeps the audit trail, as
    envelopes once the owner's data keys are deleted (never sealed itself)."""


AnyRecord = (
    Message
    | HistoryCleared
    | MessageDeleted
    | HistoryReplaced
    | NodeArchived
    | NodeRestored
    | NodeSuperseded
    | OwnerErased
)

RECORD_TYPES: tuple[type[Record], ...] = AnyRecord.__args__  # type: ignore[attr-defined]
KINDS: frozenset[str] = frozenset(t.__struct_config__.tag for t in RECORD_TYPES)  # type: ignore[misc]
CONTROL_KINDS = frozenset({"history_cleared", "message_deleted", "history_replaced"})
LIFECYCLE_KINDS = frozenset({"node_archived", "node_restored", "node_superseded"})


def kind_of(record: Record) -> str:
    """The record's ``kind`` tag."""
    return str(type(record).__struct_config__.tag)


def memory_node_id(event_id: str) -> str:
    """The id of the memory node a message event derives (deterministic, so replay agrees)."""
    return f"mem:{event_id}"


VISIBLE_TEXT_PATTERN = rf"[^\s{UNSEEN_CHARACTERS}]"
"""Text that shows something (a search: somewhere a character that is not whitespace,
control or invisible)."""
_VISIBLE = re.compile(VISIBLE_TEXT_PATTERN)


def has_visible_text(text: str) -> bool:
    """``text`` has a character that shows: not whitespace, and not one of
    :data:`UNSEEN_CHARACTERS` (control characters, zero-width and other invisible ones)."""
    return _VISIBLE.search(text) is not None


def has_only_text(content: str | list[ContentBlock]) -> bool:
    """``content`` is text alone: a string, or blocks none of which is of another type
    (an image, a file: a message may be one of those without any text; a block that is no
    object is not text either, and the record's type refuses it)."""
    if isinstance(content, str):
        return True
    return all(
        isinstance(block, str) or (isinstance(block, dict) and block.get("type") in (None, "text"))
        for block in content
    )


def message_text(content: str | list[ContentBlock]) -> str:
    """The plain text of a message's content: text blocks joined by newlines."""
    if isinstance(content, str):
        return content
    parts: list[str] = []
    for block in content:
        if isinstance(block, str):
            parts.append(block)
        elif block.get("type") == "text" and isinstance(block.get("text"), str):
            parts.append(block["text"])
    return "\n".join(parts)
