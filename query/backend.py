"""``MemoryBackend``: what ``AsyncMemoryClient`` needs of whatever serves it.

Two implementations pass one contract suite (``tests/backend_contract.py``): the embedded
:class:`~prme.query.engine.MemoryEngine` and :class:`~prme.query.http_client.HttpMemoryBackend`
(the HTTP service). Same methods, same signatures, same results, same exceptions.

``store`` and ``retrieve`` are written here once, as Structs built from their keyword
arguments; a backend subclasses the protocol and implements ``store_request`` and
``retrieve_request`` (the same Structs the HTTP service decodes).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any, Protocol, cast

from prme.producers.producer import MessageDraft
from prme.producers.transport import Position
from prme.schemas.records import Message, Role

from .fusion import FusionName
from .http_types import RetrieveRequest, StoreRequest
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
    ) -> StoreResult:
        """Append one memory; with ``wait`` (default) return once it is retrievable."""
        request = StoreRequest(
            user_id=user_id,
            content=content,
            session_id=session_id,
            scope=scope,
            role=cast(Role, role),  # the producer refuses an unknown role
            name=name,
            metadata=metadata or {},
            occurred_at=occurred_at,
            request_id=request_id,
            wait=wait,
        )
        return await self.store_request(request)

    async def store_request(self, request: StoreRequest) -> StoreResult: ...

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
    ) -> RetrieveResponse:
        request = RetrieveRequest(
            query=query,
            user_id=user_id,
            scope=scope,
            top_k=top_k,
            token_budget=token_budget,
            min_score=min_score,
            after=after,
            include_archived=include_archived,
            fusion=fusion,
        )
        return await self.retrieve_request(request)

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
