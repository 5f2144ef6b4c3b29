"""End to end: build-largefine on a few demo images, then train-saft and train-gtr on its captions
(Prefect flows, cached features, checkpoints, evaluation rows, plots), and a resumed rerun."""

from __future__ import annotations

from pathlib import Path

import pytest

from flows.build_largefine import build_largefine
from flows.train_gtr import train_gtr
from flows.train_saft import train_saft
from storage import Artifact

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def captions_root(tmp_path_factory: pytest.TempPathFactory, small_pool_url: str) -> str:
    out = str(tmp_path_factory.mktemp("train-out"))
    build_largefine(profile="demo", output_root=out, overrides={
        "input": {"kind": "pool", "path": small_pool_url}, "ingest": {"shard_size": 16},
        "largefine": {"max_images": 10, "shard_size": 5, "templates": {"sample_captions": 4, "rounds": 1}}})
    return out


TRAINING = {"evaluation": {"check_sets": []}, "training": {"views": 2, "epochs": 2, "batch_size": 8,
                                                          "held_out_share": 0.3}}


def test_train_saft_trains_evaluates_and_resumes(captions_root: str) -> None:
    summary = train_saft(profile="demo", output_root=captions_root, overrides=TRAINING)
    stages = {s["stage"]: s for s in summary["stages"]}
    assert stages["training-features"]["accepted"] >= 4 and not stages["train_saft"]["skipped"]
    folder = Path(captions_root, "train-saft", "demo", "train_saft")
    assert (folder / "model.pt").exists() and (folder / "loss.png").stat().st_size > 5000
    assert len(list(folder.glob("checkpoints/*/epoch-*.pt"))) == 2
    rows = Artifact(str(folder) + "_evaluation").rows()
    assert {r["expert"] for r in rows} == {"zero-shot", "saft"}
    assert {"R@1", "mAP", "mINP"} <= {r["metric"] for r in rows}
    log = Artifact(str(folder) + "_log").rows()
    assert '"sass"' in log[0]["terms"] and '"isd"' in log[0]["terms"]
    again = train_saft(profile="demo", output_root=captions_root, overrides=TRAINING)
    assert all(s["skipped"] for s in again["stages"])


def test_train_gtr_ada_fits_the_gmm_and_plots_it(captions_root: str) -> None:
    train_gtr(profile="demo", output_root=captions_root, overrides=TRAINING)
    folder = Path(captions_root, "train-gtr", "demo", "train_gtr-ada")
    assert (folder / "s_hat.png").exists() and (folder / "model.pt").exists()
    log = Artifact(str(folder) + "_log").rows()
    assert '"itm"' in log[-1]["terms"]


def test_training_without_captions_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="run `rde build-largefine`"):
        train_saft(profile="demo", output_root=str(tmp_path), overrides=TRAINING)


def test_a_clip_like_student_trains_end_to_end_on_the_images(captions_root: str, tmp_path: Path) -> None:
    from tiny_models import build_tiny_clip

    clip = str(build_tiny_clip(tmp_path / "clip"))
    overrides = {**TRAINING, "training": {**TRAINING["training"], "epochs": 1,
                                         "model": {"backend": "transformers-clip", "model_id": clip}}}
    summary = train_saft(profile="demo", output_root=captions_root, overrides=overrides)
    assert not {s["stage"]: s for s in summary["stages"]}["train_saft"]["skipped"]
    folder = Path(captions_root, "train-saft", "demo", "train_saft")
    rows = Artifact(str(folder) + "_evaluation").rows()
    assert {r["expert"] for r in rows} == {"zero-shot", "saft"} and {"R@1", "mAP"} <= {r["metric"] for r in rows}
    weights = __import__("torch").load(folder / "model.pt", weights_only=True)
    assert any(k.startswith("model.vision_model") for k in weights)
