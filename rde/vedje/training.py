"""Train the VEDJE stack (compressor + joint reranker + training heads) on frozen backbone
features, and evaluate reranking against the first stage (App. A.3; Sec. 4 protocol).

Per step: B training queries. VTM candidates are drawn the way ``rerank`` will see them: from the
query's stage-1 top-N (N = ``negatives_from``), the positive plus hard negatives of other groups.
A query whose positive is not in its stage-1 top-N adds no VTM term (VTC, MLM and delta still
apply): forcing such a positive in would give it a lower ρ than every negative, and with a weak
stage 1 the reranker learns "low prior = match" (we measured this shortcut: train VTM loss fell
while test recall did not move). Every candidate's cache is computed
by the compressor from the frozen features (gradients reach the compressor); the losses are
L_vtm (softmax CE over candidates, τ = 1) + L_vtc (text [CLS] → item space vs the frozen stage-1
item embeddings, scale 20) + L_mlm (15 % of caption tokens, positive cache in context) +
L_delta (Eq. 4, on the positives' frames), equal weights. AdamW (wd 0.02); linear warmup from
lr_start to lr_peak over ``warmup_steps`` steps, then lr_peak · decay^epoch.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from models.reranker.future_delta import delta_loss
from models.reranker.losses import cache_structure_loss, mlm_loss, vtc_loss, vtm_loss
from models.reranker.onnx_scoring import onnx_scoring_supported, score_onnx
from models.reranker.vedje import Vedje
from rde.vedje.data import ItemSet, negatives_for

LOSSES = ("vtm", "vtc", "mlm", "delta")


@dataclass
class VedjeTensors:
    """Frozen inputs: backbone features per frame (F×P×d_v, fp16), item→frame rows (I×T), stage-1
    item and query embeddings (normalised), and the item set they describe."""

    items: ItemSet
    frame_features: torch.Tensor
    item_frames: torch.Tensor
    item_emb: torch.Tensor
    query_emb: torch.Tensor

    def features(self, item_rows: torch.Tensor) -> torch.Tensor:
        return self.frame_features[self.item_frames[item_rows]].float()

    def rows(self, split: str) -> tuple[list[int], list[int]]:
        """(item rows, query rows) of a split."""
        it = [i for i, s in enumerate(self.items.splits) if s == split]
        qs = [q for q, i in enumerate(self.items.query_items) if self.items.splits[i] == split]
        return it, qs


@dataclass(frozen=True)
class VedjeTrainConfig:
    epochs: int = 4
    batch_size: int = 64
    train_candidates: int = 8
    negatives_from: int = 20
    lr_start: float = 1e-6
    lr_peak: float = 3e-4
    warmup_steps: int = 400
    epoch_decay: float = 0.9
    weight_decay: float = 0.02
    seed: int = 0
    losses: tuple[str, ...] = LOSSES
    # a control (experiments/vedje_convergence.py): the scorer is fed ρ = 0 in training, so any
    # VTM gain has to come from the text and the cache, not from the stage-1 score
    hide_prior: bool = False
    # weight of the experiment-only cache-structure term (``cache_structure_loss``), used when
    # "structure" is in ``losses``
    structure_weight: float = 1.0


@dataclass
class VedjeTrainResult:
    step_losses: list[dict[str, float]] = field(default_factory=list)
    epoch_loss: list[float] = field(default_factory=list)
    vtm_share: float = 0.0  # training queries whose positive is in their stage-1 top-N (they get a VTM term)
    resumed_from: int | None = None
    seconds: float = 0.0


def learning_rate(cfg: VedjeTrainConfig, step: int, epoch: int) -> float:
    """Linear warmup lr_start → lr_peak over ``warmup_steps``, then per-epoch step decay."""
    if step < cfg.warmup_steps:
        return cfg.lr_start + (cfg.lr_peak - cfg.lr_start) * step / cfg.warmup_steps
    return cfg.lr_peak * cfg.epoch_decay ** epoch


def stage1_top(data: VedjeTensors, query_rows: Sequence[int], item_rows: Sequence[int], top: int
               ) -> tuple[np.ndarray, np.ndarray]:
    """Stage-1 ranking of ``item_rows`` for each query: (Q×top item rows, Q×top cosine scores)."""
    sims = (data.query_emb[list(query_rows)] @ data.item_emb[list(item_rows)].T).numpy()
    top = min(top, len(item_rows))
    order = np.argsort(-sims, axis=1, kind="stable")[:, :top]
    return np.asarray(item_rows)[order], np.take_along_axis(sims, order, axis=1)


def batch_losses(model: Vedje, data: VedjeTensors, queries: Sequence[int], ranked: dict[int, np.ndarray],
                 cfg: VedjeTrainConfig, step: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """The four loss terms for one batch of query rows (those not in ``cfg.losses`` are skipped),
    and the experiment-only cache-structure term when ``cfg.losses`` names it (weighted)."""
    items = data.items
    pos = [items.query_items[q] for q in queries]
    vtm = [k for k, (q, p) in enumerate(zip(queries, pos, strict=True)) if p in ranked[q]]
    cands = [[pos[k], *negatives_for(queries[k], ranked[queries[k]], items.groups, items.groups[pos[k]],
                                     cfg.train_candidates - 1, cfg.seed, step)] for k in vtm]
    width = min((len(c) for c in cands), default=0)
    cands = [c[:width] for c in cands] if width >= 2 else []
    unique = list(dict.fromkeys(pos + [i for c in cands for i in c]))  # positives first
    where = {i: k for k, i in enumerate(unique)}
    device = model.reranker.device
    x = data.features(torch.tensor(unique)).to(device)
    out: dict[str, torch.Tensor] = {}
    if model.shape.structure == "frames":
        frame_tokens = model.compressor.frame_tokens(x)
        caches = frame_tokens.reshape(len(unique), -1, frame_tokens.shape[-1])
    else:
        frame_tokens, caches = None, model.compressor(x)
    text = model.reranker.tokenize([items.query_texts[q] for q in queries])
    if "vtm" in cfg.losses and cands:
        flat = [i for c in cands for i in c]
        vtm_queries = [queries[k] for k in vtm]
        rho = (data.query_emb[vtm_queries].repeat_interleave(width, 0) * data.item_emb[flat]).sum(-1)
        if cfg.hide_prior:
            rho = torch.zeros_like(rho)
        rows = torch.tensor(vtm).repeat_interleave(width)
        scores = model.reranker.score(text, rows, caches[[where[i] for i in flat]], rho)
        out["vtm"] = vtm_loss(scores.reshape(len(vtm), width))
    if "vtc" in cfg.losses:
        group_ids: dict[str, int] = {}
        groups = torch.tensor([group_ids.setdefault(items.groups[p], len(group_ids)) for p in pos])
        out["vtc"] = vtc_loss(model.reranker.text_embedding(text), data.item_emb[pos].to(device), groups=groups)
    if "mlm" in cfg.losses:
        ids, labels = model.reranker.mask_tokens(text, generator)
        targets = labels != -100
        logits = model.reranker.mlm_logits(ids, text.mask, caches[[where[p] for p in pos]], at=targets)
        out["mlm"] = mlm_loss(logits, labels[targets])
    if "structure" in cfg.losses:
        out["structure"] = cfg.structure_weight * cache_structure_loss(caches, x)
    if "delta" in cfg.losses and model.delta_head is not None and frame_tokens is not None:
        n = len(dict.fromkeys(pos))
        z = frame_tokens[:n]
        pred = model.delta_head(z.reshape(-1, *z.shape[2:])).reshape(n, z.shape[1], *model.delta_head_shape())
        out["delta"] = delta_loss(pred, x[:n], model.shape.horizons)
    return out


def train_vedje(model: Vedje, data: VedjeTensors, cfg: VedjeTrainConfig, checkpoint_dir: Path | None = None,
                on_epoch: Callable[[int, float], None] | None = None,
                on_step: Callable[[int, int], None] | None = None,
                should_stop: Callable[[int, VedjeTrainResult], bool] | None = None) -> VedjeTrainResult:
    """Train on the ``train`` split (resuming from the last epoch checkpoint in ``checkpoint_dir``);
    ``on_step(steps done, steps in all)`` before every batch and after each epoch (progress displays).
    ``should_stop(epoch, result so far)`` runs after each epoch (after its checkpoint); True ends
    training there (early stopping). It may evaluate the model: the next epoch sets train mode again."""
    start = time.perf_counter()
    torch.manual_seed(cfg.seed)
    item_rows, query_rows = data.rows("train")
    if not query_rows:
        raise ValueError("no training queries: the train split is empty")
    top, _ = stage1_top(data, query_rows, item_rows, cfg.negatives_from)
    ranked = {q: top[k] for k, q in enumerate(query_rows)}
    result = VedjeTrainResult(vtm_share=float(np.mean([data.items.query_items[q] in ranked[q] for q in query_rows])))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr_start, weight_decay=cfg.weight_decay)
    first_epoch = 0
    ckpt = checkpoint_dir / "last.pt" if checkpoint_dir else None
    if ckpt is not None and ckpt.exists():
        state = torch.load(ckpt, map_location="cpu", weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        first_epoch, result.step_losses, result.epoch_loss = state["epoch"] + 1, state["steps"], state["epoch_loss"]
        result.resumed_from = state["epoch"]
    steps_per_epoch = math.ceil(len(query_rows) / cfg.batch_size)
    generator = torch.Generator().manual_seed(cfg.seed)
    frozen_compressor = not any(p.requires_grad for p in model.compressor.parameters())
    for epoch in range(first_epoch, cfg.epochs):
        model.train()
        if frozen_compressor:  # caches at query time come from the eval-mode compressor
            model.compressor.eval()
        order = np.random.default_rng(cfg.seed + epoch).permutation(query_rows)
        totals = []
        for b in range(steps_per_epoch):
            step = epoch * steps_per_epoch + b
            batch = [int(q) for q in order[b * cfg.batch_size:(b + 1) * cfg.batch_size]]
            if on_step is not None:
                on_step(step, steps_per_epoch * cfg.epochs)
            if len(batch) < 2:
                continue
            for group in opt.param_groups:
                group["lr"] = learning_rate(cfg, step, epoch)
            terms = batch_losses(model, data, batch, ranked, cfg, step, generator)
            if not terms:  # e.g. VTM only and no positive of this batch in its stage-1 top-N
                continue
            loss = torch.stack(list(terms.values())).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
            totals.append(float(loss.detach()))
            values = {k: float(v.detach()) for k, v in terms.items()}
            result.step_losses.append({"step": step, "epoch": epoch, **values})
        result.epoch_loss.append(float(np.mean(totals)) if totals else float("nan"))
        if on_step is not None:
            on_step((epoch + 1) * steps_per_epoch, steps_per_epoch * cfg.epochs)
        if on_epoch is not None:
            on_epoch(epoch, result.epoch_loss[-1])
        if ckpt is not None:
            ckpt.parent.mkdir(parents=True, exist_ok=True)
            tmp = ckpt.with_suffix(".tmp")
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": epoch,
                        "steps": result.step_losses, "epoch_loss": result.epoch_loss}, tmp)
            tmp.replace(ckpt)
        if should_stop is not None and should_stop(epoch, result):
            break
    model.eval()
    result.seconds = time.perf_counter() - start
    return result


def validation_vtm_loss(model: Vedje, data: VedjeTensors, cfg: VedjeTrainConfig, split: str = "val",
                        batch: int = 64, step: int = 0) -> tuple[float, int]:
    """The VTM objective on a held-out split, no gradient, eval mode (no dropout): the split's
    queries ranked by stage 1 within the split's own gallery, candidates built as in training (the
    positive + ``cfg.train_candidates - 1`` hard negatives of other groups from the stage-1
    top-``cfg.negatives_from``; queries whose positive stage 1 missed add no term), negatives drawn
    at a fixed ``step`` so every evaluation sees the same candidates. Returns (mean loss over the
    queries with a term, how many; nan and 0 when none)."""
    item_rows, query_rows = data.rows(split)
    if not query_rows:
        return float("nan"), 0
    top, _ = stage1_top(data, query_rows, item_rows, cfg.negatives_from)
    ranked = {q: top[k] for k, q in enumerate(query_rows)}
    vtm_cfg = replace(cfg, losses=("vtm",))
    generator = torch.Generator().manual_seed(cfg.seed)  # unused by VTM; batch_losses takes one
    was = model.training
    model.eval()
    total, count = 0.0, 0
    try:
        with torch.no_grad():
            for s in range(0, len(query_rows), batch):
                chunk = query_rows[s:s + batch]
                n = sum(data.items.query_items[q] in ranked[q] for q in chunk)
                if n == 0:
                    continue
                terms = batch_losses(model, data, chunk, ranked, vtm_cfg, step, generator)
                if "vtm" in terms:
                    total, count = total + float(terms["vtm"]) * n, count + n
    finally:
        model.train(was)
    return (total / count if count else float("nan")), count


def stored_caches(model: Vedje, data: VedjeTensors, precision: str = "bf16"
                  ) -> Callable[[Sequence[int]], torch.Tensor]:
    """Item rows → caches as ``rerank`` reads them: compressor (eval mode) → encoded at ``precision``
    → decoded to FP32 (for evaluating without writing an index)."""
    from models.reranker.cache_codec import decode, encode

    def cache_of(rows: Sequence[int]) -> torch.Tensor:
        z = model.index(data.features(torch.tensor(list(rows)))).numpy()
        return torch.from_numpy(np.stack([decode(encode(c, precision), c.shape, precision) for c in z]))

    return cache_of


SCORE_PATHS = ("onnx", "fast", "reference")  # vedje.score_path


def joint_scores(model: Vedje, texts: Sequence[str], pairs: Sequence[tuple[int, int]], caches: torch.Tensor,
                 rho: torch.Tensor, batch: int = 256, path: str = "onnx") -> np.ndarray:
    """s_θ for (query index, cache row) pairs, in chunks of ``batch`` pairs (Alg. 1, lines 9–11).

    ``path`` "onnx" (default) runs ``JointReranker.score_fast``'s graph in ONNX Runtime
    (``onnx_scoring.score_onnx``; on the CPU, with onnxruntime installed, else it falls back to "fast"); "fast"
    scores through ``score_fast`` under inference mode (the same scores up to float rounding, fewer
    operations; a non-BERT encoder falls back to the reference); "reference" runs the encoder's own
    forward over every token (``score``)."""
    if path not in SCORE_PATHS:
        raise ValueError(f"joint scoring path must be one of {', '.join(map(repr, SCORE_PATHS))}, got {path!r}")
    model.eval()
    reranker = model.reranker
    score = reranker.score
    if path in ("onnx", "fast") and reranker.fast_scoring_supported():
        score = partial(score_onnx, reranker) if path == "onnx" and onnx_scoring_supported(reranker) \
            else reranker.score_fast
    with torch.inference_mode():
        text = reranker.tokenize(list(texts))
        out = []
        for s in range(0, len(pairs), batch):
            chunk = pairs[s:s + batch]
            rows = torch.tensor([q for q, _ in chunk])
            out.append(score(text, rows, caches[[c for _, c in chunk]], rho[s:s + batch]).float().cpu().numpy())
    return np.concatenate(out) if out else np.zeros(0, np.float32)


def hits_at(ranked_groups: Sequence[Sequence[str]], truth: Sequence[str], k: int) -> np.ndarray:
    """Per query: 1.0 when its relevant group appears in the first k of its ranking, else 0.0."""
    return np.array([t in list(r[:k]) for r, t in zip(ranked_groups, truth, strict=True)], float)


def recall_at(ranked_groups: Sequence[Sequence[str]], truth: Sequence[str], k: int) -> float:
    """Share of queries whose relevant group appears in the first k (percent)."""
    return 100.0 * float(np.mean(hits_at(ranked_groups, truth, k)))


def reranked_order(first: Sequence[Any], scores: np.ndarray, n: int) -> list[Any]:
    """A stage-1 ranking whose first ``n`` entries are reordered by their rerank ``scores`` (highest
    first, ties in stage-1 order); the rest keep their stage-1 order."""
    return [first[j] for j in np.argsort(-np.asarray(scores)[:n], kind="stable")] + list(first[n:])


def evaluate_rerank(model: Vedje, data: VedjeTensors, cache_of: Callable[[Sequence[int]], torch.Tensor],
                    n_candidates: Sequence[int], split: str = "test", batch: int = 256,
                    ks: Sequence[int] = (1, 5, 10)) -> list[dict[str, Any]]:
    """R@K of the stage-1 ranking and of the reranked top-N_c (items past N_c keep their stage-1
    order) for each N_c, over the split's queries and gallery. ``cache_of(item rows)`` gives caches."""
    item_rows, query_rows = data.rows(split)
    if not query_rows:
        return []
    n_max = min(max(n_candidates), len(item_rows))
    top, sims = stage1_top(data, query_rows, item_rows, len(item_rows))
    cand = top[:, :n_max]
    uniq = sorted({int(i) for i in cand.ravel()})
    where = {i: k for k, i in enumerate(uniq)}
    caches = cache_of(uniq)
    pairs = [(qi, where[int(i)]) for qi in range(len(query_rows)) for i in cand[qi]]
    scores = joint_scores(model, [data.items.query_texts[q] for q in query_rows], pairs, caches,
                          torch.from_numpy(sims[:, :n_max].reshape(-1).copy()), batch).reshape(len(query_rows), n_max)
    groups = data.items.groups
    truth = [groups[data.items.query_items[q]] for q in query_rows]
    first = [[groups[int(i)] for i in row] for row in top]
    rows: list[dict[str, Any]] = []
    for k in ks:
        rows.append({"ranking": "stage-1", "n_candidates": 0, "metric": f"R@{k}", "value": recall_at(first, truth, k)})
    for n in sorted({min(n, len(item_rows)) for n in n_candidates}):
        reranked = [reranked_order(first[qi], scores[qi], n) for qi in range(len(query_rows))]
        rows += [{"ranking": "rerank", "n_candidates": n, "metric": f"R@{k}", "value": recall_at(reranked, truth, k)}
                 for k in ks]
    for r in rows:
        r["queries"], r["gallery"] = len(query_rows), len(item_rows)
    return rows


