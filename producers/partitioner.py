"""Kafka's default partitioner (murmur2 of the key bytes), shared by both transports so an
owner lands in the same partition number on each."""

from __future__ import annotations

from aiokafka.partitioner import murmur2


def partition_for_key(key: bytes, partitions: int) -> int:
    """``toPositive(murmur2(key)) % partitions``, exactly as the Java client computes it."""
    if partitions <= 0:
        raise ValueError("partitions must be positive")
    return (murmur2(key) & 0x7FFFFFFF) % partitions


class Partitioner:
    """``partition_for_key`` for one partition count, remembering recent keys: an owner's
    key comes back on every write, and murmur2 in Python costs ~5 us, a fifth of sending
    the record."""

    def __init__(self, partitions: int, *, max_keys: int = 65_536) -> None:
        if partitions <= 0:
            raise ValueError("partitions must be positive")
        self._partitions = partitions
        self._max_keys = max_keys
        self._memo: dict[bytes, int] = {}

    def __call__(self, key: bytes) -> int:
        partition = self._memo.get(key)
        if partition is None:
            partition = partition_for_key(key, self._partitions)
            if len(self._memo) >= self._max_keys:
                self._memo.clear()
            self._memo[key] = partition
        return partition
