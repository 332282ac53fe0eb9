"""``from prme.integrations.llamaindex import PRMEChatStore, PRMERetriever``
(needs the ``llamaindex`` extra: ``pip install "prme[llamaindex]"``)."""

from prme.adapters.llamaindex import PRMEChatStore, PRMERetriever

__all__ = ["PRMEChatStore", "PRMERetriever"]
