"""Who an MCP call acts for, and which recall receipts it may read.

``--user-id`` fixes the owner; an API key bound to one owner acts only for that owner; an
admin key, or the local user of a stdio server without ``--user-id``, names the owner.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

from prme.query.auth import Caller
from prme.query.types import Receipt
from prme.schemas.errors import Forbidden, NotFound, shown


class OwnerPolicy:
    """``--user-id`` fixes the owner; a key bound to one owner acts only for that owner."""

    def __init__(self, user_id: str | None) -> None:
        self.user_id = user_id

    def implied(self, caller: Caller) -> str | None:
        """The owner a call acts for when it names none (None: it must name one)."""
        if self.user_id is not None:
            return self.user_id
        return None if caller.is_admin else caller.owner

    def check(self, caller: Caller, owner: str) -> None:
        if self.user_id is not None and owner != self.user_id:
            raise Forbidden(f"this MCP server acts only for owner {self.user_id!r}")
        caller.authorize(owner)


class Receipts:
    """The receipts of recent recalls, for ``prme://receipts/{id}``: in memory, at most
    ``max_entries`` (oldest dropped first), each for ``ttl_s`` seconds after its recall.

    A receipt holds its recall's query text. Another owner's receipt is answered exactly
    as an unknown one (NotFound, no owner named), as the HTTP API answers another owner's
    event."""

    def __init__(
        self, max_entries: int, *, ttl_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._max = max(1, max_entries)
        self._ttl_s = ttl_s
        self._clock = clock
        self._items: OrderedDict[str, tuple[float, Receipt]] = OrderedDict()
        """request id -> (when it expires, the receipt), oldest first."""

    def add(self, receipt: Receipt) -> None:
        self._items[receipt.request_id] = (self._clock() + self._ttl_s, receipt)
        self._items.move_to_end(receipt.request_id)
        while len(self._items) > self._max:
            self._items.popitem(last=False)

    def get(self, request_id: str, caller: Caller, policy: OwnerPolicy) -> Receipt:
        self._expire()
        entry = self._items.get(request_id)
        if entry is None or not _may_read(caller, policy, entry[1]):
            raise self.unknown(request_id)
        return entry[1]

    @staticmethod
    def unknown(request_id: str) -> NotFound:
        """The one answer for a receipt the caller may not read: unknown, expired, dropped
        or another owner's."""
        return NotFound(
            f"no receipt {shown(request_id)} here: receipts live in the memory of the server "
            "that ran the recall, and only recent ones are kept"
        )

    def visible(self, caller: Caller, policy: OwnerPolicy) -> list[Receipt]:
        """Newest first, those the caller may read."""
        self._expire()
        receipts = (receipt for _, receipt in reversed(self._items.values()))
        return [receipt for receipt in receipts if _may_read(caller, policy, receipt)]

    def drop_owner(self, owner: str) -> None:
        """Forget every receipt of ``owner`` (erased)."""
        for request_id in [k for k, (_, r) in self._items.items() if r.owner == owner]:
            del self._items[request_id]

    def _expire(self) -> None:
        now = self._clock()
        while self._items:
            expires, _ = next(iter(self._items.values()))
            if expires > now:
                break
            self._items.popitem(last=False)


def _may_read(caller: Caller, policy: OwnerPolicy, receipt: Receipt) -> bool:
    try:
        policy.check(caller, receipt.owner)
    except Forbidden:
        return False
    return True
