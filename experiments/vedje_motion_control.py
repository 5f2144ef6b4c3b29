"""Positive control for VEDJE: clips in which only the order of the frames says which way a person moves.

Each clip is T frames of one real pedestrian crop of the demo pool pasted onto one real background
window of vtest.avi (a random square of a random frame), moving left, right, towards the camera (the
crop grows), away (it shrinks), or standing still, at a seeded start and speed. Its caption names the
crop's measured colours (``saft_attributes.measured_colours``, the attribute expert's colour terms) and
the motion: "a person in a black top and gray trousers walking to the left". Every moving clip comes
with its time-reversed twin (the same frames backwards, the opposite direction) and every clip with
its mirror image (left and right swap: horizontal flips give twice the clips for free).

Relevance is multi-match: every clip whose colours and motion the caption names. Stage 1 is the
attribute expert; a clip's stage-1 vector is the frame average, and since every frame shows the same
crop, we take the crop's embedding once, for the clip, its twin and its mirror. (Embedding each
composite frame costs 0.3 s for the expert's detector: 80 minutes for this set.) So stage 1 is at
chance on the direction by construction and sees the colours. The split is by crop identity, with a
seeded 70 % of the pool's tracks in train.

The frozen backbone is the profile's image embedder; its 7×7 feature grid is average-pooled to
``--grid``² patches. The compressor's memory projections scale with the patches, so 4×4 halves a step
here, and position survives at that resolution. The reranker is the profile's ``vedje`` section (the
joint encoder truncated to ``--layers``), trained for ``--steps`` steps with ``--batch`` queries and
the recipe's losses, with VTM negatives from the stage-1 top ``--negatives-from``. Evaluation on the
test split: stage-1 and rerank R@1/5/10 at N_c = 20, and pair accuracy (the query's clip scored above
its reversed twin). Both are repeated with each clip's frames shuffled at evaluation, where the gain
must vanish if it comes from the order.

Where the order is lost: per seed, how much of a cache its frames change (``cache_order``: the
frames' spread and the distance to the reversed twin's cache, against the backbone's own spread),
before and after training; ``vedje_motion.probes`` (direction probes on the backbone and the trained
caches) and the same probes on the patch-averaged backbone; ``vedje_motion.response`` (the [CLS]'s
attention on the cache, the query × clip interaction). ``--patch-positions`` and
``--compressor-norm pre`` train the compressor variants; ``--twin-negatives`` puts each training
query's reversed twin among its VTM candidates (every step's loss then rewards reading the order);
``--untrained-only`` prints the cache measures of the four compressors untrained and stops.

    .venv/bin/python experiments/vedje_motion_control.py [--clips 700] [--steps 2000] [--seeds 1]
        [--patch-positions] [--compressor-norm pre] [--twin-negatives] [--untrained-only]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import torch
from saft_attributes import POOL, measured_colours
from vedje_motion import (
    HEADER,
    KS,
    PROBE_VIEWS,
    evaluate,
    model_spec,
    new_model,
    probe_accuracy,
    probe_views,
    probes,
    response,
    save_report,
    shuffled,
    summarise,
    table,
    train,
    twin_negatives,
)

from entry.motion_clips import PHRASE, REVERSE, directions_of, twins_of
from rde.vedje.data import ItemSet
from rde.vedje.training import VedjeTensors

VIDEO = Path(__file__).resolve().parents[1] / ".rde" / "demo-videos" / "vtest.avi"  # `make videos` fetches it
STILL = "stands still"
MOVES = (*REVERSE, STILL)
MIRROR = {"walks to the left": "walks to the right", "walks to the right": "walks to the left"}
WORDS = {**PHRASE, STILL: "standing still"}
VERSION = 1  # of the clips' content (part of the cache key): bump on any change of how clips are made


def backgrounds(video: Path, count: int = 12) -> list[np.ndarray]:
    """``count`` frames spread over the video (RGB)."""
    cap = cv2.VideoCapture(str(video))
    total = int(cap.get(cv2.CAP_PROP_FRAME_COUNT))
    out = []
    for f in np.linspace(0, total - 1, count).astype(int):
        cap.set(cv2.CAP_PROP_POS_FRAMES, int(f))
        ok, frame = cap.read()
        if ok:
            out.append(cv2.cvtColor(frame, cv2.COLOR_BGR2RGB))
    cap.release()
    if not out:
        raise SystemExit(f"no frames read from {video}: run `make videos`")
    return out


def placements(move: str, frames: int, rng: np.random.Generator) -> list[tuple[float, float]]:
    """(left edge as a share of the free width, height as a share of the window) per frame: a sideways
    walk covers a seeded 45–70 % of the width; a walk towards the camera grows the crop from a
    seeded 30–45 % of the window by 35–50 points (away: the same backwards); standing keeps one of each."""
    share = np.linspace(0.0, 1.0, frames)
    if move in MIRROR:
        span = float(rng.uniform(0.45, 0.7))
        start = float(rng.uniform(0.0, 1.0 - span))
        lefts = start + span * (share if move == "walks to the right" else 1 - share)
        return [(float(x), 0.6) for x in lefts]
    if move == STILL:
        return [(float(rng.uniform(0.1, 0.9)), float(rng.uniform(0.4, 0.75)))] * frames
    low, rise = float(rng.uniform(0.3, 0.45)), float(rng.uniform(0.35, 0.5))
    grow = share if move == "walks towards the camera" else 1 - share
    return [(0.5, low + rise * float(g)) for g in grow]


def compose(crop: np.ndarray, window: np.ndarray, places: Sequence[tuple[float, float]]) -> list[np.ndarray]:
    """The clip's frames: ``crop`` pasted onto the square ``window`` at each placement, feet near the bottom."""
    size = window.shape[0]
    aspect = crop.shape[1] / crop.shape[0]
    out = []
    for left_share, height_share in places:
        height = max(4, int(height_share * size))
        width = max(2, min(size, int(height * aspect)))
        left = int(left_share * (size - width))
        top = size - height - 2
        frame = window.copy()
        frame[top:top + height, left:left + width] = cv2.resize(crop, (width, height), interpolation=cv2.INTER_AREA)
        out.append(frame)
    return out


