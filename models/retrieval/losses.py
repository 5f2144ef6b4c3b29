"""Training losses of the two papers, on L2-normalised batch embeddings (row i of the image and
text matrices form the positive pair i).

Conventions: ``S_i2t[i, j] = p_ij`` is the student's softmax over texts j for image i (Eq. 4),
``S_t2i[i, j] = p_ji`` its softmax over images j for text i. KL(P‖Q) = Σ_j P_j (log P_j − log Q_j)
per row, averaged over the rows of the batch ("batchmean"), so every loss is a mean per sample.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _kl_rows(p_log: torch.Tensor, q_log: torch.Tensor) -> torch.Tensor:
    """Mean over rows of KL(P‖Q), both given as log-probabilities."""
    return (p_log.exp() * (p_log - q_log)).sum(dim=1).mean()


def itc_loss(img: torch.Tensor, txt: torch.Tensor, tau: float | torch.Tensor,
             weights: torch.Tensor | None = None) -> torch.Tensor:
    """Image-text contrastive loss with one-hot targets (SAFT Eq. 3-4; GTR+ Eq. 4).

    L = (L_i2t + L_t2i) / 2 with L_i2t = −(1/N) Σ_i w_i log p_ii. ``weights`` (GTR+ Eq. 10: C_i^β)
    multiply each pair's two terms; the mean stays over N (not over Σ w), as E[C^β · ℓ] in the paper.
    """
    logits = img @ txt.T / tau
    targets = torch.arange(len(img), device=img.device)
    i2t = F.cross_entropy(logits, targets, reduction="none")
    t2i = F.cross_entropy(logits.T, targets, reduction="none")
    per_pair = (i2t + t2i) / 2
    if weights is not None:
        per_pair = per_pair * weights
    return per_pair.mean()


def cross_modal_log_probs(img: torch.Tensor, txt: torch.Tensor, tau: float | torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(log S_i2t, log S_t2i): row-wise log-softmax of img·txtᵀ/τ and of txt·imgᵀ/τ (Eq. 4 and 5)."""
    logits = img @ txt.T / tau
    return F.log_softmax(logits, dim=1), F.log_softmax(logits.T, dim=1)


def sass_loss(img: torch.Tensor, txt: torch.Tensor, tau: float | torch.Tensor, teacher_img: torch.Tensor,
              teacher_txt: torch.Tensor, tau_teacher: float) -> torch.Tensor:
    """Semantic-Aware Soft Supervision (SAFT Eq. 5-6): the teacher's cross-modal distributions at
    τ_o as soft targets, KL in both directions and both modalities, averaged (the 1/4 of Eq. 6)."""
    s_i2t, s_t2i = cross_modal_log_probs(img, txt, tau)
    t_i2t, t_t2i = cross_modal_log_probs(teacher_img, teacher_txt, tau_teacher)
    return (_kl_rows(t_i2t, s_i2t) + _kl_rows(t_t2i, s_t2i) + _kl_rows(s_i2t, t_i2t) + _kl_rows(s_t2i, t_t2i)) / 4


def isd_loss(img: torch.Tensor, tau: float | torch.Tensor, teacher_img: torch.Tensor,
             tau_teacher: float) -> torch.Tensor:
    """Intra-modal Structural Distillation (SAFT Eq. 7-9): KL(T_v2v‖S_v2v) over image-image
    softmaxes. The sums of Eq. 7-8 run over k = 1..N, so the diagonal (an image with itself) is
    kept, as written."""
    s_v2v = F.log_softmax(img @ img.T / tau, dim=1)
    t_v2v = F.log_softmax(teacher_img @ teacher_img.T / tau_teacher, dim=1)
    return _kl_rows(t_v2v, s_v2v)


