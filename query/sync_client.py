"""``MemoryClient``: the sync client, a thin wrapper that runs :class:`AsyncMemoryClient`
on a worker loop (so provider coroutines always run on that one loop), with the same
methods and signatures."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, Self, TypeVar

import msgspec

from prme.producers.producer import MessageDraft
from prme.producers.transport import Position
from prme.projectors.embeddings.protocol import EmbeddingProvider
from prme.schemas.config import Settings
from prme.schemas.errors import ClientClosed, ConfigurationError
from prme.schemas.records import Message

from .client import AsyncMemoryClient, check_target, make_async_client
from .engine import MemoryEngine
from .fusion import FusionName
from .types import EventView, RetrieveResponse, StoreResult

T = TypeVar("T")


class _WorkerLoop:
    """An event loop on a daemon thread that runs the async client's coroutines."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self.loop.run_forever, name="prme-client", daemon=True
        )
        self._thread.start()

    def run(self, coroutine: Coroutine[Any, Any, T], timeout_s: float | None) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout_s)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()


class _OpenPack(msgspec.Struct):
    worker: _WorkerLoop
    client: AsyncMemoryClient
    provider: EmbeddingProvider | None
    settings: Settings | None
    """The settings the first client passed (``None``: it passed none)."""
    users: int = 1


