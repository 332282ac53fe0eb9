"""PRME: long-term memory for LLM agents, event-sourced on a log."""

__version__ = "0.1.0"
