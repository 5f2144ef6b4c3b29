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

import numpy as np
import torch
from saft_ablation import feature_cache, largefine_root, load_features, model_dims, training_captions

from models.retrieval.dual_encoder import FeatureDualEncoder
from rde.common.metrics import person_search_metrics
from rde.training.retrieval_training import TrainConfig, TrainingPairs, train


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--noise", type=float, default=0.3)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--output", default=None, help="the build-largefine run's --output (default: the profile's)")
    args = parser.parse_args()
    torch.set_num_threads(2)
    root = largefine_root(args.output)
    f = load_features(root)
    caps = training_captions(root)
    assert len(caps) == len(f["pair_image"]), f"feature cache is stale: delete {feature_cache(root)}"
    identity = np.array([c["identity"] for c in caps])
    image_identity = {int(i): identity[k] for k, i in enumerate(f["pair_image"])}
    rng = np.random.default_rng(0)
    views = {}
    for v in image_identity.values():
        if v is not None:
            views[v] = views.get(v, 0) + 1
    ids = sorted(v for v, n in views.items() if n >= 2)
    test_ids = set(rng.choice(ids, size=int(0.3 * len(ids)), replace=False).tolist())
    test_pairs = np.flatnonzero(np.isin(identity, list(test_ids)))
    train_pairs = np.flatnonzero(~np.isin(identity, list(test_ids)))
    test_images = sorted({int(f["pair_image"][p]) for p in test_pairs})
    dims = model_dims(f)
    print(f"train: {len(train_pairs)} pairs; test: {len(test_pairs)} caption queries over {len(test_images)} "
          f"images of {len(test_ids)} identities; noise {args.noise:.0%}; {args.epochs} epochs; ITC + ITM")

    def evaluate(model: FeatureDualEncoder) -> dict[str, float]:
        with torch.no_grad():
            g = model.encode_image(torch.tensor(f["images"][0, test_images])).numpy()
            q = model.encode_text(torch.tensor(f["texts"][test_pairs])).numpy()
        return person_search_metrics(q @ g.T, identity[test_pairs].tolist(),
                                     [image_identity[i] for i in test_images])

    print("\n| weighting | R@1 | R@5 | mAP | mINP | noisy found: precision | recall |\n|---|---|---|---|---|---|---|")
    zero = evaluate(FeatureDualEncoder(**dims))
    print(f"| zero-shot | {zero['R@1']:.3f} | {zero['R@5']:.3f} | {zero['mAP']:.3f} | {zero['mINP']:.3f} | - | - |")
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
            pairs = TrainingPairs(torch.tensor(f["images"]), torch.tensor(f["pair_image"][train_pairs]),
                                  torch.tensor(texts), q_txt=torch.tensor(q_txt))
            torch.manual_seed(seed)
            model = FeatureDualEncoder(**dims)
            cfg = TrainConfig(objective="itc", weighting=weighting, use_itm=True, epochs=args.epochs,
                              lr_start=args.lr / 10, lr_peak=args.lr, seed=seed)
            result = train(model, pairs, cfg)
            m = evaluate(model)
            if weighting == "ada":
                flagged = result.epochs[-1].confidence < 0.5
                tp = int((flagged & noisy).sum())
                m["precision"] = tp / max(1, int(flagged.sum()))
                m["recall"] = tp / max(1, int(noisy.sum()))
            rows.append(m)

        cells = [_mean_sd(rows, key) for key in ("R@1", "R@5", "mAP", "mINP", "precision", "recall")]
        print(f"| {weighting} | " + " | ".join(cells) + " |")


def _mean_sd(rows: list[dict[str, float]], key: str) -> str:
    vals = np.array([r[key] for r in rows if key in r])
    return f"{vals.mean():.3f} ± {vals.std(ddof=1):.3f}" if len(vals) else "-"


if __name__ == "__main__":
    main()
