"""LlamaIndex adapters: ``PRMERetriever`` (a ``BaseRetriever``) and ``PRMEChatStore``
(a ``BaseChatStore``).

Both use only the public ``MemoryClient`` API. Each takes ``directory=`` (embedded),
``url=`` with ``api_key=`` (the HTTP service) or ``client=`` (an open ``MemoryClient`` the
caller keeps owning). BaseChatStore's async methods run these sync ones in a worker thread.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from llama_index.core.llms import ChatMessage
from llama_index.core.retrievers import BaseRetriever
from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode
from llama_index.core.storage.chat_store.base import BaseChatStore
from pydantic import Field, PrivateAttr

from prme.query.sync_client import MemoryClient
from prme.schemas.records import Message

from .connection import ClientAdapter, ClientHandle
from .messages import llamaindex_to_draft, message_to_llamaindex
from .results import results_with_metadata

DEFAULT_SESSION = "default"


class PRMERetriever(ClientAdapter, BaseRetriever):
    """PRME retrieval as ``NodeWithScore``: a ``TextNode`` whose id is the memory node id,
    scored with the fused score, with the same metadata as the LangChain retriever."""

    def __init__(
        self,
        directory: str | Path | None = None,
        *,
        user_id: str,
        top_k: int = 10,
        token_budget: int = 4096,
        min_score: float | None = None,
        scope: str | None = None,
        url: str | None = None,
        api_key: str | None = None,
        client: MemoryClient | None = None,
        embedding_provider: Any = None,
        settings: Any = None,
        **base_options: Any,
    ) -> None:
        super().__init__(**base_options)
        self.user_id = user_id
        self.top_k = top_k
        self.token_budget = token_budget
        self.min_score = min_score
        self.scope = scope
        self._handle = ClientHandle(
            directory=directory,
            url=url,
            api_key=api_key,
            client=client,
            embedding_provider=embedding_provider,
            settings=settings,
        )

    def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        query = query_bundle.query_str
        response = self._handle.client.retrieve(
            query,
            self.user_id,
            scope=self.scope,
            top_k=self.top_k,
            token_budget=self.token_budget,
            min_score=self.min_score,
        )
        return [
            NodeWithScore(
                node=TextNode(
                    id_=node_id,
                    text=text,
                    metadata=metadata,
                    # Retrieval bookkeeping is not content for an LLM or an embedder.
                    excluded_llm_metadata_keys=list(metadata),
                    excluded_embed_metadata_keys=list(metadata),
                ),
                score=metadata["score"],
            )
            for node_id, text, metadata in results_with_metadata(response)
        ]


def parse_key(key: str) -> tuple[str, str]:
    """``"user_id:session_id"`` -> (user_id, session_id), split at the first colon; a key
    without a colon is a user id with the session ``"default"``."""
    user_id, colon, session_id = key.partition(":")
    return user_id, session_id if colon else DEFAULT_SESSION


class PRMEChatStore(ClientAdapter, BaseChatStore):
    """LlamaIndex chat store over PRME histories, keyed ``"user_id:session_id"``.

    Every change appends to the log: ``set_messages`` appends the messages that extend the
    stored history, and is an atomic replacement when they do not,
    ``delete_messages`` a clear marker, ``delete_message`` a deletion marker. The original
    messages stay readable through ``MemoryClient.get_event``. ``get_keys()`` lists the keys
    written through this instance: PRME has no cross-owner key listing.
    """

    directory: str | None = None
    url: str | None = None
    scope: str = "default"
    api_key: str | None = Field(default=None, exclude=True, repr=False)
    client: Any = Field(default=None, exclude=True, repr=False)
    embedding_provider: Any = Field(default=None, exclude=True, repr=False)
    settings: Any = Field(default=None, exclude=True, repr=False)

    _handle: ClientHandle = PrivateAttr()
    _keys: dict[str, None] = PrivateAttr(default_factory=dict)

    def __init__(self, directory: str | Path | None = None, **options: Any) -> None:
        if directory is not None:
            options["directory"] = str(directory)
        super().__init__(**options)
        self._handle = ClientHandle.from_fields(self)

    @classmethod
    def class_name(cls) -> str:
        return "PRMEChatStore"

    def _history(self, key: str) -> list[Message]:
        user_id, session_id = parse_key(key)
        return self._handle.client.history(user_id, session_id, scope=self.scope)

    def _replace(self, key: str, messages: list[ChatMessage]) -> None:
        """Make ``messages`` the history: appended when they extend the stored history
        (``ChatMemoryBuffer.set(get() + [new])``), an atomic replacement otherwise. Each
        replacement writes every message again, and every copy stays a memory: set after
        set, the retriever found "My dog is called Rex" four times."""
        user_id, session_id = parse_key(key)
        stored = self.get_messages(key)
        kept = len(stored) if messages[: len(stored)] == stored else None
        new = messages if kept is None else messages[kept:]
        drafts = [llamaindex_to_draft(m, user_id, session_id, self.scope) for m in new]
        if kept is None:
            self._handle.client.replace_history(user_id, session_id, drafts, scope=self.scope)
        elif drafts:
            self._handle.client.add_messages(user_id, session_id, drafts, scope=self.scope)
        self._keys[key] = None

    def set_messages(self, key: str, messages: list[ChatMessage]) -> None:
        self._replace(key, list(messages))

    def get_messages(self, key: str) -> list[ChatMessage]:
        return [message_to_llamaindex(m) for m in self._history(key)]

    def add_message(self, key: str, message: ChatMessage, idx: int | None = None) -> None:
        """Append ``message``, or insert it at ``idx`` (at the end: an append; before it: an
        atomic replacement)."""
        if idx is not None:
            messages = self.get_messages(key)
            messages.insert(idx, message)
            self._replace(key, messages)
            return
        user_id, session_id = parse_key(key)
        draft = llamaindex_to_draft(message, user_id, session_id, self.scope)
        self._handle.client.add_messages(user_id, session_id, [draft], scope=self.scope)
        self._keys[key] = None

    def delete_messages(self, key: str) -> list[ChatMessage] | None:
        """Clear the history; return what it held, or None when it held nothing."""
        self._keys.pop(key, None)
        stored = self._history(key)
        if not stored:
            return None
        user_id, session_id = parse_key(key)
        self._handle.client.clear_history(user_id, session_id, scope=self.scope)
        return [message_to_llamaindex(m) for m in stored]

    def delete_message(self, key: str, idx: int) -> ChatMessage | None:
        """Delete the message at ``idx`` (negative counts from the end); None when there is
        no such message."""
        stored = self._history(key)
        if not -len(stored) <= idx < len(stored):
            return None
        return self._delete(key, stored[idx])

    def delete_last_message(self, key: str) -> ChatMessage | None:
        stored = self._history(key)
        return self._delete(key, stored[-1]) if stored else None

    def _delete(self, key: str, message: Message) -> ChatMessage:
        user_id, _ = parse_key(key)
        self._handle.client.delete_message(user_id, message.event_id)
        return message_to_llamaindex(message)

    def get_keys(self) -> list[str]:
        return list(self._keys)