def saft_loss(img: torch.Tensor, txt: torch.Tensor, tau: float | torch.Tensor, teacher_img: torch.Tensor,
              teacher_txt: torch.Tensor, tau_teacher: float, alpha: float = 1.0, beta: float = 0.75,
              weights: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """L_SAFT = L_ITC + α·L_SASS + β·L_ISD (Eq. 10; α = 1, β = 0.75), every term and the total.

    Same values as the three functions above, computed in one pass: the student's logits and
    log-softmaxes are shared between ITC and SASS, and the teacher's (constant) distributions are
    built without autograd."""
    s_i2t, s_t2i = cross_modal_log_probs(img, txt, tau)
    per_pair = -(s_i2t.diagonal() + s_t2i.diagonal()) / 2
    itc = (per_pair * weights).mean() if weights is not None else per_pair.mean()
    with torch.no_grad():
        t_i2t, t_t2i = cross_modal_log_probs(teacher_img, teacher_txt, tau_teacher)
        t_v2v = F.log_softmax(teacher_img @ teacher_img.T / tau_teacher, dim=1)
    sass = (_kl_rows(t_i2t, s_i2t) + _kl_rows(t_t2i, s_t2i) + _kl_rows(s_i2t, t_i2t) + _kl_rows(s_t2i, t_t2i)) / 4
    isd = _kl_rows(t_v2v, F.log_softmax(img @ img.T / tau, dim=1))
    return {"itc": itc, "sass": sass, "isd": isd, "total": itc + alpha * sass + beta * isd}


def cusa_loss(img: torch.Tensor, txt: torch.Tensor, tau: float | torch.Tensor, teacher_img: torch.Tensor,
              teacher_txt: torch.Tensor, tau_teacher: float) -> torch.Tensor:
    """CUSA-style unimodal proxy supervision (the SAFT paper's baseline): the soft target for
    image i over texts j is the teacher's *image-image* distribution softmax(E^v_i·E^v_j/τ_o), and
    for text i over images the *text-text* one; KL(target‖student) in both directions, averaged.
    (Our reading of "teacher-derived unimodal priors"; the paper gives no equation.)"""
    s_i2t, s_t2i = cross_modal_log_probs(img, txt, tau)
    t_v = F.log_softmax(teacher_img @ teacher_img.T / tau_teacher, dim=1)
    t_t = F.log_softmax(teacher_txt @ teacher_txt.T / tau_teacher, dim=1)
    return (_kl_rows(t_v, s_i2t) + _kl_rows(t_t, s_t2i)) / 2


def hard_negative_itc(img: torch.Tensor, txt: torch.Tensor, tau: float | torch.Tensor, margin: float,
                      top_k: int) -> torch.Tensor:
    """Threshold hard-negative mining (SAFT Eq. 2): for query i, α_i = cos(q_i, t_i⁺) + β; negatives
    with cos > α_i are dropped as presumed false negatives, the top-K remaining by similarity are
    the negatives of a softmax over {positive} ∪ negatives. Both directions, averaged."""

    def one_direction(q: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        sims = q @ t.T
        n = len(q)
        pos = sims.diagonal()
        alpha = pos + margin
        eye = torch.eye(n, dtype=torch.bool, device=q.device)
        # excluded entries get a large finite negative (not -inf: -inf/τ would make ∂/∂τ NaN when τ trains)
        masked = sims.masked_fill(eye | (sims > alpha[:, None]), -1e4)
        k = min(top_k, n - 1)
        neg, _ = masked.topk(k, dim=1) if k > 0 else (masked[:, :0], None)
        logits = torch.cat([pos[:, None], neg], dim=1) / tau
        return F.cross_entropy(logits, torch.zeros(n, dtype=torch.long, device=q.device))

    return (one_direction(img, txt) + one_direction(txt, img)) / 2


def iss_loss(view_a: torch.Tensor, view_b: torch.Tensor, tau: float | torch.Tensor) -> torch.Tensor:
    """Image self-supervision (the ablation's ISS): InfoNCE between two augmented views of the
    same images, every other image of the batch a negative."""
    return itc_loss(view_a, view_b, tau)


def weighted_itm_loss(match_logits: torch.Tensor, labels: torch.Tensor,
                      positive_weights: torch.Tensor | None = None) -> torch.Tensor:
    """Image-text matching cross-entropy (GTR+ Eq. 5, 11): ``match_logits`` N×2, ``labels`` 1 for a
    positive pair; the confidence weights C^β multiply the positive pairs' terms only."""
    per = F.cross_entropy(match_logits, labels, reduction="none")
    if positive_weights is not None:
        per = torch.where(labels == 1, per * positive_weights, per)
    return per.mean()
