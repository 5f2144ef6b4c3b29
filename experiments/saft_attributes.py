"""Positive control for SAFT: a retrieval task on real crops where in-batch false negatives are the problem.

Data: the pedestrian crops of the demo pool (real vtest.avi crops), each labelled with the basic
colour term (``models.backends.attributes``: Berlin–Kay terms, nearest CIELAB prototype) that most of
its upper band (15–50 % of the height) and of its lower band (55–90 %) takes, over the central 60 % of
the columns. Its caption is rendered from those two words alone, "a person in a {upper} top and
{lower} trousers", so many images share one caption: the commonest of the 24 combinations covers
38 % of the crops, and a batch of 64 holds about 24 copies of it. Plain ITC calls every copy but the
pair's own a negative; those are exactly the false negatives SASS's soft targets are for.

Teacher (the role UniME-V2 plays in the paper): the attributes themselves,
[onehot(upper); onehot(lower)] / √2 for an image and for a caption, so the teacher's cosine is 1 for the
same two colours, 0.5 for one, 0 for none. Student: the CPU dual encoder (``FeatureDualEncoder``:
the semantic-bridge vector and EfficientNet-Lite0's pooled features of three views of each crop, a
linear image projection trained, the text tower frozen, as SAFT prescribes).

Split by identity (the tracks): a seeded 60 % of the identities train, the rest are the gallery.
Queries, evaluated multi-match: every combination the gallery holds, and every upper and lower colour
alone ("a person in a black top"); relevant = every gallery crop whose measured attributes satisfy
it. mAP@20 per query, averaged over seeds, with a 95 % bootstrap interval over queries, and the paired
interval of each condition's difference from ITC. Conditions: zero-shot, ITC, ITC+SASS, SAFT
(ITC+SASS+ISD), with the same steps, learning rate and batches (the pairs' order is seeded per seed,
the same for every condition).

    .venv/bin/python experiments/saft_attributes.py [--seeds 10] [--epochs 40] [--lr 1e-3] [--wordings 6]
    .venv/bin/python experiments/saft_attributes.py --sweep 10,20,40,80   # the table by length, and the plot
"""

from __future__ import annotations

import argparse
import hashlib
import math
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from models.backends.slot_layout import COLOURS
from rde.common.metrics import ap_per_query, bootstrap_interval

POOL = Path(__file__).resolve().parents[1] / "data" / "demo_pool"
CONDITIONS = {"ITC": "itc", "ITC+SASS": "itc+sass", "SAFT (ITC+SASS+ISD)": "saft"}
UPPER, LOWER = (0.15, 0.5), (0.55, 0.9)  # the bands, as shares of the crop's height


# Wordings of one pair of colours: a caption names the same two attributes in one of them (a seeded
# draw per crop), so crops with the same colours share a meaning but mostly not a text
TEMPLATES = ("a person in a {u} top and {l} trousers", "someone wearing a {u} shirt with {l} pants",
             "a pedestrian dressed in a {u} jacket and {l} trousers", "{u} upper clothing, {l} lower clothing",
             "the walker has a {u} top on and {l} legwear", "a man or woman in {u} above and {l} below")


def caption(upper: str | None, lower: str | None, template: int = 0) -> str:
    """The caption (or query) for the colours given, in wording ``template`` (a query with one colour:
    the first wording's half)."""
    if upper and lower:
        return TEMPLATES[template].format(u=upper, l=lower)
    return f"a person in a {upper} top" if upper else f"a person in {lower} trousers"


def measured_colours(rgb: np.ndarray) -> tuple[str, str]:
    """(upper, lower): the colour term most of each band's central columns take."""
    from models.backends.attributes import masked_colours

    h, w = rgb.shape[:2]
    box = np.array([0, 0, w, h], float)
    return tuple(COLOURS[int(masked_colours(rgb, box, top, bottom, None).argmax())]  # type: ignore[return-value]
                 for top, bottom in (UPPER, LOWER))