def build_model(spec: Any, d_v: int, patches: int, frames: int, item_dim: int, **overrides: Any) -> Vedje:
    """A fresh VEDJE stack from a profile's ``vedje`` section (``overrides``: VedjeShape fields, or
    ``layers`` / ``encoder_dropout`` for the joint encoder)."""
    from models.backends.torch_runtime import resolve_device
    from models.reranker.joint_encoder import JointReranker, load_bert
    from models.reranker.vedje import VedjeShape

    layers = overrides.pop("layers", spec.joint_encoder.options.get("layers"))
    encoder_dropout = overrides.pop("encoder_dropout", spec.encoder_dropout)
    bert, tokenizer = load_bert(spec.joint_encoder.model_id, spec.joint_encoder.revision, layers)
    shape = VedjeShape(**{"d_v": d_v, "patches": patches, "frames": frames, "tokens_per_frame": spec.tokens_per_frame,
                          "structure": spec.structure, "horizons": tuple(spec.horizons), "delta": spec.delta,
                          "compressor_layers": spec.compressor_layers, "compressor_norm": spec.compressor_norm,
                          "heads": spec.heads, "dropout": spec.dropout,
                          **overrides})
    model = Vedje(shape, JointReranker(bert, tokenizer, item_dim, spec.max_text_tokens, dropout=encoder_dropout))
    return model.to(resolve_device(spec.joint_encoder.device))


