"""LangChain adapters: ``PRMERetriever`` (a ``BaseRetriever``) and
``PRMEChatMessageHistory`` (a ``BaseChatMessageHistory``).

Both use only the public ``MemoryClient`` API. Each takes ``directory=`` (embedded),
``url=`` with ``api_key=`` (the HTTP service) or ``client=`` (an open ``MemoryClient`` the
caller keeps owning). LangChain's async methods fall back to these sync ones in a worker
thread.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from langchain_core.callbacks import CallbackManagerForRetrieverRun
from langchain_core.chat_history import BaseChatMessageHistory
from langchain_core.documents import Document
from langchain_core.messages import BaseMessage
from langchain_core.retrievers import BaseRetriever
from pydantic import Field, PrivateAttr, model_validator

from prme.query.sync_client import MemoryClient
from prme.schemas.errors import InvalidInput

from .connection import ClientAdapter, ClientHandle
from .messages import langchain_to_draft, message_to_langchain
from .results import results_with_metadata


class PRMERetriever(ClientAdapter, BaseRetriever):
    """PRME retrieval as LangChain ``Document``s.

    ``page_content`` is the memory text; ``metadata`` carries ``node_id``, ``event_id``,
    ``score``, ``semantic_relevance``, per-channel ``scores`` and ``ranks`` and, when the
    engine skipped the ``min_score`` floor, ``min_score_skipped: True``. ``k`` is accepted
    as an alias of ``top_k``, in the constructor and in ``invoke(query, k=...)``.
    """

    user_id: str
    top_k: int = Field(default=10, gt=0)
    token_budget: int = Field(default=4096, gt=0)
    min_score: float | None = None
    scope: str | None = None
    directory: str | Path | None = None
    url: str | None = None
    api_key: str | None = Field(default=None, repr=False)
    client: Any = Field(default=None, exclude=True, repr=False)
    embedding_provider: Any = Field(default=None, exclude=True, repr=False)
    settings: Any = Field(default=None, exclude=True, repr=False)

    _handle: ClientHandle = PrivateAttr()

    @model_validator(mode="before")
    @classmethod
    def _k_is_top_k(cls, data: Any) -> Any:
        if isinstance(data, dict) and "k" in data:
            data = dict(data)
            data["top_k"] = data.pop("k")
        return data

    def __init__(self, **data: Any) -> None:
        super().__init__(**data)
        self._handle = ClientHandle.from_fields(self)

    def _get_relevant_documents(
        self,
        query: str,
        *,
        run_manager: CallbackManagerForRetrieverRun,
        k: int | None = None,
        **options: Any,
    ) -> list[Document]:
        unknown = set(options) - {"top_k", "token_budget", "min_score", "scope"}
        if unknown:
            raise InvalidInput(f"unknown retrieval options: {sorted(unknown)}")
        response = self._handle.client.retrieve(
            query,
            self.user_id,
            scope=options.get("scope", self.scope),
            top_k=k if k is not None else options.get("top_k", self.top_k),
            token_budget=options.get("token_budget", self.token_budget),
            min_score=options.get("min_score", self.min_score),
        )
        return [
            Document(id=node_id, page_content=text, metadata=metadata)
            for node_id, text, metadata in results_with_metadata(response)
        ]


class PRMEChatMessageHistory(ClientAdapter, BaseChatMessageHistory):
    """The chat history of (``user_id``, ``session_id``, ``scope``) on PRME's log.

    Messages round-trip exactly (every JSON-serializable LangChain message, chunks and
    tool messages included). ``clear()`` appends a ``history_cleared`` control event: the
    original messages stay on the log and their memories stay retrievable.
    """

    def __init__(
        self,
        directory: str | Path | None = None,
        *,
        user_id: str,
        session_id: str,
        scope: str = "default",
        url: str | None = None,
        api_key: str | None = None,
        client: MemoryClient | None = None,
        embedding_provider: Any = None,
        settings: Any = None,
    ) -> None:
        self.user_id = user_id
        self.session_id = session_id
        self.scope = scope
        self._handle = ClientHandle(
            directory=directory,
            url=url,
            api_key=api_key,
            client=client,
            embedding_provider=embedding_provider,
            settings=settings,
        )

    @property
    def messages(self) -> list[BaseMessage]:  # type: ignore[override]
        stored = self._handle.client.history(self.user_id, self.session_id, scope=self.scope)
        return [message_to_langchain(message) for message in stored]

    def add_messages(self, messages: Sequence[BaseMessage]) -> None:
        drafts = [
            langchain_to_draft(message, self.user_id, self.session_id, self.scope)
            for message in messages
        ]
        if drafts:
            self._handle.client.add_messages(
                self.user_id, self.session_id, drafts, scope=self.scope
            )

    def clear(self) -> None:
        self._handle.client.clear_history(self.user_id, self.session_id, scope=self.scope)
