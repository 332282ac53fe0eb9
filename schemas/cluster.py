"""The cluster map: which node owns (and which nodes keep standbys of) each partition.

The consumer group's leader computes it during a rebalance and hands it to every member in
its assignment (see ``producers/kafka_membership.py``); on the embedded local log it is a
static split. Every node routes requests with it; ``GET /v1/cluster`` serves it.
"""

from __future__ import annotations

import hashlib

import msgspec


class ClusterMember(msgspec.Struct, frozen=True, kw_only=True):
    """One node: the URL other nodes and clients reach it at, and what it holds."""

    url: str
    partitions: list[int] = []
    """Partitions this node owns (serves and projects)."""
    standbys: list[int] = []
    """Partitions this node keeps warm copies of, applied continuously, not served."""
    keyed: bool = False
    """It serves with API keys (``service.api_keys``): a node without any appends nothing
    (it lets anyone in as ``*``; a cluster trial wrote a keyed node's owners through one)."""
    warmups: list[int] = []
    """Partitions the plan would give this node but that its copy is too far behind to
    serve at once (more than ``MemberClaim.acceptable_recovery_lag`` records behind the
    owner): their owner keeps them while this node builds a copy, as a standby, and the
    node asks the group to plan again once the copy has caught up (Kafka Streams'
    warm-up replicas). Also listed in ``standbys``."""


class TopicRefused(msgspec.Struct, frozen=True, kw_only=True):
    """A member the group gave nothing because it subscribes to another topic than the
    group's (a node started with another ``PRME_LOG__TOPIC``)."""

    url: str
    instance: str
    """Its ``MemberClaim.instance``: workers share the empty URL."""
    topic: str
    """The topic (or topics, comma-separated) it subscribes to."""


class ClusterMap(msgspec.Struct, frozen=True, kw_only=True):
    """Partition -> owner URL for one generation of the group."""

    generation: int
    partitions: int
    members: list[ClusterMember] = []
    refused: list[str] = []
    """URLs of members given nothing: their cluster secret is not the group's (see
    ``MemberClaim.secret_tag``), so the other nodes would refuse their forwarded requests
    and they the others'."""
    duplicates: dict[str, str] = {}
    """``MemberClaim.instance`` -> URL of members given nothing because another member
    advertises the same URL (the one that keeps it is listed in ``members``): requests
    routed to that URL would reach only one of them."""
    topic: str = ""
    """The topic whose partitions the map covers: the group's, when its members subscribe
    to different topics ("": a map from before it was named, or the embedded log)."""
    other_topic: list[TopicRefused] = []
    """Members given nothing because they subscribe to another topic than ``topic``: Kafka
    may only assign a member partitions of topics it subscribes to."""

    def owner(self, partition: int) -> str | None:
        """The URL of the node that owns ``partition`` (None while nobody does)."""
        for member in self.members:
            if partition in member.partitions:
                return member.url
        return None

    def standbys_of(self, partition: int) -> list[str]:
        return [m.url for m in self.members if partition in m.standbys]

    def member(self, url: str) -> ClusterMember | None:
        for member in self.members:
            if member.url == url:
                return member
        return None


class MemberClaim(msgspec.Struct, frozen=True, kw_only=True):
    """What a member tells the group leader when it joins (the user data of its
    subscription): where it is reached, and which partitions it has state for."""

    url: str
    owned: list[int] = []
    """Partitions it owned in the last generation (kept where possible: sticky)."""
    warm: dict[int, int] = {}
    """Partition -> applied offset of every shard it has on disk (owned or standby): the
    leader prefers the most caught-up holder when a partition must move."""
    generation: int = -1
    """The newest map generation it has seen; the leader's map is one newer."""
    standby_replicas: int = 0
    """The standbys per partition it was started with: the group keeps the most any
    member asks for, so nodes need not agree (nor the leader be the one that asked)."""
    keyed: bool = False
    """It serves with API keys (``service.api_keys``)."""
    holds_standbys: bool = True
    """False for a process that shares its data directory with sibling processes (a
    standby would sit in the directory its owner writes): it is given none."""
    secret_tag: str = ""
    """:func:`secret_tag` of its cluster secret: members with a URL whose tag is not the
    group's are given no partitions."""
    instance: str = ""
    """A random id of the process, which tells members that advertise the same URL apart."""
    reaches_url: bool = False
    """A request to its URL was seen to reach it when it started: of members advertising
    one URL, the group keeps one that it reaches."""
    warms_up: bool = False
    """It asks for a new plan when its warm-ups catch up (a node from before warm-ups
    would never ask: the group holds no partition for one)."""
    serving: list[int] = []
    """The partitions it owns and serves (caught up): a partition whose owner is still
    replaying it is not held for it."""
    caught_up: list[int] = []
    """Its standbys (warm-ups included) whose last read reached the log's end: the leader
    moves a warm-up that says so, however far the owner's claim, taken a moment later
    under writes, has moved on."""
    max_warmup_replicas: int = 0
    """``cluster.max_warmup_replicas``: the group keeps the most any member asks for."""
    acceptable_recovery_lag: int = 0
    """``cluster.acceptable_recovery_lag``: the group keeps the most any member asks for."""


SECRET_REFUSED = (
    "its cluster secret is not the one of the other nodes (PRME_CLUSTER__SECRET must be the "
    "same on every node)"
)
"""Why the group gave a node no partitions (logs, ``/v1/ready``, ``prme status``)."""

DUPLICATE_URL = (
    "another member of the group advertises the same URL, so requests routed there would "
    "reach only one of them: give each node its own --advertised-url "
    "(PRME_CLUSTER__ADVERTISED_URL), one the other nodes reach it at"
)
"""Why the group gave a node no partitions when another member advertises its URL."""


def other_topic_refusal(topic: str, cluster_map: ClusterMap) -> str:
    """Why the group gave a node that reads ``topic`` no partitions."""
    return (
        f"it reads the topic {topic!r}, the other nodes of its group read {cluster_map.topic!r} "
        "(PRME_LOG__TOPIC must be the same on every node of a group, PRME_CLUSTER__GROUP: "
        "give a node of another cluster a group of its own)"
    )


def secret_tag(secret: str | None) -> str:
    """A fingerprint of the cluster ``secret`` that members compare through the group ("":
    none). Anyone who can describe the consumer group reads it, so it is a memory-hard
    hash (scrypt, ~50 ms once per process) rather than one cheap to guess against."""
    if not secret:
        return ""
    derived = hashlib.scrypt(
        secret.encode(), salt=b"prme-cluster-secret-tag", n=2**14, r=8, p=1, dklen=16
    )
    return derived.hex()


def static_map(urls: list[str], partitions: int) -> ClusterMap:
    """The embedded local log's split across processes: process i owns p mod N == i."""
    members = [
        ClusterMember(url=url, partitions=[p for p in range(partitions) if p % len(urls) == i])
        for i, url in enumerate(urls)
    ]
    return ClusterMap(generation=0, partitions=partitions, members=members)
