"""``from prme.integrations.langchain import PRMEChatMessageHistory, PRMERetriever``
(needs the ``langchain`` extra: ``pip install "prme-memory[langchain]"``)."""

from prme.adapters.langchain import PRMEChatMessageHistory, PRMERetriever

__all__ = ["PRMEChatMessageHistory", "PRMERetriever"]
