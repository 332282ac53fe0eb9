"""One shard: every read model of one log partition, and how a batch is applied to them.

All of a shard's model calls run on the shard's own thread, so a model never sees two
threads at once; shards work in parallel with each other. The one exception is
:meth:`Shard.search_beside`: an indexed vector model (the embedded store's engine calls
hold its own lock) is searched on a second thread while the shard's thread searches the
other channels.
"""

from __future__ import annotations

import asyncio
import glob
import os
import shutil
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractAsyncContextManager, nullcontext, suppress
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

from prme.producers.sealing import keys_for
from prme.producers.transport import LogEntry
from prme.schemas.codec import encode_record
from prme.schemas.config import Settings
from prme.schemas.errors import (
    InvalidEmbedding,
    InvalidInput,
    RecordDecodeError,
    ShardUnavailable,
)
from prme.schemas.metrics import Metrics
from prme.schemas.records import Message
from prme.schemas.sealing import ErasedRecord, KeyRef, Sealer

from .backends import VectorBackend
from .dead_letters import DeadLetter
from .derive import derive_node, embedding_text
from .embeddings.protocol import EmbeddingIdentity
from .erasure import Forgetting
from .model import Commit, ModelClosed, ModelName, ProjectedRecord, ReadModel, StagedCommits
from .registry import MODEL_NAMES, ModelContext, ReadModelSpec, open_read_model, read_models
from .repeats import FirstCopies

if TYPE_CHECKING:
    from .vector_changelog import VectorChangelog

T = TypeVar("T")

RECORD_FAULTS = (InvalidInput, InvalidEmbedding, RecordDecodeError)
"""Errors a record itself causes: it goes to the dead letters and projection goes on. Any
other error (a locked file, a full disk) stops the projector instead, so it resumes from
the stored offsets rather than silently dropping records from one read model."""

RETIRED_SUFFIX = ".retired"
"""A live model folder moved aside while a rebuilt one is swapped in."""

VectorEncoder = Callable[[list[str]], Any]
"""``async (texts) -> vectors``: the runner's cached embedding step."""


def shard_directory(data_dir: Path, partition: int) -> Path:
    return data_dir / "shards" / f"p{partition}"


