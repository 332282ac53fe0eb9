"""Settings: one typed object, read once at the edge (env prefix ``PRME_``, ``__`` nests)."""

from __future__ import annotations

import difflib
import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec

from .errors import ConfigurationError
from .records import UserIdField
from .validation_hints import error_path, validation_hint

PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
Count = Annotated[int, msgspec.Meta(ge=0)]
Seconds = Annotated[float, msgspec.Meta(gt=0, le=86_400)]
"""A timeout: more than 0 and at most a day (nan and inf are refused)."""
Weight = Annotated[float, msgspec.Meta(ge=0, le=1_000_000)]
QueryPrecision = Literal["int8", "float"]
"""How the default embedding model encodes queries (``EmbeddingSettings.query_precision``)."""
"""A weight or boost: 0 to a million (nan and inf are refused)."""


class LogSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    transport: Literal["local", "kafka"] = "local"
    bootstrap: str = "127.0.0.1:9092"
    topic: str = "prme.events"
    dlq_topic: str = "prme.events.dlq"
    partitions: PositiveInt = 12
    request_timeout_s: Seconds = 30.0
    transactional_id: str | None = None
    """Kafka only: a stable id fences a crashed predecessor and aborts its open transaction."""
    replication_factor: PositiveInt | None = None
    """Kafka only, for topics PRME creates; unset: ``min(3, brokers in the cluster)``."""
    min_insync_replicas: PositiveInt | None = None
    """Kafka only; unset: ``replication_factor - 1`` (at least 1): 2 on three brokers."""
    vector_changelog: bool = True
    """Kafka only: publish computed vectors to the compacted topic ``<topic>.vectors`` and
    restore a partition's vectors from it before replaying the partition."""
    vector_changelog_configs: dict[str, str] = {}
    """Extra topic configs for the changelog when it is created (compaction tuning)."""
    seal_records: bool = True
    """Encrypt each record's private fields with its owner's data key, so erasing the
    owner (deleting the key) leaves only envelopes on the log. Off: new records are
    written plain (sealed ones still open)."""
    keys_topic_configs: dict[str, str] = {}
    """Kafka only: extra topic configs for ``<topic>.keys`` when it is created."""


class EmbeddingSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    model: str = "sentence-transformers/all-MiniLM-L6-v2"
    dimension: PositiveInt | None = None
    batch_size: PositiveInt = 32
    cache_entries: PositiveInt = 10_000
    threads: PositiveInt | None = None
    """ONNX threads for documents (projection); ``None``: onnxruntime's choice, every core."""
    query_threads: PositiveInt | None = 1
    """ONNX threads for queries, on a second session (``None``: the documents' threads,
    and with exact queries the documents' session itself): a query is a few texts, for
    which an intra-op pool spends about twice the CPU for ~15 % less latency."""
    query_precision: QueryPrecision = "int8"
    """How the default model encodes queries: ``int8`` on an int8 copy of it made at the
    first start, on cores with int8 dot products (~2x faster; cosine ~0.995 to the exact
    vectors for questions, LoCoMo recall within a question), ``float`` on the exact model.
    Documents always use the exact model; other models, and cores without int8 dot
    products, encode queries as documents."""


class ScoringSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    fusion: Literal["rrf", "weighted", "zscore"] = "zscore"
    """zscore beat rrf (k=60) by ~15 points of recall_any@5 on LoCoMo (docs/RETRIEVAL.md)."""
    rrf_k: Count = 60
    weights: dict[Literal["vector", "lexical", "graph"], Weight] = msgspec.field(
        default_factory=lambda: {"vector": 1.0, "lexical": 1.0, "graph": 1.0}
    )
    candidates: PositiveInt = 500
    """Per channel; zscore standardises over them, so more candidates, better statistics."""
    graph: bool = False
    """The graph channel lowered recall on LoCoMo under every fusion: off by default."""


class LexicalSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    window_before: Count = 2
    window_after: Count = 1
    speaker_boost: Weight = 2.0
    text_boost: Weight = 1.0
    context_boost: Weight = 0.75
    """Neighbour text weighs less than the node's own text (see docs/RETRIEVAL.md). On LoCoMo
    (3 dev conversations, 382 questions) recall_any@10 was 0.686 without windows, 0.749 at
    0.5, 0.775 at 0.75 and 0.767 at 1.0."""


class QuerySettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    strip_stopwords: bool = True
    temporal_cues: bool = True
    date_match: bool = True
    time_boost: Weight = 1.0
    """``temporal_cues``: a memory stating a time scores ``1 + time_boost`` times more."""
    date_boost: Weight = 1.0
    """``date_match``: a memory that occurred in a named span scores ``1 + date_boost`` times
    more."""
    date_slack_days: Count = 7
    """A memory recorded up to this long after a named calendar span still matches
    ("yesterday" is said afterwards); a span named relative to the time asked ("last week")
    gets no slack."""
    time_depth: Count = 100
    """How many of the fused candidates (best first) the time and speaker stages rescore."""
    speaker_match: bool = True
    speaker_boost: Weight = 0.25
    """``speaker_match``: a memory said by a speaker the query names scores
    ``1 + speaker_boost`` times more."""
    strip_speakers: bool = True
    """The vector channel embeds the query without the speakers it names."""
    consistency_timeout_s: Annotated[float, msgspec.Meta(ge=0, le=86_400)] = 10.0


class QdrantSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Unset: vectors in embedded qdrant-edge shards. ``url``: a Qdrant server. ``path``:
    qdrant-client's local mode (one process at a time)."""

    url: str | None = None
    path: str | None = None
    api_key: str | None = None
    collection: str = "prme"
    timeout_s: Seconds = 10.0
    index_threshold: Count = 20_000
    """Embedded shards: unindexed points of one shard that start a background HNSW build
    (a child process on a copy, swapped in); once indexed, a quarter of it. 0: never."""
    index_quantization: bool = True
    """Embedded shards: an HNSW build also stores int8 codes of the vectors (scalar
    quantization, in RAM: a quarter of the float vectors' size), which searches walk and
    then rescore on the float vectors. False: searches read the float vectors only, and
    new shards' builds store no codes (a shard that has them keeps storing them, since
    qdrant-edge keeps a shard's quantization, until ``prme rebuild --model vector``)."""


class LimitsSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    max_content_bytes: PositiveInt = 64 * 1024
    max_metadata_bytes: PositiveInt = 16 * 1024
    max_batch_records: PositiveInt = 1000
    max_body_bytes: PositiveInt = 4 * 1024 * 1024
    max_query_bytes: PositiveInt = 16 * 1024
    """A retrieve's query, UTF-8 (the model reads its first 256 tokens anyway; every word
    of a longer one is a lexical clause, and its analysis holds the event loop)."""
    min_free_bytes: Count = 256 * 1024 * 1024
    """The free space kept in reserve on the data directory's file system: writes to the
    embedded log are refused (503) below it, the projector waits below half of it (and a
    pack opens only with a WAL segment's room per vector shard beyond that half), and a
    rebuild or a store's rewrite needs it beyond its copy. The read
    models write into memory-mapped files, which a full disk turns into a crash (SIGBUS).
    0: no check."""


Port = Annotated[int, msgspec.Meta(ge=0, le=65535)]
"""A TCP port (0: any free one)."""


class ServiceSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    host: str = "127.0.0.1"
    port: Port = 8765
    api_keys: dict[str, str] = {}
    """API key -> owner it may act for; the owner ``*`` marks an admin key."""

    def __post_init__(self) -> None:
        # A key no request can present (headers are trimmed), or an owner no request can
        # name, is a mistake: refused, naming the owner, never the key.
        for key, owner in self.api_keys.items():
            if not key:
                raise ValueError(f"service.api_keys has an empty key (for owner {owner!r})")
            if key != key.strip() or _CONTROL.search(key):
                raise ValueError(
                    f"service.api_keys has a key (for owner {owner!r}) with surrounding "
                    "whitespace or control characters: requests could never present it"
                )
            if owner != "*" and not _is_owner_id(owner):
                raise ValueError(
                    f"service.api_keys binds a key to the owner {owner!r}: an owner is '*' "
                    "(admin) or an owner id (1-256 characters, no control or invisible "
                    "characters, no whitespace at either end)"
                )


class McpSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``prme mcp``: the MCP server (docs/MCP.md). Its API keys are ``service.api_keys``."""

    user_id: str | None = None
    """The one owner this server acts for; tools then never take the owner from the model."""
    url: str | None = None
    """A running ``prme serve`` to front instead of opening ``data_dir``."""
    api_key: str | None = None
    """The key sent to ``url`` (never on the command line: it would show in ``ps``)."""
    host: str = "127.0.0.1"
    port: Port = 8766
    path: str = "/mcp"
    receipts: PositiveInt = 256
    """Recall receipts kept in memory for ``prme://receipts/{id}`` (oldest dropped first)."""
    receipt_ttl_s: Seconds = 900.0
    """How long a receipt (it holds the recall's query text) is kept after its recall."""


class ClusterSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Several nodes serving one log (docs/ARCHITECTURE.md "Cluster")."""

    advertised_url: str | None = None
    """The URL other nodes and clients reach this node at; unset: ``http://host:port``."""
    secret: str | None = None
    """Shared by the nodes of a cluster: forwarded requests carry it, and a node refuses a
    forwarded request without it (401). Without one a node neither forwards nor accepts."""
    group: str = "prme-projectors"
    """The Kafka consumer group whose members split the partitions."""
    project: bool = True
    """False: a serve-only node (``--no-project``) that appends writes and routes every
    read to the partition's owner, reading the map from the group."""
    standby_replicas: Count = 0
    """Warm copies of each partition kept by other members, applied continuously; the
    assignor hands a moved partition to its most caught-up standby. The group keeps the
    most any member asks for; processes sharing a data directory hold none."""
    max_warmup_replicas: Count = 2
    """Kafka: how many partitions may be warming up on new owners at once across the group
    (Kafka Streams' ``max.warmup.replicas``). When a balanced plan would move a partition
    to a node whose copy is more than ``acceptable_recovery_lag`` records behind its live
    owner, the owner keeps serving it and the node builds a copy first (a warm-up: a
    standby it replays from the log and the vector changelog); when the copy has caught
    up, the node asks the group to plan again and takes the partition warm. 0: a partition
    moves at once and its new owner replays it before serving it (503 meanwhile). The
    group keeps the most any member asks for."""
    acceptable_recovery_lag: Count = 1_000
    """Kafka: a copy at most this many records behind the partition's owner takes the
    partition at once (Kafka Streams' ``acceptable.recovery.lag``, 10,000 there); one
    further behind warms up first. A takeover replays ~1,300 records/s with vectors from
    the changelog on 2 cores, so 1,000 is about a second of 503s. The group keeps the most
    any member asks for."""
    state_cleanup_delay_s: Annotated[float, msgspec.Meta(ge=0, le=365 * 86_400)] = 600.0
    """Kafka: the read models of a partition this node no longer owns nor keeps a standby
    of are deleted after this long (Kafka Streams' ``state.cleanup.delay.ms``). Kept, they
    let a partition that comes back resume instead of replaying; deleted, no copy outlives
    an erasure that its partition's new owner applied by more than this."""
    static_members: list[str] = []
    """The embedded local log only (``prme serve --processes N``): every process's URL;
    process i owns the partitions p with p mod N == i."""
    forward_timeout_s: Seconds = 30.0
    """Bound on one forwarded request (connect, read, write)."""
    session_timeout_s: Seconds = 10.0
    """Kafka: a member silent this long leaves the group and its partitions move;
    failover takes at least this long. A broker allows 6 to 300 s by default
    (``group.min.session.timeout.ms``; the brokers ``deploy/kafka/`` starts allow 2 s)."""

    def __post_init__(self) -> None:
        secret = self.secret
        if secret and not (secret.isascii() and secret.isprintable() and secret == secret.strip()):
            raise ValueError(
                "cluster.secret must be printable ASCII without surrounding spaces (it "
                "travels in an HTTP header between the nodes)"
            )


class MetricsSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    enabled: bool = True
    """Record Prometheus metrics (served at ``GET /metrics``); off, nothing is recorded."""


class TracingSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    enabled: bool = False
    """OpenTelemetry spans (the ``otel`` extra) through the process's tracer provider."""


class Settings(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    data_dir: str = "./memory"
    models_dir: str | None = None
    api_key: str | None = None
    """``PRME_API_KEY``: the key ``prme status`` sends to the service (an environment
    variable, unlike ``--api-key``, is not shown to every user by ``ps``)."""
    log: LogSettings = LogSettings()
    embedding: EmbeddingSettings = EmbeddingSettings()
    scoring: ScoringSettings = ScoringSettings()
    lexical: LexicalSettings = LexicalSettings()
    query: QuerySettings = QuerySettings()
    qdrant: QdrantSettings = QdrantSettings()
    limits: LimitsSettings = LimitsSettings()
    service: ServiceSettings = ServiceSettings()
    mcp: McpSettings = McpSettings()
    cluster: ClusterSettings = ClusterSettings()
    metrics: MetricsSettings = MetricsSettings()
    tracing: TracingSettings = TracingSettings()

    def __post_init__(self) -> None:
        # The constructor checks no types: ``Settings(scoring={"fusion": "rrf"})`` held a
        # dict that every reader of ``settings.scoring`` would trip on, or ignore.
        for field in msgspec.structs.fields(self):
            default = field.default
            value = getattr(self, field.name)
            if isinstance(default, msgspec.Struct) and not isinstance(value, type(default)):
                raise ConfigurationError(
                    f"Settings({field.name}=...) takes a {type(default).__name__}, not "
                    f"{type(value).__name__}: pass {type(default).__module__}."
                    f"{type(default).__name__}(...), or a dict "
                    f"to Settings().replace({field.name}=...) or Settings.from_env(...)"
                )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        """Settings from ``PRME_*`` variables (``PRME_SCORING__FUSION=weighted``).

        Values that look like JSON objects or lists are parsed as JSON; an empty value is
        no value (the default stays). ``overrides`` are top-level fields (or nested dicts)
        applied last.
        """
        environ = os.environ if environ is None else environ
        tree: dict[str, Any] = {}
        fields = {f.name for f in msgspec.structs.fields(cls)}
        for name, raw in environ.items():
            if not name.startswith("PRME_"):
                continue
            path = name[len("PRME_") :].lower().split("__")
            if path[0] not in fields:
                # PRME_* variables of the tooling (PRME_KAFKA_BOOTSTRAP, PRME_KAFKA_HEAP, ...)
                # are not settings; one shaped like a setting is a misspelt one.
                _refuse_misspelt(cls, name)
                continue
            if raw == "":
                continue  # set empty (PRME_API_KEY=): unset, as shells and compose files mean
            node = tree
            for part in path[:-1]:
                node = node.setdefault(part, {})
                if not isinstance(node, dict):
                    raise ConfigurationError(f"{name}: {part} is not a section")
            value: Any = raw
            if raw[:1] in ("{", "["):
                try:
                    value = json.loads(raw)
                except json.JSONDecodeError as error:
                    raise ConfigurationError(f"{name}: invalid JSON ({error})") from error
            node[path[-1]] = value
        _merge(tree, overrides)
        try:
            return msgspec.convert(tree, cls, strict=False)
        except msgspec.ValidationError as error:
            hint = validation_hint(cls, str(error), variables=True)
            if any(f"Expected `{kind}`, got `str`" in str(error) for kind in ("object", "array")):
                hint = " (a PRME_ variable gives an object or a list as JSON: '{\"key\": ...}')"
            source = _variable_of(str(error), environ)
            raise ConfigurationError(f"invalid settings: {error}{hint}{source}") from error

    def replace(self, **changes: Any) -> Settings:
        """A copy with top-level fields (or nested dicts) changed; self is not modified."""
        tree = msgspec.to_builtins(self)
        _merge(tree, changes)
        try:
            return msgspec.convert(tree, Settings, strict=False)
        except msgspec.ValidationError as error:
            hint = validation_hint(Settings, str(error))
            raise ConfigurationError(f"invalid settings: {error}{hint}") from error

    @property
    def data_path(self) -> Path:
        return Path(self.data_dir)

    @property
    def models_path(self) -> Path:
        if self.models_dir:
            return Path(self.models_dir)
        return Path(os.path.expanduser("~/.cache/prme/models"))


def _variable_of(error: str, environ: Mapping[str, str]) -> str:
    """`` (set by PRME_SCORING__FUSION)`` for an error at a path a ``PRME_`` variable set
    (that path or one around it, or the one variable set inside it), else ``""``: the
    error names the path, the user set the variable."""
    parts = error_path(error)
    if not parts:
        return ""
    for end in range(len(parts), 0, -1):
        name = "PRME_" + "__".join(parts[:end]).upper()
        if environ.get(name):
            return f" (set by {name})"
    prefix = "PRME_" + "__".join(parts).upper() + "__"
    inside = [name for name, value in environ.items() if name.startswith(prefix) and value]
    return f" (set by {inside[0]})" if len(inside) == 1 else ""


_CLOSE = 0.85
"""How alike (``difflib`` ratio) a variable's name and a top-level setting's are for the
variable to be taken for that setting misspelt."""


def _refuse_misspelt(cls: type[Settings], name: str) -> None:
    """ConfigurationError for a ``PRME_`` variable shaped like a setting that is none: a
    section's key after one underscore instead of two (``PRME_LOG_TRANSPORT``), an
    unknown section before ``__`` (``PRME_LOGS__TRANSPORT``), or a top-level setting's name
    misspelt (``PRME_DATADIR``). Ignored, either one would
    leave the default in place without a word (a node on the embedded log, not Kafka)."""
    rest = name[len("PRME_") :]
    sections = {
        field.name: field.type
        for field in msgspec.structs.fields(cls)
        if isinstance(field.type, type) and issubclass(field.type, msgspec.Struct)
    }
    if "__" in rest:
        raise ConfigurationError(
            f"{name} is not a setting: no section {rest.split('__')[0].lower()!r} "
            f"(sections: {', '.join(sorted(sections))})"
        )
    lowered = rest.lower()
    for section, section_type in sections.items():
        key = lowered.removeprefix(section + "_")
        if key != lowered and key in {f.name for f in msgspec.structs.fields(section_type)}:
            raise ConfigurationError(
                f"{name} is not a setting: did you mean PRME_{section.upper()}__{key.upper()}?"
            )
    # A top-level setting misspelt (PRME_DATADIR, PRME_DATA_DIRS) left a pack in ./memory.
    for field in msgspec.structs.fields(cls):
        if field.name in sections:
            continue
        close = difflib.SequenceMatcher(None, lowered, field.name).ratio() >= _CLOSE
        if close or lowered.replace("_", "") == field.name.replace("_", ""):
            raise ConfigurationError(
                f"{name} is not a setting: did you mean PRME_{field.name.upper()}?"
            )


_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def _is_owner_id(owner: str) -> bool:
    try:
        msgspec.convert(owner, UserIdField)
    except msgspec.ValidationError:
        return False
    return True


def _merge(tree: dict[str, Any], changes: Mapping[str, Any]) -> None:
    for key, value in changes.items():
        if isinstance(value, msgspec.Struct):
            value = msgspec.to_builtins(value)
        if isinstance(value, Mapping) and isinstance(tree.get(key), dict):
            _merge(tree[key], value)
        else:
            tree[key] = value
