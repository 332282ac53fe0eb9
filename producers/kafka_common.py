"""What the Kafka transport and consumer share: deadlines, quiet stops, record mapping."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import Any, TypeVar

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRecord
from aiokafka.errors import KafkaError

from prme.schemas.errors import ConfigurationError, TransportError

from .transport import LogEntry

T = TypeVar("T")


async def bounded(awaitable: Awaitable[T], timeout_s: float, what: str) -> T:
    """Await with a deadline; Kafka errors and timeouts become :class:`TransportError`."""
    try:
        return await asyncio.wait_for(awaitable, timeout_s)
    except TimeoutError as error:
        raise TransportError(f"kafka: {what} timed out after {timeout_s:g}s") from error
    except KafkaError as error:
        raise TransportError(f"kafka: {what} failed: {error!r}") from error


async def stop_quietly(stop: Awaitable[Any], timeout_s: float) -> None:
    # Closing is best effort: the broker expires sessions and members on its own.
    try:
        with contextlib.suppress(TimeoutError, KafkaError):
            await asyncio.wait_for(stop, timeout_s)
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise  # the caller is being cancelled
        # aiokafka's fetcher cancels its own fetch tasks on close and lets that
        # cancellation escape when one is backing off from a dead broker: the client is
        # stopped all the same, and the caller was not cancelled.


def positive_partitions(partitions: int) -> int:
    """``partitions``, refused (``ConfigurationError``) unless it is positive."""
    if partitions <= 0:
        raise ConfigurationError("partitions must be positive")
    return partitions


ClientT = TypeVar("ClientT", AIOKafkaProducer, AIOKafkaConsumer)


async def started(client: ClientT, timeout_s: float, what: str) -> ClientT:
    """``client`` once its ``start()`` returned (within ``timeout_s``, as :func:`bounded`)."""
    await bounded(client.start(), timeout_s, what)
    return client


def standalone_reader(
    bootstrap: str, client_id: str, timeout_ms: int, **options: Any
) -> AIOKafkaConsumer:
    """A consumer outside any group, for partitions the caller assigns and seeks: nothing
    committed, a fresh assignment starts at the earliest offset."""
    return AIOKafkaConsumer(
        bootstrap_servers=bootstrap,
        client_id=client_id,
        group_id=None,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        request_timeout_ms=timeout_ms,
        **options,
    )


def entry_of(record: ConsumerRecord[bytes, bytes]) -> LogEntry:
    return LogEntry(
        partition=record.partition,
        offset=record.offset,
        key=record.key or b"",
        value=record.value or b"",
        timestamp_ms=record.timestamp,
    )
