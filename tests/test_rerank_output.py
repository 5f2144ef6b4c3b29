"""What ``rde rerank --query`` prints: per query the top N items with rank, item id, score, stage-1
rank and, for clips, the time span in seconds (from a ``reranked`` artifact over real clip ids)."""

from __future__ import annotations

import pyarrow as pa
from rich.console import Console

from entry import cli_base
from rde.profile import load_profile
from storage import Artifact, ArtifactWriter
from storage.locations import project_root
from tasks.framework.context import RunContext
from tasks.vedje import top_results
from tasks.vedje.rerank import RERANKED


def test_top_results_and_the_printed_table(tmp_path, monkeypatch) -> None:
    clips = [c["clip_id"] for c in Artifact(str(project_root() / "data" / "demo_clips" / "clips")).rows(
        ["clip_id", "split"]) if c["split"] == "test"][:5]
    rows = [{"query_id": 0, "text": "a person walks to the left", "rank": r, "item_id": cid,
             "stage1_rank": [1, 0, 3, 2, 4][r], "stage1_score": 0.5, "score": 2.0 - 0.25 * r, "relevant": None}
            for r, cid in enumerate(clips)]
    writer = ArtifactWriter(str(tmp_path / "reranked"), "reranked", RERANKED, "test")
    writer.begin()
    writer.finalize([writer.write_shard(0, pa.Table.from_pylist(rows, schema=RERANKED))], code_version="test")
    results = top_results(RunContext(load_profile("demo"), "rerank", str(tmp_path)), str(tmp_path / "reranked"), 3)
    assert [q["query"] for q in results] == ["a person walks to the left"]
    top = results[0]["results"]
    assert [r["rank"] for r in top] == [1, 2, 3] and [r["stage1_rank"] for r in top] == [2, 1, 4]
    first = int(clips[0].rsplit(":", 1)[1])  # the clip id names its first frame; the demo video runs at 10 fps
    assert top[0]["span"] == {"first_frame": first, "last_frame": first + 35, "start_s": first / 10,
                              "end_s": (first + 35) / 10}
    out = Console(width=120, record=True)
    monkeypatch.setattr(cli_base, "console", out)
    cli_base.print_ranked(results[0])
    text = out.export_text()
    assert "stage-1 rank" in text and "time span" in text
    line = next(line for line in text.splitlines() if clips[0] in line)
    assert line.split("│")[1:5] == ["    1 ", f" {clips[0]} ", " 2.000 ", "            2 "]
    assert f"{first / 10:.1f}–{(first + 35) / 10:.1f} s" in line
