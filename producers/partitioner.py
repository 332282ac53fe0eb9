"""Kafka's default partitioner (murmur2 of the key bytes), shared by both transports so an
owner lands in the same partition number on each."""

from __future__ import annotations

from aiokafka.partitioner import murmur2


def partition_for_key(key: bytes, partitions: int) -> int:
    """``toPositive(murmur2(key)) % partitions``, exactly as the Java client computes it."""
    if partitions <= 0:
        raise ValueError("partitions must be positive")
    return (murmur2(key) & 0x7FFFFFFF) % partitions
