"""The projector runner: consume assigned partitions, apply batches to their shards, and
tell waiting readers what has been applied (read-your-writes)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import shutil
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from operator import methodcaller
from pathlib import Path
from typing import Any

from prme.producers.factory import open_key_store, open_vector_changelog
from prme.producers.free_space import (
    allocated_bytes,
    applying_guard,
    check_room,
    check_room_to_open,
    free_bytes,
)
from prme.producers.keys import KeyStore
from prme.producers.producer import request_event_id, request_fingerprint
from prme.producers.transport import (
    LogConsumer,
    LogTransport,
    Membership,
    Position,
    split_dedupe_key,
)
from prme.schemas.cluster import (
    DUPLICATE_URL,
    SECRET_REFUSED,
    ClusterMap,
    MemberClaim,
    other_topic_refusal,
    secret_tag,
)
from prme.schemas.config import Settings
from prme.schemas.errors import (
    AppendUnconfirmed,
    ConfigurationError,
    ConsistencyTimeout,
    InsufficientSpace,
    ShardUnavailable,
    TransportError,
    TransportUnavailable,
)
from prme.schemas.metrics import Metrics, transport_label

from .backends import VectorBackend
from .dead_letters import DeadLetter, send_dead_letter
from .embeddings.cached import CachedEmbeddingProvider
from .embeddings.protocol import EmbeddingIdentity, EmbeddingProvider
from .embeddings.validation import Float32Vector, identity_of
from .embeddings.vector_cache import VectorCache, content_hash, embed_with_cache
from .erasure import Forgetting
from .model import ModelName
from .registry import MODEL_NAMES, read_models, stored_offset
from .shard import RETIRED_SUFFIX, Shard, replace_model_directory, shard_directory
from .standby import StandbyKeeper
from .state_cleanup import DISCARDED_SUFFIX, StateCleaner
from .tasks import cancel_and_wait
from .vector_changelog import RestoreStats, VectorChangelog

GROUP = "prme-projectors"
PROGRESS_EVERY_S = 2.0
"""How often catching up and rebuilding log their progress."""
CONCURRENT_SHARDS = 3
"""Shards taking batches at once, so one shard's embedding (outside the GIL) overlaps
another's writes; of these, one at a time decodes, derives or writes to its models (the
apply gate: those steps hold the GIL, and three at once spent ~35 % more CPU on futex
handoffs for the same wall time). More only holds more batches (and vectors) in memory."""
REPLAY_CHUNK = 4096
"""Records read (and applied as one batch) at a time by a rebuild."""
REBUILD_CONCURRENCY = 2
"""Partitions rebuilt at once: one reads its next chunk from the log while the other
applies (the staged shards share the background gate, so one at a time decodes, derives
and writes). More only contend for the GIL (measured on a 20k pack before the gate: 6 at
once took 10.3-10.6 s and 4.2 s of system time in futex calls, 2 at once 8.6-9.3 s; the
gate then took a 20k in-process rebuild from 16.8-17.4 s to 14.8-14.9 s, CPU 20.6 -> 15.4 s)."""
POLL_S = 0.1
"""How long a poll of the consumer waits for records. A rebalance lands during a poll,
and a partition it assigns may need only a transaction marker stepped over to be served,
which no poll returns: the loop notes positions at least this often."""
TRANSIENT_ERRORS = (TransportUnavailable, AppendUnconfirmed)
"""Log errors a later try can get past (a broker down, restarting or stalled): waited out
and tried again, where every other error stops the projector."""
RETRY_FIRST_S = 0.5
RETRY_MAX_S = 10.0
"""The wait before trying again after a transient log error doubles up to this."""
STANDBY_ENCODE_AFTER_S = 10.0
"""A standby waits this long for its owner to publish more of a batch's vectors, then
encodes the rest itself (an owner that publishes, however slowly, is waited for)."""
MAX_BATCH_FACTOR = 16
"""A consumer that is behind polls up to this many times ``batch_size`` records: every
read model pays a fixed cost per batch (a Tantivy commit, a transaction)."""
PROBE_EVERY_S = 5.0
"""A node asks the group to plan again for its warm-up copies at most this often."""
PROBE_MAX_S = 600.0
"""The longest wait between probes for the same warm-ups (Kafka Streams probes every 10
minutes)."""
PROBE_AFTER_S = 30.0
"""Some warm-up copies caught up, others not: the ready ones wait this long after the map
for the others before the node asks the group to plan again."""
APPLY_BUDGET_S = 2.0
"""A poll is sized to take about this long to apply, once one has been timed: the next
poll waits for it, so a write to another partition meanwhile waits for it too. A new-user
trial's 1,000 long texts for the model held a small write to an idle partition for 10 to
47 s (504) behind 512-record polls."""
MIN_BATCH = 16
"""The fewest records a poll asks for, however costly they were."""
ENCODE_CHUNK = 128
"""Texts per turn at the shared embedding provider: shards take turns (first come, first
served), so a small batch waits for one chunk of a large one, not for all of it."""
STAGING_SUFFIX = ".rebuild"
"""``shards/p<N>.rebuild/``: where a rebuild of partition N stages its models."""
_log = logging.getLogger("prme.projector")


@dataclass
class StandbyWait:
    """A standby's wait for its owner to publish the vectors of the batch at ``first``."""

    first: int
    since: float
    """When the owner last published more of them (or the wait began)."""
    published: int = 0


@dataclass
class Takeover:
    """A partition assigned here and not served yet."""

    since: float
    """When it was assigned (monotonic clock)."""
    how: str
    """How its shard came: held, kept (parked through the rebalance), standby, opened."""
    records: int = 0
    """Records applied to it since."""


@dataclass(frozen=True)
class StagedPartition:
    """What a rebuild staged of one partition: records replayed, offset applied."""

    records: int
    offset: int


class VectorsNotPublished(Exception):
    """A standby's batch has texts whose vectors the owner has not published yet."""


