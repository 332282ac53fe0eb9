"""Packing ranked results into a token budget."""

from __future__ import annotations

from .tokens import TokenCounter
from .types import Bundle, MemoryResult, render_line


def pack(
    results: list[MemoryResult], token_budget: int, counter: TokenCounter
) -> tuple[Bundle, list[int]]:
    """Greedy in rank order: a result that does not fit is left out and smaller later ones
    may still fit. Each result costs the tokens of its rendered line (plus a newline).
    Returns the bundle and each result's token cost."""
    costs = counter.count_many([render_line(r) + "\n" for r in results]) if results else []
    items: list[MemoryResult] = []
    omitted: list[str] = []
    used = 0
    for result, cost in zip(results, costs, strict=True):
        if used + cost <= token_budget:
            items.append(result)
            used += cost
        else:
            omitted.append(result.node_id)
    return Bundle(items=items, token_budget=token_budget, tokens_used=used, omitted=omitted), costs
