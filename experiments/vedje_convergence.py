"""VEDJE trained long enough to learn? Early-stopped training with a validation split, then
rerank vs stage 1, then controlled checks of why it does (not) beat stage 1, on the CPU.

Sources and stage 1 as in ``vedje_rerank.py`` (its SOURCES): ``images`` = the demo
build-largefine person images (T = 1, test identities never trained on; needs a
``rde build-largefine`` run, skipped with a message otherwise), ``clips`` = the bundled vtest.avi
clips (T = 8, test clips later in time than every training clip).

1. Validation split, carved out of the *training* split only (the test split is never looked at
   for any choice): images by identity (``--val-share`` of the training identities, seeded);
   clips by clip — the last ``--val-share`` of the training clips in time, and the training clips
   that share a frame with a validation clip are dropped (``val_gap``; neighbouring clips overlap
   in 7 of 8 frames), the same way the test split is cut off. Training runs epoch by epoch; after
   every ``--eval-every`` epochs the **validation VTM loss** (the training VTM objective on the
   validation queries: stage-1 top-N within the validation gallery, the positive + hard negatives
   of other groups from it, fixed draws, eval mode, no gradient;
   ``rde.vedje.training.validation_vtm_loss``) and validation R@1 of rerank (top-20 or the whole
   validation gallery) are computed, and whether the content path learns (``content_signal``: the
   validation lists' positive–negative cosine of the stored caches, and the pairs ordered right
   with ρ zeroed). Training stops when the validation VTM loss has not improved
   for ``--patience`` evaluations, or at ``--max-epochs``; the checkpoint with the lowest
   validation VTM loss is kept. The curve is printed per seed (row "0" = the untrained model, for
   reference; it cannot be chosen as best).
2. With the best checkpoint: R@1/5/10 of stage 1 and of rerank over the test split's top-N_c,
   N_c = 20/50/100 (capped at the test gallery), ``--seeds`` seeds, mean ± sd
   (``evaluate_rerank``; BF16 caches as served).
3. If rerank does not beat stage 1 (``--checks auto``; ``always``/``never`` force it), checks on
   the first seed's best model, each a small table with a one-line reading:
   (a) ρ hidden: does the score separate the test positives from the stage-1 hard negatives of its
       top-N_c (pairwise AUC) when ρ is zeroed at scoring, and when a model is trained with ρ = 0
       (``VedjeTrainConfig.hide_prior``; same early stopping)? The scorer uses ρ as
       s = h_ψ(c + e_ρ(ρ)) (models/reranker/joint_encoder.py), so it can learn to copy stage 1.
   (b) fit: rerank vs stage 1 on the training queries (training gallery), the validation and the
       test queries — can it even fit what it trained on?
   (c) the frozen feature map: top-1 accuracy among C = ``--candidates`` candidates (the positive +
       hard negatives from stage 1's top-N_c vs + random negatives of the same gallery), and a
       linear probe on the same frozen features — s = a·ρ + q_1ᵀ W f(v), q_1 the stage-1 query
       embedding, f(v) the standardised mean of the item's backbone patch features — trained with
       the same VTM candidates and early-stopped on the same validation split; reranking top-N_c.

CPU scale (the paper's values in brackets): joint encoder = the first ``--layers`` blocks of
all-MiniLM-L6-v2 [MiniLM-L12], ``--batch`` queries [64] × ``--candidates`` VTM candidates per
step, warmup ``--warmup`` steps [400], peak lr ``--lr`` [3e-4], ×``--decay`` per epoch [0.9], up
to ``--max-epochs`` epochs with early stopping [4 epochs fixed, ≈ 11k steps]. The clips give
≈ 18 steps per epoch after the validation split (75 training clips, 286 captions).

Time. The run is bounded by ``--budget-min`` (default 30; 0 = no bound): each source gets an
equal share of the time left (a skipped source's time goes to the next), each training run (the
seeds, then check (a)'s ρ = 0 run) an equal part of its source's remainder less 15 % kept for the
evaluations, and no epoch is started that would end past its run's share ("stopped: time
budget" in the curve; the first epoch always runs). Measured on this 2-core machine while other
work shared it: a default clips step 3–8 s, so an epoch ≈ 1–2.5 min; a validation point ≈ 3 s;
the test evaluation ≈ 27 s per seed; the checks ≈ 1.5 min besides their ρ = 0 run. So the default
run takes ≈ 30–33 min, plus feature extraction on a first run (≈ 3 min per source, then cached in
``.rde/cache``). Inside that budget a clips run gets ≈ 3 min (both sources) or ≈ 6 min (clips alone)
≈ 1–6 epochs — no longer than vedje_rerank.py's 3 epochs; a validation loss that does not move
stops a run after 4 epochs anyway (patience 3). Images were not timed (no build-largefine run
here then); measured since: an images epoch (305 training images, 680 captions, 43 steps) ≈ 53 s
plus ≈ 11 s for its validation point; one seed stopped by patience after 24 epochs, 1686 s. To
train long, give one source the time: ``--only clips --seeds 1 --budget-min 0`` (≤ ``--max-epochs``
30 epochs, ≈ 30–75 min), or ``--only images --seeds 1 --checks never --budget-min 36``.

``--structure-weight W`` (> 0) trains with the experiment-only cache-structure term added to the
recipe (``models.reranker.losses.cache_structure_loss``, weight W): not the paper's objective, a
test of whether caches kept as distinct as the frozen features let the content path learn.

    .venv/bin/python experiments/vedje_convergence.py [--only images|clips] [--seeds 3]
        [--max-epochs 30] [--patience 3] [--eval-every 1] [--budget-min 30] [--checks auto|always|never]
        [--layers 3] [--batch 16] [--candidates 4] [--lr 1e-4] [--compressor-norm post|pre]
        [--structure-weight 0] [--first-seed 0] [--tiny]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import torch
from vedje_rerank import SOURCES, row, value

from models.reranker.losses import vtm_loss
from models.reranker.vedje import Vedje
from rde.profile import load_profile
from rde.vedje.data import negatives_for
from rde.vedje.features import cached_tensors
from rde.vedje.training import (
    LOSSES,
    VedjeTensors,
    build_model,
    evaluate_rerank,
    joint_scores,
    learning_rate,
    stage1_top,
    stored_caches,
    train_config,
    train_vedje,
    validation_vtm_loss,
)
from storage.locations import state_dir

VAL_BY = {"images": "identity", "clips": "clip"}
RESERVE = 0.15  # share of a source's remaining time held back from each training run for the evaluations
TINY = {"train_groups": 24, "test_groups": 8, "layers": 1, "batch": 4, "candidates": 3}
Loader = Callable[[str, dict[str, Any]], VedjeTensors]


# ---------------------------------------------------------------- data: subsets and the validation split

def subset(data: VedjeTensors, keep: Sequence[int]) -> VedjeTensors:
    """The items ``keep`` (rows) and their queries; frame features are shared, not copied."""
    keep = sorted(keep)
    new = {i: k for k, i in enumerate(keep)}
    it = data.items
    qs = [q for q, i in enumerate(it.query_items) if i in new]
    items = replace(it, item_ids=[it.item_ids[i] for i in keep], groups=[it.groups[i] for i in keep],
                    splits=[it.splits[i] for i in keep], frames=[it.frames[i] for i in keep],
                    query_texts=[it.query_texts[q] for q in qs], query_items=[new[it.query_items[q]] for q in qs])
    return VedjeTensors(items, data.frame_features, data.item_frames[keep], data.item_emb[keep], data.query_emb[qs])


def tiny_subset(data: VedjeTensors) -> VedjeTensors:
    """The first TINY["train_groups"] training and TINY["test_groups"] test groups (in item order)."""
    keep, seen = [], {"train": [], "test": []}
    for i, (g, s) in enumerate(zip(data.items.groups, data.items.splits, strict=True)):
        want = seen.get(s)
        if want is None:
            continue
        cap = TINY["train_groups"] if s == "train" else TINY["test_groups"]
        if g not in want and len(want) < cap:
            want.append(g)
        if g in want:
            keep.append(i)
    return subset(data, keep)


def validation_split(data: VedjeTensors, by: str, share: float, seed: int) -> tuple[VedjeTensors, dict[str, int]]:
    """Relabel part of the training split "val" (``by`` "identity": a seeded share of the training
    groups; "clip": the last share of the training items in item-id order, i.e. in time) and the
    training items that share a frame with a validation item "val_gap" (trained on by neither).
    The test split is untouched."""
    items = data.items
    train = [i for i, s in enumerate(items.splits) if s == "train"]
    if by == "identity":
        groups = sorted({items.groups[i] for i in train})
        n = max(1, round(share * len(groups)))
        val_groups = set(np.random.default_rng(seed).choice(groups, size=n, replace=False).tolist())
        val = {i for i in train if items.groups[i] in val_groups}
    elif by == "clip":
        ordered = sorted(train, key=lambda i: items.item_ids[i])
        val = set(ordered[len(ordered) - max(1, round(share * len(ordered))):])
    else:
        raise ValueError(f"validation split by 'identity' or 'clip', got {by!r}")
    val_frames = {k for i in val for k in items.frames[i]}
    gap = {i for i in train if i not in val and val_frames & set(items.frames[i])}
    splits = ["val" if i in val else "val_gap" if i in gap else s for i, s in enumerate(items.splits)]
    out = VedjeTensors(replace(items, splits=splits), data.frame_features, data.item_frames, data.item_emb,
                       data.query_emb)
    counts = {f"{s}_{kind}": len(out.rows(s)[k]) for s in ("train", "val", "test")
              for k, kind in ((0, "items"), (1, "queries"))}
    counts["val_gap_items"] = len(gap)
    return out, counts


# ---------------------------------------------------------------- training with early stopping

def model_spec(args: argparse.Namespace) -> Any:
    """The demo profile's vedje section, with ``--compressor-norm`` and ``--encoder`` (the joint
    encoder, when given)."""
    spec = load_profile("demo").vedje.model_copy(update={"compressor_norm": args.compressor_norm})
    if args.encoder:
        spec = spec.model_copy(update={"joint_encoder": spec.joint_encoder.model_copy(
            update={"model_id": args.encoder, "revision": None})})
    return spec


def new_model(data: VedjeTensors, args: argparse.Namespace, seed: int) -> Vedje:
    torch.manual_seed(seed)
    return build_model(model_spec(args), data.frame_features.shape[2], data.frame_features.shape[1],
                       data.item_frames.shape[1], data.item_emb.shape[1], layers=args.layers)


def experiment_losses(args: argparse.Namespace) -> dict[str, Any]:
    """``train_config`` overrides for ``--structure-weight`` (> 0: the recipe's terms plus the
    experiment-only cache-structure term at that weight; 0: the recipe)."""
    if args.structure_weight <= 0:
        return {}
    return {"losses": (*LOSSES, "structure"), "structure_weight": args.structure_weight}


def val_recall(model: Vedje, data: VedjeTensors, n: int) -> tuple[float, float]:
    """(stage-1 R@1, rerank R@1 over the top-n) on the validation split."""
    rows = evaluate_rerank(model, data, stored_caches(model, data, "bf16"), [n], split="val", ks=(1,))
    get = {r["ranking"]: r["value"] for r in rows}
    return get.get("stage-1", float("nan")), get.get("rerank", float("nan"))


def train_early_stopped(data: VedjeTensors, args: argparse.Namespace, seed: int, negatives_from: int,
                        hide_prior: bool = False, deadline: float = math.inf) -> tuple[Vedje, dict[str, Any]]:
    """Train with the validation VTM loss checked every ``--eval-every`` epochs; returns the model at
    its best checkpoint and the curve (one dict per evaluation) with the stopping facts. No epoch is
    started that would, at the mean epoch time so far, end after ``deadline`` (``time.perf_counter``
    seconds; the epoch that hits it is evaluated, then training stops: "time budget")."""
    spec = model_spec(args)
    model = new_model(data, args, seed)
    cfg = train_config(spec, epochs=args.max_epochs, batch_size=args.batch, train_candidates=args.candidates,
                       negatives_from=negatives_from, warmup_steps=args.warmup, lr_peak=args.lr,
                       epoch_decay=args.decay, seed=seed, hide_prior=hide_prior, **experiment_losses(args))
    n_val = min(20, len(data.rows("val")[0]))
    s1, r1 = val_recall(model, data, n_val)
    loss0, n_terms = validation_vtm_loss(model, data, cfg)
    cos0, pairs0 = content_signal(model, data, n_val)
    print(f"  seed {seed}, untrained: val VTM {loss0:.4f}, val R@1 {r1:.1f}, cache cos {cos0:.4f}, pairs right with "
          f"ρ zeroed {pairs0:.1f} %", flush=True)
    curve: list[dict[str, Any]] = [{"epoch": 0, "step": 0, "lr": cfg.lr_start, "train_loss": float("nan"),
                                    "train_vtm": float("nan"), "val_vtm": loss0, "val_r1": r1, "cache_cos": cos0,
                                    "rho0_pairs": pairs0, "best": False}]
    state: dict[str, Any] = {"best_loss": math.inf, "best": None, "weights": None, "bad": 0, "seen": 0,
                             "eval_s": 0.0, "stopped": "max-epochs"}

    def should_stop(epoch: int, result: Any) -> bool:
        done = epoch + 1
        t0 = time.perf_counter()
        out_of_time = t0 + (t0 - started) / done > deadline and done < args.max_epochs
        if done % args.eval_every and done != args.max_epochs and not out_of_time:
            return False
        new = result.step_losses[state["seen"]:]
        state["seen"] = len(result.step_losses)
        val_loss, _ = validation_vtm_loss(model, data, cfg)
        _, val_r1 = val_recall(model, data, n_val)
        cache_cos, rho0_pairs = content_signal(model, data, n_val)
        point = {"epoch": done, "step": len(result.step_losses),
                 "lr": learning_rate(cfg, max(len(result.step_losses) - 1, 0), epoch),
                 "train_loss": float(np.mean([sum(v for k, v in s.items() if k not in ("step", "epoch"))
                                              for s in new])) if new else float("nan"),
                 "train_vtm": float(np.mean([s["vtm"] for s in new if "vtm" in s])) if any(
                     "vtm" in s for s in new) else float("nan"),
                 "val_vtm": val_loss, "val_r1": val_r1, "cache_cos": cache_cos, "rho0_pairs": rho0_pairs,
                 "best": False}
        if val_loss < state["best_loss"] - 1e-4:
            state.update(best_loss=val_loss, best=point, bad=0,
                         weights={k: v.detach().clone() for k, v in model.state_dict().items()})
        else:
            state["bad"] += 1
        curve.append(point)
        print(f"  seed {seed}, epoch {done} (step {point['step']}): val VTM {val_loss:.4f}, val R@1 {val_r1:.1f}, "
              f"cache cos {cache_cos:.4f}, pairs right with ρ zeroed {rho0_pairs:.1f} %", flush=True)
        state["eval_s"] += time.perf_counter() - t0
        if state["bad"] >= args.patience:
            state["stopped"] = f"patience {args.patience}"
            return True
        if out_of_time:
            state["stopped"] = "time budget"
            return True
        return False

    started = time.perf_counter()
    result = train_vedje(model, data, cfg, should_stop=should_stop)
    if state["weights"] is not None:
        model.load_state_dict(state["weights"])
        state["best"]["best"] = True
    model.eval()
    best = state["best"]
    info = {"curve": curve, "val_stage1_r1": s1, "val_n": n_val, "val_vtm_queries": n_terms,
            "best_epoch": best["epoch"] if best else None, "best_step": best["step"] if best else None,
            "best_val_vtm": best["val_vtm"] if best else None, "stopped": state["stopped"],
            "epochs_run": len(result.epoch_loss), "steps": len(result.step_losses),
            "vtm_share": round(result.vtm_share, 3), "seconds": round(result.seconds, 1),
            "eval_seconds": round(state["eval_s"], 1),
            "budget_s": None if math.isinf(deadline) else round(max(deadline - started, 0.0), 1)}
    return model, info


def listed_caches(model: Vedje, data: VedjeTensors, lists: Sequence[np.ndarray]) -> torch.Tensor:
    """One flattened BF16 stored cache per item row, for the items in ``lists`` (arrays of item
    rows); zeros for the rest, which no cosine over those lists reads."""
    listed = sorted({int(i) for c in lists for i in c.ravel()})
    cache = torch.zeros(len(data.items.item_ids), model.cache_tokens * model.reranker.d)
    if listed:
        cache[listed] = stored_caches(model, data, "bf16")(listed).reshape(len(listed), -1).float()
    return cache


def content_signal(model: Vedje, data: VedjeTensors, n: int) -> tuple[float, float]:
    """Whether the content path learns as training goes on, on the validation lists (stage-1 top-n):
    (the mean cosine between a list's positive and negative stored caches — near 1 when the
    compressor collapses different people onto one cache; the pairs (%) of positive vs negative the
    score orders right with ρ zeroed — 50 is chance). Leaves the model in eval mode."""
    qs, top, sims = candidate_lists(data, "val", n)
    if not len(qs):
        return float("nan"), float("nan")
    pos = is_positive(data, qs, top)
    cosine = pos_neg_cosine(listed_caches(model, data, [top]), top, pos)
    return cosine, pair_auc(model_scores(model, data, qs, top, sims, zero_rho=True), pos)


def curve_table(info: dict[str, Any], label: str) -> str:
    f = lambda x: "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.4f}"  # noqa: E731
    lines = [f"\n{label}: validation stage-1 R@1 {info['val_stage1_r1']:.1f} (rerank over the top-{info['val_n']}; "
             f"{info['val_vtm_queries']} validation queries with a VTM term)",
             "\n| epoch | step | lr | train loss | train VTM | val VTM loss | val R@1 | val cache cos pos–neg "
             "| val pairs, ρ zeroed (%) | best |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for p in info["curve"]:
        lines.append(f"| {p['epoch']} | {p['step']} | {p['lr']:.2e} | {f(p['train_loss'])} | {f(p['train_vtm'])} | "
                     f"{f(p['val_vtm'])} | {p['val_r1']:.1f} | {f(p['cache_cos'])} | {p['rho0_pairs']:.1f} | "
                     f"{'*' if p['best'] else ''} |")
    best = (f"best epoch {info['best_epoch']} (step {info['best_step']}, val VTM {info['best_val_vtm']:.4f})"
            if info["best_epoch"] is not None else "best epoch none (no validation VTM loss improved)")
    budget = f", time share {info['budget_s']}s" if info.get("budget_s") is not None else ""
    lines.append(f"{best}; stopped: {info['stopped']} after {info['epochs_run']} epochs, {info['steps']} steps; "
                 f"train {info['seconds']}s (of which evaluation {info['eval_seconds']}s{budget})")
    return "\n".join(lines)


# ---------------------------------------------------------------- scoring helpers for the checks

def candidate_lists(data: VedjeTensors, split: str, n: int) -> tuple[list[int], np.ndarray, np.ndarray]:
    """(query rows, Q×n stage-1 top item rows, their stage-1 scores) within the split's gallery."""
    item_rows, query_rows = data.rows(split)
    top, sims = stage1_top(data, query_rows, item_rows, n)
    return query_rows, top, sims