def teacher_vector(upper: str | None, lower: str | None) -> np.ndarray:
    """[onehot(upper); onehot(lower)], L2-normalised (a query with one colour: that half only)."""
    v = np.zeros(2 * len(COLOURS), np.float32)
    if upper:
        v[COLOURS.index(upper)] = 1.0
    if lower:
        v[len(COLOURS) + COLOURS.index(lower)] = 1.0
    return v / np.linalg.norm(v)


@dataclass
class AttributeTask:
    """The task's features: ``images`` V×N×D (train crops), ``texts`` N×d (one caption per train crop,
    pair i = crop i), teacher vectors of both, and the gallery (test crops, view 0), the queries'
    text features and their relevance (Q×G booleans)."""

    images: np.ndarray
    texts: np.ndarray
    teacher_images: np.ndarray
    teacher_texts: np.ndarray
    gallery: np.ndarray
    queries: np.ndarray
    relevant: np.ndarray
    query_texts: list[str]

    @property
    def dims(self) -> dict[str, int]:
        text = self.texts.shape[1]
        return {"bridge_dim": text, "cnn_dim": self.images.shape[2] - text, "text_dim": text}


def multi_match_queries(attributes: Sequence[tuple[str, str]]) -> list[tuple[str | None, str | None]]:
    """Every combination present, then every upper and every lower colour alone (sorted)."""
    combos = sorted(set(attributes))
    return [*combos, *((u, None) for u in sorted({a[0] for a in attributes})),
            *((None, lo) for lo in sorted({a[1] for a in attributes}))]


def relevance(queries: Sequence[tuple[str | None, str | None]], attributes: Sequence[tuple[str, str]]) -> np.ndarray:
    """Q×G: gallery crop g satisfies query q (each colour it names matches)."""
    return np.array([[(u is None or u == a[0]) and (lo is None or lo == a[1]) for a in attributes]
                     for u, lo in queries], dtype=bool)


def identity_split(identities: Sequence[str], train_share: float = 0.6, seed: int = 0) -> np.ndarray:
    """True where a crop's identity is drawn for training (a seeded share of the identities)."""
    names = sorted(set(identities))
    rng = np.random.default_rng(seed)
    chosen = set(rng.permutation(names)[: round(train_share * len(names))])
    return np.array([i in chosen for i in identities])


def load_crops(seed: int = 0, views: int = 3) -> dict[str, np.ndarray]:
    """The image side, computed once and kept under .rde/cache: the train crops' tower features of
    ``views`` views, the gallery crops' (view 0), and each crop's measured colours."""
    from storage.locations import state_dir

    key = hashlib.sha256(f"{views}-{seed}-{UPPER}-{LOWER}".encode()).hexdigest()[:10]
    cache = state_dir() / "cache" / f"saft_attributes-{key}.npz"
    if cache.exists():
        with np.load(cache, allow_pickle=False) as f:
            return {k: f[k] for k in f.files}
    import pyarrow.parquet as pq

    from models.backends.registry import ModelRegistry
    from rde.common.expert_check import crop_identity
    from rde.common.image_decoding import decode_rgb
    from rde.profile import load_profile
    from rde.training.retrieval_features import image_features

    rows = [r for r in pq.read_table(POOL).to_pylist() if r["domain"] == "pedestrian"]
    rgbs = [decode_rgb(r["image_bytes"]) for r in rows]
    colours = np.array([measured_colours(rgb) for rgb in rgbs])
    train = identity_split([r["identity"] or crop_identity(r["pool_id"]) for r in rows], seed=seed)
    profile = load_profile("demo")
    registry = ModelRegistry.of(profile)
    bridge = next(registry.expert(s) for s in profile.models.experts if s.backend == "semantic-bridge")
    tr, te = np.flatnonzero(train), np.flatnonzero(~train)
    feats = image_features([rgbs[i] for i in tr], [rows[i]["pool_id"] for i in tr], bridge,
                           registry.image_embedder(), None, views=views, seed=seed)
    gallery = image_features([rgbs[i] for i in te], [rows[i]["pool_id"] for i in te], bridge,
                             registry.image_embedder(), None, views=1)
    out = {"images": feats.stacked(), "gallery": gallery.stacked()[0], "train_colours": colours[tr],
           "gallery_colours": colours[te]}
    cache.parent.mkdir(parents=True, exist_ok=True)
    np.savez(cache, **out)
    return out


