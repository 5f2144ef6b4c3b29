"""``rde evaluate`` end to end on a small benchmark made here from real demo-pool crops: a dataset
folder of plain Parquet files (no manifests, as its card describes it), scored with a user's
``python:`` factory, a CLIP built from config and saved to a folder (``transformers-clip:``) and a
scores file written from one of them; reruns, an added model, the reports, and bad input as one
line each."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from evaluation_helpers import FACTORY
from typer.testing import CliRunner

from entry.cli import app
from entry.tiny_models import build_tiny_clip
from flows.evaluate import evaluate
from storage import Artifact

pytestmark = pytest.mark.slow  # flows: the session's Prefect server

ROOT = Path(__file__).resolve().parent.parent



@pytest.fixture(scope="module")
def bench(tmp_path_factory: pytest.TempPathFactory, demo_pool_url: str) -> Path:
    """A benchmark folder (queries/, gallery/, qrels/ Parquet files, no manifests) over 40 real crops:
    each query is relevant to the crops of one identity (verified) and to a few others (pending)."""
    folder = tmp_path_factory.mktemp("bench") / "benchmark"
    rows = [r for r in Artifact(demo_pool_url).read_shard(0).to_pylist() if r["variant"] == "crop"]
    people = [r for r in rows if r["domain"] == "pedestrian"][:30]
    cars = [r for r in rows if r["domain"] == "vehicle"][:10]
    gallery = [{"image_id": f"img{n:02d}", "domain": r["domain"], "identity": r["identity"],
                "image_bytes": r["image_bytes"]} for n, r in enumerate(people + cars)]
    queries, qrels = [], []
    for n, (text, domain) in enumerate([("a person in a dark top walking", "pedestrian"),
                                        ("a person in a white top", "pedestrian"),
                                        ("a person with a bag", "pedestrian"),
                                        ("a parked white car", "vehicle")]):
        qid = f"q{n}"
        queries.append({"query_id": qid, "domain": domain, "text": text})
        mine = [g for g in gallery if g["domain"] == domain]
        ident = mine[n * 3 % len(mine)]["identity"]
        for g in mine:
            if g["identity"] == ident:
                qrels.append({"query_id": qid, "image_id": g["image_id"], "relevant": True, "verified": True})
        for g in [g for g in mine if g["identity"] != ident][n: n + 3]:  # unreviewed candidates
            qrels.append({"query_id": qid, "image_id": g["image_id"], "relevant": False, "verified": False})
    for name, table in (("queries", queries), ("gallery", gallery), ("qrels", qrels)):
        (folder / name).mkdir(parents=True)
        pq.write_table(pa.Table.from_pylist(table), folder / name / "part-00000.parquet")
    return folder


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("models")
    (root / "colour_words.py").write_text(FACTORY)
    clip = build_tiny_clip(root / "clip")
    return {"python": f"python:{root / 'colour_words.py'}:make", "clip": f"transformers-clip:{clip}"}


def _run(*args: str) -> tuple[int, str]:
    """The command in this process: for what is answered before a flow starts."""
    result = CliRunner().invoke(app, ["evaluate", *args])
    return result.exit_code, result.output


def _comparison(summary: dict, out: str) -> pd.DataFrame:
    return pd.DataFrame(Artifact(str(Path(out) / "evaluate" / "demo" / summary["comparison"])).rows())


def test_models_side_by_side_rerun_added_model_and_reports(bench: Path, models: dict[str, str], tmp_path: Path,
                                                           shared_server_env: dict[str, str]) -> None:
    out = str(tmp_path / "out")
    sets = ["--set", "evaluation.run_depth=1000", "--set", "evaluation.bootstrap_resamples=500"]
    done = subprocess.run([sys.executable, "-m", "entry.cli", "evaluate", "--benchmark", str(bench), "--output", out,
                           *sets, "-m", models["python"], "-m", models["clip"], "--json"], capture_output=True,
                          text=True, cwd=ROOT, env=shared_server_env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    first = json.loads(done.stdout)
    ran = {s["stage"]: s for s in first["stages"]}
    assert [s.split("-")[0] for s in ran] == ["embed", "score", "embed", "score", "compare"]
    assert all(not s["skipped"] for s in ran.values()) and first["balanced"]
    rows = pd.DataFrame(first["comparison_rows"])
    assert set(rows.labels) == {"verified"} and set(rows.domain) == {"pedestrian", "vehicle", "all"}
    overall = rows[rows.domain == "all"]
    assert (overall.low <= overall["mean"]).all() and (overall["mean"] <= overall.high).all()
    assert overall.groupby("model").size().tolist() == [9, 9]  # mAP@10/20/30, R@1/5/10, mINP, nDCG@10, MRR
    assert set(overall.queries) == {4}
    clip_rows = overall[overall.model == models["clip"]]
    assert clip_rows.diff_mean.notna().all()  # paired differences against the reference (the first model)
    # the python model's run file, deep enough to hold every item, read back as a scores file: the same row
    folder = Path(out) / "evaluate" / "demo" / first["comparison"].rsplit("/", 1)[0]
    run_files = sorted(folder.glob("python-*/run.trec"))
    assert len(run_files) == 1
    scores = tmp_path / "colour.trec"
    shutil.copy(run_files[0], scores)
    report = tmp_path / "report.html"
    overrides = {"evaluation": {"run_depth": 1000, "bootstrap_resamples": 500}}
    second = evaluate(profile="demo", overrides=overrides, output_root=out, benchmark=str(bench),
                      models=[models["python"], models["clip"], f"scores:{scores}"], report=str(report))
    ran = {s["stage"]: s["skipped"] for s in second["stages"]}
    assert [name for name, skipped in ran.items() if not skipped] == [
        next(n for n in ran if n.startswith("score-scores")), "compare"]  # only the added model is scored
    rows = _comparison(second, out)
    metrics = ["domain", "metric", "mean", "low", "high", "queries"]
    python_rows = rows[rows.model == models["python"]][metrics].reset_index(drop=True)
    scores_rows = rows[rows.model == f"scores:{scores}"][metrics].reset_index(drop=True)
    pd.testing.assert_frame_equal(python_rows, scores_rows, check_exact=True)
    page = report.read_text()
    assert page.count("<svg") >= 9 and "data:image/jpeg;base64," in page and "https://" not in page
    # the pending labels (the unreviewed candidates) are flagged in the title of every report
    md = tmp_path / "pending.md"
    pending = evaluate(profile="demo", overrides=overrides, output_root=out, benchmark=str(bench),
                       models=[models["python"]], labels="pending", report=str(md))
    assert set(_comparison(pending, out).labels) == {"pending"}
    assert "PENDING" in md.read_text().splitlines()[0]


@pytest.mark.parametrize(("args", "says"), [
    (["-m", "nope:x"], "the forms are transformers-clip:"),
    (["-m", "expert:attributes-v1", "--reference", "expert:semantic-bridge-v1"], "is not among the models"),
    (["-m", "transformers-clip:/no/such/folder"], "/no/such/folder"),
    (["--labels", "maybe"], "labels"),
])
def test_bad_options_are_one_line(bench: Path, args: list[str], says: str) -> None:
    code, output = _run("--benchmark", str(bench), *args)
    assert code == 2 and says in output and "Traceback" not in output, output


@pytest.mark.parametrize("missing", ["qrels", "gallery"])
def test_a_benchmark_without_qrels_or_gallery_is_one_line(bench: Path, tmp_path: Path, missing: str,
                                                          models: dict[str, str]) -> None:
    copy = tmp_path / "benchmark"
    shutil.copytree(bench, copy)
    shutil.rmtree(copy / missing)
    code, output = _run("--benchmark", str(copy), "-m", models["python"])
    assert code == 2 and f"no {missing}" in output and "Traceback" not in output, output


def test_a_factory_returning_nan_is_named_before_the_run(bench: Path, tmp_path: Path) -> None:
    bad = tmp_path / "nan_retriever.py"
    bad.write_text("import numpy as np\nclass M:\n    def encode_text(self, t): return np.full((len(t), 4), np.nan)\n"
                   "    def encode_image(self, i): return np.ones((len(i), 4))\ndef make(): return M()\n")
    code, output = _run("--benchmark", str(bench), "-m", f"python:{bad}:make")
    assert code == 2 and "encode_text returned NaN" in output and "nan_retriever.py:make" in output, output


def test_a_scores_file_with_unknown_rows_counts_them_and_scores_the_rest(bench: Path, tmp_path: Path) -> None:
    run = tmp_path / "partial.trec"
    run.write_text("q0 Q0 img00 1 0.9 x\nq0 Q0 nope 2 0.8 x\nghost Q0 img01 1 0.7 x\nq3 Q0 img35 1 0.5 x\n")
    out = str(tmp_path / "out")
    summary = evaluate(profile="demo", output_root=out, benchmark=str(bench), models=[f"scores:{run}"])
    stage = next(s for s in summary["stages"] if s["stage"].startswith("score-"))
    metrics = next(a for name, a in summary["artifacts"].items() if name.endswith("/evaluation"))
    stats = Artifact(metrics["url"]).manifest().stats
    assert (stats["unknown_items_rows"], stats["unknown_queries_rows"], stats["scores_evaluated"]) == (1, 1, 2)
    assert stage["accepted"] == 4  # every labelled query scored: those the file ranks nothing for score 0
