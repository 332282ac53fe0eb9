"""The LoCoMo benchmark runs end to end on a tiny LoCoMo-format file (not the real data)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from prme.projectors.embeddings.model_assets import default_model_dir
from prme.schemas.config import Settings

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = Path(__file__).parent / "data" / "locomo_tiny"

pytestmark = pytest.mark.model


def _benchmark_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "locomo_benchmark", ROOT / "benchmarks" / "locomo.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def locomo() -> ModuleType:
    if not (default_model_dir(Settings().models_path) / "model.onnx").exists():
        pytest.fail("the default model is missing: run `prme models pull`", pytrace=False)
    return _benchmark_module()


def test_loader_reads_sessions_times_captions_and_questions(locomo: ModuleType) -> None:
    (conversation,) = locomo.load_folder(FIXTURE)
    assert len(conversation.turns) == 18
    assert [t.session for t in conversation.turns[::6]] == [1, 2, 3]
    first = conversation.turns[0]
    assert first.occurred_at.isoformat() == "2023-03-03T10:00:00+00:00"
    assert conversation.turns[4].text.endswith("[shared an image: a photo of a cat on a laptop]")
    assert [q.category for q in conversation.questions] == [1, 2, 4, 4, 5, 5]


async def test_benchmark_reports_recall_per_category_and_ablation(
    locomo: ModuleType, tmp_path: Path
) -> None:
    variants = {name: locomo.QUERY_VARIANTS[name] for name in ("fusion rrf", "lexical only")}
    report = await locomo.benchmark(FIXTURE, variants=variants, work_dir=tmp_path)

    default = report["default"]
    assert default["overall"]["questions"] == 4
    assert default["category_5"]["questions"] == 1
    assert default["questions_without_evidence"] == 1
    assert default["unmatched_evidence_ids"] == 1
    assert set(default["per_category"]) == {"1", "2", "4", "5"}
    overall = default["overall"]
    assert overall["recall_any@1"] <= overall["recall_any@5"] <= overall["recall_any@10"]
    assert overall["recall_any@10"] == 1.0
    assert overall["recall_any@5"] >= 0.75
    assert default["latency_ms"]["p50"] <= default["latency_ms"]["p95"]
    assert set(report["ablation"]) == set(variants)
    assert report["settings"]["scoring"]["fusion"] == "zscore"
    assert "| default |" in locomo.table(default, report["ablation"])
    assert list(tmp_path.iterdir()) == []


async def test_time_question_boosts_memories_that_state_a_time(
    locomo: ModuleType, tmp_path: Path
) -> None:
    from prme.query.engine import MemoryEngine

    (conversation,) = locomo.load_folder(FIXTURE)
    async with await MemoryEngine.create(tmp_path / "pack") as engine:
        ids = await locomo.ingest(engine, [conversation])
        owner = locomo.owner_of(conversation)
        response = await engine.retrieve("When did Ben run a marathon?", owner, top_k=5)
        analysis = response.receipt.analysis
        assert analysis["time_cue"] == "when"
        assert ids[owner]["D2:1"] in analysis["boosts"]
        assert response.results[0].node_id == ids[owner]["D2:1"]

        dated = await engine.retrieve("Where did Ava move in June 2023?", owner, top_k=5)
        assert [d["text"] for d in dated.receipt.analysis["dates"]] == ["June 2023"]
        assert dated.receipt.analysis["speakers"] == ["Ava"]
        # date match (x2) times the boost for a memory said by the speaker the query names
        speaker = 1 + engine.settings.query.speaker_boost
        assert dated.receipt.analysis["boosts"][ids[owner]["D3:1"]] == pytest.approx(2.0 * speaker)

        floored = await engine.retrieve("Ava cat name", owner, top_k=10, min_score=0.3)
        assert floored.receipt.fusion == "zscore"
        assert not floored.receipt.min_score_skipped
        assert floored.results
        assert all(r.semantic_relevance is not None for r in floored.results)
        assert all(r.semantic_relevance >= 0.3 for r in floored.results)  # type: ignore[operator]
