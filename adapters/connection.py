"""How an adapter gets its ``MemoryClient``: ``directory=`` (embedded), ``url=`` with
``api_key=`` (the HTTP service), or an existing ``client=`` that the caller keeps owning."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Self, TypedDict, Unpack

from prme.query.sync_client import MemoryClient
from prme.schemas.errors import ConfigurationError


class ConnectionOptions(TypedDict, total=False):
    """The connection options every adapter takes: exactly one of ``directory``, ``url``
    (with ``api_key``) or ``client``; ``embedding_provider`` and ``settings`` configure a
    client the adapter opens."""

    directory: str | Path | None
    url: str | None
    api_key: str | None
    client: MemoryClient | None
    embedding_provider: Any
    settings: Any


CONNECTION_OPTIONS = tuple(ConnectionOptions.__annotations__)


class ClientHandle:
    """A ``MemoryClient`` and whether the adapter opened it (and so must close it)."""

    def __init__(self, **options: Unpack[ConnectionOptions]) -> None:
        given = sum(options.get(name) is not None for name in ("directory", "url", "client"))
        if given != 1:
            raise ConfigurationError(
                "give exactly one of directory= (embedded), url= (service) or client="
            )
        client = options.get("client")
        if client is not None:
            if options.get("embedding_provider") is not None or options.get("settings") is not None:
                raise ConfigurationError(
                    "embedding_provider= and settings= configure a client the adapter opens; "
                    "pass them to the MemoryClient given as client= instead"
                )
            self._client, self._owned = client, False
        else:
            self._client = MemoryClient(
                options.get("directory"),
                url=options.get("url"),
                api_key=options.get("api_key"),
                settings=options.get("settings"),
                embedding_provider=options.get("embedding_provider"),
            )
            self._owned = True
        self._closed = False

    @property
    def client(self) -> MemoryClient:
        if self._closed:
            raise ConfigurationError("this adapter is closed")
        return self._client

    def close(self) -> None:
        """Close the client if the adapter opened it; a given client stays open."""
        if self._closed:
            return
        self._closed = True
        if self._owned:
            self._client.close()

    @classmethod
    def from_fields(cls, adapter: Any) -> ClientHandle:
        """The handle for a pydantic adapter whose fields name the connection options
        (``directory``, ``url``, ``api_key``, ``client``, ``embedding_provider``,
        ``settings``); opened after validation, so that a connection error is a
        ``ConfigurationError`` and not a pydantic ``ValidationError``."""
        return cls(**{name: getattr(adapter, name) for name in CONNECTION_OPTIONS})


class ClientAdapter:
    """What every adapter offers over its ``ClientHandle`` (held in ``_handle``)."""

    _handle: ClientHandle

    @property
    def memory_client(self) -> MemoryClient:
        return self._handle.client

    def close(self) -> None:
        """Release the client (a ``client=`` given by the caller stays open)."""
        self._handle.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
