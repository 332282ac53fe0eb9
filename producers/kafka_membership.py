"""Cluster membership through the consumer group itself (Kafka Streams' pattern): each
member's subscription carries its URL and the shards it holds; the group leader's assignor
plans owners (sticky, balanced, warm copies first) and standbys, and hands every member the
whole map in its assignment. No second coordination service: a node that is not in the
group reads the same map from the group's description (``read_cluster_map``)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping

import msgspec
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.cluster import ClusterMetadata
from aiokafka.coordinator.assignors.abstract import AbstractPartitionAssignor
from aiokafka.coordinator.protocol import (
    ConsumerProtocolMemberAssignment,
    ConsumerProtocolMemberMetadata,
)

from prme.schemas.cluster import (
    DUPLICATE_URL,
    SECRET_REFUSED,
    ClusterMap,
    ClusterMember,
    MemberClaim,
    TopicRefused,
)

from .kafka_common import bounded

ASSIGNOR_NAME = "prme-cluster"
_log = logging.getLogger("prme.cluster")
_claims = msgspec.json.Decoder(MemberClaim)
_maps = msgspec.json.Decoder(ClusterMap)


def claimed_url(metadata: bytes) -> str:
    """The URL a member's subscription metadata claims ("" when it claims none)."""
    try:
        return _claims.decode(ConsumerProtocolMemberMetadata.decode(metadata).user_data).url
    except Exception:  # a member of another protocol or an older PRME: no URL to show
        return ""


def refused_members(claims: Mapping[str, MemberClaim]) -> set[str]:
    """The members with a URL whose cluster secret is not the group's. The group's is the
    one of the members that owned the most partitions in the last generation (the
    running cluster: a node started with a mistyped secret does not take partitions it
    could not serve), then of the most members (a cluster starting together); when two
    secrets tie on both, nobody is refused and the leader logs it."""
    serving = {m: c for m, c in claims.items() if c.url}
    support: dict[str, tuple[int, int]] = {}
    for claim in serving.values():
        owned, members = support.get(claim.secret_tag, (0, 0))
        support[claim.secret_tag] = (owned + len(claim.owned), members + 1)
    if len(support) < 2:
        return set()
    ranked = sorted(support.items(), key=lambda item: item[1], reverse=True)
    if ranked[0][1] == ranked[1][1]:
        _log.error(
            "the group's members disagree on the cluster secret and neither side leads "
            "(%s): set PRME_CLUSTER__SECRET the same on every node",
            sorted(c.url for c in serving.values()),
        )
        return set()
    group_tag = ranked[0][0]
    refused = {m for m, c in serving.items() if c.secret_tag != group_tag}
    _log.error(
        "gave no partitions to %s: %s", sorted(serving[m].url for m in refused), SECRET_REFUSED
    )
    return refused


def group_topic(
    subscriptions: Mapping[str, Iterable[str]], claims: Mapping[str, MemberClaim], own: str
) -> str:
    """The topic the group reads when its members subscribe to different ones (a node
    started with another ``PRME_LOG__TOPIC``): the one the most members subscribe to, then
    the one whose members owned the most partitions in the last generation (the running
    cluster), then the leader's ``own``, then the first by name."""
    support: dict[str, tuple[int, int]] = {}
    for member, topics in subscriptions.items():
        for topic in set(topics):
            members, owned = support.get(topic, (0, 0))
            support[topic] = (members + 1, owned + len(claims[member].owned))
    if not support:
        return own
    return min(support, key=lambda t: (-support[t][0], -support[t][1], t != own, t))


def duplicate_members(claims: Mapping[str, MemberClaim]) -> set[str]:
    """Members that advertise a URL another member advertises too, but for one of each URL:
    one the URL was seen to reach, then the one that owned the most partitions in the last
    generation (the running node, not the one started with its address), then the first
    by member id."""
    by_url: dict[str, list[str]] = {}
    for member, claim in claims.items():
        if claim.url:
            by_url.setdefault(claim.url, []).append(member)
    duplicates: set[str] = set()
    for url, members in by_url.items():
        if len(members) > 1:
            members.sort(key=lambda m: (not claims[m].reaches_url, -len(claims[m].owned), m))
            duplicates.update(members[1:])
            _log.error(
                "gave no partitions to %d more member(s) at %s: %s",
                len(members) - 1,
                url,
                DUPLICATE_URL,
            )
    return duplicates