@dataclasses.dataclass
class ControlClips:
    """The clips as an item set (rows: a clip, its reversed twin, its mirror, the mirror's twin), the
    frames by key, and each item's crop (its pool id: stage 1 embeds the crop)."""

    items: ItemSet
    images: dict[str, np.ndarray]
    crop_of: list[str]
    crops: dict[str, np.ndarray]


def control_clips(clips: int, frames: int = 8, size: int = 96, seed: int = 0) -> ControlClips:
    """``clips`` composite clips, the moves in turn, each with its twin and mirror (see the module doc)."""
    import pyarrow.parquet as pq

    from rde.common.expert_check import crop_identity
    from rde.common.image_decoding import decode_rgb

    rows = [r for r in pq.read_table(POOL).to_pylist() if r["domain"] == "pedestrian"]
    rng = np.random.default_rng(seed)
    identity = {r["pool_id"]: r["identity"] or crop_identity(r["pool_id"]) for r in rows}
    tracks = sorted(set(identity.values()))
    train_tracks = set(rng.permutation(tracks)[: round(0.7 * len(tracks))])
    scenes = backgrounds(VIDEO)
    images: dict[str, np.ndarray] = {}
    crops: dict[str, np.ndarray] = {}
    ids, groups, splits, keys, texts, crop_of = [], [], [], [], [], []
    for c in range(clips):
        row = rows[int(rng.integers(len(rows)))]
        crop = crops.setdefault(row["pool_id"], decode_rgb(row["image_bytes"]))
        upper, lower = measured_colours(crop)
        move = MOVES[c % len(MOVES)]
        scene = scenes[int(rng.integers(len(scenes)))]
        y, x = int(rng.integers(0, scene.shape[0] - size)), int(rng.integers(0, scene.shape[1] - size))
        shown = compose(crop, scene[y:y + size, x:x + size], placements(move, frames, rng))
        split = "train" if identity[row["pool_id"]] in train_tracks else "test"
        mirrored = [np.ascontiguousarray(f[:, ::-1]) for f in shown]
        for view, pictures, way in (("", shown, move), (":mirrored", mirrored, MIRROR.get(move, move))):
            names = [f"c{c:05d}{view}:f{t}" for t in range(frames)]  # key order = time order
            images.update(zip(names, pictures, strict=True))
            orders = ((names, way), (names[::-1], REVERSE[way])) if way in REVERSE else ((names, way),)
            for order, shown_way in orders:
                ids.append(f"c{c:05d}{view}" + ("" if order is names else ":reversed"))
                groups.append(f"{upper}/{lower}:{shown_way}")
                splits.append(split)
                keys.append(order)
                texts.append(f"a person in a {upper} top and {lower} trousers {WORDS[shown_way]}")
                crop_of.append(row["pool_id"])
    items = ItemSet(ids, groups, splits, keys, texts, list(range(len(ids))), lambda ks: {k: images[k] for k in ks})
    return ControlClips(items, images, crop_of, crops)


