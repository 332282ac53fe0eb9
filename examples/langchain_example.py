"""PRME as LangChain memory: a chat history that survives restarts and a retriever over
everything the user said.

    pip install "prme-memory[langchain]"
    prme models pull            # once: assembles the default embedding model
    python examples/langchain_example.py [DIRECTORY]
"""

from __future__ import annotations

import sys
import tempfile

from langchain_core.messages import AIMessage, HumanMessage, ToolMessage

from prme.integrations.langchain import PRMEChatMessageHistory, PRMERetriever


def main(directory: str) -> None:
    with (
        PRMEChatMessageHistory(directory=directory, user_id="alice", session_id="trip") as history,
        PRMERetriever(directory=directory, user_id="alice", top_k=3, min_score=0.2) as retriever,
    ):
        history.add_messages(
            [
                HumanMessage("I decided to fly to Lisbon in May, window seat please."),
                AIMessage(
                    "",
                    tool_calls=[{"name": "search_flights", "args": {"to": "LIS"}, "id": "c1"}],
                ),
                ToolMessage("3 flights found", tool_call_id="c1", artifact={"count": 3}),
                AIMessage("Booked the 9:40 flight with a window seat."),
            ]
        )
        print("history:")
        for message in history.messages:
            print(f"  {message.type:>5}: {message.content or message.tool_calls}")

        # Clearing the chat appends a marker; the memories stay retrievable.
        history.clear()
        print(f"after clear: {len(history.messages)} messages")

        for document in retriever.invoke("Where is Alice travelling, and which seat?"):
            meta = document.metadata
            print(
                f"  {meta['score']:.4f} cos={meta['semantic_relevance']} "
                f"{document.page_content!r} ({meta['node_id']})"
            )


if __name__ == "__main__":
    with tempfile.TemporaryDirectory(prefix="prme-langchain-") as scratch:
        main(sys.argv[1] if len(sys.argv) > 1 else scratch)
