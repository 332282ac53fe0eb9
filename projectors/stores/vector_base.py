"""The vector read model's interface and what its implementations share.

A batch of ``ProjectedRecord`` is planned into engine-neutral operations (upsert a point,
set a node's lifecycle state, erase an owner); each implementation writes them, then the
tracking record (last applied offset and the embedding identity) as the last write of the
same step. The engines apply writes in order from a write-ahead log, so a stored offset
implies every write before it; re-applying records from that offset is harmless.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Any, Literal

import msgspec
import numpy as np

from prme.projectors.embeddings.protocol import EmbeddingIdentity
from prme.projectors.embeddings.validation import checked_vectors, validate_vector
from prme.projectors.model import MemoryNode, NodeState, ProjectedRecord
from prme.schemas.errors import EmbeddingMismatch
from prme.schemas.records import Message, NodeArchived, NodeRestored, NodeSuperseded, OwnerErased

POINT_NAMESPACE = uuid.UUID("5b1f4d7e-2c1a-5a6e-9d0b-7f3e8c2a1b40")
"""Namespace of the deterministic point ids (uuid5 of the node id)."""

PAYLOAD_KEYS: tuple[str, ...] = (
    "owner",
    "scope",
    "session_id",
    "node_type",
    "state",
    "event_id",
    "node_id",
    "recorded_at",
    "occurred_at",
)
"""The payload every memory point carries; the digest covers exactly these keys."""

TRACKING_FLAG = "_tracking"
DIGEST_DECIMALS = 6


class VectorHit(msgspec.Struct, frozen=True):
    """One search result: the memory node and its cosine similarity to the query."""

    node_id: str
    score: float


class TrackingState(msgspec.Struct, frozen=True):
    """The tracking record: the last applied log offset and the store's vector space."""

    offset: int
    identity: EmbeddingIdentity


class UpsertPoint(msgspec.Struct, frozen=True, tag="upsert"):
    point_id: str
    vector: Sequence[float]
    payload: dict[str, Any]


class SetState(msgspec.Struct, frozen=True, tag="set_state"):
    """Set the lifecycle state of ``point_id`` if it exists and belongs to ``owner``."""

    point_id: str
    owner: str
    state: NodeState


class EraseOwner(msgspec.Struct, frozen=True, tag="erase_owner"):
    owner: str


VectorOp = UpsertPoint | SetState | EraseOwner


class StoredPoint(msgspec.Struct, frozen=True):
    """A point read back from an engine (for the digest)."""

    vector: list[float]
    payload: dict[str, Any]


def point_id(node_id: str) -> str:
    """The deterministic point id of a memory node."""
    return str(uuid.uuid5(POINT_NAMESPACE, node_id))


def tracking_point_id(name: str) -> str:
    """The deterministic id of a special (tracking or metadata) point."""
    return str(uuid.uuid5(POINT_NAMESPACE, f"_tracking:{name}"))


def tracking_payload(state: TrackingState) -> dict[str, Any]:
    return {
        TRACKING_FLAG: True,
        "offset": state.offset,
        "model_name": state.identity.model_name,
        "model_version": state.identity.model_version,
        "dimension": state.identity.dimension,
    }


def tracking_from_payload(payload: dict[str, Any] | None) -> TrackingState | None:
    if not payload or not payload.get(TRACKING_FLAG):
        return None
    identity = EmbeddingIdentity(
        str(payload["model_name"]), str(payload["model_version"]), int(payload["dimension"])
    )
    return TrackingState(offset=int(payload["offset"]), identity=identity)


def placeholder_vector(dimension: int) -> list[float]:
    """The vector of a special point: engines need one, searches never reach it."""
    return [1.0] + [0.0] * (dimension - 1)


def _epoch(moment: datetime | None) -> float | None:
    return None if moment is None else moment.timestamp()


def node_payload(node: MemoryNode) -> dict[str, Any]:
    """The payload of a new (active) memory point."""
    return {
        "owner": node.owner,
        "scope": node.scope,
        "session_id": node.session_id,
        "node_type": node.node_type,
        "state": "active",
        "event_id": node.event_id,
        "node_id": node.node_id,
        "recorded_at": _epoch(node.recorded_at),
        "occurred_at": _epoch(node.occurred_at),
    }


def plan_batch(batch: list[ProjectedRecord], identity: EmbeddingIdentity) -> list[VectorOp]:
    """The batch as vector operations, in order. Raises ``ValueError`` (before anything is
    written) when a vector is invalid for ``identity``."""
    embedded = [
        item
        for item in batch
        if isinstance(item.record, Message) and item.node is not None and item.vector is not None
    ]
    vectors = [item.vector for item in embedded]
    checked = iter(checked_vectors(identity, vectors))
    ops: list[VectorOp] = []
    for item in batch:
        record = item.record
        if isinstance(record, Message):
            if item.node is not None and item.vector is not None:
                ops.append(
                    UpsertPoint(
                        point_id=point_id(item.node.node_id),
                        vector=next(checked),
                        payload=node_payload(item.node),
                    )
                )
        elif isinstance(record, NodeArchived):
            ops.append(SetState(point_id(record.node_id), record.owner, "archived"))
        elif isinstance(record, NodeRestored):
            ops.append(SetState(point_id(record.node_id), record.owner, "active"))
        elif isinstance(record, NodeSuperseded):
            ops.append(SetState(point_id(record.node_id), record.owner, "superseded"))
        elif isinstance(record, OwnerErased):
            ops.append(EraseOwner(record.owner))
    return ops


