"""The motion clip set (``entry.motion_clips``) on hand-made tracks, and a smoke run of
experiments/vedje_motion.py on it with tiny sizes (a tiny random joint encoder, pixel features)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))

from tiny_models import build_tiny_bert
from vedje_motion import CONDITIONS, bootstrap, evaluate, one_frame, shuffled
from vedje_motion import main as vedje_motion_main

from entry.demo_clips import Sighting
from entry.motion_clips import REVERSE, MotionParams, crop_window, directions_of, motion_set, twins_of
from rde.vedje.features import item_embeddings
from rde.vedje.training import VedjeTensors

W, H, FRAMES = 160, 120, 100
PARAMS = MotionParams(frames=4, frame_step=2, window_stride=4, min_move=0.4, pad=0.1, crop_size=16, test_from=0.5,
                      gap_frames=10)


def _person(frames: dict[int, np.ndarray], tracks: dict, tid: int, first: int, last: int, x0: float, y0: float,
            dx: float, dy: float, colour: tuple[int, int, int], upper: str) -> None:
    """A 12×24 box from ``first`` to ``last`` moving (dx, dy) pixels a frame, painted into the frames."""
    for f in range(first, last + 1):
        x, y = x0 + dx * (f - first), y0 + dy * (f - first)
        box = np.array([x, y, x + 12, y + 24], dtype=np.float32)
        frames[f][int(y):int(y) + 24, int(x):int(x) + 12] = colour
        tracks.setdefault(tid, []).append(Sighting(f, box, upper, "blue"))


def _scene() -> tuple[dict[int, np.ndarray], dict[int, list[Sighting]]]:
    """Track 0 walks right (frames 0–30, train), 1 stands still (0–30), 2 walks up, away from the
    camera (60–90, test: after 0.5 × 100), 3 walks left across the split (40–60: the gap)."""
    rng = np.random.default_rng(0)
    frames = {f: np.full((H, W, 3), 128, np.uint8) + rng.integers(0, 8, (H, W, 3), dtype=np.uint8)
              for f in range(FRAMES)}
    tracks: dict[int, list[Sighting]] = {}
    _person(frames, tracks, 0, 0, 30, 5, 40, 3.0, 0.0, (200, 30, 30), "red")
    _person(frames, tracks, 1, 0, 30, 120, 80, 0.0, 0.0, (30, 30, 200), "navy")
    _person(frames, tracks, 2, 60, 90, 70, 90, 0.0, -2.0, (30, 200, 30), "green")
    _person(frames, tracks, 3, 40, 60, 140, 10, -3.0, 0.0, (200, 200, 30), "yellow")
    return frames, tracks


def test_crop_window_by_hand() -> None:
    """Boxes (10,20)-(30,60) and (50,20)-(70,60): union 60 wide, 40 high → side 60 × 1.2 = 72
    around the centre (40, 40): left 4, top 4; at the frame's corner it is shifted inside."""
    boxes = [np.array([10, 20, 30, 60.0]), np.array([50, 20, 70, 60.0])]
    assert crop_window(boxes, 0.1, 160, 120) == (4, 4, 76, 76)
    assert crop_window([np.array([0, 0, 20, 20.0])], 0.5, 160, 120) == (0, 0, 40, 40)


def test_motion_set_twins_directions_and_splits() -> None:
    frames, tracks = _scene()
    m = motion_set(frames, tracks, PARAMS, FRAMES, "scene")
    it = m.items
    # track 0: starts 0, 4, ..., 24 (span 6 ≤ 30): 7 clips; track 2: starts 60 … 84: 7; each with its twin
    assert it.splits.count("train") == 14 and it.splits.count("test") == 14
    assert m.rejected == {"no_motion": 7, "split_gap": 4}  # track 1 stands; track 3 spans the split
    assert it.input_rows == 14 + 11  # every window considered: kept originals and the left out
    twins = twins_of(it.item_ids)
    assert twins == {k: k + 1 if k % 2 == 0 else k - 1 for k in range(28)}  # each clip beside its twin
    directions = directions_of(it.groups)
    assert all(directions[k + 1] == REVERSE[directions[k]] for k in range(0, 28, 2))
    for k in range(0, 28, 2):
        assert it.frames[k + 1] == it.frames[k][::-1] and it.item_ids[k + 1] == it.item_ids[k] + ":reversed"
        assert it.groups[k].split(":")[0] == it.groups[k + 1].split(":")[0]
    assert it.query_texts[0] == "a person in a red top and blue trousers walking to the right"
    assert it.query_texts[1] == "a person in a red top and blue trousers walking to the left"
    assert it.query_texts[14] == "a person in a green top and blue trousers walking away from the camera"
    assert it.query_texts[15] == "a person in a green top and blue trousers walking towards the camera"
    assert it.query_items == list(range(28))
    # one fixed window per clip: the person's colour moves right across the crops of a right-walking clip
    crops = it.load_frames(it.frames[0])
    columns = [float(np.argmax((crops[k][..., 0] > 180).sum(axis=0))) for k in it.frames[0]]
    assert columns == sorted(columns) and columns[-1] > columns[0]
    assert all(c.shape == (16, 16, 3) for c in crops.values())
    # a frame-average stage 1 gives a clip and its twin the same embedding
    emb = {k: np.random.default_rng(n).normal(size=4).astype(np.float32) for n, k in enumerate(sorted(m.crops))}
    items = item_embeddings(it.frames, emb)
    assert np.array_equal(items[0], items[1]) and not np.array_equal(items[0], items[2])


