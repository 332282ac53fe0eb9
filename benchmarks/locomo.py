"""Retrieval quality on LoCoMo-format conversations, through the real pipeline (JSON out).

Each conversation becomes one owner. Every turn is stored one by one, as a live agent
would (``engine.store(..., wait=False)`` with ``occurred_at`` = the session time and
``name`` = the speaker), then the benchmark waits for the last token. Each question is
asked through :class:`~prme.query.retrieve.Retriever` and scored against its evidence turns:
recall_any@k (any evidence turn in the top k) and recall_all@k, per category and overall,
with category 5 (adversarial, no answer in the conversation) reported apart.

The ablation reuses the ingested engine and changes only query-side settings (each stage
off in turn, vector-only, lexical-only, each fusion rule); ``--lexical-ablation`` ingests
a second time without context windows. The ``default`` row uses ``Settings()`` unchanged.

    python benchmarks/locomo.py ../shared/data/locomo [--out results.json] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, get_args

import msgspec

from prme.projectors.embeddings.model_assets import default_model_dir
from prme.query.engine import MemoryEngine
from prme.query.retrieve import Retriever
from prme.query.tokens import TokenCounter
from prme.schemas.config import EmbeddingSettings, QueryPrecision, Settings

KS = (1, 5, 10)
ADVERSARIAL = 5


class Turn(msgspec.Struct, frozen=True, kw_only=True):
    dia_id: str
    session: int
    speaker: str
    text: str
    occurred_at: datetime | None


class Question(msgspec.Struct, frozen=True, kw_only=True):
    question: str
    evidence: list[str]
    category: int


class Conversation(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    turns: list[Turn]
    questions: list[Question]


class Scores(msgspec.Struct, kw_only=True):
    """Hits per metric for one group of questions."""

    questions: int = 0
    any_hits: dict[int, int] = msgspec.field(default_factory=lambda: dict.fromkeys(KS, 0))
    all_hits10: int = 0

    def add(self, ranked: Sequence[str], evidence: set[str]) -> None:
        self.questions += 1
        for k in KS:
            self.any_hits[k] += bool(evidence & set(ranked[:k]))
        self.all_hits10 += evidence <= set(ranked[:10])

    def report(self) -> dict[str, Any]:
        n = max(self.questions, 1)
        row: dict[str, Any] = {"questions": self.questions}
        for k in KS:
            row[f"recall_any@{k}"] = round(self.any_hits[k] / n, 4)
        row["recall_all@10"] = round(self.all_hits10 / n, 4)
        return row


# -- loading -------------------------------------------------------------------------------


def parse_session_time(raw: str | None) -> datetime | None:
    """``"1:56 pm on 8 May, 2023"`` -> an aware UTC datetime (None when absent/unparsable)."""
    if not raw:
        return None
    for layout in ("%I:%M %p on %d %B, %Y", "%I:%M %p on %d %b, %Y"):
        try:
            return datetime.strptime(raw.strip(), layout).replace(tzinfo=UTC)
        except ValueError:
            continue
    return None


def turn_text(turn: dict[str, Any]) -> str:
    """A turn's message content: its text, and the caption of an image it shared."""
    text = str(turn.get("text", ""))
    caption = turn.get("blip_caption")
    return f"{text} [shared an image: {caption}]" if caption else text


def load_conversation(path: Path) -> Conversation:
    data = json.loads(path.read_text(encoding="utf-8"))
    sessions = sorted(
        int(key.removeprefix("session_"))
        for key, value in data.items()
        if key.startswith("session_")
        and key.removeprefix("session_").isdigit()
        and isinstance(value, list)
    )
    turns = [
        Turn(
            dia_id=str(turn["dia_id"]),
            session=number,
            speaker=str(turn["speaker"]),
            text=turn_text(turn),
            occurred_at=parse_session_time(data.get(f"session_{number}_date_time")),
        )
        for number in sessions
        for turn in data[f"session_{number}"]
    ]
    questions = [
        Question(
            question=str(qa["question"]),
            evidence=[str(e) for e in qa.get("evidence", [])],
            category=int(qa.get("category", 0)),
        )
        for qa in data.get("qa", [])
    ]
    return Conversation(name=path.stem, turns=turns, questions=questions)


def load_folder(folder: Path) -> list[Conversation]:
    files = sorted(folder.glob("*.json"))
    if not files:
        raise SystemExit(f"no LoCoMo-format *.json files in {folder}")
    return [load_conversation(path) for path in files]


# -- ingest and evaluation ----------------------------------------------------------------


def owner_of(conversation: Conversation) -> str:
    return f"locomo-{conversation.name}"


