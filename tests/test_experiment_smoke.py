"""Smoke tests of the experiment scripts' core functions on tiny synthetic feature sets (no
build-largefine run, no real model): experiments/gtr_hallucination.py and its gtr_noise helpers."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))

from gtr_hallucination import (
    auc,
    corrupt_all,
    noise_runs,
    results_table,
    teacher_forced_q,
)
from gtr_noise import identity_split

from models.backends.interfaces import ChatMessage, GenerationRequest, GenerationResult, TokenLogprob


def _synthetic(n_ids: int = 8, per_id: int = 3, dim: int = 8, cnn: int = 4, seed: int = 0):
    """Features of n_ids identities × per_id images, one caption each, the caption near its image."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(n_ids, dim))
    n = n_ids * per_id
    bridge = centres.repeat(per_id, axis=0) + 0.3 * rng.normal(size=(n, dim))
    bridge /= np.linalg.norm(bridge, axis=1, keepdims=True)
    images = np.concatenate([bridge, rng.normal(size=(n, cnn))], axis=1)[None].astype(np.float32)
    texts = bridge + 0.2 * rng.normal(size=(n, dim))
    texts = (texts / np.linalg.norm(texts, axis=1, keepdims=True)).astype(np.float32)
    f = {"images": images, "pair_image": np.arange(n), "texts": texts,
         "q_txt": rng.uniform(0.4, 0.9, n).astype(np.float32)}
    caps = [{"identity": f"id{i // per_id}", "text": f"The person wears a {c} top."}
            for i, c in zip(range(n), ["black", "blue", "red"] * n, strict=False)]
    return f, caps


class _Scorer:
    """Teacher forcing stand-in: a caption with "red" is unlikely."""

    model_id = "scripted"

    def __init__(self) -> None:
        self.calls = 0

    def score(self, requests, texts):
        self.calls += len(texts)
        return [GenerationResult(r.request_id, t, [TokenLogprob("x", np.log(0.2 if "red" in t else 0.7))], "s")
                for r, t in zip(requests, texts, strict=True)]


def test_teacher_forced_scores_are_cached(tmp_path: Path) -> None:
    scorer = _Scorer()
    reqs = [GenerationRequest(f"r{i}", [ChatMessage("user", "Describe.")]) for i in range(3)]
    texts = ["a black top", "a red top", "a blue top"]
    q = teacher_forced_q(scorer.score, scorer.model_id, reqs, texts, tmp_path / "q.json", log=lambda _: None)
    assert q == pytest.approx([0.7, 0.2, 0.7]) and scorer.calls == 3
    again = teacher_forced_q(scorer.score, scorer.model_id, reqs, texts, tmp_path / "q.json", log=lambda _: None)
    assert again == pytest.approx(q) and scorer.calls == 3  # nothing rescored


def test_hallucination_experiment_core_runs_on_a_tiny_feature_set() -> None:
    f, caps = _synthetic()
    split = identity_split(f, caps)
    index = split.train_pairs
    corrupted, swaps = corrupt_all([caps[i]["text"] for i in index])
    corruptible = np.array([bool(s) for s in swaps])
    assert corruptible.all() and all(c != caps[i]["text"] for c, i in zip(corrupted, index, strict=True))
    clean_q = np.full(len(index), 0.7)
    noisy_q = np.full(len(index), 0.3)
    noisy_texts = np.random.default_rng(1).normal(size=f["texts"][index].shape).astype(np.float32)
    results = noise_runs(f, split, index, clean_q, noisy_q, noisy_texts, corruptible, rates=(0.3,), seeds=2,
                         epochs=2, lr=1e-3)
    assert set(results) == {(0.3, w) for w in ("none", "fix", "ada")}
    for rows in results.values():
        assert len(rows) == 2 and all(0 <= r["R@1"] <= r["R@5"] <= r["R@10"] <= 1 for r in rows)
        assert all(r["auc"] == 1.0 for r in rows)  # corrupted q_txt all below clean
        assert all(abs(r["noisy_share"] - 0.3) < 0.1 for r in rows)
    assert all("precision" in r and "recall" in r for r in results[(0.3, "ada")])
    table = results_table(results, None)
    assert table.count("\n") == 4 and "| 30% | ada |" in table


def test_auc_counts_corrupted_below_clean() -> None:
    assert auc(np.array([0.1, 0.2]), np.array([0.3, 0.4])) == 1.0
    assert auc(np.array([0.5]), np.array([0.5, 0.1])) == 0.25
