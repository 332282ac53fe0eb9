"""Records and projected batches for the read-model tests (one definition, many tests)."""

from __future__ import annotations

from datetime import UTC, datetime

from prme.projectors.derive import derive_node
from prme.projectors.model import ProjectedRecord
from prme.schemas.records import AnyRecord, Message

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
