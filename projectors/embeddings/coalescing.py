"""Concurrent one-text encodings run together, one batch at a time (queries under load).

Encoding a short text costs mostly fixed per-call work (tokenizer and ONNX calls): with
the default model on one thread a query alone takes ~5 ms, eight at once ~2.6 ms each,
and a text's vector does not depend on the texts beside it. So while one batch runs,
the texts asked for meanwhile wait and go together as the next one. There is no timer:
an idle coalescer encodes a text at once, and a lone caller waits for nothing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

MAX_BATCH = 16
"""The most texts in one batch (a batch of 16 queries takes ~40 ms on one thread)."""

Encode = Callable[[list[str]], Awaitable[list[list[float]]]]


class Coalescer:
    """Runs ``encode`` over the texts of concurrent :meth:`encode` calls, one batch at a
    time, up to ``max_batch`` distinct texts each; every caller gets its own copy."""

    def __init__(self, encode: Encode, max_batch: int = MAX_BATCH) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {max_batch}")
        self._encode = encode
        self._max_batch = max_batch
        self._waiting: list[tuple[str, asyncio.Future[list[float]]]] = []
        self._running: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.batches = 0
        """Batches encoded so far (with :attr:`texts`, how well calls were coalesced)."""
        self.texts = 0

    async def encode(self, text: str) -> list[float]:
        loop = asyncio.get_running_loop()
        if self._running is not None and self._loop is not loop:
            # A batch runs on another event loop: its futures cannot be awaited here.
            return list((await self._encode([text]))[0])
        future: asyncio.Future[list[float]] = loop.create_future()
        self._waiting.append((text, future))
        if self._running is None:
            self._loop = loop
            self._running = loop.create_task(self._drain())
        return await future

    async def _drain(self) -> None:
        try:
            while self._waiting:
                batch = self._waiting[: self._max_batch]
                del self._waiting[: self._max_batch]
                texts = list(dict.fromkeys(text for text, future in batch if not future.done()))
                if not texts:  # every caller of this batch gave up
                    continue
                try:
                    found = dict(zip(texts, await self._encode(texts), strict=True))
                except asyncio.CancelledError:
                    for _, future in self._waiting + batch:
                        future.cancel()
                    self._waiting.clear()
                    raise
                except Exception as error:  # noqa: BLE001 - handed to the batch's callers
                    for _, future in batch:
                        if not future.done():
                            future.set_exception(error)
                    continue
                self.batches += 1
                self.texts += len(texts)
                for text, future in batch:
                    if not future.done():
                        future.set_result(list(found[text]))
        finally:
            self._running = None
            self._loop = None
