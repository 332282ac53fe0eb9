"""The memory node a ``message`` record derives: deterministic, so every replay agrees."""

from __future__ import annotations

from prme.schemas.records import Message, memory_node_id, message_text

from .embeddings.vector_cache import content_hash
from .entities import extract_entities
from .model import MemoryNode
from .node_types import classify_node_type


def derive_node(record: Message) -> MemoryNode:
    """The memory node of ``record``: id ``mem:<event id>``, text, entities and type."""
    text = message_text(record.content)
    return MemoryNode(
        node_id=memory_node_id(record.event_id),
        event_id=record.event_id,
        owner=record.owner,
        session_id=record.session_id,
        scope=record.scope,
        node_type=classify_node_type(text, record.role),
        text=text,
        speaker=record.name,
        role=record.role,
        recorded_at=record.recorded_at,
        occurred_at=record.occurred_at,
        entities=extract_entities(text),
        content_hash=content_hash(text),
    )


def embedding_text(node: MemoryNode) -> str:
    """What the vector channel encodes for a node: the speaker's name, when known, then the
    text ("Caroline: ..."); the name carries who said it into the vector (DESIGN §6)."""
    return f"{node.speaker}: {node.text}" if node.speaker else node.text