async def ingest(
    engine: MemoryEngine, conversations: Sequence[Conversation]
) -> dict[str, dict[str, str]]:
    """Store every turn one by one; returns owner -> dia_id -> node id."""
    ids: dict[str, dict[str, str]] = {}
    tokens = []
    for conversation in conversations:
        owner = owner_of(conversation)
        mapping = ids.setdefault(owner, {})
        for turn in conversation.turns:
            stored = await engine.store(
                turn.text,
                owner,
                session_id=f"session_{turn.session}",
                name=turn.speaker,
                occurred_at=turn.occurred_at,
                wait=False,
            )
            mapping[turn.dia_id] = stored.node_ids[0]
            tokens.append(stored.token)
    await engine.wait_for(tokens, timeout_s=1800)
    return ids


Search = Callable[[str, str], Awaitable[list[str]]]


async def evaluate(
    search: Search, conversations: Sequence[Conversation], ids: dict[str, dict[str, str]]
) -> dict[str, Any]:
    """recall per category, overall (category 5 apart), unmatched evidence and latency."""
    per_category: dict[int, Scores] = {}
    overall = Scores()
    adversarial = Scores()
    unmatched = 0
    skipped = 0
    latencies: list[float] = []
    for conversation in conversations:
        owner = owner_of(conversation)
        mapping = ids[owner]
        for question in conversation.questions:
            evidence = {mapping[e] for e in question.evidence if e in mapping}
            unmatched += sum(e not in mapping for e in question.evidence)
            if not evidence:
                skipped += 1
                continue
            started = time.perf_counter()
            ranked = await search(question.question, owner)
            latencies.append((time.perf_counter() - started) * 1000)
            per_category.setdefault(question.category, Scores()).add(ranked, evidence)
            (adversarial if question.category == ADVERSARIAL else overall).add(ranked, evidence)
    latencies.sort()
    return {
        "overall": overall.report(),
        "category_5": adversarial.report(),
        "per_category": {str(c): s.report() for c, s in sorted(per_category.items())},
        "unmatched_evidence_ids": unmatched,
        "questions_without_evidence": skipped,
        "latency_ms": {
            "p50": round(statistics.median(latencies), 2) if latencies else None,
            "p95": round(_percentile(latencies, 0.95), 2) if latencies else None,
        },
    }


def _percentile(sorted_values: list[float], q: float) -> float:
    index = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[index]


def retriever_search(retriever: Retriever, top_k: int = 10) -> Search:
    async def search(query: str, owner: str) -> list[str]:
        response = await retriever.retrieve(query, owner, top_k=top_k)
        return [result.node_id for result in response.results]

    return search


# -- variants ------------------------------------------------------------------------------

QUERY_VARIANTS: dict[str, dict[str, Any]] = {
    "no strip_stopwords": {"query": {"strip_stopwords": False}},
    "no temporal_cues": {"query": {"temporal_cues": False}},
    "no date_match": {"query": {"date_match": False}},
    "no time stages": {"query": {"temporal_cues": False, "date_match": False}},
    "no speaker_match": {"query": {"speaker_match": False}},
    "no strip_speakers": {"query": {"strip_speakers": False}},
    "no speaker stages": {"query": {"speaker_match": False, "strip_speakers": False}},
    "no graph": {"scoring": {"graph": False}},
    "with graph": {"scoring": {"graph": True}},
    "vector only": {
        "scoring": {"fusion": "rrf", "weights": {"vector": 1.0, "lexical": 0.0, "graph": 0.0}},
        "query": {"temporal_cues": False, "date_match": False, "speaker_match": False},
    },
    "lexical only": {
        "scoring": {"fusion": "rrf", "weights": {"vector": 0.0, "lexical": 1.0, "graph": 0.0}},
        "query": {"temporal_cues": False, "date_match": False, "speaker_match": False},
    },
    "fusion rrf": {"scoring": {"fusion": "rrf"}},
    "fusion weighted": {"scoring": {"fusion": "weighted"}},
    "fusion zscore": {"scoring": {"fusion": "zscore"}},
}
"""Query-side variants of the default settings (nested changes for ``Settings.replace``)."""

LEXICAL_VARIANTS: dict[str, dict[str, Any]] = {
    "no context windows": {"lexical": {"window_before": 0, "window_after": 0}},
}
"""Variants that change what is indexed: each needs its own ingest."""


def _counter(settings: Settings) -> TokenCounter:
    return TokenCounter(default_model_dir(settings.models_path) / "tokenizer.json")