def model_scores(model: Vedje, data: VedjeTensors, query_rows: Sequence[int], cands: np.ndarray, rho: np.ndarray,
                 zero_rho: bool = False) -> np.ndarray:
    """s_θ of each (query, candidate) in ``cands`` (Q×C item rows), BF16 caches, ρ as given or 0."""
    uniq = sorted({int(i) for i in cands.ravel()})
    where = {i: k for k, i in enumerate(uniq)}
    caches = stored_caches(model, data, "bf16")(uniq)
    pairs = [(qi, where[int(i)]) for qi in range(len(query_rows)) for i in cands[qi]]
    r = torch.zeros(len(pairs)) if zero_rho else torch.from_numpy(rho.reshape(-1).astype(np.float32).copy())
    return joint_scores(model, [data.items.query_texts[q] for q in query_rows], pairs, caches, r).reshape(cands.shape)


def is_positive(data: VedjeTensors, query_rows: Sequence[int], cands: np.ndarray) -> np.ndarray:
    groups = data.items.groups
    return np.array([[groups[int(i)] == groups[data.items.query_items[q]] for i in row]
                     for q, row in zip(query_rows, cands, strict=True)], dtype=bool)


def pair_auc(scores: np.ndarray, positive: np.ndarray) -> float:
    """Share (%) of (positive, negative) candidate pairs of a query ranked the right way (ties ½),
    averaged over the queries with both; nan when none."""
    out = []
    for s, p in zip(scores, positive, strict=True):
        if p.any() and (~p).any():
            d = s[p][:, None] - s[~p][None, :]
            out.append(float(np.mean((d > 0) + 0.5 * (d == 0))))
    return 100.0 * float(np.mean(out)) if out else float("nan")