def _pixel_tensors(_args: object = None) -> VedjeTensors:
    """Frozen inputs from the hand-made scene: a frame's features are its crop's 4×4 grid of mean
    colours (P = 16, d_v = 3); stage 1 embeds a crop as its mean colour and a query by its words."""
    m = motion_set(*_scene(), PARAMS, FRAMES, "scene")
    keys = sorted(m.crops)
    index = {k: i for i, k in enumerate(keys)}
    grid = [m.crops[k].reshape(4, 4, 4, 4, 3).mean(axis=(1, 3)).reshape(16, 3) / 255.0 for k in keys]
    colour = {k: m.crops[k].reshape(-1, 3).mean(0) / 255.0 for k in keys}
    words = sorted({w for t in m.items.query_texts for w in t.split()})
    query = np.stack([np.array([t.split().count(w) for w in words], np.float32)[:3] + 0.1 for t in m.items.query_texts])
    norm = lambda a: torch.nn.functional.normalize(torch.tensor(np.asarray(a), dtype=torch.float32), dim=-1)  # noqa: E731
    return VedjeTensors(m.items, torch.tensor(np.stack(grid), dtype=torch.float16),
                        torch.tensor([[index[k] for k in f] for f in m.items.frames]),
                        norm(item_embeddings(m.items.frames, colour)), norm(query))


def test_one_frame_and_shuffled_keep_what_they_claim() -> None:
    data = _pixel_tensors()
    single = one_frame(data)
    assert single.item_frames.shape == (28, 1)
    assert torch.equal(single.item_frames[0::2], single.item_frames[1::2])  # a clip and its twin: one frame
    mixed = shuffled(data, 0)
    assert torch.equal(mixed.item_frames.sort(1).values, data.item_frames.sort(1).values)
    assert not torch.equal(mixed.item_frames, data.item_frames)


def test_bootstrap_interval_holds_the_mean_and_ignores_missing() -> None:
    low, high = bootstrap(np.array([0.0, 1.0, 1.0, 1.0, np.nan]))
    assert 0.0 <= low <= 0.75 <= high <= 1.0
    assert bootstrap(np.array([0.5, 0.5])) == (0.5, 0.5)


