"""The vector read model on an embedded qdrant-edge shard, one shard directory per partition.

Only one process may open a shard directory (a second open fails with ``WouldBlock``).
``optimize()`` (the HNSW build) blocks the whole process, so it is never called here: past
``IndexPolicy.threshold`` unindexed points, ``vector_index_build`` builds the index in a
child process on a copy and swaps it in. Until then (and for points written since the
last build) filtered search is an exact scan of the owner's points.

A deleted point's vector stays in qdrant-edge's files (its segment's vector storage, its
WAL) until a segment is rebuilt. So after an erasure deleted points, the purge rewrites the
shard: every remaining point is copied into a new shard directory, which replaces the live
one (the same swap as an index build's); the old files are deleted. The copy is read a page
at a time, so searches go on meanwhile. The new shard has no HNSW graph: a due build
follows in the background.
"""

from __future__ import annotations

import shutil
import threading
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Final, cast

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
    QuantizationSearchParams,
    Query,
    QueryRequest,
    ScrollRequest,
    SearchParams,
    UpdateOperation,
)

from prme.projectors.embeddings.protocol import EmbeddingIdentity
from prme.projectors.model import ERASURES_PENDING, ModelClosed
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
from .vector_index_build import (
    IndexBuilder,
    IndexPolicy,
    IndexStatus,
    LiveShard,
    build_directory,
    recover,
    remove_leftovers,
)
from .vector_tenancy import EXCLUDED_AT_MOST, Holding, Tenancy

if TYPE_CHECKING:
    from qdrant_edge import ConditionType, PointId

_CONFIG_FILE = "edge_config.json"
_TRACKING_ID = uuid.UUID(tracking_point_id("edge"))
_SCROLL_PAGE = 1000
NODE_ID_CACHE_POINTS: Final = 200_000
"""The most node ids a vector store keeps by point id (~190 bytes each)."""
PRIMED_FROM: Final = 1_000
"""Points from which an opened shard reads its node ids in the background (a smaller one's
are remembered within a few searches)."""
OVERSAMPLING: Final = 1.2
RESCORED_AT_LEAST: Final = 100


def quantized_search(limit: int) -> SearchParams:
    """How a search reads a shard whose build stored int8 codes
    (``IndexPolicy.quantization``): ``OVERSAMPLING`` x ``limit`` candidates by the codes
    (``RESCORED_AT_LEAST`` at least: a short list has more to lose to the codes' rounding,
    and rescoring 100 costs microseconds), rescored on the float vectors, so every score
    is the exact cosine. Segments without codes (unindexed ones) ignore it.

    Measured at 100k points of one owner, 500 hits: the same agreement with an exact scan
    as the float graph (top 10: 0.969 vs 0.963; top 500: 0.919 vs 0.918), p50 5.5 vs
    7.6 ms. An owner small enough to be scanned has its codes scanned: of 14,394 exact
    hits scoring above the 500th (a 3,000-point owner, 30 queries), one was missed."""
    oversampling = max(OVERSAMPLING, RESCORED_AT_LEAST / max(1, limit))
    return SearchParams(
        quantization=QuantizationSearchParams(rescore=True, oversampling=oversampling)
    )


def _floats_only(limit: int) -> SearchParams:
    """A search that ignores int8 codes a shard holds (``IndexPolicy.quantization`` off)."""
    return _FLOATS_ONLY


_FLOATS_ONLY: Final = SearchParams(quantization=QuantizationSearchParams(ignore=True))


def _create(path: Path, identity: EmbeddingIdentity) -> EdgeShard:
    path.mkdir(parents=True, exist_ok=True)
    vectors = EdgeVectorParams(size=identity.dimension, distance=Distance.Cosine)
    return EdgeShard.create(str(path), EdgeConfig(vectors=vectors))


def _index_fields(shard: EdgeShard) -> None:
    """The payload indexes searches filter on (owner: a tenant key)."""
    shard.update(UpdateOperation.create_field_index("owner", KeywordIndexParams(is_tenant=True)))
    for field in ("scope", "state"):
        shard.update(UpdateOperation.create_field_index(field, PayloadSchemaType.Keyword))


