"""The Kafka key store: owners' data keys on the compacted topic ``<topic>.keys``.

Co-partitioned with the events topic (an owner's keys are in its events partition
number), key ``<owner>␟<kid>``, value the raw 32-byte key; erasure writes a tombstone per
key. A process reads a partition of the topic to its end the first time it needs a key
there and again whenever it misses one (a writer publishes the key, acknowledged by
``acks=all``, before the first record it seals, so a reader that misses a key either
catches up and finds it or the key was erased).

Compaction removes an erased key's record once its segment is closed: the topic is
created with ``KEYS_TOPIC_CONFIGS``: ``segment.ms`` and ``max.compaction.lag.ms`` of a
minute, ``min.compaction.lag.ms=0``, and ``delete.retention.ms`` of a minute (how long the
tombstone itself stays); the segment files compaction replaces are deleted a second later
(``file.delete.delay.ms``). Kafka closes a segment when a record is appended after
``segment.ms``, so the bound (about two minutes plus the cleaner's backoff) holds while the
topic gets writes (new owners, other erasures); the tombstone hides the key from every
reader at once either way.
"""

from __future__ import annotations

import asyncio

from prme.schemas.sealing import DataKey, new_data_key

from .kafka_changelog import KafkaChangelog
from .keys import WRITE_TTL_S, CachingKeyStore
from .partitioner import Partitioner

KEYS_SUFFIX = ".keys"
KEYS_TOPIC_CONFIGS: dict[str, str] = {
    "cleanup.policy": "compact",
    "min.compaction.lag.ms": "0",
    "max.compaction.lag.ms": "60000",
    "segment.ms": "60000",
    "delete.retention.ms": "60000",
    "min.cleanable.dirty.ratio": "0.01",
    "file.delete.delay.ms": "1000",
}
_SEPARATOR = b"\x1f"


def key_of(owner: str, kid: str) -> bytes:
    return owner.encode() + _SEPARATOR + kid.encode()


def parse_key(key: bytes) -> tuple[str, str] | None:
    owner, separator, kid = key.rpartition(_SEPARATOR)
    if not separator or not owner or not kid:
        return None
    return owner.decode(errors="replace"), kid.decode(errors="replace")


class KafkaKeyStore(CachingKeyStore):
    """Keys on a compacted topic; every key of a partition a process has read is held in
    memory (about 100 bytes per owner)."""

    def __init__(self, topic: KafkaChangelog, *, write_ttl_s: float = WRITE_TTL_S) -> None:
        super().__init__(write_ttl_s=write_ttl_s)
        self._topic = topic
        self._partitioner = Partitioner(topic.partitions)
        self._state: dict[int, dict[str, dict[str, bytes]]] = {}
        self._next: dict[int, int] = {}

    @property
    def topic(self) -> str:
        return self._topic.topic

    async def start(self) -> None:
        await self._topic.start()

    async def close(self) -> None:
        await self._topic.close()

    async def _catch_up(
        self, partition: int, end: int | None = None
    ) -> dict[str, dict[str, bytes]]:
        state = self._state.setdefault(partition, {})
        offset = self._next.get(partition, 0)
        if end is None:
            end = await self._topic.end_offset(partition)
        while offset < end:
            entries, offset = await self._topic.read(partition, offset, end)
            for entry in entries:
                parsed = parse_key(entry.key)
                if parsed is None:
                    continue
                owner, kid = parsed
                if entry.value is None:
                    held = state.get(owner)
                    if held is not None:
                        held.pop(kid, None)
                        if not held:
                            del state[owner]
                else:
                    state.setdefault(owner, {})[kid] = entry.value
        self._next[partition] = offset
        return state

    async def _load(self, owners: list[str]) -> dict[str, dict[str, bytes]]:
        by_partition: dict[int, list[str]] = {}
        for owner in owners:
            by_partition.setdefault(self._partitioner(owner.encode()), []).append(owner)
        found: dict[str, dict[str, bytes]] = {}
        ends = await self._topic.end_offsets(by_partition)  # one request, not one each
        for partition, members in by_partition.items():
            state = await self._catch_up(partition, ends[partition])
            for owner in members:
                if owner in state:
                    found[owner] = dict(state[owner])
        return found

    async def _create(self, owners: list[str]) -> dict[str, DataKey]:
        created = {owner: new_data_key() for owner in owners}
        by_partition: dict[int, list[tuple[bytes, bytes | None]]] = {}
        for owner, key in created.items():
            partition = self._partitioner(owner.encode())
            by_partition.setdefault(partition, []).append((key_of(owner, key.kid), key.key))
        # Every key is acknowledged before any record sealed with it is appended.
        await asyncio.gather(
            *(self._topic.publish(p, records) for p, records in by_partition.items())
        )
        for owner, key in created.items():
            partition = self._partitioner(owner.encode())
            self._state.setdefault(partition, {}).setdefault(owner, {})[key.kid] = key.key
        return created

    async def _delete(self, owner: str) -> None:
        partition = self._partitioner(owner.encode())
        state = await self._catch_up(partition)
        kids = list(state.get(owner, {}))
        if not kids:
            return
        await self._topic.publish(partition, [(key_of(owner, kid), None) for kid in kids])
        state.pop(owner, None)
