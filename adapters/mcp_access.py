"""Who an MCP call acts for, and which recall receipts it may read.

``--user-id`` fixes the owner; an API key bound to one owner acts only for that owner; an
admin key, or the local user of a stdio server without ``--user-id``, names the owner.
"""

from __future__ import annotations

from collections import OrderedDict

from prme.query.auth import Caller
from prme.query.types import Receipt
from prme.schemas.errors import Forbidden, NotFound


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
    """The receipts of recent recalls, for ``prme://receipts/{id}`` (bounded, in memory)."""

    def __init__(self, max_entries: int) -> None:
        self._max = max(1, max_entries)
        self._items: OrderedDict[str, Receipt] = OrderedDict()

    def add(self, receipt: Receipt) -> None:
        self._items[receipt.request_id] = receipt
        self._items.move_to_end(receipt.request_id)
        while len(self._items) > self._max:
            self._items.popitem(last=False)

    def get(self, request_id: str, caller: Caller, policy: OwnerPolicy) -> Receipt:
        receipt = self._items.get(request_id)
        if receipt is None:
            raise NotFound(
                f"no receipt {request_id!r} here: receipts live in the memory of the server "
                "that ran the recall, and only the most recent are kept"
            )
        policy.check(caller, receipt.owner)
        return receipt

    def visible(self, caller: Caller, policy: OwnerPolicy) -> list[Receipt]:
        """Newest first, those the caller may read."""
        visible = []
        for receipt in reversed(self._items.values()):
            try:
                policy.check(caller, receipt.owner)
            except Forbidden:
                continue
            visible.append(receipt)
        return visible
