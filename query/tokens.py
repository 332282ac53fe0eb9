"""Token counting for bundles, with the default model's WordPiece tokenizer."""

from __future__ import annotations

import re
from pathlib import Path

from tokenizers import Tokenizer

_WORDS = re.compile(r"\w+|[^\w\s]", re.UNICODE)


class TokenCounter:
    """Counts tokens with ``tokenizer.json`` when given, else words and punctuation marks
    (an upper-bound stand-in that ``name`` reports as ``regex``)."""

    def __init__(self, tokenizer_file: Path | None = None) -> None:
        self._tokenizer: Tokenizer | None = None
        if tokenizer_file is not None and tokenizer_file.exists():
            self._tokenizer = Tokenizer.from_file(str(tokenizer_file))
            self._tokenizer.no_truncation()
            self._tokenizer.no_padding()

    @property
    def name(self) -> str:
        return "wordpiece" if self._tokenizer is not None else "regex"

    def count(self, text: str) -> int:
        if self._tokenizer is not None:
            return len(self._tokenizer.encode(text, add_special_tokens=False).ids)
        return len(_WORDS.findall(text))

    def count_many(self, texts: list[str]) -> list[int]:
        if self._tokenizer is not None:
            encodings = self._tokenizer.encode_batch(texts, add_special_tokens=False)
            return [len(e.ids) for e in encodings]
        return [self.count(t) for t in texts]