def pooled_grid(maps: np.ndarray, grid: int) -> np.ndarray:
    """N×49×d feature maps (7×7, row-major) average-pooled to N×grid²×d."""
    x = torch.from_numpy(maps).reshape(len(maps), 7, 7, -1).permute(0, 3, 1, 2)
    x = torch.nn.functional.adaptive_avg_pool2d(x, grid)
    return x.permute(0, 2, 3, 1).reshape(len(maps), grid * grid, -1).numpy()


def control_tensors(clips: int, frames: int, grid: int, seed: int) -> VedjeTensors:
    """The frozen inputs (the demo profile's backbone pooled to ``grid``², the attribute expert on each
    crop as stage 1), computed once and kept in ``.rde/cache/vedje_control_<key>.pt``."""
    from models.backends.interfaces import l2_normalize
    from models.backends.registry import ModelRegistry
    from rde.profile import load_profile
    from storage import content_key
    from storage.locations import state_dir

    profile = load_profile("demo")
    stage1_spec = next(s for s in profile.models.experts if s.backend == "attributes")
    key = content_key(kind="vedje-control", version=VERSION, clips=clips, frames=frames, grid=grid, seed=seed,
                      backbone=profile.models.image_embedder.model_dump(), stage1=stage1_spec.model_dump())
    path = state_dir() / "cache" / f"vedje_control_{key[:16]}.pt"
    made = control_clips(clips, frames, seed=seed)
    if not path.exists():
        reg = ModelRegistry.of(profile)
        backbone, stage1 = reg.image_embedder(), reg.expert(stage1_spec)
        began = time.perf_counter()
        names = sorted(made.images)
        feats = [pooled_grid(backbone.feature_maps([made.images[k] for k in names[s:s + 64]]), grid)
                 for s in range(0, len(names), 64)]
        pool_ids = sorted(made.crops)
        crop_emb = stage1.encode_image([made.crops[p] for p in pool_ids])
        print(f"features of {len(names)} frames and {len(pool_ids)} crops: {time.perf_counter() - began:.0f} s",
              flush=True)
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"names": names, "features": torch.from_numpy(np.concatenate(feats)).half(),
                    "pool_ids": pool_ids, "crop_emb": torch.from_numpy(np.asarray(crop_emb, np.float32)),
                    "query_emb": torch.from_numpy(np.asarray(stage1.encode_text(made.items.query_texts), np.float32))},
                   path)
    saved = torch.load(path)
    index = {k: r for r, k in enumerate(saved["names"])}
    crop_row = {p: r for r, p in enumerate(saved["pool_ids"])}
    item_emb = l2_normalize(saved["crop_emb"][[crop_row[p] for p in made.crop_of]].numpy())
    return VedjeTensors(made.items, saved["features"], torch.tensor([[index[k] for k in f] for f in made.items.frames]),
                        torch.from_numpy(item_emb), torch.from_numpy(l2_normalize(saved["query_emb"].numpy())))


