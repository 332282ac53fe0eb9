"""Read every raw record of one owner back from the log (the audit trail).

Sealed records are opened with the owner's keys; once the owner is erased (its keys
deleted) they show as their envelope with ``erased: true`` and no content."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import msgspec

from prme.schemas.errors import RecordDecodeError
from prme.schemas.sealing import Sealer

from .keys import KeyStore
from .sealing import keys_for
from .transport import LogTransport


class AuditRow(msgspec.Struct, frozen=True, omit_defaults=True):
    partition: int
    offset: int
    timestamp_ms: int
    record: Any = None
    error: str | None = None


async def audit_owner(
    transport: LogTransport, owner: str, page: int = 1000, keys: KeyStore | None = None
) -> AsyncIterator[AuditRow]:
    """Every record keyed by ``owner``, in log order; undecodable ones carry ``error``;
    sealed ones open with ``keys`` (without: every sealed record shows as erased)."""
    sealer = Sealer()
    key = owner.encode()
    partition = transport.partition_for(key)
    end = (await transport.end_offsets())[partition]
    offset = 0
    while offset < end:
        entries = await transport.read(partition, offset, page)
        if not entries:
            return
        mine = [entry for entry in entries if entry.key == key]
        found = await keys_for(keys, (entry.value for entry in mine))
        for entry in mine:
            try:
                record, _ = sealer.open_with(entry.value, found)
                yield AuditRow(entry.partition, entry.offset, entry.timestamp_ms, record)
            except RecordDecodeError as error:
                yield AuditRow(entry.partition, entry.offset, entry.timestamp_ms, error=str(error))
        offset = entries[-1].offset + 1


async def owner_on_log(transport: LogTransport, owner: str) -> bool:
    """Whether any record on the log is keyed by ``owner`` (reads its partition up to the
    first one)."""
    async for _row in audit_owner(transport, owner):
        return True
    return False
