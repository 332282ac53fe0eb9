"""The gate between an owner's writes and its erasure, alone: who waits for whom, and a
cancelled write or erasure (a caller's timeout) leaves no owner held."""

from __future__ import annotations

import asyncio

import pytest

from prme.producers.erasure_gate import ErasureGate

A, B = b"alice", b"bob"


async def test_an_erasure_waits_for_the_writes_under_way_and_holds_new_ones() -> None:
    gate, order = ErasureGate(), []
    release = asyncio.Event()

    async def write(owner: bytes, name: str, hold: bool = False) -> None:
        async with gate.writing([owner]):
            if hold:
                await release.wait()
            order.append(name)

    async def erase(owner: bytes) -> None:
        async with gate.erasing(owner):
            order.append("erased")

    under_way = asyncio.create_task(write(A, "under way", hold=True))
    await asyncio.sleep(0)
    erasure = asyncio.create_task(erase(A))
    await asyncio.sleep(0)
    later = asyncio.create_task(write(A, "later"))
    other = asyncio.create_task(write(B, "other owner"))
    await asyncio.sleep(0.01)
    assert order == ["other owner"]
    release.set()
    await asyncio.gather(under_way, erasure, later, other)
    assert order == ["other owner", "under way", "erased", "later"]


@pytest.mark.parametrize("where", ["waiting for the erasure", "inside"])
async def test_a_cancelled_write_leaves_the_owner_free(where: str) -> None:
    gate = ErasureGate()
    held, release = asyncio.Event(), asyncio.Event()

    async def hold_erasure() -> None:
        async with gate.erasing(A):
            held.set()
            await release.wait()

    async def write() -> None:
        async with gate.writing([A, B]):
            await asyncio.sleep(60)

    if where == "waiting for the erasure":
        eraser = asyncio.create_task(hold_erasure())
        await held.wait()
    writer = asyncio.create_task(write())
    await asyncio.sleep(0.01)
    writer.cancel()
    with pytest.raises(asyncio.CancelledError):
        await writer
    if where == "waiting for the erasure":
        release.set()
        await eraser
    async with asyncio.timeout(1):
        async with gate.erasing(A), gate.erasing(B):
            pass
        async with gate.writing([A, B]):
            pass


async def test_a_cancelled_erasure_leaves_the_owner_free() -> None:
    gate = ErasureGate()
    release = asyncio.Event()

    async def write() -> None:
        async with gate.writing([A]):
            await release.wait()

    writer = asyncio.create_task(write())
    await asyncio.sleep(0)
    eraser = asyncio.create_task(gate.erasing(A).__aenter__())
    await asyncio.sleep(0.01)
    eraser.cancel()  # while it waits for the write under way
    with pytest.raises(asyncio.CancelledError):
        await eraser
    async with asyncio.timeout(1):
        async with gate.writing([A]):
            pass
    release.set()
    await writer
    async with asyncio.timeout(1):
        async with gate.erasing(A):
            pass