def test_vedje_motion_runs_tiny_and_stage_1_is_at_chance_on_the_twins(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("RDE_STATE_DIR", str(tmp_path / "state"))
    bert = build_tiny_bert(tmp_path / "tiny-bert")
    report = vedje_motion_main(["--seeds", "1", "--epochs", "1", "--layers", "1", "--batch", "4", "--candidates", "3",
                                "--negatives-from", "6", "--n-c", "5", "--encoder", str(bert)], load=_pixel_tensors)
    out = capsys.readouterr().out
    assert ("28 clips (14 with a reversed twin, 14 of them with the very same stage-1 embedding), T = 4; train 14 "
            "clips of 1 track(s), 14 queries; test 14") in out
    # By hand, for every condition (stage 1 does not depend on the reranker): the 14 test clips are
    # track 2's 7 windows walking away and their 7 reversed twins (towards), each twin with its
    # clip's stage-1 embedding, so the ranking pairs them up, clip first (a stable sort on a tie):
    # the top-1 is a clip walking away for every query, a hit for the 7 "away" queries and a miss for
    # the 7 "towards" ones (R@1 = 50 %), and the top 2 already hold both directions (R@5 = R@10 =
    # 100 %). Reranking the top N_c = 5 only reorders them, so rerank R@5 and R@10 stay 100 %.
    for condition in CONDITIONS:
        s, raw = report["summary"][condition], report["raw"][condition][0]
        assert f"| {condition} | " in out
        assert s["pair_stage1"] == (50.0, 0.0)  # a twin has the same frame average: every pair a tie
        assert raw["stage1@1"] == [1.0, 0.0] * 7 and s["stage1@1"] == (50.0, 0.0), condition
        assert s["stage1@5"] == s["stage1@10"] == s["rerank@5"] == s["rerank@10"] == (100.0, 0.0), condition
        # the pair outcome of each of the 14 test queries (all have their twin in the test split)
        assert len(raw["pair_rerank"]) == 14 and set(raw["pair_rerank"]) <= {0.0, 0.5, 1.0}, condition
        assert s["pair_rerank"] == (pytest.approx(100 * np.mean(raw["pair_rerank"]), abs=1e-9), 0.0), condition
        gain = np.array(raw["rerank@1"]) - np.array(raw["stage1@1"])
        assert s["rerank@1"][0] - s["stage1@1"][0] == pytest.approx(100 * gain.mean(), abs=1e-9), condition
        assert s["gain@1_ci"] == pytest.approx(tuple(100 * x for x in bootstrap(gain)), abs=1e-9), condition
    # T = 1: a clip and its twin keep the same single frame and have the same ρ, so the reranker
    # scores them alike: every pair a tie (50 %), and the reranked top-1 is again the clip, never
    # its twin, that stage 1 put first (a stable sort on a tie): R@1 stays 50 %, the gain exactly 0
    one = report["summary"]["T = 1"]
    assert report["raw"]["T = 1"][0]["pair_rerank"] == [0.5] * 14 and one["pair_rerank_ci"] == (50.0, 50.0)
    assert one["rerank@1"] == (50.0, 0.0) and one["gain@1_ci"] == (0.0, 0.0)
    assert report["seconds"].keys() == {"VEDJE", "delta head off", "ρ hidden", "T = 1",
                                        "twin always a training negative"}
    assert set(report["probes"][0]) == {f"{source}, {view}" for source in ("backbone", "cache Z")
                                        for view in ("frames in order", "last − first frame", "frames averaged")}
    r = report["response"][0]
    assert 0.0 < r["attn_cache_last"] < 100.0
    assert r["s_query"] + r["s_item"] + r["s_inter"] == pytest.approx(100.0, abs=0.05)  # shares rounded to 0.01
    assert "| [CLS] attention on the cache, last layer (%) |" in out
    assert (tmp_path / "state" / "experiments" / "vedje_motion.json").exists()


def test_evaluate_compares_each_query_s_clip_with_its_own_twin(monkeypatch) -> None:
    """A stand-in scorer that knows the answer (1 for the query's own clip, 0 otherwise): every
    pair is right and every query whose clip is in its stage-1 top-N_c is first after the rerank."""
    import vedje_motion

    data = _pixel_tensors()
    item_rows, query_rows = data.rows("test")
    own = {qi: data.items.query_items[q] for qi, q in enumerate(query_rows)}
    monkeypatch.setattr(vedje_motion, "stored_caches", lambda model, d, precision="bf16": lambda rows: torch.tensor(
        list(rows), dtype=torch.float32))
    monkeypatch.setattr(vedje_motion, "_scores", lambda model, texts, pairs, caches, rho, zero_rho: np.array(
        [float(caches[c] == own[qi]) for qi, c in pairs]))
    result = evaluate(object(), data, 5)
    assert np.all(result["pair_stage1"] == 0.5) and np.all(result["pair_rerank"] == 1.0)
    top, _ = vedje_motion.stage1_top(data, query_rows, item_rows, 5)
    in_top = np.array([own[qi] in top[qi] for qi in range(len(query_rows))], float)
    assert np.array_equal(result["rerank@1"], np.maximum(in_top, result["stage1@1"]))


def test_twin_negatives_puts_the_twin_among_the_candidates_and_restores_the_recipe() -> None:
    from vedje_motion import twin_negatives

    import rde.vedje.training as training

    data = _pixel_tensors()
    recipe = training.negatives_for
    ranked = np.arange(14)  # the training clips, in some stage-1 order
    with twin_negatives(data):
        drawn = training.negatives_for(0, ranked, data.items.groups, data.items.groups[0], 3, 0, 0)
    assert drawn[0] == 1 and len(drawn) == 3 and 0 not in drawn  # query 0's clip is row 0, its twin row 1
    assert training.negatives_for is recipe
    assert 1 not in recipe(0, np.array([0, 2, 4, 6, 8, 10]), data.items.groups, data.items.groups[0], 3, 0, 0)


def test_a_frame_average_has_the_same_bits_whatever_the_frame_order() -> None:
    """8 frames × 512 float32 dimensions: a sum in the clip's own order differs in the last bits for
    the reversed clip; the stage-1 item embedding adds in key order, so the two are equal."""
    rng = np.random.default_rng(0)
    keys = [f"v:1:{f:06d}:000000" for f in range(0, 24, 3)]
    emb = {k: rng.normal(size=512).astype(np.float32) for k in keys}
    frames = [keys, keys[::-1]] * 200
    items = item_embeddings(frames, emb)
    assert all(np.array_equal(items[k], items[k + 1]) for k in range(0, len(frames), 2))
    naive = [np.mean([emb[k] for k in f], axis=0) for f in (keys, keys[::-1])]
    assert not np.array_equal(naive[0], naive[1])  # what the key order guards against
