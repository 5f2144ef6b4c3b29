"""End to end: build-largefine on a few demo images, then train-saft and train-gtr on its captions
(Prefect flows, cached features, checkpoints, evaluation rows, plots), and a resumed rerun.

The captions come from the scale benchmark's scripted captioner (through the product's
``openai-http`` backend), not from SmolLM2: which of SmolLM2's greedy captions pass the tier
checks depends on the CPU's rounding, and the subject here is training, not captioning
(tests/test_flow_build_largefine.py runs the real captioner)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from artifact_readers import assert_every_artifact_opens

from flows.build_largefine import build_largefine
from flows.train_gtr import train_gtr
from flows.train_saft import train_saft
from rde.common import progress
from storage import Artifact

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def captions_root(tmp_path_factory: pytest.TempPathFactory, small_pool_url: str) -> str:
    """build-largefine's captions of 10 images, every tier of each accepted (fixed texts: a function
    of the image's bytes), so every CPU trains on the same caption set."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    from scripted_captioner import ScriptedServer

    out = str(tmp_path_factory.mktemp("train-out"))
    with ScriptedServer() as server:
        summary = build_largefine(profile="demo", output_root=out, overrides={
            "input": {"kind": "pool", "path": small_pool_url}, "ingest": {"shard_size": 16},
            "models": {"generators": [server.spec()], "template_generator": server.spec()},
            "largefine": {"max_images": 10, "shard_size": 5, "tier_prompt": "gtr_tiers",
                          "templates": {"sample_captions": 4, "rounds": 1}}})
    captions = Artifact(str(Path(out, "build-largefine", "demo", "largefine"))).count_rows()
    assert captions == 3 * 10, summary["rejected"]  # base, intermediate, advanced tier of each image
    return out


TRAINING = {"evaluation": {"check_sets": []}, "training": {"views": 2, "epochs": 2, "batch_size": 8,
                                                          "held_out_share": 0.3}}


class _Steps:
    """A progress renderer keeping the last (done, total, unit) of each stage line that had a total."""

    def __init__(self) -> None:
        self.last: dict[int, tuple] = {}
        self.names: dict[int, str] = {}

    def start(self, snap: progress.Snapshot) -> int:
        self.names[len(self.names) + 1] = snap.description
        return len(self.names)

    def update(self, handle: int, snap: progress.Snapshot) -> None:
        if snap.total is not None:
            self.last[handle] = (self.names[handle], snap.done, snap.total, snap.unit)

    def stop(self, handle: int, snap: progress.Snapshot) -> None:
        pass


def test_train_saft_trains_evaluates_and_resumes(captions_root: str) -> None:
    shown = _Steps()
    with progress.install(shown):
        summary = train_saft(profile="demo", output_root=captions_root, overrides=TRAINING)
    stages = {s["stage"]: s for s in summary["stages"]}
    # no check sets, no pair cap: every caption is a training or held-out pair
    captions = Artifact(str(Path(captions_root, "build-largefine", "demo", "largefine"))).count_rows()
    assert stages["training-features"]["accepted"] == captions and not stages["train_saft"]["skipped"]
    # the held-out identities' captions are a split (evaluation data), not rejected rows
    splits = summary["splits"]
    assert set(splits) == {"train", "held_out"} and splits["held_out"] > 0 and summary["balanced"]
    assert summary["inputs"] == captions == splits["train"] + splits["held_out"] + summary["total_rejected"]
    assert not any("held_out" in key for key in summary["rejected"])
    assert stages["train_saft"]["input"] == splits["train"]
    steps = [line for line in shown.last.values() if line[0] == "train_saft"]
    assert steps and steps[-1][3] == "steps" and steps[-1][1] == steps[-1][2] > 0  # every step, then done
    folder = Path(captions_root, "train-saft", "demo", "train_saft")
    assert (folder / "model.pt").exists() and (folder / "loss.png").stat().st_size > 5000
    assert len(list(folder.glob("checkpoints/*/step-*.pt"))) == 2  # the newest two of the epochs' ends
    rows = Artifact(str(folder) + "_evaluation").rows()
    assert {r["expert"] for r in rows} == {"zero-shot", "saft"}
    assert {"R@1", "mAP", "mINP"} <= {r["metric"] for r in rows}
    assert all(0.0 <= r["value"] <= 1.0 for r in rows) and any(r["value"] > 0 for r in rows)
    log = Artifact(str(folder) + "_log").rows()
    assert '"sass"' in log[0]["terms"] and '"isd"' in log[0]["terms"]
    again = train_saft(profile="demo", output_root=captions_root, overrides=TRAINING)
    assert all(s["skipped"] for s in again["stages"])
    # its artifacts open with pandas, pyarrow and datasets (the model folder is not one)
    opened = assert_every_artifact_opens(Path(captions_root, "train-saft"), Path(captions_root, "hf-cache"))
    assert {"train_saft_log", "train_saft_evaluation"} <= {p.name for p in opened}
    features = Path(summary["artifacts"]["training_features"]["url"])
    assert features.parent == Path(captions_root, "shared", "demo", "training_features")
    assert features in assert_every_artifact_opens(features.parent, Path(captions_root, "hf-cache"))


