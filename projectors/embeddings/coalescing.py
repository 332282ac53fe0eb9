"""Concurrent one-text encodings run together, one batch at a time (queries under load).

Encoding a short text costs mostly fixed per-call work (tokenizer and ONNX calls): with
the default model on one thread a query alone takes ~5 ms, eight at once ~2.6 ms each,
and a text's vector does not depend on the texts beside it. So while one batch runs,
the texts asked for meanwhile wait and go together as the next one. There is no timer:
an idle coalescer encodes a text at once, and a lone caller waits for nothing.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable

MAX_BATCH = 16
"""The most calls in one batch (a batch of 16 queries takes ~40 ms on one thread)."""

Encode = Callable[[list[str]], Awaitable[list[list[float]]]]


class Coalescer:
    """Runs ``encode`` over the texts of concurrent :meth:`encode` calls, one batch at a
    time per event loop, up to ``max_batch`` calls each (a text asked for twice is encoded
    once); every caller gets its own copy. Callers on different event loops (sync clients
    each run their own) are batched apart: a future is only ever resolved by its loop."""

    def __init__(self, encode: Encode, max_batch: int = MAX_BATCH) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {max_batch}")
        self._encode = encode
        self._max_batch = max_batch
        self._lock = threading.Lock()
        self._queues: dict[int, _LoopQueue] = {}

    async def encode(self, text: str) -> list[float]:
        return await self._queue(asyncio.get_running_loop()).encode(text)

    def _queue(self, loop: asyncio.AbstractEventLoop) -> _LoopQueue:
        with self._lock:
            queue = self._queues.get(id(loop))
            if queue is None or queue.loop is not loop:
                # A loop seen first (or a new one at a freed id): drop the closed ones.
                for key in [k for k, q in self._queues.items() if q.loop.is_closed()]:
                    del self._queues[key]
                queue = self._queues[id(loop)] = _LoopQueue(loop, self._encode, self._max_batch)
            return queue


class _LoopQueue:
    """One event loop's waiting calls and the task encoding them (used on that loop only)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, encode: Encode, max_batch: int) -> None:
        self.loop = loop
        self._encode = encode
        self._max_batch = max_batch
        self._waiting: list[tuple[str, asyncio.Future[list[float]]]] = []
        self._running: asyncio.Task[None] | None = None

    async def encode(self, text: str) -> list[float]:
        future: asyncio.Future[list[float]] = self.loop.create_future()
        self._waiting.append((text, future))
        if self._running is None:
            self._running = self.loop.create_task(self._drain())
        return await future

    async def _drain(self) -> None:
        batch: list[tuple[str, asyncio.Future[list[float]]]] = []
        try:
            while self._waiting:
                batch = self._waiting[: self._max_batch]
                del self._waiting[: self._max_batch]
                texts = list(dict.fromkeys(text for text, future in batch if not future.done()))
                if not texts:  # every caller of this batch gave up
                    continue
                try:
                    found = dict(zip(texts, await self._encode(texts), strict=True))
                except Exception as error:  # noqa: BLE001 - handed to the batch's callers
                    for _, future in batch:
                        if not future.done():
                            future.set_exception(error)
                    continue
                for text, future in batch:
                    if not future.done():
                        future.set_result(list(found[text]))
        finally:
            # Cancelled (the loop is closing) or interrupted: nobody is left waiting.
            for _, future in batch + self._waiting:
                if not future.done():
                    future.cancel()
            self._waiting.clear()
            self._running = None
