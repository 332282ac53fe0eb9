"""The assignor's plan: balanced, sticky, moved partitions to their warmest copy, standbys
on other members."""

from __future__ import annotations

import msgspec
from aiokafka.cluster import ClusterMetadata
from aiokafka.coordinator.protocol import ConsumerProtocolMemberMetadata

from prme.producers.kafka_membership import (
    ClusterAssignor,
    duplicate_members,
    plan_cluster,
    refused_members,
)
from prme.schemas.cluster import (
    ClusterMap,
    MemberClaim,
    TopicRefused,
    other_topic_refusal,
    secret_tag,
)


def owned(plan: dict, member: str) -> list[int]:
    return plan[member].partitions


def test_a_fresh_group_is_balanced_and_covers_every_partition() -> None:
    claims = {m: MemberClaim(url=f"http://{m}") for m in ("a", "b", "c")}
    plan = plan_cluster(claims, range(12))
    assert sorted(p for m in plan for p in owned(plan, m)) == list(range(12))
    assert sorted(len(owned(plan, m)) for m in plan) == [4, 4, 4]


def test_members_keep_what_they_owned_when_one_joins() -> None:
    claims = {
        "a": MemberClaim(url="http://a", owned=list(range(0, 6))),
        "b": MemberClaim(url="http://b", owned=list(range(6, 12))),
        "c": MemberClaim(url="http://c"),
    }
    plan = plan_cluster(claims, range(12))
    assert sorted(len(owned(plan, m)) for m in plan) == [4, 4, 4]
    assert set(owned(plan, "a")) <= set(range(0, 6))
    assert set(owned(plan, "b")) <= set(range(6, 12))


def test_a_dead_members_partitions_go_to_their_standby() -> None:
    # c died; b kept standbys of 8..11 (caught up), a has stale copies of two of them.
    claims = {
        "a": MemberClaim(url="http://a", owned=[0, 1, 2, 3], warm={8: 5, 9: 5}),
        "b": MemberClaim(
            url="http://b", owned=[4, 5, 6, 7], warm={8: 900, 9: 900, 10: 900, 11: 900}
        ),
    }
    plan = plan_cluster(claims, range(12))
    assert sorted(len(owned(plan, m)) for m in plan) == [6, 6]
    moved = set(owned(plan, "b")) - {4, 5, 6, 7}
    assert moved <= {8, 9, 10, 11} and len(moved) == 2


def test_standbys_live_on_other_members() -> None:
    claims = {m: MemberClaim(url=f"http://{m}") for m in ("a", "b", "c")}
    plan = plan_cluster(claims, range(12), standby_replicas=1)
    for member in plan.values():
        assert not set(member.partitions) & set(member.standbys)
    assert sorted(p for m in plan.values() for p in m.standbys) == list(range(12))
    assert plan_cluster({"a": claims["a"]}, range(4), standby_replicas=2)["a"].standbys == []


def test_an_owners_standbys_are_spread_over_the_other_members() -> None:
    # After a first generation in which "a" held everything (warm -1: no data then).
    claims = {
        "a": MemberClaim(url="http://a", warm=dict.fromkeys(range(12), -1)),
        "b": MemberClaim(url="http://b"),
        "c": MemberClaim(url="http://c"),
    }
    plan = plan_cluster(claims, range(12), standby_replicas=1)
    for owner in plan:
        backed = [
            sum(p in plan[m].standbys for p in plan[owner].partitions) for m in plan if m != owner
        ]
        assert sorted(backed) == [2, 2], (owner, plan)


def test_any_member_asking_for_standbys_gets_them_for_the_group() -> None:
    # Only c was started with --standby-replicas 1; the leader (planning with its own 0)
    # used to plan none, as the README's example shows the flag on one node.
    claims = {
        "a": MemberClaim(url="http://a"),
        "b": MemberClaim(url="http://b"),
        "c": MemberClaim(url="http://c", standby_replicas=1),
    }
    plan = plan_cluster(claims, range(12), standby_replicas=0)
    held = sorted(p for m in plan for p in plan[m].standbys)
    assert held == list(range(12))
    for member in plan:
        assert not set(plan[member].standbys) & set(owned(plan, member))