def spread(scores: np.ndarray) -> float:
    """Mean over queries of the sd of the scores within a candidate list (0: the score ignores the item)."""
    return float(np.mean(scores.std(axis=1))) if len(scores) else float("nan")


def pos_neg_cosine(vectors: torch.Tensor, cands: np.ndarray, positive: np.ndarray) -> float:
    """Mean cosine between a list's positive and negative items (``vectors``: one row per item row)."""
    v = torch.nn.functional.normalize(vectors.float(), dim=-1)
    out = [float((v[torch.from_numpy(c[p])] @ v[torch.from_numpy(c[~p])].T).mean())
           for c, p in zip(cands, positive, strict=True) if p.any() and (~p).any()]
    return float(np.mean(out)) if out else float("nan")


def top1(scores: np.ndarray, positive: np.ndarray) -> float:
    """R@1 (%) of the candidate lists reordered by ``scores`` (stable: ties keep stage-1 order)."""
    first = np.argsort(-scores, axis=1, kind="stable")[:, 0]
    return 100.0 * float(np.mean(positive[np.arange(len(first)), first]))


def probe_inputs(data: VedjeTensors) -> tuple[torch.Tensor, torch.Tensor]:
    """(item features f(v): the mean of each item's frozen backbone patch features, standardised
    with the training items' statistics and L2-normalised; the stage-1 query embeddings)."""
    f = torch.stack([data.features(torch.tensor([i]))[0].mean(dim=(0, 1)) for i in range(len(data.items.item_ids))])
    train = torch.tensor(data.rows("train")[0])
    f = (f - f[train].mean(0)) / (f[train].std(0) + 1e-6)
    return torch.nn.functional.normalize(f, dim=-1), data.query_emb.float()


