"""What a shard's read models share: the derived memory node, the projected record, and
the ``ReadModel`` interface each model implements.

A shard projector decodes a batch, derives each message's node once (type, entities,
text) and its vector, then hands the same ``ProjectedRecord`` list to every read model.
Each model writes its data and the batch's last offset in one durable step (the tracking
record), so re-applying records after a crash is harmless.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Literal, Protocol, runtime_checkable

import msgspec

from prme.schemas.records import AnyRecord

NodeType = Literal["note", "fact", "decision", "preference", "task"]
NodeState = Literal["active", "archived", "superseded"]
ModelName = str
"""A read model's name, as registered in ``registry.READ_MODELS``."""


class MemoryNode(msgspec.Struct, frozen=True, kw_only=True):
    """The memory node a ``message`` record derives (node id ``mem:<event id>``)."""

    node_id: str
    event_id: str
    owner: str
    session_id: str
    scope: str
    node_type: NodeType
    text: str
    speaker: str | None
    role: str
    recorded_at: datetime
    occurred_at: datetime | None
    entities: list[str] = []
    content_hash: str = ""


class ProjectedRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One decoded log record with what the shard derived from it."""

    offset: int
    record: AnyRecord
    node: MemoryNode | None = None
    vector: Sequence[float] | None = None
    """A :data:`Float32Vector` from the projector; read, never changed."""
    data: bytes | None = None
    """The record's plain bytes: as the log gave them, or as they opened when sealed
    (stored as they are: no re-encoding)."""
    sealed: bytes | None = None
    """The sealed bytes on the log, when the record was sealed (what a dead letter keeps)."""


Commit = Callable[[], None]
"""Makes a staged batch durable with its offset (``StagedCommits.stage``)."""


@runtime_checkable
class StagedCommits(Protocol):
    """A read model whose commit waits on its engine's own threads (Tantivy indexes a
    batch on its threads while ``commit`` waits for them, without the GIL). The shard
    stages a batch while it holds the apply gate and runs the commit after releasing it,
    in the same call on the shard's thread (nothing runs between the two), so the next
    shard's GIL-bound steps overlap the engine's work. ``apply`` is ``stage`` then the
    commit. The shard stages any model that has ``stage``: a wrapper that forwards
    attributes must wrap ``stage`` as well as ``apply``."""

    def stage(self, batch: list[ProjectedRecord]) -> Commit | None:
        """Write the batch past the applied offset without committing it; the step that
        commits it and then moves the applied offset, or ``None`` when nothing was
        written. Raises as ``apply`` does, with nothing staged."""
        ...


class ModelClosed(RuntimeError):
    """A read model was closed (swapped by a rebuild, or its shard closed) while a call
    from outside the shard's thread was on its way to it."""


class ReadModel(Protocol):
    """One read model of one shard."""

    @property
    def name(self) -> ModelName:
        """Which read model this is."""
        ...

    def applied_offset(self) -> int:
        """The last log offset applied (``-1`` when none)."""
        ...

    def apply(self, batch: list[ProjectedRecord]) -> None:
        """Apply the batch and store its last offset in the same durable step."""
        ...

    def digest(self) -> str:
        """A canonical hash of the model's content (not its file bytes)."""
        ...

    def close(self) -> None: ...


ERASURES_PENDING = "erasures.pending"
"""In a shard's directory: the owners erased by the batch being applied, until their purge
is done (``erasure.Forgetting``); a model whose purge must run again after a crash looks
for it when it opens."""