def test_processes_sharing_a_data_directory_hold_no_standbys() -> None:
    # Two --processes children of one directory, and a node of its own.
    claims = {
        "a": MemberClaim(url="http://a:1", standby_replicas=1, holds_standbys=False),
        "b": MemberClaim(url="http://a:2", standby_replicas=1, holds_standbys=False),
        "c": MemberClaim(url="http://c", standby_replicas=1),
    }
    plan = plan_cluster(claims, range(12))
    assert plan["a"].standbys == plan["b"].standbys == []
    assert plan["c"].standbys == sorted(owned(plan, "a") + owned(plan, "b"))


def test_a_member_with_another_cluster_secret_is_refused_by_the_running_cluster() -> None:
    """Found by a trial: a node started with a mistyped secret took half the partitions,
    and every request for their owners then failed (the others refused its forwards, it
    refused theirs)."""
    good, typo = secret_tag("s3cret"), secret_tag("s3cert")
    running = {
        "a": MemberClaim(url="http://a", owned=list(range(12)), secret_tag=good),
        "b": MemberClaim(url="http://b", secret_tag=typo),
        "w": MemberClaim(url="", secret_tag=""),  # a `prme project` worker serves nothing
    }
    assert refused_members(running) == {"b"}
    # A cluster starting together: the secret most members share.
    fresh = {m: MemberClaim(url=f"http://{m}", secret_tag=good) for m in ("a", "c")}
    fresh["b"] = MemberClaim(url="http://b", secret_tag="")
    assert refused_members(fresh) == {"b"}
    # One against one, nothing owned: nobody can tell which is right; nobody is refused.
    assert refused_members({"a": fresh["a"], "b": fresh["b"]}) == set()
    assert refused_members({m: MemberClaim(url=f"http://{m}") for m in "ab"}) == set()


def test_the_assignor_gives_a_refused_member_nothing_and_names_it_in_the_map() -> None:
    good, typo = secret_tag("s3cret"), secret_tag("s3cert")
    claims = {
        "a": MemberClaim(url="http://a", owned=[0, 1, 2, 3], secret_tag=good),
        "b": MemberClaim(url="http://b", owned=[4, 5, 6, 7], secret_tag=good),
        "c": MemberClaim(url="http://c", secret_tag=typo, warm={8: 100}),
    }
    maps: list[ClusterMap] = []
    assignor = ClusterAssignor("t", lambda: claims["a"], maps.append, standby_replicas=1)
    cluster = ClusterMetadata()
    cluster.partitions_for_topic = lambda topic: set(range(8))  # type: ignore[method-assign]
    members = {
        m: ConsumerProtocolMemberMetadata(0, ["t"], msgspec.json.encode(c))
        for m, c in claims.items()
    }
    assignment = assignor.assign(cluster, members)
    assert assignment["c"].assignment == [("t", [])]
    assignor.on_assignment(assignment["c"])
    [handed] = maps
    assert handed.refused == ["http://c"]
    refused = handed.member("http://c")
    assert refused is not None and refused.partitions == [] and refused.standbys == []
    assert sorted(p for m in handed.members for p in m.partitions) == list(range(8))
    assert all(handed.owner(p) in ("http://a", "http://b") for p in range(8))
    assert secret_tag(None) == "" and len(good) == 32 and "s3cret" not in good


