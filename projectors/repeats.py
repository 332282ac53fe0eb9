"""Records that repeat an event: each read model applies an event once, the first copy.

A write sent with a ``request_id`` has an event id derived from it
(``producer.request_event_id``). A retry the log cannot deduplicate (sent through another
process, or after a restart, on Kafka) reaches the log again as the same event at a later
offset. Left to the models, such a copy would re-activate a memory archived since, add
graph edges and lexical boundaries, or (a request id reused for other content) mix two
texts. So the shard drops it before any model sees it.

"Already applied" is what the shard's events model holds (event id, offset, owner). A
staged shard without an events model (a rebuild of other models) replays its partition
from the start, so it remembers the request-carrying event ids it has seen itself. A copy
at the offset the first copy was applied at is a replay after a crash, and is kept. An
erasure forgets the owner's events, so a write after it is new again.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from prme.schemas.records import OwnerErased

from .model import ProjectedRecord

Lookup = Callable[[Sequence[str]], dict[str, tuple[int, str]]]
"""``(offset, owner)`` of each given event id already applied (``EventsModel.first_copies``)."""


class FirstCopies:
    """Drops the later copies of an event from a shard's batches."""

    def __init__(self) -> None:
        self._seen: dict[str, tuple[int, str]] = {}
        """Without an events model: the request-carrying events projected so far."""

    def keep(
        self, projected: list[ProjectedRecord], lookup: Lookup | None
    ) -> list[ProjectedRecord]:
        """``projected`` without the records whose event was applied at an earlier offset
        (by ``lookup``, or in this batch)."""
        ids = [p.record.event_id for p in projected if p.record.request_id]
        if not ids:
            return self._forget_erased(projected)
        if lookup is not None:
            known = lookup(ids)
        else:
            known = {i: self._seen[i] for i in ids if i in self._seen}
        kept: list[ProjectedRecord] = []
        for item in projected:
            record = item.record
            if isinstance(record, OwnerErased):
                known = {i: seen for i, seen in known.items() if seen[1] != record.owner}
                self._forget(record.owner)
            elif record.request_id:
                first = known.get(record.event_id)
                if first is not None and first[0] < item.offset:
                    continue
                known[record.event_id] = (item.offset, record.owner)
                if lookup is None:
                    self._seen[record.event_id] = (item.offset, record.owner)
            kept.append(item)
        return kept

    def _forget_erased(self, projected: list[ProjectedRecord]) -> list[ProjectedRecord]:
        for item in projected:
            if isinstance(item.record, OwnerErased):
                self._forget(item.record.owner)
        return projected

    def _forget(self, owner: str) -> None:
        if self._seen:
            self._seen = {i: seen for i, seen in self._seen.items() if seen[1] != owner}
