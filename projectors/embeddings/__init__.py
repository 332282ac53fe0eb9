"""Embedding providers: the protocol, validation, FastEmbed, caches."""