class Shard:
    """The read models of partition ``partition`` under ``directory``."""

    def __init__(
        self,
        directory: Path,
        partition: int,
        settings: Settings,
        identity: EmbeddingIdentity,
        *,
        models: Sequence[ModelName] = MODEL_NAMES,
        vectors: VectorBackend | None = None,
        metrics: Metrics | None = None,
        changelog: VectorChangelog | None = None,
        forgetting: Forgetting | None = None,
        apply_gate: asyncio.Lock | None = None,
    ) -> None:
        """Without ``vectors`` the shard opens (and closes) the backend ``settings`` name.
        ``forgetting``: the key store that opens sealed records and what an erasure purges
        beyond the models (see ``erasure.Forgetting``); without it, sealed records are
        skipped as erased (only plain records are projected)."""
        self.directory = directory
        self._forgetting = forgetting
        self._sealer = Sealer()
        self._changelog = changelog
        self._metrics = metrics if metrics is not None else Metrics(enabled=False)
        self.partition = partition
        self._settings = settings
        self._identity = identity
        self._owns_vectors = vectors is None
        self._vectors = vectors or VectorBackend.from_settings(settings)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"prme-p{partition}")
        self._beside = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix=f"prme-p{partition}-search"
        )
        self._closing = False
        self._closed: asyncio.Future[None] | None = None
        self.models: dict[ModelName, ReadModel] = {}
        self._specs = read_models(models)
        self.position = -1
        """The last offset this shard has processed (applied or dead-lettered)."""
        self._first_copies = FirstCopies(directory)
        self.apply_gate = apply_gate
        """Held while a batch is decoded and derived and while it is written to the models
        (shared by shards, so one of them at a time does those GIL-bound steps)."""

    def publish_vectors_to(self, changelog: VectorChangelog | None) -> None:
        """Start (or stop) publishing computed vectors: a standby promoted to owner."""
        self._changelog = changelog

    async def open(self, *, lazily: bool = False) -> None:
        """Open the models; with ``lazily``, a shard that has no directory yet is created on
        first use (opening twelve empty vector shards costs seconds)."""
        if lazily and not self.directory.exists():
            return
        await self.ensure_open()

    async def ensure_open(self) -> None:
        if self.models:
            return

        def _open() -> None:
            if self.models:  # two callers raced to open: the first one did it
                return
            for spec in self._specs:
                self.models[spec.name] = self.open_model(spec)

        await self.run(_open)
        self.position = self.applied_offset()
        if self._forgetting is not None:  # a purge a crash interrupted
            await self._forgetting.resume(self)

    def open_model(self, spec: ReadModelSpec) -> ReadModel:
        """Open ``spec``'s model in ``<directory>/<name>`` (call on the shard's thread)."""
        context = ModelContext(
            directory=self.directory / spec.name,
            partition=self.partition,
            settings=self._settings,
            identity=self._identity,
            vectors=self._vectors,
        )
        return open_read_model(spec, context)

    async def run(self, function: Callable[..., T], *args: Any) -> T:
        """Run ``function`` on the shard's thread; :class:`ShardUnavailable` once the
        shard is closing."""
        return await self._on(self._executor, function, *args)

    @property
    def closing(self) -> bool:
        """:meth:`close` has begun: what this shard answers from now on may be partial."""
        return self._closing

    async def _on(self, executor: ThreadPoolExecutor, function: Callable[..., T], *args: Any) -> T:
        if self._closing:
            raise self._unavailable()
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(executor, function, *args)
        except RuntimeError:  # ModelClosed, or an executor already shut down
            if self._closing:
                raise self._unavailable() from None
            raise

    def _unavailable(self) -> ShardUnavailable:
        return ShardUnavailable(
            f"partition {self.partition} is closing here (moved, or the node is stopping)"
        )

    async def search_beside(self, name: ModelName, function: Callable[[Any], T]) -> T:
        """Run ``function(model)`` for model ``name`` on the shard's second thread, beside
        whatever the shard's thread runs: only for a model whose calls are safe from two
        threads (the vector model). A model being swapped or closed meanwhile raises
        :class:`ModelClosed` (call it again through :meth:`call`, which waits for the
        swap)."""

        def resolved() -> T:
            model = self.models.get(name)
            if model is None:
                raise ModelClosed(f"p{self.partition}: no {name} model open")
            return function(model)

        return await self._on(self._beside, resolved)

    async def call(self, name: ModelName, function: Callable[[Any], T]) -> T:
        """Run ``function(model)`` on the shard's thread, resolving model ``name`` there, so
        a rebuild swapping models between two calls never hands out a closed one."""
        return await self.run(lambda: function(self.models[name]))

    @property
    def vector_mismatch(self) -> bool:
        vector = self.models.get("vector")
        return bool(vector is not None and getattr(vector, "identity_mismatch", False))

    @property
    def lexical_legacy(self) -> bool:
        """Whether the lexical index has its earlier terms (``prme rebuild --model lexical``)."""
        lexical = self.models.get("lexical")
        return bool(lexical is not None and getattr(lexical, "legacy_terms", False))

    def live_models(self) -> dict[ModelName, ReadModel]:
        """The models a batch is applied to (a mismatched vector model waits for a rebuild)."""
        return {
            name: model
            for name, model in self.models.items()
            if not (name == "vector" and self.vector_mismatch)
        }

    def applied_offset(self) -> int:
        """The offset every live model has applied (read-your-writes waits on this)."""
        offsets = [m.applied_offset() for m in self.live_models().values()]
        return min(offsets) if offsets else -1

    async def apply(self, entries: Sequence[LogEntry], encode: VectorEncoder) -> list[DeadLetter]:
        """Apply ``entries`` to every live model; returns the records that failed."""
        await self.ensure_open()
        dead = await self._apply(entries, encode)
        if entries:
            self.position = max(self.position, entries[-1].offset)
        return dead

    async def _apply(self, entries: Sequence[LogEntry], encode: VectorEncoder) -> list[DeadLetter]:
        live = self.live_models()
        floor = min((m.applied_offset() for m in live.values()), default=-1)
        keys = await keys_for(
            None if self._forgetting is None else self._forgetting.keys,
            (entry.value for entry in entries if entry.offset > floor),
        )
        async with self._gated():
            dead, projected = await self.run(self._project, entries, floor, keys)
        if not projected:
            return dead
        attributes = {
            "prme.partition": self.partition,
            "prme.first_offset": projected[0].offset,
            "prme.last_offset": projected[-1].offset,
            "prme.event_ids": [p.record.event_id for p in projected],  # links to prme.append
        }
        with self._metrics.tracing.span("prme.apply", attributes):
            vector = live.get("vector")
            if vector is not None:
                projected = await self._with_vectors(projected, vector.applied_offset(), encode)
            if self._changelog is not None:  # before the models: a crash repeats, never skips
                await self._changelog.record(self.partition, projected)
            if self._forgetting is not None:
                self._forgetting.before_apply(self, projected)
            dead.extend(await self._write(live, projected))
            if self._forgetting is not None:
                await self._forgetting.after_apply(self, projected)
        return dead

    def _gated(self) -> AbstractAsyncContextManager[Any]:
        return self.apply_gate if self.apply_gate is not None else nullcontext()

    async def _write(
        self, live: dict[ModelName, ReadModel], projected: list[ProjectedRecord]
    ) -> list[DeadLetter]:
        """Apply ``projected`` to the models on the shard's thread, holding the apply gate
        until every model has written or staged it: the staged models' commits, which wait
        on their engines' threads, run after the gate is free (``StagedCommits``)."""
        gate = self.apply_gate
        if gate is None:
            return await self.run(self._apply_all, live, projected, _nothing)
        loop = asyncio.get_running_loop()
        staged: asyncio.Future[None] = loop.create_future()

        def release() -> None:  # on the shard's thread
            with suppress(RuntimeError):  # a loop closed meanwhile has no gate to free
                loop.call_soon_threadsafe(_resolve, staged)

        async with gate:
            writing = asyncio.ensure_future(self.run(self._apply_all, live, projected, release))
            try:
                await asyncio.wait((writing, staged), return_when=asyncio.FIRST_COMPLETED)
            except asyncio.CancelledError:
                writing.cancel()
                raise
        return await writing

    def _project(
        self, entries: Sequence[LogEntry], floor: int, keys: dict[KeyRef, bytes]
    ) -> tuple[list[DeadLetter], list[ProjectedRecord]]:
        """Open (with ``keys``) and decode the entries past ``floor`` and derive their
        nodes, on the shard's thread (one hop per batch; the event loop stays free for
        queries meanwhile). A sealed record whose key is gone (an erased owner) is skipped."""
        dead: list[DeadLetter] = []
        projected: list[ProjectedRecord] = []
        for entry in entries:
            if entry.offset <= floor:
                continue
            try:
                record, plain = self._sealer.open_with(entry.value, keys)
            except RecordDecodeError as error:
                dead.append(DeadLetter(entry.partition, entry.offset, str(error), entry.value))
                continue
            if record.owner.encode("utf-8", "surrogatepass") != entry.key:
                # Queries find an owner's records in the owner's partition: one filed under
                # another key would be readable by event id but missing from everything else.
                dead.append(
                    DeadLetter(
                        entry.partition,
                        entry.offset,
                        f"record {record.event_id} has owner {record.owner!r} but log key "
                        f"{entry.key!r}: the key must be the owner id's UTF-8 bytes",
                        entry.value,
                    )
                )
                continue
            if isinstance(record, ErasedRecord):
                continue
            node = derive_node(record) if isinstance(record, Message) else None
            projected.append(
                ProjectedRecord(
                    offset=entry.offset,
                    record=record,
                    node=node,
                    data=plain,
                    sealed=None if plain is entry.value else entry.value,
                )
            )
        events = self.models.get("events")
        return dead, self._first_copies.keep(projected, getattr(events, "first_copies", None))

    async def _with_vectors(
        self, projected: list[ProjectedRecord], vector_offset: int, encode: VectorEncoder
    ) -> list[ProjectedRecord]:
        wanted = [p for p in projected if p.node is not None and p.offset > vector_offset]
        if not wanted:
            return projected
        vectors = await encode([embedding_text(p.node) for p in wanted if p.node is not None])
        by_offset = {p.offset: v for p, v in zip(wanted, vectors, strict=True)}
        return [
            ProjectedRecord(
                offset=p.offset,
                record=p.record,
                node=p.node,
                vector=by_offset[p.offset],
                data=p.data,
                sealed=p.sealed,
            )
            if p.offset in by_offset
            else p
            for p in projected
        ]

    def _apply_all(
        self,
        live: dict[ModelName, ReadModel],
        projected: list[ProjectedRecord],
        release: Callable[[], None],
    ) -> list[DeadLetter]:
        """Apply (or stage) ``projected`` to each model, call ``release`` (the apply gate
        may be freed), then commit what was staged. A model that fails on a record is
        applied one record at a time. Every staged commit runs, even when a later model
        (or another commit) fails with another error, as each model's whole ``apply`` did;
        the first such error is raised."""
        dead: list[DeadLetter] = []
        commits: list[_Staged] = []
        try:
            for name, model in live.items():
                applied = model.applied_offset()  # a query, for the SQLite models
                todo = [p for p in projected if p.offset > applied]
                if not todo:
                    continue
                started = time.perf_counter()
                try:
                    if isinstance(model, StagedCommits):
                        commit = model.stage(todo)
                        if commit is not None:
                            staging = time.perf_counter() - started
                            commits.append(_Staged(name, model, todo, commit, staging))
                            continue
                    else:
                        model.apply(todo)
                except RECORD_FAULTS:
                    self._observe_apply(name, time.perf_counter() - started)
                    dead.extend(self._apply_one_by_one(name, model, todo))
                    continue
                except BaseException:
                    self._observe_apply(name, time.perf_counter() - started)
                    raise
                self._observe_apply(name, time.perf_counter() - started)
        except BaseException as error:
            release()
            if (failure := self._commit_staged(commits, dead)) is not None:
                error.add_note(f"and a staged commit failed too: {failure!r}")
            raise
        release()
        if (failure := self._commit_staged(commits, dead)) is not None:
            raise failure
        return dead

    def _commit_staged(
        self, commits: list[_Staged], dead: list[DeadLetter]
    ) -> BaseException | None:
        """Run every staged commit; the first error that is not a record's (the others
        are tried all the same). A commit that fails on a record falls back to applying
        the model one record at a time, as ``apply`` does."""
        failure: BaseException | None = None
        for staged in commits:
            committing = time.perf_counter()
            try:
                staged.commit()
            except RECORD_FAULTS:
                dead.extend(self._apply_one_by_one(staged.name, staged.model, staged.todo))
            except BaseException as error:
                failure = failure or error
            # The time staging plus the time committing, not the other models' between.
            self._observe_apply(staged.name, staged.seconds + time.perf_counter() - committing)
        return failure

    def _observe_apply(self, name: ModelName, seconds: float) -> None:
        self._metrics.apply_duration.labels(name).observe(seconds)

    def _apply_one_by_one(
        self, name: ModelName, model: ReadModel, todo: list[ProjectedRecord]
    ) -> list[DeadLetter]:
        dead: list[DeadLetter] = []
        for item in todo:
            try:
                model.apply([item])
            except RECORD_FAULTS as error:
                dead.append(
                    DeadLetter(
                        self.partition,
                        item.offset,
                        f"{type(error).__name__}: {error}",
                        item.sealed or item.data or encode_record(item.record),
                        name,
                    )
                )
        return dead

    def digests(self) -> dict[str, str]:
        return {name: model.digest() for name, model in self.models.items()}

    async def close(self) -> None:
        """Close every model (each is tried even when one fails: the first failure is
        raised) and the shard's threads. A second call waits for the first and raises what
        it raised."""
        if self._closed is None:
            self._closing = True
            self._closed = asyncio.ensure_future(self._close())
        await asyncio.shield(self._closed)

    async def _close(self) -> None:
        def close_models() -> None:
            failure: BaseException | None = None
            for model in self.models.values():
                try:
                    model.close()
                except Exception as error:
                    failure = failure or error
            self.models.clear()
            self._first_copies.close()
            if self._owns_vectors:
                self._vectors.close()
            if failure is not None:
                raise failure

        try:
            await asyncio.get_running_loop().run_in_executor(self._executor, close_models)
        finally:
            self._executor.shutdown(wait=True)
            # A search still running beside need not hold up the loop; one still queued
            # finds no model and answers ShardUnavailable.
            self._beside.shutdown(wait=False)


class _Staged(NamedTuple):
    """A model's staged batch, waiting for its commit (``StagedCommits``)."""

    name: ModelName
    model: ReadModel
    todo: list[ProjectedRecord]
    commit: Commit
    seconds: float
    """The time staging took."""


def _nothing() -> None:
    return None


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def replace_model_directory(live: Path, staged: Path) -> None:
    """Swap ``staged`` in for ``live`` (rename is atomic on one file system), with the
    files beside it that belong to it (its name and a suffix: ``vector.rewrites``)."""
    retired = live.with_name(live.name + RETIRED_SUFFIX)
    if retired.exists():
        shutil.rmtree(retired)
    if live.exists():
        live.rename(retired)
    staged.rename(live)
    for companion in staged.parent.glob(f"{glob.escape(staged.name)}.*"):
        if companion.is_file():
            os.replace(companion, live.with_name(companion.name))
    shutil.rmtree(retired, ignore_errors=True)