class ProjectorRunner:
    """Owns the shards of the partitions it is assigned and keeps them up to date."""

    def __init__(
        self,
        settings: Settings,
        transport: LogTransport,
        provider: EmbeddingProvider,
        *,
        dead_letters: LogTransport | None = None,
        group: str = GROUP,
        batch_size: int = 256,
        vectors: VectorBackend | None = None,
        metrics: Metrics | None = None,
        url: str = "",
        url_reached: bool = False,
        own_data_dir: bool = True,
        keys: KeyStore | None = None,
    ) -> None:
        """Without ``vectors`` the runner opens (and closes) the backend ``settings`` name;
        without ``keys``, the key store ``settings`` name (it opens sealed records).
        ``url``: where this node is reached, carried to the group with its claim (empty:
        a worker that projects but serves nothing); ``url_reached``: a request to it was
        seen to reach this process. ``own_data_dir=False``: sibling
        processes share the data directory, so a revoked shard is closed at once (a sibling
        opens it next) and this process holds no standbys (one would sit in the directory
        its owner writes)."""
        self.settings = settings
        self.transport = transport
        self._url_reached = url_reached
        self.provider = provider
        self.identity: EmbeddingIdentity = identity_of(provider)
        self._dead_letters = dead_letters
        self._group = group
        self._batch_size = batch_size
        self._owns_vectors = vectors is None
        self.vectors = vectors or VectorBackend.from_settings(settings)
        self._data_dir = settings.data_path
        self._vector_cache = VectorCache(self._data_dir / "vector_cache.sqlite3")
        self.metrics = metrics if metrics is not None else Metrics(enabled=False)
        self._sample_caches()
        self._owns_keys = keys is None
        self.keys: KeyStore = keys if keys is not None else open_key_store(settings)
        queries = provider if isinstance(provider, CachedEmbeddingProvider) else None
        self.forgetting = Forgetting(
            self.keys,
            self._vector_cache,
            self.identity,
            queries,
            min_free_bytes=settings.limits.min_free_bytes,
        )
        changelog_log = open_vector_changelog(settings)
        self.changelog = (
            None
            if changelog_log is None
            else VectorChangelog(changelog_log, self._vector_cache, self.identity, self.keys)
        )
        self.restores: list[RestoreStats] = []
        """One entry per vector changelog restore this runner ran (partition, records, s)."""
        self.shards: dict[int, Shard] = {}
        self.url = url
        self.instance = uuid.uuid4().hex
        """Tells this process apart from another member that advertises the same URL."""
        self._secret_tag: str | None = None
        """``secret_tag`` of the cluster secret, computed at the first claim (scrypt)."""
        self._own_data_dir = own_data_dir
        self._parked: dict[int, Shard] = {}
        self.cluster_map: ClusterMap | None = None
        """The newest map the group handed this member (None before the first one)."""
        self._targets: dict[int, int] = {}
        """Per assigned partition, the log end when it was assigned: it is served once
        applied up to there (never stale data silently)."""
        self._held: dict[int, int] = {}
        """Partition -> applied offset of every shard this process held: its claim to the
        leader, which keeps partitions where their state is."""
        self._consumed: dict[int, int] = {}
        self._consumer: LogConsumer | None = None
        self._progress = asyncio.Condition()
        self._apply_lock = asyncio.Lock()
        self._partition_locks: dict[int, asyncio.Lock] = {}
        self._encode_lock = asyncio.Lock()
        self._shard_slots = asyncio.Semaphore(CONCURRENT_SHARDS)
        self._apply_gate = asyncio.Lock()
        """The owned shards' ``Shard.apply_gate``."""
        self._background_gate = asyncio.Lock()
        """The gate of standby copies and rebuild staging: background work takes turns
        among itself, and never holds up an owned shard (a write's read-your-writes) by a
        whole replay chunk."""
        self._task: asyncio.Task[None] | None = None
        self._failure: BaseException | None = None
        self.retrying: BaseException | None = None
        """The transient log error, or the full disk, the projector is waiting out (None:
        it is not)."""
        self._room = applying_guard(self._data_dir, settings.limits.min_free_bytes)
        self.known_log_ends: tuple[dict[int, int], float | None] = ({}, None)
        """The log ends a status read last, and when (monotonic): what ``/metrics`` and
        ``/v1/ready`` show, marked stale, while the log does not answer."""
        self.left_group = asyncio.Event()
        """Set once a failed projector has left its consumer group."""
        self._stopping = False
        self._assigned = asyncio.Event()
        self._owned_last: set[int] = set()
        self._assigning: set[int] = set()
        """Partitions an assignment is opening (not in ``shards`` yet)."""
        self._wakers: set[asyncio.Task[None]] = set()
        self._takeovers: dict[int, Takeover] = {}
        """Per partition assigned and not served yet (noted in the log and the takeover
        metrics once served); one a rebalance interrupts resumes its first entry."""
        self._warmups: set[int] = set()
        """Partitions the newest map asks this node to warm up before it takes them."""
        self._probed: tuple[int, float] = (-1, -PROBE_EVERY_S)
        """The map generation this node last asked the group to plan again in, and when."""
        self._map_at = 0.0
        """When the newest map arrived (monotonic)."""
        self._probe_every_s = PROBE_EVERY_S
        self._probed_ready: set[int] = set()
        """The warm-ups this node's last probe said were ready, until the next map."""
        self._served_last: set[int] = set()
        """The partitions this node served when the rebalance in progress revoked them."""
        self._standby_waits: dict[int, StandbyWait] = {}
        """Per standby partition: the batch waiting for its owner's vectors."""
        self.standbys = StandbyKeeper(
            transport,
            self._open_standby,
            self._apply_standby,
            self._partition_lock,
            may_open=lambda: self.records_behind() == 0,
            closed=self._released,
            after_pass=self._probe_when_warm,
        )
        """Warm copies of partitions other nodes own (``cluster.standby_replicas``)."""
        self.dead_letter_count = 0
        self.dead_letters_by_partition: dict[int, int] = {}
        self.state_cleaner: StateCleaner | None = None
        """Kafka, with a data directory of its own: deletes the shards it let go of."""

    # -- lifecycle ---------------------------------------------------------------------

    async def start(self, *, join: bool = True) -> None:
        """Join the consumer group and start applying in the background. ``join=False``
        opens only the key store (a serve-only node seals what it appends)."""
        self._data_dir.mkdir(parents=True, exist_ok=True)
        check_room_to_open(
            self._data_dir,
            len(existing_shards(self._data_dir)),
            self.settings.limits.min_free_bytes,
        )
        remove_stale_staging(self._data_dir)
        if self._owns_keys:
            await self.keys.start()
        if not join:
            return
        await self._check_provider()
        if self.changelog is not None:
            await self.changelog.start()
        self._held = stored_offsets(self._data_dir)
        membership = Membership(
            url=self.url,
            claim=self._claim,
            on_map=self._on_map,
            standby_replicas=self.settings.cluster.standby_replicas,
            static_members=self.settings.cluster.static_members,
            session_timeout_s=self.settings.cluster.session_timeout_s,
        )
        self._consumer = self.transport.consumer(self._group, membership)
        await self._consumer.start(self._on_assigned, self._on_revoked)
        self._task = asyncio.create_task(self._run(), name="prme-projector")
        if self._own_data_dir and self.settings.log.transport == "kafka":
            self.state_cleaner = StateCleaner(
                self._data_dir,
                self.settings.cluster.state_cleanup_delay_s,
                in_use=self._partitions_in_use,
                on_disk=lambda: existing_shards(self._data_dir),
                partition_lock=self._partition_lock,
                removed=self._forget_shard,
                may_sweep=self._may_clean,
            )
            self.state_cleaner.start()

    async def _check_provider(self) -> None:
        """Before joining: the embedding model's files are there (or can be fetched). A
        model that loads only at the first embed failed the projector after the node took
        its partitions; a provider with ``prepare`` fails the start instead (milliseconds
        when the files are on disk: the model itself still loads at the first embed)."""
        prepare = getattr(self.provider, "prepare", None)
        if not callable(prepare):
            return
        try:
            await asyncio.to_thread(prepare)
        except Exception as error:
            raise ConfigurationError(
                f"the embedding model {self.identity.model_name} cannot be loaded: {error} "
                "(check PRME_EMBEDDING__MODEL, the models directory and the network)"
            ) from error

    async def hold_stored(self) -> list[int]:
        """Open the shards stored in this data directory without joining the group, for a
        rebuild of a stopped Kafka node's directory (as a member it would take partitions
        from the live nodes, and rebuild theirs). Returns their partitions."""
        if self._consumer is not None:
            raise RuntimeError("this runner is a member of its group already")
        for partition in existing_shards(self._data_dir):
            if partition not in self.shards:
                self.shards[partition] = await self._new_shard(partition, lazily=True)
        return sorted(self.shards)

    def _partitions_in_use(self) -> set[int]:
        """Partitions whose shard directory this node uses or is about to (the newest map's
        assignment and standbys, before the rebalance callbacks open them)."""
        return (
            set(self.shards)
            | set(self._parked)
            | set(self.standbys.shards)
            | self.standbys.wanted
            | self._owned_last
            | set(self._targets)
            | set(self._takeovers)
            | self._assigning
        )

    def _released(self, partition: int) -> None:
        """The node stopped using ``partition``'s directory: its cleanup delay starts now
        (a use between two sweeps would otherwise go unseen), and what it knew of the
        partition's changelog is forgotten (another node writes it meanwhile: a later use
        restores what came since). A standby closed without it, then taken over, was
        opened as restored and encoded the texts its owner wrote since (cluster trial)."""
        if self.changelog is not None:
            self.changelog.forget(partition)
        if self.state_cleaner is not None:
            self.state_cleaner.released(partition)

    def _may_clean(self) -> bool:
        """A member in good standing: assigned at least once, not refused, not failed."""
        return (
            self._failure is None
            and self._assigned.is_set()
            and self.cluster_map is not None
            and self.refusal is None
        )

    async def _forget_shard(self, partition: int) -> None:
        """After its directory went: the claim on it, and the vectors the node-wide cache
        holds for its owners (a later restore reads its changelog from the start)."""
        self._held.pop(partition, None)
        mark = None
        if self.changelog is not None:
            self.changelog.forget(partition)
            mark = f"{self.changelog.log.topic}/{partition}/"
        await asyncio.to_thread(self._drop_cached_vectors, partition, mark)

    def _drop_cached_vectors(self, partition: int, changelog_mark: str | None) -> None:
        cache = self._vector_cache
        owners = [
            owner
            for owner in cache.owners()
            if self.transport.partition_for(owner.encode("utf-8", "surrogatepass")) == partition
        ]
        cache.drop_owners(owners)
        if changelog_mark is not None:
            cache.forget_changelog_marks(changelog_mark)

    async def close(self) -> None:
        self._stopping = True
        if self.state_cleaner is not None:
            await self.state_cleaner.close()
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            # aiokafka's getmany can miss a cancel; closing the consumer ends it then.
            await asyncio.wait({task}, timeout=5)
        if self._consumer is not None:
            await self._consumer.close()
            self._consumer = None
        if task is not None and not task.done():
            await asyncio.wait({task}, timeout=30)
        for partition in list(self.shards):
            await self._close_shard(partition)
        await self._close_parked(keep=set())
        await self.standbys.close()
        if self.changelog is not None:
            await self.changelog.close()
        if self._owns_keys:
            await self.keys.close()
        self._vector_cache.close()
        if self._owns_vectors:
            self.vectors.close()

    def _claim(self) -> MemberClaim:
        generation = -1 if self.cluster_map is None else self.cluster_map.generation
        for partition, shard in self.shards.items():
            self._held[partition] = shard.position
        self._held.update(self.standbys.positions())
        owned = sorted(self._owned_last)
        return MemberClaim(
            url=self.url,
            owned=owned,
            warm=dict(self._held),
            generation=generation,
            standby_replicas=self.settings.cluster.standby_replicas,
            keyed=bool(self.settings.service.api_keys),
            holds_standbys=self._own_data_dir,
            secret_tag=self._claimed_secret_tag(),
            instance=self.instance,
            reaches_url=self._url_reached,
            warms_up=True,
            serving=sorted(self._served_last | {p for p in self.shards if self.serving(p)}),
            caught_up=sorted(self.standbys.caught_up),
            max_warmup_replicas=self.settings.cluster.max_warmup_replicas,
            acceptable_recovery_lag=self.settings.cluster.acceptable_recovery_lag,
        )

    def _claimed_secret_tag(self) -> str:
        if self._secret_tag is None:
            self._secret_tag = secret_tag(self.settings.cluster.secret) if self.url else ""
        return self._secret_tag

    @property
    def refusal(self) -> str | None:
        """Why the group gave this node nothing: it reads another topic than the group's,
        its cluster secret is not the others', or another member advertises its URL. None
        when it was not refused."""
        cluster_map = self.cluster_map
        if cluster_map is None:
            return None
        for member in cluster_map.other_topic:  # a `prme project` worker too
            if member.instance == self.instance:
                return other_topic_refusal(member.topic, cluster_map)
        if not self.url:
            return None
        if self.instance in cluster_map.duplicates:
            return DUPLICATE_URL
        return SECRET_REFUSED if self.url in cluster_map.refused else None

    def _on_map(self, cluster_map: ClusterMap) -> None:
        self.cluster_map = cluster_map
        self._map_at = time.monotonic()
        if (refusal := self.refusal) is not None:
            _log.error("the group gave this node (%s) no partitions: %s", self.url, refusal)
        mine = cluster_map.member(self.url) if self.url and refusal is None else None
        self._owned_last = set(mine.partitions) if mine is not None else set(self.shards)
        if mine is not None:
            self.standbys.want(set(mine.standbys) | set(mine.warmups), set(mine.partitions))
        warmups = set(mine.warmups) if mine is not None else set()
        if warmups & self._probed_ready:
            # A plan after this node's probe kept copies it said were ready (the owner ran
            # ahead while the group rebalanced): back off, as Kafka Streams' timer would.
            self._probe_every_s = min(PROBE_MAX_S, 2 * self._probe_every_s)
        elif not warmups & self._warmups:
            self._probe_every_s = PROBE_EVERY_S
        self._probed_ready = set()
        self._warmups = warmups
        standbys = len(set(mine.standbys) - warmups) if mine else 0
        self.metrics.cluster_partitions.labels("standby").set(standbys)
        self.metrics.cluster_partitions.labels("warmup").set(len(warmups))
        _log.info(
            "cluster generation %d: %s",
            cluster_map.generation,
            {m.url or "(worker)": m.partitions for m in cluster_map.members},
        )
        self._wake()

    def _probe_when_warm(self) -> None:
        """Ask the group to plan again when this node's warm-up copies have caught up (all
        of them, or some and the map is ``PROBE_AFTER_S`` old), once per map generation
        and at most every ``PROBE_EVERY_S`` (doubled, up to ``PROBE_MAX_S``, each time a
        plan keeps the same warm-ups after a probe): the leader then hands the caught-up
        partitions over (Kafka Streams probes on a timer; a node that knows its copies
        are ready need not wait for one)."""
        cluster_map, consumer = self.cluster_map, self._consumer
        ready = self._warmups & self.standbys.caught_up
        if cluster_map is None or consumer is None or not ready:
            return
        now = time.monotonic()
        generation, probed_at = self._probed
        if generation == cluster_map.generation or now - probed_at < self._probe_every_s:
            return
        if ready != self._warmups and now - self._map_at < PROBE_AFTER_S:
            return
        self._probed = (cluster_map.generation, now)
        self._probed_ready = ready
        _log.info(
            "warm-up copies of partitions %s caught up: asking the group to plan again",
            sorted(ready),
        )
        self.metrics.warmup_probes.inc()
        consumer.request_rebalance()

    def _wake(self) -> None:
        task = asyncio.get_running_loop().create_task(self._notify())
        self._wakers.add(task)  # the loop keeps only a weak reference to a task
        task.add_done_callback(self._wakers.discard)

    async def _notify(self) -> None:
        async with self._progress:
            self._progress.notify_all()

    async def _on_assigned(self, partitions: set[int]) -> None:
        if self._stopping:  # a rebalance can complete while the consumer is closing
            return
        self._assigning = set(partitions)
        try:
            await self._assign(partitions)
        finally:
            self._assigning = set()

    async def _assign(self, partitions: set[int]) -> None:
        began = time.monotonic()
        _log.info("assigned partitions %s", sorted(partitions))
        await self._close_parked(keep=partitions)
        ends = await self.transport.end_offsets()
        refused: ConfigurationError | None = None
        for partition in sorted(partitions):
            if self._stopping:  # close() began during an await: its consumer takes no seek
                return
            how = "kept"
            if partition in self._parked:
                self.shards[partition] = self._parked.pop(partition)
            elif partition not in self.shards:
                async with self._partition_lock(partition):
                    promoted = self.standbys.take(partition)
                if promoted is not None:
                    how = "standby"
                    _log.info("partition %d: the standby takes over", partition)
                    promoted.publish_vectors_to(self.changelog)
                    promoted.apply_gate = self._apply_gate
                    if self.changelog is not None:  # what the old owner published last
                        await self.changelog.catch_up(partition)
                    self.metrics.standby_promotions.inc()
                    self.shards[partition] = promoted
                else:
                    how = "opened"
                    self.shards[partition] = await self._new_shard(partition, lazily=True)
            else:
                how = "held"
            if self._stopping:  # close() may have closed its shards already
                await self._close_shard(partition)
                return
            assert self._consumer is not None
            applied = self.shards[partition].applied_offset()
            if applied >= ends.get(partition, 0) and applied >= await self._log_end(partition):
                refused = self._refuse(partition, applied)
                await self._close_shard(partition)
                continue
            self._takeovers.setdefault(partition, Takeover(began, how))
            self._consumer.seek(partition, applied + 1)
            self._targets[partition] = ends.get(partition, 0)
        self._owned_last = set(self.shards)
        self._served_last = set()
        self.metrics.cluster_partitions.labels("owner").set(len(self.shards))
        self._assigned.set()
        self._note_served()
        async with self._progress:
            self._progress.notify_all()
        if refused is not None:
            raise refused

    async def _log_end(self, partition: int) -> int:
        return (await self.transport.end_offsets()).get(partition, 0)

    def _refuse(self, partition: int, applied: int) -> ConfigurationError:
        """A shard that applied an offset the log has not reached was built from another
        log (a topic made anew, another broker, a pack of the local log): serving it would
        answer with its content and skip this log's records up to that offset. The
        projector stops, saying so, and the shard's files are kept."""
        error = ConfigurationError(
            f"partition {partition}: the read models in "
            f"{shard_directory(self._data_dir, partition)} applied offset {applied}, beyond "
            "the end of this log's partition: they were built from another log (a topic "
            "deleted and made again, another cluster). Use another data directory, or move "
            "that shard directory away to rebuild it from this log."
        )
        _log.error("%s", error)
        self._failure = error
        return error

    async def _new_shard(self, partition: int, *, lazily: bool, standby: bool = False) -> Shard:
        shard = Shard(
            shard_directory(self._data_dir, partition),
            partition,
            self.settings,
            self.identity,
            vectors=self.vectors,
            metrics=self.metrics,
            changelog=self.changelog,
            forgetting=self.forgetting,
            apply_gate=self._background_gate if standby else self._apply_gate,
        )
        await shard.open(lazily=lazily)
        return shard

    async def _open_standby(self, partition: int) -> Shard:
        """The caller holds the partition's lock. A shard parked by the last revocation
        (the partition moved away and the map asks for a copy here) becomes the standby as
        it is: opening its directory again failed on the parked shard's locks."""
        shard = self._parked.pop(partition, None)
        if shard is not None:
            self._takeovers.pop(partition, None)
            if self.changelog is not None:
                self.changelog.forget(partition)
            shard.apply_gate = self._background_gate
        else:
            shard = await self._new_shard(partition, lazily=False, standby=True)
        shard.publish_vectors_to(None)  # the owner publishes; a copy only reads
        return shard

    async def _apply_standby(self, partition: int, shard: Shard, entries: list[Any]) -> bool:
        """Apply to a standby shard (the caller holds the partition's lock); False when
        the owner has not published the batch's vectors yet (try again later: a standby
        never encodes what its owner encodes, unless the owner stays silent)."""
        encode = self._encode
        if self.changelog is not None:
            if not self.changelog.restored(partition):
                self.restores.append(await self.changelog.restore(partition))
            else:
                await self.changelog.catch_up(partition)
            # How long this batch has waited here for the owner's progress (not the
            # records' age: a new standby catching up on old records must still wait for
            # the owner to publish them). A cluster trial's owner, slow under a burst,
            # published all along, yet its standby encoded the whole burst again.
            first = entries[0].offset
            wait = self._standby_waits.get(partition)
            if wait is None or wait.first != first:
                wait = self._standby_waits[partition] = StandbyWait(first, time.monotonic())
            overdue = time.monotonic() - wait.since > STANDBY_ENCODE_AFTER_S
            encode = self._encode if overdue else functools.partial(self._published_vectors, wait)
        try:
            dead = await shard.apply(entries, encode)
        except VectorsNotPublished:
            return False
        self._standby_waits.pop(partition, None)
        for letter in dead:
            _log.warning("standby p%d@%d: %s", letter.partition, letter.offset, letter.error)
        return True

    async def _published_vectors(self, wait: StandbyWait, texts: list[str]) -> list[Float32Vector]:
        """The vectors of ``texts`` from the cache only (VectorsNotPublished otherwise);
        more of them than at the last try restarts ``wait``'s clock."""
        found = await asyncio.to_thread(
            self._vector_cache.get_hashed, self.identity, [content_hash(t) for t in texts]
        )
        published = sum(vector is not None for vector in found)
        if published > wait.published:
            wait.published, wait.since = published, time.monotonic()
        if published < len(found):
            raise VectorsNotPublished
        return [vector for vector in found if vector is not None]

    async def _on_revoked(self, partitions: set[int]) -> None:
        """Kafka's classic protocol revokes every partition at each rebalance; the sticky
        plan gives most of them back, so their shards stay open (parked, not served nor
        applied) until the assignment says which to close."""
        _log.info("revoked partitions %s", sorted(partitions))
        # The claim of the join that follows says which partitions this node was serving.
        self._served_last = {p for p in partitions if self.serving(p)}
        async with self._apply_lock:
            for partition in partitions:
                async with self._partition_lock(partition):  # waits out a rebuild's swap
                    if self._own_data_dir and partition in self.shards:
                        self._targets.pop(partition, None)
                        self._consumed.pop(partition, None)
                        self._held[partition] = self.shards[partition].position
                        self._parked[partition] = self.shards.pop(partition)
                    else:
                        await self._close_shard(partition)

    async def _close_parked(self, keep: set[int]) -> None:
        for partition in sorted(set(self._parked) - keep):
            async with self._partition_lock(partition):
                shard = self._parked.pop(partition, None)
                self._takeovers.pop(partition, None)
                if self.changelog is not None:
                    self.changelog.forget(partition)
                if shard is not None:
                    await shard.close()
                    self._released(partition)

    async def _close_shard(self, partition: int) -> None:
        self._targets.pop(partition, None)
        self._takeovers.pop(partition, None)
        if partition in self.shards:
            self._held[partition] = self.shards[partition].position
        self._consumed.pop(partition, None)
        if self.changelog is not None:
            self.changelog.forget(partition)
        shard = self.shards.pop(partition, None)
        if shard is not None:
            await shard.close()
            self._released(partition)

    # -- applying ----------------------------------------------------------------------

    async def _run(self) -> None:
        consumer = self._consumer
        assert consumer is not None
        try:
            size = self._batch_size
            per_record_s = 0.0
            # A failure an assignment met (``_refuse``) ends the loop too.
            delay = RETRY_FIRST_S
            while not self._stopping and self._failure is None:
                if (full := self._room.refusal()) is not None:  # applied nothing: wait
                    self.retrying = InsufficientSpace(full)
                    _log.warning("the projector waits: %s; looking again in %.1fs", full, delay)
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, RETRY_MAX_S)
                    continue
                try:
                    batches = await consumer.poll(size, POLL_S)
                    if batches:
                        started = time.monotonic()
                        await self._apply(batches)
                        polled = sum(len(entries) for entries in batches.values())
                        per_record_s = (time.monotonic() - started) / polled
                except TRANSIENT_ERRORS as error:
                    if self._stopping:
                        raise
                    delay = await self._wait_out(error, delay)
                    continue
                delay, self.retrying = RETRY_FIRST_S, None
                await self._refresh_positions()
                self._note_served()
                size = next_batch_size(size, batches, self._batch_size, per_record_s)
        except asyncio.CancelledError:
            raise
        except BaseException as error:
            if self._stopping:  # the consumer closed under a poll that missed its cancel
                return
            if isinstance(error, TransportError):
                self.metrics.transport_errors.labels(transport_label(self.transport), "poll").inc()
            self._failure = error
        async with self._progress:
            self._progress.notify_all()
        # On the embedded log no other process would take the partitions over: the shards
        # stay open and keep answering with what they applied.
        if not self._stopping and self.settings.log.transport == "kafka":
            await self._leave_group()

    async def _wait_out(self, error: BaseException, delay: float) -> float:
        """Wait ``delay`` after a transient log error; the next wait. The loop then polls
        again and applies what the poll gives: after a failed apply, the same records (the
        consumer is sought back past what each shard processed), applied once.
        Before, a changelog publish that timed out during a 30 s broker outage stopped the
        projector for good, and a cluster whose brokers stalled lost every node so."""
        self.retrying = error
        label = transport_label(self.transport)
        self.metrics.transport_errors.labels(label, "apply").inc()
        _log.warning("the log failed for now: %r; trying again in %.1fs", error, delay)
        await self._rewind()
        await asyncio.sleep(delay)
        return min(delay * 2, RETRY_MAX_S)

    async def _rewind(self) -> None:
        """Seek each owned partition back to the record after the last its shard processed
        (applied or dead-lettered: from what the models applied, a dead letter at the end
        was read and sent again at every retry). Every partition: a failed poll may have
        taken records of partitions that did not fail."""
        consumer = self._consumer
        if consumer is None:
            return
        async with self._apply_lock:
            for partition, shard in list(self.shards.items()):
                with contextlib.suppress(Exception):  # revoked meanwhile: sought afresh
                    consumer.seek(partition, shard.position + 1)

    async def _leave_group(self) -> None:
        """The projector failed: leave the consumer group, as a Kafka Streams thread that
        dies does, so the group moves this node's partitions to members that apply them.
        A failed member that stayed kept heartbeating, and its partitions answered 503 on
        every node for as long as it ran. Its shards close (a request for their owners is
        then forwarded to the new owners); the process keeps serving ``/v1/health`` and
        answers ``/v1/ready`` 503 with the failure, until an operator restarts it."""
        failure = self._failure
        _log.error(
            "the projector stopped: %r; leaving consumer group %s so that its partitions "
            "move to the other members (restart this node once the cause is fixed)",
            failure,
            self._group,
        )
        consumer, self._consumer = self._consumer, None
        if consumer is not None:
            await consumer.close()  # sends LeaveGroup: a rebalance starts at once
        self._owned_last = set()
        self.metrics.cluster_partitions.labels("owner").set(0)
        for partition in list(self.shards):
            with contextlib.suppress(Exception):  # a shard the failure broke: still let go
                await self._close_shard(partition)
        with contextlib.suppress(Exception):
            await self._close_parked(keep=set())
        with contextlib.suppress(Exception):
            await self.standbys.close()
        async with self._progress:
            self._progress.notify_all()
        self.left_group.set()

    async def _apply(self, batches: dict[int, list[Any]]) -> None:
        """Apply each partition's entries; shards work at the same time (each on its own
        thread), so one shard's engines write while the next one derives and embeds."""
        async with self._apply_lock:
            outcomes = await asyncio.gather(
                *(self._apply_shard(partition, entries) for partition, entries in batches.items()),
                return_exceptions=True,
            )
            # The partitions that applied report their dead letters even when another
            # failed: a transient failure is tried again, and skips what was applied.
            failed = [outcome for outcome in outcomes if isinstance(outcome, BaseException)]
            for dead in outcomes:
                if isinstance(dead, BaseException):
                    continue
                for letter in dead:
                    partition = letter.partition
                    self.dead_letter_count += 1
                    self.dead_letters_by_partition[partition] = (
                        self.dead_letters_by_partition.get(partition, 0) + 1
                    )
                    self.metrics.dead_letters.labels(str(partition), letter.model or "decode").inc()
                    _log.warning(
                        "dead letter p%d@%d (%s): %s",
                        letter.partition,
                        letter.offset,
                        letter.model or "decode",
                        letter.error,
                    )
                    if self._dead_letters is not None:
                        await send_dead_letter(self._dead_letters, letter)
            if failed:  # one that stops the projector before one that is tried again
                raise next((f for f in failed if not isinstance(f, TRANSIENT_ERRORS)), failed[0])
        async with self._progress:
            self._progress.notify_all()

    async def _apply_shard(self, partition: int, entries: list[Any]) -> list[DeadLetter]:
        async with self._partition_lock(partition), self._shard_slots:
            shard = self.shards.get(partition)
            if shard is None:
                return []
            if self.changelog is not None and not self.changelog.restored(partition):
                # A partition new to this node: its vectors first, then no encoding.
                self.restores.append(await self.changelog.restore(partition))
                _log.info("restored vectors %s", self.restores[-1])
            dead = await shard.apply(entries, self._encode)
            self.retrying = None
        await self._notify()  # a write waiting on this partition need not wait for the poll
        if (takeover := self._takeovers.get(partition)) is not None:
            takeover.records += len(entries)
        self.metrics.batch_size.observe(len(entries))
        self.metrics.records_applied.labels(str(partition)).inc(len(entries))
        return dead

    def _note_served(self) -> None:
        for partition, takeover in list(self._takeovers.items()):
            if partition in self._parked:  # a rebalance meanwhile: the takeover resumes
                continue
            if partition not in self._targets:
                del self._takeovers[partition]
            elif self.serving(partition):
                del self._takeovers[partition]
                seconds = time.monotonic() - takeover.since
                self.metrics.takeover_duration.labels(takeover.how).observe(seconds)
                self.metrics.takeover_records.labels(takeover.how).inc(takeover.records)
                _log.info(
                    "partition %d served %.2fs after its assignment (%s, %d records applied)",
                    partition,
                    seconds,
                    takeover.how,
                    takeover.records,
                )

    def _partition_lock(self, partition: int) -> asyncio.Lock:
        """Held while a batch is applied to the partition's shard and while a rebuild
        catches up and swaps it, so rebuilds of different partitions swap side by side
        (lock order: ``_apply_lock`` first, then a partition's)."""
        return self._partition_locks.setdefault(partition, asyncio.Lock())

    async def _refresh_positions(self) -> None:
        """Note how far the consumer has read: on Kafka a partition can end in transaction
        markers, which no record (and so no applied offset) ever reaches."""
        assert self._consumer is not None
        changed = False
        async with self._apply_lock:
            for partition in list(self.shards):
                try:
                    position = await self._consumer.position(partition)
                except Exception:  # revoked meanwhile: the next assignment seeks afresh
                    continue
                if self._consumed.get(partition) != position:
                    self._consumed[partition] = position
                    changed = True
        if changed:
            async with self._progress:
                self._progress.notify_all()

    async def _encode(self, texts: list[str]) -> list[Float32Vector]:
        # One embed call at a time: the provider is shared by the shards applying at once.
        vectors: list[Float32Vector] = []
        for start in range(0, len(texts), ENCODE_CHUNK):
            chunk = texts[start : start + ENCODE_CHUNK]
            async with self._encode_lock:
                vectors += await embed_with_cache(
                    self.provider, self._vector_cache, chunk, self.metrics
                )
        return vectors

    @property
    def group(self) -> str:
        """The consumer group this runner's consumer joins."""
        return self._group

    @property
    def vector_cache(self) -> VectorCache:
        """The durable vector cache (its ``hits`` and ``misses`` say what a rebuild reused)."""
        return self._vector_cache

    def _sample_caches(self) -> None:
        cache, provider = self._vector_cache, self.provider

        def lookups() -> list[tuple[tuple[str, ...], float]]:
            rows: list[tuple[tuple[str, ...], float]] = [
                (("durable", "hit"), cache.hits),
                (("durable", "miss"), cache.misses),
            ]
            info = getattr(provider, "cache_info", None)
            if callable(info):
                memory = info()
                rows += [(("memory", "hit"), memory.hits), (("memory", "miss"), memory.misses)]
            return rows

        data_dir = self._data_dir
        self.metrics.sample(
            "gauge",
            "prme_data_free_bytes",
            "Free bytes on the data directory's file system (writes stop below "
            "limits.min_free_bytes, the projector below half of it)",
            (),
            lambda: [((), free_bytes(data_dir) or 0)],
        )
        self.metrics.sample(
            "counter",
            "prme_embedding_cache_lookups",
            "Embedding cache lookups: durable (the vector cache, by content hash) and memory "
            "(the provider's LRU), hits and misses",
            ("cache", "result"),
            lookups,
        )

    def next_offset(self, partition: int) -> int:
        """The offset this process reads next in ``partition``: past the last applied record
        and past any Kafka transaction markers the consumer has stepped over."""
        shard = self.shards.get(partition)
        applied = -1 if shard is None else shard.position
        return max(applied + 1, self._consumed.get(partition, 0))

    async def catch_up(self, timeout_s: float = 60.0) -> None:
        """Wait until every partition assigned here has applied the log end it had when it
        was assigned. Ownership is re-read as it goes: a partition lost in a rebalance
        meanwhile is not waited on (its new owner catches it up), one gained is.

        On Kafka the first assignment can arrive after ``start`` returns: wait for it, or
        a shard still opening would be skipped."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        try:
            await asyncio.wait_for(self._assigned.wait(), timeout_s)
        except TimeoutError as error:
            raise ConsistencyTimeout(f"no partitions assigned within {timeout_s:.1f}s") from error
        ends = await self.transport.end_offsets()

        def behind() -> dict[int, int]:
            goals = {p: max(ends.get(p, 0), self._targets.get(p, 0)) for p in self.shards}
            gaps = {p: goal - self.next_offset(p) for p, goal in goals.items()}
            return {p: gap for p, gap in gaps.items() if gap > 0}

        started, first = time.monotonic(), sum(behind().values())
        reported = started
        if first:
            _log.info("catching up: %d records to apply in partitions %s", first, sorted(behind()))

        def report() -> None:
            nonlocal reported
            if time.monotonic() - reported >= PROGRESS_EVERY_S and (lagging := behind()):
                reported = time.monotonic()
                left = sum(lagging.values())
                _log.info(
                    "catching up: %d records behind in partitions %s (%.0f records/s)",
                    left,
                    sorted(lagging),
                    (first - left) / (reported - started),
                )

        def done() -> bool:
            return not behind() or self._failure is not None

        if not await self._until(done, deadline, tick=PROGRESS_EVERY_S, on_tick=report):
            lagging = behind()
            raise ConsistencyTimeout(
                f"partitions {sorted(lagging)} have not caught up within "
                f"{timeout_s:.1f}s ({sum(lagging.values())} records behind)"
            )
        if self._failure is not None:
            raise ShardUnavailable(f"the projector stopped: {self._failure!r}") from self._failure
        if first:
            elapsed = time.monotonic() - started
            _log.info(
                "caught up: %d records in %.1fs (%.0f records/s)",
                first,
                elapsed,
                first / max(elapsed, 1e-9),
            )

    async def _until(
        self,
        done: Callable[[], bool],
        deadline: float,
        *,
        tick: float | None = None,
        on_tick: Callable[[], None] | None = None,
    ) -> bool:
        """Wait on progress until ``done()`` (True) or the loop time ``deadline`` (False);
        with ``tick``, ``on_tick`` runs at least that often meanwhile."""
        loop = asyncio.get_running_loop()
        async with self._progress:
            while not done():
                remaining = deadline - loop.time()
                if remaining <= 0:
                    return False
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(
                        self._progress.wait(), remaining if tick is None else min(remaining, tick)
                    )
                if on_tick is not None:
                    on_tick()
        return True

    async def wait_changed(self, timeout_s: float) -> None:
        """Return after the next progress, assignment or map change (or ``timeout_s``)."""
        async with self._progress:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._progress.wait(), timeout_s)

    def records_behind(self) -> int:
        """Records still to apply before every assigned partition is served."""
        return sum(
            max(0, target - self.next_offset(p))
            for p, target in self._targets.items()
            if p in self.shards
        )

    def serving(self, partition: int) -> bool:
        """Whether ``partition`` is assigned here and applied up to the log end it had when
        it was assigned (until then its owner answers nothing rather than stale data)."""
        target = self._targets.get(partition)
        return (
            target is not None and partition in self.shards and self._reached(partition, target - 1)
        )

    async def wait_serving(self, partition: int, timeout_s: float) -> bool:
        """Wait until ``partition`` is served here; False if it is not assigned here (or
        stops being) or the deadline passes first."""
        deadline = asyncio.get_running_loop().time() + timeout_s

        def settled() -> bool:
            lost = partition not in self._targets or self._failure is not None
            return lost or self.serving(partition)

        await self._until(settled, deadline)
        return self.serving(partition)

    # -- read-your-writes --------------------------------------------------------------

    @property
    def failure(self) -> BaseException | None:
        """Why the projector stopped, if it did."""
        return self._failure

    def applied_offset(self, partition: int) -> int:
        shard = self.shards.get(partition)
        return -1 if shard is None else shard.applied_offset()

    async def wait_applied(self, partition: int, offset: int, timeout_s: float) -> None:
        """Return once ``partition`` has applied ``offset``; ConsistencyTimeout otherwise.

        Kafka transactions leave offset gaps (commit markers), so "applied" means the
        shard's position reached or passed ``offset``.
        """
        deadline = asyncio.get_running_loop().time() + timeout_s

        def reached() -> bool:
            return self._failure is not None or self._reached(partition, offset)

        if not await self._until(reached, deadline):
            raise ConsistencyTimeout(
                f"partition {partition} has not applied offset {offset} within "
                f"{timeout_s:.1f}s (applied: {self.applied_offset(partition)})"
            )
        if self._failure is not None:
            raise ShardUnavailable(f"the projector stopped: {self._failure!r}") from self._failure

    def _reached(self, partition: int, offset: int) -> bool:
        shard = self.shards.get(partition)
        if shard is None:
            return False
        return shard.position >= offset or self._consumed.get(partition, -1) > offset

    async def first_writes(self, keys: Sequence[str]) -> dict[str, tuple[Position, bytes | None]]:
        """``FirstWrites`` from the events models of the shards this process holds: of
        ``keys`` (dedupe keys), the writes they have applied, with the first copy's
        position and fingerprint. A key of a partition held elsewhere, or of a shard that
        cannot answer now, is left out (the transport then writes, best effort)."""
        wanted: dict[int, dict[str, str]] = {}
        for key in keys:
            owner, request_id = split_dedupe_key(key)
            partition = self.transport.partition_for(owner.encode("utf-8", "surrogatepass"))
            wanted.setdefault(partition, {})[request_event_id(owner, request_id)] = key
        found: dict[str, tuple[Position, bytes | None]] = {}
        for partition, by_event in wanted.items():
            shard = self.shards.get(partition)
            if shard is None or "events" not in shard.models:
                continue
            lookup = methodcaller("first_records", list(by_event))
            try:
                rows = await shard.call("events", lookup)
            except (ShardUnavailable, KeyError, RuntimeError):  # closing (ModelClosed too)
                continue
            for event_id, (offset, record) in rows.items():
                fingerprint = request_fingerprint(record)
                found[by_event[event_id]] = (Position(partition, offset), fingerprint)
        return found

    async def shard_for(self, owner: str) -> Shard:
        """The open shard that holds ``owner`` (ShardUnavailable if not projected here)."""
        partition = self.transport.partition_for(owner.encode())
        shard = self.shards.get(partition)
        if shard is None:
            raise ShardUnavailable(
                f"owner {owner!r} lives in partition {partition}, which this process does not "
                "project"
            )
        await shard.ensure_open()
        return shard

    # -- rebuild -----------------------------------------------------------------------

    async def rebuild(
        self,
        models: Sequence[ModelName] = MODEL_NAMES,
        progress: Callable[[int], None] | None = None,
        *,
        processes: int = 1,
    ) -> dict[int, int]:
        """Replay the log into fresh model directories beside the live ones, then swap
        them in once caught up (blue/green). Queries keep using the old models meanwhile.
        Partitions are rebuilt ``REBUILD_CONCURRENCY`` at a time; ``progress`` is called with
        the count of each chunk replayed. With ``processes`` > 1 the bulk of the replay runs
        in up to that many child processes (``rebuild_worker.workers_for``: only where a
        worker's start pays), each staging its share of the partitions; as each partition
        is staged, this process applies what arrived since and swaps it in.
        Returns, per partition, how many records were replayed."""
        read_models(models)  # an unknown name fails here, before anything is replayed
        live = [shard.directory / name for shard in self.shards.values() for name in models]
        check_room(
            self._data_dir,
            await asyncio.to_thread(allocated_bytes, live),
            f"rebuilding {', '.join(models)} (a second copy of them, until each is swapped in)",
            self.settings.limits.min_free_bytes,
        )
        ends = await self.transport.end_offsets()
        todo = [
            (partition, shard)
            for partition, shard in sorted(self.shards.items())
            if shard.models or ends.get(partition, 0) > 0
        ]
        targets = {partition: ends.get(partition, 0) for partition, _ in todo}
        slots = asyncio.Semaphore(REBUILD_CONCURRENCY)
        staged: dict[int, StagedPartition] = {}
        rebuilding: dict[int, asyncio.Task[int]] = {}

        async def rebuild_one(partition: int, shard: Shard) -> int:
            async with slots:
                done = staged.get(partition)
                return await self._rebuild_shard(
                    partition,
                    shard,
                    models,
                    progress,
                    ends.get(partition, 0),
                    None if done is None else done.offset,
                )

        from .rebuild_worker import replay_in_processes, workers_for

        processes = workers_for(targets, processes)
        try:
            if processes > 1:
                for _, shard in todo:
                    await shard.ensure_open()
                    shutil.rmtree(staging_directory(shard.directory), ignore_errors=True)

                shards = dict(todo)  # a partition revoked meanwhile is still swapped

                def swap_in(partition: int, done: StagedPartition) -> None:
                    # Swapped in while the workers stage the rest.
                    staged[partition] = done
                    rebuilding[partition] = asyncio.create_task(
                        rebuild_one(partition, shards[partition])
                    )

                await replay_in_processes(self, targets, models, processes, progress, swap_in)
            for partition, shard in todo:  # what no worker staged
                if partition not in rebuilding:
                    rebuilding[partition] = asyncio.create_task(rebuild_one(partition, shard))
        except BaseException:
            for task in rebuilding.values():  # cancelled or failed: swap nothing more
                task.cancel()
            raise
        finally:
            outcomes = await asyncio.gather(*rebuilding.values(), return_exceptions=True)
        replayed: dict[int, int] = {}
        for partition, outcome in sorted(zip(rebuilding, outcomes, strict=True)):
            if isinstance(outcome, BaseException):
                raise outcome
            done = staged.get(partition)
            replayed[partition] = outcome + (0 if done is None else done.records)
        async with self._progress:
            self._progress.notify_all()
        return replayed

    def staged_shard(self, partition: int, models: Sequence[ModelName]) -> Shard:
        """The (unopened) shard a rebuild of ``partition`` stages its models in."""
        return Shard(
            staging_directory(shard_directory(self._data_dir, partition)),
            partition,
            self.settings,
            self.identity,
            models=models,
            vectors=self.vectors,
            metrics=self.metrics,
            forgetting=self.forgetting,
            apply_gate=self._background_gate,
        )

    async def stage(
        self,
        partition: int,
        models: Sequence[ModelName],
        target: int,
        progress: Callable[[int], None] | None = None,
    ) -> StagedPartition:
        """Replay the log into ``partition``'s staging shard from what it holds to the end,
        then close it (the part of a rebuild a worker process runs); what it staged."""
        staged = self.staged_shard(partition, models)
        await staged.open()
        try:
            records = await self._replay(staged, partition, target, 0, progress)
            return StagedPartition(records, staged.applied_offset())
        finally:
            await staged.close()

    async def _rebuild_shard(
        self,
        partition: int,
        shard: Shard,
        models: Sequence[ModelName],
        progress: Callable[[int], None] | None,
        target: int,
        staged_to: int | None = None,
    ) -> int:
        """``staged_to``: a rebuild worker has staged the partition up to that offset; if
        the log holds nothing after it, the staged models are swapped in unopened."""
        await shard.ensure_open()
        staging = staging_directory(shard.directory)
        self.metrics.rebuild_target.labels(str(partition)).set(target)
        if staged_to is None:
            shutil.rmtree(staging, ignore_errors=True)  # a rebuild starts from the log, always
            self.metrics.rebuild_replayed.labels(str(partition)).set(0)
        else:
            async with self._partition_lock(partition):
                if not await self.transport.read(partition, staged_to + 1, 1):
                    try:
                        await self._swap(shard, staging, models)
                    finally:
                        shutil.rmtree(staging, ignore_errors=True)
                    return 0
        staged = self.staged_shard(partition, models)
        await staged.open()
        try:
            replayed = await self._replay(staged, partition, target, 0, progress)
            async with self._partition_lock(partition):
                # The partition's live batches wait on this lock now: the last records take
                # the owned shards' turn, not one behind another partition's replay chunk.
                staged.apply_gate = self._apply_gate
                replayed += await self._replay(staged, partition, target, replayed, progress)
                await staged.close()
                await self._swap(shard, staging, models)
        finally:
            if staged.models:
                await staged.close()
            shutil.rmtree(staging, ignore_errors=True)  # gone once swapped; else abandoned
        return replayed

    async def _replay(
        self,
        staged: Shard,
        partition: int,
        target: int,
        done: int = 0,
        progress: Callable[[int], None] | None = None,
    ) -> int:
        """Apply the log to ``staged`` from its stored offset to the end, in chunks of
        ``REPLAY_CHUNK`` records; the next chunk is read while one is applied."""
        count = 0
        offset = staged.applied_offset() + 1
        reported = time.monotonic()
        read = self.transport.read
        pending = asyncio.ensure_future(read(partition, offset, REPLAY_CHUNK))
        try:
            while entries := await pending:
                offset = entries[-1].offset + 1
                pending = asyncio.ensure_future(read(partition, offset, REPLAY_CHUNK))
                await staged.apply(entries, self._encode)
                count += len(entries)
                self.metrics.rebuild_replayed.labels(str(partition)).set(done + count)
                if progress is not None:
                    progress(len(entries))
                if time.monotonic() - reported >= PROGRESS_EVERY_S:
                    reported = time.monotonic()
                    _log.info(
                        "rebuild p%d: %d of ~%d records replayed", partition, done + count, target
                    )
        finally:
            if not pending.done():
                await cancel_and_wait(pending)
        return count

    async def _swap(self, shard: Shard, staging: Path, models: Sequence[ModelName]) -> None:
        def _swap_models() -> None:
            for spec in read_models(models):
                shard.models.pop(spec.name).close()
                replace_model_directory(shard.directory / spec.name, staging / spec.name)
                shard.models[spec.name] = shard.open_model(spec)

        await shard.run(_swap_models)
        shutil.rmtree(staging, ignore_errors=True)


def stored_offsets(data_dir: Path) -> dict[int, int]:
    """The offset each shard on disk has applied, from its SQLite models' tracking rows
    (the smallest; -1 where one is missing), without opening the shards: a node that
    restarts claims its copies as they are, not as empty (the group then held the
    partitions it had kept up to date with whoever took them meanwhile)."""
    return {
        partition: stored_offset(data_dir / "shards" / f"p{partition}")
        for partition in existing_shards(data_dir)
    }


def existing_shards(data_dir: Path) -> list[int]:
    """Partitions with a shard directory under ``data_dir`` (state from an earlier run)."""
    root = data_dir / "shards"
    if not root.is_dir():
        return []
    return sorted(int(d.name[1:]) for d in root.iterdir() if d.is_dir() and d.name[1:].isdigit())


def staging_directory(shard_dir: Path) -> Path:
    """Where a rebuild of the shard in ``shard_dir`` stages its models."""
    return shard_dir.with_name(shard_dir.name + STAGING_SUFFIX)


def remove_stale_staging(data_dir: Path) -> list[Path]:
    """Clear what a rebuild killed mid-way leaves, before any shard opens (a pack is opened
    by one process, so nothing else uses them): ``shards/p<N>.rebuild/`` folders (and the
    ``shards/p<N>.discarded/`` a cleanup left) are removed, and a
    ``shards/p<N>/<model>.retired`` one (a swap killed between its two renames) goes back
    in place if its model is missing, else is removed. Returns them."""
    shards = data_dir / "shards"
    if not shards.is_dir():
        return []
    staged = [*shards.glob("p*" + STAGING_SUFFIX), *shards.glob("p*" + DISCARDED_SUFFIX)]
    retired = list(shards.glob("p*/*" + RETIRED_SUFFIX))
    for path in [*staged, *retired]:
        live = path.with_name(path.name.removesuffix(RETIRED_SUFFIX))
        if path in retired and not live.exists():
            _log.warning("restoring %s, moved aside by an interrupted rebuild", live)
            path.rename(live)
            continue
        _log.info("removing %s, left by an interrupted rebuild or cleanup", path)
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    return [*staged, *retired]


def next_batch_size(
    size: int, polled: dict[int, list[Any]], base: int, per_record_s: float = 0.0
) -> int:
    """The next poll's size: doubled (up to ``MAX_BATCH_FACTOR`` x ``base``) while a poll
    comes back full, since the consumer is behind; back to ``base`` once it is not, so a
    caught-up runner applies small batches soon after they are appended. Never more than
    ``APPLY_BUDGET_S`` of records at the last poll's cost per record (``MIN_BATCH`` at
    least)."""
    if sum(len(entries) for entries in polled.values()) >= size:
        wanted = min(size * 2, base * MAX_BATCH_FACTOR)
    else:
        wanted = base
    if per_record_s > 0:
        wanted = min(wanted, max(MIN_BATCH, int(APPLY_BUDGET_S / per_record_s)))
    return wanted