def plan_cluster(
    claims: Mapping[str, MemberClaim], partitions: Iterable[int], standby_replicas: int = 0
) -> dict[str, ClusterMember]:
    """Owners and standbys per member id: balanced (counts differ by at most one, once no
    copy is warming up: ``hold_cold_moves``), a member keeps the partitions it owned, a
    partition that must move goes to the member with the most caught-up copy of it (a
    standby), then to the least loaded member.
    A member with an empty URL (a ``prme project`` worker) projects but is not routed to.
    Standbys per partition: the most that ``standby_replicas`` or any claim asks for, on
    members that hold standbys (``plan_standbys``)."""
    ordered = sorted(claims, key=lambda m: (claims[m].url, m))
    todo = sorted(set(partitions))
    if not ordered:
        return {}
    base, extra = divmod(len(todo), len(ordered))
    # Members that own more today get the larger quotas, so fewer partitions move.
    by_holding = sorted(ordered, key=lambda m: (-len(claims[m].owned), claims[m].url, m))
    quota = {m: base + (1 if i < extra else 0) for i, m in enumerate(by_holding)}
    owned: dict[str, list[int]] = {m: [] for m in ordered}
    free = set(todo)
    for member in ordered:
        for partition in sorted(claims[member].owned):
            if partition in free and len(owned[member]) < quota[member]:
                owned[member].append(partition)
                free.discard(partition)
    for partition in sorted(free):
        roomy = [m for m in ordered if len(owned[m]) < quota[m]]
        best = max(
            roomy,
            key=lambda m: (claims[m].warm.get(partition, -1), -len(owned[m]), claims[m].url),
        )
        owned[best].append(partition)
    warmups = hold_cold_moves(claims, owned)
    replicas = max([standby_replicas, *(claims[m].standby_replicas for m in ordered)])
    standbys = plan_standbys(claims, owned, replicas)
    return {
        m: ClusterMember(
            url=claims[m].url,
            keyed=claims[m].keyed,
            partitions=sorted(owned[m]),
            standbys=sorted(set(standbys[m]) | warmups[m]),
            warmups=sorted(warmups[m]),
        )
        for m in ordered
    }


def hold_cold_moves(
    claims: Mapping[str, MemberClaim], owned: dict[str, list[int]]
) -> dict[str, set[int]]:
    """Kafka Streams' warm-up replicas (KIP-441), on a balanced plan ``owned`` (changed in
    place): a partition the plan moves away from its live owner (a member that owned it in
    the last generation and serves it) to a member whose copy is more than
    ``acceptable_recovery_lag`` records behind the owner's, and has not caught up by its
    own reading, stays with its owner, which serves it meanwhile, instead of going to a
    node that would answer 503 while it replays. Up to ``max_warmup_replicas``
    of those, across the group, become warm-ups of the members the plan chose: the
    returned partitions per member; the rest wait for a later plan. Partitions whose owner
    left, and those going to a member that can keep no copy (a worker without a URL, a
    process sharing its data directory, a node from before warm-ups), move at once."""
    warmups: dict[str, set[int]] = {m: set() for m in claims}
    budget = max((c.max_warmup_replicas for c in claims.values()), default=0)
    if budget == 0:
        return warmups
    lag = max(c.acceptable_recovery_lag for c in claims.values())
    ordered = sorted(claims, key=lambda m: (claims[m].url, m))
    source: dict[int, str] = {}
    for member in ordered:
        for partition in claims[member].owned:
            held = source.get(partition)
            mine = claims[member].warm.get(partition, -1)
            if held is None or mine > claims[held].warm.get(partition, -1):
                source[partition] = member
    for member in ordered:
        for partition in sorted(owned[member]):
            owner = source.get(partition)
            if owner is None or owner == member:
                continue
            target = claims[member]
            if not (target.url and target.holds_standbys and target.warms_up):
                continue  # it can keep no copy to warm up: it replays after taking over
            if partition not in claims[owner].serving or partition in target.caught_up:
                continue  # its owner is replaying it too, or the copy has caught up
            behind = claims[owner].warm.get(partition, -1) - target.warm.get(partition, -1)
            if behind <= lag:
                continue
            owned[member].remove(partition)
            owned[owner].append(partition)
            if budget:
                warmups[member].add(partition)
                budget -= 1
    if any(warmups.values()):
        _log.info(
            "kept partitions with their owners while copies warm up: %s",
            {claims[m].url: sorted(ps) for m, ps in warmups.items() if ps},
        )
    return warmups


