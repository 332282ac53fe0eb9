"""What the Kafka transport and consumer share: deadlines, quiet stops, record mapping."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRecord, TopicPartition
from aiokafka.errors import KafkaError, KafkaTimeoutError

from prme.schemas.errors import (
    AppendUnconfirmed,
    ConfigurationError,
    TransportError,
    TransportUnavailable,
)

from .transport import LogEntry

T = TypeVar("T")


async def bounded(
    awaitable: Awaitable[T], timeout_s: float, what: str, *, may_land: bool = False
) -> T:
    """Await with a deadline; Kafka errors and timeouts become :class:`TransportError`
    (see :func:`transport_error`; ``may_land``: a timeout is :class:`AppendUnconfirmed`,
    records that stay queued)."""
    try:
        return await asyncio.wait_for(awaitable, timeout_s)
    except TimeoutError as error:
        if may_land:
            raise AppendUnconfirmed(
                f"kafka: the log did not confirm the {what} within {timeout_s:g}s; the "
                "records stay queued and may still be appended (a retry with the same "
                "request_id is written once)"
            ) from error
        raise TransportUnavailable(f"kafka: {what} timed out after {timeout_s:g}s") from error
    except KafkaError as error:
        raise transport_error(what, error) from error


def transport_error(what: str, error: KafkaError) -> TransportError:
    """``error`` as PRME's: :class:`TransportUnavailable` when it :func:`passes`, else
    :class:`TransportError`."""
    kind = TransportUnavailable if passes(error) else TransportError
    return kind(f"kafka: {what} failed: {error!r}")


def passes(error: KafkaError) -> bool:
    """Whether the same call can succeed later: Kafka marks the error retriable (a broker
    down, a leader moving), or it is aiokafka's own time-out (no room in the producer's
    queue while no broker takes its batches), which it does not mark."""
    return bool(getattr(error, "retriable", False)) or isinstance(error, KafkaTimeoutError)


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


READER_FETCH_WAIT_MS = 20
"""How long a standalone reader's fetch may wait at the end of a partition. A broker
answers one connection's requests in order, so a fetch parked there for Kafka's default
500 ms held up every end-offsets and read call behind it (half a second per partition a
standby promotion or a changelog catch-up touched)."""


def standalone_reader(
    bootstrap: str, client_id: str, timeout_ms: int, **options: Any
) -> AIOKafkaConsumer:
    """A consumer outside any group, for partitions the caller assigns and seeks (through
    :func:`reading`): nothing committed, a fresh assignment starts at the earliest offset."""
    settings: dict[str, Any] = {"fetch_max_wait_ms": READER_FETCH_WAIT_MS, **options}
    return AIOKafkaConsumer(
        bootstrap_servers=bootstrap,
        client_id=client_id,
        group_id=None,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        request_timeout_ms=timeout_ms,
        **settings,
    )


@contextmanager
def reading(reader: AIOKafkaConsumer, tp: TopicPartition, offset: int) -> Iterator[None]:
    """Point a standalone reader at ``tp`` from ``offset``; paused afterwards, so it sends
    no fetches while nobody reads (an idle fetch would sit on the connection)."""
    try:
        reader.assign([tp])
        reader.seek(tp, offset)
        yield
    finally:
        reader.pause(tp)


def entry_of(record: ConsumerRecord[bytes, bytes]) -> LogEntry:
    return LogEntry(
        partition=record.partition,
        offset=record.offset,
        key=record.key or b"",
        value=record.value or b"",
        timestamp_ms=record.timestamp,
    )
