"""``from prme.integrations.llamaindex import PRMEChatStore, PRMERetriever``
(needs the ``llamaindex`` extra: ``pip install "prme-memory[llamaindex]"``)."""

from prme.adapters.llamaindex import PRMEChatStore, PRMERetriever

__all__ = ["PRMEChatStore", "PRMERetriever"]
