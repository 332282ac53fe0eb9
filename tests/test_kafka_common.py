"""Closing Kafka clients is best effort, but never hides the caller's own cancellation."""

from __future__ import annotations

import asyncio

import pytest

from prme.producers.kafka_common import stop_quietly


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