class LinearProbe(torch.nn.Module):
    """s = a·ρ + q_1ᵀ W f(v) (a fixed at 0 without ρ), W starting at 0 (= the stage-1 order)."""

    def __init__(self, d_q: int, d_f: int, use_rho: bool) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(d_q, d_f))
        self.a = torch.nn.Parameter(torch.ones(()) * 10.0, requires_grad=use_rho)
        self.use_rho = use_rho

    def forward(self, q: torch.Tensor, f: torch.Tensor, rho: torch.Tensor) -> torch.Tensor:
        """q Q×d_q, f Q×C×d_f, ρ Q×C → Q×C."""
        s = torch.einsum("qd,de,qce->qc", q, self.w, f)
        return s + self.a * rho if self.use_rho else s


def vtm_batches(data: VedjeTensors, split: str, c: int, negatives_from: int, seed: int, step: int
                ) -> tuple[list[int], np.ndarray, np.ndarray] | None:
    """Training-style VTM candidate lists: per query whose positive is in its stage-1 top-N of the
    split's gallery, the positive + c-1 hard negatives (``negatives_for``); (queries, Q×c items, Q×c ρ)."""
    query_rows, top, _ = candidate_lists(data, split, negatives_from)
    items = data.items
    qs, rows = [], []
    for q, ranked in zip(query_rows, top, strict=True):
        pos = items.query_items[q]
        if pos not in ranked:
            continue
        neg = negatives_for(q, ranked, items.groups, items.groups[pos], c - 1, seed, step)
        if len(neg) == c - 1:
            qs.append(q)
            rows.append([pos, *neg])
    if not qs:
        return None
    cands = np.asarray(rows)
    rho = (data.query_emb[qs][:, None, :] * data.item_emb[torch.from_numpy(cands)]).sum(-1).numpy()
    return qs, cands, rho


