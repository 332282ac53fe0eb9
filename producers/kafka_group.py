"""Who is in a Kafka consumer group, and which partitions each member holds."""

from __future__ import annotations

import msgspec
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.coordinator.protocol import ConsumerProtocolMemberAssignment

from .kafka_common import bounded
from .kafka_membership import claimed_url


class GroupMember(msgspec.Struct, frozen=True, kw_only=True):
    """One member of a consumer group: who it is and which partitions it holds."""

    member_id: str
    client_id: str
    host: str
    partitions: list[int]
    url: str = ""
    """The node's URL from its PRME claim ("" for a worker or a client that is not PRME's)."""


class GroupDescription(msgspec.Struct, frozen=True, kw_only=True):
    """A consumer group as its coordinator describes it."""

    state: str
    """``Stable`` once every member has its assignment; ``PreparingRebalance`` and
    ``CompletingRebalance`` during a rebalance (members are then listed without their
    partitions or URLs); ``Empty`` without members; ``Dead`` for an unknown group."""
    members: list[GroupMember]


async def describe_group(
    admin: AIOKafkaAdminClient, topic: str, group: str, timeout_s: float
) -> GroupDescription:
    """The state of ``group`` and its members with the partitions of ``topic`` each holds,
    as the group coordinator describes them (members subscribed to other topics hold none
    of ours)."""
    responses = await bounded(admin.describe_consumer_groups([group]), timeout_s, "describe group")
    members: list[GroupMember] = []
    state = "Dead"
    for response in responses:
        for described in response.to_object()["groups"]:
            state = described["state"]
            for member in described["members"]:
                raw = member["member_assignment"]
                held = ConsumerProtocolMemberAssignment.decode(raw).assignment if raw else []
                partitions = sorted(p for name, ps in held if name == topic for p in ps)
                members.append(
                    GroupMember(
                        member_id=member["member_id"],
                        client_id=member["client_id"],
                        host=member["client_host"],
                        partitions=partitions,
                        url=claimed_url(member["member_metadata"]),
                    )
                )
    return GroupDescription(
        state=state, members=sorted(members, key=lambda m: (m.partitions, m.member_id))
    )
