"""PRME: long-term memory for LLM agents, event-sourced on a log.

``from prme import MemoryClient`` and ``MemoryClient("./memory")`` opens the embedded
default (a local durable log, in-process projector, everything under that directory).

The names below are imported on first use: a process that needs only part of PRME (a
rebuild worker, a server child) does not pay for the clients' imports (the embedding
model's runtime, the HTTP client) when it imports ``prme.projectors``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from prme.producers.producer import MessageDraft
    from prme.producers.transport import Position
    from prme.projectors.embeddings.cached import CachedEmbeddingProvider
    from prme.projectors.embeddings.protocol import (
        EmbeddingProvider,
        InteractiveEmbeddingProvider,
        QueryEmbeddingProvider,
    )
    from prme.query.client import AsyncMemoryClient
    from prme.query.engine import MemoryEngine
    from prme.query.sync_client import MemoryClient
    from prme.query.types import Bundle, MemoryResult, Receipt, RetrieveResponse, StoreResult
    from prme.schemas.config import Settings

__version__ = "0.1.0"

_WHERE = {
    "AsyncMemoryClient": "prme.query.client",
    "Bundle": "prme.query.types",
    "CachedEmbeddingProvider": "prme.projectors.embeddings.cached",
    "EmbeddingProvider": "prme.projectors.embeddings.protocol",
    "InteractiveEmbeddingProvider": "prme.projectors.embeddings.protocol",
    "MemoryClient": "prme.query.sync_client",
    "MemoryEngine": "prme.query.engine",
    "MemoryResult": "prme.query.types",
    "MessageDraft": "prme.producers.producer",
    "Position": "prme.producers.transport",
    "QueryEmbeddingProvider": "prme.projectors.embeddings.protocol",
    "Receipt": "prme.query.types",
    "RetrieveResponse": "prme.query.types",
    "Settings": "prme.schemas.config",
    "StoreResult": "prme.query.types",
}

__all__ = [
    "AsyncMemoryClient",
    "Bundle",
    "CachedEmbeddingProvider",
    "EmbeddingProvider",
    "InteractiveEmbeddingProvider",
    "MemoryClient",
    "MemoryEngine",
    "MemoryResult",
    "MessageDraft",
    "Position",
    "QueryEmbeddingProvider",
    "Receipt",
    "RetrieveResponse",
    "Settings",
    "StoreResult",
]


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'prme' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_WHERE])
