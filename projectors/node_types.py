"""A memory node's type from transparent cue rules (no model): the first rule that fires wins.

1. ``decision``: "decided", "decide to", "we'll go with", "going with", "let's use",
   "let's go with", "chose", "settled on", "agreed to/on", "the plan is", "final decision";
2. ``task``: "todo", "to-do", "need(s) to", "have to", "has to", "must", "remind me",
   "don't forget", "deadline", "due by/on", "action item", "follow up";
3. ``preference``: "prefer", "I like", "I love", "I enjoy", "I hate", "favorite",
   "favourite", "hate", "dislike", "can't stand", "I'd rather", "fan of", "I'm into";
4. a question (text ending with "?") is a ``note``;
5. ``fact``: a statement with "is", "are", "was", "were", "has", "have", "had", "born",
   "live(s)", "work(s)", a digit, or a month name; a non-empty ``tool`` or ``function``
   result is a ``fact`` too;
6. anything else is a ``note``.

Cues match whole words, case-insensitively.
"""

from __future__ import annotations

import re

from .model import NodeType

_DECISION = re.compile(
    r"\b(?:decided|decide to|we'll go with|we will go with|going with|let's use|let's go with|"
    r"lets use|chose|settled on|agreed to|agreed on|the plan is|final decision)\b",
    re.IGNORECASE,
)
_TASK = re.compile(
    r"\b(?:todo|to-do|needs? to|have to|has to|must|remind me|don't forget|do not forget|"
    r"deadline|due by|due on|action item|follow up)\b",
    re.IGNORECASE,
)
_PREFERENCE = re.compile(
    r"\b(?:prefers?|preferred|i like|i love|i enjoy|i hate|favou?rite|hates?|dislikes?|"
    r"can't stand|i'd rather|fan of|i'm into)\b",
    re.IGNORECASE,
)
_FACT = re.compile(
    r"\b(?:is|are|was|were|has|have|had|born|lives?|works?|january|february|march|april|"
    r"june|july|august|september|october|november|december)\b|\d",
    re.IGNORECASE,
)
_TOOL_ROLES = frozenset({"tool", "function"})
_CUE_KINDS: tuple[NodeType, ...] = ("decision", "task", "preference")


_LOWERED = tuple(re.compile(p.pattern) for p in (_DECISION, _TASK, _PREFERENCE, _FACT))
"""The cue patterns without IGNORECASE, for ASCII text already lower-cased: on ASCII text
they match exactly where the IGNORECASE ones do, about twice as fast."""

_NEEDED = (
    (
        "decid", "go with", "going with", "let's use", "lets use", "chose", "settled on",
        "agreed", "the plan is", "final decision",
    ),
    (
        "todo", "to-do", "need", "have to", "has to", "must", "remind me", "forget",
        "deadline", "due ", "action item", "follow up",
    ),
    (
        "prefer", "i like", "i love", "i enjoy", "hate", "favo", "dislike", "can't stand",
        "i'd rather", "fan of", "i'm into",
    ),
)  # fmt: skip
"""For lower-cased ASCII text: each cue of the decision, task and preference patterns
holds one of its pattern's strings, so a text holding none cannot match it and the
pattern's scan (the costly part of a classification) is skipped."""


def classify_node_type(text: str, role: str) -> NodeType:
    """The node type of a message's ``text`` said by ``role`` (rules in the module doc)."""
    normal = text.replace("’", "'")
    if normal.isascii():
        subject = normal.lower()
        for pattern, needed, kind in zip(_LOWERED[:3], _NEEDED, _CUE_KINDS, strict=True):
            if any(map(subject.__contains__, needed)) and pattern.search(subject):
                return kind
        fact = _LOWERED[3]
    else:
        subject = normal
        for pattern, kind in zip((_DECISION, _TASK, _PREFERENCE), _CUE_KINDS, strict=True):
            if pattern.search(subject):
                return kind
        fact = _FACT
    stripped = normal.strip()
    if stripped.endswith("?"):
        return "note"
    if fact.search(subject) or (role in _TOOL_ROLES and stripped):
        return "fact"
    return "note"
