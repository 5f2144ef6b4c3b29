"""The export stage: the benchmark's queries, gallery and qrels, its dataset card and review files."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa

from rde.common.dataset_cards import card_folder_note, configs_header
from rde.secmm.benchmark import BENCHMARK_TABLES, dataset_card, qrel_rows, write_review_files
from storage.schemas import (
    GALLERY,
    QRELS,
    QUERIES,
)
from tasks.framework.accounting import StageResult
from tasks.framework.reporting import log
from tasks.framework.stage import Report, Stage, StageRun, Work, Write


class Export(Stage):
    """queries / gallery / qrels artifacts, a dataset card and the review files. Candidates people
    decided on (the ``decisions`` artifact, filled by ``rde labels import``) become verified qrels;
    the others stay ``verified = false`` (the "unverified" benchmark)."""

    name = "export"
    # 4: qrels say which tool each decision came from; 5: the review site and Label Studio grid tasks
    version = "5"
    reads = ("queries", "gallery", "candidates")
    optional_reads = ("decisions",)
    config = ("review",)
    writes = (Write("benchmark/queries", "queries", QUERIES), Write("benchmark/gallery", "gallery", GALLERY),
              Write("benchmark/qrels", "qrels", QRELS))
    main = "benchmark/qrels"
    # every candidate becomes one qrels row: input is the candidates artifact's row count (its
    # manifest), accepted the qrels rows written
    balance = True

    def run(self, run: StageRun) -> Work:
        decisions = run.input("decisions")
        queries = pa.concat_tables([t for _, t in run.input("queries").iter_shards()])
        gallery = run.input("gallery")
        candidates = run.input("candidates")
        # every column the decisions have (one imported before decisions kept their tool has no 'tool')
        made = {(d["query_id"], d["image_id"]): d for d in decisions.rows()} if decisions.is_complete() else {}
        qrels = pa.Table.from_pylist(qrel_rows(candidates.rows(["query_id", "image_id"]), made), schema=QRELS)
        verified = sum(qrels.column("verified").to_pylist())
        stats = {"input_rows": candidates.count_rows(), "accepted": qrels.num_rows, "verified": verified,
                 "decisions_not_candidates": len(made) - verified}
        first = {"benchmark/queries": queries, "benchmark/qrels": qrels}

        def shards() -> Iterator[dict[str, pa.Table]]:
            """The gallery copied one shard at a time; queries and qrels in the first shard."""
            for index, table in gallery.iter_shards():
                yield {"benchmark/gallery": table, **(first if index == 0 else {
                    "benchmark/queries": QUERIES.empty_table(), "benchmark/qrels": QRELS.empty_table()})}
            if not gallery.manifest().shards:
                yield {"benchmark/gallery": GALLERY.empty_table(), **first}

        return Work(shards(), stats)

    def report(self, run: StageRun, result: StageResult) -> Report:
        """The dataset card (also written next to the benchmark) and, on a local disk, the review files."""
        bench = run.output_url("benchmark")
        card = dataset_card(run.profile_name, bench)
        fs_path = Path(bench)
        if "://" not in bench:
            fs_path.mkdir(parents=True, exist_ok=True)
            (fs_path / "README.md").write_text(configs_header(BENCHMARK_TABLES) + card, encoding="utf-8")
            if not result.skipped or not (fs_path / "review" / "index.html").exists():
                folder = fs_path / "review"
                counts = write_review_files(f"{run.ctx.flow_name} / {run.profile_name}", run.section("review"),
                                            run.input("candidates"), run.input("queries").url,
                                            run.input("gallery").url, run.input("decisions"), folder)
                log(f"review: {counts['candidates']} candidates of {counts['queries']} queries → "
                    f"{folder / 'index.html'}; {counts['label_studio_tasks']} Label Studio tasks → "
                    f"{folder / 'label_studio_tasks.json'}")
        return Report(markdown=[("dataset-card", card_folder_note(bench) + card, "Benchmark dataset card")])
