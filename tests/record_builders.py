"""Records and projected batches for the read-model tests (one definition, many tests)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from prme.projectors.derive import derive_node
from prme.projectors.model import ProjectedRecord
from prme.schemas import records
from prme.schemas.records import AnyRecord, Message, Role

AT = datetime(2024, 3, 1, 12, 0, tzinfo=UTC)


def _envelope(event_id: str, owner: str, session: str = "default") -> dict[str, Any]:
    return {"event_id": event_id, "owner": owner, "session_id": session, "recorded_at": AT}


def msg(
    event_id: str,
    text: str,
    owner: str = "alice",
    session: str = "s1",
    scope: str = "default",
    *,
    name: str | None = None,
    role: Role = "user",
    occurred_at: datetime | None = None,
) -> Message:
    """A message recorded at ``AT`` (by the user unless ``role`` says otherwise)."""
    return Message(
        **_envelope(event_id, owner, session),
        scope=scope,
        occurred_at=occurred_at,
        role=role,
        content=text,
        name=name,
    )


def cleared(event_id: str, owner: str = "alice", session: str = "s1") -> records.HistoryCleared:
    return records.HistoryCleared(**_envelope(event_id, owner, session))


def replaced(
    event_id: str, message_count: int, owner: str = "alice", session: str = "s1"
) -> records.HistoryReplaced:
    """The clear marker of a ``history_replaced`` (its messages follow it on the log)."""
    return records.HistoryReplaced(
        **_envelope(event_id, owner, session), message_count=message_count
    )


def deleted(
    event_id: str, target_event_id: str, owner: str = "alice", session: str = "s1"
) -> records.MessageDeleted:
    return records.MessageDeleted(
        **_envelope(event_id, owner, session), target_event_id=target_event_id
    )


def archived(event_id: str, node_id: str, owner: str = "alice") -> records.NodeArchived:
    return records.NodeArchived(**_envelope(event_id, owner), node_id=node_id)


def restored(event_id: str, node_id: str, owner: str = "alice") -> records.NodeRestored:
    return records.NodeRestored(**_envelope(event_id, owner), node_id=node_id)


def superseded(
    event_id: str, node_id: str, by_node_id: str, owner: str = "alice"
) -> records.NodeSuperseded:
    return records.NodeSuperseded(
        **_envelope(event_id, owner), node_id=node_id, by_node_id=by_node_id
    )


def erased(event_id: str, owner: str = "alice") -> records.OwnerErased:
    return records.OwnerErased(**_envelope(event_id, owner))


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
    """Builds projected records at increasing offsets (event ids ``e00000``, ``e00001``, …),
    as one partition would hold them; messages carry their derived node."""

    def __init__(self) -> None:
        self.records: list[ProjectedRecord] = []

    def _append(self, record: AnyRecord) -> None:
        self.records.extend(projected([record], start=len(self.records)))

    def _next_id(self) -> str:
        return f"e{len(self.records):05d}"

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
        self._append(msg(self._next_id(), text, owner, session, scope, name=speaker, role=role))
        node = self.records[-1].node
        assert node is not None
        return node.node_id

    def messages(self, owner: str, *texts: str) -> list[str]:
        """Append one message per text, in order, in the default session; their node ids."""
        return [self.message(owner, text) for text in texts]

    def clear(self, owner: str, session: str = "s1") -> None:
        self._append(cleared(self._next_id(), owner, session))

    def replace(self, owner: str, message_count: int, session: str = "s1") -> None:
        self._append(replaced(self._next_id(), message_count, owner, session))

    def delete(self, owner: str, node_id: str, session: str = "s1") -> None:
        self._append(deleted(self._next_id(), node_id.removeprefix("mem:"), owner, session))

    def archive(self, owner: str, node_id: str) -> None:
        self._append(archived(self._next_id(), node_id, owner))

    def restore(self, owner: str, node_id: str) -> None:
        self._append(restored(self._next_id(), node_id, owner))

    def supersede(self, owner: str, node_id: str, by_node_id: str) -> None:
        self._append(superseded(self._next_id(), node_id, by_node_id, owner))

    def erase(self, owner: str) -> None:
        self._append(erased(self._next_id(), owner))
