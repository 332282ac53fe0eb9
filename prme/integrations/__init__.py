"""Seed-compatible import paths for the framework adapters."""
