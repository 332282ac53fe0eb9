"""Records and projected batches for the read-model tests (one definition, many tests)."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from prme.projectors.derive import derive_node
from prme.projectors.model import MemoryNode, ProjectedRecord
from prme.schemas.records import (
    AnyRecord,
    HistoryCleared,
    HistoryReplaced,
    Message,
    MessageDeleted,
    NodeArchived,
    NodeRestored,
    NodeSuperseded,
    OwnerErased,
    Role,
    memory_node_id,
)

AT = datetime(2024, 3, 1, 12, 0, tzinfo=UTC)


def msg(
    event_id: str, text: str, owner: str = "alice", session: str = "s1", scope: str = "default"
) -> Message:
    """A user message recorded at ``AT``."""
    return Message(
        event_id=event_id,
        owner=owner,
        session_id=session,
        scope=scope,
        recorded_at=AT,
        role="user",
        content=text,
    )


def projected(records: list[AnyRecord], start: int = 0) -> list[ProjectedRecord]:
    """``records`` at consecutive offsets from ``start``, messages with their derived node."""
    return [
        ProjectedRecord(
            offset=start + index,
            record=record,
            node=derive_node(record) if isinstance(record, Message) else None,
        )
        for index, record in enumerate(records)
    ]


class RecordLog:
    """Builds projected records at increasing offsets, as one partition would hold them.

    Messages carry a note node (``mem:<event_id>``) whose speaker is ``speaker``; each
    control and lifecycle kind has a method of its own."""

    def __init__(self, recorded_at: datetime = AT) -> None:
        self.records: list[ProjectedRecord] = []
        self._recorded_at = recorded_at

    def _envelope(self, owner: str, session: str, scope: str) -> dict[str, Any]:
        return {
            "event_id": f"e{len(self.records):05d}",
            "owner": owner,
            "session_id": session,
            "scope": scope,
            "recorded_at": self._recorded_at,
        }

    def message(
        self,
        owner: str,
        text: str,
        *,
        session: str = "s1",
        scope: str = "default",
        speaker: str | None = None,
        role: Role = "user",
    ) -> str:
        """Append a message; returns its node id."""
        envelope = self._envelope(owner, session, scope)
        record = Message(**envelope, role=role, content=text, name=speaker)
        node = MemoryNode(
            node_id=memory_node_id(record.event_id),
            event_id=record.event_id,
            owner=owner,
            session_id=session,
            scope=scope,
            node_type="note",
            text=text,
            speaker=speaker,
            role=role,
            recorded_at=self._recorded_at,
            occurred_at=None,
        )
        self.records.append(ProjectedRecord(offset=len(self.records), record=record, node=node))
        return node.node_id

    def _add(self, kind: Callable[..., AnyRecord], owner: str, session: str, **fields: Any) -> None:
        record = kind(**self._envelope(owner, session, "default"), **fields)
        self.records.append(ProjectedRecord(offset=len(self.records), record=record))

    def clear(self, owner: str, session: str = "s1") -> None:
        self._add(HistoryCleared, owner, session)

    def replace(self, owner: str, message_count: int, session: str = "s1") -> None:
        """The clear marker of a ``history_replaced`` (its messages follow as ``message``)."""
        self._add(HistoryReplaced, owner, session, message_count=message_count)

    def delete(self, owner: str, node_id: str, session: str = "s1") -> None:
        self._add(MessageDeleted, owner, session, target_event_id=node_id.removeprefix("mem:"))

    def archive(self, owner: str, node_id: str) -> None:
        self._add(NodeArchived, owner, "s1", node_id=node_id)

    def restore(self, owner: str, node_id: str) -> None:
        self._add(NodeRestored, owner, "s1", node_id=node_id)

    def supersede(self, owner: str, node_id: str, by_node_id: str) -> None:
        self._add(NodeSuperseded, owner, "s1", node_id=node_id, by_node_id=by_node_id)

    def erase(self, owner: str) -> None:
        self._add(OwnerErased, owner, "s1")