def load_task(seed: int = 0, wordings: int = len(TEMPLATES)) -> AttributeTask:
    """The task on the demo pool's pedestrian crops: each train crop captioned in one of the first
    ``wordings`` wordings (a seeded draw; 1: every crop with the same colours has the same caption)."""
    from models.backends.registry import ModelRegistry
    from rde.profile import load_profile

    crops = load_crops(seed)
    profile = load_profile("demo")
    bridge = next(ModelRegistry.of(profile).expert(s) for s in profile.models.experts if s.backend == "semantic-bridge")
    train = [tuple(c) for c in crops["train_colours"].tolist()]
    gallery = [tuple(c) for c in crops["gallery_colours"].tolist()]
    drawn = np.random.default_rng(seed).integers(0, wordings, len(train))
    texts = [caption(u, lo, int(t)) for (u, lo), t in zip(train, drawn, strict=True)]
    queries = multi_match_queries(gallery)
    teacher = np.stack([teacher_vector(*a) for a in train])
    return AttributeTask(images=crops["images"], texts=bridge.encode_text(texts).astype(np.float32),
                         teacher_images=teacher, teacher_texts=teacher, gallery=crops["gallery"],
                         queries=bridge.encode_text([caption(*q) for q in queries]).astype(np.float32),
                         relevant=relevance(queries, gallery), query_texts=[caption(*q) for q in queries])


def synthetic_task(seed: int = 0, n_train: int = 256, n_gallery: int = 160, colours: int = 4, wordings: int = 6,
                   text_dim: int = 32, cnn_dim: int = 256, noise: float = 4.0, views: int = 2) -> AttributeTask:
    """The task's tiny synthetic twin (the regression guard's, seconds to train): ``colours`` upper
    and lower colours drawn with shares 50/25/15/10 %; an image's CNN part is a fixed random
    projection of its attributes' one-hots plus Gaussian noise of sd ``noise`` (fresh per view: the
    augmentation), its bridge part near zero (zero-shot at chance); a caption's frozen text vector
    is the sum of random vectors of its two colours and of one of ``wordings`` wordings, so crops
    with the same colours share a meaning, not a text; a query names the colours only."""
    rng = np.random.default_rng(seed)
    share = np.array([0.5, 0.25, 0.15, 0.1, *[0.05] * max(0, colours - 4)])[:colours]
    share = share / share.sum()
    names = [f"c{i}" for i in range(colours)]

    def draw(n: int) -> list[tuple[str, str]]:
        return [(names[rng.choice(colours, p=share)], names[rng.choice(colours, p=share)]) for _ in range(n)]

    train, gallery = draw(n_train), draw(n_gallery)
    upper, lower, wording = (rng.normal(size=(k, text_dim)) for k in (colours, colours, wordings))
    projection = rng.normal(size=(2 * colours, cnn_dim))

    def onehot(a: tuple[str | None, str | None]) -> np.ndarray:
        v = np.zeros(2 * colours)
        v[[names.index(a[0])] if a[0] else []] = 1.0
        v[[colours + names.index(a[1])] if a[1] else []] = 1.0
        return v / np.linalg.norm(v)

    def text(a: tuple[str | None, str | None], w: int | None) -> np.ndarray:
        v = sum((m[names.index(c)] for m, c in ((upper, a[0]), (lower, a[1])) if c), np.zeros(text_dim))
        v = v + (wording[w] if w is not None else 0.0)
        return v / np.linalg.norm(v)

    def image(a: tuple[str, str]) -> np.ndarray:
        cnn = onehot(a) @ projection + noise * rng.normal(size=cnn_dim)
        return np.concatenate([0.05 * rng.normal(size=text_dim), cnn])

    images = np.stack([np.stack([image(a) for a in train]) for _ in range(views)]).astype(np.float32)
    texts = np.stack([text(a, int(rng.integers(wordings))) for a in train]).astype(np.float32)
    queries = multi_match_queries(gallery)
    teacher = np.stack([onehot(a) for a in train]).astype(np.float32)
    return AttributeTask(images=images, texts=texts, teacher_images=teacher, teacher_texts=teacher,
                         gallery=np.stack([image(a) for a in gallery]).astype(np.float32),
                         queries=np.stack([text(q, None) for q in queries]).astype(np.float32),
                         relevant=relevance(queries, gallery), query_texts=[caption(*q) for q in queries])


