"""Each benchmark command runs end to end at a tiny size and reports sane figures."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from benchmarks import (
    cluster,
    embedding_throughput,
    index_quantization,
    ingest_throughput,
    projection,
    rebuild,
    restore,
    retrieve_latency,
    soak,
)
from prme.projectors.registry import MODEL_NAMES


def run(main: Any, tmp_path: Path, *args: str) -> dict[str, Any]:
    out = tmp_path / "report.json"
    main([*args, "--out", str(out), "--work-dir", str(tmp_path / "work")])
    return json.loads(out.read_text())


@pytest.mark.kafka
def test_ingest_benchmark_compares_prme_with_bare_aiokafka(
    tmp_path: Path, kafka_bootstrap: str
) -> None:
    report = run(
        ingest_throughput.main,
        tmp_path,
        *("--messages", "400", "--owners", "20", "--runs", "1", "--bootstrap", kafka_bootstrap),
    )
    rates = report["records_per_s"]
    assert set(rates) == {
        "local",
        "local_sealed",
        "build_only",
        "prme_kafka",
        "prme_kafka_plain",
        "prme_kafka_inline",
        "bare_aiokafka",
        "bare_aiokafka_plain",
        "bare_aiokafka_batches",
    }
    assert all(rate > 0 for rate in rates.values())
    assert 250 <= report["input"]["mean_line_bytes"] <= 350
    # The baseline sends what prme writes: sealed records are longer than plain ones.
    assert report["input"]["mean_sealed_value_bytes"] > report["input"]["mean_value_bytes"]
    ratios = report["ratios"]
    assert ratios["prme_kafka_to_bare_aiokafka"] == pytest.approx(
        rates["prme_kafka"] / rates["bare_aiokafka"],
        rel=0.01,
        abs=5e-4,  # ratio() rounds to 3 decimals: a small ratio is off by more than 1 %
    )
    assert ratios["local_to_bare_aiokafka"] > 0


@pytest.mark.model
def test_embedding_benchmark_reports_plain_and_cached_rates(
    tmp_path: Path, default_model_dir: Path
) -> None:
    report = run(
        embedding_throughput.main,
        tmp_path,
        *("--sentences", "8", "--runs", "1", "--models-dir", str(default_model_dir.parent)),
    )
    assert report["sentences_per_run"] == 8 and report["machine"]["cpus"] > 0
    assert report["plain_sentences_per_s"] > 0 and report["cached_50pct_repeat_sentences_per_s"] > 0
    assert report["cached_to_plain_ratio"] == pytest.approx(
        report["cached_50pct_repeat_sentences_per_s"] / report["plain_sentences_per_s"],
        rel=0.01,
        abs=5e-3,
    )


@pytest.mark.kafka
@pytest.mark.model
def test_projection_benchmark_reports_throughput_and_per_model_freshness(
    tmp_path: Path, kafka_bootstrap: str, default_model_dir: Path
) -> None:
    report = run(
        projection.main,
        tmp_path,
        *("--messages", "200", "--real-messages", "40", "--runs", "1"),
        *("--samples", "3", "--fresh-owners", "2", "--partitions", "4"),
        *("--bootstrap", kafka_bootstrap, "--models-dir", str(default_model_dir.parent)),
    )
    for name, count in (("hashed", 200), ("real", 40)):
        figures = report["throughput"][name]
        assert figures["messages"] == count
        assert figures["records_per_s"] > 0
        assert 0 < figures["outside_embedding_share"] <= 1
        assert figures["embed_seconds"] < figures["seconds"]
    for transport in ("local", "kafka"):
        for provider in ("hashed", "real"):
            series = report["freshness_ms"][transport][provider]
            assert set(series) == {"append_ack", "wait_applied", *MODEL_NAMES}
            # A model has applied a record before the runner reports it applied.
            assert all(
                series[model]["p50_ms"] <= series["wait_applied"]["p50_ms"] for model in MODEL_NAMES
            )


@pytest.mark.model
def test_retrieve_benchmark_reports_engine_http_and_embedding_latency(
    tmp_path: Path, default_model_dir: Path
) -> None:
    report = run(
        retrieve_latency.main,
        tmp_path,
        *("--memories", "120", "--owners", "6", "--queries", "8", "--warmup", "2"),
        *("--models-dir", str(default_model_dir.parent), "--overhead-rounds", "1"),
        *("--index-threshold", "50", "--model-rounds", "2"),
    )
    # The one-owner pack's shard (120 points) got its HNSW index before the queries.
    assert report["layouts"]["single_owner"]["vector_indexes"]["shards_indexed"] == 1
    overhead = report["metrics_overhead"]
    for path in ("in_process", "http_keepalive"):
        runs = overhead[path]
        assert len(runs["p95_ms_off_rounds"]) == len(runs["p95_ms_on_rounds"]) == 1
        ratio = runs["p95_ms_on_median"] / runs["p95_ms_off_median"]
        assert runs["ratio_on_to_off"] == pytest.approx(ratio, abs=0.001)
    for name, owners in (("spread", 6), ("single_owner", 1)):
        layout = report["layouts"][name]
        assert layout["owners"] == owners
        assert layout["in_process"]["samples"] == 8
        assert 0 < layout["in_process"]["p50_ms"] <= layout["in_process"]["p95_ms"]
        assert set(layout["in_process_channels"]) >= {"vector", "lexical"}
        assert set(layout["http"]) == {"keepalive", "new_connection_per_request"}
        for precision in ("int8", "float"):
            with_model = report["with_real_model"][precision][name]
            embed = report["real_model_embed_query"][precision]
            assert with_model["p95_total_estimate_ms"] == pytest.approx(
                layout["in_process"]["p95_ms"] + embed["p95_ms"], abs=0.01
            )
            # Measured with the model in the loop: every query (warm-up too) went through it.
            assert len(with_model["rounds"]) == 2
            for measured in with_model["rounds"]:
                assert measured["in_process"]["samples"] == 8
                assert measured["queries_embedded_by_model"] == 8 + 2
                assert "vector" in measured["channels"]
            p95s = sorted(m["in_process"]["p95_ms"] for m in with_model["rounds"])
            assert with_model["p95_ms_median"] == pytest.approx(sum(p95s) / 2, abs=0.001)
    assert report["query_precision_in_effect"]["float"] == "float"
    for precision in ("int8", "float"):
        one_owner = report["with_real_model"][precision]["single_owner"]
        assert one_owner["meets_one_owner_target"] == (
            one_owner["p95_ms_median"] <= report["target_one_owner_with_model_p95_ms"]
        )


@pytest.mark.kafka
@pytest.mark.model
def test_restore_benchmark_takes_over_from_the_changelog_without_encoding(
    tmp_path: Path, kafka_bootstrap: str, default_model_dir: Path
) -> None:
    report = run(
        restore.main,
        tmp_path,
        *("--messages", "60", "--owners", "5", "--runs", "1", "--bootstrap", kafka_bootstrap),
        *("--models-dir", str(default_model_dir.parent)),
    )
    takeover = report["takeover"]
    assert report["seed_run"]["texts_encoded"] == 60
    assert takeover["reembed"]["texts_encoded"] == 60
    assert takeover["changelog"]["texts_encoded"] == 0
    assert takeover["changelog"]["changelog_records"] == 60
    assert report["changelog_to_reembed_records_per_s"] == pytest.approx(
        takeover["changelog"]["records_per_s"] / takeover["reembed"]["records_per_s"],
        rel=0.01,
        abs=5e-4,  # ratio() rounds to 3 decimals: a small ratio is off by more than 1 %
    )


def test_rebuild_benchmark_times_rebuild_and_engine_floors(tmp_path: Path) -> None:
    report = run(
        rebuild.main,
        tmp_path,
        *("--messages", "120", "--owners", "5", "--partitions", "2"),
        *("--runs", "1"),
    )
    figures = report["rebuild"]
    assert figures["records_replayed"] == 120
    assert figures["texts_encoded"] == 0  # the vector cache answers every text
    assert report["floor_points"] == 120
    floors = report["floors_seconds"]
    assert set(floors) == {
        "vector",
        "lexical",
        "graph",
        "history",
        "events",
        "lexical_sidecar",
        "sum",
    }
    assert floors["sum"] == pytest.approx(sum(v for k, v in floors.items() if k != "sum"), abs=0.01)
    assert report["rebuild_to_summed_floors"] == pytest.approx(
        figures["seconds"] / floors["sum"],
        rel=0.01,
        abs=5e-4,  # ratio() rounds to 3 decimals: a small ratio is off by more than 1 %
    )


def test_index_quantization_benchmark_builds_both_indexes_and_compares_them(
    tmp_path: Path,
) -> None:
    report = run(
        index_quantization.main,
        tmp_path,
        *("--memories", "1500", "--index-threshold", "1000", "--rounds", "2", "--queries", "5"),
    )
    for side in ("float", "int8"):
        figures = report["sides"][side]
        assert figures["build_s"] > 0 and len(figures["rounds"]) == 2
        [shard] = figures["indexed_shards"].values()  # one owner: one partition, indexed
        assert shard["points"] == 1500 and shard["indexed"] >= 1500
        assert 0 < figures["p50_ms"] <= figures["p95_ms"] and figures["vector_p50_ms"] > 0
    assert report["int8_to_float"]["p50_ms"] == pytest.approx(
        report["sides"]["int8"]["p50_ms"] / report["sides"]["float"]["p50_ms"], rel=0.01, abs=5e-4
    )


def test_soak_benchmark_reports_errors_rss_and_latency_per_operation(tmp_path: Path) -> None:
    report = run(
        soak.main,
        tmp_path,
        *("--seconds", "4", "--warmup", "1", "--clients", "4", "--owners", "4"),
        *("--rss-every", "1"),
    )
    assert report["errors"] == 0 and report["lost_writes"] == 0
    assert report["acknowledged_writes"] == report["operations"]["store"]["count"] > 0
    for operation in ("store", "retrieve"):
        latency = report["operations"][operation]["latency"]
        assert 0 < latency["p50_ms"] <= latency["p95_ms"] <= latency["max_ms"]
    rss = report["rss_mib"]
    assert 0 < rss["start"] <= rss["max"] and rss["end"] <= rss["max"]
    assert rss["growth"] == pytest.approx(rss["end"] - rss["start"], abs=0.2)
    assert report["setup"]["clients"] == 4 and report["requests"] > 0


@pytest.mark.model
def test_cluster_benchmark_compares_one_and_two_processes(tmp_path: Path) -> None:
    report = run(
        cluster.main,
        tmp_path,
        *("throughput", "--memories", "40", "--owners", "8", "--clients", "2"),
        *("--seconds", "1", "--runs", "1"),
    )
    results = report["results"]
    assert set(results) == {"processes_1", "processes_2", "processes_2_one_port"}
    for figures in results.values():
        assert figures["errors"] == 0 and figures["requests_per_s"] > 0
        # The servers' CPU is read from /proc for the whole process tree: with two
        # processes the members' work counts too.
        assert figures["server_cpu_ms_per_request"] > 0 and figures["server_cores_busy"] > 0
    two = results["processes_2"]
    whole_request_ms = two["server_cpu_ms_per_request"] + two["load_generator_cpu_ms_per_request"]
    assert report["processes_2_to_1_ceiling"] == pytest.approx(
        1000
        * len(os.sched_getaffinity(0))
        / whole_request_ms
        / results["processes_1"]["requests_per_s"],
        rel=0.01,
        abs=5e-4,
    )
    assert report["processes_2_to_1_throughput"] == pytest.approx(
        results["processes_2"]["requests_per_s"] / results["processes_1"]["requests_per_s"],
        rel=0.01,
        abs=5e-4,  # ratio() rounds to 3 decimals: a small ratio is off by more than 1 %
    )
