"""Sealing log items on their way to the log, and finding the keys to open entries.

The crypto is ``schemas.sealing``; this module joins it to a :class:`KeyStore`: the
producer seals each batch with one key lookup per distinct owner, and a reader asks for
the keys of a batch of entries at once.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import msgspec

from prme.schemas.sealing import UNSEALED_KINDS, KeyRef, Sealer, envelope_of, key_ref

from .keys import KeyStore
from .transport import LogItem


class RecordSealer:
    """Seals log items with their owners' writing keys (created on first use)."""

    def __init__(self, keys: KeyStore) -> None:
        self.keys = keys
        self._sealer = Sealer()

    async def seal(self, items: Sequence[LogItem]) -> list[LogItem]:
        envelopes = [envelope_of(item.value) for item in items]
        owners = [
            envelope.owner
            for envelope in envelopes
            if envelope.sealed is None and envelope.kind not in UNSEALED_KINDS
        ]
        if not owners:
            return list(items)
        keys = await self.keys.writing_keys(owners)
        sealed: list[LogItem] = []
        for item, envelope in zip(items, envelopes, strict=True):
            key = keys.get(envelope.owner)
            if key is None:
                sealed.append(item)
            else:
                value = self._sealer.seal(item.value, key, envelope)
                sealed.append(msgspec.structs.replace(item, value=value))
        return sealed


async def keys_for(keys: KeyStore | None, values: Iterable[bytes]) -> dict[KeyRef, bytes]:
    """The keys that open ``values`` (sealed records whose key is gone are left out)."""
    refs = {ref for value in values if (ref := key_ref(value)) is not None}
    if not refs or keys is None:
        return {}
    return await keys.reading_keys(refs)
