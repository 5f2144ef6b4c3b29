"""Frame-indexed cache compressor (VEDJE Sec. 3.2, Eq. 1–2) and the pooled controls of its Table 4.

``frames`` (the paper): U_t = X_t W_kv; Z_t = C_η(Q_0; U_t) ∈ R^{M×d} for each sampled frame with
one shared 2-layer decoder; Z(v) = [Z_1; …; Z_T] in temporal order.

The matched-budget controls keep T·M cached tokens but pool evidence across frames first:
``mean`` compresses the frame-averaged features (1/T)·Σ_t X_t with T·M learned queries;
``attention`` lets T·M learned queries attend over all T·P patch tokens at once (attention pooling
across frames; no temporal order survives). Both are our reading of the paper's one-line
description of Table 4.

Where the LayerNorms sit in C_η the paper does not say ("the output of the second layer is the
per-frame cache"). ``norm="post"`` (default; PyTorch's and BERT's layout) normalises after each
residual sum, so every cache token is a LayerNorm of the shared learned query Q_0 plus a
cross-attention read of the item: at initialisation the item's part is small and caches of
different people come out nearly equal (pos–neg cosine 0.983 on the demo person images, where the
frozen features have 0.679). ``norm="pre"`` normalises each sub-layer's input and the stack's
output (the layout the paper states for the future-delta head: "LayerNorm on the output"), so the
residual stream carries the item's read-out unnormalised past Q_0 (cosine 0.895 at initialisation).
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import nn

Structure = Literal["frames", "mean", "attention"]
NormPlacement = Literal["post", "pre"]


def decoder_stack(d: int, layers: int, heads: int, dropout: float, norm: NormPlacement = "post"
                  ) -> nn.TransformerDecoder:
    """The paper's decoder block: ``heads`` heads, FFN 4d, GELU, dropout, ``layers`` layers;
    ``norm`` "post" (LayerNorm after each residual sum) or "pre" (before each sub-layer, plus one
    on the stack's output)."""
    if norm not in ("post", "pre"):
        raise ValueError(f"norm must be post or pre, got {norm!r}")
    layer = nn.TransformerDecoderLayer(d, heads, 4 * d, dropout, activation="gelu", batch_first=True,
                                       norm_first=norm == "pre")
    return nn.TransformerDecoder(layer, layers, norm=nn.LayerNorm(d) if norm == "pre" else None)


def sinusoidal(positions: torch.Tensor, dim: int) -> torch.Tensor:
    """Standard sinusoidal encoding (Vaswani et al.): N positions → N×dim, sin(p · 10000^(−2k/dim))
    on the even channels and cos on the odd ones, k the channel pair (an odd dim ends with a sin)."""
    freq = torch.exp(-math.log(10000.0) * torch.arange((dim + 1) // 2, dtype=torch.float32) / (dim / 2))
    angles = positions.float()[:, None] * freq[None, :]
    out = torch.zeros(len(positions), dim)
    out[:, 0::2] = torch.sin(angles)
    out[:, 1::2] = torch.cos(angles[:, : dim // 2])
    return out


def patch_positions(patches: int, d: int) -> torch.Tensor:
    """P×d sinusoidal codes of the patch index p (the standard transformer encoding, sin on even and
    cos on odd dimensions): where in the frame a patch sits. Eq. 1 reads U_t = X_t W_kv and relies on
    the backbone's features to carry position (the paper's VideoPrism is a ViT: position embeddings at
    its input). A convolutional map's features carry it weakly: on the composite motion clips a
    5-class direction probe on the EfficientNet features averaged over the patches is 70.5 % right
    (last − first frame), 89.0 % on per-patch energies that keep where each patch is, and without
    this code the decoder's cross-attention reads the patches as a set
    (``experiments/vedje_motion_control.py``). Not in the paper; off unless
    ``VedjeShape.patch_positions`` (an experiment option: no profile key, no measured gain in R@K)."""
    return sinusoidal(torch.arange(patches), d)


class FrameCompressor(nn.Module):
    """X (B×T×P×d_v, frozen backbone features) → cache Z(v) (B×T·M×d)."""

    def __init__(self, d_v: int, d: int, tokens_per_frame: int = 4, frames: int = 16, layers: int = 2,
                 heads: int = 8, dropout: float = 0.1, structure: Structure = "frames",
                 norm: NormPlacement = "post", patches: int | None = None) -> None:
        super().__init__()
        if structure not in ("frames", "mean", "attention"):
            raise ValueError(f"structure must be frames, mean or attention, got {structure!r}")
        self.d_v, self.d, self.m, self.frames, self.structure = d_v, d, tokens_per_frame, frames, structure
        self.kv_proj = nn.Linear(d_v, d, bias=False)  # W_kv
        # U_t = X_t W_kv + E (``patches`` given): a fixed sinusoidal code of each patch's index, for a
        # backbone whose features do not say where in the frame they are (see ``patch_positions``)
        self.register_buffer("patch_code", None if patches is None else patch_positions(patches, d), persistent=False)
        n_queries = tokens_per_frame if structure == "frames" else frames * tokens_per_frame
        self.queries = nn.Parameter(torch.randn(n_queries, d) * 0.02)  # Q_0
        self.decoder = decoder_stack(d, layers, heads, dropout, norm)

    def memory(self, patches: torch.Tensor, per_frame: int) -> torch.Tensor:
        """U = X W_kv (N×S×d), plus each patch's code when the option is on (S = per_frame patches of
        one frame, or of several frames in a row: the code repeats per frame)."""
        memory = self.kv_proj(patches)
        if self.patch_code is None:
            return memory
        if per_frame != len(self.patch_code):
            raise ValueError(f"the compressor codes {len(self.patch_code)} patches per frame, got {per_frame}")
        return memory + self.patch_code.repeat(patches.shape[1] // per_frame, 1)

    def frame_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """Eq. 1 per frame: B×T×P×d_v → B×T×M×d (``frames`` structure only)."""
        b, t, p, _ = x.shape
        memory = self.memory(x.reshape(b * t, p, self.d_v), p)
        z = self.decoder(self.queries.unsqueeze(0).expand(b * t, -1, -1), memory)
        return z.reshape(b, t, self.m, self.d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Eq. 2: the stored cache, B×(T·M)×d (frame groups in temporal order for ``frames``)."""
        b, t, p, _ = x.shape
        if self.structure == "frames":
            return self.frame_tokens(x).reshape(b, t * self.m, self.d)
        if t != self.frames:
            raise ValueError(f"a pooled cache is sized for T={self.frames} frames, got T={t}")
        pooled = x.mean(dim=1) if self.structure == "mean" else x.reshape(b, t * p, self.d_v)
        return self.decoder(self.queries.unsqueeze(0).expand(b, -1, -1), self.memory(pooled, p))
