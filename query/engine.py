"""``MemoryEngine``: the async core that ties the log, the projector and retrieval together.

The embedded default (``transport = local``) keeps everything under one directory: the
log, the shards, the vector cache and ``prme.json``. With Kafka the same engine writes to
the topic and projects the partitions its consumer group assigns.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Self
from urllib.parse import quote

import httpx
import msgspec

from prme.producers.factory import open_dead_letters, open_transport
from prme.producers.free_space import append_room
from prme.producers.producer import (
    ADDITION_MISMATCH,
    AppendReceipt,
    MessageDraft,
    Producer,
    check_history,
    check_supersede,
    dedupe_key,
    deletion_request_id,
    request_event_id,
    request_fingerprint,
)
from prme.producers.transport import AsksFirstWrites, LogTransport, Position, split_dedupe_key
from prme.projectors.embeddings.cached import CachedEmbeddingProvider
from prme.projectors.embeddings.fastembed_provider import FastEmbedProvider
from prme.projectors.embeddings.model_assets import default_model_dir
from prme.projectors.embeddings.protocol import EmbeddingProvider
from prme.projectors.model import ModelName
from prme.projectors.registry import MODEL_NAMES
from prme.projectors.runner import ProjectorRunner
from prme.schemas.config import Settings
from prme.schemas.errors import (
    ConfigurationError,
    ConsistencyTimeout,
    InvalidEmbedding,
    InvalidInput,
    NotFound,
    PRMEError,
    RequestIdConflict,
    ShardUnavailable,
    WriteUnconfirmed,
    reused_request_id,
)
from prme.schemas.metrics import Metrics
from prme.schemas.records import Message, Record, memory_node_id
from prme.schemas.tracing import Tracing

from .backend import MemoryBackend
from .cluster import OWNER_ANSWER_MARGIN_S, ClusterRouter
from .data_lock import DataDirLock
from .http_types import (
    MAX_TOP_K,
    RetrieveRequest,
    StoreRequest,
    check_erasable,
    check_ids,
    checked,
)
from .pack_config import (
    LogIdentity,
    PackConfig,
    check_log_identity,
    check_pack_directory,
    embedding_config_of,
    load_pack_config,
    remove_pack_config,
    save_pack_config,
)
from .retrieve import Retriever
from .tokens import TokenCounter
from .types import EventView, RetrieveResponse, StoreResult, with_record

FIRST_WRITE_OWNER_WAIT_S = 1.0
"""How long the check before a keyed append waits, in all, for other nodes' owners to
answer where its request ids were first written (an unreachable owner: the append goes
on at once)."""

FIRST_WRITE_LOOKUPS = 16
"""Owners' nodes asked at once for the first writes of a batch's request ids."""


class MemoryEngine(MemoryBackend):
    """Use :meth:`create` or :meth:`open` (both async, both context managers)."""

    def __init__(
        self,
        settings: Settings,
        provider: EmbeddingProvider,
        transport: LogTransport,
        runner: ProjectorRunner,
        dead_letters: LogTransport,
        router: ClusterRouter | None = None,
        data_lock: DataDirLock | None = None,
    ) -> None:
        self.settings = settings
        self.router = router
        """How requests for partitions another node owns get there (a served node only)."""
        self._data_lock = data_lock
        self.provider = provider
        self.embedding_config = embedding_config_of(provider)
        self._transport = transport
        self._dead_letters = dead_letters
        self.runner = runner
        self.metrics = runner.metrics
        keys = runner.keys if settings.log.seal_records else None
        self._producer = Producer(
            transport,
            settings.limits,
            self.metrics,
            keys=keys,
            refusal=None if router is None else router.append_refusal,
            room=append_room(settings),
        )
        model_dir = default_model_dir(settings.models_path)
        self._retriever = Retriever(
            runner, settings, TokenCounter(model_dir / "tokenizer.json"), self.metrics
        )
        if isinstance(transport, AsksFirstWrites):
            transport.first_writes = self._first_writes

    # -- opening -----------------------------------------------------------------------

    @classmethod
    async def create(
        cls,
        directory: str | Path | None = None,
        *,
        settings: Settings | None = None,
        embedding_provider: EmbeddingProvider | None = None,
        metrics: Metrics | None = None,
        url: str | None = None,
    ) -> Self:
        """Create a new pack in ``directory`` (refused if one is there). ``metrics``: the
        instruments (and tracing) to record into; default, built from ``settings``.
        ``url``: where this node is served (a cluster member routes to the others)."""
        settings = _settings_for(directory, settings)
        if load_pack_config(settings.data_path) is not None:
            raise ConfigurationError(f"{settings.data_dir} already holds a PRME pack: use open()")
        return await cls._start(settings, embedding_provider, metrics, url)

    @classmethod
    async def open(
        cls,
        directory: str | Path | None = None,
        *,
        settings: Settings | None = None,
        embedding_provider: EmbeddingProvider | None = None,
        create_if_missing: bool = False,
        metrics: Metrics | None = None,
        url: str | None = None,
        catch_up: bool = True,
        url_reached: bool = False,
        serves_queries: bool = True,
    ) -> Self:
        """Open the pack in ``directory`` (created when missing and ``create_if_missing``).
        ``url``: where this node is served (``url_reached``: seen to reach this process,
        which the group prefers when two members advertise one URL); ``catch_up=False``
        returns before the assigned partitions have caught up (each is served once it has:
        ``runner.serving``); ``serves_queries=False``, for a command that never embeds a
        query (``prme rebuild``, ``prme erase``): the provider's query encoder is not
        prepared (the default model's int8 query copy is not made)."""
        settings = _settings_for(directory, settings)
        if load_pack_config(settings.data_path) is None and not create_if_missing:
            raise ConfigurationError(f"no PRME pack in {settings.data_dir}: use create()")
        return await cls._start(
            settings, embedding_provider, metrics, url, catch_up, url_reached, serves_queries
        )

    @classmethod
    async def _start(
        cls,
        settings: Settings,
        provider: EmbeddingProvider | None,
        metrics: Metrics | None,
        url: str | None = None,
        catch_up: bool = True,
        url_reached: bool = False,
        serves_queries: bool = True,
    ) -> Self:
        data_dir = settings.data_path
        check_pack_directory(data_dir)
        lock = DataDirLock.acquire(data_dir)
        try:
            return await cls._start_locked(
                settings, provider, metrics, url, catch_up, lock, url_reached, serves_queries
            )
        except BaseException:
            lock.release()
            raise

    @classmethod
    async def _start_locked(
        cls,
        settings: Settings,
        provider: EmbeddingProvider | None,
        metrics: Metrics | None,
        url: str | None,
        catch_up: bool,
        lock: DataDirLock,
        url_reached: bool = False,
        serves_queries: bool = True,
    ) -> Self:
        data_dir = settings.data_path
        saved = load_pack_config(data_dir)
        if provider is None:
            if saved is not None and saved.embedding.provider == "custom":
                raise ConfigurationError(
                    f"the pack in {data_dir} was built with the custom embedding provider "
                    f"{saved.embedding.provider_class} ({saved.embedding.model_name}); "
                    "pass embedding_provider= to reopen it"
                )
            provider = default_provider(settings)
        if saved is None:
            save_pack_config(
                data_dir,
                PackConfig(
                    partitions=settings.log.partitions,
                    embedding=embedding_config_of(provider),
                    log=LogIdentity.of(settings.log),
                ),
            )
            try:
                return await cls._start_configured(
                    settings, provider, metrics, url, catch_up, lock, url_reached, serves_queries
                )
            except BaseException:
                # A first start that failed (a model that does not load) decides nothing:
                # its pack file named that model, and the next start, with another model,
                # built vectors the pack file did not describe (an operations trial).
                remove_pack_config(data_dir)
                raise
        else:
            checked = check_log_identity(data_dir, saved, settings.log)
            if checked is not saved:
                save_pack_config(data_dir, checked)
            if saved.partitions != settings.log.partitions:
                settings = settings.replace(log={"partitions": saved.partitions})
        return await cls._start_configured(
            settings, provider, metrics, url, catch_up, lock, url_reached, serves_queries
        )

    @classmethod
    async def _start_configured(
        cls,
        settings: Settings,
        provider: EmbeddingProvider,
        metrics: Metrics | None,
        url: str | None,
        catch_up: bool,
        lock: DataDirLock,
        url_reached: bool,
        serves_queries: bool,
    ) -> Self:
        transport = open_transport(settings)
        dead_letters = open_dead_letters(settings)
        await transport.start()
        await dead_letters.start()
        runner = ProjectorRunner(
            settings,
            transport,
            provider,
            dead_letters=dead_letters,
            metrics=metrics or metrics_from(settings),
            url=url or "",
            url_reached=url_reached,
            group=settings.cluster.group,
            own_data_dir=lock.held,  # False under a parent's lock: siblings share it
        )
        router = None
        if url is not None:
            router = ClusterRouter(settings, runner, transport, runner.metrics, url=url)
        try:
            await runner.start(join=settings.cluster.project)
            prepare_queries = getattr(provider, "prepare_queries", None)
            if serves_queries and callable(prepare_queries):
                await asyncio.to_thread(prepare_queries)  # the int8 query copy, once a machine
            if settings.cluster.project and catch_up:
                await runner.catch_up(timeout_s=settings.log.request_timeout_s * 10)
            if router is not None:
                await router.start()
        except BaseException:
            if router is not None:
                await router.close()
            await runner.close()
            await dead_letters.close()
            await transport.close()
            raise
        return cls(settings, provider, transport, runner, dead_letters, router, lock)

    async def close(self) -> None:
        """Stop projecting and release files and connections (never the provider)."""
        try:
            if self.router is not None:
                await self.router.close()
            await self.runner.close()
            await self._dead_letters.close()
            await self._transport.close()
        finally:
            if self._data_lock is not None:
                self._data_lock.release()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # -- writing -----------------------------------------------------------------------

    async def store_request(self, request: StoreRequest) -> StoreResult:
        request = checked(request)
        return (await self.store_many([request.draft()], wait=request.wait))[0]

    async def store_many(
        self, drafts: Sequence[MessageDraft], *, wait: bool = True
    ) -> list[StoreResult]:
        """Append messages atomically (all or none)."""
        return await self._append([self._producer.build_message(d) for d in drafts], wait)

    async def add_messages(
        self,
        user_id: str,
        session_id: str,
        drafts: Sequence[MessageDraft],
        *,
        scope: str = "default",
        wait: bool = True,
    ) -> list[StoreResult]:
        check_ids(user_id=user_id, session_id=session_id, scope=scope)
        check_history(user_id, session_id, scope, drafts, ADDITION_MISMATCH)
        return await self.store_many(drafts, wait=wait)

    async def clear_history(
        self, user_id: str, session_id: str, *, scope: str = "default", wait: bool = True
    ) -> StoreResult:
        check_ids(user_id=user_id, session_id=session_id, scope=scope)
        receipt = await self._producer.append_control(
            "history_cleared", user_id, session_id=session_id, scope=scope
        )
        return await self._finish(receipt, [], wait)

    async def replace_history(
        self,
        user_id: str,
        session_id: str,
        drafts: Sequence[MessageDraft],
        *,
        scope: str = "default",
        wait: bool = True,
    ) -> list[StoreResult]:
        """Atomically append a clear marker and the new messages."""
        check_ids(user_id=user_id, session_id=session_id, scope=scope)
        records = self._producer.build_replacement(user_id, session_id, scope, drafts)
        return await self._append(records, wait)

    async def _append(self, records: Sequence[Record], wait: bool) -> list[StoreResult]:
        """Append atomically; a message's result names the memory node it derives."""
        receipts = await self._producer.append_records(records)
        results = [
            StoreResult(
                event_id=receipt.event_id,
                node_ids=[memory_node_id(receipt.event_id)] if isinstance(record, Message) else [],
                token=receipt.position,
            )
            for receipt, record in zip(receipts, records, strict=True)
        ]
        if wait:
            retry = (
                "a retry with the same request_id is applied once"
                if all(record.request_id for record in records)
                else "do not send it again: without a request_id a retry writes it twice"
            )
            await self._confirm(results, retry)
            if self.settings.log.transport == "kafka" and any(r.request_id for r in records):
                await self._check_applied_as_written(records, results)
        return results

    async def _check_applied_as_written(
        self, records: Sequence[Record], results: list[StoreResult]
    ) -> None:
        """On Kafka the request-id check before an append sees this node's recent writes
        and the applied ones (``_first_writes``): a write with the same id that another
        node appended and that is not applied yet (an owner's node down, two nodes took the
        two writes) passes it, and only the first on the log is applied. Once applied, the
        first copy of the id (``_first_writes`` again) must be this write, or say what it
        says; otherwise the conflict the check missed is answered (409), and this record,
        on the log, is never applied."""
        keyed = {
            dedupe_key(record.owner, record.request_id): (record, result)
            for record, result in zip(records, results, strict=True)
            if record.request_id is not None
        }
        # The owner may itself wait its consistency timeout (a partition catching up).
        owner_wait_s = self.settings.query.consistency_timeout_s + OWNER_ANSWER_MARGIN_S
        firsts = await self._first_writes(list(keyed), owner_wait_s=owner_wait_s)
        conflicts: list[str] = []
        for key, (record, result) in keyed.items():
            if key not in firsts:
                continue  # not readable now: best effort, as before
            position, fingerprint = firsts[key]
            if position == result.token or fingerprint in (None, request_fingerprint(record)):
                continue
            # This process took its own write for the first: let the next check ask the
            # applied events (keys sharing the prefix are asked again too).
            await self._transport.forget_dedupe(key)
            conflicts.append(
                f"{reused_request_id(record.owner, record.request_id or '')}: that write "
                f"reached the log first ({position.partition}:{position.offset}) and is the "
                f"one applied; this one is on the log too ({result.token.partition}:"
                f"{result.token.offset}) and will not be applied"
            )
        if conflicts:
            applied = len(records) - len(conflicts)
            others = f" The other {applied} write(s) of this batch are applied." if applied else ""
            raise RequestIdConflict(
                f"{'; '.join(conflicts)}.{others} A retry must send the same content (use a "
                "new request_id for a new write)"
            )

    async def _first_writes(
        self, keys: Sequence[str], *, owner_wait_s: float = FIRST_WRITE_OWNER_WAIT_S
    ) -> dict[str, tuple[Position, bytes | None]]:
        """``FirstWrites`` across the cluster: of ``keys`` (dedupe keys), the applied first
        copy of each write, with its position and fingerprint, read from the events of the
        partitions held here and, for the others, from their owners' nodes (waiting at most
        ``owner_wait_s`` for them all; an unreachable owner is not waited for). A key that
        cannot be read now is left out: the append goes on, and the check after it
        (``_check_applied_as_written``) is the backstop."""
        found = await self.runner.first_writes(keys)
        if self.router is None:
            return found
        router = self.router
        elsewhere = [
            (key, owner, request_id)
            for key, (owner, request_id) in ((k, split_dedupe_key(k)) for k in keys)
            if key not in found and router.partition_of(owner) not in self.runner.shards
        ]
        slots = asyncio.Semaphore(FIRST_WRITE_LOOKUPS)

        async def ask(key: str, owner: str, request_id: str) -> None:
            async with slots:
                copy = await self._applied_event(
                    request_event_id(owner, request_id), owner, owner_wait_s
                )
            if copy is not None:
                position = Position(copy.partition, copy.offset)
                found[key] = (position, request_fingerprint(copy.record))

        # One deadline for all of them: an owner that answers nothing (hung, or catching
        # up) costs the append ``owner_wait_s`` once, and an unreachable one nothing.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(owner_wait_s):
                await asyncio.gather(*(ask(*item) for item in elsewhere))
        return found

    async def _applied_event(self, event_id: str, owner: str, timeout_s: float) -> EventView | None:
        """The applied event ``event_id`` of ``owner``, from the node that owns its
        partition (None: not applied there, or it could not be read now)."""
        try:
            if self.router is not None:
                target = f"/v1/events/{quote(event_id, safe='')}?user_id={quote(owner, safe='')}"
                response = await self.router.forward(
                    self.router.partition_of(owner),
                    "GET",
                    target,
                    caller=owner,
                    body=b"",
                    headers={},
                    timeout_s=timeout_s,
                    wait_for_unreachable=False,  # a crashed owner: the write goes on at once
                )
                if response is not None:
                    if response.status_code != 200:
                        return None
                    return with_record(msgspec.json.decode(response.content, type=EventView))
            return await self.get_event(event_id, owner)
        except (PRMEError, httpx.HTTPError, msgspec.ValidationError, msgspec.DecodeError):
            return None

    async def _confirm(self, results: list[StoreResult], retry: str) -> None:
        """Wait for appended records to be applied; a failed wait says what was written
        and what a ``retry`` would do."""
        try:
            await self.wait_for([result.token for result in results])
        except PRMEError as error:  # whatever went wrong, the answer says what was written
            tokens = ", ".join(f"{r.token.partition}:{r.token.offset}" for r in results)
            message = (
                f"written to the log (tokens {tokens}) but not yet applied: {error}. The "
                f"write will be applied; {retry}"
            )
            if isinstance(error, ConsistencyTimeout):
                raise WriteUnconfirmed(message, written=list(results)) from error
            stopped = ShardUnavailable(message)  # the projector stopped, or the owner refused
            stopped.written = list(results)
            raise stopped from error

    async def delete_message(
        self, user_id: str, event_id: str, *, wait: bool = True
    ) -> StoreResult:
        """Remove one message from its chat history (the memory node is not archived).
        Deleting it again writes nothing and answers with the first deletion's result."""
        check_ids(user_id=user_id, event_id=event_id)
        event = await self.get_event(event_id, user_id)
        if event.kind != "message":
            raise InvalidInput(f"event {event_id} is a {event.kind}, not a message")
        receipt = await self._producer.append_control(
            "message_deleted",
            user_id,
            session_id=event.session_id,
            scope=event.scope,
            target_event_id=event_id,
            request_id=deletion_request_id(event_id),
        )
        return await self._finish(receipt, [], wait)

    async def archive(
        self, node_id: str, user_id: str, *, reason: str | None = None, wait: bool = True
    ) -> StoreResult:
        check_ids(node_id=node_id, user_id=user_id)
        await self._check_node(node_id, user_id)
        receipt = await self._producer.append_control(
            "node_archived", user_id, node_id=node_id, reason=reason
        )
        return await self._finish(receipt, [node_id], wait)

    async def restore(self, node_id: str, user_id: str, *, wait: bool = True) -> StoreResult:
        check_ids(node_id=node_id, user_id=user_id)
        await self._check_node(node_id, user_id)
        receipt = await self._producer.append_control("node_restored", user_id, node_id=node_id)
        return await self._finish(receipt, [node_id], wait)

    async def supersede(
        self, node_id: str, by_node_id: str, user_id: str, *, wait: bool = True
    ) -> StoreResult:
        check_ids(node_id=node_id, by_node_id=by_node_id, user_id=user_id)
        await self._check_node(node_id, user_id)
        check_supersede(node_id, by_node_id)
        if (state := await self._check_node(by_node_id, user_id)) != "active":
            # Its content would leave retrieval with nothing in its place (and a cycle,
            # A by B then B by A, would take both out).
            raise InvalidInput(
                f"node {by_node_id} is {state}: a node can be superseded only by an active "
                "one (restore it first) - at $.by_node_id"
            )
        receipt = await self._producer.append_control(
            "node_superseded", user_id, node_id=node_id, by_node_id=by_node_id
        )
        return await self._finish(receipt, [node_id, by_node_id], wait)

    async def erase_owner(self, user_id: str, *, wait: bool = True) -> StoreResult:
        """Remove every trace of ``user_id`` from every read model and delete the owner's
        data keys: the log keeps the owner's records as envelopes only (docs/ARCHITECTURE.md,
        "Erasure"). The marker goes first, so a crash in between leaves the key; erasing
        again deletes it."""
        check_erasable(user_id)
        receipt = await self._producer.append_erasure(
            user_id, lambda: self.runner.keys.erase(user_id)
        )
        await self._transport.forget_dedupe(dedupe_key(user_id, ""))
        return await self._finish(receipt, [], wait)

    async def _finish(self, receipt: AppendReceipt, node_ids: list[str], wait: bool) -> StoreResult:
        result = StoreResult(event_id=receipt.event_id, node_ids=node_ids, token=receipt.position)
        if wait:
            # Control records change a state: sending one again changes nothing more.
            await self._confirm([result], "a retry changes nothing more")
        return result

    # -- reading -----------------------------------------------------------------------

    async def wait_for(self, tokens: Sequence[Position], timeout_s: float | None = None) -> None:
        """Wait until every token's partition has applied its offset (read-your-writes)."""
        timeout = self.settings.query.consistency_timeout_s if timeout_s is None else timeout_s
        latest: dict[int, int] = {}
        for token in tokens:
            latest[token.partition] = max(latest.get(token.partition, -1), token.offset)
        for partition, offset in latest.items():
            if self.router is not None and partition not in self.runner.shards:
                await self.router.wait_applied(partition, offset, timeout)
            else:
                await self.runner.wait_applied(partition, offset, timeout)

    async def wait_after(self, user_id: str, token: Position) -> None:
        """Wait for a read's ``after`` token: InvalidInput at once unless it can be a token of
        a write of ``user_id`` (a partition of the log, the owner's own, an offset the log
        has handed out), since such a token would only wait out the timeout."""
        partitions = self._transport.partitions
        own = self._transport.partition_for(user_id.encode("utf-8", "surrogatepass"))
        if not 0 <= token.partition < partitions:
            raise InvalidInput(
                f"after names partition {token.partition}, but the log has partitions 0 to "
                f"{partitions - 1} - at `after`"
            )
        if token.partition != own:
            raise InvalidInput(
                f"after names partition {token.partition}, but owner {user_id!r} lives in "
                f"partition {own}: pass a token of one of the owner's writes - at `after`"
            )
        if token.offset < 0:
            raise InvalidInput(f"after has a negative offset {token.offset} - at `after`")
        if self.runner.applied_offset(token.partition) < token.offset and getattr(
            self._transport, "exact_end_offsets", False
        ):
            end = (await self._transport.end_offsets()).get(token.partition, 0)
            if token.offset >= end:
                raise InvalidInput(
                    f"after names offset {token.offset} of partition {token.partition}, which "
                    f"ends at offset {end}: no write has been given that token - at `after`"
                )
        await self.wait_for([token])

    async def retrieve_request(self, request: RetrieveRequest) -> RetrieveResponse:
        """:meth:`retrieve` with its parameters in one Struct (as the HTTP service gets them)."""
        request = checked(request)
        try:
            size = len(request.query.encode())
        except UnicodeEncodeError as error:
            raise InvalidInput(
                f"query holds a lone surrogate at character {error.start}, which is no "
                "character - at $.query"
            ) from None
        if size > self.settings.limits.max_query_bytes:
            raise InvalidInput(
                f"query is {size} bytes, over the limit of {self.settings.limits.max_query_bytes}"
                " (limits.max_query_bytes) - at $.query"
            )
        if not 1 <= request.top_k <= MAX_TOP_K:
            raise InvalidInput(
                f"top_k must be between 1 and {MAX_TOP_K}, got {request.top_k} - at $.top_k"
            )
        if request.token_budget <= 0:
            raise InvalidInput(
                f"token_budget must be at least 1, got {request.token_budget} - at $.token_budget"
            )
        if request.after is not None:
            await self.wait_after(request.user_id, request.after)
        return await self._retriever.retrieve(
            request.query,
            request.user_id,
            scope=request.scope,
            top_k=request.top_k,
            token_budget=request.token_budget,
            min_score=request.min_score,
            include_archived=request.include_archived,
            fusion=request.fusion,
        )

    async def history(
        self,
        user_id: str,
        session_id: str = "default",
        *,
        scope: str = "default",
        limit: int | None = None,
        after: Position | None = None,
    ) -> list[Message]:
        """The chat history of (owner, session, scope) with clear, replace and delete applied
        (``limit``: the newest N messages)."""
        check_ids(user_id=user_id, session_id=session_id, scope=scope)
        if limit is not None:
            if limit < 1:
                raise InvalidInput(f"limit must be at least 1, got {limit} - at `limit`")
            limit = min(limit, 2**62)  # more than any history holds, and SQLite can take it
        if after is not None:
            await self.wait_after(user_id, after)
        shard = await self.runner.shard_for(user_id)
        return await shard.call(
            "history", lambda history: history.messages(user_id, session_id, scope, limit=limit)
        )

    async def get_event(self, event_id: str, user_id: str) -> EventView:
        """The original record of an event of ``user_id`` (control events included).

        Another owner's event is NotFound, as an unknown one: an event id derived from a
        request id (``producer.request_event_id``) can be computed, and a different answer
        would tell whether that owner sent that request."""
        check_ids(event_id=event_id, user_id=user_id)
        shard = await self.runner.shard_for(user_id)  # an owner's events are in its partition
        row = await shard.call("events", lambda events: events.get(event_id))
        if row is None or row.owner != user_id:
            raise NotFound(f"no event {event_id} for owner {user_id}")
        return EventView(
            event_id=row.event_id,
            kind=row.kind,
            owner=row.owner,
            session_id=row.session_id,
            scope=row.scope,
            partition=shard.partition,
            offset=row.offset,
            node_ids=list(row.node_ids),
            record=row.record,
        )

    async def get_event_nodes(self, event_id: str, user_id: str) -> list[str]:
        """The ids of the nodes derived from an event (provenance)."""
        return (await self.get_event(event_id, user_id)).node_ids

    async def get_nodes(self, node_ids: Sequence[str], user_id: str) -> dict[str, Any]:
        shard = await self.runner.shard_for(user_id)
        return await shard.call("graph", lambda graph: graph.get_nodes(user_id, list(node_ids)))

    async def rebuild(
        self,
        models: Sequence[ModelName] = MODEL_NAMES,
        progress: Callable[[int], None] | None = None,
        *,
        processes: int = 1,
    ) -> dict[int, int]:
        """Blue/green rebuild of ``models`` from the log; see ProjectorRunner.rebuild
        (``progress`` is called with the count of each chunk of records replayed;
        ``processes`` > 1 replays in that many child processes)."""
        replayed = await self.runner.rebuild(models, progress, processes=processes)
        if "vector" in models:
            saved = load_pack_config(self.settings.data_path)
            if saved is not None:
                save_pack_config(
                    self.settings.data_path,
                    msgspec.structs.replace(saved, embedding=self.embedding_config),
                )
        return replayed

    async def _check_node(self, node_id: str, user_id: str) -> str:
        """Refuse a node that is not one of ``user_id``'s (NotFound, also for another
        owner's: see :meth:`get_event`); its state otherwise."""
        if not node_id.startswith("mem:"):
            raise NotFound(f"no node {node_id} for owner {user_id}")
        try:
            await self.get_event(node_id.removeprefix("mem:"), user_id)
        except NotFound:
            raise NotFound(f"no node {node_id} for owner {user_id}") from None
        shard = await self.runner.shard_for(user_id)
        state = await shard.call("graph", lambda graph: graph.node_state(user_id, node_id))
        if state is None:
            raise NotFound(f"no node {node_id} for owner {user_id}")
        return state


def metrics_from(settings: Settings) -> Metrics:
    """Metrics (and tracing) as ``settings`` ask: on by default, spans only when enabled."""
    tracing = Tracing.create(settings.tracing.enabled)
    return Metrics(enabled=settings.metrics.enabled, tracing=tracing)


def default_provider(settings: Settings) -> EmbeddingProvider:
    """The default: all-MiniLM-L6-v2 int8 through FastEmbed, behind an LRU cache."""
    embedding = settings.embedding
    try:
        provider = FastEmbedProvider(
            embedding.model,
            dimension=embedding.dimension,
            models_dir=settings.models_path,
            batch_size=embedding.batch_size,
            threads=embedding.threads,
            query_threads=embedding.query_threads,
            query_precision=embedding.query_precision,
        )
    except InvalidEmbedding as error:  # settings, not code: say which ones
        raise ConfigurationError(
            f"embedding.model {embedding.model!r} (PRME_EMBEDDING__MODEL) cannot be used: "
            f"{str(error).split(':')[0]}; give its dimension too (embedding.dimension, "
            "PRME_EMBEDDING__DIMENSION), or a model fastembed knows; a model fastembed does "
            "not know must also be registered in Python with TextEmbedding.add_custom_model "
            "before the client opens, so from the command line only fastembed's own work"
        ) from error
    return CachedEmbeddingProvider(provider, max_entries=embedding.cache_entries)


def _settings_for(directory: str | Path | None, settings: Settings | None) -> Settings:
    base = settings or Settings.from_env()
    return base if directory is None else base.replace(data_dir=str(directory))
