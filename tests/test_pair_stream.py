"""Streamed training pairs: the epoch order (seeded shard order, shuffled windows), batches that skip
a last single pair, DataLoader workers and ranks that change nothing about what is trained on, an
exact resume, and a CLIP-like student that trains from the stream and resumes where it stopped."""

from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np
import pytest
import torch

from entry.synth_pool import write_synth_training_pairs
from rde.common.image_decoding import decode_rgb
from rde.common.seeds import draw_seed
from rde.training.distributed import Ranks
from rde.training.pair_batches import StreamedTraining, held_out_embeddings
from rde.training.pair_stream import (
    PairIndex,
    Preprocess,
    StreamedPairs,
    epoch_order,
    global_batches,
    steps_per_epoch,
)
from rde.training.retrieval_features import random_resized_crop
from rde.training.retrieval_training import TrainConfig, train
from storage import Artifact


def _pixels(images: list[np.ndarray]) -> torch.Tensor:
    """A stand-in preprocessing: each image resized to 8×8."""
    return torch.tensor(np.stack([cv2.resize(im, (8, 8), interpolation=cv2.INTER_AREA) for im in images]))


def _tokens(texts: list[str]) -> dict[str, torch.Tensor]:
    return {"length": torch.tensor([len(t) for t in texts])}


FAKE = Preprocess(_pixels, _tokens)


@pytest.fixture(scope="module")
def pairs_url(tmp_path_factory: pytest.TempPathFactory, small_pool_url: str) -> str:
    """The 96-image slice (six shards) as training pairs, 2 captions an image, a quarter held out."""
    url = str(tmp_path_factory.mktemp("pairs") / "training_pairs")
    write_synth_training_pairs(small_pool_url, url, captions_per_image=2, teacher_dim=8, held_out_share=0.25)
    return url


def test_the_epoch_order_shuffles_windows_of_consecutive_shards() -> None:
    """Window 1 is the seeded shard order with each shard's rows in order (the shard permutation is
    the epoch's first draw, whatever the window); a larger window holds exactly its cut of that
    sequence, shuffled; every pair comes once; the order is the seed's and the epoch's."""
    lengths = [7, 5, 9, 4]
    sequence = [tuple(x) for part in epoch_order(lengths, seed=3, epoch=0, window=1) for x in part.tolist()]
    shards = list(dict.fromkeys(s for s, _ in sequence))
    assert sorted(shards) == [0, 1, 2, 3] and sequence == [(s, k) for s in shards for k in range(lengths[s])]
    for window in (6, 100):
        parts = list(epoch_order(lengths, seed=3, epoch=0, window=window))
        assert [len(p) for p in parts] == [min(window, 25 - at) for at in range(0, 25, window)]
        at = 0
        for part in parts:
            assert sorted(tuple(x) for x in part.tolist()) == sorted(sequence[at:at + len(part)])
            at += len(part)
    shuffled = [tuple(x) for part in epoch_order(lengths, 3, 0, 100) for x in part.tolist()]
    assert shuffled != sequence  # one window of all 25: shuffled
    assert [p.tolist() for p in epoch_order(lengths, 3, 0, 6)] == [p.tolist() for p in epoch_order(lengths, 3, 0, 6)]
    assert [p.tolist() for p in epoch_order(lengths, 3, 1, 6)] != [p.tolist() for p in epoch_order(lengths, 3, 0, 6)]


def test_batches_run_across_windows_and_a_last_single_pair_is_not_a_batch() -> None:
    order = iter([np.array([[0, 0], [0, 1], [0, 2]]), np.array([[1, 0], [1, 1], [1, 2], [1, 3]])])
    batches = [b.tolist() for b in global_batches(order, 3)]
    assert batches == [[[0, 0], [0, 1], [0, 2]], [[1, 0], [1, 1], [1, 2]]]  # [1, 3] alone: dropped
    assert [steps_per_epoch(n, 4) for n in (8, 9, 10, 1, 0)] == [2, 2, 3, 0, 0]
    assert [len(b) for b in global_batches(epoch_order([7, 5, 9], 0, 0, 4), 5)] == [5, 5, 5, 5]  # 21 = 4×5 + 1


def _pair_ids(dataset: StreamedPairs, workers: int) -> list[list[int]]:
    loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=workers)
    return [b["pairs"].tolist() for b in loader]