async def run_pack(
    settings: Settings,
    conversations: Sequence[Conversation],
    variants: dict[str, dict[str, Any]],
    log: Callable[[str], None],
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Ingest into a fresh pack at ``settings.data_dir``; evaluate default, then variants."""
    counter = _counter(settings)
    async with await MemoryEngine.create(settings=settings) as engine:
        started = time.perf_counter()
        ids = await ingest(engine, conversations)
        ingest_s = time.perf_counter() - started
        turns = sum(len(c.turns) for c in conversations)
        log(f"ingested {turns} turns in {ingest_s:.1f}s")
        default = await evaluate(
            retriever_search(Retriever(engine.runner, settings, counter)), conversations, ids
        )
        default["ingest"] = {"turns": turns, "seconds": round(ingest_s, 1)}
        log(f"default: {_line(default)}")
        ablation: dict[str, Any] = {}
        for name, change in variants.items():
            retriever = Retriever(engine.runner, settings.replace(**change), counter)
            ablation[name] = await evaluate(retriever_search(retriever), conversations, ids)
            log(f"{name}: {_line(ablation[name])}")
    return default, ablation


def _line(result: dict[str, Any]) -> str:
    o = result["overall"]
    return (
        f"@1 {o['recall_any@1']:.3f} @5 {o['recall_any@5']:.3f} @10 {o['recall_any@10']:.3f} "
        f"all@10 {o['recall_all@10']:.3f} p50 {result['latency_ms']['p50']}ms "
        f"p95 {result['latency_ms']['p95']}ms"
    )


def table(default: dict[str, Any], ablation: dict[str, Any]) -> str:
    """A Markdown table: the default row, then each variant (category 5 excluded)."""
    lines = [
        "| variant | recall_any@1 | @5 | @10 | recall_all@10 | p50 ms | p95 ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, result in {"default": default, **ablation}.items():
        o = result["overall"]
        lines.append(
            f"| {name} | {o['recall_any@1']:.3f} | {o['recall_any@5']:.3f} | "
            f"{o['recall_any@10']:.3f} | {o['recall_all@10']:.3f} | "
            f"{result['latency_ms']['p50']} | {result['latency_ms']['p95']} |"
        )
    return "\n".join(lines)


def category_table(result: dict[str, Any]) -> str:
    lines = [
        "| category | questions | recall_any@1 | @5 | @10 | recall_all@10 |",
        "|---|---|---|---|---|---|",
    ]
    rows = {**result["per_category"], "overall (1-4)": result["overall"]}
    for name, row in rows.items():
        lines.append(
            f"| {name} | {row['questions']} | {row['recall_any@1']:.3f} | "
            f"{row['recall_any@5']:.3f} | {row['recall_any@10']:.3f} | "
            f"{row['recall_all@10']:.3f} |"
        )
    return "\n".join(lines)


async def benchmark(
    folder: Path,
    *,
    settings: Settings | None = None,
    variants: dict[str, dict[str, Any]] | None = None,
    lexical_variants: dict[str, dict[str, Any]] | None = None,
    work_dir: Path | None = None,
    log: Callable[[str], None] = lambda _: None,
) -> dict[str, Any]:
    """Run the benchmark on every ``*.json`` file of ``folder``; returns the JSON report."""
    conversations = load_folder(folder)
    base = settings or Settings()
    variants = QUERY_VARIANTS if variants is None else variants
    lexical_variants = lexical_variants or {}
    with tempfile.TemporaryDirectory(prefix="prme-locomo-", dir=work_dir) as tmp:
        default, ablation = await run_pack(
            base.replace(data_dir=str(Path(tmp) / "default")), conversations, variants, log
        )
        for name, change in lexical_variants.items():
            changed = base.replace(data_dir=str(Path(tmp) / f"lexical-{len(ablation)}"), **change)
            ablation[name], _ = await run_pack(changed, conversations, {}, log)
    return {
        "dataset": {
            "folder": str(folder),
            "conversations": [c.name for c in conversations],
            "turns": sum(len(c.turns) for c in conversations),
            "questions": sum(len(c.questions) for c in conversations),
        },
        "settings": {
            "scoring": msgspec.to_builtins(base.scoring),
            "lexical": msgspec.to_builtins(base.lexical),
            "query": msgspec.to_builtins(base.query),
            "embedding_model": base.embedding.model,
            "query_precision": base.embedding.query_precision,
        },
        "default": default,
        "ablation": ablation,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="a folder of LoCoMo-format *.json files")
    parser.add_argument("--out", type=Path, help="write the JSON report here too")
    parser.add_argument("--quick", action="store_true", help="default settings only")
    parser.add_argument(
        "--lexical-ablation", action="store_true", help="also ingest without context windows"
    )
    parser.add_argument("--work-dir", type=Path, help="where the temporary pack lives")
    parser.add_argument(
        "--query-precision",
        choices=get_args(QueryPrecision),
        default=EmbeddingSettings().query_precision,
        help="how the default model encodes queries (embedding.query_precision)",
    )
    arguments = parser.parse_args(argv)
    settings = Settings().replace(embedding={"query_precision": arguments.query_precision})

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    report = asyncio.run(
        benchmark(
            arguments.folder,
            settings=settings,
            variants={} if arguments.quick else QUERY_VARIANTS,
            lexical_variants=LEXICAL_VARIANTS if arguments.lexical_ablation else {},
            work_dir=arguments.work_dir,
            log=log,
        )
    )
    log(category_table(report["default"]))
    log(table(report["default"], report["ablation"]))
    text = json.dumps(report, indent=2)
    if arguments.out:
        arguments.out.write_text(text + "\n", encoding="utf-8")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
