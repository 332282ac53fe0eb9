"""Replication of the topics PRME creates follows the cluster unless configured."""

from __future__ import annotations

import pytest

from prme.producers.kafka_topics import Replication, derive_replication
from prme.schemas.errors import TransportError


@pytest.mark.parametrize(
    ("brokers", "expected"),
    [
        (1, Replication(1, 1)),
        (2, Replication(2, 1)),
        (3, Replication(3, 2)),
        (5, Replication(3, 2)),
    ],
)
def test_replication_derives_from_the_cluster_size(brokers: int, expected: Replication) -> None:
    assert derive_replication(brokers) == expected


def test_configured_replication_wins_and_is_checked() -> None:
    assert derive_replication(3, factor=2) == Replication(2, 1)
    assert derive_replication(3, min_insync=3) == Replication(3, 3)
    with pytest.raises(TransportError, match="min.insync.replicas 3"):
        derive_replication(3, factor=2, min_insync=3)
    with pytest.raises(TransportError, match="no brokers"):
        derive_replication(0)
