"""Keeps an owner's writes and the owner's erasure apart within one process.

A write seals its records with the owner's key, then appends them. An erasure appends
``owner_erased``, then deletes the owner's keys. Without a gate a write could take the key
before the erasure and append after its marker: acknowledged, then unreadable (erased).
With it, the writes of an owner that are under way when its erasure begins finish first
(their records precede the marker: erased, as they should be), and those that begin
meanwhile wait for the keys to be gone, then seal with a new key. The gate holds what is
sealed inside it: records sealed before (the bulk ingest's, with keys it held) and other
processes are not held by it (docs/ARCHITECTURE.md "Erasure", limits).

Its bookkeeping is never behind an ``await``: a cancelled write or erasure (a caller's
timeout) leaves no owner counted as writing or erasing.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import AsyncIterator, Iterable


class ErasureGate:
    """Owners (log keys) being written and being erased, in this process."""

    def __init__(self) -> None:
        self._writing: Counter[bytes] = Counter()
        self._erasing: dict[bytes, asyncio.Event] = {}
        """Owner -> set once its erasure is done."""
        self._drained: dict[bytes, asyncio.Event] = {}
        """Owner -> set once none of its writes is under way (an erasure waits on it)."""

    @contextlib.asynccontextmanager
    async def writing(self, owners: Iterable[bytes]) -> AsyncIterator[None]:
        """Held while a write of ``owners`` seals and appends; waits out their erasures."""
        wanted = set(owners)
        while erasing := [self._erasing[o] for o in wanted if o in self._erasing]:
            await erasing[0].wait()
        self._writing.update(wanted)
        try:
            yield
        finally:
            for owner in wanted:
                self._writing[owner] -= 1
                if self._writing[owner] <= 0:
                    del self._writing[owner]
                    drained = self._drained.pop(owner, None)
                    if drained is not None:
                        drained.set()

    @contextlib.asynccontextmanager
    async def erasing(self, owner: bytes) -> AsyncIterator[None]:
        """Held while ``owner`` is erased: once its writes under way have finished, and
        until the erasure is done, no write of ``owner`` begins."""
        while (other := self._erasing.get(owner)) is not None:
            await other.wait()
        done = self._erasing[owner] = asyncio.Event()
        try:
            while self._writing[owner] > 0:
                drained = self._drained.setdefault(owner, asyncio.Event())
                await drained.wait()
            yield
        finally:
            del self._erasing[owner]
            done.set()
