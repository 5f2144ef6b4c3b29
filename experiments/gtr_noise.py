"""Controlled measurement: does GTR+ adaptive confidence weighting resist caption noise here?

Pairs: the demo build-largefine captions (features cached by saft_ablation.py), person
identities from the pool's tracks. Identities are split: 30 % (those with ≥ 2 captioned images)
are the person-search test set — every test caption is a query over the test images, a match is
any image of the same identity — the rest train. Noise: 30 % of the training pairs get a caption
of another identity (a permutation among them; q_txt travels with its text, as it would). Models:
ITC + ITM with no weighting, FixWeight (w = q_txt) and AdaWeight (GMM on ŝ each epoch, C^β),
three seeds each. Also how well the last GMM's "noisy" assignment (C < 0.5) finds the injected
noise.

    .venv/bin/python experiments/gtr_noise.py [--epochs 6] [--noise 0.3]
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import numpy as np
import torch
from saft_ablation import feature_cache, largefine_root, load_features, model_dims, training_captions

from models.retrieval.dual_encoder import FeatureDualEncoder
from rde.common.metrics import person_search_metrics
from rde.training.retrieval_training import TrainConfig, TrainingPairs, TrainResult, train


@dataclass
class Split:
    """Person-search split by identity: test pairs are the queries over the test images."""

    identity: np.ndarray  # per pair
    image_identity: dict[int, str | None]  # per image index
    test_ids: set[str]
    train_pairs: np.ndarray
    test_pairs: np.ndarray
    test_images: list[int]


def load_run(output: str | None) -> tuple[str, dict[str, np.ndarray], list[dict], Split]:
    """A build-largefine run's folder, its cached features, its training captions and the identity split."""
    root = largefine_root(output)
    f = load_features(root)
    caps = training_captions(root)
    assert len(caps) == len(f["pair_image"]), f"feature cache is stale: delete {feature_cache(root)}"
    return root, f, caps, identity_split(f, caps)


def identity_split(f: dict[str, np.ndarray], caps: list[dict], share: float = 0.3, seed: int = 0) -> Split:
    """``share`` of the identities with ≥ 2 captioned images are the test set, the rest train."""
    identity = np.array([c["identity"] for c in caps])
    image_identity = {int(i): identity[k] for k, i in enumerate(f["pair_image"])}
    rng = np.random.default_rng(seed)
    views: dict[str, int] = {}
    for v in image_identity.values():
        if v is not None:
            views[v] = views.get(v, 0) + 1
    ids = sorted(v for v, n in views.items() if n >= 2)
    test_ids = set(rng.choice(ids, size=int(share * len(ids)), replace=False).tolist())
    test_pairs = np.flatnonzero(np.isin(identity, list(test_ids)))
    train_pairs = np.flatnonzero(~np.isin(identity, list(test_ids)))
    test_images = sorted({int(f["pair_image"][p]) for p in test_pairs})
    return Split(identity, image_identity, test_ids, train_pairs, test_pairs, test_images)


def evaluate(model: FeatureDualEncoder, f: dict[str, np.ndarray], split: Split) -> dict[str, float]:
    """R@1/5/10, mAP, mINP of the test captions over the test images."""
    with torch.no_grad():
        g = model.encode_image(torch.tensor(f["images"][0, split.test_images])).numpy()
        q = model.encode_text(torch.tensor(f["texts"][split.test_pairs])).numpy()
    return person_search_metrics(q @ g.T, split.identity[split.test_pairs].tolist(),
                                 [split.image_identity[i] for i in split.test_images])


def train_and_evaluate(f: dict[str, np.ndarray], split: Split, texts: np.ndarray, q_txt: np.ndarray,
                       noisy: np.ndarray, weighting: str, seed: int, epochs: int, lr: float,
                       pairs_index: np.ndarray | None = None) -> dict[str, float]:
    """ITC + ITM on the training pairs (``pairs_index``, default all training pairs) with these
    texts and q_txt; test metrics, and for AdaWeight the last GMM's noise detection (C < 0.5 =
    flagged noisy) against ``noisy``."""
    index = split.train_pairs if pairs_index is None else pairs_index
    model, result = train_pairs(f, index, texts, q_txt, weighting, seed, epochs, lr)
    m = evaluate(model, f, split)
    if weighting == "ada":
        m.update(detection(result.epochs[-1].confidence < 0.5, noisy))
    return m


