"""The history read model: clear, replace and delete applied per (owner, session, scope)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from prme.projectors.stores.history import HistoryModel
from prme.schemas.records import Message

from .record_builders import AT, archived, cleared, deleted, erased, msg, projected, replaced


def texts(
    history: HistoryModel,
    owner: str = "alice",
    session: str = "s1",
    scope: str = "default",
    limit: int | None = None,
) -> list[str]:
    return [str(m.content) for m in history.messages(owner, session, scope, limit=limit)]


@pytest.fixture
def history(tmp_path: Path) -> Iterator[HistoryModel]:
    with HistoryModel(tmp_path / "history.sqlite") as model:
        yield model


def test_messages_come_back_exactly_and_in_order(history: HistoryModel) -> None:
    rich = Message(
        event_id="e2",
        owner="alice",
        session_id="s1",
        recorded_at=AT,
        role="assistant",
        content=[{"type": "text", "text": "hi"}],
        tool_calls=[{"id": "t1", "name": "search", "args": {"q": "x"}}],
        fields={"type": "ai", "response_metadata": {"model": "m"}},
        metadata={"k": [1, 2]},
    )
    history.apply(projected([msg("e1", "hello"), rich, msg("e3", "bye")]))
    assert history.messages("alice", "s1", "default") == [
        msg("e1", "hello"),
        rich,
        msg("e3", "bye"),
    ]


def test_limit_returns_the_last_messages(history: HistoryModel) -> None:
    history.apply(projected([msg(f"e{i}", f"m{i}") for i in range(5)]))
    assert texts(history, limit=2) == ["m3", "m4"]
    assert texts(history, limit=10) == ["m0", "m1", "m2", "m3", "m4"]
    assert texts(history, limit=0) == []


def test_clear_hides_earlier_messages(history: HistoryModel) -> None:
    history.apply(projected([msg("e1", "old"), cleared("c1"), msg("e2", "new")]))
    assert texts(history) == ["new"]
    assert texts(history, limit=5) == ["new"]
    history.apply(projected([cleared("c2")], start=3))
    assert texts(history) == []


def test_replace_is_a_clear_followed_by_new_messages(history: HistoryModel) -> None:
    history.apply(projected([msg("e1", "a"), msg("e2", "b")]))
    history.apply(
        projected(
            [
                replaced("r1", 2),
                msg("e3", "x"),
                msg("e4", "y"),
            ],
            start=2,
        )
    )
    assert texts(history) == ["x", "y"]


def test_delete_removes_one_message(history: HistoryModel) -> None:
    history.apply(projected([msg("e1", "a"), msg("e2", "b"), msg("e3", "c")]))
    history.apply(
        projected(
            [deleted("d1", "e2")],
            start=3,
        )
    )
    assert texts(history) == ["a", "c"]
    assert texts(history, limit=2) == ["a", "c"]


def test_delete_of_unknown_or_foreign_target_does_nothing(history: HistoryModel) -> None:
    history.apply(projected([msg("e1", "a"), msg("b1", "bob's", owner="bob")]))
    before = history.digest()
    history.apply(
        projected(
            [
                deleted("d1", "nope"),
                deleted("d2", "b1"),
            ],
            start=2,
        )
    )
    assert history.digest() == before
    assert texts(history, owner="bob") == ["bob's"]


def test_histories_are_isolated_by_owner_session_and_exact_scope(history: HistoryModel) -> None:
    history.apply(
        projected(
            [
                msg("e1", "alice s1"),
                msg("e2", "alice s2", session="s2"),
                msg("e3", "alice work", scope="work"),
                msg("e4", "alice work/x", scope="work/x"),
                msg("e5", "bob s1", owner="bob"),
                cleared("c1", session="s2"),
            ]
        )
    )
    assert texts(history) == ["alice s1"]
    assert texts(history, session="s2") == []
    assert texts(history, scope="work") == ["alice work"]
    assert texts(history, owner="bob") == ["bob s1"]
    assert texts(history, owner="carol") == []
    assert history.sessions("alice") == [
        ("s1", "default"),
        ("s1", "work"),
        ("s1", "work/x"),
        ("s2", "default"),
    ]


def test_lifecycle_records_do_not_touch_history(history: HistoryModel) -> None:
    history.apply(projected([msg("e1", "a")]))
    before = history.digest()
    history.apply(projected([archived("a1", "mem:e1")], start=1))
    assert history.digest() == before
    assert texts(history) == ["a"]


def test_owner_erased_removes_only_that_owner(history: HistoryModel) -> None:
    history.apply(projected([msg("e1", "a"), msg("e2", "b", owner="bob")]))
    history.apply(projected([erased("x")], start=2))
    assert texts(history) == []
    assert history.sessions("alice") == []
    assert texts(history, owner="bob") == ["b"]


def test_reapplying_after_a_crash_does_not_duplicate(history: HistoryModel) -> None:
    batch = projected([msg("e1", "a"), msg("e2", "b")])
    history.apply(batch)
    digest = history.digest()
    history.apply(batch)
    history.apply(batch[1:])
    assert history.digest() == digest
    assert texts(history) == ["a", "b"]


def test_reopen_keeps_offset_and_data(tmp_path: Path) -> None:
    path = tmp_path / "history.sqlite"
    with HistoryModel(path) as model:
        model.apply(projected([msg("e1", "a"), cleared("c1"), msg("e2", "b")], start=10))
        digest = model.digest()
    with HistoryModel(path) as reopened:
        assert reopened.applied_offset() == 12
        assert reopened.digest() == digest
        assert texts(reopened) == ["b"]


def test_a_failing_batch_leaves_no_trace(history: HistoryModel) -> None:
    history.apply(projected([msg("e1", "a")]))
    before = history.digest()
    broken = Message(
        event_id="e3", owner="alice", session_id="s1", recorded_at=AT, role="user", content=object()
    )  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        history.apply(projected([msg("e2", "b"), broken], start=1))
    assert history.digest() == before
    assert history.applied_offset() == 0
    assert texts(history) == ["a"]
