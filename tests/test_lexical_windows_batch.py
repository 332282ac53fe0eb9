"""``WindowStore.documents_for`` (a few queries per sequence) gives exactly what the
per-node rule gives (``affected`` + ``document`` for each node), whatever the mix of
appends, boundaries, deletes and state changes, and whatever the window sizes."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from prme.projectors.stores.lexical_windows import SequencePoint, WindowStore
from tests.record_builders import msg, projected


@pytest.mark.parametrize(("before", "after"), [(2, 1), (0, 1), (3, 0), (1, 4), (0, 0)])
@pytest.mark.parametrize("seed", [1, 2])
def test_batched_documents_equal_the_per_node_rule(
    tmp_path: Path, seed: int, before: int, after: int
) -> None:
    rng = random.Random(seed)
    store = WindowStore(tmp_path / "w.sqlite3", window_before=before, window_after=after)
    known: list[tuple[str, str, str]] = []  # node id, owner, session
    offset = 0
    try:
        for _ in range(30):
            changed: set[str] = set()
            points: list[SequencePoint] = []
            for _ in range(rng.randint(1, 40)):
                offset += rng.choice((1, 1, 1, 5000))  # now and then a gap past a cluster
                owner, session = rng.choice(("a", "b")), rng.choice(("s1", "s2", "s3"))
                roll = rng.random()
                if roll < 0.65 or not known:
                    node = projected([msg(f"e{offset}", f"text {offset}", owner, session)])[0]
                    assert node.node is not None
                    point, _created = store.add_message(offset, node.node)
                    points.append(point)
                    changed.add(node.node.node_id)
                    known.append((node.node.node_id, owner, session))
                elif roll < 0.75:
                    points.append(store.add_boundary(owner, session, "default", offset))
                elif roll < 0.88:
                    node_id, node_owner, _ = rng.choice(known)
                    removed = store.remove_message(node_owner, node_id)
                    if removed is not None:
                        points.append(removed)
                        changed.add(node_id)
                else:
                    node_id, node_owner, _ = rng.choice(known)
                    if store.set_state(node_owner, node_id, rng.choice(("archived", "active"))):
                        changed.add(node_id)
            if rng.random() < 0.1:
                changed.add("mem:unknown")
            expected = {
                node_id: store.document(node_id) for node_id in changed | store.affected(points)
            }
            assert store.documents_for(changed, points) == expected
            store.commit()
    finally:
        store.close()