def test_workers_ranks_and_a_resume_change_nothing_about_the_batches(pairs_url: str) -> None:
    index = PairIndex.scan(pairs_url, "train")
    counted = Artifact(pairs_url).count_equal("split", "train")
    assert len(index) == counted and 0 < counted < 192 and len(index.shards) == 6
    dataset = StreamedPairs(index, batch_size=10, window=25, seed=1, preprocess=FAKE, epoch=2)
    alone = _pair_ids(dataset, 0)
    assert _pair_ids(dataset, 2) == alone  # the order is the stream's, not the workers'
    seen = [p for b in alone for p in b]
    assert len(seen) == len(set(seen)) and len(alone) == steps_per_epoch(counted, 10)
    assert set(seen) <= set(range(counted)) and len(seen) == counted - (counted % 10 == 1)  # all, or all but one
    assert _pair_ids(dataset.at(2, 3), 2) == alone[3:]  # a resume at batch 3 sees the rest, once each
    halves = [_pair_ids(StreamedPairs(index, 10, 25, 1, FAKE, ranks=Ranks(r, 2), epoch=2), 0) for r in (0, 1)]
    assert [a + b for a, b in zip(*halves, strict=True)] == alone  # each rank reads its part of each batch
    assert all(len(a) == 5 for a in halves[0][:-1])


def test_a_batch_holds_its_pairs_images_texts_and_teacher_vectors(pairs_url: str) -> None:
    index = PairIndex.scan(pairs_url, "train")
    batch = next(iter(StreamedPairs(index, 4, 25, 1, FAKE, other_view=True, epoch=1)))
    rows = {r["pair"]: r for _, t in Artifact(pairs_url).iter_shards() for r in t.to_pylist() if r["split"] == "train"}
    for k, pair in enumerate(batch["pairs"].tolist()):
        row = rows[pair]
        crop = random_resized_crop(decode_rgb(row["image"]), np.random.default_rng(draw_seed(1, f"{pair}#epoch1")))
        assert torch.equal(batch["images"][k], _pixels([crop])[0])
        assert not torch.equal(batch["other_images"][k], batch["images"][k])
        assert batch["texts"]["length"][k] == len(row["text"])
        assert torch.allclose(batch["teacher_images"][k], torch.tensor(row["teacher_image"]))
        assert torch.allclose(batch["teacher_texts"][k], torch.tensor(row["teacher_text"]))
        assert batch["image_keys"][k] == row["image_key"]
    assert np.isnan(index.q_txt).sum() == 0 and index.q_txt[pair] == pytest.approx(rows[pair]["q_txt"])


@pytest.fixture(scope="module")
def clip_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tiny_models import build_tiny_clip

    return build_tiny_clip(tmp_path_factory.mktemp("clip"))


def _student(folder: Path):
    from models.retrieval.dual_encoder import HFClipDualEncoder

    torch.manual_seed(0)
    return HFClipDualEncoder(str(folder))


def _source(url: str, model, workers: int) -> StreamedTraining:
    dataset = StreamedPairs(PairIndex.scan(url, "train"), batch_size=16, window=40, seed=0, preprocess=None)
    return StreamedTraining(dataset, workers=workers).for_model(model)


class _Stop(Exception):
    pass