def train_probe(data: VedjeTensors, inputs: tuple[torch.Tensor, torch.Tensor], c: int, negatives_from: int,
                use_rho: bool, seed: int, steps: int = 300, patience: int = 5) -> tuple[LinearProbe, dict[str, Any]]:
    """Full-batch AdamW on the VTM softmax CE (fresh hard negatives every step), checked every 10
    steps on the validation VTM candidates, best kept (the same early stopping as the model);
    ``inputs`` = ``probe_inputs(data)``."""
    torch.manual_seed(seed)
    f, q = inputs
    probe = LinearProbe(q.shape[1], f.shape[1], use_rho)
    opt = torch.optim.AdamW([p for p in probe.parameters() if p.requires_grad], lr=1e-2, weight_decay=1e-3)
    val = vtm_batches(data, "val", c, negatives_from, seed, 0)

    def loss_of(batch: tuple[list[int], np.ndarray, np.ndarray]) -> torch.Tensor:
        qs, cands, rho = batch
        return vtm_loss(probe(q[qs], f[torch.from_numpy(cands)], torch.from_numpy(rho)))

    best, weights, bad, evals = math.inf, None, 0, []
    for step in range(steps):
        batch = vtm_batches(data, "train", c, negatives_from, seed, step)
        if batch is None:
            break
        loss = loss_of(batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if val is not None and (step + 1) % 10 == 0:
            with torch.no_grad():
                v = float(loss_of(val))
            evals.append((step + 1, float(loss.detach()), v))
            if v < best - 1e-4:
                best, bad, weights = v, 0, {k: t.detach().clone() for k, t in probe.state_dict().items()}
            else:
                bad += 1
                if bad >= patience:
                    break
    if weights is not None:
        probe.load_state_dict(weights)
    return probe, {"best_val_vtm": best, "evals": evals}


def probe_scores(probe: LinearProbe, inputs: tuple[torch.Tensor, torch.Tensor], query_rows: Sequence[int],
                 cands: np.ndarray, rho: np.ndarray) -> np.ndarray:
    f, q = inputs
    with torch.no_grad():
        return probe(q[list(query_rows)], f[torch.from_numpy(cands)], torch.from_numpy(rho.astype(np.float32))).numpy()


def mixed_candidates(data: VedjeTensors, split: str, c: int, n: int, seed: int, hard: bool
                     ) -> tuple[list[int], np.ndarray, np.ndarray]:
    """Per query of the split: its best stage-1-ranked positive + c-1 negatives of other groups,
    either hard (``negatives_for`` from the stage-1 top-n) or uniformly random from the gallery;
    (queries, Q×c items, Q×c stage-1 scores). Queries without a positive in the top-n are skipped
    for both, so the two lists cover the same queries."""
    item_rows, _ = data.rows(split)
    query_rows, top, _ = candidate_lists(data, split, len(item_rows))
    items, rng = data.items, np.random.default_rng(seed)
    qs, rows = [], []
    for q, ranked in zip(query_rows, top, strict=True):
        group = items.groups[items.query_items[q]]
        head = [int(i) for i in ranked[:n]]
        pos = next((i for i in head if items.groups[i] == group), None)
        if pos is None:
            continue
        if hard:
            neg = negatives_for(q, np.asarray(head), items.groups, group, c - 1, seed, 0)
        else:
            pool = [int(i) for i in ranked if items.groups[int(i)] != group]
            neg = rng.choice(pool, size=min(c - 1, len(pool)), replace=False).tolist()
        if len(neg) == c - 1:
            qs.append(q)
            rows.append([pos, *neg])
    cands = np.asarray(rows, dtype=np.int64).reshape(len(rows), c)
    rho = ((data.query_emb[qs][:, None, :] * data.item_emb[torch.from_numpy(cands)]).sum(-1).numpy()
           if qs else np.zeros((0, c), np.float32))
    return qs, cands, rho


def shuffled(cands: np.ndarray, rho: np.ndarray, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Candidates in a random order per query (so "positive first" cannot win a tie)."""
    rng = np.random.default_rng(seed)
    order = np.stack([rng.permutation(cands.shape[1]) for _ in range(len(cands))]) if len(cands) else cands
    return np.take_along_axis(cands, order, 1), np.take_along_axis(rho, order, 1)


# ---------------------------------------------------------------- the checks

def run_checks(data: VedjeTensors, model: Vedje, args: argparse.Namespace, n: int, negatives_from: int,
               deadline: float = math.inf) -> dict[str, Any]:
    """(a) ρ hidden, (b) fit, (c) frozen features; prints each table with its reading. ``deadline``:
    that of the ρ = 0 training run."""
    out: dict[str, Any] = {}
    f1 = lambda x: "–" if x is None or math.isnan(x) else f"{x:.1f}"  # noqa: E731

    # (a) ρ hidden
    qs, top, sims = candidate_lists(data, "test", n)
    pos = is_positive(data, qs, top)
    with_rho = model_scores(model, data, qs, top, sims)
    zero_rho = model_scores(model, data, qs, top, sims, zero_rho=True)
    hidden, hidden_info = train_early_stopped(data, args, args.first_seed, negatives_from, hide_prior=True,
                                              deadline=deadline)
    hidden_scores = model_scores(hidden, data, qs, top, sims, zero_rho=True)
    rows_a = {"stage 1 (ρ alone)": sims, "VEDJE (ρ = stage-1 score)": with_rho,
              "VEDJE, ρ zeroed at scoring": zero_rho,
              f"VEDJE trained with ρ = 0 (best epoch {hidden_info['best_epoch']})": hidden_scores}
    a = {k: {"auc": pair_auc(s, pos), "r1": top1(s, pos), "sd": spread(s)} for k, s in rows_a.items()}
    out["a"] = {"rows": a, "hidden_model": hidden_info}
    print(f"\n### (a) ρ hidden — test queries, stage-1 top-{n} (pairs: positive vs hard negative in that list)")
    print("\n| scorer | pos > neg pairs (%) | R@1 | score sd within a list |\n|---|---|---|---|")
    for k, v in a.items():
        print(f"| {k} | {f1(v['auc'])} | {f1(v['r1'])} | {v['sd']:.2e} |")
    s_auc, h_auc, z_auc = (a["stage 1 (ρ alone)"]["auc"], list(a.values())[3]["auc"],
                           a["VEDJE, ρ zeroed at scoring"]["auc"])
    if h_auc > max(s_auc + 2, 55):
        reading = (f"without ρ the content path separates positives from hard negatives better than stage 1 "
                   f"({h_auc:.1f} vs {s_auc:.1f} %): the signal is learnable, so with ρ the model leans on the prior")
    elif max(h_auc, z_auc) > 55:
        reading = (f"the content path alone carries some signal ({max(h_auc, z_auc):.1f} % of pairs, chance 50) but "
                   f"less than stage 1's {s_auc:.1f} %: it cannot replace ρ at this scale")
    else:
        reading = (f"with ρ hidden the model is near chance on hard negatives ({max(h_auc, z_auc):.1f} % of pairs, "
                   f"chance 50; stage 1 {s_auc:.1f} %): text × cache has learned no distinction of its own")
    print(f"Reading: {reading}.")

    # (b) fit
    b = {}
    for split in ("train", "val", "test"):
        gallery = len(data.rows(split)[0])
        if not data.rows(split)[1]:
            continue
        m = min(n, gallery)
        if split == "test":  # the lists of (a)
            q_s, sims_s, pos_s, sc = qs, sims, pos, with_rho
        else:
            q_s, top_s, sims_s = candidate_lists(data, split, m)
            pos_s = is_positive(data, q_s, top_s)
            sc = model_scores(model, data, q_s, top_s, sims_s)
        b[split] = {"queries": len(q_s), "gallery": gallery, "n": m, "stage1_r1": top1(sims_s, pos_s),
                    "rerank_r1": top1(sc, pos_s), "stage1_auc": pair_auc(sims_s, pos_s), "auc": pair_auc(sc, pos_s)}
    out["b"] = b
    print("\n### (b) fit — rerank vs stage 1 on the queries it trained on, and on held-out ones")
    print("\n| split | queries | gallery | N_c | stage-1 R@1 | rerank R@1 | stage-1 pairs (%) | VEDJE pairs (%) |"
          "\n|---|---|---|---|---|---|---|---|")
    for split, v in b.items():
        print(f"| {split} | {v['queries']} | {v['gallery']} | {v['n']} | {f1(v['stage1_r1'])} | {f1(v['rerank_r1'])} | "
              f"{f1(v['stage1_auc'])} | {f1(v['auc'])} |")
    tr = b["train"]
    gain = tr["rerank_r1"] - tr["stage1_r1"]
    if gain > 1:
        reading = (f"it fits the training queries (R@1 {gain:+.1f} over stage 1) but not the held-out ones: "
                   f"generalisation, not optimisation, is the limit")
    else:
        reading = (f"it does not beat stage 1 even on its own training queries (R@1 {gain:+.1f}, pairs "
                   f"{tr['auc'] - tr['stage1_auc']:+.1f} pts): under-fitting, not over-fitting")
    print(f"Reading: {reading}.")

    # (c) frozen feature map
    c = args.candidates
    inputs = probe_inputs(data)
    probes = {use: train_probe(data, inputs, c, negatives_from, use, 0) for use in (True, False)}
    c_rows: dict[str, dict[str, float]] = {}
    lists = {}
    for hard in (True, False):
        q_c, cands, rho = mixed_candidates(data, "test", c, n, 0, hard)
        cands, rho = shuffled(cands, rho, 1)
        lists[hard] = (q_c, cands, rho, is_positive(data, q_c, cands))
    scorers: dict[str, tuple[Callable[[list[int], np.ndarray, np.ndarray], np.ndarray], np.ndarray | None]] = {
        "stage 1 (ρ alone)": (lambda q_, c_, r_: r_, sims),
        "VEDJE": (lambda q_, c_, r_: model_scores(model, data, q_, c_, r_), with_rho),
        "VEDJE, ρ zeroed": (lambda q_, c_, r_: model_scores(model, data, q_, c_, r_, zero_rho=True), zero_rho),
        "linear probe a·ρ + q₁ᵀWf(v)": (lambda q_, c_, r_: probe_scores(probes[True][0], inputs, q_, c_, r_), None),
        "linear probe q₁ᵀWf(v) (no ρ)": (lambda q_, c_, r_: probe_scores(probes[False][0], inputs, q_, c_, r_), None)}
    for name, (score, reranked) in scorers.items():
        row_c = {}
        for hard, key in ((True, "hard"), (False, "random")):
            q_c, cands, rho, p = lists[hard]
            row_c[key] = top1(score(q_c, cands, rho), p) if len(q_c) else float("nan")
        row_c["rerank_r1"] = top1(score(qs, top, sims) if reranked is None else reranked, pos)
        c_rows[name] = row_c
    raw = torch.stack([data.features(torch.tensor([i]))[0].mean(dim=(0, 1)) for i in range(len(data.items.item_ids))])
    cache = listed_caches(model, data, [lists[hard][1] for hard in (True, False)])
    cosines = {f"{what}, {key}": pos_neg_cosine(vecs, lists[hard][1], lists[hard][3])
               for what, vecs in (("features", raw), ("caches", cache)) for hard, key in ((True, "hard"),
                                                                                         (False, "random"))}
    out["c"] = {"rows": c_rows, "queries": len(lists[True][0]), "probe": {str(k): v[1] for k, v in probes.items()},
                "cosine": cosines}
    print(f"\n### (c) the frozen feature map — test queries; top-1 among {c} candidates (the positive + {c - 1} "
          f"negatives, shuffled; chance {100 / c:.0f} %), and R@1 reranking the stage-1 top-{n}")
    print(f"\n| scorer | + hard negatives (top-{n}) | + random negatives | rerank R@1 (top-{n}) |\n|---|---|---|---|")
    for name, v in c_rows.items():
        print(f"| {name} | {f1(v['hard'])} | {f1(v['random'])} | {f1(v['rerank_r1'])} |")
    print("cosine positive–negative (mean-pooled frozen features | VEDJE caches): hard "
          f"{cosines['features, hard']:.4f} | {cosines['caches, hard']:.4f}, random {cosines['features, random']:.4f}"
          f" | {cosines['caches, random']:.4f}")
    s1, vz, lp = c_rows["stage 1 (ρ alone)"], c_rows["VEDJE, ρ zeroed"], c_rows["linear probe q₁ᵀWf(v) (no ρ)"]
    lpr = c_rows["linear probe a·ρ + q₁ᵀWf(v)"]
    parts = []
    # stage 1 sits below chance on its own hard lists by construction (they are its top-ranked
    # negatives), so the no-ρ probe is judged against chance there, with a 5-point margin
    if lpr["rerank_r1"] > s1["rerank_r1"] + 1 or lp["hard"] > 100 / c + 5:
        parts.append(f"a linear probe on the same frozen features does better (R@1 {lpr['rerank_r1']:.1f} vs stage "
                     f"1's {s1['rerank_r1']:.1f}; no-ρ probe on hard lists {lp['hard']:.1f} vs chance {100 / c:.0f}), "
                     "so the features carry signal the joint model has not learned to use")
    else:
        parts.append(f"no linear read-out of the frozen features beats stage 1 (R@1 {lpr['rerank_r1']:.1f} vs "
                     f"{s1['rerank_r1']:.1f}; no-ρ probe on hard lists {lp['hard']:.1f}, chance {100 / c:.0f}): "
                     f"consistent with the feature map (or what the captions say) being the limit, not proof of it")
    parts.append(f"without ρ VEDJE picks the positive {vz['random']:.1f} % against random negatives vs "
                 f"{vz['hard']:.1f} % against hard ones")
    print(f"Reading: {'; '.join(parts)}.")
    return out


# ---------------------------------------------------------------- main

def load_source(name: str, src: dict[str, Any]) -> VedjeTensors:
    return cached_tensors(load_profile("demo", {"vedje": {"source": src["source"]}}), src["stage1"])


def run_deadline(source_end: float, left_runs: int) -> float:
    """The end of the next training run's share: an equal part of what is left of the source's time,
    less RESERVE for the evaluations (math.inf without a budget)."""
    if math.isinf(source_end):
        return math.inf
    now = time.perf_counter()
    return now + max(source_end - now, 0.0) * (1 - RESERVE) / left_runs


def beats_stage1(runs: list[dict[str, Any]], n_c: list[int]) -> tuple[bool, str]:
    """Rerank beats stage 1 when, at some N_c, its mean R@1 exceeds stage 1's by more than
    max(1 point, the seeds' sd of the difference)."""
    notes, win = [], False
    for n in n_c:
        d = np.array([value(r["bf16"], "rerank", n, "R@1") - value(r["bf16"], "stage-1", 0, "R@1") for r in runs])
        margin = max(1.0, float(d.std()))
        win |= bool(d.mean() > margin)
        notes.append(f"N_c={n}: {d.mean():+.1f} (needs > {margin:.1f})")
    return win, "; ".join(notes)


def main(argv: Sequence[str] | None = None, load: Loader = load_source) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=sorted(SOURCES), default=None)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--max-epochs", type=int, default=30)
    parser.add_argument("--patience", type=int, default=3, help="evaluations without a lower validation VTM loss")
    parser.add_argument("--eval-every", type=int, default=1, help="epochs between evaluations")
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--candidates", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--decay", type=float, default=0.9, help="lr factor per epoch after warmup")
    parser.add_argument("--val-share", type=float, default=0.15)
    parser.add_argument("--checks", choices=("auto", "always", "never"), default="auto")
    parser.add_argument("--budget-min", type=float, default=30.0,
                        help="wall-clock budget for training + evaluation, shared out over sources and training runs; "
                             "0 = none (only --max-epochs and --patience stop training)")
    parser.add_argument("--compressor-norm", choices=("post", "pre"), default="post",
                        help="LayerNorm placement in the cache compressor (models/reranker/compressor.py)")
    parser.add_argument("--structure-weight", type=float, default=0.0,
                        help="> 0: add the experiment-only cache-structure term (not the paper's recipe), this weight")
    parser.add_argument("--first-seed", type=int, default=0, help="seeds run are first-seed … first-seed + seeds − 1")
    parser.add_argument("--encoder", default=None, help="joint encoder id or folder (default: the demo profile's)")
    parser.add_argument("--tiny", action="store_true", help="tiny sizes (smoke test): few items, 1 layer, batch 4")
    args = parser.parse_args(argv)
    if args.tiny:
        args.layers, args.batch, args.candidates = TINY["layers"], TINY["batch"], TINY["candidates"]
    torch.set_num_threads(2)
    report: dict[str, Any] = {"args": vars(args)}
    out = state_dir() / "experiments" / "vedje_convergence.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    loaded: dict[str, VedjeTensors] = {}
    for name, src in SOURCES.items():  # load (and on a first run extract features) before the clock starts
        if args.only and args.only != name:
            continue
        try:
            loaded[name] = load(name, src)
        except FileNotFoundError as exc:
            print(f"\n## {name}: skipped — {exc}", flush=True)
            report[name] = {"skipped": str(exc)}
    start = time.perf_counter()
    end = start + 60 * args.budget_min if args.budget_min > 0 else math.inf
    for k, (name, data) in enumerate(loaded.items()):
        src = SOURCES[name]
        source_end = time.perf_counter() + (end - time.perf_counter()) / (len(loaded) - k)  # unused time rolls on
        trainings = args.seeds + (args.checks != "never")  # the ρ = 0 run of check (a)

        if args.tiny:
            data = tiny_subset(data)
        data, counts = validation_split(data, VAL_BY[name], args.val_share, seed=0)
        gallery = counts["test_items"]
        n_c = sorted({min(n, gallery) for n in (20, 50, 100)})
        print(f"\n## {name}: T={data.item_frames.shape[1]}, stage 1 = {src['stage1']}, compressor "
              f"{args.compressor_norm}-norm; train {counts['train_items']} items / {counts['train_queries']} queries, "
              f"validation (by {VAL_BY[name]}) {counts['val_items']} / "
              f"{counts['val_queries']}, {counts['val_gap_items']} training items dropped as val_gap, test "
              f"{gallery} / {counts['test_queries']}", flush=True)
        runs, models = [], []
        for k_seed, seed in enumerate(range(args.first_seed, args.first_seed + args.seeds)):
            model, info = train_early_stopped(data, args, seed, src["negatives_from"],
                                              deadline=run_deadline(source_end, trainings - k_seed))
            print(curve_table(info, f"### curve, seed {seed}"), flush=True)
            rows = evaluate_rerank(model, data, stored_caches(model, data, "bf16"), n_c)
            runs.append({"bf16": rows, "train": info})
            models.append(model)
            report[name] = {"counts": counts, "runs": runs}
            out.write_text(json.dumps(report, indent=1, default=str))
        print(f"\n### rerank vs stage 1 (test, best checkpoints, {args.seeds} seeds)")
        print("\n| ranking | R@1 | R@5 | R@10 |\n|---|---|---|---|")
        print(row("stage 1", runs, "stage-1", 0))
        for n in n_c:
            print(row(f"VEDJE rerank, N_c={n}", runs, "rerank", n))
        print(f"best epochs: {[r['train']['best_epoch'] for r in runs]}; steps to best: "
              f"{[r['train']['best_step'] for r in runs]}; stopped: {[r['train']['stopped'] for r in runs]}; "
              f"training s: {[r['train']['seconds'] for r in runs]}")
        win, why = beats_stage1(runs, n_c)
        print(f"rerank beats stage 1: {'yes' if win else 'no'} (R@1 rerank − stage 1, mean over seeds: {why})")
        report[name]["beats_stage1"] = win
        if args.checks == "always" or (args.checks == "auto" and not win):
            report[name]["checks"] = run_checks(data, models[0], args, n_c[0], src["negatives_from"],
                                                deadline=run_deadline(source_end, 1))
        out.write_text(json.dumps(report, indent=1, default=str))
        print(f"({time.perf_counter() - start:.0f}s)", flush=True)
    print(f"\n{time.perf_counter() - start:.0f}s; raw results in {out}")
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