def describe(data: VedjeTensors) -> str:
    it = data.items
    moving = sum(i.endswith(":reversed") for i in it.item_ids)
    return (f"{len(it.item_ids)} clips ({moving} reversed twins), T = {data.item_frames.shape[1]}, "
            f"{data.frame_features.shape[1]} patches × {data.frame_features.shape[2]}; train "
            f"{it.splits.count('train')}, test {it.splits.count('test')}; {len(set(it.groups))} relevance groups")


def cache_order(model: Any, data: VedjeTensors, limit: int = 200) -> dict[str, float]:
    """How much of a stored cache the frame order can change, on up to ``limit`` test clips with their
    twins: the frames' spread (‖Z_t − mean_t Z‖ / ‖Z‖ over the per-frame token groups) and the cache's
    distance to its reversed twin's (‖Z(v) − Z(v reversed)‖ / ‖Z(v)‖). A cache whose frames are alike
    looks the same forwards and backwards, whatever the joint encoder does with it."""
    from rde.vedje.training import stored_caches

    twins = twins_of(data.items.item_ids)
    test = set(data.rows("test")[0])
    rows = [r for r in sorted(test) if r in twins and twins[r] in test and not data.items.item_ids[r].endswith(
        ":reversed")][:limit]
    caches = stored_caches(model, data)
    with torch.no_grad():
        z, zr = caches(rows).double(), caches([twins[r] for r in rows]).double()
        x = data.features(torch.tensor(rows)).double()  # N×T×P×d_v, the backbone's side for reference
    frames = data.item_frames.shape[1]

    def spread(v: torch.Tensor) -> float:
        per_frame = v.reshape(len(rows), frames, -1)
        return float(((per_frame - per_frame.mean(dim=1, keepdim=True)).flatten(1).norm(dim=1)
                      / v.flatten(1).norm(dim=1)).mean())

    twin_gap = (z - zr).flatten(1).norm(dim=1) / z.flatten(1).norm(dim=1)
    return {"clips": len(rows), "frame spread": spread(z), "twin distance": float(twin_gap.mean()),
            "backbone frame spread": spread(x), "backbone frame spread, patches averaged": spread(x.mean(2))}


def averaged_patch_probes(data: VedjeTensors) -> dict[str, float]:
    """``vedje_motion.probes``'s views on the backbone's features averaged over the patches (d_v per
    frame): what a reader that takes the patches as a set, like the compressor's cross-attention
    without patch codes, can get of the direction (5 classes here, with standing still)."""
    directions = directions_of(data.items.groups)
    tr, te = data.rows("train")[0], data.rows("test")[0]
    train_views, test_views = (probe_views(data.features(torch.tensor(r)).mean(2)) for r in (tr, te))
    return {f"backbone (patches averaged), {v}": probe_accuracy(train_views[v].numpy(), [directions[i] for i in tr],
                                                                test_views[v].numpy(), [directions[i] for i in te])
            for v in PROBE_VIEWS}


def model_options(args: argparse.Namespace) -> dict[str, Any]:
    """The model options the command line sets (``build_model`` overrides)."""
    options = {"patch_positions": args.patch_positions, "compressor_norm": args.compressor_norm,
               "encoder_dropout": args.encoder_dropout}
    return options | ({"dropout": args.compressor_dropout} if args.compressor_dropout is not None else {})


def untrained(data: VedjeTensors, args: argparse.Namespace, seed: int) -> Any:
    """The model ``train`` starts from (same seed and shape), for the cache measures before training."""
    spec = model_spec(argparse.Namespace(profile="demo", encoder=None))
    return new_model(data, spec, args.layers, seed, **model_options(args)).eval()


