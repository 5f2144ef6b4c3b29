"""What a run's evaluation found, printed after its summary: zero-shot vs trained, stage 1 vs
rerank, or per expert and domain, from the evaluation rows a flow wrote."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pyarrow as pa
from rich.console import Console

from entry.evaluation_view import evaluation_of, evaluation_table


def _text(table: Any) -> str:
    console = Console(record=True, width=160, color_system=None)
    console.print(table)
    return console.export_text()


def _cells(line: str) -> list[str]:
    """A table line's cells (split on the box's bars, header or body)."""
    return [p.strip() for p in re.split("[│┃]", line)[1:-1]]


def _line(text: str, *cells: str) -> str:
    """The one table line that holds every cell."""
    found = [ln for ln in text.splitlines() if all(c in _cells(ln) for c in cells)]
    assert len(found) == 1, (cells, text)
    return found[0]


def _training_rows() -> list[dict[str, Any]]:
    rows = []
    for expert, shift in (("zero-shot", 0.0), ("saft", 0.05)):
        for domain, base in (("pedestrian", 0.30), ("vehicle", 0.50)):
            rows += [{"benchmark": "vtest-check-set", "labels": "verified", "expert": expert, "domain": domain,
                      "metric": f"mAP@{k}", "value": base + shift - (0.1 if domain == "vehicle" and shift else 0),
                      "queries": 12} for k in (10, 20)]
        rows.append({"benchmark": "held-out-identities", "labels": "track identities", "expert": expert,
                     "domain": "pedestrian", "metric": "R@1", "value": 0.4 + shift, "queries": 9})
    return rows


def test_training_rows_print_zero_shot_against_trained_per_domain_with_the_change() -> None:
    text = _text(evaluation_table("train_saft_evaluation", _training_rows()))
    assert "train_saft: zero-shot vs saft" in text
    header = _cells(_line(text, "benchmark", "domain", "metric"))
    assert header == ["benchmark", "domain", "metric", "zero-shot", "saft", "Δ"]
    assert _cells(_line(text, "vtest-check-set", "pedestrian", "mAP@10")) == [
        "vtest-check-set", "pedestrian", "mAP@10", "0.300", "0.350", "+0.050"]
    assert _cells(_line(text, "vehicle", "mAP@20"))[3:] == ["0.500", "0.450", "-0.050"]  # worse shows as worse
    assert _cells(_line(text, "held-out-identities", "R@1"))[3:] == ["0.400", "0.450", "+0.050"]
    assert len(re.findall(r"mAP@\d+", text)) == 4  # one line per domain and metric, both models on it


def test_rerank_rows_print_stage_one_against_each_precision_at_each_n_c() -> None:
    rows = [{"ranking": "stage-1", "n_candidates": 0, "metric": f"R@{k}", "value": v, "precision": p,
             "queries": 32, "gallery": 40} for p in ("bf16", "fp8") for k, v in ((1, 15.625), (5, 65.625))]
    rows += [{"ranking": "rerank", "n_candidates": n, "metric": "R@1", "value": v, "precision": p, "queries": 32,
              "gallery": 40} for n in (4, 8) for p, v in (("bf16", 18.75), ("fp8", 12.5))]
    text = _text(evaluation_table("vedje_evaluation", rows))
    assert _cells(_line(text, "N_c", "metric")) == ["N_c", "metric", "stage-1", "rerank bf16", "Δ", "rerank fp8", "Δ"]
    for n in ("4", "8"):  # stage 1 ranks the whole gallery (N_c 0): its value stands against every N_c
        assert _cells(_line(text, n, "R@1")) == [n, "R@1", "15.6", "18.8", "+3.1", "12.5", "-3.1"]
    assert _cells(_line(text, "0", "R@5")) == ["0", "R@5", "65.6", "", "", "", ""]  # nothing reranked at R@5
    plain = [{**r, "precision": None} for r in rows if r["precision"] == "bf16"]  # a rerank run: no precision
    assert "rerank bf16" not in _text(evaluation_table("rerank_evaluation", plain))


def test_expert_rows_print_one_line_per_benchmark_expert_and_domain() -> None:
    rows = [{"benchmark": "check-set:vtest", "labels": "verified", "expert": e, "domain": d, "metric": m,
             "value": v, "queries": q} for e, v in (("semantic-bridge:v1", 0.25), ("attributes:v1", 0.125))
            for d, q in (("pedestrian", 13), ("all", 24)) for m in ("mAP@10", "R@1")]
    text = _text(evaluation_table("evaluation", rows))
    assert "evaluate: per expert and domain" in text
    assert _cells(_line(text, "benchmark", "expert")) == ["benchmark", "expert", "domain", "queries", "mAP@10", "R@1"]
    assert _cells(_line(text, "attributes:v1", "pedestrian")) == [
        "check-set:vtest", "attributes:v1", "pedestrian", "13", "0.125", "0.125"]
    assert evaluation_table("evaluation", []) is None


def test_a_summary_prints_its_evaluation_read_from_the_artifacts_it_lists(tmp_path: Path, capsys) -> None:
    from entry.cli import print_summary
    from storage import ArtifactWriter
    from storage.schemas import EVALUATION

    url = str(tmp_path / "train_saft_evaluation")
    writer = ArtifactWriter(url, "evaluation", EVALUATION, "train_saft")
    writer.begin()
    writer.finalize([writer.write_shard(0, pa.Table.from_pylist(_training_rows(), schema=EVALUATION))],
                    code_version="test")
    summary = {"flow": "train-saft", "profile": "demo", "output_root": str(tmp_path), "balanced": True,
               "stages": [{"stage": "train_saft", "skipped": False, "input": 40, "accepted": 40, "rejected": 0,
                           "shards": 1, "shards_reused": 0, "seconds": 1.0, "balanced": True}],
               "inputs": 40, "accepted": 40, "splits": {}, "rejected": {}, "total_rejected": 0,
               "artifacts": {"train_saft_evaluation": {"url": url},
                             "train_saft_log": {"url": str(tmp_path / "missing_log")},
                             "other_evaluation": {"url": str(tmp_path / "not_written")}}}
    assert list(evaluation_of(summary)) == ["train_saft_evaluation"]  # one not written is left out
    print_summary(summary)
    out = capsys.readouterr().out
    assert "train_saft: zero-shot vs saft" in out and "+0.050" in out
    assert out.index("zero-shot vs saft") < out.index("artifacts:")
