"""The LlamaIndex code block of docs/FRAMEWORK-INTEGRATIONS.md, run as written: embedded
with the default model, and in service mode against ``prme serve`` (directory -> url)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("llama_index.core")

from tests.service_harness import SERVICE_KEY, run_example  # noqa: E402


@pytest.mark.model
def test_llamaindex_seed_runs_as_written_with_the_default_model(
    default_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)

    from llama_index.core.llms import ChatMessage

    from prme.integrations.llamaindex import PRMEChatStore, PRMERetriever

    retriever = PRMERetriever(directory="./memory", user_id="alice", top_k=5)
    nodes = retriever.retrieve("What does Alice prefer?")

    chat = PRMEChatStore(directory="./memory")
    key = "alice:support-42"
    chat.set_messages(key, [ChatMessage(role="user", content="Use dark mode.")])
    chat.add_message(key, ChatMessage(role="assistant", content="Understood."))
    removed = chat.delete_last_message(key)
    assert removed is not None

    retriever.close()
    chat.close()

    # Beyond the seed: what was removed, what remains, and what the default model finds.
    assert nodes == []
    assert removed == ChatMessage(role="assistant", content="Understood.")
    again = PRMERetriever(directory="./memory", user_id="alice", top_k=5)
    store = PRMEChatStore(directory="./memory")
    try:
        engine = again.memory_client.engine
        assert engine is not None and engine.provider.dimension == 384
        assert store.get_messages(key) == [ChatMessage(role="user", content="Use dark mode.")]
        found = again.retrieve("Does Alice want dark mode?")
    finally:
        again.close()
        store.close()
    assert found[0].node.text == "Use dark mode."


def test_llamaindex_seed_runs_in_service_mode(service_url: str) -> None:
    from llama_index.core.llms import ChatMessage

    from prme.integrations.llamaindex import PRMEChatStore, PRMERetriever

    retriever = PRMERetriever(url=service_url, api_key=SERVICE_KEY, user_id="alice", top_k=5)
    nodes = retriever.retrieve("What does Alice prefer?")

    chat = PRMEChatStore(url=service_url, api_key=SERVICE_KEY)
    key = "alice:support-42"
    chat.set_messages(
        key, [ChatMessage(role="user", content="Use dark mode.", additional_kwargs={"a": [1]})]
    )
    chat.add_message(key, ChatMessage(role="assistant", content="Understood."))
    removed = chat.delete_last_message(key)
    assert removed == ChatMessage(role="assistant", content="Understood.")
    assert chat.get_messages(key) == [
        ChatMessage(role="user", content="Use dark mode.", additional_kwargs={"a": [1]})
    ]
    assert chat.get_keys() == [key]

    assert nodes == []
    found = retriever.retrieve("dark mode")
    assert found[0].node.text == "Use dark mode."

    retriever.close()
    chat.close()


@pytest.mark.model
def test_llamaindex_example_runs(
    default_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = run_example("llamaindex_example", tmp_path, capsys)
    assert "removed from the chat: user: My order number is 7781." in out
    assert "keys written here: ['alice:support-42']" in out
    assert "'I prefer email over phone calls.'" in out