def per_query_ap(model, task: AttributeTask, k: int = 20) -> np.ndarray:
    """AP@k of every query (each has at least one relevant crop by construction)."""
    with torch.no_grad():
        g = model.encode_image(torch.tensor(task.gallery)).numpy()
        q = model.encode_text(torch.tensor(task.queries)).numpy()
    ranked = np.argsort(-(q @ g.T), axis=1, kind="stable")[:, :k]
    rankings = [list(task.relevant[i, ranked[i]]) for i in range(len(ranked))]
    return np.array(ap_per_query(rankings, task.relevant.sum(axis=1).tolist(), k), dtype=float)


def train_condition(task: AttributeTask, objective: str, seed: int, epochs: int, lr: float,
                    batch_size: int = 64, alpha: float = 1.0, beta: float = 0.75):
    """A student trained with ``objective`` (the engine's ``train``, SAFT's schedule shape: linear
    warm-up from lr/10 over 10 % of the steps, then cosine), returned with its losses."""
    from models.retrieval.dual_encoder import FeatureDualEncoder
    from rde.training.retrieval_training import TrainConfig, TrainingPairs, train

    torch.manual_seed(seed)
    model = FeatureDualEncoder(**task.dims)
    pairs = TrainingPairs(torch.tensor(task.images), torch.arange(len(task.texts)), torch.tensor(task.texts),
                          torch.tensor(task.teacher_images), torch.tensor(task.teacher_texts))
    cfg = TrainConfig(objective=objective, epochs=epochs, batch_size=batch_size, lr_start=lr / 10, lr_peak=lr,
                      seed=seed, alpha=alpha, beta=beta)
    result = train(model, pairs, cfg)
    model.eval()
    return model, result


def in_batch_false_negatives(task: AttributeTask, batch_size: int = 64) -> float:
    """The share of a pair's in-batch negatives (uniform batches) whose caption is its own."""
    counts = Counter(map(tuple, task.teacher_texts.round(4).tolist()))
    n = len(task.texts)
    same = sum(c * (c - 1) for c in counts.values()) / (n * (n - 1))
    return same


def seed_scores(task: AttributeTask, objective: str, seeds: int, epochs: int, lr: float) -> list[np.ndarray]:
    """Per seed 0..seeds-1, the per-query AP@20 of a student trained with ``objective``."""
    return [per_query_ap(train_condition(task, objective, seed, epochs, lr)[0], task) for seed in range(seeds)]


def run(task: AttributeTask, seeds: int, epochs: int, lr: float) -> dict[str, np.ndarray]:
    """Per condition, the per-query AP@20 averaged over seeds (zero-shot: one, it is deterministic)."""
    from models.retrieval.dual_encoder import FeatureDualEncoder

    out = {"zero-shot (semantic bridge)": per_query_ap(FeatureDualEncoder(**task.dims).eval(), task)}
    for name, objective in CONDITIONS.items():
        began = time.perf_counter()
        scores = seed_scores(task, objective, seeds, epochs, lr)
        per_seed = [s.mean() for s in scores]
        out[name] = np.mean(scores, axis=0)
        print(f"{name}: mAP@20 per seed {', '.join(f'{v:.3f}' for v in per_seed)} "
              f"({time.perf_counter() - began:.0f} s)", flush=True)
    return out


