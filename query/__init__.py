"""Retrieval: channels, fusion, bundles, receipts, the engine, the HTTP service."""
