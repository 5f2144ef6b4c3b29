"""Smoke tests of the experiment scripts' core functions on tiny synthetic feature sets (no
build-largefine run, no real model): experiments/gtr_hallucination.py and its gtr_noise helpers,
gtr_gmm_separation.py's rules,
and experiments/vedje_convergence.py and vedje_cache_collapse.py end to end (``--tiny``, a tiny
random joint encoder)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))

from gtr_gmm_separation import analyse
from gtr_hallucination import (
    auc,
    corrupt_all,
    noise_runs,
    results_table,
    teacher_forced_q,
)
from gtr_noise import identity_split
from saft_ablation import interval_table
from tiny_models import build_tiny_bert
from vedje_cache_collapse import grid_sd, joint_response, redraw_blocks, two_way_shares
from vedje_cache_collapse import main as vedje_cache_collapse_main
from vedje_convergence import TINY, new_model, validation_split
from vedje_convergence import main as vedje_convergence_main

from models.backends.interfaces import ChatMessage, GenerationRequest, GenerationResult, TokenLogprob
from rde.vedje.data import ItemSet
from rde.vedje.training import LOSSES, VedjeTensors, VedjeTrainConfig, batch_losses, stage1_top


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


def test_gmm_separation_splits_by_tier_when_tiers_differ_more_than_the_noise() -> None:
    """The mechanism the results page reports, built in: two tiers whose clean ŝ levels (0.85, 0.60)
    differ more than a corruption lowers ŝ (0.10). One mixture over all pairs then splits by tier
    (flags every pair of the low tier: precision = its corrupted share), the per-tier mixture finds
    exactly the corrupted pairs, and with the tiers apart from the noise the oracle is exact."""
    rng = np.random.default_rng(0)
    level = {"base": 0.85, "inter": 0.60}
    tiers = np.repeat(["base", "inter"], 60)
    noisy = np.tile(np.arange(60) < 18, 2)  # 30 % of each tier
    x = np.array([level[t] for t in tiers]) - 0.10 * noisy + rng.normal(0, 0.01, len(tiers))
    out = analyse(x, x, noisy, tiers, confidence=np.ones(len(x)))
    fitted = out["k-means start, last ŝ"]
    assert fitted["flagged"] == pytest.approx(0.5) and fitted["precision"] == pytest.approx(18 / 60)
    per_tier = out["a mixture per tier (not the paper's)"]
    assert per_tier["precision"] == 1.0 and per_tier["recall"] == 1.0
    assert out["tiers"]["inter"]["corrupted"] == 18 and out["as trained (warm-started)"]["flagged"] == 0.0
    separated = np.where(noisy, 0.3, 0.8) + rng.normal(0, 0.01, len(x))
    oracle = analyse(separated, separated, noisy, tiers, np.ones(len(x)))["oracle components"]
    assert (oracle["flagged"], oracle["precision"], oracle["recall"]) == (0.3, 1.0, 1.0)


COLOURS = ["red", "blue", "black", "white", "green", "grey"]


def _vedje_tensors(name: str, src: dict) -> VedjeTensors:
    """Tiny frozen inputs shaped like the two VEDJE sources: ``images`` = 20 identities × 2 images
    (T = 1, 6 identities for test); ``clips`` = 30 clips of T = 4 frames, clip k on frames k..k+3
    (neighbours overlap, as in the bundled set), 22 for training, 5 for test after a gap. Two
    captions per item; stage-1 embeddings weakly tied to the item, caption colour tied to the group."""
    rng = np.random.default_rng(0 if name == "images" else 1)
    p, d_v, dim = 4, 16, 8
    if name == "images":
        groups = [f"id{k // 2}" for k in range(40)]
        splits = ["test" if k // 2 >= 14 else "train" for k in range(40)]
        frames = [[f"img{k}"] for k in range(40)]
    else:
        kept = [k for k in range(30) if not 22 <= k < 25]
        groups = [f"clip:{k:05d}" for k in kept]
        splits = ["test" if k >= 25 else "train" for k in kept]
        frames = [[f"f{k + t}" for t in range(4)] for k in kept]
    keys = sorted({f for fr in frames for f in fr})
    index = {k: i for i, k in enumerate(keys)}
    centre = {g: rng.normal(size=dim) for g in dict.fromkeys(groups)}
    item_emb = np.stack([centre[g] + 0.5 * rng.normal(size=dim) for g in groups])
    texts, query_items, query_emb = [], [], []
    for i, g in enumerate(groups):
        for c in range(2):
            colour = COLOURS[(list(centre).index(g) + c) % len(COLOURS)]
            texts.append(f"a person in a {colour} top walks to the {'left' if c else 'right'}")
            query_items.append(i)
            query_emb.append(centre[g] + 0.8 * rng.normal(size=dim))
    norm = lambda a: torch.nn.functional.normalize(torch.tensor(np.asarray(a), dtype=torch.float32), dim=-1)  # noqa: E731
    items = ItemSet([f"{name}:{k}" for k in range(len(groups))] if name == "images" else groups, groups, splits,
                    frames, texts, query_items, lambda keys: {})
    feats = torch.from_numpy(rng.normal(size=(len(keys), p, d_v)).astype(np.float16))
    item_frames = torch.tensor([[index[f] for f in fr] for fr in frames])
    return VedjeTensors(items, feats, item_frames, norm(item_emb), norm(query_emb))


def test_vedje_convergence_runs_tiny_and_early_stopping_keeps_a_best_epoch(tmp_path: Path, monkeypatch,
                                                                           capsys) -> None:
    monkeypatch.setenv("RDE_STATE_DIR", str(tmp_path / "state"))
    bert = build_tiny_bert(tmp_path / "tiny-bert")
    report = vedje_convergence_main(["--tiny", "--seeds", "1", "--first-seed", "2", "--max-epochs", "2", "--checks",
                                     "always", "--encoder", str(bert)], load=_vedje_tensors)
    out = capsys.readouterr().out
    assert out.count("| epoch | step | lr | train loss | train VTM | val VTM loss | val R@1 | val cache cos pos–neg "
                     "| val pairs, ρ zeroed (%) | best |") == 2
    assert out.count("### curve, seed 2") == 2 and "seed 0" not in out  # --first-seed 2 --seeds 1
    assert out.count("### rerank vs stage 1") == 2 and out.count("| stage 1 |") == 2
    assert "| VEDJE rerank, N_c=5 |" in out and "| VEDJE rerank, N_c=12 |" in out  # the two test galleries
    for check in ("### (a) ρ hidden", "### (b) fit", "### (c) the frozen feature map"):
        assert out.count(check) == 2
    assert out.count("Reading: ") == 6 and out.count("cosine positive–negative") == 2
    for name in ("images", "clips"):
        r = report[name]
        info = r["runs"][0]["train"]
        assert info["best_epoch"] in (1, 2) and info["epochs_run"] <= 2
        curve = info["curve"]
        assert [p["epoch"] for p in curve] == [0, 1, 2]  # the untrained reference + one point per epoch
        # the content-path columns: a cosine and a share of pairs, measured at every point
        assert all(-1.0 <= p["cache_cos"] <= 1.0 and 0.0 <= p["rho0_pairs"] <= 100.0 for p in curve)
        best = [p for p in curve if p["best"]]
        assert len(best) == 1 and best[0]["epoch"] == info["best_epoch"]
        assert best[0]["val_vtm"] == min(p["val_vtm"] for p in curve[1:])  # best = lowest validation VTM loss
        assert f"best epoch {info['best_epoch']} (step {info['best_step']}" in out
        assert r["counts"]["val_items"] > 0 and r["counts"]["val_queries"] > 0
    assert report["clips"]["counts"]["val_gap_items"] == 3  # training clips sharing a frame with a validation clip
    assert report["images"]["counts"]["val_gap_items"] == 0
    assert (tmp_path / "state" / "experiments" / "vedje_convergence.json").exists()


def test_vedje_cache_collapse_measures_each_condition_and_vtc_leaves_the_caches_alone(tmp_path: Path, monkeypatch,
                                                                                     capsys) -> None:
    """VTC reaches no compressor weight (text-only): its caches must not move, which checks the
    measurement; VTM does train the compressor (its Q_0 moves)."""
    monkeypatch.setenv("RDE_STATE_DIR", str(tmp_path / "state"))
    bert = build_tiny_bert(tmp_path / "tiny-bert")
    report = vedje_cache_collapse_main(["--tiny", "--epochs", "2", "--conditions", "vtm", "vtc", "--encoder",
                                        str(bert)], load=_vedje_tensors)
    out = capsys.readouterr().out
    assert out.count("| epoch | step | cache cos pos–neg |") == 2 and "### summary" in out
    assert out.count("| epoch | [CLS] attention on cache, last layer (%) |") == 2
    for r in report["conditions"]["vtm"]:  # the encoder-response columns at every epoch
        assert 0.0 < r["attn_cache_last"] < 100.0 and r["c_query"] + r["c_item"] + r["c_inter"] == pytest.approx(100.0)
    vtm, vtc = report["conditions"]["vtm"], report["conditions"]["vtc"]
    assert [r["epoch"] for r in vtm] == [0, 1, 2] and [r["epoch"] for r in vtc] == [0, 1, 2]
    assert all(-1.0 <= r["cache_cos"] <= 1.0 and 0.0 <= r["rho0_pairs"] <= 100.0 for r in vtm + vtc)
    assert vtc[0]["cache_cos"] == vtc[-1]["cache_cos"] and vtc[0]["q0_rms"] == vtc[-1]["q0_rms"]
    assert vtm[0]["q0_rms"] != vtm[-1]["q0_rms"] and vtm[-1]["step"] > 0
    assert vtm[0]["cache_cos"] == vtc[0]["cache_cos"]  # one seed: every condition starts from the same model
    assert (tmp_path / "state" / "experiments" / "vedje_cache_collapse.json").exists()


def test_cache_structure_term_is_added_only_when_named_and_weighted(tmp_path: Path) -> None:
    """The experiment-only term joins ``batch_losses`` when ``losses`` names it, times its weight,
    and is computed on the batch's caches: the recipe's loss set never carries it."""
    data = _vedje_tensors("images", {})
    args = argparse.Namespace(compressor_norm="post", encoder=str(build_tiny_bert(tmp_path / "tiny-bert")), layers=1)
    model = new_model(data, args, 0).eval()
    queries = data.rows("train")[1][:6]
    top, _ = stage1_top(data, queries, data.rows("train")[0], 10)
    ranked = {q: top[k] for k, q in enumerate(queries)}
    terms = {}
    for weight in (1.0, 2.5):
        cfg = VedjeTrainConfig(train_candidates=3, negatives_from=10, losses=("vtm", "structure"),
                               structure_weight=weight)
        with torch.no_grad():
            terms[weight] = batch_losses(model, data, queries, ranked, cfg, 0, torch.Generator().manual_seed(0))
    assert set(terms[1.0]) == {"vtm", "structure"} and float(terms[1.0]["structure"]) > 0
    assert float(terms[2.5]["structure"]) == pytest.approx(2.5 * float(terms[1.0]["structure"]))
    assert "structure" not in VedjeTrainConfig().losses and "structure" not in LOSSES


def test_saft_ablation_interval_table_pairs_each_condition_with_zero_shot_and_itc() -> None:
    """Hand-computed: zero-shot AP (0, 1, 0.5), ITC (1, 1, 1) → mAP 0.5 and 1.0; ITC − zero-shot
    = (1, 0, 0.5), mean +0.5; the bootstrap bounds lie within the per-query extremes."""
    table = interval_table({"zero-shot (semantic bridge)": np.array([0.0, 1.0, 0.5]),
                            "ITC": np.array([1.0, 1.0, 1.0])})
    rows = {line.split(" | ")[0].strip("| "): line for line in table.splitlines() if line.startswith("| ")}
    assert rows["zero-shot (semantic bridge)"].split(" | ")[1].startswith("0.500 [")
    itc = rows["ITC"].split(" | ")
    assert itc[1] == "1.000 [1.000, 1.000]" and itc[2].startswith("+0.500 [") and itc[3].strip(" |") == "-"
    low, high = (float(v) for v in itc[2].split("[")[1].rstrip("] ").split(", "))
    assert 0.0 <= low <= 0.5 <= high <= 1.0


def test_two_way_shares_by_hand() -> None:
    """[[1, 2], [3, 6]]: about the mean 3, SS 14 = query 2·(1.5² + 1.5²) = 9 + item 2·(1² + 1²) = 4
    + interaction 4·0.5² = 1; a vector grid adds its dimensions' sums of squares."""
    shares = two_way_shares(np.array([[1.0, 2.0], [3.0, 6.0]]))
    assert np.allclose(shares, [900 / 14, 400 / 14, 100 / 14])
    grid = np.stack([np.array([[1.0, 2.0], [3.0, 6.0]]), np.array([[0.0, 1.0], [0.0, 1.0]])], axis=-1)
    assert np.allclose(two_way_shares(grid), [900 / 15, 500 / 15, 100 / 15])  # dim 2: item SS 2·(0.5² + 0.5²) = 1