def table(per_query: dict[str, np.ndarray]) -> str:
    """Markdown: mAP@20 with its interval over queries, and the paired difference from ITC."""
    lines = ["| condition | mAP@20 [95 % interval over queries] | − ITC (paired) |", "|---|---|---|"]
    for name, values in per_query.items():
        low, high = bootstrap_interval(values)
        diff = "-"
        if name != "ITC" and "ITC" in per_query:
            d = values - per_query["ITC"]
            dl, dh = bootstrap_interval(d)
            diff = f"{100 * d.mean():+.1f} [{100 * dl:+.1f}, {100 * dh:+.1f}] points"
        lines.append(f"| {name} | {values.mean():.3f} [{low:.3f}, {high:.3f}] | {diff} |")
    return "\n".join(lines)


def sweep_plot(task: AttributeTask, epochs: Sequence[int], seeds: int, lr: float, path: str) -> str:
    """mAP@20 against the training length for ITC and SAFT (mean over seeds, with each seed's point),
    written as a PNG to ``path``; returns the table of the means."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines = ["| epochs (steps) | ITC | ITC+SASS | SAFT | SAFT − ITC |", "|---|---|---|---|---|"]
    means: dict[str, list[float]] = {name: [] for name in CONDITIONS}
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for e in epochs:
        row = {}
        for name, objective in CONDITIONS.items():
            per_seed = [s.mean() for s in seed_scores(task, objective, seeds, e, lr)]
            row[name] = float(np.mean(per_seed))
            means[name].append(row[name])
            ax.scatter([e] * len(per_seed), per_seed, s=6, alpha=0.35, color=COLOURS_PLOT[name])
        steps = e * math.ceil(len(task.texts) / 64)
        lines.append(f"| {e} ({steps}) | {row['ITC']:.3f} | {row['ITC+SASS']:.3f} | "
                     f"{row['SAFT (ITC+SASS+ISD)']:.3f} | {100 * (row['SAFT (ITC+SASS+ISD)'] - row['ITC']):+.1f} |")
    for name, values in means.items():
        ax.plot(list(epochs), values, marker="o", label=name, color=COLOURS_PLOT[name])
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(epochs), [str(e) for e in epochs])
    ax.set_xlabel("epochs (batch 64)")
    ax.set_ylabel("multi-match mAP@20")
    ax.set_title(f"Attribute control: captions in {len(TEMPLATES)} wordings, {seeds} seeds")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return "\n".join(lines)


COLOURS_PLOT = {"ITC": "tab:red", "ITC+SASS": "tab:orange", "SAFT (ITC+SASS+ISD)": "tab:blue"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--epochs", type=int, default=40)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--wordings", type=int, default=len(TEMPLATES),
                        help="captions' wordings (1: one caption per colour pair)")
    parser.add_argument("--sweep", default=None, help="epochs to sweep, e.g. 10,20,40,80: a table and --plot")
    parser.add_argument("--plot", default="docs/results/img/saft_attributes.png")
    args = parser.parse_args()
    torch.set_num_threads(2)
    task = load_task(wordings=args.wordings)
    print(f"{len(task.texts)} training pairs ({len(set(map(tuple, task.teacher_texts.tolist())))} colour pairs, "
          f"{len({t.tobytes() for t in task.texts})} distinct captions; {100 * in_batch_false_negatives(task):.0f} % "
          "of a pair's in-batch negatives share its colours), "
          f"gallery {len(task.gallery)} crops, {len(task.queries)} queries; {args.epochs} epochs, lr {args.lr}, "
          f"{args.seeds} seeds")
    if args.sweep:
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        print(sweep_plot(task, [int(e) for e in args.sweep.split(",")], args.seeds, args.lr, args.plot))
        print(f"plot: {args.plot}")
        return
    print(table(run(task, args.seeds, args.epochs, args.lr)))


if __name__ == "__main__":
    main()
