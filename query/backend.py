"""``MemoryBackend``: what ``AsyncMemoryClient`` needs of whatever serves it.

Two implementations pass one contract suite (``tests/backend_contract.py``): the embedded
:class:`~prme.query.engine.MemoryEngine` and :class:`~prme.query.http_client.HttpMemoryBackend`
(the HTTP service). Same methods, same signatures, same results, same exceptions.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any, Protocol

from prme.producers.producer import MessageDraft
from prme.producers.transport import Position
from prme.schemas.records import Message

from .fusion import FusionName
from .http_types import RetrieveRequest
from .types import EventView, RetrieveResponse, StoreResult


class MemoryBackend(Protocol):
    async def store(
        self,
        content: str | list[dict[str, Any]],
        user_id: str,
        *,
        session_id: str = "default",
        scope: str = "default",
        role: str = "user",
        name: str | None = None,
        metadata: dict[str, Any] | None = None,
        occurred_at: datetime | None = None,
        request_id: str | None = None,
        wait: bool = True,
    ) -> StoreResult: ...

    async def store_many(
        self, drafts: Sequence[MessageDraft], *, wait: bool = True
    ) -> list[StoreResult]: ...

    async def add_messages(
        self,
        user_id: str,
        session_id: str,
        drafts: Sequence[MessageDraft],
        *,
        scope: str = "default",
        wait: bool = True,
    ) -> list[StoreResult]: ...

    async def clear_history(
        self, user_id: str, session_id: str, *, scope: str = "default", wait: bool = True
    ) -> StoreResult: ...

    async def replace_history(
        self,
        user_id: str,
        session_id: str,
        drafts: Sequence[MessageDraft],
        *,
        scope: str = "default",
        wait: bool = True,
    ) -> list[StoreResult]: ...

    async def delete_message(
        self, user_id: str, event_id: str, *, wait: bool = True
    ) -> StoreResult: ...

    async def archive(
        self, node_id: str, user_id: str, *, reason: str | None = None, wait: bool = True
    ) -> StoreResult: ...

    async def restore(self, node_id: str, user_id: str, *, wait: bool = True) -> StoreResult: ...

    async def supersede(
        self, node_id: str, by_node_id: str, user_id: str, *, wait: bool = True
    ) -> StoreResult: ...

    async def erase_owner(self, user_id: str, *, wait: bool = True) -> StoreResult: ...

    async def retrieve(
        self,
        query: str,
        user_id: str,
        *,
        scope: str | None = None,
        top_k: int = 10,
        token_budget: int = 4096,
        min_score: float | None = None,
        after: Position | None = None,
        include_archived: bool = False,
        fusion: FusionName | None = None,
    ) -> RetrieveResponse: ...

    async def retrieve_request(self, request: RetrieveRequest) -> RetrieveResponse: ...

    async def history(
        self,
        user_id: str,
        session_id: str = "default",
        *,
        scope: str = "default",
        limit: int | None = None,
        after: Position | None = None,
    ) -> list[Message]: ...

    async def get_event(self, event_id: str, user_id: str) -> EventView: ...

    async def get_event_nodes(self, event_id: str, user_id: str) -> list[str]: ...

    async def close(self) -> None: ...
