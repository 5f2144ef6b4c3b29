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
