"""Seed-compatible import paths for storage components."""
