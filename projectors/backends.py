"""Where a shard's vectors live, chosen once from ``Settings``.

Embedded qdrant-edge shards under each shard directory by default; with ``qdrant.url`` a
Qdrant server, with ``qdrant.path`` qdrant-client's local mode (one process at a time):
one collection shared by every partition. The engine, ``prme project`` and ``prme
rebuild`` all open vector models through a :class:`VectorBackend`, so workers write where
the query service reads.
"""

from __future__ import annotations

import math
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from prme.schemas.config import Settings
from prme.schemas.errors import ConfigurationError

from .embeddings.protocol import EmbeddingIdentity
from .stores.vector_base import VectorModelBase

if TYPE_CHECKING:
    from qdrant_client import QdrantClient


class OneCallAtATime:
    """A client whose calls run one at a time. qdrant-client's local mode keeps its points
    in one SQLite connection that it is not safe to use from several threads at once (the
    shards apply side by side: it failed with ``SystemError: error return without
    exception set``)."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._client, name)
        if not callable(attribute):
            return attribute

        def call(*args: Any, **kwargs: Any) -> Any:
            with self._lock:
                return attribute(*args, **kwargs)

        return call


class VectorBackend:
    """Opens the vector model of a partition; holds the Qdrant client when there is one."""

    def __init__(
        self,
        collection: str,
        client: QdrantClient | None = None,
        index_threshold: int = 0,
        *,
        index_quantization: bool = True,
    ) -> None:
        """``index_threshold``, ``index_quantization``: edge shards only, see
        ``QdrantSettings``."""
        self._collection = collection
        self._client = client
        self._index_threshold = index_threshold
        self._index_quantization = index_quantization

    @classmethod
    def from_settings(cls, settings: Settings) -> VectorBackend:
        qdrant = settings.qdrant
        if qdrant.url and qdrant.path:
            raise ConfigurationError("set one of qdrant.url (a server) and qdrant.path, not both")
        if not (qdrant.url or qdrant.path):
            return cls(
                qdrant.collection,
                index_threshold=qdrant.index_threshold,
                index_quantization=qdrant.index_quantization,
            )
        from qdrant_client import QdrantClient

        if qdrant.path:
            local = QdrantClient(path=qdrant.path)
            return cls(qdrant.collection, cast(QdrantClient, OneCallAtATime(local)))
        return cls(
            qdrant.collection,
            QdrantClient(
                url=qdrant.url, api_key=qdrant.api_key, timeout=math.ceil(qdrant.timeout_s)
            ),
        )

    @property
    def kind(self) -> str:
        """``edge`` or ``qdrant``."""
        return "edge" if self._client is None else "qdrant"

    def open(self, directory: Path, partition: int, identity: EmbeddingIdentity) -> VectorModelBase:
        """The vector model of ``partition`` (``directory`` is its edge shard directory)."""
        if self._client is not None:
            from .stores.vector_qdrant import QdrantVectorModel

            return QdrantVectorModel(self._client, self._collection, partition, identity)
        from .stores.vector_edge import EdgeVectorModel
        from .stores.vector_index_build import IndexPolicy

        policy = IndexPolicy(self._index_threshold, quantization=self._index_quantization)
        return EdgeVectorModel(directory, identity, policy)

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
