"""Closing Kafka clients is best effort, but never hides the caller's own cancellation;
batch deliveries nobody awaits never surface as unretrieved errors."""

from __future__ import annotations

import asyncio
import gc

import pytest

from prme.producers.kafka_batches import EnqueuedBatches
from prme.producers.kafka_common import stop_quietly
from prme.producers.kafka_log import DedupeCache
from prme.producers.transport import Position


async def test_a_cancellation_escaping_a_client_stop_does_not_escape_stop_quietly() -> None:
    # aiokafka's consumer.stop() raised CancelledError when its fetcher was backing off
    # from a broker killed moments before (tests/test_replication.py): the projector
    # process then crashed while closing after it had caught up.
    async def stop_leaking_its_cancellation() -> None:
        raise asyncio.CancelledError

    await stop_quietly(stop_leaking_its_cancellation(), 5)


async def test_stop_quietly_keeps_the_callers_cancellation() -> None:
    started = asyncio.Event()

    async def slow_stop() -> None:
        started.set()
        await asyncio.sleep(30)

    task = asyncio.create_task(stop_quietly(slow_stop(), 60))
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


def test_a_request_id_is_answered_from_the_map_for_its_time_only() -> None:
    """After it, a retry is appended again (the same event, applied once): another node's
    map no longer answers an erased owner's reused request id with the erased write."""
    now = [100.0]
    cache = DedupeCache(capacity=2, ttl_s=60.0, clock=lambda: now[0])
    cache.put("alice\x1fr1", Position(0, 5))
    now[0] += 59.0
    assert cache.held("alice\x1fr1") == (Position(0, 5), None)
    now[0] += 2.0
    assert cache.held("alice\x1fr1") is None
    cache.put("a", Position(0, 1))
    cache.put("b", Position(0, 2))
    cache.put("c", Position(0, 3))  # over capacity: the least recently used goes
    assert (cache.held("a"), cache.held("c")) == (None, (Position(0, 3), None))


async def test_abandoned_batch_deliveries_are_not_reported_as_never_retrieved() -> None:
    # enqueue_batches raising after some batches were handed to the producer: nobody awaits
    # those deliveries, and a failure of theirs must not surface as an unretrieved error.
    loop = asyncio.get_running_loop()
    reported: list[str] = []
    loop.set_exception_handler(lambda _, context: reported.append(context["message"]))
    try:
        for abandon in (False, True):
            enqueued = EnqueuedBatches(1)
            delivery: asyncio.Future[object] = loop.create_future()
            enqueued.add(delivery, [0])  # type: ignore[arg-type]
            if abandon:
                enqueued.abandon()
            delivery.set_exception(RuntimeError("broker refused the batch"))
            await asyncio.sleep(0)  # the done callbacks run
            del delivery, enqueued
            gc.collect()
            assert len(reported) == (0 if abandon else 1)
            reported.clear()
    finally:
        loop.set_exception_handler(None)