def test_train_gtr_ada_fits_the_gmm_and_plots_it(captions_root: str) -> None:
    saft = train_saft(profile="demo", output_root=captions_root, overrides=TRAINING, until="features")
    # two data-parallel training processes (gloo): the GMM refits see every pair's ŝ on every rank
    gtr = train_gtr(profile="demo", output_root=captions_root,
                    overrides={**TRAINING, "training": {**TRAINING["training"], "processes": 2}})
    # one features artifact for both training flows: train-gtr finds train-saft's and skips the stage
    assert gtr["stages"][0]["stage"] == "training-features" and gtr["stages"][0]["skipped"]
    assert gtr["artifacts"]["training_features"] == saft["artifacts"]["training_features"]
    folder = Path(captions_root, "train-gtr", "demo", "train_gtr-ada")
    assert (folder / "s_hat.png").exists() and (folder / "model.pt").exists()
    log = Artifact(str(folder) + "_log").rows()
    assert '"itm"' in log[-1]["terms"]
    # the GMM was refit after every epoch: two components each time, confidences in [0, 1] that
    # tell pairs apart (not all 1), weights 1 while training before the first fit, below 1 after
    # the live loss curve, republished while training ran and once at its end
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
    from prefect.client.schemas.sorting import ArtifactSort

    with get_client(sync_client=True) as client:  # the newest version first: a slow run also published mid-way
        live = client.read_artifacts(artifact_filter=ArtifactFilter(
            key=ArtifactFilterKey(any_=["train-gtr-train-gtr-ada-live-loss"])), sort=ArtifactSort.CREATED_DESC)
    steps = len(Artifact(str(folder) + "_log").rows())
    assert live and f"{steps} steps so far." in str(live[0].data) and "data:image/png;base64," in str(live[0].data)
    fits = Artifact(str(folder) + "_log").manifest().stats["gmm"]
    assert [f["epoch"] for f in fits] == [0, 1]
    assert all(len(f["means"]) == 2 for f in fits)
    assert all(0.0 <= f["confidence_min"] <= f["confidence_max"] <= 1.0 for f in fits)
    assert fits[0]["confidence_min"] < 1.0
    assert fits[0]["weight_mean_during_epoch"] == 1.0 and fits[1]["weight_mean_during_epoch"] < 1.0


