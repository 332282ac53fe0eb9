"""The LangChain code block of docs/FRAMEWORK-INTEGRATIONS.md, run as written: embedded
with the default model, and in service mode against ``prme serve`` (directory -> url).

It imports no framework at module level: the no-framework import test runs without them."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from pathlib import Path

import pytest

from .service_harness import SERVICE_KEY, run_example


@pytest.mark.model
def test_langchain_seed_runs_as_written_with_the_default_model(
    default_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("langchain_core")
    monkeypatch.chdir(tmp_path)

    from langchain_core.messages import AIMessage, HumanMessage

    from prme.integrations.langchain import PRMEChatMessageHistory, PRMERetriever

    retriever = PRMERetriever(
        directory="./memory",
        user_id="alice",
        top_k=5,
        token_budget=4096,
    )
    documents = retriever.invoke("What has Alice decided?")

    history = PRMEChatMessageHistory(
        directory="./memory",
        user_id="alice",
        session_id="support-42",
    )
    history.add_messages(
        [
            HumanMessage(content="Use dark mode."),
            AIMessage(content="I will remember that."),
        ]
    )
    history.clear()
    assert history.messages == []

    retriever.close()
    history.close()

    # Beyond the seed: the first query met an empty pack, and the cleared messages are
    # still memories the default model finds.
    assert documents == []
    again = PRMERetriever(directory="./memory", user_id="alice", top_k=5)
    try:
        engine = again.memory_client.engine
        assert engine is not None and engine.provider.dimension == 384
        found = again.invoke("Does Alice want dark mode?")
    finally:
        again.close()
    assert found[0].page_content == "Use dark mode."
    assert found[0].metadata["semantic_relevance"] > 0.3


def test_langchain_seed_runs_in_service_mode(service_url: str) -> None:
    pytest.importorskip("langchain_core")
    from langchain_core.messages import AIMessage, HumanMessage

    from prme.integrations.langchain import PRMEChatMessageHistory, PRMERetriever

    retriever = PRMERetriever(
        url=service_url,
        api_key=SERVICE_KEY,
        user_id="alice",
        top_k=5,
        token_budget=4096,
    )
    documents = retriever.invoke("What has Alice decided?")

    history = PRMEChatMessageHistory(
        url=service_url,
        api_key=SERVICE_KEY,
        user_id="alice",
        session_id="support-42",
    )
    history.add_messages(
        [
            HumanMessage(content="Use dark mode."),
            AIMessage(content="I will remember that."),
        ]
    )
    assert history.messages == [
        HumanMessage(content="Use dark mode."),
        AIMessage(content="I will remember that."),
    ]
    history.clear()
    assert history.messages == []

    assert documents == []
    found = retriever.invoke("dark mode")
    assert found[0].page_content == "Use dark mode."
    assert found[0].metadata["event_id"]

    retriever.close()
    history.close()


def test_service_mode_key_of_another_owner_is_refused(service_url: str) -> None:
    pytest.importorskip("langchain_core")
    from prme.integrations.langchain import PRMEChatMessageHistory
    from prme.schemas.errors import Forbidden

    bobs = PRMEChatMessageHistory(
        url=service_url, api_key=SERVICE_KEY, user_id="bob", session_id="s"
    )
    with contextlib.closing(bobs), pytest.raises(Forbidden):
        _ = bobs.messages


def test_every_message_class_round_trips_in_service_mode(service_url: str) -> None:
    pytest.importorskip("langchain_core")
    from prme.integrations.langchain import PRMEChatMessageHistory
    from tests.test_adapter_langchain import _every_message

    history = PRMEChatMessageHistory(
        url=service_url, api_key=SERVICE_KEY, user_id="alice", session_id="s"
    )
    originals = _every_message()
    with contextlib.closing(history):
        history.add_messages(originals)
        restored = history.messages
    assert [type(m) for m in restored] == [type(m) for m in originals]
    assert restored == originals


@pytest.mark.model
def test_langchain_example_runs(
    default_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("langchain_core")
    out = run_example("langchain_example", tmp_path, capsys)
    assert "after clear: 0 messages" in out
    assert "window seat" in out.split("after clear")[1]


def test_importing_prme_needs_no_framework() -> None:
    blocker = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('langchain_core', 'llama_index'):\n"
        "            raise ImportError('blocked ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import prme, prme.integrations, prme.adapters\n"
        "import prme.adapters.messages, prme.adapters.connection, prme.adapters.results\n"
        "try:\n"
        "    import prme.integrations.langchain\n"
        "except ImportError as error:\n"
        "    print('extra needed:', error)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", blocker], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    assert "extra needed: blocked langchain_core" in result.stdout