class _EmbeddedPacks:
    """The packs this process has open, by resolved directory.

    A pack directory can be opened by one engine per process only (the vector and lexical
    engines hold file locks), yet the seed's adapters each take ``directory=``. So sync
    clients of one directory share one engine and its worker loop, counted by users; the
    last ``close()`` closes it. This registry is the one piece of process-wide state.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._packs: dict[Path, _OpenPack] = {}

    def acquire(
        self,
        directory: Path,
        settings: Settings | None,
        provider: EmbeddingProvider | None,
        timeout_s: float,
    ) -> _OpenPack:
        key = directory.resolve()
        with self._lock:
            pack = self._packs.get(key)
            if pack is not None:
                if provider is not None and provider is not pack.provider:
                    raise ConfigurationError(
                        f"{directory} is already open in this process with another embedding "
                        "provider; pass the same provider object or close the other client"
                    )
                if settings is not None and not _same_settings(directory, settings, pack):
                    raise ConfigurationError(
                        f"{directory} is already open in this process with other settings; "
                        "pass equal settings (or none) or close the other client"
                    )
                pack.users += 1
                return pack
            worker = _WorkerLoop()
            try:
                client = worker.run(
                    make_async_client(directory, None, None, settings, provider, timeout_s),
                    timeout_s,
                )
            except BaseException:
                worker.stop()
                raise
            pack = _OpenPack(worker=worker, client=client, provider=provider, settings=settings)
            self._packs[key] = pack
            return pack

    def release(self, directory: Path, timeout_s: float) -> None:
        key = directory.resolve()
        with self._lock:
            pack = self._packs[key]
            pack.users -= 1
            if pack.users > 0:
                return
            del self._packs[key]
        try:
            pack.worker.run(pack.client.close(), timeout_s)
        finally:
            pack.worker.stop()


def _same_settings(directory: Path, settings: Settings, pack: _OpenPack) -> bool:
    """Whether ``settings`` are those the open ``pack`` was given (the environment's, when
    its first client passed none), the data directory aside."""
    first = pack.settings if pack.settings is not None else Settings.from_env()
    return settings.replace(data_dir=str(directory)) == first.replace(data_dir=str(directory))


_PACKS = _EmbeddedPacks()


class MemoryClient:
    """The sync client: ``MemoryClient("./memory")`` opens the embedded default;
    ``MemoryClient(url=..., api_key=...)`` talks to ``prme serve``.

    Sync clients of the same directory in one process share one engine.
    """

    def __init__(
        self,
        directory: str | Path | None = None,
        *,
        url: str | Sequence[str] | None = None,
        api_key: str | None = None,
        settings: Settings | None = None,
        embedding_provider: EmbeddingProvider | None = None,
        timeout_s: float = 120.0,
    ) -> None:
        check_target(directory, url)
        self._timeout_s = timeout_s
        self._directory = Path(directory) if directory is not None else None
        if self._directory is not None:
            pack = _PACKS.acquire(self._directory, settings, embedding_provider, timeout_s)
            self._worker, self._client = pack.worker, pack.client
        else:
            self._worker = _WorkerLoop()
            try:
                self._client = self._worker.run(
                    make_async_client(None, url, api_key, settings, embedding_provider, timeout_s),
                    timeout_s,
                )
            except BaseException:
                self._worker.stop()
                raise
        self._closed = False

    @property
    def engine(self) -> MemoryEngine | None:
        return self._client.engine

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The worker loop the async client (and the provider's coroutines) run on."""
        return self._worker.loop

    def _run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        if self._closed:  # its worker loop is stopped, or another client's
            coroutine.close()  # never started: closed, it is not "never awaited"
            raise ClientClosed("this MemoryClient is closed: open a new one")
        return self._worker.run(coroutine, self._timeout_s)

    def store(
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
        return self._run(
            self._client.store(
                content,
                user_id,
                session_id=session_id,
                scope=scope,
                role=role,
                name=name,
                metadata=metadata,
                occurred_at=occurred_at,
                request_id=request_id,
                wait=wait,
            )
        )

    def store_many(self, drafts: Sequence[MessageDraft], *, wait: bool = True) -> list[StoreResult]:
        return self._run(self._client.store_many(drafts, wait=wait))

    def retrieve(
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
        return self._run(
            self._client.retrieve(
                query,
                user_id,
                scope=scope,
                top_k=top_k,
                token_budget=token_budget,
                min_score=min_score,
                after=after,
                include_archived=include_archived,
                fusion=fusion,
            )
        )

    def history(
        self,
        user_id: str,
        session_id: str = "default",
        *,
        scope: str = "default",
        limit: int | None = None,
        after: Position | None = None,
    ) -> list[Message]:
        return self._run(
            self._client.history(user_id, session_id, scope=scope, limit=limit, after=after)
        )

    def add_messages(
        self,
        user_id: str,
        session_id: str,
        drafts: Sequence[MessageDraft],
        *,
        scope: str = "default",
        wait: bool = True,
    ) -> list[StoreResult]:
        return self._run(
            self._client.add_messages(user_id, session_id, drafts, scope=scope, wait=wait)
        )

    def clear_history(
        self, user_id: str, session_id: str, *, scope: str = "default", wait: bool = True
    ) -> StoreResult:
        return self._run(self._client.clear_history(user_id, session_id, scope=scope, wait=wait))

    def replace_history(
        self,
        user_id: str,
        session_id: str,
        drafts: Sequence[MessageDraft],
        *,
        scope: str = "default",
        wait: bool = True,
    ) -> list[StoreResult]:
        return self._run(
            self._client.replace_history(user_id, session_id, drafts, scope=scope, wait=wait)
        )

    def delete_message(self, user_id: str, event_id: str, *, wait: bool = True) -> StoreResult:
        return self._run(self._client.delete_message(user_id, event_id, wait=wait))

    def get_event(self, event_id: str, user_id: str) -> EventView:
        return self._run(self._client.get_event(event_id, user_id))

    def get_event_nodes(self, event_id: str, user_id: str) -> list[str]:
        return self._run(self._client.get_event_nodes(event_id, user_id))

    def archive(
        self, node_id: str, user_id: str, *, reason: str | None = None, wait: bool = True
    ) -> StoreResult:
        return self._run(self._client.archive(node_id, user_id, reason=reason, wait=wait))

    def restore(self, node_id: str, user_id: str, *, wait: bool = True) -> StoreResult:
        return self._run(self._client.restore(node_id, user_id, wait=wait))

    def supersede(
        self, node_id: str, by_node_id: str, user_id: str, *, wait: bool = True
    ) -> StoreResult:
        return self._run(self._client.supersede(node_id, by_node_id, user_id, wait=wait))

    def erase_owner(self, user_id: str, *, wait: bool = True) -> StoreResult:
        return self._run(self._client.erase_owner(user_id, wait=wait))

    def close(self) -> None:
        """Release this client; the shared engine closes with its last client."""
        if self._closed:
            return
        self._closed = True
        if self._directory is not None:
            _PACKS.release(self._directory, self._timeout_s)
            return
        try:
            self._worker.run(self._client.close(), self._timeout_s)
        finally:
            self._worker.stop()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
