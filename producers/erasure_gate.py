"""Keeps an owner's writes and the owner's erasure apart within one process.

A write seals its records with the owner's key, then appends them. An erasure appends
``owner_erased``, then deletes the owner's keys. Without a gate a write could take the key
before the erasure and append after its marker: acknowledged, then unreadable (erased).
With it, the writes of an owner that are under way when its erasure begins finish first
(their records precede the marker: erased, as they should be), and those that begin
meanwhile wait for the keys to be gone, then seal with a new key. Other processes are not
held by it (docs/ARCHITECTURE.md "Erasure", limits).
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
        self._erasing: set[bytes] = set()
        self._changed = asyncio.Condition()

    @contextlib.asynccontextmanager
    async def writing(self, owners: Iterable[bytes]) -> AsyncIterator[None]:
        """Held while a write of ``owners`` seals and appends; waits out their erasures."""
        wanted = set(owners)
        async with self._changed:
            await self._changed.wait_for(lambda: self._erasing.isdisjoint(wanted))
            self._writing.update(wanted)
        try:
            yield
        finally:
            async with self._changed:
                self._writing.subtract(wanted)
                for owner in wanted:
                    if self._writing[owner] <= 0:
                        del self._writing[owner]
                self._changed.notify_all()

    @contextlib.asynccontextmanager
    async def erasing(self, owner: bytes) -> AsyncIterator[None]:
        """Held while ``owner`` is erased: once its writes under way have finished, and
        until the erasure is done, no write of ``owner`` begins."""
        async with self._changed:
            await self._changed.wait_for(lambda: owner not in self._erasing)
            self._erasing.add(owner)
        try:
            async with self._changed:
                await self._changed.wait_for(lambda: self._writing[owner] <= 0)
            yield
        finally:
            async with self._changed:
                self._erasing.discard(owner)
                self._changed.notify_all()
