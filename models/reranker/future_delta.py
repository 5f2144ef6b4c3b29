"""Training-only future-delta predictor F_ω and its loss (VEDJE Sec. 3.3, Eq. 3–4; App. A.2).

F_ω: a 2-layer transformer decoder whose queries are fixed sinusoidal vectors indexed by
(horizon h, patch position p) — the first half of the d channels encodes h, the second half p —
cross-attending to one frame's cached tokens Z_t, then LayerNorm and a linear map to d_v:
Δ̂_t ∈ R^{|H|×P×d_v}. Target Δ_{t,h} = X_{t+h} − X_t from the frozen backbone.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from models.reranker.compressor import decoder_stack, sinusoidal


def horizon_patch_queries(horizons: Sequence[int], patches: int, d: int) -> torch.Tensor:
    """Fixed queries, |H|·P × d, row (h, p) in horizon-major order: [sin(h) (d/2) ; sin(p) (d/2)]."""
    h = torch.tensor(list(horizons)).repeat_interleave(patches)
    p = torch.arange(patches).repeat(len(horizons))
    return torch.cat([sinusoidal(h, d // 2), sinusoidal(p, d - d // 2)], dim=1)


class FutureDeltaHead(nn.Module):
    """Z_t (N×M×d) → Δ̂_t (N×|H|×P×d_v)."""

    def __init__(self, d: int, d_v: int, patches: int, horizons: Sequence[int] = (3,), layers: int = 2,
                 heads: int = 8, dropout: float = 0.1) -> None:
        super().__init__()
        self.horizons, self.patches, self.d_v = tuple(horizons), patches, d_v
        self.register_buffer("queries", horizon_patch_queries(self.horizons, patches, d), persistent=False)
        self.decoder = decoder_stack(d, layers, heads, dropout)
        self.norm = nn.LayerNorm(d)
        self.out = nn.Linear(d, d_v)

    def forward(self, z_t: torch.Tensor) -> torch.Tensor:
        n = z_t.shape[0]
        y = self.out(self.norm(self.decoder(self.queries.unsqueeze(0).expand(n, -1, -1), z_t)))
        return y.reshape(n, len(self.horizons), self.patches, self.d_v)


def valid_pairs(frames: int, horizons: Sequence[int]) -> list[tuple[int, int]]:
    """Ω = {(t, h) : t + h ≤ T} as 0-based (t, index of h)."""
    return [(t, k) for k, h in enumerate(horizons) for t in range(frames) if t + h < frames]


def delta_loss(pred: torch.Tensor, x: torch.Tensor, horizons: Sequence[int]) -> torch.Tensor:
    """Eq. 4: mean over (item, (t, h) ∈ Ω) of the per-element-averaged ‖Δ̂_{t,h} − (X_{t+h} − X_t)‖².

    ``pred``: B×T×|H|×P×d_v, ``x``: B×T×P×d_v. With no valid pair (T ≤ min H, e.g. images) the loss
    is 0 (kept in the graph so the total stays differentiable).
    """
    pairs = valid_pairs(x.shape[1], horizons)
    if not pairs:
        return pred.sum() * 0.0
    t_idx = torch.tensor([t for t, _ in pairs], device=x.device)
    h_idx = torch.tensor([k for _, k in pairs], device=x.device)
    h_val = torch.tensor([horizons[k] for _, k in pairs], device=x.device)
    target = x[:, t_idx + h_val] - x[:, t_idx]  # B×|Ω|×P×d_v
    return ((pred[:, t_idx, h_idx] - target) ** 2).mean()