def test_the_cpu_models_features_stream_above_the_threshold_and_evaluate_as_in_memory(captions_root: str) -> None:
    """``training.stream_above: 0``: the CPU model's features are written as streamed pairs (a shard
    per shard of captions, the check set in a last one) and trained from the stream (GTR+: the GMM
    refit takes ŝ in a streamed pass). The zero-shot model is the same on both layouts, so its
    evaluation (the demo's check set and the held-out person search) must come out the same."""
    base = {"training": {"views": 2, "epochs": 1, "batch_size": 8, "held_out_share": 0.3, "seed": 4}}
    folder = Path(captions_root, "train-gtr", "demo", "train_gtr-ada")
    in_memory = train_gtr(profile="demo", output_root=captions_root, overrides=base)
    memory_rows = Artifact(str(folder) + "_evaluation").rows()
    streamed = train_gtr(profile="demo", output_root=captions_root,
                         overrides={"training": {**base["training"], "stream_above": 0}})
    assert streamed["balanced"] and streamed["splits"] == in_memory["splits"]
    features = Artifact(streamed["artifacts"]["training_features"]["url"])
    manifest = features.manifest()
    assert manifest.kind == "training_feature_pairs" and len(manifest.shards) == 3  # 2 caption shards + checks
    assert {r["split"] for r in features.rows(["split"])} == {"train", "heldout", "gallery", "query"}
    rows = Artifact(str(folder) + "_evaluation").rows()

    def zero_shot(table: list[dict]) -> dict:
        return {(r["benchmark"], r["domain"], r["metric"]): r["value"] for r in table if r["expert"] == "zero-shot"}

    assert zero_shot(rows).keys() == zero_shot(memory_rows).keys() and any("mAP@10" in k for k in zero_shot(rows))
    for key, value in zero_shot(memory_rows).items():
        assert zero_shot(rows)[key] == pytest.approx(value, abs=1e-6), key
    stats = Artifact(str(folder) + "_log").manifest().stats
    assert [f["epoch"] for f in stats["gmm"]] == [0] and 0.0 <= stats["data_stall_share"] <= 1.0


def test_max_pairs_keeps_the_pairs_with_the_smallest_seeded_keys(captions_root: str) -> None:
    """``training.max_pairs: 20`` of 30 captions: the 20 whose seeded key (the run seed, the image
    and the text) is smallest train or are held out, in the captions' order; 10 are rejected as
    ``over_max_pairs``; the summary balances."""
    from rde.common.seeds import draw_seed

    overrides = {**TRAINING, "training": {**TRAINING["training"], "max_pairs": 20, "seed": 9}}
    summary = train_saft(profile="demo", output_root=captions_root, until="features", overrides=overrides)
    assert summary["balanced"] and sum(summary["splits"].values()) == 20
    assert summary["rejected"] == {"training-features:over_max_pairs": 10}
    captions = Artifact(str(Path(captions_root, "build-largefine", "demo", "largefine"))).rows(["image_id", "text"])
    smallest = sorted(captions, key=lambda r: draw_seed(9, r["image_id"] + r["text"]))[:20]
    expected = [(r["image_id"], r["text"]) for r in captions if r in smallest]  # in the captions' order
    features = Artifact(summary["artifacts"]["training_features"]["url"]).rows(["kind", "key", "text"])
    kept = [(r["key"], r["text"]) for r in features if r["kind"] in ("pair", "heldout")]
    assert kept == expected


def test_training_without_captions_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="run `rde build-largefine`"):
        train_saft(profile="demo", output_root=str(tmp_path), overrides=TRAINING)


def test_a_clip_like_student_trains_end_to_end_on_the_images(captions_root: str, tmp_path: Path) -> None:
    """The production path in small: a CLIP-like student from streamed pairs, in two data-parallel
    processes (gloo), each with its own DataLoader workers."""
    from tiny_models import build_tiny_clip

    clip = str(build_tiny_clip(tmp_path / "clip"))
    overrides = {**TRAINING, "training": {**TRAINING["training"], "epochs": 1, "processes": 2,
                                         "model": {"backend": "transformers-clip", "model_id": clip}}}
    summary = train_saft(profile="demo", output_root=captions_root, overrides=overrides)
    assert not {s["stage"]: s for s in summary["stages"]}["train_saft"]["skipped"] and summary["balanced"]
    # streamed pairs: a shard per shard of captions, each caption with its image's encoded bytes
    features = Artifact(summary["artifacts"]["training_features"]["url"])
    assert features.manifest().kind == "training_pairs" and len(features.manifest().shards) == 2
    first = features.read_shard(0, ["split", "image", "teacher_image"]).to_pylist()[0]
    assert first["image"][:2] == b"\xff\xd8" and len(first["teacher_image"]) > 0  # JPEG bytes, not pixels
    folder = Path(captions_root, "train-saft", "demo", "train_saft")
    stats = Artifact(str(folder) + "_log").manifest().stats
    assert stats["batches"] > 0 and 0.0 <= stats["data_stall_share"] <= 1.0
    rows = Artifact(str(folder) + "_evaluation").rows()
    assert {r["expert"] for r in rows} == {"zero-shot", "saft"} and {"R@1", "mAP"} <= {r["metric"] for r in rows}
    weights = __import__("torch").load(folder / "model.pt", weights_only=True)
    assert any(k.startswith("model.vision_model") for k in weights)