def test_a_clip_student_trains_from_the_stream_and_resumes_where_it_stopped(pairs_url: str, clip_folder: Path,
                                                                            tmp_path: Path) -> None:
    """GTR+ (ITM, adaptive weights from a streamed ŝ pass) for 2 epochs: a run stopped three steps
    into epoch 1 resumes from its newest checkpoint (every 2 steps, and at epoch ends), at the next
    batch of that epoch, and ends where the uninterrupted run ends."""
    cfg = TrainConfig(objective="itc", weighting="ada", use_itm=True, epochs=2, batch_size=16, lr_start=1e-4,
                      lr_peak=1e-3, seed=5, checkpoint_every=2, gmm_min_fit_pairs=4)
    whole = _student(clip_folder)
    reference = train(whole, _source(pairs_url, whole, 2), cfg)
    per_epoch = len(reference.step_losses) // 2
    assert per_epoch >= 4 and reference.loader.batches == 2 * per_epoch and 0 <= reference.loader.stall_share <= 1
    assert reference.epochs[0].confidence is not None and len(reference.epochs[0].confidence) == len(
        PairIndex.scan(pairs_url, "train"))

    stop = per_epoch + 3
    saved = max(per_epoch, (stop - 1) // 2 * 2)  # the newest checkpoint before the stop

    def stop_at(done: int, total: int) -> None:
        if done == stop:
            raise _Stop

    stopped = _student(clip_folder)
    with pytest.raises(_Stop):
        train(stopped, _source(pairs_url, stopped, 0), cfg, checkpoint_dir=tmp_path, on_step=stop_at)
    resumed = _student(clip_folder)
    result = train(resumed, _source(pairs_url, resumed, 2), cfg, checkpoint_dir=tmp_path)
    assert result.resumed_from == 1 and result.resumed_step == saved
    assert [s["step"] for s in result.step_losses] == list(range(saved + 1, 2 * per_epoch + 1))
    assert [s["total"] for s in result.step_losses] == pytest.approx(
        [s["total"] for s in reference.step_losses[saved:]], rel=1e-4)
    for name, value in whole.state_dict().items():
        assert torch.allclose(resumed.state_dict()[name], value, atol=1e-5), name


def test_the_held_out_pairs_are_embedded_in_one_streamed_pass(pairs_url: str, clip_folder: Path) -> None:
    model = _student(clip_folder)
    held = PairIndex.scan(pairs_url, "heldout")
    queries, query_ids, gallery, gallery_ids = held_out_embeddings(model, held, Preprocess(model.pixel_values,
                                                                                           model.tokens), 5)
    rows = [r for _, t in Artifact(pairs_url).iter_shards(["split", "image_id", "identity"]) for r in t.to_pylist()
            if r["split"] == "heldout"]
    assert len(queries) == len(query_ids) == len(rows) == len(held) > 0
    assert len(gallery) == len(gallery_ids) == len({r["image_id"] for r in rows})
    assert held_out_embeddings(model, PairIndex.scan(pairs_url, "nothing"), FAKE) is None


def test_cached_features_stream_one_seeded_view_a_pair(tmp_path: Path) -> None:
    """The CPU model's streamed layout: a batch holds, for each pair, the features of the view drawn
    for (pair, epoch), the next view for ISS, and the pair's text vector; the draws use every view."""
    import pyarrow as pa

    from rde.training.pair_stream import FEATURE_PAIRS_KIND
    from storage import ArtifactWriter
    from storage.schemas import TRAINING_FEATURE_PAIRS

    rng = np.random.default_rng(0)
    rows = [{"split": "train", "pair": k, "image_id": f"img{k // 2}", "image_key": k // 2, "text": f"caption {k}",
             "q_txt": 0.5, "image_views": rng.standard_normal((3, 5)).astype(np.float32).tolist(),
             "text_vector": rng.standard_normal(4).astype(np.float32).tolist(),
             "teacher_image": [1.0, 0.0], "teacher_text": [0.0, 1.0]} for k in range(30)]
    url = str(tmp_path / "feature_pairs")
    writer = ArtifactWriter(url, FEATURE_PAIRS_KIND, TRAINING_FEATURE_PAIRS, "key")
    writer.begin()
    writer.finalize([writer.write_shard(i, pa.Table.from_pylist(rows[i * 10:(i + 1) * 10],
                                                                schema=TRAINING_FEATURE_PAIRS)) for i in range(3)],
                    code_version="test")
    index = PairIndex.scan(url)
    assert index.features and len(index) == 30
    chosen = []
    for batch in StreamedPairs(index, 8, 12, seed=2, preprocess=None, other_view=True, epoch=1):
        for k, pair in enumerate(batch["pairs"].tolist()):
            view = draw_seed(2, f"{pair}#epoch1#view") % 3
            chosen.append(view)
            assert torch.allclose(batch["images"][k], torch.tensor(rows[pair]["image_views"][view]))
            assert torch.allclose(batch["other_images"][k], torch.tensor(rows[pair]["image_views"][(view + 1) % 3]))
            assert torch.allclose(batch["texts"][k], torch.tensor(rows[pair]["text_vector"]))
    assert len(chosen) == 30 and set(chosen) == {0, 1, 2}
