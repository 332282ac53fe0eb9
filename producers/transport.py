"""The log transport seam: one async interface, implemented by ``local`` and ``kafka``.

Both implementations pass ``tests/transport_contract.py``. Offsets are per partition
and start at 0; ``Position`` is also the consistency token a writer gets back.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Annotated, Protocol, runtime_checkable

import msgspec

from prme.schemas.cluster import ClusterMap, MemberClaim
from prme.schemas.errors import request_id_conflict


class Position(msgspec.Struct, frozen=True, order=True):
    """Where a record landed: the consistency token ``(partition, offset)``."""

    partition: Annotated[int, msgspec.Meta(ge=0)]
    offset: Annotated[int, msgspec.Meta(ge=0)]


class LogItem(msgspec.Struct, frozen=True):
    """A record to append: the key (owner id bytes), the encoded value, and an optional
    idempotency key; a second append with the same ``dedupe_key`` returns the first
    append's position and writes nothing, unless both carry a ``fingerprint`` (a digest of
    what the write says) and the two differ: that raises ``RequestIdConflict``."""

    key: bytes
    value: bytes
    dedupe_key: str | None = None
    fingerprint: bytes | None = None


def dedupe_key(owner: str, request_id: str) -> str:
    """The idempotency key of ``request_id`` of ``owner``: distinct for distinct pairs.

    An owner without a unit separator (every owner the producer accepts) keeps the form
    the local log has always stored, ``owner␟request_id``: it splits at its first ``␟``, so
    it is unambiguous. An owner with one (written before owner ids were checked) gets a
    length-prefixed form that starts with ``␟``, which no key of the first form does (owner
    ids are not empty): owner ``a␟x`` with request ``y`` and owner ``a`` with request
    ``x␟y`` no longer share a key."""
    if "\x1f" not in owner:
        return f"{owner}\x1f{request_id}"
    return f"\x1f{len(owner)}:{owner}{request_id}"


def split_dedupe_key(key: str) -> tuple[str, str]:
    """``(owner, request_id)`` of a key ``dedupe_key`` made."""
    if key.startswith("\x1f"):
        length, _, rest = key[1:].partition(":")
        return rest[: int(length)], rest[int(length) :]
    owner, _, request_id = key.partition("\x1f")
    return owner, request_id


FirstWrites = Callable[[Sequence[str]], Awaitable[dict[str, tuple[Position, bytes | None]]]]
"""Given dedupe keys, the first write of each one a durable read model has applied: its
position and fingerprint (``None``: written before fingerprints); unknown keys are left out.
A transport that cannot look keys up itself (Kafka) asks one when its own map misses."""


@runtime_checkable
class AsksFirstWrites(Protocol):
    """A transport that asks ``first_writes`` about the keys it cannot look up itself."""

    first_writes: FirstWrites | None


def check_same_write(item: LogItem, known: bytes | None) -> None:
    """Raise ``RequestIdConflict`` when ``item`` reuses a dedupe key whose first write had
    another fingerprint (an unknown one, from before fingerprints, conflicts with none)."""
    if known is not None and item.fingerprint is not None and known != item.fingerprint:
        raise request_id_conflict(*split_dedupe_key(item.dedupe_key or ""))


class LogEntry(msgspec.Struct, frozen=True):
    """A record read back from the log."""

    partition: int
    offset: int
    key: bytes
    value: bytes
    timestamp_ms: int


PartitionsCallback = Callable[[set[int]], Awaitable[None]]


@dataclass(frozen=True)
class Membership:
    """How a consumer takes part in the cluster: on Kafka its claim rides in the group's
    join and the leader's map comes back with the assignment; on the local log
    ``static_members`` fix the split (process i owns the partitions p mod N == i)."""

    url: str
    claim: Callable[[], MemberClaim]
    on_map: Callable[[ClusterMap], None]
    standby_replicas: int = 0
    static_members: Sequence[str] = ()
    session_timeout_s: float = 10.0


@runtime_checkable
class LogTransport(Protocol):
    """Append to and read from the partitioned log."""

    @property
    def partitions(self) -> int: ...

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    def partition_for(self, key: bytes) -> int: ...

    async def append(self, item: LogItem) -> Position: ...

    async def append_many(self, items: Sequence[LogItem], *, atomic: bool = True) -> list[Position]:
        """Append all items atomically: either every item is on the log or none is.

        ``atomic=False`` lets a transport trade the all-or-nothing guarantee for speed
        (bulk ingest of independent records); order per owner is kept either way."""
        ...

    async def read(self, partition: int, offset: int, max_records: int = 500) -> list[LogEntry]:
        """Records of ``partition`` from ``offset`` on (at most ``max_records``), in order."""
        ...

    async def forget_dedupe(self, prefix: str) -> None:
        """Forget the dedupe keys starting with ``prefix`` (an erased owner's: its next
        write with a request id it used before is a new write)."""
        ...

    async def written_fingerprints(self, keys: Sequence[str]) -> dict[str, bytes | None]:
        """Of ``keys``, those an append would answer with a first write (being written
        included), each with that write's fingerprint (``None``: unknown), so a bulk
        writer can refuse a conflicting line before it sends its batch."""
        ...

    async def end_offsets(self) -> dict[int, int]:
        """For each partition, the offset the next record will get."""
        ...

    def consumer(self, group: str, membership: Membership | None = None) -> LogConsumer:
        """A consumer in ``group``: on Kafka a consumer-group member, locally all partitions
        (or this process's static share, when ``membership`` names the members)."""
        ...


@runtime_checkable
class LogConsumer(Protocol):
    """Reads assigned partitions from positions the caller chooses (offsets live with the
    read models, never in the broker)."""

    async def start(
        self, on_assigned: PartitionsCallback, on_revoked: PartitionsCallback
    ) -> None: ...

    async def close(self) -> None: ...

    def seek(self, partition: int, offset: int) -> None: ...

    async def position(self, partition: int) -> int:
        """The offset of the next record this consumer will read from ``partition`` (past
        Kafka's transaction markers once they are fetched)."""
        ...

    async def poll(self, max_records: int, timeout_s: float) -> dict[int, list[LogEntry]]:
        """The next records of assigned partitions; may call the assignment callbacks."""
        ...

    def request_rebalance(self) -> None:
        """Ask the group to plan the assignment again (Kafka: this member rejoins; the
        local log's split is static, so nothing happens)."""
        ...