def compute_digest(points: Iterable[StoredPoint], tracking: TrackingState | None) -> str:
    """sha256 over the points sorted by node id (vector rounded, payload keys sorted) and
    the tracking record: equal content gives an equal digest whatever the write order,
    file layout or engine."""
    rows = []
    for point in points:
        payload = {key: point.payload.get(key) for key in PAYLOAD_KEYS}
        # Adding 0.0 turns -0.0 into 0.0, so a rounded-away sign does not change the hash.
        vector = np.round(np.asarray(point.vector, dtype=np.float64), DIGEST_DECIMALS) + 0.0
        rows.append((str(payload["node_id"]), _encode(payload), vector.tobytes()))
    rows.sort(key=lambda row: row[0])
    hasher = hashlib.sha256()
    hasher.update(_encode(None if tracking is None else msgspec.to_builtins(tracking)))
    for _, payload_bytes, vector_bytes in rows:
        hasher.update(b"\n")
        hasher.update(payload_bytes)
        hasher.update(vector_bytes)
    return hasher.hexdigest()


def _encode(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, allow_nan=False).encode()


class SearchFilter(msgspec.Struct, frozen=True):
    """What a search must match, translated by each engine into its own payload filter."""

    owner: str
    scope: str | None
    states: tuple[NodeState, ...] | None
    """``None``: any lifecycle state."""
    node_ids: tuple[str, ...] | None = None
    """``None``: any node; else only these nodes."""


class VectorModelBase(ABC):
    """The vector read model (``ReadModel`` with ``name = "vector"``) over one engine."""

    name: Literal["vector"] = "vector"

    def __init__(self, identity: EmbeddingIdentity) -> None:
        self._identity = identity
        self._tracking: TrackingState | None = None

    @property
    def identity(self) -> EmbeddingIdentity:
        """The identity of the provider the caller embeds with."""
        return self._identity

    def stored_identity(self) -> EmbeddingIdentity | None:
        """The identity the store was built with (``None`` if it never recorded one)."""
        return None if self._tracking is None else self._tracking.identity

    @property
    def identity_mismatch(self) -> bool:
        stored = self.stored_identity()
        return stored is not None and stored != self._identity

    def applied_offset(self) -> int:
        return -1 if self._tracking is None else self._tracking.offset

    def apply(self, batch: list[ProjectedRecord]) -> None:
        self._check_identity()
        if not batch:
            return
        ops = plan_batch(batch, self._identity)
        tracking = TrackingState(offset=batch[-1].offset, identity=self._identity)
        self._write(ops, tracking)
        self._tracking = tracking

    def forget_owners(self, owners: Sequence[str]) -> None:
        """Delete every point of ``owners`` (erased) from a store of another identity,
        which is applied no batch until its rebuild: the erasure's deletes must reach it
        all the same. The tracking record stays as it is."""
        owners = [owner for owner in owners if owner]
        if owners and self.identity_mismatch and self._tracking is not None:
            self._write([EraseOwner(owner) for owner in owners], self._tracking)

    def search(
        self,
        vector: list[float],
        owner: str,
        scope: str | None,
        limit: int,
        include_inactive: bool = False,
    ) -> list[VectorHit]:
        """The ``limit`` nearest memory points of ``owner`` (and ``scope``) by cosine."""
        self._check_identity()
        query = validate_vector(self._identity, vector)
        if limit <= 0:
            return []
        states: tuple[NodeState, ...] | None = None if include_inactive else ("active",)
        return self._search(query, SearchFilter(owner, scope, states), limit)

    @property
    def search_beside(self) -> bool:
        """A search is worth a thread of its own beside the other channels' (it is long
        and its engine calls are safe from two threads); else it follows them on the
        shard's thread."""
        return False

    def scores_for(self, vector: list[float], owner: str, node_ids: list[str]) -> dict[str, float]:
        """The cosine of each of ``owner``'s ``node_ids`` to ``vector`` (any state), so results
        found by other channels get a ``semantic_relevance`` too."""
        self._check_identity()
        if not node_ids:
            return {}
        query = validate_vector(self._identity, vector)
        where = SearchFilter(owner, None, None, tuple(node_ids))
        return {hit.node_id: hit.score for hit in self._search(query, where, len(node_ids))}

    def digest(self) -> str:
        return compute_digest(self._points(), self._tracking)

    def _check_identity(self) -> None:
        if self.identity_mismatch:
            raise EmbeddingMismatch(
                f"the vector store was built with {self.stored_identity()!r}, "
                f"not {self._identity!r}: rebuild it with the new provider"
            )

    @abstractmethod
    def _write(self, ops: list[VectorOp], tracking: TrackingState) -> None:
        """Apply ``ops`` in order, then store ``tracking`` as the last write."""

    @abstractmethod
    def _search(self, vector: list[float], where: SearchFilter, limit: int) -> list[VectorHit]:
        """The nearest points matching ``where``, filtered inside the engine."""

    @abstractmethod
    def _points(self) -> Iterable[StoredPoint]:
        """Every memory point of this model (tracking points excluded)."""

    @abstractmethod
    def count(self, owner: str | None = None) -> int:
        """The number of memory points (of ``owner`` when given), any lifecycle state."""

    @abstractmethod
    def close(self) -> None: ...

    def __enter__(self) -> VectorModelBase:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