def test_of_members_advertising_one_url_the_one_that_owned_partitions_keeps_it() -> None:
    claims = {
        "m1": MemberClaim(url="http://a", instance="new"),
        "m2": MemberClaim(url="http://a", owned=[0, 1], instance="running"),
        "m3": MemberClaim(url="http://b", owned=[2, 3], instance="b"),
        "w1": MemberClaim(url=""),  # workers share the empty URL and are never duplicates
        "w2": MemberClaim(url=""),
    }
    assert duplicate_members(claims) == {"m1"}
    fresh = {m: MemberClaim(url="http://a", instance=m) for m in ("z", "y", "x")}
    assert duplicate_members(fresh) == {"y", "z"}  # none owned anything: first member id
    # the node whose URL reaches it wins over the careless one that took its partitions
    # while it was down (found by a cluster trial: restarting the right node refused it)
    restarted = {
        "careless": MemberClaim(url="http://a", owned=[0, 1, 2], instance="c"),
        "right": MemberClaim(url="http://a", reaches_url=True, instance="r"),
    }
    assert duplicate_members(restarted) == {"careless"}
    maps: list[ClusterMap] = []
    assignor = ClusterAssignor("t", lambda: claims["m2"], maps.append)
    cluster = ClusterMetadata()
    cluster.partitions_for_topic = lambda topic: set(range(4))  # type: ignore[method-assign]
    members = {
        m: ConsumerProtocolMemberMetadata(0, ["t"], msgspec.json.encode(c))
        for m, c in claims.items()
        if c.url
    }
    assignment = assignor.assign(cluster, members)
    assert assignment["m1"].assignment == [("t", [])]
    assignor.on_assignment(assignment["m1"])
    [handed] = maps
    assert handed.duplicates == {"new": "http://a"}
    assert [m.url for m in handed.members].count("http://a") == 1
    kept = handed.member("http://a")
    assert kept is not None and kept.partitions == [0, 1]
    assert sorted(p for m in handed.members for p in m.partitions) == [0, 1, 2, 3]


def test_standbys_spread_over_every_node_when_one_joined_last_without_copies() -> None:
    """Found by a cluster trial: after a rolling restart of three nodes with one standby
    each, the node that joined last held no standbys in 5 of 5 maps (the most caught-up
    copy came first), and killing node 1 then made node 3 take two partitions cold."""
    claims = {
        "n1": MemberClaim(
            url="http://n1",
            owned=[0, 1, 4, 7],
            warm=dict.fromkeys([0, 1, 4, 7, 2, 3, 5, 6, 8, 10], 500),
        ),
        "n2": MemberClaim(
            url="http://n2",
            owned=[2, 3, 5, 6],
            warm=dict.fromkeys([2, 3, 5, 6, 0, 1, 4, 7, 9, 11], 500),
        ),
        "n3": MemberClaim(url="http://n3", owned=[8, 9, 10, 11]),
    }
    plan = plan_cluster(claims, range(12), standby_replicas=1)
    assert [owned(plan, m) for m in plan] == [[0, 1, 4, 7], [2, 3, 5, 6], [8, 9, 10, 11]]
    assert [len(plan[m].standbys) for m in plan] == [4, 4, 4], plan
    for owner in plan:  # whichever node dies, each survivor takes its share from standbys
        backed = [
            sum(p in plan[m].standbys for p in plan[owner].partitions) for m in plan if m != owner
        ]
        assert backed == [2, 2], (owner, plan)
    # the copies already warm stay where they are as far as the spread allows
    assert set(plan["n1"].standbys) <= set(claims["n1"].warm)
    assert set(plan["n2"].standbys) <= set(claims["n2"].warm)
    # n1 dies: n2 and n3 share its partitions, every one of them from a standby
    survivors = {
        m: MemberClaim(
            url=claims[m].url, owned=owned(plan, m), warm=dict.fromkeys(plan[m].standbys, 900)
        )
        for m in ("n2", "n3")
    }
    after = plan_cluster(survivors, range(12), standby_replicas=1)
    for m in survivors:
        taken = set(owned(after, m)) - set(owned(plan, m))
        assert taken <= set(plan[m].standbys), (m, plan, after)


def test_standby_counts_stay_within_one_for_uneven_shapes() -> None:
    for nodes, partitions, replicas in [(3, 12, 2), (4, 10, 1), (5, 12, 2), (2, 7, 1), (4, 13, 3)]:
        names = [f"m{i}" for i in range(nodes)]
        # the first member held everything before the others joined
        claims = {m: MemberClaim(url=f"http://{m}") for m in names}
        claims[names[0]] = MemberClaim(
            url="http://m0", owned=list(range(partitions)), warm=dict.fromkeys(range(partitions), 9)
        )
        plan = plan_cluster(claims, range(partitions), standby_replicas=replicas)
        counts = [len(plan[m].standbys) for m in names]
        assert max(counts) - min(counts) <= 1, (nodes, partitions, replicas, plan)
        for p in range(partitions):
            holders = [m for m in names if p in plan[m].standbys]
            assert len(holders) == min(replicas, nodes - 1), (p, plan)
            assert all(p not in owned(plan, m) for m in holders)