def train_config(spec: Any, **overrides: Any) -> VedjeTrainConfig:
    """The training settings of a profile's ``vedje`` section."""
    return VedjeTrainConfig(**{"epochs": spec.epochs, "batch_size": spec.batch_size,
                               "train_candidates": spec.train_candidates, "negatives_from": spec.negatives_from,
                               "lr_start": spec.lr_start, "lr_peak": spec.lr_peak, "warmup_steps": spec.warmup_steps,
                               "epoch_decay": spec.epoch_decay, "weight_decay": spec.weight_decay, "seed": spec.seed,
                               **overrides})


def frozen_compressor_config(model: Vedje, previous: Vedje, cfg: VedjeTrainConfig) -> VedjeTrainConfig:
    """Keep ``previous``'s compressor in ``model`` and freeze it (the caches built with it stay
    valid); the training config without the loss that trains the compressor (``delta``)."""
    model.compressor.load_state_dict(previous.compressor.state_dict())
    model.compressor.requires_grad_(False)
    return replace(cfg, losses=tuple(t for t in cfg.losses if t != "delta"))


def evaluate_precisions(model: Vedje, data: VedjeTensors, candidates: int, batch: int,
                        precisions: Sequence[str] = ("bf16", "fp8", "fp4")) -> list[dict[str, Any]]:
    """``evaluate_rerank`` with the caches stored at each precision, one row set per precision."""
    rows: list[dict[str, Any]] = []
    for precision in precisions:
        rows += [{**r, "precision": precision} for r in evaluate_rerank(
            model, data, stored_caches(model, data, precision), candidates, batch=batch)]
    return rows