def plan_standbys(
    claims: Mapping[str, MemberClaim], owned: Mapping[str, list[int]], replicas: int
) -> dict[str, list[int]]:
    """Standbys per member, given the owners (``owned``, every member of ``claims``):
    ``replicas`` copies of each partition on members other than its owner that hold
    standbys. Priorities, in order: the members' standby counts differ by at most one
    (Kafka Streams balances standby load the same way: the member that joined last held
    none when the most caught-up copy came first); each owner's partitions are backed
    evenly by the others, so when an owner dies each survivor takes its share from
    standbys; a copy stays where it is warm (caught up); the least loaded member."""
    ordered = sorted(claims, key=lambda m: (claims[m].url, m))
    holders = [m for m in ordered if claims[m].holds_standbys]
    owner_of = {p: m for m in ordered for p in owned[m]}
    copies = {
        p: min(replicas, sum(1 for h in holders if h != owner)) for p, owner in owner_of.items()
    }
    held: dict[str, set[int]] = {m: set() for m in ordered}
    # supply[h]: partitions with copies still to place that h could take (not its own,
    # not already held): a member whose supply is down to its remaining target must take
    # the next one it can, or the counts end up uneven.
    supply = {h: sum(1 for p, n in copies.items() if n and owner_of[p] != h) for h in holders}
    target = _standby_targets(holders, owned, supply, sum(copies.values()))
    left = dict(copies)
    backing: dict[tuple[str, str], int] = {}
    for partition in sorted(copies):
        owner = owner_of[partition]
        for _ in range(copies[partition]):
            candidates = [h for h in holders if h != owner and partition not in held[h]]

            def rank(h: str, partition: int = partition, owner: str = owner) -> tuple:
                need = target[h] - len(held[h])
                return (
                    need <= 0,
                    need < supply[h],
                    backing.get((h, owner), 0),
                    -claims[h].warm.get(partition, -1),
                    len(held[h]) + len(owned[h]),
                    claims[h].url,
                    h,
                )

            best = min(candidates, key=rank)
            held[best].add(partition)
            backing[(best, owner)] = backing.get((best, owner), 0) + 1
            supply[best] -= 1
            left[partition] -= 1
            if left[partition] == 0:
                for h in holders:
                    if h != owner and partition not in held[h]:
                        supply[h] -= 1
    return {m: sorted(held[m]) for m in ordered}


def _standby_targets(
    holders: list[str], owned: Mapping[str, list[int]], room: Mapping[str, int], total: int
) -> dict[str, int]:
    """How many standbys each holder gets: ``total`` spread to within one, the larger
    shares to the holders that own the fewest partitions, none past its ``room``."""
    target = dict.fromkeys(holders, 0)
    for _ in range(total):
        open_ = [h for h in holders if target[h] < room[h]]
        if not open_:
            break
        target[min(open_, key=lambda h: (target[h], len(owned[h])))] += 1
    return target


