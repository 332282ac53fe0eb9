"""The vector read model on an embedded qdrant-edge shard, one shard directory per partition.

Only one process may open a shard directory (a second open fails with ``WouldBlock``).
``optimize()`` (the HNSW build) blocks the whole process, so it is never called here:
before HNSW, filtered search is an exact scan of the owner's points.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from qdrant_edge import (
    CountRequest,
    Distance,
    EdgeConfig,
    EdgeShard,
    EdgeVectorParams,
    FieldCondition,
    Filter,
    HasIdCondition,
    KeywordIndexParams,
    MatchAny,
    MatchValue,
    PayloadSchemaType,
    Point,
    Query,
    QueryRequest,
    ScrollRequest,
    UpdateOperation,
)

from prme.projectors.embeddings.protocol import EmbeddingIdentity
from prme.schemas.errors import EmbeddingMismatch, ShardUnavailable

from .vector_base import (
    EraseOwner,
    SearchFilter,
    SetState,
    StoredPoint,
    TrackingState,
    UpsertPoint,
    VectorHit,
    VectorModelBase,
    VectorOp,
    placeholder_vector,
    point_id,
    tracking_from_payload,
    tracking_payload,
    tracking_point_id,
)

if TYPE_CHECKING:
    from qdrant_edge import ConditionType

_CONFIG_FILE = "edge_config.json"
_TRACKING_ID = uuid.UUID(tracking_point_id("edge"))
_SCROLL_PAGE = 1000


def _match(key: str, value: str) -> FieldCondition:
    return FieldCondition(key, match=MatchValue(value))


class EdgeVectorModel(VectorModelBase):
    """Vectors of one partition in an EdgeShard at ``path`` (created when absent)."""

    def __init__(self, path: Path, identity: EmbeddingIdentity) -> None:
        super().__init__(identity)
        self._path = path
        self._shard = self._open(path, identity)
        self._closed = False
        try:
            self._tracking = self._read_tracking()
            if self._tracking is None:
                self._initialise()
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _open(path: Path, identity: EmbeddingIdentity) -> EdgeShard:
        try:
            if (path / _CONFIG_FILE).exists():
                return EdgeShard.load(str(path))
            path.mkdir(parents=True, exist_ok=True)
            vectors = EdgeVectorParams(size=identity.dimension, distance=Distance.Cosine)
            return EdgeShard.create(str(path), EdgeConfig(vectors=vectors))
        except Exception as error:
            raise ShardUnavailable(
                f"cannot open the vector shard at {path} (open in another process?): {error}"
            ) from error

    def _initialise(self) -> None:
        self._shard.update(
            UpdateOperation.create_field_index("owner", KeywordIndexParams(is_tenant=True))
        )
        for field in ("scope", "state"):
            self._shard.update(UpdateOperation.create_field_index(field, PayloadSchemaType.Keyword))
        tracking = TrackingState(offset=-1, identity=self._identity)
        try:
            self._shard.update(UpdateOperation.upsert_points([self._tracking_point(tracking)]))
        except Exception as error:
            raise EmbeddingMismatch(
                f"the vector shard at {self._path} holds another vector space: {error}"
            ) from error
        self._tracking = tracking

    def _read_tracking(self) -> TrackingState | None:
        found = self._shard.retrieve([_TRACKING_ID], with_payload=True, with_vector=False)
        return tracking_from_payload(found[0].payload) if found else None

    def _tracking_point(self, tracking: TrackingState) -> Point:
        vector = placeholder_vector(tracking.identity.dimension)
        return Point(_TRACKING_ID, vector, tracking_payload(tracking))

    def _write(self, ops: list[VectorOp], tracking: TrackingState) -> None:
        pending: list[Point] = []
        for op in ops:
            if isinstance(op, UpsertPoint):
                pending.append(Point(uuid.UUID(op.point_id), op.vector, op.payload))
                continue
            self._upsert(pending)
            pending = []
            if isinstance(op, SetState):
                where = Filter(
                    must=[HasIdCondition({uuid.UUID(op.point_id)}), _match("owner", op.owner)]
                )
                self._shard.update(
                    UpdateOperation.set_payload_by_filter(where, {"state": op.state})
                )
            elif isinstance(op, EraseOwner):
                where = Filter(must=[_match("owner", op.owner)])
                self._shard.update(UpdateOperation.delete_points_by_filter(where))
        pending.append(self._tracking_point(tracking))
        self._upsert(pending)

    def _upsert(self, points: list[Point]) -> None:
        if points:
            self._shard.update(UpdateOperation.upsert_points(points))

    def _search(self, vector: list[float], where: SearchFilter, limit: int) -> list[VectorHit]:
        must: list[ConditionType] = [_match("owner", where.owner)]
        if where.scope is not None:
            must.append(_match("scope", where.scope))
        if where.states is not None:
            must.append(FieldCondition("state", match=MatchAny(list(where.states))))
        if where.node_ids is not None:
            must.append(HasIdCondition({uuid.UUID(point_id(n)) for n in where.node_ids}))
        request = QueryRequest(
            limit=limit,
            query=Query.Nearest(vector),
            filter=Filter(must=must),
            with_payload=["node_id"],
        )
        return [
            VectorHit(node_id=str(point.payload["node_id"]), score=float(point.score))
            for point in self._shard.query(request)
            if point.payload is not None
        ]

    def _points(self) -> Iterator[StoredPoint]:
        where = Filter(must_not=[HasIdCondition({_TRACKING_ID})])
        cursor = None
        while True:
            page, cursor = self._shard.scroll(
                ScrollRequest(
                    offset=cursor,
                    limit=_SCROLL_PAGE,
                    filter=where,
                    with_payload=True,
                    with_vector=True,
                )
            )
            for record in page:
                vector = record.vector
                if isinstance(vector, list):
                    floats = [x for x in vector if isinstance(x, float | int)]
                    yield StoredPoint(
                        vector=[float(x) for x in floats], payload=record.payload or {}
                    )
            if cursor is None:
                return

    def count(self, owner: str | None = None) -> int:
        must: list[ConditionType] = [] if owner is None else [_match("owner", owner)]
        where = Filter(must=must, must_not=[HasIdCondition({_TRACKING_ID})])
        return int(self._shard.count(CountRequest(exact=True, filter=where)))

    def close(self) -> None:
        if not getattr(self, "_closed", True):
            self._closed = True
            self._shard.close()
