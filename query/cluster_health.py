"""Whether the cluster serves every partition: the health ``prme status`` exits on.

A node's own status (``projectors/status.py``) says what this process projects; a health
check needs more: every partition of the topic must have a live owner that is caught up.
The group's description alone does not say so. After a node is killed (``kill -9``) the
group keeps listing it, with its partitions, until its session timeout passes; during a
rebalance nobody owns anything; and a new owner serves a partition only once it has
restored it. So the status asks each owner the group names (``GET /v1/cluster``: what it
owns and serves), at most ``PEER_TIMEOUT_S``, and this node answers for itself.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Mapping

import httpx
import msgspec

from prme.projectors.status import (
    STATUS_TIMEOUT_S,
    ClusterHealth,
    NodeStatus,
    PartitionHealth,
    PartitionState,
)
from prme.schemas.cluster import other_topic_refusal

from .cluster import ClusterRouter
from .engine import MemoryEngine

PEER_TIMEOUT_S = STATUS_TIMEOUT_S
"""How long a status waits for the other owners' answers (asked together)."""
THIS_NODE = "this node"
"""The owner of every partition of a node that routes without a map (one process)."""


class PeerView(msgspec.Struct, frozen=True, kw_only=True):
    """What a node says it holds: the part of its ``GET /v1/cluster`` a status reads."""

    owned: list[int] = []
    serving: list[int] = []


def assess(
    partitions: int,
    owners: Mapping[int, str] | None,
    views: Mapping[str, PeerView | str],
    *,
    group_state: str | None = None,
    session_timeout_s: float | None = None,
) -> ClusterHealth:
    """The health of ``partitions`` partitions from who holds them (``owners``: partition
    -> URL, "" for a worker; None when unknown), what each owner answered (``views``: URL
    -> its view, or why it did not answer) and the group's state and session timeout
    (None: no group, the embedded log's static split)."""
    states: list[PartitionHealth] = []
    rebalancing = group_state in ("PreparingRebalance", "CompletingRebalance")
    for partition in range(partitions):
        owner = None if owners is None else owners.get(partition)
        state: PartitionState
        if rebalancing:
            state, owner = "rebalancing", None
        elif owners is None:
            state = "unknown"
        elif owner is None:
            state = "unowned"
        elif owner == "":
            state = "worker"
        else:
            view = views.get(owner, "not asked")
            if isinstance(view, str):
                state = "unreachable"
            elif partition in view.serving:
                state = "serving"
            else:
                state = "not_serving"
        states.append(PartitionHealth(partition=partition, state=state, owner=owner))
    problems = _problems(states, views, group_state, session_timeout_s)
    return ClusterHealth(healthy=not problems, partitions=states, problems=problems)


def _problems(
    states: list[PartitionHealth],
    views: Mapping[str, PeerView | str],
    group_state: str | None,
    session_timeout_s: float | None,
) -> list[str]:
    by_state: dict[str, list[int]] = defaultdict(list)
    by_owner: dict[tuple[str, str], list[int]] = defaultdict(list)
    for health in states:
        if health.state in ("unreachable", "not_serving"):
            by_owner[(health.state, health.owner or "")].append(health.partition)
        elif health.state != "serving":
            by_state[health.state].append(health.partition)
    problems: list[str] = []
    if rebalancing := by_state.get("rebalancing"):
        problems.append(
            f"the group is rebalancing ({group_state}): partitions {rebalancing} have no "
            "settled owner until it completes"
        )
    if unknown := by_state.get("unknown"):
        problems.append(
            f"the group's description did not answer: who holds partitions {unknown} is unknown"
        )
    if unowned := by_state.get("unowned"):
        problems.append(f"partitions {unowned} have no owner in the group")
    if held := by_state.get("worker"):
        problems.append(
            f"partitions {held} are held by a member that serves no requests (a `prme "
            "project` worker): run workers in a group of their own"
        )
    if session_timeout_s is None:  # the embedded log's split: nothing moves
        then = "its `prme serve --processes` parent starts a member that exits again"
    else:
        then = (
            "the group moves them once the node has been silent for its session timeout "
            f"(cluster.session_timeout_s: {session_timeout_s:g} s on this node)"
        )
    for (state, owner), partitions in sorted(by_owner.items()):
        if state == "unreachable":
            problems.append(
                f"partitions {partitions}: their owner {owner} does not answer "
                f"({views.get(owner, 'not asked')}); {then}"
            )
        else:
            problems.append(
                f"partitions {partitions}: their owner {owner} does not serve them yet "
                "(restoring them, or taking them over)"
            )
    return problems


async def cluster_health(engine: MemoryEngine, status: NodeStatus) -> ClusterHealth:
    """The health of the whole cluster as this node sees it: who holds each partition
    (the group's description on Kafka, else the map this node routes with), and whether
    each holder answers and serves it (asked at most ``PEER_TIMEOUT_S``)."""
    runner, router = engine.runner, engine.router
    here = THIS_NODE if router is None else router.url
    partitions = runner.transport.partitions
    cluster_map, topic = runner.cluster_map, engine.settings.log.topic
    if cluster_map is not None and cluster_map.topic and cluster_map.topic != topic:
        return _outside_the_group(partitions, other_topic_refusal(topic, cluster_map))
    owners: dict[int, str] | None
    if status.transport == "kafka":
        owners = None
        if status.group_members is not None:
            owners = {p: m.url for m in status.group_members for p in m.partitions}
    elif router is not None and router.cluster_map is not None:  # --processes: a split
        cluster_map = router.cluster_map
        owners = {
            p: owner for p in range(partitions) if (owner := cluster_map.owner(p)) is not None
        }
    else:  # one process holds every partition
        owners = dict.fromkeys(range(partitions), here)
    views: dict[str, PeerView | str] = {
        here: PeerView(
            owned=sorted(runner.shards),
            serving=sorted(p for p in runner.shards if runner.serving(p)),
        )
    }
    peers = sorted({url for url in (owners or {}).values() if url and url != here})
    if peers and router is not None:
        answers = await asyncio.gather(*(_ask(router, url) for url in peers))
        views.update(zip(peers, answers, strict=True))
    return assess(
        partitions,
        owners,
        views,
        group_state=status.group_state,
        session_timeout_s=(
            engine.settings.cluster.session_timeout_s if status.transport == "kafka" else None
        ),
    )


def _outside_the_group(partitions: int, refusal: str) -> ClusterHealth:
    """A node the group refused for reading another topic: the group's members hold the
    partitions of the group's topic, which this node does not read (it used to take them
    for its own topic's, and called every partition unowned)."""
    return ClusterHealth(
        healthy=False,
        partitions=[PartitionHealth(partition=p, state="unknown") for p in range(partitions)],
        problems=[
            f"this node holds no partitions: {refusal}; how the group's partitions are "
            "served is for a node of the group to say (prme status --url <one of them>)"
        ],
    )


async def _ask(router: ClusterRouter, url: str) -> PeerView | str:
    """A peer's view, or why there is none (a string)."""
    try:  # httpx bounds each phase; the whole ask is bounded too
        response = await asyncio.wait_for(router.peer_view(url, PEER_TIMEOUT_S), PEER_TIMEOUT_S)
    except (TimeoutError, httpx.TimeoutException):
        return f"no answer within {PEER_TIMEOUT_S:g}s"
    except httpx.HTTPError as error:
        return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
    if response.status_code != 200:
        return f"GET /v1/cluster answered {response.status_code}"
    try:
        return msgspec.json.decode(response.content, type=PeerView)
    except msgspec.DecodeError as error:
        return f"GET /v1/cluster answered something else than a node's view ({error})"
