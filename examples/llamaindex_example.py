"""PRME as LlamaIndex memory: a chat store keyed "user_id:session_id" and a retriever
returning NodeWithScore.

    pip install "prme-memory[llamaindex]"
    prme models pull            # once: assembles the default embedding model
    python examples/llamaindex_example.py [DIRECTORY]
"""

from __future__ import annotations

import sys
import tempfile

from llama_index.core.llms import ChatMessage

from prme.integrations.llamaindex import PRMEChatStore, PRMERetriever


def main(directory: str) -> None:
    key = "alice:support-42"
    with (
        PRMEChatStore(directory=directory) as chat,
        PRMERetriever(directory=directory, user_id="alice", top_k=3) as retriever,
    ):
        chat.set_messages(
            key,
            [
                ChatMessage(role="user", content="I prefer email over phone calls."),
                ChatMessage(role="assistant", content="Noted: email it is."),
                ChatMessage(role="user", content="My order number is 7781."),
            ],
        )
        removed = chat.delete_message(key, 2)
        print(f"removed from the chat: {removed}")
        print("chat:", [f"{m.role.value}: {m.content}" for m in chat.get_messages(key)])
        print("keys written here:", chat.get_keys())

        for scored in retriever.retrieve("How should we contact Alice?"):
            print(f"  {scored.score:.4f} {scored.node.text!r} ({scored.node.node_id})")


if __name__ == "__main__":
    with tempfile.TemporaryDirectory(prefix="prme-llamaindex-") as scratch:
        main(sys.argv[1] if len(sys.argv) > 1 else scratch)