@pytest.mark.parametrize("flow_fn", [train_saft, train_gtr], ids=["train-saft", "train-gtr"])
def test_a_caption_lost_between_read_and_features_unbalances_the_summary(
        captions_root: str, flow_fn, monkeypatch: pytest.MonkeyPatch) -> None:
    """One caption of ``largefine`` dropped on purpose where training-features reads them: the stage
    stays self-consistent, but the flow's summary compares the captions' manifest (counted when
    they were written) with train + held-out + rejected, and says it is not balanced."""
    real = Artifact.rows

    def loses_one(self: Artifact, columns=None):
        rows = real(self, columns)
        reading_captions = self.url.rstrip("/").endswith("/largefine") and columns == ["image_id", "text", "q_txt"]
        return rows[:-1] if reading_captions else rows

    monkeypatch.setattr(Artifact, "rows", loses_one)
    seed = 7 if flow_fn is train_saft else 8  # each its own stage key: features shared by both flows not reused
    overrides = {**TRAINING, "training": {**TRAINING["training"], "seed": seed}}
    summary = flow_fn(profile="demo", output_root=captions_root, until="features", overrides=overrides)
    captions = Artifact(str(Path(captions_root, "build-largefine", "demo", "largefine"))).count_rows()
    assert summary["inputs"] == captions
    assert sum(summary["splits"].values()) + summary["total_rejected"] == captions - 1
    assert summary["balanced"] is False


def test_a_pair_the_trainer_is_not_given_fails_the_training_stage(captions_root: str,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The training stage counts its input from the features artifact's training pairs, apart from
    the pairs its loader hands the trainer: one pair dropped on the way fails it, nothing marked done."""
    import dataclasses

    import tasks.training.train

    real = tasks.training.train.load_training_data

    def loses_a_pair(url: str, ctx) -> dict:
        data = real(url, ctx)
        pairs = data["pairs"]
        fewer = {name: getattr(pairs, name)[1:] for name in ("pair_image", "texts", "teacher_texts", "q_txt")
                 if getattr(pairs, name) is not None}
        data["pairs"] = dataclasses.replace(pairs, **fewer)
        return data

    monkeypatch.setattr(tasks.training.train, "load_training_data", loses_a_pair)
    overrides = {**TRAINING, "training": {**TRAINING["training"], "epochs": 1}}  # its own key for train_saft
    with pytest.raises(Exception, match=r"train_saft: \d+ inputs counted, but \d+ accepted \+ 0 rejected = \d+ "
                                        r"\(1 rows lost"):
        train_saft(profile="demo", output_root=captions_root, overrides=overrides)
    assert not Artifact(str(Path(captions_root, "train-saft", "demo", "train_saft_log"))).is_complete()


def test_the_live_loss_artifact_is_republished_as_training_goes() -> None:
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    from tasks.training.train import LiveLoss

    @flow
    def training_like() -> int:
        live = LiveLoss("test-live-loss-curve", "test", every_s=0.0)
        for step in range(1, 4):
            live.add({"total": 1.0 / step, "itc": 0.5 / step, "step": step, "epoch": 0})
        return live.publications

    assert training_like() == 3
    with get_client(sync_client=True) as client:
        versions = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[
            "test-live-loss-curve"])))
    texts = sorted(str(v.data) for v in versions)
    assert len(versions) >= 3 and any("3 steps so far." in t for t in texts)
    assert any("1 step so far." in t for t in texts)