def train_pairs(f: dict[str, np.ndarray], index: np.ndarray, texts: np.ndarray, q_txt: np.ndarray, weighting: str,
                seed: int, epochs: int, lr: float) -> tuple[FeatureDualEncoder, TrainResult]:
    """A fresh dual encoder trained with ITC + ITM on the pairs ``index`` (these texts and q_txt)."""
    pairs = TrainingPairs(torch.tensor(f["images"]), torch.tensor(f["pair_image"][index]),
                          torch.tensor(texts), q_txt=torch.tensor(q_txt))
    torch.manual_seed(seed)
    model = FeatureDualEncoder(**model_dims(f))
    cfg = TrainConfig(objective="itc", weighting=weighting, use_itm=True, epochs=epochs,
                      lr_start=lr / 10, lr_peak=lr, seed=seed)
    return model, train(model, pairs, cfg)


def detection(flagged: np.ndarray, noisy: np.ndarray) -> dict[str, float]:
    """How well ``flagged`` finds the corrupted pairs: precision and recall."""
    tp = int((flagged & noisy).sum())
    return {"precision": tp / max(1, int(flagged.sum())), "recall": tp / max(1, int(noisy.sum()))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--noise", type=float, default=0.3)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--output", default=None, help="the build-largefine run's --output (default: the profile's)")
    args = parser.parse_args()
    torch.set_num_threads(2)
    _, f, _, split = load_run(args.output)
    identity, train_pairs = split.identity, split.train_pairs
    print(f"train: {len(train_pairs)} pairs; test: {len(split.test_pairs)} caption queries over "
          f"{len(split.test_images)} images of {len(split.test_ids)} identities; noise {args.noise:.0%}; "
          f"{args.epochs} epochs; ITC + ITM")

    print("\n| weighting | R@1 | R@5 | R@10 | mAP | mINP | noisy found: precision | recall |\n"
          "|---|---|---|---|---|---|---|---|")
    zero = evaluate(FeatureDualEncoder(**model_dims(f)), f, split)
    print(f"| zero-shot | {zero['R@1']:.3f} | {zero['R@5']:.3f} | {zero['R@10']:.3f} | {zero['mAP']:.3f} | "
          f"{zero['mINP']:.3f} | - | - |")
    for weighting in ("none", "fix", "ada"):
        rows = []
        for seed in range(args.seeds):
            srng = np.random.default_rng(100 + seed)
            texts = f["texts"][train_pairs].copy()
            q_txt = f["q_txt"][train_pairs].copy()
            noisy = np.zeros(len(train_pairs), bool)
            chosen = srng.choice(len(train_pairs), size=int(args.noise * len(train_pairs)), replace=False)
            perm = srng.permutation(chosen)
            ids_train = identity[train_pairs]
            # a derangement across identities: rotate until no caption stays with its own identity
            for _ in range(20):
                if not np.any(ids_train[perm] == ids_train[chosen]):
                    break
                perm = srng.permutation(chosen)
            texts[chosen], q_txt[chosen] = f["texts"][train_pairs][perm], f["q_txt"][train_pairs][perm]
            noisy[chosen] = ids_train[perm] != ids_train[chosen]
            rows.append(train_and_evaluate(f, split, texts, q_txt, noisy, weighting, seed, args.epochs, args.lr))
        cells = [mean_sd(rows, key) for key in ("R@1", "R@5", "R@10", "mAP", "mINP", "precision", "recall")]
        print(f"| {weighting} | " + " | ".join(cells) + " |")


def mean_sd(rows: list[dict[str, float]], key: str) -> str:
    """``mean ± sd`` (sample sd) of ``key`` over the rows that have it; ``-`` when none does."""
    vals = np.array([r[key] for r in rows if key in r])
    if not len(vals):
        return "-"
    return f"{vals.mean():.3f} ± {vals.std(ddof=1):.3f}" if len(vals) > 1 else f"{vals.mean():.3f}"


if __name__ == "__main__":
    main()