def _response_model(tmp_path: Path) -> tuple:
    data, _ = validation_split(_vedje_tensors("images", {}), "identity", 0.3, seed=0)
    args = argparse.Namespace(compressor_norm="post", encoder=str(build_tiny_bert(tmp_path / "tiny-bert")),
                              layers=TINY["layers"])
    return new_model(data, args, 0), data


def test_joint_response_reads_queries_as_rows_and_attention_by_hand(tmp_path: Path, monkeypatch) -> None:
    """One cache for every item: c and s cannot depend on the item, so the item and interaction
    shares are 0 and the query share 100 (a grid read the wrong way round puts it on the item).
    Query weights zeroed: every [CLS] attends evenly, so its mass on the cache is K/(L+K) exactly."""
    import vedje_cache_collapse

    model, data = _response_model(tmp_path)
    real = vedje_cache_collapse.stored_caches
    monkeypatch.setattr(vedje_cache_collapse, "stored_caches", lambda m, d, p: lambda rows: real(m, d, p)(
        [rows[0]] * len(rows)))
    r = joint_response(model, data, 6)
    assert r["c_query"] == pytest.approx(100.0, abs=1e-6) and r["s_query"] == pytest.approx(100.0, abs=1e-6)
    assert r["c_item"] + r["c_inter"] == pytest.approx(0.0, abs=1e-6)
    monkeypatch.setattr(vedje_cache_collapse, "stored_caches", real)
    r = joint_response(model, data, 6)
    assert r["c_item"] > 1.0 and sum(r[k] for k in ("c_query", "c_item", "c_inter")) == pytest.approx(100.0)
    assert 0.0 < r["attn_cache_last"] < 100.0
    with torch.no_grad():
        for block in model.reranker.bert.encoder.layer:
            block.attention.self.query.weight.zero_()
            block.attention.self.query.bias.zero_()
    r = joint_response(model, data, 6)
    assert r["attn_cache_last"] == pytest.approx(r["attn_uniform"], rel=1e-5)
    assert r["attn_cache_mean"] == pytest.approx(r["attn_uniform"], rel=1e-5)
    assert model.reranker.bert.config._attn_implementation != "eager"  # the kernel is put back