def assign_topics(
    leader: str, claims: dict[str, MemberClaim], topics: dict[str, str]
) -> tuple[dict, ClusterMap]:
    """The assignment ``leader`` hands out when member m subscribes to ``topics[m]``
    (prme.events has 12 partitions, trialb.other 8)."""
    maps: list[ClusterMap] = []
    assignor = ClusterAssignor(topics[leader], lambda: claims[leader], maps.append)
    cluster = ClusterMetadata()
    sizes = {"prme.events": 12, "trialb.other": 8}
    cluster.partitions_for_topic = lambda topic: set(range(sizes[topic]))  # type: ignore[method-assign]
    members = {
        m: ConsumerProtocolMemberMetadata(0, [topics[m]], msgspec.json.encode(c))
        for m, c in claims.items()
    }
    assignment = assignor.assign(cluster, members)
    for member, handed in assignment.items():  # aiokafka's own check on each member
        assert {t for t, _ in handed.assignment} <= {topics[member]}, (member, handed)
    assignor.on_assignment(assignment[leader])
    return {m: a.assignment for m, a in assignment.items()}, maps[0]


def test_a_member_subscribed_to_another_topic_gets_nothing_and_is_named() -> None:
    """Found by an operator trial: a fourth node started with PRME_LOG__TOPIC=trialb.other
    in the group of three on prme.events was assigned partitions of prme.events and died
    (aiokafka: "Received an assignment for unsubscribed topic"), costing the others two
    rebalances; started first, its topic's partitions went to the next node, which died."""
    topics = {"a": "prme.events", "b": "prme.events", "c": "prme.events", "d": "trialb.other"}
    claims = {
        "a": MemberClaim(url="http://a", owned=[0, 1, 2, 3], instance="a"),
        "b": MemberClaim(url="http://b", owned=[4, 5, 6, 7], instance="b"),
        "c": MemberClaim(url="http://c", owned=[8, 9, 10, 11], instance="c"),
        "d": MemberClaim(url="http://d", instance="d"),
    }
    for leader in topics:  # whichever member leads, the group reads the majority's topic
        assignment, handed = assign_topics(leader, claims, topics)
        assert assignment["d"] == []
        assert assignment["a"] == [("prme.events", [0, 1, 2, 3])]
        assert handed.topic == "prme.events" and handed.partitions == 12
        assert handed.other_topic == [
            TopicRefused(url="http://d", instance="d", topic="trialb.other")
        ]
        assert handed.member("http://d") is None
        assert sorted(p for m in handed.members for p in m.partitions) == list(range(12))
    # Started first: one against one, the topic of the member that owned partitions.
    first = {
        "d": MemberClaim(url="http://d", owned=list(range(8)), instance="d"),
        "a": MemberClaim(url="http://a", instance="a"),
    }
    for leader in first:
        assignment, handed = assign_topics(leader, first, topics)
        assert assignment["a"] == [] and handed.topic == "trialb.other"
        assert [r.url for r in handed.other_topic] == ["http://a"]
    # A second node on prme.events: the group follows the most members.
    first["b"] = MemberClaim(url="http://b", instance="b")
    assignment, handed = assign_topics("d", first, topics)
    assert assignment["d"] == [] and handed.topic == "prme.events"
    assert sorted(len(p) for [(_, p)] in (assignment["a"], assignment["b"])) == [6, 6]
    assert "it reads the topic 'trialb.other'" in other_topic_refusal("trialb.other", handed)
    assert "'prme.events'" in other_topic_refusal("trialb.other", handed)


def _scaling_out(**limits: int) -> dict[str, MemberClaim]:
    """a owns and serves every partition, 50,000 records applied in each; b has just
    joined."""
    return {
        "a": MemberClaim(
            url="http://a",
            owned=list(range(6)),
            serving=list(range(6)),
            warm=dict.fromkeys(range(6), 50_000),
            warms_up=True,
            **limits,
        ),
        "b": MemberClaim(url="http://b", warms_up=True, **limits),
    }