def run(data: VedjeTensors, args: argparse.Namespace) -> dict[str, Any]:
    """Per seed: train; measure where the order goes (``cache_order`` untrained and trained, the
    probes, the encoder's response); evaluate in order and with the frames shuffled."""
    results: dict[str, list[dict[str, np.ndarray]]] = {"in order": [], "frames shuffled at evaluation": []}
    seconds, order = [], []
    train_rows = data.items.splits.count("train")
    epochs = max(1, round(args.steps * args.batch / train_rows))
    for seed in range(args.seeds):
        targs = argparse.Namespace(profile="demo", encoder=None, layers=args.layers, epochs=epochs,
                                   negatives_from=args.negatives_from, batch=args.batch, candidates=None)
        with twin_negatives(data) if args.twin_negatives else contextlib.nullcontext():
            model, sec = train(data, targs, seed, **model_options(args))
        seconds.append(round(sec, 1))
        order.append({"untrained": cache_order(untrained(data, args, seed), data), "trained": cache_order(model, data),
                      "probes": probes(model, data) | averaged_patch_probes(data), "response": response(model, data)})
        print(f"cache order, probes, the encoder's response: {order[-1]}", flush=True)
        results["in order"].append(evaluate(model, data, args.n_c))
        results["frames shuffled at evaluation"].append(evaluate(model, shuffled(data, 1000 + seed), args.n_c))
        steps = epochs * -(-train_rows // args.batch)
        print(f"seed {seed}: {epochs} epochs ({steps} steps) in {sec:.0f} s", flush=True)
    return {"summary": {c: summarise(r) for c, r in results.items()}, "seconds": seconds, "epochs": epochs,
            "cache order": order,
            "raw": {c: [{k: v.tolist() for k, v in r.items()} for r in rs] for c, rs in results.items()}}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clips", type=int, default=700, help="composite clips (each gives 2 to 4 items)")
    parser.add_argument("--frames", type=int, default=8)
    parser.add_argument("--grid", type=int, default=4, help="backbone grid side after pooling (7: as extracted)")
    parser.add_argument("--steps", type=int, default=2000, help="training steps (rounded to whole epochs)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--negatives-from", type=int, default=20)
    parser.add_argument("--n-c", type=int, default=20)
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0, help="of the clips")
    parser.add_argument("--patch-positions", action="store_true",
                        help="add sinusoidal patch codes to the compressor's memory (VedjeShape.patch_positions)")
    parser.add_argument("--compressor-norm", choices=("post", "pre"), default="post")
    parser.add_argument("--twin-negatives", action="store_true",
                        help="each training query's VTM candidates hold its clip's reversed twin (vedje_motion)")
    parser.add_argument("--encoder-dropout", type=float, default=None,
                        help="the joint encoder's dropout in training (VedjeSpec.encoder_dropout; default: its own)")
    parser.add_argument("--compressor-dropout", type=float, default=None,
                        help="the compressor's and delta head's dropout (VedjeSpec.dropout; default: the profile's)")
    parser.add_argument("--untrained-only", action="store_true",
                        help="print the cache measures of the untrained compressor variants and stop")
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    start = time.perf_counter()
    data = control_tensors(args.clips, args.frames, args.grid, args.seed)
    print(describe(data), flush=True)
    if args.untrained_only:
        for norm in ("post", "pre"):
            for placed in (False, True):
                variant = argparse.Namespace(**vars(args) | {"compressor_norm": norm, "patch_positions": placed})
                print(f"untrained, {norm}-norm, patch positions {placed}: "
                      f"{cache_order(untrained(data, variant, 0), data)}", flush=True)
        return {}
    report = run(data, args)
    report["args"] = vars(args)
    print(f"\n{HEADER}")
    for name, s in report["summary"].items():
        print(table(name, s))
    variant = "-patch-positions" if args.patch_positions else ""
    variant += "-pre-norm" if args.compressor_norm == "pre" else ""
    variant += "-twin-negatives" if args.twin_negatives else ""
    variant += f"-encoder-dropout-{args.encoder_dropout:g}" if args.encoder_dropout is not None else ""
    variant += f"-compressor-dropout-{args.compressor_dropout:g}" if args.compressor_dropout is not None else ""
    out = save_report(report, f"vedje_motion_control{variant}")
    print(f"\n{time.perf_counter() - start:.0f} s; raw results in {out}; R@K at K = {KS}")
    return report


if __name__ == "__main__":
    main()
