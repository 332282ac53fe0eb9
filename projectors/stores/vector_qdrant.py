"""The vector read model in one Qdrant collection shared by every partition.

The owner is a tenant payload index; each point also carries its ``partition``. Per
partition, a tracking point (deterministic id, payload ``{"_tracking": true, ...}``, no
owner, so no search reaches it) holds the last applied offset and the embedding identity;
a collection-wide metadata point records the identity the collection was created with.
A batch and its tracking point go to the server as one ``batch_update_points`` request.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, cast

from qdrant_client import QdrantClient, models

from prme.projectors.embeddings.protocol import EmbeddingIdentity

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

_META_ID = tracking_point_id("collection")
_SCROLL_PAGE = 1000


def _match(key: str, value: str | int) -> models.FieldCondition:
    return models.FieldCondition(key=key, match=models.MatchValue(value=value))


class QdrantVectorModel(VectorModelBase):
    """Vectors of partition ``partition`` in ``collection`` (created when absent)."""

    def __init__(
        self,
        client: QdrantClient,
        collection: str,
        partition: int,
        identity: EmbeddingIdentity,
    ) -> None:
        super().__init__(identity)
        self._client = client
        self._collection = collection
        self._partition = partition
        self._tracking_id = tracking_point_id(f"partition:{partition}")
        self._ensure_collection()
        self._tracking = self._read(self._tracking_id)
        if self._tracking is None:
            self._initialise()

    def _ensure_collection(self) -> None:
        if self._client.collection_exists(self._collection):
            return
        vectors = models.VectorParams(
            size=self._identity.dimension, distance=models.Distance.COSINE
        )
        try:
            self._client.create_collection(self._collection, vectors_config=vectors)
        except Exception:
            # Another partition's projector may have created it first.
            if not self._client.collection_exists(self._collection):
                raise
            return
        tenant = models.KeywordIndexParams(type=models.KeywordIndexType.KEYWORD, is_tenant=True)
        self._client.create_payload_index(self._collection, "owner", tenant)
        for field in ("scope", "state"):
            self._client.create_payload_index(
                self._collection, field, models.PayloadSchemaType.KEYWORD
            )
        self._client.create_payload_index(
            self._collection, "partition", models.PayloadSchemaType.INTEGER
        )

    def _initialise(self) -> None:
        """Record the partition's identity: the collection's, which fixes its vector space."""
        collection = self._read(_META_ID)
        if collection is not None:
            identity = collection.identity
        elif (dimension := self._dimension()) == self._identity.dimension:
            identity = self._identity
        else:
            identity = EmbeddingIdentity("unknown", "unknown", dimension)
        tracking = TrackingState(offset=-1, identity=identity)
        if identity == self._identity:
            points = [self._special(self._tracking_id, tracking)]
            if collection is None:
                points.append(self._special(_META_ID, tracking))
            self._client.upsert(self._collection, points, wait=True)
        self._tracking = tracking

    def _dimension(self) -> int:
        params = self._client.get_collection(self._collection).config.params.vectors
        if isinstance(params, models.VectorParams):
            return params.size
        raise TypeError(f"collection {self._collection} has named vectors, not one")

    def _read(self, special_id: str) -> TrackingState | None:
        found = self._client.retrieve(
            self._collection, [special_id], with_payload=True, with_vectors=False
        )
        return tracking_from_payload(found[0].payload) if found else None

    def _special(self, special_id: str, state: TrackingState) -> models.PointStruct:
        payload = {**tracking_payload(state), "partition": self._partition}
        return models.PointStruct(
            id=special_id, vector=placeholder_vector(state.identity.dimension), payload=payload
        )

    def _write(self, ops: list[VectorOp], tracking: TrackingState) -> None:
        operations: list[Any] = []
        pending: list[models.PointStruct] = []

        def flush() -> None:
            if pending:
                points = models.PointsList(points=list(pending))
                operations.append(models.UpsertOperation(upsert=points))
                pending.clear()

        for op in ops:
            if isinstance(op, UpsertPoint):
                payload = {**op.payload, "partition": self._partition}
                pending.append(
                    models.PointStruct(id=op.point_id, vector=list(op.vector), payload=payload)
                )
                continue
            flush()
            if isinstance(op, SetState):
                where = models.Filter(
                    must=[models.HasIdCondition(has_id=[op.point_id]), _match("owner", op.owner)]
                )
                change = models.SetPayload(payload={"state": op.state}, filter=where)
                operations.append(models.SetPayloadOperation(set_payload=change))
            elif isinstance(op, EraseOwner):
                where = models.Filter(must=[_match("owner", op.owner)])
                selector = models.FilterSelector(filter=where)
                operations.append(models.DeleteOperation(delete=selector))
        pending.append(self._special(self._tracking_id, tracking))
        flush()
        self._client.batch_update_points(self._collection, operations, wait=True)

    def _search(self, vector: list[float], where: SearchFilter, limit: int) -> list[VectorHit]:
        must: list[models.Condition] = [_match("owner", where.owner)]
        if where.scope is not None:
            must.append(_match("scope", where.scope))
        if where.states is not None:
            states = models.MatchAny(any=list(where.states))
            must.append(models.FieldCondition(key="state", match=states))
        if where.node_ids is not None:
            must.append(models.HasIdCondition(has_id=[point_id(n) for n in where.node_ids]))
        response = self._client.query_points(
            self._collection,
            query=vector,
            query_filter=models.Filter(must=must),
            limit=limit,
            with_payload=["node_id"],
        )
        return [
            VectorHit(node_id=str(point.payload["node_id"]), score=float(point.score))
            for point in response.points
            if point.payload is not None
        ]

    def _data_filter(self, owner: str | None = None) -> models.Filter:
        must: list[models.Condition] = [_match("partition", self._partition)]
        if owner is not None:
            must.append(_match("owner", owner))
        tracking = models.FieldCondition(key="_tracking", match=models.MatchValue(value=True))
        return models.Filter(must=must, must_not=[tracking])

    def _points(self) -> Iterator[StoredPoint]:
        cursor = None
        while True:
            page, cursor = self._client.scroll(
                self._collection,
                scroll_filter=self._data_filter(),
                limit=_SCROLL_PAGE,
                offset=cursor,
                with_payload=True,
                with_vectors=True,
            )
            for record in page:
                if isinstance(record.vector, list):
                    vector = cast(list[float], record.vector)
                    yield StoredPoint(vector=vector, payload=record.payload or {})
            if cursor is None:
                return

    def count(self, owner: str | None = None) -> int:
        result = self._client.count(self._collection, count_filter=self._data_filter(owner))
        return int(result.count)

    def close(self) -> None:
        """Nothing to release: the caller owns the client (shared by partitions)."""