def test_a_partition_whose_new_owner_is_cold_stays_with_its_owner_while_a_copy_warms_up() -> None:
    plan = plan_cluster(
        _scaling_out(max_warmup_replicas=2, acceptable_recovery_lag=10_000), range(6)
    )
    assert owned(plan, "a") == list(range(6))  # a keeps serving all of them
    assert owned(plan, "b") == []
    assert plan["b"].warmups == [3, 4]  # the first two the balanced plan gave b
    assert set(plan["b"].warmups) <= set(plan["b"].standbys)
    assert plan["a"].warmups == []


def test_caught_up_warm_ups_move_and_the_next_ones_start() -> None:
    claims = _scaling_out(max_warmup_replicas=2, acceptable_recovery_lag=10_000)
    # b's warm-ups of 3 and 4 are within the acceptable lag of a's copies
    claims["b"] = msgspec.structs.replace(claims["b"], warm={3: 45_000, 4: 50_000})
    plan = plan_cluster(claims, range(6))
    assert owned(plan, "b") == [3, 4]
    assert owned(plan, "a") == [0, 1, 2, 5]
    assert plan["b"].warmups == [5]


def test_copies_within_the_acceptable_lag_move_at_once() -> None:
    claims = _scaling_out(max_warmup_replicas=2, acceptable_recovery_lag=60_000)
    plan = plan_cluster(claims, range(6))
    assert sorted(len(owned(plan, m)) for m in plan) == [3, 3]
    assert plan["b"].warmups == []


def test_no_warm_ups_moves_cold_partitions_at_once() -> None:
    plan = plan_cluster(_scaling_out(max_warmup_replicas=0, acceptable_recovery_lag=10), range(6))
    assert sorted(len(owned(plan, m)) for m in plan) == [3, 3]
    assert all(not member.warmups for member in plan.values())


def test_a_dead_owners_partitions_move_cold_without_waiting() -> None:
    # the owner of 3..5 left: nobody serves them, so they go to b however cold it is
    claims = {
        "a": MemberClaim(
            url="http://a",
            owned=[0, 1, 2],
            warm=dict.fromkeys(range(3), 50_000),
            max_warmup_replicas=2,
        ),
        "b": MemberClaim(url="http://b", max_warmup_replicas=2),
    }
    plan = plan_cluster(claims, range(6))
    assert owned(plan, "b") == [3, 4, 5]
    assert plan["b"].warmups == []


def test_a_node_that_can_keep_no_copy_takes_its_share_at_once() -> None:
    for joiner in (
        MemberClaim(url="http://b", holds_standbys=False, warms_up=True, max_warmup_replicas=2),
        MemberClaim(url="", warms_up=True, max_warmup_replicas=2),  # a prme project worker
        MemberClaim(url="http://b", max_warmup_replicas=2),  # a node from before warm-ups
    ):
        claims = {**_scaling_out(max_warmup_replicas=2, acceptable_recovery_lag=10), "b": joiner}
        plan = plan_cluster(claims, range(6))
        assert sorted(len(owned(plan, m)) for m in plan) == [3, 3]
        assert plan["b"].warmups == []


def test_a_partition_its_owner_is_still_replaying_is_not_held_for_it() -> None:
    # a restarted, took its partitions back cold and replays them: b's copies are as good
    claims = _scaling_out(max_warmup_replicas=2, acceptable_recovery_lag=10)
    claims["a"] = msgspec.structs.replace(claims["a"], serving=[0, 1, 2])
    plan = plan_cluster(claims, range(6))
    assert sorted(len(owned(plan, m)) for m in plan) == [3, 3]
    assert plan["b"].warmups == []


def test_a_warm_up_that_read_to_the_log_end_moves_though_the_owner_ran_ahead() -> None:
    """Found by a review: under steady writes the owner's claim, taken a moment after
    the warm-up's, was always more than the acceptable lag ahead, so the same warm-ups
    came back plan after plan (a rebalance every 5 s, and the joiner never took them)."""
    claims = _scaling_out(max_warmup_replicas=2, acceptable_recovery_lag=1_000)
    claims["b"] = msgspec.structs.replace(
        claims["b"], warm={3: 48_000, 4: 48_000}, caught_up=[3, 4]
    )
    plan = plan_cluster(claims, range(6))
    assert owned(plan, "b") == [3, 4]
    assert plan["b"].warmups == [5]