def rewrites_mark(path: Path) -> Path:
    """Beside the store at ``path``: present once the store is one an erasure rewrites.
    A store made before erasures rewrote the shard (2026-12-07) may hold the vectors of
    owners erased back then, and of deleted messages, in its files; it has no mark, so it
    is rewritten once when it opens (the shard's opening waits for it)."""
    return path.with_name(path.name + ".rewrites")


def _mark_rewrites(path: Path) -> None:
    rewrites_mark(path).touch()


def _match(key: str, value: str) -> FieldCondition:
    return FieldCondition(key, match=MatchValue(value))


class EdgeVectorModel(VectorModelBase):
    """Vectors of one partition in an EdgeShard at ``path`` (created when absent)."""

    def __init__(
        self, path: Path, identity: EmbeddingIdentity, index: IndexPolicy | None = None
    ) -> None:
        """With ``index``, the shard gets its HNSW index built in the background once it
        holds enough points (see ``vector_index_build``)."""
        super().__init__(identity)
        self._path = path
        recover(path)
        self._live = LiveShard(path, self._open(path, identity))
        self._search_params = (
            quantized_search if index is None or index.quantization else _floats_only
        )
        self._closed = False
        self._builder: IndexBuilder | None = None
        self._node_ids: dict[int, str] = {}
        self._tenancy = Tenancy()
        self._tenancy_of: EdgeShard | None = None
        """The live shard ``_tenancy`` describes (another one is surveyed again)."""
        self._excluding: tuple[tuple[int, bool], Filter] | None = None
        """The last sole-owner search filter, by the tenancy's version and whether it
        excludes inactive points."""
        self._erasures = 0
        self._writes = 0
        """Batches written (a rewrite's copy is made again if one came meanwhile)."""
        self._rewrite_due = (path.parent / ERASURES_PENDING).exists()
        """Deleted points may hold vectors in the files: the next purge rewrites the shard
        (at open: when the shard's purge is pending, which a crash interrupted, or when
        the store was made by a version that did not rewrite: see :func:`rewrites_mark`)."""
        self._primer: threading.Thread | None = None
        try:
            remove_leftovers(path)
            self._tracking = self._read_tracking()
            if self._tracking is None:
                self._initialise()
                _mark_rewrites(path)
            elif not rewrites_mark(path).exists():
                self._rewrite_due = True
            if self._shard.info().points_count <= 1:  # the tracking point, or not even it
                self._tenancy.surveyed(0)
                self._tenancy_of = self._shard
            if index is not None and self._tracking is not None and not self.identity_mismatch:
                dimension = self._tracking.identity.dimension
                self._builder = IndexBuilder(self._live, dimension, index, special_points=1)
                with self._live.lock:
                    self._builder.maybe_start()
            self._start_priming()
        except BaseException:
            self.close()
            raise

    @property
    def _shard(self) -> EdgeShard:
        """The live shard: use it holding ``self._live.lock`` (a build swaps it)."""
        return self._live.shard

    @staticmethod
    def _open(path: Path, identity: EmbeddingIdentity) -> EdgeShard:
        try:
            if (path / _CONFIG_FILE).exists():
                return EdgeShard.load(str(path))
            return _create(path, identity)
        except Exception as error:
            raise ShardUnavailable(
                f"cannot open the vector shard at {path} (open in another process?): {error}"
            ) from error

    def _initialise(self) -> None:
        _index_fields(self._shard)
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
        with self._live.lock:
            try:
                self._write_locked(ops, tracking)
            except BaseException:
                # The tenancy may have taken in writes the shard did not: survey it again.
                self._tenancy.forget()
                raise
            if self._builder is not None:
                self._builder.maybe_start()

    def _write_locked(self, ops: list[VectorOp], tracking: TrackingState) -> None:
        self._writes += 1
        pending: list[Point] = []
        for op in ops:
            if isinstance(op, UpsertPoint):
                # Point reads any float sequence (stubs say list): a float32 array, uncopied.
                vector = cast("list[float]", op.vector)
                pending.append(Point(op.point_id, vector, op.payload))  # parses the UUID
                key = int(op.point_id.replace("-", ""), 16)
                self._remember(key, op)
                owner = op.payload.get("owner")
                state = str(op.payload.get("state"))
                self._tenancy.upserted(owner if isinstance(owner, str) else None, state, key)
                continue
            self._upsert(pending)
            pending = []
            if isinstance(op, SetState):
                point = uuid.UUID(op.point_id)
                where = Filter(must=[HasIdCondition({point}), _match("owner", op.owner)])
                self._shard.update(
                    UpdateOperation.set_payload_by_filter(where, {"state": op.state})
                )
                # A node without a vector (or of another owner) has no point to leave out.
                if self._tenancy.sole_owner() == op.owner and self._shard.retrieve(
                    [point], with_payload=False, with_vector=False
                ):
                    self._tenancy.state_set(op.owner, point.int, op.state)
                self._noted([point])
            elif isinstance(op, EraseOwner):
                where = Filter(must=[_match("owner", op.owner)])
                if self._shard.count(CountRequest(exact=True, filter=where)):
                    self._rewrite_due = True
                    rewrites_mark(self._path).unlink(missing_ok=True)  # (due after a restart)
                self._shard.update(UpdateOperation.delete_points_by_filter(where))
                self._tenancy.erased(op.owner)
                self._node_ids.clear()  # the process keeps no id of an erased owner
                self._erasures += 1
                if self._builder is not None:
                    self._builder.note_erased(op.owner)
        pending.append(self._tracking_point(tracking))
        self._upsert(pending)

    def _upsert(self, points: list[Point]) -> None:
        if points:
            self._shard.update(UpdateOperation.upsert_points(points))
            if self._builder is not None and self._builder.journaling:
                self._noted([point.id for point in points])

    def _noted(self, point_ids: Sequence[PointId]) -> None:
        if self._builder is not None:
            self._builder.note_points(point_ids)

    def _search(self, vector: list[float], where: SearchFilter, limit: int) -> list[VectorHit]:
        with self._live.lock:
            if self._closed:  # searched from beside the shard's thread, after a swap
                raise ModelClosed(f"the vector shard at {self._path} is closed")
            request = QueryRequest(
                limit=limit,
                query=Query.Nearest(vector),
                filter=self._filter(where),
                params=self._search_params(limit),
                with_payload=False,
            )
            found = self._shard.query(request)
            node_ids = self._node_ids_of([cast("uuid.UUID", point.id) for point in found])
        return [
            VectorHit(node_id=node_id, score=float(point.score))
            for point, node_id in zip(found, node_ids, strict=True)
            if node_id is not None
        ]

    def _filter(self, where: SearchFilter) -> Filter:
        """``where`` as a payload filter, or, when the shard holds no other owner's
        points, as the few points it must leave out (see ``vector_tenancy``)."""
        if where.scope is None and where.node_ids is None and where.states in (None, ("active",)):
            if self._tenancy_of is not self._shard:
                self._tenancy.forget()
                self._tenancy_of = self._shard
            if self._tenancy.holding is Holding.UNKNOWN:
                self._survey()
            sole = self._tenancy.sole_owner()
            if sole is not None and sole == where.owner:
                return self._sole_owner_filter(where.states is not None)
        must: list[ConditionType] = [_match("owner", where.owner)]
        if where.scope is not None:
            must.append(_match("scope", where.scope))
        if where.states is not None:
            must.append(FieldCondition("state", match=MatchAny(list(where.states))))
        if where.node_ids is not None:
            must.append(HasIdCondition({uuid.UUID(point_id(n)) for n in where.node_ids}))
        return Filter(must=must)

    def _sole_owner_filter(self, active_only: bool) -> Filter:
        key = (self._tenancy.version, active_only)
        if self._excluding is None or self._excluding[0] != key:
            left_out: set[PointId] = {_TRACKING_ID}
            if active_only:
                left_out.update(uuid.UUID(int=point) for point in self._tenancy.inactive)
            self._excluding = (key, Filter(must_not=[HasIdCondition(left_out)]))
        return self._excluding[1]

    def _survey(self) -> None:
        """Tell the tenancy which owners the live shard's memory points have: one point's
        owner, then whether any point has another (~2 ms at 100k points), then that
        owner's inactive points."""
        special = HasIdCondition({_TRACKING_ID})
        first, _ = self._shard.scroll(
            ScrollRequest(
                limit=1,
                filter=Filter(must_not=[special]),
                with_payload=["owner"],
                with_vector=False,
            )
        )
        if not first:
            self._tenancy.surveyed(0)
            return
        owner = (first[0].payload or {}).get("owner")
        if not isinstance(owner, str):
            self._tenancy.surveyed(2)
            return
        others = Filter(must_not=[special, _match("owner", owner)])
        if self._shard.count(CountRequest(exact=True, filter=others)):
            self._tenancy.surveyed(2)
            return
        inactive, _ = self._shard.scroll(
            ScrollRequest(
                limit=EXCLUDED_AT_MOST + 1,
                filter=Filter(must_not=[special, _match("state", "active")]),
                with_payload=False,
                with_vector=False,
            )
        )
        self._tenancy.surveyed(1, owner, [cast("uuid.UUID", r.id).int for r in inactive])

    def _node_ids_of(self, point_ids: list[uuid.UUID]) -> list[str | None]:
        """The node id of each point (``None``: a point without one), read from the points'
        payload only for points the process has not remembered.

        Reading the ``node_id`` payload of 500 hits cost ~4 ms, a third of a one-owner 100k
        search. So the ids of the points this process writes are remembered, an opened
        shard's are read in the background (``_prime``), and a search remembers what it
        read. A point's id is a hash of its node id, so a remembered id is never stale;
        the map is emptied when it would pass ``NODE_ID_CACHE_POINTS``."""
        known = self._node_ids
        keys = [point.int for point in point_ids]
        resolved = list(map(known.get, keys))
        if None not in resolved:
            return resolved
        missing = [p for p, node_id in zip(point_ids, resolved, strict=True) if node_id is None]
        records = self._shard.retrieve(
            cast("list[PointId]", missing), with_payload=["node_id"], with_vector=False
        )
        fetched: dict[int, str] = {}
        for record in records:
            node_id = (record.payload or {}).get("node_id")
            if isinstance(node_id, str):
                fetched[cast("uuid.UUID", record.id).int] = node_id
        resolved = [found or fetched.get(key) for found, key in zip(resolved, keys, strict=True)]
        if len(known) + len(fetched) > NODE_ID_CACHE_POINTS:
            known.clear()
        known.update(fetched)
        return resolved

    def _remember(self, key: int, op: UpsertPoint) -> None:
        node_id = op.payload.get("node_id")
        if isinstance(node_id, str) and len(self._node_ids) < NODE_ID_CACHE_POINTS:
            self._node_ids[key] = node_id

    def _start_priming(self) -> None:
        points = self._shard.info().points_count - 1  # the tracking point
        # A mismatched model serves no search until a rebuild replaces it.
        if not self.identity_mismatch and PRIMED_FROM <= points <= NODE_ID_CACHE_POINTS:
            self._primer = threading.Thread(
                target=self._prime,
                args=(self._erasures,),
                name=f"prme-{self._path.parent.name}-node-ids",
                daemon=True,
            )
            self._primer.start()

    def _prime(self, erasures: int) -> None:
        """Read every point's node id into the remembered ids, a page at a time (searches
        and writes go on between pages); stop at close, and drop what was read if an
        erasure came meanwhile. ~1 s of one core for 100k points."""
        found: dict[int, str] = {}
        cursor = None
        while True:
            request = ScrollRequest(
                offset=cursor, limit=_SCROLL_PAGE, with_payload=["node_id"], with_vector=False
            )
            with self._live.lock:
                if self._closed or self._erasures != erasures:
                    return
                page, cursor = self._shard.scroll(request)
            for record in page:
                node_id = (record.payload or {}).get("node_id")
                if isinstance(node_id, str):
                    found[cast("uuid.UUID", record.id).int] = node_id
            if cursor is None:
                break
        with self._live.lock:
            known = self._node_ids
            fresh = {point: node_id for point, node_id in found.items() if point not in known}
            if self._erasures == erasures and len(known) + len(fresh) <= NODE_ID_CACHE_POINTS:
                known.update(fresh)

    def purge(self) -> None:
        """After an erasure (:func:`erasure.purge_models`): keep no remembered node id,
        whether or not a batch reached this model (a mismatched one is never applied to).
        The rewrite that follows runs off the shard's thread (:meth:`rewrite_if_due`)."""
        with self._live.lock:
            self._node_ids.clear()
            self._erasures += 1

    def rewrite_if_due(self) -> bool:
        """If an erasure deleted points of this shard, replace the live shard by a copy of
        its remaining points (see the module's docstring); returns whether it did. Call it
        off the shard's thread while no batch is applied to the model (the erasure's purge
        does): searches go on, as the lock is held for one page of the copy at a time and
        for the swap. A write meanwhile (none is expected) has the copy made again under
        the lock. An index build is held meanwhile (a running one is abandoned: its copy
        holds the deleted points). ModelClosed if the model closes meanwhile."""
        with self._live.lock:
            if not self._rewrite_due:
                return False
            if self._closed:  # (the purge stays pending: it runs when the shard opens)
                raise ModelClosed(f"{self._path} closed before its rewrite")
            if self._builder is not None:
                self._builder.hold()
            writes = self._writes
        staged = build_directory(self._path)
        try:
            self._copy_points(staged)
            with self._live.lock:
                if self._closed:  # (the purge stays pending: it runs when the shard opens)
                    raise ModelClosed(f"{self._path} closed during its rewrite")
                if self._writes != writes:
                    shutil.rmtree(staged)
                    self._copy_points(staged)  # (the lock is reentrant: held throughout)
                self._live.replace(staged)
                self._rewrite_due = False
                _mark_rewrites(self._path)
        except BaseException:
            shutil.rmtree(staged, ignore_errors=True)
            raise
        finally:
            if self._builder is not None:
                with self._live.lock:
                    self._builder.release()
        return True

    def _copy_points(self, staged: Path) -> None:
        """A new shard at ``staged`` holding every point of the live one, read a page at a
        time under the lock."""
        stored = self._tracking.identity if self._tracking is not None else self._identity
        fresh = _create(staged, stored)
        try:
            _index_fields(fresh)
            cursor = None
            while True:
                request = ScrollRequest(
                    offset=cursor, limit=_SCROLL_PAGE, with_payload=True, with_vector=True
                )
                with self._live.lock:
                    if self._closed:
                        raise ModelClosed(f"{self._path} closed during its rewrite")
                    page, cursor = self._shard.scroll(request)
                points = [
                    Point(record.id, cast("list[float]", record.vector), record.payload or {})
                    for record in page
                    if record.vector is not None
                ]
                if points:
                    fresh.update(UpdateOperation.upsert_points(points))
                if cursor is None:
                    break
            fresh.flush()
        finally:
            fresh.close()

    def _points(self) -> Iterator[StoredPoint]:
        where = Filter(must_not=[HasIdCondition({_TRACKING_ID})])
        cursor = None
        while True:
            request = ScrollRequest(
                offset=cursor,
                limit=_SCROLL_PAGE,
                filter=where,
                with_payload=True,
                with_vector=True,
            )
            # A page at a time: a build swapped in between pages holds the same points.
            with self._live.lock:
                page, cursor = self._shard.scroll(request)
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
        with self._live.lock:
            return int(self._shard.count(CountRequest(exact=True, filter=where)))

    @property
    def rewrite_due(self) -> bool:
        """Whether the next purge, or the shard's opening, rewrites the shard."""
        return self._rewrite_due

    @property
    def search_beside(self) -> bool:
        """Once the shard has an HNSW graph (20k points and more by default): searching its
        500 nearest takes ~10 ms, as long as the lexical search, and every engine call
        holds the model's lock. A small shard's search takes ~1 ms, less than the second
        thread's cost under load (GIL hand-offs between more threads)."""
        return self._live.indexed

    def index_status(self) -> IndexStatus | None:
        """Points, indexed vectors and whether a build runs (``None``: no index policy)."""
        return None if self._builder is None else self._builder.status()

    def wait_index_idle(self, timeout_s: float) -> bool:
        """Wait until no HNSW build runs or is due; False if ``timeout_s`` passed first."""
        return True if self._builder is None else self._builder.wait_idle(timeout_s)

    def close(self) -> None:
        if not getattr(self, "_closed", True):
            self._closed = True
            if self._builder is not None:
                self._builder.close()  # without the lock: the build thread may wait on it
            with self._live.lock:
                self._shard.close()
            if self._primer is not None:
                self._primer.join()  # stops at its next page
            self._node_ids.clear()
