"""PRME: long-term memory for LLM agents, event-sourced on a log.

``from prme import MemoryClient`` and ``MemoryClient("./memory")`` opens the embedded
default (a local durable log, in-process projector, everything under that directory).
"""

from prme.producers.producer import MessageDraft
from prme.producers.transport import Position
from prme.projectors.embeddings.cached import CachedEmbeddingProvider
from prme.projectors.embeddings.protocol import EmbeddingProvider, QueryEmbeddingProvider
from prme.query.client import AsyncMemoryClient
from prme.query.engine import MemoryEngine
from prme.query.sync_client import MemoryClient
from prme.query.types import Bundle, MemoryResult, Receipt, RetrieveResponse, StoreResult
from prme.schemas.config import Settings

__version__ = "0.1.0"

__all__ = [
    "AsyncMemoryClient",
    "Bundle",
    "CachedEmbeddingProvider",
    "EmbeddingProvider",
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
