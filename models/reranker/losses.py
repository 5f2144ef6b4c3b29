"""VEDJE training objectives (Eq. 6; App. A.3): L = L_vtm + L_vtc + L_mlm + L_delta, equal weights.
L_delta lives with its predictor in ``future_delta.py``."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def vtm_loss(scores: torch.Tensor, positive: torch.Tensor | None = None, tau: float = 1.0) -> torch.Tensor:
    """Softmax cross-entropy over each query's candidate scores (Q×C) at temperature τ, the positive
    at column ``positive`` (default 0)."""
    target = torch.zeros(scores.shape[0], dtype=torch.long, device=scores.device) if positive is None else positive
    return F.cross_entropy(scores / tau, target)


def vtc_loss(text: torch.Tensor, items: torch.Tensor, scale: float = 20.0, groups: torch.Tensor | None = None
             ) -> torch.Tensor:
    """Symmetric in-batch InfoNCE between L2-normalised text and (frozen) item embeddings, logit
    scale 20; row i's positive is item i. ``groups``: items with the same group id as the positive
    (the same clip / identity twice in a batch) are removed from the negatives."""
    t, v = F.normalize(text, dim=-1), F.normalize(items.to(text.device), dim=-1)
    logits = scale * t @ v.T
    if groups is not None:
        groups = groups.to(t.device)
        same = groups[:, None] == groups[None, :]
        logits = logits.masked_fill(same & ~torch.eye(len(groups), dtype=torch.bool, device=t.device), float("-inf"))
    target = torch.arange(len(t), device=t.device)
    return 0.5 * (F.cross_entropy(logits, target) + F.cross_entropy(logits.T, target))


def mlm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over the masked positions (labels −100 elsewhere)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)


def cache_structure_loss(caches: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
    """Not in the paper (an experiment, ``experiments/vedje_cache_collapse.py``): mean over item
    pairs i ≠ j of (cos(c_i, c_j) − cos(f̄_i, f̄_j))², c_i the item's flattened cache, f̄_i the mean
    of its frozen backbone features. It asks the compressor to keep the backbone's pairwise
    similarity structure — items the features tell apart get caches that differ as much — where the
    recipe's terms make every cache alike. No parameters; 0 for fewer than two items."""
    n = caches.shape[0]
    if n < 2:
        return caches.sum() * 0.0
    c = F.normalize(caches.reshape(n, -1).float(), dim=-1)
    f = F.normalize(features.reshape(n, -1, features.shape[-1]).float().mean(dim=1), dim=-1)
    off = ~torch.eye(n, dtype=torch.bool, device=c.device)
    return ((c @ c.T - (f @ f.T).to(c.device)) ** 2)[off].mean()