class ClusterAssignor(AbstractPartitionAssignor):
    """The aiokafka assignor of a PRME node. Every member of the group must use it (the
    group refuses members that share no assignor). ``topic`` is the node's own: as the
    leader it plans the topic of the group (``group_topic``), which may be another."""

    version = 0

    def __init__(
        self,
        topic: str,
        claim: Callable[[], MemberClaim],
        on_map: Callable[[ClusterMap], None],
        standby_replicas: int = 0,
    ) -> None:
        self._topic = topic
        self._claim = claim
        self._on_map = on_map
        self._standby_replicas = standby_replicas

    @property
    def name(self) -> str:  # type: ignore[override]
        return ASSIGNOR_NAME

    def metadata(self, topics: Iterable[str]) -> ConsumerProtocolMemberMetadata:  # type: ignore[override]
        return ConsumerProtocolMemberMetadata(
            self.version, list(topics), msgspec.json.encode(self._claim())
        )

    def assign(  # type: ignore[override]
        self, cluster: ClusterMetadata, members: Mapping[str, ConsumerProtocolMemberMetadata]
    ) -> dict[str, ConsumerProtocolMemberAssignment]:
        claims: dict[str, MemberClaim] = {}
        for member_id, metadata in members.items():
            try:
                claims[member_id] = _claims.decode(metadata.user_data)
            except msgspec.DecodeError:  # a member of an older PRME: a worker, no URL
                claims[member_id] = MemberClaim(url="")
        subscriptions = {m: list(metadata.subscription) for m, metadata in members.items()}
        topic = group_topic(subscriptions, claims, self._topic)
        elsewhere = {m for m, topics in subscriptions.items() if topic not in topics}
        if elsewhere:
            _log.error(
                "gave no partitions to %s: they read another topic than the group's %r "
                "(PRME_LOG__TOPIC must be the same on every node of a group)",
                sorted(f"{claims[m].url or m} on {','.join(subscriptions[m])}" for m in elsewhere),
                topic,
            )
        on_topic = {m: c for m, c in claims.items() if m not in elsewhere}
        partitions = sorted(cluster.partitions_for_topic(topic) or ())
        refused = refused_members(on_topic)
        duplicates = duplicate_members({m: c for m, c in on_topic.items() if m not in refused})
        planned = plan_cluster(
            {m: c for m, c in on_topic.items() if m not in refused | duplicates},
            partitions,
            self._standby_replicas,
        )
        listed = sorted(planned.values(), key=lambda m: m.url)
        planned.update({m: ClusterMember(url=claims[m].url) for m in refused | duplicates})
        generation = max((c.generation for c in claims.values()), default=-1) + 1
        cluster_map = ClusterMap(
            generation=generation,
            partitions=len(partitions),
            members=sorted([*listed, *(planned[m] for m in refused)], key=lambda m: m.url),
            refused=sorted(claims[m].url for m in refused),
            duplicates={claims[m].instance: claims[m].url for m in duplicates},
            topic=topic,
            other_topic=sorted(
                (
                    TopicRefused(
                        url=claims[m].url,
                        instance=claims[m].instance,
                        topic=",".join(subscriptions[m]),
                    )
                    for m in elsewhere
                ),
                key=lambda r: (r.url, r.instance),
            ),
        )
        encoded = msgspec.json.encode(cluster_map)
        _log.info(
            "planned generation %d: %s",
            generation,
            {m.url: m.partitions for m in cluster_map.members},
        )
        # Kafka lets a member be assigned only partitions of topics it subscribes to (the
        # member's consumer fails its assertion otherwise): one on another topic gets none.
        return {
            member_id: ConsumerProtocolMemberAssignment(
                self.version,
                [] if member_id in elsewhere else [(topic, planned[member_id].partitions)],
                encoded,
            )
            for member_id in members
        }

    def on_assignment(self, assignment: ConsumerProtocolMemberAssignment) -> None:  # type: ignore[override]
        try:
            cluster_map = _maps.decode(assignment.user_data)
        except msgspec.DecodeError:
            _log.warning("an assignment without a cluster map: is every member a PRME node?")
            return
        self._on_map(cluster_map)


async def read_cluster_map(
    admin: AIOKafkaAdminClient, group: str, timeout_s: float
) -> ClusterMap | None:
    """The map the group's leader handed out, from the group's description (for a node that
    routes without being a member); None while the group is rebalancing or empty."""
    responses = await bounded(admin.describe_consumer_groups([group]), timeout_s, "describe group")
    newest: ClusterMap | None = None
    for response in responses:
        for described in response.to_object()["groups"]:
            if described.get("state") != "Stable":
                return None
            for member in described["members"]:
                raw = member["member_assignment"]
                if not raw:
                    continue
                try:
                    user_data = ConsumerProtocolMemberAssignment.decode(raw).user_data
                    candidate = _maps.decode(user_data)
                except (msgspec.DecodeError, ValueError, TypeError):
                    continue
                if newest is None or candidate.generation > newest.generation:
                    newest = candidate
    return newest