def test_redraw_blocks_redraws_the_blocks_only() -> None:
    """Every block's Linear weights re-drawn at N(0, std), biases 0, LayerNorms 1/0, from the seed;
    the embeddings (and their LayerNorm) keep what they had."""
    from transformers import BertConfig, BertModel

    def spoiled() -> BertModel:
        bert = BertModel(BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                    intermediate_size=64, max_position_embeddings=16))
        with torch.no_grad():
            for p in bert.parameters():
                p.fill_(5.0)
        return bert

    bert = spoiled()
    drawn = redraw_blocks(bert, 0.02, seed=3)
    per_block = 4 * (32 * 32 + 32) + 2 * 2 * 32 + (32 * 64 + 64) + (64 * 32 + 32)  # q k v o, 2 LNs, FFN
    assert drawn == 2 * per_block
    weights = torch.cat([m.weight.flatten() for b in bert.encoder.layer for m in b.modules()
                         if isinstance(m, torch.nn.Linear)])
    assert float(weights.std()) == pytest.approx(0.02, rel=0.05) and abs(float(weights.mean())) < 0.002
    for block in bert.encoder.layer:
        for m in block.modules():
            if isinstance(m, torch.nn.Linear):
                assert torch.count_nonzero(m.bias) == 0
            elif isinstance(m, torch.nn.LayerNorm):
                assert torch.all(m.weight == 1.0) and torch.count_nonzero(m.bias) == 0
    assert all(torch.all(p == 5.0) for p in bert.embeddings.parameters())
    again, other = spoiled(), spoiled()
    redraw_blocks(again, 0.02, seed=3)
    redraw_blocks(other, 0.02, seed=4)
    q = lambda m: m.encoder.layer[1].attention.self.query.weight  # noqa: E731
    assert torch.equal(q(again), q(bert)) and not torch.equal(q(other), q(bert))


def test_grid_sd_by_hand() -> None:
    """[[1, 2], [3, 6]]: SS 14 over 4 cells → √3.5; a constant grid has none."""
    assert grid_sd(np.array([[1.0, 2.0], [3.0, 6.0]])) == pytest.approx(3.5 ** 0.5)
    assert grid_sd(np.full((3, 2, 4), 7.0)) == 0.0
